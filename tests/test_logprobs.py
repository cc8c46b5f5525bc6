"""The completions API's logprobs object: tokens that decode to the same text, JSON-safe values."""

from __future__ import annotations

import json

from tokenmill.outputs import Logprob
from tokenmill.server.logprobs import TokenText, completion_logprobs


class _Tokenizer:
    """Tokens 1 and 2 both decode to U+FFFD (each half of one character); 3 is 'a'."""

    texts = {1: "\ufffd", 2: "\ufffd", 3: "a"}

    def decode(self, ids):
        return "".join(self.texts[i] for i in ids)


def test_tokens_sharing_a_text_keep_the_better_rank_and_ids_keep_both():
    names = TokenText(_Tokenizer())
    # Token 2 was chosen; 1 is ranked first, 2 second, 3 third; a -inf logprob must still be valid JSON.
    entry = {2: Logprob(-1.5, 2), 1: Logprob(-0.5, 1), 3: Logprob(float("-inf"), 3)}
    out = completion_logprobs(names, [2], [entry], 3, 0)
    assert out["tokens"] == ["\ufffd"] and out["token_logprobs"] == [-1.5]
    assert out["top_logprobs"] == [{"\ufffd": -0.5, "a": -9999.0}]
    json.dumps(out, allow_nan=False)
    ids = completion_logprobs(names, [2], [entry], 3, 0, as_ids=True)
    assert ids["tokens"] == ["token_id:2"]
    assert ids["top_logprobs"] == [{"token_id:1": -0.5, "token_id:2": -1.5, "token_id:3": -9999.0}]
