"""Constrained decoding through xgrammar: grammars compiled once per constraint (an LRU cache), one
matcher per sequence, and the batch's token bitmask applied to the logits before sampling."""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import OrderedDict

import torch

from tokenmill.structured.params import StructuredOutputsParams

logger = logging.getLogger("tokenmill")

CACHE_SIZE = 256  # compiled grammars kept


class GrammarMatcher:
    """Where one sequence stands in its grammar."""

    __slots__ = ("_m",)

    def __init__(self, compiled) -> None:
        import xgrammar as xgr

        self._m = xgr.GrammarMatcher(compiled)

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into row `row` of a batch bitmask."""
        self._m.fill_next_token_bitmask(bitmask, row)

    def accept(self, token: int) -> bool:
        return self._m.accept_token(token)

    def rollback(self, n: int) -> None:
        """Forget the last n accepted tokens (rejected speculative tokens)."""
        self._m.rollback(n)

    @property
    def is_terminated(self) -> bool:
        return self._m.is_terminated()


class Grammars:
    """Compiles constraints for one tokenizer and vocabulary. compile() may run on any thread; the server
    runs it off the engine thread, so a large schema does not hold up the batch."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: tuple[int, ...]) -> None:
        try:
            import xgrammar as xgr
        except ImportError as e:
            raise ValueError(f"structured outputs need the xgrammar package, which does not import here ({e})") \
                from None

        self.vocab_size = vocab_size
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=list(stop_token_ids) or None)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=2, cache_enabled=False)
        self._cache: OrderedDict[tuple, object] = OrderedDict()
        self._lock = threading.Lock()
        self.compile_seconds: list[float] = []  # for benchmarks and logs

    def compile(self, spec: StructuredOutputsParams):
        """The compiled grammar of a constraint (cached by its key); ValueError if it is not valid."""
        key = spec.key
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        start = time.perf_counter()
        try:
            compiled = self._compile(spec)
        except (RuntimeError, ValueError, TypeError) as e:
            raise ValueError(f"invalid {spec._field(spec.kind)}: {_first_line(e)}") from None
        elapsed = time.perf_counter() - start
        self.compile_seconds.append(elapsed)
        if elapsed > 0.5:
            logger.info("compiled a %s constraint in %.2f s", spec.kind, elapsed)
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, spec: StructuredOutputsParams):
        import xgrammar as xgr

        kind = spec.kind
        if kind == "json":
            return self.compiler.compile_json_schema(spec.json, any_whitespace=spec.any_whitespace,
                                                     strict_mode=spec.strict)
        if kind == "json_object":
            if spec.any_whitespace:
                return self.compiler.compile_builtin_json_grammar()
            return self.compiler.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
        if kind == "regex":
            return self.compiler.compile_regex(spec.regex)
        if kind == "choice":
            return self.compiler.compile_grammar(choice_grammar(spec.choice))
        if kind == "grammar":
            return self.compiler.compile_grammar(spec.grammar)
        if kind == "structural_tag":
            return self.compiler.compile_structural_tag(spec.structural_tag)
        raise ValueError(f"unknown constraint {kind}")

    def matcher(self, spec: StructuredOutputsParams) -> GrammarMatcher:
        return GrammarMatcher(self.compile(spec))



def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    import xgrammar as xgr

    return xgr.allocate_token_bitmask(rows, vocab_size)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Set the logits of tokens the rows' grammars forbid to -inf, in place (float32, CPU or GPU)."""
    import xgrammar as xgr

    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=rows)


def choice_grammar(choices) -> str:
    """EBNF for exactly one of the strings."""
    import json

    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


def _first_line(e: BaseException) -> str:
    """xgrammar's message without its time stamp and source location."""
    text = str(e).strip() or type(e).__name__
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", text.splitlines()[0])[:500]
