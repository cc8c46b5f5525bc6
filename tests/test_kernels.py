"""The CPU decode kernels against float32/float64 references."""

from __future__ import annotations

import pytest
import torch

from tokenmill.kernels import cpu as cpu_kernels

kernel = cpu_kernels.load()
pytestmark = pytest.mark.skipif(kernel is None, reason="needs AVX-512 and a C++ compiler")


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("n,k", [(960, 576), (49152, 576), (576, 1536), (7, 64), (4, 32)])
def test_gemv_matches_float32_reference(rows, n, k):
    g = torch.Generator().manual_seed(rows * 1000 + n)
    x = torch.randn(rows, k, generator=g).bfloat16()
    w = torch.randn(n, k, generator=g).bfloat16()
    ref = x.float() @ w.float().t()  # exact products of the same bf16 inputs, fp32 sums
    out = kernel.gemv_bf16(x, w)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, n)
    # Only the final rounding to bf16 (and summation order) may differ: 2^-8 relative.
    assert torch.allclose(out.float(), ref, rtol=2 ** -7, atol=1e-3 * k ** 0.5)


@pytest.mark.parametrize("n,k", [(960, 576), (37, 2048), (8, 64)])
def test_gemv_row_is_the_same_whatever_rows_share_the_call(n, k):
    """A row's products are summed in one order whether it is alone or one of up to 8 rows: a decode step
    of one request and a verify step of that request's positions (or a batch) compute the same bits."""
    g = torch.Generator().manual_seed(n + k)
    x = torch.randn(8, k, generator=g).bfloat16()
    w = torch.randn(n, k, generator=g).bfloat16()
    alone = torch.cat([kernel.gemv_bf16(x[i:i + 1], w) for i in range(8)])
    for rows in range(2, 9):
        assert torch.equal(kernel.gemv_bf16(x[:rows], w), alone[:rows]), rows


def test_linear_dispatch_and_bias():
    x = torch.randn(2, 64).bfloat16()
    w = torch.randn(16, 64).bfloat16()
    b = torch.randn(16).bfloat16()
    ref = torch.nn.functional.linear(x.float(), w.float(), b.float())
    assert torch.allclose(cpu_kernels.linear(x, w, b).float(), ref, rtol=2 ** -6, atol=0.05)
    # More rows than the kernel takes, or K not a multiple of 32: torch's GEMM, the same answer.
    big = torch.randn(kernel.max_gemv_rows + 1, 64).bfloat16()
    for xs, ws in ((big, w), (x[:, :48], w[:, :48])):
        assert torch.allclose(kernel.gemv_bf16(xs, ws).float(), xs.float() @ ws.float().t(), rtol=2 ** -6, atol=0.05)
    assert torch.allclose(cpu_kernels.linear(big, w).float(), big.float() @ w.float().t(), rtol=2 ** -6, atol=0.05)


def _paged_case(dtype, window):
    g = torch.Generator().manual_seed(7)
    b, h, kvh, d, bs, blocks = 5, 9, 3, 64, 4, 48
    k_cache = torch.randn(blocks * bs, kvh, d, generator=g).to(dtype)
    v_cache = torch.randn(blocks * bs, kvh, d, generator=g).to(dtype)
    q = torch.randn(b, h, d, generator=g).to(dtype)
    lens = torch.tensor([1, 7, 16, 29, 33])
    perm = torch.randperm(blocks, generator=g)
    width = 9
    bt = perm[: b * width].reshape(b, width)  # scattered, non-contiguous blocks
    return q, k_cache, v_cache, bt, lens, bs, window


