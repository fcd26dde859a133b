"""Direct force and stress heads from random weights: the pre-training before the recipe's stage 1.

    # the curriculum of docs/demo_model.md: water alone, then all four families (H200, then 2 CPU cores)
    python scripts/demo_model/direct_pretraining.py --families water --steps 10290 --out water.json
    python scripts/demo_model/direct_pretraining.py --start water.ckpt --lr 3e-4 --steps 8189 --out all.json
    python scripts/demo_model/direct_pretraining.py --start all.ckpt --lr 3e-4 --per-family --anneal 0.3 \
        --steps 41630 --out pretrained.json

metatrain's PET outputs vectors through plain linear heads, so its backbone must learn to carry
directions; from random weights the direct forces sit at the zero prediction for thousands of
steps before they learn (docs/demo_model.md, "Direct force and stress heads"). This script gets
past that point, as the atomistic cookbook's non-conservative pre-training does, before the
energy is trained:

1. ``WORK/direct/``: the options and sets of ``direct_options.py`` for ``make_dataset.py``'s
   first four families (``WORK/{train,val}.xyz``, the teacher's labels). Stage 1 fine-tunes
   from this script's checkpoint with these options.
2. ``mtt train options.yaml`` for one epoch from random weights: a checkpoint with every head,
   the composition baseline and the target scales (skipped with ``--start``: that checkpoint's).
3. Every weight (with ``--heads-only`` the direct heads' alone: the energy stays as it was)
   trained on the direct targets alone for ``--steps`` (or ``--minutes``): one structure per
   step under a random rotation or improper rotation, Adam at ``--lr`` (constant, then a cosine
   to zero over the last ``--anneal`` of the run: at a constant rate, one structure per step,
   the validation errors jump by tens of percent between evaluations), loss = the direct
   forces' squared error over the labels' mean square (over all families, or with
   ``--per-family`` the structure's family's, so that the alloy's small forces weigh as much
   as the molecules' large ones; + the same for the stress on bulk structures). Every 500
   steps the validation direct-force RMSE per family (meV/Å, beside what predicting zero
   scores) goes to ``--out``, the weights beside it (suffix ``.ckpt``).

``WORK`` may hold other labels than the teacher's: ``self_distilled_heads.py label --model
CKPT`` writes a model's own (its conservative forces as the direct targets).

The loop is bound by Python and launches: ~26 steps per second on an H200, ~17 on 2 CPU cores
(~11 each for two runs side by side with ``OMP_NUM_THREADS=1``).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch
from direct_options import write_options  # this folder is on the path of a script run from it
from self_distilled_heads import Trainer, mtt_command


def initial_checkpoint(folder: Path) -> Path:
    """One epoch of ``mtt train`` from random weights: every head, baseline and scale in place."""
    command = [mtt_command("direct_pretraining.py"), "train", "options.yaml", "-o", "init.pt"]
    command += ["-r", "architecture.training.num_epochs=1"]
    run = subprocess.run(command, cwd=folder, capture_output=True, text=True)
    if run.returncode:
        sys.exit(f"mtt train failed (exit status {run.returncode}):\n{(run.stdout + run.stderr)[-3000:]}")
    return folder / "init.ckpt"


class DirectTrainer(Trainer):
    """:class:`self_distilled_heads.Trainer`'s data and rotations, the direct targets alone."""

    def direct_errors(self, batch: list, augment: bool) -> list[dict]:
        """Per structure: direct force error [atoms, 3] (eV/Å), direct stress error [3, 3] (eV/Å^3)."""
        rotations, systems = self.rotated(batch, augment)
        out = self.pet(systems, {k: v for k, v in self.outputs.items() if k != "energy"})
        direct = out["non_conservative_force"].block().values[:, :, 0]
        stress = out["non_conservative_stress"].block().values[:, :, :, 0]
        rows, start = [], 0
        for i, (rotation, (_, labels)) in enumerate(zip(rotations, batch)):
            n = labels["atoms"]
            row = {"family": labels["family"], "direct": direct[start : start + n] - labels["forces"] @ rotation.T}
            if "stress" in labels:
                row["stress"] = stress[i] - rotation @ labels["stress"] @ rotation.T
            rows.append(row)
            start += n
        return rows

    def held_out_errors(self) -> dict:
        sums: dict = {}
        with torch.no_grad():
            for i in range(0, len(self.held_out), 8):
                for r in self.direct_errors(self.held_out[i : i + 8], augment=False):
                    sums.setdefault(r["family"], []).extend(r["direct"].pow(2).flatten().tolist())
        return {family: round(1000 * math.sqrt(np.mean(s)), 1) for family, s in sorted(sums.items())}

    def force_scales(self) -> dict:
        """Per family, the mean square force (eV²/Å²) that divides a structure's direct-force
        error: the family's own with ``--per-family``, else that of all training structures."""
        squares: dict = {}
        for _, labels in self.train:
            squares.setdefault(labels["family"], []).append(labels["forces"].pow(2).flatten())
        if not self.args.per_family:
            return dict.fromkeys(squares, self.force_ms)
        return {family: float(torch.cat(values).mean()) for family, values in squares.items()}

    def progress(self, step: int, seconds: float) -> float:
        """How far the run is, from 0 to 1: in ``--steps`` where given, else in ``--minutes``."""
        return step / self.args.steps if self.args.steps else seconds / (60 * self.args.minutes)

    def run(self) -> list[dict]:
        scales = self.force_scales()
        trained = [
            w for name, w in self.pet.named_parameters() if "non_conservative" in name or not self.args.heads_only
        ]
        for weight in self.pet.parameters():
            weight.requires_grad_(any(weight is w for w in trained))
        optimizer = torch.optim.Adam(trained, lr=self.args.lr)
        log, step, start = [], 0, time.time()
        while (done := self.progress(step, time.time() - start)) < 1:
            into_anneal = (done - 1 + self.args.anneal) / self.args.anneal if self.args.anneal else 0.0
            optimizer.param_groups[0]["lr"] = self.args.lr * (0.5 + 0.5 * math.cos(math.pi * max(into_anneal, 0.0)))
            (row,) = self.direct_errors([self.train[self.rng.integers(len(self.train))]], augment=True)
            loss = row["direct"].pow(2).mean() / scales[row["family"]]
            if "stress" in row:
                loss = loss + row["stress"].pow(2).mean() / self.stress_ms
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            if step % 500 == 0:
                log.append({"step": step, "seconds": round(time.time() - start), "validation": self.held_out_errors()})
                print(json.dumps(log[-1]), flush=True)
        log.append({"step": step, "seconds": round(time.time() - start), "validation": self.held_out_errors()})
        return log


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", default="build/demo-model", help="make_dataset.py's output folder")
    parser.add_argument("--steps", type=int, help="structures to train on (one per step); default: --minutes")
    parser.add_argument("--minutes", type=float, default=5.0, help="without --steps: train for this long")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--anneal", type=float, default=0.0, help="last fraction of the time: --lr cosine to 0")
    parser.add_argument(
        "--per-family", action="store_true", help="scale each family's force loss by its own mean square"
    )
    parser.add_argument("--families", help="comma-separated: train and validate on these families only")
    parser.add_argument(
        "--heads-only", action="store_true", help="train the direct heads alone (the backbone and energy untouched)"
    )
    parser.add_argument("--start", help="a checkpoint with the heads whose weights to start from (default: step 2's)")
    parser.add_argument("--out", required=True, help="JSON log; the weights go beside it with the suffix .ckpt")
    args = parser.parse_args()
    from ase.io import read

    work = Path(args.work)
    if not (work / "train.xyz").exists():
        sys.exit(f"{work}/train.xyz missing: run scripts/make_dataset.py --out {work} first")
    folder = work / "direct"
    write_options(work, folder)
    checkpoint = Path(args.start) if args.start else initial_checkpoint(folder)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    families = args.families.split(",") if args.families else None
    train, val = (
        [f for f in read(work / f"{split}.xyz", ":") if families is None or f.info["family"] in families]
        for split in ("train", "val")
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = DirectTrainer(checkpoint, train, val, args, device)
    zero = trainer.zero_prediction()
    print(f"{len(trainer.train)} training, {len(trainer.held_out)} validation structures; zero {zero}", flush=True)
    log = trainer.run()
    trainer.save(Path(args.out).with_suffix(".ckpt"))
    result = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "structures": {"train": len(trainer.train), "validation": len(trainer.held_out)},
        "settings": {
            "steps": args.steps,
            "minutes": None if args.steps else args.minutes,
            "lr": args.lr,
            "anneal": args.anneal,
            "per_family": args.per_family,
            "heads_only": args.heads_only,
            "families": args.families,
            "start": args.start,
        },
        "zero_prediction_meV_A": zero,
        "log": log,
    }
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
