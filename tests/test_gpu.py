"""GPU tests (run on the device; skipped without CUDA)."""

import numpy as np
import pytest
import torch

from ase_tcfp32 import TCPETCalculator, auto_precision
from ase_tcfp32.precision import support

pytestmark = pytest.mark.gpu


def test_info_reports_the_gpu_and_cublas(capsys):
    from ase_tcfp32.cli import main

    main(["info"])
    out = capsys.readouterr().out
    assert torch.cuda.get_device_name() in out and "cuBLAS 1" in out and "auto -> " in out
    assert "attention: tensor cores (TF32x3) in tf32x3" in out


def test_auto_picks_fp16x3_on_hopper_and_tf32x3_on_ampere():
    cc = torch.cuda.get_device_capability()
    if cc[0] not in (8, 9):
        pytest.skip("table rows for 8.x / 9.x")
    assert auto_precision("cuda")[0] == ("fp16x3" if cc == (9, 0) else "tf32x3")


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


@pytest.mark.parametrize("precision", ["fp32", "tf32x3", "fp16x3"])
def test_lean_and_graph_engines_match_metatomic_on_gpu(tiny_ckpt, water192, precision):
    if precision == "fp16x3" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("fp16x3 runs on Hopper")
    results = {}
    for engine in ("metatomic", "lean", "graphs"):
        atoms = water192.copy()
        atoms.calc = TCPETCalculator(tiny_ckpt, precision=precision, device="cuda", engine=engine)
        results[engine] = atoms.get_potential_energy(), atoms.get_forces(), atoms.get_stress()
        if engine != "metatomic":  # PET on packed rows where the attention is ours
            assert atoms.calc._engine.packed == (precision != "fp32")
    e0, f0, s0 = results["metatomic"]
    for engine in ("lean", "graphs"):
        e, f, s = results[engine]
        assert abs(e - e0) / len(water192) < 2e-6
        assert np.abs(f - f0).max() < 3e-5
        assert np.abs(s - s0).max() < 1e-6


def test_graph_replays_follow_md_across_list_rebuilds_and_wider_tables(tiny_ckpt, water192):
    """A hot MD run with a 0.4 Å skin: the pair list is rebuilt in place under the
    recorded graph, and a table too narrow for crowded atoms is widened (re-recorded);
    every step's forces agree with a fresh metatomic evaluation."""
    from ase.md.velocitydistribution import MaxwellBoltzmannDistribution
    from ase.md.verlet import VelocityVerlet
    from ase.units import fs

    atoms = water192.copy()
    atoms.calc = TCPETCalculator(tiny_ckpt, precision="tf32x3", device="cuda", engine="graphs", neighbor_skin=0.4)
    reference = TCPETCalculator(tiny_ckpt, precision="tf32x3", device="cuda", engine="metatomic")
    MaxwellBoltzmannDistribution(atoms, temperature_K=3000, rng=np.random.default_rng(2))
    dyn = VelocityVerlet(atoms, 1.0 * fs)
    lean = atoms.calc._engine
    for block in range(5):
        dyn.run(4)
        if block == 2:
            lean._set_width(8)  # as if the table had been sized for a sparser configuration
            atoms.calc.reset()
        if block == 3:
            lean._set_rows(1000)  # and the packed rows for far fewer pairs
            atoms.calc.reset()
        copy = atoms.copy()
        copy.calc = reference
        assert np.abs(atoms.get_forces() - copy.get_forces()).max() < 3e-5
    assert lean.rebuilds >= 2 and lean.width > 8 and lean.widenings >= 1 and lean.packed and lean.rows > 1000


def test_no_garbage_collection_runs_while_a_graph_is_captured(tiny_ckpt, water192):
    """The collector may free an old calculator's graph, a CUDA call a capture forbids: with
    the collector set to run every 100 allocations, none of its runs falls inside the
    capture of a new calculator's step, which records and gives forces."""
    import gc

    old = TCPETCalculator(tiny_ckpt, precision="tf32x3", device="cuda", engine="graphs")
    old.get_forces(water192.copy())
    old.itself = old  # a cycle: only the collector frees it and its graph
    del old
    during = []

    def collecting(phase, info):
        if phase == "start":
            during.append(torch.cuda.is_current_stream_capturing())

    threshold = gc.get_threshold()
    gc.callbacks.append(collecting)
    gc.set_threshold(100)  # thousands of objects are made during a capture
    try:
        atoms = water192.copy()
        atoms.calc = TCPETCalculator(tiny_ckpt, precision="tf32x3", device="cuda", engine="graphs")
        atoms.get_forces()  # the watchdog's eager step
        atoms.positions[0, 0] += 0.01
        forces = atoms.get_forces()  # recorded, then replayed
    finally:
        gc.set_threshold(*threshold)
        gc.callbacks.remove(collecting)
    assert atoms.calc._engine.recordings == 1 and np.isfinite(forces).all()
    assert during and not any(during)


