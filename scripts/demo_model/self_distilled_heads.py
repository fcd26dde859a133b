"""Direct heads for the shipped demo PET, trained with its whole backbone on its own labels.

    python scripts/demo_model/self_distilled_heads.py label --seed 11 --work build/heads   # ~2 min on 2 CPU cores
    python scripts/demo_model/self_distilled_heads.py train --work build/heads --minutes 7.4 --out heads.json
    python scripts/demo_model/self_distilled_heads.py evaluate heads.ckpt --merge-into heads.json   # ~3 min, CPU

An experiment, not part of the recipe (docs/demo_model.md, "Direct force and stress heads").

``label``: the structures of ``scripts/make_dataset.py`` (all five families; its generators
with another seed, the water runs driven by the demo model instead of the teacher),
labelled by the shipped model itself (FP32): energy, forces and, where 3D-periodic, stress,
the forces also as ``direct_forces`` and the stress as ``direct_stress`` (a 9-vector),
written to ``WORK/self-SEED.xyz``. No teacher is needed: the labels are what the model
already predicts, so fitting them keeps it where it is.

``train`` (a GPU): the PET inside the shipped checkpoint before its LLPR
(``git show 0336e4f:ase_tcfp32/data/pet-demo-chgnet.ckpt > WORK/stage5.ckpt``) gets
metatrain's direct force and stress heads (``mtt train`` with the ``heads`` method on 64
structures, one epoch: the checkpoint then has them, their scales included). Then all of its
weights are trained for ``--minutes`` on the labelled structures, one in ten held out:
batches of ``--batch`` structures, each under a random rotation or improper rotation; loss =
(energy drift / ``--energy-scale``)^2 per atom + (conservative force drift /
``--force-scale``)^2 + the direct forces' and stress's squared errors over the labels' mean
squares. The backbone is frozen for the first ``--frozen`` of the time (the new heads alone,
at ``--heads-lr``), then trained at ``--lr``; both rates follow a cosine over the time.
Every 500 steps, per family on the held-out structures: RMS energy drift (meV/atom),
conservative force drift and direct-force error (meV/Å) against the labels, written with
the zero prediction's RMS to ``--out``; the trained checkpoint to ``--out`` with the suffix
``.ckpt``.

``evaluate``: that checkpoint and the shipped model on the teacher-labelled test set
(``tests/data/demo_model/test.xyz``, FP32, CPU), per family: energy and force MAE against
the teacher for both, how far the fine-tune moved the energies and forces, and the direct
forces' RMS difference from the checkpoint's own conservative forces beside the RMS of those
(what predicting zero scores).
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import shutil
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch
import yaml
from direct_options import TEACHER_FORCE, TEACHER_STRESS  # this folder is on the path of a script run from it

HERE = Path(__file__).resolve().parent
DIRECT_FORCE = dict(TEACHER_FORCE, key="direct_forces")
"""The direct-force target: the shipped model's own forces, stored under ``direct_forces``."""
DIRECT_STRESS = dict(TEACHER_STRESS, key="direct_stress")
"""The direct-stress target: the shipped model's own stress, stored under ``direct_stress``."""


def label(seed: int, work: Path, model: str = "pet-demo-chgnet") -> None:
    """make_dataset.py's structures labelled by ``model`` (default the shipped one; see module doc)."""
    from ase.io import write

    sys.path.insert(0, str(HERE.parent))
    import make_dataset

    from ase_tcfp32 import TCPETCalculator

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        calc = TCPETCalculator(model, device="cpu", precision="fp32", uncertainty_threshold=None)
    rng = np.random.default_rng(seed)
    frames = []
    for make in (
        make_dataset.co_pt,
        make_dataset.cantor,
        make_dataset.diversity,
        make_dataset.water,
        make_dataset.contacts,
    ):
        kept = [f for f in make(calc, rng) if np.abs(f.get_forces()).max() <= make_dataset.MAX_FORCE]
        print(f"{make.__name__}: {len(kept)} structures", flush=True)
        frames += kept
    for frame in frames:
        frame.arrays["direct_forces"] = frame.get_forces().copy()
        if frame.pbc.all():
            frame.info["direct_stress"] = frame.get_stress(voigt=False).reshape(9)
    work.mkdir(parents=True, exist_ok=True)
    write(work / f"self-{seed}.xyz", frames, format="extxyz")


