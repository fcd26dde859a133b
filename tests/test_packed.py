"""PET on packed rows (ase_tcfp32._packed) against metatrain's neighbor table, in float64:
nothing but the table's padding (weighted 1e-15 in its attention) separates them."""

import numpy as np
import pytest
import torch

from ase_tcfp32._engines import DIRECT, PROPERTIES
from ase_tcfp32._lean import LeanPET
from ase_tcfp32._swapping import recompute_gnn_layers
from ase_tcfp32.testing import random_pet


@pytest.fixture(scope="module")
def pet64():
    return random_pet("tiny", seed=11, atomic_types=[1, 6, 8, 78]).to(torch.float64).eval()


def _both(pet, structures, **packed_options):
    wanted = PROPERTIES + DIRECT + ("energy_features",)
    table = LeanPET(pet, torch.device("cpu")).compute(structures, wanted)
    lean = LeanPET(pet, torch.device("cpu"), packed=True, **packed_options)
    return table, lean.compute(structures, wanted), lean


def _assert_same(table, packed):
    for a, b in zip(table, packed, strict=True):
        scale = np.abs(a["forces"]).max()
        assert scale > 1e-3  # not trivially small
        assert abs(a["energy"] - b["energy"]) <= 1e-12 * abs(a["energy"])
        assert np.abs(a["energies"] - b["energies"]).max() <= 1e-12 * np.abs(a["energies"]).max()
        assert np.abs(a["forces"] - b["forces"]).max() <= 1e-12 * scale
        for name in ("stress", "non_conservative_forces", "non_conservative_stress", "energy_features"):
            if name in a:
                assert np.abs(a[name] - b[name]).max() <= 1e-12 * np.abs(a[name]).max()


def test_packed_rows_give_the_tables_results(pet64, water, pt_bulk, ethanol):
    """Water, a cell whose atoms see their own images, a molecule, and all three in one batch."""
    for structures in ([water], [pt_bulk], [ethanol], [water, pt_bulk, ethanol]):
        _assert_same(*_both(pet64, structures)[:2])


def test_atoms_without_neighbors_on_packed_rows(pet64):
    """An isolated atom (no pairs at all) and a dimer: sequences of the center token alone."""
    from ase import Atoms

    for atoms in (Atoms("O", positions=[[0, 0, 0]]), Atoms("OH", positions=[[0, 0, 0], [0, 0, 0.97]])):
        table, packed, _ = _both(pet64, [atoms])
        assert packed[0]["energy"] == pytest.approx(table[0]["energy"], rel=1e-12, abs=1e-12)
        assert np.abs(packed[0]["forces"] - table[0]["forces"]).max() <= 1e-12 * max(
            1.0, np.abs(table[0]["forces"]).max()
        )


def test_a_step_with_too_few_rows_is_redone_with_more(pet64, water):
    lean = _both(pet64, [water])[2]
    lean._set_rows(100)  # as if the rows had been sized for far fewer pairs
    moved = water.copy()
    moved.positions[0] += 0.05
    again = lean.compute([moved], PROPERTIES)
    _assert_same(LeanPET(pet64, torch.device("cpu")).compute([moved], PROPERTIES), again)
    assert lean.rows > 100


def test_recomputed_gnn_layers_on_packed_rows(water):
    """low_memory=True: the layers run again in the backward, on packed rows too; same forces."""
    pet = random_pet("tiny", seed=11, atomic_types=[1, 8]).to(torch.float64).eval()
    first = LeanPET(pet, torch.device("cpu"), packed=True).compute([water], PROPERTIES)[0]
    recompute_gnn_layers(pet)
    again = LeanPET(pet, torch.device("cpu"), packed=True).compute([water], PROPERTIES)[0]
    assert np.array_equal(first["forces"], again["forces"]) and first["energy"] == again["energy"]


def test_packed_rows_refuse_what_they_cannot_evaluate():
    pet = random_pet("tiny", seed=0, atomic_types=[1, 8])
    with pytest.raises(ValueError, match="packed rows cannot evaluate this model: compile=True"):
        LeanPET(pet, torch.device("cpu"), packed=True, compile=True)
    pet.backend.featurizer_type = "residual"
    with pytest.raises(ValueError, match="its featurizer is 'residual', not 'feedforward'"):
        LeanPET(pet, torch.device("cpu"), packed=True)


def test_calculators_pack_rows_only_with_the_attention_on_tensor_cores(tiny_ckpt):
    from ase_tcfp32 import TCPETCalculator

    calc = TCPETCalculator(tiny_ckpt, precision="fp32", device="cpu", engine="lean")
    assert not calc._engine.packed and "neighbor table" in calc._repr_html_()
