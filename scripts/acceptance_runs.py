"""How a request's drafted steps follow one another: whether what a step accepted says what the next one
will, beside what the drafter itself predicts. Held-out category prompts, greedy, one request at a time,
both gates off (every step drafts: the engine's speculation gate and the drafter's draft gate decide from
these same outcomes, so they must not pick the steps measured). Per drafted step it records the drafts
accepted (all of them, and the drafter's own nodes apart from the n-gram branch nodes), the acceptance
the drafter predicted for the own nodes it verified (the sum of their raw scores, before the online
calibration) and the tokens verified; it prints the correlations between those and, by how many drafts
the step before accepted, the next step's means. Every answer is checked against plain decoding's. The
figures of docs/drafters-by-category.md's thirty-fourth round come from ``python scripts/acceptance_runs.py
--methods medusa,dspark --num-prompts 4``."""

from __future__ import annotations

import argparse
import statistics

from specserve import LLM, SamplingParams
from specserve.bench.categories import category_prompts, parse_ab_arguments

BUCKETS = 6  # the previous step's accepted drafts: 0 .. BUCKETS - 2, then BUCKETS - 1 or more


def correlation(a: list[float], b: list[float]) -> float:
    if len(a) < 2 or statistics.pstdev(a) == 0 or statistics.pstdev(b) == 0:
        return float("nan")
    return statistics.correlation(a, b)


def record_steps(llm) -> list:
    """Wrap ``llm``'s engine so that each decoding step of a single request appends (accepted, own
    accepted, predicted, verified) to the returned list; own and predicted are None for a step whose
    drafter verified none of its own nodes (the calibration learns nothing from it either)."""
    eng = llm.engine
    cal = eng.proposer.calibration
    steps, pending = [], {}
    expect, observe, commit = cal.expect, cal.observe, eng._commit

    def on_expect(seq_id, key, predicted):
        pending["predicted"] = sum(predicted)
        return expect(seq_id, key, predicted)

    def on_observe(seq_id, accepted):
        if "predicted" in pending:
            pending["own"] = accepted
        return observe(seq_id, accepted)

    def on_commit(seqs, drafts, batch, out, results):
        kept = commit(seqs, drafts, batch, out, results)  # the drafter hears of the outcome in there
        own, predicted = pending.pop("own", None), pending.pop("predicted", None)
        steps.append((len(results[0][0]) - 1, own, predicted if own is not None else None, len(batch.tokens[0]) - 1))
        return kept

    cal.expect, cal.observe, eng._commit = on_expect, on_observe, on_commit
    return steps


def report(name: str, runs: list[list[tuple]]) -> None:
    own = [s for run in runs for s in run if s[1] is not None]
    pairs = [(a, b) for run in runs for a, b in zip(run, run[1:]) if a[1] is not None and b[1] is not None]
    print(f"\n{name}: {sum(map(len, runs))} steps, {len(own)} verifying own nodes; per such step: accepted "
          f"{statistics.fmean(s[0] for s in own):.2f} (own {statistics.fmean(s[1] for s in own):.2f}, predicted "
          f"{statistics.fmean(s[2] for s in own):.2f}), verified {statistics.fmean(s[3] for s in own):.2f}")
    print(f"  correlation of a step's own accepted with its prediction: "
          f"{correlation([s[1] for s in own], [s[2] for s in own]):.2f}; of its accepted with the next step's: "
          f"{correlation([a[0] for a, _ in pairs], [b[0] for _, b in pairs]):.2f}; of its prediction with the next "
          f"step's accepted: {correlation([a[2] for a, _ in pairs], [b[0] for _, b in pairs]):.2f}")
    print("  | the step before accepted | steps | accepted | own accepted | own predicted | verified |")
    print("  |---|---|---|---|---|---|")
    for k in range(BUCKETS):
        nxt = [b for a, b in pairs if min(a[0], BUCKETS - 1) == k]
        if nxt:
            label = f"{k}+" if k == BUCKETS - 1 else str(k)
            print(f"  | {label} | {len(nxt)} | {statistics.fmean(s[0] for s in nxt):.2f} | "
                  f"{statistics.fmean(s[1] for s in nxt):.2f} | {statistics.fmean(s[2] for s in nxt):.2f} | "
                  f"{statistics.fmean(s[3] for s in nxt):.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--methods", default="medusa,dspark", help="comma-separated speculative methods (their "
                                                                "default configurations)")
    args = parse_ab_arguments(ap)
    prompts = category_prompts("categories", args.num_prompts)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    plain = LLM(speculation_gate=False)
    reference = [plain.chat([{"role": "user", "content": p}], params, use_tqdm=False)[0].outputs[0].token_ids
                 for _, p in prompts]
    for method in args.methods.split(","):
        llm = LLM(speculative_config={"method": method, "draft_gate": False}, speculation_gate=False)
        if llm.engine.proposer.calibration is None:
            raise SystemExit(f"{method}: its default configuration has no cost model to predict acceptance")
        steps, runs, same = record_steps(llm), [], 0
        for (_, p), ref in zip(prompts, reference):
            steps.clear()
            out = llm.chat([{"role": "user", "content": p}], params, use_tqdm=False)[0].outputs[0].token_ids
            same += out == ref
            runs.append(list(steps))
        report(f"{method} ({same}/{len(prompts)} answers identical to plain decoding)", runs)


if __name__ == "__main__":
    main()
