"""Speculative decoding counters (vLLM names) and the mean acceptance length tau."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecMetrics:
    num_steps: int = 0  # verification forwards (one per running sequence per step)
    num_drafts: int = 0  # steps in which at least one token was drafted
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_emitted_tokens: int = 0  # accepted + recovered/bonus
    accepted_per_position: list = field(default_factory=list)
    drafted_per_position: list = field(default_factory=list)

    def record(self, num_drafted: int, num_accepted: int) -> None:
        self.num_steps += 1
        self.num_emitted_tokens += num_accepted + 1
        if num_drafted == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        while len(self.drafted_per_position) < num_drafted:
            self.drafted_per_position.append(0)
            self.accepted_per_position.append(0)
        for i in range(num_drafted):
            self.drafted_per_position[i] += 1
            self.accepted_per_position[i] += int(i < num_accepted)

    def as_dict(self) -> dict:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "num_verify_steps": self.num_steps,
            "mean_acceptance_length": self.num_emitted_tokens / self.num_steps if self.num_steps else 0.0,
            "acceptance_rate_per_position": [a / d if d else 0.0 for a, d in
                                             zip(self.accepted_per_position, self.drafted_per_position)],
        }
