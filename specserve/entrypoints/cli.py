"""The ``specserve`` command: ``generate``, ``serve``, ``bench-serve``, ``convert``, ``bench``, ``perplexity``,
``demo`` and ``train``.

Errors a user can fix (a missing model path, a bad argument, a value the engine rejects) print
``error: <message>`` to stderr and exit with status 2, without a traceback."""

from __future__ import annotations

import argparse
import os
import sys
import time

from specserve import LLM, SamplingParams, __version__
from specserve.bench import perplexity
from specserve.bench.categories import format_category_table
from specserve.bench.harness import PRESETS, format_table, main_log, run_bench, write_json
from specserve.config import ACTIVATIONS, QUANTIZATION_NAMES, SAMPLING_MODES
from specserve.models.gguf import convert
from specserve.spec_decode.ngram.branches import POOLED_BRANCHES as DEMO_BRANCHES
from specserve.train.dspark import DSparkTrainArgs, train_dspark
from specserve.train.medusa import MedusaTrainArgs, train_medusa
from specserve.train.common import distill_only
from specserve.train.data import stderr_log
from specserve.train.options import TrainOptions, add_options, from_namespace, given
from specserve.train.options import nonneg_int as _nonneg_int
from specserve.train.options import positive_int as _positive_int

EXIT_USAGE = 2
# a chat turn like the drafters' held-out prompts; the shipped drafters accept a little less on it than
# their average over `specserve bench --prompts chitchat-heldout` (the former question, "Explain in three
# sentences why the sky is blue.", was among their worst: tau 1.2 against ~1.9 on average)
DEMO_QUESTION = "What do you like to do on weekends?"
DEMO_TOKENS = 96  # a demo answer's tokens


class CLIError(Exception):
    pass


# ---- argument parsing ---------------------------------------------------------------------------
def _json_object(s: str) -> dict:
    import json

    try:
        v = json.loads(s)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e}): {s!r}") from None
    if not isinstance(v, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {s!r}")
    return v


QUANTIZATION_HELP = ("weights: auto (the engine's choice: a .gguf, and the default model, in its own quantization "
                     "on CPU unless the dtype is float32; an HF directory dense), none (dense), gguf (the GGUF's own "
                     "blocks), int8 or int4 (weight-only, quantized at load)")


def _quantization(s: str) -> str:
    if s not in QUANTIZATION_NAMES:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(QUANTIZATION_NAMES)}, got {s!r}")
    return s


def quantization_arg(value: str | None) -> str | None:
    """``--quantization`` as ``LLM`` takes it: "none" is None."""
    return None if value in (None, "none") else value


def _add_model_args(p: argparse.ArgumentParser, dtype_help: str = "auto | float32 | bfloat16 | float16",
                    device: bool = True, quantization: str | None = None) -> None:
    """--model, --dtype, --device (unless ``device`` is False) and, when ``quantization`` is "one" or
    "list", --quantization (one value, or a comma list like --dtype's)."""
    p.add_argument("--model", default=None,
                   help="HF model directory or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="auto", help=dtype_help + " (default: auto)")
    if quantization == "one":
        p.add_argument("--quantization", type=_quantization, default="auto",
                       metavar="{" + ",".join(QUANTIZATION_NAMES) + "}", help=QUANTIZATION_HELP + " (default: auto)")
    elif quantization == "list":
        p.add_argument("--quantization", default="auto", metavar="Q[,Q...]",
                       help=QUANTIZATION_HELP + "; a comma list to run each with each --dtype (default: auto)")
    if device:  # the trainers run on the CPU
        p.add_argument("--device", default="auto",
                       help="auto | cpu | cuda | cuda:N (default auto: a CUDA GPU when torch sees one and the model "
                            "runs in one process, else the CPU; $SPECSERVE_DEVICE overrides auto)")


def _add_spec_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--speculative-method", default=None, metavar="METHOD",
                   help="drafter for lossless speculative decoding (e.g. ngram); default: plain decoding")
    p.add_argument("--num-speculative-tokens", type=_positive_int, default=None, metavar="K",
                   help="drafts per step at most, as deep as a draft goes (default: the drafter's own: ngram 5, "
                        "Medusa one per head, DSpark/DFlash the block); the cost models verify fewer where it pays")
    p.add_argument("--speculative-model", default=None, metavar="PATH", help="the drafter's checkpoint, if any")
    p.add_argument("--prompt-lookup-max", type=_positive_int, default=4, help="ngram: longest n-gram to match")
    p.add_argument("--prompt-lookup-min", type=_positive_int, default=1, help="ngram: shortest n-gram to match")
    p.add_argument("--speculative-config", type=_json_object, default=None, metavar="JSON",
                   help="the whole speculative_config as a JSON object (vLLM's flag), e.g. "
                        "'{\"method\": \"dspark\", \"dspark_tree\": \"auto\"}'; the flags above add to it")


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    """The engine's flags (``generate`` and ``serve``): model, dtype, device, quantization, sampling mode,
    tensor parallelism, threads, batch and cache sizes, speculative decoding."""
    _add_model_args(p, quantization="one")
    p.add_argument("--sampling-mode", choices=SAMPLING_MODES, default="coupled",
                   help="coupled (default): a seeded request gives plain decoding's tokens for that seed with any "
                        "drafter; rejection: vLLM's rejection sampler (exact in distribution)")
    p.add_argument("--tensor-parallel-size", "-tp", type=_positive_int, default=1)
    p.add_argument("--threads", type=_positive_int, default=None, help="torch CPU threads")
    p.add_argument("--max-num-seqs", type=_positive_int, default=16,
                   help="sequences decoded together at most (default 16)")
    p.add_argument("--max-model-len", type=_positive_int, default=None,
                   help="prompt + output tokens per sequence at most (default: the model's)")
    p.add_argument("--kv-cache-memory", type=float, default=None, metavar="GIB",
                   help="GiB of paged KV cache (default: room for max-num-seqs x max-model-len, at most a quarter "
                        "of the memory)")
    p.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   help="do not share the KV blocks of common prompt prefixes")
    p.add_argument("--speculation-gate", choices=("on", "off"), default="on",
                   help="on (default): draft only at batch sizes where steps with drafts emit tokens faster than "
                        "plain steps (measured as it runs); off: every step drafts")
    _add_activations_arg(p)
    _add_spec_args(p)