def test_compiled_graph_engine_matches_metatomic(tiny_ckpt, water192):
    """compile=True with engine='graphs': compiled code recorded in the graph, same forces."""
    atoms = water192.copy()
    atoms.calc = TCPETCalculator(tiny_ckpt, precision="tf32x3", device="cuda", engine="graphs", compile=True)
    reference = water192.copy()
    reference.calc = TCPETCalculator(tiny_ckpt, precision="tf32x3", device="cuda", engine="metatomic")
    for _ in range(3):  # recorded once, replayed after
        atoms.positions += 0.01
        reference.positions += 0.01
        assert abs(atoms.get_potential_energy() - reference.get_potential_energy()) / len(atoms) < 2e-6
        assert np.abs(atoms.get_forces() - reference.get_forces()).max() < 3e-5


@pytest.mark.parametrize("precision", ["tf32x3", "bf16x9", "fp16x3"])
def test_every_tuning_candidate_gives_the_same_bits(tuning_cache, precision):
    """Tuning changes tiles, stages and warps, never the K-tile: each candidate computes
    the same bits, forward and backward; prepare() tunes both directions and writes the
    choice to the cache file."""
    import json

    from ase_tcfp32._backends import get_backend
    from ase_tcfp32._kernels import fp16x3
    from ase_tcfp32._kernels.triton_gemm import TritonBackend, tile_candidates

    if precision == "fp16x3" and not support("fp16x3", "cuda").available:
        pytest.skip("fp16x3 needs Hopper")
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(20_011, 256, device="cuda", generator=g)
    w = torch.randn(384, 256, device="cuda", generator=g)
    b = torch.randn(384, device="cuda", generator=g)
    if precision == "fp16x3":
        words = fp16x3.split_weight(w)
        outputs = [fp16x3.launch(x, words, b, config) for config in fp16x3.CANDIDATES]
    else:
        backend = TritonBackend(precision)
        outputs = [backend.launch(x, backend.gemm(w, config=config), b) for config in tile_candidates(384, 256)]
    assert all(torch.equal(y, outputs[0]) for y in outputs[1:])

    backend = get_backend(precision, torch.device("cuda"))
    prepared = backend.prepare(w)
    assert torch.equal(backend.forward(x, prepared, b), outputs[0])
    tuned = json.loads(tuning_cache.read_text())
    assert sorted(key.rsplit("|", 2)[1:] for key in tuned) == [["n=256", "k=384"], ["n=384", "k=256"]]


def test_warm_up_tunes_every_layer_before_the_first_step(tuning_cache, tiny_ckpt, water192):
    """After warm_up() the MD steps tune nothing more (the cache file stays as it was)
    and give what a calculator without warm-up gives."""
    atoms = water192.copy()
    atoms.calc = TCPETCalculator(tiny_ckpt, device="cuda")
    assert atoms.calc.warm_up(atoms) > 0
    tuned = tuning_cache.read_text()
    atoms.positions += 0.01
    forces = atoms.get_forces()
    assert tuning_cache.read_text() == tuned
    fresh = atoms.copy()
    fresh.calc = TCPETCalculator(tiny_ckpt, device="cuda")
    assert np.abs(fresh.get_forces() - forces).max() < 3e-5


# --- reliability: any thread, empty caches, the watchdog on the GPU -----------------


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


def test_default_calculator_does_not_import_the_compiler():
    """The first call of a torch.library custom op imports torch._dynamo (0.47 s
    of a 192-atom start on the H200, with the op registrations it brings); eager code calls
    our kernels directly, so a default calculator's process never imports it."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", EAGER_START], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "no dynamo" in done.stdout, done.stderr[-3000:]


@pytest.mark.parametrize("precision", ["tf32x3", "fp16x3"])
def test_watchdog_flags_the_fp16x3_outlier_on_the_gpu(precision):
    """fp16x3's kernel on a K-tile with one 1e8 entry over a zero weight column: flagged
    (issue 25's measured 487 units 2^-24); tf32x3 on the same input: FP32-accurate, quiet."""
    import warnings

    from ase_tcfp32 import PrecisionWarning, swap_linear_layers

    if precision == "fp16x3" and not support("fp16x3", "cuda").available:
        pytest.skip("fp16x3 needs Hopper")
    g = torch.Generator(device="cuda").manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 256)).cuda()
    with torch.no_grad():
        model[0].weight[:, ::32] = 0.0
    x = torch.randn(40_000, 512, device="cuda", generator=g)  # enough rows for the kernel
    x[:, ::32] = 1e8
    swap_linear_layers(model, precision, check_accuracy=1)
    with warnings.catch_warnings(record=True) as found:
        warnings.simplefilter("always")
        model(x)
    flagged = [w for w in found if issubclass(w.category, PrecisionWarning)]
    assert len(flagged) == (precision == "fp16x3"), [str(w.message) for w in flagged]


