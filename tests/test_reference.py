"""Greedy tokens and logprobs equal Hugging Face transformers' in every scheduling mode."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import (ARCHS, PROMPTS, block_bytes, hf_greedy, reference_model,  # noqa: F401 (block_bytes: shared)
                            teacher_forced_logits)
from tokenmill import LLM, SamplingParams
from tokenmill.kernels import cpu as cpu_kernels

MAX_NEW = 32

# name -> LLM keyword arguments; each mode must give the same greedy tokens.
MODES = {
    "plain": {},
    "no-prefix-cache": {"enable_prefix_caching": False},
    "chunked": {"max_num_batched_tokens": 7},
    # 20 blocks of 4 tokens hold the longest request (69 tokens) but not 8 requests at once.
    "preempt": {"block_size": 4, "kv_cache_blocks": 20},
}



_reference_cache: dict[str, tuple] = {}


def reference(folder: str, prompt_ids: list[list[int]]):
    if folder not in _reference_cache:
        _reference_cache[folder] = hf_greedy(folder, prompt_ids, MAX_NEW)
    return _reference_cache[folder]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_matches_transformers(tiny_models, arch, mode):
    folder = tiny_models[arch]
    kwargs = dict(MODES[mode])
    if "kv_cache_blocks" in kwargs:
        kwargs["kv_cache_memory"] = kwargs.pop("kv_cache_blocks") * block_bytes(folder, kwargs["block_size"])
    llm = LLM(folder, dtype="float32", seed=0, **kwargs)
    tok = llm.get_tokenizer()
    prompt_ids = [tok.encode(p) for p in PROMPTS]
    ref_tokens, ref_logprobs = reference(folder, prompt_ids)

    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, min_tokens=MAX_NEW, logprobs=5)
    outs = llm.generate(prompt_ids, params)

    for i, out in enumerate(outs):
        assert out.outputs[0].token_ids == ref_tokens[i], f"prompt {i} differs from transformers"
        first = out.outputs[0].logprobs[0]
        top = torch.topk(ref_logprobs[i], 5)
        for value, token in zip(top.values.tolist(), top.indices.tolist()):
            assert token in first, f"prompt {i}: transformers' top token {token} missing from our top 5"
            assert abs(first[token].logprob - value) < 1e-4
    engine = llm.engine
    if mode == "preempt":
        assert engine.scheduler.num_preemptions > 0, "the pool was meant to be too small to avoid preemption"
    if mode == "chunked":
        assert max(len(p) for p in prompt_ids) > 7, "some prompt must be longer than the token budget"
    # Nothing leaked: every block is back in the free queue with no reference.
    pool = engine.kv_manager.pool
    assert pool.num_free == pool.num_blocks
    assert all(b.ref_cnt == 0 for b in pool.blocks)


@pytest.mark.parametrize("arch", ["llama", "gemma3", "phi3", "mixtral", "qwen2-moe", "qwen3-moe"])
def test_shared_prefixes_reuse_cache_and_match(tiny_models, arch):
    """Many requests sharing prefixes of different lengths: cache hits happen, tokens equal transformers'
    (Gemma 3's: windows of 8 over blocks of 4, so hits end inside and beyond local layers' windows; Phi-3's:
    prompts on both sides of its LongRoPE switch, whose blocks differ, and requests recomputed as they grow
    past it, which may then take the longer prompts' blocks)."""
    folder = tiny_models[arch]
    llm = LLM(folder, dtype="float32", block_size=4)
    tok = llm.get_tokenizer()
    base = tok.encode(PROMPTS[5])
    prompt_ids = [base[:n] + tok.encode(tail) for n in (4, 9, 17, 25) for tail in (" fox", " dog jumps")]
    ref_tokens, _ = hf_greedy(folder, prompt_ids, 16)
    params = SamplingParams(temperature=0, max_tokens=16, min_tokens=16)
    llm.generate(prompt_ids[:1], params)  # warm the cache with one of them
    outs = llm.generate(prompt_ids, params)
    assert [o.outputs[0].token_ids for o in outs] == ref_tokens
    assert sum(o.num_cached_tokens for o in outs) > 0
    assert llm.engine.kv_manager.num_hit_tokens > 0


def test_parallel_samples_share_prompt_blocks(tiny_models):
    """n > 1 and identical prompts arriving together reuse the prompt's blocks, and still match transformers."""
    folder = tiny_models["qwen3"]
    llm = LLM(folder, dtype="float32", block_size=4)
    tok = llm.get_tokenizer()
    prompt = tok.encode(PROMPTS[5])
    ref_tokens, _ = hf_greedy(folder, [prompt], 12)
    params = SamplingParams(n=3, temperature=0, max_tokens=12, min_tokens=12)
    out = llm.generate([prompt], params)[0]
    assert [c.token_ids for c in out.outputs] == ref_tokens * 3
    full_blocks = (len(prompt) - 1) // 4
    # Children 1 and 2 find the blocks child 0 writes in the same step.
    assert llm.engine.kv_manager.num_hit_tokens == 2 * full_blocks * 4
    same = llm.generate([prompt + [5]] * 3, SamplingParams(temperature=0, max_tokens=4))
    assert all(o.num_cached_tokens >= full_blocks * 4 for o in same[1:])


@pytest.mark.parametrize("arch", ARCHS)
# Fused decode steps of up to 32 requests run in one parallel region (1 row: the one-row GEMV; 3: the
# blocked one; 11: two groups of rows over each tile of weight rows), of up to 8 with a mixture of experts
# (11: operation by operation inside the fused step, torch's GEMM for dense weights).
@pytest.mark.parametrize("fused,num_requests", [(True, 1), (True, 3), (True, 11), (False, 11)],
                         ids=["fused-1", "fused-3", "fused-11", "modules-11"])
def test_bfloat16_decode_tracks_transformers(tiny_models, arch, fused, num_requests):
    """bf16 (fused whole-step decode where the CPU kernels run, and module by module) against transformers
    in float32, teacher-forced on our own tokens: each chosen token is the reference's greedy choice up to
    bf16 rounding, and its logprob agrees with the reference's."""
    folder = tiny_models[arch]
    llm = LLM(folder, dtype="bfloat16", seed=0, kv_cache_memory=1 << 22)
    model = llm.engine.model
    model.use_fused_decode = fused
    used = []
    pick = model._fused_decoder
    model._fused_decoder = lambda *a: used.append(pick(*a)) or used[-1]
    tok = llm.get_tokenizer()
    prompt_ids = [tok.encode(p) for p in PROMPTS + [p + " again" for p in PROMPTS[:3]]][:num_requests]
    assert len(prompt_ids) == num_requests
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, min_tokens=MAX_NEW, logprobs=1)
    outs = llm.generate(prompt_ids, params, use_tqdm=False)
    fused_steps = sum(f is not None for f in used)
    if fused and cpu_kernels.load() is not None:
        assert fused_steps > MAX_NEW // 2, "decode-only steps should run fused"
    else:
        assert fused_steps == 0

    ref = reference_model(folder)
    lp_err, gaps = [], []
    for ids, out in zip(prompt_ids, outs):
        gen = out.outputs[0].token_ids
        with torch.no_grad():
            lps = teacher_forced_logits(ref, ids + gen).float().log_softmax(-1)
        for j, t in enumerate(gen[1:], start=1):  # the decode steps (the first token comes from prefill)
            ref_lp = lps[len(ids) + j - 1]
            gaps.append(float(ref_lp.max() - ref_lp[t]))
            lp_err.append(abs(out.outputs[0].logprobs[j][t].logprob - float(ref_lp[t])))
    # bf16 rounding moves these tiny random models' logprobs by ~0.02 nats on average (either path);
    # a wrong operation (a rotary left out, say) moves them by 1-2.5 nats on average. In a mixture of
    # experts, rounding also flips a token's choice between two nearly equal experts now and then, which
    # moves that token's logprob by up to ~1.8 nats here (transformers' own bf16 against its float32 too).
    # Such flips also shift a request's later logprobs a little (through its cache): over 16 prompts one at a
    # time the tiny Mixtral's mean error is 0.05 nats on either path, but single prompts reach 0.17 on either.
    moe = model.config.moe is not None
    worst, mean_gap, mean_err = (2.0, 0.06, 0.2) if moe else (0.5, 0.03, 0.06)
    assert sum(lp_err) / len(lp_err) < mean_err and max(lp_err) < worst, (sum(lp_err) / len(lp_err), max(lp_err))
    assert sum(gaps) / len(gaps) < mean_gap and max(gaps) < 2 * worst, (sum(gaps) / len(gaps), max(gaps))


