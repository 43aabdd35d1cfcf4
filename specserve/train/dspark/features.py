"""The drafter's inputs from the frozen target: which of its layers feed the drafter, their outputs
and final hidden states over every training sequence (computed once, cached on disk), and the
log-sum-exp of its logits that a pruned draft vocabulary's loss needs."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from specserve.train.common import fingerprint, target_forwards
from specserve.train.data import _model_fingerprint, cached_chunks, cached_torch

DEFAULT_NUM_TARGET_LAYERS = 5


def default_target_layer_ids(num_layers: int, count: int = DEFAULT_NUM_TARGET_LAYERS) -> list[int]:
    """``count`` layer ids evenly spaced between 1 and L-3 (z-lab's rule), or, when the target is too
    shallow for that, between 0 and L-2; never the last layer. L=2 -> [0]; L=36, 5 -> [1,9,17,25,33]."""
    if num_layers < 2:
        raise ValueError(f"the target needs at least 2 layers (the last one cannot feed the drafter), "
                         f"got {num_layers}")
    lo, hi = 1, num_layers - 3
    if hi < lo:
        lo, hi = 0, num_layers - 2
    count = max(1, min(count, hi - lo + 1))
    if count == 1:
        return [(lo + hi) // 2]
    return sorted({int(round(lo + i * (hi - lo) / (count - 1))) for i in range(count)})


def parse_layer_ids(spec) -> list[int]:
    """"1,9,17" or [1, 9, 17] -> sorted unique ids (the target emits its layer outputs in layer order,
    which is the order the drafter's ``fc`` reads them in)."""
    if isinstance(spec, str):
        try:
            ids = [int(x) for x in spec.replace(" ", "").split(",") if x]
        except ValueError:
            raise ValueError(f"target_layer_ids must be 'auto' or a comma-separated list of integers, "
                             f"got {spec!r}") from None
    else:
        ids = [int(x) for x in spec]
    if not ids:
        raise ValueError("target_layer_ids is empty")
    return sorted(set(ids))


def resolve_layer_ids(spec, num_layers: int, count: int = DEFAULT_NUM_TARGET_LAYERS) -> list[int]:
    if isinstance(spec, str) and spec.strip().lower() == "auto":
        return default_target_layer_ids(num_layers, count)
    ids = parse_layer_ids(spec)
    bad = [i for i in ids if not 0 <= i < num_layers - 1]
    if bad:
        raise ValueError(f"target_layer_ids {ids}: {bad} not in [0, {num_layers - 2}] (the target has {num_layers} "
                         "layers and its last one is forbidden)")
    return ids


@torch.inference_mode()
def compute_target_features(model, samples: list[dict], layer_ids, max_batch_tokens: int = 4096,
                            progress: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per sequence: (outputs of ``layer_ids`` concatenated [T, m*d] bfloat16, final normed hidden
    [T, d] float32), from one cache-free causal forward per batch of right-padded sequences."""
    layers = tuple(sorted(layer_ids))
    out: list = [None] * len(samples)
    for batch, hidden, aux in target_forwards(model, samples, layers, max_batch_tokens, progress, "target features"):
        if len(aux) != len(layers):
            raise RuntimeError(f"the target returned {len(aux)} layer outputs for layers {list(layers)}")
        feats = torch.cat(aux, dim=-1)
        for r, b in enumerate(batch):
            n = len(samples[b]["ids"])
            out[b] = (feats[r, :n].to(torch.bfloat16).cpu().clone(), hidden[r, :n].float().cpu().clone())
    return out


def cached_target_features(model, model_dir, samples, layer_ids, cache_dir, log=None, progress=False,
                           key: dict | None = None):
    """``compute_target_features`` through a disk cache keyed by the model, sequences and layers, in
    chunks of sequences (``cached_chunks``); ``key``: more the features depend on (``feature_key``)."""
    base = {"v": 2, "kind": "dspark-features", "model": _model_fingerprint(Path(model_dir)),
            "layers": sorted(layer_ids), **(key or {})}
    dtype = next(model.parameters()).dtype
    if dtype != torch.float32:  # float32 keeps the key it always had
        base["dtype"] = str(dtype).removeprefix("torch.")

    def compute(start, part):
        fs = compute_target_features(model, samples[start : start + len(part)], layer_ids, progress=progress)
        return {"aux": torch.cat([a for a, _ in fs]) if fs else torch.zeros(0),
                "final": torch.cat([h for _, h in fs]) if fs else torch.zeros(0),
                "lengths": [len(h) for _, h in fs]}

    chunks = cached_chunks(cache_dir, "dspark-features", [s["ids"] for s in samples],
                           lambda start, part: {**base, "ids": part}, compute, log, "target features", mmap=True)
    return [x for d in chunks for x in zip(torch.split(d["aux"], d["lengths"]), torch.split(d["final"], d["lengths"]))]


def target_lse(lm_w: torch.Tensor, lm_b: torch.Tensor | None, feats: list, samples: list[dict],
               chunk: int = 2048, dtype: torch.dtype = torch.float32, cache: tuple | None = None,
               log=None, device: str = "cpu") -> list[torch.Tensor]:
    """log-sum-exp over the whole target vocabulary of the target's logits at the response positions of
    every sequence ([T] per sequence, 0 before ``prompt_len``; from its final hidden states): with it,
    a pruned draft vocabulary's target probabilities need only the draft rows of the lm_head. The
    positions of all sequences go through the lm_head in blocks of exactly ``chunk`` rows (the last one
    padded): per-sequence logits of thousands of different sizes, freed between small tensors that stay,
    fragmented the heap past 24 GB in a 2400-sequence run; one block size is allocated and released whole.
    ``dtype``: of the lm_head product (bfloat16 for mixed-precision training, whose draft logits are
    bfloat16 products too); the log-sum-exp itself is float32. ``cache``: (cache_dir, key) where ``key``
    names the target and its features (the result is cached under it with the sequences and ``dtype``): on
    a million positions the product takes minutes, every run that reads the same features again.
    ``device``: where the product runs (the result is on the CPU either way)."""
    spans = []
    for (_, fin), smp in zip(feats, samples):
        lo = min(int(smp["prompt_len"]), fin.shape[0])
        spans.append((lo, fin.shape[0]))

    def compute():
        rows = torch.cat([fin[lo:hi].float() for (_, fin), (lo, hi) in zip(feats, spans)]) if feats else torch.zeros(0)
        flat = torch.zeros(rows.shape[0])
        w, b = lm_w.to(device, dtype), (None if lm_b is None else lm_b.to(device, dtype))
        with torch.no_grad():
            for a in range(0, rows.shape[0], chunk):
                x = rows[a : a + chunk].to(device, dtype)
                n = x.shape[0]
                if n < chunk:
                    x = torch.cat([x, x.new_zeros(chunk - n, x.shape[1])])
                flat[a : a + n] = torch.logsumexp(F.linear(x, w, b).float(), dim=-1)[:n].cpu()
        return flat

    if cache is None:
        flat = compute()
    else:
        key = {"v": 1, "kind": "dspark-lse", "of": cache[1], "dtype": str(dtype), "chunk": chunk,
               "sequences": fingerprint([[torch.tensor(s["ids"], dtype=torch.int32) for s in samples],
                                         [s["prompt_len"] for s in samples]])}
        flat = cached_torch(cache[0], "dspark-lse", key, compute, log, "target log-sum-exp")
    out, i = [], 0
    for (_, fin), (lo, hi) in zip(feats, spans):
        lse = torch.zeros(fin.shape[0])
        lse[lo:hi] = flat[i : i + hi - lo]
        i += hi - lo
        out.append(lse)
    return out
