"""How fast this machine trains the shipped DSpark drafter: steps of ``specserve train dspark``'s loop
(``train.dspark.loop``: bfloat16 autocast, or float32 with ``--train-dtype float32``; AdamW, 8 sequences a
step, ``--anchors`` blocks each) on synthetic sequences of ``--length`` tokens with random target
features, after two warm-up steps. Prints ms a step and blocks a second: what a training round of N
blocks would take here (the target's features and the held-out evaluation come on top). Optionally the
profiler's top ops (``--profile``)."""

from __future__ import annotations

import argparse
import time

import torch

from specserve.models.loader import read_config, resolve_model_dir
from specserve.spec_decode.dspark.formats import load_dspark_checkpoint
from specserve.spec_decode.dspark.model import DFlashDrafter
from specserve.spec_decode.dspark.proposer import SHIPPED_DIR
from specserve.train.common import adamw_cosine
from specserve.train.dspark.loop import _Loop
from specserve.train.dspark.loss import slot_weights


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--anchors", type=int, default=24, help="blocks per sequence (--anchors-per-seq)")
    ap.add_argument("--length", type=int, default=200, help="tokens per sequence (prompt 80 + response)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--train-dtype", choices=("bfloat16", "float32"), default="bfloat16",
                    help="as train dspark's --train-dtype (bfloat16 autocast is slow on CPUs without bfloat16 math)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tcfg = read_config(resolve_model_dir(None))
    cfg, sd = load_dspark_checkpoint(SHIPPED_DIR / "dspark-smollm2-135m", tcfg)
    drafter = DFlashDrafter(cfg, dtype=torch.float32)
    drafter.load_state(sd)
    drafter.requires_grad_(True)
    V, d, m = tcfg.vocab_size, tcfg.hidden_size, len(cfg.target_layer_ids)
    g = torch.Generator().manual_seed(0)
    n_seqs = 8 * (args.steps + 3)
    samples = [{"ids": torch.randint(0, cfg.draft_vocab_size or V, (args.length,), generator=g).tolist(),
                "prompt_len": min(80, args.length // 2)} for _ in range(n_seqs)]
    feats = [(torch.randn(args.length, m * d, generator=g).bfloat16(), torch.randn(args.length, d, generator=g),
              torch.randn(args.length, generator=g) + 10) for _ in range(n_seqs)]
    target = (0.05 * torch.randn(V, d, generator=g), None, 0.05 * torch.randn(V, d, generator=g))
    loop = _Loop(drafter, samples, feats, target, gamma=cfg.block_size, mask_token_id=cfg.mask_token_id,
                 anchors_per_seq=args.anchors, batch_size=8, loss_w=(0.1, 0.9, 1.0), grad_clip=1.0,
                 mixed=args.train_dtype == "bfloat16", progress=False, log=None, state=None)
    loop.params, loop.opt, loop.sched = adamw_cosine(drafter, 3e-4, 0.0, 0.04, 100)
    loop.sw, loop.gen = slot_weights(cfg.block_size, 4.0), torch.Generator().manual_seed(0)
    drafter.train()
    G = cfg.block_size
    sums = [0.0, torch.zeros(G, dtype=torch.float64), torch.zeros(G, dtype=torch.float64), 0]
    batches = [list(range(s * 8, s * 8 + 8)) for s in range(n_seqs // 8)]
    for b in batches[:2]:
        loop._step(b, sums)
    t0 = time.perf_counter()
    for b in batches[2 : 2 + args.steps]:
        loop._step(b, sums)
    dt = (time.perf_counter() - t0) / args.steps
    print(f"{args.threads} threads, {8 * args.anchors} blocks a step of {args.length}-token sequences: "
          f"{dt * 1e3:.0f} ms a step, {8 * args.anchors / dt:.0f} blocks/s")
    if args.profile:
        from torch.profiler import profile

        with profile() as prof:
            loop._step(batches[-1], sums)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


if __name__ == "__main__":
    main()
