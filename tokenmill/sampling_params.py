"""SamplingParams: how one request's tokens are chosen and when it stops."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from tokenmill.structured.params import StructuredOutputsParams

# Bounds that keep one request from exhausting the server; generous for offline use.
MAX_N = 128
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_LEN = 256


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


class RequestOutputKind(enum.Enum):
    """What a request's consumer reads: its state after every step (streaming), or only its end."""

    CUMULATIVE = 0
    FINAL_ONLY = 2


@dataclass(slots=True)
class SamplingParams:
    """Per-request sampling and stopping parameters, validated on construction."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the model's context length
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # number of top logprobs per generated token (0: only the chosen one)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    cache_salt: str | None = None
    # What the output must match (a JSON schema, regex, choice, grammar): tokenmill.structured. A dict of
    # StructuredOutputsParams' fields is taken too; guided_decoding is the older name.
    structured_outputs: StructuredOutputsParams | dict | None = None
    guided_decoding: StructuredOutputsParams | dict | None = None
    # FINAL_ONLY: nobody reads the request's outputs before it ends, so its tokens need not be handed on one
    # step at a time, and the engine may run decode steps back to back for it.
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # Filled by the engine from the tokenizer / generation_config, not by users.
    _eos_token_ids: tuple[int, ...] = field(default=(), repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if self.guided_decoding is not None:
            if self.structured_outputs is not None:
                raise ValueError("give structured_outputs or guided_decoding (its older name), not both")
            self.structured_outputs, self.guided_decoding = self.guided_decoding, None
        self.structured_outputs = StructuredOutputsParams.coerce(self.structured_outputs)
        self._validate()

    def _validate(self) -> None:
        _check(isinstance(self.n, int) and 1 <= self.n <= MAX_N, f"n must be an integer in [1, {MAX_N}], got {self.n}")
        _check(0.0 <= self.temperature, f"temperature must be >= 0, got {self.temperature}")
        _check(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}")
        _check(isinstance(self.top_k, int) and self.top_k >= 0,
               f"top_k must be 0 or -1 (disabled) or a positive integer, got {self.top_k}")
        _check(0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}")
        _check(0.0 < self.repetition_penalty <= 10.0,
               f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}")
        _check(-2.0 <= self.presence_penalty <= 2.0,
               f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        _check(-2.0 <= self.frequency_penalty <= 2.0,
               f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.max_tokens is not None:
            _check(isinstance(self.max_tokens, int) and self.max_tokens >= 1,
                   f"max_tokens must be at least 1, got {self.max_tokens}")
        _check(isinstance(self.min_tokens, int) and self.min_tokens >= 0,
               f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None:
            _check(self.min_tokens <= self.max_tokens,
                   f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        if self.seed is not None:
            _check(isinstance(self.seed, int) and -(2**63) <= self.seed < 2**64,
                   f"seed must be a 64-bit integer, got {self.seed}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check(isinstance(value, int) and 0 <= value <= MAX_LOGPROBS,
                       f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {value}")
        _check(len(self.stop) <= MAX_STOP_STRINGS, f"stop may hold at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        for s in self.stop:
            _check(isinstance(s, str) and 0 < len(s) <= MAX_STOP_STRING_LEN,
                   f"each stop string must have 1 to {MAX_STOP_STRING_LEN} characters, got {s!r}")
        for t in self.stop_token_ids:
            _check(isinstance(t, int) and t >= 0, f"stop_token_ids must be non-negative integers, got {t}")
        if self.logit_bias:
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            for k, v in self.logit_bias.items():
                _check(k >= 0, f"logit_bias keys must be non-negative token ids, got {k}")
                _check(-100.0 <= v <= 100.0, f"logit_bias values must be in [-100, 100], got {v}")

    def validate_for_vocab(self, vocab_size: int) -> None:
        """Check token ids named by the request against the model's vocabulary."""
        for t in self.stop_token_ids:
            _check(t < vocab_size, f"stop_token_ids must be < vocab size {vocab_size}, got {t}")
        for t in (self.logit_bias or {}):
            _check(t < vocab_size, f"logit_bias token ids must be < vocab size {vocab_size}, got {t}")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def ending_token_ids(self) -> list[int]:
        """Tokens that end the request once min_tokens are out: stop_token_ids, and EOS unless ignore_eos."""
        return list(self.stop_token_ids) + ([] if self.ignore_eos else list(self._eos_token_ids))

    @property
    def needs_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def clone(self, **changes) -> "SamplingParams":
        """A copy with some fields replaced (validated again)."""
        values = {f: getattr(self, f) for f in self.__dataclass_fields__}
        values.update(changes)
        eos = values.pop("_eos_token_ids")
        sp = SamplingParams(**values)
        sp._eos_token_ids = eos
        return sp
