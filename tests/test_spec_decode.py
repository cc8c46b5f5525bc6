"""Speculative decoding: proposals verified by the target give the outputs of decoding without them.

Most tests drive verification with an oracle proposer that knows the target's reference output and
spoils some of its proposals, so that long accepted runs and rejections at every position both occur
(a tiny random model rarely repeats itself, so prompt lookup alone would leave verification idle)."""

from __future__ import annotations

import itertools
import json
import math
import random
import time

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chi2_contingency

from conftest import ARCHS, PROMPTS, block_bytes
from tokenmill import LLM, SamplingParams
from tokenmill.sampling_params import RequestOutputKind
from tokenmill.kernels import cpu as cpu_kernels
from tokenmill.spec.proposer import AdaptiveDraft, StepCost, ngram_lookup, plan_drafts

NGRAM = {"method": "ngram", "num_speculative_tokens": 4}


class Oracle:
    """Proposes each request's reference continuation; with probability `spoil` one proposed token is
    replaced by another."""

    def __init__(self, refs: dict[tuple, list[int]], vocab: int, spoil: float = 0.3, seed: int = 0,
                 delay: float = 0.0) -> None:
        self.refs, self.vocab, self.spoil, self.delay = refs, vocab, spoil, delay
        self.rng = random.Random(seed)

    def propose(self, wanted):
        if wanted and self.delay:  # a costly proposer (a large draft model, say)
            time.sleep(self.delay)
        out = []
        for req, k in wanted:
            ref = self.refs[tuple(req.prompt_token_ids)]
            drafts = list(ref[req.num_output_tokens:req.num_output_tokens + k])
            if drafts and self.rng.random() < self.spoil:
                j = self.rng.randrange(len(drafts))
                drafts[j] = (drafts[j] + 1 + self.rng.randrange(self.vocab - 1)) % self.vocab
            out.append(drafts)
        return out


def _ids(llm: LLM, prompts: list[str]) -> list[list[int]]:
    return [llm.engine.encode(p) for p in prompts]


def _tokens(outs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


def _always_proposing(llm: LLM) -> LLM:
    """Proposals at every step, whatever steps with and without them have been giving (StepCost's gate):
    for tests of what proposals do, on tiny models whose steps are too cheap for proposals to pay."""
    llm.engine.step_cost.proposing_pays = lambda batch, decode_only=True: True
    return llm


def _with_oracle(folder: str, refs: dict, spoil: float = 0.3, **kw) -> LLM:
    llm = _always_proposing(LLM(folder, dtype="float32", speculative_config=NGRAM, **kw))
    llm.engine.proposer = Oracle(refs, llm.engine.vocab_size, spoil)
    llm.engine.spec_rows = 64  # verify many requests at once: steps past the fused decoder's team path too
    return llm


def test_proposals_only_while_the_step_has_room(tiny_models):
    """A decode step holds at most spec_rows query rows: proposals fill the room oldest request first,
    and with as many decodes as rows there are none."""
    folder = tiny_models["llama"]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    base = LLM(folder, dtype="float32")
    ref = _tokens(base.generate(PROMPTS, sp))
    llm = _with_oracle(folder, {tuple(i): r for i, r in zip(_ids(base, PROMPTS), ref)}, spoil=0.0)
    engine = llm.engine
    for rows in (8, 10, 3):
        engine.spec_rows = rows
        for i, p in enumerate(PROMPTS):
            engine.add_request(f"{rows}-{i}", p, sp)
        while engine.has_unfinished_requests():
            engine.step()
            decoding = [r for r in engine.scheduler.running if r.num_tokens - r.num_computed_tokens == 1]
            proposed = sum(len(r.spec_token_ids) for r in decoding)
            assert len(decoding) + proposed <= max(rows, len(decoding))
            if len(decoding) >= rows:
                assert proposed == 0
    assert engine.stats()["spec_decode_num_accepted_tokens"] > 0


@pytest.mark.skipif(cpu_kernels.load() is None, reason="the CPU kernels did not build")
@pytest.mark.parametrize("arch", ["llama", "mixtral"])
def test_a_batch_of_eight_gets_proposals_up_to_the_fused_decoders_team(tiny_models, arch):
    """The room for proposals is the fused decoder's team (one parallel region, each weight read once):
    eight decoding requests of a dense model still get proposals, verified in that one region, and the
    outputs are those without speculation. A mixture of experts' team is 8 rows, so none there."""
    folder = tiny_models[arch]
    prompts = PROMPTS  # eight
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    base = LLM(folder, dtype="float32")
    ref = _tokens(base.generate(prompts, sp))
    llm = LLM(folder, dtype="float32", speculative_config=NGRAM)
    engine = llm.engine
    engine.proposer = Oracle({tuple(i): r for i, r in zip(_ids(base, prompts), ref)}, engine.vocab_size, spoil=0.0)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, sp)
    outs, full_steps = {}, []  # proposals of the steps that verify eight decoding requests
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs[out.request_id] = list(out.outputs[0].token_ids)
        sched = engine.last_step
        if len(sched.scheduled) == 8 and all(s.samples and s.num_new_tokens == 1 + len(s.spec_token_ids)
                                             for s in sched.scheduled):
            full_steps.append(sum(len(s.spec_token_ids) for s in sched.scheduled))
    assert [outs[str(i)] for i in range(len(prompts))] == ref
    team = engine.model._fused[1].team_rows()  # the decoder the steps ran through
    assert engine.spec_rows == team == (8 if arch == "mixtral" else 32)
    if arch == "mixtral":
        assert not any(full_steps)
    else:
        assert max(full_steps) > 0 and 8 + max(full_steps) <= team


