"""Whether speculation pays at the current batch size: the engine drafts while steps with drafts emit
tokens at least as fast as steps without, per batch size, and backs off to plain steps where a batch
makes verification (or drafting) cost more than the accepted drafts give. Measured online, so it
follows the machine, the drafter and the prompts; lossless (it only decides whether to draft)."""

from __future__ import annotations


class SpeculationGate:
    """Per batch size, exponentially weighted tokens per second of decoding steps with drafts and of
    steps without. A batch size drafts until both rates are known (its first steps measure each),
    then takes the faster choice, trying the other one step in ``probe_every`` so that both estimates
    stay current as prompts and machine load change."""

    def __init__(self, probe_every: int = 16, decay: float = 0.8, warmup: int = 2):
        if probe_every < 2 or not 0.0 < decay < 1.0 or warmup < 1:
            raise ValueError(f"need probe_every >= 2, decay in (0, 1), warmup >= 1; got {probe_every}, {decay}, "
                             f"{warmup}")
        self.probe_every, self.decay, self.warmup = probe_every, decay, warmup
        self._rate: dict[int, list[float | None]] = {}  # batch -> [plain rate, speculative rate]
        self._seen: dict[int, list[int]] = {}  # batch -> [plain steps, speculative steps]
        self._steps: dict[int, int] = {}

    def draft(self, batch: int) -> bool:
        """Whether this step of ``batch`` sequences drafts."""
        seen = self._seen.setdefault(batch, [0, 0])
        if seen[1] < self.warmup:
            return True
        if seen[0] < self.warmup:
            return False
        n = self._steps[batch] = self._steps.get(batch, 0) + 1
        plain, spec = self._rate[batch]
        best = spec >= plain
        return (not best) if n % self.probe_every == 0 else best

    def record(self, batch: int, drafted: bool, tokens: int, seconds: float) -> None:
        """A step of ``batch`` sequences (with drafts or not) emitted ``tokens`` in ``seconds``."""
        if seconds <= 0:
            return
        rate = tokens / seconds
        r = self._rate.setdefault(batch, [None, None])
        old = r[drafted]
        r[drafted] = rate if old is None else self.decay * old + (1 - self.decay) * rate
        self._seen.setdefault(batch, [0, 0])[drafted] += 1

    def rates(self, batch: int) -> tuple[float | None, float | None]:
        """(plain, speculative) tokens per second at ``batch`` (None: not measured yet)."""
        plain, spec = self._rate.get(batch, [None, None])
        return plain, spec
