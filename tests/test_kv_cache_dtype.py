"""8-bit KV caches (kv_cache_dtype int8 / fp8): the codes, the attention kernels that read them in place,
the engine paths that write them, and what they cost in quality on the default model."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.attention import kv_format
from tokenmill.attention.backend import AttentionMetadata
from tokenmill.attention.cpu import TorchSDPABackend
from tokenmill.kernels import cpu as cpu_kernels

kernel = cpu_kernels.load()
needs_kernels = pytest.mark.skipif(kernel is None, reason="needs AVX-512 and a C++ compiler")


def _rows(n, kvh, d, seed):
    """Rows of K-like values: per row a different magnitude (1e-3 to 1e3), a few outliers, an all-zero row."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, kvh, d, generator=g) * torch.logspace(-3, 3, n * kvh).view(n, kvh, 1)
    x[1, 0, 3] = 40 * x[1, 0].abs().max()  # one value far above the rest of its row
    x[2, -1] = 0.0
    return x


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_codes_hold_each_value_to_the_format_precision(kind):
    """value - code * scale: at most half an int8 step (scale / 2) for int8; for e4m3 half a step at the
    value's own exponent (2^-4 of it) or half the smallest subnormal step (scale * 2^-10). Only a row's
    largest value may sit past the last code (the bf16 scale is rounded: by up to 2^-8 of it)."""
    x = _rows(40, 3, 64, seed=1).float()
    cache = kv_format.KVCache.allocate(kind, 40, 3, 64, lambda shape, dtype: torch.zeros(shape, dtype=dtype))
    back = cache.write(torch.arange(40), x).double()
    x = x.double()
    scale = cache.scales.double().unsqueeze(-1)
    amax = x.abs().amax(-1, keepdim=True)
    assert torch.all((scale - amax / cache.qmax).abs() <= amax / cache.qmax * 2 ** -8 * 1.0001)
    err = (back - x).abs()
    step = scale * 0.5 if kind == "int8" else torch.maximum(x.abs() * 2 ** -4, scale * 2 ** -10)
    clamped = x.abs() == amax
    assert torch.all(err[~clamped] <= step.expand_as(x)[~clamped] * (1 + 1e-9))
    assert torch.all(err[clamped] <= (step + amax * 2 ** -8).expand_as(x)[clamped] * (1 + 1e-9))
    assert torch.all(back[2, -1] == 0) and torch.all(cache.scales[2, -1] == 0)
    assert torch.equal(cache.read(torch.arange(40), torch.float32), back.float())
    # A code row takes head_dim bytes plus a 2-byte scale.
    assert kv_format.bytes_per_row(kind, 64, torch.bfloat16) == 66
    assert kv_format.bytes_per_row("auto", 64, torch.float32) == 256


@needs_kernels
@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_writes_the_codes_python_writes(kind, dtype):
    """The fused decoder's cache writes (quantize_kv) and the module path's (KVCache.write) give the same
    bits, so a token's cache row does not depend on which path computed the step."""
    x = _rows(64, 2, 80, seed=2)
    # Rows whose scale is exactly 1 (largest value 127, or 448 for e4m3), so x / scale is x itself:
    # halves between int8 codes (ties go to even), values between e4m3 codes, and -0.0.
    qmax = 127.0 if kind == "int8" else 448.0
    ties = torch.arange(80) % 16 - 7.5 if kind == "int8" else torch.tensor([1.0625, 17.0, 0.0029296875, -9.5, 208.0] * 16)
    x[3, 0], x[3, 1] = ties, -ties
    x[3, :, 0] = qmax
    x[4, 0] = -0.0
    x[5, 0] = 1e-30  # a tiny scale (bfloat16 keeps float32's exponent range)
    x[6, 1] = 0.3  # every value equal
    x = x.to(dtype)
    cache = kv_format.KVCache.allocate(kind, 64, 2, 80, lambda shape, dtype: torch.zeros(shape, dtype=dtype))
    codes, scales = cache.quantize(x)
    kcodes, kscales = kernel.quantize_kv(x, kind)
    assert kcodes.dtype == codes.dtype and kscales.dtype == torch.bfloat16
    assert torch.equal(kcodes.view(torch.uint8), codes.view(torch.uint8))
    assert torch.equal(kscales, scales)
    if dtype == torch.float32:
        # int8: halves to the even neighbour; e4m3: 1.0625 -> 1, 17 -> 16, 3 * 2^-10 -> 2^-8 (subnormals),
        # -9.5 -> -10 (the neighbour with an even last mantissa bit); 208 is a code.
        want = ties.round() if kind == "int8" else torch.tensor([1.0, 16.0, 2.0 ** -8, -10.0, 208.0] * 16)
        assert scales[3, 0] == 1 and torch.equal(codes[3, 0, 1:].float(), want[1:])
    # A row holding NaN or infinity reads back as NaN, the other rows of the token as they are.
    bad = torch.randn(2, 2, 16).to(dtype)
    bad[0, 0, 3], bad[1, 1, 5] = float("nan"), float("inf")
    for c, s in (cache.quantize(bad), kernel.quantize_kv(bad, kind)):
        back = cache.dequantize(c, s, torch.float32)
        assert back[0, 0].isnan().all() and back[1, 1].isnan().all()
        assert back[0, 1].isfinite().all() and back[1, 0].isfinite().all()
        assert (c[0, 0].float() == 0).all() and (c[1, 1].float() == 0).all()


