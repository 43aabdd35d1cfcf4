"""Self-distilled responses kept in the repository: the target's own answers as token ids, compressed,
so that no training run has to generate them again (the target's hidden states are recomputed from
the ids; they are never stored).

A store is a directory (the shipped ones under ``specserve/train/distilled/``):

* ``store.json``: ``settings``, what wrote every response in it (the target's ``target_fingerprint``,
  its dtype and quantization, ``max_tokens``, ``temperature``, whether the chat template was applied),
  and a free-text ``note``;
* ``part-NNNN.npz`` (``numpy.savez_compressed``): records appended as generation goes, each part
  holding ``ids`` (the records' prompt + response ids, concatenated; uint16 when the vocabulary fits),
  ``lens`` and ``prompt_lens`` (per record) and ``seeds`` (the sampling seed, -1 for greedy responses).

A record is found by its prompt ids (and its seed when the responses are sampled), so any selection of
prompts, in any order or number, takes what the store holds. ``DistillStore.distill`` answers a list
of prompts from the store and generates the missing ones ``part_size`` at a time, each part written
(atomically) before the next begins: a stopped run loses at most the part it was writing, and the same
command continues where it stopped. A store made with other settings is refused with the first field
that differs.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import zipfile
from pathlib import Path
from typing import Sequence

import numpy as np

from specserve.models.loader import gguf_source
from specserve.train.data import DataError, distilled_sample, generate_responses

STORE_FILE = "store.json"
PART_SIZE = 400  # prompts generated (and saved) per part


def target_fingerprint(model_dir) -> str:
    """The target's identity, the same on every machine: its config, tokenizer and weight files' names
    and sizes (a GGUF's: the file's), not where they lie."""
    model_dir = Path(model_dir)
    h = hashlib.sha256()
    for name in ("config.json", "tokenizer.json"):
        f = model_dir / name
        if f.exists():
            h.update(name.encode() + f.read_bytes())
    src = gguf_source(model_dir)
    weights = [src] if src is not None else sorted(model_dir.glob("*.safetensors"))
    for f in weights:
        h.update(f"{f.name}:{f.stat().st_size}".encode())
    return h.hexdigest()[:16]


def run_settings(llm, max_tokens: int, temperature: float, chat: bool) -> dict:
    """What a store's responses depend on, for the target loaded in ``llm``."""
    runner = llm.engine.runner
    return {"target_fingerprint": target_fingerprint(llm.engine.model_dir),
            "dtype": str(runner.dtype).removeprefix("torch."), "quantization": runner.quantization or "none",
            "max_tokens": int(max_tokens), "temperature": float(temperature), "chat": bool(chat)}


def _key(prompt_ids: Sequence[int], seed: int) -> bytes:
    return np.asarray(prompt_ids, dtype=np.int64).tobytes() + seed.to_bytes(8, "little", signed=True)


def record_prompt(key: bytes) -> np.ndarray:
    """The prompt ids of a record's key (``_key``'s first part)."""
    return np.frombuffer(key[:-8], dtype=np.int64)