def _random_requests(lens, h, kvh, d, bs, dtype, seed):
    """Random queries and caches for requests of the given context lengths, their blocks scattered."""
    g = torch.Generator().manual_seed(seed)
    width = max(-(-n // bs) for n in lens)
    blocks = len(lens) * width
    k_cache = torch.randn(blocks * bs, kvh, d, generator=g).to(dtype)
    v_cache = torch.randn(blocks * bs, kvh, d, generator=g).to(dtype)
    q = torch.randn(len(lens), h, d, generator=g).to(dtype)
    bt = torch.randperm(blocks, generator=g).reshape(len(lens), width)
    return q, k_cache, v_cache, bt, torch.tensor(lens)


def _dense_reference(q, k_cache, v_cache, bt, lens, bs, window, scale, softcap=None):
    out = torch.empty(q.shape, dtype=torch.float64)
    for i in range(q.shape[0]):
        n = int(lens[i])
        pos = torch.arange(n)
        slots = bt[i][pos // bs] * bs + pos % bs
        keys, values = k_cache[slots].double(), v_cache[slots].double()  # [n, KVH, D]
        group = q.shape[1] // keys.shape[1]
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
        scores = torch.einsum("hd,nhd->hn", q[i].double(), keys) * scale
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        if window:
            scores[:, : max(0, n - window)] = float("-inf")
        out[i] = torch.einsum("hn,nhd->hd", scores.softmax(-1), values)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("batch", [1, 5])  # one short request splits its KV heads across cores; five do not
def test_paged_decode_attention_kernel_and_fallback(dtype, window, batch, monkeypatch):
    from tokenmill.attention.backend import AttentionMetadata
    from tokenmill.attention.cpu import TorchSDPABackend

    q, kc, vc, bt, lens, bs, window = _paged_case(dtype, window)
    q, bt, lens = q[-batch:], bt[-batch:], lens[-batch:]
    scale = 64 ** -0.5
    ref = _dense_reference(q, kc, vc, bt, lens, bs, window, scale)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    out = kernel.paged_decode_attention(q, kc, vc, bt, lens, bs, scale, window or 0)
    assert torch.allclose(out.double(), ref, atol=tol, rtol=tol)
    # The portable path (used where the kernels cannot be built) agrees too.
    meta = AttentionMetadata(slot_mapping=torch.tensor([], dtype=torch.long), query_start_loc=[], seq_lens=[],
                             num_decodes=q.shape[0], decode_block_tables=bt, decode_seq_lens=lens,
                             block_tables=[], block_size=bs)
    monkeypatch.setattr(cpu_kernels, "load", lambda: None)
    fallback = TorchSDPABackend._decode(q, kc, vc, meta, scale, window)
    assert torch.allclose(fallback.double(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 100])
@pytest.mark.parametrize("lens", [[300], [1, 300], [5, 400], [200, 65, 130]])
@pytest.mark.parametrize("kvh", [1, 2])
def test_paged_decode_attention_splits_long_contexts(dtype, window, lens, kvh):
    """Few requests with long contexts: each request's tokens are split into ranges, all KV heads in each
    (some ranges empty, for the one-token request), that threads compute apart and the kernel merges."""
    d, bs = 64, 16
    q, k_cache, v_cache, bt, lens_t = _random_requests(lens, 6, kvh, d, bs, dtype, seed=len(lens))
    scale = d ** -0.5
    ref = _dense_reference(q, k_cache, v_cache, bt, lens_t, bs, window, scale)
    out = kernel.paged_decode_attention(q, k_cache, v_cache, bt, lens_t, bs, scale, window or 0)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(out.double(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [16, 48, 80, 128, 256])  # odd multiples of 16 leave half of the last bf16 pair empty
@pytest.mark.parametrize("h,kvh", [(7, 1), (8, 2), (4, 4)])  # query heads per KV head above, at and below a group
def test_paged_decode_attention_head_shapes(dtype, d, h, kvh):
    bs = 16
    q, k_cache, v_cache, bt, lens_t = _random_requests([37, 3, 70], h, kvh, d, bs, dtype, seed=d + h)
    scale = d ** -0.5
    ref = _dense_reference(q, k_cache, v_cache, bt, lens_t, bs, None, scale)
    for rows in ([0], [0, 1, 2]):  # one request (heads split across threads) and three
        out = kernel.paged_decode_attention(q[rows], k_cache, v_cache, bt[rows], lens_t[rows], bs, scale, 0)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        assert torch.allclose(out.double(), ref[rows], atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("lens", [[300], [37, 3, 70]])  # token ranges merged across threads; heads split
def test_paged_decode_attention_softcaps_logits(dtype, window, lens, monkeypatch):
    """softcap > 0: the logits pass through softcap * tanh(logits / softcap) before the softmax (Gemma 2
    style), in the kernel and the portable path; caps of 0.3 and 3 bend logits of this size a lot and
    a little, on both sides of tanh's polynomial/exponential seam."""
    from tokenmill.attention.backend import AttentionMetadata
    from tokenmill.attention.cpu import TorchSDPABackend

    d, bs = 64, 16
    q, k_cache, v_cache, bt, lens_t = _random_requests(lens, 6, 2, d, bs, dtype, seed=5)
    scale = d ** -0.5
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    meta = AttentionMetadata(slot_mapping=torch.tensor([], dtype=torch.long), query_start_loc=[], seq_lens=[],
                             num_decodes=q.shape[0], decode_block_tables=bt, decode_seq_lens=lens_t,
                             block_tables=[], block_size=bs)
    for cap in (0.3, 3.0):
        ref = _dense_reference(q, k_cache, v_cache, bt, lens_t, bs, window, scale, softcap=cap)
        uncapped = _dense_reference(q, k_cache, v_cache, bt, lens_t, bs, window, scale)
        assert (ref - uncapped).abs().max() > 0.01  # the cap matters here (against float32's tolerance)
        out = kernel.paged_decode_attention(q, k_cache, v_cache, bt, lens_t, bs, scale, window or 0, softcap=cap)
        assert torch.allclose(out.double(), ref, atol=tol, rtol=tol), cap
        with monkeypatch.context() as m:
            m.setattr(cpu_kernels, "load", lambda: None)
            fallback = TorchSDPABackend._decode(q, k_cache, v_cache, meta, scale, window, cap)
        assert torch.allclose(fallback.double(), ref, atol=tol, rtol=tol), cap


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 100])
def test_paged_decode_attention_is_the_same_in_any_batch(dtype, window):
    """A request's attention output does not depend on the other requests of the step, bit for bit: the
    split of its tokens over threads follows its own context length. (Verifying several positions of a
    request as rows of their own then computes each as a plain decode step of that position would.)"""
    d, bs = 64, 16
    lens = [300, 7, 45, 64, 129, 1000, 2]
    q, k_cache, v_cache, bt, lens_t = _random_requests(lens, 8, 2, d, bs, dtype, seed=11)
    scale = d ** -0.5
    together = kernel.paged_decode_attention(q, k_cache, v_cache, bt, lens_t, bs, scale, window or 0)
    for rows in ([0], [5], [1, 2], [0, 3, 4, 6], list(range(len(lens)))[::-1]):
        apart = kernel.paged_decode_attention(q[rows], k_cache, v_cache, bt[rows], lens_t[rows], bs, scale,
                                              window or 0)
        assert torch.equal(apart, together[rows]), rows


def _verify_rows(request_lens, other_lens, seed):
    """A step's rows that verify positions of one request (one block table, lengths one apart) between the
    first of other requests and the rest: (the request's row indices, block tables, lengths, cache slots)."""
    g = torch.Generator().manual_seed(seed)
    width = -(-max(request_lens + other_lens) // 16)
    blocks = torch.randperm(width * (len(other_lens) + 1), generator=g).reshape(-1, width)  # scattered
    own, others = blocks[0], list(blocks[1:])
    tables = others[:1] + [own] * len(request_lens) + others[1:]
    lens = other_lens[:1] + request_lens + other_lens[1:]
    return list(range(1, 1 + len(request_lens))), torch.stack(tables), torch.tensor(lens), blocks.numel() * 16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 100])
@pytest.mark.parametrize("start,k", [(3, 3), (30, 4), (62, 4), (300, 3), (1000, 8), (95, 16)])
@pytest.mark.parametrize("plan_threads", [0, 3, 8])
def test_paged_decode_attention_verifies_a_request_s_positions_as_alone(dtype, window, start, k, plan_threads):
    """Positions L..L+k of one request as rows of one step (what verifying k proposals asks), beside other
    requests: each row's output is, bit for bit, what a plain decode step of that position alone computes
    (so speculation changes no greedy output), and matches float64 attention. Planned for more threads
    than this machine may have, short requests split per KV head: a row's token ranges must not change
    with that (lengths around 64 and 96 cross where a request's tokens split into more ranges)."""
    d, h, kvh, bs = 64, 9, 3, 16
    rows, bt, lens_t, slots = _verify_rows(list(range(start, start + k + 1)), [40, 700], seed=start + k)
    g = torch.Generator().manual_seed(k)
    k_cache = torch.randn(slots, kvh, d, generator=g).to(dtype)
    v_cache = torch.randn(slots, kvh, d, generator=g).to(dtype)
    q = torch.randn(len(lens_t), h, d, generator=g).to(dtype)
    scale = d ** -0.5
    kernel.set_plan_threads(plan_threads)
    try:
        together = kernel.paged_decode_attention(q, k_cache, v_cache, bt, lens_t, bs, scale, window or 0)
        for r in range(len(lens_t)):
            alone = kernel.paged_decode_attention(q[r:r + 1], k_cache, v_cache, bt[r:r + 1], lens_t[r:r + 1], bs,
                                                  scale, window or 0)
            assert torch.equal(alone[0], together[r]), (r, int(lens_t[r]))
        just_them = kernel.paged_decode_attention(q[rows], k_cache, v_cache, bt[rows], lens_t[rows], bs, scale,
                                                  window or 0)
        assert torch.equal(just_them, together[rows])
    finally:
        kernel.set_plan_threads(0)
    ref = _dense_reference(q, k_cache, v_cache, bt, lens_t, bs, window, scale)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(together.double(), ref, atol=tol, rtol=tol)


def test_argmax_matches_torch():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 49157, generator=g)  # a length that leaves a tail after the 16-wide steps
    x[1, 40000] = x[1, 7] = x[1].max() + 1  # ties: the first wins
    x[2] = float("-inf")
    x[3, 49156] = 1e9  # the largest in the tail
    x[4, 12345] = float("nan")  # NaN wins, as in torch
    x[5] = torch.round(x[5])  # many ties
    assert torch.equal(kernel.argmax_rows(x), x.argmax(dim=-1))
    xb = x.bfloat16()  # rounding makes more ties
    assert torch.equal(kernel.argmax_rows(xb), xb.float().argmax(dim=-1))
    for n in (1, 15, 16, 17):
        y = torch.randn(3, n, generator=g)
        assert torch.equal(kernel.argmax_rows(y), y.argmax(dim=-1))


# ------------------------------------------------------------------ bounds at the kernels' boundary

def test_paged_decode_attention_refuses_block_tables_outside_the_cache():
    """Block ids past the cache, negative ones, and lengths past the block table raise instead of reading
    foreign memory; columns past a request's length are padding and are not looked at."""
    bs = 4
    q, k_cache, v_cache, bt, lens = _random_requests([6, 9], 4, 2, 16, bs, torch.float32, seed=3)
    blocks = k_cache.shape[0] // bs
    scale = 16 ** -0.5

    def run(bt=bt, lens=lens):
        return kernel.paged_decode_attention(q, k_cache, v_cache, bt, lens, bs, scale, 0)

    ok = run()
    padded = torch.cat([bt, torch.full((2, 1), 10 ** 9)], dim=1)
    padded[0, 2] = -5  # request 0 (6 tokens) uses two blocks: column 2 is padding
    assert torch.equal(run(bt=padded), ok)
    for column, bad in ((1, blocks), (0, -1)):
        table = bt.clone()
        table[1, column] = bad
        with pytest.raises(RuntimeError, match=f"block id {bad} .* outside the KV cache"):
            run(bt=table)
    for bad_len, message in ((bt.shape[1] * bs + 1, "is not covered"), (0, "is below 1")):
        with pytest.raises(RuntimeError, match=f"sequence length {bad_len} {message}"):
            run(lens=torch.tensor([6, bad_len]))
    with pytest.raises(RuntimeError, match="must match q's batch"):
        run(lens=lens[:1])


def _tiny_fused_decoder(num_layers=2, cache_slots=64, block_size=4, positions=32, vocab=50):
    """A FusedDecoder over random bf16 weights (4 heads, 2 KV heads of 16, hidden 64), its caches and an
    output layer."""
    g = torch.Generator().manual_seed(0)
    h, kvh, d, hidden, inter = 4, 2, 16, 64, 128

    def rand(*shape):
        return (torch.randn(*shape, generator=g) * 0.1).bfloat16()

    angles = torch.arange(positions)[:, None] * torch.rand(d // 2, generator=g)[None]
    cos, sin = angles.cos().repeat(1, 2), angles.sin().repeat(1, 2)
    ones = torch.ones(hidden).bfloat16()
    def dense(*shape):
        return [(rand(*shape), 30)]

    dec = kernel.FusedDecoderBF16(h, kvh, d, inter, 1e-6, d ** -0.5, block_size, ones, dense(vocab, hidden),
                                  dense(vocab, hidden), cos, sin)
    caches = []
    for i in range(num_layers):
        kc, vc = (torch.zeros(cache_slots, kvh, d).bfloat16() for _ in range(2))
        dec.add_layer(ones, dense((h + 2 * kvh) * d, hidden), None, None, None, dense(hidden, h * d), None, ones,
                      dense(2 * inter, hidden), None, dense(hidden, inter), None, kc, vc, 5 * i)
        caches += [kc, vc]
    return dec, caches


def test_fused_decoder_refuses_steps_outside_its_cache_and_tables():
    """Each bookkeeping error a step can carry (a slot past the cache, a block id past it, a length past
    the block table, a position past the rotary table, a token past the vocabulary) raises before the
    step writes anything, in each entry point; the decoder then runs valid steps as before."""
    dec, caches = _tiny_fused_decoder()
    # Request 0: 6 tokens in blocks 0, 1 (column 2 padding); request 1: 10 tokens in blocks 2, 3, 4.
    good = dict(ids=torch.tensor([3, 7]), pos=torch.tensor([5, 9]), slots=torch.tensor([5, 17]),
                bt=torch.tensor([[0, 1, 0], [2, 3, 4]]), lens=torch.tensor([6, 10]))

    def with_(**change):
        step = {k: v.clone() for k, v in good.items()}
        for k, (index, value) in change.items():
            step[k][index] = value
        return step

    bad_steps = {
        "cache slot 64 is outside the KV cache": with_(slots=(1, 64)),
        "cache slot -1 is outside the KV cache": with_(slots=(0, -1)),
        "block id 16 at block table column 1 is outside": with_(bt=((0, 1), 16)),
        "block id -3 at block table column 2 is outside": with_(bt=((1, 2), -3)),
        "sequence length 13 is not covered": with_(lens=(1, 13)),
        "sequence length 0 is below 1": with_(lens=(0, 0)),
        "position beyond the rotary table": with_(pos=(1, 32)),
        r"token id 50 is out of range \[0, 50\)": with_(ids=(0, 50)),
    }
    entry_points = {
        "forward": lambda s: dec.forward(s["ids"], s["pos"], s["slots"], s["bt"], s["lens"]),
        "logits": lambda s: dec.logits(s["ids"], s["pos"], s["slots"], s["bt"], s["lens"]),
        "decode_greedy": lambda s: dec.decode_greedy(s["ids"], s["pos"], s["slots"][None], s["bt"], s["lens"],
                                                     [[], []]),
    }
    padded = with_(bt=((0, 2), 10 ** 9))  # a column past request 0's length is never read
    want = entry_points["forward"](good)
    assert torch.equal(entry_points["forward"](padded), want)
    before = [c.clone() for c in caches]
    for name, run in entry_points.items():
        for message, step in bad_steps.items():
            with pytest.raises(RuntimeError, match=message):
                run(step)
    # A burst: every step's slots, and the lengths its last step reaches, are checked before it starts.
    burst = dict(good, slots=torch.tensor([[5, 17], [6, 18], [64, 19]]))
    with pytest.raises(RuntimeError, match="cache slot 64"):
        dec.decode_greedy(burst["ids"], burst["pos"], burst["slots"], burst["bt"], burst["lens"], [[], []])
    slots = torch.tensor([[5, 17], [6, 18], [7, 19]])
    with pytest.raises(RuntimeError, match="sequence length 13 is not covered"):
        dec.decode_greedy(good["ids"], good["pos"], slots, good["bt"], torch.tensor([6, 11]), [[], []])
    assert all(torch.equal(b, c) for b, c in zip(before, caches)), "a refused step wrote to the cache"
    assert torch.equal(entry_points["forward"](good), want)
    tokens = dec.decode_greedy(good["ids"], good["pos"], slots, good["bt"], good["lens"], [[], []])
    assert tokens.shape == (3, 2)


def test_a_bursts_step_hook_sees_each_step_and_can_end_it():
    """on_step gets every step's tokens as the step ends (the rows decode_greedy returns); returning True
    ends the burst after that step; an exception it raises ends the burst and reaches the caller as
    itself. decode_sampled at temperature 0 is decode_greedy; its draws depend on u, and its parameters
    must come one per request."""
    dec, _ = _tiny_fused_decoder()
    ids, pos, bt, lens = torch.tensor([3, 7]), torch.tensor([5, 9]), torch.tensor([[0, 1, 0], [2, 3, 4]]), \
        torch.tensor([6, 10])
    slots = torch.tensor([[5, 17], [6, 18], [7, 19]])
    seen = []
    tokens = dec.decode_greedy(ids, pos, slots, bt, lens, [[], []], on_step=lambda j, row: seen.append((j, row)))
    assert seen == list(enumerate(tokens.tolist())) and len(seen) == 3
    seen.clear()
    short = dec.decode_greedy(ids, pos, slots, bt, lens, [[], []], on_step=lambda j, row: seen.append(j) or j == 1)
    assert seen == [0, 1] and torch.equal(short, tokens[:2])

    class Boom(Exception):
        pass

    def boom(j, row):
        seen.append(j)
        raise Boom("from the hook")

    seen.clear()
    with pytest.raises(Boom, match="from the hook"):
        dec.decode_greedy(ids, pos, slots, bt, lens, [[], []], on_step=boom)
    assert seen == [0]

    def sampled(temperature, u):
        return dec.decode_sampled(ids, pos, slots, bt, lens, [[], []], torch.tensor(temperature), torch.tensor([0, 0]),
                                  torch.tensor([1.0, 1.0]), torch.tensor([0.0, 0.0]), u)

    assert torch.equal(sampled([0.0, 0.0], torch.rand(3, 2, dtype=torch.float64)), tokens)
    draws = {tuple(sampled([5.0, 5.0], torch.full((3, 2), q, dtype=torch.float64)).flatten().tolist())
             for q in (0.01, 0.5, 0.99)}
    assert len(draws) == 3  # a hot distribution: u picks where in it the tokens fall
    with pytest.raises(RuntimeError, match="one per request"):
        sampled([1.0, 1.0, 1.0], torch.rand(3, 2, dtype=torch.float64))
    with pytest.raises(RuntimeError, match=r"u: \[steps, batch\]"):
        sampled([1.0, 1.0], torch.rand(2, 2, dtype=torch.float64))


@pytest.fixture(params=[False, True], ids=["pairs", "amx"])
def prompt_amx(request):
    """prefill_attention through bf16 pair products, then (where the CPU has AMX) through AMX's tiles."""
    module = cpu_kernels.load()
    if module is None:
        pytest.skip("the CPU kernels did not build")
    if request.param and not module.prompt_amx:
        pytest.skip("no AMX on this CPU")
    module.set_prompt_amx(request.param)
    yield request.param
    module.set_prompt_amx(True)


@pytest.mark.skipif(cpu_kernels.load() is None, reason="the CPU kernels did not build")
@pytest.mark.parametrize("n,length,h,kvh,d,window", [
    (736, 736, 9, 3, 64, 0),    # the default model's shapes, a whole prompt
    (40, 100, 8, 2, 128, 0),    # a chunk after a cached prefix
    (33, 100, 8, 1, 128, 17),   # a sliding window
    (70, 70, 4, 4, 256, 0),     # head_dim 256 (Gemma 3)
    (5, 37, 2, 1, 16, 3),
    (1, 1, 4, 4, 32, 0),
])
def test_prefill_attention_matches_a_float64_reference(n, length, h, kvh, d, window, prompt_amx):
    torch.manual_seed(n + length)
    q = torch.randn(n, h, d, dtype=torch.bfloat16)
    k, v = (torch.randn(length, kvh, d, dtype=torch.bfloat16) for _ in range(2))
    out = cpu_kernels.load().prefill_attention(q, k, v, d ** -0.5, window)
    # Each row a decode query at its position, over a cache that holds the keys in order (blocks of 1).
    ref = _dense_reference(q, k, v, torch.arange(length).expand(n, length), torch.arange(length - n + 1, length + 1),
                           1, window, d ** -0.5)
    # bfloat16 output and probabilities: torch's own bf16 attention is off by as much (~8e-3 here).
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)
    with pytest.raises(RuntimeError, match="bfloat16"):
        cpu_kernels.load().prefill_attention(q.float(), k.float(), v.float(), d ** -0.5, window)


@pytest.mark.skipif(cpu_kernels.load() is None, reason="the CPU kernels did not build")
@pytest.mark.parametrize("window", [0, 50])
def test_prefill_attention_rows_are_the_same_in_any_chunk(window, prompt_amx):
    """A prompt's rows computed in one call, or in chunks each over the prefix before it, are the same
    bits: a row's arithmetic depends on its position and the keys up to it only."""
    torch.manual_seed(0)
    q = torch.randn(300, 6, 64, dtype=torch.bfloat16)
    k, v = (torch.randn(300, 2, 64, dtype=torch.bfloat16) for _ in range(2))
    attend = cpu_kernels.load().prefill_attention
    whole = attend(q, k, v, 0.125, window)
    for cuts in ([1, 2, 300], [31, 33, 64, 65, 300], [100, 299, 300]):
        start, parts = 0, []
        for end in cuts:
            parts.append(attend(q[start:end], k[:end], v[:end], 0.125, window))
            start = end
        assert torch.equal(torch.cat(parts), whole)


@pytest.mark.skipif(cpu_kernels.load() is None or not cpu_kernels.load().prompt_amx, reason="no AMX on this CPU")
def test_prefill_attention_on_amx_tiles_is_its_own_path():
    """The tiles' sums run in another order than the pair products': the two give different bits on the
    default model's shapes (so the tests above that run with AMX on do run its code), within bf16 rounding."""
    module = cpu_kernels.load()
    torch.manual_seed(1)
    q = torch.randn(200, 9, 64, dtype=torch.bfloat16)
    k, v = (torch.randn(200, 3, 64, dtype=torch.bfloat16) for _ in range(2))
    try:
        module.set_prompt_amx(False)
        pairs = module.prefill_attention(q, k, v, 0.125, 0)
        module.set_prompt_amx(True)
        tiles = module.prefill_attention(q, k, v, 0.125, 0)
    finally:
        module.set_prompt_amx(True)
    assert not torch.equal(pairs, tiles)
    torch.testing.assert_close(tiles, pairs, atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(cpu_kernels.load() is None, reason="the CPU kernels did not build")
def test_chunk_ops_round_as_the_eager_operations(monkeypatch):
    """rms_norm_bf16, glu_bf16 and rotary_bf16 against the eager bfloat16 operations they stand for (RMSNorm,
    gated, apply_rotary with the kernels off): the rotary embedding bit for bit (the same products and
    roundings), the norm and activations within a bfloat16 step or two (float32 sums and exp in another
    order)."""
    import torch.nn.functional as F

    from tokenmill.model import rotary
    from tokenmill.model.layers import gated

    module = cpu_kernels.load()
    torch.manual_seed(0)
    bf = torch.bfloat16

    def close(got, want, share):
        # two bfloat16 steps at that magnitude (an activation rounded one step apart, then its product with
        # up rounded), or 1e-5 (gelu_tanh's tail: ~5e-7 where torch's is 0)
        step = (want.float().abs() * 2 ** -6).clamp_min(1e-5)
        assert ((got.float() - want.float()).abs() <= step).all()
        assert (got != want).float().mean() <= share

    x, w = (torch.randn(37, 576) * 3).to(bf), torch.randn(576).to(bf)
    close(module.rms_norm_bf16(x, w, 1e-5), w * F.rms_norm(x.float(), (576,), eps=1e-5).to(bf), 1e-3)
    close(module.rms_norm_bf16(x, w, 1e-6, 1.0, True), (F.rms_norm(x.float(), (576,), eps=1e-6) * (1 + w.float())).to(bf), 1e-3)
    gu = (torch.randn(37, 2 * 1536) * 2).to(bf)
    for index, (activation, glu) in enumerate([("silu", (1.0, 0.0)), ("gelu_tanh", (1.0, 0.0)),
                                               ("clamped_swiglu", (1.702, 7.0))]):
        want = gated(gu[:, :1536], gu[:, 1536:], activation, glu)
        close(module.glu_bf16(gu, index, *glu), want, 0.05)
    # silu(0.0078125) falls at a rounding boundary: one step apart there, two in its product with up
    edge = torch.tensor([[0.0078125] * 16 + [-3.34375] * 16], dtype=bf)
    close(module.glu_bf16(edge, 0), gated(edge[:, :16], edge[:, 16:], "silu"), 1.0)
    qkv = torch.randn(37, 15 * 64).to(bf)
    q, k = qkv[:, :576].view(37, 9, 64), qkv[:, 576:768].view(37, 3, 64)  # views, rows 960 values apart
    for r in (64, 48, 32):  # whole heads, and partial rotary
        angle = torch.randn(37, 1, r // 2)
        cos, sin = (torch.cat([f(angle), f(angle)], -1).to(bf) for f in (torch.cos, torch.sin))
        monkeypatch.setattr(cpu_kernels, "CHUNK_OPS", False)
        want = rotary.apply_rotary(q, k, cos, sin)
        monkeypatch.setattr(cpu_kernels, "CHUNK_OPS", True)
        got = rotary.apply_rotary(q, k, cos, sin)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and got[0].is_contiguous()
    with pytest.raises(RuntimeError, match="multiple of 16"):
        module.glu_bf16(torch.zeros(2, 40, dtype=bf), 0)


@pytest.mark.skipif(cpu_kernels.load() is None, reason="the CPU kernels did not build")
def test_bfloat16_prompts_through_the_prompt_kernel_track_transformers(tiny_models, monkeypatch):
    """bfloat16 prompt rows (whole prompts and chunks after a cached prefix) take the kernel by default, and
    greedy tokens track transformers' float32 choices teacher-forced as test_reference's dense models do
    (bf16 rounding ~0.01 nats a token; a wrong attention, ~1)."""
    from conftest import PROMPTS, teacher_forced_gaps
    from tokenmill import LLM, SamplingParams
    from tokenmill.attention import cpu as cpu_attention

    if not cpu_attention.PROMPT_KERNEL:
        pytest.skip("TOKENMILL_PROMPT_ATTENTION=torch")
    module, calls = cpu_kernels.load(), []
    attend = module.prefill_attention
    monkeypatch.setattr(module, "prefill_attention", lambda q, k, v, *a: calls.append(k.shape[0] - q.shape[0])
                        or attend(q, k, v, *a), raising=False)
    folder = tiny_models["llama"]
    llm = LLM(folder, dtype="bfloat16", seed=0, max_num_batched_tokens=16, long_prefill_token_threshold=8)
    prompts = [llm.get_tokenizer().encode(p) for p in PROMPTS]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, min_tokens=8), use_tqdm=False)
    assert calls and max(calls) > 0  # chunks after a prefix in the cache, as well as first chunks
    gaps = teacher_forced_gaps(folder, prompts, outs)
    assert sum(gaps) / len(gaps) < 0.03 and max(gaps) < 1.0, (sum(gaps) / len(gaps), max(gaps))
