"""Quantized GGUF files run in their own formats: against the dequantized path, across scheduling modes,
in memory, and with bad files."""

import logging
import struct

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from tests.conftest import MOE_ARCHS  # noqa: E402
from tests.gguf_models import write_llama_gguf  # noqa: E402
from tokenmill import LLM, SamplingParams  # noqa: E402
from tokenmill.kernels import quant  # noqa: E402
from tokenmill.model.gguf_loader import GGUFFile  # noqa: E402
from tokenmill.model.loader import quantized_weights, weight_bytes  # noqa: E402


def _config(vocab: int):
    from transformers import LlamaConfig

    # Rows of 256 and 512: every format's blocks fit, the K formats' super-blocks included.
    return {"llama256": LlamaConfig(vocab_size=vocab, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                    initializer_range=0.05, eos_token_id=2, bos_token_id=1, pad_token_id=0)}


def _q4_k_m(name: str) -> str:  # llama.cpp's Q4_K_M mix: Q6_K for v and down, Q4_K elsewhere
    if name.endswith(("attn_v.weight", "ffn_down.weight", "output.weight")):
        return "Q6_K"
    return "Q5_K" if name.startswith("token_embd") else "Q4_K"


def _q5_k_m(name: str) -> str:  # llama.cpp's Q5_K_M mix: Q6_K for v and down, Q5_K elsewhere
    return "Q6_K" if name.endswith(("attn_v.weight", "ffn_down.weight", "output.weight")) else "Q5_K"


VARIANTS = {
    "Q8_0": lambda name: "Q8_0",
    "Q4_0": lambda name: "Q8_0" if name.startswith("output") else "Q4_0",
    "Q4_1": lambda name: "Q4_1",
    "Q4_K_M": _q4_k_m,
    "Q5_K_M": _q5_k_m,
    # q, k and v in different formats (one merged projection, three kernels), gate and up too (Q4_1 and
    # MXFP4); TQ2_0 has no kernel (dequantized)
    "mixed": lambda name: {"attn_q": "Q4_0", "attn_k": "Q8_0", "attn_v": "Q5_1", "attn_output": "Q5_0",
                           "ffn_up": "MXFP4", "ffn_down": "TQ2_0"}.get(name.split(".")[-2], "Q4_1"),
    # the 2-, 3- and 4-bit formats of Q2_K, Q3_K_S/M/L and IQ4_XS files (IQ4_NL: where a row does not divide
    # into IQ4_XS's 256), q, k and v again in three, the embedding in one of them
    "lowbit": lambda name: {"attn_q": "Q3_K", "attn_k": "IQ4_NL", "attn_v": "IQ4_XS", "attn_output": "Q2_K",
                            "ffn_gate": "Q3_K", "ffn_up": "IQ4_XS", "ffn_down": "Q2_K", "token_embd": "Q3_K",
                            "output": "IQ4_XS"}[name.split(".")[-2]],
}


@pytest.fixture(scope="module")
def quantized_files(tmp_path_factory):
    from tests.conftest import save_tiny_models

    if quant.load() is None:
        pytest.skip("the quantized-weight kernels could not be built here")
    root = tmp_path_factory.mktemp("qgguf")
    folder = save_tiny_models(root, _config)["llama256"]
    return {name: write_llama_gguf(root / f"{name}.gguf", folder, types) for name, types in VARIANTS.items()}


PROMPTS = [[1, 5, 9, 33, 2, 17, 4, 88, 100, 7, 3, 250, 12, 64, 99, 31, 45, 6, 8, 10] * 3,
           [300, 22, 11, 5, 5, 5, 91, 13], [42] * 7 + [43, 44, 45, 46, 47]]


def _engine(path, **kw):
    return LLM(path, dtype="float32", kv_cache_memory=kw.pop("kv_cache_memory", "16MiB"), **kw)


