"""Mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE): routing as each reference routes, experts run
grouped (one product per active expert, never a loop over tokens), GGUF files with stacked expert tensors,
and the fused decode step running them. Greedy equality in every scheduling mode is in
test_reference.py (the MoE architectures are in conftest.ARCHS)."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch

from tests.conftest import PROMPTS, hf_greedy, moe_configs, save_tiny_models, teacher_forced_gaps
from tokenmill import LLM, SamplingParams
from tokenmill.model.moe import Experts

MOE = ["mixtral", "qwen2-moe", "qwen3-moe"]
MAX_NEW = 16


def _configs(vocab: int) -> dict:
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  initializer_range=0.2, eos_token_id=2, bos_token_id=1, pad_token_id=0)
    return moe_configs(common)


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    return save_tiny_models(tmp_path_factory.mktemp("moe"), _configs)


def _greedy(llm: LLM, prompts: list[list[int]], n: int = MAX_NEW) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=n, min_tokens=n)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def _prompts(folder: str) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    return [tok.encode(p) for p in PROMPTS]


def test_the_tiny_models_route_tokens_to_many_experts(folders):
    """The fixtures exercise routing: across the prompts every expert of a layer is chosen, and tokens differ
    in their choices (so a wrong grouping or scatter would show)."""
    for name in MOE:
        llm = LLM(folders[name], dtype="float32", seed=0)
        model = llm.engine.model
        chosen = []
        layer = model.layers[0].mlp
        route = layer.route

        def recording(x, route=route, chosen=chosen):
            ids, weights = route(x)
            chosen.append(ids)
            return ids, weights

        layer.route = recording
        _greedy(llm, _prompts(folders[name])[:4], 2)
        ids = torch.cat(chosen)
        assert ids.unique().numel() == 8, (name, ids.unique())
        assert len({tuple(sorted(r)) for r in ids.tolist()}) >= 6, name


@pytest.mark.parametrize("num_requests", [1, 12])
def test_decode_runs_one_product_per_active_expert(folders, num_requests, monkeypatch):
    """Every expert product covers all of that expert's rows of the step: per MoE layer per step, as many
    products as distinct experts chosen (at most 8 here, with 12 requests x 2 choices = 24 rows in a
    decode step), together covering each token's top-k rows exactly once. (Module by module: prompt steps,
    mixed steps, and decode where the fused decoder does not run; its own decode is compared below.)"""
    records = []
    forward, expert = Experts.forward, Experts.expert

    def counted_forward(self, x, ids, weights):
        records.append({"tokens": x.shape[0], "distinct": ids.unique().numel(), "calls": 0, "rows": 0,
                        "k": ids.shape[1]})
        return forward(self, x, ids, weights)

    def counted_expert(self, e, x, float_from=None):
        records[-1]["calls"] += 1
        records[-1]["rows"] += x.shape[0]
        return expert(self, e, x, float_from)

    monkeypatch.setattr(Experts, "forward", counted_forward)
    monkeypatch.setattr(Experts, "expert", counted_expert)
    folder = folders["qwen3-moe"]
    llm = LLM(folder, dtype="float32", seed=0)
    llm.engine.model.use_fused_decode = False
    prompts = (_prompts(folder) * 2)[:num_requests]
    got = _greedy(llm, prompts, 6)
    assert got == hf_greedy(folder, prompts, 6)[0]
    for r in records:
        assert r["calls"] == r["distinct"] <= 8 and r["rows"] == r["tokens"] * r["k"], r
    decode = [r for r in records if r["tokens"] == num_requests]
    assert decode, "no decode step was seen"
    if num_requests == 12:
        assert all(r["calls"] < r["tokens"] for r in decode), "expert products must not scale with the batch"


def test_norm_topk_prob_is_honoured(folders, tmp_path):
    """The same Qwen3-MoE weights with norm_topk_prob true (the fixture) and false: transformers' greedy tokens
    differ between the two, and ours equal each (a decoder that ignored the flag would fail one)."""
    folder = folders["qwen3-moe"]
    flipped = tmp_path / "qwen3-moe-unnormalised"
    flipped.mkdir()
    for f in os.listdir(folder):
        if f != "config.json":
            os.symlink(os.path.join(folder, f), flipped / f)
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    assert config["norm_topk_prob"] is True
    (flipped / "config.json").write_text(json.dumps({**config, "norm_topk_prob": False}))
    prompts = _prompts(folder)[:4]
    results = {}
    for path in (folder, str(flipped)):
        ref, _ = hf_greedy(path, prompts, MAX_NEW)
        assert _greedy(LLM(path, dtype="float32", seed=0), prompts) == ref, path
        results[path] = ref
    assert results[folder] != results[str(flipped)], "the fixture must be sensitive to the renormalisation"


def test_routing_weights_follow_each_family():
    """Mixtral: a softmax over the top-k logits; Qwen: a softmax over all, top-k, renormalised only with
    norm_topk_prob; Qwen2-MoE's shared expert gated by sigmoid(x . w)."""
    from tokenmill.model.description import MoESpec
    from tokenmill.model.moe import SparseMoE

    torch.manual_seed(0)
    x = torch.randn(5, 32)
    for norm in (True, False):
        spec = MoESpec(num_experts=6, top_k=2, intermediate_size=32, norm_topk_prob=norm, sparse_layers=[True])
        moe = SparseMoE(32, spec, "silu")
        torch.nn.init.normal_(moe.gate.weight)
        ids, w = moe.route(x)
        logits = x @ moe.gate.weight.T
        top, top_ids = logits.topk(2, dim=-1)
        assert torch.equal(ids, top_ids)
        expected = top.softmax(-1) if norm else logits.softmax(-1).gather(1, top_ids)
        torch.testing.assert_close(w, expected)
        assert torch.allclose(w.sum(-1), torch.ones(5)) == norm


