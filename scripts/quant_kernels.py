"""Times every linear of the default model's shape (30 layers + the tied LM head) once, per weight
format and row count: dense float32 and bfloat16 (oneDNN-packed, as the engine runs them), int8 per
channel, int4 in groups of 32 (Q4_1's layout), 8-bit in groups of 32 (Q8_0's layout), the last two
through torch's kernels and through specserve's C++ group kernel (where built). Random weights;
ms per pass over all of them, median of several passes. The table in docs/quantization.md comes from
it: ``python scripts/quant_kernels.py --threads 2``."""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specserve.layers import cpu_ops
from specserve.layers.quant import GroupKernel, QuantKernel, quantize

SHAPES = [(960, 576)] * 30 + [(576, 576)] * 30 + [(3072, 576)] * 30 + [(576, 1536)] * 30 + [(49152, 576)]


def dense(w: torch.Tensor, dtype):
    packed = torch.ops.mkldnn._reorder_linear_weight(w.to(dtype), 16)
    return lambda x: torch.ops.mkldnn._linear_pointwise(x.to(dtype), packed, None, "none", [], "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,2,4,8,16,32,64")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    ws = {s: torch.randn(*s, generator=g) * 0.05 for s in set(SHAPES)}
    formats = {
        "float32": lambda w: dense(w, torch.float32),
        "bfloat16": lambda w: dense(w, torch.bfloat16),
        "int8": lambda w: QuantKernel(quantize(w, 8)),
        "int4-g32": lambda w: QuantKernel(quantize(w, 4, 32)),
        "8bit-g32 (Q8_0)": lambda w: QuantKernel(quantize(w, 8, 32)),
    }
    ops = cpu_ops.get()
    if ops is not None and ops.group_gemm_available():
        formats["int4-g32, group kernel"] = lambda w: GroupKernel(quantize(w, 4, 32), ops)
        formats["8bit-g32 (Q8_0), group kernel"] = lambda w: GroupKernel(quantize(w, 8, 32), ops)
    if ops is not None and ops.group_gemm_a8_available():
        formats["int4-g32, 8-bit activations"] = lambda w: GroupKernel(quantize(w, 4, 32), ops, int8_activations=True)
        formats["8bit-g32 (Q8_0), 8-bit activations"] = lambda w: GroupKernel(quantize(w, 8, 32), ops,
                                                                                int8_activations=True)
    rows = [int(r) for r in args.rows.split(",")]
    print(f"ms per pass over every linear of SmolLM2-135M (30 layers + LM head), {args.threads} threads")
    print("| format | " + " | ".join(f"{m} rows" for m in rows) + " |")
    print("|---|" + "---|" * len(rows))
    with torch.inference_mode():
        for name, make in formats.items():
            fns = {s: make(w) for s, w in ws.items()}
            cells = []
            for m in rows:
                xs = {k: torch.randn(m, k).to(torch.bfloat16 if name != "float32" else torch.float32)
                      for k in {s[1] for s in SHAPES}}
                times = []
                for _ in range(args.reps + 1):
                    t0 = time.perf_counter()
                    for s in SHAPES:
                        fns[s](xs[s[1]])
                    times.append(time.perf_counter() - t0)
                cells.append(f"{1000 * statistics.median(times[1:]):.1f}")
            print(f"| {name} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
