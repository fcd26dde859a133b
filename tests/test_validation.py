import json

import numpy as np
import pytest
import torch

from ase_tcfp32.cli import main
from ase_tcfp32.validation import cantor_slab, co_on_pt111, report, water_box


def test_builders():
    water = water_box(64, seed=0)
    assert len(water) == 192 and water.get_chemical_formula() == "H128O64"
    assert water.get_volume() == pytest.approx(64 * 18.015 / 6.02214076e23 * 1e24, rel=1e-6)  # 1 g/cm³
    slab = cantor_slab(seed=3)
    assert len(slab) == 539 and slab.get_chemical_formula() == "Co108Cr108Fe108Mn107Ni108"
    assert not np.array_equal(slab.numbers, cantor_slab(seed=4).numbers)
    co = co_on_pt111(2.5)
    top_pt = co.positions[co.numbers == 78, 2].max()
    assert co.positions[-2, 2] - top_pt == pytest.approx(2.5)
    assert co.get_chemical_symbols()[-2:] == ["C", "O"]


@pytest.fixture(scope="module")
def quick_suite(tmp_path_factory):
    """The quick suite with the default model (the bundled demo) and precisions (every
    mode the CPU runs), NVE and FIRE runs in two worker processes (a third less time on the
    2-core CI machine)."""
    out = tmp_path_factory.mktemp("validation")
    main(["validate", "all", "--quick", "--jobs", "2", "--out", str(out), "--device", "cpu"])
    return out


def load(out, name):
    return json.loads((out / f"{name}.json").read_text())


def rows_by_precision(rows):
    return {r["precision"]: r for r in rows}


def test_every_test_writes_json_plot_and_the_report(quick_suite):
    for name in report.TESTS:
        assert (quick_suite / f"{name}.json").exists() and (quick_suite / f"{name}.png").stat().st_size > 1000
    text = (quick_suite / "report.md").read_text()
    assert "## smoothness" in text and "![nve](nve.png)" in text and "pet-demo-chgnet" in text


def test_single_point_fp32_accurate_modes_pass_and_tf32_does_not_meet_them(quick_suite):
    rows = rows_by_precision(load(quick_suite, "single-point")["systems"][0]["rows"])
    assert rows["tf32x3"]["passed"] and rows["fp16x3"]["passed"] and rows["bf16x9"]["passed"]
    assert rows["tf32"]["vs_fp32_force_rms"] > 100 * rows["fp32 noise"]["vs_fp32_force_rms"]


def test_smoothness_separates_single_pass_tf32(quick_suite):
    rows = rows_by_precision(load(quick_suite, "smoothness")["rows"])
    assert rows["tf32x3"]["passed"] and rows["fp16x3"]["passed"] and rows["bf16x9"]["passed"]
    assert rows["tf32"]["roughness"] > 20 * rows["fp32"]["roughness"]


def test_nve_runs_and_tracks_fp32(quick_suite):
    result = load(quick_suite, "nve")
    traces = result["traces"]
    assert all(r["finite"] for r in result["rows"])
    e32, e3 = np.array(traces["fp32"]["e_tot_eV_atom"]), np.array(traces["tf32x3"]["e_tot_eV_atom"])
    assert len(e32) == 21 and np.abs(e3 - e32).max() < 1e-5  # 100 steps, recorded every 5


def test_nve_measures_fp32_run_to_run_noise_from_a_displaced_start(quick_suite):
    result = load(quick_suite, "nve")
    assert [r["precision"] for r in result["rows"]][:2] == ["fp32", "fp32 noise"]
    e32, noise = (np.array(result["traces"][p]["e_tot_eV_atom"]) for p in ("fp32", "fp32 noise"))
    assert 0 < np.abs(noise - e32).max() < 1e-5


def test_report_from_the_files_of_tests_run_one_by_one(quick_suite, capsys):
    before = (quick_suite / "report.md").read_text()
    (quick_suite / "report.md").unlink()
    main(["validate", "report", "--out", str(quick_suite)])
    assert (quick_suite / "report.md").read_text() == before
    with pytest.raises(FileNotFoundError, match="no validation results"):
        main(["validate", "report", "--out", str(quick_suite / "empty")])


