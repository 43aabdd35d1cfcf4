"""N-gram branches beside another drafter (``speculative_config`` keys ``ngram_branch``,
``ngram_candidates``, ``ngram_pool``): ``NgramBranches`` wraps the drafter's proposer and offers each
sequence's n-gram continuations (from itself and, pooled, from earlier requests) as more branches of
its chain or tree. A drafter that ``plans_branches`` weighs them with its own cost model (with
``BranchAcceptance``'s scores); for the others whole branches are grafted below their drafts. The
drafters miss on different tokens: chat answers repeat words of the prompt, of themselves and of
earlier answers, which a trained drafter often does not predict. Verification stays lossless
(deterministic drafts, one-hot rule), whichever wins."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

from specserve.sample.tree import TreeCache
from specserve.spec_decode.cost_model import sampling_key
from specserve.spec_decode.ngram.config import PROMPT_LOOKUP_MAX, PROMPT_LOOKUP_MIN, NgramBranchOptions
from specserve.spec_decode.ngram.datastore import open_datastore
from specserve.spec_decode.ngram.index import NgramIndex, NgramPool
from specserve.spec_decode.options import parse_options
from specserve.spec_decode.proposer import Proposal, ProposeInputs, Proposer
from specserve.spec_decode.tree_select import BranchDraft, graft

# the n-gram branches as the demo and the bench's "-pool" presets use them (speculative_config keys):
# 3 continuations of up to 12 tokens, from the sequence itself and from earlier requests
POOLED_BRANCHES = {"ngram_branch": 12, "ngram_candidates": 3, "ngram_pool": True}
BRANCH_KEYS = (*POOLED_BRANCHES, "ngram_datastore")


class BranchAcceptance:
    """Online estimate of how often the n-gram branches' tokens are accepted, per key (the engine's:
    the sampling setting, ``cost_model.sampling_key``, the length n of the matched n-gram, as a
    4-gram match predicts better than a 1-gram one, and the candidate's rank), so that a cost model
    can weigh each branch token against what verifying it costs, as it weighs a drafter's own nodes.

    At depth d it keeps exponentially decayed counts of the steps where the sequence's next d - 1
    tokens turned out to be the branch's (the branch's token d was "tried") and of those where the
    d-th was too; the conditional rate is ``(hits + prior * p0) / (tries + prior)`` (a depth without
    evidence takes the rate of the depth above it as ``p0``) and a token's score is the product of the
    rates down to it. The tokens a step emitted (accepted drafts + the target's own token) say this for
    every branch token up to their length, whether the step verified the branch or not: the estimate
    needs no exploration. Lossless: it reads earlier steps' emitted tokens only."""

    def __init__(self, max_depth: int, decay: float = 0.99, prior: float = 2.0, p0: float = 0.5):
        if not 0.0 < decay <= 1.0 or prior <= 0 or not 0.0 < p0 < 1.0:
            raise ValueError(f"need decay in (0, 1], prior > 0 and p0 in (0, 1), got {decay}, {prior}, {p0}")
        self.max_depth, self.decay, self.prior, self.p0 = int(max_depth), float(decay), float(prior), float(p0)
        self._stats: dict[tuple, list[list[float]]] = {}  # key -> [tries[d], hits[d]]

    def rates(self, key: tuple, prior: list[float] | None = None) -> list[float]:
        """The conditional acceptance rates at depths 1..max_depth; ``prior[d]``, where given, is the
        rate depth d + 1 takes without evidence (a datastore continuation's votes) in place of the rate
        of the depth above."""
        st = self._stats.get(key)
        out: list[float] = []
        for d in range(self.max_depth):
            tries, hits = (st[0][d], st[1][d]) if st else (0.0, 0.0)
            above = prior[d] if prior is not None and d < len(prior) else out[-1] if out else self.p0
            out.append((hits + self.prior * above) / (tries + self.prior))
        return out

    def draft(self, key: tuple, tokens: list[int], prior: list[float] | None = None) -> BranchDraft:
        scores, run = [], 1.0
        for r in self.rates(key, prior)[: len(tokens)]:
            run *= r
            scores.append(run)
        return BranchDraft(list(tokens), scores)

    def observe(self, key: tuple, branch: list[int], emitted: list[int]) -> None:
        """A step that offered ``branch`` emitted ``emitted``."""
        if not branch or not emitted:
            return
        st = self._stats.setdefault(key, [[0.0] * self.max_depth, [0.0] * self.max_depth])
        for row in st:
            row[:] = [x * self.decay for x in row]
        for d, (b, e) in enumerate(zip(branch[: self.max_depth], emitted)):
            st[0][d] += 1.0
            if b != e:
                break
            st[1][d] += 1.0


def store_key(n: int, votes: list[tuple[int, int]]) -> tuple:
    """The bins a datastore continuation's acceptance is learnt in: the matched n (in pairs), how many
    occurrences matched (1, 2, 3+) and the share of them that agree on its first token (in halves)."""
    c, t = votes[0]
    return "store", min(n, 8) // 2, min(t, 3), round(2 * c / t)


class Offer(NamedTuple):
    """A continuation offered as a draft: its ``tokens``, the ``key`` its acceptance is learnt under and,
    for a datastore's, the ``prior`` rate of each token (from its votes)."""

    tokens: list[int]
    key: tuple
    prior: list[float] | None = None


class NgramSource:
    """Each sequence's n-gram continuations, step by step, with what they are worth: its n-grams
    indexed as it grows, the ``pool`` of earlier requests' tokens (or None), the ``datastore``
    (``datastore.NgramDatastore`` or None, set by ``load_model``) and the ``acceptance`` estimates that
    learn from what each step emitted. ``matches`` offers up to ``limit`` continuations of up to
    ``max_len`` tokens from the sequence and the pool, and up to ``limit`` more from the datastore
    (counted in ``stored_offers``); ``observe`` hears what the step that offered them emitted."""

    def __init__(self, max_len: int, limit: int, pool: bool, n_max: int = PROMPT_LOOKUP_MAX,
                 n_min: int = PROMPT_LOOKUP_MIN, datastore: str | None = None):
        self.max_len, self.limit, self.n_max, self.n_min = int(max_len), int(limit), int(n_max), int(n_min)
        self.acceptance = BranchAcceptance(self.max_len)
        self.pool = NgramPool(n_max, n_min) if pool else None
        self.datastore_option, self.datastore = datastore, None
        self.stored_offers = 0
        self._index: dict[int, NgramIndex] = {}  # seq_id -> its n-grams, kept up to date step by step
        self._offered: dict[int, list[Offer]] = {}  # seq_id -> what its last step offered

    def load_datastore(self, target) -> None:
        """Opens the datastore the options name for ``target`` (a ``ModelRunner``)."""
        self.datastore = open_datastore(self.datastore_option, target.model_dir, target.config.vocab_size)

    def matches(self, seq, room: int) -> list[Offer]:
        """``seq``'s continuations of at most ``room`` tokens, remembered for ``observe``. Their keys: the
        sampling setting, then the matched n and the rank for the sequence's and the pool's, or
        ``"store"`` and the bins of the match (``store_key``) for the datastore's."""
        k = min(self.max_len, room)
        key = sampling_key(seq.params)
        out = []
        if k > 0:
            index = self._index.setdefault(seq.seq_id, NgramIndex(self.n_max, self.n_min))
            found = index.update(seq.all_ids).candidates(k, self.limit, self.pool)
            out = [Offer(toks, (key, n, r)) for r, (toks, n) in enumerate(found)]
            if self.datastore is not None:
                n, stored = self.datastore.continuations(index.ids, k, self.limit)
                new = [Offer(toks, (key, *store_key(n, votes)), [c / (t + 1) for c, t in votes])
                       for toks, votes in stored if not any(o.tokens[: len(toks)] == toks for o in out)]
                self.stored_offers += len(new)
                out += new
        self._offered[seq.seq_id] = out
        return out

    def drafts(self, matches: list[Offer]) -> list[BranchDraft]:
        """``matches`` scored for a cost model."""
        return [self.acceptance.draft(m.key, m.tokens, m.prior) for m in matches]

    def observe(self, seq, emitted: list[int]) -> None:
        """The step that offered ``seq``'s matches emitted ``emitted``: every continuation offered learns
        from it, verified or not."""
        for m in self._offered.pop(seq.seq_id, ()):
            self.acceptance.observe(m.key, m.tokens, emitted)

    def forget(self, seq) -> None:
        self._offered.pop(seq.seq_id, None)
        self._index.pop(seq.seq_id, None)
        if seq.finished and self.pool is not None:  # a finished answer serves later requests
            self.pool.add(seq.all_ids)


def split_ngram_branch(spec) -> tuple[object, NgramBranchOptions]:
    """``speculative_config`` -> (the drafter's own config, ``NgramBranchOptions``). The ``ngram``
    drafter takes ``ngram_candidates``, ``ngram_pool`` and ``ngram_datastore`` as its own keys, and no
    branches."""
    if spec is None or not any(k in spec.options for k in BRANCH_KEYS):
        return spec, NgramBranchOptions()
    if spec.method == "ngram":
        if spec.options.get("ngram_branch"):
            raise ValueError("ngram_branch adds n-gram drafts to another drafter's; method 'ngram' already drafts "
                             "them (its ngram_candidates, ngram_pool and ngram_datastore keys say how many and "
                             "from where)")
        return dataclasses.replace(spec, options={k: v for k, v in spec.options.items() if k != "ngram_branch"}), \
            NgramBranchOptions()
    opts = parse_options(NgramBranchOptions, {k: v for k, v in spec.options.items() if k in BRANCH_KEYS}, spec.method)
    own = {k: v for k, v in spec.options.items() if k not in BRANCH_KEYS}
    return dataclasses.replace(spec, options=own), opts


class NgramBranches(Proposer):
    """``inner``'s drafts with each sequence's n-gram continuations as more branches. Counts
    ``branch_tokens`` (branch nodes verified beyond the drafter's own) and ``branch_wins`` (steps where
    a branch node was accepted past the drafter's own)."""

    def __init__(self, inner: Proposer, opts: NgramBranchOptions):
        self.inner, self.opts = inner, opts
        self.name = inner.name
        self.source = NgramSource(opts.ngram_branch, opts.ngram_candidates, opts.ngram_pool,
                                  datastore=opts.ngram_datastore)
        self._trees = TreeCache.by_parents()  # grafted shapes recur
        self._own: dict[int, int | None] = {}  # seq_id -> the drafter's own nodes of its last draft tree
        self.branch_tokens = self.branch_wins = 0

    # the drafter's own attributes, as the engine reads them
    num_speculative_tokens = property(lambda self: self.inner.num_speculative_tokens)
    aux_layers = property(lambda self: self.inner.aux_layers)
    needs_hidden = property(lambda self: self.inner.needs_hidden)
    lossy_verify = property(lambda self: self.inner.lossy_verify)
    calibration = property(lambda self: self.inner.calibration)

    def load_model(self, target) -> None:
        self.source.load_datastore(target)
        self.inner.load_model(target)

    def dummy_run(self, batch_size: int = 1) -> None:
        self.inner.dummy_run(batch_size)

    def observe(self, seq, last_hidden, aux, reset) -> None:
        self.inner.observe(seq, last_hidden, aux, reset)

    @property
    def pool(self) -> NgramPool | None:
        return self.source.pool

    def forget(self, seq) -> None:
        self.inner.forget(seq)
        self._own.pop(seq.seq_id, None)
        self.source.forget(seq)

    def step_cost(self, num_tokens: int, seconds: float) -> None:
        self.inner.step_cost(num_tokens, seconds)

    def propose(self, inputs: ProposeInputs) -> Proposal:
        seqs, B = inputs.seqs, len(inputs.seqs)
        matches = [self.source.matches(s, room) for s, room in zip(seqs, inputs.room)]
        planned = self.inner.plans_branches
        branches = [self.source.drafts(m) for m in matches] if planned else None
        prop = self.inner.propose(ProposeInputs(seqs, inputs.max_drafts, inputs.room, branches))
        own = list(prop.own_nodes or [None] * B)
        if not planned and prop.draft_probs is None and self.inner.lossy_verify is None:
            chains = [list(c[:m]) for c, m in zip(prop.chains, inputs.max_drafts)]
            trees = prop.trees if prop.has_trees else [None] * B
            grafted = [graft(t, s.output_ids[-1], c, [o.tokens for o in m], self._trees)
                       for s, c, t, m in zip(seqs, chains, trees, matches)]  # whole branches below the drafter's
            prop = Proposal(chains, None, [g[0] for g in grafted])
            own = [g[1] for g in grafted]
        for s, o in zip(seqs, own):
            self._own[s.seq_id] = o
        self.branch_tokens += sum(len(t.tokens) - o for t, o in zip(prop.trees or [], own) if o is not None)
        return prop

    def verified(self, seq, emitted: list[int], kept: list[int]) -> None:
        """The drafter hears of its own nodes' part of what was accepted; the branch statistics learn
        from every continuation offered, verified or not."""
        own = self._own.pop(seq.seq_id, None)
        n = len(emitted) - 1
        if own is not None:  # the drafter's nodes: a prefix of any path
            n = sum(1 for i in kept[1:] if i < own)
            self.branch_wins += n < len(emitted) - 1
        self.inner.verified(seq, emitted[: n + 1], kept[: n + 1])
        self.source.observe(seq, emitted)