def mtt_command(script: str) -> str:
    """metatrain's ``mtt``: the running environment's own, else the one on PATH; ``script``
    (the caller's name) stops with a clear error when there is none."""
    beside = Path(sys.executable).with_name("mtt")
    mtt = str(beside) if beside.exists() else shutil.which("mtt")
    if mtt is None:
        sys.exit(f"{script} needs metatrain's mtt (pip install metatrain)")
    return mtt


def add_heads(work: Path, frames: list) -> Path:
    """``mtt train`` with metatrain's heads method (``heads.yaml``, one epoch) on ``frames``."""
    from ase.io import write

    mtt = mtt_command("self_distilled_heads.py")
    subset = []
    for frame in frames[:64]:
        plain = frame.copy()  # numbers, positions and the direct targets only: metatrain reads keys by name
        plain.calc = None
        for key in [k for k in plain.arrays if k not in ("numbers", "positions", "direct_forces")]:
            del plain.arrays[key]
        subset.append(plain)
    write(work / "heads-bulk.xyz", [f for f in subset if f.pbc.all()])
    write(work / "heads-open.xyz", [f for f in subset if not f.pbc.all()])
    options = yaml.safe_load((HERE / "heads.yaml").read_text())
    options["architecture"]["training"]["num_epochs"] = 1
    sets = [
        {
            "systems": {"read_from": "heads-bulk.xyz", "length_unit": "angstrom"},
            "targets": {"non_conservative_force": DIRECT_FORCE, "non_conservative_stress": DIRECT_STRESS},
        },
        {
            "systems": {"read_from": "heads-open.xyz", "length_unit": "angstrom"},
            "targets": {"non_conservative_force": DIRECT_FORCE},
        },
    ]
    (work / "heads.yaml").write_text(
        yaml.safe_dump(dict(options, training_set=sets, validation_set=sets, test_set=0.0))
    )
    run = subprocess.run([mtt, "train", "heads.yaml", "-o", "model.pt"], cwd=work, capture_output=True, text=True)
    if run.returncode:
        sys.exit(f"mtt train failed (exit status {run.returncode}):\n{(run.stdout + run.stderr)[-3000:]}")
    return work / "model.ckpt"


