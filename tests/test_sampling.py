"""The sampler draws from the distribution its parameters define; seeds, stops and penalties behave."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tests.conftest import PROMPTS
from tokenmill import LLM, SamplingParams
from tokenmill.engine.request import Request
from tokenmill.kernels import cpu as cpu_kernels
from tokenmill.sample.sampler import Sampler, _nucleus_sorted, apply_penalties, filter_logits

LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
N = 20000


@pytest.fixture(params=["kernel", "torch"])
def sampler_path(request, monkeypatch):
    """The sampler's two ways of drawing on the CPU: the kernel (sample_rows) and torch's operations."""
    if request.param == "kernel":
        if cpu_kernels.load() is None:
            pytest.skip("no CPU kernels on this machine")
        monkeypatch.setattr(cpu_kernels, "SAMPLE_KERNEL", True)
    else:
        monkeypatch.setattr(cpu_kernels, "SAMPLE_KERNEL", False)
    return request.param


def expected(logits: np.ndarray, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> np.ndarray:
    """The target distribution written out from the definitions, independently of the sampler."""
    z = logits / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    keep = np.ones_like(p, dtype=bool)
    if top_k:
        keep[order[top_k:]] = False
    q = np.where(keep, p, 0)
    q /= q.sum()
    cum = 0.0
    for idx in order:  # nucleus: keep tokens until the ones before reach top_p
        if keep[idx] and cum >= top_p:
            keep[idx] = False
        cum += q[idx] if keep[idx] else 0.0
    q = np.where(keep, p, 0)
    q /= q.sum()
    if min_p:
        keep &= q >= min_p * q.max()
        q = np.where(keep, p, 0)
        q /= q.sum()
    return q


def draw(params: SamplingParams, n: int = N) -> np.ndarray:
    sampler = Sampler(len(LOGITS), seed=1234)
    reqs = [Request(str(i), [0], params, 16) for i in range(n)]
    tokens, _ = sampler(LOGITS.repeat(n, 1), reqs)
    return np.bincount(tokens, minlength=len(LOGITS)) / n


@pytest.mark.parametrize("kwargs", [
    {"temperature": 1.0},
    {"temperature": 0.5},
    {"temperature": 2.0},
    {"temperature": 1.0, "top_k": 3},
    {"temperature": 1.0, "top_p": 0.8},
    {"temperature": 0.7, "top_p": 0.5, "top_k": 5},
    {"temperature": 1.0, "min_p": 0.2},
])
def test_sampling_distribution(kwargs, sampler_path):
    observed = draw(SamplingParams(**kwargs))
    target = expected(LOGITS.numpy().astype(np.float64), **kwargs)
    # Tokens outside the allowed set must never appear; the rest within sampling noise.
    assert np.all(observed[target == 0] == 0)
    # Chi-square statistic against the target over allowed tokens; 99.9% quantile bound for <= 7 dof is 24.3.
    allowed = target > 0
    chi2 = N * np.sum((observed[allowed] - target[allowed]) ** 2 / target[allowed])
    assert chi2 < 24.3, (observed, target)


@pytest.mark.parametrize("scale", [0.5, 3.0, 8.0])  # nucleus: most of the vocabulary, ~1,000 tokens, a few
@pytest.mark.parametrize("top_k,top_p", [(0, 0.9), (0, 0.5), (50, 1.0), (50, 0.8), (3000, 0.95)])
@pytest.mark.parametrize("by_rows", [True, False], ids=["ranking-rows", "sorting-all"])
def test_filter_keeps_the_nucleus_over_a_large_vocabulary(scale, top_k, top_p, by_rows):
    """filter_logits on the CPU ranks only each row's highest logits, ranking more while the nucleus goes
    on (and sorting the whole row where it spans much of it); on other devices it sorts all rows at once.
    Either keeps the tokens the definition keeps (numpy, float64), their logits unchanged, except at
    most a token or two whose probability ranked above them lies within float32 rounding of top_p."""
    g = torch.Generator().manual_seed(int(scale * 10) + top_k)
    logits = torch.randn(2, 20000, generator=g) * scale
    if by_rows:
        out = filter_logits(logits, [top_k] * 2, [top_p] * 2, [0.0] * 2)
    else:
        out = _nucleus_sorted(logits, [top_k] * 2, [top_p] * 2)
    for row, o in zip(logits, out):
        kept = torch.isfinite(o)
        assert torch.equal(o[kept], row[kept])
        z = row.double().numpy()
        want = expected(z, top_k=top_k, top_p=top_p) > 0
        order = np.argsort(-z, kind="stable")
        p = np.exp(z - z.max())
        if top_k:
            p[order[top_k:]] = 0
        p /= p.sum()
        before = np.empty_like(p)
        before[order] = np.cumsum(p[order]) - p[order]
        differ = kept.numpy() != want
        assert differ.sum() <= 2 and np.all(np.abs(before[differ] - top_p) < 1e-4), (differ.sum(), want.sum())


def test_greedy_is_argmax(sampler_path):
    observed = draw(SamplingParams(temperature=0), n=50)
    assert observed[0] == 1.0


def test_seed_reproducible_across_batch_companions(tiny_models):
    llm = LLM(tiny_models["llama"], dtype="float32")
    seeded = SamplingParams(temperature=1.0, seed=42, max_tokens=24, ignore_eos=True)
    alone = llm.generate([PROMPTS[0]], seeded)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True)
    mixed = llm.generate(PROMPTS[1:5] + [PROMPTS[0]] + PROMPTS[5:], [others] * 4 + [seeded] + [others] * 3)
    assert mixed[4].outputs[0].token_ids == alone
    different = llm.generate([PROMPTS[0]], seeded.clone(seed=43))[0].outputs[0].token_ids
    assert different != alone  # a different seed changes the draw (24 tokens at temperature 1)


def test_n_completions_differ_and_are_reproducible(tiny_models):
    llm = LLM(tiny_models["llama"], dtype="float32")
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=16, ignore_eos=True)
    a = llm.generate(PROMPTS[2], params)[0]
    b = llm.generate(PROMPTS[2], params)[0]
    assert [o.index for o in a.outputs] == [0, 1, 2]
    assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    assert len({tuple(o.token_ids) for o in a.outputs}) > 1


def test_stop_string_spanning_tokens(tiny_models):
    llm = LLM(tiny_models["llama"], dtype="float32")
    tok = llm.get_tokenizer()
    base = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=32, min_tokens=32))[0].outputs[0]
    # Find a stop string made of the end of one token and the start of the next.
    pieces = [tok.decode(base.token_ids[:i]) for i in range(len(base.token_ids) + 1)]
    for i in range(4, len(base.token_ids) - 1):
        a, b = pieces[i], pieces[i + 1]
        if len(b) - len(a) >= 2 and len(a) - len(pieces[i - 1]) >= 2:
            stop = a[-1] + b[len(a)]
            if stop not in a[:-1]:
                break
    else:
        pytest.skip("no two adjacent multi-character tokens in this output")
    out = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=32, min_tokens=0, stop=[stop]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == a[:-1]
    kept = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=32, stop=[stop],
                                                   include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == a[:-1] + stop


def test_stop_token_ids_and_max_tokens(tiny_models):
    llm = LLM(tiny_models["llama"], dtype="float32")
    base = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].outputs[0]
    assert base.finish_reason == "length" and len(base.token_ids) == 12
    target = base.token_ids[5]
    first = base.token_ids.index(target)
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[target]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == target
    assert out.token_ids == base.token_ids[:first + 1]


def test_penalties_hand_computed():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]])
    params = SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    req = Request("r", [1], params, 8)
    req.output_token_ids = [3, 3, 2]
    apply_penalties(logits, [req], 5)
    # token 0: unseen -> 2.0; token 1: in prompt, negative -> -1*2 = -2.0
    # token 2: output once -> 0.5/2 - 0.25*1 - 0.5 = -0.5; token 3: output twice -> 3/2 - 0.25*2 - 0.5 = 0.5
    # token 4: unseen -> -2.0
    assert torch.allclose(logits, torch.tensor([[2.0, -2.0, -0.5, 0.5, -2.0]]))


def test_overflowing_logits_still_draw_a_token_of_the_vocabulary(tiny_models, sampler_path):
    """A repetition penalty just above 0 (or a tiny temperature) overflows the penalised logits to inf, and
    the softmax of a row holding inf is NaN: the draw must still give a token of the vocabulary, the one at
    inf where there is one, and a row with nothing to draw from its greedy choice."""
    sampler = Sampler(5, seed=0)
    reqs = [Request(f"r{i}", [0], SamplingParams(temperature=1.0, seed=i), 8) for i in range(3)]
    logits = torch.tensor([[1.0, float("inf"), 0.0, -1.0, 2.0],
                           [float("nan")] * 5,
                           [float("-inf"), float("-inf"), 3.0, float("inf"), float("inf")]])
    tokens, _ = sampler(logits, reqs)
    assert tokens[0] == 1 and 0 <= tokens[1] < 5 and tokens[2] in (3, 4)
    llm = LLM(tiny_models["llama"], dtype="float32")
    vocab = llm.engine.vocab_size
    prompt = PROMPTS[0]
    for params in (SamplingParams(repetition_penalty=5e-324, seed=0, max_tokens=6, ignore_eos=True),
                   SamplingParams(repetition_penalty=5e-324, temperature=0.5, top_p=0.9, seed=1, max_tokens=6,
                                  ignore_eos=True)):
        out = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
        assert len(out.token_ids) == 6 and all(0 <= t < vocab for t in out.token_ids)


def test_logit_bias_forces_token(tiny_models):
    llm = LLM(tiny_models["llama"], dtype="float32")
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True,
                                                  logit_bias={17: 100.0}))[0].outputs[0]
    assert out.token_ids == [17] * 5


def test_logprobs_are_normalised_and_ranked(tiny_models):
    llm = LLM(tiny_models["qwen2"], dtype="float32")
    out = llm.generate(PROMPTS[3], SamplingParams(temperature=0, max_tokens=4, logprobs=3, prompt_logprobs=2))[0]
    for step, tok in zip(out.outputs[0].logprobs, out.outputs[0].token_ids):
        assert step[tok].rank == 1  # greedy picks the top token
        assert all(lp.logprob <= 0 for lp in step.values())
        assert sorted(lp.rank for lp in step.values())[:3] == [1, 2, 3]
    total = sum(step[t].logprob for step, t in zip(out.outputs[0].logprobs, out.outputs[0].token_ids))
    assert math.isclose(out.outputs[0].cumulative_logprob, total, rel_tol=1e-6)
    assert out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == len(out.prompt_token_ids)
    for pos, d in enumerate(out.prompt_logprobs[1:], start=1):
        assert out.prompt_token_ids[pos] in d


def test_each_logprob_is_decoded_once_however_many_outputs_carry_it(tiny_models, monkeypatch):
    """A request read step by step gets an output per token, each with all its logprobs so far: their
    tokens' texts are decoded once, not again for every later output (a cost that grew with the length)."""
    from tokenmill.engine.output_processor import OutputProcessor

    llm = LLM(tiny_models["qwen2"], dtype="float32")
    looked_at = []
    decode = OutputProcessor._decode_logprobs
    monkeypatch.setattr(OutputProcessor, "_decode_logprobs", lambda self, d: looked_at.append(id(d)) or decode(self, d))
    engine = llm.engine
    engine.add_request("a", PROMPTS[3], SamplingParams(temperature=0, max_tokens=40, logprobs=2, prompt_logprobs=1,
                                                       ignore_eos=True))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.request_id == "a"]
    assert len(outputs) > 20  # read step by step
    final = outputs[-1]
    assert len(final.outputs[0].logprobs) == 40
    positions = 40 + len(final.prompt_logprobs) - 1  # (the first prompt position has none)
    assert len(looked_at) == len(set(looked_at)) == positions
    for out in outputs:  # every output's logprobs carry their texts
        for d in out.outputs[0].logprobs + out.prompt_logprobs[1:]:
            assert all(lp.decoded_token is not None for lp in d.values())


