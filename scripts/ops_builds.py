"""Times the default model's forward under two builds of the C++ ops, alternating in one process (the
only fair A/B on a shared machine, where two processes differ by 10-15%): each build's ``csrc`` is
compiled under its own module name, and the same loaded model switches between them round by round.
A build is a checkout's root (``git worktree add <dir> <commit>`` for an old one). Prints the median ms
of a forward appending n tokens to a context of ``--context`` positions (128), per build, and their
ratio. The figures of docs/quantization.md's "between the linears" paragraph come from
``python scripts/ops_builds.py <old checkout> . --tokens 1,2,3,4,8 --rounds 12``. With ``--linears``: the
group kernel alone on each distinct shape of the model's quantized linears (one weight, from cache),
fastest of the rounds, and B's time over A's ("4-bit codes in fixed point")."""

from __future__ import annotations

import argparse
import hashlib
import statistics
import tempfile
import time
from pathlib import Path

import torch

from specserve.layers import cpu_ops
from specserve.layers.quant import GROUP_GRAIN, GROUP_TILE, GroupKernel

def build(root: Path, tag: str):
    """The ops of checkout ``root`` as module ``specserve_ops_<tag>`` (built once, in the temp dir)."""
    csrc = root.resolve() / "specserve" / "csrc"
    where = hashlib.sha256(str(csrc).encode()).hexdigest()[:10]
    out = Path(tempfile.gettempdir()) / "specserve_ops_builds" / f"{tag}_{where}"
    out.mkdir(parents=True, exist_ok=True)
    return cpu_ops.compile_ops(csrc, f"specserve_ops_{tag}", out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("a", type=Path, help="checkout root of build A")
    ap.add_argument("b", type=Path, help="checkout root of build B")
    ap.add_argument("--tokens", default="1,3,4,8", help="tokens a forward appends")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--forwards", type=int, default=40, help="timed forwards per size and round")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=128, help="positions before the appended tokens")
    ap.add_argument("--linears", action="store_true", help="time the group kernel alone per linear shape")
    args = ap.parse_args()
    context = args.context
    torch.set_num_threads(args.threads)
    from specserve.engine.model_runner import ModelRunner
    from specserve.models.loader import resolve_model_dir

    mods = {"A": build(args.a, "a"), "B": build(args.b, "b")}
    sizes = [int(s) for s in args.tokens.split(",")]
    runner = ModelRunner(resolve_model_dir(None), max_num_seqs=1)
    model = runner.model
    linears = [m for m in model.modules() if isinstance(getattr(m, "qkernel", None), GroupKernel)]

    def use(mod) -> None:  # everything that holds the ops, and the layers' plans made with them
        cpu_ops._state["ops"] = mod
        for m in linears:
            m.qkernel.ops = mod
        for layer in model.model.layers:
            layer._one_call = None
        model._plan = None

    if args.linears:
        time_linears(mods, linears, sizes, args.rounds, args.forwards)
        return
    ms = {k: {n: [] for n in sizes} for k in mods}
    with torch.inference_mode():
        for r in range(args.rounds):
            for name in ("A", "B") if r % 2 == 0 else ("B", "A"):
                use(mods[name])
                runner.forward(0, [[0] * context], [0], "none")
                for n in sizes:
                    for _ in range(3):
                        runner.forward(0, [[0] * n], [context], "all")
                    ts = []
                    for _ in range(args.forwards):
                        t0 = time.perf_counter()
                        runner.forward(0, [[0] * n], [context], "all")
                        ts.append(time.perf_counter() - t0)
                    ms[name][n].append(statistics.median(ts) * 1e3)
    med = {k: {n: statistics.median(v) for n, v in per.items()} for k, per in ms.items()}
    print(f"ms of a forward appending n tokens after {context} positions, medians of {args.rounds} rounds, "
          f"{args.threads} threads")
    print("| build | " + " | ".join(f"n={n}" for n in sizes) + " |")
    print("|---|" + "---|" * len(sizes))
    for k, path in (("A", args.a), ("B", args.b)):
        print(f"| {k}: {path} | " + " | ".join(f"{med[k][n]:.3f}" for n in sizes) + " |")
    print("| B / A | " + " | ".join(f"{med['B'][n] / med['A'][n]:.3f}" for n in sizes) + " |")


@torch.inference_mode()
def time_linears(mods: dict, linears: list, sizes: list[int], rounds: int, calls: int) -> None:
    """Per distinct (bits, out x in) of ``linears``: the fastest of ``rounds`` means of ``calls`` group_gemm
    calls on n rows, the builds alternating; prints B's time over A's."""
    shapes = {}
    for m in linears:
        k = m.qkernel
        shapes.setdefault((k.bits, k.out_features, k.in_features), k)
    g = torch.Generator().manual_seed(0)
    print(f"group kernel alone, B's time over A's (fastest of {rounds} x {calls} calls)")
    print("| linear | " + " | ".join(f"n={n}" for n in sizes) + " |")
    print("|---|" + "---|" * len(sizes))
    for (bits, n_out, n_in), k in sorted(shapes.items()):
        ratios = []
        for n in sizes:
            x = torch.randn(n, n_in, generator=g).to(torch.bfloat16)
            best = {name: float("inf") for name in mods}
            for r in range(rounds):
                for name in mods if r % 2 == 0 else list(mods)[::-1]:
                    t0 = time.perf_counter()
                    for _ in range(calls):
                        mods[name].group_gemm(x, k.weight, bits, GROUP_GRAIN, GROUP_TILE)
                    best[name] = min(best[name], time.perf_counter() - t0)
            ratios.append(best["B"] / best["A"])
        print(f"| {bits}-bit {n_out} x {n_in} | " + " | ".join(f"{v:.2f}" for v in ratios) + " |")


if __name__ == "__main__":
    main()
