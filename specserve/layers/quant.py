"""Weight-only quantized weights on CPU: a ``QuantTensor`` holds integer codes with a scale and an
offset per group of input columns (w = code * scale + offset), as GGUF's Q4_0 / Q4_1 / Q8_0 blocks
do and as ``quantize`` makes from float weights. ``make_kernel`` picks how ``x W^T`` runs (bfloat16
activations unless asked otherwise):

``GroupKernel``, specserve's C++ kernel (``csrc/quant_gemm.cpp``, CPUs with AVX-512 BF16), for 4-bit
codes with an offset and 8-bit codes without, in groups of a multiple of 32, scales and offsets in
float16 (GGUF's own; ``quantize`` rounds to float16): the weight re-laid out once (``pack_groups``),
read once per call whatever the row count, each product of a code and an x value exact in float32. With
``int8_activations`` (``LLM(activations="int8")``) the same weights go through ``csrc/quant_gemm_a8.cpp``
instead (AVX-512 VNNI or AVX2; ``pack_groups(qt, int8_activations=True)``): x in 8-bit groups of 32 as
llama.cpp's kernels take it (``quantize_activations``), integer dot products, the arithmetic that
``reference_gemm_a8`` spells out.
Otherwise ``QuantKernel``, torch's weight-only kernels:

- 4-bit codes (0..15) in groups of 32..256: ``_weight_int4pack_mm_for_cpu``, which computes
  ``sum_k x[k] * ((c[k] - 8) * S0 + S1)`` with the scale S0 and the additive zero S1 in bfloat16:
  S0 = scale, S1 = offset + 8 * scale;
- 8-bit codes in groups (Q8_0): the same kernel over two 4-bit halves of each code, c = 16 * hi + lo
  (hi = c >> 4 in -8..7, lo = c & 15), stacked along the input (the input fed twice): the hi half with
  scale 16 * scale and zero 0, the lo half with scale ``scale`` and zero 8 * scale + offset; exact up
  to the bfloat16 rounding of the scale;
- 8-bit codes per output channel (one group per row, no offset): ``_weight_int8pack_mm``.

Each kernel gives a row of ``x`` the same bits whatever other rows travel with it (they split the
work over output columns and row blocks, never over the input dimension); ``rows_invariant`` probes
that at load time, so that verifying k tokens reproduces k one-token steps bit for bit.

A ``PendingQuant`` stands in for a layer's weight while a checkpoint's quantized tensors are loaded
through the layers' own ``weight_loader``s (which take shards by ``narrow`` and ``copy_``); ``finish``
assembles the shards into one ``QuantTensor``."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from specserve.layers import cpu_ops

log = logging.getLogger("specserve")

INT4_GROUPS = (32, 64, 128, 256)  # the group sizes _weight_int4pack_mm_for_cpu takes
GROUP_ROWS, GROUP_COLS = 16, 32  # GroupKernel's block: output rows x input columns
GROUP_GRAIN = 4  # GroupKernel: row blocks per thread below which a call stays on one thread
GROUP_TILE = 8  # GroupKernel: rows of x that share one pass over the weight (1..8)


@dataclass
class QuantTensor:
    """A [N, K] weight as ``codes`` [N, K] (uint8 0..15 for 4 bits, int8 for 8 bits), ``scale`` and
    ``offset`` [N, K // group] float32 (``offset`` None: zero): w = codes * scale + offset, group by
    group along K. ``kind`` names where it came from (a GGUF type or the quantization asked for)."""

    codes: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor | None
    group: int
    bits: int
    kind: str

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    @property
    def data(self) -> "QuantTensor":  # the weight loaders read ``tensor.data`` of a parameter
        return self

    @property
    def format(self) -> tuple:
        return (self.bits, self.group, self.offset is not None)

    def narrow(self, dim: int, start: int, length: int) -> "QuantTensor":
        if dim == 0:
            return self._rows(slice(start, start + length))
        if start % self.group or length % self.group:
            raise ValueError(f"a {self.kind} weight splits along its input only at multiples of {self.group} "
                             f"columns (asked for {length} columns from {start})")
        g0, gn = start // self.group, length // self.group
        return QuantTensor(self.codes.narrow(1, start, length), self.scale.narrow(1, g0, gn),
                           None if self.offset is None else self.offset.narrow(1, g0, gn), self.group, self.bits,
                           self.kind)

    def __getitem__(self, rows) -> "QuantTensor":
        return self._rows(rows)

    def _rows(self, rows) -> "QuantTensor":
        return QuantTensor(self.codes[rows], self.scale[rows], None if self.offset is None else self.offset[rows],
                           self.group, self.bits, self.kind)

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        """The float weight [N, K] (computed in float32: exact for GGUF's float16 scales)."""
        N, K = self.shape
        w = self.codes.float().view(N, K // self.group, self.group) * self.scale.unsqueeze(-1)
        if self.offset is not None:
            w = w + self.offset.unsqueeze(-1)
        return w.view(N, K).to(dtype)

    def embedding(self, ids: torch.Tensor, dtype) -> torch.Tensor:
        """Rows ``ids`` (any shape) dequantized: an embedding lookup, [*ids.shape, K]."""
        flat = ids.reshape(-1)
        return self._rows(flat).dequantize(dtype).view(*ids.shape, self.shape[1])

    @staticmethod
    def cat(parts: list["QuantTensor"]) -> "QuantTensor":
        """Row-wise concatenation of tensors of one format."""
        if len({p.format for p in parts}) != 1:
            raise ValueError("cannot stack quantized weights of different formats")
        p0 = parts[0]
        return QuantTensor(torch.cat([p.codes for p in parts]), torch.cat([p.scale for p in parts]),
                           None if p0.offset is None else torch.cat([p.offset for p in parts]), p0.group, p0.bits,
                           p0.kind if len({p.kind for p in parts}) == 1 else "mixed")


def quantize(w: torch.Tensor, bits: int, group: int | None = None, kind: str | None = None) -> QuantTensor:
    """``w`` [N, K] (float) -> ``QuantTensor``. 4 bits: asymmetric in groups of ``group`` (default 32;
    min..max of each group over codes 0..15). 8 bits: symmetric, codes -127..127, per output channel
    (``group`` None or K) or in groups of ``group``. Scales and offsets of groups are float16 values
    (as GGUF's), the codes chosen for them."""
    w = w.detach().float()
    N, K = w.shape
    if bits == 4:
        group = group or 32
        g = w.view(N, K // group, group)
        lo = _half(g.amin(-1))
        scale = _half((g.amax(-1) - lo) / 15).clamp_min(2.0**-24)
        codes = ((g - lo.unsqueeze(-1)) / scale.unsqueeze(-1)).round().clamp(0, 15).to(torch.uint8)
        return QuantTensor(codes.view(N, K), scale, lo, group, 4, kind or f"int4-g{group}")
    if bits == 8:
        per_channel = group is None or group == K
        group = group or K
        g = w.view(N, K // group, group)
        scale = g.abs().amax(-1) / 127
        scale = scale.clamp_min(1e-12) if per_channel else _half(scale).clamp_min(2.0**-24)
        codes = (g / scale.unsqueeze(-1)).round().clamp(-127, 127).to(torch.int8)
        return QuantTensor(codes.view(N, K), scale, None, group, 8,
                           kind or ("int8" if per_channel else f"int8-g{group}"))
    raise ValueError(f"bits must be 4 or 8, got {bits}")


def _half(t: torch.Tensor) -> torch.Tensor:
    """``t`` rounded to a float16 value (kept in float32)."""
    return t.clamp(-65504, 65504).half().float()


def check_kernel_shape(qt: QuantTensor, name: str = "weight") -> None:
    """A clear error where no kernel takes ``qt`` (input size and group size)."""
    N, K = qt.shape
    if qt.bits == 8 and qt.group == K and qt.offset is None:
        if K % 16:
            raise ValueError(f"{name}: an int8 per-channel weight needs a multiple of 16 inputs, has {K}")
    elif qt.group not in INT4_GROUPS or K % qt.group:
        raise ValueError(f"{name}: a {qt.kind} weight needs groups of {INT4_GROUPS} columns, has {qt.group}")


class _Kernel:
    """``x W^T (+ bias)`` for a [N, K] weight: x [..., K] in any float dtype, computed in bfloat16,
    returned in x's dtype; subclasses give ``mm`` ([M, K] bfloat16, contiguous -> [M, >= N])."""

    out_features: int
    in_features: int
    kind: str

    @property
    def key(self) -> tuple:
        """What decides the kernel's arithmetic: one row-invariance probe per key (``make_batch_invariant``)."""
        return (type(self).__name__, self.kind, self.out_features, self.in_features)

    def mm(self, x2: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        K = x.shape[-1]
        x2 = x.reshape(-1, K)
        if x2.dtype != torch.bfloat16 or not x2.is_contiguous():
            x2 = x2.to(torch.bfloat16).contiguous()
        y = self.mm(x2)
        if y.shape[1] != self.out_features:
            y = y[:, : self.out_features]
        y = y.reshape(*x.shape[:-1], self.out_features)
        if y.dtype != x.dtype:
            y = y.to(x.dtype)
        return y if bias is None else y + bias


def _pad_rows(qt: QuantTensor, multiple: int) -> QuantTensor:
    """``qt`` with zero rows appended up to a multiple of ``multiple`` rows (the kernels' blocks)."""
    return QuantTensor.cat([qt, _zeros(qt, -qt.shape[0] % multiple)]) if qt.shape[0] % multiple else qt


class QuantKernel(_Kernel):
    """torch's weight-only kernels (see the module docstring)."""

    def __init__(self, qt: QuantTensor):
        check_kernel_shape(qt)
        self.out_features, self.in_features = qt.shape
        self.kind = qt.kind
        qt = _pad_rows(qt, 16)  # the kernels take a multiple of 16 output rows: zero rows, sliced off
        self.per_channel = qt.bits == 8 and qt.group == qt.shape[1] and qt.offset is None
        self.twice = False  # 8-bit codes through the 4-bit kernel: the input is fed twice
        if self.per_channel:
            self.weight = qt.codes.to(torch.int8).contiguous()
            self.scales = qt.scale.view(-1).to(torch.bfloat16).contiguous()
            return
        offset = qt.offset if qt.offset is not None else torch.zeros_like(qt.scale)
        if qt.bits == 4:
            scale, zero = qt.scale, offset + 8 * qt.scale
        else:  # two 4-bit halves: hi (scale 16 s, zero 0) then lo (scale s, zero 8 s + offset)
            scale = torch.cat([16 * qt.scale, qt.scale], dim=1)
            zero = torch.cat([torch.zeros_like(offset), offset + 8 * qt.scale], dim=1)
            self.twice = True
        self.group = qt.group
        pack = torch.ops.aten._convert_weight_to_int4pack_for_cpu
        self.weight = torch.cat([pack(self._codes4(qt.codes[i : i + 4096]), 1)  # in row blocks: small int32 copies
                                 for i in range(0, qt.shape[0], 4096)])
        self.scales = torch.stack([scale.t(), zero.t()], dim=-1).to(torch.bfloat16).contiguous()  # [K/G, N, 2]

    @property
    def key(self) -> tuple:
        return super().key + (self.per_channel, self.twice)

    def _codes4(self, codes: torch.Tensor) -> torch.Tensor:
        """The 4-bit kernel's codes (0..15, int32) of some rows of ``codes``: as they are, or the hi and
        lo halves of 8-bit codes side by side."""
        c = codes.to(torch.int32)
        return torch.cat([(c >> 4) + 8, c & 15], dim=1) if self.twice else c.contiguous()

    def mm(self, x2: torch.Tensor) -> torch.Tensor:
        if self.per_channel:
            return torch.ops.aten._weight_int8pack_mm(x2, self.weight, self.scales)
        if self.twice:
            x2 = torch.cat([x2, x2], dim=1)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.weight, self.group, self.scales)


def group_kernel_takes(qt: QuantTensor) -> bool:
    """Whether ``GroupKernel`` computes ``qt`` as it is: 4-bit codes with an offset or 8-bit codes
    without, groups of a multiple of 32 columns, scales and offsets float16 values."""
    if qt.group % GROUP_COLS or qt.shape[1] % qt.group or (qt.bits == 8) != (qt.offset is None):
        return False
    return all(torch.equal(t.half().float(), t) for t in (qt.scale, qt.offset) if t is not None)


def in_groups_of_32(qt: QuantTensor) -> QuantTensor:
    """``qt`` with a scale (and offset) per 32 columns: those of larger groups repeated."""
    if qt.group == GROUP_COLS:
        return qt
    r = qt.group // GROUP_COLS
    return QuantTensor(qt.codes, qt.scale.repeat_interleave(r, 1),
                       None if qt.offset is None else qt.offset.repeat_interleave(r, 1), GROUP_COLS, qt.bits, qt.kind)


def pack_groups(qt: QuantTensor, int8_activations: bool = False) -> torch.Tensor:
    """``qt`` (``group_kernel_takes``) in ``GroupKernel``'s layout: uint8 [N / 16, K / 32, B], one
    B-byte block per 16 output rows x 32 inputs (N padded with zero rows). 4 bits (B = 320): 8 chunks
    of 32 bytes, chunk c byte 2 i + e = code[row i, 2 c + e] | code[row i, 16 + 2 c + e] << 4; then the
    16 rows' scales and offsets in float16. 8 bits (B = 544): 16 chunks, chunk c byte 2 i + e =
    code[row i, 2 c + e] (int8); then the 16 scales in float16. ``int8_activations``: the same bytes
    ordered for the kernel with 8-bit activations (``csrc/quant_gemm_a8.cpp``), four inputs of a row
    to a 32-bit lane: 4 bits, four 64-byte vectors, vector j byte 4 i + e = code[row i, 8 j + e] |
    code[row i, 8 j + 4 + e] << 4; 8 bits, eight 64-byte vectors, vector j byte 4 i + e =
    code[row i, 4 j + e] + 128 (unsigned)."""
    qt = _pad_rows(in_groups_of_32(qt), GROUP_ROWS)
    N, K = qt.shape
    nb, G = N // GROUP_ROWS, K // GROUP_COLS

    def halves(t: torch.Tensor) -> torch.Tensor:  # [N, G] -> [nb, G, 32] bytes of float16
        return t.half().view(nb, GROUP_ROWS, G).transpose(1, 2).contiguous().view(torch.uint8)

    if qt.bits == 4:
        if int8_activations:  # [block, row, group, vector, half, e]
            c = qt.codes.view(nb, GROUP_ROWS, G, 4, 2, 4)
            codes = c[:, :, :, :, 0] | (c[:, :, :, :, 1] << 4)
        else:  # [block, row, group, half, chunk, e]
            c = qt.codes.view(nb, GROUP_ROWS, G, 2, 8, 2)
            codes = c[:, :, :, 0] | (c[:, :, :, 1] << 4)
        return torch.cat([codes.permute(0, 2, 3, 1, 4).reshape(nb, G, 256), halves(qt.scale),
                          halves(qt.offset)], 2).contiguous()
    c = qt.codes.view(torch.uint8)  # [block, row, group, chunk or vector, e]
    c = (c ^ 0x80).view(nb, GROUP_ROWS, G, 8, 4) if int8_activations else c.view(nb, GROUP_ROWS, G, 16, 2)
    return torch.cat([c.permute(0, 2, 3, 1, 4).reshape(nb, G, 512), halves(qt.scale)], 2).contiguous()


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (bfloat16) in 8-bit groups of 32, as the kernel with 8-bit activations takes it (float32,
    round half to even): a = max |x| of the group, q = rint(x * (127 / a)), dx = a / 127 (0 and q = 0 where
    a = 0). Returns q [M, K / 32, 32] (float32 integers) and dx [M, K / 32]."""
    g = x.float().view(x.shape[0], -1, GROUP_COLS)
    a = g.abs().amax(-1)
    c = torch.full_like(a, 127.0)  # tensor by tensor: ``127.0 / a`` would round a reciprocal first
    inv = torch.where(a > 0, c / a, torch.zeros_like(a))
    return torch.round(g * inv.unsqueeze(-1)), torch.where(a > 0, a / c, torch.zeros_like(a))


def _fma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """float32 a * b + c with one rounding (float64 holds the product of two float32 values exactly)."""
    return (a.double() * b.double() + c.double()).float()


@torch.inference_mode()
def reference_gemm_a8(x: torch.Tensor, qt: QuantTensor) -> torch.Tensor:
    """``x W^T`` in PyTorch by the arithmetic of the kernel with 8-bit activations (``csrc/quant_gemm_a8.cpp``):
    per group the exact integer dot product of the codes and ``quantize_activations``' q, then float32
    ``y = fma(i, d * dx, y)`` (and ``y = fma(m, dx * s, y)`` with the offset m, s = sum q), groups in order,
    bfloat16 at the end. Slow: for tests."""
    qt = in_groups_of_32(qt)
    q, dx = quantize_activations(x.to(torch.bfloat16))
    N, K = qt.shape
    codes = qt.codes.view(torch.int8).float() if qt.bits == 8 else qt.codes.float()
    dots = torch.einsum("mgk,ngk->mng", q.double(), codes.view(N, -1, GROUP_COLS).double()).float()  # exact
    sx = dx * q.sum(-1)
    y = torch.zeros(x.shape[0], N)
    for g in range(K // GROUP_COLS):
        y = _fma(dots[:, :, g], qt.scale[:, g].float() * dx[:, g : g + 1], y)
        if qt.offset is not None:
            y = _fma(qt.offset[:, g].float().expand_as(y), sx[:, g : g + 1].expand_as(y), y)
    return y.to(torch.bfloat16)


class GroupKernel(_Kernel):
    """specserve's C++ kernel (``csrc/quant_gemm.cpp``; see the module docstring) for a weight that
    ``group_kernel_takes``; ``ops``: the loaded ``cpu_ops`` extension. ``int8_activations``: the kernel
    that takes x in 8-bit groups (``csrc/quant_gemm_a8.cpp``, CPUs with AVX-512 VNNI or AVX2) instead."""

    INT8_ACTIVATIONS = 16  # the flag in ``code``, the bits the C++ decoder layer is given

    def __init__(self, qt: QuantTensor, ops, int8_activations: bool = False):
        if not group_kernel_takes(qt):
            raise ValueError(f"the group kernel does not take a {qt.kind} weight")
        self.out_features, self.in_features = qt.shape
        self.kind, self.bits, self.ops = qt.kind, qt.bits, ops
        self.int8_activations = int8_activations
        self.code = qt.bits | (self.INT8_ACTIVATIONS if int8_activations else 0)
        self.weight = pack_groups(qt, int8_activations)
        self._gemm = ops.group_gemm_a8 if int8_activations else ops.group_gemm

    @property
    def key(self) -> tuple:
        return super().key + (self.int8_activations,)

    def mm(self, x2: torch.Tensor) -> torch.Tensor:
        return self._gemm(x2, self.weight, self.bits, GROUP_GRAIN, GROUP_TILE)

    gathered = False  # its weight lies in a buffer of ``gather_weights``


HUGE_PAGE = 2 << 20  # bytes of a transparent huge page (x86-64, aarch64 with 4 KB base pages)
_MADV_HUGEPAGE = 14  # Linux's madvise advice: back this range with huge pages where it can


def _advise_huge_pages(addr: int, length: int) -> bool:
    """Linux ``madvise(addr, length, MADV_HUGEPAGE)`` (the C library the process has loaded already);
    False where there is no such call or it fails (another OS, transparent huge pages compiled out)."""
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return False
    try:
        madvise = ctypes.CDLL(None).madvise
        return madvise(ctypes.c_void_p(addr), ctypes.c_size_t(length), _MADV_HUGEPAGE) == 0
    except (OSError, AttributeError):
        return False


def gather_weights(kernels: list["GroupKernel"]) -> int:
    """Move the packed weights of ``kernels`` (those not moved yet) into one buffer that the OS is asked
    to back with 2 MB pages (``madvise(MADV_HUGEPAGE)``; honoured where transparent huge pages are
    ``always`` or ``madvise``, the usual settings). A decoding step streams every weight once: on 4 KB
    pages it pays a TLB walk, and the hardware prefetcher a restart, every 4 KB. The bytes are the same,
    so is every result. Where the advice cannot be given, or the weights fill less than two such pages,
    they stay where they are. Returns the bytes of the buffer they took (0: none moved)."""
    ks = [k for k in dict.fromkeys(kernels) if not k.gathered]  # each kernel once
    sizes = [-(-k.weight.numel() // 64) * 64 for k in ks]  # each weight 64-byte aligned
    total = -(-sum(sizes) // HUGE_PAGE) * HUGE_PAGE
    if total < 2 * HUGE_PAGE:
        return 0
    buf = torch.empty(total + HUGE_PAGE, dtype=torch.uint8)
    start = -buf.data_ptr() % HUGE_PAGE
    if not _advise_huge_pages(buf.data_ptr() + start, total):
        return 0
    at = start
    for k, n in zip(ks, sizes):
        w = buf[at : at + k.weight.numel()].view(k.weight.shape)
        w.copy_(k.weight)  # the first touch of these pages: they come as huge pages
        k.weight, k.gathered = w, True
        at += n
    return at - start


def int8_activations_available() -> bool:
    """Whether this machine's C++ ops have the kernel with 8-bit activations (AVX-512 VNNI or AVX2 + FMA)."""
    ops = cpu_ops.get()
    return ops is not None and ops.group_gemm_a8_available()


def make_kernel(qt: QuantTensor, int8_activations: bool = False) -> _Kernel:
    """``GroupKernel`` where it takes ``qt`` and the C++ ops are built with it, else ``QuantKernel``;
    ``int8_activations``: the group kernel with 8-bit activations where it takes ``qt`` and this machine
    has it (``int8_activations_available``), for any other weight as without."""
    ops = cpu_ops.get() if group_kernel_takes(qt) else None
    if int8_activations and ops is not None and ops.group_gemm_a8_available():
        return GroupKernel(qt, ops, int8_activations=True)
    if ops is not None and ops.group_gemm_available():
        return GroupKernel(qt, ops)
    return QuantKernel(qt)


@torch.inference_mode()
def rows_invariant(fn, in_features: int, dtype=torch.bfloat16, counts=(2, 3, 5, 8, 17, 33, 64)) -> bool:
    """Whether the row-wise ``fn`` gives every row the same bits alone as among ``counts`` rows."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(max(counts), in_features, generator=g).to(dtype)
    alone = torch.cat([fn(x[i : i + 1]) for i in range(max(counts))])
    return all(torch.equal(fn(x[:m]), alone[:m]) for m in counts)


class PendingQuant:
    """A layer's weight [N, K] while quantized checkpoint tensors are loaded into it: the weight
    loaders' ``narrow(0, ...)`` / ``[a:b]`` + ``copy_`` record which rows each ``QuantTensor`` fills;
    ``finish`` assembles them (rows never written: zero, as the padded rows of a vocabulary shard)."""

    def __init__(self, shape: tuple[int, int], name: str = "weight"):
        self.shape = tuple(shape)
        self.name = name
        self.parts: list[tuple[int, QuantTensor]] = []

    @property
    def data(self) -> "PendingQuant":
        return self

    def narrow(self, dim: int, start: int, length: int) -> "_Rows":
        if dim != 0:
            raise ValueError(f"{self.name}: a quantized weight is filled by whole rows")
        return _Rows(self, start, length)

    def __getitem__(self, rows: slice) -> "_Rows":
        start, stop, step = rows.indices(self.shape[0])
        if step != 1:
            raise ValueError(f"{self.name}: rows must be contiguous")
        return _Rows(self, start, stop - start)

    def zero_(self) -> "PendingQuant":
        return self

    def copy_(self, src) -> None:
        _Rows(self, 0, self.shape[0]).copy_(src)

    def finish(self) -> QuantTensor:
        N, K = self.shape
        if not self.parts:
            raise ValueError(f"{self.name}: no quantized tensor was loaded")
        parts = sorted(self.parts, key=lambda p: p[0])
        formats = {p.format for _, p in parts}
        if len(formats) > 1:  # e.g. q/k/v of different GGUF types: one common format (8 bits, groups of 32)
            log.warning("%s: parts of different formats (%s) re-quantized to 8 bits in groups of 32", self.name,
                        ", ".join(sorted({p.kind for _, p in parts})))
            parts = [(r, quantize(p.dequantize(), 8, 32, "int8-g32")) for r, p in parts]
        rows, filled = [], 0
        for r0, p in parts:
            if r0 > filled:  # a gap: zero rows
                rows.append(_zeros(p, r0 - filled))
            rows.append(p)
            filled = r0 + p.shape[0]
        if filled < N:
            rows.append(_zeros(parts[-1][1], N - filled))
        out = QuantTensor.cat(rows) if len(rows) > 1 else rows[0]
        if out.shape != (N, K):
            raise ValueError(f"{self.name}: quantized parts make {out.shape}, expected {(N, K)}")
        return out


def _zeros(like: QuantTensor, n: int) -> QuantTensor:
    K = like.shape[1]
    codes = torch.full((n, K), 8 if like.bits == 4 else 0, dtype=like.codes.dtype)
    scale = torch.zeros(n, K // like.group)
    return QuantTensor(codes, scale, None if like.offset is None else torch.zeros_like(scale), like.group,
                       like.bits, like.kind)


class _Rows:
    def __init__(self, pending: PendingQuant, start: int, length: int):
        self.pending, self.start, self.length = pending, start, length
        self.shape = (length, pending.shape[1])

    def copy_(self, src) -> None:
        if not isinstance(src, QuantTensor):
            raise TypeError(f"{self.pending.name}: expected a quantized tensor, got {type(src).__name__}")
        if src.shape != self.shape:
            raise ValueError(f"{self.pending.name}: rows of shape {self.shape}, got {src.shape}")
        self.pending.parts.append((self.start, src))
