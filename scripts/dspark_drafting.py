"""DSpark's default configuration with its drafting step as it was and as it is, interleaved in one
process with plain decoding: "before" runs the drafter's block forward op by op and its tree search over
W2 in blocks of whole columns (the eleventh round's starting point); "now" runs each drafter layer in one
C++ ``decoder_layer`` call and the tree search over W2's columns in pairs (``vdpbf16ps``), the default.
Held-out category prompts, greedy; prints tok/s over plain decoding (all and per category), drafting ms
per call, and whether every answer is plain decoding's. The figures in docs/drafters-by-category.md
(eleventh round) come from ``python scripts/dspark_drafting.py --num-prompts 6 --threads 2``; the sixth
round's (the tree search's loop against its one call) from this script at 0395400."""

from __future__ import annotations

import argparse
import time

from specserve import LLM
from specserve.bench.categories import interleaved_chats, parse_ab_arguments


def as_before(llm: LLM) -> None:
    """The drafter of ``llm`` runs its layers op by op and reads W2 in blocks of whole columns."""
    drafter = llm.engine.runner.helper("dspark").drafter
    drafter._layer_calls = lambda ops: None
    w1d, w2p = drafter.markov_head.search_pack
    if w2p.dim() == 4:  # [blocks, r / 2, 16, 2] -> [blocks, r, 16]
        w2p = w2p.permute(0, 1, 3, 2).reshape(w2p.shape[0], -1, 16).contiguous()
    drafter.markov_head.search_pack = (w1d, w2p)


def timed_drafting(llm: LLM, spent: list[float]) -> None:
    """Adds each drafting call's seconds of ``llm`` to ``spent``."""
    worker = llm.engine.runner.helper("dspark")
    real = worker.propose_tree

    def propose_tree(*args, **kwargs):
        t0 = time.perf_counter()
        out = real(*args, **kwargs)
        spent.append(time.perf_counter() - t0)
        return out

    worker.propose_tree = propose_tree


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    args = parse_ab_arguments(ap)
    engines = {"plain": LLM(), "before": LLM(speculative_config={"method": "dspark"}),
               "now": LLM(speculative_config={"method": "dspark"})}
    as_before(engines["before"])
    drafting = {name: [] for name in ("before", "now")}
    for name, spent in drafting.items():
        timed_drafting(engines[name], spent)
    prompts, wall, tokens, same = interleaved_chats(engines, args)
    print(f"{len(prompts)} prompts, {args.max_tokens} tokens, greedy, {args.threads} threads")
    print("| row | tok/s | x plain | drafting ms a call (calls) | identical to plain |\n|---|---|---|---|---|")
    for name in engines:
        d = drafting.get(name)
        call = f"{1e3 * sum(d) / max(1, len(d)):.2f} ({len(d)})" if d is not None else "-"
        print(f"| {name} | {tokens[name] / wall[name]:.1f} | {wall['plain'] / wall[name]:.3f}x | {call} | "
              f"{same[name]}/{len(prompts)} |")
    print("\n| category | before | now |\n|---|---|---|")
    for cat in dict.fromkeys(c for c, _ in prompts):
        print(f"| {cat} | {wall[(cat, 'plain')] / wall[(cat, 'before')]:.3f}x | "
              f"{wall[(cat, 'plain')] / wall[(cat, 'now')]:.3f}x |")


if __name__ == "__main__":
    main()
