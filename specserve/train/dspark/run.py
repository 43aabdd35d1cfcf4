"""The whole ``specserve train dspark`` command: self-distil, compute the target features, build the
drafter (random, or loaded and grown), train it, evaluate and calibrate it on held-out prompts, save
it with its report; or (``eval_only``) re-evaluate a saved one."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

from specserve.spec_decode.dspark.formats import load_dspark_checkpoint
from specserve.spec_decode.dspark.model import DFlashDrafter
from specserve.train.common import (
    TrainState,
    by_source,
    feature_key,
    feature_runner,
    fingerprint,
    keep_num_threads,
    prompt_sources,
    round_to_bf16_,
    select_draft_vocab,
    start_run,
    target_embedding,
    target_lm_head,
)
from specserve.train.data import DataError, _model_fingerprint, stderr_log
from specserve.train.dspark.calibration import fit_sts
from specserve.train.dspark.checkpoint import checkpoint_config, save_checkpoint
from specserve.train.dspark.drafter import (
    draft_vocab_ids,
    drafter_config,
    grow_draft_vocab,
    grow_drafter_,
    growable_vocab,
    init_drafter_,
    set_draft_vocab_,
)
from specserve.train.dspark.evaluate import evaluate_drafter
from specserve.train.dspark.features import cached_target_features, resolve_layer_ids, target_lse
from specserve.train.dspark.loop import train_drafter
from specserve.train.dspark.options import DSparkTrainArgs
from specserve.train.dspark.report import heldout_meta, readme, summary, training_meta


def train_dspark(args: DSparkTrainArgs, command: str | None = None, log=stderr_log) -> dict:
    """Self-distil, compute target features, train, calibrate, evaluate on held-out prompts, save.
    Returns ``out``, ``timings`` (seconds per phase), ``heldout`` / ``heldout_init``
    (``evaluate_drafter`` summaries), ``sts``, ``train``, ``meta``, ``config`` (the DSparkConfig as a
    dict) and ``train_samples`` / ``heldout_samples``."""
    args.validate()
    with keep_num_threads():
        return _train_dspark(args, command, log)


@dataclass
class Job:
    """What the phases of a run hand on: the options, the data with its target features and the
    target's frozen lm_head and embedding (the target itself is released after the features)."""

    args: DSparkTrainArgs
    log: Callable[[str], None]
    t_start: float
    timings: dict
    cache_dir: Path
    model_fp: str
    data_desc: str
    gen_dtype: str
    tcfg: object
    layer_ids: list[int]
    mask_id: int
    saved: tuple | None  # eval_only / init_from: (config, state dict, config.json) of the drafter read
    grow_from: torch.Tensor | None  # init_from with draft_vocab_size: the loaded draft vocabulary, to grow
    train_s: list | None = None
    held_s: list | None = None
    held_sizes: list | None = None
    f_train: list | None = None
    f_held: list | None = None
    lm_w: torch.Tensor | None = None
    lm_b: torch.Tensor | None = None
    embed_w: torch.Tensor | None = None
    feature_key: dict | None = None  # ``feature_key``: {} for a dense target's features
    vocab_cover: float = 1.0

    @property
    def train_seed(self) -> int:
        return self.args.seed if self.args.train_seed is None else self.args.train_seed


def _train_dspark(args: DSparkTrainArgs, command: str | None, log) -> dict:
    job = _prepare(args, log)
    drafter, cfg = _drafter(job)
    if cfg.pruned_vocab:
        _draft_vocab(job, drafter, cfg)
    G = cfg.block_size
    loss_w = (args.ce_weight, args.tv_weight, args.conf_weight)
    ekw = dict(gamma=G, mask_token_id=job.mask_id, device=args.device, loss_decay=args.loss_decay, loss_w=loss_w,
               progress=args.progress,
               sources=(job.held_sizes, prompt_sources(args.prompts_file)))
    if args.eval_only:
        return _evaluate_saved(job, command, drafter, cfg, ekw)
    t = time.perf_counter()
    init_ev = evaluate_drafter(drafter, job.held_s, job.f_held, job.lm_w, job.lm_b, job.embed_w, **ekw)
    job.timings["eval_init_s"] = time.perf_counter() - t
    log(f"held-out at init: loss {init_ev['loss']:.4f}, tau estimate {init_ev['tau']:.3f}")
    tr = _train(job, drafter, cfg, loss_w)
    # -- evaluation (weights as saved) + STS
    t = time.perf_counter()
    round_to_bf16_(drafter)
    ev = evaluate_drafter(drafter, job.held_s, job.f_held, job.lm_w, job.lm_b, job.embed_w, **ekw)
    sts = fit_sts(ev["conf_logit"], ev["cstar"], ev["valid"])
    job.timings["eval_s"] = time.perf_counter() - t
    log(f"held-out: loss {ev['loss']:.4f}, acceptance estimate per slot "
        + " ".join(f"{x:.3f}" for x in ev["acceptance"]) + f", tau estimate {ev['tau']:.3f} "
        f"(greedy {ev['greedy_tau']:.3f}; greedy decoding replayed {ev['decode']['tau']:.3f}); STS temperatures "
        + " ".join(f"{x:.2f}" for x in sts["temperatures"]))
    return _save(job, command, drafter, cfg, tr, init_ev, ev, sts)


