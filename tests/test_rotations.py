"""Rotational averaging (ase_tcfp32._rotations): metatomic-ase's quadrature and averages,
evaluated through batched calls, and what it is for: predictions that no longer depend on
the orientation of the input."""

import math

import ase.build
import numpy as np
import pytest
import torch
from ase.calculators.calculator import all_changes
from ase.calculators.lj import LennardJones
from metatomic_ase import MetatomicCalculator, SymmetrizedCalculator
from metatomic_ase._symmetry import _choose_quadrature, _compute_rotational_average, _get_quadrature
from scipy.spatial.transform import Rotation

from ase_tcfp32 import TCPETCalculator
from ase_tcfp32._rotations import MAX_ORDER, average, evaluate_averaged, quadrature, rotated, whole_batches

pytestmark = pytest.mark.usefixtures("one_thread")  # small evaluations on 2 shared cores


@pytest.fixture(scope="module")
def demo():
    return TCPETCalculator(
        "pet-demo-chgnet", device="cpu", precision="fp32", progress=False, uncertainty_threshold=None
    )


@pytest.fixture
def h2o():
    atoms = ase.build.molecule("H2O")
    atoms.center(vacuum=3.0)
    atoms.rattle(0.05, seed=3)
    return atoms


def counting(evaluate):
    """``evaluate``, counting its calls and the structures it saw."""

    def wrapped(structures):
        wrapped.calls.append(len(structures))
        return evaluate(structures)

    wrapped.calls = []
    return wrapped


# -- the quadrature ------------------------------------------------------------------


@pytest.mark.parametrize("inversion", [True, False])
@pytest.mark.parametrize("order", [1, 2, 3, 5, 8])
def test_quadrature_is_orthogonal_matrices_with_normalized_weights(order, inversion):
    rotations, weights = quadrature(order, inversion)
    assert rotations.dtype == weights.dtype == np.float64
    assert rotations.shape == (len(weights), 3, 3)
    assert weights.sum() == pytest.approx(1.0, abs=1e-14)
    assert (weights > 0).all()
    assert np.abs(rotations @ rotations.transpose(0, 2, 1) - np.eye(3)).max() < 1e-13
    det = np.linalg.det(rotations)
    assert np.abs(np.abs(det) - 1).max() < 1e-13
    if inversion:
        assert (det < 0).sum() == (det > 0).sum() == len(det) // 2
        assert weights[det < 0].sum() == pytest.approx(0.5)
    else:
        assert (det > 0).all()


@pytest.mark.parametrize("order, count", [(1, 6 * 3 * 2), (3, 6 * 7 * 2), (5, 14 * 11 * 2), (7, 26 * 15 * 2)])
def test_quadrature_size(order, count):
    assert len(quadrature(order)[0]) == count
    assert len(quadrature(order, inversion=False)[0]) == count // 2


@pytest.mark.parametrize("order", [2, 3, 5, 11])
def test_quadrature_is_metatomic_ases(order):
    rotations, weights = quadrature(order)
    expected, expected_weights = _get_quadrature(*_choose_quadrature(order), True)
    np.testing.assert_allclose(rotations, expected, rtol=0, atol=1e-15)
    np.testing.assert_allclose(weights, expected_weights / expected_weights.sum(), rtol=1e-14)


@pytest.mark.parametrize("order", [0, -1, MAX_ORDER + 1, 2.0, True, None])
def test_quadrature_refuses_orders_outside_the_lebedev_range(order):
    with pytest.raises(ValueError, match=f"from 1 to {MAX_ORDER}"):
        quadrature(order)


@pytest.mark.parametrize("inversion", [True, False])
@pytest.mark.parametrize("order", [1, 2, 3, 5])
def test_quadrature_integrates_low_degree_polynomials_of_r_exactly(order, inversion):
    """Haar averages: <R> = 0 and <R_ij R_kl> = delta_ik delta_jl / 3 (a quadrature of order 1
    is already exact to degree 2: 3 in-plane angles and the 6-node grid); on SO(3) and from
    order 3, the third moment <R_ij R_kl R_mn> = eps_ikm eps_jln / 6."""
    rotations, weights = quadrature(order, inversion)
    first = np.einsum("b,bij->ij", weights, rotations)
    assert np.abs(first).max() < 1e-14
    second = np.einsum("b,bij,bkl->ijkl", weights, rotations, rotations)
    assert np.abs(second - np.einsum("ik,jl->ijkl", np.eye(3), np.eye(3)) / 3).max() < 1e-14
    third = np.einsum("b,bij,bkl,bmn->ijklmn", weights, rotations, rotations, rotations)
    if inversion:
        assert np.abs(third).max() < 1e-14  # odd under R -> -R
    elif order >= 3:
        eps = np.zeros((3, 3, 3))
        eps[0, 1, 2] = eps[1, 2, 0] = eps[2, 0, 1] = 1
        eps[0, 2, 1] = eps[2, 1, 0] = eps[1, 0, 2] = -1
        assert np.abs(third - np.einsum("ikm,jln->ijklmn", eps, eps) / 6).max() < 1e-14