MODES = {
    "batched": dict(block_size=4),
    "chunked": dict(block_size=4, max_num_batched_tokens=12, long_prefill_token_threshold=6),
    "preempted": dict(block_size=4, kv_cache_blocks=48, max_num_seqs=8),  # 96 KiB of the 2-layer models' blocks
    "single-steps": dict(block_size=4, num_scheduler_steps=1, enable_prefix_caching=False),
}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_outputs_equal_decoding_without_speculation(tiny_models, arch, mode):
    kw = dict(MODES[mode])
    if "kv_cache_blocks" in kw:  # the same number of blocks whatever a block of this model weighs
        kw["kv_cache_memory"] = kw.pop("kv_cache_blocks") * block_bytes(tiny_models[arch], kw["block_size"])
    prompts = PROMPTS + PROMPTS[:3]  # repeated prompts: prefix-cache hits
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    base = LLM(tiny_models[arch], dtype="float32", **kw)
    ref = _tokens(base.generate(prompts, sp))
    ids = _ids(base, prompts)
    llm = _with_oracle(tiny_models[arch], {tuple(i): r for i, r in zip(ids, ref)}, **kw)
    assert _tokens(llm.generate(prompts, sp)) == ref
    stats = llm.engine.stats()
    assert stats["spec_decode_num_accepted_tokens"] > 0.5 * stats["spec_decode_num_draft_tokens"]
    assert stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]  # rejections too
    if mode == "preempted":
        assert stats["num_preemptions"] > 0
    if mode == "batched":
        assert stats["prefix_cache_hits"] > 0
    assert llm.engine.kv_manager.pool.num_free == llm.engine.num_blocks


def _default_model_repeats(gguf: str, instruction: str, text: str, max_tokens: int):
    """A chat asking the default model to repeat a text, its greedy parameters, and its answer's tokens
    without speculation."""
    msgs = [{"role": "user", "content": f"{instruction}:\n\n{text}"}]
    sp = SamplingParams(temperature=0, max_tokens=max_tokens)
    return msgs, sp, _tokens(LLM(gguf).chat(msgs, sp))


def test_prompt_lookup_on_the_default_model_is_exact_and_accepted(default_gguf):
    """The real n-gram proposer, on a prompt the default model quotes from: greedy outputs equal those of
    decoding without speculation, and most proposals are accepted."""
    text = ("The engine keeps keys and values in blocks of sixteen tokens. A block that fills is hashed with "
            "every token before it, so a later request with the same prefix finds it and skips that work.")
    msgs, sp, ref = _default_model_repeats(default_gguf, "Repeat this text word for word", text, 48)
    llm = LLM(default_gguf, speculative_config={"method": "ngram", "num_speculative_tokens": 5})
    out = llm.chat(msgs, sp)[0]
    assert list(out.outputs[0].token_ids) == ref[0]
    m = out.metrics
    assert m.spec_num_draft_tokens > 0 and m.spec_acceptance_rate > 0.5, (m.spec_num_draft_tokens, m.spec_acceptance_rate)


def test_stops_inside_an_accepted_run_end_the_request_there(tiny_models):
    folder = tiny_models["llama"]
    base = LLM(folder, dtype="float32", block_size=4)
    prompt = PROMPTS[2]
    full = _tokens(base.generate([prompt], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)))[0]
    ids = tuple(_ids(base, [prompt])[0])
    # A token whose first occurrence lies well inside the output, a stop string from the text, max_tokens.
    pos = next(i for i in range(6, 30) if full[i] not in full[:i])
    text = base.get_tokenizer().decode(full[:pos + 1])
    cases = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop_token_ids=[full[pos]]),
             SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[text[-3:]]),
             SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)]
    for sp in cases:
        want = base.generate([prompt], sp)[0].outputs[0]
        llm = _with_oracle(folder, {ids: full}, spoil=0.0, block_size=4)
        got = llm.generate([prompt], sp)[0].outputs[0]
        assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason)
        assert llm.engine.stats()["spec_decode_num_accepted_tokens"] >= 3  # the stop came inside a run


def test_rejected_blocks_are_freed_after_each_step(tiny_models):
    folder = tiny_models["llama"]
    base = LLM(folder, dtype="float32", block_size=2)
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ref = _tokens(base.generate(PROMPTS[:4], sp))
    llm = _with_oracle(folder, {tuple(i): r for i, r in zip(_ids(base, PROMPTS[:4]), ref)}, spoil=0.6, block_size=2)
    engine = llm.engine
    for i, p in enumerate(PROMPTS[:4]):
        engine.add_request(str(i), p, sp)
    while engine.has_unfinished_requests():
        engine.step()
        for s in engine.last_step.scheduled:
            req = s.request
            if s.spec_token_ids and not req.is_finished:
                # Only the blocks of computed tokens remain: none that held just rejected proposals.
                assert len(req.block_ids) == math.ceil(req.num_computed_tokens / 2)
    assert engine.stats()["spec_decode_num_accepted_tokens"] < engine.stats()["spec_decode_num_draft_tokens"]
    assert engine.kv_manager.pool.num_free == engine.num_blocks


# ---------------------------------------------------------------------------------------- sampling
def _sample_counts(llm: LLM, prompt: str, sp: SamplingParams, n: int) -> list[tuple]:
    return [tuple(t) for t in _tokens(llm.generate([prompt] * n, [sp] * n, use_tqdm=False))]


