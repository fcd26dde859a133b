"""Systems in pieces, one GNN layer at a time (ase_tcfp32._layerwise): the whole
evaluation's results to rounding, in float64 (same modules on the same rows, summed in
another order) and in FP32 (no more error against float64 than the whole evaluation has)."""

import copy
import re

import numpy as np
import pytest
import torch
from ase.md.verlet import VelocityVerlet

from ase_tcfp32 import TCPETCalculator
from ase_tcfp32._engines import DIRECT, PROPERTIES
from ase_tcfp32._layerwise import Pieces, pieces
from ase_tcfp32._lean import LeanPET
from ase_tcfp32._swapping import recompute_gnn_layers
from ase_tcfp32.testing import random_pet
from ase_tcfp32.validation import water_box

EPS64 = float(np.finfo(np.float64).eps)
EPS32 = float(np.finfo(np.float32).eps)
WANTED = PROPERTIES + DIRECT + ("energy_features",)


@pytest.fixture(scope="module")
def pet64():
    return random_pet("tiny", seed=11, atomic_types=[1, 6, 8, 78]).to(torch.float64).eval()


def _assert_close(whole: dict, parts: dict, bound: float) -> None:
    """Every result of ``parts`` within ``bound`` x its largest magnitude of ``whole``'s."""
    assert set(whole) == set(parts)
    for key, value in whole.items():
        value, other = np.asarray(value), np.asarray(parts[key])
        scale = np.abs(value).max()
        assert scale > 0, key
        assert np.abs(value - other).max() <= bound * scale, key


def test_plan_covers_every_atom_and_row_once():
    first = np.array([0, 3, 3, 7, 12, 20])  # atom 1 has no rows
    plan = pieces(first, 25, 4)
    assert [(p.start, p.stop) for p in plan] == [(0, 4), (4, 6)]
    assert [(p.first, p.last) for p in plan] == [(0, 12), (12, 25)]
    # rows past the buffer (a step that will be redone with more) are clamped, not read
    assert pieces(first, 10, 4)[-1] == (4, 6, 10, 10)


@pytest.mark.parametrize("atoms_per_piece, keep", [(1, 0), (7, 0), (7, 1000), (40, 1000)])
def test_pieces_give_the_whole_evaluation(pet64, water, pt_bulk, ethanol, atoms_per_piece, keep):
    """Pieces of one atom, of a few, and pieces across structures of a batch, each layer's
    outputs recomputed or kept: every output (energies, forces, stress, direct heads,
    last-layer features) to float64 rounding."""
    structures = [water, pt_bulk, ethanol]
    whole = LeanPET(pet64, torch.device("cpu"), packed=True).compute(structures, WANTED)
    lean = LeanPET(pet64, torch.device("cpu"), packed=True, pieces=Pieces(0, atoms_per_piece, keep))
    for a, b in zip(whole, lean.compute(structures, WANTED), strict=True):
        _assert_close(a, b, 1e3 * EPS64)


def test_pieces_with_recomputed_layers_and_an_energy_only_call(pet64, water):
    """``low_memory=True`` wraps the GNN layers (the pieces unwrap them); an energy-only
    call runs no backward pass."""
    recomputed = random_pet("tiny", seed=11, atomic_types=[1, 6, 8, 78]).to(torch.float64).eval()
    recompute_gnn_layers(recomputed)
    whole = LeanPET(pet64, torch.device("cpu"), packed=True).compute([water], PROPERTIES)[0]
    lean = LeanPET(recomputed, torch.device("cpu"), packed=True, pieces=Pieces(10, 5))
    _assert_close(whole, lean.compute([water], PROPERTIES)[0], 1e3 * EPS64)
    energy = lean.compute([water], ("energy",))[0]
    assert "forces" not in energy
    assert energy["energy"] == pytest.approx(whole["energy"], rel=1e3 * EPS64)


def test_md_in_pieces_follows_the_whole_trajectory(pet64):
    """Velocity Verlet with the neighbor list reused across steps (and rebuilt when atoms
    move past the skin): in pieces, no further from the whole evaluation's trajectory than
    a 1e-13 Å nudge of one atom takes it (the random model's dynamics is chaotic)."""
    start = water_box(12, seed=4)
    start.rattle(0.02, seed=5)
    final = []
    for piece_atoms, nudge in ((0, 0.0), (0, 1e-13), (9, 0.0)):
        atoms = start.copy()
        atoms.positions[0, 0] += nudge
        model = copy.deepcopy(pet64)
        atoms.calc = TCPETCalculator(model, dtype="float64", device="cpu", piece_atoms=piece_atoms, progress=False)
        atoms.set_momenta(np.zeros_like(atoms.positions))
        VelocityVerlet(atoms, timestep=0.5).run(10)
        final.append(atoms.positions.copy())
    nudged = np.abs(final[1] - final[0]).max()
    assert np.abs(final[2] - final[0]).max() <= nudged


