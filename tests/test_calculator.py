import re

import numpy as np
import pytest
import torch
from ase import Atoms
from ase.calculators.calculator import PropertyNotImplementedError
from ase.filters import FrechetCellFilter
from ase.md.langevin import Langevin
from ase.md.velocitydistribution import thermalize_momenta
from ase.md.verlet import VelocityVerlet
from ase.optimize import BFGS, FIRE
from ase.units import fs
from metatomic_ase import MetatomicCalculator
from metatrain.utils.io import load_model

from ase_tcfp32 import TCPETCalculator
from ase_tcfp32.testing import random_pet


def compare_with_metatomic(path, atoms):
    """Ours (FP32) and MetatomicCalculator on the same checkpoint; energies and forces checked."""
    ours, ref = atoms.copy(), atoms.copy()
    ours.calc = TCPETCalculator(path, precision="fp32", device="cpu")
    ref.calc = MetatomicCalculator(load_model(path).export(), device="cpu", uncertainty_threshold=None)
    e_ref = ref.get_potential_energy()
    assert abs(ours.get_potential_energy() - e_ref) <= 1e-6 * abs(e_ref)
    assert np.abs(ours.get_forces() - ref.get_forces()).max() <= 1e-5
    return ours, ref


@pytest.mark.parametrize("name", ["pet-v16", "llpr-v4"])
def test_fp32_reproduces_metatomic_on_shipped_checkpoints(shipped, ethanol, name):
    ours, ref = compare_with_metatomic(shipped(name), ethanol)
    e_ref = ref.get_potential_energy()
    energies = ours.get_potential_energies()
    assert energies.shape == (len(ethanol),)
    assert energies.sum() == pytest.approx(e_ref, rel=1e-6)
    assert ours.get_potential_energy(force_consistent=True) == ours.get_potential_energy()


def test_fp32_reproduces_metatomic_with_stress(tiny_ckpt, water):
    ours, ref = compare_with_metatomic(tiny_ckpt, water)
    assert np.abs(ours.get_stress() - ref.get_stress()).max() <= 1e-6


@pytest.fixture(scope="module")
def float64_calc():
    """A PET in float64, so finite differences resolve the derivatives."""
    pet = random_pet("tiny", seed=11, atomic_types=[1, 8, 78]).to(torch.float64)
    return TCPETCalculator(pet, precision="fp32", device="cpu")


def test_forces_match_finite_differences(float64_calc, water):
    water.calc = float64_calc
    forces = water.get_forces()
    assert np.abs(forces).max() > 1e-3  # a non-trivial check
    h = 1e-4
    for atom, axis in [(0, 0), (1, 2), (5, 1), (13, 0)]:
        plus, minus = water.copy(), water.copy()
        plus.positions[atom, axis] += h
        minus.positions[atom, axis] -= h
        plus.calc = minus.calc = float64_calc
        fd = -(plus.get_potential_energy() - minus.get_potential_energy()) / (2 * h)
        assert forces[atom, axis] == pytest.approx(fd, abs=1e-6, rel=1e-5)


def test_stress_matches_finite_differences(float64_calc, water):
    water.calc = float64_calc
    stress = water.get_stress(voigt=False)
    assert np.abs(stress).max() > 1e-5
    h = 1e-5
    volume = water.get_volume()
    for i, j in [(0, 0), (1, 1), (2, 2), (1, 2), (0, 2), (0, 1)]:
        energies = []
        for sign in (1, -1):
            strained = water.copy()
            eps = np.eye(3)
            eps[i, j] += sign * h / (2 if i != j else 1)
            if i != j:
                eps[j, i] += sign * h / 2
            strained.set_cell(water.cell @ eps, scale_atoms=True)
            strained.calc = float64_calc
            energies.append(strained.get_potential_energy())
        fd = (energies[0] - energies[1]) / (2 * h) / volume
        assert stress[i, j] == pytest.approx(fd, abs=1e-7, rel=1e-4)
    voigt = water.get_stress()
    assert voigt == pytest.approx([stress[0, 0], stress[1, 1], stress[2, 2], stress[1, 2], stress[0, 2], stress[0, 1]])


