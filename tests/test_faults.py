"""Faults stay where they happen: a request whose output fails ends alone, a step that fails leaves no
unwritten block findable in the prefix cache, and a preempted request's prompt logprobs are not doubled."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch

from tests.conftest import PROMPTS
from tokenmill import LLM, SamplingParams
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.engine.kv_cache import KVCacheManager
from tokenmill.engine.request import Request, RequestStatus
from tokenmill.engine.scheduler import ModelOutput, Scheduler

LONG = " ".join(PROMPTS)  # several blocks of 16 tokens


def _break_detokenizer(engine, request_id: str) -> None:
    """Make the output of one request fail from its next token on, as a tokenizer bug would."""
    det = engine.output_processor.parents[request_id].detokenizers[0]

    def broken(token_id):
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")

    det.add = broken


def test_a_failing_output_fails_only_its_request(tiny_models):
    llm = LLM(tiny_models["llama"], dtype="float32")
    ref = llm.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))

    async def run():
        engine = AsyncEngine(llm.engine)
        engine.start()
        try:
            params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
            tok = llm.get_tokenizer()
            # The failing request runs long enough to be still running when the breakage lands (the tiny
            # model decodes ~1,000 tokens a second: 12 tokens could all be done by then).
            long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
            bad = engine.generate("bad", tok.encode(PROMPTS[0]), long)
            good = engine.generate("good", tok.encode(PROMPTS[1]), params)
            first_bad = await bad.__anext__()  # both are queued and running now
            engine.call(lambda e: _break_detokenizer(e, "bad"))
            failure = None
            try:
                async for _ in bad:
                    pass
            except Exception as e:
                failure = e
            assert type(failure).__name__ == "RequestFailedError" and "UnicodeDecodeError" in str(failure)
            assert first_bad.outputs[0].token_ids
            outs = [out async for out in good]
            assert not engine.is_dead
            # The engine goes on serving new requests too.
            again = [out async for out in engine.generate("again", tok.encode(PROMPTS[0]), params)]
            return outs[-1], again[-1]
        finally:
            engine.shutdown()

    good, again = asyncio.run(run())
    assert good.outputs[0].token_ids == ref[1].outputs[0].token_ids and good.outputs[0].text == ref[1].outputs[0].text
    assert again.outputs[0].token_ids == ref[0].outputs[0].token_ids
    assert llm.engine.kv_manager.usage() == 0 and not llm.engine.has_unfinished_requests()


def test_server_answers_500_for_the_failed_request_only(tiny_models):
    """Through the HTTP app: the failing request gets an OpenAI-shaped 500, its neighbour its answer."""
    from tokenmill.server.app import ServerState, build_app
    from tokenmill.server.args import add_server_args
    import argparse

    parser = argparse.ArgumentParser()
    add_server_args(parser)
    state = ServerState(parser.parse_args([]), {"model": tiny_models["llama"], "dtype": "float32"})
    llm = LLM(tiny_models["llama"], dtype="float32")
    app = build_app(state)
    original = llm.engine.output_processor.add

    def add_and_break(prompt, prompt_ids, children):  # break the request whose prompt is PROMPTS[0]
        original(prompt, prompt_ids, children)
        if prompt == PROMPTS[0]:
            _break_detokenizer(llm.engine, children[0].request_id)

    llm.engine.output_processor.add = add_and_break

    async def run():
        state.engine = AsyncEngine(llm.engine)
        state.engine.start()
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
                body = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}
                bad, good = await asyncio.gather(client.post("/v1/completions", json={**body, "prompt": PROMPTS[0]}),
                                                 client.post("/v1/completions", json={**body, "prompt": PROMPTS[1]}))
                health = await client.get("/health")
                return bad, good, health
        finally:
            state.engine.shutdown()

    bad, good, health = asyncio.run(run())
    assert bad.status_code == 500 and bad.json()["error"]["type"] == "server_error", bad.text
    assert "UnicodeDecodeError" in bad.json()["error"]["message"]
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 8
    assert health.status_code == 200


def test_a_failed_step_leaves_no_unwritten_block_in_the_prefix_cache(tiny_models):
    """A step interrupted by an exception (Ctrl-C, a bug) must not leave blocks findable whose KV it never
    wrote: a later prompt with the same prefix computes them instead of reading garbage."""
    llm = LLM(tiny_models["llama"], dtype="float32")
    plain = LLM(tiny_models["llama"], dtype="float32", enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    runner = llm.engine.runner
    execute = runner.execute

    def interrupted(sched):
        raise KeyboardInterrupt

    runner.execute = interrupted
    with pytest.raises(KeyboardInterrupt):
        llm.generate(LONG, params)
    runner.execute = execute
    assert llm.engine.kv_manager.usage() == 0  # the interrupted request was aborted and freed its blocks
    out = llm.generate(LONG, params)[0]
    assert out.num_cached_tokens == 0
    assert out.outputs[0].token_ids == plain.generate(LONG, params)[0].outputs[0].token_ids
    # Blocks a finished step wrote are found as before.
    assert llm.generate(LONG, params)[0].num_cached_tokens >= 16


def test_blocks_of_a_step_that_never_finished_are_forgotten():
    kv = KVCacheManager(16, 4)
    sch = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    sch.add_request(Request("a", list(range(9)), SamplingParams(), 1))
    sch.add_request(Request("b", list(range(9)), SamplingParams(), 1))
    out = sch.schedule()
    # Within the step, the second request shares the blocks the first one is computing.
    assert out.scheduled[1].request.num_computed_tokens == 8
    # The step raised before update(): the next schedule forgets those blocks.
    sch.finish_requests(["a", "b"], RequestStatus.FINISHED_ABORTED)
    sch.schedule()
    assert kv.get_computed_blocks(Request("c", list(range(9)), SamplingParams(), 1)) == []
    # A step that finishes keeps them.
    sch.add_request(Request("d", list(range(9)), SamplingParams(), 1))
    done = sch.schedule()
    sch.update(done, ModelOutput(sampled={"d": 1}))
    sch.schedule()
    assert len(kv.get_computed_blocks(Request("e", list(range(9)), SamplingParams(), 1))) == 2


def test_prompt_logprobs_under_preemption_match_transformers(tiny_models):
    """Requests preempted while they run compute their prompt again; their prompt logprobs must come out
    once per position, equal to transformers'."""
    from transformers import AutoModelForCausalLM

    folder = tiny_models["llama"]
    # A cache of 12 blocks of 16 tokens for 6 requests that each grow to ~60 tokens: preemption is certain.
    llm = LLM(folder, dtype="float32", kv_cache_memory=12 * 8192, max_model_len=192,
              max_num_batched_tokens=64)
    tok = llm.get_tokenizer()
    prompts = [tok.encode(p + " " + PROMPTS[2])[:40] for p in PROMPTS[:6]]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, prompt_logprobs=1))
    assert llm.engine.scheduler.num_preemptions > 0
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    for ids, out in zip(prompts, outs):
        assert len(out.prompt_logprobs) == len(ids) and out.prompt_logprobs[0] is None
        with torch.no_grad():
            ref = model(torch.tensor([ids])).logits[0].log_softmax(-1)
        got = [out.prompt_logprobs[i][t].logprob for i, t in enumerate(ids) if i]
        assert got == pytest.approx([ref[i - 1, t].item() for i, t in enumerate(ids) if i], abs=2e-4)