@pytest.mark.parametrize("name", MOE)
def test_gguf_matches_transformers_on_its_folder(folders, tmp_path, name):
    """The model written as llama.cpp writes it (experts stacked in ffn_*_exps, Mixtral as llama with expert
    counts, Qwen2-MoE's shared expert as ffn_*_shexp and ffn_gate_inp_shexp) loads and matches transformers."""
    pytest.importorskip("gguf")
    from tests.gguf_models import write_llama_gguf

    folder = folders[name]
    # The fixture's Mixtral slides a window of 24 (Mixtral 8x7B has none; llama.cpp writes none for arch llama):
    # said in the file's metadata so that the file describes the folder's model.
    window = {"llama.attention.sliding_window": 24} if name == "mixtral" else None
    path = write_llama_gguf(tmp_path / f"{name}.gguf", folder, lambda n: "F32", metadata=window)
    llm = LLM(path, dtype="float32", seed=0, block_size=4)
    model = llm.engine.model
    assert type(model).__name__ == {"mixtral": "MixtralForCausalLM", "qwen2-moe": "Qwen2MoeForCausalLM",
                                    "qwen3-moe": "Qwen3MoeForCausalLM"}[name]
    moe = model.config.moe
    assert (moe.num_experts, moe.top_k) == (8, 2) and moe.norm_topk_prob == (name != "qwen2-moe")
    assert moe.sparse_layers == ([True, False, True] if name == "qwen2-moe" else [True, True])
    assert model.config.layer_windows == ([24, 24] if name == "mixtral" else [None] * len(moe.sparse_layers))
    prompts = _prompts(folder)
    assert _greedy(llm, prompts) == hf_greedy(folder, prompts, MAX_NEW)[0]


