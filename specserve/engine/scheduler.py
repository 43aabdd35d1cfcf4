"""Which requests run in the next step: admission, chunked prefill, KV blocks, preemption.

Requests wait in arrival order and are admitted while a slot is free (``max_num_seqs``) and the KV
cache has the blocks for their prompt plus one block of room. An admitted request is *prefilling*:
each step computes at most ``prefill_chunk`` prompt tokens in all (short prompts together, a long one
a chunk at a time), then decodes the running batch, so a long prompt never stalls the requests
already decoding. A request whose prefill is complete joins the running batch (its slot and block
table move next to the others: a table move, no copy).

Before each decoding step the running sequences get the blocks their step writes; when blocks run
short, speculation backs off first (no drafts this step), then a prefilling request (it holds blocks
and has produced nothing), then the most recently admitted running sequence is preempted: its blocks
are given back and it waits at the head of the queue, to be recomputed (its prompt and output so far
prefilled again) when blocks are free. Nothing fails for want of blocks: the budget checked at start-up
(``model_runner.kv_cache_blocks``) holds at least one sequence of ``max_model_len`` positions.

The block counts are read from the driver's ``BlockManager`` (every tensor-parallel rank holds the
same tables), so no step is sent to the workers that could run out of blocks on them.
"""

from __future__ import annotations

from collections import deque

from specserve.engine.block_manager import BlockManager
from specserve.engine.sequence import Sequence, Status


class Scheduler:
    def __init__(self, max_num_seqs: int, blocks: BlockManager):
        self.max_num_seqs = max_num_seqs
        self.blocks = blocks
        self.waiting: deque[Sequence] = deque()
        self.prefilling: list[Sequence] = []  # admitted, prompt not yet computed (in admission order)
        self.running: list[Sequence] = []  # slots 0..len-1, decoding
        self.num_preempted = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running)

    @staticmethod
    def prefill_ids(s: Sequence) -> list[int]:
        """What a prefill computes: the prompt, or for a preempted sequence all but its last token."""
        return s.all_ids[:-1] if s.output_ids else s.prompt_ids

    def admit(self) -> list[Sequence]:
        """Move waiting sequences into free slots (prefilling) while slots and blocks allow (first come,
        first served: a sequence that does not fit holds back the ones behind it)."""
        admitted = []
        avail = self.blocks.num_free() - sum(self.blocks.needed(p.slot, len(self.prefill_ids(p)) + 1)
                                             for p in self.prefilling)
        while self.waiting and len(self.running) + len(self.prefilling) < self.max_num_seqs:
            s = self.waiting[0]
            need = self.blocks.blocks_for(len(s.all_ids) + 1)
            if need > avail and (self.running or self.prefilling):
                break  # wait for blocks to be given back
            avail -= need
            self.waiting.popleft()
            taken = {p.slot for p in self.prefilling}
            s.slot = next(i for i in range(len(self.running), self.max_num_seqs) if i not in taken)
            s.status = Status.RUNNING
            self.prefilling.append(s)
            admitted.append(s)
        return admitted

    def fits(self, rows: list[tuple[int, int]]) -> bool:
        """Whether every (slot, length) can hold its positions, all at once."""
        return sum(self.blocks.needed(slot, n) for slot, n in rows) <= self.blocks.num_free()

    def reserve(self, lengths: list[int]) -> bool:
        """Whether running sequence ``b`` can hold ``lengths[b]`` positions, all of them at once."""
        return self.fits([(s.slot, n) for s, n in zip(self.running, lengths)])

    def preempt(self) -> Sequence:
        """Take out the last prefilling sequence, else the most recently admitted running one (its slot
        is the last): it waits at the head of the queue and will be recomputed. The caller gives back
        the blocks of its slot (``slot`` is still set)."""
        s = self.prefilling.pop() if self.prefilling else self.running.pop()
        s.status = Status.WAITING
        s.num_computed = 0
        self.waiting.appendleft(s)
        self.num_preempted += 1
        return s
