"""Benchmark harness: the same prompts (the same token ids), one request at a time, through a list of
*methods*, one row per (method, dtype).

A method is a small runner object with ``name``, ``start(ctx) -> Session`` (the method loaded and
warmed up, generating one prompt at a time), ``run(ctx) -> MethodResult`` (all prompts) and optionally
``check()`` (raise ``BenchError`` before anything runs when it cannot run). Rows today:

- ``none``: specserve, plain decoding (the baseline every other row is compared with);
- ``hf``:   HF transformers ``generate`` on the same HF directory, same dtype, same torch threads.

Speculative methods are added the same way, as ``SpecserveMethod(name, speculative_config={...})`` in
``METHODS`` (or through ``register_method``); their acceptance metrics come from ``LLM.get_metrics()``.

Timing: every prompt is one request (batch size 1) timed from submission to its last token, prefill
included, after one short warm-up generation per method. All methods are loaded first and the prompts
go through them interleaved (prompt 1 through every method, then prompt 2, ..., the order rotating),
so slow drifts of the machine's speed weigh on every row alike (``--no-interleave``: one method after
the other; tensor-parallel runs always go one method after the other). With ``tensor_parallel_size`` > 1 every
specserve row runs over that many processes (gloo, ``threads // size`` threads each) and reports the
collectives it ran: per generated token (rank 0, timed requests only) and, for block drafters, per
drafting step (``collectives_per_draft_step``, the ranks' counts of one step). ``tokens_per_s`` = all generated tokens /
the sum of those wall times, i.e. a per-request latency comparison.

Identity (greedy only): for each prompt, a method's output ids are compared with ``none``'s over their
common prefix, i.e. the first ``min(len(ours), len(theirs))`` tokens. Both stop at the same EOS ids
(which are kept in the output) and at the same ``max_tokens``, so lengths normally match; when one run
emits EOS where the other does not, that position is inside the common prefix and counts as a
divergence. A length difference alone is counted in ``length_mismatches``. At temperature > 0
``identical_to_none`` is null.
"""

from __future__ import annotations

import gc
import importlib.util
import json
import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from specserve.spec_decode.ngram import POOLED_BRANCHES

BUILTIN_PROMPTS = Path(__file__).with_name("prompts.jsonl")
HELDOUT = "chitchat-heldout"  # --prompts value: the held-out split of the drafters' training prompts
INSTRUCTIONS_HELDOUT = "instructions-heldout"  # the held-out split of the instruction prompts (train/instructions.py)
SHAREGPT_HELDOUT = "sharegpt-heldout"  # the held-out split of the ShareGPT prompts (train/sharegpt.py)
WARMUP_TOKENS = 4


class BenchError(ValueError):
    """A problem with the benchmark's inputs or environment (reported as ``error: ...``)."""


# ---- inputs ---------------------------------------------------------------------------------------
def load_prompts(path: str | os.PathLike | None = None) -> list[str]:
    """Prompts from a JSONL file (one object with a "prompt" field per line) or a plain text file (one
    prompt per line). Blank lines are skipped. ``None``: the built-in set."""
    if str(path) == HELDOUT:  # the chat prompts our drafters never saw in training
        from specserve.train.data import load_prompts as load_chitchat

        return load_chitchat("heldout")
    if str(path) == INSTRUCTIONS_HELDOUT:  # the instruction prompts they never saw
        from specserve.train.instructions import load_instruction_prompts

        return load_instruction_prompts("heldout")
    from specserve.train.data import DataError, read_prompts_file

    try:
        if str(path) == SHAREGPT_HELDOUT:  # ShareGPT conversations held out of training
            from specserve.train.sharegpt import load_sharegpt_prompts

            return load_sharegpt_prompts("heldout")
        return read_prompts_file(path if path is not None else BUILTIN_PROMPTS)
    except DataError as e:
        raise BenchError(str(e)) from None


@dataclass
class BenchContext:
    """What every method receives: one dtype, the shared prompt ids and the sampling settings."""

    model: str | None
    model_dir: Path
    dtype: str  # a concrete name: float32 | bfloat16 | float16
    prompt_ids: list[list[int]]
    eos_ids: list[int]
    max_tokens: int
    temperature: float
    seed: int
    threads: int
    tensor_parallel_size: int = 1
    device: str = "cpu"


