"""A request in flight: prompt ids, sampling params, its own generator, output tokens, incremental
detokenization and stop checks."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from specserve.config import SamplingParams


class Status(enum.Enum):
    WAITING = 0
    RUNNING = 1
    FINISHED = 2


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    cumulative_logprob: float | None = None

    def __repr__(self) -> str:
        return (f"CompletionOutput(text={self.text!r}, token_ids=<{len(self.token_ids)} ids>, "
                f"finish_reason={self.finish_reason!r})")


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    metrics: dict = field(default_factory=dict)


class Sequence:
    def __init__(self, seq_id: int, prompt: str | None, prompt_ids: list[int], params: SamplingParams,
                 seed: int, tokenizer, eos_ids: list[int], max_model_len: int):
        self.seq_id = seq_id
        self.prompt = prompt
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.seed = seed  # coupled sampling's key (``sample.coupled``)
        self.generator = torch.Generator().manual_seed(seed)  # the rejection sampler's stream
        self.tokenizer = tokenizer
        self.eos_ids = set(eos_ids)
        self.max_model_len = max_model_len
        self.output_ids: list[int] = []
        self.num_computed = 0  # tokens whose K/V are in the cache
        self.status = Status.WAITING
        self.finish_reason: str | None = None
        self.stop_reason = None
        self.slot = -1
        self.text = ""
        self._ctx = self.prompt_ids[-5:]  # a few prompt tokens so the first output token decodes right
        self._prefix = 0
        self._read = len(self._ctx)
        self._max_stop = max((len(s) for s in params.stop), default=0)
        # params.logprobs set: per output token (its target logprob, [(id, logprob)] of the top alternatives)
        self.logprobs: list[tuple[float, list[tuple[int, float]]]] | None = (
            [] if params.logprobs is not None else None)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.status == Status.FINISHED

    def append_tokens(self, ids: list[int]) -> int:
        """Append tokens one by one, stopping at the first stop condition. Returns how many were kept."""
        kept = 0
        for t in ids:
            if self.finished:
                break
            self.output_ids.append(int(t))
            kept += 1
            self._check_stop(int(t))
        return kept

    def record_logprobs(self, logits: torch.Tensor, tokens: list[int]) -> None:
        """``tokens[j]`` was emitted from the target's raw ``logits[j]`` [n, V]: keep its log-probability
        (log-softmax of the target's logits, whatever the sampling settings) and the top alternatives, equal
        values in token id order (as greedy decoding's argmax takes the first)."""
        lp = torch.log_softmax(logits.float(), dim=-1)
        chosen = lp.gather(1, torch.tensor(tokens, dtype=torch.long, device=lp.device).view(-1, 1))[:, 0].tolist()
        k = self.params.logprobs or 0
        for j, v in enumerate(chosen):
            self.logprobs.append((v, top_alternatives(lp[j], k) if k else []))

    def _finish(self, reason: str, stop_reason=None) -> None:
        if not isinstance(stop_reason, str):  # flush bytes held back for an incomplete character
            ids = self._ctx + self.output_ids
            if self._read < len(ids):
                skip = self.params.skip_special_tokens
                prefix_text = self.tokenizer.decode(ids[self._prefix : self._read], skip)
                self.text += self.tokenizer.decode(ids[self._prefix :], skip)[len(prefix_text) :]
                self._read = len(ids)
        self.status = Status.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason

    def _check_stop(self, t: int) -> None:
        p = self.params
        self._detok()
        if not p.ignore_eos and t in self.eos_ids:
            return self._finish("stop")
        if t in p.stop_token_ids:
            return self._finish("stop", t)
        if p.stop:
            start = max(0, len(self.text) - self._max_stop - 16)
            for s in p.stop:
                i = self.text.find(s, start)
                if i >= 0:
                    self.text = self.text[: i + len(s)] if p.include_stop_str_in_output else self.text[:i]
                    return self._finish("stop", s)
        if p.max_tokens is not None and len(self.output_ids) >= p.max_tokens:
            return self._finish("length")
        if len(self) >= self.max_model_len:
            return self._finish("length")

    def _detok(self) -> None:
        skip = self.params.skip_special_tokens
        ids = self._ctx + self.output_ids
        prefix_text = self.tokenizer.decode(ids[self._prefix : self._read], skip)
        new_text = self.tokenizer.decode(ids[self._prefix :], skip)
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self.text += new_text[len(prefix_text) :]
            self._prefix, self._read = self._read, len(ids)

    def stream_text(self) -> str:
        """Text safe to show now: holds back what could still turn out to be part of a stop string."""
        if self.finished or not self._max_stop:
            return self.text
        return self.text[: max(0, len(self.text) - self._max_stop + 1)]

    def to_output(self) -> RequestOutput:
        comp = CompletionOutput(0, self.text, list(self.output_ids), self.finish_reason, self.stop_reason)
        return RequestOutput(str(self.seq_id), self.prompt, list(self.prompt_ids), [comp], self.finished)


def top_alternatives(lp: torch.Tensor, k: int) -> list[tuple[int, float]]:
    """The ``k`` largest entries of ``lp`` [V] as (token id, value), largest first, equal values in id
    order (``topk`` orders ties as it likes: a tie for the first place would name another token than
    the one greedy decoding emitted)."""
    cut = lp.topk(k).values[-1]
    ids = (lp >= cut).nonzero()[:, 0]  # every entry tied with the k-th too, in id order
    order = torch.sort(lp[ids], descending=True, stable=True).indices[:k]
    return list(zip(ids[order].tolist(), lp[ids[order]].tolist()))
