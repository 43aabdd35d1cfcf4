"""Where a decoding step's time goes inside the engine, for plain decoding and each drafter, interleaved in
one process prompt by prompt: per step the drafter's call, the target forward, verification and commit,
and the target forward's time by how many tokens it verified (what each verified token costs as the
engine runs it, beside the start-up table of bare forwards that the cost models read and
``step_costs.py`` prints). Held-out category prompts, greedy, the speculation gate off (every step may
draft); every answer is checked against plain decoding's. The figures of docs/drafters-by-category.md's
twenty-ninth round come from ``python scripts/step_anatomy.py --methods medusa,dspark --num-prompts 3``."""

from __future__ import annotations

import argparse
import collections
import time

from specserve import LLM
from specserve.bench.categories import interleaved_chats, parse_ab_arguments, print_ab_table
from specserve.bench.serve_bench import parse_configs
from specserve.engine import llm_engine

PARTS = (("_propose", "drafting"), ("_commit", "commit"))


def timed(obj, attr: str, sink: collections.Counter, key, counts: collections.Counter | None = None, by=None):
    """Wrap ``obj.attr`` so that its seconds add to ``sink[key]`` (``by(args)``: a sub-key, e.g. a token count)."""
    inner = getattr(obj, attr)

    def call(*args, **kwargs):
        t0 = time.perf_counter()
        out = inner(*args, **kwargs)
        k = key if by is None else (key, by(args))
        sink[k] += time.perf_counter() - t0
        if counts is not None:
            counts[k] += 1
        return out

    setattr(obj, attr, call)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--methods", default="medusa", help="comma-separated bench presets, or LABEL={json "
                                                        "speculative_config} entries separated by ';'")
    args = parse_ab_arguments(ap)
    engines = {"plain": LLM(speculation_gate=False)}
    engines.update({label: LLM(speculative_config=cfg, speculation_gate=False)
                    for label, cfg in parse_configs(args.methods) if cfg is not None})
    seconds, forwards = collections.Counter(), collections.Counter()
    decoding = {"step": False}  # set by ``forward_inputs``, which runs just before a step's forward only
    make_inputs = llm_engine.forward_inputs

    def step_inputs(*a, **kw):
        decoding["step"] = True
        return make_inputs(*a, **kw)

    llm_engine.forward_inputs = step_inputs
    for name, llm in engines.items():
        eng = llm.engine
        for attr, part in PARTS:
            timed(eng, attr, seconds, (name, part))
        timed(eng.verifier, "verify", seconds, (name, "verification"))
        # the target forwards of decoding steps by tokens verified (of one sequence: the chats run alone)
        timed(eng.runner, "forward", seconds, (name, "forward"), forwards,
              by=lambda a: len(a[1][0]) if decoding.pop("step", False) else "prefill")
    prompts, wall, tokens, same = interleaved_chats(engines, args)
    print_ab_table("step anatomy: ", args, engines, prompts, wall, tokens, same)
    print("\nms per decoding step (the forward's prefills left out)")
    print("| row | steps | tokens a step | step | drafting | target forward | verification | commit |")
    print("|---|---|---|---|---|---|---|---|")
    for name, llm in engines.items():
        st = llm.engine.stats
        n = max(st.decode_steps, 1)
        fwd = sum(s for k, s in seconds.items() if k[0] == (name, "forward") and k[1] != "prefill")
        print(f"| {name} | {st.decode_steps} | {st.decode_tokens / n:.2f} | {1e3 * st.decode_s / n:.2f} | "
              f"{1e3 * seconds[(name, 'drafting')] / n:.2f} | {1e3 * fwd / n:.2f} | "
              f"{1e3 * seconds[(name, 'verification')] / n:.2f} | {1e3 * seconds[(name, 'commit')] / n:.2f} |")
    print("\ntarget forward by tokens verified: ms (steps)")
    for name in engines:
        row = sorted((k[1], seconds[k] / forwards[k], forwards[k]) for k in forwards
                     if k[0] == (name, "forward") and k[1] != "prefill")
        print(f"{name}: " + ", ".join(f"{c}: {1e3 * s:.2f} ({n})" for c, s, n in row))


if __name__ == "__main__":
    main()