def _same_distribution(a: list[tuple], b: list[tuple], key) -> float:
    """p-value of a chi-square test that key(sample) has one distribution in a and b (rare values pooled)."""
    ka, kb = [key(x) for x in a], [key(x) for x in b]
    values = sorted(set(ka) | set(kb), key=lambda v: -(ka.count(v) + kb.count(v)))
    common = [v for v in values if ka.count(v) + kb.count(v) >= 10]
    rows = [[ka.count(v) for v in common], [kb.count(v) for v in common]]
    rest = [len(ka) - sum(rows[0]), len(kb) - sum(rows[1])]
    if min(rest) > 0 or max(rest) > 0:
        rows[0].append(rest[0]), rows[1].append(rest[1])
    return chi2_contingency(rows).pvalue


SAMPLING = [dict(temperature=0.7), dict(temperature=0.9, top_p=0.8), dict(temperature=1.2, top_k=4)]


class GreedyContinuation:
    """Proposes the reference model's greedy continuation of each request's tokens (transformers, the
    same weights): a deterministic function of the context, likely under the target's sampling but far
    from certain."""

    def __init__(self, folder: str) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        self.cache: dict[tuple, list[int]] = {}

    def propose(self, wanted):
        out = []
        for req, k in wanted:
            key = (tuple(req.all_token_ids), k)
            if key not in self.cache:
                with self.torch.no_grad():
                    x = self.torch.tensor([req.all_token_ids])
                    y = self.model.generate(x, max_new_tokens=k, min_new_tokens=k, do_sample=False, pad_token_id=0)
                self.cache[key] = y[0, x.shape[1]:].tolist()
            out.append(self.cache[key])
        return out


def _sampled_runs(tiny_models, params: dict, n: int, verify=None):
    folder = tiny_models["llama"]
    prompt = PROMPTS[0]
    base = LLM(folder, dtype="float32", block_size=4, seed=1)
    sp = SamplingParams(max_tokens=3, ignore_eos=True, **params)
    plain = _sample_counts(base, prompt, sp, n)
    llm = LLM(folder, dtype="float32", block_size=4, seed=2, speculative_config=NGRAM)
    llm.engine.proposer = GreedyContinuation(folder)
    llm.engine.spec_rows = 1024
    if verify is not None:
        llm.engine.runner._verify = verify.__get__(llm.engine.runner)
    spec = _sample_counts(llm, prompt, sp, n)
    return plain, spec, llm.engine.stats()


@pytest.mark.parametrize("params", SAMPLING, ids=["temperature", "top_p", "top_k"])
def test_sampled_tokens_have_the_distribution_of_decoding_without_speculation(tiny_models, params):
    plain, spec, stats = _sampled_runs(tiny_models, params, 1200)
    assert 0.1 * stats["spec_decode_num_draft_tokens"] < stats["spec_decode_num_accepted_tokens"] < \
        0.9 * stats["spec_decode_num_draft_tokens"]
    for key in (lambda t: t[1], lambda t: t[2], lambda t: t[:2]):
        assert _same_distribution(plain, spec, key) > 1e-3


def test_accepting_without_the_ratio_test_is_caught(tiny_models):
    """A planted bug: every proposal accepted as it is. The distribution test must reject it."""

    def accept_all(self, out, logits, spec):
        type(self)._verify(self, out, logits, spec)
        for s, _ in spec:
            out.spec_sampled[s.request.request_id] = list(s.spec_token_ids)

    plain, spec, _ = _sampled_runs(tiny_models, SAMPLING[0], 1200, verify=accept_all)
    assert min(_same_distribution(plain, spec, key) for key in (lambda t: t[1], lambda t: t[2])) < 1e-6


def test_seeded_requests_reproduce_and_match_decoding_without_speculation(tiny_models):
    """Each verified row draws one number from the request's own generator, as a plain step does, so a
    seeded request gives the very tokens it gives without speculation."""
    folder = tiny_models["llama"]
    sps = [SamplingParams(temperature=0.9, top_p=0.95, max_tokens=20, ignore_eos=True, seed=s) for s in range(6)]
    base = LLM(folder, dtype="float32", block_size=4)
    prompts = PROMPTS[:6]
    ref = _tokens(base.generate(prompts, sps))
    refs = {tuple(i): r for i, r in zip(_ids(base, prompts), ref)}
    for _ in range(2):
        llm = _with_oracle(folder, refs, spoil=0.4, block_size=4)
        assert _tokens(llm.generate(prompts, sps)) == ref
        assert llm.engine.stats()["spec_decode_num_accepted_tokens"] > 0


def test_penalties_and_logprobs_see_the_accepted_tokens(tiny_models):
    """A row chosen after accepted proposals sees them as output (repetition penalty), and its logprobs
    are those of a plain step."""
    folder = tiny_models["llama"]
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, repetition_penalty=1.5,
                        frequency_penalty=0.5, logprobs=2)
    base = LLM(folder, dtype="float32", block_size=4)
    want = base.generate(PROMPTS[:3], sp)
    refs = {tuple(i): list(o.outputs[0].token_ids) for i, o in zip(_ids(base, PROMPTS[:3]), want)}
    llm = _with_oracle(folder, refs, spoil=0.3, block_size=4)
    got = llm.generate(PROMPTS[:3], sp)
    assert _tokens(got) == _tokens(want)
    assert llm.engine.stats()["spec_decode_num_accepted_tokens"] > 0
    for g, w in zip(got, want):
        for lg, lw in zip(g.outputs[0].logprobs, w.outputs[0].logprobs):
            assert lg.keys() == lw.keys()
            assert all(abs(lg[t].logprob - lw[t].logprob) < 1e-4 for t in lg)


