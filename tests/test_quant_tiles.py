"""Weight rows interleaved by 16 (kernels/quant_tiles.h): the same values as the file's blocks, products
against a float64 reference, and results that do not depend on the schedule."""

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from tokenmill.kernels import quant  # noqa: E402
from tests.test_quant_kernels import kernels, quantized_activation, random_blocks  # noqa: E402,F401

T = gguf.GGMLQuantizationType
TILE_TYPES = [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K, T.Q6_K, T.Q2_K, T.Q3_K, T.IQ4_XS, T.IQ4_NL]
K_TYPES = (T.Q4_K, T.Q5_K, T.Q6_K, T.Q2_K, T.Q3_K, T.IQ4_XS)


def shapes(qtype) -> list[tuple[int, int]]:
    """(rows, row length): rows of 1, 18, 35 and 48 blocks; 1, 2 and 8 super-blocks for the K formats."""
    return [(16, 256), (48, 512), (32, 2048)] if qtype in K_TYPES else [(16, 32), (48, 576), (32, 1120), (64, 1536)]


def width(qtype, k: int) -> int:
    """A row length like k that the format's blocks divide (the K formats' super-blocks are 256)."""
    return (k + 255) // 256 * 256 if qtype in K_TYPES else k


def tiled(kernels, qtype, data: np.ndarray, k: int) -> torch.Tensor:
    """The tiled bytes of GGUF blocks, repacked by `kernels` (either build: the layout is the same)."""
    return kernels.repack(torch.from_numpy(data), int(qtype) | quant.TILED, k)


