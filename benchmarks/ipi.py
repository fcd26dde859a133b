"""Path-integral MD through i-PI: bead-steps and atom-steps per second per batch size.

    python benchmarks/ipi.py [--model s] [--beads 32] [--molecules 64] [--batches 1,32]
                             [--precisions fp32,auto] [--engines auto,graphs] [--large 5760]
                             [--driver-options neighbor_skin=0.5] [--floor] [--server i-pi]
                             [--out FILE.json]

A real i-PI server (unix socket; ``ase-tcfp32 ipi-server``: i-PI with the correction for
drivers that die mid-request, or with ``--server i-pi`` i-PI's own launcher) runs PIMD NVT
of a water box with ``--beads`` beads; one driver process (``ase_tcfp32.ipi``) evaluates the
forces, one structure per request (``batch_size`` 1) or ``--batches`` structures per request,
in each precision and engine.
The time per MD step is the median and the mean interval between consecutive lines of
i-PI's output file after ``--warmup`` steps; the rates per second come from the mean (every
step counted: neighbor-list rebuilds, and steps that i-PI sends as two padded batches).
Our drivers say at exit how many requests they served and how many ended in repeated
structures (i-PI's padding), printed against the run's steps.
``--large N`` also runs one N-molecule box (1 bead) through i-PI and the same box in ASE in
this process: what the socket costs. ``--driver-options``
adds driver options (``ase_tcfp32.ipi``) to every driver, e.g. ``neighbor_skin=0.5`` (the
ASE comparison keeps the calculator's defaults). ``--floor`` also runs each batch size with
i-PI's own ``dummy`` driver (zero forces, no model): what the server's integration and the
socket cost per step, the part of a step no driver can remove. Drivers of
:func:`run` can be spread over GPUs (``benchmarks/ipi_multi_gpu.py``).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

# this file is named like the i-PI package: keep its folder off the import path
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.append(str(Path(__file__).resolve().parent))  # after the packages: _results, _timing still found
SERVERS = {
    "ipi-server": [sys.executable, "-m", "ase_tcfp32.cli", "ipi-server"],
    "i-pi": [shutil.which("i-pi") or str(Path(sys.executable).parent / "i-pi")],
}
"""The server launchers: ``ase-tcfp32 ipi-server`` of this Python, or i-PI's own ``i-pi``."""


