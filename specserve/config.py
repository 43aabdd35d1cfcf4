"""Configuration dataclasses: the model's architecture (read from an HF ``config.json``)
and the engine's knobs. Every field documents its bounds; bad values raise ``ValueError``."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

# architectures name -> family flags. One decoder implementation covers them all.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
SUPPORTED_MODEL_TYPES = {"llama", "mistral", "qwen2", "qwen3"}


class UnsupportedModelError(ValueError):
    pass


@dataclass
class ModelConfig:
    """Decoder architecture. ``family`` is one of llama | mistral | qwen2 | qwen3."""

    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v projections (Qwen2: True)
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3)
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list | None = None
    torch_dtype: str | None = None

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "ModelConfig":
        archs = cfg.get("architectures") or []
        family = None
        for a in archs:
            if a in SUPPORTED_ARCHITECTURES:
                family = SUPPORTED_ARCHITECTURES[a]
                break
        if family is None and not archs and cfg.get("model_type") in SUPPORTED_MODEL_TYPES:
            family = cfg["model_type"]
        if family is None:
            raise UnsupportedModelError(
                f"unsupported architecture {archs or cfg.get('model_type')!r}; supported: "
                f"{', '.join(SUPPORTED_ARCHITECTURES)} (model_type {', '.join(sorted(SUPPORTED_MODEL_TYPES))})"
            )
        try:
            n_heads = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
            c = cls(
                family=family,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_hidden_layers=int(cfg["num_hidden_layers"]),
                num_attention_heads=n_heads,
                num_key_value_heads=int(cfg.get("num_key_value_heads") or n_heads),
                head_dim=int(cfg.get("head_dim") or hidden // n_heads),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=float(cfg.get("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))),
                rope_scaling=_rope_scaling(cfg),
                max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_bias=bool(cfg.get("attention_bias", family == "qwen2")),
                qk_norm=family == "qwen3",
                sliding_window=(cfg.get("sliding_window") if cfg.get("use_sliding_window", family == "mistral")
                                else None),
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_id=cfg.get("eos_token_id"),
                torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
            )
        except KeyError as e:
            raise UnsupportedModelError(f"config.json is missing required field {e.args[0]!r}") from None
        c.validate()
        return c

    def validate(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")

    def to_hf(self) -> dict[str, Any]:
        """An HF ``config.json`` dict that transformers loads to the same architecture."""
        arch = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}[self.family]
        d = {
            "architectures": [arch],
            "model_type": self.family,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "hidden_act": "silu",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "torch_dtype": "float32",
        }
        return d


def _rope_scaling(cfg: dict) -> dict | None:
    rs = cfg.get("rope_scaling")
    if rs is None:
        rp = cfg.get("rope_parameters")
        if rp and rp.get("rope_type", "default") != "default":
            rs = rp
    if not rs:
        return None
    kind = rs.get("rope_type", rs.get("type", "default"))
    if kind not in ("default", "llama3", "linear"):
        raise UnsupportedModelError(f"unsupported rope_scaling type {kind!r}; supported: default, llama3, linear")
    return None if kind == "default" else dict(rs, rope_type=kind)


def check_int(name: str, value, none_ok: bool = False) -> None:
    """A ``TypeError`` naming ``name`` unless ``value`` is an int (not a bool; None when ``none_ok``)."""
    if value is None and none_ok:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int{' or None' if none_ok else ''}, got {value!r}")


def check_number(name: str, value) -> None:
    """A ``TypeError`` naming ``name`` unless ``value`` is a real number (int or float, not a bool)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {value!r}")


MAX_LOGPROBS = 20  # most likely alternatives a request may ask for per token


