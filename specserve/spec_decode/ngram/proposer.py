"""N-gram drafter (prompt lookup): match the sequence's last n tokens earlier in the sequence (n from
``prompt_lookup_max`` down to ``prompt_lookup_min``) and propose the tokens that followed.

``ngram_verify="full"`` is vLLM's n-gram drafting: the continuation of the most recent match, every
token verified. With ``"auto"`` (what ``{"method": "ngram"}`` runs, ``spec_decode.defaults``) the
drafter offers up to ``ngram_candidates`` continuations, from the sequence itself and, with
``ngram_pool``, from earlier requests, each token scored by how often such tokens were accepted
(``branches.BranchAcceptance``), and verifies the tokens the cost model finds worth their share of the
target's step (measured at start-up, as the model drafters' are): on a CPU, where every verified token
costs, an unlikely continuation is left out instead of slowing the step. The drafts are deterministic
either way, verified with the one-hot rule: lossless."""

from __future__ import annotations

from specserve.spec_decode.cost_model import tree_profile_sizes
from specserve.spec_decode.model_drafter import ModelDrafter
from specserve.spec_decode.ngram.branches import NgramSource
from specserve.spec_decode.ngram.config import NgramOptions
from specserve.spec_decode.proposer import Proposal, ProposeInputs


class NgramProposer(ModelDrafter):
    name = "ngram"

    Options = NgramOptions

    def __init__(self, opts: NgramOptions):
        super().__init__(online_calibration=False)  # the branch acceptance estimates are online already
        self.num_speculative_tokens = opts.num_speculative_tokens
        self.verify_mode = opts.ngram_verify
        self.source = NgramSource(opts.num_speculative_tokens, opts.ngram_candidates, opts.ngram_pool,
                                  opts.prompt_lookup_max, opts.prompt_lookup_min, opts.ngram_datastore)

    def load_model(self, target) -> None:
        self.source.load_datastore(target)
        if self.verify_mode == "auto":
            max_seqs = getattr(target, "max_num_seqs", 1)
            _, sizes = tree_profile_sizes(max_seqs, self.source.limit * self.num_speculative_tokens)
            self.measure_costs(target, sizes, self.num_speculative_tokens)

    def forget(self, seq) -> None:
        self.source.forget(seq)
        super().forget(seq)

    def verified(self, seq, emitted: list[int], kept: list[int]) -> None:
        self.source.observe(seq, emitted)

    def propose(self, inputs: ProposeInputs) -> Proposal:
        seqs = inputs.seqs
        matches = [self.source.matches(s, k) for s, k in zip(seqs, inputs.max_drafts)]
        if self.verify_mode == "auto":
            none = [None] * len(seqs)
            empty = Proposal([[] for _ in seqs], trees=list(none), own_nodes=list(none))
            return self.add_branch_only_trees(seqs, empty, [self.source.drafts(m) for m in matches], set())
        if self.source.limit == 1:
            return Proposal([m[0].tokens if m else [] for m in matches])
        grafted = [self.with_branches(None, s, [o.tokens for o in m])[0] for s, m in zip(seqs, matches)]
        return Proposal([[] for _ in seqs], trees=grafted)  # every continuation verified whole: a tree
