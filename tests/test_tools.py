"""Tool calling: the Hermes <tool_call> format parsed and streamed, calls constrained by their schemas,
through the official openai client and LangChain, on the real default model."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from tests.server_utils import ServerProcess
from tokenmill.server import tools

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 30}},
                   "required": ["zone"]}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}


WRITTEN = {
    "hermes": ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris \\"centre\\"", '
               '"unit": "celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n'
               '</tool_call>'),
    "llama3_json": ('Let me check. <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris \\"centre\\"", '
                    '"unit": "celsius"}}; {"name": "get_time", "parameters": {"zone": "CET"}}'),
    "mistral": ('Let me check. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris \\"centre\\"", '
                '"unit": "celsius"}}, {"name": "get_time", "arguments": {"zone": "CET"}}]'),
}


@pytest.mark.parametrize("fmt", list(WRITTEN))
def test_parse_and_stream_agree(fmt):
    text = WRITTEN[fmt]
    fmt = tools.FORMATS[fmt]
    if fmt.name == "llama3_json":  # content ends where the first call's JSON starts
        text = text.replace("<|python_tag|>", "")
    content, calls = tools.parse(text, fmt)
    assert content == "Let me check."
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": 'Paris "centre"', "unit": "celsius"}
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    for step in (1, 3, 7, len(text)):  # fed a few characters at a time, as tokens arrive
        parser, deltas = tools.StreamParser(fmt), []
        for end in range(step, len(text) + step, step):
            deltas += parser.feed(text[:end], final=end >= len(text))
        assert "".join(d.get("content", "") for d in deltas) == "Let me check. "
        streamed = {}
        for d in deltas:
            for tc in d.get("tool_calls", []):
                entry = streamed.setdefault(tc["index"], {"name": None, "arguments": ""})
                if "id" in tc:  # the first delta of a call: id, type and name, arguments empty
                    assert entry["name"] is None and tc["type"] == "function" and tc["function"]["arguments"] == ""
                    entry["name"] = tc["function"]["name"]
                entry["arguments"] += tc["function"]["arguments"]
        assert [(e["name"], e["arguments"]) for e in streamed.values()] == \
            [(c["function"]["name"], c["function"]["arguments"]) for c in calls]
    assert tools.parse("no calls <tool_call>{broken") == ("no calls <tool_call>{broken", [])
    # a call that never closes: what follows it still reaches the client
    parser = tools.StreamParser()
    sent = parser.feed('<tool_call>\n{"name": "f", "arguments": {"a": 1}, "b": 2}</tool_call> tail', final=True)
    assert sent[-1] == {"content": ', "b": 2}</tool_call> tail'}
    assert tools.format_for("... [TOOL_CALLS] ...").name == "mistral"
    assert tools.format_for("{{ '<|python_tag|>' }}").name == "llama3_json"
    assert tools.format_for(None).name == "hermes" and tools.format_for(None, "mistral").name == "mistral"


@pytest.mark.slow
def test_every_format_gives_valid_calls_from_the_default_model(default_gguf):
    """The fallback prompt and the constraint of each format, offline: required and named calls parse
    back into calls whose arguments follow the schemas."""
    from tokenmill import LLM, SamplingParams

    llm = LLM(default_gguf)
    fns = tools.functions([WEATHER, TIME])
    for fmt in tools.FORMATS.values():
        for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
            mode, names = tools.chosen(choice, fns)
            messages = tools.render_messages(ASK, fns, mode, native=False, fmt=fmt)
            spec = tools.constraint(mode, names, fns, parallel=True, fmt=fmt)
            out = llm.chat(messages, SamplingParams(temperature=0.8, seed=1, max_tokens=120,
                                                    structured_outputs=spec))[0].outputs[0]
            assert out.finish_reason == "stop", (fmt.name, out.text)
            content, calls = tools.parse(out.text, fmt)
            assert calls and content is None, (fmt.name, out.text)
            for c in calls:
                assert c["function"]["name"] in names
                jsonschema.validate(json.loads(c["function"]["arguments"]), SCHEMAS[c["function"]["name"]])


def test_choices_and_bad_tools():
    fns = tools.functions([WEATHER, TIME])
    assert tools.chosen(None, fns) == ("auto", ["get_weather", "get_time"])
    assert tools.chosen({"type": "function", "function": {"name": "get_time"}}, fns) == ("required", ["get_time"])
    assert tools.chosen(None, {}) == ("none", [])
    with pytest.raises(tools.ToolError, match="not among the tools"):
        tools.chosen({"type": "function", "function": {"name": "nope"}}, fns)
    with pytest.raises(tools.ToolError, match="needs tools"):
        tools.chosen("required", {})
    with pytest.raises(tools.ToolError, match="not among the tools"):
        tools.chosen({"type": "function", "function": "get_time"}, fns)
    with pytest.raises(tools.ToolError, match=r"tools\[0\]"):
        tools.functions([{"type": "function", "function": {"description": "no name"}}])


@pytest.fixture(scope="module")
def server(default_gguf):
    s = ServerProcess(default_gguf)
    yield s
    s.stop()


def _post(server, **body):
    r = httpx.post(server.url + "/v1/chat/completions", timeout=120, json={"max_tokens": 120, **body})
    return r


ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_required_and_named_calls_are_valid_even_from_a_small_model(server, temperature):
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        for seed in range(3):
            r = _post(server, messages=ASK, tools=[WEATHER, TIME], tool_choice=choice, temperature=temperature,
                      seed=seed)
            assert r.status_code == 200, r.text
            c = r.json()["choices"][0]
            assert c["finish_reason"] == "tool_calls", c
            calls = c["message"]["tool_calls"]
            assert calls and all(t["id"].startswith("call_") for t in calls)
            for t in calls:
                name = t["function"]["name"]
                assert name in SCHEMAS and (choice == "required" or name == "get_time")
                jsonschema.validate(json.loads(t["function"]["arguments"]), SCHEMAS[name])


@pytest.mark.slow
def test_streamed_calls_add_up_to_the_whole_answer(server):
    for choice in ("required", "auto"):
        body = dict(messages=ASK, tools=[WEATHER, TIME], tool_choice=choice, temperature=0.7, seed=11)
        whole = _post(server, **body).json()["choices"][0]
        with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=120,
                          json={"max_tokens": 120, "stream": True, **body}) as s:
            events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
        content, calls, reason = "", {}, None
        for e in events:
            ch = e["choices"][0]
            reason = ch["finish_reason"] or reason
            content += ch["delta"].get("content") or ""
            for tc in ch["delta"].get("tool_calls") or []:
                entry = calls.setdefault(tc["index"], {"name": tc["function"].get("name"), "arguments": ""})
                entry["arguments"] += tc["function"].get("arguments", "")
        assert reason == whole["finish_reason"]
        want = [(t["function"]["name"], t["function"]["arguments"]) for t in whole["message"].get("tool_calls") or []]
        assert [(c["name"], c["arguments"]) for c in calls.values()] == want
        assert (content.strip() or None) == (whole["message"]["content"] or None if want else whole["message"]["content"].strip() or None)


@pytest.mark.slow
def test_tool_results_round_trip_and_errors(server):
    first = _post(server, messages=ASK, tools=[WEATHER], tool_choice="required", temperature=0).json()
    call = first["choices"][0]["message"]["tool_calls"][0]
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": call["id"], "content": '{"temperature": 18, "sky": "clear"}'}]
    r = _post(server, messages=history, tools=[WEATHER], tool_choice="none", temperature=0, max_tokens=40)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
    assert "tool_calls" not in r.json()["choices"][0]["message"]
    for extra, param in (({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
                         ({"tools": [{"type": "function", "function": {}}]}, "tools"),
                         ({"tool_choice": "required", "tools": None}, "tool_choice"),
                         ({"tool_choice": {"type": "function", "function": "get_weather"}}, "tool_choice"),
                         ({"tools": [{"type": "function", "function": {
                             "name": f"f{i}", "description": "x" * 300, "parameters": {
                                 "type": "object", "properties": {f"p{j}": {"type": "string", "description": "y" * 40}
                                                                  for j in range(30)}}}} for i in range(30)],
                           "tool_choice": "required"}, "tools")):
        r = _post(server, messages=ASK, **{"tools": [WEATHER], **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


@pytest.mark.slow
def test_openai_client_and_langchain(server):
    import openai
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    model = client.models.list().data[0].id
    done = client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER], tool_choice="required",
                                          max_tokens=120, temperature=0)
    call = done.choices[0].message.tool_calls[0]
    assert done.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS["get_weather"])

    class Weather(BaseModel):
        """Weather in a city."""
        city: str = Field(max_length=30)
        unit: str = Field(pattern="^(celsius|fahrenheit)$")

    llm = ChatOpenAI(base_url=server.url + "/v1", api_key="none", model=model, max_tokens=120, temperature=0)
    bound = llm.bind_tools([Weather], tool_choice="required")
    msg = bound.invoke("What is the weather in Paris?")
    assert msg.tool_calls and msg.tool_calls[0]["name"] == "Weather"
    assert isinstance(msg.tool_calls[0]["args"]["city"], str)
    for method in ("json_schema", "function_calling"):
        result = llm.with_structured_output(Weather, method=method).invoke("Weather in Rome, in celsius?")
        assert isinstance(result, Weather), method


def test_a_template_that_knows_tools_renders_them_itself(tiny_models):
    """Natively: the template gets the tools and earlier calls (arguments as objects), and no fallback
    prompt is added."""
    from transformers import AutoTokenizer

    from tokenmill.llm import apply_chat_template

    tok = AutoTokenizer.from_pretrained(tiny_models["llama"])
    template = ("{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}\n{% endif %}"
                "{% for m in messages %}{{ m.role }}: {{ m.content or '' }}"
                "{% for c in m.tool_calls or [] %}[call {{ c.function.name }} {{ c.function.arguments.city }}]"
                "{% endfor %}\n{% endfor %}")
    assert tools.template_handles_tools(template) and not tools.template_handles_tools("{{ messages }}")
    fns = tools.functions([WEATHER, TIME])
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "cold"}]
    messages = tools.render_messages(history, fns, "auto", native=True)
    text = apply_chat_template(tok, messages, template, tools=[{"type": "function", "function": f}
                                                                  for f in fns.values()])
    assert text.startswith("TOOLS:get_weather;get_time;") and "user: What is the weather in Paris?" in text
    assert "[call get_weather Oslo]" in text and "tool: cold" in text and "<tools>" not in text
    fallback = tools.render_messages(history, fns, "auto", native=False)
    assert fallback[0]["role"] == "system" and '"get_time"' in fallback[0]["content"]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in fallback[2]["content"]
    assert fallback[3] == {"role": "user", "content": "<tool_response>\ncold\n</tool_response>"}
