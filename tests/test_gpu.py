"""On a CUDA GPU: the engine's tokens track transformers' on the same GPU in float32 and bfloat16, in every
scheduling mode, with decode steps replayed from CUDA graphs and eagerly; the sampler draws from its
distribution with logits on the GPU; bench roofline and compare measure the GPU. Skipped where torch sees
no CUDA GPU. TOKENMILL_TEST_DEVICE=cpu runs the same checks on the CPU (the module-by-module path: the CPU's
fused decoder is switched off), the decode graphs' padded buffers then run eagerly."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from tests.conftest import ARCHS, MOE_ARCHS, PROMPTS, reference_model, teacher_forced_logits
from tests.test_reference import MODES, block_bytes
from tests.test_sampling import LOGITS, N, expected
from tokenmill import LLM, SamplingParams
from tokenmill.engine.request import Request
from tokenmill.sample.sampler import Sampler

DEVICE = os.environ.get("TOKENMILL_TEST_DEVICE", "cuda")
pytestmark = pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason="no CUDA GPU")
MAX_NEW = 24


def make_llm(folder: str, dtype: str, graphs: bool = True, **kwargs) -> LLM:
    llm = LLM(folder, device=DEVICE, dtype=dtype, seed=0, enforce_eager=not graphs, **kwargs)
    assert llm.engine.device.type == DEVICE
    runner = llm.engine.runner
    if DEVICE == "cpu":
        llm.engine.model.use_fused_decode = False  # the CPU-only fused step
        runner.supports_bursts = False
        if graphs:
            runner.decode_graphs = runner.new_decode_graphs(capture=False)
    assert (runner.decode_graphs is not None) == graphs
    return llm


def teacher_forced_errors(folder: str, prompt_ids: list[list[int]], outs) -> tuple[list[float], list[float]]:
    """Per generated token after the first: how far below transformers' (float32, same device) best logit
    our choice lies in logprob, and how far our logprob of it is from transformers'. The requests run with
    min_tokens = max_tokens, so the end-of-sequence tokens, which they may not choose, are no one's best."""
    ref = reference_model(folder).to(DEVICE)
    eos = ref.generation_config.eos_token_id
    banned = torch.tensor([eos] if isinstance(eos, int) else list(eos or []), dtype=torch.long)
    gaps, lp_err = [], []
    for ids, out in zip(prompt_ids, outs):
        gen = out.outputs[0].token_ids
        assert len(gen) == MAX_NEW
        with torch.no_grad():
            lps = teacher_forced_logits(ref, ids + gen).float().log_softmax(-1).cpu()
        for j, t in enumerate(gen):
            ref_lp = lps[len(ids) + j - 1]
            gaps.append(float(ref_lp.index_fill(0, banned, float("-inf")).max() - ref_lp[t]))
            lp_err.append(abs(out.outputs[0].logprobs[j][t].logprob - float(ref_lp[t])))
    return gaps, lp_err


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("mode", list(MODES) + ["eager"])
def test_float32_greedy_tracks_transformers(tiny_models, arch, mode):
    """Every greedy token is transformers' choice (ties within float32 noise aside) and its logprob agrees,
    with chunked prefill, preemption and prefix caching each in play, decode steps from graphs or eager;
    no block leaks."""
    folder = tiny_models[arch]
    kwargs = dict(MODES.get(mode, {}))
    if "kv_cache_blocks" in kwargs:
        kwargs["kv_cache_memory"] = kwargs.pop("kv_cache_blocks") * block_bytes(folder, kwargs["block_size"])
    llm = make_llm(folder, "float32", graphs=mode != "eager", **kwargs)
    tok = llm.get_tokenizer()
    prompt_ids = [tok.encode(p) for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, min_tokens=MAX_NEW, logprobs=1)
    outs = llm.generate(prompt_ids, params, use_tqdm=False)
    gaps, lp_err = teacher_forced_errors(folder, prompt_ids, outs)
    assert max(gaps) < 1e-3 and max(lp_err) < 1e-3, (max(gaps), max(lp_err))
    if mode == "preempt":
        assert llm.engine.scheduler.num_preemptions > 0
    graphs = llm.engine.runner.decode_graphs
    if graphs is not None and DEVICE == "cuda":
        assert graphs.num_graphs > 0
    pool = llm.engine.kv_manager.pool
    assert pool.num_free == pool.num_blocks


