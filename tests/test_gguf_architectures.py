"""GGUF files of each family against transformers on the Hugging Face folder each was made from: Llama 3.1
(llama3 rope scaling stored as a rope_freqs tensor), Llama 3.2 (the same, embeddings tied), Gemma 2 and
Gemma 3 (norms stored as 1 + w, four norms a layer, local and global layers), Phi-3 and Phi-4-mini (merged
attn_qkv and ffn_up, LongRoPE factors as tensors, partial rotary), gpt-oss (YaRN from metadata, attention
sinks as tensors, biased experts, in F32 and in MXFP4); and files that cannot load."""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from tests.conftest import (PROMPTS, gpt_oss_config, hf_greedy, phi3_configs, save_tiny_models,  # noqa: E402
                            teacher_forced_scores)
from tests.gguf_models import write_llama_gguf  # noqa: E402
from tokenmill import LLM, SamplingParams  # noqa: E402

MAX_NEW = 24
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}


def _configs(vocab: int) -> dict:
    from transformers import Gemma2Config, Gemma3TextConfig, LlamaConfig

    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  initializer_range=0.2, eos_token_id=2, bos_token_id=1, pad_token_id=0)
    return {
        "llama3.1": LlamaConfig(**common, rope_theta=500000.0, rope_scaling=LLAMA3),
        "llama3.2": LlamaConfig(**common, rope_theta=500000.0, rope_scaling=LLAMA3, tie_word_embeddings=True),
        "gemma2": Gemma2Config(**common, head_dim=16, sliding_window=8, query_pre_attn_scalar=16,
                               attn_logit_softcapping=1.0, final_logit_softcapping=1.5),
        # Six layers, the sixth global (the pattern a GGUF leaves unsaid); a scaled rope on it (a Gemma 3 4B's
        # kind); query_pre_attn_scalar equal to head_dim, as in the released models but the 27B.
        "gemma3": Gemma3TextConfig(**{**common, "num_hidden_layers": 6}, head_dim=32, sliding_window=8,
                                   query_pre_attn_scalar=32, rope_scaling={"rope_type": "linear", "factor": 2.0}),
        **phi3_configs(common),
        # GGUF files hold no clamp: llama.cpp applies gpt-oss's 7.
        "gpt-oss": gpt_oss_config(common, swiglu_limit=7.0),
    }


def _float(name: str) -> str:
    return "F32"


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, tuple[str, str]]:
    """(HF folder, GGUF file made from it) per name."""
    root = tmp_path_factory.mktemp("gguf-archs")
    folders = save_tiny_models(root, _configs)
    return {name: (folder, write_llama_gguf(root / f"{name}.gguf", folder, _float)) for name, folder in folders.items()}


@pytest.mark.parametrize("name", ["llama3.1", "llama3.2", "gemma2", "gemma3", "phi3", "phi4-mini", "gpt-oss"])
def test_gguf_greedy_matches_transformers_on_its_folder(files, name):
    from transformers import AutoTokenizer

    folder, path = files[name]
    llm = LLM(path, dtype="float32", seed=0, block_size=4)
    model = llm.engine.model
    cfg = model.config
    if name.startswith("llama"):
        assert cfg.ropes[0].scaling["rope_type"] == "freq_factors"
        assert (model.lm_head is None) == (name == "llama3.2")
    elif name.startswith("phi"):
        assert cfg.ropes[0].scaling["rope_type"] == "longrope" and model.kv_recompute_length == 24
        assert (cfg.rotary_dim, cfg.layer_windows[0], model.lm_head is None) == \
            ((16, 20, False) if name == "phi3" else (12, None, True))
    elif name == "gpt-oss":  # YaRN from the file's keys, unrounded as gpt-oss defines it; sinks; windows of 8
        assert cfg.ropes[0].scaling == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                                        "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}
        assert cfg.attn_sinks and cfg.layer_windows == [8, None, 8] and cfg.moe.expert_bias
    else:
        assert cfg.norm_offset == 1.0 and cfg.sandwich_norms and None in cfg.layer_windows and 8 in cfg.layer_windows
    tok = AutoTokenizer.from_pretrained(folder)
    prompt_ids = [tok.encode(p) for p in PROMPTS]
    ref_tokens, ref_logprobs = hf_greedy(folder, prompt_ids, MAX_NEW)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, min_tokens=MAX_NEW, logprobs=5)
    outs = llm.generate(prompt_ids, params, use_tqdm=False)
    for i, out in enumerate(outs):
        assert out.outputs[0].token_ids == ref_tokens[i], f"prompt {i} differs from transformers"
        first = out.outputs[0].logprobs[0]
        top = torch.topk(ref_logprobs[i], 5)
        for value, token in zip(top.values.tolist(), top.indices.tolist()):
            assert token in first and abs(first[token].logprob - value) < 1e-4, (i, token)


