"""Multiple time stepping with direct forces (ase_tcfp32.mts) on CPU: a tiny random
PET-MAD-shaped model (random direct heads: its direct forces differ from the conservative
ones by as much as the forces themselves, the hard case) on a box of 8 water molecules.

Bounds: over a time ``t`` the correction ``F_c - F_d`` moves an atom of mass ``m`` by about
``t² |F_c - F_d| / (2 m)``; dynamics on the direct forces alone miss it (measured: 0.99 of
it), r-RESPA applies it as impulses whose error is of third order in the outer step
(measured: at most 0.045 of it over 1 to 3 outer steps of 4 × 0.25 fs): bound 0.1."""

import copy
import warnings

import numpy as np
import pytest
from ase import units
from ase.calculators.emt import EMT
from ase.io import Trajectory
from ase.md.velocitydistribution import Stationary, thermalize_momenta
from ase.md.verlet import VelocityVerlet
from helpers import quiet_calculator as calculator

from ase_tcfp32 import TCPETCalculator
from ase_tcfp32.mts import MTSLangevin, MTSVelocityVerlet
from ase_tcfp32.testing import random_pet
from ase_tcfp32.validation import water_box

BOTH = ["energy", "forces", "non_conservative_forces"]


@pytest.fixture(scope="module")
def pet():
    return random_pet("tiny", seed=3, atomic_types=[1, 8])


@pytest.fixture
def water():
    """8 water molecules at 300 K, no net momentum."""
    atoms = water_box(8, seed=1)
    thermalize_momenta(atoms, temperature_K=300, rng=np.random.default_rng(0))
    Stationary(atoms)
    return atoms