@pytest.mark.parametrize("engine", ["metatomic", "graphs"])
def test_watchdog_is_quiet_on_pet_in_every_engine(engine, water192):
    import warnings

    from ase_tcfp32 import PrecisionWarning
    from ase_tcfp32._folded import folded
    from ase_tcfp32.testing import random_checkpoint

    atoms = water192.repeat((2, 2, 1))  # 768 atoms: our kernels, not cuBLAS
    atoms.calc = TCPETCalculator(random_checkpoint("xs", seed=3), device="cuda", engine=engine, check_accuracy=2)
    with warnings.catch_warnings(record=True) as found:
        warnings.simplefilter("always")
        for _ in range(4):  # graphs: eager check, record, replay, eager check
            atoms.positions += 0.001
            atoms.get_forces()
    assert not [w for w in found if issubclass(w.category, PrecisionWarning)]
    # every layer was checked; a compression folded away (ase_tcfp32._folded) by its messages' layer
    folded_away = {id(m.compress[0]): folded(m).messages for m in atoms.calc.pet.modules() if hasattr(m, "compress")}
    layers = [folded_away.get(id(m), m) for m in atoms.calc.pet.modules() if hasattr(m, "check_accuracy")]
    assert all(m._calls["forward"] >= 2 for m in layers)


def test_a_batch_of_32_copies_gives_what_32_single_calls_give(water192):
    """32 beads of the 192-atom box in one call (6,144 atoms: our kernels, not cuBLAS), in
    the default precision: per structure the energies, forces and stresses of single calls."""
    from helpers import beads_of

    from ase_tcfp32.testing import random_checkpoint

    beads = beads_of(water192, 32)
    model = random_checkpoint("xs", seed=3)
    batched = TCPETCalculator(model, device="cuda").evaluate(beads)
    alone = TCPETCalculator(model, device="cuda")
    for bead, result in zip(beads, batched):
        single = alone.evaluate([bead])[0]
        assert result["energy"] == pytest.approx(single["energy"], rel=3e-6, abs=1e-4)
        assert np.abs(result["forces"] - single["forces"]).max() < 3e-5
        assert np.abs(result["stress"] - single["stress"]).max() < 1e-6


def test_the_gpus_pair_list_of_a_batch_is_vesins(water192, pt_bulk):
    """On the GPU small periodic cells get their pairs from lean.all_pairs, on the CPU from
    vesin: the same pairs, shifts, offsets and structures of pairs for a batch of
    beads, a triclinic cell, a cell whose atoms see their own images and a molecule."""
    from ase.build import molecule
    from helpers import beads_of

    from ase_tcfp32._neighbors import VIRIAL_BINS, Structures, build_pairs

    triclinic = water192.copy()
    triclinic.set_cell(water192.cell.array + [[0, 0, 0], [3.0, 0, 0], [1.0, 2.0, 0]], scale_atoms=False)
    structures = [*beads_of(water192, 8), triclinic, pt_bulk, molecule("CH3CH2OH")]
    batch = Structures.of(structures)
    lists = []
    for device in ("cpu", "cuda"):
        positions = torch.tensor(batch.positions, dtype=torch.float64, device=device)
        pairs = build_pairs(positions, batch.cells, batch.pbcs, batch.sizes, 10.0, 0)
        structure = pairs.bins // VIRIAL_BINS
        key = torch.cat([pairs.centers[:, None], pairs.neighbors[:, None], pairs.shifts, structure[:, None]], 1)[
            : pairs.count
        ]
        order = torch.from_numpy(np.lexsort(key.cpu().numpy().T[::-1]))
        lists.append([key.cpu()[order], pairs.offsets.cpu()[: pairs.count][order], pairs.first.cpu()])
    assert torch.equal(lists[0][0], lists[1][0]) and torch.equal(lists[0][2], lists[1][2])
    assert torch.allclose(lists[0][1], lists[1][1], rtol=0, atol=1e-12)


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