# one-row GEMV, blocked GEMV, two groups of rows a tile of weight rows, operation by operation (torch's GEMM)
@pytest.mark.parametrize("num_requests", [1, 3, 11, 33])
def test_fused_logits_sample_as_the_separate_output_layer(tiny_models, num_requests):
    """Decode steps that sample take their logits from the fused decoder's one call (the layers and the
    output layer together): the same tokens and logprobs, seeded, as the hidden states through the
    model's own output layer. Up to 8 rows both are the same GEMV, bit for bit; past 8 the layer is torch's
    GEMM, whose float32 sums run in another order, so now and then a logit rounds to the neighbouring
    bfloat16 value (1 of 52,800 here, moving the logprobs ~2e-7): there the logprobs agree within 1e-3."""
    if cpu_kernels.load() is None:
        pytest.skip("the CPU decode kernels do not run here")
    folder = tiny_models["llama"]
    prompts = [list(range(10 + i, 30 + 2 * i)) for i in range(num_requests)]
    params = [SamplingParams(temperature=0.9, top_p=0.95, max_tokens=12, ignore_eos=True, logprobs=2, seed=i)
              for i in range(num_requests)]
    results = []
    for one_call in (True, False):
        llm = LLM(folder, dtype="bfloat16", seed=0, kv_cache_memory=1 << 22)
        model = llm.engine.model
        calls = []
        own = model.decode_logits
        model.decode_logits = lambda *a: calls.append(own(*a) if one_call else None) or calls[-1]
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert len(calls) >= 11 and all((c is not None) == one_call for c in calls)
        results.append([(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs])
                        for o in outs])
    if num_requests <= cpu_kernels.load().max_gemv_rows:
        assert results[0] == results[1]
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(*results):
        assert tokens == want_tokens
        for got, want in zip(logprobs, want_logprobs):
            assert got.keys() == want.keys() and got == pytest.approx(want, abs=1e-3)