def _add_activations_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--activations", choices=ACTIVATIONS, default="bfloat16",
                   help="what quantized weights multiply: bfloat16 (default; every product exact) or int8 (x in "
                        "8-bit groups of 32, as llama.cpp's kernels: cheaper verification, other tokens in places)")


def engine_kwargs(args) -> dict:
    """``LLM(...)`` keyword arguments from the engine's flags (``_add_engine_args``)."""
    return dict(model=args.model, dtype=args.dtype, tensor_parallel_size=args.tensor_parallel_size,
                num_threads=args.threads, speculative_config=speculative_config_from_args(args), device=args.device,
                quantization=quantization_arg(args.quantization), sampling_mode=args.sampling_mode,
                max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                kv_cache_memory=args.kv_cache_memory, enable_prefix_caching=args.enable_prefix_caching,
                speculation_gate=args.speculation_gate == "on", activations=args.activations)


def speculative_config_from_args(args) -> dict | None:
    """``--speculative-config`` with ``--speculative-method``/``-model``/``--num-speculative-tokens`` added
    (a flag that contradicts the JSON is an error); None: plain decoding."""
    cfg = dict(args.speculative_config or {})
    for key, flag, value in (("method", "--speculative-method", args.speculative_method),
                             ("model", "--speculative-model", args.speculative_model),
                             ("num_speculative_tokens", "--num-speculative-tokens", args.num_speculative_tokens)):
        if value is None:
            continue
        if key in cfg and cfg[key] != value:
            raise CLIError(f"{flag} {value!r} contradicts --speculative-config's {key!r}: {cfg[key]!r}")
        cfg[key] = value
    if not cfg:
        return None
    if "method" not in cfg:
        raise CLIError("--speculative-config needs a \"method\" (or give --speculative-method)")
    if cfg["method"] == "ngram":
        cfg.setdefault("prompt_lookup_max", args.prompt_lookup_max)
        cfg.setdefault("prompt_lookup_min", args.prompt_lookup_min)
    return cfg


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specserve",
                                     description="Lossless speculative decoding for LLM inference.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    g = sub.add_parser("generate", help="generate text for one prompt, streamed to stdout",
                       description="Generate text for one prompt, streamed to stdout; stats go to stderr.")
    _add_engine_args(g)
    g.add_argument("--prompt", required=True, help="the prompt text")
    g.add_argument("--chat", action="store_true", help="send the prompt as a user message through the chat template")
    g.add_argument("--max-tokens", type=_positive_int, default=128, help="tokens to generate at most (default 128)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default 0)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1, help="-1 = off")
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None, help="seed of this request's sampling")
    g.add_argument("--stop", nargs="+", action="extend", default=None, metavar="STR",
                   help="stop strings (not included in the output)")
    g.set_defaults(func=cmd_generate)

    _add_serve_parser(sub)

    c = sub.add_parser("convert", help="convert a .gguf file to an HF model directory")
    c.add_argument("gguf", metavar="IN.gguf")
    c.add_argument("out_dir", metavar="OUT_DIR")
    c.set_defaults(func=cmd_convert)

    b = sub.add_parser("bench", help="tokens/s of each method on the same prompts, one request at a time",
                       description="Run each method on the same prompts (same token ids), one request at a "
                                   "time, and report tokens/s, speed-up over plain decoding and whether greedy "
                                   "outputs are identical to plain decoding.")
    _add_model_args(b, "auto | float32 | bfloat16 | float16, or a comma list to run each", quantization="list")
    b.add_argument("--methods", default="none,hf",
                   help="comma list of rows (default none,hf): presets (" + ", ".join(PRESETS) + "), peers "
                        "(hf; llama.cpp: llama-cpp-python on the same .gguf, same prompt ids and threads, pip "
                        "install llama-cpp-python==0.3.36, with a 'vs llama.cpp' column) and the names of "
                        "--speculative-config rows; 'none' (the baseline) always runs")
    b.add_argument("--speculative-config", action="append", default=[], metavar="NAME=JSON",
                   help="one more row named NAME with this speculative_config, e.g. "
                        "'old={\"method\": \"dspark\", \"model\": \"ck/old\"}' (repeatable)")
    b.add_argument("--prompts", default=None, metavar="FILE",
                   help="JSONL with a \"prompt\" field per line, or plain text with one prompt per line, or "
                        "'chitchat-heldout' / 'instructions-heldout' / 'sharegpt-heldout' (the held-out splits "
                        "of the drafters' training prompt sources; default: the built-in set), or 'categories' / "
                        "'category:NAME[,NAME]' (held-out prompts by category: coding, math, extraction, qa, "
                        "summary, writing, roleplay, advice; --num-prompts per category; a table per category "
                        "follows the main one)")
    b.add_argument("--num-prompts", type=_positive_int, default=None, help="use the first N prompts (default all)")
    b.add_argument("--max-tokens", type=_positive_int, default=128, help="tokens per request at most (default 128)")
    b.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default 0)")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--sampling-mode", choices=SAMPLING_MODES, default="coupled",
                   help="how specserve rows sample at --temperature > 0 (default coupled: each request's tokens "
                        "are plain decoding's with its seed, so they are compared too)")
    b.add_argument("--threads", type=_positive_int, default=None,
                   help="torch CPU threads for every method (default: torch's default)")
    b.add_argument("--speculation-gate", choices=("on", "off"), default="on",
                   help="the specserve rows' speculation gate (default on, as LLM's; off: every step drafts, "
                        "so tau measures the drafter on every step)")
    _add_activations_arg(b)
    b.add_argument("--tensor-parallel-size", type=_positive_int, default=1,
                   help="run every specserve row over N processes (gloo); rows then report collectives per "
                        "token and per drafting step (default 1)")
    b.add_argument("--no-interleave", dest="interleave", action="store_false",
                   help="run the methods one after the other instead of loading them all and interleaving "
                        "them prompt by prompt (default: interleaved, so drifts of the machine's speed hit "
                        "every row alike)")
    b.add_argument("--json", default=None, metavar="OUT", help="write the rows as a JSON list to OUT")
    b.set_defaults(func=cmd_bench)

    px = sub.add_parser("perplexity", help="perplexity of the model in each weight format on held-out text",
                        description="Perplexity of the target in each weight format (float32, bfloat16, int8, "
                                    "int4, gguf) on the same held-out text, fed in chunks through the engine's "
                                    "own forward.")
    px.add_argument("--model", default=None,
                    help="HF model directory or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    px.add_argument("--formats", default=None, metavar="F[,F...]",
                    help="comma list of weight formats: float32, bfloat16, int8, int4, gguf (a .gguf or the default "
                         "model only), int4-a8 and gguf-a8 (with 8-bit activations), or DTYPE+QUANTIZATION (e.g. "
                         "float32+int8) (default: every one without -a8 that applies)")
    px.add_argument("--dtype", default=None,
                    help="with --quantization (or alone): one format, DTYPE+QUANTIZATION, instead of --formats")
    px.add_argument("--quantization", type=_quantization, default=None,
                    metavar="{" + ",".join(QUANTIZATION_NAMES) + "}", help="see --dtype")
    px.add_argument("--text", default=None, metavar="FILE",
                    help="plain UTF-8 text to score (default: chitchat-heldout, the chitchat conversations held out "
                         "of the drafters' training)")
    px.add_argument("--max-tokens", type=_positive_int, default=4096,
                    help="tokens of text to score at most (default 4096)")
    px.add_argument("--context", type=_positive_int, default=1024,
                    help="tokens per window: each window starts again at position 0 (default 1024)")
    px.add_argument("--chunk", type=_positive_int, default=256, help="tokens per forward (default 256)")
    px.add_argument("--threads", type=_positive_int, default=None, help="torch CPU threads")
    px.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N (default auto)")
    px.add_argument("--json", default=None, metavar="OUT", help="write the rows as a JSON list to OUT")
    px.set_defaults(func=cmd_perplexity)

    d = sub.add_parser("demo", help="stream a short chat answer from the default model and report tokens/s")
    d.add_argument("--threads", type=_positive_int, default=None, help="torch CPU threads")
    d.add_argument("--dtype", default="auto",
                   help="auto | float32 | bfloat16 (default auto: float32 on CPU; bfloat16 on a CPU with AVX512 "
                        "is batch-invariant, so speculative decoding still gives plain decoding's text)")
    d.add_argument("--quantization", type=_quantization, default="auto",
                   metavar="{" + ",".join(QUANTIZATION_NAMES) + "}", help=QUANTIZATION_HELP + " (default: auto)")
    d.set_defaults(func=cmd_demo)

    t = sub.add_parser("train", help="train a drafter on the target's own outputs",
                       description="Train a drafter for speculative decoding on the target's own outputs "
                                   "(self-distillation).")
    tsub = t.add_subparsers(dest="trainer", metavar="DRAFTER")
    tsub.required = True
    _add_train_parsers(tsub)
    return parser