def drift_warnings(dyn, steps: int) -> list[str]:
    """The energy check's warnings while ``dyn`` runs ``steps`` steps."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dyn.run(steps)
    return [str(w.message) for w in caught if "does not conserve energy" in str(w.message)]


def with_calculator(atoms, calc):
    atoms = atoms.copy()
    atoms.calc = calc
    return atoms


def test_one_inner_step_is_velocity_verlet(pet, water):
    """M = 1: the slow and fast half kicks add up to velocity Verlet's conservative one, to
    rounding, at every step."""
    plain = with_calculator(water, calculator(pet))
    mts = with_calculator(water, calculator(pet))
    verlet, respa = VelocityVerlet(plain, 0.5 * units.fs), MTSVelocityVerlet(mts, 0.5 * units.fs, inner_steps=1)
    for _ in range(4):
        verlet.run(1)
        respa.run(1)
        assert np.abs(mts.positions - plain.positions).max() < 1e-12
        assert np.abs(mts.get_momenta() - plain.get_momenta()).max() < 1e-12
        assert mts.get_potential_energy() == pytest.approx(plain.get_potential_energy(), abs=1e-12)


def test_inner_steps_follow_velocity_verlet_with_the_correction(pet, water):
    """M = 4, 0.25 fs inner steps: after each outer step, positions are those of velocity
    Verlet on the conservative forces (0.25 fs steps) within a tenth of the displacement the
    correction makes (module doc), where velocity Verlet on the direct forces misses most of it."""
    dt, inner = 0.25 * units.fs, 4
    forces = calculator(pet).evaluate([water], BOTH)[0]
    correction = np.abs(forces["forces"] - forces["non_conservative_forces"]).max()
    plain = with_calculator(water, calculator(pet))
    mts = with_calculator(water, calculator(pet))
    direct = with_calculator(water, calculator(pet, non_conservative="forces"))
    runs = VelocityVerlet(plain, dt), MTSVelocityVerlet(mts, dt, inner_steps=inner), VelocityVerlet(direct, dt)
    for outer in range(1, 4):
        runs[0].run(inner)
        runs[1].run(1)
        runs[2].run(inner)
        displacement = 0.5 * (outer * inner * dt) ** 2 * correction / water.get_masses().min()
        assert np.abs(mts.positions - plain.positions).max() < 0.1 * displacement
        assert np.abs(direct.positions - plain.positions).max() > 0.5 * displacement
    assert runs[1].get_time() == pytest.approx(3 * inner * dt)


def test_energy_is_conserved(pet, water):
    """The conservative energy over 10 outer steps of 4 × 0.25 fs (10 fs): it varies by 7e-4
    of the kinetic energy (velocity Verlet: 6e-5); on the direct forces alone, by 700 times
    more (their work is not the energy's change)."""
    dt = 0.25 * units.fs
    mts = with_calculator(water, calculator(pet))
    direct = with_calculator(water, calculator(pet, non_conservative="forces"))
    reference = calculator(pet)
    runs = [(MTSVelocityVerlet(mts, dt, inner_steps=4), mts, 1), (VelocityVerlet(direct, dt), direct, 4)]
    spans = []
    for dyn, atoms, every in runs:
        energies = []
        dyn.attach(lambda a=atoms: energies.append(reference.get_potential_energy(a) + a.get_kinetic_energy()), every)
        dyn.run(10 * every)
        spans.append(np.ptp(energies))
    kinetic = water.get_kinetic_energy()
    assert spans[0] < 2e-3 * kinetic
    assert spans[1] > 10 * spans[0]


def test_cost_logger_trajectory_and_cached_results(pet, water, tmp_path):
    """One outer step of M inner steps costs M evaluations (M - 1 direct, one of both
    kinds); the logger, trajectories and atoms.get_potential_energy() read the conservative
    model's results of the last one without evaluating again; one step is M inner steps of time."""
    calc = calculator(pet)
    atoms = with_calculator(water, calc)
    dt = 0.5 * units.fs
    trajectory = tmp_path / "md.traj"
    dyn = MTSVelocityVerlet(atoms, dt, inner_steps=4, logfile=tmp_path / "md.log", trajectory=str(trajectory))
    seen = []
    dyn.attach(lambda: seen.append(atoms.get_potential_energy()))
    dyn.run(3)
    assert calc._engine.evaluations == 1 + 3 * 4  # the first one before the first step
    assert dyn.dt == pytest.approx(4 * dt) and dyn.get_time() == pytest.approx(12 * dt)
    expected = calculator(pet).evaluate([atoms], ["energy", "forces"])[0]
    assert seen[-1] == pytest.approx(expected["energy"], abs=1e-5)
    assert np.abs(atoms.get_forces() - expected["forces"]).max() < 1e-5
    assert calc._engine.evaluations == 13
    frames = Trajectory(trajectory)
    assert len(frames) == 4 and frames[-1].get_potential_energy() == pytest.approx(seen[-1])
    log = (tmp_path / "md.log").read_text().splitlines()
    assert len(log) == 5 and float(log[-1].split()[0]) == pytest.approx(12 * 0.5e-3)  # time in ps
    assert dyn.todict()["inner_steps"] == 4


def test_unusable_calculators_are_refused_before_any_step(pet, water):
    atoms = water.copy()
    atoms.calc = EMT()
    with pytest.raises(TypeError, match="needs atoms.calc to be a TCPETCalculator, not EMT"):
        MTSVelocityVerlet(atoms, units.fs)
    direct = calculator(pet, non_conservative="forces")
    atoms.calc = direct
    with pytest.raises(ValueError, match="built here with non_conservative='forces'"):
        MTSLangevin(atoms, units.fs, 300, 0.01 / units.fs)
    plain = copy.deepcopy(pet)
    plain.remove_output("non_conservative_force")
    atoms.calc = calculator(plain)
    with pytest.raises(ValueError, match="has no direct force head"):
        MTSVelocityVerlet(atoms, units.fs)
    assert atoms.calc._engine.evaluations == 0 and direct._engine.evaluations == 0
    atoms.calc = calculator(pet)
    with pytest.raises(ValueError, match="inner_steps is a whole number"):
        MTSVelocityVerlet(atoms, units.fs, inner_steps=0)


def test_langevin_reaches_its_temperature(pet, water):
    """From rest, 150 outer steps of 2 × 0.5 fs with a 5 fs relaxation time: the mean
    temperature of the last 120 is within 15% of 300 K. 72 degrees of freedom: one sample
    spreads by 17% of the temperature; the kinetic energy forgets in 1 / (2 friction) = 2.5 fs,
    so ~24 independent samples, a mean spread of 3.5%: 15% is 4 spreads (seeded: 8% off)."""
    atoms = with_calculator(water, calculator(pet))
    atoms.set_momenta(np.zeros_like(atoms.positions))
    dyn = MTSLangevin(atoms, 0.5 * units.fs, 300, 0.2 / units.fs, inner_steps=2, rng=np.random.default_rng(1))
    temperatures = []
    dyn.attach(lambda: temperatures.append(atoms.get_temperature()))
    dyn.run(150)
    assert np.mean(temperatures[-120:]) == pytest.approx(300, rel=0.15)
    assert dyn.todict()["temperature_K"] == 300


def test_a_run_that_does_not_conserve_energy_says_so_once(pet, water):
    """Random direct heads at M = 8, 0.5 fs inner steps: the total energy moves by ~1 meV/atom
    within 10 outer steps (measured), past a 0.4 meV/atom ``energy_drift_warning``: one warning,
    naming M and the outer step. Velocity Verlet (M = 1) over the same 40 fs moves it by 0.014
    meV/atom: no warning; ``energy_drift_warning=None``: none either."""

    def warnings_of(inner_steps: int, steps: int, **options) -> list[str]:
        atoms = with_calculator(water, calculator(pet))
        dyn = MTSVelocityVerlet(atoms, 0.5 * units.fs, inner_steps=inner_steps, **options)
        caught = drift_warnings(dyn, steps)
        assert dyn.initial_energy == pytest.approx(
            calculator(pet).get_potential_energy(water) + water.get_kinetic_energy(), abs=1e-5
        )
        return caught

    (message,) = warnings_of(8, 10, energy_drift_warning=4e-4)
    assert "M = 8, outer step 4 fs" in message and "meV/atom in 0.0" in message
    assert warnings_of(1, 80, energy_drift_warning=4e-4) == []
    assert warnings_of(8, 10, energy_drift_warning=None) == []
    with pytest.raises(ValueError, match="energy_drift_warning is more than 0"):
        MTSVelocityVerlet(with_calculator(water, calculator(pet)), units.fs, energy_drift_warning=0)


def test_the_energy_check_measures_from_a_reset(pet, water):
    """Momenta doubled between runs (the kinetic energy x4, 0.1 eV/atom more here): measured
    from the first step that is a drift and warns; with ``initial_energy`` reset it is not."""
    caught_by_reset = []
    for reset in (False, True):
        atoms = with_calculator(water, calculator(pet))
        dyn = MTSVelocityVerlet(atoms, 0.5 * units.fs, inner_steps=1)
        dyn.run(2)
        atoms.set_momenta(2 * atoms.get_momenta())
        if reset:
            dyn.initial_energy = None
        caught_by_reset.append(drift_warnings(dyn, 2))
    assert len(caught_by_reset[0]) == 1 and caught_by_reset[1] == []


@pytest.mark.gpu
def test_graphs_engine_records_each_kind_of_evaluation_once(tiny_ckpt):
    """On the GPU (engine="graphs"): the direct-only and the combined evaluations each
    replay their own recorded CUDA graph (two recordings for the run, not one per switch),
    and the trajectory is the eager lean engine's to FP32 rounding."""
    water = water_box(64, seed=0)
    thermalize_momenta(water, temperature_K=300, rng=np.random.default_rng(0))
    runs = {}
    for engine in ("graphs", "lean"):
        atoms = with_calculator(
            water, TCPETCalculator(tiny_ckpt, precision="tf32x3", device="cuda", engine=engine, check_accuracy=0)
        )
        MTSVelocityVerlet(atoms, 0.5 * units.fs, inner_steps=4).run(3)
        runs[engine] = atoms
    assert runs["graphs"].calc._engine.recordings <= 4  # 2 (4 after a widening); one per switch: 7
    assert np.abs(runs["graphs"].positions - runs["lean"].positions).max() < 1e-5


def seeded_dynamics(atoms, integrator: str, inner_steps: int, on_device: bool):
    """``MTSVelocityVerlet`` (``"verlet"``) or ``MTSLangevin`` (300 K, 0.05 / fs, seeded noise)
    with 0.5 fs inner steps, on the device or through ASE."""
    if integrator == "verlet":
        return MTSVelocityVerlet(atoms, 0.5 * units.fs, inner_steps=inner_steps, device_inner_steps=on_device)
    rng = np.random.default_rng(5)
    return MTSLangevin(atoms, 0.5 * units.fs, 300, 0.05 / units.fs, inner_steps, rng=rng, device_inner_steps=on_device)


@pytest.mark.parametrize("integrator", ["verlet", "langevin"])
def test_inner_steps_on_the_device_follow_the_ase_path(pet, water, integrator):
    """The inner steps and the outer evaluations run on the model's device (the default)
    give the trajectory of the same steps through ASE, one calculator call each: the same
    arithmetic in the same order on the same forces (bound: 1e-9 Å and amu·Å/fs, far below
    the FP32 rounding of the forces that a different order would show), with the same
    evaluations counted (a 2 Å skin: no neighbor list expires in these 10 fs), and the
    calculator holds the same results at the end (what ASE's ``get_*`` calls read)."""
    runs = []
    for on_device in (True, False):
        atoms = with_calculator(water, calculator(pet, neighbor_skin=2.0))
        dyn = seeded_dynamics(atoms, integrator, 4, on_device)
        dyn.run(5)
        runs.append(atoms)
        assert dyn.redone_steps == 0
    device, host = runs
    assert device.calc._engine.evaluations == host.calc._engine.evaluations == 1 + 5 * 4
    assert np.abs(device.positions - host.positions).max() < 1e-9
    assert np.abs(device.get_momenta() - host.get_momenta()).max() < 1e-9 * units.fs
    assert np.abs(device.positions - water.positions).max() > 1e-3  # they moved
    assert sorted(device.calc.results) == sorted(host.calc.results)
    for name, value in host.calc.results.items():
        assert np.allclose(device.calc.results[name], value, rtol=0, atol=1e-9), name
    assert not device.calc.check_state(device)  # the results are the atoms' own: no evaluation more


def test_inner_steps_on_the_device_read_the_direct_force_head_alone(pet, water, monkeypatch):
    """The inner steps need the direct forces only: their evaluations do not read the energy
    head (a tenth of a small system's kernels); the outer ones read both."""
    from ase_tcfp32 import _lean

    read = []

    def table_predictions(backend, nodes, edges, batch, names, *args):
        read.append(names)
        return original(backend, nodes, edges, batch, names, *args)

    original = _lean.table_predictions  # a CPU evaluates PET on the neighbor table
    monkeypatch.setattr(_lean, "table_predictions", table_predictions)
    atoms = with_calculator(water, calculator(pet, neighbor_skin=2.0))
    dyn = MTSVelocityVerlet(atoms, 0.5 * units.fs, inner_steps=4)
    dyn.run(2)
    assert dyn.redone_steps == 0
    both, direct = ["energy", "non_conservative_force"], ["non_conservative_force"]
    assert read == [both] + 2 * (3 * [direct] + [both])  # first evaluation; per outer step 3 inner, 1 outer


def test_inner_steps_leave_the_device_when_the_neighbor_list_expires(pet, water):
    """With a 0.02 Å skin the neighbor list expires within a few inner steps: the steps on
    the device notice it afterwards and the outer step is redone through ASE, which rebuilds
    the list; the trajectory is still the ASE path's."""
    runs = []
    for on_device in (True, False):
        atoms = with_calculator(water, calculator(pet, neighbor_skin=0.02))
        dyn = MTSVelocityVerlet(atoms, 0.5 * units.fs, inner_steps=4, device_inner_steps=on_device)
        dyn.run(4)
        runs.append(atoms)
        assert (dyn.redone_steps > 0) == on_device
    device, host = runs
    assert device.calc._engine.rebuilds > 2
    assert device.calc._engine.evaluations > host.calc._engine.evaluations  # the redone inner steps
    assert np.abs(device.positions - host.positions).max() < 1e-9


def test_positions_that_are_not_numbers_are_not_trusted_on_the_device(pet, water):
    """An inner evaluation at NaN positions (dynamics that blew up) is flagged like one out of
    the neighbor list's reach, so the outer step is redone through ASE, which checks them."""
    import torch

    from ase_tcfp32 import _inner_steps

    atoms = with_calculator(water, calculator(pet, neighbor_skin=2.0))
    atoms.get_forces()  # sizes the engine's table
    evaluations = _inner_steps.evaluations_on_device(atoms.calc._engine, [atoms], set(BOTH))
    positions = torch.tensor(atoms.positions)
    assert not bool(evaluations.direct(positions)[1])
    positions[3, 1] = float("nan")
    assert bool(evaluations.direct(positions)[1])


@pytest.mark.gpu
@pytest.mark.parametrize("integrator", ["verlet", "langevin"])
def test_inner_steps_on_the_device_replay_the_recorded_graph(tiny_ckpt, integrator):
    """On the GPU with the default engine (CUDA graphs): the inner steps on the device
    replay the direct evaluation's recorded graph (no more recordings than through ASE), with
    each outer step's noise for MTSLangevin, rebuild the pairs in their buffers at the end of
    outer steps (``VerletList.rebuilder``), and follow the ASE path's trajectory to FP32
    rounding. A GPU's sums (``index_add_``'s atomics) round in any order, so the two paths'
    forces agree to FP32 rounding, within 1e-4 eV/Å (forces of ~10 eV/Å); over two outer steps
    (8 fs, the second a replay with new inputs) that moves a hydrogen by at most
    ½ t² ΔF / m = 3.1e-5 Å. The random model's dynamics are chaotic and later steps amplify
    the difference (measured: 1.04e-5 Å after four outer steps, H100), so the trajectories
    are compared after two outer steps. Stale inputs (the first step's noise, say) would put
    them ~1e-2 Å apart."""
    water = water_box(64, seed=0)
    thermalize_momenta(water, temperature_K=300, rng=np.random.default_rng(0))
    runs, early = {}, {}
    for on_device in (True, False):
        atoms = with_calculator(water, TCPETCalculator(tiny_ckpt, precision="tf32x3", device="cuda", check_accuracy=0))
        dyn = seeded_dynamics(atoms, integrator, 8, on_device)
        dyn.run(2)
        early[on_device] = atoms.get_positions()
        dyn.run(2)
        runs[on_device] = atoms
        assert dyn.redone_steps == 0
    device, host = runs[True].calc._engine, runs[False].calc._engine
    assert device.cuda_graphs and device.recordings <= host.recordings
    assert device.rebuilds > 1  # after the first evaluation's, rebuilt at outer steps' ends (~0.3 Å per step)
    assert device.evaluations == host.evaluations == 1 + 4 * 8
    assert np.abs(early[True] - early[False]).max() < 3.1e-5
