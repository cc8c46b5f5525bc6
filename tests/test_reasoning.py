"""Reasoning outputs: <think> tags and the harmony format split into reasoning_content and content (and
harmony's calls into tool_calls), streamed and whole, through the official openai client; chat_template_kwargs
and reasoning_effort reach the template."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from tests.server_utils import ServerProcess
from tokenmill.server import reasoning

# ---------------------------------------------------------------------- the parsers, on written text


def _streamed(parser, text: str, step: int) -> list[dict]:
    deltas = []
    for end in range(step, len(text) + step, step):
        deltas += parser.feed(text[:end], final=end >= len(text))
    return deltas


THINK_CASES = [
    # (prompt's end, output, reasoning, content)
    ("", "<think>\nIt is 2 + 2.\n</think>\n\nFour.", "\nIt is 2 + 2.\n", "Four."),
    ("", "  <think>a < b</thi nk></think>Yes", "a < b</thi nk>", "Yes"),
    ("<think>\n", "opened by the prompt</think>\n\nDone", "opened by the prompt", "Done"),
    ("<think>\n\n</think>\n\n", "No thinking here.", None, "No thinking here."),
    ("", "Plain answer with a <think> inside.", None, "Plain answer with a <think> inside."),
    ("", "<think>cut off by max_tokens", "cut off by max_tokens", None),
    ("", "<thin", None, "<thin"),
    ("", "", None, None),
]


@pytest.mark.parametrize("prompt,text,thought,content", THINK_CASES)
def test_think_tags_streamed_and_whole(prompt, text, thought, content):
    whole = reasoning.parse(reasoning.new_parser("think", "<|im_start|>assistant\n" + prompt), text)
    assert whole.get("reasoning_content") == thought and whole["content"] == content
    for step in (1, 2, 5, max(len(text), 1)):
        deltas = _streamed(reasoning.new_parser("think", prompt), text, step)
        assert reasoning.merge(deltas) == whole
        assert all(len(d) == 1 and next(iter(d.values())) for d in deltas)  # no empty pieces


def _harmony_tokenizer(folder=None):
    """A small byte-level BPE tokenizer with harmony's markers as special tokens (gpt-oss's vocabulary
    is not on this machine); EOS is <|return|> alone, as in a GGUF file, so <|call|> must be added as a stop."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from tests.conftest import TEXT

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>",
                "<|constrain|>"]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([TEXT, "analysis final commentary functions to json weather Paris"] * 4, trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|return|>", pad_token="<|endoftext|>")
    hf.chat_template = HARMONY_TEMPLATE
    if folder is not None:
        hf.save_pretrained(folder)
    return hf


# A harmony-shaped template written for these tests (system, user and tool turns; the reply's header).
HARMONY_TEMPLATE = (
    "<|start|>system<|message|>Reasoning: {{ reasoning_effort | default('medium') }}<|end|>"
    "{% for m in messages %}"
    "{% if m.role == 'assistant' %}"
    "{% if m.thinking %}<|start|>assistant<|channel|>analysis<|message|>{{ m.thinking }}<|end|>{% endif %}"
    "<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>"
    "{% else %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}")

HARMONY_REPLY = ('<|channel|>analysis<|message|>User asks the weather in Paris. Call the tool.<|end|>'
                 '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
                 '{"city": "Paris", "unit": "celsius"}<|call|>')
HARMONY_ANSWER = ('<|channel|>analysis<|message|>The tool said 20.<|end|>'
                  '<|start|>assistant<|channel|>final<|message|>It is 20 C in Paris.<|return|>')


def _detokenized(tok, text: str) -> list[str]:
    """The texts the engine's detokenizer shows token by token (special tokens kept), as a stream sees them."""
    from tokenmill.engine.detokenizer import IncrementalDetokenizer
    from tokenmill.sampling_params import SamplingParams

    ids = tok.encode(text, add_special_tokens=False)
    prompt = tok.encode("<|start|>assistant", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok.backend_tokenizer, prompt, SamplingParams(skip_special_tokens=False))
    texts = []
    for i in ids:
        detok.add(i)
        texts.append(detok.visible_text(False))
    assert texts[-1] == text  # the markers survive detokenization as written
    return texts


def test_harmony_channels_and_calls_from_detokenized_tokens():
    tok = _harmony_tokenizer()
    for text, thought, content, calls in [
            (HARMONY_REPLY, "User asks the weather in Paris. Call the tool.", None,
             [("get_weather", '{"city": "Paris", "unit": "celsius"}')]),
            (HARMONY_ANSWER, "The tool said 20.", "It is 20 C in Paris.", []),
            # a preamble on the commentary channel is for the user; a message to a tool this server does not
            # run is the model's own working; a reply cut inside a header loses nothing it had said
            ("<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant to=browser.search<|channel|>"
             "commentary json<|message|>{\"q\": 1}<|call|>", '{"q": 1}', "Checking.", []),
            ("<|channel|>final<|message|>Short.<|end|><|start|>assistant<|chan", None, "Short.", []),
            ("no markup at all", None, "no markup at all", [])]:
        whole = reasoning.parse(reasoning.new_parser("harmony"), text)
        assert whole.get("reasoning_content") == thought and whole["content"] == content
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in whole.get("tool_calls", [])] == calls
        assert all(c["id"].startswith("call_") for c in whole.get("tool_calls", []))
        texts = _detokenized(tok, text)
        parser, deltas = reasoning.new_parser("harmony"), []
        for k, t in enumerate(texts):
            deltas += parser.feed(t, final=k == len(texts) - 1)
        streamed = reasoning.merge(deltas)
        for c in streamed.get("tool_calls", []):
            c["id"] = None
        for c in whole.get("tool_calls", []):
            c["id"] = None
        assert streamed == whole
        assert parser.calls == len(calls)
        assert not any("<|" in v for d in deltas for v in d.values() if isinstance(v, str))  # no markup leaks


