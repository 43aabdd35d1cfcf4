"""Medusa heads: K heads on the target's last hidden state (after the final norm); head k predicts
token t+k+1. Each head is a stack of L residual blocks ``x + SiLU(W x + b)`` (a real ModuleList, no
weight tying) followed by its own vocab projection, or by the target's own ``lm_head`` when the
checkpoint shares it (Medusa "v2" / vLLM ``original_lm_head``).

With ``token_input`` each head's first block also reads the target's embedding e of the token the
target has just emitted from that state (token t+1, the root of the step's tree, known before any
head runs): ``x + SiLU(W x + U e + b)``. Plain Medusa heads guess token t+2 without knowing t+1; these
know it, and the heads stay independent of each other, so chains and trees are drafted as before.

The heads are small next to the cost of a collective, so under tensor parallelism they are
replicated on every rank: an own head is ``ParallelLMHead(..., disable_tp=True)`` (full vocabulary,
no gather); only a shared head goes through the target's sharded ``lm_head``.

Our checkpoint format (``specserve-medusa``): a directory with ``config.json``::

    {"format": "specserve-medusa", "num_heads": K, "num_layers": L, "hidden_size": d,
     "vocab_size": V, "shared_lm_head": bool, "bias": bool, "base_model": "...",
     "draft_vocab_size": N or null, "token_input": bool}

and ``medusa.safetensors`` with ``blocks.{h}.{l}.weight`` [d, d], ``blocks.{h}.{l}.bias`` [d] (when
``bias``), ``blocks.{h}.0.token_weight`` [d, d] (U, when ``token_input``) and, unless shared,
``lm_heads.{h}.weight`` [V, d].

A *draft vocabulary* (``draft_vocab_size`` N < V, vLLM's ``truncated_vocab_size``) limits the heads'
candidates to N target tokens, listed by ``token_map`` [N] (int64 target ids, saved with the weights):
the heads' logits are then [.., N] (own heads are [N, d]; a shared head uses those N rows of the
target's lm_head), and drafted indices are mapped through ``token_map``. Drafting gets N/V as
expensive; verification is unchanged, so it stays lossless. Other formats (FasterDecoding, vLLM,
Medusa-2 full checkpoints) are converted to these names by ``specserve.spec_decode.medusa.formats``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specserve.distributed.parallel_state import TPGroup
from specserve.layers.embed_head import LogitsProcessor, ParallelLMHead
from specserve.layers.quant import make_kernel, quantize
from specserve.models.loader import CheckpointError

FORMAT = "specserve-medusa"


@dataclass
class MedusaConfig:
    num_heads: int
    num_layers: int
    hidden_size: int
    vocab_size: int
    shared_lm_head: bool = True
    bias: bool = True
    base_model: str | None = None
    draft_vocab_size: int | None = None  # None: the whole vocabulary; else a token_map of that many ids
    token_input: bool = False  # the first blocks also read the embedding of the step's root token

    def validate(self) -> None:
        if not (1 <= self.num_heads <= 32):
            raise ValueError(f"medusa num_heads must be in 1..32, got {self.num_heads}")
        if self.num_layers < 0:
            raise ValueError(f"medusa num_layers must be >= 0, got {self.num_layers}")
        if self.draft_vocab_size is not None and not 1 <= self.draft_vocab_size < self.vocab_size:
            raise ValueError(f"medusa draft_vocab_size must be in 1..{self.vocab_size - 1}, "
                             f"got {self.draft_vocab_size}")
        if self.token_input and self.num_layers < 1:
            raise ValueError("medusa token_input needs num_layers >= 1 (the first block reads the token)")

    @property
    def head_vocab_size(self) -> int:
        """Rows of the heads' logits: the draft vocabulary's size, or the whole vocabulary's."""
        return self.draft_vocab_size or self.vocab_size

    def to_json(self) -> dict:
        return {"format": FORMAT, **asdict(self)}


