"""What acceptance a drafter needs on this machine to reach a given speed: an oracle drafter that knows plain
decoding's greedy answer to each prompt proposes chains of k tokens, each the answer's own token with
probability a (else a token that cannot be accepted: every later draft of the chain is then lost too), through
the real engine (target forward, verification, commit; the speculation gate off, so every step drafts),
interleaved prompt by prompt with plain decoding. The oracle's drafting takes no time; what a real drafter's
drafting costs is added per drafting step from the figures measured here (ms a step, tokens a step), for the
drafting costs given by ``--draft-ms``.

Prints, per (a, k): tokens a step, ms a step and speed over plain decoding, then per drafting cost the least a
that reaches each speed of ``--targets`` for each k. Held-out category prompts, greedy; every answer is
checked against plain decoding's. The figures of docs/drafters-by-category.md's thirty-fifth round come from
``python scripts/oracle_ceiling.py --num-prompts 2``."""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass

from specserve import LLM, SamplingParams
from specserve.bench.categories import category_prompts, interleaved_chats, parse_ab_arguments
from specserve.spec_decode import PROPOSERS
from specserve.spec_decode.options import option
from specserve.spec_decode.proposer import Proposal, ProposeInputs, Proposer


@dataclass(frozen=True)
class OracleOptions:
    num_speculative_tokens: int = option(8, "the longest chain any setting asks for", lo=1, hi=32)


class OracleChain(Proposer):
    """Chains from the known answers (``answers``: prompt ids -> plain decoding's output ids): ``k`` tokens a
    step, each right with probability ``accuracy`` (a seeded stream), else a token next to the answer's."""

    name = "oracle-chain"
    Options = OracleOptions

    def __init__(self, opts: OracleOptions):
        self.num_speculative_tokens = opts.num_speculative_tokens
        self.answers: dict[tuple, list[int]] = {}
        self.accuracy, self.k = 1.0, 1
        self.rng = random.Random(0)

    def propose(self, inputs: ProposeInputs) -> Proposal:
        chains = []
        for s, m in zip(inputs.seqs, inputs.max_drafts):
            answer = self.answers.get(tuple(s.prompt_ids))
            if answer is None:
                raise KeyError("the oracle has no answer for this prompt: run plain decoding on it first")
            n = len(s.output_ids)
            want = answer[n : n + min(m, self.k)]
            chains.append([t if self.rng.random() < self.accuracy else (t - 1 if t else 1) for t in want])
        return Proposal(chains)


class Setting:
    """An engine called as an ``LLM`` is by ``interleaved_chats``, counting its decoding steps and their seconds;
    with ``accuracy`` and ``k``, one setting of the shared oracle engine."""

    def __init__(self, llm: LLM, accuracy: float | None = None, k: int = 0):
        self.llm, self.accuracy, self.k = llm, accuracy, k
        self.steps = self.seconds = 0.0

    def chat(self, *args, **kwargs):
        if self.accuracy is not None:
            proposer = self.llm.engine.proposer
            proposer.accuracy, proposer.k = self.accuracy, self.k
        stats = self.llm.engine.stats
        steps, seconds = stats.decode_steps, stats.decode_s
        out = self.llm.chat(*args, **kwargs)
        self.steps += stats.decode_steps - steps
        self.seconds += stats.decode_s - seconds
        return out


def floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--accuracies", type=floats, default=floats("0.5,0.6,0.7,0.8,0.9,1.0"),
                    help="per-token probabilities that a draft is the answer's token")
    ap.add_argument("--chains", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 3, 5, 7],
                    help="chain lengths k")
    ap.add_argument("--draft-ms", type=floats, default=floats("0,0.6,2.5"),
                    help="drafting costs (ms a drafting step) to read the figures at")
    ap.add_argument("--targets", type=floats, default=floats("1.3,2.0"), help="speeds over plain decoding")
    args = parse_ab_arguments(ap)
    PROPOSERS[OracleChain.name] = OracleChain
    plain = LLM(enable_prefix_caching=False)
    oracle = LLM(enable_prefix_caching=False, speculation_gate=False,
                 speculative_config={"method": OracleChain.name, "num_speculative_tokens": max(args.chains)})
    prompts = category_prompts("categories", args.num_prompts)
    t0 = time.perf_counter()
    for seq_ids, answer in plain_answers(plain, prompts, args.max_tokens):
        oracle.engine.proposer.answers[seq_ids] = answer
    settings = {f"a={a:g} k={k}": Setting(oracle, a, k) for a in args.accuracies for k in args.chains}
    engines = {"plain": Setting(plain), **settings}
    prompts, wall, tokens, same = interleaved_chats(engines, args, prompts)
    plain_ms = 1e3 * engines["plain"].seconds / engines["plain"].steps
    print(f"oracle chains: {len(prompts)} prompts, {args.max_tokens} tokens, greedy, {args.threads} threads, "
          f"speculation gate off ({time.perf_counter() - t0:.0f} s); plain decoding {plain_ms:.2f} ms a step")
    print("| a | k | tokens a step | ms a step | x plain | identical to plain |\n|---|---|---|---|---|---|")
    per_step = {}
    for name, s in settings.items():
        tps = (tokens[name] - len(prompts)) / s.steps  # each answer's first token comes from its prefill
        ms = 1e3 * s.seconds / s.steps
        per_step[(s.accuracy, s.k)] = (tps, ms)
        print(f"| {s.accuracy:g} | {s.k} | {tps:.2f} | {ms:.2f} | {wall['plain'] / wall[name]:.3f}x | "
              f"{same[name]}/{len(prompts)} |")
    for c in args.draft_ms:
        print(f"\ndrafting at {c:g} ms a step: the least a reaching each speed (decoding steps only)")
        print("| k | " + " | ".join(f"{t:g}x" for t in args.targets) + " |\n|---|" + "---|" * len(args.targets))
        for k in args.chains:
            cells = []
            for target in args.targets:
                ok = [a for a in args.accuracies
                      if per_step[(a, k)][0] * plain_ms / (per_step[(a, k)][1] + c) >= target]
                cells.append(f"{min(ok):g}" if ok else "-")
            print(f"| {k} | " + " | ".join(cells) + " |")


def plain_answers(llm: LLM, prompts, max_tokens: int):
    """(prompt ids, output ids) of plain decoding's greedy answer to each prompt."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    for _, p in prompts:
        res = llm.chat([[{"role": "user", "content": p}]], params, use_tqdm=False)[0]
        yield tuple(res.prompt_token_ids), list(res.outputs[0].token_ids)


if __name__ == "__main__":
    main()
