"""Benchmark harness: the same prompts (the same token ids), one request at a time, through a list of
*methods*, one row per (method, dtype, weight format).

A method is a small runner object with ``name``, ``start(ctx) -> Session`` (the method loaded and
warmed up, generating one prompt at a time), ``run(ctx) -> MethodResult`` (all prompts) and optionally
``check(model=, device=, tensor_parallel_size=)`` (raise ``BenchError`` before anything loads when it
cannot run; it may take any of these keywords, or none). Rows today:

- ``none``: specserve, plain decoding (the baseline every other row is compared with);
- ``hf``:   HF transformers ``generate`` on the same HF directory, same dtype, same torch threads;
- ``llama.cpp`` (or ``llamacpp``): llama-cpp-python on the same GGUF file (the default model's, or the
  ``--model`` .gguf), in the GGUF's own quantization, greedy (or plain sampling at the temperature),
  the same prompt ids, ``n_threads`` = the bench's threads, reusing the KV of the prefix a request
  shares with the one before (as our rows' prefix caching, and llama.cpp's server, do). Its tokens are
  compared with ``none``'s for information only (llama.cpp also quantizes the activations of its
  quantized matmuls, so its greedy text drifts from ours); every row of a run with it gets
  ``speedup_vs_llamacpp`` (tok/s over llama.cpp's).

Weight formats (``--quantization``, a comma list like ``--dtype``): every (dtype, quantization) pair
is one group of rows, each with its own ``none`` baseline; "auto" is the GGUF's own quantization for
a .gguf (and the default model), dense weights for an HF directory. A row's ``quantization`` is what
its weights are (null: dense) and ``weights`` the label the table shows (e.g. ``int8``, ``gguf Q4_1``).

Speculative rows are ``SpecserveMethod(name, speculative_config)``: a named preset of ``PRESETS``, or any
configuration named on the command line (``--speculative-config NAME=JSON``); their acceptance metrics
come from ``LLM.get_metrics()``.

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
divergence. A length difference alone is counted in ``length_mismatches``. At temperature > 0 the
specserve rows are compared the same way under ``sampling_mode="coupled"`` (the default: a seeded
request's tokens are plain decoding's whatever the drafter); otherwise, and for the peers,
``identical_to_none`` is null.
"""

from __future__ import annotations

import gc
import importlib.util
import inspect
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from specserve import LLM, SamplingParams
from specserve.config import QUANTIZATION_NAMES, SAMPLING_MODES
from specserve.device import DTYPES, resolve_device, resolve_dtype
from specserve.engine.model_runner import resolve_quantization
from specserve.models.gguf import read_gguf
from specserve.models.loader import default_gguf_path, gguf_source, read_config, resolve_model_dir
from specserve.spec_decode.ngram.branches import POOLED_BRANCHES
from specserve.tokenizer import Tokenizer
from specserve.bench.categories import category_figures, category_prompts, draft_vocabulary, is_category_spec
from specserve.bench.oracle import METHOD as NGRAM_ORACLE
from specserve.bench.oracle import NgramOracleMethod
from specserve.spec_decode.metrics import SpecMetrics
from specserve.train.data import DataError, read_prompts_file
from specserve.train.data import load_prompts as load_chitchat
from specserve.train.instructions import load_instruction_prompts
from specserve.train.sharegpt import load_sharegpt_prompts

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

        return load_chitchat("heldout")
    if str(path) == INSTRUCTIONS_HELDOUT:  # the instruction prompts they never saw

        return load_instruction_prompts("heldout")

    try:
        if is_category_spec(path):  # the stored held-out prompts by category (bench/categories.py)
            return [p for _, p in category_prompts(path)]
        if str(path) == SHAREGPT_HELDOUT:  # ShareGPT conversations held out of training

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
    quantization: str | None = None  # resolved: None (dense), "gguf", "int8" or "int4"
    sampling_mode: str = "coupled"  # the specserve rows' ``LLM(sampling_mode=...)``
    speculation_gate: bool | None = None  # the specserve rows' ``LLM(speculation_gate=...)`` (None: its default)
    activations: str = "bfloat16"  # the specserve rows' ``LLM(activations=...)``


