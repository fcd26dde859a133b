"""upet's non-conservative force and stress ensembles: metatrain's LLPR ensembles of the
direct heads, on a tiny random PET wrapped in metatrain's LLPR with ensembles of all three
heads (:func:`ase_tcfp32.testing.random_llpr`), on CPU.

The reference is upet's arithmetic: metatrain's ``mtt::aux::non_conservative_*_ensemble``
outputs of the exported LLPR model through metatomic-ase's ``run_model``, each force member's
net force removed, the members re-centred on the conservative forces where the calculator is
conservative.

Bounds: in float64 both are the same sums in other orders (1e-10 relative leaves a margin
of ~1e4 over what is seen, ~1e-14). In FP32 our members are as far from the float64
reference as metatrain's own FP32 evaluation is (measured 4e-6 of the largest force member,
dominated by the features' FP32 rounding; 3e-7 of the largest stress member, where
metatrain's FP32 product loses 1e-5 to the cancellation of the members' common part, which
is the volume times larger than the stress, and our centred weights do not): 2e-5 leaves a
margin of 5x."""

import warnings

import ase.build
import numpy as np
import pytest
import torch
from ase.calculators.calculator import PropertyNotImplementedError
from ase.stress import voigt_6_to_full_3x3_stress
from helpers import assert_as_accurate_as_fp32

from ase_tcfp32 import TCPETCalculator
from ase_tcfp32._heads import FORCE, STRESS
from ase_tcfp32._uncertainty import voigt
from ase_tcfp32.layers import TCLinear
from ase_tcfp32.models import import_dependencies
from ase_tcfp32.testing import random_llpr_checkpoint
from ase_tcfp32.validation import water_box

K = 8
"""Members of each ensemble of the test checkpoint."""

FP32 = 2e-5
"""Relative distance of an FP32 evaluation from float64 (see the module doc)."""

KEYS = {"forces": "mtt::aux::non_conservative_force_ensemble", "stress": "mtt::aux::non_conservative_stress_ensemble"}


@pytest.fixture(scope="module")
def checkpoint():
    """The LLPR checkpoint with ensembles of the energy and both direct heads (made once, in
    the temporary folder)."""
    return random_llpr_checkpoint(members=K)


@pytest.fixture
def atoms():
    atoms = water_box(4, seed=11)
    atoms.rattle(0.02, seed=1)
    return atoms


def calculator(path, **options):
    options = {"precision": "fp32", "device": "cpu", "progress": False, "uncertainty_threshold": None, **options}
    return TCPETCalculator(path, **options)


def close(a, b, rel):
    a, b = np.asarray(a), np.asarray(b)
    return np.abs(a - b).max() <= rel * np.abs(b).max()


def metatrains(path, atoms, dtype=torch.float64) -> dict:
    """upet's arithmetic on metatrain's outputs: the direct force members [n, 3, K] less each
    member's net force, the direct stress members [3, 3, K], and the conservative forces
    (to re-centre on), of the exported LLPR model in ``dtype`` (set as upet sets it)."""
    import_dependencies(metatomic_ase=True)
    from metatomic.torch import ModelOutput
    from metatomic_ase import MetatomicCalculator
    from metatrain.utils.io import load_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = load_model(path).export()
        model._capabilities.dtype = "float64" if dtype == torch.float64 else "float32"
        calc = MetatomicCalculator(model.to(dtype=dtype), device="cpu", uncertainty_threshold=None)
    outputs = {
        KEYS["forces"]: ModelOutput(unit="eV/A", sample_kind="atom"),
        KEYS["stress"]: ModelOutput(unit="eV/A^3", sample_kind="system"),
    }
    out = calc.run_model(atoms, outputs)
    forces, stress = (out[KEYS[key]].block().values.detach().double().numpy().squeeze() for key in ("forces", "stress"))
    return {"forces": forces - forces.mean(0), "stress": stress, "conservative": calc.get_forces(atoms)}