def test_md_and_optimisers_run(shipped, ethanol, tiny_ckpt, pt_bulk):
    ethanol.calc = TCPETCalculator(shipped("pet-v16"), precision="fp32", device="cpu")
    thermalize_momenta(ethanol, temperature_K=300, rng=np.random.default_rng(0))
    start = ethanol.get_total_energy()
    VelocityVerlet(ethanol, timestep=0.5 * fs).run(10)
    assert abs(ethanol.get_total_energy() - start) < 0.05
    Langevin(ethanol, 0.5 * fs, temperature_K=300, friction=0.01, fixcm=False, rng=np.random.default_rng(1)).run(5)
    e0 = ethanol.get_potential_energy()
    FIRE(ethanol, logfile=None).run(fmax=0.05, steps=20)
    assert ethanol.get_potential_energy() <= e0
    e1 = ethanol.get_potential_energy()
    BFGS(ethanol, logfile=None).run(fmax=0.05, steps=10)
    assert ethanol.get_potential_energy() <= e1 + 1e-6

    pt_bulk.calc = TCPETCalculator(tiny_ckpt, precision="fp32", device="cpu")
    e0 = pt_bulk.get_potential_energy()
    opt = FIRE(FrechetCellFilter(pt_bulk), logfile=None)
    opt.run(fmax=1e-3, steps=15)
    assert pt_bulk.get_potential_energy() < e0


def test_results_are_cached_between_property_requests(tiny_ckpt, water):
    calc = TCPETCalculator(tiny_ckpt, precision="fp32", device="cpu")
    water.calc = calc
    water.get_forces()  # the backward pass gives a periodic system's stress with its forces
    before = dict(calc.results)
    assert {"energy", "free_energy", "forces", "stress"} <= set(before)
    water.get_potential_energy()
    water.get_stress()
    assert calc.results["forces"] is before["forces"]  # no second model call


@pytest.mark.parametrize(
    "change",
    [
        "none",
        "positions",
        "tiny move",
        "tiny, then large",
        "all moved",
        "cell",
        "tiny cell",
        "pbc",
        "numbers",
        "charges",
        "magmoms",
        "momenta",
        "more atoms",
    ],
)
def test_check_state_answers_as_ase_does(tiny_ckpt, water, change):
    """The cheaper comparisons never answer otherwise than ASE's ``compare_atoms``."""
    from ase.calculators.calculator import compare_atoms

    calc = TCPETCalculator(tiny_ckpt, precision="fp32", device="cpu")
    water.calc = calc
    water.get_potential_energy()
    moved = water.copy()
    if change == "positions":
        moved.positions[4, 2] += 1e-3
    elif change == "tiny move":  # below ASE's tolerance: no change for either
        moved.positions[4, 2] = np.nextafter(moved.positions[4, 2], np.inf)
    elif change == "tiny, then large":  # the first difference is within the tolerance, a later one is not
        moved.positions[0, 0] = np.nextafter(moved.positions[0, 0], np.inf)
        moved.positions[4, 2] += 1e-3
    elif change == "all moved":  # an MD step
        moved.positions += np.random.default_rng(0).normal(0, 1e-3, moved.positions.shape)
    elif change == "cell":
        moved.cell[0, 0] += 0.01
    elif change == "tiny cell":
        moved.cell[0, 0] = np.nextafter(moved.cell[0, 0], np.inf)
    elif change == "pbc":
        moved.pbc = [True, True, False]
    elif change == "numbers":
        moved.numbers[0] = 78
    elif change == "charges":
        moved.set_initial_charges(np.arange(len(moved), dtype=float))
    elif change == "magmoms":
        moved.set_initial_magnetic_moments(np.ones(len(moved)))
    elif change == "momenta":  # not a system change for ASE
        moved.set_momenta(np.ones((len(moved), 3)))
    elif change == "more atoms":
        moved += Atoms("H", positions=[[0.5, 0.5, 0.5]])
    if change.startswith("tiny"):
        assert not np.array_equal(moved.positions, calc.atoms.positions) or not np.array_equal(
            moved.cell, calc.atoms.cell
        )
    assert sorted(calc.check_state(moved)) == sorted(compare_atoms(calc.atoms, moved, tol=1e-15))
    assert (calc.check_state(moved) == []) == (change in ("none", "tiny move", "tiny cell", "momenta"))


