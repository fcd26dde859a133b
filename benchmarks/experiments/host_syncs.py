"""Count the operators of one MD step that make the host wait for the GPU, per engine.

    python benchmarks/experiments/host_syncs.py [--model random:s] [--molecules 64] [--engines metatomic,lean]

Runs a few ASE MD steps, then profiles one on the host (any device, CPU included) and
counts the aten operators that, on a CUDA device, return a value the host must wait for:
``_local_scalar_dense`` (``.item()``, ``bool(tensor)``), ``nonzero``, ``equal``,
``repeat_interleave`` (an output size that depends on data), ``unique``. Each one stalls the
launch queue until the GPU catches up, so the GPU idles while the host then works on.
"""

from __future__ import annotations

import argparse
import collections

import numpy as np
from ase.md.velocitydistribution import MaxwellBoltzmannDistribution
from ase.md.verlet import VelocityVerlet
from ase.units import fs
from torch.profiler import ProfilerActivity, profile

from ase_tcfp32.validation import water_box
from ase_tcfp32.validation.common import calculator, resolve_model

SYNCING = ["aten::_local_scalar_dense", "aten::nonzero", "aten::equal", "aten::repeat_interleave", "aten::_unique2"]


def count_syncs(model: str, engine: str, molecules: int, device: str | None) -> dict[str, int]:
    """Sync-prone operator counts of one MD step (after two warm-up steps)."""
    atoms = water_box(molecules)
    atoms.calc = calculator(model, "fp32", device, engine)
    MaxwellBoltzmannDistribution(atoms, temperature_K=300, rng=np.random.default_rng(0))
    dyn = VelocityVerlet(atoms, 0.25 * fs)
    dyn.run(2)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        dyn.run(1)
    counts = collections.Counter(event.name for event in prof.events())
    return {name.removeprefix("aten::"): counts[name] for name in SYNCING}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="random:s")
    parser.add_argument("--molecules", type=int, default=64)
    parser.add_argument("--engines", default="metatomic,lean")
    parser.add_argument("--device", default=None)
    args = parser.parse_args()
    model = resolve_model(args.model)
    print(f"{'engine':10s} " + " ".join(f"{name.removeprefix('aten::'):>20s}" for name in SYNCING))
    for engine in args.engines.split(","):
        counts = count_syncs(model, engine, args.molecules, args.device)
        print(f"{engine:10s} " + " ".join(f"{counts[name.removeprefix('aten::')]:20d}" for name in SYNCING))


if __name__ == "__main__":
    main()
