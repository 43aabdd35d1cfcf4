"""The default model with bfloat16 and with 8-bit activations (``LLM(activations=...)``), plain decoding and
each drafter's default, all engines interleaved prompt by prompt in one process on held-out category
prompts. Prints each engine's speed over plain decoding with bfloat16 activations and over plain decoding
with its own activations, and how many answers equal the latter's (plain decoding with 8-bit activations:
bfloat16's; the two settings are two targets, their answers differ in places). ``--avx2`` builds
specserve's C++ ops for AVX2 + FMA only (how they run on a CPU without AVX-512) on a machine that has
AVX-512. docs/quantization.md's figures come from ``python scripts/activations_ab.py --methods
ngram,medusa,dspark --num-prompts 4`` (and ``--avx2 --num-prompts 3``)."""

from __future__ import annotations

import argparse

from specserve import LLM
from specserve.bench.categories import interleaved_chats, parse_ab_arguments

SETTINGS = ("bfloat16", "int8")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--methods", default="ngram,medusa,dspark", help="comma-separated speculative methods")
    ap.add_argument("--temperature", type=float, default=0.0, help="> 0: sampled, seeded by the prompt's index")
    ap.add_argument("--avx2", action="store_true", help="specserve's C++ ops built for AVX2 + FMA only")
    args = parse_ab_arguments(ap)
    if args.avx2:
        from specserve.layers import cpu_ops

        cpu_ops._variant = lambda: ("avx2", ["-mavx2", "-mfma", "-mf16c"])
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    engines, references = {}, {}
    for act in SETTINGS:
        engines[f"none/{act}"] = LLM(activations=act)
        for m in methods:
            engines[f"{m}/{act}"] = LLM(activations=act, speculative_config={"method": m})
            references[f"{m}/{act}"] = f"none/{act}"
    prompts, wall, tokens, same = interleaved_chats(engines, args, temperature=args.temperature,
                                                    references=references)
    rate = {name: tokens[name] / wall[name] for name in engines}
    print(f"{len(prompts)} category prompts, {args.max_tokens} tokens, temperature {args.temperature}, "
          f"{args.threads} threads{', ops built for AVX2' if args.avx2 else ''}")
    print("| method | activations | tok/s | x plain (bfloat16) | x plain (same activations) | identical to it |")
    print("|---|---|---|---|---|---|")
    for name, r in rate.items():
        m, act = name.split("/")
        print(f"| {m} | {act} | {r:.1f} | {r / rate['none/bfloat16']:.3f}x | {r / rate[f'none/{act}']:.3f}x | "
              f"{same[name]}/{len(prompts)} |")


if __name__ == "__main__":
    main()