def _prepare(args: DSparkTrainArgs, log) -> Job:
    """Self-distillation and the target features (a float32 target unless ``feature_dtype`` says
    otherwise), once; the target's engine is shut down at the end."""
    run = start_run(args)
    llm = run.llm
    tcfg = llm.engine.runner.config
    try:
        saved, grow_from, layer_ids, mask_id = _starting_point(args, tcfg)
    except (ValueError, OSError):
        llm.shutdown()
        raise
    job = Job(args, log, run.t_start, run.timings, run.cache_dir, _model_fingerprint(run.model_dir), run.data_desc,
              run.gen_dtype, tcfg, layer_ids, mask_id, saved, grow_from)
    log(f"{run.describe(args)}; target layers {layer_ids}, mask token {mask_id}")
    t = run.t_distill
    job.train_s, job.held_s = run.distill(args, log)
    job.held_sizes = run.held_sizes
    job.timings["self_distill_s"] = time.perf_counter() - t

    t = time.perf_counter()
    runner, kept = feature_runner(llm, args.gen_dtype, args.feature_dtype, args.device)
    model, model_dir, job.feature_key = runner.model, run.model_dir, feature_key(runner)
    features = lambda s, model=model: cached_target_features(model, model_dir, s, layer_ids,  # noqa: E731
                                                             job.cache_dir, log, args.progress, job.feature_key)
    job.f_train = [] if args.eval_only else by_source(features, job.train_s, run.train_sizes)
    job.f_held = by_source(features, job.held_s, run.held_sizes)
    job.lm_w, job.lm_b = (x.cpu().clone() if x is not None else None for x in target_lm_head(runner))
    job.embed_w = target_embedding(runner).cpu()
    if kept:
        llm.shutdown()
    del llm, run, runner, model, features
    job.timings["features_s"] = time.perf_counter() - t
    n_resp = sum(len(s["ids"]) - s["prompt_len"] for s in job.train_s)
    log(f"{len(job.train_s)} training sequences ({n_resp} response tokens), {len(job.held_s)} held-out sequences")
    return job


def _starting_point(args: DSparkTrainArgs, tcfg):
    """(saved drafter or None, draft vocabulary to grow or None, target layer ids, mask token id): read
    from the drafter at ``out`` (eval_only) or ``init_from``, else from the options."""
    saved = grow_from = None
    if args.eval_only or args.init_from is not None:
        path = args.out if args.eval_only else args.init_from
        cfg_sd = load_dspark_checkpoint(path, tcfg)
        saved = (*cfg_sd, json.loads((Path(path) / "config.json").read_text(encoding="utf-8")))
        layer_ids, mask_id = list(saved[0].target_layer_ids), int(saved[0].mask_token_id)
        if args.init_from is not None and args.draft_vocab_size:  # checked before hours of data
            grow_from = growable_vocab(saved[0], saved[1], args.draft_vocab_size)
    else:
        layer_ids = resolve_layer_ids(args.target_layer_ids, tcfg.num_hidden_layers, args.num_target_layers)
        mask_id = tcfg.vocab_size - 1 if args.mask_token_id is None else int(args.mask_token_id)
    if not 0 <= mask_id < tcfg.vocab_size:
        raise ValueError(f"mask_token_id {mask_id} is outside the target's vocabulary [0, {tcfg.vocab_size})")
    return saved, grow_from, layer_ids, mask_id


