"""Sliding attention windows per layer (Qwen2/Qwen3's max_window_layers, explicit layer_types, Mistral's
one window) against transformers: module by module in float32, and through the fused decoder in bfloat16."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.conftest import PROMPTS, save_tiny_models
from tokenmill import LLM, SamplingParams
from tokenmill.kernels import cpu as cpu_kernels
from tokenmill.model.llama import layer_windows

WINDOW = 8
MAX_NEW = 24


def _window_configs(vocab: int) -> dict:
    from transformers import Qwen2Config, Qwen3Config

    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  initializer_range=0.2, eos_token_id=2, bos_token_id=1, pad_token_id=0)
    return {
        # Full attention in layer 0, the window from layer 1 on.
        "qwen2-max-window-layers": Qwen2Config(**common, use_sliding_window=True, sliding_window=WINDOW,
                                               max_window_layers=1),
        # Interleaved; max_window_layers (28 by default) would make every layer full: layer_types wins.
        "qwen3-layer-types": Qwen3Config(**common, use_sliding_window=True, sliding_window=WINDOW,
                                         layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    }


@pytest.fixture(scope="module")
def window_models(tmp_path_factory) -> dict[str, str]:
    paths = save_tiny_models(tmp_path_factory.mktemp("windows"), _window_configs)
    # As released Qwen2.5 configs: no layer_types, only use_sliding_window and max_window_layers.
    path = os.path.join(paths["qwen2-max-window-layers"], "config.json")
    with open(path) as f:
        c = json.load(f)
    del c["layer_types"]
    with open(path, "w") as f:
        json.dump(c, f)
    return paths


def _reference(folder: str):
    """transformers' model in float32 with eager attention (whose masks carry the windows)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    assert "sliding_attention" in model.config.layer_types and "full_attention" in model.config.layer_types
    return model


_greedy_cache: dict[str, tuple] = {}


def _hf_greedy(folder: str, prompts: list[list[int]]):
    if folder not in _greedy_cache:
        model = _reference(folder)
        tokens, logprobs = [], []
        with torch.no_grad():
            for ids in prompts:
                x = torch.tensor([ids])
                out = model.generate(x, max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW, do_sample=False,
                                     pad_token_id=0)
                tokens.append(out[0, len(ids):].tolist())
                logprobs.append(model(x).logits[0, -1].float().log_softmax(-1))
        _greedy_cache[folder] = tokens, logprobs
    return _greedy_cache[folder]


def test_layer_windows_follow_transformers_configs():
    """Each layer's window as transformers' own configs decide it, for the config shapes models ship."""
    from transformers import MistralConfig, Qwen2Config, Qwen3Config

    small = dict(num_hidden_layers=5, hidden_size=64, num_attention_heads=4)
    derived = [  # layer_types derived from max_window_layers
        Qwen2Config(**small, use_sliding_window=True, sliding_window=16, max_window_layers=2),
        Qwen2Config(**small, use_sliding_window=True, sliding_window=16, max_window_layers=0),
        Qwen2Config(**small, use_sliding_window=False, sliding_window=16, max_window_layers=2),  # Qwen2.5's
        Qwen3Config(**small, use_sliding_window=True, sliding_window=16, max_window_layers=4),
    ]
    explicit = Qwen3Config(**small, use_sliding_window=True, sliding_window=16,
                           layer_types=["sliding_attention", "full_attention"] * 2 + ["sliding_attention"])
    for cfg in derived + [explicit]:
        want = [cfg.sliding_window if t == "sliding_attention" else None for t in cfg.layer_types]
        c = cfg.to_dict()
        assert layer_windows(c) == want, c
        if cfg is not explicit:  # a config.json without layer_types: the same windows from max_window_layers
            del c["layer_types"]
            assert layer_windows(c) == want, c
    assert layer_windows(MistralConfig(**small, sliding_window=16).to_dict(), per_layer=False) == [16] * 5
    assert layer_windows(MistralConfig(**small, sliding_window=None).to_dict(), per_layer=False) == [None] * 5
    # A hand-written config.json as Mistral's: one window, no use_sliding_window key.
    assert layer_windows({"num_hidden_layers": 2, "sliding_window": 4096}) == [4096, 4096]
    with pytest.raises(ValueError, match="chunked_attention"):
        layer_windows({"num_hidden_layers": 2, "sliding_window": 8,
                       "layer_types": ["chunked_attention", "full_attention"]})
    with pytest.raises(ValueError, match="3 layers"):
        layer_windows({"num_hidden_layers": 2, "sliding_window": 8, "layer_types": ["full_attention"] * 3})