def _add_serve_parser(sub) -> None:
    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (completions, chat, metrics)",
                       description="Serve the model over an OpenAI-compatible HTTP API (/v1/completions, "
                                   "/v1/chat/completions, /v1/models, /health, /metrics, /tokenize, /detokenize) "
                                   "with continuous batching and the engine's speculative decoding. Ctrl-C or "
                                   "SIGTERM aborts the requests in flight and stops. See docs/serving.md.")
    s.add_argument("model_arg", nargs="?", default=None, metavar="MODEL",
                   help="HF model directory or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    _add_engine_args(s)
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    s.add_argument("--port", type=_nonneg_int, default=8000, help="port (default 8000; 0: any free port)")
    s.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route (default: $SPECSERVE_API_KEY, else open)")
    s.add_argument("--served-model-name", default=None, help="the model's name in the API (default: from the path)")
    s.add_argument("--max-num-queued-requests", type=_nonneg_int, default=256,
                   help="sequences that may wait beyond --max-num-seqs; more get 429 with Retry-After (default 256)")
    s.add_argument("--max-n", type=_positive_int, default=16, help="choices per request at most (default 16)")
    s.add_argument("--max-tokens-cap", type=_positive_int, default=None,
                   help="max_tokens a request may ask for (default: max-model-len)")
    s.add_argument("--max-stop", type=_positive_int, default=16, help="stop strings per request at most (default 16)")
    s.add_argument("--max-body-bytes", type=_positive_int, default=1 << 20,
                   help="request body size at most (default 1 MiB; larger: 413)")
    s.add_argument("--max-header-bytes", type=_positive_int, default=32 * 1024,
                   help="request line + headers size at most (default 32 KiB)")
    s.add_argument("--log-level", default="warning", choices=("debug", "info", "warning", "error"),
                   help="uvicorn's log level (default warning)")
    s.set_defaults(func=cmd_serve)

    b = sub.add_parser("bench-serve", help="load OpenAI-compatible servers at fixed concurrencies, with a plot",
                       description="Send streamed chat requests (temperature 0) to servers at fixed concurrencies "
                                   "and report output tokens/s, time to first token, inter-token and end-to-end "
                                   "latency percentiles side by side, with a PNG. The servers run already "
                                   "(--server) or are started here one after the other (--configs). See "
                                   "docs/serving.md.")
    b.add_argument("--server", action="append", default=[], metavar="LABEL=URL",
                   help="a running server, e.g. plain=http://127.0.0.1:8000 (repeat for more)")
    b.add_argument("--configs", default=None, metavar="C[,C...]",
                   help="start `specserve serve` for each speculative configuration in turn: the bench's presets "
                        "(specserve bench --help), or LABEL={json} entries separated by ';' "
                        "(default when no --server: none,medusa-tree-dynamic)")
    b.add_argument("--serve-args", default="", metavar="ARGS",
                   help="more flags for the servers started here, e.g. '--threads 2 --max-num-seqs 8'")
    b.add_argument("--concurrency", default="1,2,4,8", metavar="N[,N...]", help="levels (default 1,2,4,8)")
    b.add_argument("--num-requests", type=_positive_int, default=16,
                   help="requests per level (at least the concurrency; default 16)")
    b.add_argument("--max-tokens", type=_positive_int, default=64, help="tokens per request at most (default 64)")
    b.add_argument("--ignore-eos", action="store_true", help="every request generates --max-tokens tokens")
    b.add_argument("--prompts", default=None, metavar="FILE",
                   help="as `specserve bench --prompts` (default: the built-in set), sent as chat messages")
    b.add_argument("--api-key", default=None, help="the servers' API key, if any")
    b.add_argument("--out", default="bench-serve.png", metavar="PNG", help="the plot (default bench-serve.png)")
    b.add_argument("--json", default=None, metavar="OUT", help="write the rows as JSON to OUT")
    b.set_defaults(func=cmd_bench_serve)


def _add_train_parsers(tsub) -> None:
    # ``specserve train NAME``: (help, description, options class, options left out, handler)
    trainers = {
        "medusa": ("Medusa-1 heads on the frozen target",
                   "Train Medusa heads (Medusa-1: the target stays frozen). The target answers the prompts itself, its "
                   "final hidden states are computed once (--feature-dtype), then the heads learn to predict the "
                   "tokens 2, 3, ... positions ahead. Writes config.json, medusa.safetensors and README.md to --out "
                   "and reports per-head accuracy on held-out prompts.", MedusaTrainArgs, (), cmd_train_medusa),
        "dspark": ("a DSpark (or DFlash) block drafter on the frozen target",
                   "Train an anchor-first block drafter (DSpark: Markov head + confidence head; --markov-rank 0: a "
                   "DFlash baseline with the same recipe) on the frozen target. The target answers the prompts itself, "
                   "the outputs of its --target-layer-ids layers are computed once, then the drafter learns to draft "
                   "the next --block-size tokens after an anchor from them. Writes a DeepSpec-format checkpoint "
                   "(speculators format with --draft-vocab-size) (config.json, model.safetensors) and README.md to "
                   "--out and reports per-position acceptance estimates on held-out prompts.", DSparkTrainArgs, (),
                   cmd_train_dspark),
        # the data options the trainers share, none about the drafter
        "distill": ("self-distillation alone: the target's responses into a --distill-store",
                    "Let the target answer the prompts of the data options (the same options and the same responses as "
                    "`train medusa` / `train dspark`), into --distill-store DIR: token ids, compressed, a part saved "
                    "every 400 prompts, so a stopped run continues where it stopped and a later training run with the "
                    "same store generates nothing. Trains nothing.", TrainOptions,
                    ("out", "draft_vocab_size", "eval_only", "progress", "save_every_min", "resume"),
                    cmd_train_distill),
    }
    for name, (help_text, description, cls, skip, handler) in trainers.items():
        m = tsub.add_parser(name, help=help_text, description=description)
        add_options(m, cls, skip=skip)
        m.set_defaults(func=handler)


def _version() -> str:
    try:

        return __version__
    except Exception:
        return "?"


# ---- commands -----------------------------------------------------------------------------------
def _stream(llm, prompt, params, out=sys.stdout) -> tuple[float, object]:
    t0 = time.perf_counter()
    for delta in llm.stream(prompt, params):
        out.write(delta)
        out.flush()
    out.write("\n")
    out.flush()
    return time.perf_counter() - t0, llm.last_output


def cmd_generate(args) -> int:

    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                            seed=args.seed, max_tokens=args.max_tokens, stop=args.stop)
    llm = LLM(**engine_kwargs(args))
    try:
        if args.chat:
            prompt = {"prompt": args.prompt,
                      "prompt_token_ids": llm.tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}])}
        else:
            prompt = args.prompt
        wall, out = _stream(llm, prompt, params)
        comp = out.outputs[0]
        n = len(comp.token_ids)
        st = llm.engine.stats
        decode = f", decode {st.decode_tokens / st.decode_s:.1f} tok/s" if st.decode_s > 0 else ""
        if llm.engine.proposer.name != "none":
            m = llm.get_metrics()
            decode += (f", {llm.engine.proposer.name}: mean acceptance length {m['mean_acceptance_length']:.2f}, "
                       f"{m['num_accepted_tokens']}/{m['num_draft_tokens']} drafts accepted")
        print(f"[specserve] {n} tokens in {wall:.2f} s: {n / wall if wall > 0 else 0.0:.1f} tok/s{decode}, "
              f"prompt {len(out.prompt_token_ids)} tokens, finish_reason={comp.finish_reason}",
              file=sys.stderr, flush=True)
    finally:
        llm.shutdown()
    return 0