def test_nve_in_worker_processes_gives_the_same_trajectories(quick_suite, tmp_path):
    """--jobs 2 (the quick suite's) runs the precisions in two spawned processes, each with
    its share of the CPU threads; here they run again one after the other, in this process.
    A different thread count changes the order of CPU reductions, so the trajectories
    agree within FP32's own noise: the larger of the spread that a 1e-6 Å displacement
    (the "fp32 noise" run) gives the serial FP32 trajectory, and four units of FP32
    rounding of the total energy. The displaced run is one sample of that noise
    and the reordered one another, so either can be the larger (1.46e-7 against 1.38e-7
    eV/atom in one CI run, at 5.2 eV/atom, whose FP32 rounding unit is 3.1e-7); a worker
    with the wrong model or precision misses by orders of magnitude."""
    main(
        [
            "validate",
            "nve",
            "--model",
            "pet-demo-chgnet",
            "--quick",
            "--precisions",
            "fp32,tf32x3",
            "--out",
            str(tmp_path),
            "--device",
            "cpu",
        ]
    )
    parallel, serial = load(quick_suite, "nve")["traces"], load(tmp_path, "nve")["traces"]
    energy = {name: np.array(trace["e_tot_eV_atom"]) for name, trace in serial.items()}
    noise = max(np.abs(energy["fp32 noise"] - energy["fp32"]).max(), 4 * 2.0**-24 * np.abs(energy["fp32"]).max())
    for precision in ("fp32", "tf32x3"):
        assert np.abs(np.array(parallel[precision]["e_tot_eV_atom"]) - energy[precision]).max() <= noise


def test_relax_trajectories_agree_at_the_start_and_converge_as_fp32_does(quick_suite):
    """The quick FIRE run is long enough for FP32 to converge with the bundled model (90
    steps on the CI machine), so the FP32-accurate precisions get a verdict, and pass."""
    result = load(quick_suite, "relax")
    runs = result["runs"]
    f32 = np.array(runs["fp32"][0]["fmax_trace"][:10])
    for precision in ("tf32x3", "bf16x9"):
        assert np.allclose(runs[precision][0]["fmax_trace"][:10], f32, rtol=1e-4)
    rows = rows_by_precision(result["rows"])
    assert rows["fp32"]["converged"] == "1/1"
    assert all(rows[p]["passed"] is True for p in ("tf32x3", "fp16x3", "bf16x9"))


def test_relax_gives_no_verdict_when_fp32_does_not_converge(tmp_path):
    from ase_tcfp32.validation.common import resolve_model

    result = report.run(
        "relax", resolve_model("random:tiny"), ["fp32", "tf32x3"], "cpu", tmp_path, quick=True, max_steps=2
    )
    rows = rows_by_precision(result["rows"])
    assert rows["fp32"]["converged"] == "0/1" and rows["tf32x3"]["passed"] is None
    assert report._verdict(result["rows"]) == "tf32x3 no verdict (FP32 itself did not converge)"


def test_speed_reports_every_precision_against_fp32(quick_suite):
    rows = rows_by_precision(load(quick_suite, "speed")["systems"][0]["rows"])
    assert set(rows) == {"fp32", "tf32", "tf32x3", "fp16x3", "bf16x9"}
    assert rows["fp32"]["speedup"] == 1.0 and rows["tf32x3"]["backend"] == "reference"


def test_api_runs_one_test_and_rejects_unknown_names(tmp_path):
    from ase_tcfp32.validation.common import resolve_model

    result = report.run("single-point", resolve_model("random:tiny"), ["fp32", "tf32x3"], "cpu", tmp_path, quick=True)
    assert result["test"] == "single-point"
    with pytest.raises(ValueError, match="unknown validation test 'nvt'"):
        report.run("nvt", "x", ["fp32"])


