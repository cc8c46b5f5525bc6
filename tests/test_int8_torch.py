"""quantization="int8" where tokenmill's CPU kernels do not run it (a GPU, or a CPU they could not be built
for): int8 weights with a scale per output channel through torch's weight-only int8 product
(kernels/int8.py). On a CPU the engine is made to believe its kernels failed to build; on a GPU the same
tests run the device's product."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import assert_channel_format_matches, reference_model
from tokenmill import LLM
from tokenmill.kernels import quant
from tokenmill.kernels.int8 import Int8Weight

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def fake_int8(w: torch.Tensor) -> torch.Tensor:
    """w rounded to int8 per row in float64, under a scale of at least max|row| / 127 (Int8Weight's scales are
    that, moved up to a bfloat16 value: taken from the weights themselves, see below)."""
    q = Int8Weight.quantize(w)
    s = q.scales.double().unsqueeze(-1)
    assert (s * 127 >= w.double().abs().amax(-1, keepdim=True)).all()
    return (w.double() / s).round().clamp(-127, 127) * s


def test_weights_within_half_a_step_and_scales_held_by_bfloat16():
    w = torch.randn(48, 96) * torch.logspace(-3, 2, 48).unsqueeze(1)  # rows of very different scales
    w[7] = 0
    q = Int8Weight.quantize(w)
    assert q.codes.dtype == torch.int8 and q.shape == (48, 96) and q.nbytes == 48 * 96 + 48 * 4
    s = q.scales.double()
    # at or just above max|row| / 127: within one bfloat16 step (2^-7 relative) of it, never below
    exact = w.double().abs().amax(1) / 127
    rows = torch.arange(48) != 7
    assert (s[rows] >= exact[rows]).all() and (s[rows] <= exact[rows] * (1 + 2 ** -7)).all()
    assert torch.equal(q.scales.to(torch.bfloat16).float(), q.scales)
    back = q.dequantize().double()
    assert ((back - w.double()).abs() <= s.unsqueeze(1) / 2 + 1e-12).all()
    assert (back[7] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_product_is_the_product_of_the_dequantized_weights(dtype, rows):
    """x @ W^T as the float64 product of x and the codes times their scales: within float32's rounding, or
    bfloat16's (2^-8 of the outputs' size); the dequantizing fallback (a device without the op) as well."""
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(80, 128, generator=g)
    x = torch.randn(rows, 128, generator=g).to(dtype)
    q = Int8Weight.quantize(w.to(DEVICE))
    want = x.double() @ q.dequantize().double().cpu().t()

    def check(y):
        assert y.dtype == dtype and y.shape == (rows, 80)
        if dtype == torch.float32:
            torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-5)
        else:
            assert (y.double() - want).norm() / want.norm() < 2 ** -8

    y = q.matmul(x.to(DEVICE)).cpu()
    check(y)
    q._product = False
    check(q.matmul(x.to(DEVICE)).cpu())
    exact = x.double() @ w.double().t()
    assert (y.double() - exact).norm() / exact.norm() < 0.02


@pytest.fixture
def torch_int8(monkeypatch):
    """On a CPU: the engine as where its quantized-weight kernels could not be built."""
    if DEVICE == "cpu":
        monkeypatch.setattr(quant, "load", lambda: None)


def _int8_reference(folder: str):
    """transformers' float32 model with every linear projection but the output layer (and mixture-of-experts
    experts and routers) rounded as Int8Weight rounds it; activations stay float."""
    model = reference_model(folder)
    with torch.no_grad():
        for name, m in model.named_modules():
            if isinstance(m, torch.nn.Linear) and name != "lm_head" and not name.endswith((".gate", ".router")) \
                    and ".experts." not in name:
                m.weight.copy_(fake_int8(m.weight).float())
    return model


@pytest.mark.parametrize("arch", ["llama", "qwen2", "phi3", "gemma2", "mixtral"])
def test_int8_through_torch_matches_transformers_in_int8(tiny_models, arch, torch_int8):
    """The layers hold Int8Weight (q, k, v merged; Phi-3's stored merged), the embedding, output layer and
    experts stay float; prompt logprobs match transformers on the same rounded weights, and greedy tokens
    match it."""
    llm = LLM(tiny_models[arch], dtype="float32", quantization="int8", device=DEVICE, kv_cache_memory="16MiB")
    assert_channel_format_matches(llm, _int8_reference(tiny_models[arch]).to(DEVICE), Int8Weight, arch, DEVICE, 1e-4)


def test_int8_through_torch_halves_the_projections(tiny_models, torch_int8):
    from tokenmill.model.loader import weight_bytes

    def projection_bytes(llm):
        return weight_bytes(llm.engine.model) - sum(
            p.numel() * p.element_size() for n, p in llm.engine.model.named_parameters()
            if "embed" in n or "lm_head" in n or "norm" in n)

    base = LLM(tiny_models["llama"], dtype="bfloat16", device=DEVICE, kv_cache_memory="16MiB")
    int8 = LLM(tiny_models["llama"], dtype="bfloat16", quantization="int8", device=DEVICE, kv_cache_memory="16MiB")
    assert projection_bytes(int8) < 0.55 * projection_bytes(base)


def test_int4_without_the_kernels_is_still_refused(tiny_models, monkeypatch):
    monkeypatch.setattr(quant, "load", lambda: None)
    with pytest.raises(ValueError, match="needs the quantized-weight kernels"):
        LLM(tiny_models["llama"], dtype="float32", quantization="int4", kv_cache_memory="16MiB")
