"""Figures of the demo PET's LLPR uncertainty (and direct heads, if any), via metatomic-ase.

    python scripts/demo_model/evaluate_uncertainty.py --model ase_tcfp32/data/pet-demo-chgnet.ckpt \
        --test tests/data/demo_model/test.xyz --ood build/demo-model/ood.xyz \
        --out build/demo-model/uncertainty.json [--merge-into docs/demo_model.json]

The model is exported from its metatrain checkpoint and run with
``metatomic_ase.MetatomicCalculator`` (FP32, CPU), the path upet's calculator takes:
``energy_uncertainty`` (per structure and per atom) and the spread of ``energy_ensemble``
per family of the held-out test set and of out-of-distribution structures
(``ood_structures.py``), with the real energy error against the teacher where the
structures carry its labels; and, for a model with direct heads, the conservative forces
and stress (``non_conservative=False``) against the direct ones (``non_conservative=True``;
the calculator removes the mean direct force).
"""

from __future__ import annotations

import argparse
import json
import warnings
from collections import defaultdict

import numpy as np
import torch
from ase.io import read

GPA = 160.21766208  # GPa per eV/Å³


def calculators(checkpoint: str):
    from metatomic_ase import MetatomicCalculator
    from metatrain.utils.io import load_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = load_model(checkpoint).export()
    options = dict(device="cpu", uncertainty_threshold=None)
    if "non_conservative_force" not in model.capabilities().outputs:
        return MetatomicCalculator(model, **options), None
    return MetatomicCalculator(model, **options), MetatomicCalculator(model, non_conservative=True, **options)


def uncertainties(calc, atoms) -> dict:
    from metatomic.torch import ModelOutput

    system = calc.run_model(
        atoms,
        {"energy_uncertainty": ModelOutput(sample_kind="system"), "energy_ensemble": ModelOutput(sample_kind="system")},
    )
    per_atom = calc.run_model(atoms, {"energy_uncertainty": ModelOutput(sample_kind="atom")})
    return {
        "sigma": float(system["energy_uncertainty"].block().values.item()),
        "ensemble_std": float(system["energy_ensemble"].block().values.std().item()),
        "sigma_atoms": per_atom["energy_uncertainty"].block().values.detach().numpy().ravel(),
    }


def evaluate(conservative, direct, frames) -> dict[str, list[dict]]:
    rows = defaultdict(list)
    for atoms in frames:
        reference = atoms.calc.results if atoms.calc is not None else {}
        a = atoms.copy()
        a.calc = conservative
        row = {"atoms": len(a), "energy": a.get_potential_energy(), "forces": a.get_forces().copy()}
        if a.pbc.all():
            row["stress"] = a.get_stress().copy()
        if direct is not None:
            b = atoms.copy()
            b.calc = direct
            row["direct_forces"] = b.get_forces().copy()
            if b.pbc.all():
                row["direct_stress"] = b.get_stress().copy()
        row.update(uncertainties(conservative, atoms))
        if "energy" in reference:
            row["reference_energy"] = reference["energy"]
            row["reference_forces"] = reference["forces"]
        rows[atoms.info["family"]].append(row)
    return rows


def heads_table(rows: list[dict]) -> dict:
    delta = np.concatenate([(r["direct_forces"] - r["forces"]).ravel() for r in rows])
    size = np.concatenate([r["forces"].ravel() for r in rows])
    table = {
        "structures": len(rows),
        "force_rms_meV_A": 1e3 * float(np.sqrt(np.mean(delta**2))),
        "force_mae_meV_A": 1e3 * float(np.mean(np.abs(delta))),
        "force_max_meV_A": 1e3 * float(np.abs(delta).max()),
        "conservative_force_mean_abs_meV_A": 1e3 * float(np.mean(np.abs(size))),
    }
    if "reference_forces" in rows[0]:
        for key, name in (("forces", "conservative"), ("direct_forces", "direct")):
            err = np.concatenate([(r[key] - r["reference_forces"]).ravel() for r in rows])
            table[f"{name}_vs_teacher_force_mae_meV_A"] = 1e3 * float(np.mean(np.abs(err)))
    stressed = [r for r in rows if "stress" in r]
    if stressed:
        ds = np.concatenate([r["direct_stress"] - r["stress"] for r in stressed])
        table["stress_structures"] = len(stressed)
        table["stress_rms_GPa"] = GPA * float(np.sqrt(np.mean(ds**2)))
        table["stress_mae_GPa"] = GPA * float(np.mean(np.abs(ds)))
        table["conservative_stress_mean_abs_GPa"] = GPA * float(
            np.mean(np.abs(np.concatenate([r["stress"] for r in stressed])))
        )
    return table


