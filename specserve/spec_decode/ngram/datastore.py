"""A datastore of answers for n-gram drafting (``speculative_config`` key ``ngram_datastore``; retrieval
drafting as in REST, He et al. 2023): the sequence's last n tokens (n from ``n_max`` down to ``n_min``,
the longest that occurs) are looked up among the datastore's token windows, and the continuations that
followed them there are offered as n-gram drafts, each token with its votes (how many of the matched
occurrences agree on it), which ``branches.NgramSource`` turns into acceptance estimates. A small chat
model answers different questions with the same phrases, so its own answers to other prompts predict
its next tokens where the sequence itself has nothing to copy.

``NgramDatastore`` indexes token sequences in numpy: every position's next tokens packed into two
64-bit words (16 bits a token, or as many as the largest id needs), positions sorted by them, so that
the occurrences of any n-gram up to ``n_max`` tokens are one contiguous range found by binary search. ``load`` reads a
distillation store directory (``train/store.py``: every record's response, after the last tokens of
its prompt) or a description naming one and the records to leave out; ``open_datastore`` resolves an
``ngram_datastore`` value (``"auto"``: the description shipped for the target, ``DATASTORE_DIR``,
matched by the target's fingerprint). Drafts never depend on the target's verdicts: lossless whatever
the datastore holds."""

from __future__ import annotations

import collections
import hashlib
import json
from pathlib import Path

import numpy as np

PACKAGE_DIR = Path(__file__).resolve().parents[2]  # specserve/
DATASTORE_DIR = Path(__file__).with_name("datastores")
MIN_BITS = 16  # bits a packed token takes at least (the code is id + 1; 0 marks "past the sequence's end")
PROMPT_TAIL = 3  # prompt tokens kept before each response (the chat template's assistant header)
MAX_READ = 64  # continuation tokens read per occurrence at most


class DatastoreError(ValueError):
    """A datastore file that cannot be read, named with what is wrong."""