@pytest.fixture(scope="module")
def reference(checkpoint):
    atoms = water_box(4, seed=11)
    atoms.rattle(0.02, seed=1)
    return metatrains(checkpoint, atoms)


@pytest.mark.parametrize("engine", ["lean", "metatomic"])
def test_the_direct_ensembles_are_metatrains(checkpoint, atoms, reference, engine):
    """A calculator reading the direct heads gives metatrain's ensembles of them, as upet
    reads them: in float64 to its rounding, in FP32 to FP32's error; each force member has
    no net force; the members' mean is the direct prediction; upet's shapes."""
    assert reference["forces"].shape == (len(atoms), 3, K) and reference["stress"].shape == (3, 3, K)
    # rounding: the members' mean against the forces of another call (a periodic system's
    # get_forces also asks the direct stress: other FP32 operations, as many units apart)
    for dtype, bound, rounding in (("float64", 1e-10, 1e-12), ("float32", FP32, 8e-6)):
        calc = calculator(checkpoint, dtype=dtype, engine=engine, non_conservative=True)
        forces, stress = calc.get_forces_ensemble(atoms), calc.get_stress_ensemble(atoms, voigt=False)
        assert forces.shape == (len(atoms), 3, K) and stress.shape == (3, 3, K)
        assert close(forces, reference["forces"], bound) and close(stress, reference["stress"], bound)
        assert np.abs(forces.sum(0)).max() <= 1e-12 * np.abs(forces).max()
        assert close(forces.mean(-1), calc.get_forces(atoms), rounding)
        assert close(stress.mean(-1), voigt_6_to_full_3x3_stress(calc.get_stress(atoms)), rounding)
        assert not close(forces, np.repeat(forces.mean(-1, keepdims=True), K, -1), 1e-3)  # a spread


def test_on_a_conservative_calculator_the_force_members_are_about_its_forces(checkpoint, atoms, reference):
    """upet's rule: ``non_conservative=True`` on a conservative calculator re-centres the
    direct force members on the conservative forces, keeping their spread; the stress
    members stay metatrain's."""
    calc = calculator(checkpoint, dtype="float64")
    forces = calc.get_forces_ensemble(atoms, non_conservative=True)
    expected = reference["forces"] + (reference["conservative"] - reference["forces"].mean(-1))[..., None]
    assert close(forces, expected, 1e-10)
    assert close(forces.mean(-1), calc.get_forces(atoms), 1e-14)
    spread = forces - forces.mean(-1, keepdims=True)
    assert close(spread, reference["forces"] - reference["forces"].mean(-1, keepdims=True), 1e-10)
    assert close(calc.get_stress_ensemble(atoms, voigt=False, non_conservative=True), reference["stress"], 1e-10)
    conservative = calc.get_forces_ensemble(atoms)  # the energy ensemble's gradients: another spread
    assert close(conservative.mean(-1), calc.get_forces(atoms), 1e-10) and not close(conservative, forces, 1e-3)


def test_they_are_upets(checkpoint, atoms):
    """upet's own calculator on the checkpoint, both regimes of the calculator, float64."""
    upet_calculator = pytest.importorskip("upet.calculator")

    for setting in (False, True):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            upet = upet_calculator.UPETCalculator(
                checkpoint_path=checkpoint,
                device="cpu",
                dtype="float64",
                non_conservative=setting,
                uncertainty_threshold=None,
            )
            theirs = upet.get_forces_ensemble(atoms, True), upet.get_stress_ensemble(atoms, False, True)
        calc = calculator(checkpoint, dtype="float64", non_conservative=setting)
        ours = calc.get_forces_ensemble(atoms, True), calc.get_stress_ensemble(atoms, False, True)
        for mine, expected in zip(ours, theirs):
            assert mine.shape == expected.shape and close(mine, expected, 1e-10)


