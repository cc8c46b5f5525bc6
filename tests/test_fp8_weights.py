"""quantization="fp8": e4m3 weights with a scale per output channel, multiplied by torch's FP8 product with
each activation row quantized likewise (kernels/fp8.py). Run here through torch's CPU product; on a GPU
with FP8 tensor cores the same code runs the hardware's."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import assert_channel_format_matches
from tokenmill import LLM
from tokenmill.kernels.fp8 import E4M3_MAX, Fp8Weight

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def fake_fp8(x: torch.Tensor) -> torch.Tensor:
    """x with each row rounded to e4m3 under a scale of its largest magnitude over 448, in float64."""
    s = x.double().abs().amax(-1, keepdim=True).clamp(min=1e-12) / E4M3_MAX
    return (x.double() / s).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).double() * s


def test_weights_keep_three_mantissa_bits_per_channel():
    """Each weight within half an e4m3 step of itself (relative 2^-4 for normal codes), each row's largest
    magnitude exact, a row of zeros zero."""
    w = torch.randn(48, 96) * torch.logspace(-3, 2, 48).unsqueeze(1)  # rows of very different scales
    w[7] = 0
    q = Fp8Weight.quantize(w)
    assert q.codes.dtype == torch.float8_e4m3fn and q.shape == (48, 96) and q.nbytes == 48 * 96 + 48 * 4
    back = q.dequantize().double()
    step = w.double().abs().amax(1, keepdim=True) / E4M3_MAX * 2 ** -9  # e4m3's subnormal step, per row
    assert ((back - w.double()).abs() <= w.double().abs() * 2 ** -4 + step).all()
    rows = torch.arange(48) != 7
    amax = w.abs().argmax(1)
    assert torch.allclose(back[rows, amax[rows]], w.double()[rows, amax[rows]], rtol=1e-6)
    assert (back[7] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_product_is_the_scaled_product_of_the_codes(dtype, rows):
    """x @ W^T as the float64 product of both sides' e4m3 values times their scales, within the output
    dtype's rounding; and within a few percent of the float product."""
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(80, 128, generator=g)
    x = torch.randn(rows, 128, generator=g).to(dtype)
    q = Fp8Weight.quantize(w.to(DEVICE))
    y = q.matmul(x.to(DEVICE)).cpu()
    assert y.dtype == dtype and y.shape == (rows, 80)
    want = fake_fp8(x) @ q.dequantize().double().cpu().t()
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(y.double(), want, rtol=tol, atol=tol)
    exact = x.double() @ w.double().t()
    assert (y.double() - exact).norm() / exact.norm() < 0.06


def _fp8_reference(folder: str):
    """transformers' float32 model with every linear projection but the output layer (and mixture-of-experts
    routers) computing in FP8 arithmetic: inputs and weights rounded to e4m3 under per-row scales."""
    from tests.conftest import reference_model

    model = reference_model(folder)
    with torch.no_grad():
        for name, m in model.named_modules():
            if isinstance(m, torch.nn.Linear) and name != "lm_head" and not name.endswith((".gate", ".router")):
                m.weight.copy_(fake_fp8(m.weight).float())
                m.register_forward_pre_hook(lambda _, args: (fake_fp8(args[0]).float(),))
    return model


@pytest.mark.parametrize("arch", ["llama", "qwen2", "phi3", "gemma2", "mixtral"])
def test_fp8_at_load_matches_transformers_in_fp8(tiny_models, arch):
    """The layers hold Fp8Weight (q, k, v merged; Phi-3's stored merged), the embedding, output layer and
    experts stay float, the fused CPU decode step stands aside; prompt logprobs match transformers doing
    the same FP8 arithmetic, and greedy tokens match it."""
    llm = LLM(tiny_models[arch], dtype="float32", quantization="fp8", device=DEVICE, kv_cache_memory="16MiB")
    assert_channel_format_matches(llm, _fp8_reference(tiny_models[arch]).to(DEVICE), Fp8Weight, arch, DEVICE, 2e-3)


def test_fp8_saves_the_bytes_of_the_projections(tiny_models):
    base = LLM(tiny_models["llama"], dtype="bfloat16", kv_cache_memory="16MiB")
    fp8 = LLM(tiny_models["llama"], dtype="bfloat16", quantization="fp8", kv_cache_memory="16MiB")
    from tokenmill.model.loader import weight_bytes

    def projection_bytes(llm):
        return weight_bytes(llm.engine.model) - sum(
            p.numel() * p.element_size() for n, p in llm.engine.model.named_parameters()
            if "embed" in n or "lm_head" in n or "norm" in n)

    assert projection_bytes(fp8) < 0.55 * projection_bytes(base)
    # No float copy of the projections was ever allocated: the CPU's weight buffer holds only what stays float.
    float_bytes = sum(p.numel() * p.element_size() for p in fp8.engine.model.parameters())
    assert fp8.engine.model.weight_arena.numel() < float_bytes + 4096 * len(list(fp8.engine.model.parameters()))


def test_fp8_on_a_quantized_file_is_refused(default_gguf):
    with pytest.raises(ValueError, match=r"already quantized .*quantization 'fp8' applies to float weights"):
        LLM(default_gguf, quantization="fp8")
