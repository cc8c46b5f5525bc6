"""Reasoning outputs: a model's thinking returned apart from its answer, as `reasoning_content` (and
`reasoning`, the newer name) next to `content`.

Models write it in one of two ways (PARSERS names them as vLLM does; "auto" reads the chat template):
- think tags (DeepSeek-R1, QwQ, Qwen3): `<think>reasoning</think>answer`. A chat template may open the
  tag in the prompt (DeepSeek-R1's does), so the output then starts inside it; a template that writes an
  empty `<think></think>` (Qwen3 with enable_thinking false) leaves the output outside.
- OpenAI's harmony format (gpt-oss): a reply is a run of messages, each `<|channel|>NAME<|message|>TEXT`
  ended by `<|end|>` (more follows, after `<|start|>assistant`), `<|return|>` or `<|call|>`. The
  analysis channel is reasoning, final is the answer, and a commentary message addressed
  `to=functions.NAME` is a call of that function with the message as its JSON arguments. Its markers
  are special tokens, so such requests are detokenized with them (skip_special_tokens off).

A parser turns a growing completion text into chat deltas as the tool-call StreamParser does:
{"reasoning_content": ...}, {"content": ...}, and (harmony) {"tool_calls": [...]}. `parse` gives the
whole message from the same parser, so streamed and whole answers cannot disagree.
"""

from __future__ import annotations

import json
import re
import uuid

PARSERS = ("auto", "none", "deepseek_r1", "qwen3", "openai_gptoss")

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, RETURN, CALL = "<|end|>", "<|return|>", "<|call|>"
# the tokens that end a harmony reply: it stops at them, whatever the file names as its EOS
HARMONY_STOPS = (RETURN, CALL)


def kind_for(template: str | None, parser: str | None) -> str | None:
    """"think", "harmony" or None (no reasoning parsed) for a server's --reasoning-parser and a chat template."""
    parser = parser or "auto"
    if parser not in PARSERS:
        raise ValueError(f"reasoning parser must be one of {', '.join(PARSERS)}, got {parser!r}")
    if parser == "none":
        return None
    if parser == "openai_gptoss":
        return "harmony"
    if parser in ("deepseek_r1", "qwen3"):
        return "think"
    t = template or ""
    if CHANNEL in t and MESSAGE in t:
        return "harmony"
    if THINK_OPEN in t and THINK_CLOSE in t:
        return "think"
    return None


def request_params(kind: str | None, params, tokenizer):
    """SamplingParams for a chat request whose output this kind of parser reads: a harmony reply keeps its
    markers (special tokens) in the text and stops at <|return|> or <|call|>."""
    if kind != "harmony":
        return params
    ids = [tokenizer.convert_tokens_to_ids(t) for t in HARMONY_STOPS]
    stops = [i for i, t in zip(ids, HARMONY_STOPS) if isinstance(i, int) and tokenizer.convert_ids_to_tokens(i) == t]
    return params.clone(skip_special_tokens=False, stop_token_ids=params.stop_token_ids + stops)


def after_thinking(spec, prompt: str):
    """An output constraint (StructuredOutputsParams) for a model that writes <think> tags: the reasoning is
    free text (opened by the prompt, or optional where the prompt leaves it to the model), and the
    constraint holds from the first non-blank character after </think>. None stays None, and so does a
    constraint that writes </think> itself (it covers the reasoning too) or one after a prompt that ends with
    </think>."""
    if spec is None or THINK_CLOSE in spec.text or prompt.rstrip().endswith(THINK_CLOSE):
        return spec  # (a prompt that closes the tag itself turned thinking off: Qwen3's enable_thinking false)
    from tokenmill.structured.backend import choice_grammar
    from tokenmill.structured.params import StructuredOutputsParams

    kind = spec.kind
    if kind in ("json", "json_object"):  # the same grammar as the constraint alone (its whitespace, strictness)
        import xgrammar as xgr

        if kind == "json_object" and spec.any_whitespace:
            grammar = xgr.Grammar.builtin_json_grammar()
        else:
            grammar = xgr.Grammar.from_json_schema(spec.text if kind == "json" else '{"type": "object"}',
                                                   any_whitespace=spec.any_whitespace,
                                                   strict_mode=spec.strict if kind == "json" else False)
        inner = {"type": "grammar", "grammar": str(grammar)}
    elif kind == "regex":
        inner = {"type": "regex", "pattern": spec.regex}
    elif kind in ("choice", "grammar"):
        inner = {"type": "grammar", "grammar": choice_grammar(spec.choice) if kind == "choice" else spec.grammar}
    else:
        tag = spec.structural_tag
        tag = json.loads(tag) if isinstance(tag, str) else tag
        if not isinstance(tag, dict) or "format" not in tag:
            return spec  # xgrammar's older tag form: left as it is
        inner = tag["format"]
    inside = _opened(prompt)
    think = {"type": "tag", "begin": "" if inside else THINK_OPEN, "content": {"type": "any_text"}, "end": THINK_CLOSE}
    if not inside:
        think = {"type": "optional", "content": think}
    # a few blanks between (Qwen3 writes two newlines), not as many as a small model would write
    body = {"type": "sequence", "elements": [think, {"type": "regex", "pattern": r"[ \t\r\n]{0,4}"}, inner]}
    try:
        return StructuredOutputsParams(structural_tag={"type": "structural_tag", "format": body})
    except ValueError:  # over the size limit as a grammar: the constraint holds from the first token, as before
        return spec