@pytest.mark.parametrize("qtype", TILE_TYPES, ids=lambda t: t.name)
def test_tiles_hold_the_file_s_values(kernels, qtype):
    """Every row read back out of its tile (the embedding lookup, the prompt path's dequantized rows) is the
    gguf package's dequantization of the file's blocks, exactly; the tiles take the file's bytes."""
    rng = np.random.default_rng(int(qtype))
    for n, k in shapes(qtype):
        data = random_blocks(qtype, n, k, rng)
        w = tiled(kernels, qtype, data, k)
        assert w.shape == data.shape
        want = gguf.quants.dequantize(data, qtype).reshape(n, k)
        np.testing.assert_array_equal(kernels.dequantize(w, int(qtype) | quant.TILED, k, torch.empty(0)).numpy(), want)
        ids = torch.tensor([n - 1, 0, 17 % n, n // 2])
        np.testing.assert_array_equal(kernels.dequantize(w, int(qtype) | quant.TILED, k, ids).numpy(),
                                      want[ids.numpy()])


@pytest.mark.parametrize("qtype", TILE_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("batch", [1, 2, 3, 4, 5, 9, 64])
def test_tiled_products_match_float64(kernels, qtype, batch):
    """Below float_rows: int8 inputs and the tile kernel (vectorized, or its portable reference in the
    portable build), against the exact float64 product of the inputs as the kernel rounds them; from
    float_rows on, the rows dequantized out of their tiles times the float inputs."""
    rng = np.random.default_rng(batch * 10 + int(qtype))
    int8_inputs = batch < kernels.float_rows()
    for n, k in shapes(qtype):
        data = random_blocks(qtype, n, k, rng)
        w64 = gguf.quants.dequantize(data, qtype).reshape(n, k).astype(np.float64)
        x = rng.standard_normal((batch, k)).astype(np.float32)
        x[0, :32] = 0  # an all-zero activation block
        got = kernels.qmatmul(torch.from_numpy(x), tiled(kernels, qtype, data, k), int(qtype) | quant.TILED, k).numpy()
        xk = quantized_activation(x, qtype) if int8_inputs else x.astype(np.float64)
        scale = np.abs(xk) @ np.abs(w64).T + 1e-30
        assert np.max(np.abs(got - xk @ w64.T) / scale) < 2e-5, (n, k)


@pytest.mark.parametrize("qtype", TILE_TYPES, ids=lambda t: t.name)
def test_a_tiled_row_s_product_does_not_depend_on_the_schedule(kernels, qtype):
    """A weight row's product is the same bits whether its input row comes alone or with others (a decode
    step against a verify step or a batch), on one thread or two (another split of the tiles), and wherever
    its tile lies in the matrix."""
    rng = np.random.default_rng(int(qtype) + 3)
    k = width(qtype, 640)
    data = random_blocks(qtype, 64, k, rng)
    w = tiled(kernels, qtype, data, k)
    typ = int(qtype) | quant.TILED
    rows = min(6, kernels.float_rows() - 1)
    x = torch.from_numpy(rng.standard_normal((rows, k)).astype(np.float32))
    alone = torch.cat([kernels.qmatmul(x[i:i + 1], w, typ, k) for i in range(rows)])
    for m in range(2, rows + 1):
        assert torch.equal(kernels.qmatmul(x[:m], w, typ, k), alone[:m]), m
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(kernels.qmatmul(x, w, typ, k), alone)
    finally:
        torch.set_num_threads(threads)
    one_tile = kernels.qmatmul(x, tiled(kernels, qtype, np.ascontiguousarray(data[32:48]), k), typ, k)
    assert torch.equal(one_tile, alone[:, 32:48])


def test_tiled_and_row_layouts_agree(kernels):
    """The two layouts sum the same products in different orders: equal to float rounding."""
    rng = np.random.default_rng(5)
    for qtype in TILE_TYPES:
        k = width(qtype, 576)
        data = random_blocks(qtype, 48, k, rng)
        x = torch.from_numpy(rng.standard_normal((3, k)).astype(np.float32))
        rows = kernels.qmatmul(x, kernels.repack(torch.from_numpy(data), int(qtype), k), int(qtype), k)
        tiles = kernels.qmatmul(x, tiled(kernels, qtype, data, k), int(qtype) | quant.TILED, k)
        torch.testing.assert_close(tiles, rows, rtol=1e-5, atol=1e-5 * float(rows.abs().max()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_prompt_rows_meet_the_same_dequantized_weights(kernels, dtype):
    """A prompt's rows multiply the weights dequantized to their dtype, out of tiles as out of rows: the
    gguf package's values (rounded to bfloat16 for bfloat16 inputs), bit for bit, read back through one-hot
    input rows (bfloat16 tiles take the pair products of kernels/quant_pairs.h where the CPU has AVX-512
    BF16, the rest a dequantized copy and torch's GEMM)."""
    rng = np.random.default_rng(9)
    for qtype in TILE_TYPES:
        k = width(qtype, 640)
        data = random_blocks(qtype, 48, k, rng)
        want = torch.from_numpy(gguf.quants.dequantize(data, qtype).reshape(48, k)).to(dtype).t()
        eye = torch.eye(k, dtype=dtype)
        for layout in (int(qtype), int(qtype) | quant.TILED):
            w = kernels.repack(torch.from_numpy(data), layout, k)
            assert torch.equal(kernels.qmatmul(eye, w, layout, k, float_inputs=True), want), (qtype.name, layout)


@pytest.mark.parametrize("qtype", TILE_TYPES, ids=lambda t: t.name)
def test_bfloat16_prompt_rows_match_float64(kernels, qtype):
    """bfloat16 prompt rows through tiles, 1 to 40 of them (passes of 12 rows and what is left; a matrix of
    one tile, of three, of four): within the output's bfloat16 rounding and float32 sums of the exact
    float64 product of the same bfloat16 inputs and weights."""
    rng = np.random.default_rng(int(qtype) + 11)
    for n, k in shapes(qtype):
        data = random_blocks(qtype, n, k, rng)
        w = torch.from_numpy(gguf.quants.dequantize(data, qtype).reshape(n, k)).bfloat16().double()
        wt = tiled(kernels, qtype, data, k)
        for batch in (1, 5, 12, 13, 40):
            x = torch.from_numpy(rng.standard_normal((batch, k)).astype(np.float32)).bfloat16()
            got = kernels.qmatmul(x, wt, int(qtype) | quant.TILED, k, float_inputs=True)
            assert got.dtype == torch.bfloat16
            want = x.double() @ w.t()
            bound = 2.0 ** -8 * want.abs() + 1e-5 * (x.double().abs() @ w.abs().t()) + 1e-30
            assert torch.all((got.double() - want).abs() <= bound), (n, k, batch)


@pytest.mark.parametrize("qtype", TILE_TYPES, ids=lambda t: t.name)
def test_a_prompt_row_s_product_does_not_depend_on_the_chunk(kernels, qtype):
    """A bfloat16 prompt row's product through tiles is the same bits whether the row comes alone or among
    others (another pass of rows, another place in it: a prompt split into other chunks, or partly held by
    the prefix cache), on one thread or two, and wherever its tile lies in the matrix."""
    rng = np.random.default_rng(int(qtype) + 5)
    k = width(qtype, 1120)
    data = random_blocks(qtype, 48, k, rng)
    w = tiled(kernels, qtype, data, k)
    typ = int(qtype) | quant.TILED
    x = torch.from_numpy(rng.standard_normal((30, k)).astype(np.float32)).bfloat16()
    whole = kernels.qmatmul(x, w, typ, k, float_inputs=True)
    for a, b in ((0, 1), (7, 8), (3, 17), (5, 30)):
        assert torch.equal(kernels.qmatmul(x[a:b], w, typ, k, float_inputs=True), whole[a:b]), (a, b)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(kernels.qmatmul(x, w, typ, k, float_inputs=True), whole)
    finally:
        torch.set_num_threads(threads)
    one_tile = kernels.qmatmul(x, tiled(kernels, qtype, np.ascontiguousarray(data[16:32]), k), typ, k, float_inputs=True)
    assert torch.equal(one_tile, whole[:, 16:32])


@pytest.mark.parametrize("qtype", TILE_TYPES + [T.MXFP4], ids=lambda t: t.name)
def test_bfloat16_prompt_rows_through_the_row_layout(kernels, qtype):
    """A matrix kept in rows (Q6_K on CPUs with AMX, a format without tiles, rows that are not whole tiles:
    40 here), rows longer than a part of k (2,048) and more input rows than a pass (256): bfloat16 prompt
    rows within the output's bfloat16 rounding and float32 sums of the float64 product. Where AMX's bfloat16
    tiles take them (their pairs built from the rows), also the bits of the same blocks in tiles, and the same
    bits whatever the chunk (elsewhere a dequantized copy and torch's GEMM, whose summation order is its own)."""
    rng = np.random.default_rng(int(qtype) + 17)
    k = width(qtype, 2336)
    for n in (48, 40):
        data = random_blocks(qtype, n, k, rng)
        w = torch.from_numpy(gguf.quants.dequantize(data, qtype).reshape(n, k)).bfloat16().double()
        rows = kernels.repack(torch.from_numpy(data), int(qtype), k)
        x = torch.from_numpy(rng.standard_normal((270, k)).astype(np.float32)).bfloat16()
        whole = kernels.qmatmul(x, rows, int(qtype), k, float_inputs=True)
        want = x.double() @ w.t()
        bound = 2.0 ** -8 * want.abs() + 1e-5 * (x.double().abs() @ w.abs().t()) + 1e-30
        assert torch.all((whole.double() - want).abs() <= bound), n
        if not kernels.amx_pairs:
            continue
        for a, b in ((0, 1), (3, 17), (16, 21), (250, 270)):
            assert torch.equal(kernels.qmatmul(x[a:b], rows, int(qtype), k, float_inputs=True), whole[a:b]), (n, a, b)
        if n % 16 == 0 and qtype != T.MXFP4:
            assert torch.equal(kernels.qmatmul(x, tiled(kernels, qtype, data, k), int(qtype) | quant.TILED, k,
                                               float_inputs=True), whole)


def test_which_matrices_are_tiled():
    """Whole tiles of a format with a tile kernel, where the CPU has VNNI; a
    stacked expert tensor only where each expert's rows are whole tiles; none after set_tiles(False)."""
    m = quant.load()
    if m is None:
        pytest.skip("the quantized-weight kernels could not be built here")
    rng = np.random.default_rng(1)
    data = random_blocks(T.Q8_0, 48, 64, rng)
    expect = bool(m.vnni)
    assert quant.QuantizedWeight.from_blocks(8, (48, 64), torch.from_numpy(data)).tiled == expect
    assert not quant.QuantizedWeight.from_blocks(8, (40, 64), torch.from_numpy(data[:40])).tiled
    assert not quant.QuantizedWeight.from_blocks(8, (48, 64), torch.from_numpy(data), tile_rows=24).tiled
    assert quant.QuantizedWeight.from_blocks(8, (48, 64), torch.from_numpy(data), tile_rows=16).tiled == expect
    for qtype in (T.Q5_K, T.Q6_K, T.Q2_K, T.Q3_K, T.IQ4_XS, T.IQ4_NL):
        blocks = random_blocks(qtype, 16, 256, rng)
        assert quant.QuantizedWeight.from_blocks(int(qtype), (16, 256), torch.from_numpy(blocks)).tiled == expect
    mx = random_blocks(T.MXFP4, 16, 256, rng)  # (no tile kernel)
    assert not quant.QuantizedWeight.from_blocks(39, (16, 256), torch.from_numpy(mx)).tiled
    quant.set_tiles(False)
    try:
        assert not quant.QuantizedWeight.from_blocks(8, (48, 64), torch.from_numpy(data)).tiled
    finally:
        quant.set_tiles(True)
    with pytest.raises(ValueError, match="interleaved by 16"):
        quant.QuantizedWeight(8 | quant.TILED, (40, 64), torch.zeros(40, 68, dtype=torch.uint8))
    with pytest.raises(ValueError, match="no kernel"):
        quant.QuantizedWeight(39 | quant.TILED, (16, 256), torch.zeros(16, 136, dtype=torch.uint8))
