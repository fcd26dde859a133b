"""check_consistency (upet's and metatomic-ase's keyword): each evaluation's inputs and
outputs checked; a stale neighbor list or a non-finite result is an error, not a wrong force."""

import numpy as np
import pytest

from ase_tcfp32 import TCPETCalculator
from ase_tcfp32._consistency import ConsistencyError
from ase_tcfp32.validation import water_box


def calculator(**options):
    return TCPETCalculator("pet-demo-chgnet", device="cpu", progress=False, uncertainty_threshold=None, **options)


@pytest.mark.parametrize("engine", ["lean", "metatomic"])
def test_checked_evaluations_give_the_unchecked_results(engine):
    atoms = water_box(8, seed=1)
    plain = calculator(engine=engine).evaluate([atoms])[0]
    checked = calculator(engine=engine, check_consistency=True).evaluate([atoms])[0]
    for key in ("energy", "forces", "stress"):
        assert np.abs(np.asarray(checked[key]) - plain[key]).max() <= 1e-6 * max(1.0, np.abs(plain[key]).max())


def test_a_stale_neighbor_list_is_caught(monkeypatch):
    """A Verlet list that is not rebuilt after atoms moved past half its skin misses pairs:
    with check_consistency it is an error (without, it would be wrong forces)."""
    atoms = water_box(8, seed=1)
    calc = calculator(check_consistency=True, neighbor_skin=0.5)
    atoms.calc = calc
    atoms.get_forces()
    monkeypatch.setattr(type(calc._engine.neighbors), "stale", lambda self, batch, reach=0.5: False)
    atoms.positions[0] += [1.5, 0.0, 0.0]  # far past half the skin
    with pytest.raises(ConsistencyError, match=r"lacks \d+ pair\(s\) within the model's cutoff"):
        atoms.get_forces()


def test_bad_values_are_refused():
    with pytest.raises(TypeError, match="check_consistency is True or False"):
        calculator(check_consistency="yes")


@pytest.mark.gpu
def test_checked_evaluations_on_the_gpu():
    """The lean engine's list lives on the GPU (and its step in a CUDA graph): the check reads
    it back and passes for a correct list, in MD-like repeated calls."""
    atoms = water_box(64, seed=3)
    calc = TCPETCalculator("pet-demo-chgnet", device="cuda", progress=False, check_consistency=True)
    atoms.calc = calc
    for _ in range(3):
        atoms.positions += np.random.default_rng(0).normal(scale=0.05, size=atoms.positions.shape)
        assert np.isfinite(atoms.get_forces()).all()
    assert calc._engine.cuda_graphs