# -- copies and averages -------------------------------------------------------------


def test_rotated_copies_rotate_positions_and_cell_and_wrap(water):
    rotations = quadrature(1)[0][[1, 20, 35]]
    for rotation, copy in zip(rotations, rotated(water, rotations), strict=True):
        np.testing.assert_allclose(copy.cell.array, water.cell.array @ rotation.T, atol=1e-12)
        scaled = copy.get_scaled_positions(wrap=False)
        assert (scaled >= -1e-12).all() and (scaled < 1 + 1e-12).all()
        shift = copy.positions - water.positions @ rotation.T  # whole lattice vectors only
        lattice = np.linalg.solve(copy.cell.array.T, shift.T).T
        np.testing.assert_allclose(lattice, np.round(lattice), atol=1e-9)
    assert copy.calc is None and water.positions is not copy.positions


def test_rotated_copies_are_ases_wrap_of_each_rotation():
    """All copies at once give what rotating one copy at a time and ASE's ``wrap`` give,
    also for a triclinic cell periodic along two of its vectors."""
    slab = ase.build.fcc111("Pt", (2, 2, 3), vacuum=4.0, a=3.9)
    slab.set_cell(slab.cell.array + [[0, 0, 0], [0.7, 0, 0], [0.3, 0.2, 0]], scale_atoms=False)
    slab.rattle(0.3, seed=2)
    rotations = quadrature(3)[0]
    for rotation, copy in zip(rotations, rotated(slab, rotations), strict=True):
        expected = slab.copy()
        expected.positions = expected.positions @ rotation.T
        expected.set_cell(expected.cell.array @ rotation.T, scale_atoms=False)
        expected.wrap()
        np.testing.assert_allclose(copy.positions, expected.positions, atol=1e-10)
        np.testing.assert_allclose(copy.cell.array, expected.cell.array, atol=1e-12)


def test_average_of_an_exactly_invariant_model_is_its_prediction():
    """Lennard-Jones is invariant: every back-rotated copy agrees, so the averages are the
    unrotated prediction (stress in Voigt order) and the spreads vanish."""
    atoms = ase.build.bulk("Ar", "fcc", a=5.2) * (2, 1, 1)
    atoms.rattle(0.1, seed=4)
    lj = LennardJones(sigma=3.4, epsilon=0.01, rc=6.0, smooth=True)

    def evaluate(structures):
        results = []
        for copy in structures:
            lj.calculate(copy, ["energy", "energies", "forces", "stress"])
            results.append({**lj.results, "free_energy": lj.results["energy"]})
        return results

    reference = evaluate([atoms])[0]
    out = evaluate_averaged(evaluate, atoms, order=2)
    assert set(out) == {
        "energy",
        "free_energy",
        "energies",
        "forces",
        "stress",
        "energy_rot_std",
        "energies_rot_std",
        "forces_rot_std",
        "stress_rot_std",
    }
    assert out["energy"] == pytest.approx(reference["energy"], rel=1e-12)
    assert out["free_energy"] == out["energy"]
    np.testing.assert_allclose(out["energies"], reference["energies"], rtol=1e-12)
    np.testing.assert_allclose(out["forces"], reference["forces"], atol=1e-12)
    assert out["stress"].shape == (6,) and out["stress_rot_std"].shape == (3, 3)
    np.testing.assert_allclose(out["stress"], reference["stress"], atol=1e-12)
    assert np.abs(reference["forces"]).max() > 1e-3 and np.abs(reference["stress"]).max() > 1e-5
    for key in ("energy", "energies", "forces", "stress"):
        assert np.max(out[f"{key}_rot_std"]) < 1e-10


def test_average_is_metatomic_ases_on_the_same_results(water):
    """Arbitrary per-copy results: our average (Voigt stress in and out) is metatomic-ase's
    (3 x 3 stress), every key and spread."""
    rng = np.random.default_rng(5)
    rotations, weights = quadrature(2)
    count, n = len(rotations), len(water)
    full = rng.normal(size=(count, 3, 3))
    full = full + full.transpose(0, 2, 1)
    raw = {
        "energy": list(rng.normal(size=count)),
        "energies": rng.normal(size=(count, n)),
        "forces": rng.normal(size=(count, n, 3)),
        "stress": full,
    }
    results = [
        {
            "energy": raw["energy"][k],
            "energies": raw["energies"][k],
            "forces": raw["forces"][k],
            "stress": ase.stress.full_3x3_to_voigt_6_stress(full[k]),
        }
        for k in range(count)
    ]
    ours = average(results, rotations, weights, water)
    theirs = _compute_rotational_average(raw, rotations, weights, True)
    assert set(ours) == set(theirs)
    for key, value in theirs.items():
        expected = ase.stress.full_3x3_to_voigt_6_stress(value) if key == "stress" else value
        np.testing.assert_allclose(ours[key], expected, rtol=1e-12, atol=1e-14, err_msg=key)


