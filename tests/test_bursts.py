"""Bursts of decode steps run back to back in the fused CPU decoder (num_scheduler_steps > 1): the same
tokens, text, stops and KV-cache state as one step at a time (greedy ones transformers' choices, sampled
ones the sampler kernel's draws from the same numbers), each step handed to a stream as it is done."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from tests.conftest import ARCHS, PROMPTS, reference_model, teacher_forced_logits
from tokenmill import LLM, SamplingParams
from tokenmill.kernels import cpu as cpu_kernels
from tokenmill.sampling_params import RequestOutputKind

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="the CPU decode kernels do not run here")

MAX_NEW = 24


def _count_bursts(llm) -> list[int]:
    """Records the length of every burst the engine runs (the steps it returned)."""
    runner = llm.engine.runner
    lengths: list[int] = []
    run = runner.execute_burst

    def spy(*args):
        out = run(*args)
        if out is not None:
            lengths.append(len(out))
        return out

    runner.execute_burst = spy
    return lengths


def _llm(folder, steps, **kw):
    return LLM(folder, dtype="bfloat16", seed=0, kv_cache_memory=1 << 22, num_scheduler_steps=steps, **kw)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("num_requests", [1, 3, 11])  # one-row GEMV, blocked GEMV, two groups a weight tile
def test_bursts_choose_transformers_greedy_tokens(tiny_models, arch, num_requests):
    """Tokens from bursts are the ones single steps choose, and each is transformers' (float32) greedy
    choice up to bf16 rounding, teacher-forced on our own tokens."""
    folder = tiny_models[arch]
    burst, single = _llm(folder, 8), _llm(folder, 1)
    lengths = _count_bursts(burst)
    tok = burst.get_tokenizer()
    prompt_ids = [tok.encode(p) for p in PROMPTS + [p + " again" for p in PROMPTS[:3]]][:num_requests]
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = burst.generate(prompt_ids, params, use_tqdm=False)
    if burst.engine.model.kv_recompute_length is None:
        assert max(lengths) == 8 and sum(lengths) >= MAX_NEW - 8, lengths  # decode ran in bursts
    else:  # bursts also end where a request grows past the switch of a LongRoPE model (it is recomputed there)
        assert max(lengths) > 1, lengths
    expected = single.generate(prompt_ids, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in expected]

    ref = reference_model(folder)
    gaps = []
    for ids, out in zip(prompt_ids, outs):
        gen = out.outputs[0].token_ids
        assert len(gen) == MAX_NEW
        with torch.no_grad():
            lps = teacher_forced_logits(ref, ids + gen).float().log_softmax(-1)
        for j, t in enumerate(gen[1:], start=1):
            row = lps[len(ids) + j - 1]
            gaps.append(float(row.max() - row[t]))
    # As in the bf16 decode test: rounding costs these tiny models ~0.01 nats; a wrong token, 1 or more. In a
    # mixture of experts rounding also flips a choice between two nearly equal experts now and then (up to
    # ~1.8 nats on a token here, as transformers' own bf16 against its float32).
    worst, mean_gap = (4.0, 0.06) if burst.engine.model.config.moe is not None else (1.0, 0.03)
    assert sum(gaps) / len(gaps) < mean_gap and max(gaps) < worst, (sum(gaps) / len(gaps), max(gaps))

    # The cache the bursts wrote serves prefix hits as the single steps' cache does: continuing each
    # prompt + its output reads the decoded tokens' K and V from it.
    again = [ids + out.outputs[0].token_ids[:20] for ids, out in zip(prompt_ids, outs)]
    short = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    hits = burst.generate(again, short, use_tqdm=False)
    assert all(h.num_cached_tokens > len(ids) for h, ids in zip(hits, prompt_ids))
    expected = single.generate(again, short, use_tqdm=False)
    assert [h.outputs[0].token_ids for h in hits] == [e.outputs[0].token_ids for e in expected]


def _single_and_burst(tiny_models, num_prompts: int, max_tokens: int):
    """Engines taking single steps and bursts, the burst lengths recorded, prompts, and each prompt's
    free-running greedy completion (to place stops inside bursts)."""
    folder = tiny_models["llama"]
    single, burst = _llm(folder, 1), _llm(folder, 8)
    lengths = _count_bursts(burst)
    tok = single.get_tokenizer()
    prompts = [tok.encode(p) for p in PROMPTS[:num_prompts]]
    free = single.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                           use_tqdm=False)
    return single, burst, lengths, prompts, [o.outputs[0] for o in free]


def test_bursts_stop_where_single_steps_stop(tiny_models):
    """max_tokens, stop tokens, EOS and stop strings that fall inside a burst end each request exactly
    where single steps end it; the steps a burst ran past a stop leave no blocks behind."""
    single, burst, lengths, prompts, gen = _single_and_burst(tiny_models, 4, 40)
    params = [
        SamplingParams(temperature=0, max_tokens=13, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[gen[1].token_ids[11]], ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=40, stop=[gen[2].text[len(gen[2].text) // 2:][:3]], ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=40).clone(_eos_token_ids=(gen[3].token_ids[9],)),
    ]
    want = single.generate(prompts, params, use_tqdm=False)
    got = burst.generate(prompts, params, use_tqdm=False)
    assert lengths, "decode should have run in bursts"
    for w, g in zip(want, got):
        a, b = w.outputs[0], g.outputs[0]
        assert (b.token_ids, b.text, b.finish_reason, b.stop_reason) == (a.token_ids, a.text, a.finish_reason,
                                                                         a.stop_reason)
    assert [g.outputs[0].finish_reason for g in got] == ["length", "stop", "stop", "stop"]
    assert len(got[0].outputs[0].token_ids) == 13
    engine = burst.engine
    assert not engine.has_unfinished_requests() and engine.kv_manager.pool.num_free == engine.num_blocks


def test_bursts_only_where_the_kernel_chooses_and_nothing_waits(tiny_models, monkeypatch):
    """Greedy and plainly sampled requests (temperature, top-k/p, min-p) run in bursts; logprobs, penalties
    and a bias take single steps, as does sampling with the sampler's torch path; so does any step while
    requests wait."""
    llm = _llm(tiny_models["llama"], 8, max_num_seqs=2)
    lengths = _count_bursts(llm)
    prompt = [list(range(10, 30))]
    for params in (SamplingParams(temperature=0, max_tokens=12, logprobs=2),
                   SamplingParams(temperature=0, max_tokens=12, repetition_penalty=1.3),
                   SamplingParams(temperature=0.8, max_tokens=12, seed=1, logit_bias={5: 2.0})):
        assert len(llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids) == 12
    assert lengths == []
    sampled = SamplingParams(temperature=0.8, top_p=0.9, top_k=20, min_p=0.01, max_tokens=12, seed=1,
                             ignore_eos=True)
    monkeypatch.setattr(cpu_kernels, "SAMPLE_KERNEL", False)
    llm.generate(prompt, sampled, use_tqdm=False)
    assert lengths == []
    monkeypatch.setattr(cpu_kernels, "SAMPLE_KERNEL", True)
    llm.generate(prompt, sampled, use_tqdm=False)
    assert lengths and max(lengths) == 8, lengths
    lengths.clear()
    # Three requests, two seats: while the third waits, the two running decode one step at a time.
    engine = llm.engine
    for i in range(3):
        engine.add_request(f"w{i}", list(range(10 + i, 30)), SamplingParams(temperature=0, max_tokens=6 + 10 * i,
                                                                              ignore_eos=True))
    while engine.has_unfinished_requests():
        waiting = engine.scheduler.num_waiting
        before = len(lengths)
        engine.step()
        if waiting:
            assert len(lengths) == before
    assert lengths  # the last request, alone, decoded in bursts


@pytest.mark.parametrize("num_requests", [1, 3, 11])
def test_sampled_bursts_draw_what_single_steps_draw(tiny_models, num_requests):
    """A burst draws a sampled request's tokens from the step's logits with the numbers single steps take
    from the same generators (a seeded request's own, the engine's for the others), so seeded and
    unseeded requests, mixed with greedy ones, get the single steps' tokens exactly; the sampler path
    they follow is the one tests/test_sampling.py checks against the distributions' definitions. After
    an interrupted burst each generator has given only the numbers of the steps run."""
    single, burst, lengths, prompts, _ = _single_and_burst(tiny_models, 3, 8)
    prompts = (prompts * 4)[:num_requests]
    kinds = [dict(temperature=1.0, seed=7), dict(temperature=0.7, top_p=0.8), dict(temperature=0),
             dict(temperature=1.3, top_k=5, seed=3), dict(temperature=0.9, min_p=0.1)]
    params = [SamplingParams(max_tokens=30, ignore_eos=True, **kinds[i % len(kinds)]) for i in range(num_requests)]
    want = single.generate(prompts, params, use_tqdm=False)
    got = burst.generate(prompts, params, use_tqdm=False)
    assert lengths and max(lengths) == 8, lengths
    assert [g.outputs[0].token_ids for g in got] == [w.outputs[0].token_ids for w in want]
    distinct = {tuple(w.outputs[0].token_ids) for w in want[:1]} | {tuple(single.generate(
        prompts[:1], params[0].clone(seed=8), use_tqdm=False)[0].outputs[0].token_ids)}
    assert len(distinct) == 2  # the draws do depend on the numbers: another seed, other tokens

    # Interrupted after its first step: the request goes on from the generator's next number.
    lengths.clear()
    engine = burst.engine
    run = engine.runner._execute_burst

    def interrupted_after_one(sched, steps, interrupted, on_step):
        return run(sched, steps, interrupted, lambda result: True)

    engine.runner._execute_burst = interrupted_after_one
    try:
        again = burst.generate(prompts[:1], params[0], use_tqdm=False)[0].outputs[0].token_ids
    finally:
        engine.runner._execute_burst = run
    assert lengths and max(lengths) == 1, lengths
    assert again == want[0].outputs[0].token_ids


def test_interrupt_ends_a_burst_after_its_current_step(tiny_models):
    """interrupt() from another thread (as the server does when a request arrives) ends a running burst
    early; no burst starts until clear_interrupt(), and the request carries on to the same tokens."""
    params = SamplingParams(temperature=0, max_tokens=450, ignore_eos=True)
    prompt = list(range(10, 20))
    llm = _llm(tiny_models["llama"], 400)
    engine = llm.engine
    lengths = _count_bursts(llm)
    outputs = {}

    def step():
        outputs.update((o.request_id, o) for o in engine.step())

    engine.add_request("long", prompt, params)
    step()  # the prompt
    worker = threading.Thread(target=step)
    worker.start()
    deadline = time.monotonic() + 30
    while engine.runner._burst is None and worker.is_alive() and time.monotonic() < deadline:
        time.sleep(0.0002)
    engine.interrupt()
    worker.join(30)
    assert not worker.is_alive()
    assert len(lengths) == 1 and 1 <= lengths[0] < 400, lengths
    step()  # still interrupted: a single step
    assert len(lengths) == 1
    engine.clear_interrupt()
    while engine.has_unfinished_requests():
        step()
    assert engine.kv_manager.pool.num_free == engine.num_blocks
    expected = _llm(tiny_models["llama"], 1).generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    assert outputs["long"].outputs[0].token_ids == expected and len(expected) == 450


def test_bursts_pick_the_whole_rows_argmax(tiny_models):
    """Each thread of a burst takes the largest logit of its share of the output rows; combined, the
    choice is torch.argmax's over the whole row: the first index where the largest value repeats in
    every share, and the first NaN where the row has NaNs."""
    folder = tiny_models["llama"]
    burst, single = _llm(folder, 8), _llm(folder, 1)
    lengths = _count_bursts(burst)
    def head_of(llm):  # the output layer's weight, which the fused decoder reads in place
        model = llm.engine.model
        return (model.embed_tokens if model.lm_head is None else model.lm_head).weight

    weight = head_of(burst).detach().clone()
    vocab = weight.shape[0]
    repeating = weight[torch.arange(vocab) % 16].clone()  # rows repeat every 16: the largest value repeats
    one_nan, two_nans = weight.clone(), weight.clone()
    one_nan[vocab - 3] = float("nan")  # in the last thread's share
    two_nans[vocab - 3] = two_nans[5] = float("nan")
    prompt = [list(range(10, 30))]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for head, expect in ((repeating, lambda t: t < 16), (one_nan, lambda t: t == vocab - 3),
                         (two_nans, lambda t: t == 5)):
        for llm in (burst, single):
            with torch.no_grad():
                head_of(llm).copy_(head)
        got = burst.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
        want = single.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
        assert got == want and all(expect(t) for t in got), (got, want)
    assert lengths, "decode should have run in bursts"


def _stream(llm, prompts, params) -> tuple[dict, dict]:
    """Run requests with an output stream attached, as the server does: each output as it is emitted."""
    engine = llm.engine
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(f"s{i}", None, sp, prompt_token_ids=p)
    counts: dict[str, list[int]] = {}
    finals = {}

    def emit(outputs):
        for out in outputs:
            counts.setdefault(out.request_id, []).append(len(out.outputs[0].token_ids))
            if out.finished:
                finals[out.request_id] = out

    while engine.has_unfinished_requests():
        assert engine.step(emit=emit) == []
    return counts, finals


def test_streamed_requests_get_each_step_of_a_burst_as_it_ends(tiny_models):
    """With an output stream attached (the server), a burst takes and emits every step's tokens from
    inside the fused decoder's call, so a request read as it goes gets one output per token, in order,
    as with single steps; a burst whose requests have all met a stop string ends there. The tokens, text
    and stops are the single steps'."""
    single, burst, lengths, prompts, gen = _single_and_burst(tiny_models, 3, 30)
    params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=30, stop=[gen[1].text[len(gen[1].text) // 2:][:3]],
                             ignore_eos=True),
              SamplingParams(temperature=0.8, seed=5, max_tokens=19, ignore_eos=True)]
    want = single.generate(prompts, params, use_tqdm=False)
    for kind in (RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY):
        lengths.clear()
        counts, finals = _stream(burst, prompts, [p.clone(output_kind=kind) for p in params])
        for i, w in enumerate(want):
            got = finals[f"s{i}"].outputs[0]
            assert (got.token_ids, got.text, got.finish_reason) == (w.outputs[0].token_ids, w.outputs[0].text,
                                                                    w.outputs[0].finish_reason)
            if kind is RequestOutputKind.CUMULATIVE:
                assert counts[f"s{i}"] == list(range(1, len(got.token_ids) + 1)), counts[f"s{i}"]
        assert max(lengths) == 8, (kind, lengths)
        assert burst.engine.kv_manager.pool.num_free == burst.engine.num_blocks

    # One request alone, its stop string met inside a burst: the burst ends at that step.
    stop = gen[0].text[len(gen[0].text) // 2:][:4]
    alone = SamplingParams(temperature=0, max_tokens=30, stop=[stop], ignore_eos=True)
    expected = single.generate(prompts[:1], alone, use_tqdm=False)[0].outputs[0]
    assert expected.finish_reason == "stop"
    lengths.clear()
    counts, finals = _stream(burst, prompts[:1], [alone])
    assert finals["s0"].outputs[0].token_ids == expected.token_ids
    # The bursts' steps add up to the tokens the request took after its prompt's step: none ran past the
    # stop (which falls inside a burst, not at its end).
    assert (len(expected.token_ids) - 1) % 8, "the stop should fall inside a burst"
    assert sum(lengths) == len(expected.token_ids) - 1, (lengths, len(expected.token_ids))
