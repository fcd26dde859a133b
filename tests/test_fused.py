"""The fused SwiGLU and message-combination swaps on CPU: which modules they change, what
they keep, and the fallbacks; on the GPU (``gpu``-marked) the kernels against FP64."""

import copy
import pickle

import numpy as np
import pytest
import torch

from ase_tcfp32._fused import combine_messages, swap_feed_forwards, swiglu
from ase_tcfp32._table import swap_backends, swap_transformer_layers

pytest.importorskip("triton")


def test_the_swap_keeps_parameters_and_state_dict_and_survives_copies(tiny_ckpt):
    from ase_tcfp32._fused import FusedFeedForward
    from ase_tcfp32.models import load_pet

    pet = load_pet(tiny_ckpt)
    keys = list(pet.state_dict())
    names = swap_feed_forwards(pet)
    assert names and all(type(pet.get_submodule(n)) is FusedFeedForward for n in names)
    assert any(n.endswith(".mlp") for n in names) and any(n.endswith(".center_mlp") for n in names)
    assert swap_feed_forwards(pet) == names  # idempotent
    assert list(pet.state_dict()) == keys
    for clone in (copy.deepcopy(pet), pickle.loads(pickle.dumps(pet))):
        assert type(clone.get_submodule(names[0])) is FusedFeedForward
    swap_feed_forwards(pet, False)
    assert all(type(pet.get_submodule(n)).__name__ == "FeedForward" for n in names)


def test_a_silu_feed_forward_is_left_alone():
    from metatrain.pet.modules.transformer import FeedForward

    block = FeedForward(8, 16, "SiLU")
    assert swap_feed_forwards(block) == [] and type(block) is FeedForward


def test_calculators_without_tensor_core_attention_keep_metatrains_feed_forward(tiny_ckpt):
    from ase_tcfp32 import TCPETCalculator

    for precision in ("fp32", "tf32x3"):  # on CPU: no kernels of ours
        calc = TCPETCalculator(tiny_ckpt, device="cpu", precision=precision)
        assert all(type(m).__name__ != "FusedFeedForward" for m in calc.pet.modules())


def test_swiglu_on_cpu_tensors_is_metatrains_expression():
    g = torch.Generator().manual_seed(0)
    y = torch.randn(5, 3, 14, generator=g, dtype=torch.float64)
    v, gate = y.chunk(2, dim=-1)
    assert torch.equal(swiglu(y), v * torch.sigmoid(gate))