@dataclass
class MethodResult:
    outputs: list[list[int]]  # generated ids per prompt (EOS included when emitted)
    wall_s: float  # summed per-request wall time
    mean_acceptance_length: float = 1.0
    acceptance_rate_per_position: list[float] = field(default_factory=list)
    extra: dict = field(default_factory=dict)

    @property
    def generated_tokens(self) -> int:
        return sum(len(o) for o in self.outputs)


# ---- methods --------------------------------------------------------------------------------------
class Session:
    """One method, loaded and warmed up, generating the bench's prompts one request at a time:
    ``generate(i)`` times prompt i, ``result()`` collects the row, ``close()`` frees it."""

    def __init__(self, ctx: BenchContext):
        self.ctx = ctx
        self.outputs: dict[int, list[int]] = {}
        self.wall = 0.0

    def generate(self, i: int) -> None:
        t0 = time.perf_counter()
        out = self._generate(self.ctx.prompt_ids[i], self.ctx.max_tokens, i)
        self.wall += time.perf_counter() - t0
        self.outputs[i] = out

    def _outputs(self) -> list[list[int]]:
        return [self.outputs[i] for i in sorted(self.outputs)]

    def result(self) -> MethodResult:
        return MethodResult(self._outputs(), self.wall)

    def close(self) -> None:
        gc.collect()


def run_alone(method, ctx: BenchContext) -> MethodResult:
    """All prompts through one method, start to finish."""
    session = method.start(ctx)
    try:
        for i in range(len(ctx.prompt_ids)):
            session.generate(i)
        return session.result()
    finally:
        session.close()


class SpecserveMethod:
    """specserve's ``LLM``; ``speculative_config=None`` is plain decoding."""

    def __init__(self, name: str, speculative_config: dict | None = None):
        self.name = name
        self.speculative_config = speculative_config

    def start(self, ctx: BenchContext) -> "SpecserveSession":
        return SpecserveSession(ctx, self.speculative_config)

    def run(self, ctx: BenchContext) -> MethodResult:
        return run_alone(self, ctx)


