"""One decoder for Llama (SmolLM2, Llama 2/3, Mistral), Qwen2 (q/k/v bias) and Qwen3 (per-head
q_norm/k_norm), selected by ``ModelConfig`` flags. Parameter names follow HF so checkpoints map 1:1,
except q/k/v and gate/up, which are fused (``packed_modules``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specserve.config import ModelConfig
from specserve.distributed.parallel_state import TPGroup
from specserve.layers import cpu_ops
from specserve.layers.attention import Attention, ForwardContext
from specserve.layers.embed_head import LogitsProcessor, ParallelLMHead, VocabParallelEmbedding
from specserve.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from specserve.layers.norm import RMSNorm, stack_head_norms
from specserve.layers.quant import GROUP_GRAIN, GROUP_TILE
from specserve.layers.rotary import RotaryEmbedding, rotate_


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, tp: TPGroup, dtype):
        super().__init__()
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads,
            bias=cfg.attention_bias, tp=tp, dtype=dtype,
        )
        o_bias = cfg.attention_bias and cfg.family != "qwen2"
        qkv = self.qkv_proj
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size, o_bias, tp, dtype,
                                        in_partition=(qkv.q_start, qkv.q_size))
        self.h, self.hkv, self.d = self.qkv_proj.heads_local, self.qkv_proj.kv_heads_local, cfg.head_dim
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype)
        else:
            self.q_norm = self.k_norm = None
        self.attn = Attention(layer_idx, self.h, self.hkv, cfg.head_dim)

    def forward(self, x, cos, sin, ctx: ForwardContext, cache=None):
        """q, k and v stay views of the projection's output: q and k are normed (Qwen3) and rotated in
        place, and k, v (side by side) go to the cache in one copy."""
        B, Q, _ = x.shape
        h, hkv = self.h, self.hkv
        qkv = self.qkv_proj.forward(x).view(B, Q, h + 2 * hkv, self.d)  # .forward: no nn.Module call overhead
        qk = qkv[:, :, : h + hkv]
        if self.q_norm is not None:
            qk[:, :, :h] = self.q_norm(qk[:, :, :h])
            qk[:, :, h:] = self.k_norm(qk[:, :, h:])
        rotate_(qk, cos, sin)  # q and k heads in one go
        return self.o_proj.forward(self.attn.forward(qkv[:, :, :h], qkv[:, :, h:].unflatten(2, (2, hkv)), ctx, cache))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup, dtype):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size] * 2, False, tp, dtype)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, False, tp, dtype)

    def forward(self, x):
        gate, up = self.gate_up_proj.forward(x).chunk(2, dim=-1)
        return self.down_proj.forward(F.silu(gate, inplace=True) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, tp: TPGroup, dtype):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = LlamaAttention(cfg, layer_idx, tp, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = LlamaMLP(cfg, tp, dtype)

    def forward(self, h, cos, sin, ctx, cache=None):
        """``cache``: this layer's KV cache tensor (``Attention.forward``)."""
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, ctx, cache)
        return h + self.mlp(self.post_attention_layernorm(h))

    def one_call(self, ops, ctx, cache) -> tuple | None:
        """The arguments of the C++ ``decoder_layer`` (the whole layer in one call) where it computes this
        layer: the batch-invariant attention op over a cache, and weights ``layer_call_weights`` takes; else
        None. The weights part is made once."""
        at = self.self_attn
        if cache is None or not at.attn.batch_invariant or at.attn._ops(cache, ctx.mask) is None:
            return None
        if self._one_call is None:
            self._one_call = layer_call_weights(ops, self.input_layernorm, self.post_attention_layernorm,
                                                (at.qkv_proj, at.o_proj, self.mlp.gate_up_proj, self.mlp.down_proj),
                                                (at.h, at.hkv, at.d), at.attn.scale, at.q_norm, at.k_norm)
        return self._one_call or None

    _one_call = None  # ``one_call``'s weights part, () where the layer does not qualify

    def forward_fused(self, ops, vec, h, x, cos, sin, ctx, cache=None):
        """``forward`` with the residual adds fused into the norms after them (bfloat16, C++ ops): takes
        the residual stream ``h`` and the previous layer's MLP output ``x`` not yet added (None for the
        first layer) and returns this layer's (h, x). The same bits as ``forward``: ``h + x`` is torch's
        bfloat16 add and the norm ``RMSNorm``'s (``specserve/csrc/cpu_ops.cpp``)."""
        ln = self.input_layernorm
        if (one := self.one_call(ops, ctx, cache)) is not None:
            return decoder_layer_call(ops, one, vec, h, x, cos, sin, ctx, cache)
        if x is None:
            normed = ops.rms_norm(h, ln.weight, ln.eps, vec)
        else:
            h, normed = ops.add_rms_norm(h, x, ln.weight, ln.eps, vec)
        a = self.self_attn.forward(normed, cos, sin, ctx, cache)  # .forward: no nn.Module call overhead
        ln = self.post_attention_layernorm
        h, normed = ops.add_rms_norm(h, a, ln.weight, ln.eps, vec)
        return h, self.mlp.forward(normed)


