"""The C++ CPU ops of the bfloat16 decoding step (``specserve/csrc/cpu_ops.cpp``): batch-invariant
attention over the paged KV cache (each row summed in one fixed order: float32 for bfloat16 rows where
the ops are built for AVX-512 BF16 or AVX2, float64 otherwise and for float32 rows), the fused residual add +
RMSNorm, a whole decoder layer of a quantized model in one call, the drafters' candidate search
(``softmax_topk``: DSpark per depth; ``medusa_paths``: the heads' top k, their paths' products and ranking
for Medusa's dynamic trees in one call; ``tree_search``: a whole DSpark tree), torch's
``argmax`` in one pass a row (``argmax``: the greedy token of every verification), and
(``specserve/csrc/quant_gemm.cpp``, AVX-512 BF16 and AVX2 builds) the group kernel of 4- and 8-bit
weights (``layers.quant.GroupKernel``).

Built with ``torch.utils.cpp_extension.load`` on first use (~40 s) into the specserve cache
(``cache_root() / "torch_ext"``), so later processes load it at once. ``-O3 -fopenmp`` (the ops'
``at::parallel_for`` runs on torch's own OpenMP threads), plus ``-mavx512f -mavx512bw -mavx512bf16``
where this CPU has them, else ``-mavx2 -mfma -mf16c`` where it has those (checked at run time): the build
directory is named after the variant.
Where the build fails (no compiler) or ``SPECSERVE_NO_EXT=1`` is set, ``get`` returns None and the
callers use their PyTorch code (one log line says so). ``ENABLED`` (module flag) switches the ops off
in a running process (benchmarks compare both ways)."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import sys
import threading
from pathlib import Path

import torch
import torch.nn.functional as F

from specserve.config import cache_root

logger = logging.getLogger(__name__)

ENABLED = True  # False: callers take their PyTorch path (``get`` still loads)
PARALLEL_WORK = 1 << 15  # attention over more multiply-adds than this runs on the intra-op threads

_lock = threading.Lock()
_state: dict = {}  # "ops": the loaded module or None once tried


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _variant() -> tuple[str, list[str]]:
    """(name suffix, extra compile flags): AVX-512 code only where torch and the CPU say it runs."""
    cap = torch.backends.cpu.get_cpu_capability()
    flags = _cpu_flags()
    if cap.startswith("AVX512") and {"avx512f", "avx512bw", "avx512_bf16"} <= flags:
        vnni = ["-mavx512vnni"] if "avx512_vnni" in flags else []  # group_gemm_a8
        return "avx512" + ("vnni" if vnni else ""), ["-mavx512f", "-mavx512bw", "-mavx512bf16", *vnni]
    if cap in ("AVX2", "AVX512") and {"avx2", "fma", "f16c"} <= flags:
        return "avx2", ["-mavx2", "-mfma", "-mf16c"]
    return "generic", []


def variant() -> str:
    """Which build of the ops this CPU takes: "avx512" (AVX-512 BF16; "avx512vnni" with VNNI, which the kernel
    with 8-bit activations uses), "avx2" (AVX2 + FMA) or "generic"."""
    return _variant()[0]


def norm_vec_width() -> int:
    """Lanes of the float32 sum order of torch's CPU ``sum`` (``Vectorized<float>`` in its reduction
    kernels: 8 on the AVX2 and AVX512 builds seen so far), which the norm ops reproduce: probed once
    against ``F.rms_norm`` (8 where neither width matches every row: still one fixed order per row)."""
    if "vec" not in _state:
        import torch.nn.functional as F

        ops, width = get(), 8
        if ops is not None:
            g = torch.Generator().manual_seed(0)
            x = (torch.randn(64, 1000, generator=g) * torch.rand(64, 1, generator=g) * 8).to(torch.bfloat16)
            w = torch.ones(1000, dtype=torch.bfloat16)
            want = F.rms_norm(x, (1000,), None, 1e-5)
            for v in (8, 16):
                if torch.equal(ops.rms_norm(x, w, 1e-5, v), want):
                    width = v
                    break
            else:
                logger.info("specserve rms_norm op: no sum order matches F.rms_norm here (rare last-bit differences)")
        _state["vec"] = width
    return _state["vec"]


def _build():
    csrc = Path(__file__).resolve().parent.parent / "csrc"
    src = csrc / "cpu_ops.cpp"
    suffix = _variant()[0]
    tag = f"torch{torch.__version__.replace('+', '_')}-py{sys.version_info[0]}{sys.version_info[1]}"
    # one build per source location: the build files name the source's path, so two checkouts sharing
    # the cache would otherwise rebuild each other's
    where = hashlib.sha256(str(src).encode()).hexdigest()[:10]
    build_dir = cache_root() / "torch_ext" / tag / f"cpu_ops_{suffix}_{where}"
    build_dir.mkdir(parents=True, exist_ok=True)
    if not any(build_dir.glob("*.so")):
        logger.warning("specserve: compiling its C++ CPU ops into %s (once, ~40 s)", build_dir)
    return compile_ops(csrc, f"specserve_cpu_ops_{suffix}", build_dir)


@contextlib.contextmanager
def build_lock(build_dir: Path):
    """Hold ``build_dir`` for one process's build or load. torch's loader marks a build with a ``lock`` file
    that a killed build (Ctrl-C in its ~40 s) leaves behind, and every later loader would wait on it
    forever; this lock is the kernel's (``flock``), released when its holder exits however it exits, and
    whoever holds it removes a ``lock`` file it finds: no other specserve process is building there."""
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / "specserve.lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            stale = build_dir / "lock"
            if stale.exists():
                logger.warning("specserve: removing %s, left by a build that did not finish", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def compile_ops(csrc: Path, name: str, build_dir: Path):
    """The ops of the sources in ``csrc`` built (or loaded, when up to date) as module ``name`` in
    ``build_dir``, with this CPU's flags (``_variant``), one process at a time (``build_lock``)."""
    from torch.utils import cpp_extension

    with build_lock(build_dir):
        return cpp_extension.load(
            name=name,
            sources=[str(csrc / name) for name in ("cpu_ops.cpp", "quant_gemm.cpp", "quant_gemm_a8.cpp")],
            # OpenMP: at::parallel_for is compiled into the extension (torch's own libgomp at run time)
            extra_cflags=["-O3", "-fno-math-errno", "-fopenmp", *_variant()[1]],
            extra_ldflags=["-fopenmp"],
            build_directory=str(build_dir),
            verbose=False,
        )


