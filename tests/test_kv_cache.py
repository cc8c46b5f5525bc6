"""Block pool and prefix cache invariants, driven through the scheduler with a stand-in model."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill.engine.kv_cache import KVCacheManager, hash_block
from tokenmill.engine.request import Request, RequestStatus
from tokenmill.engine.scheduler import ModelOutput, Scheduler
from tokenmill.sampling_params import SamplingParams

BS = 4


def fake_model(sched) -> ModelOutput:
    """Deterministic next token (a function of the sequence so far), as a model would give."""
    out = ModelOutput()
    for s in sched.scheduled:
        if s.samples:
            r = s.request
            out.sampled[r.request_id] = (sum(r.all_token_ids) * 31 + r.num_tokens) % 7
    return out


def check_invariants(sch: Scheduler) -> None:
    pool = sch.kv.pool
    holders = Counter()
    for req in sch.running:
        assert len(set(req.block_ids)) == len(req.block_ids), "a request holds a block twice"
        holders.update(req.block_ids)
        assert len(req.block_ids) * BS >= req.num_computed_tokens
    for b in pool.blocks:
        assert b.ref_cnt == holders[b.block_id], f"block {b.block_id}: ref_cnt {b.ref_cnt} != holders"
        assert (b.block_id in pool.free) == (b.ref_cnt == 0)
        if holders[b.block_id] > 1:
            assert b.block_hash is not None, "only cached full blocks may be shared"
    for digest, b in pool.cached.items():
        assert b.block_hash is not None and b.block_hash.digest == digest
    for req in sch.waiting:
        assert req.block_ids == []
    for req in sch.running:  # a finished pass confirms every block its tokens filled
        assert not set(req.block_ids[:req.num_computed_tokens // BS]) & set(sch.kv._pending)


ops = st.lists(st.one_of(
    st.tuples(st.just("add"), st.integers(0, 3), st.integers(1, 14), st.integers(1, 6), st.sampled_from([None, "a"])),
    st.tuples(st.just("step")),
    st.tuples(st.just("abort"), st.integers(0, 30)),
), min_size=1, max_size=60)


def _request(op, rid: str, max_model_len: int) -> Request | None:
    """The request an "add" op describes (None where its prompt leaves no room for a token). Prompts are
    drawn from 4 shared stems so that prefixes repeat."""
    _, prefix, length, max_tokens, salt = op
    prompt = ([prefix] * 5 + list(range(20)))[:length]
    max_tokens = min(max_tokens, max_model_len - length)
    if max_tokens < 1:
        return None
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, cache_salt=salt), max_tokens)


@settings(max_examples=150, deadline=None)
@given(ops=ops, num_blocks=st.integers(6, 24), budget=st.integers(1, 16), caching=st.booleans())
def test_pool_invariants_under_random_traffic(ops, num_blocks, budget, caching):
    kv = KVCacheManager(num_blocks, BS, enable_caching=caching)
    sch = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=budget, max_model_len=num_blocks * BS)
    ids = []
    for op in ops:
        if op[0] == "add":
            req = _request(op, f"r{len(ids)}", sch.max_model_len)
            if req is None:
                continue
            ids.append(req.request_id)
            sch.add_request(req)
        elif op[0] == "step":
            out = sch.schedule()
            assert out.num_batched_tokens <= budget and len(sch.running) <= 4
            sch.update(out, fake_model(out))
        elif ids:
            sch.finish_requests([ids[op[1] % len(ids)]], RequestStatus.FINISHED_ABORTED)
        check_invariants(sch)
    # Drain: everything finishes and every block comes back.
    for _ in range(2000):
        if not sch.has_unfinished():
            break
        out = sch.schedule()
        sch.update(out, fake_model(out))
        check_invariants(sch)
    assert not sch.has_unfinished()
    assert kv.pool.num_free == num_blocks and all(b.ref_cnt == 0 for b in kv.pool.blocks)


def _next(tokens: list[int]) -> int:
    return (sum(tokens) * 31 + len(tokens)) % 7  # fake_model's rule


def verifying_model(sched) -> ModelOutput:
    """fake_model, verifying proposals: each proposal kept while it equals the rule's token."""
    out = ModelOutput()
    for s in sched.scheduled:
        if s.samples:
            tokens = s.request.all_token_ids
            chosen = [_next(tokens)]
            for d in s.spec_token_ids:
                if d != chosen[-1]:
                    break
                tokens = tokens + [d]
                chosen.append(_next(tokens))
            out.sampled[s.request.request_id] = chosen[0]
            if s.spec_token_ids:
                out.spec_sampled[s.request.request_id] = chosen[1:]
    return out


def _propose(sch: Scheduler, draw) -> None:
    """Proposals for running decodes, as the engine makes them: right or wrong tokens, never past
    max_tokens or the context."""
    for req in sch.running:
        req.spec_token_ids = []
        if req.num_tokens - req.num_computed_tokens != 1:
            continue
        k = min(draw(st.integers(0, 4)), req.max_tokens - req.num_output_tokens - 1,
                sch.max_model_len - req.num_tokens - 1)
        tokens = req.all_token_ids
        for _ in range(max(k, 0)):
            t = _next(tokens) if draw(st.booleans()) else draw(st.integers(0, 6))
            req.spec_token_ids.append(t)
            tokens = tokens + [t]