class Trainer:
    """The whole PET on the labelled structures (see module doc)."""

    def __init__(self, checkpoint: Path, train: list, held_out: list, args, device: torch.device):
        from metatomic.torch import ModelOutput, systems_to_torch
        from metatrain.utils.io import load_model
        from metatrain.utils.neighbor_lists import get_system_with_neighbor_lists

        self.args, self.device, self.rng, self.checkpoint = args, device, np.random.default_rng(0), checkpoint
        self.pet = load_model(str(checkpoint)).to(device).eval()  # eval: outputs in eV and eV/Å, as labelled
        for weight in self.pet.parameters():
            weight.requires_grad_(True)
        self.options = self.pet.requested_neighbor_lists()

        def prepare(frame) -> tuple:
            system = systems_to_torch(frame, dtype=torch.float32)
            system = get_system_with_neighbor_lists(system, self.options).to(device)
            labels = {
                "atoms": len(frame),
                "family": frame.info.get("family", "?"),
                "energy": torch.tensor(frame.get_potential_energy(), device=device),
                "forces": torch.tensor(frame.get_forces(), dtype=torch.float32, device=device),
            }
            if frame.pbc.all():
                labels["stress"] = torch.tensor(frame.get_stress(voigt=False), dtype=torch.float32, device=device)
            return system, labels

        self.train, self.held_out = [prepare(f) for f in train], [prepare(f) for f in held_out]
        labelled = [labels for _, labels in self.train]
        self.force_ms = float(torch.cat([labels["forces"] for labels in labelled]).pow(2).mean())
        self.stress_ms = float(
            torch.stack([labels["stress"] for labels in labelled if "stress" in labels]).pow(2).mean()
        )
        self.outputs = {
            "energy": ModelOutput(sample_kind="system"),
            "non_conservative_force": ModelOutput(sample_kind="atom"),
            "non_conservative_stress": ModelOutput(sample_kind="system"),
        }

    def zero_prediction(self) -> dict:
        """Per family, the held-out forces' RMS (meV/Å): what predicting zero scores."""
        squares: dict = {}
        for _, labels in self.held_out:
            squares.setdefault(labels["family"], []).extend(labels["forces"].pow(2).flatten().tolist())
        return {family: round(1000 * math.sqrt(np.mean(v)), 1) for family, v in sorted(squares.items())}

    def save(self, path: Path) -> None:
        """The starting checkpoint with the trained weights, for mtt and ``load_model``."""
        from metatrain.utils.io import load_model

        saved = load_model(str(self.checkpoint)).get_checkpoint()
        saved["model_state_dict"] = saved["best_model_state_dict"] = {
            name: value.detach().cpu() for name, value in self.pet.state_dict().items()
        }
        torch.save(saved, path)

    def _turned(self, system, rotation: torch.Tensor):
        """``system`` with positions, cell and neighbor vectors multiplied by ``rotation``."""
        from metatensor.torch import TensorBlock
        from metatomic.torch import System

        turned = System(system.types, system.positions @ rotation.T, system.cell @ rotation.T, system.pbc)
        for options in self.options:
            pairs = system.get_neighbor_list(options)
            vectors = (pairs.values[:, :, 0] @ rotation.T)[:, :, None]
            turned.add_neighbor_list(options, TensorBlock(vectors, pairs.samples, pairs.components, pairs.properties))
        return turned

    def rotated(self, batch: list, augment: bool) -> tuple[list, list]:
        """The rotation matrices [3, 3] and the systems of ``batch``, each turned by a random
        rotation or improper rotation (``augment``) or left as it is."""
        from scipy.spatial.transform import Rotation

        rotations, systems = [], []
        for system, _ in batch:
            rotation = torch.eye(3)
            if augment:
                turn = Rotation.random(random_state=self.rng).as_matrix() * self.rng.choice([-1, 1])
                rotation = torch.tensor(turn, dtype=torch.float32)
            rotations.append(rotation.to(self.device))
            systems.append(self._turned(system, rotations[-1]))
        return rotations, systems

    def differences(self, batch: list, augment: bool) -> list[dict]:
        """Per structure: energy drift per atom (eV), conservative force drift and direct force
        error [atoms, 3] (eV/Å), direct stress error [3, 3] (eV/Å^3) where labelled."""
        rotations, systems = self.rotated(batch, augment)
        for system in systems:
            system.positions.requires_grad_(True)
        # PyTorch's efficient attention has no double backward: training on forces needs the math one
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
            out = self.pet(systems, self.outputs)
            energy = out["energy"].block().values[:, 0]
            gradients = torch.autograd.grad(energy.sum(), [s.positions for s in systems], create_graph=augment)
        direct = out["non_conservative_force"].block().values[:, :, 0]
        stress = out["non_conservative_stress"].block().values[:, :, :, 0]
        rows, start = [], 0
        for i, (rotation, (_, labels)) in enumerate(zip(rotations, batch)):
            n, forces = labels["atoms"], labels["forces"] @ rotation.T
            row = {
                "family": labels["family"],
                "energy": (energy[i] - labels["energy"]) / n,
                "forces": -gradients[i] - forces,
                "direct": direct[start : start + n] - forces,
            }
            if "stress" in labels:
                row["stress"] = stress[i] - rotation @ labels["stress"] @ rotation.T
            rows.append(row)
            start += n
        return rows

    def loss(self, rows: list[dict]) -> torch.Tensor:
        a = self.args
        energy = sum(r["energy"] ** 2 for r in rows) / len(rows) / a.energy_scale**2
        forces = torch.cat([r["forces"] for r in rows]).pow(2).mean() / a.force_scale**2
        direct = torch.cat([r["direct"] for r in rows]).pow(2).mean() / self.force_ms
        stresses = [r["stress"] for r in rows if "stress" in r]
        stress = (
            torch.stack(stresses).pow(2).mean() / self.stress_ms if stresses else torch.zeros((), device=self.device)
        )
        return energy + forces + direct + stress

    def held_out_errors(self) -> dict:
        sums: dict = {}
        for i in range(0, len(self.held_out), 8):
            for r in self.differences(self.held_out[i : i + 8], augment=False):
                s = sums.setdefault(r["family"], {"energy": [], "forces": [], "direct": []})
                s["energy"].append(r["energy"].item() ** 2)
                s["forces"] += r["forces"].pow(2).flatten().tolist()
                s["direct"] += r["direct"].pow(2).flatten().tolist()
        return {
            family: {
                "energy_drift_meV_atom": round(1000 * math.sqrt(np.mean(s["energy"])), 2),
                "force_drift_meV_A": round(1000 * math.sqrt(np.mean(s["forces"])), 1),
                "direct_rmse_meV_A": round(1000 * math.sqrt(np.mean(s["direct"])), 1),
            }
            for family, s in sorted(sums.items())
        }

    def run(self) -> list[dict]:
        a = self.args
        heads = [w for name, w in self.pet.named_parameters() if "non_conservative" in name]
        backbone = [w for name, w in self.pet.named_parameters() if "non_conservative" not in name]
        optimizer = torch.optim.Adam([{"params": heads}, {"params": backbone}])
        log, step, start, budget = [], 0, time.time(), 60 * a.minutes
        while (elapsed := time.time() - start) < budget:
            cosine = 0.5 * (1 + math.cos(math.pi * elapsed / budget))
            optimizer.param_groups[0]["lr"] = a.heads_lr * cosine
            optimizer.param_groups[1]["lr"] = 0.0 if elapsed < a.frozen * budget else a.lr * cosine
            batch = [self.train[i] for i in self.rng.integers(0, len(self.train), a.batch)]
            loss = self.loss(self.differences(batch, augment=True))
            optimizer.zero_grad()
            with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
                loss.backward()
            optimizer.step()
            step += 1
            if step % 500 == 0:
                log.append({"step": step, "seconds": round(time.time() - start), "held_out": self.held_out_errors()})
                print(json.dumps(log[-1]), flush=True)
        log.append({"step": step, "seconds": round(time.time() - start), "held_out": self.held_out_errors()})
        return log


