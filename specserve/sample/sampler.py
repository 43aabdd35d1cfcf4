"""Token sampling: greedy, temperature, top-k, top-p, min-p, with one ``torch.Generator`` per request
so that a seeded request samples the same tokens whatever else is in the batch.

Sampling draws by the exponential race ``argmax(p / E)``, ``E ~ Exp(1)`` from the row's own
generator: an exact sample of ``p`` with no host sync and no cumulative sums."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.config import SamplingParams


@dataclass
class SamplingBatch:
    """The sampling parameters of a batch of rows, as tensors."""

    params: list[SamplingParams]
    generators: list[torch.Generator]
    temperature: torch.Tensor  # [N] (greedy rows hold 1.0)
    top_k: torch.Tensor  # [N] long, 0 = off
    top_p: torch.Tensor  # [N]
    min_p: torch.Tensor  # [N]
    greedy: torch.Tensor  # [N] bool
    all_greedy: bool
    need_top_k: bool
    need_top_p: bool
    need_min_p: bool

    @classmethod
    def build(cls, params: list[SamplingParams], generators: list[torch.Generator], device="cpu") -> "SamplingBatch":
        greedy = [p.greedy for p in params]
        return cls(
            params=params,
            generators=generators,
            temperature=torch.tensor([1.0 if g else p.temperature for p, g in zip(params, greedy)], device=device),
            top_k=torch.tensor([max(p.top_k, 0) for p in params], dtype=torch.long, device=device),
            top_p=torch.tensor([p.top_p for p in params], device=device),
            min_p=torch.tensor([p.min_p for p in params], device=device),
            greedy=torch.tensor(greedy, device=device),
            all_greedy=all(greedy),
            need_top_k=any(p.top_k > 0 for p in params),
            need_top_p=any(p.top_p < 1.0 for p in params),
            need_min_p=any(p.min_p > 0 for p in params),
        )

    def subset(self, rows: list[int]) -> "SamplingBatch":
        return SamplingBatch.build([self.params[i] for i in rows], [self.generators[i] for i in rows],
                                   self.temperature.device)

    def repeat(self, counts: list[int]) -> "SamplingBatch":
        """One row per position: row i repeated counts[i] times (generators shared)."""
        idx = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts, dtype=torch.long))
        il = idx.tolist()
        return SamplingBatch(
            params=[self.params[i] for i in il], generators=[self.generators[i] for i in il],
            temperature=self.temperature[idx], top_k=self.top_k[idx], top_p=self.top_p[idx], min_p=self.min_p[idx],
            greedy=self.greedy[idx], all_greedy=self.all_greedy, need_top_k=self.need_top_k,
            need_top_p=self.need_top_p, need_min_p=self.need_min_p,
        )


def filtered_logits(logits: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p as -inf masks. logits [N, V] float32 -> [N, V]."""
    logits = logits / sb.temperature.unsqueeze(-1)
    if sb.need_top_k or sb.need_top_p:
        sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
        V = logits.shape[-1]
        remove = torch.zeros_like(sorted_logits, dtype=torch.bool)
        if sb.need_top_k:
            k = torch.where(sb.top_k > 0, sb.top_k.clamp(max=V), V)
            remove |= torch.arange(V, device=logits.device).unsqueeze(0) >= k.unsqueeze(-1)
        if sb.need_top_p:
            probs = sorted_logits.masked_fill(remove, float("-inf")).softmax(-1)
            before = probs.cumsum(-1) - probs  # mass strictly before each token
            # only rows that asked for top-p: float rounding of the cumsum must not touch the others
            remove |= (before >= sb.top_p.unsqueeze(-1)) & (sb.top_p < 1.0).unsqueeze(-1)
            remove[:, 0] = False
        logits = logits.scatter(-1, sorted_idx, sorted_logits.masked_fill(remove, float("-inf")))
    if sb.need_min_p:
        probs = logits.softmax(-1)
        thresh = probs.max(-1, keepdim=True).values * sb.min_p.unsqueeze(-1)
        logits = logits.masked_fill(probs < thresh, float("-inf"))
    return logits


def target_probs(logits: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
    """The distribution plain sampling draws from (one-hot argmax for greedy rows)."""
    probs = filtered_logits(logits.float(), sb).softmax(-1)
    if sb.greedy.any():
        onehot = torch.zeros_like(probs).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
        probs = torch.where(sb.greedy.unsqueeze(-1), onehot, probs)
    return probs


def exponential_noise(shape_v: int, generators: list[torch.Generator], device="cpu") -> torch.Tensor:
    """[N, V] of Exp(1), row i drawn from generators[i] (on the generator's own device)."""
    rows = [torch.empty(shape_v, device=g.device).exponential_(generator=g) for g in generators]
    return torch.stack(rows).to(device)


def sample(logits: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
    """logits [N, V] -> token ids [N] (long)."""
    greedy_tokens = logits.argmax(-1)
    if sb.all_greedy:
        return greedy_tokens
    rows = [i for i, g in enumerate(sb.greedy.tolist()) if not g]  # greedy rows draw no randomness
    probs = filtered_logits(logits[rows].float(), sb.subset(rows)).softmax(-1)
    noise = exponential_noise(probs.shape[-1], [sb.generators[i] for i in rows], probs.device)
    out = greedy_tokens.clone()
    out[rows] = (probs / noise).argmax(-1)
    return out