class ResBlock(nn.Module):
    """``x + SiLU(W x + b)``; with ``token_input``, ``x + SiLU(W x + U e + b)`` (e: a token embedding)."""

    def __init__(self, d: int, bias: bool, dtype, token_input: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(d, d, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(d, dtype=dtype)) if bias else None
        self.token_weight = nn.Parameter(torch.zeros(d, d, dtype=dtype)) if token_input else None

    def forward(self, x, emb=None):
        z = F.linear(x, self.weight, self.bias)
        if self.token_weight is not None:
            z = z + F.linear(emb, self.token_weight)
        return x + F.silu(z)


class MedusaHeads(nn.Module):
    def __init__(self, cfg: MedusaConfig, tp: TPGroup | None = None, dtype=torch.float32):
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        self.blocks = nn.ModuleList(
            nn.ModuleList(ResBlock(cfg.hidden_size, cfg.bias, dtype, cfg.token_input and l == 0)
                          for l in range(cfg.num_layers))
            for _ in range(cfg.num_heads)
        )
        self.lm_heads = None
        Vh = cfg.head_vocab_size
        if not cfg.shared_lm_head:  # replicated on every rank: full vocab, no gather
            self.lm_heads = nn.ModuleList(
                ParallelLMHead(Vh, cfg.hidden_size, tp, disable_tp=True, dtype=dtype)
                for _ in range(cfg.num_heads)
            )
        self.register_buffer("token_map", torch.arange(Vh) if cfg.draft_vocab_size else None)
        self.logits_processor = LogitsProcessor(Vh)

    def to_target(self, idx: torch.Tensor) -> torch.Tensor:
        """Indices into the heads' logits -> target token ids."""
        return idx if self.token_map is None else self.token_map[idx]

    def pack_first_blocks(self, bits: int | None = None) -> None:
        """Run every head's first residual block as one GEMM: one weight read a drafting step instead of
        one small GEMM a head. CPU: a oneDNN-packed copy of their stacked weights, or with ``bits`` (8 or
        4) the weights quantized in groups of 32 columns through ``layers.quant``'s kernels (beside a
        quantized target: fewer bytes a step; the heads only draft)."""
        if self.cfg.num_layers == 0:
            return
        first = [blocks[0] for blocks in self.blocks]
        w = torch.cat([b.weight.detach() if b.token_weight is None  # with token_input: [W U] on [x; e]
                       else torch.cat([b.weight.detach(), b.token_weight.detach()], 1) for b in first])
        bias = torch.cat([b.bias.detach() for b in first]) if self.cfg.bias else None
        if bits:
            self._first = (make_kernel(quantize(w, bits, 32, f"int{bits}-g32")), bias)
        else:
            self._first = (torch.ops.mkldnn._reorder_linear_weight(w, 16), bias)

    _first = None  # (packed stacked weight or quantized kernel, stacked bias): ``pack_first_blocks``

    def head_states(self, hidden: torch.Tensor, emb: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [N, d] -> [N, K, d]: each head's residual stack applied to the target state. ``emb``
        [N, d]: the target's embedding of each row's root token (required with ``token_input``)."""
        if self.cfg.token_input and emb is None:
            raise ValueError("these Medusa heads read the root token's embedding (token_input); pass emb")
        first = None
        if self._first is not None:
            w, bias = self._first
            x_in = hidden if not self.cfg.token_input else torch.cat([hidden, emb.to(hidden.dtype)], -1)
            y = None
            if not isinstance(w, torch.Tensor):  # a quantized kernel: any float dtype
                y = w(x_in, bias)
            elif hidden.dtype == w.dtype:
                y = torch.ops.mkldnn._linear_pointwise(x_in, w, bias, "none", [], "")
            if y is not None:
                K, d = self.cfg.num_heads, self.cfg.hidden_size
                first = hidden.unsqueeze(1) + F.silu(y.view(-1, K, d))  # [N, K, d]
                if self.cfg.num_layers == 1:
                    return first
        outs = []
        for i, blocks in enumerate(self.blocks):  # (indexing, not slicing: a slice builds a new container)
            x = hidden if first is None else first[:, i]
            for j in range(0 if first is None else 1, len(blocks)):
                x = blocks[j](x, emb)
            outs.append(x)
        return torch.stack(outs, dim=1)

    def logits(self, hidden: torch.Tensor, target_lm_head: ParallelLMHead | None = None,
               emb: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [N, d] -> logits [N, K, V'] (float32; V' = ``cfg.head_vocab_size``, map indices with
        ``to_target``). A shared head is passed as ``target_lm_head`` (its draft-vocabulary rows when
        there is a token_map); ``emb``: as ``head_states``."""
        states = self.head_states(hidden, emb)
        if self.lm_heads is None:
            if target_lm_head is None:
                raise ValueError("these Medusa heads share the target's lm_head; pass it")
            return self.logits_processor(target_lm_head, states).float()
        return torch.stack([self.logits_processor(h, states[:, i]) for i, h in enumerate(self.lm_heads)], 1).float()

    # ---- our format -------------------------------------------------------------------------------
    def _tensors(self) -> dict[str, torch.Tensor]:
        """Our names -> the heads' own parameters and token_map (what is saved, and what must load)."""
        out = {}
        for h, blocks in enumerate(self.blocks):
            for l, blk in enumerate(blocks):
                out[f"blocks.{h}.{l}.weight"] = blk.weight
                if blk.bias is not None:
                    out[f"blocks.{h}.{l}.bias"] = blk.bias
                if blk.token_weight is not None:
                    out[f"blocks.{h}.{l}.token_weight"] = blk.token_weight
        if self.lm_heads is not None:
            for h, head in enumerate(self.lm_heads):
                out[f"lm_heads.{h}.weight"] = head.weight
        if self.token_map is not None:
            out["token_map"] = self.token_map
        return out

    def state_for_save(self) -> dict[str, torch.Tensor]:
        return {name: t.detach() for name, t in self._tensors().items()}

    def load_state(self, sd: dict[str, torch.Tensor]) -> None:
        """Load our names; every tensor must be present with its exact shape (errors name it)."""
        want = self._tensors()
        missing = sorted(set(want) - set(sd))
        if missing:
            raise CheckpointError(f"Medusa checkpoint is missing {', '.join(missing[:6])}")
        unexpected = sorted(set(sd) - set(want))
        if unexpected:
            raise CheckpointError(f"Medusa checkpoint has unexpected tensors {', '.join(unexpected[:6])}")
        for name, p in want.items():
            t = sd[name]
            if tuple(t.shape) != tuple(p.shape):
                raise CheckpointError(f"Medusa tensor {name!r}: checkpoint shape {tuple(t.shape)}, "
                                      f"expected {tuple(p.shape)}")
            with torch.no_grad():
                p.copy_(t.to(p.dtype))

    def save(self, out_dir: str | Path, dtype=torch.bfloat16, extra_config: dict | None = None) -> Path:
        from safetensors.torch import save_file

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        save_file({k: (v.to(dtype) if v.is_floating_point() else v).contiguous()
                   for k, v in self.state_for_save().items()}, str(out / "medusa.safetensors"))
        (out / "config.json").write_text(json.dumps({**self.cfg.to_json(), **(extra_config or {})}, indent=2))
        return out
