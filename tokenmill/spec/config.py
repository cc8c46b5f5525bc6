"""speculative_config: which proposer, how many tokens it proposes, validated once at start."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

METHODS = ("ngram", "draft_model", "self")
MAX_SPECULATIVE_TOKENS = 16


@dataclass(slots=True)
class SpeculativeConfig:
    """method "ngram": proposals copied from the request's own tokens where its last few tokens occurred
    before (prompt lookup); "draft_model": a smaller model with the same vocabulary proposes them;
    "self": the target's own weights, quantized, are the draft."""

    method: str
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4  # ngram: the longest suffix looked up
    prompt_lookup_min: int = 2  # ngram: the shortest suffix that still counts as a match
    model: str | None = None  # draft_model: a path or known name
    quantization: str = "int4"  # self: how the target's weights are quantized for the draft

    @classmethod
    def parse(cls, value: "SpeculativeConfig | dict | str | None") -> "SpeculativeConfig | None":
        """From a dict (the Python API) or a JSON object (the command line); None stays None."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config must be a JSON object: {e}") from e
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict (a JSON object), got {value!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config has unknown keys {unknown}; known: {sorted(known)}")
        if "method" not in value:
            raise ValueError(f"speculative_config needs a method, one of {', '.join(METHODS)}")
        cfg = cls(**value)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config method must be one of {', '.join(METHODS)}, got {self.method!r}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be an integer from 1 to {MAX_SPECULATIVE_TOKENS}, "
                             f"got {k!r}")
        if self.method == "ngram":
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
                if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                    raise ValueError(f"{name} must be a positive integer, got {v!r}")
            if lo > hi:
                raise ValueError(f"prompt_lookup_min ({lo}) must not exceed prompt_lookup_max ({hi})")
        if self.method == "draft_model" and not self.model:
            raise ValueError('speculative_config method "draft_model" needs "model": a path or known name')
        if self.method == "self" and self.quantization not in ("int8", "int4", "int4-gptq"):
            raise ValueError('speculative_config method "self" quantizes to int8, int4 or int4-gptq, got '
                             f'{self.quantization!r}')

    def describe(self) -> str:
        extra = {"ngram": f", lookup {self.prompt_lookup_min}-{self.prompt_lookup_max} tokens",
                 "draft_model": f", draft {self.model}", "self": f", the target's weights in {self.quantization}"}
        return f"{self.method}, up to {self.num_speculative_tokens} tokens a step{extra[self.method]}"