def _teacher_forced(llm) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per prompt position after the first: the top-1 token, its margin over the second, and the logprob
    of the prompt's token."""
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2))
    top, margin, given = [], [], []
    for prompt, out in zip(PROMPTS, outs):
        for tok, pos in zip(prompt[1:], out.prompt_logprobs[1:]):
            ranked = sorted(pos, key=lambda t: pos[t].rank)
            top.append(ranked[0])
            margin.append(pos[ranked[0]].logprob - pos[ranked[1]].logprob)
            given.append(pos[tok].logprob)
    return np.array(top), np.array(margin), np.array(given)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_native_agrees_with_dequantized(quantized_files, variant):
    """Teacher-forced over the prompts, against the dequantized path: every logprob within 0.1 nats, the
    same top-1 token wherever the reference's top two are more than 0.1 nats apart, and at least 95% of
    all positions (a random model leaves near ties). Not exact equality: activations are multiplied as
    int8 blocks, as llama.cpp does, which changes the rounding."""
    path = quantized_files[variant]
    native = _engine(path)
    assert native.engine.model.quantized and quantized_weights(native.engine.model)
    reference = _engine(path, quantization="none")
    assert not reference.engine.model.quantized
    top_n, _, given_n = _teacher_forced(native)
    top_r, margin_r, given_r = _teacher_forced(reference)
    assert np.max(np.abs(given_n - given_r)) < 0.1
    assert np.all((top_n == top_r)[margin_r > 0.1])
    assert np.mean(top_n == top_r) >= 0.95


def _greedy(llm, prompts, n=12):
    outs = llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture
def int8_products():
    """Every block-format product on its int8 path (int8 inputs, integer dot products). By default a prompt's
    rows, and a step of 48 rows or more, dequantize the weights and multiply float inputs instead, so a
    row's rounding depends on where it comes (as in llama.cpp, and as torch's GEMM blocks rows differently
    by count); the comparisons below are of schedules on one path."""
    quant.set_float_rows(10**9)
    quant.set_float_prompts(False)
    yield
    quant.set_float_rows(0)
    quant.set_float_prompts(True)


@pytest.mark.parametrize("variant", ["Q4_K_M", "mixed"])
def test_scheduling_modes_give_the_same_tokens(quantized_files, variant, int8_products):
    """On the int8 path, the quantized product of a row does not depend on the rows beside it: alone,
    batched, chunked, preempted and prefix-cached runs give the same greedy tokens."""
    path = quantized_files[variant]
    alone_llm = _engine(path)
    alone = [_greedy(alone_llm, [p])[0] for p in PROMPTS]
    assert _greedy(alone_llm, PROMPTS) == alone  # batched
    assert _greedy(alone_llm, PROMPTS) == alone  # again, prompts now in the prefix cache
    chunked = _engine(path, max_num_batched_tokens=16, long_prefill_token_threshold=8)
    assert _greedy(chunked, PROMPTS) == alone
    # 5 blocks of 16 tokens (32 KiB each) for three requests that grow to 40 tokens (3 blocks) each
    small = _engine(path, kv_cache_memory=5 * 32768, max_model_len=48)
    short = [p[:30] for p in PROMPTS]
    assert _greedy(small, short, n=10) == [_greedy(alone_llm, [p], n=10)[0] for p in short]
    assert small.engine.scheduler.num_preemptions > 0


