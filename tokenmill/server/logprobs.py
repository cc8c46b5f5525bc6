"""Logprobs in the shapes the API returns: the completions object (tokens, token_logprobs, top_logprobs,
text_offset), the chat content list (with each token's raw bytes) and vLLM's prompt_logprobs."""

from __future__ import annotations

import json
import math
import re

from tokenmill.outputs import Logprob

# JSON has no -Infinity: a token the model rules out entirely gets this floor, as vLLM reports it.
_FLOOR = -9999.0
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _value(lp: Logprob) -> float:
    return _FLOOR if math.isnan(lp.logprob) or lp.logprob < _FLOOR else lp.logprob


class TokenText:
    """A token's text as the API shows it (its own decoding, or `token_id:N` when asked for ids) and
    its raw bytes (a token that ends mid-character decodes to U+FFFD, but its bytes are what it holds)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._byte_level: dict[str, int] | None | bool = False  # False: not looked at yet

    def _byte_table(self) -> dict[str, int] | None:
        """For a byte-level vocabulary, the byte each of its characters stands for; else None."""
        if self._byte_level is False:
            decoder = json.loads(self.tokenizer.backend_tokenizer.to_str()).get("decoder") or {}
            kinds = {d.get("type") for d in decoder.get("decoders", [decoder])}
            self._byte_level = _byte_level_table() if "ByteLevel" in kinds else None
        return self._byte_level

    def text(self, token_id: int, lp: Logprob | None = None, as_id: bool = False) -> str:
        if as_id:
            return f"token_id:{token_id}"
        if lp is not None and lp.decoded_token is not None:
            return lp.decoded_token
        return self.tokenizer.decode([token_id])

    def raw_bytes(self, token_id: int) -> list[int]:
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if piece is None:
            return []
        table = self._byte_table()
        if table is not None and all(ch in table for ch in piece):
            return [table[ch] for ch in piece]
        byte = _BYTE_PIECE.fullmatch(piece)
        if byte:  # a byte-fallback piece of a SentencePiece vocabulary
            return [int(byte.group(1), 16)]
        return list(piece.replace("\u2581", " ").encode())


def _byte_level_table() -> dict[str, int]:
    """Byte-level BPE vocabularies (GPT-2's scheme) write each byte as one printable character: printable
    Latin-1 bytes as themselves, the others as the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    return table


def completion_logprobs(names: TokenText, token_ids: list[int], entries: list, num_top: int, offset: int,
                        as_ids: bool = False) -> dict:
    """The completions API's logprobs of tokens (prompt positions may be None: the first has no logprob).
    top_logprobs holds the token itself and the num_top most likely, keyed by text; where two tokens share
    a text the better ranked one keeps the key. text_offset counts characters from `offset`."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for t, d in zip(token_ids, entries):
        s = names.text(t, d.get(t) if d else None, as_ids)
        out["tokens"].append(s)
        out["text_offset"].append(offset)
        offset += len(s)
        if d is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(_value(d[t]))
        top: dict[str, float] = {}
        for tid, lp in sorted(d.items(), key=lambda kv: kv[1].rank):
            if tid == t or lp.rank <= num_top:
                top.setdefault(names.text(tid, lp, as_ids), _value(lp))
        out["top_logprobs"].append(top)
    return out


def chat_logprobs(names: TokenText, token_ids: list[int], entries: list, num_top: int, as_ids: bool = False) -> list:
    """The chat API's logprobs content: per token its text, logprob, raw bytes and a ranked list of the top."""
    def item(tid: int, lp: Logprob) -> dict:
        return {"token": names.text(tid, lp, as_ids), "logprob": _value(lp), "bytes": names.raw_bytes(tid)}

    content = []
    for t, d in zip(token_ids, entries):
        tops = sorted(((tid, lp) for tid, lp in d.items() if lp.rank <= num_top), key=lambda kv: kv[1].rank)
        content.append({**item(t, d[t]), "top_logprobs": [item(tid, lp) for tid, lp in tops]})
    return content


def prompt_logprobs(names: TokenText, entries: list | None) -> list | None:
    """vLLM's prompt_logprobs: per prompt position None (the first) or {token id: logprob, rank, text}."""
    if entries is None:
        return None
    return [None if d is None else {str(tid): {"logprob": _value(lp), "rank": lp.rank,
                                               "decoded_token": names.text(tid, lp)} for tid, lp in d.items()}
            for d in entries]