@pytest.mark.parametrize("arch,rows", [("llama", 32), ("mixtral", 8)])
def test_decode_steps_past_8_requests_run_in_one_parallel_region(tiny_models, arch, rows):
    """Past 8 requests a decode step still reads each weight once, in one parallel region (the team): the
    dense GEMV passes groups of input rows over tiles of weight rows, the block formats' products take
    their rows in groups already. Mixtures of experts stay at 8. Twelve requests decoding together: team
    regions counted for the dense model, none for the mixture (its step goes operation by operation)."""
    if cpu_kernels.load() is None:
        pytest.skip("the CPU decode kernels do not run here")
    llm = LLM(tiny_models[arch], dtype="bfloat16", seed=0, kv_cache_memory=1 << 22)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    llm.generate([[5, 6, 7]], params, use_tqdm=False)  # builds the decoder
    decoder = llm.engine.model._fused[1]
    assert decoder.team_rows() == rows
    before = decoder.team_stats()[0]
    llm.generate([[(11 * i + j) % 200 + 3 for j in range(9)] for i in range(12)], params, use_tqdm=False)
    regions = decoder.team_stats()[0] - before
    assert (regions > 0) == (rows >= 12), regions


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_request_s_logits_in_a_step_of_12_are_those_it_gets_alone(tiny_models, arch):
    """Each request's logits from a fused decode step of 12 (two groups of input rows over each tile of
    weight rows) are the bits that request gets in a step of its own (the one-row GEMV): a row's sums do
    not depend on the rows beside it."""
    if cpu_kernels.load() is None:
        pytest.skip("the CPU decode kernels do not run here")
    # Single steps: a burst would draw these sampled tokens inside the decoder, without decode_logits.
    llm = LLM(tiny_models[arch], dtype="bfloat16", seed=0, kv_cache_memory=1 << 22, num_scheduler_steps=1)
    model = llm.engine.model
    own, seen = model.decode_logits, []

    def spy(ids, pos, kv, meta):
        decoder = model._fused_decoder(kv, meta)
        if decoder is not None and len(ids) == 12 and not seen:
            args = (ids, pos, meta.slot_mapping, meta.decode_block_tables, meta.decode_seq_lens)
            seen.append(torch.cat([decoder.logits(*(a[b:b + 1] for a in args)) for b in range(12)]))
            seen.append(decoder.logits(*args))
        return own(ids, pos, kv, meta)

    model.decode_logits = spy
    params = SamplingParams(temperature=0.8, max_tokens=4, ignore_eos=True, seed=1)
    llm.generate([[(11 * i + j) % 200 + 3 for j in range(9 + i)] for i in range(12)], params, use_tqdm=False)
    assert seen, "no decode step of 12 requests ran fused"
    alone, together = seen
    assert torch.equal(alone, together)
