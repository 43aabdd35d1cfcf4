"""Tensor-parallel linear layers (vLLM names). Each parameter owns a ``weight_loader`` that takes the
full checkpoint tensor, checks its shape and copies this rank's shard."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from specserve.distributed.parallel_state import TPGroup, split_evenly
from specserve.layers.quant import make_kernel


def partition(n: int, size: int, rank: int) -> tuple[int, int]:
    """(start, count) of ``rank``'s share of ``n`` units split as evenly as possible (the first
    ``n % size`` ranks take one more)."""
    base, extra = divmod(n, size)
    return rank * base + min(rank, extra), base + (1 if rank < extra else 0)


class ShapeMismatch(ValueError):
    """A checkpoint tensor whose shape is not the one the parameter needs."""

    def __init__(self, expected: tuple, got: tuple):
        super().__init__(f"expected shape {tuple(expected)}, checkpoint has {tuple(got)}")
        self.expected, self.got = tuple(expected), tuple(got)


def check_shape(expected, loaded: torch.Tensor) -> None:
    if tuple(loaded.shape) != tuple(expected):
        raise ShapeMismatch(tuple(expected), tuple(loaded.shape))


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
    """Replicated parameter: the checkpoint tensor is copied whole."""
    check_shape(param.shape, loaded)
    param.data.copy_(loaded)


def _param(shape, dtype, loader) -> nn.Parameter:
    p = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    p.weight_loader = loader
    return p


@functools.cache
def mkldnn_packing_available(dtype: torch.dtype) -> bool:
    """Whether weights can be pre-packed for oneDNN on this CPU (float32 always; bf16 needs AVX512);
    probed once a process per dtype."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=dtype), 16)
        return True
    except (RuntimeError, AttributeError):
        return False


def fast_bfloat16(device="cpu") -> bool:
    """Whether bfloat16 GEMMs beat float32 ones on ``device``: a GPU, or a CPU with oneDNN's bfloat16
    weight packing and native bfloat16 arithmetic (AVX512-BF16 or AMX; without them oneDNN emulates it)."""
    if str(device).startswith("cuda"):
        return True
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    native = any(getattr(torch.cpu, f, lambda: False)() for f in probes)
    return native and mkldnn_packing_available(torch.bfloat16)


PACK_BATCH_HINT = 16  # the verify widths we run (1..16 tokens) all do well with this layout