def test_shapes_voigt_order_and_uncertainties(checkpoint, atoms):
    """Voigt [6, K] by default (upet's conversion), the uncertainties the members' standard
    deviations, the last calculated atoms by default; a molecule has a force ensemble and
    no stress one."""
    calc = calculator(checkpoint, non_conservative=True)
    atoms.calc = calc
    atoms.get_forces()
    forces, stress = calc.get_forces_ensemble(), calc.get_stress_ensemble(voigt=False)
    assert np.array_equal(calc.get_stress_ensemble(), voigt(stress)) and voigt(stress).shape == (6, K)
    assert np.array_equal(calc.get_forces_uncertainty(), forces.std(-1))
    assert np.array_equal(calc.get_stress_uncertainty(), voigt(stress).std(-1))
    assert calc.get_stress_uncertainty(voigt=False).shape == (3, 3)
    assert calc.get_forces_uncertainty(atoms).shape == (len(atoms), 3) and np.all(calc.get_forces_uncertainty() > 0)
    water = ase.build.molecule("H2O")
    members = calc.get_forces_ensemble(water)
    assert members.shape == (3, 3, K) and np.abs(members.sum(0)).max() < 1e-5 * np.abs(members).max()
    with pytest.raises(PropertyNotImplementedError, match="periodic in all three directions"):
        calc.get_stress_ensemble(water)


@pytest.mark.parametrize("engine", ["lean", "metatomic"])
def test_evaluate_gives_them_for_each_structure(checkpoint, atoms, engine):
    """Batched, in structures of different sizes: ``non_conservative_*_ensemble`` by name
    (the direct head's, not re-centred; the stress in Voigt order), and ``forces_ensemble`` /
    ``stress_ensemble`` in the calculator's regime, one structure's as a single call's."""
    other = water_box(2, seed=3)
    names = ["forces", "non_conservative_forces_ensemble", "non_conservative_stress_ensemble"]
    conservative = calculator(checkpoint, dtype="float64", engine=engine).evaluate([atoms, other], names)
    direct = calculator(checkpoint, dtype="float64", engine=engine, non_conservative=True)
    both = direct.evaluate([atoms, other], ["forces", "forces_ensemble", "stress_ensemble"])
    for k, structure in enumerate((atoms, other)):
        single = direct.get_forces_ensemble(structure), direct.get_stress_ensemble(structure)
        assert conservative[k]["non_conservative_forces_ensemble"].shape == (len(structure), 3, K)
        assert conservative[k]["non_conservative_stress_ensemble"].shape == (6, K)
        for result in (conservative[k], both[k]):
            forces = result["forces_ensemble" if "forces_ensemble" in result else "non_conservative_forces_ensemble"]
            stress = result["stress_ensemble" if "stress_ensemble" in result else "non_conservative_stress_ensemble"]
            assert close(forces, single[0], 1e-10) and close(stress, single[1], 1e-10)
        assert "non_conservative_forces" not in conservative[k]  # the prediction they are centred on, not asked
        assert close(both[k]["forces"], both[k]["forces_ensemble"].mean(-1), 1e-12)


def test_the_direct_ensembles_in_pieces(checkpoint, atoms):
    """Evaluated one GNN layer at a time, in pieces of a few atoms, next to the energy
    ensemble's gradients (whose backward pass runs through the pieces): the whole
    evaluation's, float64."""
    results = []
    for piece_atoms in (0, 5):
        calc = calculator(checkpoint, dtype="float64", piece_atoms=piece_atoms)
        names = ["forces_ensemble", "stress_ensemble", "non_conservative_forces_ensemble"]
        results.append(calc.evaluate([atoms], [*names, "non_conservative_stress_ensemble"])[0])
    assert set(results[0]) == set(results[1])
    for key, value in results[0].items():
        assert close(results[1][key], value, 1e-12), key


