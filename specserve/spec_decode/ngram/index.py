"""A sequence's n-grams and those of earlier requests, indexed for prompt lookup: what the ``ngram``
drafter (``proposer``) and the n-gram branches beside another drafter (``branches``) draft from."""

from __future__ import annotations

import torch

from specserve.spec_decode.ngram.config import PROMPT_LOOKUP_MAX, PROMPT_LOOKUP_MIN


def ngram_propose(ids: torch.Tensor, k: int, n_max: int, n_min: int) -> list[int]:
    """ids: the whole sequence (a list or 1-D tensor). Returns up to k tokens that followed the most recent
    earlier occurrence of its last n tokens, for the largest n in [n_min, n_max] that has one."""
    return NgramIndex(n_max, n_min).update(ids).most_recent(k)


def ngram_windows(ids: list[int], n_min: int, n_max: int, done: int = 0):
    """(n-gram, its start) of every window of ``ids`` that a token follows, n from ``n_min`` to ``n_max``,
    leaving out those of its first ``done`` tokens (the windows a shorter prefix already had)."""
    for n in range(n_min, n_max + 1):
        for h in range(max(0, done - n), len(ids) - n):
            yield tuple(ids[h : h + n]), h


class NgramPool:
    """The tokens of earlier requests (prompt and output of each finished one), indexed by their
    n-grams, so that a sequence's n-gram branch can also continue a phrase that an earlier answer
    used (as vLLM's suffix decoding does with a tree of earlier responses): a chat model answers
    different questions with the same phrases. Each n-gram keeps its ``per_key`` most recent
    occurrences; the oldest sequences are dropped past ``max_tokens`` tokens in all."""

    def __init__(self, n_max: int = PROMPT_LOOKUP_MAX, n_min: int = PROMPT_LOOKUP_MIN, max_tokens: int = 1 << 20,
                 per_key: int = 4):
        self.n_max, self.n_min, self.max_tokens, self.per_key = n_max, n_min, int(max_tokens), int(per_key)
        self._seqs: dict[int, list[int]] = {}  # sequence number -> tokens, oldest first
        self._next = 0
        self._total = 0
        self._index: dict[tuple, list[tuple[int, int]]] = {}  # n-gram -> [(sequence, continuation start)]

    def __len__(self) -> int:
        return len(self._seqs)

    def add(self, ids: list[int]) -> None:
        ids = [int(t) for t in ids]
        if len(ids) < 2:
            return
        no, self._next = self._next, self._next + 1
        self._seqs[no] = ids
        self._total += len(ids)
        for key, h in ngram_windows(ids, self.n_min, self.n_max):
            hits = self._index.setdefault(key, [])
            hits.append((no, h + len(key)))
            if len(hits) > self.per_key:
                del hits[0]
        while self._total > self.max_tokens and len(self._seqs) > 1:
            old = next(iter(self._seqs))
            gone = self._seqs.pop(old)
            self._total -= len(gone)
            for key, _ in ngram_windows(gone, self.n_min, self.n_max):  # its index entries go too
                hits = [h for h in self._index.get(key, ()) if h[0] != old]
                if hits:
                    self._index[key] = hits
                else:
                    self._index.pop(key, None)

    def continuations(self, suffix: list[int], k: int) -> list[list[int]]:
        """Up to k tokens that followed ``suffix`` in earlier sequences, most recent first."""
        out = []
        for no, start in reversed(self._index.get(tuple(suffix), ())):
            ids = self._seqs.get(no)
            if ids is not None:
                out.append(ids[start : start + k])
        return out


class NgramIndex:
    """One sequence's n-grams (n from ``n_min`` to ``n_max``) with where each occurred, kept up to date as
    the sequence grows (``update``), so that a step's lookup (``candidates``) reads a few dict entries
    instead of scanning the whole sequence. A sequence that is not the indexed one grown (another, or a
    shorter one) is indexed anew."""

    def __init__(self, n_max: int = PROMPT_LOOKUP_MAX, n_min: int = PROMPT_LOOKUP_MIN):
        self.n_max, self.n_min = int(n_max), int(n_min)
        self.ids: list[int] = []
        self._starts: dict[tuple, list[int]] = {}  # n-gram -> starts of its earlier occurrences, ascending

    def update(self, ids) -> "NgramIndex":
        """Index ``ids`` (a list or 1-D tensor of the whole sequence): an n-gram is listed once a token
        follows it."""
        ids = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        m = len(self.ids)
        if len(ids) < m or ids[:m] != self.ids:
            self.ids, self._starts, m = [], {}, 0
        for key, h in ngram_windows(ids, self.n_min, self.n_max, m):  # the windows new since the last update
            self._starts.setdefault(key, []).append(h)
        self.ids = ids
        return self

    def candidates(self, k: int, limit: int, pool: "NgramPool | None" = None) -> list[tuple[list[int], int]]:
        """Up to ``limit`` distinct continuations (each up to k tokens) of the indexed sequence, as
        (tokens, n): for n from ``n_max`` down, the tokens that followed its last n tokens earlier in
        itself (most recent first), then in ``pool``'s earlier sequences. A candidate that is a prefix of
        an earlier one adds nothing and is skipped."""
        ids, L = self.ids, len(self.ids)
        out: list[tuple[list[int], int]] = []
        if k <= 0 or limit <= 0:
            return out

        def offer(tokens: list[int], n: int) -> bool:
            if tokens and not any(c[: len(tokens)] == tokens for c, _ in out):
                out.append((tokens, n))
            return len(out) >= limit

        for n in range(min(self.n_max, L - 1), self.n_min - 1, -1):
            suffix = tuple(ids[L - n :])
            for h in reversed(self._starts.get(suffix, ())):
                if offer(ids[h + n : h + n + k], n):
                    return out
            if pool is not None:
                for tokens in pool.continuations(list(suffix), k):
                    if offer(tokens, n):
                        return out
        return out

    def most_recent(self, k: int) -> list[int]:
        """The ``ngram`` drafter's draft: up to k tokens that followed the most recent earlier occurrence
        of the indexed sequence's longest matched suffix ([] when none)."""
        found = self.candidates(k, 1)
        return found[0][0] if found else []


def ngram_candidates(ids, k: int, limit: int, pool: NgramPool | None = None,
                     n_max: int = PROMPT_LOOKUP_MAX, n_min: int = PROMPT_LOOKUP_MIN) -> list[tuple[list[int], int]]:
    """``NgramIndex.candidates`` of the sequence ``ids`` (a list or 1-D tensor), indexed for this one call."""
    return NgramIndex(n_max, n_min).update(ids).candidates(k, limit, pool)
