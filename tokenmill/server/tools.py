"""Tool calling in the formats models are trained on (FORMATS): Hermes/Qwen
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, Llama 3's JSON `{"name": ..., "parameters": {...}}`
and Mistral's `[TOOL_CALLS][{"name": ..., "arguments": {...}}]`, chosen from the chat template (or
--tool-call-parser); Hermes where the template says nothing.

Rendering: where the chat template handles `tools` itself, it gets them; otherwise a system prompt (FALLBACK)
lists them and asks for the format, and earlier tool calls and results are written in it too.
Constraint: tool_choice "required" or a named function constrains the whole output to calls of the given
functions (arguments to their parameter schemas); "auto" lets the model write freely and constrains a call
once it starts one; "none" renders no tools. Parsing: the calls become message.tool_calls, and while
streaming each call goes out as OpenAI sends it: id, type and name first, then argument fragments.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from tokenmill.server.reasoning import partial_tail
from tokenmill.structured.params import StructuredOutputsParams

_NAME = r'"name"\s*:\s*"(?P<name>(?:[^"\\]|\\.)*)"\s*,\s*'


@dataclass(frozen=True)
class ToolFormat:
    """How one family of models writes tool calls."""

    name: str
    start: str  # where calls begin: text before it is content
    head: re.Pattern  # a call up to its arguments' value; group "name"
    close: re.Pattern  # what ends a call after its arguments' value (matched right there)
    args_key: str
    prefix: str  # before a call's opening brace, in the constraint and the fallback prompt
    suffix: str  # after a call's closing brace
    separator: str  # between calls
    wrap: tuple[str, str] = ("", "")  # around all the calls (Mistral's list)
    instructions: str = ""

    def example(self) -> str:
        call = f'{{"name": "<function name>", "{self.args_key}": {{"<argument>": "<value>"}}}}'
        return self.wrap[0] + self.prefix + call + self.suffix + self.wrap[1]

    def write(self, calls: list[tuple[str, object]]) -> str:
        """Calls as this format writes them (earlier turns in the fallback rendering)."""
        return self.wrap[0] + self.separator.join(
            self.prefix + json.dumps({"name": n, self.args_key: a}, ensure_ascii=False) + self.suffix
            for n, a in calls) + self.wrap[1]


FORMATS = {
    "hermes": ToolFormat(
        "hermes", "<tool_call>", re.compile(r'<tool_call>\s*\{\s*' + _NAME + r'"arguments"\s*:\s*', re.DOTALL),
        re.compile(r"\s*\}\s*</tool_call>"), "arguments", "<tool_call>\n", "\n</tool_call>", "\n",
        instructions="answer with a <tool_call></tool_call> block holding a JSON object with the function's "
                     "name and its arguments (one block per call)"),
    "llama3_json": ToolFormat(
        "llama3_json", '{"name"', re.compile(r'(?:<\|python_tag\|>)?\s*\{\s*' + _NAME + r'"parameters"\s*:\s*',
                                              re.DOTALL),
        re.compile(r"\s*\}"), "parameters", "", "", "; ",
        instructions="answer with only a JSON object holding the function's name and its parameters (calls "
                     "separated by '; ')"),
    "mistral": ToolFormat(
        "mistral", "[TOOL_CALLS]", re.compile(r'\{\s*' + _NAME + r'"arguments"\s*:\s*', re.DOTALL),
        re.compile(r"\s*\}"), "arguments", "", "", ", ", wrap=("[TOOL_CALLS][", "]"),
        instructions="answer with [TOOL_CALLS] followed by a JSON list of objects, each holding a function's "
                     "name and its arguments"),
}

FALLBACK = """You can call functions to help answer. The functions, as JSON schemas:
<tools>
{tools}
</tools>
To call a function, {instructions}:
{example}"""


def format_for(template: str | None, override: str | None = None) -> ToolFormat:
    """The format a parser name gives, or the one the chat template shows; Hermes by default."""
    if override:
        if override not in FORMATS:
            raise ValueError(f"tool call parser must be one of {', '.join(FORMATS)}, got {override!r}")
        return FORMATS[override]
    t = template or ""
    if "[TOOL_CALLS]" in t:
        return FORMATS["mistral"]
    if "<|python_tag|>" in t or "ipython" in t:
        return FORMATS["llama3_json"]
    return FORMATS["hermes"]


class ToolError(ValueError):
    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def functions(tools: list[dict] | None) -> dict[str, dict]:
    """name -> function description, checked."""
    out = {}
    for i, tool in enumerate(tools or []):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ToolError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}", "tools")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise ToolError(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
        out[fn["name"]] = {**fn, "parameters": params}
    return out


def chosen(tool_choice, fns: dict[str, dict]) -> tuple[str, list[str]]:
    """The mode (none, auto, required) and the functions a call may name."""
    if tool_choice is None:
        return ("auto" if fns else "none"), list(fns)
    if tool_choice in ("none", "auto", "required"):
        if tool_choice != "none" and not fns:
            raise ToolError(f"tool_choice {tool_choice!r} needs tools", "tool_choice")
        return tool_choice, list(fns)
    if isinstance(tool_choice, dict):
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if name not in fns:
            raise ToolError(f"tool_choice names function {name!r}, which is not among the tools "
                            f"({', '.join(fns) or 'none given'})", "tool_choice")
        return "required", [name]
    raise ToolError("tool_choice must be none, auto, required or {\"type\": \"function\", \"function\": {\"name\": "
                    "...}}", "tool_choice")


def constraint(mode: str, names: list[str], fns: dict[str, dict], parallel: bool,
               fmt: ToolFormat = FORMATS["hermes"]) -> StructuredOutputsParams | None:
    if mode == "none":
        return None
    tags = [{"type": "tag", "begin": f'{fmt.prefix}{{"name": {json.dumps(n)}, "{fmt.args_key}": ',
             "content": {"type": "json_schema", "json_schema": fns[n]["parameters"]}, "end": "}" + fmt.suffix}
            for n in names]
    calls = {"type": "tags_with_separator", "tags": tags, "separator": fmt.separator, "at_least_one": True,
             "stop_after_first": not parallel}
    if mode == "required":
        if fmt.wrap == ("", ""):
            body = calls
        else:
            body = {"type": "sequence", "elements": [{"type": "const_string", "value": fmt.wrap[0]}, calls,
                                                     {"type": "const_string", "value": fmt.wrap[1]}]}
    else:  # auto: free text until the model starts a call
        if fmt.wrap != ("", ""):  # a list opened by a marker: one call per list here
            tags = [{**t, "begin": fmt.wrap[0] + t["begin"], "end": t["end"] + fmt.wrap[1]} for t in tags]
            trigger = fmt.wrap[0]
        else:
            trigger = fmt.prefix or fmt.start
        body = {"type": "triggered_tags", "triggers": [trigger], "tags": tags, "at_least_one": False,
                "stop_after_first": not parallel}
    return StructuredOutputsParams(structural_tag={"type": "structural_tag", "format": body})


def template_handles_tools(template: str | None) -> bool:
    return bool(template) and "tools" in template


def render_messages(messages: list[dict], fns: dict[str, dict], mode: str, native: bool,
                    fmt: ToolFormat = FORMATS["hermes"]) -> list[dict]:
    """Messages for the template. Natively: as they are (tool_calls' arguments as objects, as templates
    expect). Otherwise: the fallback system prompt, calls written in the format, results as
    <tool_response> blocks from the user."""
    out = []
    for m in messages:
        m = dict(m)
        calls = m.get("tool_calls") or []
        if native:
            if calls:
                m["tool_calls"] = [{**c, "function": {**c["function"], "arguments": _as_object(
                    c["function"].get("arguments"))}} for c in calls]
            out.append(m)
            continue
        if calls:
            written = fmt.write([(c["function"]["name"], _as_object(c["function"].get("arguments"))) for c in calls])
            m["content"] = ((m.get("content") or "") + "\n" + written).strip()
        elif m.get("role") == "tool":
            m = {"role": "user", "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"}
        out.append({k: v for k, v in m.items() if k in ("role", "content", "reasoning_content", "thinking")})
    if not native and mode != "none" and fns:
        prompt = FALLBACK.format(tools="\n".join(json.dumps({"type": "function", "function": f}) for f in fns.values()),
                                 instructions=fmt.instructions, example=fmt.example())
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def _as_object(arguments):
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return arguments if arguments is not None else {}


def _new_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse(text: str, fmt: ToolFormat = FORMATS["hermes"]) -> tuple[str | None, list[dict]]:
    """The content before the calls, and the calls: ids, names, and arguments as the model wrote them (so
    a streamed call's fragments add up to the same string). Text that is not a complete call stays
    content; so does everything when no call is complete."""
    first = text.find(fmt.start)
    if first < 0:
        return text, []
    calls, pos = [], first
    while (head := fmt.head.search(text, pos)) is not None:
        pos = head.end()
        end = _json_end(text[head.end():])
        if end is None:
            break
        args = text[head.end():head.end() + end]
        closing = fmt.close.match(text, head.end() + end)
        if closing is None:
            continue
        try:
            json.loads(args)
        except json.JSONDecodeError:
            continue
        name = _name(head.group("name"))
        calls.append({"id": _new_id(), "type": "function", "function": {"name": name, "arguments": args}})
        pos = closing.end()
    if not calls:
        return text, []
    return text[:first].strip() or None, calls


def _name(written: str) -> str:
    """A function name as written inside JSON quotes (escapes decoded where they are valid)."""
    try:
        return json.loads(f'"{written}"')
    except json.JSONDecodeError:
        return written


def _json_end(text: str) -> int | None:
    """The end of the JSON value at the start of text, or None while it is incomplete."""
    depth, in_string, escaped = 0, False, False
    for i, ch in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


@dataclass
class StreamParser:
    """Turns a growing completion text into chat deltas: content, then each call's id and name, then its
    argument fragments as they are written."""

    fmt: ToolFormat = FORMATS["hermes"]
    sent: int = 0  # characters of the text dealt with
    calls: int = 0
    in_calls: bool = False  # past the start of the calls: the rest is calls and what separates them
    in_args: bool = False
    args_start: int = 0
    args_sent: int = 0

    def feed(self, text: str, final: bool = False) -> list[dict]:
        deltas = []
        start = self.fmt.start
        if not self.in_calls:
            at = text.find(start, self.sent)
            if at < 0:
                # hold back what may be the start of a call
                keep = 0 if final else partial_tail(text[self.sent:], (start,))
                piece = text[self.sent:len(text) - keep]
                if piece:
                    deltas.append({"content": piece})
                self.sent += len(piece)
                return deltas
            if text[self.sent:at]:
                deltas.append({"content": text[self.sent:at]})
            self.sent, self.in_calls = at, True
        while True:
            if not self.in_args:
                head = self.fmt.head.search(text, self.sent)
                if head is not None and head.end() == len(text) and not final:
                    head = None  # the arguments have not begun: whitespace may still follow
                if head is None:
                    if final and not self.calls:  # never became a call: it is content
                        deltas.append({"content": text[self.sent:]})
                        self.sent = len(text)
                    return deltas
                name = _name(head.group("name"))
                deltas.append({"tool_calls": [{"index": self.calls, "id": _new_id(), "type": "function",
                                               "function": {"name": name, "arguments": ""}}]})
                self.in_args, self.args_start, self.args_sent = True, head.end(), head.end()
                self.sent = head.end()
            end = _json_end(text[self.args_start:])
            stop = self.args_start + end if end is not None else len(text)
            if stop > self.args_sent:
                deltas.append({"tool_calls": [{"index": self.calls,
                                               "function": {"arguments": text[self.args_sent:stop]}}]})
                self.args_sent = stop
            closing = self.fmt.close.match(text, stop) if end is not None else None
            if closing is None:
                if final and text[stop:]:  # what follows a call that never closed is content, not lost
                    deltas.append({"content": text[stop:]})
                    self.sent = len(text)
                return deltas
            self.sent, self.in_args = closing.end(), False
            self.calls += 1
