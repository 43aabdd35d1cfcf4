"""Pieces shared by the drafter trainers (``specserve.train.dspark``; the same rules as
``specserve.train.medusa``, which keeps its own inline copy of the prompt selection).

- ``select_prompts``: the training and held-out prompts (chitchat or a prompts file), with exactly
  the Medusa trainer's split, seed and truncation, so both trainers see the same prompts.
- ``distill_splits``: the target answers both prompt sets (``self_distill``, cached; the held-out set
  with the Medusa trainer's seed offset, so the cached generations are shared between trainers).
- ``float32_runner``: a float32 ``ModelRunner`` of the target for feature extraction (the
  generation engine's own when it already runs in float32).
- ``cached_torch``: a ``torch.save`` disk cache keyed by a JSON-able key.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from pathlib import Path
from typing import Callable

import torch

from specserve.train.data import (DataError, default_cache_dir, load_prompts, read_prompts_file, self_distill,
                                  split_prompts)

HELDOUT_SEED_OFFSET = 1_000_003  # the held-out responses' seed (as in specserve.train.medusa)
CHITCHAT_DESC = "chitchat-dataset 0.9.0 (first substantive turn of each conversation as the user message)"


def select_prompts(prompts_file: str | None, num_prompts: int, num_eval_prompts: int, seed: int
                   ) -> tuple[list[str], list[str], str]:
    """(training prompts, held-out prompts, description of the data). A prompts file is split by
    the hash of each prompt (``split_prompts``), the training part shuffled with ``seed``; chitchat
    uses its conversation-id split. Raises ``DataError`` unless both parts are non-empty."""
    if prompts_file:
        train_p, held_p = split_prompts(read_prompts_file(prompts_file))
        random.Random(seed).shuffle(train_p)
        train_p, held_p = train_p[:num_prompts], held_p[:num_eval_prompts]
        desc = f"prompts file {prompts_file}"
    else:
        train_p = load_prompts("train", num_prompts, seed)
        held_p = load_prompts("heldout", num_eval_prompts, seed)
        desc = CHITCHAT_DESC
    if not train_p or not held_p:
        raise DataError(f"need at least one training and one held-out prompt, got {len(train_p)} and {len(held_p)}")
    return train_p, held_p, desc


def distill_splits(llm, train_p, held_p, *, max_tokens: int, temperature: float, batch_size: int, seed: int,
                   chat: bool, cache_dir, log=None) -> tuple[list[dict], list[dict]]:
    """The target's own responses to the training and held-out prompts (``self_distill``)."""
    kw = dict(max_tokens=max_tokens, temperature=temperature, batch_size=batch_size, seed=seed, chat=chat,
              cache_dir=cache_dir, log=log)
    train_s = self_distill(llm, train_p, **kw)
    held_s = self_distill(llm, held_p, **{**kw, "seed": seed + HELDOUT_SEED_OFFSET})
    return train_s, held_s


def float32_runner(llm, gen_dtype_arg: str):
    """(a float32 ``ModelRunner`` of the target, whether it is ``llm``'s own). When it is not,
    ``llm`` is shut down here; when it is, the caller shuts ``llm`` down after use."""
    from specserve.engine.model_runner import ModelRunner

    runner = llm.engine.runner
    kept = runner.dtype == torch.float32 and gen_dtype_arg in ("auto", "float32", "fp32")
    if kept:
        return runner, True
    model_dir = llm.engine.model_dir
    llm.shutdown()
    return ModelRunner(model_dir, dtype="float32", max_num_seqs=1), False


def cache_key(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:20]


def cached_torch(cache_dir, prefix: str, key_obj, compute: Callable[[], object], log=None, what: str = "data"):
    """``compute()`` through a ``torch.save`` file ``{cache_dir}/{prefix}-{key}.pt`` (``cache_dir``
    None: the default cache, False: no cache). A corrupt file is recomputed."""
    f = None
    if cache_dir is not False:
        f = Path(cache_dir or default_cache_dir()) / f"{prefix}-{cache_key(key_obj)}.pt"
        if f.exists():
            try:
                data = torch.load(f, weights_only=True)
                if log:
                    log(f"{what}: cached, from {f}")
                return data
            except Exception:  # noqa: BLE001 - a partial / corrupt file: recompute
                pass
    data = compute()
    if f is not None:
        f.parent.mkdir(parents=True, exist_ok=True)
        tmp = f.with_suffix(f".tmp{os.getpid()}")
        torch.save(data, tmp)
        tmp.replace(f)
    return data