def test_elements_are_checked_again_when_they_change(shipped):
    calc = TCPETCalculator(shipped("pet-v16"), precision="fp32", device="cpu")
    atoms = Atoms("CH4", positions=[[0, 0, 0], [1, 0, 0], [0, 1, 0], [0, 0, 1], [-1, 0, 0]])
    atoms.calc = calc
    atoms.get_potential_energy()
    atoms.numbers[1] = 92
    with pytest.raises(ValueError, match="U"):
        atoms.get_potential_energy()


# --- bad input: a clear exception before any model work -------------------------


def test_unknown_element_is_named(shipped):
    calc = TCPETCalculator(shipped("pet-v16"), precision="fp32", device="cpu")
    atoms = Atoms("CPtU", positions=[[0, 0, 0], [2, 0, 0], [0, 2, 0]])
    atoms.calc = calc
    with pytest.raises(ValueError, match="Pt, U"):
        atoms.get_potential_energy()
    assert calc.atoms is None and calc.results == {}


@pytest.mark.parametrize("where", ["positions", "cell"])
def test_nan_geometry_is_rejected(tiny_ckpt, water, where):
    calc = TCPETCalculator(tiny_ckpt, precision="fp32", device="cpu")
    if where == "positions":
        water.positions[3, 1] = np.nan
    else:
        water.cell[0, 0] = np.inf
    water.calc = calc
    with pytest.raises(ValueError, match=f"{where}.*NaN or infinite"):
        water.get_forces()
    assert calc.results == {}


def test_empty_atoms_are_rejected(tiny_ckpt):
    atoms = Atoms()
    atoms.calc = TCPETCalculator(tiny_ckpt, precision="fp32", device="cpu")
    with pytest.raises(ValueError, match="empty"):
        atoms.get_potential_energy()


@pytest.mark.parametrize("pbc", [False, [True, True, False]])
def test_stress_needs_full_periodicity(tiny_ckpt, water, pbc):
    water.pbc = pbc
    water.calc = TCPETCalculator(tiny_ckpt, precision="fp32", device="cpu")
    assert np.isfinite(water.get_potential_energy())
    assert "stress" not in water.calc.results
    with pytest.raises(PropertyNotImplementedError, match="periodic in all three"):
        water.get_stress()


def test_emulated_precision_needs_a_float32_model():
    pet = random_pet("tiny", atomic_types=[1, 8]).to(torch.float64)
    with pytest.warns(UserWarning):  # the CPU emulation note comes first
        with pytest.raises(ValueError, match="needs a float32 model"):
            TCPETCalculator(pet, precision="tf32x3", device="cpu")


def test_unknown_precision_lists_valid_ones(tiny_ckpt):
    with pytest.raises(ValueError, match="unknown precision 'tf64'.*auto, fp32, tf32, tf32x3, fp16x3, bf16x9"):
        TCPETCalculator(tiny_ckpt, precision="tf64")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")
@pytest.mark.parametrize("skin", [-0.5, float("nan"), float("inf"), "2", True])
def test_a_bad_neighbor_skin_is_refused_before_loading(skin):
    with pytest.raises(ValueError, match="neighbor_skin is a distance in Å, 0 or more"):
        TCPETCalculator("no-such-model", device="cpu", neighbor_skin=skin)  # refused before the model is looked up


def test_cuda_request_without_gpu_is_an_error(tiny_ckpt):
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        TCPETCalculator(tiny_ckpt, precision="fp32", device="cuda")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")
def test_auto_on_cpu_warns_and_uses_fp32(tiny_ckpt):
    with pytest.warns(UserWarning, match="precision='auto' uses fp32: device 'cpu' has no tensor cores"):
        calc = TCPETCalculator(tiny_ckpt, device="cpu")
    assert calc.precision == "fp32"
    assert "precision='fp32'" in repr(calc)


