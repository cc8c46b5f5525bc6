"""quantization="int4-gptq": Q4_1 blocks fitted by GPTQ to each layer's calibration inputs."""

import os

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.kernels import quant

pytestmark = pytest.mark.skipif(quant.load() is None, reason="the quantized-weight kernels could not be built here")


@pytest.fixture(autouse=True)
def _fits_kept_in_tmp(tmp_path, monkeypatch):
    """The tiny models' fits go to the test's own folder, not the user's model cache (where each run's fresh
    model folders would leave files no later load reads)."""
    from tokenmill.model import calibrate

    where = calibrate.cache_file
    monkeypatch.setattr(calibrate, "cache_file", lambda *a: str(tmp_path / "calibrated" / os.path.basename(where(*a))))


def _inputs(k: int, gen: torch.Generator):
    """Draws of inputs shaped like a transformer layer's: correlated features, a few channels far larger than
    the rest. Returns draw(rows)."""
    mix = torch.randn(k, k, generator=gen) / k ** 0.5 + torch.eye(k)
    scale = torch.ones(k)
    scale[torch.randperm(k, generator=gen)[:k // 32]] = 8.0
    return lambda rows: (torch.randn(rows, k, generator=gen) @ mix) * scale


def test_gptq_moves_the_layer_outputs_less_than_rounding():
    """On inputs it was not fitted to (fresh draws of the same distribution), a GPTQ-fitted matrix's outputs
    are much closer to the float ones than those of the same format fitted to the weights alone (0.28x the
    squared error here; 0.60x where the groups' grids ignore which inputs are large, 0.68x where they also
    start from the range alone); its blocks are valid Q4_1 (every code on its group's grid)."""
    gen = torch.Generator().manual_seed(0)
    n, k = 96, 256
    w = torch.randn(n, k, generator=gen)
    draw = _inputs(k, gen)
    fit, held_out = draw(4096), draw(4096)
    blocks = quant.gptq_q4_1(w, fit.T @ fit)
    gptq = quant.QuantizedWeight.from_blocks(3, (n, k), blocks).dequantize().float()
    rounded = quant.quantize(w, 3).dequantize().float()

    def err(q):
        return ((held_out @ (w - q).T) ** 2).mean().item()

    assert err(gptq) < 0.4 * err(rounded), (err(gptq), err(rounded))
    # Each group's codes lie on its own grid d q + m, q in 0..15.
    g = blocks.view(n, k // 32, 20)
    d = g[..., 0:2].contiguous().view(torch.float16).float()
    m = g[..., 2:4].contiguous().view(torch.float16).float()
    codes = (gptq.view(n, k // 32, 32) - m) / d
    assert torch.allclose(codes, codes.round(), atol=1e-3) and codes.min() > -1e-3 and codes.max() < 15 + 1e-3


def test_gptq_rows_are_independent():
    """The loader quantizes a merged projection (q, k and v) whole and hands each part its rows: the same
    blocks as quantizing each part on its own."""
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(48, 128, generator=gen)
    x = _inputs(128, gen)(1024)
    whole = quant.gptq_q4_1(w, x.T @ x)
    assert torch.equal(quant.gptq_q4_1(w[:16], x.T @ x), whole[:16])
    assert torch.equal(quant.gptq_q4_1(w[16:], x.T @ x), whole[16:])


def test_gptq_checks_its_shapes():
    with pytest.raises(ValueError, match="layer.w: rows of 40 elements do not divide into groups of 32"):
        quant.gptq_q4_1(torch.zeros(4, 40), torch.eye(40), "layer.w")
    with pytest.raises(ValueError, match=r"a Hessian of shape \(32, 32\) for rows of 64 elements"):
        quant.gptq_q4_1(torch.zeros(4, 64), torch.eye(32))


@pytest.mark.parametrize("arch", ["llama", "phi3", "qwen3-moe"])
def test_int4_gptq_runs_the_fitted_blocks(tiny_models, arch):
    """The engine's layers hold the blocks calibrate.gptq_int4 fitted on the float model, each part of a
    merged projection its own rows of them (llama's q, k and v checkpoint tensors; Phi-3's stored merged);
    the embedding, output layer and mixture-of-experts experts are rounded as int4 rounds them."""
    from tokenmill.attention.backend import new_backend
    from tokenmill.model import calibrate
    from tokenmill.model.loader import load_model

    folder = tiny_models[arch]
    llm = LLM(folder, dtype="float32", quantization="int4-gptq", kv_cache_memory="16MiB")
    model = llm.engine.model
    reference = load_model(folder, torch.float32, torch.device("cpu"), new_backend(torch.device("cpu")),
                           quantization="none")
    fitted = calibrate.gptq_int4(reference.model, calibrate.calibration_windows(reference.tokenizer))
    names = {f"layers.{i}.{part}" for i in range(len(model.layers)) for part in ("self_attn.qkv_proj", "self_attn.o_proj")}
    if arch != "qwen3-moe":
        names |= {f"layers.{i}.mlp.{part}" for i in range(len(model.layers)) for part in ("gate_up_proj", "down_proj")}
    assert set(fitted) == names
    for name, blocks in fitted.items():
        layer = model.get_submodule(name)
        want = quant.QuantizedWeight.from_blocks(3, (blocks.shape[0], layer.in_features), blocks).dequantize()
        got = torch.cat([p.dequantize() for p in layer.qparts])
        assert torch.equal(got, want), name
    plain = LLM(folder, dtype="float32", quantization="int4", kv_cache_memory="16MiB").engine.model
    assert torch.equal(model.embed_tokens.qweight.dequantize(), plain.embed_tokens.qweight.dequantize())
    if arch == "qwen3-moe":
        experts, plain_experts = model.layers[0].mlp.experts, plain.layers[0].mlp.experts
        assert all(torch.equal(a.data, b.data) for a, b in zip(experts.qparts, plain_experts.qparts))
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=4, temperature=0, min_tokens=4))[0]
    assert len(out.outputs[0].token_ids) == 4


def _logprob_shift(folder: str, quantization: str, prompts) -> float:
    """Mean absolute change, from the float model's, of the logprob each prompt token gets."""
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)

    def logprobs(llm):
        return torch.tensor([pos[t].logprob for prompt, out in zip(prompts, llm.generate(prompts, params))
                             for pos, t in zip(out.prompt_logprobs[1:], prompt[1:])])

    ref = logprobs(LLM(folder, dtype="float32", kv_cache_memory="16MiB"))
    got = logprobs(LLM(folder, dtype="float32", quantization=quantization, kv_cache_memory="16MiB"))
    return (ref - got).abs().mean().item()


def test_int4_gptq_is_closer_to_the_float_model(tiny_models):
    """On text the calibration never saw (the evaluation text), the tokens' logprobs under int4-gptq move
    less from the float model's than under int4."""
    from tokenmill.data import default_text
    from tokenmill.model.loader import load_tokenizer

    folder = tiny_models["llama"]
    ids = load_tokenizer(folder).encode(default_text(), add_special_tokens=False)
    prompts = [ids[i:i + 256] for i in range(0, 4 * 256, 256)]
    gptq, rounded = _logprob_shift(folder, "int4-gptq", prompts), _logprob_shift(folder, "int4", prompts)
    assert gptq < 0.9 * rounded, (gptq, rounded)  # 0.84x here


def test_int4_gptq_split_over_two_ranks(tiny_models, tmp_path, monkeypatch):
    """tensor_parallel_size=2: the whole model is fitted once, each rank holds its cut of the fitted blocks
    (rank 0's equal to the cut of the unsplit model's, value for value), and the greedy tokens are the
    unsplit model's."""
    from tokenmill.model import calibrate

    monkeypatch.setenv("TOKENMILL_CACHE", str(tmp_path))  # the other rank's process: where this one keeps fits
    folder = tiny_models["llama"]
    prompts, sp = [[5, 6, 7, 8, 9], [20, 21, 22, 23] * 6], SamplingParams(temperature=0, max_tokens=24,
                                                                          ignore_eos=True)
    split = LLM(folder, dtype="float32", quantization="int4-gptq", tensor_parallel_size=2, kv_cache_memory="16MiB")
    try:
        got = [o.outputs[0].token_ids for o in split.generate(prompts, sp)]
        rank0 = split.engine.loaded.model
        shard = rank0.tp_shard
        fits = []
        fit = calibrate.gptq_int4
        monkeypatch.setattr(calibrate, "gptq_int4", lambda *a: fits.append(1) or fit(*a))
        whole = LLM(folder, dtype="float32", quantization="int4-gptq", kv_cache_memory="16MiB")
        assert fits == [], "the split load should have kept its fit for the next load"
        for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
            mine = rank0.layers[1].get_submodule(name).qweight
            theirs = whole.engine.model.layers[1].get_submodule(name).qweight
            assert mine.name == theirs.name == "Q4_1"
            cut = shard.float_tensor(f"layers.1.{name}.weight", theirs.dequantize())
            assert cut.shape != theirs.shape and torch.equal(mine.dequantize(), cut), name
        assert got == [o.outputs[0].token_ids for o in whole.generate(prompts, sp)]
    finally:
        split.engine.shutdown()


def test_a_split_that_cannot_be_made_is_refused_before_the_fit(tiny_models, monkeypatch):
    """Four ranks for a model of two KV heads: refused at once, not after minutes of calibration."""
    from tokenmill.attention.backend import new_backend
    from tokenmill.model import calibrate
    from tokenmill.model.loader import load_model

    fits = []
    monkeypatch.setattr(calibrate, "gptq_int4", lambda *a: fits.append(1))
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="exceeds the model's 2 key/value heads"):
        load_model(tiny_models["llama"], torch.float32, cpu, new_backend(cpu), quantization="int4-gptq",
                   tensor_parallel=(0, 4, None))
    assert fits == []


def test_loads_at_once_fit_once(tmp_path, monkeypatch):
    """Two loads of one checkpoint at the same time (tensor-parallel ranks): one fits, on the threads it was
    given (a rank's own count is its share of the CPUs), the other waits for its file and reads it."""
    import threading
    import time
    from types import SimpleNamespace

    from tokenmill.model import calibrate

    monkeypatch.setattr(calibrate, "cache_file", lambda *a: str(tmp_path / "calibrated" / "fit.pt"))
    monkeypatch.setattr(calibrate, "calibration_windows", lambda tokenizer, window: [[1, 2]])
    fits = []

    def gptq_int4(model, windows):
        fits.append(torch.get_num_threads())
        time.sleep(0.3)  # long enough for the other load to look for the file meanwhile
        return {"layers.0.mlp.down_proj": torch.full((2, 20), len(fits), dtype=torch.uint8)}

    monkeypatch.setattr(calibrate, "gptq_int4", gptq_int4)
    got = []
    loads = [threading.Thread(target=lambda: got.append(calibrate.fitted_int4(
        "m", torch.float32, 512, lambda: SimpleNamespace(model=None, tokenizer=None), threads=2))) for _ in range(2)]
    own = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for t in loads:
            t.start()
        for t in loads:
            t.join()
        assert torch.get_num_threads() == 1  # given back
    finally:
        torch.set_num_threads(own)
    assert fits == [2] and len(got) == 2 and all(torch.equal(g["layers.0.mlp.down_proj"], got[0][
        "layers.0.mlp.down_proj"]) for g in got)


def test_int4_gptq_as_the_self_draft(tiny_models):
    """{"method": "self", "quantization": "int4-gptq"}: the draft is the target's weights fitted at 4 bits; the
    outputs are those of decoding without it."""
    target = tiny_models["llama"]
    prompts, sp = [[5, 6, 7, 8, 9], [20, 21, 22]], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(target, dtype="bfloat16").generate(prompts, sp)]
    llm = LLM(target, dtype="bfloat16", speculative_config={"method": "self", "quantization": "int4-gptq",
                                                            "num_speculative_tokens": 3})
    assert llm.engine.proposer.model.layers[0].self_attn.qkv_proj.qweight.name == "Q4_1"
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, sp)] == want
    with pytest.raises(ValueError, match='"self" quantizes to int8, int4 or int4-gptq, got \'int3\''):
        LLM(target, speculative_config={"method": "self", "quantization": "int3"})


