"""The training loop: AdamW with warm-up and cosine decay over batches of random anchor blocks, its
state saved when due and picked up again by the same run (the result is that of an uninterrupted run)."""

from __future__ import annotations

import time

import torch

from specserve.train.common import TrainState, adamw_cosine, progress_bar
from specserve.train.data import DataError
from specserve.train.dspark.loss import anchor_range, block_outputs, collate, on_device, slot_weights, to_device


def train_drafter(drafter, samples, feats, lm_w, lm_b, embed_w, *, gamma: int, mask_token_id: int,
                  anchors_per_seq: int = 16, epochs: int = 2, lr: float = 6e-4, batch_size: int = 8,
                  warmup: float = 0.04, weight_decay: float = 0.0, loss_decay: float = 4.0,
                  loss_w=(0.1, 0.9, 1.0), grad_clip: float = 1.0, seed: int = 0, progress: bool = True,
                  log=None, train_dtype: str = "float32", state: TrainState | None = None,
                  device: str = "cpu") -> dict:
    """Train ``drafter`` in place. Each epoch draws ``anchors_per_seq`` random anchors per sequence
    (without replacement) and takes ``batch_size`` sequences per step. ``train_dtype`` "bfloat16":
    the forward runs under bfloat16 autocast (the weights, gradients and optimiser stay float32).
    ``state``: where the loop saves itself when due and, if a saved state is there, continues from it
    (the weights, optimiser, schedule, random generator and running sums, so the result is the one of an
    uninterrupted run); cleared at the end. ``device``: where the steps run (the batches are collated on the
    CPU and moved there; ``drafter`` ends on the device it came on). Returns ``epoch_loss``,
    ``epoch_acceptance`` ([epoch][G] mean c* per slot on the training blocks), ``step_loss``, ``steps``,
    ``blocks`` (per epoch), ``resumed_at`` (the steps a run continued from) and ``train_s`` (seconds of
    training, in all runs)."""
    with on_device(drafter, device) as dev:
        target = tuple(None if t is None else t.to(dev) for t in (lm_w, lm_b, embed_w))
        loop = _Loop(drafter, samples, feats, target, gamma=gamma, mask_token_id=mask_token_id,
                     anchors_per_seq=anchors_per_seq, batch_size=batch_size, loss_w=loss_w, grad_clip=grad_clip,
                     mixed=train_dtype == "bfloat16", progress=progress, log=log, state=state)
        return loop.run(epochs, lr, warmup, weight_decay, slot_weights(gamma, loss_decay).to(dev), seed)