def test_the_kernels_refuse_what_they_cannot_take_before_launching():
    from ase_tcfp32._kernels import swiglu as kernels

    with pytest.raises(ValueError, match=r"contiguous float32 \[\.\.\., 2F\] tensor expected"):
        kernels.forward(torch.zeros(4, 7))
    with pytest.raises(ValueError, match="float64"):
        kernels.forward(torch.zeros(4, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="contiguous"):
        kernels.backward(torch.zeros(8, 2), torch.zeros(4, 8).T)


def test_the_backend_and_layer_swaps_keep_parameters_and_state_dict_and_survive_copies(tiny_ckpt):
    from ase_tcfp32._table import FusedPETBackend, FusedTransformerLayer
    from ase_tcfp32.models import load_pet

    pet = load_pet(tiny_ckpt)
    keys = list(pet.state_dict())
    assert swap_backends(pet) == ["backend"] and type(pet.backend) is FusedPETBackend
    assert swap_backends(pet) == ["backend"]  # idempotent
    layers = swap_transformer_layers(pet)
    assert (
        layers and layers == swap_transformer_layers(pet) and all(name.endswith(".trans.layers.0") for name in layers)
    )
    assert list(pet.state_dict()) == keys
    for clone in (copy.deepcopy(pet), pickle.loads(pickle.dumps(pet))):
        assert type(clone.backend) is FusedPETBackend
        assert all(type(clone.get_submodule(name)) is FusedTransformerLayer for name in layers)
    swap_backends(pet, False), swap_transformer_layers(pet, False)
    assert type(pet.backend).__name__ == "PETBackend"
    assert all(type(pet.get_submodule(name)).__name__ == "TransformerLayer" for name in layers)


def test_a_residual_featurizer_is_left_alone(tiny_ckpt):
    from ase_tcfp32.models import load_pet

    pet = load_pet(tiny_ckpt)
    pet.backend.featurizer_type = "residual"  # metatrain's other featurizer (no combination step)
    assert swap_backends(pet) == [] and type(pet.backend).__name__ == "PETBackend"


def test_calculators_without_tensor_core_attention_keep_metatrains_backend(tiny_ckpt):
    from ase_tcfp32 import TCPETCalculator

    for precision in ("fp32", "tf32x3"):  # on CPU: no kernels of ours
        calc = TCPETCalculator(tiny_ckpt, device="cpu", precision=precision)
        assert type(calc.pet.backend).__name__ == "PETBackend"


def test_the_swapped_featurizer_gives_metatrains_bits_in_float64(tiny_ckpt, water):
    """Our copy of metatrain's feed-forward featurizer (its combination in
    :func:`combine_messages`, on CPU metatrain's expression) runs the same modules on the
    same values, in float64: the same energy, forces and stress up to the padding, which
    is its own reverse here (another slot's in metatrain) and weighs 1e-15 in PET's
    attention (it clamps the cutoff factors there). A metatrain release that changes its
    featurizer fails here."""
    from ase_tcfp32._engines import PROPERTIES
    from ase_tcfp32._lean import LeanPET
    from ase_tcfp32.models import load_pet

    pet = load_pet(tiny_ckpt).double()
    lean = LeanPET(pet, torch.device("cpu"))
    atoms = water.copy()
    atoms.rattle(0.05, seed=3)
    before = lean.compute([atoms], PROPERTIES)[0]
    swap_backends(pet)
    after = lean.compute([atoms], PROPERTIES)[0]
    for key in ("energy", "forces", "stress"):
        assert np.abs(after[key] - before[key]).max() <= 100 * 1e-15 * np.abs(before[key]).max(), key


def test_combine_messages_on_cpu_tensors_is_metatrains_expression():
    g = torch.Generator().manual_seed(0)
    o, reverse = torch.randn(3, 4, 6, generator=g), torch.tensor([[1, 0, 2, 3], [4, 5, 6, 7], [8, 9, 11, 10]])
    norm = torch.nn.LayerNorm(12)
    assert torch.equal(
        combine_messages(o, reverse, norm),
        norm(torch.cat([o, o.reshape(12, 6)[reverse.reshape(-1)].reshape(o.shape)], -1)),
    )


# --- on the GPU (pytest -m gpu tests; skipped without CUDA) ---


def _assert_swiglu_errors_within_8_units(y, grad, h, grad_y):
    """Elementwise, against FP64, where the gate is finite: a few roundings of 2^-24 each
    (libdevice's exp, 1 + e, the division, the products), plus FP32's underflow (2^-126)
    for results below its normal range; the gate's gradient relative to |dh v| (1 - s
    cancels where s is near 1, as in torch's own kernels)."""
    u, tiny = 2.0**-24, 2.0**-126
    v, gate = (t.double() for t in y.chunk(2, dim=-1))
    dv, dg = (t.double() for t in grad_y.chunk(2, dim=-1))
    s, grad, finite = torch.sigmoid(gate), grad.double(), torch.isfinite(gate)
    assert ((h.double() - v * s).abs() <= (8 * u * s + tiny) * v.abs())[finite].all()
    assert ((dv - grad * s).abs() <= (8 * u * s + tiny) * grad.abs())[finite].all()
    assert ((dg - grad * v * s * (1 - s)).abs() <= (8 * u + tiny) * (grad * v).abs())[finite].all()


@pytest.mark.gpu
def test_fused_swiglu_matches_fp64():
    """The SwiGLU kernels (libdevice's exp on the GPU) against FP64, forward and backward,
    with non-finite gates propagating as in torch."""
    from ase_tcfp32._fused import swiglu

    g = torch.Generator(device="cuda").manual_seed(0)
    for rows, features in [(100_003, 512), (1_001, 2048), (77, 40)]:
        y = torch.randn(rows, 2 * features, device="cuda", generator=g) * 4
        y[0, features : features + 5] = torch.tensor([90.0, -90.0, float("inf"), -float("inf"), float("nan")])
        grad = torch.randn(rows, features, device="cuda", generator=g)
        ours, plain = y.clone().requires_grad_(), y.clone().requires_grad_()
        h = swiglu(ours)
        h.backward(grad)
        v, gate = plain.chunk(2, dim=-1)
        expected = v * torch.sigmoid(gate)
        expected.backward(grad)
        assert torch.equal(torch.isnan(h), torch.isnan(expected)) and torch.equal(
            torch.isnan(ours.grad), torch.isnan(plain.grad)
        )
        _assert_swiglu_errors_within_8_units(y, grad, h, ours.grad)


@pytest.mark.gpu
def test_fused_swiglu_past_2_31_elements():
    """Offsets past 2^31 elements (a 2.2-billion-float input, 26 GB in all): the last rows."""
    from ase_tcfp32._kernels import swiglu

    rows, features = 2**31 // 1024 + 3, 512
    y = torch.randn(rows, 2 * features, device="cuda")
    grad = torch.randn(rows, features, device="cuda")
    h = swiglu.forward(y)[-4:].clone()
    grad_y = swiglu.backward(grad, y)[-4:]
    _assert_swiglu_errors_within_8_units(y[-4:], grad[-4:], h, grad_y)


@pytest.mark.gpu
def test_message_combination_matches_fp64():
    """The message-combination kernels on the GPU against FP64 (``helpers.check_combination``)."""
    from helpers import check_combination

    check_combination("cuda")


@pytest.mark.gpu
def test_pre_norm_matches_fp64():
    """The pre-norm kernels on the GPU against FP64 (``helpers.check_pre_norm``)."""
    from helpers import check_pre_norm

    check_pre_norm("cuda")


def test_the_swapped_backend_computes_only_the_heads_that_are_read(water):
    """metatrain's ``predict`` asks for every head's last-layer features, then reads those of
    the outputs requested: through the swapped backend an energy-only or conservative call
    of a PET with direct heads runs the energy head alone, a direct one (forces and stress
    of a periodic system) all three; energies and forces as metatrain's."""
    from metatomic_ase import MetatomicCalculator

    from ase_tcfp32.testing import random_pet

    pet = random_pet("tiny", seed=3, atomic_types=[1, 8]).eval()

    def evaluate(model, direct):
        atoms = water.copy()
        atoms.calc = MetatomicCalculator(model.export(), device="cpu", non_conservative=direct)
        return atoms.get_potential_energy(), atoms.get_forces()

    expected = {direct: evaluate(copy.deepcopy(pet), direct) for direct in (False, True)}
    assert swap_backends(pet) == ["backend"]
    read = set()
    for name, heads in pet.backend.edge_heads.items():
        heads[0][0].register_forward_hook(lambda *args, name=name: read.add(name))
    everything = set(pet.backend.edge_heads.keys())
    assert everything == {"energy", "non_conservative_force", "non_conservative_stress"}
    for direct, heads in ((False, {"energy"}), (True, everything)):
        read.clear()
        energy, forces = evaluate(pet, direct)
        assert read == heads, direct
        assert abs(energy - expected[direct][0]) <= 1e-5 * abs(expected[direct][0])
        assert np.abs(forces - expected[direct][1]).max() <= 1e-5 * np.abs(expected[direct][1]).max()