def test_kind_for_templates_and_names():
    assert reasoning.kind_for(HARMONY_TEMPLATE, "auto") == "harmony"
    assert reasoning.kind_for("{{ '<think>' }}...{{ '</think>' }}", None) == "think"
    assert reasoning.kind_for("plain", "auto") is None
    assert reasoning.kind_for(HARMONY_TEMPLATE, "none") is None
    assert reasoning.kind_for("plain", "deepseek_r1") == "think"
    assert reasoning.kind_for("plain", "openai_gptoss") == "harmony"
    with pytest.raises(ValueError, match="reasoning parser must be one of"):
        reasoning.kind_for("plain", "granite")


# ---------------------------------------------------------------------- through the server


# A Qwen3-shaped template (written here): enable_thinking false closes an empty think in the prompt,
# think_in_prompt opens one (DeepSeek-R1's way); earlier replies carry their reasoning_content.
THINK_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' and m.reasoning_content %}<think>{{ m.reasoning_content }}</think>\n{% endif %}"
    "{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% elif think_in_prompt is defined and think_in_prompt %}<think>\n{% endif %}{% endif %}")

THOUGHT, ANSWER = "[a-z ]{4,40}", "[A-Z][a-z ]{4,40}"


@pytest.fixture(scope="module")
def server(default_gguf):
    s = ServerProcess(default_gguf, "--allow-request-chat-template", "--max-model-len", "512")
    yield s
    s.stop()


def _rendered(default_gguf, messages, **kwargs) -> list[int]:
    """The prompt's token ids as the server renders and encodes a chat request."""
    from tokenmill.llm import apply_chat_template
    from tokenmill.model.loader import load_tokenizer

    tok = load_tokenizer(default_gguf)
    text = apply_chat_template(tok, messages, THINK_TEMPLATE, chat_template_kwargs=kwargs or None)
    return tok.encode(text, add_special_tokens=False)


MESSAGES = [{"role": "user", "content": "Is the sky blue? Think first."}]


