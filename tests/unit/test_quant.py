"""Weight-only quantization: the kernels against their dequantized float reference at 1..64 rows and
their row-count invariance, GGUF Q4_0 / Q4_1 / Q8_0 blocks unpacked and packed, quantized models
(quantized at load) decoding speculatively token for token as they decode plainly at temperature 0 (the
distribution test at temperature 1 on an int4 model: ``test_spec_engine``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.engine.model_runner import ModelRunner, resolve_quantization
from specserve.layers import cpu_ops
from specserve.layers.quant import (GroupKernel, PendingQuant, QuantKernel, QuantTensor, group_kernel_takes,
                                    make_kernel, quantize, rows_invariant)
from specserve.models.gguf import GGUF_BLOCKS, pack_blocks, unpack_blocks

ROWS = (1, 2, 3, 4, 8, 16, 17, 32, 64)
KINDS = {  # name: (bits, group)
    "int4-g32": (4, 32),
    "int4-g64": (4, 64),
    "int8-per-channel": (8, None),
    "int8-g32 (Q8_0 layout)": (8, 32),
}


def _group_ops():
    ops = cpu_ops.get()
    return ops is not None and ops.group_gemm_available()


needs_group_kernel = pytest.mark.skipif(not _group_ops(), reason="the C++ group kernel needs AVX-512 BF16 or AVX2")
GROUP_KINDS = {"int4-g32": (4, 32), "int4-g64": (4, 64), "int8-g32 (Q8_0 layout)": (8, 32)}


def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).float()


def kernel_reference(qt: QuantTensor, x: torch.Tensor) -> torch.Tensor:
    """What the kernel computes, in float64: the weight rebuilt from the bfloat16 scales and zeros it
    holds (``QuantKernel``), times x; the kernel then rounds each output once to bfloat16."""
    N, K = qt.shape
    c = qt.codes.double().view(N, K // qt.group, qt.group)
    off = qt.offset if qt.offset is not None else torch.zeros_like(qt.scale)
    if qt.bits == 4:
        w = (c - 8) * _bf16(qt.scale).double().unsqueeze(-1) + _bf16(off + 8 * qt.scale).double().unsqueeze(-1)
    elif qt.group == K:
        w = c * _bf16(qt.scale).double().unsqueeze(-1)
    else:
        hi, lo = torch.div(c, 16, rounding_mode="floor"), torch.remainder(c, 16)
        s = _bf16(qt.scale).double().unsqueeze(-1)
        w = hi * 16 * s + (lo - 8) * s + _bf16(off + 8 * qt.scale).double().unsqueeze(-1)
    return x.double() @ w.view(N, K).t()


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("shape", [(96, 64), (200, 128)])  # 200: not a multiple of 16 (zero-row padding)
def test_kernel_matches_dequantized_reference(kind, shape):
    bits, group = KINDS[kind]
    g = torch.Generator().manual_seed(1)
    w = torch.randn(*shape, generator=g) * 0.1
    qt = quantize(w, bits, group)
    assert (qt.dequantize() - w).abs().max() <= qt.scale.max() * (0.51 if bits == 8 else 0.51)
    k = QuantKernel(qt)
    for m in ROWS:
        x = torch.randn(m, shape[1], generator=g).to(torch.bfloat16)
        y = k(x)
        assert y.shape == (m, shape[0]) and y.dtype == torch.bfloat16
        ref = kernel_reference(qt, x)
        # one bfloat16 rounding of the output (2^-8 relative) plus float32 accumulation
        tol = ref.abs() * 2.0**-8 + 1e-4 * (x.double().abs() @ qt.dequantize().double().abs().t())
        assert ((y.double() - ref).abs() <= tol).all(), (kind, m)
        # float32 activations give the same values (computed in bfloat16), returned in float32
        assert torch.equal(k(x.float()), y.float())


@pytest.mark.parametrize("kind", list(KINDS))
def test_kernels_are_row_count_invariant(kind):
    bits, group = KINDS[kind]
    k = QuantKernel(quantize(torch.randn(192, 128) * 0.1, bits, group))
    assert rows_invariant(k, 128)
    x = torch.randn(40, 128).to(torch.bfloat16)
    full = k(x)
    for m in (1, 5, 33):
        assert torch.equal(k(x[:m]), full[:m])


def _assert_near_exact_product(y: torch.Tensor, x: torch.Tensor, qt: QuantTensor) -> None:
    """``y`` is x W^T for the exact weight (float16 scales and offsets, as stored) up to one bfloat16
    rounding of each output and float32 sums."""
    w = qt.dequantize().double()
    ref = x.double() @ w.t()
    tol = ref.abs() * 2.0**-8 + 2e-6 * (x.double().abs() @ w.abs().t())
    assert ((y.double() - ref).abs() <= tol).all()


@needs_group_kernel
@pytest.mark.parametrize("kind", list(GROUP_KINDS))
@pytest.mark.parametrize("shape", [(96, 64), (200, 128)])  # 200: not a multiple of 16 (zero-row padding)
def test_group_kernel_matches_exact_product_and_is_row_invariant(kind, shape):
    bits, group = GROUP_KINDS[kind]
    g = torch.Generator().manual_seed(2)
    qt = quantize(torch.randn(*shape, generator=g) * 0.1, bits, group)
    k = make_kernel(qt)
    assert isinstance(k, GroupKernel)
    x = torch.randn(64, shape[1], generator=g).to(torch.bfloat16)
    full = k(x)
    assert full.shape == (64, shape[0]) and full.dtype == torch.bfloat16
    for m in ROWS:
        y = k(x[:m])
        _assert_near_exact_product(y, x[:m], qt)
        assert torch.equal(y, full[:m])  # a row's bits whatever shares the call (tiles of 1..8 rows)
    assert torch.equal(k(x[5:6]), full[5:6]) and rows_invariant(k, shape[1])
    assert torch.equal(k(x.float()), full.float())  # float32 activations: computed in bfloat16


@needs_group_kernel
def test_group_kernel_keeps_small_values_beside_an_outlier():
    """LLM activations have channels thousands of times the others (the down projection's inputs of the
    default model: a group's largest magnitude up to ~20,000 times its median). A group holding such a
    value keeps its other values as bfloat16 gives them: with the outlier's weights zero, every output is
    near the exact product of the small values. A kernel that rounds x against its group's largest value
    (tried on AVX2, docs/quantization.md) loses them and fails here."""
    N, K = 32, 128
    rng = np.random.default_rng(8)
    codes = torch.from_numpy(rng.integers(0, 16, (N, K), dtype=np.uint8))
    codes[:, 5::32] = 0  # the outlier's column: w = 0 * d + 0
    qt = QuantTensor(codes, torch.from_numpy(rng.uniform(0.005, 0.02, (N, K // 32))).half().float(),
                     torch.zeros(N, K // 32), 32, 4, "outlier")
    x = torch.randn(6, K, generator=torch.Generator().manual_seed(8))
    x[:, 5::32] = 2.0**14 * torch.tensor([1.0, -1.0, 1.0, -1.0, 1.0, -1.0]).unsqueeze(1)
    x = x.to(torch.bfloat16)
    k = make_kernel(qt)
    assert isinstance(k, GroupKernel)
    for m in (1, 2, 6):
        _assert_near_exact_product(k(x[:m]), x[:m], qt)


def _sums_in_order(x: np.ndarray, pairs_swapped: bool = False) -> np.ndarray:
    """Per row: the float32 sum, group after group, of each group of 32 values added one by one (or
    with each pair of neighbours added the other way round: a wrong order the test must tell apart)."""
    out = []
    for row in x.astype(np.float32):
        tot = np.float32(0)
        for g in range(0, len(row), 32):
            vals = row[g : g + 32]
            if pairs_swapped:
                vals = vals.reshape(16, 2)[:, ::-1].reshape(-1)
            s = np.float32(0)
            for v in vals:
                s = np.float32(s + v)
            tot = np.float32(tot + s)
        out.append(tot)
    return np.array(out, dtype=np.float32)


@needs_group_kernel
def test_group_kernel_sums_each_group_of_x_in_order():
    """The 4-bit kernel's offset term, m times each group's sum of x: with scales d = 0 and offsets m = 1
    every output is the groups' sums added in order, each group's 32 values added one by one in float32.
    x is made of runs (s, B, -B, t), |s| < 1 and |B| = 2^24: in order s vanishes into B and the run adds
    t; in another order s or t may survive or round. 37 groups: two passes of 16 groups a lane and 5
    more one by one."""
    K, N = 32 * 37, 16
    rng = np.random.default_rng(4)
    sign = lambda: rng.choice([-1.0, 1.0], (6, K // 4))  # noqa: E731
    big = sign() * 2.0**24
    runs = [sign() * rng.choice([0.125, 0.25, 0.5], (6, K // 4)), big, -big, sign() * rng.integers(1, 9, (6, K // 4))]
    x = torch.tensor(np.stack(runs, axis=-1).reshape(6, K), dtype=torch.float32).to(torch.bfloat16)
    codes = torch.from_numpy(rng.integers(0, 16, (N, K), dtype=np.uint8))
    qt = QuantTensor(codes, torch.zeros(N, K // 32), torch.ones(N, K // 32), 32, 4, "offset only")
    k = make_kernel(qt)
    assert isinstance(k, GroupKernel)
    y = k(x)
    want = torch.from_numpy(_sums_in_order(x.float().numpy())).to(torch.bfloat16)
    assert torch.equal(y, want.unsqueeze(1).expand(6, N))
    swapped = torch.from_numpy(_sums_in_order(x.float().numpy(), pairs_swapped=True)).to(torch.bfloat16)
    assert not torch.equal(swapped, want)  # the data tells the orders apart
    assert torch.equal(k(x[2:3]), y[2:3])


def _vdpbf16ps_order(x: np.ndarray, qt: QuantTensor, swapped: bool = False) -> np.ndarray:
    """The group kernel's float32 outputs as its operations define them, every step rounded to float32:
    per group two chains over the chunks in order, each adding its lane's odd input's product, then the
    even one's (vdpbf16ps; ``swapped``: the even one first, a wrong order the test must tell apart); the
    chains added, times d, plus m times the group's sum of x (in order)."""
    x = x.astype(np.float64)
    codes = qt.codes.numpy().astype(np.float64)
    d = qt.scale.numpy().astype(np.float64)
    m = None if qt.offset is None else qt.offset.numpy().astype(np.float64)
    f32 = lambda v: v.astype(np.float32).astype(np.float64)  # noqa: E731
    tot = np.zeros((x.shape[0], codes.shape[0]))
    for g in range(codes.shape[1] // 32):
        xg, cg = x[:, 32 * g : 32 * g + 32], codes[:, 32 * g : 32 * g + 32]
        a = [np.zeros_like(tot), np.zeros_like(tot)]
        for c in range(8 if qt.bits == 4 else 16):
            # 4 bits: chunk c holds inputs 2c, 2c + 1 (chain 0) and 16 + 2c, 17 + 2c (chain 1); 8 bits:
            # chunk c holds inputs 2c, 2c + 1, even chunks in chain 0
            pairs = [(0, 2 * c), (1, 16 + 2 * c)] if qt.bits == 4 else [(c % 2, 2 * c)]
            for chain, k in pairs:
                for e in ((0, 1) if swapped else (1, 0)):
                    a[chain] = f32(a[chain] + np.outer(xg[:, k + e], cg[:, k + e]))
        tot = f32((f32(a[0] + a[1])) * d[:, g] + tot)
        if m is not None:
            xs = np.zeros(x.shape[0])
            for k in range(32):
                xs = f32(xs + xg[:, k])
            tot = f32(np.outer(xs, m[:, g]) + tot)
    return tot.astype(np.float32)


@pytest.mark.skipif(not _group_ops() or cpu_ops.variant() != "avx2", reason="the AVX2 build of the group kernel")
@pytest.mark.parametrize("kind", list(GROUP_KINDS))
def test_avx2_group_kernel_runs_the_operations_of_vdpbf16ps(kind):
    """The AVX2 kernel (float32 FMAs on codes masked where they sit and x scaled by the inverse power of
    two) gives the bits of the operations it emulates, step by step; a kernel that added a lane's two
    products the other way round, or summed the chunks in another order, would not."""
    bits, group = GROUP_KINDS[kind]
    g = torch.Generator().manual_seed(5)
    qt = quantize(torch.randn(48, 256, generator=g) * 0.1, bits, group)
    k = make_kernel(qt)
    x = (torch.randn(7, 256, generator=g) * torch.rand(7, 1, generator=g) * 4).to(torch.bfloat16)
    qt32 = QuantTensor(qt.codes, qt.scale.repeat_interleave(group // 32, 1),
                       None if qt.offset is None else qt.offset.repeat_interleave(group // 32, 1), 32, bits, qt.kind)
    want = torch.from_numpy(_vdpbf16ps_order(x.float().numpy(), qt32)).to(torch.bfloat16)
    assert torch.equal(k(x), want)
    # unit codes and scales; x multiples of 4 but for the last two pairs of each chain: (s, B), (t, -B)
    # with B = 2^25 (float32 steps of 4 there) and |s|, |t| = 1. The odd input first keeps t (B + s
    # rounds to B, -B cancels it, t stays); the even one first loses it (B + t rounds to B)
    N, K = 16, 64
    unit = QuantTensor(torch.ones(N, K, dtype=torch.uint8 if bits == 4 else torch.int8), torch.ones(N, K // 32),
                       torch.zeros(N, K // 32) if bits == 4 else None, 32, bits, "unit")
    rng = np.random.default_rng(6)
    xv = 4.0 * rng.integers(-8, 9, (3, K))
    runs = [(12, 14), (28, 30)] if bits == 4 else [(24, 28), (26, 30)]  # each chain's last two pairs
    for g0 in range(0, K, 32):
        for a, b in runs:
            big = rng.choice([-1.0, 1.0], 3) * 2.0**25
            xv[:, g0 + a], xv[:, g0 + a + 1] = rng.choice([-1.0, 1.0], 3), big
            xv[:, g0 + b], xv[:, g0 + b + 1] = rng.choice([-1.0, 1.0], 3), -big
    x = torch.tensor(xv, dtype=torch.float32).to(torch.bfloat16)
    want = torch.from_numpy(_vdpbf16ps_order(x.float().numpy(), unit)).to(torch.bfloat16)
    assert torch.equal(make_kernel(unit)(x), want)
    swapped = _vdpbf16ps_order(x.float().numpy(), unit, swapped=True)
    assert not torch.equal(torch.from_numpy(swapped).to(torch.bfloat16), want)  # the data tells the orders apart


@needs_group_kernel
@pytest.mark.parametrize("kind", list(GGUF_BLOCKS))
def test_group_kernel_computes_gguf_blocks_as_stored(kind):
    """GGUF Q4_0 / Q4_1 / Q8_0 blocks (gguf-py's quantizer) go to the group kernel with their float16
    scales unchanged: the product of the exact dequantized weight."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize as gguf_quantize

    w = np.random.default_rng(1).standard_normal((80, 160)).astype(np.float32)
    qt = unpack_blocks(gguf_quantize(w, GGMLQuantizationType[kind]), kind, [80, 160], "synthetic")
    k = make_kernel(qt)
    assert isinstance(k, GroupKernel)
    x = torch.randn(9, 160).to(torch.bfloat16)
    _assert_near_exact_product(k(x), x, qt)


def test_make_kernel_takes_torch_kernels_where_the_group_kernel_cannot():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(64, 64, generator=g)
    per_channel = quantize(w, 8)  # one float32 scale a row
    assert not group_kernel_takes(per_channel) and isinstance(make_kernel(per_channel), QuantKernel)
    q4 = quantize(w, 4, 32)
    assert torch.equal(q4.scale.half().float(), q4.scale) and torch.equal(q4.offset.half().float(), q4.offset)
    assert group_kernel_takes(q4)
    odd = QuantTensor(q4.codes, q4.scale * (1 + 2.0**-13), q4.offset, 32, 4, "int4")  # not float16 values
    assert not group_kernel_takes(odd) and isinstance(make_kernel(odd), QuantKernel)
    assert isinstance(make_kernel(q4), GroupKernel if _group_ops() else QuantKernel)


@needs_group_kernel
@pytest.mark.parametrize("kind, head_size", [("llama", 16), ("llama", 64), ("qwen3", 32)])
def test_decoder_layer_in_one_call_keeps_the_bits(tiny_llama, tmp_path, kind, head_size):
    """The C++ ``decoder_layer`` (a whole layer in one call) against the same layer op by op: the same
    logits bit for bit for a prefill, a chain, a tree and a batch of two; heads of 16 (the rotary's
    scalar loop) and of 64 (its vector path, as the default model's), and Qwen3's q/k norms."""
    from conftest import make_tiny_model

    if kind == "qwen3":
        model = make_tiny_model(tmp_path / "m", kind="qwen3")
    else:
        model = tiny_llama if head_size == 16 else make_tiny_model(tmp_path / "m", hidden_size=4 * head_size)
    runner = ModelRunner(model, max_num_seqs=2, quantization="int4")
    layers = runner.model.model.layers
    ops = cpu_ops.get()

    def run(one_call: bool) -> list[torch.Tensor]:
        for layer in layers:
            if one_call:
                layer.__dict__.pop("_one_call", None)
            else:
                layer._one_call = ()
        out = [runner.forward(0, [list(range(3, 40))], [0], "all").logits,
               runner.forward(0, [[7, 8, 9, 10]], [37], "all").logits,
               runner.forward(0, [[11, 12, 13]], [37], "all", tree_mask=[[[1, 0, 0], [1, 1, 0], [1, 0, 1]]],
                              positions=[[37, 38, 38]]).logits,
               runner.forward(0, [list(range(50, 60)), [5, 6]], [0, 0], "all").logits,
               runner.forward(0, [[1, 2], [3]], [10, 2], "all").logits]
        assert all((layer.one_call(ops, _Ctx(), runner.kv.kv[0]) is not None) == one_call for layer in layers)
        return out

    fused, plain = run(True), run(False)
    assert all(torch.equal(a, b) for a, b in zip(fused, plain))


class _Ctx:  # what ``one_call`` reads of a ForwardContext
    mask = None


def test_pack_linears_leaves_dense_weights_oneDNN_cannot_pack(monkeypatch):
    """Where oneDNN does not pack a dtype (bfloat16 on a CPU without AVX-512), ``pack_linears`` gives a
    quantized linear its kernel and leaves a dense one as it is (it once failed there, in a drafter with
    8-bit linears beside a dense Markov head)."""
    from specserve.layers import packing
    from specserve.layers.linear import ReplicatedLinear

    asked = []
    monkeypatch.setattr(packing, "mkldnn_packing_available", lambda dtype: asked.append(dtype) or False)
    g = torch.Generator().manual_seed(7)
    quantized, dense = ReplicatedLinear(64, 32, dtype=torch.bfloat16), ReplicatedLinear(8, 16, dtype=torch.bfloat16)
    for lin in (quantized, dense):
        lin.weight.data = torch.randn(lin.weight.shape, generator=g).to(torch.bfloat16)
    w = dense.weight.data.clone()
    quantized.quant = quantize(quantized.weight.data.float(), 8, 32)
    packing.pack_linears(torch.nn.ModuleList([quantized, dense]))
    assert quantized.qkernel is not None and dense.packed is None and torch.equal(dense.weight.data, w)
    assert asked == [torch.bfloat16]  # probed once for the dense dtype
    x = torch.randn(3, 8, generator=g).to(torch.bfloat16)
    assert torch.equal(dense(x), torch.nn.functional.linear(x, w))


@needs_group_kernel
def test_pack_linears_gathers_group_kernel_weights_on_huge_pages(monkeypatch):
    """``pack_linears`` moves the group kernels' weights into one buffer advised onto 2 MB pages: each
    weight 64-byte aligned, the advised range 2 MB aligned and holding them all, every output the same
    bits; a second call moves nothing; where the advice fails nothing moves."""
    from specserve.layers import packing, quant
    from specserve.layers.linear import ReplicatedLinear

    advised = []
    real = quant._advise_huge_pages
    monkeypatch.setattr(quant, "_advise_huge_pages", lambda a, n: advised.append((a, n)) or real(a, n) or True)
    g = torch.Generator().manual_seed(8)

    def linears(shapes, bits):
        out = []
        for n_out, n_in in shapes:
            lin = ReplicatedLinear(n_in, n_out, dtype=torch.bfloat16)
            lin.quant = quantize(torch.randn(n_out, n_in, generator=g) * 0.1, bits, 32)
            out.append(lin)
        return torch.nn.ModuleList(out)

    shapes = [(4096, 576), (1536, 576), (576, 1536), (1040, 512)]  # ~3 MB packed: two 2 MB pages
    mods = linears(shapes, 4)
    xs = [torch.randn(5, n_in, generator=g).to(torch.bfloat16) for _, n_in in shapes]
    refs = [make_kernel(lin.quant) for lin in mods]  # the same packed weights, left where they are
    mods_again = linears(shapes, 4)
    packing.pack_linears(mods)
    ks = [lin.qkernel for lin in mods]
    old = [k.weight for k in refs]
    assert len(advised) == 1 and all(k.gathered for k in ks)
    start, length = advised[0]
    assert start % quant.HUGE_PAGE == 0 and length % quant.HUGE_PAGE == 0
    for k, w in zip(ks, old):
        p = k.weight.data_ptr()
        assert torch.equal(k.weight, w) and p % 64 == 0 and start <= p and p + w.numel() <= start + length
    assert len({k.weight.untyped_storage().data_ptr() for k in ks}) == 1
    for lin, x, ref in zip(mods, xs, refs):
        assert torch.equal(lin(x), ref(x))
    assert quant.gather_weights(ks) == 0 and len(advised) == 1  # nothing left to move
    monkeypatch.setattr(quant, "_advise_huge_pages", lambda a, n: False)
    packing.pack_linears(mods_again)
    assert not any(lin.qkernel.gathered for lin in mods_again)
    small = linears([(64, 64)], 8)
    monkeypatch.setattr(quant, "_advise_huge_pages", lambda a, n: True)
    packing.pack_linears(small)
    assert not small[0].qkernel.gathered  # under two pages: left where it is


def test_rows_invariant_detects_a_row_count_dependent_kernel():
    assert not rows_invariant(lambda x: x * (1 + 1e-2 * x.shape[0]), 32)
    assert rows_invariant(lambda x: x * 3, 32)


@pytest.mark.parametrize("kind", list(GGUF_BLOCKS))
def test_gguf_blocks_unpack_and_pack(kind):
    """Q4_0 / Q4_1 / Q8_0 bytes made by gguf-py's own quantizer: unpacked codes and scales give
    gguf-py's dequantization exactly, and pack back to the same bytes."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize
    from gguf.quants import quantize as gguf_quantize

    qtype = GGMLQuantizationType[kind]
    w = np.random.default_rng(0).standard_normal((48, 96)).astype(np.float32)
    raw = gguf_quantize(w, qtype)
    qt = unpack_blocks(raw, kind, [48, 96], "synthetic")
    assert qt.kind == kind and qt.shape == (48, 96) and qt.bits == (8 if kind == "Q8_0" else 4)
    assert torch.equal(qt.dequantize(), torch.from_numpy(dequantize(raw, qtype).reshape(48, 96)))
    assert np.array_equal(pack_blocks(qt), raw)
    # nibble order: byte j of a 4-bit block holds weight j (low nibble) and weight j + 16 (high)
    if kind != "Q8_0":
        first = raw.reshape(48, 3, GGUF_BLOCKS[kind])[0, 0, GGUF_BLOCKS[kind] - 16]
        assert qt.codes[0, 0] == first & 15 and qt.codes[0, 16] == first >> 4
    with pytest.raises(ValueError, match="truncated"):
        unpack_blocks(raw[:, :-2], kind, [48, 96], "synthetic")


def test_pending_quant_assembles_shards_and_mixed_formats():
    a, b = quantize(torch.randn(32, 64), 4), quantize(torch.randn(16, 64), 4)
    p = PendingQuant((64, 64), "qkv")
    p.narrow(0, 32, 16).copy_(b)
    p.data[0:32].copy_(a)
    out = p.finish()
    assert out.shape == (64, 64)
    assert torch.equal(out.dequantize()[:32], a.dequantize()) and torch.equal(out.dequantize()[32:48], b.dequantize())
    assert (out.dequantize()[48:] == 0).all()  # rows never written: zero
    mixed = PendingQuant((48, 64), "qkv")
    mixed.narrow(0, 0, 32).copy_(a)
    c = quantize(torch.randn(16, 64), 8, 32)
    mixed.narrow(0, 32, 16).copy_(c)
    m = mixed.finish()
    assert m.format == (8, 32, False)
    assert torch.allclose(m.dequantize()[32:], c.dequantize(), atol=c.scale.max().item())
    with pytest.raises(ValueError, match="shape"):
        PendingQuant((8, 64)).narrow(0, 0, 8).copy_(a)


def test_quantization_argument():
    assert resolve_quantization("auto", "auto", True) == "gguf"
    assert resolve_quantization("auto", "float32", True) is None  # float32 asked for: dense
    assert resolve_quantization("auto", "auto", False) is None
    assert resolve_quantization("none", "auto", True) is None
    assert resolve_quantization("int4", "auto", False) == "int4"
    with pytest.raises(ValueError, match="needs a .gguf"):
        resolve_quantization("gguf", "auto", False)
    with pytest.raises(ValueError, match="quantization must be"):
        resolve_quantization("q3", "auto", False)
    with pytest.raises(ValueError, match="quantization must be"):
        LLM(quantization="fp4")
    # sharded models run dense float32 for now (bfloat16 under tensor parallelism: a known bug)
    assert resolve_quantization("auto", "auto", True, "cpu", tensor_parallel_size=2) is None
    for dtype, q in (("bfloat16", "auto"), ("auto", "gguf"), ("float32", "int8")):
        with pytest.raises(ValueError, match="dense float32 weights only"):
            resolve_quantization(q, dtype, True, "cpu", tensor_parallel_size=2)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantized_model_close_to_float_and_small(tiny_llama, scheme):
    """Quantized at load: logits near the float model's, no float weight kept, activations bfloat16."""
    dense = ModelRunner(tiny_llama, dtype="float32", max_num_seqs=1, quantization=None)
    q = ModelRunner(tiny_llama, max_num_seqs=1, quantization=scheme)
    assert q.quantization == scheme and q.dtype == torch.bfloat16 and q.batch_invariant
    ids = list(range(3, 40))
    a = dense.forward(0, [ids], [0], "all").logits[0]
    b = q.forward(0, [ids], [0], "all").logits[0]
    rel = ((a - b).norm() / a.norm()).item()
    assert rel < (0.08 if scheme == "int8" else 0.5), rel  # random weights: 4 bits lose much (bf16 alone: 0.02)
    assert all(p.numel() == 0 for n, p in q.model.named_parameters() if n.endswith("proj.weight"))


@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("spec", [
    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1},
    {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 1, "prompt_lookup_max": 2},
])
def test_quantized_greedy_speculative_identical_to_plain(tiny_llama, scheme, spec):
    """Verifying k tokens through the quantized kernels reproduces k one-token steps bit for bit: the
    same greedy tokens alone and batched, drafts accepted and rejected."""
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 10, 11, 12, 9, 10, 11], [100, 3, 100, 3, 100]]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = LLM(model=str(tiny_llama), quantization=scheme)
    ref = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    alone = [plain.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    assert alone == ref
    llm = LLM(model=str(tiny_llama), quantization=scheme, speculative_config=dict(spec))
    out = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert out == ref
    m = llm.get_metrics()
    assert m["num_accepted_tokens"] > 0 and m["num_draft_tokens"] > m["num_accepted_tokens"]


def test_gguf_reader_reads_tensors_and_names_a_truncated_file(tmp_path):
    """Our GGUF reader against gguf-py's writer: metadata, tensor types, shapes and bytes; a file cut
    short fails with its name and the tensor that runs past the end."""
    import gguf

    from specserve.models.gguf import read_gguf

    w = np.random.default_rng(0).standard_normal((64, 96)).astype(np.float32)
    q41 = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q4_1)
    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint32("llama.block_count", 1)
    writer.add_array("tokenizer.ggml.tokens", ["a", "b", "c"])
    writer.add_tensor("blk.0.ffn_up.weight", q41, raw_shape=q41.shape, raw_dtype=gguf.GGMLQuantizationType.Q4_1)
    writer.add_tensor("output_norm.weight", np.ones(96, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    meta, tensors = read_gguf(path)
    assert meta["llama.block_count"] == 1 and meta["tokenizer.ggml.tokens"] == ["a", "b", "c"]
    by_name = {t.name: t for t in tensors}
    up = by_name["blk.0.ffn_up.weight"]
    assert up.tensor_type == gguf.GGMLQuantizationType.Q4_1 and up.shape == (96, 64)
    assert np.array_equal(np.asarray(up.data), q41)
    assert np.array_equal(np.asarray(by_name["output_norm.weight"].data), np.ones(96, dtype=np.float32))
    short = tmp_path / "short.gguf"
    short.write_bytes(path.read_bytes()[:-200])
    with pytest.raises(ValueError, match="short.gguf: tensor .* runs past the end"):
        read_gguf(short)
    (tmp_path / "head.gguf").write_bytes(path.read_bytes()[:40])
    with pytest.raises(ValueError, match="head.gguf: truncated GGUF header"):
        read_gguf(tmp_path / "head.gguf")
