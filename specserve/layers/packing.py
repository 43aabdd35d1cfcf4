"""Weight packing and batch invariance of a model's layers: oneDNN pre-packed GEMMs on CPU, and GEMMs
and attention that give each token the same bits whatever else shares the forward."""

from __future__ import annotations

import torch

from specserve.layers.attention import Attention
from specserve.layers.linear import PackedGEMM, lone_row_differs, mkldnn_packing_available
from specserve.layers.quant import GroupKernel, gather_weights, rows_invariant


def pack_linears(module: torch.nn.Module, int8_activations: bool = False) -> None:
    """Pre-pack every linear layer and LM head of ``module`` for oneDNN (CPU): a few-token GEMM then
    costs little more than one token's (call after the weights are loaded). A quantized weight gets its
    kernel; a dense one is packed only where oneDNN packs its dtype on this CPU (bfloat16 needs AVX-512),
    else it stays as it is. The group kernels' weights then share one buffer on 2 MB pages
    (``quant.gather_weights``). ``int8_activations``: quantized weights' group kernels take x in 8-bit
    groups (``quant.make_kernel``)."""
    for m in module.modules():
        if isinstance(m, PackedGEMM) and (m.quant is not None or mkldnn_packing_available(m.weight.dtype)):
            m.int8_activations = int8_activations
            m.pack()
    gather_weights([m.qkernel for m in module.modules()
                    if isinstance(m, PackedGEMM) and isinstance(m.qkernel, GroupKernel)])


ROW_BLOCK = 32  # oneDNN's bf16 GEMMs give each row the same bits for any row count from 2 up to this


def make_batch_invariant(module: torch.nn.Module, row_block: int = ROW_BLOCK) -> None:
    """Make every linear, LM head and attention of ``module`` give each token the same bits whatever
    else shares the forward (CPU, bfloat16, packed weights): verifying a chain or a tree of k tokens then
    reproduces k one-token steps, so greedy speculative decoding gives plain decoding's tokens in
    bfloat16 as it does in float32. GEMMs run in blocks of at most ``row_block`` rows (exact by
    construction: each row's bits are the kernel's for any row count from 2 up to 32); a lone row gets a
    zero row beside it where a probe at load time (``lone_row_differs``, one per weight shape) finds that
    one row alone takes a kernel that sums in another order (on CPUs without AMX: the default model's
    1536-wide down projection); attention sums each row in one fixed order (``Attention.forward``). Costs
    extra GEMM calls for forwards over more than ``row_block`` rows (prefill, trees over 32 nodes,
    batches)."""
    probed: dict[tuple, bool] = {}
    for m in module.modules():
        if isinstance(m, PackedGEMM) and m.qkernel is not None:
            # weight-only kernels never split the input dimension: rows are exact at any count (probed
            # once per kernel kind and shape); were a kernel not, its rows would run one at a time
            k = m.qkernel
            key = (k.key, m.bias is not None)
            if key not in probed:
                probed[key] = rows_invariant(lambda x: m.dense_matmul(x, m.bias), k.in_features)
            if not probed[key]:
                m.row_block, m.pad_lone_row = 1, False
        elif isinstance(m, PackedGEMM):
            m.row_block = row_block
            m.pad_lone_row = _lone_row_differs(m, probed)
        elif isinstance(m, Attention):
            m.batch_invariant = True


def _lone_row_differs(m: PackedGEMM, probed: dict) -> bool:
    """``lone_row_differs`` for the GEMM of linear or LM head ``m`` (with and without its bias), probed
    once per weight shape."""
    w = m.packed if m.packed is not None else m.weight  # a packed weight keeps its logical shape
    bias = m.bias
    fns = [m.dense_matmul] + ([lambda x: m.dense_matmul(x, bias)] if bias is not None else [])
    key = (tuple(w.shape), w.dtype, m.packed is not None, bias is not None)
    if key not in probed:
        probed[key] = any(lone_row_differs(fn, w.shape[1], w.dtype) for fn in fns)
    return probed[key]