def test_compiled_calculator_matches_eager_and_keeps_our_gemms(tiny_ckpt, water):
    """compile=True: PET's tensor code through torch.compile, the emulated GEMMs as an opaque
    custom op; same energies, forces and stress as eager, and moving atoms does not recompile."""
    eager = TCPETCalculator(tiny_ckpt, precision="tf32x3", device="cpu")
    compiled = TCPETCalculator(tiny_ckpt, precision="tf32x3", device="cpu", compile=True)
    assert "compile=True" in repr(compiled)
    rng = np.random.default_rng(0)
    atoms = water.copy()
    for step in range(3):
        atoms.positions += rng.normal(scale=0.05, size=atoms.positions.shape)
        a, b = atoms.copy(), atoms.copy()
        a.calc, b.calc = eager, compiled
        assert b.get_potential_energy() == pytest.approx(a.get_potential_energy(), abs=1e-5)
        assert np.abs(b.get_forces() - a.get_forces()).max() < 3e-5  # fused ops: FP32 reordering
        assert np.abs(b.get_stress() - a.get_stress()).max() < 1e-6
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert frames <= 6  # three compiled stages (and their backward), not one per step


@pytest.mark.parametrize("precision", ["fp32", "tf32x3"])
def test_low_memory_recomputes_and_gives_the_same_results(tiny_ckpt, water, precision):
    """low_memory=True recomputes the GNN layers in the backward pass: same numbers."""
    results = []
    for low_memory in (False, True):
        calc = TCPETCalculator(tiny_ckpt, precision=precision, device="cpu", low_memory=low_memory)
        atoms = water.copy()
        atoms.calc = calc
        results.append((atoms.get_potential_energy(), atoms.get_forces(), atoms.get_stress()))
    assert "low_memory=True" in repr(calc)
    assert all(type(layer).__name__ == "Recomputed" for layer in calc.pet.backend.gnn_layers)
    (e0, f0, s0), (e1, f1, s1) = results
    assert e1 == e0
    np.testing.assert_allclose(f1, f0, rtol=0, atol=1e-6)
    np.testing.assert_allclose(s1, s0, rtol=0, atol=1e-8)


def test_default_engine_is_chosen_and_explained(tiny_ckpt, water):
    """engine='auto' (the default) runs the lean engine on a CPU and says why; explicit
    engines win; the result is the metatomic engine's to FP32 rounding."""
    calc = TCPETCalculator(tiny_ckpt, device="cpu", precision="fp32")
    assert calc.engine == "auto" and calc.engine_used == "lean"
    assert "engine='auto' (lean: " in repr(calc) and "engine" in calc._repr_html_()
    water.calc = calc
    forces = water.get_forces()
    explicit = TCPETCalculator(tiny_ckpt, device="cpu", precision="fp32", engine="metatomic")
    assert explicit.engine_used == "metatomic" and "engine='metatomic'" in repr(explicit)
    other = water.copy()
    other.calc = explicit
    assert np.abs(other.get_forces() - forces).max() < 1e-5