def new_parser(kind: str, prompt: str = ""):
    return HarmonyParser() if kind == "harmony" else ThinkParser.after(prompt)


def _opened(prompt: str) -> bool:
    """Whether the prompt ends inside a <think> it opened."""
    return prompt.rfind(THINK_OPEN) > prompt.rfind(THINK_CLOSE)


def partial_tail(text: str, markers: tuple[str, ...]) -> int:
    """How many characters at the end of text could begin one of the markers (held back while streaming)."""
    best = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:k]):
                best = k
                break
    return best


class ThinkParser:
    """`<think>...</think>` at the start of the output (or opened by the prompt) is reasoning; the rest,
    from its first non-blank character, is content."""

    calls = 0  # think tags carry no tool calls of their own

    def __init__(self, inside: bool = False) -> None:
        self.state = "inside" if inside else "start"  # start | inside | gap | content
        self.sent = 0

    @classmethod
    def after(cls, prompt: str) -> "ThinkParser":
        """A parser for the output that follows this prompt: inside a tag the prompt left open."""
        return cls(inside=_opened(prompt))

    def feed(self, text: str, final: bool = False) -> list[dict]:
        deltas: list[dict] = []
        while self.sent < len(text):
            rest = text[self.sent:]
            if self.state == "start":
                lead = len(rest) - len(rest.lstrip())
                body = rest[lead:]
                if body.startswith(THINK_OPEN):
                    self.sent += lead + len(THINK_OPEN)
                    self.state = "inside"
                elif not final and (not body or THINK_OPEN.startswith(body)):
                    break  # blank so far, or the tag half written: wait
                else:
                    self.state = "content"
            elif self.state == "inside":
                at = rest.find(THINK_CLOSE)
                upto = at if at >= 0 else len(rest) - (0 if final else partial_tail(rest, (THINK_CLOSE,)))
                if upto > 0:
                    deltas.append({"reasoning_content": rest[:upto]})
                self.sent += upto
                if at < 0:
                    break
                self.sent += len(THINK_CLOSE)
                self.state = "gap"
            elif self.state == "gap":  # the blank between the closing tag and the answer is dropped
                lead = len(rest) - len(rest.lstrip())
                self.sent += lead
                if lead < len(rest):
                    self.state = "content"
            else:
                deltas.append({"content": rest})
                self.sent = len(text)
        return deltas


_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_ENDS = (END, RETURN, CALL, START)  # what ends a message's text (START: a message begun without <|end|>)
_HEADS = ("<|", " to=")  # how a message's header can begin (the prompt may end with its role)


