import warnings

import numpy as np
import pytest
import torch
from helpers import fp32_in_order, rel_error
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from ase_tcfp32 import EmulationWarning, TCLinear, TCPETCalculator, restore_linear_layers, swap_linear_layers, tc_linear
from ase_tcfp32.layers import MIN_EMULATED_K
from ase_tcfp32.models import load_pet

EMULATED = ["tf32x3", "fp16x3", "bf16x9"]
UNIT = 2.0**-24


def operands(m, k, n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)


@settings(max_examples=40, deadline=None)
@given(m=st.integers(0, 70), k=st.integers(1, 300), n=st.integers(1, 70), seed=st.integers(0, 2**16))
@pytest.mark.parametrize("precision", EMULATED)
def test_error_bound_holds_for_every_shape(precision, m, k, n, seed):
    """Elementwise bound |y - exact| <= (K + 4) 2^-22 sum_k |x||w| for any shape, M = 0 too."""
    x, w, b = operands(m, k, n, seed)
    y = tc_linear(x, w, b, precision)
    assert y.shape == (m, n)
    exact = x.double() @ w.double().T + b.double()
    scale = x.double().abs() @ w.double().abs().T + b.double().abs()
    assert torch.all((y.double() - exact).abs() <= (k + 4) * 2.0**-22 * scale)


@settings(max_examples=25, deadline=None)
@given(m=st.integers(16, 96), k=st.integers(MIN_EMULATED_K, 2048), n=st.integers(16, 96), seed=st.integers(0, 2**16))
def test_error_vs_fp64_is_fp32_level(m, k, n, seed):
    """TF32x3 and FP16x3 within 2x of FP32's own error (summed in order, the same on
    every machine), BF16x9 no worse (K >= 16, >= 256 outputs)."""
    x, w, _ = operands(m, k, n, seed)
    exact = x.double() @ w.double().T
    fp32 = rel_error(fp32_in_order(x, w), exact)
    assert rel_error(tc_linear(x, w, None, "tf32x3"), exact) <= 2 * fp32
    assert rel_error(tc_linear(x, w, None, "fp16x3"), exact) <= 2 * fp32
    assert rel_error(tc_linear(x, w, None, "bf16x9"), exact) <= fp32


