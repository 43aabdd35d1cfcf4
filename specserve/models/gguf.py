"""GGUF reading through the ``gguf`` package: metadata -> HF config, dequantized tensors under HF
names (llama.cpp's Q/K row permutation undone), tokenizer and chat template from the metadata, and
``convert`` to a plain HF directory."""

from __future__ import annotations

import json
import logging
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from specserve.layers.quant import QuantTensor, quantize

log = logging.getLogger("specserve")

ARCH_TO_HF = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
              "qwen3": "Qwen3ForCausalLM"}

_TENSOR_MAP = [
    (r"^token_embd\.weight$", "model.embed_tokens.weight"),
    (r"^output_norm\.weight$", "model.norm.weight"),
    (r"^output\.weight$", "lm_head.weight"),
    (r"^blk\.(\d+)\.attn_norm\.weight$", r"model.layers.\1.input_layernorm.weight"),
    (r"^blk\.(\d+)\.ffn_norm\.weight$", r"model.layers.\1.post_attention_layernorm.weight"),
    (r"^blk\.(\d+)\.attn_q\.(weight|bias)$", r"model.layers.\1.self_attn.q_proj.\2"),
    (r"^blk\.(\d+)\.attn_k\.(weight|bias)$", r"model.layers.\1.self_attn.k_proj.\2"),
    (r"^blk\.(\d+)\.attn_v\.(weight|bias)$", r"model.layers.\1.self_attn.v_proj.\2"),
    (r"^blk\.(\d+)\.attn_output\.(weight|bias)$", r"model.layers.\1.self_attn.o_proj.\2"),
    (r"^blk\.(\d+)\.attn_q_norm\.weight$", r"model.layers.\1.self_attn.q_norm.weight"),
    (r"^blk\.(\d+)\.attn_k_norm\.weight$", r"model.layers.\1.self_attn.k_norm.weight"),
    (r"^blk\.(\d+)\.ffn_gate\.weight$", r"model.layers.\1.mlp.gate_proj.weight"),
    (r"^blk\.(\d+)\.ffn_up\.weight$", r"model.layers.\1.mlp.up_proj.weight"),
    (r"^blk\.(\d+)\.ffn_down\.weight$", r"model.layers.\1.mlp.down_proj.weight"),
]
_TENSOR_RE = [(re.compile(p), r) for p, r in _TENSOR_MAP]

# pre-tokenizer regexes of llama.cpp's BPE "pre" types
_QWEN2_RE = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_LLAMA3_RE = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_DIGIT_SPLIT_PRE = {"smollm", "starcoder", "refact", "codeshell", "minerva"}


_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


@dataclass
class TensorInfo:
    name: str
    tensor_type: int  # a ``gguf.GGMLQuantizationType`` value
    shape: tuple[int, ...]  # ggml order: the row length (ne0) first
    data: np.ndarray  # a read-only view of the file: [rows, bytes per row] (quantized) or the values


