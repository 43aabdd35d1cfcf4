"""Step-cost model of speculative decoding on the running device: what one target forward costs for a
given number of new tokens (measured at start-up, never a constant: verifying 64 tokens is nearly free
on a GPU and expensive on a 2-core CPU), and the choice of how many drafts to verify that maximises
expected tokens per second.

``choose_verify_lengths`` is DSpark's cost-model scheduling: given each request's survival products
``S_b,k = prod_{i<=k} c_b,i`` of its draft confidences (the probability that drafts 1..k are all
accepted), verifying ``L_b`` drafts yields ``1 + sum_{k<=L_b} S_b,k`` tokens in expectation (the bonus
or recovered token included) and costs ``verify(sum_b (L_b + 1)) + draft(B)`` seconds. Because each
request's ``S_b,k`` does not increase with k, the best lengths for any total number of drafts take the
largest survival products across requests; the total is then chosen to maximise tokens per second.
The choice reads drafter outputs only (confidences), never the target's verdict, so truncating there
cannot change which tokens are accepted: lossless.
"""

from __future__ import annotations

import time

from specserve.engine.model_runner import synchronize


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


def measure_step_costs(target, sizes: list[int], reps: int = 3) -> dict[int, float]:
    """Seconds of one target forward that appends ``n`` tokens to a 128-token context, for each n
    (median of ``reps``), measured on the running device in slot 0 before any request runs."""
    ctx = 128
    device = target.device
    target.forward(0, [[0] * ctx], [0], "none")
    if device != "cpu":  # first launches of each shape (kernel selection, allocator) are not the cost
        for n in sizes:
            target.forward(0, [[0] * n], [ctx], "all")
    out = {}
    for n in sizes:
        ts = []
        for _ in range(reps):
            synchronize(device)
            t0 = time.perf_counter()
            target.forward(0, [[0] * n], [ctx], "all")
            synchronize(device)
            ts.append(time.perf_counter() - t0)
        out[n] = sorted(ts)[len(ts) // 2]
    # a cost curve must not decrease with n (noise): make it monotonic
    run = 0.0
    for n in sorted(out):
        run = max(run, out[n])
        out[n] = run
    return out


def choose_verify_lengths(survival: list[list[float]], verify_cost, draft_cost: float = 0.0) -> list[int]:
    """How many drafts of each request to verify. ``survival[b]``: the non-increasing survival products
    of request b's drafts; ``verify_cost(n)``: seconds of a target forward over n new tokens in all;
    ``draft_cost``: seconds already spent drafting this step. Maximises
    ``(B + sum of the chosen survival products) / (verify_cost(B + sum L_b) + draft_cost)``."""
    B = len(survival)
    if B == 0:
        return []
    order = sorted(((float(p), b, k) for b, row in enumerate(survival) for k, p in enumerate(row)),
                   key=lambda t: (-t[0], t[1], t[2]))
    best_n, best_rate, gain = 0, B / max(verify_cost(B) + draft_cost, 1e-12), 0.0
    taken = [0] * B
    for n, (p, b, k) in enumerate(order, start=1):
        if k != taken[b]:  # ties inside a row keep its prefix order
            raise ValueError("survival products must not increase along a request's drafts")
        taken[b] += 1
        gain += p
        rate = (B + gain) / max(verify_cost(B + n) + draft_cost, 1e-12)
        if rate > best_rate:
            best_n, best_rate = n, rate
    lengths = [0] * B
    for p, b, k in order[:best_n]:
        lengths[b] += 1
    return lengths
