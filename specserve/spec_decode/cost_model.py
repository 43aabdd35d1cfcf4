"""Step-cost model of speculative decoding on the running device: what one target forward costs for a
given number of new tokens (measured at start-up, never a constant: verifying 64 tokens is nearly free
on a GPU and expensive on a 2-core CPU), and the choice of how many drafts to verify that maximises
expected tokens per second.

``choose_verify_lengths`` is DSpark's cost-model scheduling: given each request's survival products
``S_b,k = prod_{i<=k} c_b,i`` of its draft confidences (the probability that drafts 1..k are all
accepted), verifying ``L_b`` drafts yields ``1 + sum_{k<=L_b} S_b,k`` tokens in expectation (the bonus
or recovered token included). The forward pads a batch to its longest row, so verifying up to m drafts
a request costs ``verify(B * (m + 1))`` seconds whatever the shorter rows hold: m is chosen to maximise
tokens per second, every request verifying its first m drafts (all it has, if fewer). The
drafting time is spent by then whatever is verified, so it does not enter the choice: counted in, it
made a dear drafter verify drafts that cost more than they give (``DraftGate`` weighs it, before the
next drafting step). The choice reads drafter outputs only (confidences), never the target's verdict,
so truncating there cannot change which tokens are accepted: lossless.
"""

from __future__ import annotations

import torch

from specserve.layers import cpu_ops


def interp_cost(cost: dict[int, float], n: int) -> float:
    ks = sorted(cost)
    if n <= ks[0]:
        return cost[ks[0]]
    for a, b in zip(ks, ks[1:]):
        if a <= n <= b:
            return cost[a] + (cost[b] - cost[a]) * (n - a) / (b - a)
    return cost[ks[-1]] * n / ks[-1]


MAX_PROFILED_TOKENS = 160  # larger verifications are extrapolated (linear: compute-bound by then)


