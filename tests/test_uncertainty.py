"""upet's force and stress uncertainties and ensembles, and ``uncertainty_threshold``, on
the bundled demo model (an LLPR with a 128-member energy ensemble, none for its direct heads) and on
random PET-MAD-shaped models (direct heads, no LLPR), on CPU.

Bounds: in float64 the members' forces and stress are the exact derivatives of the members'
energies, so central differences with step h agree to their truncation error (h² times
third derivatives: ~1e-7 of the largest force at h = 1e-4 Å, measured 6e-7 relative at
most; 1e-5 leaves a margin of ~15x) and float64 rounding. Two FP32 evaluations (ours and
upet's, metatrain's member-by-member gradients) differ by FP32 rounding of the largest
terms: 1e-5 relative (measured 5e-7 to 1e-6)."""

import warnings

import ase.build
import numpy as np
import pytest
from ase.calculators.calculator import PropertyNotImplementedError
from helpers import assert_as_accurate_as_fp32, quiet_calculator

from ase_tcfp32 import TCPETCalculator
from ase_tcfp32._uncertainty import voigt
from ase_tcfp32.models import bundled_checkpoint
from ase_tcfp32.testing import random_pet
from ase_tcfp32.validation import water_box

K = 128
"""Members of the demo model's energy ensemble."""


def demo(**options):
    options = {"precision": "fp32", "device": "cpu", "progress": False, "uncertainty_threshold": None, **options}
    return TCPETCalculator("pet-demo-chgnet", **options)


@pytest.fixture
def pt():
    atoms = ase.build.bulk("Pt", "fcc", a=3.92, cubic=True)
    atoms.rattle(0.05, seed=2)
    return atoms


def close(a, b, rel):
    a, b = np.asarray(a), np.asarray(b)
    return np.abs(a - b).max() <= rel * np.abs(b).max()


def test_members_are_the_gradients_of_the_energy_ensemble(pt):
    """float64: each member's forces and stress are the central differences of its energy
    (get_energy_ensemble) by positions and strain; their mean is the prediction; the
    uncertainties are the ensemble's standard deviations; upet's shapes, units, Voigt order."""
    calc = demo(dtype="float64")
    forces, stress = calc.get_forces_ensemble(pt), calc.get_stress_ensemble(pt, voigt=False)
    assert forces.shape == (4, 3, K) and stress.shape == (3, 3, K)
    h = 1e-4
    for atom, axis in [(0, 0), (2, 1), (3, 2)]:
        energies = []
        for sign in (1, -1):
            moved = pt.copy()
            moved.positions[atom, axis] += sign * h
            energies.append(calc.get_energy_ensemble(moved))
        assert close(
            forces[atom, axis],
            -(energies[0] - energies[1]) / (2 * h),
            1e-5 * np.abs(forces).max() / np.abs(forces[atom, axis]).max(),
        )
    for i, j in [(0, 0), (0, 1), (2, 1)]:
        energies = []
        for sign in (1, -1):
            strain = np.eye(3)
            strain[i, j] += sign * h
            strained = pt.copy()
            strained.set_cell(pt.cell.array @ strain, scale_atoms=True)
            energies.append(calc.get_energy_ensemble(strained))
        expected = (energies[0] - energies[1]) / (2 * h) / pt.get_volume()
        assert np.abs(stress[i, j] - expected).max() <= 1e-5 * np.abs(stress).max()
    pt.calc = calc
    assert close(forces.mean(-1), pt.get_forces(), 1e-10)
    assert close(calc.get_stress_ensemble(pt).mean(-1), pt.get_stress(), 1e-10)
    assert np.array_equal(calc.get_forces_uncertainty(), forces.std(-1))  # the last calculated atoms
    voigt = calc.get_stress_ensemble()
    assert voigt.shape == (6, K) and np.allclose(voigt[3], (stress[1, 2] + stress[2, 1]) / 2, rtol=0, atol=1e-15)
    assert np.array_equal(calc.get_stress_uncertainty(), voigt.std(-1))
    assert calc.get_stress_uncertainty(voigt=False).shape == (3, 3)