def cmd_serve(args) -> int:
    if args.model_arg is not None:
        if args.model is not None and args.model != args.model_arg:
            raise CLIError(f"two models given: {args.model_arg!r} and --model {args.model!r}")
        args.model = args.model_arg
    try:
        from specserve.entrypoints.openai.server import serve_from_args
    except ImportError as e:
        raise CLIError(f"serving needs the 'serve' extra (pip install -e '.[serve]'): {e}") from None
    return serve_from_args(args, engine_kwargs(args))


def cmd_bench_serve(args) -> int:
    from specserve.bench.serve_bench import main as bench_serve

    return bench_serve(args)


def cmd_convert(args) -> int:
    from pathlib import Path

    src = Path(args.gguf)
    if not src.is_file():
        raise CLIError(f"no such file: {args.gguf}")

    out = convert(src, args.out_dir)
    files = ", ".join(sorted(p.name for p in Path(out).iterdir() if p.is_file()))
    print(f"wrote an HF model directory to {out} ({files})")
    return 0


def cmd_bench(args) -> int:

    rows = run_bench(model=args.model, methods=args.methods, speculative_configs=args.speculative_config,
                     prompts_file=args.prompts, num_prompts=args.num_prompts,
                     max_tokens=args.max_tokens, temperature=args.temperature, dtypes=args.dtype,
                     threads=args.threads, seed=args.seed, log=main_log,
                     tensor_parallel_size=args.tensor_parallel_size, interleave=args.interleave,
                     device=args.device, quantizations=args.quantization, sampling_mode=args.sampling_mode,
                     speculation_gate=args.speculation_gate == "on", activations=args.activations)
    r0 = rows[0]
    tp = f" over {r0['tensor_parallel_size']} TP ranks" if r0["tensor_parallel_size"] > 1 else ""
    where = f"{r0['threads']} threads{tp}" if r0["device"] == "cpu" else r0["device"]
    print(f"{r0['num_prompts']} prompts, max {r0['max_tokens']} tokens, temperature {r0['temperature']}, "
          f"{where}, batch size 1, speculation gate {args.speculation_gate}, "
          f"{'methods interleaved prompt by prompt' if r0['interleaved'] else 'one method after the other'}; "
          "tok/s = generated tokens / request wall time (prefill included)")
    print(format_table(rows), flush=True)
    by_category = format_category_table(rows)
    if by_category:
        print("\nper category (vs none: tok/s over plain decoding on the category's prompts; first rejection: share "
              "of drafting steps whose first rejected draft was at position 1, 2, ...)")
        print(by_category, flush=True)
    if args.json:
        write_json(rows, args.json)
        print(f"wrote {len(rows)} rows to {args.json}")
    return 0