@dataclass
class SamplingParams:
    """Per-request sampling parameters (vLLM names).

    temperature: >= 0; 0 means greedy. top_p: (0, 1]. top_k: -1/0 (off) or >= 1.
    min_p: [0, 1]. max_tokens: >= 1. seed: None or an int (own generator per request).
    logprobs: None, or record the target's log-probability of each emitted token and its ``logprobs``
    most likely alternatives (0..20; ``Sequence.logprobs``).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logprobs: int | None = None

    def __post_init__(self) -> None:
        for name in ("n", "top_k", "seed", "max_tokens", "logprobs"):
            check_int(name, getattr(self, name), none_ok=name != "n")
        for name in ("temperature", "top_p", "min_p"):
            check_number(name, getattr(self, name))
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None and (not isinstance(self.stop, (list, tuple))
                                      or not all(isinstance(x, str) for x in self.stop)):
            raise TypeError(f"stop must be a string or a list of strings, got {self.stop!r}")
        self.stop = [s for s in (self.stop or []) if s]
        if self.stop_token_ids is not None and not isinstance(self.stop_token_ids, (list, tuple)):
            raise TypeError(f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}")
        for t in self.stop_token_ids or []:
            check_int("stop_token_ids", t)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            raise ValueError(f"seed must fit in 64 bits, got {self.seed}")
        if self.n != 1:
            raise ValueError("n > 1 is not supported yet; submit the prompt several times with different seeds")
        if not (self.temperature >= 0):
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not (0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is None or self.top_k == 0:
            self.top_k = -1
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or >= 1, got {self.top_k}")
        if not (0 <= self.min_p <= 1):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in 0..{MAX_LOGPROBS} or None, got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def clone(self, **changes) -> "SamplingParams":
        return dataclasses.replace(self, **changes)


@dataclass
class SpeculativeConfig:
    """``speculative_config`` (vLLM names). method: a registered drafter (ngram, ...).
    num_speculative_tokens: drafts per step, 1..32. model: the drafter's checkpoint, if it has one.
    Every other key is the method's own option (e.g. ngram's prompt_lookup_max/min) and is checked
    by that drafter."""

    method: str
    num_speculative_tokens: int | None = None  # None: the drafter's default (ngram 5, medusa its heads)
    model: str | None = None
    options: dict = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d: "dict | SpeculativeConfig | None") -> "SpeculativeConfig | None":
        if d is None or isinstance(d, SpeculativeConfig):
            return d
        if not isinstance(d, dict):
            raise TypeError(f"speculative_config must be a dict, got {type(d).__name__}")
        d = dict(d)
        if "method" not in d:
            raise ValueError("speculative_config needs a 'method' (e.g. 'ngram')")
        k = d.pop("num_speculative_tokens", None)
        c = cls(method=str(d.pop("method")), num_speculative_tokens=None if k is None else int(k),
                model=d.pop("model", None), options=d)
        if c.num_speculative_tokens is not None and not (1 <= c.num_speculative_tokens <= 32):
            raise ValueError(f"num_speculative_tokens must be in 1..32, got {c.num_speculative_tokens}")
        return c

    def proposer_kwargs(self) -> dict:
        kw = dict(self.options)
        if self.num_speculative_tokens is not None:
            kw["num_speculative_tokens"] = self.num_speculative_tokens
        if self.model is not None:
            kw["model"] = self.model
        return kw


# how random requests draw their tokens (``EngineConfig.sampling_mode``; ``sample.coupled``)
SAMPLING_MODES = ("coupled", "rejection")
# the engine's default: speculation only at batch sizes where it pays (the test suite pins it off)
SPECULATION_GATE = True

# "auto": a GGUF runs in its own quantization (``gguf``), an HF directory unquantized; None / "none":
# dense weights (a GGUF dequantized at load); "int8": every weight int8 per output channel; "int4":
# linears int4 in groups of 32, embedding / LM head int8 per output channel (``layers.quant``)
QUANTIZATION_NAMES = ("auto", "none", "gguf", "int8", "int4")  # as written on the command line
QUANTIZATIONS = (None, *QUANTIZATION_NAMES)  # as LLM takes them
# what a quantized weight's group kernel multiplies: "bfloat16" activations (every product of a code and an
# activation exact), or "int8": x in 8-bit groups of 32 as llama.cpp's kernels take it (``layers.quant``)
ACTIVATIONS = ("bfloat16", "int8")


@dataclass
class EngineConfig:
    """Engine knobs. max_num_seqs: sequences decoded together (>= 1). max_model_len: prompt +
    output tokens per sequence (None: the model's max_position_embeddings). prefill_chunk: prompt
    tokens computed per engine step, all prefilling requests together (>= 16; a longer prompt takes
    several steps, with the running batch decoding in each). sampling_mode: how random requests draw their tokens,
    "coupled" (each position's randomness from the request's seed and the position alone: a seeded
    request's text is plain decoding's with that seed, whatever the drafter, batch or tensor-parallel
    size; ``sample.coupled``) or "rejection" (vLLM's rejection sampler: exact in distribution, one
    random stream per request). kv_cache_memory: GiB of KV cache blocks (None: room for max_num_seqs
    sequences of max_model_len, at most a quarter of the machine's memory; reserved, resident as used).
    enable_prefix_caching: requests share the cached blocks of a common prompt prefix.
    speculation_gate: draft only at batch sizes where steps with drafts emit tokens faster than plain
    steps (measured online, ``engine.spec_gate``); False: every step drafts; None: ``SPECULATION_GATE``.
    activations: what a quantized model's group kernels multiply (``ACTIVATIONS``; ``layers.quant``)."""

    dtype: str = "auto"
    quantization: str | None = "auto"
    activations: str = "bfloat16"
    tensor_parallel_size: int = 1
    max_num_seqs: int = 16
    max_model_len: int | None = None
    prefill_chunk: int = 512
    seed: int = 0
    num_threads: int | None = None
    speculative: SpeculativeConfig | None = None
    sampling_mode: str = "coupled"
    kv_cache_memory: float | None = None
    enable_prefix_caching: bool = True
    speculation_gate: bool | None = None

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "max_num_seqs", "prefill_chunk", "seed", "num_threads", "max_model_len"):
            check_int(name, getattr(self, name), none_ok=name in ("num_threads", "max_model_len"))
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2 (a prompt token and an output token) or None (the "
                             f"model's own), got {self.max_model_len}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")
        if not isinstance(self.dtype, (str, torch.dtype)):
            raise TypeError(f"dtype must be a string such as 'auto', 'float32' or 'bfloat16', got {self.dtype!r}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.prefill_chunk < 16:
            raise ValueError(f"prefill_chunk must be >= 16, got {self.prefill_chunk}")
        if self.kv_cache_memory is not None:
            check_number("kv_cache_memory", self.kv_cache_memory)
            if not self.kv_cache_memory > 0:
                raise ValueError(f"kv_cache_memory must be > 0 (GiB) or None, got {self.kv_cache_memory}")
        if self.speculation_gate is None:
            self.speculation_gate = SPECULATION_GATE
        for name in ("enable_prefix_caching", "speculation_gate"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.sampling_mode not in SAMPLING_MODES:
            raise ValueError(f"sampling_mode must be 'coupled' or 'rejection', got {self.sampling_mode!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16", "fp32", "bf16", "fp16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(map(str, QUANTIZATIONS))}, "
                             f"got {self.quantization!r}")
        if self.activations not in ACTIVATIONS:
            raise ValueError(f"activations must be one of {', '.join(ACTIVATIONS)}, got {self.activations!r}")


def cache_root() -> Path:
    """Where specserve keeps what it derives once (GGUF metadata, compiled ops, training data):
    ``$SPECSERVE_CACHE``, else ``$XDG_CACHE_HOME/specserve`` or ``~/.cache/specserve``."""
    env = os.environ.get("SPECSERVE_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "specserve"
