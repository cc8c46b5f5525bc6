"""A streaming client gets every token as soon as it is computed: requests whose outputs are read as they
come take one decode step at a time, while those read only at the end (FINAL_ONLY, the server's
non-streaming requests) and offline generation keep bursts of decode steps.

The compiled decoder's bursts are played by a stand-in that chooses fixed tokens, so that this runs on
any CPU: what is checked is how the engine passes steps on, not the kernel's arithmetic (the kernel tests
and tests/test_bursts.py check that where the kernels run)."""

from __future__ import annotations

import asyncio

from tests.conftest import PROMPTS
from tokenmill import LLM, SamplingParams
from tokenmill.engine.async_engine import AsyncEngine


class StandIn:
    """Plays the fused decoder's burst: step j gives every request tokens[j]."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens
        self.steps_run: list[int] = []

    def clear_interrupt(self) -> None:
        pass

    def interrupt(self) -> None:
        pass

    def decode_greedy(self, input_ids, positions, slots, block_tables, seq_lens, stop_ids):
        import torch

        rows = [[self.tokens[j]] * input_ids.shape[0] for j in range(slots.shape[0])]
        self.steps_run.append(len(rows))
        return torch.tensor(rows, dtype=torch.long)


def _llm_with_stand_in(tiny_models) -> tuple[LLM, StandIn]:
    llm = LLM(tiny_models["llama"], dtype="float32", num_scheduler_steps=8)
    fake = StandIn([llm.get_tokenizer().convert_tokens_to_ids(c) for c in "abcdefgh"])
    runner, model = llm.engine.runner, llm.engine.model
    runner.supports_bursts = True
    run = runner.execute_burst

    def burst(*args, **kwargs):  # the stand-in serves bursts only; other steps run the model as usual
        model._fused_decoder = lambda kv_caches, meta: fake
        try:
            return run(*args, **kwargs)
        finally:
            del model._fused_decoder

    runner.execute_burst = burst
    return llm, fake


def _stream_through_async_engine(llm, params) -> list[int]:
    """Token counts of the outputs a request's reader receives through the async engine (the server's)."""
    tok = llm.get_tokenizer()

    async def run():
        engine = AsyncEngine(llm.engine)
        engine.start()
        try:
            stream = engine.generate("r", tok.encode(PROMPTS[0]), params)
            return [len(out.outputs[0].token_ids) async for out in stream]
        finally:
            engine.shutdown()

    return asyncio.run(run())


def test_a_streamed_request_gets_each_token_on_its_own(tiny_models):
    llm, fake = _llm_with_stand_in(tiny_models)
    counts = _stream_through_async_engine(llm, SamplingParams(temperature=0, max_tokens=17, ignore_eos=True))
    assert counts == list(range(1, 18)), counts
    assert fake.steps_run == []  # no burst: each step's token went out before the next step ran


def test_a_request_read_at_its_end_keeps_bursts(tiny_models):
    from tokenmill.sampling_params import RequestOutputKind

    llm, fake = _llm_with_stand_in(tiny_models)
    params = SamplingParams(temperature=0, max_tokens=17, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)
    assert _stream_through_async_engine(llm, params) == [17]  # the final output alone
    assert fake.steps_run == [8, 8]


def test_offline_bursts_report_once(tiny_models):
    llm, fake = _llm_with_stand_in(tiny_models)
    engine = llm.engine
    engine.add_request("a", PROMPTS[0], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    engine.step()  # the prompt
    outs = engine.step()  # a burst of 8 without a stream: one output with all of them
    assert [len(o.outputs[0].token_ids) for o in outs] == [9] and fake.steps_run == [8]