class _Cursor:
    def __init__(self, buf, path: Path):
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, fmt: str):
        try:
            (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        except struct.error:
            raise ValueError(f"{self.path.name}: truncated GGUF header") from None
        self.pos += struct.calcsize(fmt)
        return v

    def string(self) -> str:
        n = self.take("<Q")
        raw = bytes(self.buf[self.pos : self.pos + n])
        if len(raw) != n:
            raise ValueError(f"{self.path.name}: truncated GGUF header")
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def value(self, vtype: int):
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            itype, n = self.take("<I"), self.take("<Q")
            if itype in _SCALARS and itype != 7:  # numbers: one numpy read
                dt = np.dtype(_SCALARS[itype][1:]).newbyteorder("<")
                arr = np.frombuffer(self.buf, dt, n, self.pos)
                self.pos += n * dt.itemsize
                return arr.tolist()
            return [self.value(itype) for _ in range(n)]
        if vtype not in _SCALARS:
            raise ValueError(f"{self.path.name}: unknown GGUF value type {vtype}")
        return self.take(_SCALARS[vtype])


def read_gguf(path: Path) -> tuple[dict, list[TensorInfo]]:
    """The metadata (key -> value) and tensors (views of the memory-mapped file) of a GGUF file.
    Our own reader of the format (header, key/values, tensor infos, aligned data), as gguf-py's
    ``GGUFReader`` builds a numpy view per metadata item, slow for a large vocabulary."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        mm = np.memmap(path, dtype=np.uint8, mode="r")
    except (OSError, ValueError) as e:
        raise ValueError(f"{path.name}: cannot read ({e})") from None
    if bytes(mm[:4]) != b"GGUF":
        raise ValueError(f"{path.name}: not a GGUF file (bad magic)")
    cur = _Cursor(memoryview(mm), path)
    cur.pos = 4
    version, n_tensors, n_kv = cur.take("<I"), cur.take("<Q"), cur.take("<Q")
    if version < 2:
        raise ValueError(f"{path.name}: GGUF version {version} is not supported")
    meta = {}
    for _ in range(n_kv):
        key = cur.string()
        meta[key] = cur.value(cur.take("<I"))
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        dims = [cur.take("<Q") for _ in range(cur.take("<I"))]
        infos.append((name, cur.take("<I"), tuple(dims), cur.take("<Q")))
    align = int(meta.get("general.alignment", 32))
    start = -(-cur.pos // align) * align
    tensors = []
    for name, ttype, dims, off in infos:
        qtype = GGMLQuantizationType(ttype)
        block, nbytes = GGML_QUANT_SIZES[qtype]
        n = int(np.prod(dims))
        rows, row_len = n // dims[0], dims[0]
        size = n // block * nbytes
        if start + off + size > mm.size:
            raise ValueError(f"{path.name}: tensor {name!r} runs past the end of the file "
                             f"({mm.size} bytes): a truncated or damaged file")
        raw = mm[start + off : start + off + size]
        if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            data = raw.view(np.float32 if qtype == GGMLQuantizationType.F32 else np.float16)
            data = data.reshape(rows, row_len) if len(dims) > 1 else data
        else:
            data = raw.reshape(rows, row_len // block * nbytes)
        tensors.append(TensorInfo(name, ttype, dims, data))
    return meta, tensors


class GGUFFile:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.meta, self.tensor_infos = read_gguf(self.path)
        self.meta = {k: v for k, v in self.meta.items() if not k.startswith("GGUF.")}
        self.arch = self.meta.get("general.architecture")
        if self.arch not in ARCH_TO_HF:
            raise ValueError(f"unsupported GGUF architecture {self.arch!r}; supported: {', '.join(ARCH_TO_HF)}")

    def _m(self, key, default=None):
        return self.meta.get(f"{self.arch}.{key}", default)

    def hf_config(self) -> dict:
        n_heads = int(self._m("attention.head_count"))
        hidden = int(self._m("embedding_length"))
        names = {t.name for t in self.tensor_infos}
        tokens = self.meta.get("tokenizer.ggml.tokens") or []
        cfg = {
            "architectures": [ARCH_TO_HF[self.arch]],
            "model_type": self.arch,
            "vocab_size": int(self._m("vocab_size", len(tokens))),
            "hidden_size": hidden,
            "intermediate_size": int(self._m("feed_forward_length")),
            "num_hidden_layers": int(self._m("block_count")),
            "num_attention_heads": n_heads,
            "num_key_value_heads": int(self._m("attention.head_count_kv", n_heads)),
            "head_dim": int(self._m("attention.key_length", hidden // n_heads)),
            "rms_norm_eps": float(self._m("attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_theta": float(self._m("rope.freq_base", 10000.0)),
            "max_position_embeddings": int(self._m("context_length", 4096)),
            "tie_word_embeddings": "output.weight" not in names,
            "hidden_act": "silu",
            "bos_token_id": self.meta.get("tokenizer.ggml.bos_token_id"),
            "eos_token_id": self.meta.get("tokenizer.ggml.eos_token_id"),
            "torch_dtype": "float32",
        }
        if self.arch == "qwen2":
            cfg["attention_bias"] = True
        if self._m("rope.scaling.type") == "linear":
            cfg["rope_scaling"] = {"rope_type": "linear", "factor": float(self._m("rope.scaling.factor"))}
        return cfg

    def _hf_names(self):
        """(GGUF tensor, HF name) of every tensor that has one (llama3 rope factors: none needed)."""
        for t in self.tensor_infos:
            name = None
            for pat, rep in _TENSOR_RE:
                if pat.match(t.name):
                    name = pat.sub(rep, t.name)
                    break
            if name is None:
                if t.name in ("rope_freqs.weight",):  # llama3 rope factors: derived from metadata instead
                    continue
                raise ValueError(f"{self.path.name}: GGUF tensor {t.name!r} has no HF equivalent")
            yield t, name

    def _qk_heads(self, name: str, cfg: dict) -> int | None:
        """Heads whose rotary halves llama.cpp interleaved in this q/k weight's rows (None: not such);
        ``cfg``: ``hf_config()``, made once by the caller."""
        if self.arch in ("llama", "mistral") and name.endswith(("q_proj.weight", "k_proj.weight")):
            return cfg["num_attention_heads"] if "q_proj" in name else cfg["num_key_value_heads"]
        return None

    def tensors(self):
        """Yield (HF name, float32 tensor) for every tensor, dequantized."""
        from gguf import GGMLQuantizationType

        cfg = self.hf_config()
        for t, name in self._hf_names():
            w = _dense(t, GGMLQuantizationType(t.tensor_type), [int(x) for x in reversed(t.shape)], self.path)
            heads = self._qk_heads(name, cfg)
            yield name, torch.from_numpy(unpermute_qk(w.numpy(), heads).copy()) if heads else w

    def quantized_tensors(self):
        """Yield (HF name, tensor) for every tensor: matrices in Q4_0, Q4_1 and Q8_0 as ``QuantTensor``s
        with the file's own codes and scales (no dequantization), other matrix types dequantized and
        re-quantized to 8 bits in groups of 32 (one log line per type), vectors (norms, biases) as
        float32 tensors."""
        from gguf import GGMLQuantizationType

        cfg = self.hf_config()
        converted: dict[str, int] = {}
        for t, name in self._hf_names():
            qtype = GGMLQuantizationType(t.tensor_type)
            shape = [int(x) for x in reversed(t.shape)]
            if len(shape) != 2:
                yield name, _dense(t, qtype, shape, self.path)
                continue
            if qtype.name in GGUF_BLOCKS:
                qt = unpack_blocks(np.asarray(t.data), qtype.name, shape, f"{self.path.name}: {t.name}")
            else:
                converted[qtype.name] = converted.get(qtype.name, 0) + 1
                qt = quantize(_dense(t, qtype, shape, self.path), 8, 32, f"{qtype.name}->int8-g32")
            heads = self._qk_heads(name, cfg)
            if heads:
                qt = QuantTensor(*(None if a is None else torch.from_numpy(unpermute_qk(a.numpy(), heads))
                                   for a in (qt.codes, qt.scale, qt.offset)), qt.group, qt.bits, qt.kind)
            yield name, qt
        for kind, n in converted.items():
            log.warning("%s: %d %s matrices have no kernel of their own: converted to 8 bits in groups of 32",
                        self.path.name, n, kind)

    def write_metadata(self, out: str | Path, source: bool = True) -> Path:
        """config.json and the tokenizer files in ``out``, with ``source`` also ``gguf_source.json``
        (this file's path): an HF directory whose weights are read from this file."""
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        for name, text in self.tokenizer_files().items():
            (out / name).write_text(text)
        (out / "config.json").write_text(json.dumps(self.hf_config(), indent=2))
        if source:
            (out / "gguf_source.json").write_text(json.dumps({"path": str(self.path.resolve())}))
        return out

    def tokenizer_files(self) -> dict[str, str]:
        """tokenizer.json, tokenizer_config.json and generation_config.json contents."""
        from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

        kind = self.meta.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(f"GGUF tokenizer model {kind!r} is not supported (only byte-level BPE, 'gpt2'); "
                             "convert the model with its HF tokenizer.json instead")
        tokens = list(self.meta["tokenizer.ggml.tokens"])
        types = list(self.meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
        merges = [tuple(m.split(" ", 1)) for m in self.meta.get("tokenizer.ggml.merges", [])]
        tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False))
        pre = self.meta.get("tokenizer.ggml.pre", "default")
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
        if pre in _DIGIT_SPLIT_PRE:
            tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
        elif pre in ("qwen2", "llama-bpe", "llama3"):
            regex = _QWEN2_RE if pre == "qwen2" else _LLAMA3_RE
            tok.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(regex), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
            ])
        else:
            tok.pre_tokenizer = byte_level
        tok.decoder = decoders.ByteLevel()
        special = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == 3]
        user = [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == 4]
        tok.add_special_tokens(special)
        if user:
            tok.add_tokens(user)

        def name(key):
            i = self.meta.get(f"tokenizer.ggml.{key}_token_id")
            return tokens[i] if i is not None and 0 <= i < len(tokens) else None

        tcfg = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": name("bos"),
            "eos_token": name("eos"),
            "unk_token": name("unknown"),
            "pad_token": name("padding"),
            "add_bos_token": bool(self.meta.get("tokenizer.ggml.add_bos_token", False)),
            "clean_up_tokenization_spaces": False,
            "model_max_length": int(self._m("context_length", 4096)),
        }
        if self.meta.get("tokenizer.chat_template"):
            tcfg["chat_template"] = self.meta["tokenizer.chat_template"]
        gen = {"bos_token_id": self.meta.get("tokenizer.ggml.bos_token_id"),
               "eos_token_id": self.meta.get("tokenizer.ggml.eos_token_id")}
        return {"tokenizer.json": tok.to_str(), "tokenizer_config.json": json.dumps(tcfg, indent=2),
                "generation_config.json": json.dumps(gen, indent=2)}


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's interleaving of the rotary halves in attn_q / attn_k rows."""
    rows = w.shape[0]
    d = rows // n_heads // 2
    return w.reshape(n_heads, d, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _dense(t, qtype, shape, path: Path) -> torch.Tensor:
    from gguf.quants import dequantize

    try:
        arr = dequantize(t.data, qtype).reshape(shape)
    except ValueError as e:
        raise ValueError(f"{path.name}: tensor {t.name!r} cannot be read ({e})") from None
    return torch.from_numpy(np.array(arr, dtype=np.float32))


# GGUF block layouts kept as they are: bytes per block of 32 weights, and how to read them
GGUF_BLOCKS = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}


