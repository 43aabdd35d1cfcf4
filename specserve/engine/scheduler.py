"""Which requests run in the next step: admission, KV blocks, preemption.

Requests wait in arrival order and are admitted while a running slot is free (``max_num_seqs``) and
the KV cache has the blocks for their prompt (less what prefix caching shares) plus one block of room.
Before each decoding step the running sequences get the blocks their step writes; when blocks run
short, speculation backs off first (no drafts this step), then the most recently admitted sequence is
preempted: its blocks are given back and it waits at the head of the queue, to be recomputed (its
prompt and output so far prefilled again) when blocks are free. Nothing fails for want of blocks:
``check_request`` refuses up front a request that could not fit even alone.

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
        self.running: list[Sequence] = []
        self.num_preempted = 0

    @property
    def capacity(self) -> int:
        """Positions the whole cache holds (scratch block excluded): the most one sequence can use."""
        return (self.blocks.num_blocks - 1) * self.blocks.block_size

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def admit(self) -> list[Sequence]:
        """Move waiting sequences into running slots while slots and blocks allow (first come, first
        served: a sequence that does not fit holds back the ones behind it)."""
        admitted, avail = [], self.blocks.num_free()
        while self.waiting and len(self.running) < self.max_num_seqs:
            s = self.waiting[0]
            need = self.blocks.blocks_for(len(s.all_ids) + 1)
            if need > avail and (self.running or admitted):
                break  # wait for blocks to be given back
            avail -= need
            self.waiting.popleft()
            s.slot = len(self.running)
            s.status = Status.RUNNING
            self.running.append(s)
            admitted.append(s)
        return admitted

    def reserve(self, lengths: list[int]) -> bool:
        """Whether running sequence ``b`` can hold ``lengths[b]`` positions, all of them at once."""
        need = sum(self.blocks.needed(s.slot, n) for s, n in zip(self.running, lengths))
        return need <= self.blocks.num_free()

    def preempt_last(self) -> Sequence:
        """Take the most recently admitted running sequence out (its slot is the last one): it waits at
        the head of the queue and will be recomputed. The caller gives back its blocks."""
        s = self.running.pop()
        s.status = Status.WAITING
        s.num_computed = 0
        self.waiting.appendleft(s)
        self.num_preempted += 1
        return s