def test_average_needs_one_result_per_rotation(water):
    rotations, weights = quadrature(1)
    with pytest.raises(ValueError, match="need one each"):
        average([{"energy": 0.0}] * 3, rotations, weights, water)


# -- with the demo model ---------------------------------------------------------------


def test_matches_metatomic_ases_symmetrized_calculator(demo, ethanol):
    ours = evaluate_averaged(demo.evaluate, ethanol, order=3)
    reference = ethanol.copy()
    metatomic = MetatomicCalculator(demo.pet.export(), device="cpu", uncertainty_threshold=None)
    reference.calc = SymmetrizedCalculator(metatomic, l_max=3, store_rotational_std=True)
    reference.calc.calculate(reference, ["energy", "energies", "forces"], all_changes)
    theirs = reference.calc.results
    assert {key for key in ours if key.endswith("_rot_std")} == {key for key in theirs if key.endswith("_rot_std")}
    assert ours["energy"] == pytest.approx(theirs["energy"], rel=1e-6)
    assert np.abs(ours["energies"] - theirs["energies"]).max() < 1e-5
    assert np.abs(ours["forces"] - theirs["forces"]).max() < 1e-5
    assert ours["energy_rot_std"] > 1e-3  # the model is not invariant: something was averaged
    assert ours["energy_rot_std"] == pytest.approx(theirs["energy_rot_std"], rel=1e-4)
    for key in ("energies_rot_std", "forces_rot_std"):
        assert np.abs(ours[key] - theirs[key]).max() < 1e-5, key


def spreads(demo, atoms, order, count=6, seed=0):
    """Over ``count`` random rotations of ``atoms``: the spread (max - min) of the plain and
    of the averaged energy (eV), and the largest deviation of the plain and averaged forces,
    brought back to the frame of ``atoms``, from their mean over the inputs (eV/Å)."""
    turns = Rotation.random(count, random_state=seed).as_matrix()
    inputs = rotated(atoms, turns)
    plain = demo.evaluate(inputs)
    averaged = [evaluate_averaged(demo.evaluate, copy, order) for copy in inputs]

    def spread(results):
        energies = [r["energy"] for r in results]
        forces = np.array([r["forces"] @ turn for r, turn in zip(results, turns, strict=True)])
        return np.ptp(energies), np.abs(forces - forces.mean(axis=0)).max()

    return spread(plain), spread(averaged)


def test_averaging_makes_a_molecule_orientation_independent(demo, h2o):
    """Order 5 on a water molecule, 6 random orientations of the input. Measured (CPU, FP32):
    the energy's spread drops from 3.65 meV to 1.8e-7 eV (about 20,000x), the forces' largest
    deviation from 0.051 to 4.2e-6 eV/Å (about 12,000x); bound 10x. (Ethanol, the same way:
    38.7 meV to 6.9e-7 eV, 56,000x; forces 15,000x; 5x the time, so not here.)"""
    (energy, forces), (energy_averaged, forces_averaged) = spreads(demo, h2o, order=5)
    assert energy > 1e-4  # the model alone is measurably not invariant
    assert energy_averaged * 10 <= energy
    assert forces_averaged * 10 <= forces


@pytest.mark.gpu
def test_averaging_makes_a_water_box_orientation_independent(water192):
    """Order 5 on 192 water atoms, 6 random orientations of the input (cell rotated with the
    atoms), on the GPU in FP32 (6 x 308 copies of 192 periodic atoms: minutes on a CPU).
    Measured on the H200: the energy's spread drops from 26.9 meV to 9.2e-7 eV (about
    29,000x), the forces' largest deviation from 0.034 to 1.5e-5 eV/Å (about 2,300x);
    bound 10x."""
    demo = TCPETCalculator(
        "pet-demo-chgnet", device="cuda", precision="fp32", progress=False, uncertainty_threshold=None
    )
    (energy, forces), (energy_averaged, forces_averaged) = spreads(demo, water192, order=5)
    print(
        f"192 water atoms: energy spread {energy:.3g} -> {energy_averaged:.3g} eV, forces {forces:.3g} -> {forces_averaged:.3g} eV/Å"
    )
    assert energy > 1e-4
    assert energy_averaged * 10 <= energy
    assert forces_averaged * 10 <= forces


