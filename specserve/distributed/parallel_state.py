"""The tensor-parallel group, passed explicitly to every layer (never read from a global).

``TPGroup()`` is the single-process group: size 1, every collective a no-op. A real group wraps a
``torch.distributed`` process group (gloo: the ranks are CPU processes). Each collective is counted, so tests
and benchmarks can say how many collectives a step ran.
"""

from __future__ import annotations

import collections
import datetime
import socket
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass
class TPGroup:
    rank: int = 0
    size: int = 1
    group: object | None = None
    counts: collections.Counter = field(default_factory=collections.Counter)

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        self.counts["all_reduce"] += 1
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's ``x`` along ``dim``."""
        if self.size == 1:
            return x
        self.counts["all_gather"] += 1
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=dim)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        if self.size == 1:
            return x
        self.counts["broadcast"] += 1
        dist.broadcast(x, src=src, group=self.group)
        return x

    def num_collectives(self) -> int:
        return sum(self.counts.values())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


COLLECTIVE_TIMEOUT_S = 120  # the group set-up and any one collective; a dead peer is noticed at once


def init_tp_group(rank: int, size: int, init_method: str, backend: str | None = None,
                  timeout_s: float = COLLECTIVE_TIMEOUT_S) -> TPGroup:
    """Join the ``size``-process world and return its TP group (all ranks). The set-up and every
    collective give up after ``timeout_s`` (a rank that never joins, or hangs); a rank whose process
    died breaks its peers' connections, so they fail at once."""
    if size == 1:
        return TPGroup()
    backend = backend or "gloo"  # the TP ranks are CPU processes
    timeout = datetime.timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size, timeout=timeout)
    group = dist.new_group(list(range(size)), backend=backend, timeout=timeout)
    return TPGroup(rank=rank, size=size, group=group)


def split_evenly(n: int, size: int, what: str) -> int:
    if n % size:
        raise ValueError(f"{what} ({n}) is not divisible by tensor_parallel_size ({size})")
    return n // size
