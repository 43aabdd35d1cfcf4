"""A drafter's gates against other settings, interleaved in one process with plain decoding, in three kinds of
use: greedy requests one at a time, sampled ones (temperature 0.8, seeded: with coupled sampling every answer
still equals plain decoding's) and greedy batches of 4. Held-out category prompts; prints per kind each
engine's speed over plain decoding, its mean acceptance length and how many answers equal plain decoding's.
An engine is the method's default configuration with some keys changed: ``LABEL={json}`` entries separated by
';', where the key ``speculation_gate`` goes to ``LLM``, ``probe_every``, ``max_probe_every``, ``decay`` and
``warmup`` to its ``SpeculationGate``, and the rest to ``speculative_config``. The figures of
docs/drafters-by-category.md's thirtieth round come from ``python scripts/gate_ab.py --method medusa
--num-prompts 5 --variants 'nospec={"speculation_gate": false};neither={"speculation_gate": false,
"draft_gate": false}'`` (and ``--method dspark``), the thirty-first round's from ``--variants
'nobackoff={"max_probe_every": 16}'``. Each kind answers prompts of its own: a drafter's n-gram pool
keeps earlier answers, and greedy answers to the same prompt repeat word for word."""

from __future__ import annotations

import argparse
import collections

from specserve import LLM
from specserve.bench.categories import category_prompts, interleaved_chats, parse_ab_arguments
from specserve.bench.serve_bench import parse_configs

KINDS = {"greedy": (1, 0.0), "sampled": (1, 0.8), "batch4": (4, 0.0)}  # requests a call, temperature
GATE_KEYS = {"probe_every", "max_probe_every", "decay", "warmup"}  # the speculation gate's own settings


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--method", default="medusa", help="the speculative method every variant runs")
    ap.add_argument("--variants", default='neither={"speculation_gate": false, "draft_gate": false}',
                    help="LABEL={json} entries separated by ';' (beside the default configuration)")
    ap.add_argument("--kinds", default=",".join(KINDS), help=f"which of {', '.join(KINDS)}")
    args = parse_ab_arguments(ap)
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    if not kinds or any(k not in KINDS for k in kinds):
        raise SystemExit(f"--kinds: choose from {', '.join(KINDS)}")
    engines = {"plain": LLM(), "default": LLM(speculative_config={"method": args.method})}
    for label, settings in parse_configs(args.variants):
        if not isinstance(settings, dict):
            raise SystemExit(f"--variants: {label} is not LABEL={{json object}}")
        spec = {k: v for k, v in settings.items() if k != "speculation_gate" and k not in GATE_KEYS}
        engines[label] = LLM(speculative_config={"method": args.method, **spec},
                             speculation_gate=settings.get("speculation_gate"))
        for k in GATE_KEYS.intersection(settings):
            if engines[label].engine.gate is None:
                raise SystemExit(f"--variants: {label} sets {k} with the speculation gate off")
            setattr(engines[label].engine.gate, k, settings[k])
    n = args.num_prompts
    held_out = category_prompts("categories")
    per_category = collections.Counter(c for c, _ in held_out)
    if n * len(kinds) > min(per_category.values()):
        raise SystemExit(f"--num-prompts: each kind takes prompts of its own, {min(per_category.values())} a "
                         f"category in all: at most {min(per_category.values()) // len(kinds)} for {len(kinds)} kinds")
    for j, kind in enumerate(kinds):  # a kind's own prompts: a drafter's n-gram pool keeps earlier answers
        seen = collections.Counter()
        prompts = []
        for c, p in held_out:
            seen[c] += 1
            if j * n < seen[c] <= (j + 1) * n:
                prompts.append((c, p))
        size, temperature = KINDS[kind]
        before = {name: llm.get_metrics() for name, llm in engines.items()}
        _, wall, _, same = interleaved_chats(engines, args, prompts, size, temperature)
        calls = -(-len(prompts) // size)
        print(f"{args.method}, {kind}: {len(prompts)} prompts in {calls} calls, {args.max_tokens} tokens")
        print("| row | x plain | tau | identical to plain |\n|---|---|---|---|")
        for name, llm in engines.items():
            m, m0 = llm.get_metrics(), before[name]
            steps = m.get("num_verify_steps", 0) - m0.get("num_verify_steps", 0)
            tau = "-" if not steps else f"{1 + (m['num_accepted_tokens'] - m0['num_accepted_tokens']) / steps:.2f}"
            print(f"| {name} | {wall['plain'] / wall[name]:.3f}x | {tau} | {same[name]}/{calls} |")


if __name__ == "__main__":
    main()
