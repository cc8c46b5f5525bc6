"""What a request's output must match: a JSON schema, any JSON object, a regex, one of several strings, or a
grammar. Named as vLLM names them (StructuredOutputsParams; GuidedDecodingParams is the older name)."""

from __future__ import annotations

import json
from dataclasses import dataclass

MAX_SPEC_BYTES = 64 * 1024  # a schema, regex or grammar larger than this is refused
MAX_CHOICES = 1024

KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


@dataclass(frozen=True, slots=True)
class StructuredOutputsParams:
    """Exactly one of the constraints. json: a JSON schema (a dict or its JSON text); json_object: any JSON
    object; regex; choice: a list of strings; grammar: EBNF (GBNF-style rules, `root ::= ...`);
    structural_tag: xgrammar's structural tag JSON (free text, constrained after trigger strings).

    strict (JSON schemas): properties the schema does not name are not generated, as OpenAI's strict mode
    promises; False lets additionalProperties default to the schema's own word. Whitespace in JSON is
    compact unless any_whitespace (small models may otherwise write whitespace until max_tokens)."""

    json: str | dict | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None
    structural_tag: str | dict | None = None
    strict: bool = True
    any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured outputs take exactly one of json, json_object, regex, choice, grammar, "
                             f"structural_tag; got {', '.join(given) or 'none'}")
        kind = given[0]
        if kind in ("json", "structural_tag"):
            value = getattr(self, kind)
            if isinstance(value, str):
                try:
                    parsed = json.loads(value)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{self._field(kind)} is not valid JSON: {e}") from None
            else:
                parsed = value
            if not isinstance(parsed, dict) and not (kind == "json" and isinstance(parsed, bool)):
                raise ValueError(f"{self._field(kind)} must be a JSON object")
            object.__setattr__(self, kind, json.dumps(parsed, sort_keys=False, separators=(",", ":")))
        if kind == "choice":
            choices = self.choice
            if isinstance(choices, str) or not isinstance(choices, (list, tuple)) or not choices or \
                    not all(isinstance(c, str) for c in choices):
                raise ValueError("choice must be a non-empty list of strings")
            if len(choices) > MAX_CHOICES:
                raise ValueError(f"choice may hold at most {MAX_CHOICES} strings, got {len(choices)}")
            object.__setattr__(self, "choice", tuple(choices))
        if kind in ("regex", "grammar") and (not isinstance(getattr(self, kind), str) or not getattr(self, kind)):
            raise ValueError(f"{self._field(kind)} must be a non-empty string")
        if len(self.text.encode()) > MAX_SPEC_BYTES:
            raise ValueError(f"{self._field(kind)} is {len(self.text.encode())} bytes, over the limit of "
                             f"{MAX_SPEC_BYTES}")

    @staticmethod
    def _field(kind: str) -> str:
        return {"json": "JSON schema", "json_object": "JSON object", "structural_tag": "structural tag"}.get(kind, kind)

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def text(self) -> str:
        """The constraint as one string (for sizes and cache keys)."""
        kind = self.kind
        if kind == "json_object":
            return ""
        if kind == "choice":
            return json.dumps(list(self.choice))
        return getattr(self, kind)

    @property
    def key(self) -> tuple:
        """What identifies the compiled grammar: equal keys share one compilation."""
        return (self.kind, self.text, self.strict, self.any_whitespace)

    @classmethod
    def coerce(cls, value) -> "StructuredOutputsParams | None":
        """From a StructuredOutputsParams, a dict of its fields, or None."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, dict):
            unknown = sorted(set(value) - set(cls.__dataclass_fields__))
            if unknown:
                raise ValueError(f"structured_outputs: unknown field(s) {', '.join(unknown)}")
            return cls(**value)
        raise ValueError(f"structured_outputs must be a StructuredOutputsParams or a dict, got {type(value).__name__}")


GuidedDecodingParams = StructuredOutputsParams  # the older name
