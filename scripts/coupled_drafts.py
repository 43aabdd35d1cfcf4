"""How often a sampled request would accept Medusa's first draft under other ways of drafting, offline: on the
held-out category answers of the distilled store, the shipped heads' head 0 distribution q (the token after
next, from the target's hidden state and the token it just emitted) against the target's own distribution p
of that token, both at temperature T. Per T, the mean over positions of:

* ``greedy``: p(argmax q), a deterministic draft, what the engine drafts (in both sampling modes);
* ``invcdf``: the draft drawn from q with the uniform the target's coupled draw uses at that position
  (``sample.coupled``: inverse CDF in token order), accepted when the two draws agree;
* ``gumbel``: both draws by Gumbel-max with the same noise (what a coupled sampler built on the exponential
  race would give; Monte Carlo over 32 noise vectors);
* ``1-TV``: the maximal coupling, what rejection sampling reaches with drafts sampled from q;
* ``top4`` / ``gumbel-top4``: a node's 4 children, q's top 4 against the Gumbel top 4 of q with the
  target's noise (the chance the target's token is among them);
* ``greedy-T0``: greedy decoding's first-draft acceptance, for scale.

The figures of docs/drafters-by-category.md's thirty-fifth round come from ``python scripts/coupled_drafts.py``
(40 held-out prompts, 4,039 positions)."""

from __future__ import annotations

import argparse

import torch

import specserve.train.medusa as medusa_train
from specserve.train.medusa import MedusaTrainArgs, example_range, head_logits, train_medusa

HEADS = "specserve/checkpoints/medusa-smollm2-135m"
STORE = "specserve/train/distilled/categories-smollm2-135m-q4_1"


def heldout_positions(args) -> tuple:
    """The shipped heads and the held-out examples of ``train_medusa --eval-only`` (the store's answers, the
    target's hidden states), taken where that command would evaluate them."""
    got = {}

    def keep(_args, _command, _log, heads, data, _sources):
        got["heads"], got["data"] = heads, data
        return {}

    medusa_train._evaluate_saved = keep
    train_medusa(MedusaTrainArgs(out=HEADS, eval_only=True, prompts_file="categories", num_prompts=1,
                                 num_eval_prompts=args.num_eval_prompts, max_tokens=128, gen_quantization="gguf",
                                 distill_store=STORE, feature_dtype="bfloat16", threads=args.threads,
                                 progress=False))
    return got["heads"], got["data"]


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--temperatures", default="0.7,0.8,1.0")
    ap.add_argument("--num-eval-prompts", type=int, default=5, help="held-out prompts per category")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.manual_seed(0)
    heads, data = heldout_positions(args)
    embed = data.embed.float()  # the tied lm_head over the whole vocabulary
    rows, start = [], 0
    for n in (max(0, t1 - t0) for t0, t1 in map(example_range, data.held_s)):
        rows += range(start, start + n - 1)  # positions t whose t + 1 is in the same answer
        start += n
    rows = torch.tensor(rows)
    q_logits = torch.full((len(rows), embed.shape[0]), float("-inf"))
    q_logits[:, heads.token_map] = head_logits(heads, data.Hh[rows], data.lm_w, data.lm_b,
                                               emb=embed[data.Rh[rows]])[:, 0]
    p_logits = data.Hh[rows + 1] @ embed.T
    print(f"{len(rows)} held-out positions; Medusa head 0's draft against the target's token")
    for T in (float(t) for t in args.temperatures.split(",")):
        sums = dict.fromkeys(("greedy", "invcdf", "gumbel", "1-TV", "top4", "gumbel-top4", "greedy-T0"), 0.0)
        for s in range(0, len(rows), 256):
            lp, lq = torch.log_softmax(p_logits[s : s + 256] / T, -1), torch.log_softmax(q_logits[s : s + 256] / T, -1)
            p, q = lp.exp(), lq.exp()
            sums["greedy"] += p.gather(1, lq.argmax(-1, keepdim=True)).sum().item()
            sums["greedy-T0"] += (p_logits[s : s + 256].argmax(-1) == lq.argmax(-1)).sum().item()
            sums["1-TV"] += (1 - 0.5 * (p - q).abs().sum(-1)).sum().item()
            fp, fq = p.double().cumsum(-1), q.double().cumsum(-1)  # token i's interval: [F(i) - mass, F(i))
            sums["invcdf"] += (torch.minimum(fp, fq) - torch.maximum(fp - p, fq - q)).clamp(min=0).sum().item()
            sums["top4"] += p.gather(1, lq.topk(4, -1).indices).sum().item()
            for _ in range(32):
                g = -torch.log(-torch.log(torch.rand_like(lp).clamp_min(1e-20)))
                y = (lp + g).argmax(-1, keepdim=True)
                sums["gumbel"] += ((lq + g).argmax(-1, keepdim=True) == y).sum().item() / 32
                sums["gumbel-top4"] += ((lq + g).topk(4, -1).indices == y).any(-1).sum().item() / 32
        print(f"T={T:g}: " + " ".join(f"{k}={v / len(rows):.3f}" for k, v in sums.items()))


if __name__ == "__main__":
    main()
