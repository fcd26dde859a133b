"""benchmarks/speed_of_light.py: its FLOP counts against torch's own count of the same
forward and backward pass, its stages against the package's forward, and its floors-only
run on a CPU."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from ase_tcfp32 import _packed
from ase_tcfp32.validation import water_box

ROOT = Path(__file__).parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import speed_of_light as sol  # noqa: E402


@pytest.fixture(scope="module")
def tiny():
    """A tiny PET-MAD-shaped model's calculator on 96 water atoms, its kept neighbors,
    candidate pairs and stages run one by one."""
    atoms = water_box(32, seed=0)
    calc = sol.make_calculator("tiny", "fp16x3", atoms, "cpu")
    counts, candidates = sol.neighbors(calc, atoms)
    return calc, atoms, counts, candidates, sol.StagedStep(calc, atoms)


def test_flops_are_torchs_count_of_the_same_pass(tiny):
    """Every Linear product of the stages, forward and backward (frozen weights: input
    gradients only), is what torch's FlopCounterMode counts on the package's packed-row
    forward; the attention (here torch's padded fallback: every sequence T long) is 4 d N T²
    forward and twice that backward, the formula the floors apply to the real lengths."""
    calc, atoms, counts, candidates, staged = tiny
    packed = staged.packed
    leaves = [packed.vectors.clone(), packed.distances.clone(), packed.factors.clone()]
    for leaf in leaves:
        leaf.requires_grad_(True)
    inputs = packed._replace(vectors=leaves[0], distances=leaves[1], factors=leaves[2])
    with torch.no_grad():
        _packed.predictions(calc.pet.backend, inputs, ["energy"])  # the folded weights made outside the count
    with FlopCounterMode(display=False) as forward:
        energies = _packed.predictions(calc.pet.backend, inputs, ["energy"])[0][0]
    with FlopCounterMode(display=False) as backward:
        torch.autograd.grad(energies.sum(), leaves)

    stages = sol.model_stages(calc.pet, counts, candidates, rows=staged.engine.rows)
    linear = {
        direction: sum(s.gemm_flops + s.fp32_flops for s in stages if s.direction == direction)
        for direction in ("forward", "backward")
    }
    width = calc.pet.backend.gnn_layers[0].trans.layers[0].attention.input_linear.in_features
    layers = sum(len(gnn.trans.layers) for gnn in calc.pet.backend.gnn_layers)
    tokens = packed.sequences.tokens  # the fallback pads every sequence to this length
    padded = layers * sol.attention_flops(width, len(atoms) * tokens**2)
    assert forward.get_total_flops() == linear["forward"] + padded
    assert backward.get_total_flops() == linear["backward"] + 2 * padded
    assert linear["backward"] < linear["forward"]  # the first layer's embeddings need no gradient

    real = layers * sol.attention_flops(width, float(((counts.double() + 1) ** 2).sum()))
    assert sum(s.attention_flops for s in stages if s.direction == "forward") == real
    assert sum(s.attention_flops for s in stages if s.direction == "backward") == 2 * real
    assert all(s.gemm_flops == 0 for s in stages if s.kind in ("attention", "inputs", "embeddings"))


def test_floors_follow_the_peaks(tiny):
    calc, atoms, counts, candidates, _ = tiny
    stages = sol.model_stages(calc.pet, counts, candidates)
    for stage in stages:
        floor, bound = stage.floor_ms("fp16x3")
        memory = 1e3 * stage.bytes / sol.PEAKS["hbm"]
        compute = 1e3 * (3 * stage.gemm_flops / 989e12 + stage.attention_tf32_flops / 494e12 + stage.fp32_flops / 67e12)
        assert stage.bytes > 0 and floor == pytest.approx(max(compute, memory), rel=1e-12)
        assert bound == ("compute" if compute > memory else "memory")
        # tf32x3's products run at half fp16x3's rate: never a lower floor
        assert stage.floor_ms("tf32x3")[0] >= floor
    total = sol.totals(stages, "fp16x3")
    assert total["stage_floor_ms"] >= max(total["tensor_core_floor_ms"], total["memory_floor_ms"])


def test_stages_one_by_one_are_the_packages_forward_and_time(tiny, capsys):
    """The measured side on a CPU (no profile there): the step's time, and every stage of
    the floors timed alone through the package's functions, whose energies are its forward's."""
    (row,) = sol.analyse("tiny", 96, ["fp16x3"], "cpu", reps=1, replay_us=None, measure=True)
    assert row["step_ms"] > 0 and row["staged_energy_error"] == 0.0
    assert all(stage["measured_ms"] > 0 for stage in row["stages"])
    assert row["stages_measured_ms"] == pytest.approx(sum(stage["measured_ms"] for stage in row["stages"]), rel=1e-4)
    sol.show(row)
    assert "furthest above their floors" in capsys.readouterr().out


def test_floors_only_run_writes_its_rows(tmp_path):
    out = tmp_path / "speed_of_light_cpu.json"
    command = [sys.executable, "benchmarks/speed_of_light.py", "--models", "tiny", "--atoms", "96", "--dry-run"]
    done = subprocess.run([*command, "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "peaks used" in done.stdout and "sum of stage floors" in done.stdout
    data = json.loads(out.read_text())
    assert [(r["precision"], r["atoms"]) for r in data["rows"]] == [("fp16x3", 96), ("tf32x3", 96)]
    for row in data["rows"]:
        assert "step_ms" not in row and row["stage_floor_ms"] > 0
        assert {k["kind"] for k in row["kinds"]} == set(sol.KINDS)