def layer_call_weights(ops, input_norm: RMSNorm, post_norm: RMSNorm, lins: tuple, heads: tuple, scale: float,
                       q_norm: RMSNorm | None = None, k_norm: RMSNorm | None = None) -> tuple:
    """The weights part of the C++ ``decoder_layer``'s arguments for a decoder layer (the two norms, the
    qkv, o, gate_up and down linears, (H, Hkv, D), the attention scale, Qwen3's q/k norms or None), or ()
    where it cannot compute the layer: a linear not through ``ops``' ``GroupKernel``, with a bias, split
    over ranks or in row blocks, or q/k norms with another eps than the layer norms'."""
    ks = [lin.qkernel for lin in lins]
    eps = input_norm.eps
    if (not hasattr(ops, "decoder_layer") or any(getattr(k, "ops", None) is not ops for k in ks)
            or any(lin.bias is not None or lin.tp_size > 1 or lin.row_block for lin in lins)
            or post_norm.eps != eps or (q_norm is not None and not q_norm.eps == k_norm.eps == eps)):
        return ()
    qk_norm = None if q_norm is None else stack_head_norms(q_norm, heads[0], k_norm, heads[1])
    return ([input_norm.weight, post_norm.weight], eps, [k.weight for k in ks], [k.code for k in ks],
            [k.out_features for k in ks], list(heads), scale, qk_norm)


def decoder_layer_call(ops, one: tuple, vec: int, h, x, cos, sin, ctx, cache):
    """The C++ ``decoder_layer`` on a layer's ``one_call`` arguments and this forward's inputs."""
    norms, eps, weights, bits, n, heads, scale, qk_norm = one
    return ops.decoder_layer(h, x, norms, eps, vec, weights, bits, n, heads, cos, sin, cache, ctx.tables,
                             ctx.write_idx, ctx.kv_len, ctx.mask, ctx.is_causal, scale, cpu_ops.PARALLEL_WORK,
                             GROUP_GRAIN, GROUP_TILE, qk_norm)


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup, dtype):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp, dtype=dtype)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i, tp, dtype) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)


class LlamaForCausalLM(nn.Module):
    # checkpoint name fragment -> (our fused parameter fragment, shard id)
    packed_modules = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    ignored_checkpoint_keys = ("rotary_emb.inv_freq",)

    def __init__(self, cfg: ModelConfig, tp: TPGroup | None = None, dtype=torch.float32):
        super().__init__()
        tp = tp or TPGroup()
        self.config, self.tp = cfg, tp
        self.model = LlamaModel(cfg, tp, dtype)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp, dtype=dtype)
        if cfg.tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)
        self.logits_processor = LogitsProcessor(cfg.vocab_size)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, min(cfg.max_position_embeddings, 4096),
                                      cfg.rope_scaling)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext, aux_layers=()):
        """input_ids, positions [B, Q] -> (final normed hidden [B, Q, d], [outputs of ``aux_layers``, in
        that order]).

        The output of decoder layer i is HF's ``hidden_states[i + 1]`` (pre-norm residual stream)."""
        h = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary.rotation(ctx.positions_range or positions, h.dtype)
        caches = ctx.kv.kv if ctx.kv is not None else [None] * len(self.model.layers)
        kept = {}
        if (h.dtype == torch.bfloat16 and h.device.type == "cpu" and self.model.norm.weight.dtype == torch.bfloat16
                and (ops := cpu_ops.active()) is not None):
            # bfloat16 on CPU: each residual add fused into the norm after it (the same bits)
            vec, x = cpu_ops.norm_vec_width(), None
            plan = self._one_call_plan(ops, ctx, caches)  # every layer in one C++ call, or None
            for i, layer in enumerate(self.model.layers):
                if plan is not None:
                    h, x = decoder_layer_call(ops, plan[i], vec, h, x, cos, sin, ctx, caches[i])
                else:
                    h, x = layer.forward_fused(ops, vec, h, x, cos, sin, ctx, caches[i])
                if aux_layers and i in aux_layers:
                    kept[i] = h + x
            norm = self.model.norm
            return ops.add_rms_norm(h, x, norm.weight, norm.eps, vec)[1], [kept[i] for i in aux_layers]
        for i, layer in enumerate(self.model.layers):
            h = layer(h, cos, sin, ctx, caches[i])
            if aux_layers and i in aux_layers:
                kept[i] = h
        return self.model.norm(h), [kept[i] for i in aux_layers]  # in the order asked for

    _plan = None  # (ops, the first layer's _one_call, [each layer's one_call arguments] or ())

    def _one_call_plan(self, ops, ctx, caches) -> list | None:
        """Each layer's ``one_call`` arguments where every layer computes in one call this forward, else
        None: the layers' loop without ``forward_fused``, ``one_call`` and a dozen attribute lookups a
        layer. What depends on the forward (the cache, the mask, the ops switched on) is the same for
        every layer and checked on the first; the rest is made once (again when the first layer's
        ``_one_call`` is made anew)."""
        layers = self.model.layers
        if not len(layers) or layers[0].one_call(ops, ctx, caches[0]) is None:
            return None
        if self._plan is None or self._plan[0] is not ops or self._plan[1] is not layers[0]._one_call:
            ones = [layer.one_call(ops, ctx, cache) for layer, cache in zip(layers, caches)]
            self._plan = (ops, layers[0]._one_call, () if any(o is None for o in ones) else ones)
        return self._plan[2] or None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.logits_processor(self.lm_head, hidden)

    def checkpoint_name_map(self, name: str):
        """HF checkpoint name -> (our parameter name, shard id) or None to skip it."""
        if any(s in name for s in self.ignored_checkpoint_keys):
            return None
        if name == "lm_head.weight" and self.config.tie_word_embeddings:
            return None
        for frag, (ours, shard) in self.packed_modules.items():
            if f".{frag}." in name:
                return name.replace(f".{frag}.", f".{ours}."), shard
        return name, None

    def required_shards(self, param_name: str):
        for frag, (ours, _) in self.packed_modules.items():
            if f".{ours}." in param_name:
                return {s for f, (o, s) in self.packed_modules.items() if o == ours}
        return {None}