# ---------------------------------------------------------------------------------------- the parts
def _lookup_reference(tokens: list[int], k: int, lo: int, hi: int) -> list[int]:
    n_tokens = len(tokens)
    for n in range(min(hi, n_tokens - 1), lo - 1, -1):
        for i in range(n_tokens - n - 1, -1, -1):
            if tokens[i:i + n] == tokens[n_tokens - n:]:
                return tokens[i + n:i + n + k]
    return []


@settings(max_examples=300, deadline=None)
@given(tokens=st.lists(st.integers(0, 3), min_size=1, max_size=40), k=st.integers(1, 6), lo=st.integers(1, 3),
       extra=st.integers(0, 3))
def test_ngram_lookup_finds_the_latest_longest_match(tokens, k, lo, extra):
    assert ngram_lookup(tokens, k, lo, lo + extra) == _lookup_reference(tokens, k, lo, lo + extra)


def test_adaptive_draft_grows_shrinks_and_pauses():
    a = AdaptiveDraft(4)
    assert a.want(0) == 4
    a.update(4, 1, 2)
    assert a.want(2) == 2  # one more than the accepted run
    a.update(2, 2, 5)
    assert a.want(5) == 3  # grows after a proposal accepted whole
    done = 5
    for _ in range(6):
        done += 1
        a.update(3, 0, done)
        if a.want(done) == 0:
            break
    # paused for the request's next PAUSE_TOKENS tokens, however many steps they take (bursts of several)
    assert [a.want(n) for n in range(done, done + AdaptiveDraft.PAUSE_TOKENS)] == [0] * AdaptiveDraft.PAUSE_TOKENS
    assert a.want(done + AdaptiveDraft.PAUSE_TOKENS) == 1  # tried again, small


def _tokens_per_second(rates, ks, others, a, b) -> float:
    rows = len(ks) + others
    return (rows + sum(p ** j for p, k in zip(rates, ks) for j in range(1, k + 1))) / (a + b * (rows + sum(ks)))


@settings(max_examples=300, deadline=None)
@given(rates=st.lists(st.floats(0.0, 1.0), min_size=1, max_size=3), caps=st.lists(st.integers(0, 4), min_size=3,
       max_size=3), others=st.integers(0, 2), a=st.floats(0.1, 10.0), b=st.floats(0.0, 5.0))
def test_plan_drafts_gives_the_most_expected_tokens_per_second(rates, caps, others, a, b):
    """Against every allotment within the caps: the plan's expected tokens per second is the best one's."""
    caps = caps[:len(rates)]
    ks = plan_drafts(rates, caps, (a, b), others)
    assert all(0 <= k <= c for k, c in zip(ks, caps))
    allotments = itertools.product(*(range(c + 1) for c in caps))
    best = max(_tokens_per_second(rates, list(c), others, a, b) for c in allotments)
    assert _tokens_per_second(rates, ks, others, a, b) >= best * (1 - 1e-9)
    assert plan_drafts(rates, caps, None, others) == caps  # no costs known yet: as many as allowed


def test_step_cost_fits_the_line_through_its_row_counts():
    cost = StepCost()
    for _ in range(5):
        cost.record(2, 0.004)
    assert cost.line(2) is None  # one row count: no slope yet
    for t in (0.007, 0.008, 0.009):  # the first steps of a row count count alike
        cost.record(6, t)
        cost.record(10, t + 0.004)
    a, b = cost.line(2)
    assert a == pytest.approx(0.002) and b == pytest.approx(0.001)
    assert cost.line(3) is None  # not yet seen without proposals at 3 rows: no line to judge them by
    flat = StepCost()
    for _ in range(5):
        flat.record(2, 0.005)
        flat.record(9, 0.004)  # noise that would give a falling line: never cheaper per row than free
    assert flat.line(2)[1] == 0.0


class HalfRight:
    """Proposes each request's reference continuation, but the first token spoiled every other time: a
    request's drafts are accepted about half the time, whole or not at all."""

    def __init__(self, refs: dict[tuple, list[int]], vocab: int) -> None:
        self.refs, self.vocab, self.calls = refs, vocab, 0

    def propose(self, wanted):
        out = []
        for req, k in wanted:
            drafts = list(self.refs[tuple(req.prompt_token_ids)][req.num_output_tokens:req.num_output_tokens + k])
            self.calls += 1
            if drafts and self.calls % 2:
                drafts[0] = (drafts[0] + 1) % self.vocab
            out.append(drafts)
        return out


class FixedCost:
    def __init__(self, line) -> None:
        self.fixed = line

    def record(self, rows, seconds) -> None:
        pass

    def line(self, base):
        return self.fixed

    def record_yield(self, *args, **kw) -> None:
        pass

    def proposing_pays(self, batch, decode_only=True):
        return True

    def plain_is_better(self, batch):
        return False


