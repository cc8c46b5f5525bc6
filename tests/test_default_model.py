"""The real default model from its GGUF file against transformers loading the same file."""

from __future__ import annotations

import os

import pytest
import torch

from tokenmill import LLM, SamplingParams

pytestmark = pytest.mark.slow

VARIED_TEXT = [
    "Hello world",
    "  leading spaces and\ttabs\n\n\nnewlines   trailing  ",
    "def f(x):\n    return {'a': [1, 2.5e-3, None]}  # comment\n",
    "Ünïcödé café naïve — “quotes” 日本語のテキスト 🙂🚀 👩‍👩‍👧",
    "<|im_start|>user\nHi<|im_end|>\n",
    "1234567890 3.14159 0x1F $100,000",
]

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time,"]


@pytest.fixture(scope="module")
def hf_gguf(default_gguf):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.dirname(default_gguf), os.path.basename(default_gguf)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    return tok, model


@pytest.fixture(scope="module")
def llm32():
    return LLM(dtype="float32")


def test_tokenizer_matches_transformers(hf_gguf, llm32):
    ref, _ = hf_gguf
    ours = llm32.get_tokenizer()
    for text in VARIED_TEXT:
        ids = ours.encode(text)
        assert ids == ref.encode(text), text
        assert ours.decode(ids) == ref.decode(ids)
    assert ours.eos_token_id == ref.eos_token_id


def test_greedy_matches_transformers(hf_gguf, llm32):
    ref_tok, model = hf_gguf
    outs = llm32.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=32, min_tokens=32))
    with torch.no_grad():
        for prompt, out in zip(PROMPTS, outs):
            ids = ref_tok(prompt, return_tensors="pt").input_ids
            assert out.prompt_token_ids == ids[0].tolist()
            ref = model.generate(ids, max_new_tokens=32, min_new_tokens=32, do_sample=False,
                                 pad_token_id=ref_tok.eos_token_id)
            assert out.outputs[0].token_ids == ref[0, ids.shape[1]:].tolist(), prompt
            assert out.outputs[0].text == ref_tok.decode(ref[0, ids.shape[1]:])


def test_chat_uses_template(llm32):
    out = llm32.chat([{"role": "user", "content": "What is 2+2?"}], SamplingParams(temperature=0, max_tokens=24))
    tok = llm32.get_tokenizer()
    prompt = tok.decode(out[0].prompt_token_ids)
    assert prompt.startswith("<|im_start|>system") and prompt.endswith("<|im_start|>assistant\n")
    assert out[0].outputs[0].finish_reason in ("stop", "length")
    assert "4" in out[0].outputs[0].text