def run(
    model: str,
    structure,
    *,
    beads: int,
    steps: int,
    warmup: int,
    batch_size: int,
    drivers: list[dict],
    timeout: float = 540.0,
    launcher: str = "ipi-server",
) -> dict:
    """One i-PI run, its server started by ``launcher`` (a key of :data:`SERVERS`); ``drivers``:
    per driver process its options (``precision``, ``engine``,
    ``device``) and, optionally, ``env`` (e.g. ``CUDA_VISIBLE_DEVICES``) and ``mode`` (an
    i-PI driver other than ours, e.g. ``"dummy"``: no options passed). Returns the median
    ms per MD step after ``warmup`` steps and the seconds to the first step."""
    import ase.io

    from ase_tcfp32 import ipi

    folder = Path(tempfile.mkdtemp(prefix="tcpet-bench-"))
    started = []
    try:
        ase.io.write(folder / "structure.xyz", structure)
        xml = ipi.pimd_input(
            f"{folder}/structure.xyz",
            beads=beads,
            steps=warmup + steps,
            batch_size=batch_size,
            sockets=f"{folder}/",
            prefix=f"{folder}/sim",
            trajectory_stride=100000,
        )
        (folder / "input.xml").write_text(xml)
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        start = time.perf_counter()
        server = subprocess.Popen(
            [*SERVERS[launcher], "input.xml"],
            cwd=folder,
            stdout=open(folder / "server.log", "w"),
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        started.append(server)
        while not (folder / "pet").exists():
            if server.poll() is not None or time.perf_counter() - start > 60:
                raise RuntimeError((folder / "server.log").read_text()[-2000:])
            time.sleep(0.1)
        for k, options in enumerate(drivers):
            options = dict(options)
            extra, mode = options.pop("env", {}), options.pop("mode", "custom")
            args = [sys.executable, ipi.driver_script(), "-m", mode, "-u", "-a", "pet", "-S", f"{folder}/"]
            if mode == "custom":
                params = {"template": f"{folder}/structure.xyz", "model": model, **options}
                args += ["-P", ipi.__file__, "-o", ",".join(f"{key}={value}" for key, value in params.items())]
            started.append(
                subprocess.Popen(
                    args,
                    cwd=folder,
                    stdout=open(folder / f"driver{k}.log", "w"),
                    stderr=subprocess.STDOUT,
                    env={**env, **extra},
                    start_new_session=True,
                )
            )
        stamps, lines, out = [], 0, folder / "sim.out"
        deadline, drivers_left = start + timeout, started[1:]
        while server.poll() is None:
            if drivers_left and all(p.poll() is not None for p in drivers_left):
                # at its end i-PI closes the sockets (the drivers exit) before it writes its files and exits
                deadline, drivers_left = min(deadline, time.perf_counter() + 30), []
            if time.perf_counter() > deadline:
                logs = "".join(p.read_text()[-1500:] for p in sorted(folder.glob("*.log")))
                raise RuntimeError(f"i-PI run did not finish within {timeout:.0f} s, or 30 s after its drivers: {logs}")
            if out.exists():
                count = sum(1 for line in out.read_text().splitlines() if line and not line.startswith("#"))
                stamps += [time.perf_counter()] * (count - lines)
                lines = count
            time.sleep(0.002)
        intervals = np.diff(stamps[warmup:])
        row = {
            "ms_per_step": 1000 * float(np.median(intervals)),
            "first_step_s": stamps[0] - start if stamps else None,
            "steps_timed": len(intervals),
            "ms_per_step_mean": 1000 * float(np.mean(intervals)),
            "step_ms": [round(1000 * float(t), 2) for t in intervals],
        }
        return {**row, **_requests(started[1:], folder, steps=warmup + steps + 1)}
    finally:
        for process in started:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        shutil.rmtree(folder, ignore_errors=True)


def _requests(drivers: list, folder: Path, steps: int) -> dict:
    """What our drivers said at exit (``ase_tcfp32.ipi``): requests served in all, and how
    many ended in repeated structures (batches i-PI padded), against the run's ``steps``."""
    counts = []
    for k, process in enumerate(drivers):
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            continue
        found = re.search(r"tcpet driver: (\d+) requests, (\d+) of them", (folder / f"driver{k}.log").read_text())
        if found:
            counts.append([int(found[1]), int(found[2])])
    if not counts:
        return {}
    return {"steps_in_all": steps, "requests": sum(c[0] for c in counts), "padded_requests": sum(c[1] for c in counts)}


def ase_step_ms(model: str, structure, precision: str, steps: int) -> float:
    """Median ms per ASE velocity-Verlet step of ``structure`` in this process (default engine)."""
    from _timing import md_step_times
    from ase.md.verlet import VelocityVerlet
    from ase.units import fs

    from ase_tcfp32 import TCPETCalculator

    atoms = structure.copy()
    atoms.calc = TCPETCalculator(model, precision=precision)
    dyn = VelocityVerlet(atoms, 0.5 * fs)
    dyn.run(3)
    return 1000 * float(np.median(md_step_times(dyn, steps)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="s", help="PET-MAD shape of the random-weight model (tiny, xs, s, m)")
    parser.add_argument("--beads", type=int, default=32)
    parser.add_argument("--molecules", type=int, default=64)
    parser.add_argument("--batches", default="1,32", help="batch sizes ('' for none: only --large)")
    parser.add_argument("--precisions", default="fp32,auto", help="'' for none (with --floor: only i-PI's cost)")
    parser.add_argument("--engines", default="auto,graphs", help="engines tried per batch size (the fastest counts)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--large", type=int, default=0, help="also one box of this many molecules, i-PI vs ASE")
    parser.add_argument("--driver-options", default="", help="key=value,... added to every driver's options")
    parser.add_argument("--floor", action="store_true", help="also each batch size with i-PI's dummy driver (no model)")
    parser.add_argument(
        "--server", default="ipi-server", choices=SERVERS, help="the server's launcher (default ipi-server)"
    )
    parser.add_argument("--out", default=None, help="results file (default: benchmarks/results/ipi_<gpu>.json)")
    args = parser.parse_args()

    from ase_tcfp32._engines import GRAPH_ATOMS
    from ase_tcfp32.testing import random_checkpoint
    from ase_tcfp32.validation import water_box

    model = str(random_checkpoint(args.model))
    extra = dict(item.split("=", 1) for item in args.driver_options.split(",") if item)
    water = water_box(args.molecules, seed=0)
    rows = []
    print(
        f"{'precision':>9} {'engine':>7} {'batch':>5} {'median ms':>9} {'mean ms':>8} {'bead-steps/s':>12} "
        f"{'atom-steps/s':>12} {'requests':>9} {'padded':>6} {'steps':>5}"
    )
    batches = list(map(int, args.batches.split(","))) if args.batches else []
    runs = [("none", "dummy", batch) for batch in batches if args.floor]
    precisions = [p for p in args.precisions.split(",") if p]
    runs += [
        (precision, engine, batch)
        for precision in precisions
        for batch in batches
        for engine in args.engines.split(",")
        if not (engine == "graphs" and batch * len(water) <= GRAPH_ATOMS)
    ]  # "graphs" where "auto" is graphs: skipped
    for precision, engine, batch in runs:
        row = {
            "precision": precision,
            "engine": engine,
            "batch_size": batch,
            "beads": args.beads,
            "atoms": len(water),
            "server": args.server,
        }
        if engine == "dummy":
            driver = {"mode": "dummy"}
        else:
            driver = {"precision": precision, "engine": engine, **extra}
            row.update(model=f"random-{args.model}", **extra)
        try:
            row.update(
                run(
                    model,
                    water,
                    beads=args.beads,
                    steps=args.steps,
                    warmup=args.warmup,
                    batch_size=batch,
                    drivers=[driver],
                    launcher=args.server,
                )
            )
            row["bead_steps_per_s"] = args.beads * 1000 / row["ms_per_step_mean"]
            row["atom_steps_per_s"] = row["bead_steps_per_s"] * len(water)
            print(
                f"{precision:>9} {engine:>7} {batch:>5} {row['ms_per_step']:9.1f} {row['ms_per_step_mean']:8.1f} "
                f"{row['bead_steps_per_s']:12.0f} {row['atom_steps_per_s']:12.0f} {row.get('requests', '-'):>9} "
                f"{row.get('padded_requests', '-'):>6} {row.get('steps_in_all', '-'):>5}",
                flush=True,
            )
        except Exception as error:  # a configuration that fails must not stop the others
            row["error"] = str(error)[-1500:]
            print(f"{precision:>9} {engine:>7} {batch:>5} failed: {row['error'][-300:]}", flush=True)
        rows.append(row)
        save(args.out, rows)
    if args.large:
        large = water_box(args.large, seed=0)
        for precision in precisions:
            row = {
                "precision": precision,
                "engine": "auto",
                "batch_size": 1,
                "beads": 1,
                "atoms": len(large),
                "model": f"random-{args.model}",
                "large": True,
                "server": args.server,
                **extra,
            }
            row.update(
                run(
                    model,
                    large,
                    beads=1,
                    steps=args.steps,
                    warmup=args.warmup,
                    batch_size=1,
                    drivers=[{"precision": precision, **extra}],
                    launcher=args.server,
                )
            )
            row["ase_ms_per_step"] = ase_step_ms(model, large, precision, steps=args.steps)
            row["atom_steps_per_s"] = len(large) * 1000 / row["ms_per_step_mean"]
            print(
                f"{len(large)} atoms, {precision}: i-PI {row['ms_per_step']:.1f} ms/step, ASE {row['ase_ms_per_step']:.1f} "
                f"ms/step, {row['atom_steps_per_s']:.0f} atom-steps/s through i-PI",
                flush=True,
            )
            rows.append(row)
            save(args.out, rows)


KEY = ("precision", "engine", "batch_size", "beads", "atoms", "large", "neighbor_skin", "server")
"""What identifies a row of the results file: a new row replaces the old one with the same values."""


def save(path, rows) -> None:
    """Merge the rows so far into the results file, with i-PI's version and the host's cores."""
    from importlib.metadata import version

    import _results

    env = {**_results.environment(), "ipi": version("ipi"), "host_cpus": os.cpu_count()}
    _results.write("ipi", rows, KEY, env=env, out=path)


if __name__ == "__main__":
    main()