@pytest.mark.parametrize("regex,kwargs", [
    (f"<think>{THOUGHT}</think>\n\n{ANSWER}", {}),
    (f"{THOUGHT}</think>\n\n{ANSWER}", {"think_in_prompt": True}),
    (ANSWER, {"enable_thinking": False}),
])
def test_reasoning_content_against_the_raw_completion(server, default_gguf, regex, kwargs):
    """The raw text (the completions endpoint on the same rendered prompt and constraint) split by hand is
    the reference for the chat answer, whole and streamed, through the official openai client."""
    import openai

    raw = httpx.post(server.url + "/v1/completions", json={
        "prompt": _rendered(default_gguf, MESSAGES, **kwargs), "max_tokens": 80, "temperature": 0,
        "guided_regex": regex}, timeout=120).json()["choices"][0]["text"]
    assert re.fullmatch(regex, raw), raw
    if kwargs.get("enable_thinking") is False:
        want_thought, want_answer = None, raw
    else:
        head, _, want_answer = raw.partition("</think>\n\n")
        want_thought = head.removeprefix("<think>")

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x")
    model = client.models.list().data[0].id
    extra = {"guided_regex": regex, "chat_template": THINK_TEMPLATE, "chat_template_kwargs": kwargs}
    resp = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=80, temperature=0,
                                          extra_body=extra)
    msg = resp.choices[0].message
    assert msg.content == want_answer
    assert (msg.model_extra or {}).get("reasoning_content") == want_thought
    assert (msg.model_extra or {}).get("reasoning") == want_thought

    thought, answer, pieces = "", "", 0
    for ev in client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=80, temperature=0,
                                             stream=True, extra_body=extra):
        if not ev.choices:
            continue
        delta = ev.choices[0].delta
        extra_fields = delta.model_extra or {}
        assert extra_fields.get("reasoning") == extra_fields.get("reasoning_content")
        thought += extra_fields.get("reasoning_content") or ""
        answer += delta.content or ""
        pieces += 1
    assert thought == (want_thought or "") and answer == want_answer
    assert pieces > 3  # token by token, not one piece at the end


def test_include_reasoning_false_returns_the_answer_alone(server, default_gguf):
    """include_reasoning: false (vLLM's switch): the same answer as the raw text split by hand, with no
    reasoning in the message or in any streamed delta."""
    import openai

    regex = f"<think>{THOUGHT}</think>\n\n{ANSWER}"
    raw = httpx.post(server.url + "/v1/completions", json={
        "prompt": _rendered(default_gguf, MESSAGES), "max_tokens": 80, "temperature": 0,
        "guided_regex": regex}, timeout=120).json()["choices"][0]["text"]
    want_answer = raw.partition("</think>\n\n")[2]
    assert want_answer
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x")
    model = client.models.list().data[0].id
    extra = {"guided_regex": regex, "chat_template": THINK_TEMPLATE, "include_reasoning": False}
    msg = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=80, temperature=0,
                                         extra_body=extra).choices[0].message
    assert msg.content == want_answer
    assert not {"reasoning_content", "reasoning"} & set(msg.model_extra or {})
    answer, pieces = "", 0
    for ev in client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=80, temperature=0,
                                             stream=True, extra_body=extra):
        if not ev.choices:
            continue
        assert not {"reasoning_content", "reasoning"} & set(ev.choices[0].delta.model_extra or {})
        answer += ev.choices[0].delta.content or ""
        pieces += 1
    assert answer == want_answer and pieces > 3


