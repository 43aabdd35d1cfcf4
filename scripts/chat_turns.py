"""Multi-turn chats, as a chat user sends them: a conversation is two held-out prompts of one category
and a follow-up asking to shorten both answers, every turn sent with the whole conversation so far
(specserve's prefix caching skips the positions it has computed, DSpark/DFlash included; llama.cpp keeps
the KV of the prefix a turn shares with the one before). The rows (bench presets, plain decoding first,
and ``llama.cpp``: llama-cpp-python on the same GGUF and token ids) run conversation by conversation in
one process, the order reversed every other conversation; greedy. Prints per row tok/s over all turns,
x plain decoding, x llama.cpp, the prompt tokens it computed and how many answers equal plain
decoding's. The figures of docs/drafters-by-category.md's twentieth round come from
``python scripts/chat_turns.py --methods none,llama.cpp,ngram,medusa,dspark --num-prompts 2``."""

from __future__ import annotations

import argparse
import time

from specserve import LLM, SamplingParams
from specserve.bench.categories import category_prompts, parse_ab_arguments
from specserve.bench.harness import PRESETS, import_llama_cpp, model_gguf_path

FOLLOW_UP = "Now shorten both of your answers to two sentences each."


class LlamaCppChat:
    """llama.cpp's greedy turns on the default model's GGUF; its KV cache carries over between turns."""

    def __init__(self, threads: int, tokenizer, eos: set[int]):
        llama_cpp = import_llama_cpp()
        self.llm = llama_cpp.Llama(model_path=str(model_gguf_path(None)), n_ctx=4096, n_threads=threads,
                                   n_threads_batch=threads, verbose=False, logits_all=False)
        self.tokenizer, self.eos, self.prefill = tokenizer, eos, 0

    def turn(self, messages, max_tokens: int) -> tuple[list[int], str]:
        ids = self.tokenizer.apply_chat_template(messages, True)
        self.prefill += len(ids) - self._kept(ids)  # the positions past the prefix its cache keeps
        out = []
        for t in self.llm.generate(ids, reset=True, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, typical_p=1.0,
                                   repeat_penalty=1.0):
            out.append(int(t))
            if out[-1] in self.eos or len(out) >= max_tokens:
                break
        return out, self.tokenizer.decode([t for t in out if t not in self.eos])

    def _kept(self, ids) -> int:
        """The prefix of ``ids`` that ``generate`` will find in the cache (never the last id)."""
        n = 0
        for a, b in zip(self.llm._input_ids[: len(ids) - 1], ids):
            if a != b:
                break
            n += 1
        return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--methods", default="none,llama.cpp,ngram,medusa,dspark",
                    help="comma list: bench presets (plain decoding 'none' first) and llama.cpp")
    args = parse_ab_arguments(ap)
    names = [m.strip() for m in args.methods.split(",") if m.strip()]
    if names[0] != "none" or any(n not in PRESETS and n != "llama.cpp" for n in names):
        raise SystemExit(f"--methods: 'none' first, then presets or llama.cpp; got {args.methods}")
    rows = {}
    for n in names:
        if n != "llama.cpp":
            rows[n] = LLM(speculative_config=PRESETS[n]) if PRESETS[n] else LLM()
    tok = rows["none"].tokenizer
    if "llama.cpp" in names:
        rows["llama.cpp"] = LlamaCppChat(args.threads, tok, set(rows["none"].engine.eos_ids))
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    prompts = [p for _, p in category_prompts("categories", 2 * args.num_prompts)]
    wall = dict.fromkeys(names, 0.0)
    tokens = dict.fromkeys(names, 0)
    same = dict.fromkeys(names, 0)
    turns = 0
    for c in range(0, len(prompts) - 1, 2):
        order = names if (c // 2) % 2 == 0 else names[::-1]
        answers = {}
        for n in order:
            messages, got = [], []
            for text in (prompts[c], prompts[c + 1], FOLLOW_UP):
                messages.append({"role": "user", "content": text})
                t0 = time.perf_counter()
                if n == "llama.cpp":
                    ids, reply = rows[n].turn(messages, args.max_tokens)
                else:
                    (out,) = rows[n].chat(messages, params, use_tqdm=False)
                    ids, reply = list(out.outputs[0].token_ids), out.outputs[0].text
                wall[n] += time.perf_counter() - t0
                tokens[n] += len(ids)
                got.append(ids)
                messages.append({"role": "assistant", "content": reply})
            answers[n] = got
        for n in names:
            same[n] += sum(a == b for a, b in zip(answers[n], answers["none"]))
        turns += 3
    print(f"{turns // 3} conversations of 3 turns, {args.max_tokens} tokens a turn, greedy, {args.threads} threads")
    print("| row | tok/s | x plain | x llama.cpp | prompt tokens computed | identical to plain |")
    print("|---|---|---|---|---|---|")
    rate = {n: tokens[n] / wall[n] for n in names}
    for n in names:
        computed = rows[n].prefill if n == "llama.cpp" else rows[n].engine.stats.prefill_tokens
        vs_llama = f"{rate[n] / rate['llama.cpp']:.2f}x" if "llama.cpp" in names else "-"
        print(f"| {n} | {rate[n]:.1f} | {rate[n] / rate['none']:.3f}x | {vs_llama} | {computed} | {same[n]}/{turns} |")


if __name__ == "__main__":
    main()