def cmd_perplexity(args) -> int:

    formats = args.formats
    if args.dtype is not None or args.quantization is not None:
        if formats is not None:
            raise CLIError("give --formats, or --dtype/--quantization for one format, not both")
        formats = [f"{args.dtype or 'auto'}+{args.quantization or 'none'}"]
    rows = perplexity.evaluate(model=args.model, formats=formats, text=args.text, max_tokens=args.max_tokens,
                               threads=args.threads, context=args.context, chunk=args.chunk, device=args.device,
                               log=main_log)
    r0 = rows[0]
    where = f"{r0['threads']} threads" if r0["device"] == "cpu" else r0["device"]
    print(f"perplexity on {r0['text']}: {r0['tokens']} tokens scored in windows of {r0['context']} "
          f"({r0['chunk']} tokens a forward), {where}; seconds = the forwards, loading excluded")
    print(perplexity.format_table(rows), flush=True)
    if args.json:
        write_json(rows, args.json)
        print(f"wrote {len(rows)} rows to {args.json}")
    return 0


def cmd_demo(args) -> int:
    """Plain decoding, then lossless Medusa and DSpark drafting, on the same chat prompt: same text,
    tokens/s and mean acceptance length (tau) of each; then one held-out prompt of every category through
    the three, interleaved prompt by prompt, for speeds less at the mercy of one short answer."""
    from types import SimpleNamespace

    import torch

    from specserve.bench.categories import category_prompts, interleaved_chats

    params = SamplingParams(temperature=0.0, max_tokens=DEMO_TOKENS)
    runs = [("plain decoding", None),
            ("Medusa (shipped heads; the cost model chooses each step's tree among their candidates and n-gram "
             "branches; lossless)",
             {"method": "medusa", "medusa_tree": "auto", "medusa_verify": "auto", **DEMO_BRANCHES}),
            ("DSpark (shipped drafter; the cost model chooses each step's tree among its candidates and n-gram "
             "branches; lossless)", {"method": "dspark", "dspark_tree": "auto", **DEMO_BRANCHES})]
    engines, results = {}, []
    try:
        for title, spec in runs:
            name = title.split(" (")[0]
            t0 = time.perf_counter()
            llm = engines[name] = LLM(
                num_threads=args.threads, speculative_config=spec, dtype=getattr(args, "dtype", "auto"),
                quantization=quantization_arg(getattr(args, "quantization", "auto")))
            load_s = time.perf_counter() - t0
            dtype = str(llm.engine.runner.dtype).removeprefix("torch.")
            quant = getattr(llm.engine.runner, "quantization", None)
            dtype += f", {quant} weights" if quant else ""
            print(f"\n== {title}: SmolLM2-135M-Instruct ({dtype}, {torch.get_num_threads()} CPU threads), "
                  f"loaded in {load_s:.1f} s")
            print(f"Q: {DEMO_QUESTION}\nA: ", end="", flush=True)
            ids = llm.tokenizer.apply_chat_template([{"role": "user", "content": DEMO_QUESTION}])
            wall, out = _stream(llm, {"prompt": DEMO_QUESTION, "prompt_token_ids": ids}, params)
            st = llm.engine.stats
            dec = st.decode_tokens / st.decode_s if st.decode_s > 0 else 0.0
            tau = llm.get_metrics()["mean_acceptance_length"]
            results.append((name, out.outputs[0].token_ids, dec, tau))
            print(f"-> {len(out.outputs[0].token_ids)} tokens in {wall:.2f} s: decoding {dec:.1f} tok/s, "
                  f"mean acceptance length {tau:.2f}")
        _, base_ids, base_tps, _ = results[0]
        print()
        for name, ids, tps, tau in results[1:]:
            same = "identical" if ids == base_ids else "DIFFERENT (a bug: please report it)"
            print(f"{name} vs plain, this answer: {tps / base_tps:.2f}x decoding speed, "
                  f"mean acceptance length {tau:.2f}, text {same}")
        prompts = category_prompts("categories", 1)
        print(f"\none answer is too short to time: {len(prompts)} held-out prompts, one of every category "
              f"(specserve/bench/categories-heldout.jsonl.gz), through the three in turn, {DEMO_TOKENS} tokens "
              "each ...", flush=True)
        before = {name: llm.get_metrics() for name, llm in engines.items()}
        _, wall, tokens, same = interleaved_chats(engines, SimpleNamespace(max_tokens=DEMO_TOKENS), prompts)
        plain = next(iter(engines))
        for name, llm in list(engines.items())[1:]:
            m0, m1 = before[name], llm.get_metrics()
            steps = m1["num_verify_steps"] - m0["num_verify_steps"]
            tau = 1.0 + (m1["num_accepted_tokens"] - m0["num_accepted_tokens"]) / max(steps, 1)
            ok = f"{same[name]}/{len(prompts)} answers identical" + ("" if same[name] == len(prompts) else
                                                                      " (a bug: please report it)")
            print(f"{name} vs plain: {wall[plain] / wall[name]:.2f}x tokens/s (request wall time, "
                  f"{tokens[name]} tokens), mean acceptance length {tau:.2f}, {ok}")
    finally:
        for llm in engines.values():
            llm.shutdown()
    print("(`specserve bench --prompts categories --num-prompts 6` averages 48 held-out prompts, with llama.cpp "
          "beside them)")
    print("next: specserve generate --chat --prompt '...' --speculative-method medusa   |   "
          "specserve bench --methods none,ngram,medusa,dspark,dflash")
    return 0