def test_rope_freqs_hold_the_llama3_scaling(files):
    """The file's factors divide the frequencies as transformers' llama3 scaling scales them."""
    from tokenmill.model.gguf_loader import GGUFFile, read_config
    from tokenmill.model.rotary import rope_inv_freq

    folder, path = files["llama3.1"]
    config = read_config(GGUFFile(path))
    from_file, _ = rope_inv_freq(16, config["rope_theta"], config["rope_scaling"])
    from_folder, _ = rope_inv_freq(16, 500000.0, LLAMA3)
    plain, _ = rope_inv_freq(16, 500000.0, None)
    assert torch.allclose(from_file, from_folder, rtol=1e-6) and not torch.allclose(from_file, plain, rtol=0.1)


@pytest.mark.parametrize("name,missing", [("llama3.1", "blk.1.attn_k.weight"), ("llama3.1", "blk.0.ffn_gate.weight"),
                                          ("llama3.1", "output_norm.weight"), ("gemma3", "blk.2.post_ffw_norm.weight"),
                                          ("gemma3", "blk.0.attn_q_norm.weight"), ("phi3", "blk.1.attn_qkv.weight"),
                                          ("phi3", "blk.0.ffn_up.weight"), ("gpt-oss", "blk.1.attn_sinks.weight"),
                                          ("gpt-oss", "blk.0.ffn_up_exps.bias")])
def test_a_missing_tensor_is_named(files, tmp_path, name, missing):
    """A file without one of the model's tensors is refused with that tensor's GGUF name, a part of a
    merged projection (k of q/k/v, gate of gate/up) too."""
    folder, _ = files[name]
    path = write_llama_gguf(tmp_path / "incomplete.gguf", folder, _float, skip=(missing,))
    with pytest.raises(ValueError, match=rf"incomplete.gguf lacks tensor '{re.escape(missing)}'"):
        LLM(path, dtype="float32")


def test_unsupported_architectures_list_the_supported_ones(files, tmp_path):
    folder, path = files["gemma3"]
    gguf_path = tmp_path / "falcon.gguf"
    writer = gguf.GGUFWriter(str(gguf_path), "falcon")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"unsupported GGUF architecture 'falcon'; supported: gemma2, gemma3, gpt-oss, "
                                         r"llama, "
                                         r"mistral, phi3, qwen2, qwen2moe, qwen3, qwen3moe"):
        LLM(str(gguf_path), dtype="float32")
    # Gemma 3's multimodal checkpoints (image and text) name another class than the text model's.
    multimodal = tmp_path / "gemma3-vision"
    multimodal.mkdir()
    for f in os.listdir(folder):
        os.symlink(os.path.join(folder, f), multimodal / f)
    os.remove(multimodal / "config.json")
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    (multimodal / "config.json").write_text(json.dumps({**config, "architectures": ["Gemma3ForConditionalGeneration"]}))
    with pytest.raises(ValueError, match=r"unsupported model architecture \['Gemma3ForConditionalGeneration'\]; "
                                         r"supported: Gemma2ForCausalLM, Gemma3ForCausalLM, GptOssForCausalLM, "
                                         r"LlamaForCausalLM"):
        LLM(str(multimodal), dtype="float32")