def _decode_runs(path, dtype, fused, prompts):
    """Greedy tokens for 1, 3, 11 and 33 of the prompts at once, and 3 seeded sampled runs' tokens and
    logprobs, with the whole-step decoder on (fused) or off; checks that it ran exactly when on."""
    llm = LLM(path, dtype=dtype, kv_cache_memory="16MiB")
    model = llm.engine.model
    model.use_fused_decode = fused
    used = []
    pick = model._fused_decoder
    model._fused_decoder = lambda *a: used.append(pick(*a)) or used[-1]
    greedy = [_greedy(llm, prompts[:n], n=10) for n in (1, 3, 11, 33)]
    outs = llm.generate(prompts[:3], [SamplingParams(max_tokens=8, temperature=0.8, seed=i, logprobs=1, ignore_eos=True)
                                      for i in range(3)], use_tqdm=False)
    assert (sum(f is not None for f in used) > 0) == fused
    sampled = [(o.outputs[0].token_ids, [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
               for o in outs]
    return greedy, sampled


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("variant", ["Q8_0", "Q4_0", "Q4_K_M", "Q5_K_M", "mixed", "lowbit"])
def test_fused_decode_step_agrees_with_the_module_path(quantized_files, variant, dtype, int8_products):
    """The whole-step decoder reads the blocks in place (each format; a merged projection in two formats; an
    output layer tied to a quantized embedding or its own), for one request (one row per pass over the
    weights), three (rows in groups), eleven (still one pass over the weights) and 33 (the step
    operation by operation), in greedy bursts and sampled steps. Reference: the module-by-module path in float32, teacher-forced on the fused path's own
    tokens. Not exact equality, even in float32: both paths round the same activations to int8, but the
    float ops between the products sum in different orders, and an ulp of difference flips an int8
    rounding wherever a value sits on a tie (common here: a 4-bit embedding's rows are small multiples of
    one scale). So: in float32, the greedy token is the reference's top choice at 98% of the 150 positions or
    more (which near-ties flip moves with any change in the order of the kernels' sums), any other within
    0.05 nats of it, and logprobs agree within 0.1 nats (the tolerance of the quantized
    path against the dequantized one); in bf16, as closely as the dense bf16 decoder agrees with
    transformers."""
    from tokenmill.kernels import cpu as cpu_kernels

    if cpu_kernels.load() is None:
        pytest.skip("the CPU decode kernels do not run here")
    path = quantized_files[variant]
    if variant in ("Q4_K_M", "Q5_K_M"):  # its K-format matrices in tiles of 16 rows where the CPU takes them
        m = quant.load()
        layer = LLM(path, dtype=dtype, kv_cache_memory="16MiB").engine.model.layers[0]
        parts = layer.self_attn.qkv_proj.qparts + layer.mlp.down_proj.qparts
        assert {p.name for p in parts} == {variant[:4], "Q6_K"}
        assert all(p.tiled == bool(m.vnni) for p in parts)
    prompts = [[(7 * i + j) % 250 + 3 for j in range(5 + 2 * i)] for i in range(33)]
    greedy, sampled = _decode_runs(path, dtype, True, prompts)
    reference = _engine(path)
    reference.engine.model.use_fused_decode = False

    def forced(prompt, gen):  # per generated position: the reference's logprobs of its top token and of gen's
        out = reference.generate([prompt + gen], SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)[0]
        return [{t: lp.logprob for t, lp in row.items()} for row in out.prompt_logprobs[len(prompt):]]

    gaps, errors = [], []
    for runs in greedy:
        for prompt, gen in zip(prompts, runs):
            gaps += [max(row.values()) - row[t] for row, t in zip(forced(prompt, gen), gen)]
    for prompt, (gen, lps) in zip(prompts, sampled):
        errors += [abs(row[t] - lp) for row, t, lp in zip(forced(prompt, gen), gen, lps)]
    gaps, errors = np.array(gaps), np.array(errors)
    if dtype == "float32":
        assert np.mean(gaps == 0) >= 0.98 and gaps.max() < 0.05, (np.mean(gaps == 0), gaps.max())
        assert errors.mean() < 0.02 and errors.max() < 0.1, (errors.mean(), errors.max())
    else:
        assert gaps.mean() < 0.03 and gaps.max() < 1.0, (gaps.mean(), gaps.max())
        assert errors.mean() < 0.06 and errors.max() < 0.5, (errors.mean(), errors.max())


def test_fused_step_of_many_requests_on_the_float_path(quantized_files):
    """A decode step of 48+ requests runs the fused decoder operation by operation, its block-format
    products through dequantized tiles (a merged q/k/v in two formats: parts at row offsets). Reference:
    the module path, teacher-forced on the fused tokens, every product pinned to the float path too, so
    the two differ only in the order of float sums."""
    from tokenmill.kernels import cpu as cpu_kernels

    if cpu_kernels.load() is None:
        pytest.skip("the CPU decode kernels do not run here")
    quant.set_float_rows(1)
    try:
        path = quantized_files["mixed"]
        prompts = [[(7 * i + j) % 250 + 3 for j in range(3 + i % 5)] for i in range(50)]
        llm = _engine(path)
        used = []
        pick = llm.engine.model._fused_decoder
        llm.engine.model._fused_decoder = lambda *a: used.append(pick(*a)) or used[-1]
        runs = _greedy(llm, prompts, n=6)
        assert any(f is not None for f in used)
        reference = _engine(path)
        reference.engine.model.use_fused_decode = False
        gaps = []
        for prompt, gen in zip(prompts, runs):
            out = reference.generate([prompt + gen], SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)[0]
            rows = [{t: lp.logprob for t, lp in row.items()} for row in out.prompt_logprobs[len(prompt):]]
            gaps += [max(row.values()) - row[t] for row, t in zip(rows, gen)]
        gaps = np.array(gaps)
        assert np.mean(gaps == 0) >= 0.98 and gaps.max() < 0.05, (np.mean(gaps == 0), gaps.max())
    finally:
        quant.set_float_rows(0)


@pytest.mark.parametrize("variant", ["Q4_K_M", "lowbit"])
def test_memory_is_the_files(quantized_files, variant):
    """Resident weights: the file's tensor bytes (the blocks are not widened), norms in float32."""
    path = quantized_files[variant]
    llm = _engine(path)
    reader = GGUFFile(path)
    file_bytes = sum(t.data.nbytes for t in reader.tensors)
    assert weight_bytes(llm.engine.model) <= 1.1 * file_bytes
    dequantized = _engine(path, quantization="none")
    assert weight_bytes(dequantized.engine.model) > 5 * file_bytes


def test_types_without_kernel_are_dequantized_and_said(quantized_files, caplog):
    with caplog.at_level(logging.INFO, logger="tokenmill"):
        llm = _engine(quantized_files["mixed"])
    assert "no kernel for TQ2_0: 2 tensors dequantized at load (e.g. blk.0.ffn_down.weight)" in caplog.text
    mlp = llm.engine.model.layers[0].mlp
    assert mlp.down_proj.qweight is None and mlp.down_proj.weight is not None
    assert [w.name for w in mlp.gate_up_proj.qweight] == ["Q4_1", "MXFP4"]
    qkv = llm.engine.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv.qweight, list) and [w.name for w in qkv.qweight] == ["Q4_0", "Q8_0", "Q5_1"]


def _patch_tensor_info(src, dst, tensor: str, first_dim: int | None = None, qtype: int | None = None):
    """A copy of a GGUF file with one tensor's first dimension or type changed in its header."""
    data = bytearray(open(src, "rb").read())
    key = struct.pack("<Q", len(tensor)) + tensor.encode()
    at = data.index(key) + len(key)
    n_dims = struct.unpack_from("<I", data, at)[0]
    if first_dim is not None:
        struct.pack_into("<Q", data, at + 4, first_dim)
    if qtype is not None:
        struct.pack_into("<I", data, at + 4 + 8 * n_dims, qtype)
    open(dst, "wb").write(bytes(data))
    return str(dst)


def test_bad_files_name_the_tensor(quantized_files, tmp_path):
    src = quantized_files["Q4_0"]
    bad = _patch_tensor_info(src, tmp_path / "shape.gguf", "blk.1.attn_q.weight", first_dim=250)
    with pytest.raises(ValueError, match=r"'blk.1.attn_q.weight' of shape \[250, 256\] does not divide into "
                                         r"Q4_0 blocks of 32"):
        _engine(bad)
    bad = _patch_tensor_info(src, tmp_path / "type.gguf", "blk.0.ffn_down.weight", qtype=99)
    with pytest.raises(ValueError, match="'blk.0.ffn_down.weight' has an unknown type 99"):
        _engine(bad)


def test_quantization_option_is_checked():
    with pytest.raises(ValueError, match="quantization must be"):
        LLM("x.gguf", quantization="int3")


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("arch", ["llama", "llama3-tied", "mistral", "qwen2", "qwen3", "phi4-mini", *MOE_ARCHS])
def test_quantization_at_load_each_architecture(tiny_models, arch, mode):
    """quantization='int8' / 'int4' on float weights: the layers hold Q8_0 / Q4_1 blocks (the embedding and
    output layer Q8_0; mixture-of-experts experts as the other layers, routers float), and the prompt
    logprobs match transformers running the same quantized weights (dequantized into its float model):
    within 1e-4 by default (a prompt's rows take float inputs, however few) and where every product takes
    float inputs; within the int8 rounding of the activations where they take int8 inputs (looser for
    mixture-of-experts, where that rounding can flip a near-tie between two experts)."""
    from transformers import AutoModelForCausalLM

    folder = tiny_models[arch]
    llm = LLM(folder, dtype="float32", quantization=mode, kv_cache_memory="16MiB")
    model = llm.engine.model
    linear_format = "Q8_0" if mode == "int8" else "Q4_1"
    mlp = model.layers[0].mlp
    moe = arch in MOE_ARCHS
    if moe:
        experts = mlp.experts
        assert experts.gate_up_proj is None and experts.down_proj is None  # no float copy kept
        # Each expert's matrices, or (gpt-oss, whose checkpoints stack them) each part's stack whole.
        assert {w.name for w in experts.qparts} == {linear_format}
        rows = experts.num_experts * (2 * experts.intermediate + experts.hidden)
        assert sum(w.shape[0] for w in experts.qparts) == rows
        assert mlp.gate.weight is not None and mlp.gate.weight.dtype == torch.float32  # the router
    else:
        assert mlp.down_proj.qweight.name == linear_format
    assert model.layers[1].self_attn.qkv_proj.qweight.name == linear_format
    assert model.embed_tokens.qweight.name == "Q8_0"
    assert model.lm_head is None or model.lm_head.qweight.name == "Q8_0"

    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            # (Experts stacked [E, rows, cols]; gpt-oss's expert biases [E, rows] are not weights.)
            if p.dim() >= 2 and not name.endswith(("mlp.gate.weight", "mlp.router.weight", "_bias")):
                qtype = 8 if mode == "int8" or "embed" in name or "lm_head" in name else 3
                # gpt-oss stacks its experts transposed, [E, cols, rows]: quantized along their input columns.
                w = p.transpose(1, 2) if arch == "gpt-oss" and ".experts." in name else p
                rows = w.reshape(-1, w.shape[-1])
                w.copy_(quant.quantize(rows, qtype).dequantize().reshape(w.shape))
    prompts = [PROMPTS[1], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14] * 2]
    # int8 inputs: gpt-oss's one token at 0.31 (its clamped activations and biased experts, near a flip);
    # phi4-mini's int4 one at 0.104 (these tiny models' logits span ~10: 8-bit inputs move them by 1%).
    int8_tol = (0.4 if arch == "gpt-oss" else 0.25) if moe else 0.15
    for inputs, tol in (("default", 1e-4), ("float", 1e-4), ("int8", int8_tol)):
        quant.set_float_rows({"default": 0, "float": 1, "int8": 10**9}[inputs])
        quant.set_float_prompts(inputs != "int8")
        try:
            outs = llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1))
        finally:
            quant.set_float_rows(0)
            quant.set_float_prompts(True)
        for ids, out in zip(prompts, outs):
            with torch.no_grad():
                want = ref(torch.tensor([ids])).logits[0].log_softmax(-1)
            got = [out.prompt_logprobs[i][t].logprob for i, t in enumerate(ids) if i]
            want = [want[i - 1, t].item() for i, t in enumerate(ids) if i]
            if moe and inputs == "int8":  # one flipped near-tie of the router moves its position further
                off = [abs(g - w) for g, w in zip(got, want) if abs(g - w) > tol]
                assert len(off) <= 1 and all(d < 1.0 for d in off), (inputs, off)
            else:
                assert got == pytest.approx(want, abs=tol), inputs


