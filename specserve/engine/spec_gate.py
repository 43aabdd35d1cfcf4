"""Whether speculation pays for the running batch: the engine drafts while steps with drafts emit tokens
at least as fast as steps without, per kind of batch (its size, and whether all its requests are greedy:
sampled requests accept fewer drafts), and backs off to plain steps where a batch makes verification (or
drafting) cost more than the accepted drafts give. Measured online, so it follows the machine, the
drafter and the prompts; lossless (it only decides whether to draft)."""

from __future__ import annotations

from collections.abc import Callable, Hashable


class SpeculationGate:
    """Per key (a kind of batch: the engine's ``LLMEngine.gate_key``), exponentially weighted tokens per
    second of decoding steps with drafts and of steps without. A key drafts until both rates are known
    (its first steps measure each), then takes the faster choice, trying the other one now and then so
    that both estimates stay current as prompts and machine load change: ``probe_every`` steps after
    the choice was made, then twice as long after each probe that leaves it standing, up to
    ``max_probe_every`` (a probe of drafting in a large batch verifies many tokens and can cost a few
    plain steps), back to ``probe_every`` when the choice flips. Keys for which ``keep_probing(key)``
    holds probe every ``probe_every`` steps throughout (the engine's single greedy requests: their text
    has stretches where drafting pays, which frequent probes find)."""

    def __init__(self, probe_every: int = 16, decay: float = 0.8, warmup: int = 2, max_probe_every: int = 256,
                 keep_probing: Callable[[Hashable], bool] = lambda key: False):
        if probe_every < 2 or not 0.0 < decay < 1.0 or warmup < 1 or max_probe_every < probe_every:
            raise ValueError(f"need probe_every >= 2, decay in (0, 1), warmup >= 1, max_probe_every >= "
                             f"probe_every; got {probe_every}, {decay}, {warmup}, {max_probe_every}")
        self.probe_every, self.decay, self.warmup = probe_every, decay, warmup
        self.max_probe_every, self.keep_probing = max_probe_every, keep_probing
        self._rate: dict[Hashable, list[float | None]] = {}  # key -> [plain rate, speculative rate]
        self._seen: dict[Hashable, list[int]] = {}  # key -> [plain steps, speculative steps]
        self._probe: dict[Hashable, list] = {}  # key -> [steps to the next probe, the interval, the choice]

    def draft(self, key: Hashable) -> bool:
        """Whether this step of a batch of kind ``key`` drafts."""
        seen = self._seen.setdefault(key, [0, 0])
        if seen[1] < self.warmup:
            return True
        if seen[0] < self.warmup:
            return False
        plain, spec = self._rate[key]
        best = spec >= plain
        p = self._probe.get(key)
        if p is None or p[2] != best:  # a new choice: probe the other one soon
            p = self._probe[key] = [self.probe_every, self.probe_every, best]
        p[0] -= 1
        if p[0] > 0:
            return best
        if not self.keep_probing(key):  # the next probe, if this one leaves the choice as it is
            p[1] = min(2 * p[1], self.max_probe_every)
        p[0] = p[1]
        return not best

    def record(self, key: Hashable, drafted: bool, tokens: int, seconds: float) -> None:
        """A step of a batch of kind ``key`` (with drafts or not) emitted ``tokens`` in ``seconds``."""
        if seconds <= 0:
            return
        rate = tokens / seconds
        r = self._rate.setdefault(key, [None, None])
        old = r[drafted]
        r[drafted] = rate if old is None else self.decay * old + (1 - self.decay) * rate
        self._seen.setdefault(key, [0, 0])[drafted] += 1

    def rates(self, key: Hashable) -> tuple[float | None, float | None]:
        """(plain, speculative) tokens per second for ``key`` (None: not measured yet)."""
        plain, spec = self._rate.get(key, [None, None])
        return plain, spec