def test_proposals_stop_where_the_rows_cost_more_than_they_bring(tiny_models):
    """Drafts accepted half the time: with each verified row as costly as ten steps' fixed part, proposing
    does not pay and stops once the requests' acceptance is known; with free rows it goes on. The outputs
    are the reference either way, and the engine measures its steps' costs by row count."""
    folder = tiny_models["llama"]
    sp = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    base = LLM(folder, dtype="float32")
    ref = _tokens(base.generate(PROMPTS[:3], sp))
    refs = {tuple(i): r for i, r in zip(_ids(base, PROMPTS[:3]), ref)}
    drafted = {}
    for name, line in (("costly", (1.0, 10.0)), ("free", (1.0, 0.0)), ("measured", None)):
        llm = LLM(folder, dtype="float32", speculative_config=NGRAM, num_scheduler_steps=1)
        llm.engine.proposer = HalfRight(refs, llm.engine.vocab_size)
        if line is not None:
            llm.engine.step_cost = FixedCost(line)
        assert _tokens(llm.generate(PROMPTS[:3], sp)) == ref
        drafted[name] = llm.engine.stats()["spec_decode_num_draft_tokens"]
        if line is None:
            counts = llm.engine.step_cost.counts
            assert len(counts) >= 2 and max(counts) > 3  # decode steps seen, with proposals in some
    assert drafted["free"] >= 80
    assert drafted["costly"] <= drafted["free"] / 4


def test_proposing_stops_where_steps_with_proposals_make_fewer_tokens_a_second(tiny_models):
    """Proposals that are always right but cost 50 ms each time (a draft far slower than the target):
    once steps with them have been timed against steps without, they stop, where every verify row would
    still pay by the row-cost line. Free proposals of the same tokens go on. Outputs are exact either way."""
    folder = tiny_models["llama"]
    prompts = PROMPTS[:4]
    sp = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    base = LLM(folder, dtype="float32", num_scheduler_steps=1)
    ref = _tokens(base.generate(prompts, sp))
    refs = {tuple(i): r for i, r in zip(_ids(base, prompts), ref)}
    drafted = {}
    for name, delay in (("free", 0.0), ("slow", 0.05)):
        llm = LLM(folder, dtype="float32", speculative_config=NGRAM, num_scheduler_steps=1)
        llm.engine.proposer = Oracle(refs, llm.engine.vocab_size, spoil=0.0, delay=delay)
        assert _tokens(llm.generate(prompts, sp)) == ref
        drafted[name] = llm.engine.stats()["spec_decode_num_draft_tokens"]
    assert drafted["free"] >= 100, drafted
    # The MIN_SAMPLES steps that timed proposals (4 requests, k = 4), and none after.
    assert drafted["slow"] <= StepCost.MIN_SAMPLES * 4 * 4, drafted


def test_streamed_requests_decode_in_bursts_where_proposals_do_not_pay(tiny_models):
    """Streamed requests with speculation on take single steps, so that each can propose at every step;
    where proposals have been found not to pay (a proposer far slower than the target), they decode in
    bursts again, as without speculation, each step's tokens still reaching the stream one by one."""
    folder = tiny_models["llama"]
    prompts = PROMPTS[:2]
    kw = dict(dtype="bfloat16", block_size=4)  # bfloat16: the fused decoder's bursts
    sp = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, output_kind=RequestOutputKind.CUMULATIVE)
    base = LLM(folder, **kw)
    ref = _tokens(base.generate(prompts, sp))
    refs = {tuple(i): r for i, r in zip(_ids(base, prompts), ref)}
    llm = LLM(folder, speculative_config=NGRAM, **kw)
    engine = llm.engine
    engine.proposer = Oracle(refs, engine.vocab_size, spoil=0.0, delay=0.05)
    runner = engine.runner
    bursts, execute_burst = [], runner.execute_burst
    runner.execute_burst = lambda *a, **k: (lambda r: bursts.append(r) or r)(execute_burst(*a, **k))
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, sp)
    seen: dict[str, list[int]] = {}
    emitted = []
    while engine.has_unfinished_requests():
        engine.step(emit=lambda outs: emitted.extend(outs))
    for out in emitted:
        seen[out.request_id] = list(out.outputs[0].token_ids)
    assert [seen[str(i)] for i in range(len(prompts))] == ref
    assert engine.stats()["spec_decode_num_draft_tokens"] <= (StepCost.MIN_SAMPLES + 1) * len(prompts) * 4
    ran = [len(r) for r in bursts if r is not None]
    assert len(ran) >= 2 and max(ran) > 1, ran
    # One output per request per step, bursts included (streamed token by token).
    assert len(emitted) >= len(prompts) * (64 - 4 * (StepCost.MIN_SAMPLES + 1))


def test_self_drafting_reads_the_target_s_own_cache(tiny_models):
    """The target's weights quantized as its draft read the target's keys and values and write their
    proposals' into the target's next slots: the draft computes no prompt and keeps no cache, its
    proposals are nearly all accepted, the outputs are those of decoding without it, and every block
    returns to the pool."""
    target = tiny_models["llama"]
    kw = dict(dtype="bfloat16", block_size=4)  # bfloat16: the fused decoder's bursts
    prompts, sp = PROMPTS[:3], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    ref = _tokens(LLM(target, **kw).generate(prompts, sp))
    llm = _always_proposing(LLM(target, speculative_config={"method": "self", "quantization": "int8",
                                                            "num_speculative_tokens": 4}, **kw))
    proposer = llm.engine.proposer
    assert proposer.model.quantized
    modular, forward = [], proposer.model.forward
    proposer.model.forward = lambda ids, *a: modular.append(len(ids)) or forward(ids, *a)
    assert _tokens(llm.generate(prompts, sp)) == ref
    assert modular == []  # no prompt, no catch-up: only the fused decoder's bursts
    assert proposer.runner.kv_caches is llm.engine.runner.kv_caches
    s = llm.engine.stats()
    assert s["spec_decode_num_draft_tokens"] >= 40
    assert s["spec_decode_num_accepted_tokens"] > 0.6 * s["spec_decode_num_draft_tokens"]  # a random model's
    assert llm.engine.kv_manager.pool.num_free == llm.engine.num_blocks  # close calls flip under int8


