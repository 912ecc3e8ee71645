"""Speculative-decoding counters, per request and per run."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    num_speculative_tokens: int
    num_verify_steps: int = 0
    num_drafted: int = 0
    num_accepted: int = 0
    accepted_per_position: list[int] = field(default_factory=list)   # [k]: drafts accepted at position j

    def __post_init__(self):
        if not self.accepted_per_position:
            self.accepted_per_position = [0] * self.num_speculative_tokens

    def record(self, num_drafts: int, num_accepted: int) -> None:
        self.num_verify_steps += 1
        self.num_drafted += num_drafts
        self.num_accepted += num_accepted
        for j in range(num_accepted):
            self.accepted_per_position[j] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_drafted if self.num_drafted else 0.0

    @property
    def acceptance_rate_per_position(self) -> list[float]:
        n = self.num_verify_steps
        return [a / n if n else 0.0 for a in self.accepted_per_position]

    @property
    def mean_accept_length(self) -> float:
        """Tokens emitted per verify step: accepted drafts plus the target's own token."""
        return 1 + self.num_accepted / self.num_verify_steps if self.num_verify_steps else 0.0

    def as_dict(self) -> dict:
        return {"num_speculative_tokens": self.num_speculative_tokens,
                "num_verify_steps": self.num_verify_steps, "num_drafted": self.num_drafted,
                "num_accepted": self.num_accepted, "acceptance_rate": self.acceptance_rate,
                "acceptance_rate_per_position": self.acceptance_rate_per_position,
                "mean_accept_length": self.mean_accept_length}
