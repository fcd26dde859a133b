"""The accuracy watchdog (ase_tcfp32.watchdog) on CPU: the reference emulation computes
the GPU kernels' arithmetic, so what it flags there the kernels flag too. The ``gpu``-marked tests check the
kernels themselves."""

import warnings

import pytest
import torch
from helpers import fp32_in_order

from ase_tcfp32 import PrecisionWarning, TCPETCalculator, swap_linear_layers
from ase_tcfp32.precision import support
from ase_tcfp32.watchdog import FACTOR, errors, floor


def running_layers(pet) -> list:
    """The watched layers of ``pet`` that a conservative evaluation runs: all but those of
    the direct force and stress heads (read only when asked for)."""
    backend = pet.backend
    heads = (backend.node_heads, backend.edge_heads, backend.node_last_layers, backend.edge_last_layers)
    idle = {
        id(m)
        for name in ("non_conservative_force", "non_conservative_stress")
        for group in heads
        if name in group
        for m in group[name].modules()
    }
    return [m for m in pet.modules() if hasattr(m, "check_accuracy") and id(m) not in idle]


def outlier_inputs(seed=0):
    """x [64, 256] with an entry 1e8 in every 32-column K-tile, whose weight column is
    zero: the exact products ignore it, but it sets the tile's scale in fp16x3."""
    g = torch.Generator().manual_seed(seed)
    layer = torch.nn.Linear(256, 128)
    x = torch.randn(64, 256, generator=g)
    with torch.no_grad():
        layer.weight[:, ::32] = 0.0
    x[:, ::32] = 1e8
    return torch.nn.Sequential(layer), x


def caught(function):
    with warnings.catch_warnings(record=True) as found:
        warnings.simplefilter("always")
        function()
    return [w for w in found if issubclass(w.category, PrecisionWarning)]


def test_fp16x3_outlier_raises_a_precision_warning_naming_the_layer():
    model, x = outlier_inputs()
    swap_linear_layers(model, "fp16x3", check_accuracy=1)
    x.requires_grad_(True)
    found = caught(lambda: model(x).sum().backward())
    assert len(found) == 1  # once per layer
    message = str(found[0].message)
    assert "layer '0'" in message and "fp16x3" in message and "forward" in message
    assert caught(lambda: model(x)) == []  # already reported


def test_fp16x3_outlier_is_outside_fp32_accuracy_by_far():
    """The measured gap the warning is for: hundreds of units 2^-24 against FP32's few
    (FP32 summed in order: the same on every machine)."""
    model, x = outlier_inputs()
    swap_linear_layers(model, "fp16x3")
    weight, bias = model[0].weight, model[0].bias
    emulated = errors(x, weight, bias, model(x))[0].item()
    fp32 = errors(x, weight, bias, fp32_in_order(x, weight) + bias)[0].item()
    assert emulated > 300 and emulated > 20 * fp32


@pytest.mark.parametrize("precision", ["tf32x3", "fp16x3", "bf16x9"])
def test_ordinary_inputs_raise_nothing_and_the_check_can_fail(precision):
    g = torch.Generator().manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(200, 300), torch.nn.SiLU(), torch.nn.Linear(300, 50))
    swap_linear_layers(model, precision, check_accuracy=1)
    x = torch.randn(500, 200, generator=g, requires_grad=True)
    assert caught(lambda: model(x).sum().backward()) == []
    # the same check on a result one FP32 rounding step per entry off fails
    y = model[0](x).detach()
    wrong = y + y.abs() * FACTOR * floor(200) * 2.0**-18
    emulated, fp32 = errors(x.detach()[:8], model[0].weight, model[0].bias, wrong[:8]).tolist()
    assert emulated > max(FACTOR * fp32, floor(200))


def test_environment_variable_sets_the_interval(monkeypatch):
    model, x = outlier_inputs()
    monkeypatch.setenv("ASE_TCFP32_CHECK_ACCURACY", "3")
    swap_linear_layers(model, "fp16x3")
    assert model[0].check_accuracy == 3
    assert len(caught(lambda: model(x))) == 1  # the first call is checked
    monkeypatch.setenv("ASE_TCFP32_CHECK_ACCURACY", "often")
    with pytest.raises(ValueError, match="ASE_TCFP32_CHECK_ACCURACY must be a non-negative integer"):
        swap_linear_layers(model, "fp16x3")


def test_every_nth_call_is_checked():
    model, x = outlier_inputs()
    swap_linear_layers(model, "fp16x3", check_accuracy=4)
    layer = model[0]
    layer._calls["forward"] = 1  # the first call is past: the next three are not due
    assert [len(caught(lambda: model(x))) for _ in range(4)] == [0, 0, 0, 1]