@pytest.mark.parametrize("kwargs,fragment", [
    ({"top_p": 1.5}, "top_p must be in (0, 1], got 1.5"),
    ({"temperature": -1}, "temperature"),
    ({"n": 0}, "n must be"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"top_k": -3}, "top_k"),
    ({"min_p": 2}, "min_p"),
    ({"logprobs": 50}, "logprobs"),
    ({"stop": [""]}, "stop"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
])
def test_invalid_params_rejected(kwargs, fragment):
    with pytest.raises(ValueError, match=None) as e:
        SamplingParams(**kwargs)
    assert fragment in str(e.value)


def _large_row(kind: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(5)
    row = torch.randn(20000, generator=g)
    lead = {"peaked": 30.0, "moderate": 12.0, "flat": 6.0}[kind]
    row[:10] = lead - 0.5 * torch.arange(10.0)  # ten leading tokens over a long tail
    return row


@pytest.mark.parametrize("kind,kwargs", [
    ("peaked", {"temperature": 0.5, "top_p": 0.9}),  # the tail's mass is negligible
    ("moderate", {"temperature": 1.0, "top_p": 0.9}),  # the tail's mass counts (one softmax gives it)
    ("flat", {"temperature": 1.0, "top_p": 0.9}),  # the nucleus reaches past the ranked tokens
    ("moderate", {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}),
    ("flat", {"temperature": 1.0, "min_p": 0.3}),
    ("flat", {"temperature": 1.5, "min_p": 0.001}),  # min-p keeps tokens past the ranked ones
])
def test_sampling_distribution_over_a_large_vocabulary(kind, kwargs, sampler_path):
    """Truncated sampling draws from the highest logits alone where it can; the draws follow the
    definition (numpy, float64) over a 20,000-token vocabulary: the ten leading tokens one by one, the
    rest of the kept set as one bin, and nothing outside it."""
    row = _large_row(kind)
    target = expected(row.double().numpy(), **kwargs)
    sampler = Sampler(row.shape[0], seed=99)
    n, chunk = 4000, 2000
    counts = np.zeros(row.shape[0])
    for c in range(n // chunk):
        reqs = [Request(f"{c}-{i}", [0], SamplingParams(**kwargs), 16) for i in range(chunk)]
        tokens, _ = sampler(row.repeat(chunk, 1), reqs)
        counts += np.bincount(tokens, minlength=row.shape[0])
    assert counts[target == 0].sum() == 0
    bins_obs = np.append(counts[:10], counts[10:].sum()) / n
    bins_exp = np.append(target[:10], target[10:].sum())
    nz = bins_exp > 0
    chi2 = n * np.sum((bins_obs[nz] - bins_exp[nz]) ** 2 / bins_exp[nz])
    assert chi2 < 31.3, (bins_obs, bins_exp)  # 99.9% quantile for 10 degrees of freedom (29.6 for 10, 31.3 for 11 bins)


@pytest.mark.parametrize("kwargs", [
    {"temperature": 0.8},
    {"temperature": 1.0, "top_p": 0.9},
    {"temperature": 0.7, "top_k": 40, "min_p": 0.02},
])
def test_the_kernel_draws_from_bfloat16_rows_with_masked_tokens(kwargs):
    """The kernel draws from the model's bfloat16 logits as they are: the definition's distribution over the
    values bfloat16 holds, ties (bfloat16 has many) included, and never a -inf or NaN token."""
    kernel = cpu_kernels.load()
    if kernel is None:
        pytest.skip("no CPU kernels on this machine")
    row = _large_row("moderate").to(torch.bfloat16)
    row[3], row[11], row[12] = float("-inf"), float("nan"), float("-inf")  # a leading token masked, two in the tail
    exact = row.double()
    exact[11] = float("-inf")  # a NaN logit counts as -inf
    target = expected(exact.numpy(), **kwargs)
    n = 20000
    p = SamplingParams(**kwargs)
    u = torch.rand(n, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    tokens = kernel.sample_rows(row.repeat(n, 1), torch.full((n,), p.temperature), torch.full((n,), p.top_k),
                                torch.full((n,), p.top_p), torch.full((n,), p.min_p), u)
    counts = np.bincount(tokens.numpy(), minlength=row.shape[0])
    assert counts[target == 0].sum() == 0 and counts[[3, 11, 12]].sum() == 0
    bins_obs = np.append(counts[:10], counts[10:].sum()) / n
    bins_exp = np.append(target[:10], target[10:].sum())
    nz = bins_exp > 0
    chi2 = n * np.sum((bins_obs[nz] - bins_exp[nz]) ** 2 / bins_exp[nz])
    assert chi2 < 29.6, (bins_obs, bins_exp)  # 99.9% quantile, 10 degrees of freedom (10 bins in use)
    # u alone picks the token: the same numbers give the same tokens.
    again = kernel.sample_rows(row.repeat(n, 1), torch.full((n,), p.temperature), torch.full((n,), p.top_k),
                               torch.full((n,), p.top_p), torch.full((n,), p.min_p), u)
    assert torch.equal(tokens, again)


def test_the_kernels_greedy_rows_and_empty_rows():
    """Temperature 0 is the argmax (the first of equal ones), and a row with no finite logit gives -1 (the
    sampler then takes its greedy choice) in the kernel; the sampler batches greedy and random rows."""
    kernel = cpu_kernels.load()
    if kernel is None:
        pytest.skip("no CPU kernels on this machine")
    rows = torch.tensor([[0.5, 3.0, 3.0, -1.0], [float("nan")] * 4, [float("-inf")] * 4, [1.0, 2.0, 0.0, 9.0]])
    out = kernel.sample_rows(rows, torch.tensor([0.0, 1.0, 1.0, 1e-4]), torch.zeros(4, dtype=torch.long),
                             torch.ones(4), torch.zeros(4), torch.full((4,), 0.5, dtype=torch.float64))
    assert out.tolist() == [1, -1, -1, 3]
    sampler = Sampler(4, seed=0)
    reqs = [Request("g", [0], SamplingParams(temperature=0), 8), Request("r", [0], SamplingParams(temperature=1.0), 8)]
    tokens, _ = sampler(torch.tensor([[0.0, 1.0, 5.0, 2.0], [float("-inf"), float("-inf"), 0.0, float("-inf")]]), reqs)
    assert tokens == [2, 2]
