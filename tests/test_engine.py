"""Engine behaviour: validation, abort, scheduler limits, streaming text."""

from __future__ import annotations

import pytest

from tests.conftest import PROMPTS
from tokenmill import LLM, SamplingParams
from tokenmill.engine.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(tiny_models["llama"], dtype="float32", max_num_seqs=3, max_num_batched_tokens=20, block_size=4)


def test_prompt_too_long_is_clear_error(llm):
    with pytest.raises(ValueError, match="maximum context length is 512 tokens. However, you requested 530 tokens"):
        llm.generate([list(range(10, 40)) * 10], SamplingParams(max_tokens=230))
    assert not llm.engine.has_unfinished_requests()


def test_bad_prompts_rejected_before_any_work(llm):
    with pytest.raises(ValueError, match="empty"):
        llm.generate([PROMPTS[0], ""], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match=r"prompt token ids must be integers in \[0, "):
        llm.generate([[1, 2, 10**6]], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="one per prompt"):
        llm.generate(PROMPTS[:2], [SamplingParams()] * 3)
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm.generate(PROMPTS[:1], SamplingParams(stop_token_ids=[10**6]))
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.kv_manager.pool.num_free == llm.engine.num_blocks


def test_limits_respected_every_step(llm):
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"lim{i}", p, params)
    finished = set()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished.add(out.request_id)
        s = engine.last_step
        assert s.num_batched_tokens <= 20
        assert sum(x.num_new_tokens for x in s.scheduled) == s.num_batched_tokens
        assert len(s.scheduled) <= 3 and engine.scheduler.num_running <= 3
    assert finished == {f"lim{i}" for i in range(len(PROMPTS))}
    assert engine.kv_manager.pool.num_free == engine.num_blocks


def test_abort_frees_blocks_at_any_moment(llm):
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"ab{i}", p, params)
    engine.step()  # some running, some waiting
    engine.step()
    assert engine.kv_manager.pool.num_free < engine.num_blocks
    outs = engine.abort_request([f"ab{i}" for i in range(len(PROMPTS))])
    assert all(o.finished and o.outputs[0].finish_reason == "abort" for o in outs)
    assert not engine.has_unfinished_requests()
    pool = engine.kv_manager.pool
    assert pool.num_free == pool.num_blocks and all(b.ref_cnt == 0 for b in pool.blocks)
    assert engine.step() == []


def test_streamed_text_adds_up_to_final(llm):
    engine = llm.engine
    engine.add_request("s", PROMPTS[2], SamplingParams(temperature=0.8, seed=3, max_tokens=30, stop=["zz"]))
    seen = ""
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            text = out.outputs[0].text
            assert text.startswith(seen)  # cumulative text only grows
            seen = text
            final = out
    assert final.finished and final.outputs[0].text == seen


def test_detokenizer_utf8_and_byte_tokens(tiny_models, llm):
    tok = llm.get_tokenizer()
    text = "naïve café — 日本語 🙂 the end"
    ids = tok.encode(text)
    det = IncrementalDetokenizer(tok._tokenizer, [], SamplingParams(stop=["end"]))
    for t in ids[:-1]:
        assert det.add(t) is None
        assert "\ufffd" not in det.text  # a half character is never shown
    assert det.add(ids[-1]) == "end"
    assert det.text == "naïve café — 日本語 🙂 the "


def test_generate_returns_input_order_and_metrics(llm):
    prompts = PROMPTS[:5]
    outs = llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=k, ignore_eos=True) for k in (9, 1, 5, 3, 7)])
    assert [o.prompt for o in outs] == prompts
    assert [len(o.outputs[0].token_ids) for o in outs] == [9, 1, 5, 3, 7]
    for o in outs:
        m = o.metrics
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time


def test_generate_takes_vllm_prompt_dicts(llm):
    """vLLM's prompt forms: {"prompt": text} and {"prompt_token_ids": ids}, alone or in a list, give what the
    plain string and id list give; a dict with other keys is a clear error before any work."""
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    ids = llm.get_tokenizer().encode(PROMPTS[1])
    plain = llm.generate([PROMPTS[0], ids], sp)
    dicts = llm.generate([{"prompt": PROMPTS[0]}, {"prompt_token_ids": ids}], sp)
    assert [o.outputs[0].token_ids for o in dicts] == [o.outputs[0].token_ids for o in plain]
    assert dicts[0].prompt == PROMPTS[0] and dicts[1].prompt_token_ids == ids
    one = llm.generate({"prompt_token_ids": ids}, sp)
    assert len(one) == 1 and one[0].outputs[0].token_ids == plain[1].outputs[0].token_ids
    with pytest.raises(ValueError, match="multi_modal_data"):
        llm.generate({"prompt": PROMPTS[0], "multi_modal_data": {}}, sp)
    assert not llm.engine.has_unfinished_requests()