def test_quantized_experts_run_in_their_block_format(folders, tmp_path):
    """A Q8_0 Qwen2-MoE file: the stacked experts and the shared expert stay in Q8_0 (each expert's slice a
    view multiplied by the format's kernel), the router stays float; teacher-forced logprobs agree with the
    same file dequantized within 0.1 nats, and greedy tokens agree with it in most positions."""
    pytest.importorskip("gguf")
    from tests.gguf_models import write_llama_gguf
    from tokenmill.kernels import quant

    if quant.load() is None:
        pytest.skip("the quantized-weight kernels could not be built here")
    folder = folders["qwen2-moe"]
    path = write_llama_gguf(tmp_path / "moe-q8.gguf", folder, lambda name: "Q8_0")
    native = LLM(path, dtype="float32", seed=0)
    moe = native.engine.model.layers[0].mlp
    experts = moe.experts
    assert experts.gate_up_proj is None and experts.down_proj is None
    assert [w.name for w in experts.qparts] == ["Q8_0"] * 3 and experts.qparts[0].shape == (8 * 32, 64)
    down = experts.qparts[2].data  # expert 3's rows: a view 3 x 64 rows into the stacked blocks, not a copy
    assert experts._slices[2][3].data.data_ptr() == down.data_ptr() + 3 * 64 * down.shape[1]
    assert moe.gate.weight is not None and moe.shared_expert.gate_up_proj.qweight.name == "Q8_0"
    reference = LLM(path, dtype="float32", seed=0, quantization="none")
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    prompts = _prompts(folder)
    got, want = (llm.generate(prompts, params, use_tqdm=False) for llm in (native, reference))
    for prompt, g, w in zip(prompts, got, want):
        for tok, lg, lw in zip(prompt[1:], g.prompt_logprobs[1:], w.prompt_logprobs[1:]):
            assert abs(lg[tok].logprob - lw[tok].logprob) < 0.1


def test_mixtral_gguf_with_one_tensor_per_expert(folders, tmp_path):
    """Older Mixtral files hold each expert's matrices apart (blk.N.ffn_gate.E, ...): they load (quantized ones
    dequantized at load) and match transformers."""
    pytest.importorskip("gguf")
    from tests.gguf_models import write_llama_gguf

    folder = folders["mixtral"]
    window = {"llama.attention.sliding_window": 24}
    path = write_llama_gguf(tmp_path / "old.gguf", folder, lambda n: "F32", metadata=window, legacy_experts=True)
    prompts = _prompts(folder)[:4]
    assert _greedy(LLM(path, dtype="float32", seed=0), prompts) == hf_greedy(folder, prompts, MAX_NEW)[0]
    quantized = write_llama_gguf(tmp_path / "old-q8.gguf", folder, lambda n: "Q8_0", metadata=window,
                                 legacy_experts=True)
    experts = LLM(quantized, dtype="float32", seed=0).engine.model.layers[1].mlp.experts
    assert experts.gate_up_proj is not None and not experts.qparts


def test_a_missing_expert_tensor_is_named(folders, tmp_path):
    pytest.importorskip("gguf")
    from tests.gguf_models import write_llama_gguf

    path = write_llama_gguf(tmp_path / "incomplete.gguf", folders["mixtral"], lambda n: "F32",
                            skip=("blk.1.ffn_down_exps.weight",))
    with pytest.raises(ValueError, match=re.escape("incomplete.gguf lacks tensor 'blk.1.ffn_down_exps.weight'")):
        LLM(path, dtype="float32")


def _spy_fused(model) -> list:
    """Records what the model's choice of the fused decoder gives each step (None: module by module)."""
    used = []
    pick = model._fused_decoder
    model._fused_decoder = lambda *a: used.append(pick(*a)) or used[-1]
    return used