def test_int4_gptq_fits_once_and_keeps_the_blocks(tiny_models, tmp_path, monkeypatch):
    """The fitted blocks are kept in the cache and read by the next load (no calibration then); a checkpoint
    changed since is fitted again."""
    import shutil

    from tokenmill.model import calibrate

    folder = str(tmp_path / "llama")
    shutil.copytree(tiny_models["llama"], folder)
    kept = tmp_path / "calibrated"  # (where _fits_kept_in_tmp sends them)

    def blocks(llm):
        return [p.data for m in llm.engine.model.modules() for p in getattr(m, "qparts", ())]

    first = blocks(LLM(folder, dtype="float32", quantization="int4-gptq", kv_cache_memory="16MiB"))
    assert len(os.listdir(kept)) == 1
    fits = []
    fit = calibrate.gptq_int4
    monkeypatch.setattr(calibrate, "gptq_int4", lambda *a: fits.append(1) or fit(*a))
    again = blocks(LLM(folder, dtype="float32", quantization="int4-gptq", kv_cache_memory="16MiB"))
    assert fits == [] and len(again) == len(first) and all(torch.equal(a, b) for a, b in zip(again, first))
    weights = os.path.join(folder, "model.safetensors")
    st = os.stat(weights)
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    LLM(folder, dtype="float32", quantization="int4-gptq", kv_cache_memory="16MiB")
    assert fits == [1] and len(os.listdir(kept)) == 2


def test_int4_gptq_fits_again_over_an_unreadable_cache_file(tiny_models, tmp_path, monkeypatch, caplog):
    from tokenmill.model import calibrate

    kept = tmp_path / "kept.pt"
    monkeypatch.setattr(calibrate, "cache_file", lambda *a: str(kept))
    kept.write_bytes(b"not a torch file")
    llm = LLM(tiny_models["llama"], dtype="float32", quantization="int4-gptq", kv_cache_memory="16MiB")
    assert "could not be read" in caplog.text
    assert llm.engine.model.layers[0].self_attn.qkv_proj.qweight.name == "Q4_1"
    assert isinstance(torch.load(kept, weights_only=True), dict)  # replaced by the fitted blocks


def test_gptq_in_a_fresh_process():
    """The fit in a process that has run nothing quantized before (calibration loads the float model, which
    builds no quantized product): the compiled grid fit is loaded on first use."""
    import subprocess
    import sys

    code = ("import torch; from tokenmill.kernels import quant; w = torch.randn(32, 64); x = torch.randn(256, 64); "
            "b = quant.gptq_q4_1(w, x.T @ x); print(tuple(b.shape), tuple(quant.quantize(w, 3).data.shape))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[0] == "(32, 40) (32, 40)"