def in_row_blocks(fn, x: torch.Tensor, block: int, pad_lone_row: bool = True) -> torch.Tensor:
    """``fn`` (row-wise: each output row depends on its input row only) applied to at most ``block``
    rows of ``x`` (rows: all dims but the last) at a time and, with ``pad_lone_row``, never to a single
    row alone; ``block`` 0 = all at once, as given. oneDNN's bf16 GEMM gives every row the same bits for
    any row count from 2 up to 32, but switches kernels above that, and on a CPU without AMX one row
    alone may take a kernel that sums in another order (measured on the 1536-wide down projection of the
    default model; ``lone_row_differs`` finds the shapes): fed in blocks, a lone row padded with a zero
    row, a row's result no longer depends on how many rows travel with it (see
    ``model_runner.make_batch_invariant``)."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if not block or 1 < rows <= block or rows == 0 or (rows == 1 and not pad_lone_row):
        return fn(x)
    flat = x.reshape(rows, x.shape[-1])
    outs = []
    for i in range(0, rows, block):
        part = flat[i : i + block]
        if part.shape[0] == 1 and pad_lone_row:  # the kernel of 2..block rows, not the one of a lone row
            outs.append(fn(torch.cat([part, torch.zeros_like(part)]))[:1])
        else:
            outs.append(fn(part))
    out = torch.cat(outs) if len(outs) > 1 else outs[0]
    return out.view(*x.shape[:-1], out.shape[-1])


@torch.inference_mode()
def lone_row_differs(fn, in_features: int, dtype: torch.dtype, trials: int = 8, rows: int = 4) -> bool:
    """Whether the row-wise ``fn`` gives a row alone other bits than the same row among ``rows`` others
    (on any of ``trials`` random inputs): then the kernel of one row sums in another order and
    ``in_row_blocks`` must pad a lone row. Kernels are chosen by shape and dtype, not values, so a probe
    per shape decides for every layer of that shape."""
    g = torch.Generator().manual_seed(0)
    for _ in range(trials):
        x = torch.randn(rows, in_features, generator=g).to(dtype)
        full = fn(x)
        if any(not torch.equal(fn(x[i : i + 1]), full[i : i + 1]) for i in range(rows)):
            return True
    return False


def packed_or_dense_linear(x: torch.Tensor, packed, weight: torch.Tensor, bias) -> torch.Tensor:
    """``x W^T + b`` through the oneDNN-packed copy of ``W`` when there is one (``pack``), else dense."""
    if packed is not None:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return F.linear(x, weight, bias)


class PackedGEMM:
    """The GEMM of a layer with a ``weight`` (the linears and the LM head): through the oneDNN-packed
    copy once ``packed`` is set (CPU), through a weight-only quantized kernel once ``quant`` is set
    and packed (``layers.quant``), in row blocks once ``row_block`` is set
    (``model_runner.make_batch_invariant``)."""

    packed = None  # oneDNN copy of the weight, set by the layer's ``pack``
    quant = None  # the weight as a ``QuantTensor`` (weight-only quantization), set at load
    qkernel = None  # its kernel (``quant.make_kernel``), set by ``pack``
    int8_activations = False  # its kernel takes x in 8-bit groups where it can (``pack_linears``)
    row_block = 0  # > 0: GEMMs of at most this many rows (``in_row_blocks``)
    pad_lone_row = True  # with row_block: a lone row travels with a zero row (``in_row_blocks``)

    def pack(self) -> None:
        """Set ``packed`` (``model_runner.pack_linears``), or ``qkernel`` for a quantized weight."""
        raise NotImplementedError

    def pack_quant(self) -> bool:
        """Build ``qkernel`` from ``quant`` (the kernel holds its own copy of the weight); whether the
        weight is quantized."""
        if self.quant is None:
            return False
        if self.qkernel is None:
            self.qkernel = make_kernel(self.quant, self.int8_activations)
        return True

    def dense_matmul(self, x, bias=None):
        """``x W^T (+ bias)`` in one GEMM, as given."""
        if self.qkernel is not None:
            return self.qkernel(x, bias)
        return packed_or_dense_linear(x, self.packed, self.weight, bias)

    def _matmul(self, x, bias=None):
        if self.qkernel is not None and not self.row_block:  # any row count at once (rows_invariant)
            return self.qkernel(x, bias)
        return in_row_blocks(lambda rows: self.dense_matmul(rows, bias), x, self.row_block, self.pad_lone_row)


class LinearBase(PackedGEMM, nn.Module):
    """Base of the TP linears. On CPU, ``pack()`` re-lays the weight out for oneDNN once: a decode
    or verification GEMM with a few rows then runs 1.5-3x faster than through MKL's sgemm."""

    def __init__(self, tp: TPGroup, bias: bool):
        super().__init__()
        self.tp = tp
        self.tp_size = tp.size
        self.tp_rank = tp.rank
        self.has_bias = bias

    def pack(self) -> None:
        if self.pack_quant():
            self.quant = None  # the kernel holds the weight
        else:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.data, PACK_BATCH_HINT)
        self.weight.data = torch.empty(0, dtype=self.weight.dtype)  # the packed copy replaces it


class ReplicatedLinear(LinearBase):
    def __init__(self, in_features, out_features, bias=False, tp: TPGroup | None = None, dtype=torch.float32):
        super().__init__(tp or TPGroup(), bias)
        self.weight = _param((out_features, in_features), dtype, default_weight_loader)
        self.bias = _param((out_features,), dtype, default_weight_loader) if bias else None

    def forward(self, x):
        return self._matmul(x, self.bias)

    @classmethod
    def stacked(cls, parts: list["ReplicatedLinear"]) -> "ReplicatedLinear":
        """One linear whose output is the outputs of ``parts`` (same input size, all with or all without
        a bias) side by side, in that order: one GEMM instead of several (call before ``pack``)."""
        w = torch.cat([p.weight.data for p in parts])
        out = cls(w.shape[1], w.shape[0], parts[0].bias is not None, dtype=w.dtype).to(w.device)
        out.weight.data = w
        if out.bias is not None:
            out.bias.data = torch.cat([p.bias.data for p in parts])
        return out


