"""Speculative decoding: cheap proposals of a request's next tokens, verified by one pass of the target."""

from tokenmill.spec.config import SpeculativeConfig
from tokenmill.spec.stats import SpecStats

__all__ = ["SpeculativeConfig", "SpecStats"]
