"""A drafter's cost model with and without the engine's own step times, interleaved in one process with
plain decoding: "table" reads only the start-up table of bare target forwards; "steps" (the default)
corrects it by the engine's single-sequence steps (``cost_model.StepCosts``). Held-out category prompts,
greedy; prints tok/s over plain decoding and the verify costs each engine ended with, and checks every
answer against plain decoding's. The figures in docs/drafters-by-category.md (eleventh round) come from
``python scripts/step_costs.py --method dspark --num-prompts 6`` (and ``--method medusa``)."""

from __future__ import annotations

import argparse

from specserve import LLM
from specserve.bench.categories import interleaved_chats, parse_ab_arguments, print_ab_table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--method", default="dspark", help="a drafter with a cost model: dspark, dflash or medusa")
    args = parse_ab_arguments(ap)
    spec = {"method": args.method}
    engines = {"plain": LLM(), "table": LLM(speculative_config=spec), "steps": LLM(speculative_config=spec)}
    engines["table"].engine.proposer.step_cost = lambda n, seconds: None  # the start-up table only
    prompts, wall, tokens, same = interleaved_chats(engines, args)
    print_ab_table(f"{args.method}: ", args, engines, prompts, wall, tokens, same)
    counts = (1, 2, 3, 4, 6, 8, 12, 16)
    for name in ("table", "steps"):
        drafter = engines[name].engine.proposer
        drafter = getattr(drafter, "inner", drafter)
        print(f"{name} verify cost, ms:", {n: round(1e3 * drafter.verify_cost(n), 2) for n in counts})


if __name__ == "__main__":
    main()