@dataclass
class MethodResult:
    outputs: list[list[int]]  # generated ids per prompt (EOS included when emitted)
    wall_s: float  # summed per-request wall time
    mean_acceptance_length: float = 1.0
    acceptance_rate_per_position: list[float] = field(default_factory=list)
    extra: dict = field(default_factory=dict)
    # per prompt, not in the rows: "walls" (seconds), "metrics" (``SpecMetrics``), "draft_vocabulary"
    details: dict = field(default_factory=dict)

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
        self.walls: dict[int, float] = {}
        self.wall = 0.0

    def generate(self, i: int) -> None:
        t0 = time.perf_counter()
        out = self._generate(self.ctx.prompt_ids[i], self.ctx.max_tokens, i)
        self.walls[i] = time.perf_counter() - t0
        self.wall += self.walls[i]
        self.outputs[i] = out

    def _outputs(self) -> list[list[int]]:
        return [self.outputs[i] for i in sorted(self.outputs)]

    def _walls(self) -> dict:
        return {"walls": [self.walls[i] for i in sorted(self.walls)]}

    def result(self) -> MethodResult:
        return MethodResult(self._outputs(), self.wall, details=self._walls())

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

        super().__init__(ctx)
        kwargs = {"speculative_config": speculative_config} if speculative_config else {}
        self.tp = tp = ctx.tensor_parallel_size
        self.llm = LLM(model=ctx.model, dtype=ctx.dtype, seed=ctx.seed, num_threads=max(1, ctx.threads // tp),
                       device=ctx.device, quantization=ctx.quantization, sampling_mode=ctx.sampling_mode,
                       speculation_gate=ctx.speculation_gate, max_num_seqs=1, tensor_parallel_size=tp,
                       activations=ctx.activations, **kwargs)
        try:
            runner = self.llm.engine.runner
            ran = (str(getattr(runner, "dtype", ctx.dtype)).removeprefix("torch."),
                   getattr(runner, "quantization", ctx.quantization),
                   "int8" if getattr(runner, "int8_activations", ctx.activations == "int8") else "bfloat16")
            if ran != (ctx.dtype, ctx.quantization, ctx.activations):  # the row's label must be what runs
                raise BenchError(f"asked for dtype {ctx.dtype} with quantization {ctx.quantization} and "
                                 f"{ctx.activations} activations, the engine loaded {ran[0]} with {ran[1]} and "
                                 f"{ran[2]}")
            self._generate(ctx.prompt_ids[0], WARMUP_TOKENS, 0)
            self.llm.reset_metrics()
            self.prompt_metrics: dict[int, SpecMetrics] = {}
            self.stats_before = self.llm.engine.stats.as_dict()
            self.collectives_before = _rank0_collectives(self.llm.engine.runner) if tp > 1 else 0
        except BaseException:  # no session to close yet: stop the engine (and its TP workers) here
            self.llm.shutdown()
            raise

    def generate(self, i: int) -> None:
        """Prompt i, with the engine's acceptance counters of this request alone kept aside."""
        engine = self.llm.engine
        run, engine.metrics = engine.metrics, SpecMetrics()
        try:
            super().generate(i)
        finally:
            self.prompt_metrics[i] = engine.metrics
            run.merge(engine.metrics)
            engine.metrics = run

    def _generate(self, ids: list[int], n: int, i: int) -> list[int]:

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
        extra.update(step_breakdown(llm.engine.stats.as_dict(), self.stats_before))
        extra["first_rejected_per_position"] = m["first_rejected_per_position"]
        details = {**self._walls(), "metrics": [self.prompt_metrics[i] for i in sorted(self.prompt_metrics)],
                   "draft_vocabulary": draft_vocabulary(llm)}
        return MethodResult(outputs, self.wall, m["mean_acceptance_length"], m["acceptance_rate_per_position"],
                            extra=extra, details=details)

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
    quantization = None  # dense weights whatever the group's format

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

        if ctx.tensor_parallel_size > 1:
            raise BenchError("method 'hf' runs on one process: drop it with --tensor-parallel-size > 1")
        super().__init__(ctx)
        torch.set_num_threads(ctx.threads)
        gguf = gguf_source(ctx.model_dir)  # a GGUF's weights: transformers reads (dequantizes) the file itself
        where, kw = (gguf.parent, {"gguf_file": gguf.name}) if gguf else (ctx.model_dir, {})
        self.model = transformers.AutoModelForCausalLM.from_pretrained(where, dtype=DTYPES[ctx.dtype], **kw)
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


LLAMACPP = "llama.cpp"
LLAMACPP_INSTALL = "pip install llama-cpp-python==0.3.36 (compiles llama.cpp, ~10 minutes), or specserve[llamacpp]"


def model_gguf_path(model: str | os.PathLike | None) -> Path | None:
    """The GGUF file a model runs from: the default model's for None, ``model`` itself for a .gguf file,
    None for an HF directory (or anything else)."""
    if model is None:

        return default_gguf_path()
    p = Path(model).expanduser()
    return p if p.suffix == ".gguf" and p.is_file() else None


def gguf_file_type(path: str | os.PathLike | None) -> str | None:
    """The quantization a GGUF file declares (``general.file_type``, e.g. "Q4_1"); None when unknown."""
    if path is None:
        return None
    try:
        import gguf

        file_type = read_gguf(Path(path))[0].get("general.file_type")
        return None if file_type is None else gguf.LlamaFileType(int(file_type)).name.removeprefix("MOSTLY_")
    except (OSError, ValueError, KeyError, TypeError):  # a label only: never stops the bench
        return None


class LlamaCppMethod:
    """llama-cpp-python on the GGUF our rows load (see the module docstring)."""

    name = LLAMACPP
    quantization = "gguf"
    identity_informational = True  # its tokens differ from ours by design: compared for information only

    def check(self, model=None, device: str = "cpu", tensor_parallel_size: int = 1) -> None:
        """Fail before anything loads: llama-cpp-python missing, an HF directory as the model, TP, a GPU."""
        import_llama_cpp()
        if tensor_parallel_size > 1:
            raise BenchError(f"method '{LLAMACPP}' runs on one process: drop it with --tensor-parallel-size > 1")
        if device != "cpu":
            raise BenchError(f"method '{LLAMACPP}' runs llama.cpp on the CPU: compare it with --device cpu")
        llamacpp_gguf(model)

    def start(self, ctx: BenchContext) -> LlamaCppSession:
        return LlamaCppSession(ctx, llamacpp_gguf(ctx.model))

    def run(self, ctx: BenchContext) -> MethodResult:
        return run_alone(self, ctx)


def import_llama_cpp():
    """The ``llama_cpp`` module, or a one-line ``BenchError`` saying how to install it."""
    try:
        import llama_cpp
    except ImportError:
        raise BenchError(f"{LLAMACPP} row: llama-cpp-python is not installed: {LLAMACPP_INSTALL}") from None
    return llama_cpp


def llamacpp_gguf(model) -> Path:
    """The .gguf file the llama.cpp row runs: the default model's, or ``--model`` when it is a .gguf."""
    gguf = model_gguf_path(model)
    if gguf is None:
        raise BenchError(f"{LLAMACPP} row: llama.cpp needs a .gguf model, got --model {model} (pass --model X.gguf, "
                         "or leave --model out for the default model's GGUF)")
    return gguf


class LlamaCppSession(Session):
    """One ``llama_cpp.Llama`` over the GGUF, ``n_threads`` = ``n_threads_batch`` = the bench's threads,
    a context big enough for the longest prompt and ``max_tokens``; a request reuses the KV of the prefix
    it shares with the one before (llama-cpp-python's ``generate`` keeps the longest common prefix, as
    llama.cpp's server caches prompts), as our rows share cached blocks of earlier requests (prefix
    caching); prefill included in its time like our rows'."""

    def __init__(self, ctx: BenchContext, gguf: Path):
        llama_cpp = import_llama_cpp()
        super().__init__(ctx)
        longest = max((len(ids) for ids in ctx.prompt_ids), default=1)
        n_ctx = -(-(longest + max(ctx.max_tokens, WARMUP_TOKENS) + 1) // 256) * 256
        self.llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=n_ctx, n_threads=ctx.threads,
                                   n_threads_batch=ctx.threads, seed=ctx.seed, verbose=False, logits_all=False)
        self.eos = set(ctx.eos_ids)
        # greedy (temperature 0: llama.cpp's greedy sampler), else plain sampling at the temperature with
        # top-k, top-p, min-p and the repeat penalty off, as in our rows
        greedy = ctx.temperature < 1e-5
        self.sampling = {"temp": 0.0 if greedy else ctx.temperature, "top_k": 1 if greedy else 0, "top_p": 1.0,
                         "min_p": 0.0, "typical_p": 1.0, "repeat_penalty": 1.0}
        self.version = getattr(llama_cpp, "__version__", "?")
        self.gguf = gguf
        self._generate(ctx.prompt_ids[0], WARMUP_TOKENS, 0)

    def _generate(self, ids: list[int], n: int, i: int) -> list[int]:
        if self.sampling["temp"] > 0:
            self.llm.set_seed(self.ctx.seed + i)
        out: list[int] = []
        for t in self.llm.generate(list(ids), reset=True, **self.sampling):
            out.append(int(t))
            if out[-1] in self.eos or len(out) >= n:
                break
        return out

    def result(self) -> MethodResult:
        return MethodResult(self._outputs(), self.wall, details=self._walls(),
                            extra={"llama_cpp_version": self.version, "gguf": str(self.gguf),
                                   "n_threads": self.ctx.threads})

    def close(self) -> None:
        close = getattr(self.llm, "close", None)
        if close is not None:
            close()
        del self.llm
        super().close()


POOL = POOLED_BRANCHES  # n-gram branches: 3 continuations of up to 12 tokens, also from earlier requests
NO_BRANCHES = {"ngram_branch": 0}
# the bench's named presets: row name -> ``speculative_config`` (None: plain decoding). Any other
# configuration is a row of its own through ``--speculative-config NAME=JSON`` (``parse_configs``).
# A bare method name is that method's default configuration (``spec_decode.defaults``: for the model
# drafters a tree chosen every step with pooled n-gram branches); the other rows name each key they change.
PRESETS: dict[str, dict | None] = {
    "none": None,
    # n-gram drafting: the default (up to 3 continuations, pooled from earlier requests, the tokens worth
    # verifying chosen by the cost model), and vLLM's (the most recent match's 5 tokens, all verified)
    "ngram": {"method": "ngram"},
    "ngram-chain": {"method": "ngram", "ngram_verify": "full", "num_speculative_tokens": 5, "prompt_lookup_max": 4,
                    "prompt_lookup_min": 1},
    # the heads shipped for the default model: the default; a chain (argmax of each head, all verified:
    # Medusa-1), a tree sized at start-up, chains cut per step, a tree chosen per step (all by the cost
    # model), and that last one with n-gram branches (= the default, spelled out)
    "medusa": {"method": "medusa"},
    "medusa-chain": {"method": "medusa", "medusa_tree": None, "medusa_verify": "full"},
    "medusa-tree": {"method": "medusa", "medusa_tree": "auto", "medusa_verify": "full", **NO_BRANCHES},
    "medusa-auto": {"method": "medusa", "medusa_tree": None, "medusa_verify": "auto"},
    "medusa-tree-dynamic": {"method": "medusa", "medusa_tree": "auto", "medusa_verify": "auto", **NO_BRANCHES},
    "medusa-tree-dynamic-pool": {"method": "medusa", "medusa_tree": "auto", "medusa_verify": "auto", **POOL},
    # the block drafters shipped for the default model (block 7): the default, and a chain with every
    # draft verified
    "dspark": {"method": "dspark"},
    "dflash": {"method": "dflash"},
    "dspark-chain": {"method": "dspark", "dspark_tree": None},
    "dflash-chain": {"method": "dflash", "dspark_tree": None},
    # DSpark chains: verification length from the start-up cost model, or cut at a confidence
    # threshold; drafts sampled from the corrected distribution (for temperature > 0); the Markov head
    # sharded across tensor-parallel ranks instead of replicated (for the TP comparison)
    "dspark-auto": {"method": "dspark", "dspark_verify": "auto"},
    "dspark-threshold": {"method": "dspark", "dspark_verify": "threshold", "confidence_threshold": 0.3},
    "dspark-prob": {"method": "dspark", "draft_sample_method": "probabilistic"},
    "dspark-sharded": {"method": "dspark", "dspark_tree": None, "markov_replicate": False},
    # draft trees (every branch with its own Markov bias), as many nodes as the cost model finds worth,
    # without and with n-gram branches (the latter = the default, spelled out)
    "dspark-tree": {"method": "dspark", "dspark_tree": "auto", **NO_BRANCHES},
    "dspark-tree-pool": {"method": "dspark", "dspark_tree": "auto", **POOL},
    "dflash-tree": {"method": "dflash", "dspark_tree": "auto", **NO_BRANCHES},
    "dflash-tree-pool": {"method": "dflash", "dspark_tree": "auto", **POOL},
    # the block drafters' weights dense or in 4 bits (default: 8 bits beside a quantized target)
    "dspark-draft-dense": {"method": "dspark", "draft_quantization": "none"},
    "dspark-draft-int4": {"method": "dspark", "draft_quantization": "int4"},
    "dflash-draft-dense": {"method": "dflash", "draft_quantization": "none"},
    "dflash-draft-int4": {"method": "dflash", "draft_quantization": "int4"},
    # the defaults with the datastore shipped for the target (its own answers to training prompts) as one more
    # source of continuations
    "ngram-datastore": {"method": "ngram", "ngram_datastore": "auto"},
    "medusa-datastore": {"method": "medusa", "ngram_datastore": "auto"},
    "dspark-datastore": {"method": "dspark", "ngram_datastore": "auto"},
    # the ceiling: the target as its own drafter (a copy proposing its greedy chain; greedy: every draft
    # accepted); the oracle n-gram is a row of PEERS (computed from the none row's outputs)
    "target": {"method": "target"},
}
# the peers' rows: HF transformers, and llama-cpp-python on the same GGUF (pip install llama-cpp-python==0.3.36)
# and the oracle n-gram (``bench/oracle.py``: computed from the ``none`` row's outputs, nothing runs)
PEERS: dict[str, Callable[[], object]] = {"hf": HFMethod, LLAMACPP: LlamaCppMethod, NGRAM_ORACLE: NgramOracleMethod}
METHOD_ALIASES = {"llamacpp": LLAMACPP}


def parse_configs(items: list[str] | dict | None) -> dict[str, dict]:
    """``--speculative-config NAME=JSON`` items (or a ready dict) -> row name -> ``speculative_config``:
    rows of any configuration, e.g. ``old={"method": "dspark", "model": "ck/old"}`` beside ``dspark``."""
    if isinstance(items, dict):
        return dict(items)
    out: dict[str, dict] = {}
    for item in items or []:
        name, eq, text = item.partition("=")
        name = name.strip()
        if not eq or not name or "," in name:
            raise BenchError(f"--speculative-config takes NAME=JSON (a row name without commas), got {item!r}")
        if name in PRESETS or name in PEERS or name in METHOD_ALIASES:
            raise BenchError(f"--speculative-config: {name!r} is a preset's name; choose another")
        try:
            spec = json.loads(text)
        except json.JSONDecodeError as e:
            raise BenchError(f"--speculative-config {name}: not valid JSON ({e.msg})") from None
        if not isinstance(spec, dict) or not isinstance(spec.get("method"), str):
            raise BenchError(f"--speculative-config {name}: a JSON object with a \"method\" is needed, got {text!r}")
        out[name] = spec
    return out


def method_factory(name: str, configs: dict[str, dict] | None = None) -> Callable[[], object] | None:
    """The runner factory of a row name: one of ``configs`` (``parse_configs``), ``PRESETS`` or ``PEERS``;
    None for an unknown name."""
    name = METHOD_ALIASES.get(name, name)
    if configs and name in configs and configs[name].get("method") == NGRAM_ORACLE:
        return lambda: NgramOracleMethod(name, dict(configs[name]))
    if configs and name in configs:
        return lambda: SpecserveMethod(name, dict(configs[name]))
    if name in PEERS:
        return PEERS[name]
    if name in PRESETS:
        spec = PRESETS[name]
        return lambda: SpecserveMethod(name, dict(spec) if spec else None)
    return None


def parse_methods(spec: str | list[str], configs: dict[str, dict] | None = None) -> list[str]:
    names = [METHOD_ALIASES.get(m.strip(), m.strip())
             for m in (spec.split(",") if isinstance(spec, str) else spec) if m.strip()]
    names += [n for n in configs or {} if n not in names]  # a configured row runs without being listed
    if not names:
        raise BenchError("no methods given")
    unknown = [m for m in names if method_factory(m, configs) is None]
    if unknown:
        raise BenchError(f"unknown method(s) {', '.join(map(repr, unknown))}; presets: "
                         f"{', '.join([*PRESETS, *PEERS])} ({', '.join(METHOD_ALIASES)} = "
                         f"{', '.join(METHOD_ALIASES.values())}); any other configuration: "
                         "--speculative-config NAME=JSON")
    names = list(dict.fromkeys(names))
    if "none" in names:
        names.remove("none")
    return ["none"] + names  # the baseline always runs first: every row is compared with it


def parse_dtypes(spec: str | list[str], device: str = "cpu") -> list[str]:

    names = comma_list(spec)
    if not names:
        raise BenchError("no dtype given")
    out = []
    for d in names:
        if d != "auto" and d not in DTYPES:
            raise BenchError(f"unknown dtype {d!r}; choose from auto, float32, bfloat16, float16")
        out.append(str(resolve_dtype(d, device)).removeprefix("torch."))
    return list(dict.fromkeys(out))


def comma_list(spec: str | list[str]) -> list[str]:
    return [x.strip() for x in (spec.split(",") if isinstance(spec, str) else spec) if x and x.strip()]


def resolve_format(dtype: str, quantization: str | None, model=None, device: str = "cpu",
                   tensor_parallel_size: int = 1) -> tuple[str, str | None]:
    """The concrete (dtype name, quantization) that ``LLM(model, dtype=dtype, quantization=quantization)``
    runs on ``device``: the engine's own rules (``model_runner.resolve_quantization``: "auto" is a
    GGUF's own quantization unless float32 is asked for, dense for an HF directory; an "auto" dtype is
    bfloat16 for quantized weights), so that a row's label is what ran."""

    if dtype != "auto" and dtype not in DTYPES:
        raise BenchError(f"unknown dtype {dtype!r}; choose from auto, float32, bfloat16, float16")
    if quantization is not None and quantization not in QUANTIZATION_NAMES:
        raise BenchError(f"unknown quantization {quantization!r}; choose from {', '.join(QUANTIZATION_NAMES)}")
    is_gguf = model_gguf_path(model) is not None
    try:
        q = resolve_quantization(quantization, dtype, is_gguf, device, tensor_parallel_size)
    except ValueError as e:
        raise BenchError(f"--quantization {quantization}: {e}") from None
    dt = resolve_dtype("bfloat16" if q and dtype == "auto" else dtype, device)
    return str(dt).removeprefix("torch."), q


def parse_formats(dtypes: str | list[str], quantizations: str | list[str], model=None,
                  device: str = "cpu", tensor_parallel_size: int = 1) -> list[tuple[str, str | None]]:
    """Every (dtype, quantization) pair of two comma lists, resolved (``resolve_format``), in the
    order dtype by dtype, duplicates dropped."""
    ds, qs = comma_list(dtypes), comma_list(quantizations)
    if not ds:
        raise BenchError("no dtype given")
    if not qs:
        raise BenchError("no quantization given")
    return list(dict.fromkeys(resolve_format(d, q, model, device, tensor_parallel_size) for d in ds for q in qs))


def weights_label(quantization: str | None, gguf_type: str | None = None, activations: str = "bfloat16") -> str:
    """The weight format as the table shows it: dense, int8, int4, gguf Q4_1; ", a8" with 8-bit activations."""
    if quantization is None:
        return "dense"
    label = f"gguf {gguf_type}" if quantization == "gguf" and gguf_type else quantization
    return label + (", a8" if activations == "int8" else "")


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
              interleave: bool = True, device: str | None = "auto",
              quantizations: str | list[str] = "auto", sampling_mode: str = "coupled",
              speculative_configs: list[str] | dict | None = None, speculation_gate: bool | None = None,
              activations: str = "bfloat16") -> list[dict]:
    """Run every method at every (dtype, weight format) pair; returns one row (a dict) per (dtype,
    quantization, method). ``interleave`` (one process only): see ``_run_methods``."""

    log = log or (lambda s: None)
    configs = parse_configs(speculative_configs)
    names = parse_methods(methods, configs)
    runners = {n: method_factory(n, configs)() for n in names}

    try:
        device = resolve_device(device, tensor_parallel_size)
    except ValueError as e:
        raise BenchError(str(e)) from None
    for r in runners.values():  # before anything loads
        _check(r, model=model, device=device, tensor_parallel_size=tensor_parallel_size)
    if device != "cpu" and tensor_parallel_size > 1:
        raise BenchError("--tensor-parallel-size > 1 runs gloo processes on CPU: use --device cpu")
    groups = parse_formats(dtypes, quantizations, model, device, tensor_parallel_size)
    if max_tokens < 1:
        raise BenchError(f"--max-tokens must be >= 1, got {max_tokens}")
    if temperature < 0:
        raise BenchError(f"--temperature must be >= 0, got {temperature}")
    if sampling_mode not in SAMPLING_MODES:
        raise BenchError(f"--sampling-mode must be coupled or rejection, got {sampling_mode!r}")
    if threads is not None and threads < 1:
        raise BenchError(f"--threads must be >= 1, got {threads}")
    if tensor_parallel_size < 1:
        raise BenchError(f"--tensor-parallel-size must be >= 1, got {tensor_parallel_size}")
    if tensor_parallel_size > 1 and "hf" in names:
        raise BenchError("method 'hf' runs on one process: drop it with --tensor-parallel-size > 1")
    if num_prompts is not None and num_prompts < 1:
        raise BenchError(f"--num-prompts must be >= 1, got {num_prompts}")
    labels = None  # each prompt's category, with --prompts categories | category:NAME
    if is_category_spec(prompts_file):  # --num-prompts: per category
        try:
            labels, texts = map(list, zip(*category_prompts(prompts_file, num_prompts)))
        except DataError as e:
            raise BenchError(str(e)) from None
    else:
        texts = load_prompts(prompts_file)
        if num_prompts is not None:
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

    cfg_eos = read_config(model_dir).eos_token_id
    cfg_eos = [cfg_eos] if isinstance(cfg_eos, int) else list(cfg_eos or [])
    eos_ids = list(dict.fromkeys((tok.eos_token_ids or []) + cfg_eos))
    interleaved = interleave and tensor_parallel_size == 1  # TP: one set of worker processes at a time
    gguf_type = gguf_file_type(model_gguf_path(model))

    rows = []
    for dtype, quant in groups:
        ctx = BenchContext(model, model_dir, dtype, prompt_ids, eos_ids, max_tokens, temperature, seed, threads,
                           tensor_parallel_size, device, quant, sampling_mode, speculation_gate, activations)
        ran = [n for n in names if not getattr(runners[n], "derived", False)]
        results = _run_methods(runners, ran, ctx, interleaved, log)
        for n in names:  # rows computed from plain decoding's outputs (the oracle n-gram)
            if n not in results:
                results[n] = derived_result(runners[n], ctx, results["none"])
        group = group_rows(names, runners, results, ctx, gguf_type,
                           {"interleaved": interleaved, "model_dir": str(model_dir)})
        if labels:
            for row in group:
                row["categories"] = category_figures(labels, results[row["method"]], results["none"])
        rows += group
    return rows


