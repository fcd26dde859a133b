"""Does a PET of the demo model's size learn direct (non-conservative) forces from scratch?

    python scripts/demo_model/direct_probe.py --mode joint       --out probe.json [--frames 60] [--minutes 8]
    python scripts/demo_model/direct_probe.py --mode direct-only --out probe.json [--frames 40] [--minutes 3] [--batch-size 8]

An experiment, not part of the recipe (docs/demo_model.md, "Direct force and stress heads").
In a fresh folder (``--work``): Langevin runs of the shipped demo model
(``TCPETCalculator("pet-demo-chgnet")``, on the GPU when there is one) on six water boxes of
48-192 atoms at 300-500 K, ``--frames`` frames from each, labelled with the model's own
energy and forces, the forces also as the direct-force target (self-distillation: the targets
are what the direct heads would have to reproduce); one frame in eight held out for
validation. Then ``mtt train`` from random weights with the demo model's architecture
(``scripts/demo_model/options.yaml``) on the energy, its forces (``joint``; ``direct-only``:
``forces: off``, as the atomistic cookbook's non-conservative pre-training does) and a
``non_conservative_force`` target, 100 epochs of cosine schedule, stopped after
``--minutes``. Writes each epoch's validation RMSE of both kinds of forces and the RMS of the
validation forces (what predicting zero scores) to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import yaml
from self_distilled_heads import DIRECT_FORCE, mtt_command  # this folder is on the path of a script run from it

HERE = Path(__file__).resolve().parent
RUNS = [(16, 300), (32, 350), (48, 400), (64, 450), (32, 500), (64, 300)]
"""(water molecules, temperature in K) of the Langevin runs."""


def make_frames(frames: int, stride: int, device: str) -> list:
    """``frames`` frames ``stride`` steps (0.5 fs) apart from each run of :data:`RUNS`."""
    from ase import units
    from ase.md.langevin import Langevin
    from ase.md.velocitydistribution import MaxwellBoltzmannDistribution

    from ase_tcfp32 import TCPETCalculator
    from ase_tcfp32.validation import water_box

    rng = np.random.default_rng(0)
    out = []
    for seed, (molecules, temperature) in enumerate(RUNS):
        atoms = water_box(molecules, seed=seed)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            atoms.calc = TCPETCalculator("pet-demo-chgnet", device=device, uncertainty_threshold=None)
            MaxwellBoltzmannDistribution(atoms, temperature_K=temperature, rng=rng)
        dynamics = Langevin(atoms, 0.5 * units.fs, temperature_K=temperature, friction=0.02, rng=rng)
        dynamics.run(4 * stride)
        for _ in range(frames):
            dynamics.run(stride)
            frame = atoms.copy()
            frame.info["energy"] = atoms.get_potential_energy()
            frame.arrays["forces"] = atoms.get_forces().copy()
            frame.arrays["direct_forces"] = frame.arrays["forces"].copy()
            out.append(frame)
    return [out[i] for i in rng.permutation(len(out))]


def options(mode: str, batch_size: int = 8) -> dict:
    """``mtt train`` options: the demo model's architecture, the energy (with its forces
    unless ``direct-only``) and a direct-force target, ``batch_size`` structures per step."""
    base = yaml.safe_load((HERE / "options.yaml").read_text())
    base["architecture"]["training"].update(num_epochs=100, checkpoint_interval=1000, batch_size=batch_size)

    def dataset(path: str) -> dict:
        energy = {"key": "energy", "unit": "eV", "forces": False if mode == "direct-only" else {"key": "forces"}}
        return {
            "systems": {"read_from": path, "length_unit": "angstrom"},
            "targets": {"energy": energy, "non_conservative_force": DIRECT_FORCE},
        }

    return dict(base, training_set=dataset("train.xyz"), validation_set=dataset("val.xyz"), test_set=0.0)


def epochs(log: str) -> list[dict]:
    """Each epoch's validation RMSEs (meV/Å) from ``mtt train``'s log."""
    rows = []
    for line in log.splitlines():
        epoch = re.search(r"Epoch:\s*(\d+)", line)
        if not epoch:
            continue
        row = {"epoch": int(epoch.group(1))}
        for name, key in [("forces", "validation forces RMSE"), ("direct", "validation non_conservative_force RMSE")]:
            found = re.search(re.escape(key) + r"[^:]*:\s*([\d.]+)", line)
            if found:
                row[name] = float(found.group(1))
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["joint", "direct-only"], default="joint")
    parser.add_argument("--frames", type=int, default=60, help="frames per Langevin run")
    parser.add_argument("--stride", type=int, default=10, help="MD steps between frames")
    parser.add_argument("--minutes", type=float, default=8.0, help="training stops after this long")
    parser.add_argument("--batch-size", type=int, default=8, help="structures per optimizer step")
    parser.add_argument("--work", default="build/direct-probe")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    import torch
    from ase.io import write

    mtt = mtt_command("direct_probe.py")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    frames = make_frames(args.frames, args.stride, device)
    held = len(frames) // 8
    write(work / "val.xyz", frames[:held])
    write(work / "train.xyz", frames[held:])
    (work / "options.yaml").write_text(yaml.safe_dump(options(args.mode, args.batch_size)))
    try:
        run = subprocess.run(
            [mtt, "train", "options.yaml", "-o", "model.pt"],
            cwd=work,
            capture_output=True,
            text=True,
            timeout=60 * args.minutes,
        )
        log, finished = run.stdout + run.stderr, True
        if run.returncode:
            sys.exit(f"mtt train failed (exit status {run.returncode}); the end of its log:\n{log[-3000:]}")
    except subprocess.TimeoutExpired as stopped:
        text = [part.decode() if isinstance(part, bytes) else part or "" for part in (stopped.stdout, stopped.stderr)]
        log, finished = "".join(text), False
    validation = np.concatenate([frame.arrays["forces"] for frame in frames[:held]])
    result = {
        "mode": args.mode,
        "batch_size": args.batch_size,
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "frames": {"train": len(frames) - held, "validation": held},
        "zero_prediction_force_rmse_meV_A": round(1000 * float(np.sqrt((validation**2).mean())), 1),
        "all_100_epochs_ran": finished,
        "validation_rmse_meV_A_by_epoch": epochs(log),
    }
    Path(args.out).write_text(json.dumps(result, indent=1))
    last = result["validation_rmse_meV_A_by_epoch"][-1:] or [{}]
    print(f"zero prediction {result['zero_prediction_force_rmse_meV_A']} meV/A, last epoch {last[0]}")


if __name__ == "__main__":
    main()
