"""The proposer interface every drafter implements (vLLM's shape: ``load_model``, ``propose``,
``dummy_run``). Plain decoding is the same engine loop with ``NoProposer``."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.spec_decode.target import DraftTarget


@dataclass
class TreeDraft:
    """A draft tree for one sequence: ``tokens[0]`` is the root (the sequence's last token, not yet in
    the KV cache) and ``buffers`` (``specserve.sample.tree.TreeBuffers``) its shape."""

    tokens: list[int]
    buffers: object


@dataclass
class Proposal:
    """Drafts for a batch. ``chains[b]``: the draft tokens of sequence b (may be empty), or
    ``trees[b]``: a ``TreeDraft`` (then ``chains[b]`` is ignored). ``draft_probs``: None
    (deterministic drafts, verified with the one-hot rule) or ``[B, max_k, V]`` float32, the exact
    distributions the chain drafts were sampled from."""

    chains: list[list[int]]
    draft_probs: torch.Tensor | None = None
    trees: list[TreeDraft | None] | None = None
    # a proposer that ``plans_branches``: per tree, how many of its nodes (root included; a prefix) are
    # the drafter's own, the rest coming from ``ProposeInputs.branches`` (None: no branch node)
    own_nodes: list[int | None] | None = None

    @property
    def has_trees(self) -> bool:
        return bool(self.trees) and any(t is not None for t in self.trees)


@dataclass
class ProposeInputs:
    """What a proposer may look at: the running sequences, how many drafts each may propose at most
    (``max_drafts``: within the drafter's ``num_speculative_tokens``) and how many draft tokens each
    has room for at all (``room``: before its max_tokens or max_model_len). Target features arrive
    earlier, through ``Proposer.observe``. ``branches``: for a proposer that ``plans_branches``, each
    sequence's n-gram branches (a list of ``tree_select.BranchDraft``, maybe empty) to weigh with its
    own drafts."""

    seqs: list
    max_drafts: list[int]
    room: list[int] | None = None
    branches: list | None = None


class Proposer:
    """Base class. Subclasses set ``name`` and ``Options`` (a frozen dataclass of their
    ``speculative_config`` keys, ``options.option`` fields: the constructor's one argument) and
    override ``propose``."""

    name = "none"
    Options = None
    num_speculative_tokens = 0
    aux_layers: tuple = ()  # target layers whose outputs the proposer reads
    needs_hidden = False  # whether it reads the target's final hidden state
    # an opt-in LOSSY acceptance rule (tokens, logits, tree, params, generator) -> (nodes, extra),
    # used instead of exact verification for random rows; None = lossless verification
    lossy_verify = None
    # an "auto" mode's online correction of its predicted acceptance
    # (``specserve.spec_decode.cost_model.AcceptanceCalibration``), or None
    calibration = None
    # whether propose() itself chooses which tokens of ``ProposeInputs.branches`` (n-gram branches,
    # ``ngram.branches``) to verify, with its cost model; otherwise whole branches are grafted in
    plans_branches = False

    def load_model(self, target: DraftTarget) -> None:
        """Attach to the target (``target.DraftTarget``: its embedding, LM head, config, step costs)."""

    def observe(self, seq, last_hidden: torch.Tensor | None, aux: list[torch.Tensor], reset: bool) -> None:
        """Called after every forward that kept positions of ``seq`` in the cache (after the tokens that
        step emitted are appended to ``seq``): ``last_hidden`` [d]
        is the target's final normed hidden state at the last kept position (when ``needs_hidden``);
        ``aux[i]`` [n, d] the outputs of ``aux_layers[i]`` at the n newly kept positions; ``reset``
        marks the first prefill chunk of a sequence."""

    def forget(self, seq) -> None:
        """``seq`` finished: drop any state kept for it."""

    def verified(self, seq, emitted: list[int], kept: list[int]) -> None:
        """Called after every verification of ``seq``'s drafts: the step emitted ``emitted`` (the
        accepted drafts and one target token) and kept the draft positions ``kept`` (node indices, the
        root first). A drafter may learn from it for later steps; this one feeds its ``calibration``."""
        if self.calibration is not None:
            self.calibration.observe(seq.seq_id, len(emitted) - 1)

    def step_cost(self, num_tokens: int, seconds: float) -> None:
        """Called after every decoding step of a single sequence: it verified ``num_tokens`` tokens (its
        last one and the drafts) in ``seconds``, drafting excluded. A drafter with a cost model may
        correct its step costs by it."""

    def propose(self, inputs: ProposeInputs) -> Proposal:
        return Proposal([[] for _ in inputs.seqs])

    def dummy_run(self, batch_size: int = 1) -> None:
        """Warm-up: run the proposer once on placeholder inputs."""


class NoProposer(Proposer):
    """Plain decoding: proposes nothing."""
