"""Tool calling in the Hermes format: <tool_call>{"name": ..., "arguments": {...}}</tool_call>.

Rendering: where the chat template handles `tools` itself, it gets them; otherwise a system prompt (FALLBACK)
lists them and asks for that format, and earlier tool calls and results are written in it too.
Constraint: tool_choice "required" or a named function constrains the whole output to calls of the given
functions (arguments to their parameter schemas); "auto" lets the model write freely and constrains a call
once it writes "<tool_call>"; "none" renders no tools. Parsing: the calls become message.tool_calls, and
while streaming each call goes out as OpenAI sends it: id, type and name first, then argument fragments.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from tokenmill.structured.params import StructuredOutputsParams

OPEN, CLOSE = "<tool_call>", "</tool_call>"

FALLBACK = """You can call functions to help answer. The functions, as JSON schemas:
<tools>
{tools}
</tools>
To call a function, answer with a <tool_call></tool_call> block holding a JSON object with the function's name \
and its arguments (one block per call):
<tool_call>
{{"name": "<function name>", "arguments": {{"<argument>": "<value>"}}}}
</tool_call>"""


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
        name = (tool_choice.get("function") or {}).get("name")
        if name not in fns:
            raise ToolError(f"tool_choice names function {name!r}, which is not among the tools "
                            f"({', '.join(fns) or 'none given'})", "tool_choice")
        return "required", [name]
    raise ToolError("tool_choice must be none, auto, required or {\"type\": \"function\", \"function\": {\"name\": "
                    "...}}", "tool_choice")


def constraint(mode: str, names: list[str], fns: dict[str, dict], parallel: bool) -> StructuredOutputsParams | None:
    if mode == "none":
        return None
    tags = [{"type": "tag", "begin": f'{OPEN}\n{{"name": {json.dumps(n)}, "arguments": ',
             "content": {"type": "json_schema", "json_schema": fns[n]["parameters"]}, "end": "}\n" + CLOSE}
            for n in names]
    if mode == "required":
        fmt = {"type": "tags_with_separator", "tags": tags, "separator": "\n", "at_least_one": True,
               "stop_after_first": not parallel}
    else:
        fmt = {"type": "triggered_tags", "triggers": [OPEN], "tags": tags, "at_least_one": False,
               "stop_after_first": not parallel}
    return StructuredOutputsParams(structural_tag={"type": "structural_tag", "format": fmt})


def template_handles_tools(template: str | None) -> bool:
    return bool(template) and "tools" in template


def render_messages(messages: list[dict], fns: dict[str, dict], mode: str, native: bool) -> list[dict]:
    """Messages for the template. Natively: as they are (tool_calls' arguments as objects, as templates
    expect). Otherwise: the fallback system prompt, calls written as <tool_call> blocks, results as
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
            blocks = "\n".join(f"{OPEN}\n{json.dumps({'name': c['function']['name'], 'arguments': _as_object(c['function'].get('arguments'))})}\n{CLOSE}"
                               for c in calls)
            m = {"role": "assistant", "content": ((m.get("content") or "") + "\n" + blocks).strip()}
        elif m.get("role") == "tool":
            m = {"role": "user", "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"}
        out.append({k: v for k, v in m.items() if k in ("role", "content")})
    if not native and mode != "none" and fns:
        prompt = FALLBACK.format(tools="\n".join(json.dumps({"type": "function", "function": f}) for f in fns.values()))
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


def parse(text: str) -> tuple[str | None, list[dict]]:
    """The content outside the calls, and the calls: ids, names, and arguments as the model wrote them (so
    a streamed call's fragments add up to the same string). A block that is not a complete call stays
    in the content."""
    calls, spans, pos = [], [], 0
    while (head := _HEAD.search(text, pos)) is not None:
        pos = head.end()
        end = _json_end(text[head.end():])
        if end is None:
            break
        args = text[head.end():head.end() + end]
        close = text.find(CLOSE, head.end() + end)
        if close < 0 or text[head.end() + end:close].strip() != "}":
            continue
        try:
            json.loads(args)
            name = json.loads(f'"{head.group(1)}"')
        except json.JSONDecodeError:
            continue
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": name, "arguments": args}})
        spans.append((head.start(), close + len(CLOSE)))
        pos = close + len(CLOSE)
    if not calls:
        return text, []
    content = text
    for a, b in reversed(spans):
        content = content[:a] + content[b:]
    return content.strip() or None, calls


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


_HEAD = re.compile(r'<tool_call>\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*', re.DOTALL)


@dataclass
class StreamParser:
    """Turns a growing completion text into chat deltas: content, then each call's id and name, then its
    argument fragments as they are written."""

    sent: int = 0  # characters of the text dealt with
    calls: int = 0
    in_call: bool = False
    args_start: int = 0
    args_sent: int = 0
    ids: list = field(default_factory=list)

    def feed(self, text: str, final: bool = False) -> list[dict]:
        deltas = []
        while True:
            if not self.in_call:
                at = text.find(OPEN, self.sent)
                if at < 0:
                    # hold back what may be the start of "<tool_call>"
                    keep = 0 if final else next((k for k in range(min(len(OPEN) - 1, len(text) - self.sent), 0, -1)
                                                 if text.endswith(OPEN[:k])), 0)
                    piece = text[self.sent:len(text) - keep]
                    if piece and (piece.strip() or not self.calls):
                        deltas.append({"content": piece})
                    self.sent += len(piece)
                    return deltas
                piece = text[self.sent:at]
                if piece.strip():
                    deltas.append({"content": piece})
                head = _HEAD.match(text, at)
                if head is not None and head.end() == len(text) and not final:
                    head = None  # the arguments have not begun: whitespace may still follow
                if head is None:
                    self.sent = at
                    if final:  # never became a call: it is content
                        deltas.append({"content": text[at:]})
                        self.sent = len(text)
                    return deltas
                name = json.loads(f'"{head.group(1)}"')
                call_id = f"call_{uuid.uuid4().hex[:24]}"
                self.ids.append(call_id)
                deltas.append({"tool_calls": [{"index": self.calls, "id": call_id, "type": "function",
                                               "function": {"name": name, "arguments": ""}}]})
                self.in_call, self.args_start, self.args_sent = True, head.end(), head.end()
                self.sent = head.end()
            args = text[self.args_start:]
            end = _json_end(args)
            stop = self.args_start + end if end is not None else len(text)
            if stop > self.args_sent:
                deltas.append({"tool_calls": [{"index": self.calls,
                                               "function": {"arguments": text[self.args_sent:stop]}}]})
                self.args_sent = stop
            if end is None:
                return deltas
            close = text.find(CLOSE, stop)
            if close < 0:
                return deltas
            self.sent = close + len(CLOSE)
            self.in_call = False
            self.calls += 1
