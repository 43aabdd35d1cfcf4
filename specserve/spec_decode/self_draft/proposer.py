"""Method ``target``: a copy of the target model (the same checkpoint, dtype and weight format, a KV
cache of its own: ``ModelRunner.replica``) proposes its own greedy continuation, ``num_speculative_tokens``
tokens a step, one forward per token.

What it is for: the ceiling. At temperature 0 every draft must be accepted (acceptance rate 1.0 at
every position, tau = num_speculative_tokens + 1 but for the last steps of a request): anything less is
a bug in verification, or a forward over k tokens that rounds differently from k one-token forwards.
At temperature > 0 its greedy drafts are verified like any deterministic drafts (lossless), and the
acceptance measures how often sampling follows the argmax. It is never faster than plain decoding.

The copy keeps, per sequence, the tokens its cache holds; each step it reuses the longest prefix they
share with the sequence (accepted drafts included) and computes the rest. One process only (a sharded
target is refused).
"""

from __future__ import annotations

import torch

from specserve.spec_decode.proposer import Proposal, ProposeInputs, Proposer
from specserve.spec_decode.self_draft.config import SelfDraftOptions


class TargetCopy:
    """The target's copy next to the runner (built by ``DraftTarget.attach``): greedy chains, one
    cache slot per running sequence."""

    def __init__(self, runner):
        self.runner = runner.replica()
        self.slots: dict[int, int] = {}  # seq_id -> the copy's cache slot
        self.cached: dict[int, list[int]] = {}  # seq_id -> the tokens of that slot's cache
        self.free = list(range(self.runner.max_num_seqs))

    @torch.inference_mode()
    def greedy(self, seq_id: int, ids: list[int], k: int) -> list[int]:
        """The target's greedy continuation of ``ids``, ``k`` tokens."""
        if seq_id not in self.slots:
            if not self.free:
                raise RuntimeError("the target's copy has no free cache slot")
            self.slots[seq_id], self.cached[seq_id] = self.free.pop(), []
        slot, held = self.slots[seq_id], self.cached[seq_id]
        start = 0
        while start < min(len(held), len(ids) - 1) and held[start] == ids[start]:
            start += 1
        new, out = list(ids[start:]), []
        for _ in range(k):
            logits = self.runner.forward(slot, [new], [start], "last").logits[0]
            start += len(new)
            new = [int(logits.argmax())]
            out += new
        self.cached[seq_id] = list(ids) + out[:-1]
        return out

    def forget(self, seq_id: int) -> None:
        slot = self.slots.pop(seq_id, None)
        self.cached.pop(seq_id, None)
        if slot is not None:
            self.runner.release_slot(slot)
            self.free.append(slot)


class SelfDraftProposer(Proposer):
    name = "target"
    Options = SelfDraftOptions

    def __init__(self, opts: SelfDraftOptions):
        self.num_speculative_tokens = opts.num_speculative_tokens

    def load_model(self, target) -> None:
        if target.tp.size > 1:
            raise ValueError("method 'target' runs its copy of the target on one process: use tensor_parallel_size 1")
        target.attach(self.name, TargetCopy)
        self.copy: TargetCopy = target.helper(self.name)

    def propose(self, inputs: ProposeInputs) -> Proposal:
        chains = []
        for seq, k in zip(inputs.seqs, inputs.max_drafts):
            k = min(k, self.num_speculative_tokens)
            chains.append(self.copy.greedy(seq.seq_id, seq.all_ids, k) if k > 0 else [])
        return Proposal(chains)

    def forget(self, seq) -> None:
        self.copy.forget(seq.seq_id)