@pytest.mark.parametrize("value", [-1, 1.5, "7", True])
def test_bad_intervals_are_refused(tiny_ckpt, value):
    with pytest.raises(ValueError, match="check_accuracy must be a non-negative integer"):
        TCPETCalculator(tiny_ckpt, device="cpu", precision="fp16x3", check_accuracy=value)


def test_tf32_is_not_checked():
    model, _ = outlier_inputs()
    with pytest.raises(ValueError, match="tf32 is ~1e-4 accurate by design"):
        swap_linear_layers(model, "tf32", check_accuracy=1)


@pytest.mark.parametrize("engine", ["metatomic", "lean"])
def test_calculator_checks_every_layer_and_stays_quiet_on_pet(tiny_ckpt, water, engine):
    calc = TCPETCalculator(tiny_ckpt, device="cpu", precision="fp16x3", engine=engine, check_accuracy=1)
    water.calc = calc
    assert caught(water.get_forces) == []
    layers = running_layers(calc.pet)
    assert layers and all(m._calls["forward"] == 1 for m in layers)
    backward = [m._calls.get("input gradient", 0) for m in layers]  # layers fed by positions
    assert set(backward) == {0, 1} and sum(backward) > len(layers) // 2


@pytest.mark.parametrize("precision", ["tf32x3", "bf16x9"])
def test_subnormal_inputs_are_flagged_for_the_unscaled_splits(precision):
    """x ~1e-40 (subnormal in FP32) against w ~1e30: tf32x3 and bf16x9 lose the products
    (docs/precision.md, 'Where FP32 accuracy ends'); the watchdog says so."""
    g = torch.Generator().manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 96, bias=False))
    with torch.no_grad():
        model[0].weight.normal_(generator=g).mul_(1e30)
    swap_linear_layers(model, precision, check_accuracy=1)
    x = torch.randn(64, 256, generator=g) * 1e-40
    assert len(caught(lambda: model(x))) == 1


# --- on the GPU (pytest -m gpu tests; skipped without CUDA) ---


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["tf32x3", "fp16x3"])
def test_watchdog_flags_the_fp16x3_outlier_on_the_gpu(precision):
    """fp16x3's kernel on a K-tile with one 1e8 entry over a zero weight column: flagged
    (issue 25's measured 487 units 2^-24); tf32x3 on the same input: FP32-accurate, quiet."""
    import warnings

    from ase_tcfp32 import PrecisionWarning, swap_linear_layers

    if precision == "fp16x3" and not support("fp16x3", "cuda").available:
        pytest.skip("fp16x3 needs Hopper")
    g = torch.Generator(device="cuda").manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 256)).cuda()
    with torch.no_grad():
        model[0].weight[:, ::32] = 0.0
    x = torch.randn(40_000, 512, device="cuda", generator=g)  # enough rows for the kernel
    x[:, ::32] = 1e8
    swap_linear_layers(model, precision, check_accuracy=1)
    with warnings.catch_warnings(record=True) as found:
        warnings.simplefilter("always")
        model(x)
    flagged = [w for w in found if issubclass(w.category, PrecisionWarning)]
    assert len(flagged) == (precision == "fp16x3"), [str(w.message) for w in flagged]


@pytest.mark.gpu
@pytest.mark.parametrize("engine", ["metatomic", "graphs"])
def test_watchdog_is_quiet_on_pet_in_every_engine(engine, water192):
    import warnings

    from ase_tcfp32 import PrecisionWarning
    from ase_tcfp32._folded import folded
    from ase_tcfp32.testing import random_checkpoint

    atoms = water192.repeat((2, 2, 1))  # 768 atoms: our kernels, not cuBLAS
    atoms.calc = TCPETCalculator(random_checkpoint("xs", seed=3), device="cuda", engine=engine, check_accuracy=2)
    with warnings.catch_warnings(record=True) as found:
        warnings.simplefilter("always")
        for _ in range(4):  # graphs: eager check, record, replay, eager check
            atoms.positions += 0.001
            atoms.get_forces()
    assert not [w for w in found if issubclass(w.category, PrecisionWarning)]
    # every layer that ran was checked (the direct heads' layers do not run for conservative
    # forces); a compression folded away (ase_tcfp32._folded) by its messages' layer
    pet = atoms.calc.pet
    folded_away = {id(m.compress[0]): folded(m).messages for m in pet.modules() if hasattr(m, "compress")}
    idle = {
        id(m)
        for name in ("non_conservative_force", "non_conservative_stress")
        for heads in (
            pet.backend.node_heads,
            pet.backend.edge_heads,
            pet.backend.node_last_layers,
            pet.backend.edge_last_layers,
        )
        if name in heads
        for m in heads[name].modules()
    }
    layers = [folded_away.get(id(m), m) for m in pet.modules() if hasattr(m, "check_accuracy") and id(m) not in idle]
    assert layers and all(m._calls["forward"] >= 2 for m in layers)