def test_the_uncertainty_threshold_is_checked_in_the_averaged_evaluation(h2o):
    """The per-atom energy uncertainty comes from the rotated copies' own batched evaluation
    (each atom's largest over the copies), not from an evaluation of its own: one warning,
    one model call."""
    calc = TCPETCalculator(
        "pet-demo-chgnet",
        device="cpu",
        precision="fp32",
        progress=False,
        rotational_average_order=1,
        uncertainty_threshold=0.01,
    )
    compute, calls = calc._compute, []
    calc._compute = lambda structures, properties: calls.append(len(structures)) or compute(structures, properties)
    h2o.calc = calc
    with pytest.warns(
        UserWarning, match=r"threshold of 0.01 eV. The prediction is above the threshold for atoms \[0 1 2\]"
    ):
        h2o.get_potential_energy()
    assert calls == [len(quadrature(1)[0])]
    h2o.positions[0, 0] += 1e-3
    sigmas = [r["energy_uncertainty"] for r in compute(rotated(h2o, quadrature(1)[0]), ["energy_uncertainty"])]
    largest = np.sort(np.max(sigmas, 0))
    calc.uncertainty_threshold = float(largest[-2:].mean())  # between the atoms' two largest: the top one warns
    with pytest.warns(UserWarning, match=rf"atoms \[{int(np.argmax(np.max(sigmas, 0)))}\]\."):
        h2o.get_potential_energy()


# -- batches -------------------------------------------------------------------------


def test_batches_give_the_same_average_in_one_call_each(demo, h2o):
    order = 2
    count = len(quadrature(order)[0])  # 6 x 5 x 2 = 60
    whole, batched = counting(demo.evaluate), counting(demo.evaluate)
    at_once = evaluate_averaged(whole, h2o, order)
    in_batches = evaluate_averaged(batched, h2o, order, batch_size=7)
    assert whole.calls == [count]
    assert len(batched.calls) == math.ceil(count / 7) and sum(batched.calls) == count
    assert set(at_once) == set(in_batches)
    for key, value in at_once.items():
        np.testing.assert_allclose(in_batches[key], value, rtol=1e-6, atol=1e-6, err_msg=key)


@pytest.mark.parametrize(
    "count, size, whole, expected",
    [(308, 192, None, 308), (308, 192, 80_000, 308), (308, 192, 41_700, 154), (308, 192, 20_000, 103), (10, 50, 30, 1)],
)
def test_copies_that_would_go_into_pieces_come_in_the_fewest_equal_batches_that_fit(count, size, whole, expected):
    assert whole_batches(count, size, whole) == expected


def test_the_calculator_batches_copies_that_would_go_into_pieces(h2o):
    """By default the copies go through one call, or where that many atoms would be evaluated
    in pieces (``piece_atoms``, by default what the GPU's memory holds whole), through the
    fewest equal calls that each evaluate whole: the same average."""
    averages = {}
    for piece_atoms in (0, 100):
        calc = TCPETCalculator(
            "pet-demo-chgnet", device="cpu", precision="fp32", progress=False, uncertainty_threshold=None,
            rotational_average_order=2, piece_atoms=piece_atoms, engine="lean",
        )  # fmt: skip
        compute, calls = calc._engine.compute, []
        calc._engine.compute = lambda structures, *args: calls.append(len(structures)) or compute(structures, *args)
        atoms = h2o.copy()
        atoms.calc = calc
        forces = atoms.get_forces()  # one averaged evaluation gives both
        averages[piece_atoms] = atoms.get_potential_energy(), forces
        count = len(quadrature(2)[0])  # 60 copies of 3 atoms: 180 atoms, in pieces above 100
        assert calls == ([count] if piece_atoms == 0 else [30, 30])
    assert averages[100][0] == pytest.approx(averages[0][0], rel=1e-6, abs=1e-6)
    np.testing.assert_allclose(averages[100][1], averages[0][1], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("batch_size", [0, -3, 2.5])
def test_batch_size_must_be_a_positive_integer(h2o, batch_size):
    with pytest.raises(ValueError, match="positive integer"):
        evaluate_averaged(lambda structures: [], h2o, 1, batch_size=batch_size)


def test_out_of_memory_advises_smaller_batches_or_order(h2o):
    def evaluate(structures):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    with pytest.raises(torch.OutOfMemoryError, match="rotational_average_batch_size") as error:
        evaluate_averaged(evaluate, h2o, 3, batch_size=20)
    assert "rotational_average_order" in str(error.value) and "2.00 GiB" in str(error.value)
    assert "20 rotated copies" in str(error.value)