def test_fp32_in_pieces_is_as_accurate_as_the_whole_evaluation():
    """The bundled model in FP32 on 192 water atoms, whole and in pieces of 50, against
    its float64 evaluation: pieces add no error beyond FP32's own."""
    atoms = water_box(64, seed=0)
    results = {}
    for name, options in {
        "fp64": {"dtype": "float64"},
        "whole": {"piece_atoms": 0},
        "pieces": {"piece_atoms": 50},
    }.items():
        calc = TCPETCalculator("pet-demo-chgnet", device="cpu", progress=False, uncertainty_threshold=None, **options)
        results[name] = calc.evaluate([atoms])[0]
    exact = results["fp64"]
    for key in ("energy", "forces", "stress"):
        scale = np.abs(exact[key]).max()
        whole = np.abs(np.asarray(results["whole"][key]) - exact[key]).max()
        parts = np.abs(np.asarray(results["pieces"][key]) - exact[key]).max()
        assert parts <= 2 * whole + 16 * EPS32 * scale, key


@pytest.mark.parametrize(
    "options, message",
    [
        ({"piece_atoms": -1}, "piece_atoms is a number of atoms"),
        ({"piece_atoms": True}, "piece_atoms is a number of atoms"),
        ({"piece_atoms": 100, "engine": "metatomic"}, "not 'metatomic'"),
        ({"piece_atoms": 100, "compile": True}, "compile=True"),
    ],
)
def test_bad_piece_settings_are_refused(tiny_ckpt, options, message):
    with pytest.raises(ValueError, match=message):
        TCPETCalculator(tiny_ckpt, device="cpu", progress=False, **options)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp16x3", "tf32x3", "bf16x9"])
def test_pieces_on_the_gpu_are_as_accurate_as_the_whole_evaluation(precision):
    """PET-S shape, 1,536 water atoms in pieces of 500 in each FP32-accurate precision,
    against the whole float64 evaluation: no more error than the whole evaluation."""
    pet = random_pet("s", seed=0)
    atoms = water_box(512, seed=0)
    results = {}
    for name, options in {
        "fp64": {"dtype": "float64"},
        "whole": {"precision": precision, "piece_atoms": 0},
        "pieces": {"precision": precision, "piece_atoms": 500},
    }.items():
        calc = TCPETCalculator(copy.deepcopy(pet), device="cuda", progress=False, check_accuracy=0, **options)
        results[name] = calc.evaluate([atoms])[0]
        del calc
    exact = results["fp64"]
    for key in ("energy", "forces", "stress"):
        scale = np.abs(exact[key]).max()
        whole = np.abs(np.asarray(results["whole"][key]) - exact[key]).max()
        parts = np.abs(np.asarray(results["pieces"][key]) - exact[key]).max()
        assert parts <= 2 * whole + 16 * EPS32 * scale, (key, parts, whole)


def test_the_llpr_force_and_stress_ensembles_in_pieces():
    """The ensembles differentiate the last-layer features once per direction of the
    ensemble's weights: through the pieces' backward pass, repeated, as through the whole one."""
    atoms = water_box(8, seed=1)
    results = []
    for piece_atoms in (0, 7):
        calc = TCPETCalculator(
            "pet-demo-chgnet", dtype="float64", device="cpu", piece_atoms=piece_atoms, progress=False
        )
        (result,) = calc.evaluate([atoms], ["forces_ensemble", "stress_ensemble"])  # both from one evaluation
        results.append((result["forces_ensemble"], result["stress_ensemble"]))
    for whole, parts in zip(*results):
        assert np.abs(whole - parts).max() <= 1e3 * EPS64 * np.abs(whole).max()


def test_evaluations_in_pieces_say_how_far_they_are(pet64, water, monkeypatch, capsys):
    """Every evaluation in pieces (seconds each on large systems), not only the first, shows
    the progress line past progress.DELAY, naming the layer, the direction and the piece."""
    import contextlib

    from ase_tcfp32 import _progress as progress

    named = []
    doing = progress.doing

    @contextlib.contextmanager
    def recorded(what):
        named.append(what)
        with doing(what):
            yield

    monkeypatch.setattr(progress, "DELAY", 0.0)
    monkeypatch.setattr(progress, "_live", lambda: False)  # plain lines, as in a log file
    monkeypatch.setattr(progress, "doing", recorded)
    water.calc = TCPETCalculator(copy.deepcopy(pet64), dtype="float64", device="cpu", piece_atoms=5)
    water.get_forces()
    capsys.readouterr()
    water.positions += 0.01
    named.clear()
    water.get_forces()  # not the first: shown because it is in pieces
    assert re.search(r"ase-tcfp32: 24 atoms in pieces: done in [\d.]+ s", capsys.readouterr().err)
    for what in ("GNN layer 1, forward, piece 1 of 5", "GNN layer 2, backward, piece 5 of 5", "readout, backward"):
        assert any(label.startswith(what) for label in named), (what, named)


def test_a_relaxation_in_pieces_takes_the_whole_evaluations_path(pet64):
    """FIRE, 15 steps, with the cell fixed: the same positions to float64 noise."""
    from ase.optimize import FIRE

    start = water_box(12, seed=7)
    final = []
    for piece_atoms in (0, 9):
        atoms = start.copy()
        atoms.calc = TCPETCalculator(
            copy.deepcopy(pet64), dtype="float64", device="cpu", piece_atoms=piece_atoms, progress=False
        )
        FIRE(atoms, logfile=None).run(fmax=1e-3, steps=15)
        final.append(atoms.positions.copy())
    assert np.abs(final[0] - start.positions).max() > 1e-2  # it did move
    assert np.abs(final[1] - final[0]).max() < 1e-9
