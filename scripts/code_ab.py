"""A drafter under two versions of specserve's Python code, interleaved prompt by prompt in one process
with plain decoding (the only fair A/B on a shared machine, where two processes differ by 10-15%; two
builds of the C++ ops: ``scripts/ops_builds.py``). The old version is a checkout (``git worktree add
<dir> <commit>``) imported as ``specserve_old`` from a copy whose imports are renamed; each version
loads the C++ ops of its own checkout. Held-out category prompts, greedy or sampled; prints tok/s over plain
decoding per version and whether every answer equals plain decoding's, then each engine's decoding steps and
their mean time, drafting included and alone. The figures of
docs/drafters-by-category.md's thirteenth round come from ``python scripts/code_ab.py <old checkout>
--method medusa --num-prompts 6`` (and ``--method dspark``)."""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import re
import shutil
import sys
import tempfile
from pathlib import Path

from specserve import LLM
from specserve.bench.categories import interleaved_chats, parse_ab_arguments, print_ab_table

IMPORTS = re.compile(r"^(\s*)(from|import) specserve(?=[. ])", re.M)


def import_old(root: Path):
    """Checkout ``root``'s ``specserve`` package as module ``specserve_old``: a renamed copy in the temp dir,
    at a path of its own per checkout (its C++ ops build, keyed by the path, is made once)."""
    where = hashlib.sha256(str(root.resolve()).encode()).hexdigest()[:10]
    dest = Path(tempfile.gettempdir()) / "specserve_code_ab" / where
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(root.resolve() / "specserve", dest / "specserve_old",
                    ignore=shutil.ignore_patterns("__pycache__", "checkpoints"))
    (dest / "specserve_old" / "checkpoints").symlink_to(root.resolve() / "specserve" / "checkpoints")
    for f in (dest / "specserve_old").rglob("*.py"):
        f.write_text(IMPORTS.sub(r"\1\2 specserve_old", f.read_text()))
    sys.path.insert(0, str(dest))
    return importlib.import_module("specserve_old")


class OldLLM:
    """The old version's ``LLM``, taking this version's ``SamplingParams`` (each version checks its own type)."""

    def __init__(self, module, **kwargs):
        self.module, self.llm = module, module.LLM(**kwargs)

    def chat(self, messages, params, **kwargs):
        old = self.module.SamplingParams(temperature=params.temperature, seed=params.seed,
                                         max_tokens=params.max_tokens)
        return self.llm.chat(messages, old, **kwargs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("old", type=Path, help="checkout root of the old version")
    ap.add_argument("--method", default="medusa", help="the speculative method both versions run ('none': "
                                                       "plain decoding), or its speculative_config as JSON")
    ap.add_argument("--speculation-gate", choices=("on", "off"), default="on",
                    help="'off': both versions draft every step they can (the engine's speculation gate)")
    ap.add_argument("--temperature", type=float, default=0.0, help="> 0: sampled, seeded by the prompt's index")
    args = parse_ab_arguments(ap)
    spec = (None if args.method == "none" else json.loads(args.method) if args.method.startswith("{")
            else {"method": args.method})
    gate = args.speculation_gate == "on"
    engines = {"plain": LLM(), "old": OldLLM(import_old(args.old), speculative_config=spec, speculation_gate=gate),
               "new": LLM(speculative_config=spec, speculation_gate=gate)}
    prompts, wall, tokens, same = interleaved_chats(engines, args, temperature=args.temperature)
    print_ab_table(f"{args.method}: ", args, engines, prompts, wall, tokens, same)
    print("| row | decoding steps | ms a step | of it drafting |\n|---|---|---|---|")
    for name, llm in engines.items():
        st = getattr(llm, "llm", llm).engine.stats
        n = max(st.decode_steps, 1)
        print(f"| {name} | {st.decode_steps} | {1e3 * st.decode_s / n:.2f} | {1e3 * st.draft_s / n:.2f} |")


if __name__ == "__main__":
    main()