def test_a_molecule_has_a_force_ensemble_and_no_stress_one():
    calc = demo()
    water = ase.build.molecule("H2O")
    members = calc.get_forces_ensemble(water)
    assert members.shape == (3, 3, K) and np.abs(members.sum(0)).max() < 1e-5  # no net force per member
    assert np.all(calc.get_forces_uncertainty(water) > 0)
    with pytest.raises(PropertyNotImplementedError, match="periodic in all three directions"):
        calc.get_stress_ensemble(water)


def test_the_ensembles_are_upets(pt):
    """upet's UPETCalculator on the same checkpoint (metatrain's gradients of each member,
    through metatomic-ase), FP32 both; the batched evaluate and the metatomic engine give
    the same."""
    upet_calculator = pytest.importorskip("upet.calculator")

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        upet = upet_calculator.UPETCalculator(
            checkpoint_path=bundled_checkpoint("pet-demo-chgnet"), device="cpu", uncertainty_threshold=None
        )
        theirs = upet.get_forces_ensemble(pt), upet.get_stress_ensemble(pt, voigt=False)
    calc = demo()
    ours = calc.get_forces_ensemble(pt), calc.get_stress_ensemble(pt, voigt=False)
    for mine, expected in zip(ours, theirs):
        assert mine.shape == expected.shape and close(mine, expected, 1e-5)
    assert np.abs(calc.get_forces_uncertainty(pt) - theirs[0].std(-1)).max() <= 1e-5 * np.abs(theirs[0]).max()
    other = pt.copy()
    other.rattle(0.05, seed=9)
    wanted = ["energy", "forces", "forces_ensemble", "stress_ensemble"]
    batches = {engine: demo(engine=engine).evaluate([pt, other], wanted) for engine in ("lean", "metatomic")}
    for results in batches.values():
        assert results[0]["stress_ensemble"].shape == (6, K) and "energy_ensemble_forces" not in results[0]
        assert close(results[0]["forces_ensemble"], theirs[0], 1e-5)
        assert close(results[0]["stress_ensemble"], voigt(theirs[1]), 1e-5)
        assert close(results[1]["forces_ensemble"].mean(-1), results[1]["forces"], 1e-5)
    lean, metatomic = (batches[engine][1] for engine in ("lean", "metatomic"))
    for key in ("forces_ensemble", "stress_ensemble"):
        assert close(metatomic[key], lean[key], 1e-5) and not close(lean[key], batches["lean"][0][key], 1e-2)
    with pytest.raises(ValueError, match="not rotationally averaged"):
        demo(rotational_average_order=2).evaluate([pt], ["forces_ensemble"])


def test_uncertainties_are_larger_out_of_distribution(pt):
    """Positive and finite; the mean force uncertainty per atom of a random H/C/O gas is
    above that of held-out-like water, and PtO rocksalt's above rattled Pt's (measured:
    0.57 against 0.29 eV/Å, 0.078 against 0.020 eV/Å); the stress uncertainty of Pt at 80% of
    its lattice constant above that at its own."""
    calc = demo()
    rng = np.random.default_rng(0)
    positions = []
    while len(positions) < 24:
        p = rng.uniform(0, 10, 3)
        if all(np.linalg.norm(p - q) > 0.9 for q in positions):
            positions.append(p)
    gas = ase.Atoms(rng.choice(["H", "C", "O"], 24).tolist(), positions=positions, cell=[10] * 3, pbc=True)
    oxide = ase.build.bulk("PtO", "rocksalt", a=4.6, cubic=True)
    oxide.rattle(0.05, seed=1)
    pairs = [(water_box(8, seed=1), gas), (pt, oxide)]
    for held_out, far in pairs:
        sigmas = [calc.get_forces_uncertainty(atoms) for atoms in (held_out, far)]
        assert all(np.isfinite(s).all() and (s > 0).all() for s in sigmas)
        assert sigmas[1].mean() > 1.5 * sigmas[0].mean(), far.get_chemical_formula()
    compressed = pt.copy()
    compressed.set_cell(pt.cell * 0.8, scale_atoms=True)
    stress = [calc.get_stress_uncertainty(atoms)[:3].mean() for atoms in (pt, compressed)]
    assert stress[1] > 2 * stress[0] > 0


