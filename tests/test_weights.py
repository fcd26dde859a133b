"""The engines' weighted energies (``compute(..., weights=...)``): the energy is the weighted
sum of the per-atom energies and the forces and stress are its derivatives, in both engines
(what a LAMMPS rank needs: its owned atoms weighted 1, its ghosts 0; ase_tcfp32.lammps)."""

import warnings

import numpy as np
import pytest

from ase_tcfp32 import TCPETCalculator
from ase_tcfp32.validation import water_box

EPS64 = float(np.finfo(np.float64).eps)

pytestmark = pytest.mark.usefixtures("one_thread")  # small evaluations on 2 shared cores


def float64_engine(engine: str):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return TCPETCalculator("pet-demo-chgnet", dtype="float64", device="cpu", engine=engine, progress=False)._engine


@pytest.fixture(scope="module")
def engines():
    return {name: float64_engine(name) for name in ("lean", "metatomic")}


@pytest.mark.parametrize("engine", ["lean", "metatomic"])
def test_forces_are_the_gradient_of_the_weighted_energy(engines, engine):
    atoms = water_box(8, seed=2)
    atoms.pbc = False  # a cluster, as a LAMMPS rank's domain and ghosts
    weights = np.random.default_rng(0).uniform(0.0, 1.0, len(atoms))
    weights[::3] = 0.0
    (result,) = engines[engine].compute([atoms], {"energy", "energies", "forces"}, weights=[weights])
    assert result["energy"] == pytest.approx((result["energies"] * weights).sum(), rel=1e-12)
    h = 1e-4  # central differences in FP64: truncation ~h^2 |E'''| and rounding ~1e-16 |E| / h, both < 1e-7
    for atom, axis in ((0, 0), (4, 1), (13, 2)):  # a zero-weight oxygen, a hydrogen, an atom of weight > 0
        shifted = []
        for sign in (1, -1):
            moved = atoms.copy()
            moved.positions[atom, axis] += sign * h
            shifted.append(engines[engine].compute([moved], {"energy"}, weights=[weights])[0]["energy"])
        assert -(shifted[0] - shifted[1]) / (2 * h) == pytest.approx(result["forces"][atom, axis], abs=1e-6)


def test_weighted_results_agree_between_engines_and_ones_give_the_plain_ones(engines):
    atoms = water_box(8, seed=4)
    weights = np.zeros(len(atoms))
    weights[:10] = 1.0
    lean, metatomic = (
        engines[name].compute([atoms], {"energy", "forces", "stress"}, weights=[weights])[0]
        for name in ("lean", "metatomic")
    )
    # both engines evaluate the same float64 arithmetic in other orders: rounding-level differences
    for key in ("energy", "forces", "stress"):
        scale = np.abs(metatomic[key]).max()
        assert np.abs(lean[key] - metatomic[key]).max() <= 1e3 * EPS64 * scale, key
    assert np.abs(lean["forces"]).max() > 0.1  # not trivially zero
    plain = engines["lean"].compute([atoms], {"energy", "forces", "stress"})[0]
    ones = engines["lean"].compute([atoms], {"energy", "forces", "stress"}, weights=[np.ones(len(atoms))])[0]
    assert ones["energy"] == pytest.approx(plain["energy"], abs=1e-10)
    assert np.abs(ones["forces"] - plain["forces"]).max() < 1e-12
    assert np.abs(ones["stress"] - plain["stress"]).max() < 1e-13


@pytest.mark.gpu
def test_weights_through_replayed_cuda_graphs_and_pieces(engines):
    """A rank's cluster on the GPU: the weights are an input of the recorded CUDA graph
    (changed between replays, as owned atoms change) and of the evaluation in pieces; the
    default precision within FP32's error of the float64 results."""
    atoms = water_box(64, seed=6)
    atoms.pbc = False
    rng = np.random.default_rng(1)
    graphs = TCPETCalculator("pet-demo-chgnet", device="cuda", progress=False, uncertainty_threshold=None)._engine
    pieces = TCPETCalculator(
        "pet-demo-chgnet", device="cuda", progress=False, uncertainty_threshold=None, piece_atoms=50
    )._engine
    for _ in range(3):
        weights = (rng.uniform(size=len(atoms)) < 0.5).astype(float)
        exact = engines["lean"].compute([atoms], {"energy", "forces"}, weights=[weights])[0]
        scale = np.abs(exact["forces"]).max()
        for engine in (graphs, pieces):
            result = engine.compute([atoms], {"energy", "forces"}, weights=[weights])[0]
            assert result["energy"] == pytest.approx(exact["energy"], rel=1e-5)
            assert np.abs(result["forces"] - exact["forces"]).max() <= 1e-4 * scale
    assert graphs.cuda_graphs and graphs.recordings == 1