class _Loop:
    """One call of ``train_drafter``: the data and settings, and the optimiser, schedule, generator and
    running figures of the run (``run`` sets them up, possibly from a saved state)."""

    def __init__(self, drafter, samples, feats, target, *, gamma, mask_token_id, anchors_per_seq, batch_size, loss_w,
                 grad_clip, mixed, progress, log, state):
        self.drafter, self.samples, self.feats, self.target = drafter, samples, feats, target
        self.gamma, self.mask_token_id, self.anchors_per_seq = gamma, mask_token_id, anchors_per_seq
        self.batch_size, self.loss_w, self.grad_clip = batch_size, loss_w, grad_clip
        self.mixed, self.progress, self.log, self.state = mixed, progress, log, state
        self.usable = [i for i, s in enumerate(samples) if anchor_range(s)[1] > anchor_range(s)[0]]
        if not self.usable:
            raise DataError("no training blocks: every response is shorter than 2 tokens")
        self.steps_per_epoch = -(-len(self.usable) // batch_size)
        # what the run has done: saved with its state, restored when it continues
        self.done = {"epoch_loss": [], "epoch_acc": [], "step_loss": [], "blocks": [], "resumed_at": []}
        self.first_ep, self.first_step, self.before_s, self.saved = 0, 0, 0.0, None

    def run(self, epochs, lr, warmup, weight_decay, sw, seed) -> dict:
        total = self.steps_per_epoch * epochs
        self.params, self.opt, self.sched = adamw_cosine(self.drafter, lr, weight_decay, warmup, total)
        self.sw, self.epochs = sw, epochs
        self.gen = torch.Generator().manual_seed(seed)
        self.t0 = time.perf_counter()
        if self.state is not None and (saved := self.state.load_loop(self.drafter, self.opt, self.sched, self.gen,
                                                                      self.steps_per_epoch)) is not None:
            self._resume(saved)
        self.drafter.train()
        for ep in range(self.first_ep, epochs):
            self._epoch(ep)
        self.drafter.eval()
        if self.state is not None:
            self.state.clear()
        d = self.done
        return {"epoch_loss": d["epoch_loss"], "epoch_acceptance": d["epoch_acc"], "step_loss": d["step_loss"],
                "steps": total, "blocks": d["blocks"], "resumed_at": d["resumed_at"],
                "train_s": self.before_s + time.perf_counter() - self.t0, "train_s_before": self.before_s}

    def _resume(self, saved: dict) -> None:
        for k in ("epoch_loss", "epoch_acc", "step_loss", "blocks"):
            self.done[k] = saved[k]
        self.first_ep, self.first_step, self.before_s = saved["epoch"], saved["step"], saved["train_s"]
        self.done["resumed_at"] = saved["resumed_at"] + [self.first_ep * self.steps_per_epoch + self.first_step]
        self.saved = saved

    def _epoch(self, ep: int) -> None:
        G, d = self.gamma, self.done
        if self.saved is not None and ep == self.first_ep:
            order, sums = self.saved["order"], list(self.saved["sums"])
        else:
            order = [self.usable[j] for j in torch.randperm(len(self.usable), generator=self.gen).tolist()]
            sums = [0.0, torch.zeros(G, dtype=torch.float64), torch.zeros(G, dtype=torch.float64), 0]
        start = self.first_step if ep == self.first_ep else 0
        bar = progress_bar(self.steps_per_epoch, f"epoch {ep + 1}/{self.epochs}", self.progress, initial=start)
        for s in range(start, self.steps_per_epoch):
            lv = self._step(order[s * self.batch_size : (s + 1) * self.batch_size], sums)
            if bar:
                acc = (sums[1] / sums[2].clamp(min=1)).tolist()
                bar.set_postfix_str(f"loss {lv:.3f} acc " + "/".join(f"{x:.2f}" for x in acc), refresh=False)
                bar.update(1)
            if self.state is not None and self.state.due():
                self._save(ep, s + 1, order, sums)
        if bar:
            bar.close()
        tot, cs, cn, nb = sums
        d["epoch_loss"].append(tot / self.steps_per_epoch)
        d["epoch_acc"].append((cs / cn.clamp(min=1)).tolist())
        d["blocks"].append(nb)
        if self.log:
            self.log(f"epoch {ep + 1}/{self.epochs}: mean loss {d['epoch_loss'][-1]:.4f}, training acceptance "
                     "estimate per slot " + " ".join(f"{x:.3f}" for x in d["epoch_acc"][-1]))

    def _step(self, seqs: list[int], sums: list) -> float:
        """One optimiser step over ``anchors_per_seq`` random blocks of each of ``seqs``; adds to the
        epoch's running ``sums`` (loss, c* per slot, slot count, blocks) and returns the step's loss."""
        items = []
        for i in seqs:
            lo, hi = anchor_range(self.samples[i])
            perm = torch.randperm(hi - lo, generator=self.gen)[: self.anchors_per_seq]
            items.append((i, (lo + perm).sort().values))
        dev = self.sw.device
        batch = to_device(collate(items, self.samples, self.feats, self.gamma, self.mask_token_id,
                                  torch.bfloat16 if self.mixed else torch.float32), dev)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=self.mixed):
            out = block_outputs(self.drafter, batch, *self.target, self.sw, self.loss_w)
        self.opt.zero_grad(set_to_none=True)
        out["loss"].backward()
        if self.grad_clip:
            torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip)
        self.opt.step()
        self.sched.step()
        slot, cstar = out["slot"].cpu(), out["cstar"].double().cpu()
        sums[1].index_add_(0, slot, cstar)
        sums[2].index_add_(0, slot, torch.ones_like(cstar))
        sums[3] += sum(len(a) for _, a in items)
        lv = out["loss"].detach().item()
        self.done["step_loss"].append(lv)
        sums[0] += lv
        return lv

    def _save(self, ep: int, step: int, order: list[int], sums: list) -> None:
        d = self.done
        self.state.save_loop(self.drafter, self.opt, self.sched, self.gen, epoch=ep, step=step,
                             steps_per_epoch=self.steps_per_epoch, order=order, sums=tuple(sums),
                             epoch_loss=d["epoch_loss"], epoch_acc=d["epoch_acc"], step_loss=d["step_loss"],
                             blocks=d["blocks"], resumed_at=d["resumed_at"],
                             train_s=self.before_s + time.perf_counter() - self.t0)