def unpack_blocks(raw: np.ndarray, kind: str, shape: list[int], what: str) -> QuantTensor:
    """A GGUF Q4_0 / Q4_1 / Q8_0 matrix [N, K] (``raw``: its bytes, [N, K / 32 * block bytes]) as a
    ``QuantTensor`` with the same codes, scales (float16 -> float32, exact) and offsets:
    Q4_0 w = d * (q - 8), Q4_1 w = d * q + m, Q8_0 w = d * q; in a 4-bit block byte j holds weight j
    in its low nibble and weight j + 16 in its high one."""
    N, K = shape
    nbytes = GGUF_BLOCKS[kind]
    if K % 32 or raw.size != N * K // 32 * nbytes:
        raise ValueError(f"{what}: {kind} data of {raw.size} bytes does not hold a {N}x{K} matrix "
                         f"({N * K // 32 * nbytes} bytes): a truncated or damaged file")
    blocks = np.ascontiguousarray(raw).reshape(N, K // 32, nbytes)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if kind == "Q8_0":
        codes = blocks[..., 2:].copy().view(np.int8).reshape(N, K)
        return QuantTensor(torch.from_numpy(codes), torch.from_numpy(d), None, 32, 8, kind)
    qs = blocks[..., 4:] if kind == "Q4_1" else blocks[..., 2:]
    codes = np.concatenate([qs & 15, qs >> 4], axis=-1).reshape(N, K).astype(np.uint8)
    if kind == "Q4_1":
        offset = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    else:
        offset = -8 * d
    return QuantTensor(torch.from_numpy(codes), torch.from_numpy(d), torch.from_numpy(offset), 32, 4, kind)


def pack_blocks(qt: QuantTensor) -> np.ndarray:
    """The inverse of ``unpack_blocks`` (scales rounded to float16): GGUF bytes [N, K / 32 * block bytes]
    of ``qt`` (``qt.kind`` Q4_0, Q4_1 or Q8_0)."""
    N, K = qt.shape
    d = qt.scale.numpy().astype(np.float16).reshape(N, K // 32, 1).view(np.uint8)
    if qt.kind == "Q8_0":
        parts = [d, qt.codes.numpy().astype(np.int8).reshape(N, K // 32, 32).view(np.uint8)]
    else:
        c = qt.codes.numpy().astype(np.uint8).reshape(N, K // 32, 32)
        qs = (c[..., :16] | (c[..., 16:] << 4)).astype(np.uint8)
        parts = [d] + ([qt.offset.numpy().astype(np.float16).reshape(N, K // 32, 1).view(np.uint8)]
                       if qt.kind == "Q4_1" else []) + [qs]
    return np.concatenate(parts, axis=-1).reshape(N, -1)


def convert(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """Write an HF directory (config.json, model.safetensors in float32, tokenizer files)."""
    from safetensors.torch import save_file

    g = GGUFFile(gguf_path)
    out = g.write_metadata(out_dir, source=False)
    tensors = {n: t.contiguous() for n, t in g.tensors()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
