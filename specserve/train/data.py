"""Training data for draft models: prompts, and the target's own responses to them (self-distillation).

Prompts
-------
``load_prompts`` reads the ``chitchat-dataset`` package (7,168 open-domain chat conversations,
``chitchat_dataset/dataset.json``: ``{conversation_id: {"messages": [turn, ...], "prompt": topic, ...}}``,
where a turn is a list of consecutive utterances ``{"sender", "text", "timestamp"}`` by one speaker).

One prompt per conversation, a single user message: the **first substantive turn**, i.e. the first of
the conversation's first ``SEARCH_TURNS`` turns whose utterances, joined with spaces, have at least
``MIN_WORDS`` words. Most conversations open with "Hello?" / "Hi!", which would make hundreds of
identical, uninformative prompts; the first substantive turn is varied, conversational text. When no
early turn is long enough the conversation's topic question (``"prompt"``) is used, else its longest
early turn. The chat template of the target is applied later, by ``self_distill``.

Held-out split: a conversation is held out when ``sha256(conversation_id)`` falls in the first
``HELDOUT_FRACTION`` (10%) of the hash range. Many conversations open with the same question ("What if
unicorns were real?"), so a held-out conversation whose prompt text is also the prompt of a training
conversation is dropped from the held-out split: a held-out prompt is never a training prompt, not even
word for word (greedy self-distillation would make it the very same training sequence). The split depends
on nothing else (not on ``seed`` or ``n``), so training never sees a benchmark prompt. ``seed`` only
orders each split before the first ``n`` are taken.

``read_prompts_file`` reads a user's file instead: JSONL with a "prompt" field per line, or plain text
with one prompt per line; ``split_prompts`` splits such a list with the same hash rule (on the text).

Self-distillation
-----------------
``self_distill(llm, prompts, max_tokens, temperature, batch_size)`` lets the target write the responses
(through its chat template) and returns ``[{"prompt", "ids", "prompt_len"}]`` with ``ids`` = prompt ids +
response ids. Results are cached (``torch.save``) under a key of every argument that changes them, in
chunks of ``CACHE_CHUNK`` prompts (``cached_chunks``), so a rerun skips generation and a run with more
prompts of the same source generates only the ones past those already cached.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

import torch

from specserve.config import SamplingParams, cache_root
from specserve.models.loader import package_file

HELDOUT_FRACTION = 0.10
MIN_WORDS = 6
SEARCH_TURNS = 6
DATASET_PACKAGE = "chitchat_dataset"


class DataError(ValueError):
    """A problem with the training data (reported by the CLI as ``error: ...``)."""


# ---- split ------------------------------------------------------------------------------------------
def _hash_unit(key: str) -> float:
    """A deterministic number in [0, 1) from ``key`` (the same on every machine and Python run)."""
    return int(hashlib.sha256(key.encode("utf-8")).hexdigest()[:15], 16) / 16**15


def is_heldout(key: str, fraction: float = HELDOUT_FRACTION) -> bool:
    return _hash_unit(key) < fraction


# ---- chitchat ---------------------------------------------------------------------------------------
def chitchat_path() -> Path:
    return package_file(DATASET_PACKAGE, "dataset.json", "the chitchat dataset", "pip install chitchat-dataset==0.9.0",
                        "or pass --prompts FILE", DataError)


_CONVERSATIONS: dict | None = None


def load_conversations() -> dict:
    """``{conversation_id: conversation}`` from the chitchat package (parsed once per process)."""
    global _CONVERSATIONS
    if _CONVERSATIONS is None:
        _CONVERSATIONS = json.loads(chitchat_path().read_text(encoding="utf-8"))
    return _CONVERSATIONS


def _turn_text(turn) -> str:
    return " ".join(" ".join(str(u.get("text", "")).split()) for u in turn if isinstance(u, dict)).strip()


def conversation_prompt(conv: dict) -> str | None:
    """The user message made from one conversation (see the module docstring); None if it has no text."""
    turns = [t for t in (_turn_text(turn) for turn in (conv.get("messages") or [])[:SEARCH_TURNS]) if t]
    for t in turns:
        if len(t.split()) >= MIN_WORDS:
            return t
    topic = (conv.get("prompt") or "").strip()
    if topic:
        return topic
    return max(turns, key=lambda t: len(t.split())) if turns else None


def split_records(recs: Sequence[tuple[str, str]], split: str, n: int | None = None, seed: int = 0,
                  unique: bool = False) -> list[tuple[str, str]]:
    """``[(key, prompt)]`` of one split of ``recs``: held out when the key hashes into the first
    ``HELDOUT_FRACTION`` (``is_heldout``), a held-out prompt dropped when its text is also a training
    prompt's (never trained on, not even word for word); ``unique``: the first record of each text
    only; ordered by ``seed``, the first ``n`` (all if None)."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    want_heldout = split == "heldout"
    train_texts = {p for key, p in recs if not is_heldout(key)}
    out = [(key, p) for key, p in recs
           if is_heldout(key) == want_heldout and not (want_heldout and p in train_texts)]
    if unique:
        first = {}
        for key, p in out:
            first.setdefault(p, (key, p))
        out = list(first.values())
    random.Random(seed).shuffle(out)
    return out if n is None else out[:n]


