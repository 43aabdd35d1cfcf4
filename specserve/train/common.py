"""Pieces shared by the drafter trainers (``specserve.train.medusa`` and ``specserve.train.dspark``).

- ``select_prompts``: the training and held-out prompts (chitchat or a prompts file), with the same
  split, seed and truncation for both trainers, so both see the same prompts.
- ``distill_splits``: the target answers both prompt sets (``self_distill``, cached; the held-out set
  with a fixed seed offset, so the cached generations are shared between trainers).
- ``float32_runner``: a float32 ``ModelRunner`` of the target for feature extraction (the
  generation engine's own when it already runs in float32).
- ``select_draft_vocab``: a draft vocabulary (the most frequent response tokens) for drafters whose
  logits cover only part of the target's vocabulary.
"""

from __future__ import annotations

import random

import torch

from specserve.train.data import DataError, load_prompts, read_prompts_file, self_distill, split_prompts

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


def select_draft_vocab(samples: list[dict], vocab_size: int, size: int) -> torch.Tensor:
    """The ``size`` most frequent tokens of the responses (ties and unseen tokens: lowest id first),
    as target ids in increasing order [size] long: the draft vocabulary (``t2d``'s true rows)."""
    if not 0 < size <= vocab_size:
        raise ValueError(f"draft vocabulary size {size} must be in 1..{vocab_size}")
    counts = torch.zeros(vocab_size, dtype=torch.float64)
    for s in samples:
        resp = torch.as_tensor(s["ids"][s["prompt_len"]:], dtype=torch.long)
        counts.index_add_(0, resp, torch.ones(resp.numel(), dtype=torch.float64))
    score = counts - torch.arange(vocab_size, dtype=torch.float64) / (2.0 * vocab_size)  # ties: lower id
    return score.topk(size).indices.sort().values