def test_fp16x3_keeps_fp32_range_row_by_row():
    """Rows of x and w from 1e-30 to 1e30 (FP16 alone spans 6e-8 ... 65504): the per-row
    powers of two keep FP32-level error on every output."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 300, generator=g) * 10.0 ** torch.randint(-30, 30, (64, 1), generator=g)
    w = torch.randn(48, 300, generator=g) * 10.0 ** torch.randint(-8, 8, (48, 1), generator=g)
    exact = x.double() @ w.double().T
    y = tc_linear(x, w, None, "fp16x3")
    scale = x.double().abs() @ w.double().abs().T
    assert torch.all((y.double() - exact).abs() <= 304 * 2.0**-22 * scale)
    assert rel_error(y, exact) <= 2 * rel_error(fp32_in_order(x, w), exact)


def test_single_pass_tf32_is_tf32_accurate_only():
    x, w, _ = operands(64, 256, 64, 0)
    error = rel_error(tc_linear(x, w, None, "tf32"), x.double() @ w.double().T)
    assert 1e-5 < error < 2e-3


@pytest.mark.parametrize("precision", ["tf32", "tf32x3", "fp16x3", "bf16x9"])
def test_inf_and_nan_propagate_like_torch(precision):
    x, w, b = operands(6, 40, 5, 1)
    x[0, 3] = float("inf")
    x[1, 7] = -float("inf")
    x[2, 0] = float("nan")
    w[4, 3] = 0.0  # inf * 0 -> nan in column 4 of row 0
    x[3, 10] = float("inf")
    x[3, 11] = float("inf")
    w[:, 11] = -w[:, 10]  # inf - inf -> nan in row 3 wherever w[:, 10] != 0
    y, ref = tc_linear(x, w, b, precision), x @ w.T + b
    assert torch.equal(torch.isnan(y), torch.isnan(ref))
    assert torch.equal(torch.isinf(y), torch.isinf(ref))
    assert torch.equal(y[torch.isinf(ref)], ref[torch.isinf(ref)])


@pytest.mark.parametrize("precision", EMULATED)
def test_grad_input_uses_fp32_level_emulated_gemm(precision):
    x, w, b = operands(300, 128, 96, 2)
    g = torch.randn(300, 96, generator=torch.Generator().manual_seed(9))
    x.requires_grad_(True)
    (tc_linear(x, w, b, precision) * g).sum().backward()
    exact = g.double() @ w.double()
    assert rel_error(x.grad, exact) <= 2 * rel_error(fp32_in_order(g, w.T), exact)


def test_weight_and_bias_gradients_when_trainable():
    layer = TCLinear(40, 24, precision="tf32x3")
    ref = nn.Linear(40, 24)
    ref.load_state_dict(layer.state_dict())
    x = torch.randn(50, 40)
    layer(x).square().sum().backward()
    ref(x).square().sum().backward()
    assert torch.allclose(layer.weight.grad, ref.weight.grad, rtol=1e-5, atol=1e-5)
    assert torch.allclose(layer.bias.grad, ref.bias.grad, rtol=1e-5, atol=1e-5)


def test_tclinear_is_a_drop_in_for_linear():
    linear = nn.Linear(48, 20)
    layer = TCLinear.from_linear(linear, "tf32x3")
    assert layer.weight is linear.weight and layer.bias is linear.bias
    assert layer.state_dict().keys() == linear.state_dict().keys()
    x = torch.randn(3, 7, 48)  # leading dimensions are kept
    assert layer(x).shape == (3, 7, 20)
    assert torch.allclose(layer(x), linear(x), rtol=1e-5, atol=1e-6)
    assert "precision=tf32x3" in repr(layer)
    assert isinstance(TCLinear(8, 4, bias=False), nn.Linear)


def test_weights_are_split_once_and_again_after_a_change():
    layer = TCLinear(32, 8, precision="tf32x3")
    x = torch.randn(5, 32)
    layer(x)
    first = layer._prepared
    layer(x)
    assert layer._prepared is first
    with torch.no_grad():
        layer.weight.mul_(2.0)
    y = layer(x)
    assert layer._prepared is not first
    assert torch.allclose(y, x @ layer.weight.T + layer.bias, rtol=1e-5, atol=1e-5)


def test_swap_is_idempotent_reversible_and_covers_pet(tiny_ckpt):
    pet = load_pet(tiny_ckpt)
    linears = {n for n, m in pet.named_modules() if type(m) is nn.Linear}
    small_k = {n for n in linears if pet.get_submodule(n).in_features < MIN_EMULATED_K}
    assert small_k == {n for n in linears if n.endswith("edge_embedder")}
    swapped = swap_linear_layers(pet, "tf32x3")
    assert set(swapped) == linears - small_k
    assert swap_linear_layers(pet, "tf32x3") == swapped
    assert all(pet.get_submodule(n).precision == "tf32x3" for n in swapped)
    swap_linear_layers(pet, "tf32")  # single-pass TF32 has no FP32 exceptions
    assert all(isinstance(pet.get_submodule(n), TCLinear) for n in linears)
    assert set(restore_linear_layers(pet)) == linears
    assert {n for n, m in pet.named_modules() if type(m) is nn.Linear} == linears


def test_pet_mad_s_has_57_linear_layers_that_swap():
    from ase_tcfp32.testing import random_pet

    pet = random_pet("s")
    linears = [n for n, m in pet.named_modules() if type(m) is nn.Linear]
    assert len(linears) == 57
    assert len(swap_linear_layers(pet, "tf32x3")) == 57 - 3  # the three K=4 edge embedders stay FP32


def test_unknown_precision_in_swap_is_rejected():
    with pytest.raises(ValueError, match="unknown precision"):
        swap_linear_layers(nn.Sequential(nn.Linear(2, 2)), "fp16")


# --- every mode end to end through the calculator on CPU ----------------------

BOUNDS = {  # |E - E_fp32| / atom (eV), max |F - F_fp32| (eV/Å), on the tiny random PET
    "tf32": (1e-3, 1e-2),
    "tf32x3": (2e-6, 5e-6),
    "fp16x3": (2e-6, 5e-6),
    "bf16x9": (2e-6, 5e-6),
}


@pytest.mark.parametrize("precision", sorted(BOUNDS))
def test_calculator_modes_stay_within_bounds_of_fp32(tiny_ckpt, water, precision):
    water.calc = TCPETCalculator(tiny_ckpt, precision="fp32", device="cpu")
    e32, f32 = water.get_potential_energy(), water.get_forces()
    with pytest.warns(EmulationWarning, match="reference emulation"):
        calc = TCPETCalculator(tiny_ckpt, precision=precision, device="cpu")
    assert calc.backend == "reference"
    water.calc = calc
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing else to complain about
        de = abs(water.get_potential_energy() - e32) / len(water)
        df = np.abs(water.get_forces() - f32).max()
    e_bound, f_bound = BOUNDS[precision]
    assert de <= e_bound and df <= f_bound
    if precision == "tf32":
        assert df > 10 * BOUNDS["tf32x3"][1]  # single-pass TF32 is visibly worse


def test_llpr_ensemble_layer_swaps_too(shipped):
    """PET-MAD's LLPR wrapper adds a Linear per ensembled output; it swaps with the rest."""
    from metatrain.utils.io import load_model

    llpr = load_model(shipped("llpr-v4"))
    swapped = swap_linear_layers(llpr, "tf32")
    assert "llpr_ensemble_layers.energy" in swapped
    assert any(name.startswith("model.backend.") for name in swapped)
