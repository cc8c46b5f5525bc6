"""Structured outputs: constrain what a request generates (JSON schema, regex, choice, grammar)."""

from tokenmill.structured.params import GuidedDecodingParams, StructuredOutputsParams

__all__ = ["StructuredOutputsParams", "GuidedDecodingParams"]