def _decoded(model: str, prompts, fused: bool):
    """Greedy tokens and their logprobs in float32, decode steps fused or module by module; and the fused
    decoders used. A new engine each time: a prefix-cache hit would compute a prompt's last token on its
    own, and a quantized product of one row rounds its input otherwise than one of a whole prompt."""
    llm = LLM(model, dtype="float32", seed=0)
    llm.engine.model.use_fused_decode = fused
    used = _spy_fused(llm.engine.model)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, min_tokens=MAX_NEW, logprobs=0)
    outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    return [(o.token_ids, [lp[t].logprob for lp, t in zip(o.logprobs, o.token_ids)]) for o in outs], used


@pytest.mark.parametrize("name", MOE)
@pytest.mark.parametrize("num_requests", [3, 12])  # one parallel region a step; operation by operation past 8
def test_fused_decode_step_runs_the_experts(folders, name, num_requests):
    """float32 decode steps of a MoE model run in the fused decoder (routing, each active expert's rows in one
    product, the shared expert) and give the tokens of the module-by-module path with logprobs equal to
    float32 rounding; the tokens are transformers' greedy ones."""
    from tokenmill.kernels import cpu as cpu_kernels

    if cpu_kernels.load() is None:
        pytest.skip("the CPU decode kernels do not run here")
    folder = folders[name]
    prompts = (_prompts(folder) * 2)[:num_requests]
    fused, used = _decoded(folder, prompts, True)
    assert sum(f is not None for f in used) >= MAX_NEW - 1, "decode steps must run fused"
    module, used = _decoded(folder, prompts, False)
    assert all(f is None for f in used)
    assert [t for t, _ in fused] == [t for t, _ in module] == hf_greedy(folder, prompts, MAX_NEW)[0]
    _assert_close(fused, module)


def _assert_close(fused, module) -> None:
    """Logprobs equal to float32 rounding, but where the router's logits, which round a little differently in
    the two paths, flip a near-tie between two experts: that request's logprobs differ from that step on (the
    token's KV differs), by a few thousandths of a nat (seen: 0.011), never more than 0.02. Few requests may
    flip: at most one in four (one in a batch of fewer), the others within 1e-4 at every token."""
    flipped = 0
    for (_, x), (_, y) in zip(fused, module):
        gaps = [abs(a - b) for a, b in zip(x, y)]
        assert max(gaps) < 0.02, gaps
        flipped += max(gaps) > 1e-4
    assert flipped <= max(1, len(fused) // 4), f"{flipped} of {len(fused)} requests flipped"


def test_fused_experts_in_their_block_format(folders, tmp_path):
    """A Q8_0 Qwen2-MoE file (experts and shared expert Q8_0, router float) decodes fused with the module
    path's tokens and logprobs (both quantize each input row the same way) in float32."""
    pytest.importorskip("gguf")
    from tests.gguf_models import write_llama_gguf
    from tokenmill.kernels import cpu as cpu_kernels, quant

    if quant.load() is None or cpu_kernels.load() is None:
        pytest.skip("the kernels could not be built here")
    path = write_llama_gguf(tmp_path / "moe-q8.gguf", folders["qwen2-moe"], lambda name: "Q8_0")
    assert LLM(path, dtype="float32").engine.model.layers[0].mlp.experts.qparts[0].name == "Q8_0"
    prompts = _prompts(folders["qwen2-moe"])[:5]
    fused, used = _decoded(path, prompts, True)
    assert sum(f is not None for f in used) >= MAX_NEW - 1
    module, _ = _decoded(path, prompts, False)
    assert [t for t, _ in fused] == [t for t, _ in module]
    _assert_close(fused, module)


def test_bfloat16_fused_experts_track_transformers(folders):
    """bf16 decode of a MoE model runs fused, and its tokens track transformers' float32 choices teacher-forced,
    as the dense models' do. Over all eight prompts: a bf16 rounding that moves one expert choice can carry a
    prompt's answer elsewhere (up to ~0.9 nats at a token), and over three prompts the mean depended on which
    rounding (0.018 with torch's prompt attention, 0.039 with it computed in float32 and rounded once, 0.039-0.040
    with the kernels'); over eight, 0.018-0.027 each, while experts chosen from the bottom of the router's
    ranking give 0.48-0.84 (the three MoE fixtures)."""
    from tokenmill.kernels import cpu as cpu_kernels

    folder = folders["mixtral"]
    llm = LLM(folder, dtype="bfloat16", seed=0)
    model = llm.engine.model
    used = _spy_fused(model)
    prompts = _prompts(folder)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW, min_tokens=MAX_NEW),
                        use_tqdm=False)
    if cpu_kernels.load() is not None:
        assert sum(f is not None for f in used) >= MAX_NEW - 1, "decode steps must run fused"
    assert model.graph_capturable is False  # nor in CUDA graphs: the active experts change step to step
    gaps = teacher_forced_gaps(folder, prompts, outs)
    assert sum(gaps) / len(gaps) < 0.06 and max(gaps) < 2.0, (sum(gaps) / len(gaps), max(gaps))