class HarmonyParser:
    """The messages of a harmony reply as chat deltas (module docstring)."""

    def __init__(self) -> None:
        self.sent = 0
        self.in_body = False
        self.route = "content"  # where the current message's text goes: content | reasoning_content | call
        self.calls = 0

    def _open(self, header: str) -> list[dict]:
        """Start a message from its header (role, channel, recipient, content type)."""
        header = header.replace(START, " ").replace(CONSTRAIN, " ")
        channel = header.split(CHANNEL, 1)[1].split()[0] if CHANNEL in header else ""
        match = _RECIPIENT.search(header)
        recipient = match.group(1) if match else None
        if recipient is not None and recipient.startswith("functions."):
            self.route = "call"
            return [{"tool_calls": [{"index": self.calls, "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                                     "function": {"name": recipient[len("functions."):], "arguments": ""}}]}]
        # the final channel (and commentary preambles) answer the user; analysis, and messages to tools
        # this server does not run, are the model's own working
        self.route = "content" if channel in ("final", "commentary") and recipient is None else "reasoning_content"
        return []

    def _text(self, piece: str) -> dict:
        if self.route == "call":
            return {"tool_calls": [{"index": self.calls, "function": {"arguments": piece}}]}
        return {self.route: piece}

    def feed(self, text: str, final: bool = False) -> list[dict]:
        deltas: list[dict] = []
        while self.sent < len(text):
            rest = text[self.sent:]
            if not self.in_body:
                if not any(h.startswith(rest[:len(h)]) for h in _HEADS):
                    self.in_body = True  # not a header: text without harmony's markup is the answer
                    continue
                at = rest.find(MESSAGE)
                if at < 0:
                    if final:  # a header cut short (max_tokens) carries no text
                        self.sent = len(text)
                    break
                deltas += self._open(rest[:at])
                self.sent += at + len(MESSAGE)
                self.in_body = True
                continue
            ends = [i for i in (rest.find(m) for m in _ENDS) if i >= 0]
            at = min(ends) if ends else -1
            upto = at if at >= 0 else len(rest) - (0 if final else partial_tail(rest, _ENDS))
            if upto > 0:
                deltas.append(self._text(rest[:upto]))
            self.sent += upto
            if at < 0:
                if final:
                    self._close()
                break
            marker = next(m for m in _ENDS if rest.startswith(m, at))
            if marker != START:  # a message begun without its <|end|> keeps the marker for its header
                self.sent += len(marker)
            self._close()
        return deltas

    def _close(self) -> None:
        if self.route == "call":
            self.calls += 1
        self.in_body, self.route = False, "content"


def parse(parser, text: str) -> dict:
    """A whole reply as message fields: content (None if empty), reasoning_content and tool_calls where
    there are any."""
    return merge(parser.feed(text, final=True))


def merge(deltas: list[dict]) -> dict:
    """Chat deltas summed into message fields."""
    content, reasoning, calls = [], [], {}
    for d in deltas:
        content.append(d.get("content", ""))
        reasoning.append(d.get("reasoning_content", ""))
        for c in d.get("tool_calls", ()):
            entry = calls.setdefault(c["index"], {"id": None, "type": "function",
                                                  "function": {"name": None, "arguments": ""}})
            if "id" in c:
                entry["id"], entry["function"]["name"] = c["id"], c["function"]["name"]
            entry["function"]["arguments"] += c["function"]["arguments"]
    message = {"content": "".join(content) or None}
    if any(reasoning):
        message["reasoning_content"] = "".join(reasoning)
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return message


def shown(delta: dict, include_reasoning: bool) -> dict | None:
    """A delta or message as the client gets it: its reasoning under both names clients read,
    reasoning_content (DeepSeek's API, llama-server, older vLLM) and reasoning (newer vLLM); or, with
    include_reasoning false, without it. None where nothing is left to send."""
    if not include_reasoning:
        return {k: v for k, v in delta.items() if k != "reasoning_content"} or None
    if "reasoning_content" in delta:
        delta = {**delta, "reasoning": delta["reasoning_content"]}
    return delta


class Reply:
    """One chat choice's growing text as deltas: the reasoning parser (if any) splits off the reasoning,
    then the tool-call parser (if any) reads the content."""

    def __init__(self, reasoning=None, tools=None) -> None:
        self.reasoning, self.tools = reasoning, tools
        self.content = ""

    @property
    def calls(self) -> int:
        return (self.tools.calls if self.tools is not None else 0) + getattr(self.reasoning, "calls", 0)

    def feed(self, text: str, final: bool = False) -> list[dict]:
        if self.reasoning is None:
            return self.tools.feed(text, final)
        out = []
        for d in self.reasoning.feed(text, final):
            if "content" in d and self.tools is not None:
                self.content += d["content"]
                out += self.tools.feed(self.content)
            else:
                out.append(d)
        if final and self.tools is not None:
            out += self.tools.feed(self.content, final=True)
        return out