class ColumnParallelLinear(LinearBase):
    """Y = X W^T with W split by output rows: each rank computes its slice of Y (no collective)."""

    def __init__(self, in_features, out_features, bias=False, tp: TPGroup | None = None, dtype=torch.float32):
        super().__init__(tp or TPGroup(), bias)
        self.in_features = in_features
        self.out_features = out_features
        self.out_local = split_evenly(out_features, self.tp_size, "output size")
        self.weight = _param((self.out_local, in_features), dtype, self.weight_loader)
        self.bias = _param((self.out_local,), dtype, self.weight_loader) if bias else None

    def weight_loader(self, param, loaded, shard_id=None):
        check_shape((self.out_features,) + tuple(param.shape[1:]), loaded)
        param.data.copy_(loaded.narrow(0, self.tp_rank * self.out_local, self.out_local))

    def forward(self, x):
        return self._matmul(x, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel matrices stored as one (gate_proj + up_proj). Shard id = index."""

    def __init__(self, in_features, output_sizes: list[int], bias=False, tp=None, dtype=torch.float32):
        self.output_sizes = list(output_sizes)
        super().__init__(in_features, sum(output_sizes), bias, tp, dtype)

    def weight_loader(self, param, loaded, shard_id=None):
        if shard_id is None:
            return super().weight_loader(param, loaded)
        full = self.output_sizes[shard_id]
        check_shape((full,) + tuple(param.shape[1:]), loaded)
        local = full // self.tp_size
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        param.data.narrow(0, offset, local).copy_(loaded.narrow(0, self.tp_rank * local, local))


class QKVParallelLinear(LinearBase):
    """q, k and v projections in one matrix, split by KV-head groups (a KV head and the query heads
    that share it stay on one rank). Groups that do not divide evenly give some ranks one more group
    (SmolLM2's 3 KV heads over 2 ranks: 2 + 1). Shard ids "q", "k", "v"."""

    def __init__(self, hidden_size, head_dim, num_heads, num_kv_heads, bias=False, tp=None, dtype=torch.float32):
        super().__init__(tp or TPGroup(), bias)
        if num_kv_heads < self.tp_size:
            raise ValueError(f"num_key_value_heads ({num_kv_heads}) must be >= tensor_parallel_size ({self.tp_size})")
        self.head_dim, self.num_heads, self.num_kv_heads = head_dim, num_heads, num_kv_heads
        group = num_heads // num_kv_heads
        kv_start, self.kv_heads_local = partition(num_kv_heads, self.tp_size, self.tp_rank)
        self.heads_local = self.kv_heads_local * group
        self.q_size, self.kv_size = self.heads_local * head_dim, self.kv_heads_local * head_dim
        self.q_start, self.kv_start = kv_start * group * head_dim, kv_start * head_dim
        out_local = self.q_size + 2 * self.kv_size
        self.weight = _param((out_local, hidden_size), dtype, self.weight_loader)
        self.bias = _param((out_local,), dtype, self.weight_loader) if bias else None

    def weight_loader(self, param, loaded, shard_id=None):
        if shard_id is None:  # a checkpoint with q, k, v already fused
            q_full, kv_full = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
            check_shape((q_full + 2 * kv_full,) + tuple(param.shape[1:]), loaded)
            for sid, off in (("q", 0), ("k", q_full), ("v", q_full + kv_full)):
                self.weight_loader(param, loaded.narrow(0, off, q_full if sid == "q" else kv_full), sid)
            return
        heads = self.num_heads if shard_id == "q" else self.num_kv_heads
        check_shape((heads * self.head_dim,) + tuple(param.shape[1:]), loaded)
        local = self.q_size if shard_id == "q" else self.kv_size
        src = self.q_start if shard_id == "q" else self.kv_start
        offset = {"q": 0, "k": self.q_size, "v": self.q_size + self.kv_size}[shard_id]
        param.data.narrow(0, offset, local).copy_(loaded.narrow(0, src, local))

    def forward(self, x):
        return self._matmul(x, self.bias)


class RowParallelLinear(LinearBase):
    """Y = X W^T with W split by input columns; the partial products are summed by an all-reduce."""

    def __init__(self, in_features, out_features, bias=False, tp: TPGroup | None = None, dtype=torch.float32,
                 in_partition: tuple[int, int] | None = None):
        """``in_partition``: (start, count) of this rank's input columns when the split is uneven
        (attention output after an uneven head split); default an even split."""
        super().__init__(tp or TPGroup(), bias)
        self.in_features = in_features
        if in_partition is None:
            n = split_evenly(in_features, self.tp_size, "input size")
            in_partition = (self.tp_rank * n, n)
        self.in_start, self.in_local = in_partition
        self.weight = _param((out_features, self.in_local), dtype, self.weight_loader)
        self.bias = _param((out_features,), dtype, default_weight_loader) if bias else None

    def weight_loader(self, param, loaded, shard_id=None):
        check_shape((param.shape[0], self.in_features), loaded)
        param.data.copy_(loaded.narrow(1, self.in_start, self.in_local))

    def forward(self, x):
        y = self._matmul(x)
        y = self.tp.all_reduce(y)
        return y if self.bias is None else y + self.bias
