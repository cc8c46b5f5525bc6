"""A burst of decode steps hands each step's tokens on as soon as that step is done, so a streaming client
sees every token when it is computed, not a burst's worth at a time.

The compiled decoder is replaced by a stand-in that chooses fixed tokens, so that this runs on any CPU:
what is checked is how the engine and the runner pass steps on, not the kernel's arithmetic (the kernel
tests and tests/test_bursts.py check that where the kernels run)."""

from __future__ import annotations

import asyncio

from tests.conftest import PROMPTS
from tokenmill import LLM, SamplingParams
from tokenmill.engine.async_engine import AsyncEngine


class StandIn:
    """Plays the fused decoder's burst: step j gives every request tokens[j], calling on_step after each
    step as the compiled decoder does, and stops when on_step says so."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens
        self.steps_run: list[int] = []
        self.events: list[str] = []

    def clear_interrupt(self) -> None:
        pass

    def interrupt(self) -> None:
        pass

    def decode_greedy(self, input_ids, positions, slots, block_tables, seq_lens, lm_head, stop_ids, on_step=None):
        import torch

        rows = []
        for j in range(slots.shape[0]):
            rows.append([self.tokens[j]] * input_ids.shape[0])
            self.events.append(f"step {j}")
            if on_step is not None and not on_step(rows[-1]):
                break
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


def test_each_burst_step_reaches_the_stream_when_done(tiny_models):
    llm, fake = _llm_with_stand_in(tiny_models)
    tok = llm.get_tokenizer()

    async def run():
        engine = AsyncEngine(llm.engine, on_step=lambda outs, now: fake.events.append(
            "emit " + ",".join(str(len(o.outputs[0].token_ids)) for o in outs)))
        engine.start()
        try:
            params = SamplingParams(temperature=0, max_tokens=17, ignore_eos=True)
            return [len(out.outputs[0].token_ids) async for out in engine.generate("r", tok.encode(PROMPTS[0]), params)]
        finally:
            engine.shutdown()

    counts = asyncio.run(run())
    # One token per output: the first from the prompt's step, then 16 from bursts of 8, each step on its own.
    assert counts == list(range(1, 18)), counts
    assert fake.steps_run == [8, 8]
    # Each step's output went out before the next step ran (inside the burst, not after it).
    bursts = fake.events[fake.events.index("step 0"):]
    assert bursts[:4] == ["step 0", "emit 2", "step 1", "emit 3"], bursts


def test_offline_bursts_report_once_and_stop_where_a_stop_string_ends_them(tiny_models):
    llm, fake = _llm_with_stand_in(tiny_models)
    engine = llm.engine
    stop = "bc"  # completed by the third token of a burst
    engine.add_request("a", PROMPTS[0], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    engine.step()  # the prompt
    outs = engine.step()  # a burst of 8 without a stream: one output with all of them
    assert [len(o.outputs[0].token_ids) for o in outs] == [9] and fake.steps_run == [8]

    engine.abort_request("a")
    engine.add_request("b", PROMPTS[1], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop]))
    engine.step()
    seen = []
    engine.step(emit=seen.extend)
    # Streaming: the step that completes the stop string ends the burst there.
    assert fake.steps_run[-1] == 3 and seen[-1].finished and seen[-1].outputs[0].finish_reason == "stop"
