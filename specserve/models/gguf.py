"""GGUF reading through the ``gguf`` package: metadata -> HF config, dequantized tensors under HF
names (llama.cpp's Q/K row permutation undone), tokenizer and chat template from the metadata, and
``convert`` to a plain HF directory."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import torch

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


class GGUFFile:
    def __init__(self, path: str | Path):
        from gguf import GGUFReader

        self.path = Path(path)
        self.reader = GGUFReader(str(path))
        self.meta = {}
        for k, f in self.reader.fields.items():
            if k.startswith("GGUF."):
                continue
            try:
                self.meta[k] = f.contents()
            except Exception:  # a field the gguf package cannot decode is not one we need
                continue
        self.arch = self.meta.get("general.architecture")
        if self.arch not in ARCH_TO_HF:
            raise ValueError(f"unsupported GGUF architecture {self.arch!r}; supported: {', '.join(ARCH_TO_HF)}")

    def _m(self, key, default=None):
        return self.meta.get(f"{self.arch}.{key}", default)

    def hf_config(self) -> dict:
        n_heads = int(self._m("attention.head_count"))
        hidden = int(self._m("embedding_length"))
        names = {t.name for t in self.reader.tensors}
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

    def tensors(self):
        """Yield (HF name, float32 tensor) for every tensor, dequantized."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        cfg = self.hf_config()
        for t in self.reader.tensors:
            name = None
            for pat, rep in _TENSOR_RE:
                if pat.match(t.name):
                    name = pat.sub(rep, t.name)
                    break
            if name is None:
                if t.name in ("rope_freqs.weight",):  # llama3 rope factors: derived from metadata instead
                    continue
                raise ValueError(f"GGUF tensor {t.name!r} has no HF equivalent")
            arr = dequantize(t.data, GGMLQuantizationType(t.tensor_type))
            arr = np.ascontiguousarray(arr.reshape([int(x) for x in reversed(t.shape)]), dtype=np.float32)
            if self.arch in ("llama", "mistral") and name.endswith(("q_proj.weight", "k_proj.weight")):
                n = cfg["num_attention_heads"] if "q_proj" in name else cfg["num_key_value_heads"]
                arr = unpermute_qk(arr, n)
            yield name, torch.from_numpy(arr if arr.flags.writeable else arr.copy())

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


def convert(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """Write an HF directory (config.json, model.safetensors in float32, tokenizer files)."""
    from safetensors.torch import save_file

    g = GGUFFile(gguf_path)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = g.tokenizer_files()
    tensors = {n: t.contiguous() for n, t in g.tensors()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(g.hf_config(), indent=2))
    for name, text in files.items():
        (out / name).write_text(text)
    return out