def test_decodes_get_their_token_before_a_prompt_chunk():
    """A long prompt still being computed ahead of decoding requests takes only what the decodes leave."""
    kv = KVCacheManager(64, 4)
    sch = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=16, max_model_len=256)
    long = Request("long", list(range(100)), SamplingParams(max_tokens=4), 4)
    short = [Request(f"s{i}", [i + 1] * 3, SamplingParams(max_tokens=50), 50) for i in range(3)]
    sch.add_request(long)
    first = sch.schedule()  # the long prompt's first chunk takes the whole budget
    assert [s.request for s in first.scheduled] == [long]
    long.num_computed_tokens += 16
    for r in short:
        sch.add_request(r)
    # The short requests are admitted and brought up to decoding while the long prompt runs at the head.
    for r in short:
        sch.waiting.remove(r)
        assert kv.allocate_slots(r, 3)
        r.num_computed_tokens = 3
        r.output_token_ids.append(7)
        r.status = type(r.status).RUNNING
        sch.running.append(r)
    out = sch.schedule()
    got = {s.request.request_id: s.num_new_tokens for s in out.scheduled}
    assert got == {"s0": 1, "s1": 1, "s2": 1, "long": 13}
    for s in out.scheduled:
        s.request.num_computed_tokens += s.num_new_tokens
        if s.request is not long:
            s.request.output_token_ids.append(7)
    # With long_prefill_token_threshold, the chunk that shares a step with decodes is capped.
    sch.long_prefill_token_threshold = 5
    got = {s.request.request_id: s.num_new_tokens for s in sch.schedule().scheduled}
    assert got == {"s0": 1, "s1": 1, "s2": 1, "long": 5}


def test_cut_off_ends_requests_in_flight_and_any_added_later(tiny_models):
    """The server's shutdown cut-off: running requests end with RequestCutOffError and give back their
    blocks; a request that was still being prepared (tokenised, its grammar compiled) when the cut came
    is refused as it is added, instead of running until the server cancels it."""
    from tokenmill.engine.async_engine import RequestCutOffError

    llm = LLM(tiny_models["llama"], dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)

    async def run():
        engine = AsyncEngine(llm.engine)
        engine.start()
        try:
            running = engine.generate("running", [1, 2, 3], params)
            await running.__anext__()
            assert engine.cut_off("shutting down") == 1
            with pytest.raises(RequestCutOffError, match="shutting down"):
                async for _ in running:
                    pass
            assert engine.try_reserve(1, limit=8)
            with pytest.raises(RequestCutOffError):
                engine.add("late", [1, 2, 3], params, reserved=True)
            engine.release(1)
            for _ in range(100):  # the abort reaches the engine thread between steps
                if not llm.engine.has_unfinished_requests():
                    break
                await asyncio.sleep(0.05)
            assert engine.num_waiting == 0
        finally:
            engine.shutdown()

    asyncio.run(run())
    assert llm.engine.kv_manager.usage() == 0 and not llm.engine.has_unfinished_requests()