def test_phi3_merged_projections_run_in_their_block_format(files, tmp_path):
    """A Q8_0 Phi-3 file: attn_qkv and ffn_up stay one quantized matrix each (the format's kernel runs the
    merged product), and agree with the same file dequantized: teacher-forced logprobs within 0.1 nats."""
    from tokenmill.kernels import quant

    if quant.load() is None:
        pytest.skip("the quantized-weight kernels could not be built here")
    folder, _ = files["phi4-mini"]
    path = write_llama_gguf(tmp_path / "phi-q8.gguf", folder, lambda name: "Q8_0")
    native = LLM(path, dtype="float32", seed=0)
    layer = native.engine.model.layers[0]
    for merged, rows in ((layer.self_attn.qkv_proj, 64 + 2 * 32), (layer.mlp.gate_up_proj, 256)):
        assert merged.weight is None and merged.qweight.name == "Q8_0" and merged.qweight.shape == (rows, 64)
    reference = LLM(path, dtype="float32", seed=0, quantization="none")
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    prompts = [native.get_tokenizer().encode(p) for p in PROMPTS]
    got, want = (llm.generate(prompts, params, use_tqdm=False) for llm in (native, reference))
    for prompt, g, w in zip(prompts, got, want):
        for tok, lg, lw in zip(prompt[1:], g.prompt_logprobs[1:], w.prompt_logprobs[1:]):
            assert abs(lg[tok].logprob - lw[tok].logprob) < 0.1


def test_gpt_oss_experts_run_in_mxfp4(files, tmp_path):
    """gpt-oss as its GGUF files ship: the experts in MXFP4, read in place by the MXFP4 kernel (no float copy),
    the rest F32. Reference: transformers on the same folder, each expert matrix replaced by its MXFP4 values,
    teacher-forced on our tokens. Module by module with float inputs everywhere: prompt and decode logprobs
    within 1e-4, every token the reference's greedy choice. Fused decode steps on int8 inputs (as llama.cpp
    multiplies them): prompt logprobs still within 1e-4 (a prompt's rows take float inputs); decoded tokens
    the reference's choice at 95% of positions or more, within the int8 rounding (which also flips a near
    tie between two experts here and there: 1.2 nats at one position of 128, the same module by module)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tokenmill.kernels import quant

    folder, _ = files["gpt-oss"]
    path = write_llama_gguf(tmp_path / "gpt-oss-mxfp4.gguf", folder, lambda name: "MXFP4" if "_exps" in name else "F32")
    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    mxfp4 = gguf.GGMLQuantizationType.MXFP4
    with torch.no_grad():
        for layer in ref.model.layers:
            for p in (layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj):  # [E, cols, rows]
                rows = np.ascontiguousarray(p.transpose(1, 2).numpy())  # each row quantized along its inputs
                values = gguf.quants.dequantize(gguf.quants.quantize(rows, mxfp4), mxfp4)
                p.copy_(torch.from_numpy(values.reshape(rows.shape)).transpose(1, 2))
    tok = AutoTokenizer.from_pretrained(folder)
    prompts = [tok.encode(p) for p in PROMPTS]

    def run(fused: bool) -> tuple[np.ndarray, np.ndarray]:  # per decoded token: gap to the top choice, logprob error
        llm = LLM(path, dtype="float32", seed=0, kv_cache_memory="16MiB")
        model = llm.engine.model
        model.use_fused_decode = fused
        experts = model.layers[0].mlp.experts
        assert experts.gate_up_proj is None and experts.down_proj is None
        assert {w.name for w in experts.qparts} == {"MXFP4"}
        used = []
        pick = model._fused_decoder
        model._fused_decoder = lambda *a: used.append(pick(*a)) or used[-1]
        prompt_err, gaps, errors = teacher_forced_scores(llm, ref, prompts)
        assert any(f is not None for f in used) == fused
        assert prompt_err <= 1e-4, prompt_err
        return gaps, errors

    quant.set_float_rows(1)
    try:
        gaps, errors = run(fused=False)
    finally:
        quant.set_float_rows(0)
    assert gaps.max() == 0 and errors.max() < 1e-4, (gaps.max(), errors.max())
    gaps, errors = run(fused=True)
    assert np.mean(gaps == 0) >= 0.95 and gaps.mean() < 0.03, (np.mean(gaps == 0), gaps.mean())
    assert errors.mean() < 0.05, errors.mean()