def uncertainty_table(rows: list[dict]) -> dict:
    per_atom = np.array([r["sigma"] / r["atoms"] for r in rows])
    atoms = np.concatenate([r["sigma_atoms"] for r in rows])
    table = {
        "structures": len(rows),
        "sigma_meV_atom_median": 1e3 * float(np.median(per_atom)),
        "sigma_meV_atom_min": 1e3 * float(per_atom.min()),
        "sigma_meV_atom_max": 1e3 * float(per_atom.max()),
        "ensemble_std_meV_atom_median": 1e3 * float(np.median([r["ensemble_std"] / r["atoms"] for r in rows])),
        "atom_sigma_eV_median": float(np.median(atoms)),
        "atom_sigma_eV_max": float(atoms.max()),
    }
    if "reference_energy" in rows[0]:
        errors = np.array([abs(r["energy"] - r["reference_energy"]) / r["atoms"] for r in rows])
        table["abs_error_meV_atom_median"] = 1e3 * float(np.median(errors))
        table["abs_error_meV_atom_max"] = 1e3 * float(errors.max())
    return table


def auroc(inside: np.ndarray, outside: np.ndarray) -> float:
    """Probability that an out-of-distribution structure has the larger value (ties half)."""
    greater = (outside[:, None] > inside[None, :]).mean()
    ties = (outside[:, None] == inside[None, :]).mean()
    return float(greater + 0.5 * ties)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="ase_tcfp32/data/pet-demo-chgnet.ckpt")
    parser.add_argument("--test", required=True)
    parser.add_argument("--ood", required=True)
    parser.add_argument("--out", default=None)
    parser.add_argument("--merge-into", default=None, help="a JSON file to add the results to, as 'uncertainty'")
    args = parser.parse_args()
    torch.set_num_threads(1)
    conservative, direct = calculators(args.model)
    test = evaluate(conservative, direct, read(args.test, ":"))
    ood = evaluate(conservative, direct, read(args.ood, ":"))
    all_test = [r for rows in test.values() for r in rows]
    all_ood = [r for rows in ood.values() for r in rows]
    inside = np.array([r["sigma"] / r["atoms"] for r in all_test])
    outside = np.array([r["sigma"] / r["atoms"] for r in all_ood])
    results = {}
    if direct is not None:
        results["direct_heads_vs_conservative"] = {f: heads_table(rows) for f, rows in sorted(test.items())} | {
            "all": heads_table(all_test)
        }
    results |= {
        "energy_uncertainty": {
            "test": {f: uncertainty_table(rows) for f, rows in sorted(test.items())}
            | {"all": uncertainty_table(all_test)},
            "out_of_distribution": {f: uncertainty_table(rows) for f, rows in ood.items()}
            | {"all": uncertainty_table(all_ood)},
            "auroc_sigma_per_atom": auroc(inside, outside),
            "ood_above_largest_test": int((outside > inside.max()).sum()),
            "ood_structures": len(outside),
        },
    }
    print(json.dumps(results, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    if args.merge_into:
        with open(args.merge_into) as f:
            card = json.load(f)
        card["uncertainty"] = results
        with open(args.merge_into, "w") as f:
            json.dump(card, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