def load_prompt_records(split: str = "train", n: int | None = None, seed: int = 0) -> list[tuple[str, str]]:
    """``[(conversation_id, prompt)]`` of one split, ordered by ``seed``, the first ``n`` (all if None)."""
    convs = load_conversations()
    recs = [(cid, p) for cid, p in ((cid, conversation_prompt(convs[cid])) for cid in sorted(convs)) if p]
    return split_records(recs, split, n, seed)


def load_prompts(split: str = "train", n: int | None = None, seed: int = 0) -> list[str]:
    """Chat prompts (user messages) from chitchat: ``split`` "train" (~90%) or "heldout" (~10%)."""
    return [p for _, p in load_prompt_records(split, n, seed)]


# ---- a user's prompts file --------------------------------------------------------------------------
def read_prompts_file(path: str | os.PathLike) -> list[str]:
    """JSONL (one object with a string "prompt" per line) or plain text (one prompt per line)."""
    p = Path(path)
    if not p.is_file():
        raise DataError(f"prompts file does not exist: {p}")
    lines = [(i, ln.strip()) for i, ln in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if ln.strip()]
    if not lines:
        raise DataError(f"prompts file {p} has no prompts")
    if not (p.suffix == ".jsonl" or lines[0][1].startswith("{")):
        return [ln for _, ln in lines]
    out = []
    for i, ln in lines:
        try:
            obj = json.loads(ln)
        except json.JSONDecodeError as e:
            raise DataError(f"{p}:{i}: not valid JSON ({e.msg})") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str) or not obj["prompt"].strip():
            raise DataError(f"{p}:{i}: each line needs a non-empty string field \"prompt\"")
        out.append(obj["prompt"])
    return out


def split_prompts(prompts: Sequence[str], fraction: float = HELDOUT_FRACTION) -> tuple[list[str], list[str]]:
    """(train, heldout) by the hash of each prompt's text. With two or more distinct prompts both
    parts are non-empty: if the hash rule leaves one empty, the prompt with the smallest hash is
    held out (or, if all are held out, the one with the largest hash goes to training)."""
    uniq = list(dict.fromkeys(prompts))
    train = [p for p in uniq if not is_heldout(p, fraction)]
    held = [p for p in uniq if is_heldout(p, fraction)]
    if len(uniq) >= 2 and not held:
        first = min(uniq, key=_hash_unit)
        held, train = [first], [p for p in uniq if p != first]
    elif len(uniq) >= 2 and not train:
        last = max(uniq, key=_hash_unit)
        train, held = [last], [p for p in uniq if p != last]
    return train, held


# ---- self-distillation ------------------------------------------------------------------------------
def default_cache_dir() -> Path:
    return cache_root() / "train"