@pytest.mark.parametrize("arch", ARCHS)
def test_bfloat16_decode_tracks_transformers(tiny_models, arch):
    """bf16 with 11 requests batched: each token is the float32 reference's greedy choice up to bf16
    rounding (the thresholds of the CPU's bf16 test)."""
    folder = tiny_models[arch]
    llm = make_llm(folder, "bfloat16", kv_cache_memory=1 << 22)
    tok = llm.get_tokenizer()
    prompt_ids = [tok.encode(p) for p in PROMPTS + [p + " again" for p in PROMPTS[:3]]]
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, min_tokens=MAX_NEW, logprobs=1)
    outs = llm.generate(prompt_ids, params, use_tqdm=False)
    gaps, lp_err = teacher_forced_errors(folder, prompt_ids, outs)
    # Requests finish together here; a second batch of other sizes reuses and adds graphs.
    more = llm.generate(prompt_ids[:5], params, use_tqdm=False)
    gaps5, lp_err5 = teacher_forced_errors(folder, prompt_ids[:5], more)
    gaps, lp_err = gaps + gaps5, lp_err + lp_err5
    # Mixture-of-experts models may flip a token between two nearly equal experts in bf16 (test_reference.py).
    worst, mean_gap = (2.0, 0.06) if arch in MOE_ARCHS else (0.5, 0.03)
    assert sum(lp_err) / len(lp_err) < 0.06 and max(lp_err) < worst, (sum(lp_err) / len(lp_err), max(lp_err))
    assert sum(gaps) / len(gaps) < mean_gap and max(gaps) < 2 * worst, (sum(gaps) / len(gaps), max(gaps))


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_8bit_kv_cache_from_graphs_and_eagerly(tiny_models, kind):
    """An 8-bit KV cache on the device: decode steps replayed from graphs quantize, write and read it as
    eager steps do (the same tokens and logprobs), and greedy tokens stay transformers' choices within
    what 8-bit keys and values move the logits."""
    folder = tiny_models["llama"]
    runs = []
    for graphs in (True, False):
        llm = make_llm(folder, "float32", graphs=graphs, kv_cache_dtype=kind, kv_cache_memory=1 << 22)
        tok = llm.get_tokenizer()
        prompt_ids = [tok.encode(p) for p in PROMPTS]
        params = SamplingParams(temperature=0, max_tokens=MAX_NEW, min_tokens=MAX_NEW, logprobs=1)
        outs = llm.generate(prompt_ids, params, use_tqdm=False)
        runs.append(outs)
        if graphs and DEVICE == "cuda":
            assert llm.engine.runner.decode_graphs.num_graphs > 0
    for a, b in zip(*runs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb, t in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, a.outputs[0].token_ids):
            assert abs(la[t].logprob - lb[t].logprob) < 1e-4
    gaps, lp_err = teacher_forced_errors(folder, prompt_ids, runs[0])
    stats = (sum(gaps) / len(gaps), max(gaps), sum(lp_err) / len(lp_err), max(lp_err))
    # Bounds of (mean gap, largest gap, mean logprob error, largest). The tiny models' logits are large, so
    # e4m3's 3-bit mantissas move them visibly (measured on the CPU: int8 0.001 / 0.08 / 0.02 / 0.11,
    # fp8 0.02 / 0.63 / 0.10 / 0.50).
    bounds = (0.01, 0.3, 0.05, 0.3) if kind == "int8" else (0.05, 1.0, 0.2, 1.0)
    assert all(x < b for x, b in zip(stats, bounds)), stats


@pytest.mark.parametrize("kwargs", [{"temperature": 0.7}, {"temperature": 1.0, "top_k": 3},
                                    {"temperature": 1.0, "top_p": 0.8, "min_p": 0.1}])
def test_sampling_distribution_with_logits_on_the_device(kwargs):
    sampler = Sampler(len(LOGITS), seed=1234)
    reqs = [Request(str(i), [0], SamplingParams(**kwargs), 16) for i in range(N)]
    tokens, _ = sampler(LOGITS.to(DEVICE).repeat(N, 1), reqs)
    observed = np.bincount(tokens, minlength=len(LOGITS)) / N
    target = expected(LOGITS.numpy().astype(np.float64), **kwargs)
    assert np.all(observed[target == 0] == 0)
    allowed = target > 0
    chi2 = N * np.sum((observed[allowed] - target[allowed]) ** 2 / target[allowed])
    assert chi2 < 24.3, (observed, target)  # 99.9% quantile of chi-square with <= 7 degrees of freedom


def test_seeded_sampling_is_reproducible_in_a_batch(tiny_models):
    llm = make_llm(tiny_models["llama"], "float32")
    seeded = SamplingParams(temperature=1.0, seed=42, max_tokens=16, ignore_eos=True)
    alone = llm.generate([PROMPTS[0]], seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    mixed = llm.generate(PROMPTS[1:4] + [PROMPTS[0]], [others] * 3 + [seeded], use_tqdm=False)
    assert mixed[3].outputs[0].token_ids == alone


def test_roofline_measures_the_device(tiny_models):
    from tokenmill.bench.roofline import memory_bandwidth, run_roofline

    llm = make_llm(tiny_models["llama"], "bfloat16")
    r = run_roofline(llm, context=8, prompt_len=16, repeats=3)
    assert r["device"].startswith(DEVICE)
    low, high = r["memory_bandwidth_range_GBps"]
    assert 0 < low <= high and r["matmul_GFLOPs"] > 0 and r["decode_tokens_per_s"] > 0
    if DEVICE == "cuda":
        # The GPU's memory, not the host's, is what was measured.
        host = memory_bandwidth(repeats=3, size_bytes=1 << 28) / 1e9
        assert high > 2 * host, (high, host)


def test_compare_runs_transformers_on_the_device(tiny_models):
    from tokenmill.bench.compare import TransformersRunner
    from tokenmill.bench.datasets import random_requests

    hf = TransformersRunner(tiny_models["qwen2"], torch.bfloat16, batch_size=4, device=DEVICE)
    assert next(hf.model.parameters()).device.type == DEVICE
    assert hf.generate(random_requests(6, (3, 12), (2, 5), 400, seed=2)) > 0