def profile_sizes(max_batch: int, num_drafts: int) -> tuple[list[int], list[int]]:
    """The batch sizes and total token counts a verify-length cost model measures at start-up, for
    batches of up to ``max_batch`` sequences drafting up to ``num_drafts`` tokens each (token counts
    above ``MAX_PROFILED_TOKENS`` are not measured: ``interp_cost`` extrapolates them)."""
    max_b = max(1, int(max_batch))
    batch_sizes = sorted({b for b in (1, 2, 4, 8, 16, max_b) if b <= max_b})
    g = num_drafts
    sizes = {n for b in batch_sizes for n in (b, b * (g + 1) // 2, b * (g + 1))} | {1, 2, 4}
    capped = {n for n in sizes if n <= MAX_PROFILED_TOKENS}
    if capped != sizes:
        capped.add(MAX_PROFILED_TOKENS)
    return batch_sizes, sorted(capped)


TREE_SIZES = (2, 4, 6, 8, 12, 16, 24, 32, 48, 64)  # node counts whose verification a tree mode measures


def tree_profile_sizes(max_batch: int, max_nodes: int) -> tuple[list[int], list[int]]:
    """``profile_sizes`` for trees of up to ``max_nodes`` drafted nodes, plus every single-tree size of
    ``TREE_SIZES`` below it (the cost curve bends most where one tree's size is chosen)."""
    batch_sizes, sizes = profile_sizes(max_batch, max_nodes)
    return batch_sizes, sorted(set(sizes) | {m + 1 for m in TREE_SIZES if m < max_nodes})


def choose_verify_lengths(survival: list[list[float]], verify_cost) -> list[int]:
    """How many drafts of each request to verify. ``survival[b]``: the non-increasing survival products
    of request b's drafts; ``verify_cost(n)``: seconds of a target forward over n new tokens in all.
    Maximises the expected tokens per second, ``(B + the chosen survival products) / cost`` (the
    drafting time, already spent, left out: the module's docstring). One request verifying L drafts
    costs ``verify_cost(1 + L)``; a batch is padded to its longest row (``ModelRunner.forward``: every
    row computes as many positions), so B requests verifying up to m drafts each cost
    ``verify_cost(B * (1 + m))`` however many the shorter rows use, and a row's drafts up to the
    longest row's count come free."""
    B = len(survival)
    if B == 0:
        return []
    rows = [[float(p) for p in row] for row in survival]
    if any(q > p for row in rows for p, q in zip(row, row[1:])):
        raise ValueError("survival products must not increase along a request's drafts")
    best_m, best_rate = 0, B / max(verify_cost(B), 1e-12)
    column = [0.0] * max(len(row) for row in rows)  # per depth: the rows' sum, in row order
    for row in rows:
        for i, p in enumerate(row):
            column[i] += p
    gain = 0.0
    for m, p in enumerate(column, 1):
        gain += p
        rate = (B + gain) / max(verify_cost(B * (1 + m)), 1e-12)
        if rate > best_rate:
            best_m, best_rate = m, rate
    return [min(best_m, len(row)) for row in rows]


def sampling_key(params) -> tuple:
    """The sampling settings that change how often drafts are accepted: greedy, or temperature with
    top-k, top-p and min-p (rounded, so that near-equal settings share their statistics)."""
    if params.greedy:
        return ("greedy",)
    return (round(float(params.temperature), 2), max(int(params.top_k), 0), round(float(params.top_p), 2),
            round(float(params.min_p), 3))


class AcceptanceCalibration:
    """Online correction of the acceptance an "auto" mode predicts, from what verification observed.

    An auto mode predicts for every draft it might verify the probability that the draft's whole path
    is accepted (a chain's survival products, a tree node's path score) from its heads' or confidence
    head's outputs. Those were fitted on greedy self-distilled data, so they can be far off for the
    requests actually running: at temperature > 0 the target's own draw spreads over more tokens
    than the one a draft carries, and prompts unlike the training data are harder. A wrong prediction
    verifies drafts that fail, and drafting then slows decoding down.

    Per sampling setting (``sampling_key``) and depth ``d`` this keeps exponentially decayed sums of
    the predicted ``P(depth >= d accepted)`` over the verified drafts (the predicted scores of the
    verified nodes at depth d: the nodes of one depth carry different tokens, so at most one of them
    is accepted) and of the observed ``1[depth >= d accepted]``, and scales predictions at depth d
    by ``r_1 = (observed_1 + prior) / (predicted_1 + prior)`` and, deeper,
    ``r_d = min(r_{d-1}, (observed_d + prior r_{d-1}) / (predicted_d + prior))``: a depth without
    evidence takes the factor of the depth above it, and a scaled path never scores above its parent
    (every cut stays a prefix or a subtree). The sums decay by ``decay`` at every step the setting
    runs, verified or not, so a setting that stopped drafting returns to the prediction it started
    from and tries again.

    Lossless: a step's choice reads the outcomes of earlier steps only, whose tokens are already
    emitted; given them, the step's output has the target's distribution whatever it verifies.
    """

    def __init__(self, max_depth: int, decay: float = 0.98, prior: float = 2.0):
        if not 0.0 < decay <= 1.0 or prior <= 0:
            raise ValueError(f"decay must be in (0, 1] and prior > 0, got {decay}, {prior}")
        self.max_depth, self.decay, self.prior = int(max_depth), float(decay), float(prior)
        self._stats: dict[tuple, list[list[float]]] = {}  # key -> [predicted[d], observed[d]]
        self._pending: dict[int, tuple[tuple, list[float]]] = {}  # seq id -> (key, predicted per depth)

    def factors(self, key: tuple) -> list[float]:
        """``r_1 .. r_D`` of ``key`` (all 1 before any observation)."""
        st = self._stats.get(key)
        if st is None:
            return [1.0] * self.max_depth
        out: list[float] = []
        for pred, obs in zip(*st):
            above = out[-1] if out else 1.0  # a depth's prior: the factor of the depth above it
            r = (obs + self.prior * above) / (pred + self.prior)
            out.append(min(above, r) if out else r)
        return out

    def begin_step(self, keys) -> None:
        """Decay the sums of every setting running in this step."""
        for key in set(keys):
            st = self._stats.setdefault(key, [[0.0] * self.max_depth, [0.0] * self.max_depth])
            for row in st:
                row[:] = [x * self.decay for x in row]

    def expect(self, seq_id: int, key: tuple, predicted: list[float]) -> None:
        """What the step verifies for ``seq_id``: ``predicted[d-1]`` the summed unscaled predictions of
        its verified drafts at depth d (nothing verified: nothing to learn, nothing kept)."""
        if any(predicted):
            self._pending[seq_id] = (key, [float(x) for x in predicted[: self.max_depth]])
        else:
            self._pending.pop(seq_id, None)

    def expect_nodes(self, seq, scores, depths) -> None:
        """``expect`` for ``seq`` verifying nodes of unscaled ``scores`` at ``depths`` (1-based)."""
        self.expect(seq.seq_id, sampling_key(seq.params), depth_sums(scores, depths, self.max_depth))

    def observe(self, seq_id: int, accepted: int) -> None:
        """Verification accepted ``accepted`` drafts of ``seq_id``'s last expected step."""
        item = self._pending.pop(seq_id, None)
        if item is None:
            return
        key, predicted = item
        st = self._stats.setdefault(key, [[0.0] * self.max_depth, [0.0] * self.max_depth])
        for d, p in enumerate(predicted):
            if p > 0.0:
                st[0][d] += p
                st[1][d] += 1.0 if accepted > d else 0.0


def depth_sums(scores, depths, max_depth: int) -> list[float]:
    """Summed ``scores`` per depth 1..max_depth (``depths[i]``: the depth of score i)."""
    out = [0.0] * max_depth
    for s, d in zip(scores, depths):
        if 1 <= d <= max_depth:
            out[d - 1] += float(s)
    return out


def calibrated_lengths(calibration: "AcceptanceCalibration | None", seqs, survival: list[list[float]],
                       verify_cost) -> tuple[list[int], list[float]]:
    """``choose_verify_lengths`` for chains whose survival products go through ``calibration`` first
    (None: as predicted); what each sequence verifies is recorded for the calibration to check.
    Returns (lengths, each sequence's expected accepted drafts: its chosen survival products, scaled)."""
    if calibration is None:
        scaled = survival
    else:
        keys = [sampling_key(s.params) for s in seqs]
        calibration.begin_step(keys)
        scaled = [[min(1.0, p * f) for p, f in zip(row, calibration.factors(k))] for row, k in zip(survival, keys)]
    lengths = choose_verify_lengths(scaled, verify_cost)
    if calibration is not None:
        for s, k, row, n in zip(seqs, keys, survival, lengths):
            calibration.expect(s.seq_id, k, row[:n])
    return lengths, [sum(row[:n]) for row, n in zip(scaled, lengths)]


def calibration_factors(calibration: "AcceptanceCalibration | None", seqs) -> list[list[float]] | None:
    """Each sequence's calibration factor by depth 0 .. max_depth (1.0 at depth 0), None without a
    calibration. Starts the calibration's step."""
    if calibration is None:
        return None
    keys = [sampling_key(s.params) for s in seqs]
    calibration.begin_step(keys)
    return [[1.0] + calibration.factors(k) for k in keys]


def calibrated_scores(calibration: "AcceptanceCalibration | None", seqs, scores, depth):
    """Tree node (or path) scores ``[B, N]`` at depths ``depth`` (``[N]``, 1-based) scaled by each
    sequence's calibration factors (capped at 1; negative scores, which mark excluded nodes, stay).
    Starts the calibration's step."""
    factors = calibration_factors(calibration, seqs)
    if factors is None:
        return scores
    f = torch.tensor(factors, dtype=scores.dtype, device=scores.device)
    scale = f.gather(1, depth.clamp(0, calibration.max_depth).view(1, -1).expand(len(seqs), -1).to(scores.device))
    return torch.where(scores >= 0, (scores * scale).clamp(max=1.0), scores)


def ranked_scores(calibration: "AcceptanceCalibration | None", seqs, scores, depth,
                  limits: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``calibrated_scores``, then every node deeper than its sequence's ``limits[b]`` at -1, sorted by
    decreasing score (equal scores in index order): (the sorted scores, their indices), ``[B, N]``
    each. One call of the C++ op on CPU (``cpu_ops``: the same bits), else PyTorch. Starts the
    calibration's step."""
    ops = cpu_ops.active() if scores.device.type == "cpu" and scores.dtype == torch.float32 else None
    if ops is not None:
        factors = calibration_factors(calibration, seqs)
        scale = None if factors is None else torch.tensor(factors, dtype=torch.float32)
        return tuple(ops.rank_nodes(scores, depth.long(), scale, torch.tensor(limits, dtype=torch.long)))
    scores = calibrated_scores(calibration, seqs, scores, depth)
    too_deep = depth.view(1, -1) > torch.tensor(limits, device=scores.device).view(-1, 1)
    scores = torch.where(too_deep, torch.full_like(scores, -1.0), scores)
    return scores.sort(dim=1, descending=True, stable=True)


class DraftGate:
    """Whether a sequence should draft at all this step ("auto" modes whose drafting is costly).

    The cost model chooses what to verify once the drafts exist, so the drafting time is already spent
    when it decides; on a request the drafter predicts badly it may verify little or nothing and the
    step then costs more than a plain one. After each drafting step the gate compares the step's
    expected tokens per second, ``(1 + expected accepted) / (verify(1 + n verified) + draft(1))``
    from the (calibrated) predictions the choice used, with a plain step's ``1 / verify(1)``; when
    drafting did not pay, the sequence skips drafting for the next ``backoff`` steps (1, doubling up
    to ``max_backoff`` while probes keep failing, back to 1 once one pays). The choice reads earlier
    steps only: lossless."""

    def __init__(self, max_backoff: int = 16):
        self.max_backoff = int(max_backoff)
        self._state: dict[int, list[int]] = {}  # seq id -> [steps left to skip, next backoff]

    def skip(self, seq_id: int) -> bool:
        """True when ``seq_id`` sits this step out (counts the step)."""
        st = self._state.get(seq_id)
        if st is None or st[0] <= 0:
            return False
        st[0] -= 1
        return True

    def judge(self, seq_id: int, expected: float, num_verified: int, verify_cost, draft_cost: float) -> bool:
        """Record whether this drafting step was worth its cost; returns that verdict."""
        plain = max(verify_cost(1), 1e-12)
        worth = (1.0 + expected) / max(verify_cost(1 + num_verified) + draft_cost, 1e-12) >= 1.0 / plain
        st = self._state.setdefault(seq_id, [0, 1])
        if worth:
            st[:] = [0, 1]
        else:
            st[:] = [st[1], min(2 * st[1], self.max_backoff)]
        return worth

    def forget(self, seq_id: int) -> None:
        self._state.pop(seq_id, None)


def running_mean(prev: tuple[int, float] | None, x: float, min_count: int, weight: float) -> tuple[int, float]:
    """(count, mean) after ``x``: a plain mean of the first ``min_count`` values, then an exponential one
    (``weight`` for the new value), so that it follows a machine whose speed drifts."""
    n, m = prev or (0, 0.0)
    m = m + (x - m) / (n + 1) if n < min_count else m + weight * (x - m)
    return n + 1, m


class StepCosts:
    """What verifying n tokens costs inside the engine, as a correction to the start-up table of bare
    target forwards (``ModelDrafter.verify_cost``). The table times one forward of n tokens again and
    again before any request runs; a step in the engine also builds the inputs, verifies, commits and
    projects the target's features, and on a shared or throttled machine the forward of several tokens
    (bound by arithmetic, where one token is bound by memory) drifts far from the table: on this
    project's CPU the table read the second and third tokens as nearly free while the engine paid
    several times that for each, so the cost models verified and drafted more than paid.

    ``observe(n, seconds, table)``: a step verified n tokens in ``seconds`` (drafting excluded) where the
    table says ``table``; per n, the running mean (``running_mean``) of the difference, each clipped to
    -table / 2 .. +table (a pause of the process, a collection of garbage: one such step would move a
    mean of a few steps by many milliseconds). ``corrections``:
    the difference for every token count, linear between the counts seen at least ``min_steps`` times,
    from 0 at no tokens up to the first (a count below every one seen is corrected less, never more: a
    plain step is not made dearer by what trees cost) and flat past the last (none seen: 0). Lossless:
    it reads earlier steps' times only."""

    def __init__(self, min_steps: int = 8, weight: float = 0.1):
        self.min_steps, self.weight = int(min_steps), float(weight)
        self._diff: dict[int, tuple[int, float]] = {}  # token count -> (steps, running mean of the difference)

    def observe(self, n: int, seconds: float, table: float) -> None:
        diff = min(max(seconds - table, -0.5 * table), table)
        self._diff[n] = running_mean(self._diff.get(n), diff, self.min_steps, self.weight)

    def corrections(self, size: int) -> list[float]:
        """The correction of every token count 0 .. size - 1."""
        seen = sorted((n, m) for n, (c, m) in self._diff.items() if c >= self.min_steps)
        if not seen:
            return [0.0] * size
        if seen[0][0] > 0:
            seen.insert(0, (0, 0.0))
        out, j = [], 0
        for k in range(size):
            while j + 1 < len(seen) and seen[j + 1][0] <= k:
                j += 1
            a, ma = seen[j]
            if k <= a or j + 1 == len(seen):
                out.append(ma)
            else:
                b, mb = seen[j + 1]
                out.append(ma + (mb - ma) * (k - a) / (b - a))
        return out


class DraftCosts:
    """What one drafting call costs, by batch size, for the cost models: the start-up table
    (``interp_cost``; a call measured where none covers the batch), raised to the running mean of the
    calls timed in the engine once ``min_calls`` of that batch size have run. The start-up table drafts
    one placeholder context again and again (its weights in cache, no new target features to project)
    and reads low inside the engine; a table above the engine's calls (a test's synthetic one) stands."""

    def __init__(self, min_calls: int = 8, weight: float = 0.1):
        self.min_calls, self.weight = int(min_calls), float(weight)
        self._mean: dict[int, tuple[int, float]] = {}  # batch size -> (calls, running mean)

    def observe(self, batch: int, seconds: float) -> None:
        """A drafting call of ``batch`` sequences took ``seconds`` in the engine (``running_mean``)."""
        self._mean[batch] = running_mean(self._mean.get(batch), seconds, self.min_calls, self.weight)

    def __call__(self, table: dict[int, float] | None, batch: int, measured: float) -> float:
        """Seconds of a drafting call of ``batch`` sequences (``measured``: this step's own)."""
        base = interp_cost(table, batch) if table and batch <= max(table) else measured
        n, m = self._mean.get(batch, (0, 0.0))
        return max(base, m) if n >= self.min_calls else base