def test_template_kwargs_and_earlier_reasoning_reach_the_template(server, default_gguf):
    from tokenmill.server.openai_routes import chat_prompt
    from tokenmill.server.protocol import ChatCompletionRequest
    from tokenmill.model.loader import load_tokenizer
    from tokenmill.server import tools

    body = ChatCompletionRequest(messages=[
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello.", "reasoning_content": "greet back"},
        {"role": "user", "content": "Again"}], chat_template=THINK_TEMPLATE,
        chat_template_kwargs={"enable_thinking": False})
    text = chat_prompt(load_tokenizer(default_gguf), body, {}, "none", tools.FORMATS["hermes"])
    assert "<think>greet back</think>\nHello." in text and text.endswith("<think>\n\n</think>\n\n")

    r = httpx.post(server.url + "/v1/chat/completions", json={
        "messages": MESSAGES, "chat_template": THINK_TEMPLATE, "chat_template_kwargs": {"add_generation_prompt": False},
        "max_tokens": 4}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"
    assert "add_generation_prompt" in r.json()["error"]["message"]
    # a plain template: no reasoning parsed, content is the raw text as before
    r = httpx.post(server.url + "/v1/chat/completions", json={
        "messages": MESSAGES, "max_tokens": 8, "temperature": 0, "guided_regex": "<think>[a-z]{3}</think>"},
        timeout=60).json()
    assert r["choices"][0]["message"]["content"].startswith("<think>")
    assert "reasoning_content" not in r["choices"][0]["message"]


@pytest.fixture(scope="module")
def harmony_model(tmp_path_factory):
    """A tiny random gpt-oss model behind the harmony tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM

    from tests.conftest import gpt_oss_config

    folder = tmp_path_factory.mktemp("harmony")
    tok = _harmony_tokenizer(str(folder))
    common = dict(vocab_size=len(tok), hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=512, initializer_range=0.2, eos_token_id=tok.eos_token_id,
                  pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(gpt_oss_config(common), dtype=torch.float32).save_pretrained(folder)
    return str(folder), tok


def test_harmony_requests_keep_markers_and_stop_at_a_call(harmony_model):
    folder, tok = harmony_model
    call, channel, message = (tok.convert_tokens_to_ids(t) for t in ("<|call|>", "<|channel|>", "<|message|>"))
    s = ServerProcess(folder)
    try:
        # <|call|> is not the file's EOS: the reply still ends there, as a harmony reply does
        r = httpx.post(s.url + "/v1/chat/completions", json={
            "messages": MESSAGES, "max_tokens": 16, "logit_bias": {str(call): 100}}, timeout=60).json()
        assert r["usage"]["completion_tokens"] == 1 and r["choices"][0]["finish_reason"] == "stop"
        # the markers reach the parser (skip_special_tokens off): a message on no channel is not the answer
        r = httpx.post(s.url + "/v1/chat/completions", json={
            "messages": MESSAGES, "max_tokens": 6, "logit_bias": {str(message): 100}}, timeout=60).json()
        assert r["usage"]["completion_tokens"] == 6 and r["choices"][0]["message"]["content"] is None
        assert r["choices"][0]["message"]["reasoning_content"]
        # the same through the completions endpoint: raw text, markers skipped as asked by default
        raw = httpx.post(s.url + "/v1/completions", json={
            "prompt": "Hi", "max_tokens": 3, "logit_bias": {str(channel): 100}}, timeout=60).json()
        assert raw["choices"][0]["text"] == ""
        r = httpx.post(s.url + "/v1/chat/completions", json={
            "messages": MESSAGES, "max_tokens": 4, "tools": [{"type": "function", "function": {
                "name": "f", "parameters": {"type": "object"}}}], "tool_choice": "required"}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
        # random text with no markup is the answer, streamed as it comes
        events = []
        with httpx.stream("POST", s.url + "/v1/chat/completions", json={
                "messages": MESSAGES, "max_tokens": 12, "stream": True, "temperature": 0,
                "logit_bias": {str(t): -100 for t in tok.all_special_ids}}, timeout=60) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    events.append(json.loads(line[6:]))
        streamed = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
        whole = httpx.post(s.url + "/v1/chat/completions", json={
            "messages": MESSAGES, "max_tokens": 12, "temperature": 0,
            "logit_bias": {str(t): -100 for t in tok.all_special_ids}}, timeout=60).json()
        assert streamed and streamed == whole["choices"][0]["message"]["content"]
    finally:
        s.stop()


CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                         "sunny": {"type": "boolean"}}, "required": ["city", "sunny"]}


@pytest.mark.parametrize("kwargs", [{"think_in_prompt": True}, {}])
def test_an_output_format_holds_after_the_reasoning(server, kwargs):
    """response_format constrains the answer, not the reasoning: the model thinks freely first (here nudged to
    close its thoughts soon, a small model rambles), then writes JSON that follows the schema."""
    import jsonschema

    close = [9617, 17400, 46]  # "</", "think", ">" in the default model's vocabulary
    for seed in range(3):
        r = httpx.post(server.url + "/v1/chat/completions", json={
            "messages": MESSAGES, "chat_template": THINK_TEMPLATE, "chat_template_kwargs": kwargs,
            "max_tokens": 120, "temperature": 1.0, "seed": seed, "logit_bias": {str(t): 8 for t in close},
            "response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": CITY, "strict": True}}},
            timeout=120).json()
        msg = r["choices"][0]["message"]
        if r["choices"][0]["finish_reason"] == "length":
            continue  # still thinking at max_tokens: nothing to check
        # (with the prompt's <think> open, a constraint from the first token would leave no answer at all)
        jsonschema.validate(json.loads(msg["content"]), CITY)
        return
    pytest.fail("no answer within max_tokens in 3 tries")


def test_a_bad_schema_with_reasoning_is_a_400(server):
    r = httpx.post(server.url + "/v1/chat/completions", json={
        "messages": MESSAGES, "chat_template": THINK_TEMPLATE, "max_tokens": 4,
        "response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "nonsense"}}}},
        timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"