def test_self_drafting_leaves_the_prefix_cache_as_decoding_without_it(tiny_models):
    """A request whose prompt is an earlier request's prompt and output finds in the prefix cache as many
    tokens after that earlier request was self-drafted as after it decoded without speculation: the
    draft's writes into the target's next slots register no block of their own."""
    target = tiny_models["llama"]
    kw = dict(dtype="bfloat16", block_size=4)
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    hits = {}
    for name, spec in (("plain", None), ("self", {"method": "self", "quantization": "int8",
                                                  "num_speculative_tokens": 3})):
        llm = LLM(target, speculative_config=spec, **kw)
        if spec:
            _always_proposing(llm)
        first = llm.generate(PROMPTS[:1], sp)[0]
        again = list(first.prompt_token_ids) + list(first.outputs[0].token_ids)
        before = llm.engine.stats()["prefix_cache_hits"]
        llm.generate([{"prompt_token_ids": again}], SamplingParams(temperature=0, max_tokens=1))
        hits[name] = llm.engine.stats()["prefix_cache_hits"] - before
    assert hits["self"] == hits["plain"] > 30, hits


class AlwaysWrong:
    """Proposes tokens the target never chooses (its reference's next token, shifted): every draft is
    rejected at once. Records each proposal as (the request's output tokens then, tokens proposed)."""

    def __init__(self, refs: dict[tuple, list[int]], vocab: int) -> None:
        self.refs, self.vocab, self.proposals = refs, vocab, []

    def propose(self, wanted):
        out = []
        for req, k in wanted:
            ref = self.refs[tuple(req.prompt_token_ids)]
            drafts = [(t + 1) % self.vocab for t in ref[req.num_output_tokens:req.num_output_tokens + k]]
            self.proposals.append((req.num_output_tokens, len(drafts)))
            out.append(drafts)
        return out


def test_a_pause_in_proposals_lasts_its_tokens_not_its_steps(tiny_models):
    """A request whose drafts all fail stops getting proposals for AdaptiveDraft.PAUSE_TOKENS of its
    tokens, then is tried again, also where the steps without proposals run as bursts of several tokens:
    a burst stops where the pause ends, and the first proposal after the pause comes exactly there."""
    folder = tiny_models["llama"]
    sp = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
    base = LLM(folder, dtype="bfloat16", kv_cache_memory=1 << 22)  # bfloat16: the fused decoder's bursts
    ref = _tokens(base.generate(PROMPTS[:1], sp))
    refs = {tuple(i): r for i, r in zip(_ids(base, PROMPTS[:1]), ref)}
    del base
    llm = LLM(folder, dtype="bfloat16", kv_cache_memory=1 << 22, speculative_config=NGRAM, num_scheduler_steps=8)
    proposer = llm.engine.proposer = AlwaysWrong(refs, llm.engine.vocab_size)
    llm.engine.step_cost = FixedCost(None)  # proposals whatever a row costs
    runner = llm.engine.runner
    bursts, execute_burst = [], runner.execute_burst
    runner.execute_burst = lambda *a, **k: (lambda r: bursts.append(r) or r)(execute_burst(*a, **k))
    assert _tokens(llm.generate(PROMPTS[:1], sp)) == ref
    assert any(r is not None and len(r) > 1 for r in bursts), "no burst ran: nothing tested"
    gaps = [b[0] - a[0] for a, b in zip(proposer.proposals, proposer.proposals[1:])]
    # Each rejected draft yields one token; after the pause, the next draft comes PAUSE_TOKENS tokens on.
    assert AdaptiveDraft.PAUSE_TOKENS + 1 in gaps, gaps
    assert max(gaps) == AdaptiveDraft.PAUSE_TOKENS + 1, gaps


def test_a_burst_ends_where_prompt_lookup_finds_a_proposal_again(default_gguf):
    """Where prompt lookup finds nothing for a request, the steps after run as a burst; that burst ends
    after the first step whose token lets the lookup find a proposal, so proposing resumes at once. The
    outputs are those of decoding without speculation."""
    text = ("Blocks of sixteen tokens hold the keys and values; a full block is hashed with every token "
            "before it. Blocks of sixteen tokens hold the keys and values; a full block is hashed with every "
            "token before it, so that a later request with the same prefix finds it and skips that work.")
    msgs, sp, ref = _default_model_repeats(default_gguf, "Repeat this text word for word, twice", text, 160)
    llm = LLM(default_gguf, speculative_config={"method": "ngram", "num_speculative_tokens": 3},
              num_scheduler_steps=8, enable_prefix_caching=False)
    llm.engine.step_cost = FixedCost(None)  # proposals whatever a row costs: only lookup misses leave a step without
    engine, runner = llm.engine, llm.engine.runner
    bursts, execute_burst = [], runner.execute_burst

    def recorded(sched, steps, interrupted, on_step=None):
        req = sched.scheduled[0].request
        before = list(req.all_token_ids)
        paused = req.spec_draft is not None and req.spec_draft.paused_until > req.num_output_tokens
        results = execute_burst(sched, steps, interrupted, on_step)
        if results is not None:
            bursts.append((before, [r.sampled[req.request_id] for r in results], steps, paused))
        return results
    runner.execute_burst = recorded
    assert _tokens(llm.chat(msgs, sp)) == ref
    finds = engine.proposer.finds
    ended_early = 0
    for before, tokens, steps, paused in bursts:
        if paused:
            continue
        for j in range(len(tokens) - 1):
            assert not finds(before + tokens[:j + 1]), (before[-8:], tokens, j)
        ended_early += len(tokens) < steps and finds(before + tokens)
    assert ended_early >= 1, f"no burst ended on a lookup hit: nothing tested ({len(bursts)} bursts)"