def get():
    """The extension module, built or loaded on the first call (once per process), or None."""
    if "ops" in _state:
        return _state["ops"]
    with _lock:
        if "ops" not in _state:
            ops = None
            if os.environ.get("SPECSERVE_NO_EXT", "") not in ("", "0"):
                logger.info("specserve C++ CPU ops disabled (SPECSERVE_NO_EXT): using the PyTorch fallback")
            else:
                try:
                    ops = _build()
                except Exception as e:  # no compiler, no headers, a failed build: the fallback
                    last = (str(e).strip().splitlines() or [""])[-1]
                    logger.warning("specserve C++ CPU ops unavailable (%s: %s): using the PyTorch fallback",
                                   type(e).__name__, last)
            _state["ops"] = ops
    return _state["ops"]


def argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(-1)``, the same indices (torch's rule: the first of the largest, the first NaN where
    there is one), in one pass a row through the extension where it applies (float32 CPU rows stored
    contiguously, at most 3 dimensions)."""
    ops = (active() if x.device.type == "cpu" and x.dtype == torch.float32 and 1 <= x.dim() <= 3
           and x.shape[-1] > 0 and x.stride(-1) == 1 else None)
    if ops is None:
        return x.argmax(-1)
    lead = x.shape[:-1]
    while x.dim() < 3:
        x = x.unsqueeze(0)
    return ops.argmax_rows(x).view(lead)


def softmax_topk(base: torch.Tensor, bias: torch.Tensor | None, scale: torch.Tensor | None,
                 k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` most probable tokens of ``softmax((base + bias) / scale)``, best first: base [B, V]
    float32, bias None or [B, W, V] (promoted to float32 exactly), scale None or [B, 1, 1] -> (probabilities,
    ids) [B, W or 1, k]. One pass per row in the C++ op on CPU (``cpu_ops``; ties go to the lower id, the
    probabilities to float32 rounding), else PyTorch's softmax and topk. They only rank candidates:
    verification is exact either way."""
    ops = active() if base.device.type == "cpu" and base.dtype == torch.float32 else None
    if ops is not None and (bias is None or bias.dtype in (torch.float32, torch.bfloat16)):
        return tuple(ops.softmax_topk(base, bias, None if scale is None else scale.reshape(-1), k))
    logits = base.unsqueeze(1) if bias is None else torch.add(base.unsqueeze(1), bias)
    return torch.softmax(logits if scale is None else logits / scale, dim=-1).topk(k, dim=-1)


def inverse_cdf_draws(logits: torch.Tensor, temperature: torch.Tensor, min_p: torch.Tensor,
                      u: torch.Tensor) -> torch.Tensor | None:
    """One draw a row of ``logits`` [n, V] at ``temperature`` [n] with ``min_p`` [n] by the uniforms ``u`` [n]
    (``sample.sampler.draw``) in one pass of the C++ op, without a softmax, a float64 cumsum and a search
    over the row as tensors; None where the op does not apply (not a CPU float32 tensor, no extension)."""
    ops = active() if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2 else None
    if ops is None:
        return None
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    return ops.inverse_cdf_draws(logits, temperature, min_p, u)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``F.silu(gate) * up`` of ``gate_up`` [..., 2 n] (gate | up), the same bits: one pass through the
    extension for bfloat16 on the CPU outside autograd, else PyTorch's two ops."""
    n = gate_up.shape[-1] // 2
    ops = (active() if gate_up.device.type == "cpu" and gate_up.dtype == torch.bfloat16
           and not (torch.is_grad_enabled() and gate_up.requires_grad) else None)
    if ops is None:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
    return ops.silu_mul(gate_up.reshape(-1, 2 * n), n).view(*gate_up.shape[:-1], n)


def active():
    """The extension module when it is loaded and ``ENABLED``, else None (callers fall back)."""
    if not ENABLED:
        return None
    return get()