def _model_fingerprint(model_dir: Path) -> str:
    h = hashlib.sha256(str(Path(model_dir).resolve()).encode())
    for name in ("config.json", "tokenizer.json"):
        f = Path(model_dir) / name
        if f.exists():
            h.update(f.read_bytes())
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{int(st.st_mtime)}".encode())
    return h.hexdigest()[:16]


def prompt_token_ids(tokenizer, prompt, chat: bool = True) -> list[int]:
    """A prompt (a user message string, or a list of chat messages) as token ids."""
    if isinstance(prompt, list):
        return tokenizer.apply_chat_template(prompt, True)
    if chat and tokenizer.chat_template:
        return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], True)
    return tokenizer.encode(prompt)


def self_distill(llm, prompts: Sequence, max_tokens: int, temperature: float = 0.0, batch_size: int = 16,
                 seed: int = 0, chat: bool = True, cache_dir: str | os.PathLike | None = None,
                 log=None, cache_chunk: int | None = None, store=None) -> list[dict]:
    """The target writes its own responses to ``prompts``: ``[{"prompt", "ids", "prompt_len"}]``, where
    ``ids`` = prompt ids + response ids (EOS kept when generated). Generation runs through
    ``llm.generate`` with up to ``batch_size`` requests running at once (continuous batching).
    ``temperature`` 0 is greedy; otherwise request i is seeded with ``seed + i``. The result is cached
    in ``cache_dir`` (default ``~/.cache/specserve/train``) under a key of the model, prompts and every
    argument, in chunks of ``cache_chunk`` (default ``CACHE_CHUNK``) prompts (``cached_chunks``); pass
    ``cache_dir=False`` to disable the cache; with ``store`` (a ``train.store.DistillStore``) the responses
    come from that store instead, and the missing ones are generated into it. A prompt that leaves no
    room for ``max_tokens`` within the model's ``max_model_len`` is skipped (and counted in the log)
    rather than stopping the run."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    engine = llm.engine
    ids = [prompt_token_ids(llm.tokenizer, p, chat) for p in prompts]
    limit = engine.max_model_len - max_tokens
    n_long = sum(len(x) > limit for x in ids)
    if n_long:
        (log or print)(f"self-distillation: skipping {n_long} of {len(ids)} prompts longer than "
                       f"{limit} tokens (max_model_len {engine.max_model_len} - max_tokens {max_tokens}; "
                       f"the longest has {max(len(x) for x in ids)})")
    if store is not None:
        keep = [i for i, x in enumerate(ids) if len(x) <= limit]
        return store.distill(llm, [prompts[i] for i in keep], [ids[i] for i in keep], max_tokens=max_tokens,
                             temperature=temperature, batch_size=batch_size, seed=seed, chat=chat, log=log)
    dtype = str(getattr(engine.runner, "dtype", "?")).removeprefix("torch.")
    base = {"v": 2, "model": _model_fingerprint(engine.model_dir), "dtype": dtype, "max_tokens": max_tokens,
            "temperature": float(temperature)}
    if getattr(engine.runner, "quantization", None):  # quantized generation (dense keys stay as they were)
        base["quantization"] = engine.runner.quantization

    # chunks are cut from the prompt list before the skip, so that a longer list of prompts still begins
    # with the same cache entries; a skipped prompt just leaves its chunk one shorter
    def fits(start, part):
        return [i for i, x in enumerate(part, start) if len(x) <= limit]

    def key(start, part):  # greedy responses do not depend on the seed
        return {**base, "ids": [x for x in part if len(x) <= limit], "seed": seed + start if temperature > 0 else None}

    def compute(start, part):
        keep = fits(start, part)
        return generate_responses(llm, [prompts[i] for i in keep], [ids[i] for i in keep], max_tokens,
                                  temperature, batch_size, [seed + start + j for j in range(len(keep))], log)

    chunks = cached_chunks(cache_dir, "distill", ids, key, compute, log, "self-distillation",
                           cache_chunk or CACHE_CHUNK)
    return [x for c in chunks for x in c]


def generate_responses(llm, prompts, ids, max_tokens, temperature, batch_size, seeds, log) -> list[dict]:
    """The responses, in prompt order. The engine runs its batch with one key length for all rows (the
    longest row's), so one long prompt slows every row beside it: the prompts go through shortest first,
    and a long one meets its peers. Request i keeps seed ``seeds[i]`` (when sampled) whatever the order."""
    out: list = [None] * len(ids)
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    t0, done, n_tok = time.perf_counter(), 0, 0
    per_call = 8 * batch_size  # the engine keeps batch_size running (max_num_seqs); a log line per call
    for b in range(0, len(order), per_call):
        chunk = order[b : b + per_call]
        params = [SamplingParams(temperature=temperature, max_tokens=max_tokens,
                                 seed=seeds[i] if temperature > 0 else None) for i in chunk]
        res = llm.generate([{"prompt_token_ids": ids[i]} for i in chunk], params, use_tqdm=False)
        for i, r in zip(chunk, res):
            out[i] = distilled_sample(prompts[i], ids[i], r.outputs[0].token_ids)
            n_tok += len(r.outputs[0].token_ids)
        done += len(chunk)
        if log:
            dt = time.perf_counter() - t0
            log(f"self-distillation: {done}/{len(ids)} prompts, {n_tok} tokens, {dt:.0f} s "
                f"({n_tok / max(dt, 1e-9):.0f} tok/s)")
    return out


def distilled_sample(prompt, prompt_ids, response_ids) -> dict:
    """One self-distilled sequence as the trainers take it: ``{"prompt", "ids", "prompt_len"}``."""
    return {"prompt": prompt if isinstance(prompt, str) else json.dumps(prompt),
            "ids": list(prompt_ids) + list(response_ids), "prompt_len": len(prompt_ids)}


def cache_key(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:20]


def save_atomic(obj, path: Path) -> None:
    """``torch.save`` to a temporary file beside ``path``, then renamed over it: a reader (or a later
    run, after a crash) sees the whole old file or the whole new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    torch.save(obj, tmp)
    tmp.replace(path)


def cached_torch(cache_dir, prefix: str, key_obj, compute: Callable[[], object], log=None, what: str = "data",
                 mmap: bool = False):
    """``compute()`` through a ``torch.save`` file ``{cache_dir}/{prefix}-{key}.pt`` (``cache_dir``
    None: the default cache, False: no cache). A corrupt file is recomputed. ``mmap``: the tensors are
    mapped from the file, read-only, not held in the process's memory (a freshly computed result is
    saved, then mapped too): the training features of thousands of prompts outgrow the RAM of a small
    machine, while the page cache keeps what fits."""
    f = None
    if cache_dir is not False:
        f = Path(cache_dir or default_cache_dir()) / f"{prefix}-{cache_key(key_obj)}.pt"
        if f.exists():
            try:
                data = torch.load(f, weights_only=True, mmap=mmap)
                if log:
                    log(f"{what}: cached, from {f}")
                return data
            except Exception:  # noqa: BLE001 - a partial / corrupt file: recompute
                pass
    data = compute()
    if f is not None:
        save_atomic(data, f)
        if mmap:
            del data
            data = torch.load(f, weights_only=True, mmap=True)
    return data


CACHE_CHUNK = 400  # items (prompts, sequences) per cache entry of ``cached_chunks``


def cached_chunks(cache_dir, prefix: str, items: list, key: Callable[[int, list], object],
                  compute: Callable[[int, list], object], log=None, what: str = "data",
                  chunk: int = CACHE_CHUNK, mmap: bool = False) -> list:
    """``compute(start, items[start:start + chunk])`` for each consecutive chunk of ``items``, each
    through its own ``cached_torch`` entry keyed by ``key(start, chunk items)``: the list of the chunks'
    results. A longer list that begins with the items of an earlier call reuses that call's entries
    (its first chunks are the same), so adding prompts to a source computes only the new ones."""
    out = []
    for start in range(0, len(items), chunk):
        part = items[start : start + chunk]
        out.append(cached_torch(cache_dir, prefix, key(start, part), lambda s=start, p=part: compute(s, p), log,
                                f"{what} (items {start}..{start + len(part) - 1})", mmap))
    return out


def stderr_log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