class NgramDatastore:
    """Token ``sequences`` indexed for ``continuations``. ``n_max``: cut to the tokens two words hold
    (8 of up to 16 bits, 6 of up to 21 bits); ``max_rows``: the
    matched occurrences read per lookup at most (evenly spaced over all of them)."""

    def __init__(self, sequences, n_min: int = 2, n_max: int = 8, max_rows: int = 32):
        seqs = [np.asarray(s, dtype=np.int64).reshape(-1) for s in sequences]
        seqs = [s for s in seqs if s.size >= 2]
        top = max((int(s.max()) for s in seqs), default=0)
        if any(int(s.min()) < 0 for s in seqs) or top >= 1 << 31:
            raise ValueError("datastore token ids must lie in 0..2**31 - 1")
        self.bits = max(MIN_BITS, (top + 1).bit_length())
        self.per_word = 64 // self.bits
        n_max = min(n_max, 2 * self.per_word)
        if not 1 <= n_min <= n_max or max_rows < 1:
            raise ValueError(f"need 1 <= n_min <= n_max (at most {2 * self.per_word} here) and max_rows >= 1, got "
                             f"{n_min}, {n_max}, {max_rows}")
        self.n_min, self.n_max, self.max_rows = int(n_min), int(n_max), int(max_rows)
        self.num_sequences, self.max_id = len(seqs), top
        self.num_tokens = int(sum(s.size for s in seqs))
        pad = np.full(1, -1, dtype=np.int64)
        # the tokens, each sequence followed by -1, and enough -1 at the end for any read past the last one
        tail = 2 * self.per_word + MAX_READ
        flat = np.concatenate([x for s in seqs for x in (s, pad)] + [np.full(tail, -1, dtype=np.int64)])
        self.tokens = flat.astype(np.int32)
        starts = np.nonzero(flat[: flat.size - tail] >= 0)[0]
        words = [np.zeros(starts.size, dtype=np.uint64) for _ in range(2)]
        alive = np.ones(starts.size, dtype=bool)
        for j in range(2 * self.per_word):  # position p's token j, packed; 0 from the sequence's end on
            code = (flat[starts + j] + 1) * alive
            alive &= code > 0
            w = words[j // self.per_word]
            w <<= np.uint64(self.bits)
            w |= code.astype(np.uint64)
        order = np.lexsort((words[1], words[0]))
        self._hi, self._lo, self._pos = words[0][order], words[1][order], starts[order].astype(np.int64)

    def __len__(self) -> int:
        return self.num_sequences

    # ---- lookup -------------------------------------------------------------------------------------
    def _range(self, codes: list[int]) -> tuple[int, int]:
        """The sorted positions whose next len(codes) tokens are ``codes`` (ids + 1): [lo, hi)."""
        n, per, bits = len(codes), self.per_word, self.bits
        word = 0
        for c in codes[:per]:
            word = (word << bits) | c
        if n <= per:
            shift = bits * (per - n)
            a, b = np.searchsorted(self._hi, np.array([word << shift, (word + 1) << shift], dtype=np.uint64))
            return int(a), int(b)
        a, b = np.searchsorted(self._hi, np.array([word, word + 1], dtype=np.uint64))
        if a == b:
            return 0, 0
        low = 0
        for c in codes[per:]:
            low = (low << bits) | c
        shift = bits * (2 * per - n)
        c, d = np.searchsorted(self._lo[a:b], np.array([low << shift, (low + 1) << shift], dtype=np.uint64))
        return int(a + c), int(a + d)

    def continuations(self, ids, k: int, limit: int) -> tuple[int, list[tuple[list[int], list[tuple[int, int]]]]]:
        """The continuations of ``ids`` (the sequence's tokens, a list) after its longest suffix of
        ``n_min``..``n_max`` tokens that occurs: (n, up to ``limit`` continuations of up to ``k`` tokens).
        One continuation per distinct first token, the most voted first; each follows, token by token,
        the most frequent next token among the occurrences that agree so far, ending where fewer than
        half of them agree or a sequence ends (``k`` is capped at ``MAX_READ``). ``votes[d]`` =
        (occurrences with the continuation's first d + 1 tokens, occurrences with its first d). (0, [])
        when no suffix occurs with a token after it."""
        k = min(k, MAX_READ)
        if k <= 0 or limit <= 0:
            return 0, []
        for n in range(min(self.n_max, len(ids)), self.n_min - 1, -1):
            codes = [int(t) + 1 for t in ids[len(ids) - n :]]
            if min(codes) <= 0 or max(codes) > self.max_id + 1:
                continue  # an id the datastore cannot hold occurs nowhere in it
            a, b = self._range(codes)
            if b <= a:
                continue
            pos = self._pos[a:b]
            if pos.size > self.max_rows:
                pos = pos[np.linspace(0, pos.size - 1, self.max_rows).astype(np.int64)]
            found = _vote(self.tokens[(pos + n)[:, None] + np.arange(k)].tolist(), limit)
            if found:  # (else every occurrence ends a sequence: a shorter suffix may have a continuation)
                return n, found
        return 0, []

    # ---- files --------------------------------------------------------------------------------------
    @classmethod
    def load(cls, path, **kw) -> "NgramDatastore":
        """A datastore of a distillation store directory (``train/store.py``: every record's response,
        after its prompt's last ``PROMPT_TAIL`` tokens), or of a datastore description (``.json``: the
        ``store`` directory, relative to the specserve package, and the records to ``exclude``, by the
        ``record_digest`` of their keys: the shipped ones leave out the bench's held-out prompts)."""
        path = Path(path)
        if path.is_dir():
            return cls(store_sequences(path), **kw)
        if not path.is_file():
            raise DatastoreError(f"ngram_datastore: {path}: no such file or directory")
        try:
            meta = json.loads(path.read_text())
            store, exclude = PACKAGE_DIR / meta["store"], set(meta.get("exclude", ()))
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
            raise DatastoreError(f"ngram_datastore: {path}: not a datastore description or store directory "
                                 f"({type(e).__name__}: {e})") from None
        return cls(store_sequences(store, exclude), **kw)


def _vote(rows: list[list[int]], limit: int) -> list[tuple[list[int], list[tuple[int, int]]]]:
    out = []
    for first, count in collections.Counter(r[0] for r in rows).most_common():
        if len(out) >= limit:
            break
        if first < 0:
            continue
        agree = [r for r in rows if r[0] == first]
        tokens, votes = [first], [(count, len(rows))]
        for d in range(1, len(rows[0])):
            tok, c = collections.Counter(r[d] for r in agree).most_common(1)[0]
            if tok < 0 or 2 * c < len(agree):  # a sequence's end, or no half of them agree
                break
            tokens.append(tok)
            votes.append((c, len(agree)))
            agree = [r for r in agree if r[d] == tok]
        out.append((tokens, votes))
    return out


def record_digest(key: bytes) -> str:
    """A store record's key (its prompt ids and seed) as the short digest datastore descriptions list."""
    return hashlib.sha256(key).hexdigest()[:16]


def store_sequences(path, exclude: set[str] = frozenset()) -> list[np.ndarray]:
    """A distillation store's records as datastore sequences, those whose ``record_digest`` is in
    ``exclude`` left out: each response after the last ``PROMPT_TAIL`` tokens of its prompt (so that an
    answer's first tokens follow the assistant header)."""
    from specserve.train.data import DataError
    from specserve.train.store import DistillStore, record_prompt

    store = DistillStore(path)
    try:
        if store.settings() is None:
            raise DatastoreError(f"ngram_datastore: {path}: not a distillation store (no store.json)")
        recs = store.records()
    except DataError as e:
        raise DatastoreError(f"ngram_datastore: {e}") from None
    return [np.concatenate([record_prompt(key)[-PROMPT_TAIL:], resp])
            for key, resp in recs.items() if record_digest(key) not in exclude]


def shipped_datastore(fingerprint: str) -> Path | None:
    """The datastore description shipped for the target with this ``train.store.target_fingerprint``
    (``DATASTORE_DIR``), or None."""
    for f in sorted(DATASTORE_DIR.glob("*.json")):
        if json.loads(f.read_text()).get("target_fingerprint") == fingerprint:
            return f
    return None


_OPEN: dict[tuple, NgramDatastore] = {}  # (path, its mtime) -> the datastore: engines of a process share it


def open_datastore(value: str | None, model_dir, vocab_size: int) -> NgramDatastore | None:
    """The datastore an ``ngram_datastore`` value names for the target at ``model_dir``: None for None,
    ``"auto"``: the one shipped for this target (None if there is none), else the path of a store
    directory or datastore description. Its token ids must be the target's (below ``vocab_size``)."""
    if value is None:
        return None
    if value == "auto":
        from specserve.train.store import target_fingerprint

        path = shipped_datastore(target_fingerprint(model_dir))
        if path is None:
            return None
    else:
        path = Path(value).expanduser().resolve()
    stamp = (str(path), path.stat().st_mtime if path.exists() else None)
    if stamp not in _OPEN:
        _OPEN[stamp] = NgramDatastore.load(path)
    ds = _OPEN[stamp]
    if ds.max_id >= vocab_size:
        raise DatastoreError(f"ngram_datastore: {path}: token id {ds.max_id} is outside the target's vocabulary "
                             f"of {vocab_size}: a datastore of another tokenizer")
    return ds