def _quantized_case(kind, lens, h, kvh, d, bs, dtype, seed):
    """Caches whose rows' magnitudes differ by up to 8x from slot to slot and head to head, so a scale
    taken from the wrong token or head shows."""
    g = torch.Generator().manual_seed(seed)
    width = max(-(-n // bs) for n in lens)
    blocks = len(lens) * width
    caches = []
    for _ in range(2):
        c = kv_format.KVCache.allocate(kind, blocks * bs, kvh, d, lambda shape, dtype: torch.zeros(shape, dtype=dtype))
        magnitude = 2.0 ** torch.randint(-2, 2, (blocks * bs, kvh, 1), generator=g)
        c.write(torch.arange(blocks * bs), torch.randn(blocks * bs, kvh, d, generator=g) * magnitude)
        caches.append(c)
    q = torch.randn(len(lens), h, d, generator=g).to(dtype)
    bt = torch.randperm(blocks, generator=g).reshape(len(lens), width)
    return q, caches[0], caches[1], bt, torch.tensor(lens)


def _reference(q, k, v, bt, lens, bs, window, scale):
    """float64 attention over the values the caches hold."""
    slots = torch.arange(k.codes.shape[0])
    keys, values = k.read(slots, torch.float64), v.read(slots, torch.float64)
    out = torch.empty(q.shape, dtype=torch.float64)
    for i in range(q.shape[0]):
        n = int(lens[i])
        pos = torch.arange(n)
        s = bt[i][pos // bs] * bs + pos % bs
        group = q.shape[1] // keys.shape[1]
        kk, vv = keys[s].repeat_interleave(group, 1), values[s].repeat_interleave(group, 1)
        scores = torch.einsum("hd,nhd->hn", q[i].double(), kk) * scale
        if window:
            scores[:, : max(0, n - window)] = float("-inf")
        out[i] = torch.einsum("hn,nhd->hd", scores.softmax(-1), vv)
    return out


@needs_kernels
@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d,h,kvh", [(64, 9, 3), (16, 4, 4), (80, 7, 1), (128, 8, 2)])
@pytest.mark.parametrize("lens,window", [([1, 7, 29, 33], None), ([300], None), ([5, 400], 100)])
@pytest.mark.parametrize("plan_threads", [0, 32])  # 32: parts per KV head (kh0 > 0) even for several requests
def test_decode_attention_reads_the_codes_in_place(kind, dtype, d, h, kvh, lens, window, plan_threads, monkeypatch):
    """The kernel against float64 attention over the dequantized cache: only float32 sums (and the bf16
    output rounding) differ. One long request splits into token ranges merged afterwards; several short
    ones do not; planned for many threads, requests split per KV head. The portable path (gather and
    dequantize) agrees as well."""
    bs = 16
    q, k, v, bt, lens_t = _quantized_case(kind, lens, h, kvh, d, bs, dtype, seed=d + h + len(lens))
    scale = d ** -0.5
    ref = _reference(q, k, v, bt, lens_t, bs, window, scale)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    kernel.set_plan_threads(plan_threads)
    try:
        out = kernel.paged_decode_attention(q, k.codes, v.codes, bt, lens_t, bs, scale, window or 0, k.scales,
                                            v.scales)
    finally:
        kernel.set_plan_threads(0)
    assert out.dtype == dtype
    assert torch.allclose(out.double(), ref, atol=tol, rtol=tol), (out.double() - ref).abs().max()
    meta = AttentionMetadata(slot_mapping=torch.tensor([], dtype=torch.long), query_start_loc=[], seq_lens=[],
                             num_decodes=q.shape[0], decode_block_tables=bt, decode_seq_lens=lens_t,
                             block_tables=[], block_size=bs)
    monkeypatch.setattr(cpu_kernels, "load", lambda: None)
    fallback = TorchSDPABackend._decode(q, k, v, meta, scale, window)
    # In bf16 the portable path also rounds the values and the weights to bf16 (rows up to 2x larger here).
    assert torch.allclose(fallback.double(), ref, atol=2 * tol, rtol=tol)


@needs_kernels
def test_kernel_refuses_mismatched_caches():
    q, k, v, bt, lens = _quantized_case("int8", [5], 4, 2, 16, 16, torch.float32, seed=0)
    with pytest.raises(RuntimeError, match="needs its scales"):
        kernel.paged_decode_attention(q, k.codes, v.codes, bt, lens, 16, 0.25, 0)
    with pytest.raises(RuntimeError, match="bfloat16 \\[slots, KV heads\\]"):
        kernel.paged_decode_attention(q, k.codes, v.codes, bt, lens, 16, 0.25, 0, k.scales.float(), v.scales)
    plain = torch.zeros(k.codes.shape)
    with pytest.raises(RuntimeError, match="takes no scales"):
        kernel.paged_decode_attention(q, plain, plain, bt, lens, 16, 0.25, 0, k.scales, v.scales)


def test_kv_cache_dtype_is_checked_and_sizes_the_cache(tiny_models):
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, int8, fp8"):
        LLM(tiny_models["llama"], kv_cache_dtype="int4")
    blocks = {}
    for kind in ("auto", "int8", "fp8_e4m3"):
        llm = LLM(tiny_models["llama"], dtype="float32", kv_cache_memory="4MiB", kv_cache_dtype=kind)
        blocks[kind] = llm.engine.num_blocks
    d = 16  # head_dim of the tiny models: float32 rows of 64 bytes against 16 codes + a 2-byte scale
    assert blocks["int8"] == blocks["fp8_e4m3"] == (4 << 20) // (2 * 2 * 16 * 2 * (d + 2))
    assert blocks["int8"] / blocks["auto"] == pytest.approx(4 * d / (d + 2), rel=0.01)


def _greedy(llm, prompts, n=12):
    outs = llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


PROMPTS = [[(11 * i + 5 * j) % 200 + 3 for j in range(20 + 9 * i)] for i in range(4)]


def _prompt_logprobs(llm, prompts):
    outs = llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    return np.array([o.prompt_logprobs[i][p[i]].logprob for o, p in zip(outs, prompts) for i in range(1, len(p))])


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_schedules_see_the_same_cache_values(tiny_models, kind):
    """A prompt attends over its K/V as the cache holds them, whether it runs in one chunk (its own K/V,
    read back) or in several (earlier chunks from the cache), alone, batched or from the prefix cache: the
    same prompt logprobs (to float32 sums) and greedy tokens, where the cache in the model's dtype gives
    visibly different logprobs."""
    folder = tiny_models["llama"]
    llm = LLM(folder, dtype="float32", kv_cache_memory="8MiB", kv_cache_dtype=kind)
    alone = [_greedy(llm, [p])[0] for p in PROMPTS]
    assert _greedy(llm, PROMPTS) == alone
    assert _greedy(llm, PROMPTS) == alone  # prompts now in the prefix cache
    whole = _prompt_logprobs(llm, PROMPTS)
    chunked = LLM(folder, dtype="float32", kv_cache_memory="8MiB", kv_cache_dtype=kind, max_num_batched_tokens=16,
                  long_prefill_token_threshold=8, enable_prefix_caching=False)
    assert _greedy(chunked, PROMPTS) == alone
    assert np.abs(_prompt_logprobs(chunked, PROMPTS) - whole).max() < 1e-4
    exact = _prompt_logprobs(LLM(folder, dtype="float32", kv_cache_memory="8MiB", enable_prefix_caching=False), PROMPTS)
    assert np.abs(exact - whole).max() > 1e-3


@needs_kernels
@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral", "gemma3"])
@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_decoder_agrees_with_the_module_path(tiny_models, arch, kind, dtype):
    """The whole-step decoder writes and reads the 8-bit cache (bursts and sampled steps, 1 and 4 requests);
    the module path, teacher-forced on its tokens, reads the same codes: its top token is the fused
    path's at 99% of positions or more, and logprobs agree closely."""
    folder = tiny_models[arch]
    llm = LLM(folder, dtype=dtype, kv_cache_memory="8MiB", kv_cache_dtype=kind)
    model = llm.engine.model
    used = []
    pick = model._fused_decoder
    model._fused_decoder = lambda *a: used.append(pick(*a)) or used[-1]
    runs = [(p, g) for n in (1, 4) for p, g in zip(PROMPTS[:n], _greedy(llm, PROMPTS[:n], n=16))]
    outs = llm.generate(PROMPTS, [SamplingParams(max_tokens=10, temperature=0.8, seed=i, logprobs=1, ignore_eos=True)
                                  for i in range(len(PROMPTS))], use_tqdm=False)
    assert any(f is not None for f in used)
    reference = LLM(folder, dtype=dtype, kv_cache_memory="8MiB", kv_cache_dtype=kind)
    reference.engine.model.use_fused_decode = False

    def forced(prompt, gen):
        out = reference.generate([prompt + gen], SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)[0]
        return [{t: lp.logprob for t, lp in row.items()} for row in out.prompt_logprobs[len(prompt):]]

    gaps, errors = [], []
    for prompt, gen in runs:
        gaps += [max(row.values()) - row[t] for row, t in zip(forced(prompt, gen), gen)]
    for prompt, o in zip(PROMPTS, outs):
        gen = o.outputs[0].token_ids
        errors += [abs(row[t] - lp[t].logprob) for row, t, lp in zip(forced(prompt, gen), gen, o.outputs[0].logprobs)]
    gaps, errors = np.array(gaps), np.array(errors)
    if dtype == "float32":
        assert np.mean(gaps == 0) >= 0.99 and gaps.max() < 0.05, (np.mean(gaps == 0), gaps.max())
        assert errors.max() < 0.02, errors.max()
    else:
        assert gaps.mean() < 0.03 and gaps.max() < 1.0, (gaps.mean(), gaps.max())
        assert errors.mean() < 0.06 and errors.max() < 0.5, (errors.mean(), errors.max())


@pytest.mark.slow
def test_default_model_quality(default_gguf):
    """int8 against the cache in the model's dtype on the real default model, over the same contexts (chat
    prompts and the auto cache's greedy answers to them, teacher-forced): the greedy token is the same at 95%
    of positions or more, and perplexity over real English text (4 windows of 512 tokens) is within 1%.
    fp8 (3 mantissa bits): perplexity within 3%. (Free-running answers are not compared token by token:
    after the first near-tie that flips, they are different texts.)"""
    from tokenmill.data import default_text
    from tokenmill.eval import perplexity

    prompts = ["What is the capital of France?", "Write a haiku about the sea.", "How do plants make food?",
               "Give three tips for learning to code.", "Why is the sky blue?", "What is 12 times 7?"]
    contexts, starts, results = None, None, {}
    for kind in ("auto", "int8", "fp8"):
        llm = LLM(default_gguf, kv_cache_memory="64MiB", kv_cache_dtype=kind, enable_prefix_caching=False)
        if contexts is None:
            outs = llm.chat([[{"role": "user", "content": p}] for p in prompts],
                            SamplingParams(max_tokens=48, temperature=0, ignore_eos=True), use_tqdm=False)
            contexts = [o.prompt_token_ids + o.outputs[0].token_ids for o in outs]
            starts = [len(o.prompt_token_ids) for o in outs]
        scored = llm.generate(contexts, SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)
        greedy = [[max(row, key=lambda t: row[t].logprob) for row in o.prompt_logprobs[n:]]
                  for o, n in zip(scored, starts)]
        ppl = perplexity(llm, default_text(), ctx=512, max_windows=4, progress=False).perplexity
        results[kind] = greedy, ppl
        del llm
    base_greedy, base_ppl = results["auto"]

    def agreement(kind):
        pairs = [(a, b) for x, y in zip(base_greedy, results[kind][0]) for a, b in zip(x, y)]
        assert len(pairs) == 6 * 48
        return sum(a == b for a, b in pairs) / len(pairs)

    assert agreement("int8") >= 0.95, agreement("int8")
    assert results["int8"][1] == pytest.approx(base_ppl, rel=0.01), (results["int8"][1], base_ppl)
    assert results["fp8"][1] == pytest.approx(base_ppl, rel=0.03), (results["fp8"][1], base_ppl)
    assert 5 < base_ppl < 100