def test_what_a_model_lacks_is_a_clear_error(pt):
    """upet's rules: the non-conservative regime needs an ensemble of the direct head (none
    of the models here has one: the random PET-MAD-shaped ones have the heads and no LLPR,
    the demo model the heads and an LLPR of its energy only), the conservative one the energy ensemble."""
    tiny = random_pet("tiny", seed=3, atomic_types=[1, 8, 78])
    direct = quiet_calculator(tiny, non_conservative=True)
    for method in ("get_forces_ensemble", "get_forces_uncertainty"):
        with pytest.raises(NotImplementedError, match="non-conservative force uncertainty/ensemble is not available"):
            getattr(direct, method)(pt)
    with pytest.raises(NotImplementedError, match="non-conservative stress uncertainty/ensemble is not available"):
        direct.get_stress_ensemble(pt)
    with pytest.raises(NotImplementedError, match="energy ensemble is required for the stress ensemble"):
        quiet_calculator(tiny).get_stress_uncertainty(pt)
    with pytest.raises(NotImplementedError, match="non-conservative force uncertainty/ensemble"):
        demo().get_forces_ensemble(pt, non_conservative=True)
    with pytest.raises(ValueError, match="non_conservative is None, True or False"):
        demo().get_forces_ensemble(pt, non_conservative="forces")
    with pytest.raises(ValueError, match="no atoms given and none calculated yet"):
        demo().get_forces_uncertainty()


def catch(function):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        function()
    return [str(warning.message) for warning in caught]


@pytest.mark.parametrize("engine", ["lean", "metatomic"])
def test_the_threshold_warns_for_the_atoms_above_it(engine):
    """metatomic-ase's check: the demo model's per-atom sigma is ~0.2 eV in water (up to
    ~0.5): upet's default 0.1 eV names every atom, the median sigma the atoms above it, 1 eV
    none; None checks nothing. evaluate checks every structure."""
    atoms = water_box(8, seed=1)
    sigma = demo().get_energy_uncertainty(atoms, per_atom=True)
    assert sigma.min() > 0.1 and sigma.max() < 1.0
    middle = round(float(np.median(sigma)), 3)
    for threshold, expected in [(0.1, np.arange(len(atoms))), (middle, np.where(sigma > middle)[0])]:
        calc = demo(engine=engine, uncertainty_threshold=threshold)
        assert calc.supports_uncertainty and 0 < len(expected)
        atoms.calc = calc
        (message,) = catch(atoms.get_forces)
        listed = " ".join(map(str, expected))
        assert f"larger than the threshold of {threshold} eV" in message and f"atoms [{listed}]." in message
    calc = TCPETCalculator("pet-demo-chgnet", precision="fp32", device="cpu", progress=False, engine=engine)
    assert calc.uncertainty_threshold == 0.1  # upet's default
    (message,) = catch(lambda: calc.evaluate([atoms, atoms.copy()], ["energy"]))
    assert "structure 0: atoms [" in message and "structure 1: atoms [" in message
    (message,) = catch(lambda: calc.evaluate([atoms] * 10, ["energy"]))  # many: the first 4 named
    assert "10 of 10 structures (structure 0: atoms [" in message and "structure 3: atoms [" in message
    assert "structure 4:" not in message and message.endswith("; and 6 more).")
    (message,) = catch(lambda: calc.evaluate([water_box(64, seed=1)], ["energy"]))  # 192 atoms, all above 0.1 eV
    assert message.endswith(f"atoms [{' '.join(map(str, range(32)))} ... and 160 more].")
    for threshold in (1.0, None):
        atoms.calc = demo(engine=engine, uncertainty_threshold=threshold)
        assert catch(atoms.get_potential_energy) == []
    assert not demo(uncertainty_threshold=None).supports_uncertainty  # upet says so too


