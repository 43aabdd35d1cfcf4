"""Vocabulary-parallel embedding and LM head. The vocabulary is split in ``tp_size`` equal, padded
ranges; ``ParallelLMHead(..., disable_tp=True)`` keeps the full vocabulary on every rank (the
small-heads rule: no gather for it)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specserve.distributed.parallel_state import TPGroup
from specserve.layers.linear import PackedGEMM, check_shape


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings, embedding_dim, tp: TPGroup | None = None, disable_tp=False, dtype=torch.float32):
        super().__init__()
        tp = tp or TPGroup()
        self.tp = TPGroup() if disable_tp else tp
        self.tp_size, self.tp_rank = self.tp.size, self.tp.rank
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.per_partition = -(-num_embeddings // self.tp_size)
        self.vocab_start = self.tp_rank * self.per_partition
        self.vocab_end = min(self.vocab_start + self.per_partition, num_embeddings)
        self.weight = nn.Parameter(torch.zeros(self.per_partition, embedding_dim, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param, loaded, shard_id=None):
        check_shape((self.num_embeddings, self.embedding_dim), loaded)
        n = self.vocab_end - self.vocab_start
        param.data.zero_()
        param.data[:n].copy_(loaded[self.vocab_start : self.vocab_end])

    quant = None  # the table as a ``QuantTensor`` (weight-only quantization): rows dequantized on lookup

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:
            return self.quant.embedding(ids, self.weight.dtype)
        return F.embedding(ids, self.weight)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self._lookup(ids)
        inside = (ids >= self.vocab_start) & (ids < self.vocab_end)
        local = torch.where(inside, ids - self.vocab_start, 0)
        out = self._lookup(local) * inside.unsqueeze(-1).to(self.weight.dtype)
        return self.tp.all_reduce(out)

    def dense_rows(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's table (or its ``rows``) as a float tensor in the layer's dtype, quantized or not."""
        if self.quant is not None:
            q = self.quant if rows is None else self.quant[rows]
            return q.dequantize(self.weight.dtype)
        return self.weight.detach() if rows is None else self.weight.detach()[rows]


class ParallelLMHead(PackedGEMM, VocabParallelEmbedding):
    """Output projection hidden -> vocab. Apply it through ``LogitsProcessor``."""

    def __init__(self, num_embeddings, embedding_dim, tp=None, disable_tp=False, bias=False, dtype=torch.float32):
        super().__init__(num_embeddings, embedding_dim, tp, disable_tp, dtype)
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.zeros(self.per_partition, dtype=dtype), requires_grad=False)
            self.bias.weight_loader = self.bias_loader

    def bias_loader(self, param, loaded, shard_id=None):
        check_shape((self.num_embeddings,), loaded)
        param.data.zero_()
        param.data[: self.vocab_end - self.vocab_start].copy_(loaded[self.vocab_start : self.vocab_end])

    def pack(self, batch_hint: int = 16) -> None:
        """The oneDNN copy of the weight (CPU), or the kernel of a quantized one; the weight stays (a
        tied embedding reads it)."""
        if not self.pack_quant():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.data, batch_hint)

    def tie_to(self, embed: VocabParallelEmbedding) -> None:
        if embed.tp_size != self.tp_size or embed.per_partition != self.per_partition:
            raise ValueError("tied embedding and LM head must be sharded the same way")
        self.weight = embed.weight

    def forward(self, *_):
        raise RuntimeError("use LogitsProcessor(head, hidden_states)")


class LogitsProcessor(nn.Module):
    """hidden -> logits over the full vocabulary. Gathers across ranks only when the head is really
    sharded (``head.tp_size > 1``); a replicated head never triggers a collective."""

    def __init__(self, vocab_size: int, scale: float = 1.0):
        super().__init__()
        self.vocab_size = vocab_size
        self.scale = scale

    def forward(self, head: ParallelLMHead, hidden: torch.Tensor) -> torch.Tensor:
        logits = head._matmul(hidden, head.bias)
        if head.tp_size > 1:
            logits = head.tp.all_gather(logits, dim=-1)
        if logits.shape[-1] != self.vocab_size:
            logits = logits[..., : self.vocab_size]
        if self.scale != 1.0:
            logits = logits * self.scale
        return logits