def test_import_and_default_calculator_print_nothing(tmp_path):
    """A quiet start: importing the package and building the default calculator on the
    bundled model print nothing (no Warp banner, no torch.jit notes from dependencies)."""
    import subprocess
    import sys

    code = (
        "import warnings; warnings.simplefilter('default')\n"
        "import ase_tcfp32\n"
        "c = ase_tcfp32.TCPETCalculator('pet-demo-chgnet', device='cpu', precision='fp32', engine='metatomic')\n"
        "c = ase_tcfp32.TCPETCalculator('pet-demo-chgnet', device='cpu', precision='fp32')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "" and done.stderr == "", (done.stdout, done.stderr)


def test_offline_model_name_fails_at_once_without_the_download_code(monkeypatch):
    """No network (here: a closed local port as the hub) and no cached copy: a clear
    ModelDownloadError, without importing upet or entering its retry loop."""
    import sys

    from huggingface_hub import constants

    from ase_tcfp32 import ModelDownloadError
    from ase_tcfp32.models import hub_reachable

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    assert not hub_reachable()
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert not hub_reachable()
    loaded = "upet._models" in sys.modules
    with pytest.raises(ModelDownloadError, match="cannot be reached.*pet-demo-chgnet"):
        TCPETCalculator("pet-mad-xs", device="cpu")
    assert ("upet._models" in sys.modules) == loaded


def test_out_of_memory_message_says_what_fits():
    """The estimate reproduces the largest PET-S water boxes measured on the H200 (143,771 MiB:
    78,000 atoms fit and 80,436 do not; 131,625 and 136,500 with low_memory,
    benchmarks/results/memory_h200.json) to 10%, and suggests low_memory unless it is on."""

    from ase_tcfp32._memory import out_of_memory_message
    from ase_tcfp32.testing import random_pet

    h200 = 143_771 * 2**20
    for low_memory, measured in ((False, 78_000), (True, 131_625)):
        message = out_of_memory_message(random_pet("s"), 200_000, h200, "NVIDIA H200", low_memory=low_memory)
        fits = int(re.search(r"about ([\d,]+) atoms", message)[1].replace(",", ""))
        assert abs(fits - measured) / measured < 0.1, message
        assert "200,000 atoms did not fit" in message and ("low_memory=True" in message) != low_memory
    pet_m = out_of_memory_message(random_pet("m"), 60_000, h200, "NVIDIA H200", low_memory=False)
    assert 20_000 < int(re.search(r"about ([\d,]+) atoms", pet_m)[1].replace(",", "")) < 30_000  # 88 GB at 17,280


def test_a_long_first_evaluation_says_what_it_is_doing(tiny_ckpt, water, monkeypatch, capsys):
    """Past progress.DELAY seconds the first evaluation shows a status line on stderr (here
    with the delay at 0 and compile=True, whose first call compiles); progress=False and
    later evaluations show none."""
    from ase_tcfp32 import _progress as progress

    monkeypatch.setattr(progress, "DELAY", 0.0)
    torch._dynamo.reset()  # code that an earlier test compiled would not compile (nor say so) again
    water.calc = TCPETCalculator(tiny_ckpt, device="cpu", precision="fp32", compile=True)
    water.get_forces()
    err = capsys.readouterr().err
    assert "ase-tcfp32: first evaluation (24 atoms)" in err and "torch.compile" in err
    # captured standard error is no terminal: plain lines as in a log file, none redrawn
    lines = err.splitlines()
    assert "\r" not in err and err.endswith("\n") and len(lines) < 10, err
    assert re.fullmatch(r"ase-tcfp32: first evaluation \(24 atoms\): done in [\d.]+ s", lines[-1]), err
    water.positions += 0.01
    water.get_forces()
    assert "first evaluation" not in capsys.readouterr().err
    quiet = water.copy()
    quiet.calc = TCPETCalculator(tiny_ckpt, device="cpu", precision="fp32", progress=False)
    quiet.get_forces()
    assert "first evaluation" not in capsys.readouterr().err


def test_auto_gives_a_cpu_the_small_skin_and_explicit_skins_win(tiny_ckpt):
    """No CUDA graph replays on a CPU, so every candidate pair costs work: engine='auto'
    takes the 0.5 Å skin there; an explicit skin or engine keeps its own."""
    from ase_tcfp32._engines import LARGE_SKIN, SMALL_SKIN

    assert TCPETCalculator(tiny_ckpt, precision="fp32", device="cpu")._engine.skins == (LARGE_SKIN, LARGE_SKIN)
    assert TCPETCalculator(tiny_ckpt, precision="fp32", device="cpu", neighbor_skin=1.5)._engine.skins == (1.5, 1.5)
    assert TCPETCalculator(tiny_ckpt, precision="fp32", device="cpu", engine="lean")._engine.skins == (
        SMALL_SKIN,
        SMALL_SKIN,
    )
    assert f"skin {LARGE_SKIN} Å" in repr(TCPETCalculator(tiny_ckpt, precision="fp32", device="cpu"))


# --- on the GPU (pytest -m gpu tests; skipped without CUDA) ---


@pytest.mark.gpu
def test_calculator_modes_on_gpu(tiny_ckpt, water192):
    results = {}
    hopper = torch.cuda.get_device_capability() == (9, 0)
    precisions = ["fp32", "tf32", "tf32x3", "bf16x9"] + (["fp16x3"] if hopper else [])
    for precision in precisions:
        atoms = water192.copy()
        atoms.calc = TCPETCalculator(tiny_ckpt, precision=precision, device="cuda")
        backend = {"fp32": "cuBLAS SGEMM", "fp16x3": "gluon"}.get(precision, "triton")
        assert atoms.calc.backend == backend
        results[precision] = (atoms.get_potential_energy(), atoms.get_forces(), atoms.get_stress())
    e32, f32, s32 = results["fp32"]
    for precision in precisions[2:]:
        e, f, s = results[precision]
        assert abs(e - e32) / len(water192) < 2e-6
        assert np.abs(f - f32).max() < 3e-5  # FP32 itself varies ~1e-5 here (atomic scatter-adds)
        assert np.abs(s - s32).max() < 1e-6
    assert np.abs(results["tf32"][1] - f32).max() > 1e-4


@pytest.mark.gpu
def test_tf32_mode_does_not_leak_and_fp32_stays_ieee(tiny_ckpt, water192):
    matmul = torch.backends.cuda.matmul
    saved = matmul.fp32_precision
    try:
        atoms = water192.copy()
        atoms.calc = TCPETCalculator(tiny_ckpt, precision="tf32", device="cuda")
        atoms.get_forces()
        assert matmul.fp32_precision == saved  # nothing switched process-wide
        atoms = water192.copy()
        atoms.calc = TCPETCalculator(tiny_ckpt, precision="fp32", device="cuda")
        f_ieee = atoms.get_forces()
        matmul.fp32_precision = "tf32"  # the user's own setting for other code
        atoms = water192.copy()
        atoms.calc = TCPETCalculator(tiny_ckpt, precision="fp32", device="cuda")
        assert np.abs(atoms.get_forces() - f_ieee).max() < 1e-5  # TF32 would move them ~1e-3
        assert matmul.fp32_precision == "tf32"
    finally:
        matmul.fp32_precision = saved


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["tf32x3", "fp16x3"])
def test_compiled_calculator_on_gpu(tiny_ckpt, water192, precision):
    """torch.compile around our kernels (a custom op): same forces as eager."""
    if precision == "fp16x3" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("fp16x3 runs on Hopper")
    results = {}
    for compile in (False, True):
        atoms = water192.copy()
        atoms.calc = TCPETCalculator(tiny_ckpt, precision=precision, device="cuda", compile=compile)
        results[compile] = atoms.get_potential_energy(), atoms.get_forces()
    (e0, f0), (e1, f1) = results[False], results[True]
    assert abs(e1 - e0) / len(water192) < 2e-6
    assert np.abs(f1 - f0).max() < 3e-5


