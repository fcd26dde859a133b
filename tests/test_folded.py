"""The folded edge-token compression on CPU: metatrain's numbers, what the swap keeps."""

import copy
import pickle

import numpy as np
import pytest
import torch

from ase_tcfp32._engines import PROPERTIES
from ase_tcfp32._folded import folded, swap_cartesian_transformers
from ase_tcfp32._lean import LeanPET
from ase_tcfp32.layers import TCLinear, swap_linear_layers
from ase_tcfp32.models import load_pet


def results_before_and_after_the_swap(pet, atoms) -> tuple[dict, dict]:
    lean = LeanPET(pet, torch.device("cpu"))
    before = lean.compute([atoms], PROPERTIES)[0]
    assert swap_cartesian_transformers(pet) == ["backend.gnn_layers.0", "backend.gnn_layers.1"]
    return before, lean.compute([atoms], PROPERTIES)[0]


def test_folding_gives_metatrains_numbers_in_float64(tiny_ckpt, water):
    """The folded maps are metatrain's exactly: in float64 the same energy, forces and
    stress to float64 rounding. A metatrain release that changes its layer fails here."""
    atoms = water.copy()
    atoms.rattle(0.05, seed=3)
    before, after = results_before_and_after_the_swap(load_pet(tiny_ckpt).double(), atoms)
    for key in ("energy", "forces", "stress"):
        assert np.abs(after[key] - before[key]).max() <= 64 * 2.0**-53 * np.abs(before[key]).max() * len(atoms), key


@pytest.mark.parametrize("precision", ["fp32", "tf32x3"])
def test_folding_agrees_to_fp32_rounding_in_every_precision_of_the_layers(tiny_ckpt, water, precision):
    """In float32, with FP32 or emulated tensor-core layers (CPU reference emulation):
    the folded messages' layer has the compression's precision, and results agree to FP32
    rounding (the folded weights round the exact maps once, the unfolded layer rounds its
    embeddings and sums)."""
    pet = load_pet(tiny_ckpt)
    swap_linear_layers(pet, precision)
    before, after = results_before_and_after_the_swap(pet, water.copy())
    messages = folded(pet.backend.gnn_layers[1]).messages
    assert type(messages) is (TCLinear if precision != "fp32" else torch.nn.Linear)
    assert getattr(messages, "precision", "fp32") == precision
    u = 2.0**-24
    assert abs(after["energy"] - before["energy"]) <= 16 * len(water) * u * abs(before["energy"])
    assert np.abs(after["forces"] - before["forces"]).max() <= 1e-5 * np.abs(before["forces"]).max()
    assert np.abs(after["stress"] - before["stress"]).max() <= 1e-5 * np.abs(before["stress"]).max()


def test_the_fold_follows_the_weights(tiny_ckpt, water):
    """Weights changed in place are folded again: the swapped model follows metatrain's."""
    pet = load_pet(tiny_ckpt).double()
    swap_cartesian_transformers(pet)
    lean = LeanPET(pet, torch.device("cpu"))
    lean.compute([water], ("energy", "energies", "forces"))
    with torch.no_grad():
        pet.backend.gnn_layers[1].neighbor_embedder.weight.mul_(2.0)
        pet.backend.gnn_layers[0].edge_embedder.bias.add_(0.1)
    after = lean.compute([water], ("energy", "energies", "forces"))[0]
    swap_cartesian_transformers(pet, False)
    expected = lean.compute([water], ("energy", "energies", "forces"))[0]
    assert np.abs(after["forces"] - expected["forces"]).max() <= 1e-12 * np.abs(expected["forces"]).max()


def test_the_swap_keeps_parameters_and_state_dict_and_survives_copies(tiny_ckpt, water):
    from ase_tcfp32._folded import FoldedCartesianTransformer

    pet = load_pet(tiny_ckpt)
    keys = list(pet.state_dict())
    names = swap_cartesian_transformers(pet)
    assert swap_cartesian_transformers(pet) == names  # idempotent
    LeanPET(pet, torch.device("cpu")).compute([water], ("energy", "energies", "forces"))  # folds
    assert list(pet.state_dict()) == keys
    for clone in (copy.deepcopy(pet), pickle.loads(pickle.dumps(pet))):
        assert type(clone.get_submodule(names[0])) is FoldedCartesianTransformer
        assert list(clone.state_dict()) == keys
    swap_cartesian_transformers(pet, False)
    assert all(type(pet.get_submodule(n)).__name__ == "CartesianTransformer" for n in names)


def test_calculators_without_tensor_core_attention_keep_metatrains_layers(tiny_ckpt):
    from ase_tcfp32 import TCPETCalculator

    calc = TCPETCalculator(tiny_ckpt, device="cpu", precision="fp32")
    assert all(type(m).__name__ != "FoldedCartesianTransformer" for m in calc.pet.modules())