@pytest.mark.parametrize("arch", ["llama", "qwen3-moe"])
def test_a_decode_row_beside_a_prompt_keeps_its_path(tiny_models, arch):
    """By default a prompt's rows take float inputs and decode rows (fewer than float_rows) int8 ones: a
    step holding both splits each product's rows so (for a mixture of experts, each expert's rows), and a
    request's decode is the same whether a long prompt is processed in its steps or not: bit for bit, but for
    a mixture of experts' router, a float product whose last bits torch's GEMM sets by the row count."""
    llm = LLM(tiny_models[arch], dtype="float32", quantization="int4", kv_cache_memory="16MiB",
              enable_prefix_caching=False)
    llm.engine.model.use_fused_decode = False  # module by module both ways: only the steps' other rows differ
    params = SamplingParams(max_tokens=8, temperature=0, logprobs=3, ignore_eos=True)
    prompt = [5, 6, 7, 8, 9]
    alone = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    engine = llm.engine
    engine.add_request("a", prompt, params)
    engine.step()
    engine.step()  # "a" decodes from here on
    engine.add_request("b", [(11 * i) % 200 + 3 for i in range(60)], SamplingParams(max_tokens=4, ignore_eos=True))
    mixed = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == "a" and out.finished:
                beside = out.outputs[0]
        kinds = {(s.request.request_id, s.num_new_tokens) for s in engine.last_step.scheduled}
        mixed += {r for r, _ in kinds} == {"a", "b"} and ("b", 60) in kinds
    assert mixed == 1  # one step of 61 rows: more than float_rows (48), as a whole it would take float inputs
    assert beside.token_ids == alone.token_ids
    got, want = ([[d[t].logprob for t in sorted(d)] for d in o.logprobs] for o in (beside, alone))
    if arch in MOE_ARCHS:  # (int8 against float inputs moves them by ~1e-2)
        assert np.abs(np.array(got) - np.array(want)).max() < 1e-5
    else:
        assert got == want


