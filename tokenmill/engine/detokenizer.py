"""Incremental detokenization and stop strings.

Text grows by whole characters only (a multi-byte UTF-8 character split across byte-fallback tokens
appears once complete). While a request runs, the last len(longest stop string) - 1 characters are
held back, so a stop string never shows in streamed text and streamed deltas always add up to the
final text.
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

from tokenmill.sampling_params import SamplingParams

# Prompt tokens fed as context so the first output token decodes with the right leading space.
_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer  # a tokenizers.Tokenizer
        self.stream = DecodeStream(ids=list(prompt_token_ids[-_CONTEXT_TOKENS:]),
                                   skip_special_tokens=params.skip_special_tokens)
        self.stop = params.stop
        self.include_stop = params.include_stop_str_in_output
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""
        self.finished = False

    def add(self, token_id: int) -> str | None:
        """Append one token; returns the stop string if it completed one."""
        piece = self.stream.step(self.tokenizer, token_id)
        if not piece:
            return None
        old_len = len(self.text)
        self.text += piece
        if not self.stop:
            return None
        # Only a match that ends in the new piece is new; earlier ones were checked already.
        search_from = max(0, old_len - self.holdback)
        best = None
        for s in self.stop:
            i = self.text.find(s, search_from)
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        i, s = best
        self.text = self.text[: i + len(s)] if self.include_stop else self.text[:i]
        return s

    def visible_text(self, finished: bool) -> str:
        """The text to show now: all of it at the end, else all but the held-back tail."""
        if finished or not self.holdback:
            return self.text
        return self.text[: max(0, len(self.text) - self.holdback)]