def train(args) -> None:
    from ase.io import read

    work = Path(args.work)
    if not (work / "stage5.ckpt").exists():
        sys.exit(
            f"{work}/stage5.ckpt missing: git show 0336e4f:ase_tcfp32/data/pet-demo-chgnet.ckpt > {work}/stage5.ckpt"
        )
    frames = [frame for path in sorted(work.glob("self-*.xyz")) for frame in read(path, ":")]
    if not frames:
        sys.exit(f"no labelled structures in {work}: run the label step first")
    order = np.random.default_rng(0).permutation(len(frames))
    held_out = [frames[i] for i in order[: len(frames) // 10]]
    training = [frames[i] for i in order[len(frames) // 10 :]]
    checkpoint = add_heads(work, training)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = Trainer(checkpoint, training, held_out, args, device)
    zero = trainer.zero_prediction()
    print(f"{len(training)} training and {len(held_out)} held-out structures; zero prediction {zero}", flush=True)
    log = trainer.run()
    out = Path(args.out)
    trainer.save(out.with_suffix(".ckpt"))
    settings = {k: v for k, v in vars(args).items() if k not in ("command", "work", "out")}
    result = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "structures": {"train": len(training), "held_out": len(held_out)},
        "settings": settings,
        "zero_prediction_meV_A": zero,
        "log": log,
    }
    out.write_text(json.dumps(result, indent=1))


def evaluate(checkpoint: str, test: str) -> dict:
    """Per family of ``test``: see ``evaluate`` in the module doc (meV/atom, meV/Å)."""
    from ase.io import read

    from ase_tcfp32 import TCPETCalculator

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        calculators = {
            "shipped": TCPETCalculator("pet-demo-chgnet", device="cpu", precision="fp32", uncertainty_threshold=None),
            "tuned": TCPETCalculator(checkpoint, device="cpu", precision="fp32", uncertainty_threshold=None),
            "direct": TCPETCalculator(
                checkpoint, device="cpu", precision="fp32", uncertainty_threshold=None, non_conservative=True
            ),
        }
    sums: dict = {}
    for frame in read(test, ":"):
        results = {}
        for name, calc in calculators.items():
            atoms = frame.copy()
            atoms.calc = calc
            results[name] = (atoms.get_potential_energy() / len(atoms), atoms.get_forces())
        energy, forces = frame.get_potential_energy() / len(frame), frame.get_forces()
        (shipped_e, shipped_f), (tuned_e, tuned_f), (_, direct_f) = results.values()
        s = sums.setdefault(frame.info.get("family", "?"), collections.defaultdict(list))
        s["shipped energy error"].append(abs(shipped_e - energy))
        s["tuned energy error"].append(abs(tuned_e - energy))
        s["shipped force error"] += np.abs(shipped_f - forces).ravel().tolist()
        s["tuned force error"] += np.abs(tuned_f - forces).ravel().tolist()
        s["energy moved"].append(abs(tuned_e - shipped_e))
        s["forces moved, squared"] += ((tuned_f - shipped_f) ** 2).ravel().tolist()
        s["direct minus conservative, squared"] += ((direct_f - tuned_f) ** 2).ravel().tolist()
        s["conservative, squared"] += (tuned_f**2).ravel().tolist()

    def mean(values: list, digits: int) -> float:
        return round(1000 * float(np.mean(values)), digits)

    def rms(squares: list) -> float:
        return round(1000 * math.sqrt(np.mean(squares)), 1)

    return {
        family: {
            "energy_mae_vs_teacher_meV_atom": {
                "shipped": mean(s["shipped energy error"], 2),
                "tuned": mean(s["tuned energy error"], 2),
            },
            "force_mae_vs_teacher_meV_A": {
                "shipped": mean(s["shipped force error"], 1),
                "tuned": mean(s["tuned force error"], 1),
            },
            "energy_moved_mae_meV_atom": mean(s["energy moved"], 2),
            "forces_moved_rms_meV_A": rms(s["forces moved, squared"]),
            "direct_vs_conservative_rms_meV_A": rms(s["direct minus conservative, squared"]),
            "conservative_rms_meV_A": rms(s["conservative, squared"]),
        }
        for family, s in sorted(sums.items())
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    labelling = commands.add_parser("label", help="label make_dataset.py's structures with the shipped model")
    labelling.add_argument("--seed", type=int, default=11)
    labelling.add_argument("--work", default="build/heads")
    labelling.add_argument("--model", default="pet-demo-chgnet", help="the labelling model (name or checkpoint)")
    training = commands.add_parser("train", help="add the heads and train the whole PET (a GPU)")
    training.add_argument("--work", default="build/heads")
    training.add_argument("--minutes", type=float, default=7.4)
    training.add_argument("--batch", type=int, default=8, help="structures per step")
    training.add_argument("--lr", type=float, default=1e-4, help="the backbone's learning rate")
    training.add_argument("--heads-lr", type=float, default=1e-3, help="the direct heads' learning rate")
    training.add_argument("--frozen", type=float, default=0.15, help="fraction of the time with the backbone frozen")
    training.add_argument(
        "--energy-scale", type=float, default=0.003, help="eV/atom of energy drift worth one unit of loss"
    )
    training.add_argument("--force-scale", type=float, default=0.03, help="eV/Å of force drift worth one unit of loss")
    training.add_argument("--out", required=True)
    evaluating = commands.add_parser("evaluate", help="a trained checkpoint on the held-out test set (CPU)")
    evaluating.add_argument("checkpoint")
    evaluating.add_argument("--test", default=str(HERE.parents[1] / "tests/data/demo_model/test.xyz"))
    evaluating.add_argument("--merge-into", required=True, help="train's JSON: the results go under test_set")
    args = parser.parse_args()
    if args.command == "label":
        label(args.seed, Path(args.work), args.model)
    elif args.command == "train":
        train(args)
    else:
        path = Path(args.merge_into)
        result = json.loads(path.read_text())
        result["test_set"] = evaluate(args.checkpoint, args.test)
        path.write_text(json.dumps(result, indent=1))
        print(json.dumps(result["test_set"], indent=1))


if __name__ == "__main__":
    main()
