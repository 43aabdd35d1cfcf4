"""The DFlash / DSpark drafter: a block-diffusion draft backbone conditioned on target features by KV
injection (``DFlashDrafter``, its ``DraftCache``), with DSpark's Markov and confidence heads
(``heads.py``) and the drafting loop that turns its slots into tokens (``drafting.py``).

Layout of one drafting step for a sequence whose next (not yet verified) token is the *anchor* at
absolute position ``p`` (the target's last sampled "bonus" token):

* the draft cache holds, per draft layer, the projected K/V of the context features (the outputs of
  ``cfg.target_layer_ids`` in the target, concatenated, then ``hidden_norm(fc(.))``) at every
  committed position ``< p``; each step only the newly committed tokens' features are projected
  (``DraftCache.extend``);
* the block input is ``[embed(anchor), embed(mask) x (B-1)]`` at positions ``p .. p+B-1``, with the
  TARGET's embedding (``embed_fn``; never copied into the drafter);
* every layer attends from the block to ``[context ; block]`` (context strictly before ``p``, the
  block bidirectionally: no causal mask inside the block); a quantized bfloat16 drafter on the CPU (the
  drafting worker's beside a GGUF target) runs each layer of a one-sequence block in one C++
  ``decoder_layer`` call (the target's, with Qwen3's q/k norms), the block's K/V written past the
  cache's end and never kept;
* the final-normed block hidden states give the draft slots: **anchor-first** (DSpark,
  ``sample_from_anchor=True``): all B slots, slot k predicts position ``p+k+1``; **mask-only**
  (DFlash, ``sample_from_anchor=False``): slots 1..B-1, slot k predicts position ``p+k`` (the anchor
  slot gives no draft). ``DSparkConfig.num_drafts`` is B or B-1 accordingly;
* ``draft_block`` turns the draft slots into tokens left to right: base logits ``U_k`` (the target's
  lm_head, or the drafter's own pruned head when ``draft_vocab_size < vocab_size``) plus the Markov
  bias ``B_k(x_{k-1})`` (``x_0`` = the anchor), greedy or sampled; with a sampled draft the exact
  corrected distribution ``q_k`` is kept (mapped to the target vocabulary) for lossless rejection
  sampling.

Parameter names follow the DeepSpec checkpoints (``fc.weight``, ``hidden_norm.weight``,
``layers.{i}.self_attn.{q,k,v,o}_proj.weight``, ``...{q,k}_norm.weight``,
``layers.{i}.mlp.{gate,up,down}_proj.weight``, ``layers.{i}.{input,post_attention}_layernorm.weight``,
``norm.weight``, ``markov_head.markov_w1.weight [V, r]``, ``markov_head.markov_w2.weight [V_draft, r]``,
``markov_head.gate_proj.*`` / ``markov_head.joint_proj.*``, ``confidence_head.proj.{weight,bias}``)
plus, for a pruned draft vocabulary, ``lm_head.weight [V_draft, d]`` and the ``d2t`` offsets
(``target_id = draft_id + d2t[draft_id]``). ``expected_state_shapes(cfg)`` lists them;
``specserve.spec_decode.dspark.formats`` converts DeepSpec, speculators and z-lab checkpoints to them.

Tensor parallelism: the drafter is replicated on every rank (its inputs, the target's layer outputs,
are full after the target's all-reduces). The Markov head is replicated by default (the small-heads
rule: a collective per draft position costs more than the replicated weights); ``replicate=False``
shards it (``VocabParallelEmbedding`` W1 + gathered ``ParallelLMHead`` W2) for comparison.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from specserve.distributed.parallel_state import TPGroup
from specserve.layers import cpu_ops
from specserve.layers.attention import ForwardContext
from specserve.layers.embed_head import LogitsProcessor, ParallelLMHead
from specserve.layers.linear import ReplicatedLinear, ShapeMismatch, default_weight_loader
from specserve.layers.norm import RMSNorm, rms_norm_heads, stack_head_norms
from specserve.layers.rotary import RotaryEmbedding, apply_rotary, rotate_
from specserve.models.llama import decoder_layer_call, layer_call_weights
from specserve.models.loader import CheckpointError
from specserve.spec_decode.dspark.config import DSparkConfig
from specserve.spec_decode.dspark.drafting import (
    DraftBlock,
    DraftTree,
    draft_block,
    draft_blocks,
    draft_target_ids,
    draft_trees,
)
from specserve.spec_decode.dspark.heads import ConfidenceHead, MarkovHead

# ---- backbone -------------------------------------------------------------------------------------


class DFlashAttention(nn.Module):
    """Non-causal attention of the block over ``[context ; block]``. K/V of the context are computed
    once by ``project_kv`` (cached); the block's own K/V in every forward."""

    def __init__(self, cfg: DSparkConfig, dtype):
        super().__init__()
        d, H, Hkv, D = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.H, self.Hkv, self.D = H, Hkv, D
        self.q_proj = ReplicatedLinear(d, H * D, cfg.attention_bias, dtype=dtype)
        self.k_proj = ReplicatedLinear(d, Hkv * D, cfg.attention_bias, dtype=dtype)
        self.v_proj = ReplicatedLinear(d, Hkv * D, cfg.attention_bias, dtype=dtype)
        self.o_proj = ReplicatedLinear(H * D, d, False, dtype=dtype)
        self.q_norm = RMSNorm(D, cfg.rms_norm_eps, dtype)
        self.k_norm = RMSNorm(D, cfg.rms_norm_eps, dtype)
        self.scale = D**-0.5
        self.qkv_proj = None  # set by ``fuse``
        self.qk_norm_weight = None

    def fuse(self) -> None:
        """For inference: q, k and v in one GEMM (one weight read, one call), and q_norm, k_norm and the
        rotation over all heads of q and k at once. Same math as the separate layers (each output is the
        same dot product; the norms are per head); the separate q/k/v weights are dropped, so a fused
        layer no longer trains or saves."""
        self.qkv_proj = ReplicatedLinear.stacked([self.q_proj, self.k_proj, self.v_proj])
        self.qk_norm_weight = stack_head_norms(self.q_norm, self.H, self.k_norm, self.Hkv)
        self.q_proj = self.k_proj = self.v_proj = None

    def project_kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [..., n, d] -> k, v [..., Hkv, n, D] (k normed per head and rotated at its positions)."""
        shape = (*x.shape[:-1], self.Hkv, self.D)
        k = apply_rotary(self.k_norm(self.k_proj(x).view(shape)), cos, sin)
        v = self.v_proj(x).view(shape)
        return k.transpose(-3, -2), v.transpose(-3, -2)

    def forward(self, x, cos, sin, ctx_k, ctx_v, mask):
        """A batch of S rows of Q block tokens each: x [S, Q, d] (after input_layernorm), cos/sin
        [S, Q, 1, D], ctx_k/v [S, Hkv, n, D] (the context, already projected), mask None or bool
        [S, 1, Q, n + Q] -> [S, Q, d]. Differentiable (the trainer runs it too)."""
        S, Q, _ = x.shape
        if self.qkv_proj is not None:  # fused for inference (``fuse``)
            H, Hkv = self.H, self.Hkv
            qkv = self.qkv_proj(x).view(S, Q, H + 2 * Hkv, self.D)
            qk = apply_rotary(rms_norm_heads(qkv[:, :, : H + Hkv], self.qk_norm_weight, self.q_norm.eps), cos, sin)
            q, k = qk[:, :, :H].transpose(1, 2), qk[:, :, H:].transpose(1, 2)
            v = qkv[:, :, H + Hkv :].transpose(1, 2)
        else:
            q = apply_rotary(self.q_norm(self.q_proj(x).view(S, Q, self.H, self.D)), cos, sin).transpose(1, 2)
            k = apply_rotary(self.k_norm(self.k_proj(x).view(S, Q, self.Hkv, self.D)), cos, sin).transpose(1, 2)
            v = self.v_proj(x).view(S, Q, self.Hkv, self.D).transpose(1, 2)
        k = torch.cat([ctx_k.to(k.dtype), k], dim=2)
        v = torch.cat([ctx_v.to(v.dtype), v], dim=2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale,
                                             enable_gqa=self.H != self.Hkv)  # no repeated copies of k/v
        return self.o_proj(out.transpose(1, 2).reshape(S, Q, self.H * self.D))


class DFlashMLP(nn.Module):
    def __init__(self, cfg: DSparkConfig, dtype):
        super().__init__()
        self.gate_proj = ReplicatedLinear(cfg.hidden_size, cfg.intermediate_size, False, dtype=dtype)
        self.up_proj = ReplicatedLinear(cfg.hidden_size, cfg.intermediate_size, False, dtype=dtype)
        self.down_proj = ReplicatedLinear(cfg.intermediate_size, cfg.hidden_size, False, dtype=dtype)
        self.gate_up_proj = None  # set by ``fuse``

    def fuse(self) -> None:
        """For inference: gate and up projections in one GEMM (the separate weights are dropped)."""
        self.gate_up_proj = ReplicatedLinear.stacked([self.gate_proj, self.up_proj])
        self.gate_proj = self.up_proj = None

    def forward(self, x):
        if self.gate_up_proj is not None:  # silu(gate) * up in one pass where the C++ op runs
            return self.down_proj(cpu_ops.silu_mul(self.gate_up_proj(x)))
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, cfg: DSparkConfig, dtype):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = DFlashAttention(cfg, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = DFlashMLP(cfg, dtype)

    def forward(self, h, cos, sin, ctx_k, ctx_v, mask):
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, ctx_k, ctx_v, mask)
        return h + self.mlp(self.post_attention_layernorm(h))

    def call_weights(self, ops) -> tuple:
        """``layer_call_weights`` of this layer once fused (``DFlashAttention.fuse``, ``DFlashMLP.fuse``), else ()."""
        at, mlp = self.self_attn, self.mlp
        if at.qkv_proj is None or mlp.gate_up_proj is None:
            return ()
        return layer_call_weights(ops, self.input_layernorm, self.post_attention_layernorm,
                                  (at.qkv_proj, at.o_proj, mlp.gate_up_proj, mlp.down_proj), (at.H, at.Hkv, at.D),
                                  at.scale, at.q_norm, at.k_norm)


class DraftCache:
    """The drafter's KV cache of ONE sequence: per draft layer, the projected K/V of the context
    features at their absolute positions, ``kv`` [num_layers, 2, Hkv, capacity, D] (a layer's entry is
    the one-block pool the C++ ``decoder_layer`` reads; the capacity a power of two). ``extend`` projects
    only the new rows; ``crop(n)`` keeps the first n entries (rollback). The block's own K/V are never
    kept (each step recomputes them; the one-call forward writes them past the end), so nothing needs
    cropping after a block forward."""

    def __init__(self, drafter: "DFlashDrafter", capacity: int = 64):
        cfg = drafter.cfg
        self.drafter = drafter
        self.length = 0
        p = next(drafter.parameters())
        self._shape = (cfg.num_layers, cfg.num_key_value_heads, cfg.head_dim)
        self._dtype, self._device = p.dtype, p.device
        self.kv = None
        self._alloc(max(1, capacity))

    def _alloc(self, cap: int) -> None:
        L, Hkv, D = self._shape
        cap = 1 << (cap - 1).bit_length()
        kv = torch.zeros(L, 2, Hkv, cap, D, dtype=self._dtype, device=self._device)
        pos = torch.zeros(cap, dtype=torch.long, device=self._device)
        if self.kv is not None and self.length:
            n = self.length
            kv[..., :n, :], pos[:n] = self.kv[..., :n, :], self._pos[:n]
        self.kv, self._pos = kv, pos

    def reserve(self, n: int) -> None:
        """Room for ``n`` entries (the capacity doubled as needed), the kept ones unchanged."""
        if n > self.capacity:
            self._alloc(max(n, 2 * self.capacity))

    @property
    def k(self) -> torch.Tensor:
        """Keys [num_layers, Hkv, capacity, D] (a view)."""
        return self.kv[:, 0]

    @property
    def v(self) -> torch.Tensor:
        return self.kv[:, 1]

    @property
    def capacity(self) -> int:
        return self._pos.shape[0]

    def __len__(self) -> int:
        return self.length

    @property
    def positions(self) -> torch.Tensor:
        return self._pos[: self.length]

    @torch.no_grad()
    def extend(self, features: torch.Tensor, positions) -> None:
        """Append the context rows ``features`` [n, m*d] (target layer outputs, concatenated in
        ``target_layer_ids`` order) at absolute ``positions`` [n] (a ``range`` of step 1: consecutive)."""
        n = features.shape[0]
        if n == 0:
            return
        span = (positions.start, positions.stop) if isinstance(positions, range) and positions.step == 1 else None
        positions = (torch.arange(*span, device=self._device) if span else
                     torch.as_tensor(positions, dtype=torch.long, device=self._device).reshape(-1))
        if positions.numel() != n:
            raise ValueError(f"{n} feature rows but {positions.numel()} positions")
        k, v = self.drafter.project_context(features, span or positions)
        self.reserve(self.length + n)
        a, b = self.length, self.length + n
        self.k[:, :, a:b] = k
        self.v[:, :, a:b] = v
        self._pos[a:b] = positions
        self.length = b

    def crop(self, n: int) -> None:
        """Keep the first ``n`` entries."""
        if not (0 <= n <= self.length):
            raise ValueError(f"cannot crop a draft cache of {self.length} entries to {n}")
        self.length = n

    def reset(self) -> None:
        self.length = 0

    def layer_kv(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[i, :, : self.length], self.v[i, :, : self.length]


class DFlashDrafter(nn.Module):
    """The DFlash backbone (``fc``, ``hidden_norm``, ``layers``, ``norm``) with DSpark's optional
    ``markov_head`` / ``confidence_head`` and, for a pruned vocabulary, its own ``lm_head`` + ``d2t``.
    Embedding and (full-vocabulary) lm_head are the target's, passed at call time.

    ``forward_blocks`` runs one block per sequence for a batch of sequences (each with its own
    ``DraftCache``, the contexts padded and masked) in one forward; ``forward_block`` is one of them;
    ``forward_anchored_blocks`` is the trainer's shape (many blocks per sequence over its whole context)."""

    def __init__(self, cfg: DSparkConfig, tp: TPGroup | None = None, dtype=torch.float32,
                 markov_replicate: bool = True):
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        d = cfg.hidden_size
        self.fc = ReplicatedLinear(cfg.num_aux_layers * d, d, False, dtype=dtype)
        self.hidden_norm = RMSNorm(d, cfg.rms_norm_eps, dtype)
        self.layers = nn.ModuleList(DFlashDecoderLayer(cfg, dtype) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(d, cfg.rms_norm_eps, dtype)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, 4096, cfg.rope_scaling)
        self.lm_head = None
        d2t = None
        if cfg.pruned_vocab:  # the drafter's own head over the draft vocabulary, replicated
            self.lm_head = ParallelLMHead(cfg.draft_vocab_size, d, tp, disable_tp=True, dtype=dtype)
            d2t = torch.zeros(cfg.draft_vocab_size, dtype=torch.long)
        self.register_buffer("d2t", d2t)  # draft id -> target id offsets (None: same vocabulary)
        self.logits_processor = LogitsProcessor(cfg.draft_vocab_size)
        self.markov_head = None
        if cfg.has_markov:
            self.markov_head = MarkovHead(cfg.vocab_size, cfg.draft_vocab_size, cfg.markov_rank, d,
                                          cfg.markov_head_type, tp, markov_replicate, dtype)
        self.confidence_head = None
        if cfg.enable_confidence_head:
            self.confidence_head = ConfidenceHead(d, cfg.markov_rank, cfg.confidence_head_with_markov, dtype)
        self.ctx_kv_proj = None  # ``fuse_projections``
        self.ctx_k_norm_weight = None

    # -- context ------------------------------------------------------------------------------------
    def new_cache(self, capacity: int = 64) -> DraftCache:
        return DraftCache(self, capacity)

    def context_features(self, features: torch.Tensor) -> torch.Tensor:
        """H_ctx = hidden_norm(fc(features)): [n, m*d] -> [n, d]."""
        w = self.hidden_norm.weight
        return self.hidden_norm(self.fc(features.to(device=w.device, dtype=w.dtype)))

    def project_context(self, features: torch.Tensor, positions: torch.Tensor | tuple[int, int]):
        """Context rows [n, m*d] at positions [n] (or the range (a, b)) -> k, v [num_layers, Hkv, n, D]
        (every layer's)."""
        h = self.context_features(features)
        if self.ctx_kv_proj is None:
            if isinstance(positions, tuple):
                positions = torch.arange(*positions, device=h.device)
            cos, sin = self.rotary.cos_sin(positions, h.dtype)
            kv = [layer.self_attn.project_kv(h, cos, sin) for layer in self.layers]
            return torch.stack([k for k, _ in kv]), torch.stack([v for _, v in kv])
        n, L, Hkv, D = h.shape[0], len(self.layers), self.cfg.num_key_value_heads, self.cfg.head_dim
        kv = self.ctx_kv_proj(h).view(n, 2, L * Hkv, D)
        cos, sin = self.rotary.rotation(positions, h.dtype)  # (``rotate_``: apply_rotary's bits, in place)
        k = rotate_(rms_norm_heads(kv[:, 0], self.ctx_k_norm_weight, self.cfg.rms_norm_eps), cos.view(n, 1, D),
                    sin.view(n, 1, D))
        return k.view(n, L, Hkv, D).permute(1, 2, 0, 3), kv[:, 1].view(n, L, Hkv, D).permute(1, 2, 0, 3)

    def fuse_projections(self) -> None:
        """For inference (the drafting worker): fewer, larger GEMMs and fewer small ops per drafting step,
        the same math. Each layer's q/k/v and gate/up projections become one GEMM each
        (``DFlashAttention.fuse``, ``DFlashMLP.fuse``), and the context K/V of all layers one GEMM with
        their k_norms in one call (``project_context``); a vanilla Markov head keeps a copy of its weights
        for the C++ tree search (``MarkovHead.pack_for_search``). Call after the weights are loaded and
        before ``pack_linears``; a fused drafter no longer trains or saves."""
        if self.ctx_kv_proj is not None:
            return
        attn = [layer.self_attn for layer in self.layers]
        self.ctx_kv_proj = ReplicatedLinear.stacked([a.k_proj for a in attn] + [a.v_proj for a in attn])
        self.ctx_k_norm_weight = torch.cat([a.k_norm.weight.data.expand(a.Hkv, a.D) for a in attn])
        for layer in self.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()
        if self.markov_head is not None:  # the tree search's own copy of the Markov weights
            self.markov_head.pack_for_search(draft_target_ids(self.d2t))

    # -- block --------------------------------------------------------------------------------------
    def block_input_ids(self, anchor) -> torch.Tensor:
        """[anchor, mask x (block_size - 1)] (target ids) -> [block_size] long."""
        ids = torch.full((self.cfg.block_size,), int(self.cfg.mask_token_id), dtype=torch.long,
                         device=self.norm.weight.device)
        ids[0] = torch.as_tensor(anchor).reshape(())
        return ids

    @torch.no_grad()
    def forward_block(self, anchor, start_pos: int, cache: DraftCache,
                      embed_fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """The block ``[anchor, mask x (B-1)]`` at positions ``start_pos ..`` over the cached context
        -> final-normed hidden [B, d] of every slot (``draft_hidden`` selects the draft slots).
        ``embed_fn``: the target's embedding, ids [n] -> [n, d]."""
        x = embed_fn(self.block_input_ids(anchor))
        return self.forward_block_embeds(x, start_pos, cache)

    @torch.no_grad()
    def forward_block_embeds(self, x: torch.Tensor, start_pos: int, cache: DraftCache) -> torch.Tensor:
        """Block input embeddings [B, d] at positions ``start_pos .. start_pos+B-1`` -> [B, d]. The block
        sees every cached context entry at a position < ``start_pos`` and itself, bidirectionally."""
        return self.forward_blocks(x.unsqueeze(0), [start_pos], [cache])[0]

    @torch.no_grad()
    def forward_blocks(self, x: torch.Tensor, start_pos, caches: list) -> torch.Tensor:
        """A batch of blocks, one per sequence: input embeddings x [S, B, d], row s at positions
        ``start_pos[s] ..`` over ``caches[s]`` -> final-normed hidden [S, B, d]. Each row sees the
        entries of its own cache at positions < its start and its own block, bidirectionally."""
        S, B = x.shape[:2]
        x = x.to(device=self.norm.weight.device, dtype=self.norm.weight.dtype)
        if S == 1 and (out := self._forward_in_layer_calls(x, int(start_pos[0]), caches[0])) is not None:
            return out
        dev = x.device
        starts = torch.as_tensor(list(start_pos), dtype=torch.long, device=dev).reshape(S)
        pos = starts.unsqueeze(1) + torch.arange(B, device=dev)
        cos, sin = self.rotary.cos_sin(pos, x.dtype)
        n = max(len(c) for c in caches)
        if S == 1:  # views of the one cache, no copy
            visible = caches[0].positions.unsqueeze(0) < starts.unsqueeze(1)
            kv = [tuple(t.unsqueeze(0) for t in caches[0].layer_kv(i)) for i in range(len(self.layers))]
        else:  # the contexts right-padded to the longest
            Hkv, D = self.cfg.num_key_value_heads, self.cfg.head_dim
            visible = torch.zeros(S, n, dtype=torch.bool, device=dev)
            kv = []
            for i in range(len(self.layers)):
                k = x.new_zeros(S, Hkv, n, D)
                v = x.new_zeros(S, Hkv, n, D)
                for r, c in enumerate(caches):
                    ck, cv = c.layer_kv(i)
                    k[r, :, : len(c)], v[r, :, : len(c)] = ck, cv
                kv.append((k, v))
            for r, c in enumerate(caches):
                visible[r, : len(c)] = c.positions < starts[r]
        mask = None
        if n and not bool(visible.all()):
            mask = torch.cat([visible.unsqueeze(1).expand(S, B, n),
                              visible.new_ones(S, B, B)], dim=-1).unsqueeze(1)  # [S, 1, B, n + B]
        return self._decode(x, cos, sin, kv, mask)

    _calls = None  # (ops, the first layer's qkv kernel, each layer's ``call_weights`` or None)

    def _layer_calls(self, ops) -> list | None:
        """Each layer's ``call_weights`` where the C++ ``decoder_layer`` computes every layer (a fused
        bfloat16 drafter whose linears run through ``ops``' group kernel: a quantized drafter), else None;
        made once (again when the layers' kernels change)."""
        first = getattr(self.layers[0].self_attn.qkv_proj, "qkernel", None) if len(self.layers) else None
        if self._calls is None or self._calls[0] is not ops or self._calls[1] is not first:
            calls = [layer.call_weights(ops) for layer in self.layers]
            ok = calls and all(calls) and self.norm.weight.dtype == torch.bfloat16
            self._calls = (ops, first, calls if ok else None)
        return self._calls[2]

    def _forward_in_layer_calls(self, x: torch.Tensor, start: int, cache: DraftCache) -> torch.Tensor | None:
        """``forward_blocks`` of one block x [1, B, d] (bfloat16, CPU) with each layer in one C++
        ``decoder_layer`` call, or None where it cannot (``_layer_calls``). The block's own keys and values
        go to ``cache`` past its end (scratch, not kept) and the block attends to the cache and itself."""
        if x.device.type != "cpu" or x.dtype != torch.bfloat16 or (ops := cpu_ops.active()) is None:
            return None
        calls = self._layer_calls(ops)
        if calls is None:
            return None
        n, B = len(cache), x.shape[1]
        cache.reserve(n + B)
        visible = cache.positions < start
        mask = None
        if n and not bool(visible.all()):
            mask = torch.cat([visible, visible.new_ones(B)]).view(1, 1, 1, n + B)
        ctx = ForwardContext(None, tables=torch.zeros(1, 1, dtype=torch.long),
                             write_idx=torch.arange(n, n + B).view(1, B), kv_len=n + B, mask=mask)
        cos, sin = self.rotary.rotation((start, start + B), x.dtype)
        vec = cpu_ops.norm_vec_width()
        h, out = x.contiguous(), None
        for i, one in enumerate(calls):
            h, out = decoder_layer_call(ops, one, vec, h, out, cos, sin, ctx, cache.kv[i].unsqueeze(0))
        return ops.add_rms_norm(h, out, self.norm.weight, self.norm.eps, vec)[1]

    def forward_anchored_blocks(self, x: torch.Tensor, anchors: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """The training shape: N blocks of each of S sequences over its whole context, in one differentiable
        forward. x [S, N, B, d]: block input embeddings; anchors [S, N]: the position of each block's first
        slot; features [S, T, m*d]: each sequence's context features at positions 0 .. T-1 (zero past its
        end) -> final-normed hidden [S, N, B, d]. Block (s, n) sees row s's context at positions
        < anchors[s, n] and itself, bidirectionally, not the other blocks: what ``forward_blocks`` gives it
        over a ``DraftCache`` holding that context."""
        S, N, B = x.shape[:3]
        T, dtype, dev = features.shape[1], self.norm.weight.dtype, features.device
        x = x.reshape(S, N * B, -1).to(dtype)
        pos = (anchors.unsqueeze(-1) + torch.arange(B, device=dev)).reshape(S, N * B)
        ctx = self.context_features(features)  # [S, T, d]
        cpos = torch.arange(T, device=dev).unsqueeze(0).expand(S, T)
        cos, sin = self.rotary.cos_sin(pos, dtype)
        cos_c, sin_c = self.rotary.cos_sin(cpos, dtype)
        vis_ctx = cpos.unsqueeze(1) < anchors.repeat_interleave(B, dim=1).unsqueeze(2)  # [S, N*B, T]
        blk = torch.arange(N, device=dev).repeat_interleave(B)
        vis_blk = (blk.unsqueeze(1) == blk.unsqueeze(0)).unsqueeze(0).expand(S, N * B, N * B)
        mask = torch.cat([vis_ctx, vis_blk], dim=-1).unsqueeze(1)
        kv = [layer.self_attn.project_kv(ctx, cos_c, sin_c) for layer in self.layers]
        return self._decode(x, cos, sin, kv, mask).view(S, N, B, -1)

    def _decode(self, h, cos, sin, kv, mask) -> torch.Tensor:
        """The decoder layers over the projected context ``kv`` (one (k, v) per layer), then the final norm."""
        for layer, (ck, cv) in zip(self.layers, kv):
            h = layer(h, cos, sin, ck, cv, mask)
        return self.norm(h)

    def draft_hidden(self, block_hidden: torch.Tensor) -> torch.Tensor:
        """[..., B, d] -> the draft slots [..., num_drafts, d] (all slots anchor-first; slots 1.. mask-only)."""
        return block_hidden[..., self.cfg.first_draft_slot :, :]

    # -- logits and drafting ------------------------------------------------------------------------
    def base_logits(self, hidden: torch.Tensor,
                    target_logits_fn: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        """U = lm_head(h) over the draft vocabulary, float32: the drafter's own head for a pruned
        vocabulary (never the target's), else ``target_logits_fn`` (the target's ``compute_logits``)."""
        if self.lm_head is not None:
            return self.logits_processor(self.lm_head, hidden).float()
        if target_logits_fn is None:
            raise ValueError("this drafter uses the target's lm_head: pass target_logits_fn")
        return target_logits_fn(hidden).float()

    @torch.no_grad()
    def propose(self, anchor, start_pos: int, cache: DraftCache, embed_fn, target_logits_fn=None,
                temperature: float | None = 0.0, generator: torch.Generator | None = None,
                num_drafts: int | None = None) -> DraftBlock:
        """One drafting step of one sequence: block forward + ``draft_block``."""
        hidden = self.draft_hidden(self.forward_block(anchor, start_pos, cache, embed_fn))
        return draft_block(lambda h: self.base_logits(h, target_logits_fn), hidden, anchor, self.markov_head,
                           temperature, generator, self.d2t, confidence_head=self.confidence_head,
                           target_vocab_size=self.cfg.vocab_size, num_drafts=num_drafts)

    @torch.no_grad()
    def propose_batch(self, anchors: list[int], start_pos: list[int], caches: list, embed_fn, target_logits_fn=None,
                      temperatures=None, generators=None, num_drafts: int | None = None) -> DraftBlock:
        """One drafting step of a batch of sequences (one block forward, one base-logits GEMM, the
        Markov loop batched): ``draft_blocks`` outputs with a leading batch dimension."""
        ids, hidden = self._draft_slots(anchors, start_pos, caches, embed_fn)
        return draft_blocks(lambda h: self.base_logits(h, target_logits_fn), hidden, ids, self.markov_head,
                            temperatures, generators, self.d2t, confidence_head=self.confidence_head,
                            target_vocab_size=self.cfg.vocab_size, num_drafts=num_drafts)

    @torch.no_grad()
    def propose_tree_batch(self, anchors: list[int], start_pos: list[int], caches: list, embed_fn,
                           target_logits_fn=None, temperatures=None, num_drafts: int | None = None, topk: int = 4,
                           beam: int = 4, confidence_temperatures=None, min_score: float = 0.0) -> DraftTree:
        """Candidate draft trees of a batch of sequences (``draft_trees``) from one block forward."""
        ids, hidden = self._draft_slots(anchors, start_pos, caches, embed_fn)
        return draft_trees(lambda h: self.base_logits(h, target_logits_fn), hidden, ids, self.markov_head,
                           topk=topk, beam=beam, temperatures=temperatures, confidence_head=self.confidence_head,
                           confidence_temperatures=confidence_temperatures, d2t=self.d2t, num_drafts=num_drafts,
                           min_score=min_score)

    def _draft_slots(self, anchors, start_pos, caches, embed_fn) -> tuple[torch.Tensor, torch.Tensor]:
        """The anchors [S] and the draft slots' hidden states [S, g, d] of one block forward."""
        ids = torch.as_tensor(anchors, dtype=torch.long, device=self.norm.weight.device).reshape(-1)
        rows = embed_fn(ids)  # [S, d]: only the anchor varies; the mask slots' row is looked up once
        S, B = rows.shape[0], self.cfg.block_size
        mask = self.mask_row(embed_fn)
        x = torch.cat([rows.unsqueeze(1), mask.to(rows.dtype).expand(S, B - 1, -1)], 1) if B > 1 else rows.unsqueeze(1)
        return ids, self.draft_hidden(self.forward_blocks(x, start_pos, caches))

    _mask_rows = None  # (embed_fn, its row of the mask token): ``mask_row``

    def mask_row(self, embed_fn) -> torch.Tensor:
        """``embed_fn`` of the mask token, [1, d], looked up once per embedding function (with tensor
        parallelism a collective, at the first drafting step of every rank)."""
        if self._mask_rows is None or self._mask_rows[0] is not embed_fn:
            ids = torch.full((1,), int(self.cfg.mask_token_id), dtype=torch.long, device=self.norm.weight.device)
            self._mask_rows = (embed_fn, embed_fn(ids))
        return self._mask_rows[1]

    # -- weights ------------------------------------------------------------------------------------
    def _tensors(self) -> dict[str, torch.Tensor]:
        if self.ctx_kv_proj is not None:
            raise RuntimeError("a drafter fused for inference (fuse_projections) has no checkpoint tensors")
        out = dict(self.named_parameters())
        if self.d2t is not None:
            out["d2t"] = self.d2t
        return out

    def state_for_save(self) -> dict[str, torch.Tensor]:
        return {k: v.detach() for k, v in self._tensors().items()}

    def load_state(self, sd: dict[str, torch.Tensor]) -> None:
        """Load our names (``expected_state_shapes``); every tensor must be present with its exact
        shape. Errors name the tensor."""
        want = self._tensors()
        missing = sorted(set(want) - set(sd))
        if missing:
            raise CheckpointError(f"drafter checkpoint is missing {', '.join(missing[:6])}"
                                  + (" ..." if len(missing) > 6 else ""))
        unexpected = sorted(set(sd) - set(want))
        if unexpected:
            raise CheckpointError(f"drafter checkpoint has unexpected tensors {', '.join(unexpected[:6])}")
        with torch.no_grad():
            for name, p in want.items():
                t = sd[name]
                try:
                    if name == "d2t":
                        if tuple(t.shape) != tuple(p.shape):
                            raise ShapeMismatch(tuple(p.shape), tuple(t.shape))
                        p.copy_(t.to(torch.long))
                        continue
                    getattr(p, "weight_loader", default_weight_loader)(p, t.to(p.dtype))
                except ShapeMismatch as e:
                    raise CheckpointError(f"drafter tensor {name!r}: checkpoint shape {e.got}, "
                                          f"expected {e.expected}") from None
