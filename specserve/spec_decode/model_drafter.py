"""What the drafters with a cost model (Medusa, DSpark/DFlash, and n-gram drafting in its "auto" mode)
share: the target's step costs measured at start-up, the online calibration of predicted acceptance,
and choosing a step's nodes from their scored candidates and the n-gram branches (``tree_select``)."""

from __future__ import annotations

import logging

from specserve.sample.tree import TreeCache
from specserve.spec_decode.cost_model import (
    AcceptanceCalibration,
    DraftCosts,
    DraftGate,
    StepCosts,
    choose_verify_lengths,
    interp_cost,
    sampling_key,
)
from specserve.spec_decode.proposer import Proposal, Proposer, TreeDraft
from specserve.spec_decode.tree_select import graft, merge_branches, no_candidates, split_items

log = logging.getLogger("specserve.spec_decode")

COST_TABLE_SIZE = 257  # token counts whose verify cost ``verify_cost`` keeps in a list
REFRESH_STEPS = 8  # ``verify_cost`` takes the engine's step times (``step_cost``) in this often
EXPAND_TOKENS = 8  # drafts a sequence over which ``expand_threshold`` averages the cost of a verified token


class ModelDrafter(Proposer):
    """Base of the drafters with a cost model. ``verify_costs``: seconds of a target forward by
    token count (set by ``measure_costs``), corrected by the engine's own steps (``step_cost``);
    ``calibration``: the online correction of predicted acceptance (``online_calibration``, in the
    "auto" modes); ``gate``: the draft gate (``cost_model.DraftGate``) where a subclass sets one, judged
    with the drafting costs ``draft_costs`` (a start-up table, or None) and ``drafting`` (the engine's
    own drafting calls, timed)."""

    def __init__(self, online_calibration: bool = True):
        self.step_costs = StepCosts()
        self._steps_seen = 0
        self.verify_costs = None
        self.online_calibration = bool(online_calibration)
        self.calibration: AcceptanceCalibration | None = None
        self._grafted = TreeCache.by_parents()  # trees with n-gram branch nodes: their shapes recur
        self.draft_costs: dict[int, float] | None = None
        self.drafting = DraftCosts()
        self.gate: DraftGate | None = None

    def measure_costs(self, target, sizes: list[int], max_depth: int) -> None:
        """The "auto" modes' start: the target's step costs for ``sizes`` tokens, and the calibration of
        up to ``max_depth`` drafts."""
        self.verify_costs = target.step_costs(sizes)
        if self.online_calibration:
            self.calibration = AcceptanceCalibration(max_depth)
        log.info("%s auto: verify cost %s ms", self.name, {n: round(v * 1e3, 1) for n, v in self.verify_costs.items()})

    @property
    def verify_costs(self) -> dict[int, float] | None:
        return self._verify_costs

    @verify_costs.setter
    def verify_costs(self, costs: dict[int, float] | None) -> None:
        self._verify_costs, self._cost_table, self._table_costs = costs, None, None

    def _table_cost(self, n: int) -> float:
        """``verify_costs`` interpolated at ``n`` (the first ``COST_TABLE_SIZE`` counts in a list made once)."""
        if self._table_costs is None:
            self._table_costs = [interp_cost(self._verify_costs, k) for k in range(COST_TABLE_SIZE)]
        return self._table_costs[n] if 0 <= n < COST_TABLE_SIZE else interp_cost(self._verify_costs, n)

    def verify_cost(self, n: int) -> float:
        """Seconds of a step verifying ``n`` tokens: ``verify_costs`` interpolated, plus the engine's own
        steps' correction (``cost_model.StepCosts``), never decreasing with n nor below half the table;
        a list of the first ``COST_TABLE_SIZE`` counts, made again every ``REFRESH_STEPS`` steps timed (a
        step asks for many)."""
        if self._cost_table is None:
            corr = self.step_costs.corrections(COST_TABLE_SIZE)
            table, run = [], 0.0
            for k, c in enumerate(corr):
                base = self._table_cost(k)
                run = max(run if k > 1 else 0.0, base + c, 0.5 * base)  # (no step verifies 0 tokens)
                table.append(run)
            self._cost_table = table
        if 0 <= n < COST_TABLE_SIZE:
            return self._cost_table[n]
        # past the list: the table's own growth on the last entry (its correction carried)
        return self._table_cost(n) + (self._cost_table[-1] - self._table_cost(COST_TABLE_SIZE - 1))

    def step_cost(self, num_tokens: int, seconds: float) -> None:
        """The engine verified ``num_tokens`` tokens of one sequence in ``seconds`` (its drafting excluded):
        what ``verify_cost`` will correct the start-up table by."""
        if self._verify_costs is None or num_tokens < 1:
            return
        self.step_costs.observe(num_tokens, seconds, self._table_cost(num_tokens))
        self._steps_seen += 1
        if self._steps_seen % REFRESH_STEPS == 0:
            self._cost_table = None

    def verify_counts(self, survival: list[list[float]]) -> list[int]:
        """How many of each request's scored nodes to verify (``cost_model.choose_verify_lengths``)."""
        return choose_verify_lengths(survival, self.verify_cost)

    def expand_threshold(self, seqs) -> float:
        """The least raw score of a candidate node whose children a tree search of this batch should still
        draft: half of what one more verified token costs on average, as a share of a step without drafts,
        over the first ``EXPAND_TOKENS`` drafts a sequence (``verify_cost``), over the largest calibration
        factor of the batch's sampling settings (the cost model compares calibrated scores; 0 without a
        cost table). A node of score s is worth verifying only where s exceeds its token's cost as a
        share of the step (times the tokens the step yields already), and its descendants score at most
        s: with costs that grow evenly the cost model takes no node below that share, and the half
        leaves room for costs that do not."""
        if self._verify_costs is None or not seqs:
            return 0.0
        B, K = len(seqs), EXPAND_TOKENS
        plain = max(self.verify_cost(B), 1e-12)
        share = (self.verify_cost(B * (1 + K)) - plain) / (B * K * plain)
        top = 1.0
        if self.calibration is not None:
            top = max(max(self.calibration.factors(sampling_key(s.params))) for s in seqs)
        return max(0.0, 0.5 * share / max(top, 1e-6))

    def take_nodes(self, seq, items: list[tuple] | None, n: int, order: list[int], raw, depth):
        """The first ``n`` nodes of ``seq``'s ranking -> (the chosen candidates, sorted; the chosen branch
        nodes' token paths). ``items``: the ``tree_select.merge_branches`` ranking, or None (then the
        candidates' ``order``). The calibration learns what it will check: the chosen candidates' raw
        scores ``raw[c]`` at depths ``depth[c]``."""
        chosen, extra = split_items(items, n, order)
        if self.calibration is not None:
            self.calibration.expect_nodes(seq, [float(raw[c]) for c in chosen], [int(depth[c]) for c in chosen])
        return chosen, extra

    def with_branches(self, tree: TreeDraft | None, seq, extra: list[list[int]]) -> tuple[TreeDraft | None, int | None]:
        """``tree`` with the chosen branch nodes ``extra`` grafted in, and how many nodes were the drafter's
        own (None: no branch node)."""
        if not extra:
            return tree, None
        return graft(tree, seq.output_ids[-1], [], extra, self._grafted)

    def add_branch_only_trees(self, seqs, prop: Proposal, branches, drafted: set[int]) -> Proposal:
        """The rows that did not draft this step (the draft gate, or no budget) still verify the n-gram
        branch tokens that the cost model finds worth it (weighed on their own): they cost no drafting."""
        todo = [b for b, br in enumerate(branches or []) if br and b not in drafted]
        if not todo:
            return prop
        items = [merge_branches(no_candidates, [], [], branches[b]) for b in todo]
        counts = self.verify_counts([[it[0] for it in row] for row in items])
        trees = list(prop.trees or [None] * len(seqs))
        own = list(prop.own_nodes or [None] * len(seqs))
        for b, row, n in zip(todo, items, counts):
            if n:
                trees[b], own[b] = self.with_branches(None, seqs[b], split_items(row, n, [])[1])
        return Proposal(prop.chains, prop.draft_probs, trees, own)

    def forget(self, seq) -> None:
        """``seq`` finished: the draft gate forgets it (a subclass drops its own state and calls this)."""
        if self.gate is not None:
            self.gate.forget(seq.seq_id)

    def _draft_cost(self, batch: int, measured: float) -> float:
        """This step's drafting time: the start-up table (less noisy than one measurement) when it has
        the batch size, else the measured one; never below the engine's own calls' running mean
        (``cost_model.DraftCosts``)."""
        return self.drafting(self.draft_costs, batch, measured)

    def _judge(self, seq, expected: float, num_verified: int, draft_s: float, batch: int = 1) -> None:
        """Tell the draft gate what this step's drafting (``draft_s``, a call of ``batch`` sequences) is
        expected to give a single sequence."""
        self.gate.judge(seq.seq_id, expected, num_verified, self.verify_cost, self._draft_cost(batch, draft_s))
