"""gpt-oss from a Hugging Face folder as OpenAI ships it: the experts in MXFP4 (<proj>_blocks and
<proj>_scales, quantization_config quant_method "mxfp4"), against transformers loading the same folder
(dequantized by its own MXFP4 code). The float folder's equality with transformers in every scheduling mode
is in test_reference.py (gpt-oss is in conftest.ARCHS); GGUF files in test_gguf_architectures.py."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch

from tests.conftest import PROMPTS, teacher_forced_scores
from tokenmill import LLM
from tokenmill.kernels import quant

gguf = pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def mxfp4_folder(tiny_models, tmp_path_factory) -> str:
    """The tiny gpt-oss with its experts in OpenAI's MXFP4 layout: each row's 32-element blocks, a byte its
    E8M0 scale and 16 bytes of codes, element 2j in the low nibble of byte j (made with gguf's MXFP4
    rounding, then laid out as the released checkpoints are)."""
    from safetensors.torch import load_file, save_file

    src = tiny_models["gpt-oss"]
    dst = str(tmp_path_factory.mktemp("gpt-oss") / "mxfp4")
    shutil.copytree(src, dst)
    state = load_file(os.path.join(src, "model.safetensors"))
    out = {}
    for name, t in state.items():
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            out[name] = t
            continue
        rows = t.transpose(1, 2).contiguous().numpy()  # [E, out features, in features]
        e, r, c = rows.shape
        q = gguf.quants.quantize(rows.reshape(e * r, c), gguf.GGMLQuantizationType.MXFP4).reshape(e, r, c // 32, 17)
        codes = np.concatenate([q[..., 1:] & 0xF, q[..., 1:] >> 4], axis=-1)  # GGUF: element j low, j + 16 high
        out[f"{name}_blocks"] = torch.from_numpy(np.ascontiguousarray(codes[..., 0::2] | (codes[..., 1::2] << 4)))
        out[f"{name}_scales"] = torch.from_numpy(np.ascontiguousarray(q[..., 0]))
    os.remove(os.path.join(dst, "model.safetensors"))
    save_file(out, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(dst, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    return dst


def _reference(folder: str):
    from transformers import AutoModelForCausalLM, Mxfp4Config

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager",
                                                quantization_config=Mxfp4Config(dequantize=True)).eval()


def test_mxfp4_experts_stay_in_their_blocks(mxfp4_folder):
    """The experts load as MXFP4 blocks (no float copy) and run on the MXFP4 kernel. Module by module with
    float inputs everywhere: every logprob within 1e-4 of transformers', every token its greedy choice. With
    the fused decode step (int8 inputs): prompt logprobs still within 1e-4, decoded tokens the reference's
    choice at 95% of positions or more."""
    if quant.load() is None:
        pytest.skip("the quantized-weight kernels could not be built here")
    ref = _reference(mxfp4_folder)
    llm = LLM(mxfp4_folder, dtype="float32", seed=0, kv_cache_memory="16MiB")
    tok = llm.get_tokenizer()
    prompts = [tok.encode(p) for p in PROMPTS]
    model = llm.engine.model
    for layer in model.layers:
        experts = layer.mlp.experts
        assert experts.gate_up_proj is None and experts.down_proj is None
        assert [w.name for w in experts.qparts] == ["MXFP4"] * 3
    model.use_fused_decode = False
    quant.set_float_rows(1)
    try:
        prompt_err, gaps, errors = teacher_forced_scores(llm, ref, prompts)
    finally:
        quant.set_float_rows(0)
    assert prompt_err < 1e-4 and gaps.max() == 0 and errors.max() < 1e-4, (prompt_err, gaps.max(), errors.max())
    model.use_fused_decode = True
    llm.engine.reset_prefix_cache()
    prompt_err, gaps, errors = teacher_forced_scores(llm, ref, prompts)
    assert prompt_err < 1e-4
    assert np.mean(gaps == 0) >= 0.95 and gaps.mean() < 0.03 and errors.mean() < 0.05, \
        (np.mean(gaps == 0), gaps.mean(), errors.mean())


@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_mxfp4_experts_dequantized_where_asked(mxfp4_folder, quantization):
    """quantization="none" dequantizes the blocks at load (transformers' numbers: greedy tokens equal, logprobs
    within 1e-4); "int8" requantizes those values as Q8_0 like any float checkpoint's weights (the reference
    then holds the same Q8_0 values: prompt logprobs within 1e-4)."""
    ref = _reference(mxfp4_folder)
    if quantization == "int8":
        if quant.load() is None:
            pytest.skip("the quantized-weight kernels could not be built here")
        with torch.no_grad():
            for name, p in ref.named_parameters():
                if p.dim() >= 2 and not name.endswith(("router.weight", "_bias")):
                    w = p.transpose(1, 2) if ".experts." in name else p  # experts [E, cols, rows]
                    w.copy_(quant.quantize(w.reshape(-1, w.shape[-1]), 8).dequantize().reshape(w.shape))
    llm = LLM(mxfp4_folder, dtype="float32", seed=0, kv_cache_memory="16MiB", quantization=quantization)
    experts = llm.engine.model.layers[0].mlp.experts
    if quantization == "none":
        assert experts.gate_up_proj is not None and not experts.qparts
    else:
        assert {w.name for w in experts.qparts} == {"Q8_0"}
    tok = llm.get_tokenizer()
    prompt_err, gaps, errors = teacher_forced_scores(llm, ref, [tok.encode(p) for p in PROMPTS])
    assert prompt_err < 1e-4
    if quantization == "none":
        assert gaps.max() == 0 and errors.max() < 1e-4
    else:  # decode on int8 inputs, every projection's (seen: 94.5% of tokens the top choice, mean gap 0.005)
        assert np.mean(gaps == 0) >= 0.9 and gaps.mean() < 0.03, (np.mean(gaps == 0), gaps.mean())


def test_a_lone_half_of_a_projection_is_named(mxfp4_folder, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = str(tmp_path / "broken")
    shutil.copytree(mxfp4_folder, folder)
    state = load_file(os.path.join(folder, "model.safetensors"))
    del state["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(state, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.experts\.down_proj_blocks without its scales"):
        LLM(folder, dtype="float32", kv_cache_memory="16MiB")