def cmd_train_medusa(args) -> int:
    import shlex

    targs = from_namespace(MedusaTrainArgs, args)
    argv = getattr(args, "_argv", None)
    command = "specserve " + shlex.join(argv) if argv is not None else None
    res = train_medusa(targs, command=command)
    ev, tm = res["heldout"], res["timings"]
    zero = res["meta"].get("heldout_zero_init_top1")  # eval-only: from the training record, if any
    what = "evaluated" if targs.eval_only else "wrote"
    print(f"{what} Medusa heads ({res['config']['num_heads']} heads x {res['config']['num_layers']} layer(s)) "
          f"{'at' if targs.eval_only else 'to'} {res['out']} (config.json, "
          f"{'' if targs.eval_only else 'medusa.safetensors, '}README.md)")
    print(f"time: {tm['total_s']:.0f} s (" + ", ".join(f"{k.removesuffix('_s')} {v:.0f} s" for k, v in tm.items()
                                                    if k != "total_s") + ")")
    print(f"held-out accuracy on {res['meta']['heldout_prompts']} prompts ({res['meta']['heldout_positions']} "
          f"positions); head k predicts token t+k+2:")
    for k in range(len(ev["top1"])):
        print(f"  head {k}: top-1 {ev['top1'][k]:.3f}  top-5 {ev['top5'][k]:.3f}"
              + (f"  ({'at init' if res['meta'].get('init_from') else 'zero init'} top-1 {zero[k]:.3f})"
                 if zero else ""))
    dec = ev["decode"]
    print(f"greedy decoding with {len(ev['top1'])}-token chains, replayed: tau {dec['tau']:.3f} ("
          + " ".join(f"{x:.2f}" for x in dec["acceptance"]) + ")"
          + "".join(f", {k} {v:.3f}" for k, v in dec.get("by_source", {}).items()))
    return 0