def test_quantize_int8_rounds_to_nearest():
    """Q8_0: every weight within half a step of its group's scale."""
    if quant.load() is None:
        pytest.skip("the quantized-weight kernels could not be built here")
    w = torch.randn(7, 96) * torch.linspace(0.01, 2, 7)[:, None]
    got = quant.quantize(w, 8).dequantize()
    g = w.reshape(7, 3, 32)
    step = (g.abs().amax(-1) / 127)[..., None]
    err = (got.reshape(7, 3, 32) - g).abs()
    assert torch.all(err <= step * 0.5 * 1.01 + 1e-6), (err / step).max()


def _reference_affine_fit(g, top, iterations=4, importance=None, search=0):
    """The int4 grid fit (kernels/quant.py's `_fit_affine`) restated as whole-tensor torch operations: from
    the range's grid; with search, from the best of the refitted codes of `search` grids over the range;
    then rounds of refitting d and m by weighted least squares and rounding the codes, keeping the best."""
    c = torch.ones(g.shape[-1]) if importance is None else importance.float()
    n, cg = c.sum(), c * g
    sw = cg.sum(-1, keepdim=True)

    def error(d, m):
        df = d.float()
        q = ((g - m.float()) * torch.where(df > 0, 1 / df, torch.zeros(()))).round().clamp(0, top)
        return (c * (q * df + m.float() - g) ** 2).sum(-1, keepdim=True), q

    def refit(q, fallback):
        sq, sqq, sqw = (c * q).sum(-1, keepdim=True), (c * q * q).sum(-1, keepdim=True), (q * cg).sum(-1, keepdim=True)
        den = n * sqq - sq * sq
        d = torch.where(den > 0, (n * sqw - sq * sw) / den.clamp(min=1e-30), fallback.float()).clamp(min=0)
        return d.half(), ((sw - d * sq) / n).half()

    def keep(d, m, q, state):
        err, codes = error(d, m)
        better = err < state[2]
        return [torch.where(better, d, state[0]), torch.where(better, m, state[1]), torch.minimum(err, state[2]),
                torch.where(better, codes, state[3]) if q is None else codes]

    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    d, m = ((hi - lo) / top).half(), lo.half()
    state = [d, m, *error(d, m)]
    for steps in torch.linspace(top - 1, top + 1, search).tolist() if search else []:
        d, m = refit(((g - lo) * (steps / (hi - lo).clamp(min=1e-30))).round().clamp(0, top), state[0])
        state = keep(d, m, None, state)
    for _ in range(iterations):
        d, m = refit(state[3], state[0])
        state = keep(d, m, True, state)
    return state[0], state[1]


