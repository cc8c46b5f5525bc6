"""Counters of proposed and accepted speculative tokens, named as vLLM names its metrics."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SpecStats:
    num_drafts: int = 0  # verification passes of a request with at least one proposed token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # [i]: drafts whose token at position i (0-based) was accepted
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def record(self, proposed: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        if len(self.num_accepted_tokens_per_pos) < proposed:
            self.num_accepted_tokens_per_pos.extend([0] * (proposed - len(self.num_accepted_tokens_per_pos)))
        for i in range(accepted):
            self.num_accepted_tokens_per_pos[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens each verification pass produced on average: the accepted ones plus the target's own."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def as_dict(self) -> dict:
        return {"spec_decode_num_drafts": self.num_drafts, "spec_decode_num_draft_tokens": self.num_draft_tokens,
                "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
                "spec_decode_num_accepted_tokens_per_pos": list(self.num_accepted_tokens_per_pos)}

    def describe(self) -> str:
        return (f"speculation: acceptance {100 * self.acceptance_rate:.1f}%, mean accepted length "
                f"{self.mean_accepted_length:.2f}, {self.num_drafts} drafts")
