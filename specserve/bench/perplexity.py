"""Perplexity of one model in several weight formats on the same held-out text: what int8, int4 and a
GGUF's own quantization cost in quality next to dense float32 / bfloat16 weights.

A *format* is a (dtype, quantization) pair given to ``LLM(model, dtype=..., quantization=...)``:
``float32`` (float32, dense), ``bfloat16`` (bfloat16, dense), ``int8``, ``int4`` and ``gguf`` (the
engine's dtype for quantized weights, weights int8 / int4 / the GGUF file's own blocks; ``gguf`` only
for a .gguf model or the default model), ``int4-a8`` and ``gguf-a8`` (those weights with 8-bit activations,
``LLM(activations="int8")``), or ``DTYPE+QUANTIZATION`` (e.g. ``float32+int8``).

The text is tokenized once (no special tokens) and cut to ``max_tokens``; it goes through the target in
windows of ``context`` tokens (each window starts from an empty cache at position 0, with the
tokenizer's BOS first when it adds one), each window fed in consecutive chunks of ``chunk`` tokens
through the runner's own forward (``logits_mode="all"``, the KV cache of slot 0 holding the window so
far). Every token of a window after its first (all of them after a BOS) is scored: perplexity =
exp(mean negative log-likelihood), summed in float64. Chunking gives the same numbers as one forward
over the window up to float rounding (``tests/unit/test_perplexity.py``).

Default text ``chitchat-heldout``: the conversations of the chitchat dataset held out of the drafters'
training (``train.data.is_heldout`` of the conversation id), every turn on its own line, conversations
separated by a blank line, in conversation-id order; or ``--text FILE`` (plain UTF-8 text).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from specserve import LLM
from specserve.bench.harness import BenchError, comma_list, model_gguf_path
from specserve.config import QUANTIZATION_NAMES
from specserve.device import resolve_device
from specserve.models.loader import resolve_model_dir
from specserve.tokenizer import Tokenizer
from specserve.train.data import DataError, is_heldout, load_conversations

DEFAULT_TEXT = "chitchat-heldout"
CONTEXT = 1024  # tokens per window
CHUNK = 256  # tokens per forward
MAX_TOKENS = 4096  # tokens of text evaluated by default
# format name -> (dtype, quantization) given to LLM
FORMATS = {"float32": ("float32", None), "bfloat16": ("bfloat16", None), "int8": ("auto", "int8"),
           "int4": ("auto", "int4"), "gguf": ("auto", "gguf"), "int4-a8": ("auto", "int4"), "gguf-a8": ("auto", "gguf")}
INT8_ACTIVATIONS = ("int4-a8", "gguf-a8")  # formats whose weights multiply x in 8-bit groups


@dataclass
class WeightFormat:
    name: str  # as the table shows it: float32, int8, bfloat16+int8, ...
    dtype: str  # given to LLM
    quantization: str | None  # given to LLM (None: dense)
    activations: str = "bfloat16"  # given to LLM


def default_formats(model=None, device: str = "cpu") -> list[str]:
    """Every format that applies: the dense ones, plus int8, int4 (and gguf for a GGUF model) on CPU."""
    if device != "cpu":
        return ["float32", "bfloat16"]
    return ["float32", "bfloat16", "int8", "int4"] + (["gguf"] if model_gguf_path(model) is not None else [])


def parse_formats(spec: str | list[str] | None, model=None, device: str = "cpu") -> list[WeightFormat]:
    """Format names (see the module docstring) from a comma list; None: ``default_formats``."""
    names = default_formats(model, device) if spec is None else comma_list(spec)
    if not names:
        raise BenchError("--formats: no format given")
    out = []
    for name in dict.fromkeys(names):
        if name in FORMATS:
            dtype, quant = FORMATS[name]
        elif "+" in name:
            dtype, quant = name.split("+", 1)
            if dtype not in ("auto", "float32", "bfloat16", "float16") or quant not in QUANTIZATION_NAMES:
                raise BenchError(f"--formats: bad format {name!r}: DTYPE+QUANTIZATION takes a dtype of auto, "
                                 f"float32, bfloat16, float16 and a quantization of {', '.join(QUANTIZATION_NAMES)}")
            quant = None if quant == "none" else quant
        else:
            raise BenchError(f"--formats: unknown format {name!r}; choose from {', '.join(FORMATS)} "
                             "or DTYPE+QUANTIZATION (e.g. float32+int8)")
        if quant == "gguf" and model_gguf_path(model) is None:
            raise BenchError(f"--formats: format {name!r} needs a .gguf model (or the default model), "
                             f"got --model {model}")
        out.append(WeightFormat(name, dtype, quant, "int8" if name in INT8_ACTIVATIONS else "bfloat16"))
    return out


# ---- text ---------------------------------------------------------------------------------------
def heldout_chitchat_text(max_chars: int | None = None) -> str:
    """The held-out chitchat conversations as plain text (see the module docstring), stopping once
    ``max_chars`` characters are reached."""

    try:
        convs = load_conversations()
    except DataError:
        raise BenchError(f"--text {DEFAULT_TEXT}: the chitchat dataset is not installed: "
                         "pip install chitchat-dataset==0.9.0 (or pass --text FILE)") from None
    parts, size = [], 0
    for cid in sorted(convs):
        if not is_heldout(cid):
            continue
        turns = [" ".join(" ".join(str(u.get("text", "")).split()) for u in turn if isinstance(u, dict)).strip()
                 for turn in convs[cid].get("messages") or []]
        conv = "\n".join(t for t in turns if t)
        if conv:
            parts.append(conv)
            size += len(conv) + 2
            if max_chars is not None and size >= max_chars:
                break
    return "\n\n".join(parts)


def load_text(source: str | os.PathLike | None = None, max_chars: int | None = None) -> str:
    """``chitchat-heldout`` (the default) or a plain text file."""
    if source is None or str(source) == DEFAULT_TEXT:
        return heldout_chitchat_text(max_chars)
    p = Path(source)
    if not p.is_file():
        raise BenchError(f"--text: no such file: {source}")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise BenchError(f"--text: {source} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    if not text.strip():
        raise BenchError(f"--text: {source} is empty")
    return text


# ---- scoring ------------------------------------------------------------------------------------
def windows(ids: list[int], context: int, bos: int | None = None) -> list[list[int]]:
    """``ids`` cut into consecutive windows of at most ``context`` tokens, each with ``bos`` first when
    given (then ``context - 1`` text tokens a window)."""
    step = context - (bos is not None)
    if step < 1:
        raise BenchError(f"--context must be >= {1 + (bos is not None)}, got {context}")
    return [([bos] if bos is not None else []) + ids[i : i + step] for i in range(0, len(ids), step)]


def window_nll(runner, seq: list[int], chunk: int) -> tuple[float, int]:
    """(sum of -log p(seq[t] | seq[:t]) over t >= 1, number of tokens scored), ``seq`` fed through
    ``runner.forward`` in chunks of ``chunk`` tokens from an empty cache (slot 0)."""
    if chunk < 1:
        raise BenchError(f"--chunk must be >= 1, got {chunk}")
    total, n = 0.0, 0
    for s in range(0, len(seq), chunk):
        piece = seq[s : s + chunk]
        logits = runner.forward(0, [piece], [s], logits_mode="all").logits[0, : len(piece)]
        targets = seq[s + 1 : s + 1 + len(piece)]  # the window's last token predicts nothing
        if not targets:
            continue
        logp = torch.log_softmax(logits[: len(targets)].float(), dim=-1)
        picked = logp.gather(1, torch.tensor(targets, device=logp.device).unsqueeze(1))
        total -= picked.double().sum().item()
        n += len(targets)
    return total, n


def perplexity(llm, ids: list[int], context: int = CONTEXT, chunk: int = CHUNK) -> dict:
    """Perplexity of ``llm``'s target on token ids ``ids`` (see the module docstring): ``nll`` (mean),
    ``perplexity``, ``tokens`` (scored), ``windows`` and ``seconds`` (the forwards)."""
    runner = llm.engine.runner
    context = min(context, llm.engine.max_model_len)
    tok = llm.tokenizer
    bos = tok.bos_token_id if tok.add_bos_token and tok.bos_token_id is not None else None
    total, n = 0.0, 0
    wins = windows(ids, context, bos)
    t0 = time.perf_counter()
    for seq in wins:
        s, k = window_nll(runner, seq, chunk)
        total, n = total + s, n + k
    seconds = time.perf_counter() - t0
    if n == 0:
        raise BenchError("perplexity: the text has too few tokens to score (at least 2 needed)")
    return {"nll": total / n, "perplexity": math.exp(total / n), "tokens": n, "windows": len(wins),
            "seconds": seconds}


def evaluate(model: str | None = None, formats: str | list[str] | None = None, text: str | None = None,
             max_tokens: int = MAX_TOKENS, threads: int | None = None, context: int = CONTEXT, chunk: int = CHUNK,
             device: str | None = "auto", log: Callable[[str], None] | None = None) -> list[dict]:
    """One row per weight format: format, dtype and quantization that ran, perplexity, mean NLL, tokens
    scored, seconds of forwards (and of loading)."""

    log = log or (lambda s: None)
    for flag, v, low in (("--max-tokens", max_tokens, 2), ("--context", context, 2), ("--chunk", chunk, 1)):
        if v < low:
            raise BenchError(f"{flag} must be >= {low}, got {v}")
    if threads is not None and threads < 1:
        raise BenchError(f"--threads must be >= 1, got {threads}")
    try:
        device = resolve_device(device)
    except ValueError as e:
        raise BenchError(str(e)) from None
    fmts = parse_formats(formats, model, device)
    raw = load_text(text, max_chars=8 * max_tokens)
    tok = Tokenizer.from_dir(resolve_model_dir(model))
    ids = tok.encode(raw, add_special_tokens=False)[:max_tokens]
    threads = threads or torch.get_num_threads()
    rows = []
    for f in fmts:
        log(f"loading {f.name} (dtype {f.dtype}, quantization {f.quantization})...")
        torch.set_num_threads(threads)
        t0 = time.perf_counter()
        llm = LLM(model=model, dtype=f.dtype, quantization=f.quantization, num_threads=threads, device=device,
                  max_num_seqs=1, activations=f.activations)
        load_s = time.perf_counter() - t0
        try:
            runner = llm.engine.runner
            log(f"scoring {len(ids)} tokens with {f.name}...")
            r = perplexity(llm, ids, context, chunk)
            rows.append({"format": f.name, "dtype": str(getattr(runner, "dtype", f.dtype)).removeprefix("torch."),
                         "quantization": getattr(runner, "quantization", f.quantization),
                         "perplexity": round(r["perplexity"], 4), "nll": round(r["nll"], 6), "tokens": r["tokens"],
                         "windows": r["windows"], "seconds": round(r["seconds"], 2), "load_s": round(load_s, 2),
                         "context": min(context, llm.engine.max_model_len), "chunk": chunk, "threads": threads,
                         "device": device, "text": str(text or DEFAULT_TEXT)})
        finally:
            llm.shutdown()
    return rows


def format_table(rows: list[dict]) -> str:
    """format | dtype | quantization | perplexity | vs first row | tokens | seconds."""
    head = ["format", "dtype", "quantization", "perplexity", f"vs {rows[0]['format']}" if rows else "vs first",
            "tokens", "seconds"]
    base = rows[0]["perplexity"] if rows else None
    body = [[r["format"], r["dtype"], r["quantization"] or "none", f"{r['perplexity']:.3f}",
             f"{r['perplexity'] / base - 1:+.2%}" if base else "-", str(r["tokens"]), f"{r['seconds']:.1f}"]
            for r in rows]
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(head)]

    def line(cells):
        return "  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    return "\n".join([line(head), line(["-" * w for w in widths])] + [line(b) for b in body])