def _drafter(job: Job):
    """The drafter to train or evaluate and its config: loaded (grown by layers or vocabulary as asked;
    frozen unless trained further) or new with random weights."""
    args, tcfg = job.args, job.tcfg
    if job.saved:
        cfg, sd = job.saved[0], job.saved[1]
        if job.grow_from is not None:  # the loaded vocabulary + this run's most frequent other response tokens
            new_ids = select_draft_vocab(job.train_s, tcfg.vocab_size, args.draft_vocab_size, keep=job.grow_from)
            cfg, sd = grow_draft_vocab(cfg, sd, new_ids, job.lm_w)
        if args.add_layers:
            cfg = dataclasses.replace(cfg, num_layers=cfg.num_layers + args.add_layers)
        drafter = DFlashDrafter(cfg, dtype=torch.float32)
        if args.add_layers:
            torch.manual_seed(job.train_seed)
            grow_drafter_(drafter, sd, job.saved[0].num_layers)
        else:
            drafter.load_state(sd)
        drafter.requires_grad_(args.init_from is not None)  # loaded weights are frozen until trained further
        return drafter, cfg
    cfg = drafter_config(tcfg, num_layers=args.num_layers, block_size=args.block_size, layer_ids=job.layer_ids,
                         mask_token_id=job.mask_id, markov_rank=args.markov_rank,
                         markov_head_type=args.markov_head_type, draft_vocab_size=args.draft_vocab_size)
    cfg.validate(tcfg)
    torch.manual_seed(job.train_seed)
    drafter = DFlashDrafter(cfg, dtype=torch.float32)
    init_drafter_(drafter)
    return drafter, cfg


def _draft_vocab(job: Job, drafter, cfg) -> None:
    """A pruned draft vocabulary: the drafter's own (loaded) or the most frequent training response tokens,
    its held-out coverage, and the target's full-vocabulary log-sum-exp added to every sequence's features."""
    t = time.perf_counter()
    vocab_size = job.tcfg.vocab_size
    if job.saved:  # the drafter's own vocabulary
        vocab_ids = draft_vocab_ids(drafter)
    else:
        vocab_ids = select_draft_vocab(job.train_s, vocab_size, cfg.draft_vocab_size)
        set_draft_vocab_(drafter, vocab_ids, job.lm_w)
    inside = torch.zeros(vocab_size, dtype=torch.bool)
    inside[vocab_ids] = True
    resp = torch.cat([torch.as_tensor(s["ids"][s["prompt_len"]:], dtype=torch.long) for s in job.held_s])
    job.vocab_cover = float(inside[resp].float().mean()) if resp.numel() else 1.0
    lse_dtype = getattr(torch, job.args.train_dtype)  # the held-out figures are float32 products either way
    cache = (job.cache_dir, {"model": job.model_fp, "feature_dtype": job.args.feature_dtype, **job.feature_key})
    dev = job.args.device
    job.f_train = [(a, h, lse) for (a, h), lse in zip(job.f_train, target_lse(
        job.lm_w, job.lm_b, job.f_train, job.train_s, dtype=lse_dtype, cache=cache, log=job.log, device=dev))]
    job.f_held = [(a, h, lse) for (a, h), lse in zip(job.f_held, target_lse(
        job.lm_w, job.lm_b, job.f_held, job.held_s, cache=cache, log=job.log, device=dev))]
    job.timings["draft_vocab_s"] = time.perf_counter() - t
    grown = "" if job.grow_from is None else f", grown from {job.grow_from.numel()}"
    job.log(f"draft vocabulary: {cfg.draft_vocab_size} tokens{grown}; they cover "
            f"{100 * job.vocab_cover:.2f}% of the held-out response tokens")


def _train(job: Job, drafter, cfg, loss_w) -> dict:
    """``train_drafter`` with the run's options, its state saved in the cache under a key of everything the
    trained weights depend on (``save_every_min``), and SIGINT / SIGTERM saving it before they stop."""
    args = job.args
    hyper = dict(anchors_per_seq=args.anchors_per_seq, epochs=args.epochs, lr=args.lr, batch_size=args.batch_size,
                 warmup=args.warmup, weight_decay=args.weight_decay, loss_decay=args.loss_decay, loss_w=loss_w,
                 grad_clip=args.grad_clip, seed=job.train_seed, train_dtype=args.train_dtype)
    # where it runs is no part of the state's key: a run stopped on a GPU may continue on the CPU
    state = None
    if args.save_every_min > 0:  # everything the trained weights depend on names the saved state
        key = fingerprint({"model": job.model_fp, "feature_dtype": args.feature_dtype, **job.feature_key,
                           "config": cfg.to_dict(),
                           "init": drafter.state_dict(), "hyper": hyper,
                           "data": [torch.tensor(s["ids"], dtype=torch.int32) for s in job.train_s],
                           "prompt_lens": [s["prompt_len"] for s in job.train_s]})
        state = TrainState(job.cache_dir, "dspark-train-state", key, every_s=60.0 * args.save_every_min,
                           resume=args.resume, log=job.log)
    with state.stop_on_signals() if state is not None else contextlib.nullcontext():
        tr = train_drafter(drafter, job.train_s, job.f_train, job.lm_w, job.lm_b, job.embed_w, gamma=cfg.block_size,
                           mask_token_id=job.mask_id, progress=args.progress, log=job.log, state=state,
                           device=args.device, **hyper)
    job.timings["train_s"] = tr["train_s"]  # earlier runs' part too when it continued a saved state
    job.t_start -= tr["train_s_before"]
    return tr


