"""Structured outputs: JSON schemas, JSON objects, regexes, choices and grammars, offline and through the
server, checked against jsonschema / re and against an independent xgrammar matcher."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest

from tests.conftest import PROMPTS
from tests.server_utils import ServerProcess
from tokenmill import LLM, GuidedDecodingParams, SamplingParams, StructuredOutputsParams

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}}, "required": ["name"]},
    {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120}}, "required": ["age"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}}, "required": ["colour"]},
    {"type": "object", "properties": {"price": {"type": "number", "minimum": 0, "maximum": 1000}},
     "required": ["price"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 10},
                                               "minItems": 1, "maxItems": 3}}, "required": ["tags"]},
    {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                      "population": {"type": "integer", "minimum": 0}},
     "required": ["city", "population"]},
    {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["zip"]},
    {"type": "object", "properties": {"date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}},
     "required": ["date"]},
    {"type": "object", "properties": {"person": {"type": "object", "properties": {
        "first": {"type": "string", "maxLength": 15}, "last": {"type": "string", "maxLength": 15}},
        "required": ["first", "last"]}}, "required": ["person"]},
    {"type": "object", "properties": {"scores": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                            "maximum": 10}, "maxItems": 4}},
     "required": ["scores"]},
    {"type": "object", "properties": {"title": {"type": "string", "maxLength": 30},
                                      "subtitle": {"type": "string", "maxLength": 30}}, "required": ["title"]},
    {"type": "object", "properties": {"status": {"enum": ["open", "closed"]}, "count": {"type": "integer",
                                                                                         "minimum": 1,
                                                                                         "maximum": 99}},
     "required": ["status", "count"]},
    {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "minItems": 2, "maxItems": 5},
    {"type": "object", "properties": {"point": {"type": "array", "items": {"type": "number"}, "minItems": 2,
                                                "maxItems": 2}}, "required": ["point"]},
    {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]},
                                      "confidence": {"type": "number", "minimum": 0, "maximum": 1}},
     "required": ["answer", "confidence"]},
    {"type": "object", "properties": {"items": {"type": "array", "maxItems": 2, "items": {
        "type": "object", "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{2}$"},
                                         "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["sku", "qty"]}}}, "required": ["items"]},
    {"type": "object", "properties": {"email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"}},
     "required": ["email"]},
    {"type": "object", "properties": {"value": {"anyOf": [{"type": "integer"}, {"type": "null"}]}},
     "required": ["value"]},
    {"type": "object", "properties": {"meta": {"type": "object", "properties": {
        "version": {"type": "integer", "minimum": 1, "maximum": 9},
        "stable": {"type": "boolean"}}, "required": ["version", "stable"]},
        "name": {"type": "string", "maxLength": 12}}, "required": ["meta", "name"]},
]


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_output_validates_against_its_schema(default_gguf, temperature):
    llm = LLM(default_gguf)
    chats = [[{"role": "user", "content": f"Reply in JSON matching this schema: {json.dumps(s)}"}] for s in SCHEMAS]
    params = [SamplingParams(temperature=temperature, seed=i, max_tokens=160,
                             structured_outputs=StructuredOutputsParams(json=s)) for i, s in enumerate(SCHEMAS)]
    outs = llm.chat(chats, params, use_tqdm=False)
    for schema, out in zip(SCHEMAS, outs):
        c = out.outputs[0]
        assert c.finish_reason == "stop", (schema, c.text)
        jsonschema.validate(json.loads(c.text), schema)


def test_regex_choice_grammar_and_json_object(tiny_models):
    llm = LLM(tiny_models["llama"], dtype="float32")

    def run(spec, temperature=1.0, seed=0, max_tokens=64, **kw):
        return llm.generate(PROMPTS[0], SamplingParams(temperature=temperature, seed=seed, max_tokens=max_tokens,
                                                       structured_outputs=spec, **kw))[0].outputs[0]

    for seed in range(4):  # a random model: every token comes from the mask, none from sense
        assert re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", run({"regex": r"\(\d{3}\) \d{3}-\d{4}"}, seed=seed).text)
        assert run({"choice": ["alpha", "beta", "gamma delta"]}, seed=seed).text in ("alpha", "beta", "gamma delta")
        text = run({"grammar": 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'}, seed=seed).text
        assert re.fullmatch(r"\(\d{1,2}(\+\d{1,2})*\)", text), text
    obj = run(StructuredOutputsParams(json_object=True), temperature=0, max_tokens=200)
    if obj.finish_reason == "stop":
        assert isinstance(json.loads(obj.text), dict)
    else:  # cut at max_tokens: still a prefix of an object
        assert obj.text.startswith("{")
    # the older name; greedy requests with a constraint decode too; ignore_eos cannot run past the end
    old = run(None, temperature=0, guided_decoding=GuidedDecodingParams(choice=["yes", "no"]), ignore_eos=True)
    assert old.text in ("yes", "no") and old.finish_reason == "stop"
    # min_tokens does not hold back the end a grammar reaches
    short = run({"choice": ["yes", "no"]}, min_tokens=5)
    assert short.text in ("yes", "no") and short.finish_reason == "stop"


def test_every_sampled_token_keeps_an_independent_matcher_accepting(tiny_models):
    """The reference: a fresh xgrammar matcher replays each output token by token."""
    import xgrammar as xgr

    llm = LLM(tiny_models["qwen2"], dtype="float32")
    schema = SCHEMAS[16]
    spec = StructuredOutputsParams(json=schema)
    outs = llm.generate(PROMPTS, [SamplingParams(temperature=1.5, seed=s, max_tokens=120, structured_outputs=spec)
                                  for s in range(len(PROMPTS))])
    compiled = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(
        llm.get_tokenizer(), vocab_size=llm.engine.vocab_size,
        stop_token_ids=list(llm.engine.eos_token_ids))).compile_json_schema(json.dumps(schema), any_whitespace=False)
    finished = 0
    for out in outs:
        m = xgr.GrammarMatcher(compiled)
        for t in out.outputs[0].token_ids:
            assert m.accept_token(t), (out.outputs[0].token_ids, t)
        if out.outputs[0].finish_reason == "stop":
            finished += 1
            assert m.is_terminated()
            jsonschema.validate(json.loads(out.outputs[0].text), schema)
    assert finished >= 1


def test_a_constrained_request_leaves_its_batch_companions_unchanged(tiny_models):
    llm = LLM(tiny_models["llama"], dtype="float32")
    plain = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, plain)]
    constrained = SamplingParams(temperature=0.8, seed=1, max_tokens=24, structured_outputs={"regex": "[a-z ]{5,40}"})
    mixed = llm.generate(PROMPTS[:1] + ["hello"] + PROMPTS[1:], [plain, constrained] + [plain] * (len(PROMPTS) - 1))
    assert [o.outputs[0].token_ids for i, o in enumerate(mixed) if i != 1] == alone
    assert re.fullmatch("[a-z ]{5,40}", mixed[1].outputs[0].text)


def test_bad_constraints_are_clear_errors():
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams(json={"type": "object"}, regex="a")
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="not valid JSON"):
        StructuredOutputsParams(json="{nope")
    with pytest.raises(ValueError, match="over the limit"):
        StructuredOutputsParams(regex="a" * 70000)
    with pytest.raises(ValueError, match="non-empty list of strings"):
        StructuredOutputsParams(choice="yes")
    with pytest.raises(ValueError, match="not both"):
        SamplingParams(structured_outputs={"regex": "a"}, guided_decoding={"regex": "b"})
    with pytest.raises(ValueError, match="unknown field"):
        SamplingParams(structured_outputs={"jsn": {}})


def test_server_structured_outputs_and_bad_input(tiny_models):
    server = ServerProcess(tiny_models["llama"], "--dtype", "float32", "--served-model-name", "tiny")
    url = server.url + "/v1/chat/completions"
    msgs = [{"role": "user", "content": "hi"}]
    schema = SCHEMAS[12]
    try:
        def chat(**extra):
            return httpx.post(url, json={"model": "tiny", "messages": msgs, "max_tokens": 200, "seed": 3,
                                         **extra}, timeout=120)

        fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema, "strict": True}}
        r = chat(response_format=fmt)
        assert r.status_code == 200, r.text
        c = r.json()["choices"][0]
        if c["finish_reason"] == "stop":
            jsonschema.validate(json.loads(c["message"]["content"]), schema)
        # streamed, the deltas add up to the same constrained text
        with httpx.stream("POST", url, json={"model": "tiny", "messages": msgs, "max_tokens": 200, "seed": 3,
                                             "stream": True, "response_format": fmt}, timeout=120) as s:
            pieces = [json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                      for line in s.iter_lines() if line.startswith("data: {")]
        assert "".join(pieces) == c["message"]["content"]
        for field, value in (("guided_choice", ["left", "right"]), ("guided_regex", "[0-9]{4}"),
                             ("structured_outputs", {"choice": ["up", "down"]})):
            text = chat(**{field: value}).json()["choices"][0]["message"]["content"]
            assert text in ("left", "right", "up", "down") or re.fullmatch("[0-9]{4}", text), (field, text)
        completion = httpx.post(server.url + "/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": "x", "max_tokens": 10, "guided_regex": "[ab]{3}"}).json()
        assert re.fullmatch("[ab]{3}", completion["choices"][0]["text"])

        bad = [({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {
                    "type": "objekt"}}}}, "response_format", "Unsupported type"),
               ({"response_format": {"type": "json_schema", "json_schema": {"name": "s"}}}, "response_format",
                "needs json_schema.schema"),
               ({"guided_regex": "(unclosed"}, "guided_regex", "parenthesis"),
               ({"guided_grammar": "root ::= foo"}, "guided_grammar", 'Rule "foo" is not defined'),
               ({"guided_json": {"type": "string", "pattern": "x" * 70000}}, "guided_json", "over the limit"),
               ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "one output constraint"),
               ({"structured_outputs": {"regexp": "a"}}, "structured_outputs", "unknown field")]
        for extra, param, words in bad:
            r = chat(**extra)
            assert r.status_code == 400, (extra, r.text)
            err = r.json()["error"]
            assert err["param"] == param and words in err["message"], (extra, err)
        assert httpx.get(server.url + "/health").status_code == 200
        assert chat(response_format={"type": "text"}).status_code == 200
    finally:
        server.stop()


@pytest.mark.slow
def test_openai_client_parse_with_a_pydantic_model(default_gguf):
    import openai
    from pydantic import BaseModel, Field

    class City(BaseModel):
        name: str = Field(max_length=20)
        country: str = Field(max_length=20)
        # Bounded: a JSON integer has no length limit, and at temperature 1 the small model can write
        # digits until max_tokens (seen on one seed); the grammar enforces the bound.
        population: int = Field(ge=0, le=100_000_000)

    server = ServerProcess(default_gguf)
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
        model = client.models.list().data[0].id
        for seed in range(3):
            done = client.chat.completions.parse(
                model=model, response_format=City, max_tokens=100, seed=seed, temperature=1.0,
                messages=[{"role": "user", "content": "Name a large city, its country and population."}])
            city = done.choices[0].message.parsed
            assert isinstance(city, City) and 0 <= city.population <= 100_000_000
    finally:
        server.stop()