def derived_result(runner, ctx: BenchContext, base: MethodResult) -> MethodResult:
    """The result of a row computed from plain decoding's (``runner.derive``: per-prompt metrics)."""
    per_prompt = runner.derive(ctx, base)
    total = SpecMetrics()
    for m in per_prompt:
        total.merge(m)
    d = total.as_dict()
    extra = {k: d[k] for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "first_rejected_per_position")}
    return MethodResult(list(base.outputs), 0.0, d["mean_acceptance_length"], d["acceptance_rate_per_position"],
                        extra={"simulated": True, **extra}, details={"metrics": per_prompt})


def _check(runner, **setup) -> None:
    """``runner.check`` with the keywords of ``setup`` it takes (none, some or all)."""
    check = getattr(runner, "check", None)
    if check is None:
        return
    params = inspect.signature(check).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        check(**setup)
    else:
        check(**{k: v for k, v in setup.items() if k in params})


def group_rows(names: list[str], runners: dict, results: dict[str, MethodResult], ctx: BenchContext,
               gguf_type: str | None = None, common: dict | None = None) -> list[dict]:
    """The rows of one (dtype, weight format) group: tok/s, speed-up over ``none`` (and over the
    ``llama.cpp`` row, when there is one), identity with ``none`` (greedy; for information only for
    a method with ``identity_informational``), acceptance and the method's extras."""
    greedy = ctx.temperature < 1e-5
    coupled = ctx.sampling_mode == "coupled"
    tps_of = {n: (r.generated_tokens / r.wall_s if r.wall_s > 0 else 0.0) for n, r in results.items()}
    base, base_tps = results["none"], tps_of["none"]
    ref_tps = tps_of.get(LLAMACPP)
    rows = []
    for name in names:
        res, tps, runner = results[name], tps_of[name], runners[name]
        quant = getattr(runner, "quantization", ctx.quantization)
        derived = getattr(runner, "derived", False)  # computed from none's outputs: no speed, no identity
        comparable = not derived and (greedy or (coupled and isinstance(runner, SpecserveMethod)))
        identical, divergent, mismatched = compare(base.outputs, res.outputs) if comparable else (None, None, None)
        row = {
            "method": name,
            "dtype": ctx.dtype,
            "quantization": quant,
            "weights": weights_label(quant, gguf_type, ctx.activations if isinstance(runner, SpecserveMethod)
                                     else "bfloat16"),
            "tokens_per_s": None if derived else round(tps, 3),
            "speedup_vs_none": round(tps / base_tps, 4) if base_tps and not derived else None,
        }
        if ref_tps is not None:
            row["speedup_vs_llamacpp"] = round(tps / ref_tps, 4) if ref_tps and not derived else None
        informational = getattr(runner, "identity_informational", False)
        row.update({
            "num_prompts": len(ctx.prompt_ids),
            "max_tokens": ctx.max_tokens,
            "temperature": ctx.temperature,
            "generated_tokens": res.generated_tokens,
            "wall_s": round(res.wall_s, 4),
            # informational rows (llama.cpp) are never marked identical or not: see the divergence counts
            "identical_to_none": None if informational else identical,
            "divergent_prompts": divergent,
            "length_mismatches": mismatched,
            "mean_acceptance_length": res.mean_acceptance_length,
            "acceptance_rate_per_position": res.acceptance_rate_per_position,
            "tensor_parallel_size": ctx.tensor_parallel_size,
            "threads": ctx.threads,
            "device": ctx.device,
            **(common or {}),
            **res.extra,
        })
        if informational and greedy:
            row["identity_informational"] = True
            row["mean_common_prefix_tokens"] = round(common_prefix(base.outputs, res.outputs), 2)
        rows.append(row)
    return rows