def test_the_threshold_is_checked_when_averaging():
    atoms = water_box(8, seed=1)
    middle = round(float(np.median(demo().get_energy_uncertainty(atoms, per_atom=True))), 3)
    atoms.calc = demo(uncertainty_threshold=middle, rotational_average_order=2)
    (message,) = catch(atoms.get_potential_energy)
    assert f"threshold of {middle} eV" in message and "energy_rot_std" in atoms.calc.results


@pytest.mark.parametrize("threshold", [0, -0.1, float("nan"), float("inf"), "0.1", True])
def test_a_bad_threshold_is_refused_before_the_model_loads(threshold):
    with pytest.raises(ValueError, match="uncertainty_threshold"):
        TCPETCalculator("no-such-model.ckpt", uncertainty_threshold=threshold)


def test_a_model_without_uncertainty_ignores_the_threshold():
    """As upet (metatomic-ase): no uncertainty to check, no warning, no error."""
    calc = quiet_calculator(random_pet("tiny", seed=3, atomic_types=[1, 8]), uncertainty_threshold=0.01)
    atoms = water_box(8, seed=1)
    atoms.calc = calc
    assert catch(atoms.get_forces) == [] and not calc.supports_uncertainty


# --- on the GPU (pytest -m gpu tests; skipped without CUDA) ---

METHODS = ("get_forces_ensemble", "get_forces_uncertainty", "get_stress_ensemble", "get_stress_uncertainty")


@pytest.mark.gpu
def test_the_ensembles_on_tensor_cores_are_fp32_accurate():
    """Each new method with the default calculator on the GPU (its FP32-accurate precision,
    packed rows; the ensemble's step eager between CUDA-graph steps) is as far from the
    float64 model as an FP32 calculator's (4x margin: a handful of roundings apart); forces
    replayed from the graph after the ensemble calls are the FP32 calculator's."""
    atoms = water_box(32, seed=2)
    exact = demo(dtype="float64", device="cuda")
    fp32 = demo(device="cuda")
    default = TCPETCalculator("pet-demo-chgnet", device="cuda", progress=False, uncertainty_threshold=None)
    moved = atoms.copy()
    moved.calc = default
    moved.get_forces()  # a forces step recorded as a CUDA graph
    assert_as_accurate_as_fp32(atoms, METHODS, exact, fp32, default)
    moved.positions[0, 0] += 1e-3
    assert close(moved.get_forces(), fp32.get_forces(moved), 1e-4)


@pytest.mark.gpu
def test_the_threshold_on_the_gpu_names_the_atoms_float64_does():
    """The check in the step (replayed from a CUDA graph) names the atoms whose float64
    per-atom uncertainty is above the threshold (none within FP32's error of it here)."""
    atoms = water_box(32, seed=2)
    sigma = demo(dtype="float64", device="cuda").get_energy_uncertainty(atoms, per_atom=True)
    threshold = 0.5
    assert np.abs(sigma - threshold).min() > 1e-4 and (sigma > threshold).any()
    calc = TCPETCalculator("pet-demo-chgnet", device="cuda", progress=False, uncertainty_threshold=threshold)
    for step in range(3):  # the first records the graph, the others replay it
        moved = atoms.copy()
        moved.positions += 1e-6 * step  # a new calculation each time (sigma moves by ~1e-7 eV)
        moved.calc = calc
        (message,) = [text for text in catch(moved.get_forces) if "energy uncertainties" in text]  # (GPU notes aside)
        named = " ".join(map(str, np.where(sigma > threshold)[0]))
        assert f"for atoms [{named}]." in message
