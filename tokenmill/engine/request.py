"""Request: the token ids of one sequence and how far its KV cache has caught up."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from tokenmill.outputs import Logprob, RequestMetrics
from tokenmill.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # this request alone failed (its output could not be made)

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED,
                        RequestStatus.FINISHED_ERROR)


@dataclass(slots=True, eq=False)
class Request:
    """One sequence to generate (a parent request with n > 1 becomes n of these)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int  # resolved against the model's context length
    parent_id: str = ""
    index: int = 0  # which of the parent's n completions
    arrival_time: float = field(default_factory=time.time)
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prompt tokens served from the prefix cache at first scheduling; -1 before
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list = field(default_factory=list)  # of full blocks, filled by the KV cache manager
    num_cached_blocks: int = 0  # leading blocks already registered in the prefix cache
    stop_reason: int | str | None = None
    generator: torch.Generator | None = None
    # Sampled-token logprobs and the prompt's, accumulated for the output.
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    prompt_logprobs: list = field(default_factory=list)
    metrics: RequestMetrics | None = None
    num_preemptions: int = 0
    grammar: object | None = None  # a structured.GrammarMatcher: where the output stands in its constraint
    # Speculative decoding: tokens proposed to follow this request's last one, for the next step to verify;
    # how many to propose (spec.proposer.AdaptiveDraft); what its drafts proposed and what was accepted.
    spec_token_ids: list[int] = field(default_factory=list)
    spec_draft: object | None = None
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    def __post_init__(self) -> None:
        if self.metrics is None:
            self.metrics = RequestMetrics(arrival_time=self.arrival_time)
        if not self.parent_id:
            self.parent_id = self.request_id
        seed = self.sampling_params.seed
        if seed is not None:
            # Each completion of a seeded request gets its own stream, independent of batch companions.
            self.generator = torch.Generator().manual_seed((seed + self.index) % (2**64))

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def token_ids(self, start: int, end: int) -> list[int]:
        """Token ids in [start, end) over prompt + output."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n:end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - n]

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None
