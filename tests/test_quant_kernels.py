"""The quantized-weight kernels against the gguf package's dequantization and a float64 matmul."""

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from tokenmill.kernels import quant  # noqa: E402

T = gguf.GGMLQuantizationType
TYPES = [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_NL, T.IQ4_XS, T.MXFP4]
PER256 = (T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_XS)  # the formats whose rows take inputs rounded per 256


@pytest.fixture(scope="module", params=["native", "portable"])
def kernels(request):
    """The kernels built for this CPU, then the portable build (what CPUs without AVX-512 BW run)."""
    native = quant.load()
    if native is None:
        pytest.skip("the quantized-weight kernels could not be built here")
    if request.param == "native":
        yield native
        return
    portable = quant.build(portable=True)
    assert not portable.vectorized
    quant._module = portable
    try:
        yield portable
    finally:
        quant._module = native


def random_blocks(qtype, n: int, k: int, rng) -> np.ndarray:
    """[n, bytes per row] of valid blocks: quantized from random floats where gguf can quantize the type,
    else random bytes with the float16 scales set to moderate values (every bit pattern of the rest is a
    valid block)."""
    if qtype in (T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1):
        w = rng.standard_normal((n, k)).astype(np.float32) * 0.05 + rng.uniform(-0.02, 0.02, (n, 1)).astype(np.float32)
        return gguf.quants.quantize(w, qtype)
    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    data = rng.integers(0, 256, (n, k // block, nbytes), dtype=np.uint8)
    if qtype == T.MXFP4:  # the E8M0 scale byte: 2^-10 to 2^-4, and some of the smallest (subnormal halves)
        data[..., 0] = np.where(rng.random((n, k // block)) < 0.05, rng.integers(0, 2, (n, k // block)),
                                rng.integers(117, 124, (n, k // block)))
        return data.reshape(n, -1)
    halves = rng.uniform(1e-4, 2e-3, (n, k // block, 2)).astype(np.float16).view(np.uint8)
    if qtype in (T.Q6_K, T.Q3_K):  # d is the last 2 bytes
        data[..., -2:] = halves[..., 0:2]
    elif qtype == T.Q2_K:  # d, dmin are the last 4
        data[..., -4:] = halves.reshape(n, k // block, 4)
    elif qtype in (T.IQ4_NL, T.IQ4_XS):  # d leads the block
        data[..., 0:2] = halves[..., 0:2]
    else:  # d, dmin lead the block
        data[..., 0:4] = halves.reshape(n, k // block, 4)
    return data.reshape(n, -1)


def quantized_activation(x: np.ndarray, qtype=None) -> np.ndarray:
    """The activations the kernel multiplies: int8 blocks of 32, d = max|x| / 127, round to nearest even.
    Against the K formats' rows, max|x| is taken over each 256 values (one scale per super-block)."""
    group = 256 if qtype in PER256 and x.shape[1] % 256 == 0 else 32
    b = x.astype(np.float32).reshape(x.shape[0], -1, group)
    amax = np.abs(b).max(-1, keepdims=True)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    q = np.rint(b * inv)
    return (q.astype(np.float64) * (amax / np.float32(127)).astype(np.float32).astype(np.float64)).reshape(x.shape)


SHAPES = {  # (rows, row length): odd row counts, and rows of an odd number of blocks; for the 32-element
    # formats also whole tiles of 16 rows (stored interleaved where the CPU has AVX-512 VNNI: quant_tiles.h)
    32: [(1, 32), (13, 96), (67, 288), (5, 1120), (8, 2048), (16, 32), (48, 576), (32, 1120)],
    256: [(1, 256), (13, 768), (37, 512)],
}


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_dequantize_matches_gguf(kernels, qtype):
    rng = np.random.default_rng(int(qtype))
    block, _ = gguf.GGML_QUANT_SIZES[qtype]
    for n, k in SHAPES[block]:
        data = random_blocks(qtype, n, k, rng)
        w = quant.QuantizedWeight.from_blocks(int(qtype), (n, k), torch.from_numpy(data))
        want = gguf.quants.dequantize(data, qtype).reshape(n, k)
        np.testing.assert_array_equal(w.dequantize().numpy(), want)
        ids = torch.tensor([n - 1, 0, n // 2, n - 1])
        np.testing.assert_array_equal(w.dequantize(ids).numpy(), want[ids.numpy()])


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("batch", [1, 2, 3, 4, 5, 16, 17, 47, 48, 64])
def test_matmul_matches_float64(kernels, qtype, batch):
    """Below kernels.float_rows input rows the product quantizes them to int8 (the decode path); from it on
    it multiplies dequantized weights with the float inputs (the prompt path). Each against its own
    exact float64 product, and both against the float inputs."""
    rng = np.random.default_rng(batch * 100 + int(qtype))
    block, _ = gguf.GGML_QUANT_SIZES[qtype]
    int8_inputs = batch < kernels.float_rows()
    for n, k in SHAPES[block]:
        data = random_blocks(qtype, n, k, rng)
        w64 = gguf.quants.dequantize(data, qtype).reshape(n, k).astype(np.float64)
        x = rng.standard_normal((batch, k)).astype(np.float32)
        x[0, :32] = 0  # an all-zero activation block
        w = quant.QuantizedWeight.from_blocks(int(qtype), (n, k), torch.from_numpy(data))
        got = w.matmul(torch.from_numpy(x)).numpy()
        # Exactly what the kernel computes, up to float32 accumulation: tight.
        xk = quantized_activation(x, qtype) if int8_inputs else x.astype(np.float64)
        exact = xk @ w64.T
        scale = np.abs(xk) @ np.abs(w64).T + 1e-30
        assert np.max(np.abs(got - exact) / scale) < 2e-5, (n, k)
        # Against the float activations: the int8 rounding, about 1/254 of each block's largest value.
        plain = x.astype(np.float64) @ w64.T
        assert np.max(np.abs(got - plain) / scale) < (1e-2 if int8_inputs else 2e-5), (n, k)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_a_row_s_product_does_not_depend_on_the_rows_beside_it(kernels, qtype):
    """Below float_rows, each input row's products are summed in one order whether it comes alone or with
    others (a decode step of one request and a verify step of its positions compute the same bits). Rows of
    9, 20, 35 and 64 blocks: whole groups of 16 blocks, and a last group of 9, 4 or 3."""
    rng = np.random.default_rng(int(qtype) + 7)
    block, _ = gguf.GGML_QUANT_SIZES[qtype]
    rows = min(6, kernels.float_rows() - 1)
    for k in ((288, 640, 1120, 2048) if block == 32 else (512, 2048)):
        data = random_blocks(qtype, 19, k, rng)
        w = quant.QuantizedWeight.from_blocks(int(qtype), (19, k), torch.from_numpy(data))
        x = torch.from_numpy(rng.standard_normal((rows, k)).astype(np.float32))
        alone = torch.cat([w.matmul(x[i:i + 1]) for i in range(rows)])
        for m in range(2, rows + 1):
            assert torch.equal(w.matmul(x[:m]), alone[:m]), (k, m)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_a_weight_row_s_product_does_not_depend_on_the_weight_rows_beside_it(kernels, qtype):
    """Weight rows are multiplied two at a time where the kernel can (the pair shares the inputs' loads):
    each row's products are those of the row alone, whichever row it is paired with, or none. A thread's
    share of a matrix, which decides the pairs, then changes no bits."""
    rng = np.random.default_rng(int(qtype) + 11)
    block, _ = gguf.GGML_QUANT_SIZES[qtype]
    for k in ((288, 640, 1120) if block == 32 else (512, 768)):
        data = random_blocks(qtype, 11, k, rng)
        for m in sorted({1, 3, min(6, kernels.float_rows() - 1)}):
            x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32))
            whole = quant.QuantizedWeight.from_blocks(int(qtype), (11, k), torch.from_numpy(data)).matmul(x)
            for start in (1, 2):  # every row paired with another neighbour, the last alone or not
                part = quant.QuantizedWeight.from_blocks(int(qtype), (11 - start, k), torch.from_numpy(data[start:]))
                assert torch.equal(part.matmul(x), whole[:, start:]), (k, m, start)
            for i in (0, 5, 10):
                alone = quant.QuantizedWeight.from_blocks(int(qtype), (1, k), torch.from_numpy(data[i:i + 1]))
                assert torch.equal(alone.matmul(x)[:, 0], whole[:, i]), (k, m, i)


def test_bfloat16_rows_below_the_float_path_take_int8_inputs(kernels):
    """bfloat16 inputs just below float_rows(bfloat16=True) rows (on AMX's int8 tiles where the CPU has them,
    from 16 rows) give the exact product of their int8-rounded values, as float32 inputs do."""
    rng = np.random.default_rng(11)
    rows = kernels.float_rows(bfloat16=True) - 1
    for qtype in TYPES:
        block, _ = gguf.GGML_QUANT_SIZES[qtype]
        n, k = 37, 2 * block
        data = random_blocks(qtype, n, k, rng)
        w = quant.QuantizedWeight.from_blocks(int(qtype), (n, k), torch.from_numpy(data))
        x = torch.from_numpy(rng.standard_normal((rows, k)).astype(np.float32)).to(torch.bfloat16)
        got = w.matmul(x).double().numpy()
        xk = quantized_activation(x.float().numpy(), qtype)
        w64 = gguf.quants.dequantize(data, qtype).reshape(n, k).astype(np.float64)
        exact = xk @ w64.T
        scale = np.abs(xk) @ np.abs(w64).T + 1e-30
        # Within the output's bfloat16 rounding of the exact product (float32 sums aside); the float inputs'
        # product lies further off, by the int8 rounding of the inputs.
        assert np.all(np.abs(got - exact) <= 2.0 ** -8 * np.abs(exact) + 2e-5 * scale), qtype


def test_prompt_path_keeps_float_inputs(kernels):
    """The first rows of a long chunk come out as they would alone through the float path, and differ
    from the int8 path's by its rounding: the two paths really are different. Rows of 2048 and 2100 weight
    rows take two dequantized tiles."""
    kernels.set_float_rows(48)
    try:
        rng = np.random.default_rng(9)
        for qtype, n, k in ((T.Q4_K, 300, 512), (T.Q4_0, 2100, 2048)):
            data = random_blocks(qtype, n, k, rng)
            w = quant.QuantizedWeight.from_blocks(int(qtype), (n, k), torch.from_numpy(data))
            x = torch.randn(48, k)
            want = x.double() @ w.dequantize().double().T
            long = w.matmul(x).double()
            short = w.matmul(x[:4]).double()
            torch.testing.assert_close(long, want, rtol=1e-4, atol=1e-4)  # float32 sums over K
            assert (short - want[:4]).abs().max() > 100 * (long[:4] - want[:4]).abs().max()
    finally:
        kernels.set_float_rows(0)


def test_bfloat16_activations(kernels):
    rng = np.random.default_rng(5)
    data = random_blocks(T.Q4_K, 16, 512, rng)
    w = quant.QuantizedWeight.from_blocks(int(T.Q4_K), (16, 512), torch.from_numpy(data))
    x = torch.randn(3, 512).to(torch.bfloat16)
    got = w.matmul(x)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), w.matmul(x.float()), rtol=1e-2, atol=1e-2)


def test_bfloat16_prompt_rows_meet_bfloat16_weights(kernels):
    """From float_rows input rows on, bfloat16 inputs are multiplied with the weights dequantized to
    bfloat16 by torch's bfloat16 GEMM: the numbers of the same file dequantized at load into a bfloat16
    model (quantization="none"), not those of float32 weights."""
    rng = np.random.default_rng(6)
    gen = torch.Generator().manual_seed(6)
    cases = [(qtype, 96, k) for qtype in TYPES for _, k in SHAPES[gguf.GGML_QUANT_SIZES[qtype][0]]]
    for qtype, n, k in cases + [(T.Q8_0, 2100, 2048)]:  # (two weight tiles)
        data = random_blocks(qtype, n, k, rng)
        w = quant.QuantizedWeight.from_blocks(int(qtype), (n, k), torch.from_numpy(data))
        x = torch.randn(kernels.float_rows(bfloat16=True) + 16, k, generator=gen).to(torch.bfloat16)
        got = w.matmul(x)
        assert got.dtype == torch.bfloat16
        w16 = w.dequantize().to(torch.bfloat16)
        # The same bits but for a rare last-bit difference: a GEMM's blocking of a weight tile can order a
        # column's sums differently from one over the whole matrix.
        assert (got != torch.nn.functional.linear(x, w16)).float().mean() < 1e-3, (qtype, n, k)
        if qtype != T.MXFP4:  # (whose values, a power of two times a 2-bit mantissa, bfloat16 holds exactly)
            float_weights = torch.nn.functional.linear(x.float(), w.dequantize()).to(torch.bfloat16)
            assert (got != float_weights).float().mean() > 0.05, (qtype, n, k)


def test_bad_shapes_name_the_tensor(kernels):
    data = torch.zeros(4, 18, dtype=torch.uint8)
    with pytest.raises(ValueError, match="blk.0.attn_q.weight.*Q4_0 blocks of 32"):
        quant.QuantizedWeight(2, (4, 40), data, name="blk.0.attn_q.weight")
    with pytest.raises(ValueError, match="blk.1.ffn_up.weight.*does not hold"):
        quant.QuantizedWeight(2, (4, 64), data, name="blk.1.ffn_up.weight")
    with pytest.raises(ValueError, match="token_embd.weight.*IQ2_XS has no kernel"):
        quant.QuantizedWeight(int(T.IQ2_XS), (4, 256), data, name="token_embd.weight")