class SpecserveSession(Session):
    def __init__(self, ctx: BenchContext, speculative_config: dict | None):
        from specserve import LLM

        super().__init__(ctx)
        kwargs = {"speculative_config": speculative_config} if speculative_config else {}
        self.tp = tp = ctx.tensor_parallel_size
        self.llm = LLM(model=ctx.model, dtype=ctx.dtype, seed=ctx.seed, num_threads=max(1, ctx.threads // tp),
                       device=ctx.device,
                       max_num_seqs=1, tensor_parallel_size=tp, **kwargs)
        try:
            self._generate(ctx.prompt_ids[0], WARMUP_TOKENS, 0)
            self.llm.reset_metrics()
            self.stats_before = dict(self.llm.engine.stats)
            self.collectives_before = _rank0_collectives(self.llm.engine.runner) if tp > 1 else 0
        except BaseException:  # no session to close yet: stop the engine (and its TP workers) here
            self.llm.shutdown()
            raise

    def _generate(self, ids: list[int], n: int, i: int) -> list[int]:
        from specserve import SamplingParams

        params = SamplingParams(temperature=self.ctx.temperature, max_tokens=n, seed=self.ctx.seed + i, top_p=1.0,
                                top_k=-1, min_p=0.0)
        torch.set_num_threads(max(1, self.ctx.threads // self.tp))
        (out,) = self.llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
        return list(out.outputs[0].token_ids)

    def result(self) -> MethodResult:
        llm, runner, outputs = self.llm, self.llm.engine.runner, self._outputs()
        m = llm.get_metrics()
        extra = {}
        if self.tp > 1:
            n_tok = max(1, sum(len(o) for o in outputs))
            extra["collectives_per_token"] = round((_rank0_collectives(runner) - self.collectives_before) / n_tok, 3)
            name = getattr(llm.engine.proposer, "name", "")
            if name in getattr(runner.local, "helpers", {}):
                per_rank = runner.helper_report(name, "draft_step_collectives", 1)
                extra["collectives_per_draft_step"] = per_rank[0]
        extra.update({k: m[k] for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")})
        extra.update(step_breakdown(llm.engine.stats, self.stats_before))
        return MethodResult(outputs, self.wall, m["mean_acceptance_length"], m["acceptance_rate_per_position"],
                            extra=extra)

    def close(self) -> None:
        self.llm.shutdown()
        del self.llm
        super().close()


def step_breakdown(stats: dict, before: dict) -> dict:
    """Where a decoding step's time went, from the engine's counters since ``before``: ``ms_per_step``
    (whole steps), ``draft_ms_per_step`` (the drafter's share) and ``verified_tokens_per_step`` (tokens
    through the target's forward). With one request at a time, a row's speedup over plain decoding is
    its tau times the ratio of plain decoding's ms_per_step to its own."""
    d = {k: stats[k] - before.get(k, 0) for k in ("decode_s", "decode_steps", "draft_s", "verified_tokens")}
    n = max(1, d["decode_steps"])
    return {"ms_per_step": round(1e3 * d["decode_s"] / n, 3), "draft_ms_per_step": round(1e3 * d["draft_s"] / n, 3),
            "verified_tokens_per_step": round(d["verified_tokens"] / n, 3)}


def _rank0_collectives(runner) -> int:
    return sum(runner.collective_counts()[0].values())


class HFMethod:
    """HF transformers ``generate`` on the same directory: greedy at temperature 0, else plain sampling
    at that temperature (top_k/top_p off, as in specserve's defaults)."""

    name = "hf"

    def check(self) -> None:
        """Fail before anything runs when transformers is missing."""
        if importlib.util.find_spec("transformers") is None:
            raise BenchError("method 'hf' needs HF transformers: pip install specserve[bench]")

    def start(self, ctx: BenchContext) -> "HFSession":
        return HFSession(ctx)

    def run(self, ctx: BenchContext) -> MethodResult:
        return run_alone(self, ctx)


class HFSession(Session):
    def __init__(self, ctx: BenchContext):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        try:
            import transformers
        except ImportError:
            raise BenchError("method 'hf' needs HF transformers: pip install specserve[bench]") from None
        transformers.utils.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
        from specserve.engine.model_runner import DTYPES

        if ctx.tensor_parallel_size > 1:
            raise BenchError("method 'hf' runs on one process: drop it with --tensor-parallel-size > 1")
        super().__init__(ctx)
        torch.set_num_threads(ctx.threads)
        self.model = transformers.AutoModelForCausalLM.from_pretrained(ctx.model_dir, dtype=DTYPES[ctx.dtype])
        self.model = self.model.to(ctx.device).eval()
        self._generate(ctx.prompt_ids[0], WARMUP_TOKENS, 0)

    def _generate(self, ids: list[int], n: int, i: int) -> list[int]:
        ctx = self.ctx
        torch.set_num_threads(ctx.threads)
        x = torch.tensor([ids], device=ctx.device)
        kw = dict(do_sample=False) if ctx.temperature < 1e-5 else dict(
            do_sample=True, temperature=ctx.temperature, top_k=0, top_p=1.0)
        if kw["do_sample"]:
            torch.manual_seed(ctx.seed + i)
        with torch.inference_mode():
            y = self.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=0,
                                    eos_token_id=ctx.eos_ids or None, pad_token_id=ctx.eos_ids[0] if ctx.eos_ids else 0,
                                    **kw)
        return _strip_after_eos(y[0, len(ids):].tolist(), ctx.eos_ids)

    def close(self) -> None:
        del self.model
        super().close()


def _strip_after_eos(ids: list[int], eos_ids: list[int]) -> list[int]:
    """HF pads after EOS only in batches; at batch size 1 this is a no-op kept for safety."""
    eos = set(eos_ids)
    for j, t in enumerate(ids):
        if t in eos:
            return ids[: j + 1]
    return ids


# name -> factory
METHODS: dict[str, Callable[[], object]] = {
    "none": lambda: SpecserveMethod("none", None),
    "hf": HFMethod,
    "ngram": lambda: SpecserveMethod("ngram", {"method": "ngram", "num_speculative_tokens": 5,
                                               "prompt_lookup_max": 4, "prompt_lookup_min": 1}),
    # the heads shipped for the default model: chain (argmax of each head), a tree sized at start-up,
    # chains cut per step, a tree chosen per step (all by the cost model)
    "medusa": lambda: SpecserveMethod("medusa", {"method": "medusa"}),
    "medusa-tree": lambda: SpecserveMethod("medusa-tree", {"method": "medusa", "medusa_tree": "auto"}),
    "medusa-auto": lambda: SpecserveMethod("medusa-auto", {"method": "medusa", "medusa_verify": "auto"}),
    "medusa-tree-dynamic": lambda: SpecserveMethod("medusa-tree-dynamic", {"method": "medusa", "medusa_tree": "auto",
                                                                           "medusa_verify": "auto"}),
    # the block drafters shipped for the default model (block 7), every draft verified
    "dspark": lambda: SpecserveMethod("dspark", {"method": "dspark"}),
    "dflash": lambda: SpecserveMethod("dflash", {"method": "dflash"}),
    # DSpark variants: verification length from the start-up cost model, or cut at a confidence
    # threshold; drafts sampled from the corrected distribution (for temperature > 0); the Markov head
    # sharded across tensor-parallel ranks instead of replicated (for the TP comparison)
    "dspark-auto": lambda: SpecserveMethod("dspark-auto", {"method": "dspark", "dspark_verify": "auto"}),
    "dspark-threshold": lambda: SpecserveMethod("dspark-threshold", {"method": "dspark", "dspark_verify": "threshold",
                                                                     "confidence_threshold": 0.3}),
    "dspark-prob": lambda: SpecserveMethod("dspark-prob", {"method": "dspark",
                                                           "draft_sample_method": "probabilistic"}),
    "dspark-sharded": lambda: SpecserveMethod("dspark-sharded", {"method": "dspark", "markov_replicate": False}),
    # draft trees (every branch with its own Markov bias), as many nodes as the cost model finds worth
    "dspark-tree": lambda: SpecserveMethod("dspark-tree", {"method": "dspark", "dspark_tree": "auto"}),
    "dflash-tree": lambda: SpecserveMethod("dflash-tree", {"method": "dflash", "dspark_tree": "auto"}),
}


def register_method(name: str, factory: Callable[[], object]) -> None:
    METHODS[name] = factory


DRAFTER_METHODS = ("medusa", "dspark", "dflash")  # the methods that load a drafter checkpoint
SIZED_TREE = re.compile(r"(medusa|dspark|dflash)-tree-([1-9][0-9]*)")  # e.g. medusa-tree-64: 64 nodes, fixed
TREE_OPTION = {"medusa": "medusa_tree", "dspark": "dspark_tree", "dflash": "dspark_tree"}


# e.g. medusa-tree-dynamic-ngram: that method plus ``ngram_branch: 5``; -ngramK: ``ngram_branch: K``;
# -pool / -poolK: also earlier requests' continuations, 3 candidates of 12 / K tokens
NGRAM_SUFFIX = re.compile(r"(.+)-(ngram|pool)([1-9][0-9]*)?")
NGRAM_SUFFIX_OPTIONS = {"ngram": {"ngram_branch": 5}, "pool": POOLED_BRANCHES}


# e.g. dspark-draft-float32: that block-drafter method with its drafter run in float32 (draft_dtype)
DRAFT_DTYPE_SUFFIX = re.compile(r"(.+)-draft-(float32|bfloat16)")


def method_factory(name: str) -> Callable[[], object] | None:
    """The runner factory of a method name: one of ``METHODS``, ``{medusa,dspark,dflash}-tree-N`` (the
    shipped drafter with trees of N nodes, whatever verifying N tokens costs here), or either with the
    suffix ``-ngram`` (the n-gram continuation as one more branch of every draft: ``ngram_branch: 5``),
    ``-ngramK`` (``ngram_branch: K``), ``-pool`` (3 continuations of up to 12 tokens, from the sequence
    and from earlier requests: ``ngram_candidates: 3``, ``ngram_pool: true``) or ``-poolK``. A DSpark or
    DFlash method may end in ``-draft-float32`` or ``-draft-bfloat16``: its drafter run in that dtype
    (``draft_dtype``; default ``"auto"``), e.g. ``dspark-draft-float32`` beside ``dspark``. Any of the
    drafter methods may end in ``@PATH``: the same with the drafter checkpoint at PATH instead of the
    shipped one (``speculative_config["model"]``), e.g. ``dspark-tree-pool@my-drafter``, to compare
    drafters side by side in one run."""
    if "@" in name:
        base_name, path = name.split("@", 1)
        base = method_factory(base_name) if path else None
        spec = getattr(base(), "speculative_config", None) if base else None
        if not spec or spec["method"] not in DRAFTER_METHODS:
            return None  # plain decoding, HF and the n-gram drafter have no checkpoint
        return lambda: SpecserveMethod(name, {**spec, "model": path})
    if name in METHODS:
        return METHODS[name]
    m = DRAFT_DTYPE_SUFFIX.fullmatch(name)
    if m:
        base = method_factory(m.group(1))
        spec = getattr(base(), "speculative_config", None) if base else None
        if not spec or spec["method"] not in ("dspark", "dflash") or "draft_dtype" in spec:
            return None
        return lambda: SpecserveMethod(name, {**spec, "draft_dtype": m.group(2)})
    m = SIZED_TREE.fullmatch(name)
    if m:
        method = m.group(1)
        return lambda: SpecserveMethod(name, {"method": method, TREE_OPTION[method]: int(m.group(2))})
    m = NGRAM_SUFFIX.fullmatch(name)
    base = method_factory(m.group(1)) if m else None
    if base is None:
        return None
    runner = base()
    spec = getattr(runner, "speculative_config", None)
    if (not spec or spec["method"] == "ngram" or "ngram_branch" in spec
            or spec.get("draft_sample_method") == "probabilistic"):
        return None  # plain decoding, HF, the n-gram drafter, a branch already there, sampled drafts
    opts = dict(NGRAM_SUFFIX_OPTIONS[m.group(2)])
    if m.group(3):
        opts["ngram_branch"] = int(m.group(3))
    return lambda: SpecserveMethod(name, {**spec, **opts})


def parse_methods(spec: str | list[str]) -> list[str]:
    names = [m.strip() for m in (spec.split(",") if isinstance(spec, str) else spec) if m.strip()]
    if not names:
        raise BenchError("no methods given")
    unknown = [m for m in names if method_factory(m) is None]
    if unknown:
        raise BenchError(f"unknown method(s) {', '.join(map(repr, unknown))}; known methods: {', '.join(METHODS)}, "
                         "{medusa,dspark,dflash}-tree-N (trees of N nodes), any drafter's name + "
                         "'-ngram', '-ngramK' (an n-gram branch of 5 or K tokens), '-pool' or '-poolK' (3 branches, "
                         "also from earlier requests), a DSpark/DFlash method + '-draft-float32' or "
                         "'-draft-bfloat16' (its drafter's dtype), and a drafter method + '@PATH' (its drafter "
                         "checkpoint at PATH)")
    names = list(dict.fromkeys(names))
    if "none" in names:
        names.remove("none")
    return ["none"] + names  # the baseline always runs first: every row is compared with it


def parse_dtypes(spec: str | list[str], device: str = "cpu") -> list[str]:
    from specserve.engine.model_runner import DTYPES, resolve_dtype

    names = [d.strip() for d in (spec.split(",") if isinstance(spec, str) else spec) if d.strip()]
    if not names:
        raise BenchError("no dtype given")
    out = []
    for d in names:
        if d != "auto" and d not in DTYPES:
            raise BenchError(f"unknown dtype {d!r}; choose from auto, float32, bfloat16, float16")
        out.append(str(resolve_dtype(d, device)).removeprefix("torch."))
    return list(dict.fromkeys(out))


# ---- the run --------------------------------------------------------------------------------------
def compare(base: list[list[int]], other: list[list[int]]) -> tuple[bool, int, int]:
    """(identical over the common prefix on every prompt, divergent prompts, length mismatches)."""
    divergent = mismatched = 0
    for a, b in zip(base, other):
        n = min(len(a), len(b))
        if a[:n] != b[:n]:
            divergent += 1
        elif len(a) != len(b):
            mismatched += 1
    return divergent == 0, divergent, mismatched


def run_bench(model: str | None = None, methods: str | list[str] = "none,hf", prompts_file: str | None = None,
              num_prompts: int | None = None, max_tokens: int = 128, temperature: float = 0.0,
              dtypes: str | list[str] = "auto", threads: int | None = None, seed: int = 0,
              log: Callable[[str], None] | None = None, tensor_parallel_size: int = 1,
              interleave: bool = True, device: str | None = "auto") -> list[dict]:
    """Run every method at every dtype; returns one row (a dict) per (dtype, method). ``interleave``
    (one process only): see ``_run_methods``."""
    from specserve.models.loader import resolve_model_dir
    from specserve.tokenizer import Tokenizer

    log = log or (lambda s: None)
    names = parse_methods(methods)
    runners = {n: method_factory(n)() for n in names}
    for r in runners.values():
        if hasattr(r, "check"):
            r.check()
    from specserve.engine.model_runner import resolve_device

    try:
        device = resolve_device(device, tensor_parallel_size)
    except ValueError as e:
        raise BenchError(str(e)) from None
    if device != "cpu" and tensor_parallel_size > 1:
        raise BenchError("--tensor-parallel-size > 1 runs gloo processes on CPU: use --device cpu")
    dtype_names = parse_dtypes(dtypes, device)
    if max_tokens < 1:
        raise BenchError(f"--max-tokens must be >= 1, got {max_tokens}")
    if temperature < 0:
        raise BenchError(f"--temperature must be >= 0, got {temperature}")
    if threads is not None and threads < 1:
        raise BenchError(f"--threads must be >= 1, got {threads}")
    if tensor_parallel_size < 1:
        raise BenchError(f"--tensor-parallel-size must be >= 1, got {tensor_parallel_size}")
    if tensor_parallel_size > 1 and "hf" in names:
        raise BenchError("method 'hf' runs on one process: drop it with --tensor-parallel-size > 1")
    texts = load_prompts(prompts_file)
    if num_prompts is not None:
        if num_prompts < 1:
            raise BenchError(f"--num-prompts must be >= 1, got {num_prompts}")
        if num_prompts > len(texts):
            log(f"note: only {len(texts)} prompts available; using all of them")
        texts = texts[:num_prompts]
    threads = threads or torch.get_num_threads()
    torch.set_num_threads(threads)

    model_dir = resolve_model_dir(model)
    tok = Tokenizer.from_dir(model_dir)
    if tok.chat_template:
        prompt_ids = [tok.apply_chat_template([{"role": "user", "content": t}]) for t in texts]
    else:
        prompt_ids = [tok.encode(t) for t in texts]
    from specserve.models.loader import read_config

    cfg_eos = read_config(model_dir).eos_token_id
    eos_ids = list(dict.fromkeys((tok.eos_token_ids or []) + ([cfg_eos] if isinstance(cfg_eos, int) else list(cfg_eos or []))))
    greedy = temperature < 1e-5
    interleaved = interleave and tensor_parallel_size == 1  # TP: one set of worker processes at a time

    rows = []
    for dtype in dtype_names:
        ctx = BenchContext(model, model_dir, dtype, prompt_ids, eos_ids, max_tokens, temperature, seed, threads,
                           tensor_parallel_size, device)
        base: MethodResult | None = None
        base_tps = None
        results = _run_methods(runners, names, ctx, interleaved, log)
        for name in names:
            res = results[name]
            tps = res.generated_tokens / res.wall_s if res.wall_s > 0 else 0.0
            if name == "none":
                base, base_tps = res, tps
            identical, divergent, mismatched = compare(base.outputs, res.outputs) if greedy else (None, None, None)
            rows.append({
                "method": name,
                "dtype": dtype,
                "tokens_per_s": round(tps, 3),
                "speedup_vs_none": round(tps / base_tps, 4) if base_tps else None,
                "num_prompts": len(prompt_ids),
                "max_tokens": max_tokens,
                "temperature": temperature,
                "generated_tokens": res.generated_tokens,
                "wall_s": round(res.wall_s, 4),
                "identical_to_none": identical,
                "divergent_prompts": divergent,
                "length_mismatches": mismatched,
                "mean_acceptance_length": res.mean_acceptance_length,
                "acceptance_rate_per_position": res.acceptance_rate_per_position,
                "threads": threads,
                "device": device,
                "tensor_parallel_size": tensor_parallel_size,
                "interleaved": interleaved,
                "model_dir": str(model_dir),
                **res.extra,
            })
    return rows


def _run_methods(runners: dict, names: list[str], ctx: BenchContext, interleave: bool, log) -> dict[str, MethodResult]:
    """Every method's result. Interleaved: all methods loaded at once, then prompt by prompt through
    each of them (the order rotating from prompt to prompt), so that a machine getting faster or
    slower during the run (thermal or frequency changes, noisy neighbours) weighs on every row alike.
    Else one method after the other (tensor parallelism: one set of worker processes at a time)."""
    n = len(ctx.prompt_ids)
    where = f"{ctx.threads} threads" if ctx.device == "cpu" else ctx.device
    what = f"({ctx.dtype}, {n} prompts x {ctx.max_tokens} tokens, {where})"
    if not interleave:
        out = {}
        for name in names:
            log(f"running {name} {what}...")
            out[name] = runners[name].run(ctx)
        return out
    sessions: dict[str, Session] = {}
    try:
        for name in names:
            log(f"loading {name}...")
            sessions[name] = runners[name].start(ctx)
        log(f"running {', '.join(names)} interleaved, prompt by prompt {what}...")
        for i in range(n):
            r = i % len(names)
            for name in names[r:] + names[:r]:
                sessions[name].generate(i)
        return {name: s.result() for name, s in sessions.items()}
    finally:
        for s in sessions.values():
            s.close()


def format_table(rows: list[dict]) -> str:
    """method | dtype | tok/s | vs none | ours/hf | identical | mean acc. length | tokens | ms per decoding
    step | of which drafting | tokens verified per step."""
    head = ["method", "dtype", "tok/s", "vs none", "ours/hf", "identical", "acc.len", "tokens", "ms/step", "draft ms",
            "verified/step"]
    tp = any("collectives_per_token" in r for r in rows)
    if tp:
        head += ["coll/token", "coll/draft step"]
    body = []
    for r in rows:
        ours_hf = ""
        if r["method"] == "hf" and r["speedup_vs_none"]:
            ours_hf = f"{1 / r['speedup_vs_none']:.2f}x"
        ident = {True: "yes", False: f"NO ({r['divergent_prompts']} differ)", None: "-"}[r["identical_to_none"]]
        if r["method"] == "none":
            ident = "(baseline)"
        body.append([r["method"], r["dtype"], f"{r['tokens_per_s']:.1f}",
                     f"{r['speedup_vs_none']:.2f}x" if r["speedup_vs_none"] is not None else "-", ours_hf, ident,
                     f"{r['mean_acceptance_length']:.2f}", str(r["generated_tokens"])]
                    + ([f"{r['ms_per_step']:.1f}", f"{r['draft_ms_per_step']:.1f}", f"{r['verified_tokens_per_step']:.1f}"]
                       if "ms_per_step" in r else ["-"] * 3))
        if tp:
            step = r.get("collectives_per_draft_step")
            body[-1] += [f"{r.get('collectives_per_token', 0):.1f}",
                         "-" if step is None else (" + ".join(f"{v} {k}" for k, v in sorted(step.items())) or "0")]
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(head)]
    line = lambda cells: "  ".join(c.ljust(w) if i < 2 or i == 5 else c.rjust(w)  # noqa: E731
                                   for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([line(head), line(["-" * w for w in widths])] + [line(b) for b in body])


def write_json(rows: list[dict], path: str | os.PathLike) -> None:
    p = Path(path)
    if p.parent and not p.parent.exists():
        p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(rows, indent=2) + "\n")


def main_log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