@pytest.mark.gpu
def test_low_memory_lowers_the_peak_and_keeps_the_forces():
    """low_memory=True on a PET-MAD-S-shaped model, 3,072 water atoms: smaller peak of
    the forces call (CPU measured 0.55x), same forces."""
    from ase_tcfp32.testing import random_checkpoint
    from ase_tcfp32.validation import water_box

    results = {}
    for low_memory in (False, True):
        atoms = water_box(1024, seed=0)
        atoms.calc = TCPETCalculator(
            random_checkpoint("s"), precision="tf32x3", device="cuda", low_memory=low_memory, engine="metatomic"
        )  # the same engine both ways (auto records graphs without low_memory)
        atoms.get_potential_energy()
        atoms.calc.reset()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        forces = atoms.get_forces()
        results[low_memory] = torch.cuda.max_memory_allocated() - base, forces
        del atoms
        torch.cuda.empty_cache()
    (peak0, f0), (peak1, f1) = results[False], results[True]
    assert peak1 < 0.75 * peak0
    assert np.abs(f1 - f0).max() < 1e-4  # GPU FP32 sums are not deterministic (rerun noise ~1e-5)


TWO_THREADS = """
import threading, numpy as np, torch
from ase_tcfp32 import TCPETCalculator
from ase_tcfp32.testing import random_checkpoint
from ase_tcfp32.validation import water_box
model = random_checkpoint("xs", seed=3)
boxes = [water_box(256, seed=s) for s in (0, 1)]  # 768 atoms: the edge GEMMs run our kernels
results, errors = {}, []
def run(i):
    try:
        atoms = boxes[i].copy()
        atoms.calc = TCPETCalculator(model, device="cuda", engine="lean")
        results[i] = atoms.get_forces()
    except BaseException as error:
        errors.append(repr(error))
threads = [threading.Thread(target=run, args=(i,)) for i in (0, 1)]
[t.start() for t in threads]
[t.join(timeout=240) for t in threads]
assert not errors, errors
for i in (0, 1):  # the same forces from the main thread
    atoms = boxes[i].copy()
    atoms.calc = TCPETCalculator(model, device="cuda", engine="lean")
    assert np.abs(atoms.get_forces() - results[i]).max() < 3e-5
print("two threads ok")
"""


