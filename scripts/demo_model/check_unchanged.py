"""Check that growing the demo PET left its energies and conservative forces bit-identical.

    python scripts/demo_model/check_unchanged.py BEFORE.ckpt AFTER.ckpt tests/data/demo_model/test.xyz

Evaluates both checkpoints (FP32, CPU) on every structure of the file twice: through
metatrain's export and metatomic-ase's calculator (the upet path), and through
ase-tcfp32's own loader and calculator (``TCPETCalculator(path, precision="fp32")``).
Exits non-zero unless energies and forces are exactly equal in both.
"""

import sys
import warnings

import numpy as np
import torch
from ase.io import read


def metatomic(checkpoint: str):
    from metatomic_ase import MetatomicCalculator
    from metatrain.utils.io import load_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return MetatomicCalculator(load_model(checkpoint).export(), device="cpu", uncertainty_threshold=None)


def ours(checkpoint: str):
    from ase_tcfp32 import TCPETCalculator

    return TCPETCalculator(checkpoint, precision="fp32", device="cpu")


def evaluate(calc, frames) -> list[tuple[float, np.ndarray]]:
    results = []
    for atoms in frames:
        atoms = atoms.copy()
        atoms.calc = calc
        results.append((atoms.get_potential_energy(), atoms.get_forces().copy()))
    return results


def main(before: str, after: str, structures: str) -> None:
    torch.set_num_threads(1)
    frames = read(structures, ":")
    failed = False
    for name, make in (("metatomic-ase", metatomic), ("ase-tcfp32", ours)):
        old, new = evaluate(make(before), frames), evaluate(make(after), frames)
        energy = sum(e0 != e1 for (e0, _), (e1, _) in zip(old, new, strict=True))
        forces = sum(not np.array_equal(f0, f1) for (_, f0), (_, f1) in zip(old, new, strict=True))
        print(f"{name}: {len(frames)} structures, energies differ on {energy}, forces on {forces}")
        failed |= bool(energy or forces)
    if failed:
        raise SystemExit("energies or conservative forces changed")


if __name__ == "__main__":
    main(*sys.argv[1:4])
