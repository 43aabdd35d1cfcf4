"""Times the C++ attention op's two kernels for bfloat16 rows, interleaved in one process: float64
(``set_float64_attention(True)``) and float32 (the default where AVX-512 BF16 is built). First the op
alone over the default model's heads (9 query heads, 3 kv heads, head size 64, 30 layers) per query
count and context length; then the default model's whole forward appending n tokens to a context of
``--contexts`` positions (what a plain step, n = 1, or a verification costs), fastest of ``--reps``.
The table in docs/quantization.md comes from it: ``python scripts/attention_kernels.py --threads 2``."""

from __future__ import annotations

import argparse
import time

import torch

from specserve.layers import cpu_ops

H, HKV, D, LAYERS, BS = 9, 3, 64, 30, 16
KERNELS = {"float64": True, "float32": False}


def op_times(ops, queries: int, context: int, reps: int) -> dict[str, float]:
    """ms of 30 layers' attention ops, per kernel (fastest of ``reps`` rounds of 200 calls)."""
    g = torch.Generator().manual_seed(queries * 10_000 + context)
    nb = (context + BS - 1) // BS
    cache = torch.randn(nb + 1, 2, HKV, BS, D, generator=g).to(torch.bfloat16)
    tables = torch.arange(1, nb + 1).view(1, nb)
    q = torch.randn(1, queries, H, D, generator=g).to(torch.bfloat16)
    best = {k: float("inf") for k in KERNELS}
    for _ in range(reps):
        for name, f64 in KERNELS.items():
            ops.set_float64_attention(f64)
            ops.attention(q, cache, tables, context, None, False, D**-0.5, cpu_ops.PARALLEL_WORK)
            t0 = time.perf_counter()
            for _ in range(200):
                ops.attention(q, cache, tables, context, None, False, D**-0.5, cpu_ops.PARALLEL_WORK)
            best[name] = min(best[name], (time.perf_counter() - t0) / 200 * LAYERS * 1e3)
    return best


def forward_times(runner, ops, sizes: list[int], context: int, reps: int) -> dict[str, dict[int, float]]:
    """ms of one target forward appending n tokens to ``context`` positions, per kernel and n."""
    runner.forward(0, [[0] * context], [0], "none")
    best = {k: {n: float("inf") for n in sizes} for k in KERNELS}
    for _ in range(reps):
        for name, f64 in KERNELS.items():
            ops.set_float64_attention(f64)
            for n in sizes:
                t0 = time.perf_counter()
                runner.forward(0, [[0] * n], [context], "all")
                best[name][n] = min(best[name][n], (time.perf_counter() - t0) * 1e3)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--queries", default="1,4,8,16")
    ap.add_argument("--contexts", default="128,512,1024")
    ap.add_argument("--sizes", default="1,2,4,8,16", help="tokens per forward of the whole model")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ops = cpu_ops.get()
    if ops is None:
        raise SystemExit("the C++ ops did not build here: nothing to compare")
    queries = [int(x) for x in args.queries.split(",")]
    contexts = [int(x) for x in args.contexts.split(",")]
    sizes = [int(x) for x in args.sizes.split(",")]
    try:
        print("attention op, 30 layers, ms: float64 / float32")
        print("context  " + "  ".join(f"{f'{q} queries':>22}" for q in queries))
        for c in contexts:
            cells = []
            for q in queries:
                t = op_times(ops, q, c, args.reps)
                cells.append(f"{t['float64']:6.2f} / {t['float32']:5.2f} {t['float64'] / t['float32']:4.2f}x")
            print(f"{c:7d}  " + "  ".join(f"{x:>22}" for x in cells))
        from specserve import LLM

        llm = LLM(num_threads=args.threads, max_num_seqs=1, enable_prefix_caching=False)
        runner = llm.engine.runner
        print("\nthe default model's forward appending n tokens, ms: float64 / float32")
        print("context  " + "  ".join(f"{f'n={n}':>22}" for n in sizes))
        for c in contexts:
            t = forward_times(runner, ops, sizes, c, args.reps)
            cells = [f"{t['float64'][n]:6.2f} / {t['float32'][n]:5.2f} {t['float64'][n] / t['float32'][n]:4.2f}x"
                     for n in sizes]
            print(f"{c:7d}  " + "  ".join(f"{x:>22}" for x in cells))
    finally:
        ops.set_float64_attention(False)


if __name__ == "__main__":
    main()