@pytest.mark.gpu
def test_two_calculators_in_two_threads_from_empty_caches(tmp_path):
    import os
    import subprocess
    import sys

    env = dict(os.environ, ASE_TCFP32_CACHE=str(tmp_path / "cache"), TRITON_CACHE_DIR=str(tmp_path / "triton"))
    done = subprocess.run([sys.executable, "-c", TWO_THREADS], env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]


EAGER_START = """
import sys
from ase_tcfp32 import TCPETCalculator
from ase_tcfp32.validation import water_box
atoms = water_box(64, seed=0)
atoms.calc = TCPETCalculator("pet-demo-chgnet", device="cuda")  # the defaults: lean engine, CUDA graphs
atoms.get_forces()
atoms.positions += 0.01
atoms.get_forces()
assert "torch._dynamo" not in sys.modules, "an eager evaluation imported torch._dynamo"
print("no dynamo")
"""


@pytest.mark.gpu
def test_default_calculator_does_not_import_the_compiler():
    """The first call of a torch.library custom op imports torch._dynamo (0.47 s
    of a 192-atom start on the H200, with the op registrations it brings); eager code calls
    our kernels directly, so a default calculator's process never imports it."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", EAGER_START], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "no dynamo" in done.stdout, done.stderr[-3000:]


@pytest.mark.gpu
def test_out_of_memory_says_what_fits_and_the_calculator_recovers():
    """A system too large for the memory it may use: torch.OutOfMemoryError with the
    estimate and the low_memory hint; then a small system works on the same calculator."""
    from ase_tcfp32.testing import random_checkpoint
    from ase_tcfp32.validation import water_box

    calc = TCPETCalculator(random_checkpoint("s"), device="cuda")
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(0.02)  # ~2.8 GB of an H200
    try:
        with pytest.raises(torch.OutOfMemoryError, match="did not fit in the .* Estimated largest system here"):
            calc.evaluate([water_box(5760, seed=0)])
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()
    assert np.isfinite(calc.evaluate([water_box(64, seed=0)])[0]["forces"]).all()


@pytest.mark.gpu
@pytest.mark.parametrize("shape", ["s", "m"])
def test_small_systems_of_pet_mad_shapes_stay_at_fp32s_error(water192, shape):
    """192 atoms of PET-S's and PET-M's shapes in the default calculator (fp16x3, CUDA
    graphs): the node layers run 64-row tiles summed in parts (their rows are too few for
    the tuned tiles), the rest our kernels; energy, forces and stress against the float64
    model within a few times FP32's own error (FP32 in the same engine) plus a few units of
    FP32 roundoff of the largest value."""
    from ase_tcfp32._kernels import fp16x3
    from ase_tcfp32.testing import random_checkpoint

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("fp16x3 is the default on Hopper")
    model = random_checkpoint(shape)
    width = {"s": 1024, "m": 1536}[shape]  # the node update's [192 x 2 d_node] -> d_node product
    assert fp16x3.parts(192, width, 2 * width, torch.device("cuda"), fp16x3.SMALL) > 1
    exact = TCPETCalculator(model, device="cuda", dtype="float64").evaluate([water192])[0]
    errors = {}
    for precision in ("fp16x3", "fp32"):
        result = TCPETCalculator(model, device="cuda", precision=precision).evaluate([water192])[0]
        errors[precision] = [np.abs(result[name] - exact[name]).max() for name in ("energy", "forces", "stress")]
    scales = [np.abs(exact[name]).max() for name in ("energy", "forces", "stress")]
    for ours, fp32, scale in zip(errors["fp16x3"], errors["fp32"], scales):
        assert ours <= 4 * fp32 + 8 * 2.0**-24 * scale, (errors, scales)