@pytest.mark.parametrize("config, message", [
    ({"method": "medusa"}, "method must be one of"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "from 1 to 16"),
    ({"method": "ngram", "num_speculative_tokens": 17}, "from 1 to 16"),
    ({"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 3}, "must not exceed"),
    ({"method": "ngram", "lookahead": 3}, "unknown keys"),
    ({"num_speculative_tokens": 3}, "needs a method"),
    ({"method": "draft_model"}, "needs \"model\""),
    ("{not json", "must be a JSON object"),
])
def test_bad_speculative_configs_are_refused_at_start(tiny_models, config, message):
    with pytest.raises(ValueError, match=message):
        LLM(tiny_models["llama"], dtype="float32", speculative_config=config)


def test_server_streams_speculated_tokens_and_reports_metrics(default_gguf):
    from server_utils import ServerProcess

    text = "Blocks of sixteen tokens are hashed with every token before them, so a later request finds them."
    server = ServerProcess(default_gguf, "--speculative-config", json.dumps(NGRAM))
    try:
        model = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
        body = {"model": model, "stream": True, "max_tokens": 40, "temperature": 0,
                "messages": [{"role": "user", "content": f"Repeat this text word for word:\n\n{text}"}],
                "stream_options": {"include_usage": True}}
        pieces, usage = [], None
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for c in chunk["choices"]:
                    if c["delta"].get("content"):
                        pieces.append(c["delta"]["content"])
        metrics = server.metrics()
        accepted = metrics["tokenmill:spec_decode_num_accepted_tokens_total"]
        assert metrics["tokenmill:spec_decode_num_drafts_total"] > 0 and accepted > 0
        assert metrics["tokenmill:spec_decode_num_accepted_tokens_per_pos_total"] == accepted
        # Accepted runs reach the client token by token, not as one piece per verification.
        assert usage is not None and len(pieces) >= usage["completion_tokens"] - 2
    finally:
        server.stop()


# ---------------------------------------------------------------------------------------- draft models
@pytest.mark.parametrize("draft", ["same weights", "another random model"])
def test_draft_model_outputs_equal_decoding_without_speculation(tiny_models, draft):
    """A draft that agrees with the target (its own weights: nearly every proposal accepted) and a tiny
    random one (few accepted: adaptive proposal sizes pause it): greedy outputs as without a draft."""
    target = tiny_models["llama"]
    spec = {"method": "draft_model", "num_speculative_tokens": 4,
            "model": target if draft == "same weights" else tiny_models["qwen2"]}
    sp = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    kw = dict(dtype="float32", block_size=4, max_num_batched_tokens=48)  # prompts in chunks, decodes among them
    ref = _tokens(LLM(target, **kw).generate(PROMPTS, sp))
    llm = LLM(target, speculative_config=spec, **kw)
    llm.engine.spec_rows = 64
    assert _tokens(llm.generate(PROMPTS, sp)) == ref
    s = llm.engine.stats()
    rate = s["spec_decode_num_accepted_tokens"] / s["spec_decode_num_draft_tokens"]
    if draft == "same weights":
        assert rate > 0.95
    else:
        assert rate < 0.3
        # Paused after its drafts kept failing: far fewer proposals than verified positions would allow.
        assert s["spec_decode_num_draft_tokens"] < 4 * len(PROMPTS) * 32 / 4
    proposer = llm.engine.proposer
    llm.engine.step()  # a step with nothing to run lets the proposer forget finished requests
    assert not proposer.shadows and proposer.kv.pool.num_free == proposer.kv.pool.num_blocks


def _drafting_for_itself(target: str, prompts: list[str], sp: SamplingParams):
    """A bfloat16 engine whose draft (k = 4) has the target's own weights, the greedy outputs of the target
    without it, and the list the draft's bursts append their step counts to."""
    kw = dict(dtype="bfloat16", block_size=4)
    ref = _tokens(LLM(target, **kw).generate(prompts, sp))
    llm = _always_proposing(LLM(target, speculative_config={"method": "draft_model", "num_speculative_tokens": 4,
                                                            "model": target}, **kw))
    runner = llm.engine.proposer.runner
    bursts, execute_burst = [], runner.execute_burst
    runner.execute_burst = lambda sched, steps, stop: bursts.append(steps) or execute_burst(sched, steps, stop)
    return llm, ref, bursts


@pytest.mark.skipif(cpu_kernels.load() is None, reason="needs the CPU kernels (bursts of the fused decoder)")
def test_draft_model_proposes_in_one_burst_of_its_fused_decoder(tiny_models):
    """In bfloat16 the draft's fused decoder runs decode steps back to back: once a request's prompt is
    in the draft's cache, a proposal of k tokens takes k passes of it: a burst of k steps after a
    rejection (one token to catch up), or, after a proposal accepted whole, one step of two decode rows
    (the last proposal and the target's next token) and a burst of k - 1; no step of the draft's
    module-by-module path runs past the prompts. Greedy outputs are those of decoding without a draft,
    nearly every proposal of a draft with the target's own weights is accepted, and the draft's blocks
    all return to its pool."""
    prompts, sp = PROMPTS[:3], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    llm, ref, bursts = _drafting_for_itself(tiny_models["llama"], prompts, sp)
    proposer = llm.engine.proposer
    steps, execute = [], proposer.runner.execute
    proposer.runner.execute = lambda sched: steps.append([(s.num_new_tokens, len(s.spec_token_ids))
                                                          for s in sched.scheduled]) or execute(sched)
    modular, forward = [], proposer.model.forward
    proposer.model.forward = lambda ids, *a: modular.append(len(ids)) or forward(ids, *a)
    assert _tokens(llm.generate(prompts, sp)) == ref
    assert 3 in bursts and set(bursts) <= {3, 4}  # 4: after a rejection, if any
    # Two-row catch-ups, each its own last row verified as the draft's proposal.
    assert sum((2, 1) in step for step in steps) >= 3
    assert all(n == 1 or (n, spec) == (2, 1) or n > 2 and spec == 0 for step in steps for n, spec in step)
    # Module-by-module steps only for the prompts (each request's first catch-up, with its first proposal).
    assert len(modular) <= len(prompts) and min(modular) > 2
    s = llm.engine.stats()
    assert s["spec_decode_num_accepted_tokens"] / s["spec_decode_num_draft_tokens"] > 0.9
    llm.engine.step()
    assert not proposer.shadows and proposer.kv.pool.num_free == proposer.kv.pool.num_blocks


def test_a_draft_model_s_steps_on_one_thread_are_counted(tiny_models):
    """A draft model's passes held on one thread by its runner's step governor (a core taken by another
    process; here a hold that does not end) count in the engine's one-thread stats, which /metrics
    reports, beside the target's own."""
    prompts, sp = PROMPTS[:2], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    target = tiny_models["llama"]
    llm = _always_proposing(LLM(target, speculative_config={"method": "draft_model", "num_speculative_tokens": 3,
                                                            "model": target}))
    held = cpu_kernels.ThreadGovernor(2)
    held.solo_until = float("inf")
    llm.engine.proposer.runner.governor = held
    llm.generate(prompts, sp)
    assert held.solo_steps >= 3  # the draft's passes ran, each on one thread
    own = llm.engine.runner.one_thread_stats().get("cpu_steps_on_one_thread", 0)
    assert llm.engine.stats()["cpu_steps_on_one_thread"] == own + held.solo_steps


@pytest.mark.skipif(cpu_kernels.load() is None, reason="needs the CPU kernels (bursts of the fused decoder)")
def test_a_two_row_catch_up_whose_draft_disagrees_runs_its_last_token_again(tiny_models):
    """Where the draft's choice after its last proposal is not the target's next token, its logits after
    that token are not kept by the two-row step: the token is computed again with the burst, whose
    first step it is (k steps then), and the proposals and outputs are as before."""
    prompts, sp = PROMPTS[:2], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    llm, ref, bursts = _drafting_for_itself(tiny_models["llama"], prompts, sp)
    proposer = llm.engine.proposer
    dropped, execute = [], proposer.runner.execute

    def disagreeing(sched):  # as if the draft had chosen another token after each last proposal
        out = execute(sched)
        popped = [out.spec_sampled.pop(i.request.request_id, None) for i in sched.scheduled if i.spec_token_ids]
        if popped:
            dropped.append(popped)
        return out

    proposer.runner.execute = disagreeing
    assert _tokens(llm.generate(prompts, sp)) == ref
    assert len(dropped) >= 3 and all(all(step) for step in dropped)  # the same weights agree: logits to drop
    # Each of those tokens again, first in a burst of k (but where max_tokens leaves fewer).
    assert bursts.count(4) >= len(dropped) - 1
    s = llm.engine.stats()
    assert s["spec_decode_num_accepted_tokens"] / s["spec_decode_num_draft_tokens"] > 0.9


def test_self_drafting_with_int8_weights(tiny_models):
    target = tiny_models["llama"]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ref = _tokens(LLM(target, dtype="float32", block_size=4).generate(PROMPTS[:4], sp))
    llm = LLM(target, dtype="float32", block_size=4,
              speculative_config={"method": "self", "quantization": "int8", "num_speculative_tokens": 3})
    assert llm.engine.proposer.model.quantized
    assert _tokens(llm.generate(PROMPTS[:4], sp)) == ref
    s = llm.engine.stats()
    assert s["spec_decode_num_accepted_tokens"] > 0.7 * s["spec_decode_num_draft_tokens"]


def test_seeded_sampling_with_a_draft_model_matches_decoding_without_it(tiny_models):
    target = tiny_models["llama"]
    sps = [SamplingParams(temperature=0.6, max_tokens=16, ignore_eos=True, seed=s) for s in range(4)]
    ref = _tokens(LLM(target, dtype="float32", block_size=4).generate(PROMPTS[:4], sps))
    llm = LLM(target, dtype="float32", block_size=4,
              speculative_config={"method": "draft_model", "model": target, "num_speculative_tokens": 3})
    assert _tokens(llm.generate(PROMPTS[:4], sps)) == ref
    assert llm.engine.stats()["spec_decode_num_accepted_tokens"] > 0


def test_a_draft_with_another_vocabulary_is_refused(tiny_models, default_gguf):
    with pytest.raises(ValueError, match="must share the target's vocabulary"):
        LLM(tiny_models["llama"], dtype="float32",
            speculative_config={"method": "draft_model", "model": default_gguf})


def test_self_drafting_an_already_quantized_file_is_refused(default_gguf):
    with pytest.raises(ValueError, match="already quantized"):
        LLM(default_gguf, speculative_config={"method": "self", "quantization": "int4"})
