"""Every example runs, in a short form, as a user would start it."""

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).parents[1] / "examples"

RUNS = {
    "md_water.py": (
        ["--nvt", "3", "--nve", "3", "--traj", "w.traj", "--device", "cpu", "--engine", "lean"],
        "trajectory: w.traj",
    ),
    "relax_adsorbate.py": (["--steps", "3", "--device", "cpu"], "converged:"),
    "cell_relax.py": (["--steps", "3", "--device", "cpu"], "cell lengths"),
    "compare_precisions.py": (["--device", "cpu"], "tf32x3"),
    "preview_gpu.py": (["--model", "{tiny}"], "bf16x9 on B200"),  # the tiny model: 18 s, not 3 min
    # water vapour: ~1,000-atom domains with their halos, not 7,000 (docs/scaling.md)
    "lammps_water.py": (["--molecules", "27", "--density", "0.1", "--steps", "2", "--device", "cpu"], "LAMMPS ran 2"),
}


def test_every_example_is_covered():
    assert {p.name for p in EXAMPLES.glob("*.py")} == set(RUNS)


@pytest.mark.parametrize("script", sorted(RUNS))
def test_example_runs(script, tmp_path, tiny_ckpt):
    args, expected = RUNS[script]
    args = [a.format(tiny=tiny_ckpt) for a in args]
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args], cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert expected in result.stdout
    if script == "md_water.py":
        from ase.io import read

        frames = read(tmp_path / "w.traj", ":")
        assert len(frames) >= 2 and len(frames[0]) == 192