def common_prefix(base: list[list[int]], other: list[list[int]]) -> float:
    """Mean over prompts of the number of leading tokens two runs share."""
    n = []
    for a, b in zip(base, other):
        k = 0
        while k < min(len(a), len(b)) and a[k] == b[k]:
            k += 1
        n.append(k)
    return sum(n) / len(n) if n else 0.0


def _run_methods(runners: dict, names: list[str], ctx: BenchContext, interleave: bool, log) -> dict[str, MethodResult]:
    """Every method's result. Interleaved: all methods loaded at once, then prompt by prompt through
    each of them (the order rotating from prompt to prompt), so that a machine getting faster or
    slower during the run (thermal or frequency changes, noisy neighbours) weighs on every row alike.
    Else one method after the other (tensor parallelism: one set of worker processes at a time)."""
    n = len(ctx.prompt_ids)
    where = f"{ctx.threads} threads" if ctx.device == "cpu" else ctx.device
    what = (f"({ctx.dtype}, {weights_label(ctx.quantization, activations=ctx.activations)} weights, {n} prompts x "
            f"{ctx.max_tokens} tokens, {where})")
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
    """method | dtype | weights | tok/s | vs none | vs llama.cpp (when a llama.cpp row ran) | ours/hf |
    identical | mean acc. length | tokens | ms per decoding step | of which drafting | tokens verified
    per step."""
    ref = any("speedup_vs_llamacpp" in r for r in rows)
    head = ["method", "dtype", "weights", "tok/s", "vs none"] + (["vs llama.cpp"] if ref else []) + [
        "ours/hf", "identical", "acc.len", "tokens", "ms/step", "draft ms", "verified/step"]
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
        elif r.get("identity_informational"):
            ident = f"info: {r['divergent_prompts']} differ" if r["divergent_prompts"] else "info: same"
        body.append([r["method"], "-" if r["method"] == LLAMACPP else r["dtype"], r.get("weights", "dense"),
                     "-" if r["tokens_per_s"] is None else f"{r['tokens_per_s']:.1f}", _ratio(r["speedup_vs_none"])]
                    + ([_ratio(r.get("speedup_vs_llamacpp"))] if ref else [])
                    + [ours_hf, ident, f"{r['mean_acceptance_length']:.2f}", str(r["generated_tokens"])]
                    + ([f"{r['ms_per_step']:.1f}", f"{r['draft_ms_per_step']:.1f}",
                        f"{r['verified_tokens_per_step']:.1f}"]
                       if "ms_per_step" in r else ["-"] * 3))
        if tp:
            step = r.get("collectives_per_draft_step")
            body[-1] += [f"{r.get('collectives_per_token', 0):.1f}",
                         "-" if step is None else (" + ".join(f"{v} {k}" for k, v in sorted(step.items())) or "0")]
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(head)]
    left = {"method", "dtype", "weights", "identical"}
    line = lambda cells: "  ".join(c.ljust(w) if head[i] in left else c.rjust(w)  # noqa: E731
                                   for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([line(head), line(["-" * w for w in widths])] + [line(b) for b in body])


def _ratio(v: float | None) -> str:
    return f"{v:.2f}x" if v is not None else "-"


def write_json(rows: list[dict], path: str | os.PathLike) -> None:
    p = Path(path)
    if p.parent and not p.parent.exists():
        p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(rows, indent=2) + "\n")


def main_log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