MODES = {
    "plain": {},
    # Prompts in chunks of 7 over blocks of 4: windows reach back into earlier chunks and blocks.
    "chunked": {"max_num_batched_tokens": 7, "block_size": 4},
    "portable": {},  # the torch decode path used where the CPU kernels cannot be built
}


@pytest.mark.parametrize("name", ["qwen2-max-window-layers", "qwen3-layer-types"])
@pytest.mark.parametrize("mode", list(MODES))
def test_float32_greedy_with_layer_windows_matches_transformers(window_models, name, mode, monkeypatch):
    folder = window_models[name]
    if mode == "portable":
        monkeypatch.setattr(cpu_kernels, "load", lambda: None)
    llm = LLM(folder, dtype="float32", seed=0, **MODES[mode])
    windows = llm.engine.model.config.layer_windows
    assert None in windows and WINDOW in windows, windows
    tok = llm.get_tokenizer()
    prompt_ids = [tok.encode(p) for p in PROMPTS]
    assert sum(len(p) > WINDOW for p in prompt_ids) >= 4, "most prompts must outgrow the window"
    ref_tokens, ref_logprobs = _hf_greedy(folder, prompt_ids)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, min_tokens=MAX_NEW, logprobs=5)
    outs = llm.generate(prompt_ids, params, use_tqdm=False)
    for i, out in enumerate(outs):
        assert out.outputs[0].token_ids == ref_tokens[i], f"prompt {i} differs from transformers"
        first = out.outputs[0].logprobs[0]
        top = torch.topk(ref_logprobs[i], 5)
        for value, token in zip(top.values.tolist(), top.indices.tolist()):
            assert token in first and abs(first[token].logprob - value) < 1e-4, (i, token)


@pytest.mark.skipif(cpu_kernels.load() is None, reason="the CPU decode kernels do not run here")
@pytest.mark.parametrize("name", ["qwen2-max-window-layers", "qwen3-layer-types"])
# 1 and 3 requests: one parallel region per step; 11: the batched path; burst: greedy steps back to back.
@pytest.mark.parametrize("case", ["fused-1", "fused-3", "fused-11", "burst-3"])
def test_bfloat16_fused_decode_with_layer_windows_tracks_transformers(window_models, name, case):
    """bf16 through the fused decoder against transformers in float32, teacher-forced on our tokens (as in
    test_reference's bf16 test): each token is the reference's greedy choice up to bf16 rounding, and its
    logprob agrees with the reference's."""
    folder = window_models[name]
    burst = case.startswith("burst")
    num_requests = int(case.split("-")[1])
    llm = LLM(folder, dtype="bfloat16", seed=0, kv_cache_memory=1 << 22, num_scheduler_steps=8 if burst else 1)
    model, runner = llm.engine.model, llm.engine.runner
    used, bursts = [], []
    pick, run_burst = model._fused_decoder, runner.execute_burst
    model._fused_decoder = lambda *a: used.append(pick(*a)) or used[-1]
    runner.execute_burst = lambda *a, **k: bursts.append(run_burst(*a, **k)) or bursts[-1]
    tok = llm.get_tokenizer()
    prompt_ids = [tok.encode(p) for p in PROMPTS + [p + " again" for p in PROMPTS[:3]]][:num_requests]
    # Bursts run for plain greedy requests only: no logprobs, no min_tokens.
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=None if burst else 1)
    outs = llm.generate(prompt_ids, params, use_tqdm=False)
    fused_calls = sum(f is not None for f in used)  # a burst asks once for all its steps
    assert fused_calls >= 2 if burst else fused_calls > MAX_NEW // 2, "decode steps should run fused"
    assert any(bursts) == burst  # whether a burst ran

    ref = _reference(folder)
    lp_err, gaps = [], []
    for ids, out in zip(prompt_ids, outs):
        gen = out.outputs[0].token_ids
        assert len(gen) == MAX_NEW and len(ids) + MAX_NEW > 3 * WINDOW
        with torch.no_grad():
            lps = ref(torch.tensor([ids + gen])).logits[0].float().log_softmax(-1)
        for j, t in enumerate(gen[1:], start=1):  # the decode steps (the first token comes from prefill)
            row = lps[len(ids) + j - 1]
            gaps.append(float(row.max() - row[t]))
            if not burst:
                lp_err.append(abs(out.outputs[0].logprobs[j][t].logprob - float(row[t])))
    # The bounds of test_reference's bf16 test: rounding moves these tiny models' logprobs by ~0.02 nats;
    # a wrong operation, by 1 or more on average.
    assert sum(gaps) / len(gaps) < 0.03 and max(gaps) < 1.0, (sum(gaps) / len(gaps), max(gaps))
    if lp_err:
        assert sum(lp_err) / len(lp_err) < 0.06 and max(lp_err) < 0.5, (sum(lp_err) / len(lp_err), max(lp_err))
