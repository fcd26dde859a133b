"""The one current results file of each benchmark: ``benchmarks/results/<benchmark>_<gpu>.json``.

Every benchmark script writes its rows with :func:`write`. A file holds::

    {"benchmark": "md_step", "device": "NVIDIA H200",
     "runs": [{"command": "python benchmarks/md_step.py ...", "date": "2026-12-02",
               "environment": {"torch": ..., "triton": ..., "cuda": ..., "gpu": ...}}, ...],
     "rows": [{..., "run": 0}, ...]}

Each row names the run (command, date, environment) that measured it. A new run's rows
replace the rows with the same key (a run at one size does not erase another size's rows);
runs that no row names any more are dropped.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import sys
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
STARTED = datetime.datetime.now().isoformat(timespec="seconds")
"""When this process started: the rows it writes after each measurement stay one run."""


def environment(device: str | None = None) -> dict:
    """Versions of Python, torch, Triton and CUDA, and the GPU (or the CPU) of this process."""
    import torch

    env = {"python": platform.python_version(), "torch": torch.__version__, "machine": platform.machine()}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        pass
    if device != "cpu" and torch.cuda.is_available():
        index = torch.device(device or "cuda").index or 0
        major, minor = torch.cuda.get_device_capability(index)
        env.update(
            gpu=torch.cuda.get_device_name(index), compute_capability=f"{major}.{minor}", cuda=torch.version.cuda
        )
    else:
        env.update(cpu=platform.processor() or platform.machine(), cpu_threads=torch.get_num_threads())
    return env


def checkpoint_digest(model: str) -> str:
    """The first 12 hex digits of the sha256 of ``model``'s checkpoint file (a uPET name, the
    bundled model's name or a path): which weights a row was measured with."""
    import hashlib

    from ase_tcfp32.models import resolve_checkpoint

    return hashlib.sha256(resolve_checkpoint(model).read_bytes()).hexdigest()[:12]


def device_tag(env: dict) -> str:
    """The file-name tag of a device: ``NVIDIA H200`` -> ``h200``, no GPU -> ``cpu``."""
    gpu = env.get("gpu")
    if not gpu:
        return "cpu"
    return gpu.replace("NVIDIA", "").strip().split()[0].lower()


def path(benchmark: str, env: dict) -> Path:
    """Where :func:`write` keeps ``benchmark``'s results for the device of ``env``."""
    return RESULTS / f"{benchmark}_{device_tag(env)}.json"


def command() -> str:
    """This process's command line, as one would type it from the repository's root."""
    script = Path(sys.argv[0]).resolve()
    try:
        script = script.relative_to(Path(__file__).parents[1])
    except ValueError:
        pass
    return shlex.join(["python", str(script), *sys.argv[1:]])


def write(
    benchmark: str,
    rows: list[dict],
    key: tuple[str, ...],
    env: dict | None = None,
    out: str | os.PathLike | None = None,
    note: str | None = None,
) -> Path:
    """Merge ``rows`` into ``benchmark``'s results file (``out`` if given) as one new run.

    ``key`` names the fields that identify a row (e.g. model, atoms, precision): an older
    row with the same values is replaced. Scripts call this after every row, so a run cut
    short keeps what it measured. Returns the file's path."""
    env = env if env is not None else environment()
    target = Path(out) if out else path(benchmark, env)
    old = json.loads(target.read_text()) if target.exists() else {"runs": [], "rows": []}
    run = {"command": command(), "date": STARTED[:10], "started": STARTED, "environment": env}
    if note:
        run["note"] = note
    same = [i for i, r in enumerate(old["runs"]) if r.get("started") == STARTED and r["command"] == run["command"]]
    this = same[0] if same else len(old["runs"])
    new_keys = {identity(row, key) for row in rows}
    kept = [row for row in old["rows"] if identity(row, key) not in new_keys]
    merged = kept + [{**row, "run": this} for row in rows]
    runs = old["runs"] + ([] if same else [run])
    used = sorted({row["run"] for row in merged})
    renumber = {old_index: new_index for new_index, old_index in enumerate(used)}
    result = {
        "benchmark": benchmark,
        "device": env.get("gpu") or "cpu",
        "key": list(key),
        "runs": [runs[i] for i in used],
        "rows": [{**row, "run": renumber[row["run"]]} for row in merged],
    }
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(result, indent=1) + "\n")
    return target


def identity(row: dict, key: tuple[str, ...]) -> tuple[str, ...]:
    """The values of ``row``'s key fields, comparable whatever their type."""
    return tuple(json.dumps(row.get(k), sort_keys=True) for k in key)


def read(name: str) -> dict:
    """A results file of ``benchmarks/results`` by name (``md_step_h200``)."""
    return json.loads((RESULTS / f"{name}.json").read_text())