def _save(job: Job, command, drafter, cfg, tr, init_ev, ev, sts) -> dict:
    """Write the checkpoint (config.json with the training record, model.safetensors) and its README."""
    t = time.perf_counter()
    args = job.args
    out = Path(args.out)
    command = command or "specserve.train.dspark.train_dspark(" + repr(asdict(args)) + ")"
    meta = training_meta(job, command, cfg, drafter, tr, init_ev, ev, sts)
    job.timings["save_s"] = time.perf_counter() - t
    job.timings["total_s"] = time.perf_counter() - job.t_start
    meta["timings_s"] = {k: round(v, 1) for k, v in job.timings.items()}
    config = checkpoint_config(cfg, job.tcfg, num_anchors=args.anchors_per_seq, temperatures=sts["temperatures"],
                               training=meta)
    save_checkpoint(out, drafter, config)
    (out / "README.md").write_text(readme(out, cfg, meta, ev, sts), encoding="utf-8")
    job.log(f"wrote the {meta['method']} drafter to {out} ({job.timings['total_s']:.0f} s in all)")
    return {"out": str(out), "timings": job.timings, "heldout": summary(ev), "heldout_init": summary(init_ev),
            "sts": sts, "train": tr, "meta": meta, "config": cfg.to_dict(), "train_samples": job.train_s,
            "heldout_samples": job.held_s}


def _evaluate_saved(job: Job, command, drafter, cfg, ekw) -> dict:
    """``--eval-only``: the held-out evaluation and calibration of the drafter already at ``args.out``,
    written back into its ``config.json`` (``training``'s held-out figures, ``confidence_temperatures``)
    and ``README.md``; its weights are not touched. The training figures stay those of its training."""
    args, timings, raw = job.args, job.timings, job.saved[2]
    t = time.perf_counter()
    ev = evaluate_drafter(drafter, job.held_s, job.f_held, job.lm_w, job.lm_b, job.embed_w, **ekw)
    sts = fit_sts(ev["conf_logit"], ev["cstar"], ev["valid"])
    timings["eval_s"] = time.perf_counter() - t
    job.log(f"held-out: loss {ev['loss']:.4f}, tau estimate {ev['tau']:.3f} (greedy {ev['greedy_tau']:.3f}; greedy "
            f"decoding replayed {ev['decode']['tau']:.3f})")
    timings["total_s"] = time.perf_counter() - job.t_start
    meta = dict(raw.get("training") or {})
    if "command" not in meta:
        raise DataError(f"{args.out}/config.json has no 'training' record: --eval-only rewrites the held-out "
                        "figures of a drafter trained by this command")
    meta.update({
        **heldout_meta(ev, sts, len(job.held_s), job.vocab_cover),
        "heldout_evaluated_by": {"command": command or "specserve.train.dspark.train_dspark(" + repr(asdict(args))
                                 + ")", "eval_s": round(timings["eval_s"], 1),
                                 "total_s": round(timings["total_s"], 1)},
    })
    out = Path(args.out)
    raw = {**raw, "training": meta}
    if cfg.enable_confidence_head:
        raw["confidence_temperatures"] = [round(float(x), 6) for x in sts["temperatures"]]
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n", encoding="utf-8")
    (out / "README.md").write_text(readme(out, cfg, meta, ev, sts), encoding="utf-8")
    job.log(f"rewrote the held-out figures of {out} (config.json, README.md)")
    return {"out": str(out), "timings": timings, "heldout": summary(ev), "sts": sts, "meta": meta,
            "config": cfg.to_dict(), "heldout_samples": job.held_s}
