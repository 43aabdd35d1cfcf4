"""Speculative decoding counters (vLLM names), the mean acceptance length tau, and where drafts fail
first: ``first_rejected_per_position[i]`` counts the steps whose first rejected draft was draft i + 1
(a step that accepts all its drafts counts in none; a tree step's drafts are its accepted path's depth)."""

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
    first_rejected_per_position: list = field(default_factory=list)

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
            self.first_rejected_per_position.append(0)
        for i in range(num_drafted):
            self.drafted_per_position[i] += 1
            self.accepted_per_position[i] += int(i < num_accepted)
        if num_accepted < num_drafted:
            self.first_rejected_per_position[num_accepted] += 1

    def merge(self, other: "SpecMetrics") -> None:
        """Add ``other``'s counts to these (e.g. one request's metrics into a run's)."""
        for name in ("num_steps", "num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_emitted_tokens"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for name in ("accepted_per_position", "drafted_per_position", "first_rejected_per_position"):
            mine, theirs = getattr(self, name), getattr(other, name)
            mine.extend([0] * (len(theirs) - len(mine)))
            for i, v in enumerate(theirs):
                mine[i] += v

    def as_dict(self) -> dict:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "num_verify_steps": self.num_steps,
            "mean_acceptance_length": self.num_emitted_tokens / self.num_steps if self.num_steps else 0.0,
            "acceptance_rate_per_position": [a / d if d else 0.0 for a, d in
                                             zip(self.accepted_per_position, self.drafted_per_position)],
            "first_rejected_per_position": list(self.first_rejected_per_position),
        }