def test_unsupported_architecture_lists_the_moe_ones(folders, tmp_path):
    folder = tmp_path / "deepseek"
    folder.mkdir()
    source = folders["qwen3-moe"]
    for f in os.listdir(source):
        if f != "config.json":
            os.symlink(os.path.join(source, f), folder / f)
    with open(os.path.join(source, "config.json")) as f:
        config = json.load(f)
    (folder / "config.json").write_text(json.dumps({**config, "architectures": ["DeepseekV3ForCausalLM"]}))
    with pytest.raises(ValueError, match=r"unsupported model architecture \['DeepseekV3ForCausalLM'\]; supported: .*"
                                         r"MixtralForCausalLM, Phi3ForCausalLM, Qwen2ForCausalLM, Qwen2MoeForCausalLM, "
                                         r"Qwen3ForCausalLM, Qwen3MoeForCausalLM"):
        LLM(str(folder), dtype="float32")


def test_experts_of_rows_that_are_not_whole_tiles(tmp_path):
    """Experts of 24 rows, their gate and up stacked 8 to a Q8_0 tensor (192 rows: whole tiles of 16, each
    expert's slice not; down kept F32, its 24-wide rows no blocks of 32): the stacked tensors keep the row
    layout, so that every expert's slice is a matrix of its own, and the logprobs agree with the file
    dequantized."""
    pytest.importorskip("gguf")
    from transformers import Qwen3MoeConfig

    from tests.conftest import save_tiny_models
    from tests.gguf_models import write_llama_gguf
    from tokenmill.kernels import quant

    if quant.load() is None:
        pytest.skip("the quantized-weight kernels could not be built here")

    def configs(vocab):
        return {"qwen3-moe-24": Qwen3MoeConfig(
            vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, max_position_embeddings=512, initializer_range=0.2,
            eos_token_id=2, bos_token_id=1, pad_token_id=0, num_experts=8, num_experts_per_tok=2,
            moe_intermediate_size=24, norm_topk_prob=True)}

    folder = save_tiny_models(tmp_path, configs)["qwen3-moe-24"]
    path = write_llama_gguf(tmp_path / "moe24-q8.gguf", folder,
                            lambda name: "F32" if "ffn_down_exps" in name else "Q8_0")
    prompts = _prompts(folder)[:4]
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    want = LLM(path, dtype="float32", quantization="none").generate(prompts, params, use_tqdm=False)
    llm = LLM(path, dtype="float32")
    experts = llm.engine.model.layers[0].mlp.experts
    assert [w.shape for w in experts.qparts] == [(8 * 24, 64)] * 2 and not any(w.tiled for w in experts.qparts)
    got = llm.generate(prompts, params, use_tqdm=False)
    for prompt, g, w in zip(prompts, got, want):
        for tok, lg, lw in zip(prompt[1:], g.prompt_logprobs[1:], w.prompt_logprobs[1:]):
            assert abs(lg[tok].logprob - lw[tok].logprob) < 0.1