@pytest.mark.parametrize("search,weighted", [(0, False), (11, False), (11, True)])
def test_int4_grid_fit_matches_its_reference(search, weighted):
    """The compiled fit of each group's int4 grid against the same method in torch operations: the same d and
    m for nearly every group (sums taken in another order may round a near tie the other way), and the same
    squared error in all, on groups of Gaussian weights at many scales, some with outliers."""
    if quant.load() is None:
        pytest.skip("the quantized-weight kernels could not be built here")
    gen = torch.Generator().manual_seed(1)
    g = torch.randn(4096, 32, generator=gen) * torch.logspace(-3, 1, 4096)[:, None]
    g[::7, 3] *= 8
    importance = torch.rand(32, generator=gen) * 4 + 0.01 if weighted else None
    *got, codes = quant._fit_affine(g, 15, importance=importance, search=search)
    want = _reference_affine_fit(g, 15, importance=importance, search=search)
    assert torch.equal(codes.float(), quant._affine_codes(g, *got, 15))  # the codes on the grids it chose
    same = (got[0] == want[0]) & (got[1] == want[1])
    assert same.float().mean() > 0.99, same.float().mean()
    c = torch.ones(32) if importance is None else importance

    def sq_error(d, m):
        q = ((g - m.float()) / d.float()).round().clamp(0, 15)
        return (c * (q * d.float() + m.float() - g) ** 2).sum(-1) / (g * g).sum(-1)

    assert abs(sq_error(*got).mean() / sq_error(*want).mean() - 1) < 1e-3