def _spec_step(sch: Scheduler, draw, budget: int) -> None:
    out = sch.schedule()
    assert out.num_batched_tokens <= budget and len(sch.running) <= 4
    for result in verifying_model(out).passes():
        sch.update(out, result)
    sch.release_rejected(out)
    for s in out.scheduled:  # a request that verified keeps only the blocks of its computed tokens
        if s.spec_token_ids and not s.request.is_finished:
            assert len(s.request.block_ids) == -(-s.request.num_computed_tokens // BS)
    _propose(sch, draw)


@settings(max_examples=150, deadline=None)
@given(ops=ops, num_blocks=st.integers(6, 24), budget=st.integers(1, 16), caching=st.booleans(), data=st.data())
def test_pool_invariants_under_random_traffic_with_speculation(ops, num_blocks, budget, caching, data):
    """The same traffic with proposed tokens verified in steps: accepted runs, rejected tails, proposals
    cut by the budget or by free blocks, preemption. No block leaks, none is shared without a hash, and
    each request's tokens are those the rule gives (proposals never change outputs)."""
    kv = KVCacheManager(num_blocks, BS, enable_caching=caching)
    sch = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=budget, max_model_len=num_blocks * BS)
    reqs = []
    for op in ops:
        if op[0] == "add":
            req = _request(op, f"r{len(reqs)}", sch.max_model_len)
            if req is None:
                continue
            reqs.append(req)
            sch.add_request(req)
        elif op[0] == "step":
            _spec_step(sch, data.draw, budget)
        elif reqs:
            sch.finish_requests([reqs[op[1] % len(reqs)].request_id], RequestStatus.FINISHED_ABORTED)
        check_invariants(sch)
    for _ in range(2000):
        if not sch.has_unfinished():
            break
        _spec_step(sch, data.draw, budget)
        check_invariants(sch)
    assert not sch.has_unfinished()
    assert kv.pool.num_free == num_blocks and all(b.ref_cnt == 0 for b in kv.pool.blocks)
    for r in reqs:
        if r.status != RequestStatus.FINISHED_ABORTED:
            tokens = list(r.prompt_token_ids)
            for t in r.output_token_ids:
                assert t == _next(tokens)
                tokens.append(t)
            assert r.num_output_tokens == r.max_tokens


def _compute(kv: KVCacheManager, req: Request, n: int) -> None:
    """Allocate n more tokens and mark them computed, as a finished forward pass would."""
    assert kv.allocate_slots(req, n)
    req.num_computed_tokens += n
    kv.cache_computed_blocks(req)


def test_eviction_is_least_recently_used():
    kv = KVCacheManager(4, BS)  # exactly the blocks of a and b, so no never-used block comes first
    a = Request("a", list(range(8)), SamplingParams(), 1)
    b = Request("b", list(range(100, 108)), SamplingParams(), 1)
    for r in (a, b):
        _compute(kv, r, 8)
    a_blocks, b_blocks = list(a.block_ids), list(b.block_ids)
    kv.free(a)
    kv.free(b)
    # a was freed first, and within a request the tail goes first: a's tail, a's head, then b's.
    fresh = Request("c", list(range(200, 212)), SamplingParams(), 1)
    assert kv.allocate_slots(fresh, 12)
    assert fresh.block_ids[:3] == [a_blocks[1], a_blocks[0], b_blocks[1]]
    # b's head block is still cached and found; a's blocks are gone.
    assert kv.get_computed_blocks(Request("b2", list(range(100, 108)) + [5], SamplingParams(), 1))[0].block_id == b_blocks[0]
    assert kv.get_computed_blocks(Request("a2", list(range(8)) + [5], SamplingParams(), 1)) == []


def test_hit_confirmed_by_tokens_and_salt_isolates():
    kv = KVCacheManager(8, BS)
    r = Request("r", list(range(9)), SamplingParams(), 1)
    _compute(kv, r, 9)
    # A forged entry under the same digest with other tokens is not served.
    h = r.block_hashes[0]
    assert kv.pool.lookup(h) is not None
    assert kv.pool.lookup(type(h)(h.digest, (9, 9, 9, 9))) is None
    same = Request("s", list(range(9)), SamplingParams(), 1)
    assert len(kv.get_computed_blocks(same)) == 2
    salted = Request("t", list(range(9)), SamplingParams(cache_salt="tenant-b"), 1)
    assert kv.get_computed_blocks(salted) == []
    # A hit never covers the last token: an 8-token prompt reuses one block, not two.
    exact = Request("u", list(range(8)), SamplingParams(), 1)
    assert len(kv.get_computed_blocks(exact)) == 1
    assert hash_block(None, [1, 2]).digest != hash_block(None, [1, 2], b"x").digest


def test_a_pass_confirms_only_the_blocks_it_filled():
    """Each block a request fills is confirmed once, by the pass that filled it: a decode step does not walk
    the request's earlier blocks again (a cost that grew with the context)."""
    kv = KVCacheManager(64, BS, enable_caching=True)
    popped = []

    class Counting(dict):
        def pop(self, key, *default):
            popped.append(key)
            return super().pop(key, *default)

    kv._pending = Counting()
    sch = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=8, max_model_len=64 * BS)
    req = Request("r", list(range(20)), SamplingParams(max_tokens=150), 150)
    sch.add_request(req)
    steps = 0
    while sch.has_unfinished():
        out = sch.schedule()
        sch.update(out, fake_model(out))
        check_invariants(sch)
        steps += 1
    assert steps > 150 and req.num_output_tokens == 150
    assert len(popped) <= (20 + 150) // BS + 1