class DistillStore:
    """One store directory (``path``); created on the first ``distill`` that writes to it."""

    def __init__(self, path, note: str = ""):
        self.path = Path(path)
        self.note = note
        self._records: dict[bytes, np.ndarray] | None = None

    # ---- reading ------------------------------------------------------------------------------------
    def settings(self) -> dict | None:
        f = self.path / STORE_FILE
        if not f.exists():
            return None
        try:
            return json.loads(f.read_text())["settings"]
        except (ValueError, KeyError, TypeError) as e:
            raise DataError(f"{f}: not a store description ({type(e).__name__}: {e})") from None

    def parts(self) -> list[Path]:
        return sorted(self.path.glob("part-*.npz"))

    def records(self) -> dict[bytes, np.ndarray]:
        """(prompt ids, seed) key -> response ids, of every part."""
        if self._records is None:
            self._records = {}
            for f in self.parts():
                for key, resp in _read_part(f):
                    self._records[key] = resp
        return self._records

    def __len__(self) -> int:
        return len(self.records())

    def check(self, settings: dict) -> None:
        """Refuse a store whose responses were written with other ``settings`` (naming the field)."""
        have = self.settings()
        if have is None:
            return
        for k, v in settings.items():
            if have.get(k) != v:
                raise DataError(f"{self.path}: its responses were made with {k}={have.get(k)!r}, this run has "
                                f"{k}={v!r}; use another store directory or the settings it was made with")

    # ---- the responses ------------------------------------------------------------------------------
    def distill(self, llm, prompts: Sequence, ids: list[list[int]], *, max_tokens: int, temperature: float,
                batch_size: int, seed: int, chat: bool, log=None, part_size: int = PART_SIZE) -> list[dict]:
        """``[{"prompt", "ids", "prompt_len"}]`` for ``prompts`` (token ids ``ids``), as ``self_distill``
        returns them: from the store where it holds them, else generated (request i seeded with
        ``seed + i`` when sampled) and saved into a new part every ``part_size`` prompts."""
        settings = run_settings(llm, max_tokens, temperature, chat)
        self.check(settings)
        seeds = [seed + i if temperature > 0 else -1 for i in range(len(ids))]
        recs = self.records()
        missing = [i for i in range(len(ids)) if _key(ids[i], seeds[i]) not in recs]
        if log:
            log(f"self-distillation: {len(ids) - len(missing)} of {len(ids)} responses in the store {self.path}, "
                f"{len(missing)} to generate")
        for start in range(0, len(missing), part_size):
            todo = missing[start : start + part_size]
            out = generate_responses(llm, [prompts[i] for i in todo], [ids[i] for i in todo], max_tokens,
                                     temperature, batch_size, [seeds[i] for i in todo], log)
            self._append(settings, [(ids[i], seeds[i], o["ids"][o["prompt_len"]:]) for i, o in zip(todo, out)])
        return [distilled_sample(p, x, recs[_key(x, s)].tolist()) for p, x, s in zip(prompts, ids, seeds)]

    def _append(self, settings: dict, rows: list[tuple[list[int], int, list[int]]]) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        f = self.path / STORE_FILE
        if not f.exists():
            _write_atomic(f, (json.dumps({"settings": settings, "note": self.note}, indent=1) + "\n").encode())
        n = len(self.parts())
        _write_atomic(self.path / f"part-{n:04d}.npz", _pack_part(rows))
        recs = self.records()
        for prompt, s, resp in rows:
            recs[_key(prompt, s)] = np.asarray(resp, dtype=np.int64)


def _pack_part(rows) -> bytes:
    seqs = [list(p) + list(r) for p, _, r in rows]
    flat = np.fromiter((t for s in seqs for t in s), dtype=np.int64)
    dtype = np.uint16 if flat.size == 0 or flat.max() < 2**16 else np.int32
    buf = io.BytesIO()
    np.savez_compressed(buf, ids=flat.astype(dtype), lens=np.asarray([len(s) for s in seqs], dtype=np.int32),
                        prompt_lens=np.asarray([len(p) for p, _, _ in rows], dtype=np.int32),
                        seeds=np.asarray([s for _, s, _ in rows], dtype=np.int64))
    return buf.getvalue()


def _read_part(f: Path):
    try:
        with np.load(f) as z:
            ids, lens, plens, seeds = z["ids"].astype(np.int64), z["lens"], z["prompt_lens"], z["seeds"]
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as e:
        raise DataError(f"{f}: not a store part ({type(e).__name__}: {e})") from None
    if lens.sum() != ids.size or len(plens) != len(lens) or len(seeds) != len(lens):
        raise DataError(f"{f}: its record lengths do not add up to its {ids.size} ids")
    pos = 0
    for n, p, s in zip(lens.tolist(), plens.tolist(), seeds.tolist()):
        seq = ids[pos : pos + n]
        pos += n
        yield _key(seq[:p], int(s)), seq[p:]


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_bytes(data)
    tmp.replace(path)