def test_quantize_int4_fits_each_group():
    """Q4_1 (int4): each group's squared error at most that of the grid spanning the group's range (rounded
    to nearest, d and m in float16 as stored), and on Gaussian weights at least 10% less in all; weights
    already on such a grid keep it exactly."""
    if quant.load() is None:
        pytest.skip("the quantized-weight kernels could not be built here")
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(64, 256, generator=gen) * torch.linspace(0.01, 2, 64)[:, None]
    g = w.reshape(64, 8, 32)
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    d, m = ((hi - lo) / 15).half().float(), lo.half().float()
    ranged = ((g - m) / d).round().clamp(0, 15) * d + m
    ranged_err = ((ranged - g) ** 2).sum(-1)
    got_err = ((quant.quantize(w, 3).dequantize().reshape(64, 8, 32) - g) ** 2).sum(-1)
    assert torch.all(got_err <= ranged_err * (1 + 1e-5) + 1e-12)
    assert got_err.sum() < 0.9 * ranged_err.sum()

    d = (torch.rand(64, 8, 1, generator=gen) + 0.1).half().float()  # a grid float16 holds exactly
    m = torch.randn(64, 8, 1, generator=gen).half().float()
    q = torch.randint(0, 16, (64, 8, 32), generator=gen).float()
    q[..., 0], q[..., 1] = 0, 15
    on_grid = (q * d + m).reshape(64, 256)
    assert torch.equal(quant.quantize(on_grid, 3).dequantize(), on_grid)


def test_int4_on_a_quantized_file_is_refused(quantized_files):
    with pytest.raises(ValueError, match=r"Q4_0.gguf is already quantized \(Q4_0, Q8_0\); quantization 'int4' "
                                         "applies to float weights"):
        _engine(quantized_files["Q4_0"], quantization="int4")