def test_what_the_checkpoint_lacks_is_a_clear_error(atoms):
    """An LLPR with an energy ensemble only: the non-conservative regime names the missing
    output (upet's NotImplementedError), the conservative one works; the conservative
    regime on a calculator reading the direct head is an error."""
    energy_only = random_llpr_checkpoint(members=K, direct=False)
    direct = calculator(energy_only, non_conservative=True)
    for method, quantity in [("get_forces_ensemble", "force"), ("get_stress_uncertainty", "stress")]:
        match = (
            f"non-conservative {quantity} uncertainty/ensemble is not available for this model: its LLPR has no "
            f"ensemble of the direct {quantity} head \\(metatrain's 'mtt::aux::non_conservative_{quantity}_ensemble'"
        )
        with pytest.raises(NotImplementedError, match=match):
            getattr(direct, method)(atoms)
    conservative = calculator(energy_only)
    with pytest.raises(NotImplementedError, match="non-conservative force uncertainty/ensemble is not available"):
        conservative.get_forces_ensemble(atoms, non_conservative=True)
    with pytest.raises(NotImplementedError, match="no ensemble of the direct stress head"):
        conservative.evaluate([atoms], ["non_conservative_stress_ensemble"])
    assert conservative.get_forces_ensemble(atoms).shape == (len(atoms), 3, K)
    with pytest.raises(NotImplementedError, match="needs a calculator computing conservative forces"):
        calculator(random_llpr_checkpoint(members=K), non_conservative=True).get_forces_ensemble(atoms, False)


def test_emulated_tensor_cores_are_fp32_accurate(checkpoint, atoms):
    """fp16x3 on the A100's tensor-core model (CPU): the ensemble layer runs in it, like the
    heads' last layers, and the members and their spread are as far from float64 as FP32's
    (4x margin: a handful of roundings apart)."""
    exact = calculator(checkpoint, dtype="float64", non_conservative=True)
    emulated = calculator(checkpoint, precision="fp16x3", emulate="A100", non_conservative=True)
    layers = emulated._engine.uncertainty.direct
    assert set(layers) == {FORCE, STRESS}
    assert all(
        isinstance(layer, TCLinear) and (layer.precision, layer.emulate) == ("fp16x3", "A100")
        for layer in layers.values()
    )

    def quantities(calc):
        forces, stress = calc.get_forces_ensemble(atoms), calc.get_stress_ensemble(atoms, voigt=False)
        return [forces, stress, forces - forces.mean(-1, keepdims=True), stress - stress.mean(-1, keepdims=True)]

    reference = quantities(exact)
    for name, calc in (("fp32", calculator(checkpoint, non_conservative=True)), ("fp16x3", emulated)):
        errors = [
            np.abs(ours - theirs).max() / np.abs(theirs).max() for ours, theirs in zip(quantities(calc), reference)
        ]
        if name == "fp32":
            fp32 = errors
            assert max(errors) < FP32
        else:
            assert all(error <= 4 * bound + 1e-9 for error, bound in zip(errors, fp32)), (errors, fp32)


# --- on the GPU (pytest -m gpu tests; skipped without CUDA) ---


@pytest.mark.gpu
def test_the_direct_ensembles_on_tensor_cores_are_fp32_accurate(checkpoint):
    """The default calculator on the GPU (its FP32-accurate precision, packed rows, the
    ensemble's step eager between CUDA-graph steps) is as far from the float64 model as an
    FP32 calculator (4x margin); forces replayed from the graph afterwards are unchanged."""
    atoms = water_box(32, seed=2)
    methods = ("get_forces_ensemble", "get_forces_uncertainty", "get_stress_ensemble", "get_stress_uncertainty")
    exact = calculator(checkpoint, dtype="float64", device="cuda", non_conservative=True)
    fp32 = calculator(checkpoint, device="cuda", non_conservative=True)
    default = TCPETCalculator(
        checkpoint, device="cuda", progress=False, uncertainty_threshold=None, non_conservative=True
    )
    moved = atoms.copy()
    moved.calc = default
    before = moved.get_forces()  # a step recorded as a CUDA graph
    assert_as_accurate_as_fp32(atoms, methods, exact, fp32, default)
    moved.positions[0, 0] += 1e-3
    assert close(moved.get_forces(), before, 1e-2) and close(moved.get_forces(), fp32.get_forces(moved), 1e-4)