def test_cli_runs_a_test_in_the_lean_engine(tmp_path):
    """``--engine lean``: the calculators of the test use it, the JSON and report say so,
    and the FP32-accurate mode still passes against the (metatomic) FP64 reference."""
    main(
        [
            "validate",
            "single-point",
            "--model",
            "random:tiny",
            "--precisions",
            "fp32,tf32x3",
            "--device",
            "cpu",
            "--engine",
            "lean",
            "--quick",
            "--out",
            str(tmp_path),
        ]
    )
    result = load(tmp_path, "single-point")
    assert result["environment"]["engine"] == "lean"
    assert rows_by_precision(result["systems"][0]["rows"])["tf32x3"]["passed"]
    with pytest.raises(SystemExit):
        main(["validate", "nve", "--model", "random:tiny", "--engine", "fast"])


def test_cli_rejects_unknown_precision(capsys):
    with pytest.raises(SystemExit, match="unknown precision 'fp16'"):
        main(["validate", "nve", "--model", "random:tiny", "--precisions", "fp32,fp16"])


def test_info_lists_precisions_and_auto(capsys, monkeypatch):
    monkeypatch.setattr("sys.dont_write_bytecode", True)  # as PYTHONDONTWRITEBYTECODE=1 sets it
    main(["info"])
    assert "python bytecode cache: off (PYTHONDONTWRITEBYTECODE" in capsys.readouterr().out
    monkeypatch.setattr("sys.dont_write_bytecode", False)
    main(["info"])
    out = capsys.readouterr().out
    assert "python bytecode cache: " in out and "PYTHONDONTWRITEBYTECODE" not in out
    assert "auto -> fp32" in out and "tf32x3" in out and "pet-mad-s" in out
    assert "GEMM tuning: on" in out and "autotune.json" in out
    assert "triton kernel cache: " in out
    assert "attention: torch SDPA" in out  # the CPU's (tensor-core attention is for CUDA)


# --- on the GPU (pytest -m gpu tests; skipped without CUDA) ---


@pytest.mark.gpu
def test_info_reports_the_gpu_and_cublas(capsys):
    from ase_tcfp32.cli import main

    main(["info"])
    out = capsys.readouterr().out
    assert torch.cuda.get_device_name() in out and "cuBLAS 1" in out and "auto -> " in out
    assert "attention: tensor cores (TF32x3) in tf32x3" in out


def test_direct_against_conservative_matches_each_calculator_regime():
    """``direct_against_conservative`` on a water box (3D-periodic) and a CO/Pt slab (not):
    its RMS figures equal those from two calculators, one reading the conservative forces and
    stress, the other the direct heads (``non_conservative=True``): the same model, the
    other code path; the slab has no stress figures."""
    from helpers import quiet_calculator

    from ase_tcfp32.testing import random_pet
    from ase_tcfp32.validation.accuracy import direct_against_conservative

    pet = random_pet("tiny", seed=3, atomic_types=[1, 6, 8, 78])
    water, slab = water_box(8, seed=1), co_on_pt111(2.5)
    water.info["family"], slab.info["family"] = "water", "co-pt111"
    table = direct_against_conservative(quiet_calculator(pet), [water, slab])
    conservative, direct = quiet_calculator(pet), quiet_calculator(pet, non_conservative=True)
    for atoms, family in ((water, "water"), (slab, "co-pt111")):
        forces, direct_forces = conservative.get_forces(atoms), direct.get_forces(atoms)
        row = table[family]
        assert row["force_rms_conservative"] == pytest.approx(1000 * np.sqrt(np.mean(forces**2)), rel=1e-9)
        difference = 1000 * np.sqrt(np.mean((direct_forces - forces) ** 2))
        assert row["force_rms_difference"] == pytest.approx(difference, rel=1e-6) and difference > 0
    stress, direct_stress = conservative.get_stress(water), direct.get_stress(water)
    assert table["water"]["stress_rms_difference"] == pytest.approx(
        1000 * np.sqrt(np.mean((direct_stress - stress) ** 2)), rel=1e-6
    )
    assert table["co-pt111"]["stress_rms_conservative"] is None