def cmd_train_distill(args) -> int:
    # the data options are every trainer's (TrainOptions); a trainer's class fills the training fields
    # that TrainOptions.validate also checks, with their defaults
    targs = from_namespace(MedusaTrainArgs, args, out="")
    targs.validate()
    if not targs.distill_store:
        raise CLIError("train distill needs --distill-store DIR (where the responses go)")
    res = distill_only(targs, log=stderr_log)
    print(f"{targs.distill_store}: {res['train_sequences']} training + {res['heldout_sequences']} held-out responses "
          f"({res['response_tokens']} tokens) of {res['data']}, {res['seconds']:.0f} s")
    return 0


def cmd_train_dspark(args) -> int:
    import shlex

    fixed = given(args, DSparkTrainArgs, "shape")
    if args.init_from is not None and fixed:
        print(f"error: --init-from takes the drafter's shape from {args.init_from}; drop " + ", ".join(fixed),
              file=sys.stderr)
        return 2
    targs = from_namespace(DSparkTrainArgs, args)
    argv = getattr(args, "_argv", None)
    command = "specserve " + shlex.join(argv) if argv is not None else None
    res = train_dspark(targs, command=command)
    ev, tm, cfg = res["heldout"], res["timings"], res["config"]
    init = res.get("heldout_init")
    if targs.eval_only:
        print(f"evaluated the drafter at {res['out']} (block {cfg['block_size']}, Markov rank {cfg['markov_rank']}) "
              "and rewrote the held-out figures of its config.json and README.md")
    else:
        print(f"wrote a {res['meta']['method']} drafter ({cfg['num_layers']} layer(s), block {cfg['block_size']}, "
              f"Markov rank {cfg['markov_rank']}, target layers {cfg['target_layer_ids']}) to {res['out']} "
              f"(config.json, model.safetensors, README.md)")
    print(f"time: {tm['total_s']:.0f} s (" + ", ".join(f"{k.removesuffix('_s')} {v:.0f} s" for k, v in tm.items()
                                                    if k != "total_s") + ")")
    was = f"{init['loss']:.3f} at init -> " if init else ""
    print(f"held-out on {res['meta']['heldout_prompts']} prompts ({ev['blocks'][0]} blocks): loss {was}"
          f"{ev['loss']:.3f}; slot k drafts the token at a+k:")
    for k in range(len(ev["acceptance"])):
        print(f"  slot {k + 1}: acceptance estimate {ev['acceptance'][k]:.3f}  cumulative {ev['cumulative'][k]:.3f}  "
              f"greedy {ev['greedy_acceptance'][k]:.3f}  STS T {res['sts']['temperatures'][k]:.2f}")
    print(f"tau estimate {ev['tau']:.3f} (greedy {ev['greedy_tau']:.3f}"
          + (f"; {init['tau']:.3f} at init" if init else "")
          + f"); greedy decoding replayed: tau {ev['decode']['tau']:.3f} ("
          + " ".join(f"{x:.2f}" for x in ev["decode"]["acceptance"]) + ")"
          + "".join(f", {k} {v:.3f}" for k, v in ev["decode"].get("by_source", {}).items()))
    return 0


# ---- entry point --------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = build_parser().parse_args(argv)  # bad arguments: argparse prints usage + error, exits 2
    args._argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return args.func(args)
    except BrokenPipeError:  # e.g. `specserve generate ... | head`
        return 0
    except (CLIError, ValueError, TypeError, OSError, NotImplementedError) as e:
        msg = str(e) or type(e).__name__
        if isinstance(e, OSError) and e.filename and str(e.filename) not in msg:
            msg = f"{msg}: {e.filename}"
        print(f"error: {msg}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    except KeyboardInterrupt as e:
        print("\ninterrupted" + (f": {e}" if str(e) else ""), file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
