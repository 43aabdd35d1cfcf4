"""How closely the default model's served weights (the GGUF file through the group kernel) follow the same
model in float32 (dense, dequantized), on held-out prompts of every category and the README's held-out
instruction prompts.

float32 writes greedy answers; both then read prompt + answer in one forward each (teacher forcing), and
at every answer position we compare the next-token distributions: how often the argmax agrees, and
KL(float32 || served). Also printed: how many of the served model's own greedy answers equal float32's,
their mean common prefix (both chaotic: one flipped token changes the rest), and the answer to "What is
the capital of France?". To compare two builds of the C++ ops, run this from each checkout
(``PYTHONPATH=<checkout> python scripts/kernel_fidelity.py``): float32 is the same in both.

    python scripts/kernel_fidelity.py --per-category 4 --max-tokens 96
"""

from __future__ import annotations

import argparse

import torch

from specserve import LLM, SamplingParams
from specserve.bench.categories import category_prompts
from specserve.bench.harness import INSTRUCTIONS_HELDOUT, common_prefix, load_prompts

PARIS = "What is the capital of France?"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--per-category", type=int, default=4, help="held-out prompts of each category")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    prompts = [p for _, p in category_prompts("categories", args.per_category)]
    prompts += load_prompts(INSTRUCTIONS_HELDOUT)[:12] + [PARIS]
    chats = [[{"role": "user", "content": p}] for p in prompts]
    sp = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    ref, served = LLM(dtype="float32", quantization="none", max_num_seqs=1), LLM(max_num_seqs=1)
    ref_ids = [list(o.outputs[0].token_ids) for o in ref.chat(chats, sp, use_tqdm=False)]
    own = [o.outputs[0] for o in served.chat(chats, sp, use_tqdm=False)]
    agree, kls = 0, []
    with torch.inference_mode():
        for chat, ans in zip(chats, ref_ids):
            prompt = list(ref.tokenizer.apply_chat_template(chat))
            seq = prompt + ans[:-1]
            lp = [llm.engine.runner.forward(0, [seq], [0], logits_mode="all").logits[0, len(prompt) - 1 : len(seq)]
                  .float().log_softmax(-1) for llm in (ref, served)]
            agree += (lp[0].argmax(-1) == lp[1].argmax(-1)).sum().item()
            kls.append((lp[0].exp() * (lp[0] - lp[1])).sum(-1))
    kl = torch.cat(kls)
    own_ids = [list(o.token_ids) for o in own]
    same = sum(a == r for a, r in zip(own_ids, ref_ids))
    prefix = common_prefix(ref_ids, own_ids)
    print(f"{len(prompts)} prompts, {kl.numel()} answer positions of float32's greedy answers (teacher forcing)")
    print(f"argmax agrees with float32: {agree / kl.numel():.4f}; KL(float32 || served): mean {kl.mean():.5f}, "
          f"p99 {kl.quantile(0.99):.4f}, max {kl.max():.3f}")
    print(f"own greedy answers equal to float32's: {same}/{len(prompts)}, mean common prefix {prefix:.1f} tokens")
    print(f"{PARIS!r} -> {own[-1].text!r}")


if __name__ == "__main__":
    main()
