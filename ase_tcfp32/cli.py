"""Command line: ``ase-tcfp32 validate TEST ...``, ``ase-tcfp32 warmup ...``, ``ase-tcfp32 info``, i-PI's
``ase-tcfp32 ipi-driver ...`` and ``ase-tcfp32 ipi-server INPUT.xml``, and ``ase-tcfp32 lammps-input STRUCTURE``
(a LAMMPS run across MPI ranks: :mod:`ase_tcfp32.lammps`)."""

from __future__ import annotations

import argparse
import sys

from ._engines import ENGINES
from .models import BUNDLED
from .precision import PRECISIONS

DEMO_MODEL = next(iter(BUNDLED))
"""What ``validate`` checks when no ``--model`` is given: the model bundled with the package."""


def _validate(args) -> None:
    from .validation import report
    from .validation.common import resolve_model

    if args.test == "report":
        report.from_files(args.out)
        print(f"report: {args.out}/report.md")
        return
    if args.model is None:
        args.model = DEMO_MODEL
        print(f"validating the bundled demo model {DEMO_MODEL} (--model for yours)", flush=True)
    if args.precisions is None:  # every mode this device runs, so that auto's choice is among them
        from .precision import available_precisions

        precisions = [row.precision for row in available_precisions(args.device) if row.available]
    else:
        precisions = args.precisions.split(",")
    for p in precisions:
        if p not in PRECISIONS:
            raise SystemExit(f"unknown precision {p!r}; valid: {', '.join(PRECISIONS)}")
    model = resolve_model(args.model)
    options = {"nve": {}, "relax": {}}
    if args.nve_ps is not None:
        options["nve"]["ps"] = args.nve_ps
    if args.relax_steps is not None:
        options["relax"]["max_steps"] = args.relax_steps
    if args.relax_repeats is not None:
        options["relax"]["repeats"] = args.relax_repeats
    if args.jobs > 1:
        options["nve"]["jobs"] = options["relax"]["jobs"] = args.jobs
    if args.test == "all":
        report.run_all(model, precisions, args.device, args.out, args.quick, options, args.engine)
        print(f"report: {args.out}/report.md")
    else:
        report.run(
            args.test, model, precisions, args.device, args.out, args.quick, args.engine, **options.get(args.test, {})
        )


def _warmup(args) -> None:
    import time

    from ._kernels import autotune
    from .calculator import TCPETCalculator
    from .validation import water_box
    from .validation.common import resolve_model

    if args.atoms < 3:
        raise SystemExit("--atoms must be at least 3 (a water molecule)")
    start = time.perf_counter()
    calc = TCPETCalculator(resolve_model(args.model), precision=args.precision, device=args.device)
    atoms = water_box(max(1, args.atoms // 3), seed=0)
    seconds = calc.warm_up(atoms)
    print(calc)
    print(
        f"{len(atoms)}-atom water box: first evaluation {seconds:.1f} s ({time.perf_counter() - start:.1f} s with loading)"
    )
    print(f"GEMM tuning: {len(autotune.known())} shapes in {autotune.cache_file()}")


def _ipi_driver(args) -> None:
    """Load the model, then serve i-PI with :mod:`ase_tcfp32.ipi`'s driver."""
    try:
        from . import ipi
    except ImportError as error:
        raise SystemExit(f"the i-PI driver needs i-PI ({error}): pip install 'ase-tcfp32[ipi]'") from None
    if not args.wait >= 0:
        raise SystemExit(f"--wait is a number of seconds, 0 or more, not {args.wait}")
    try:
        driver = ipi.TCPETDriver(
            template=args.template,
            model=args.model,
            precision=args.precision,
            device=args.device,
            engine=args.engine,
            neighbor_skin=args.neighbor_skin,
            non_conservative=args.non_conservative,
            uncertainty_threshold=args.uncertainty_threshold,
            verbose=args.verbose,
        )
    except ValueError as error:  # a bad option or template, said before anything is served
        raise SystemExit(f"ase-tcfp32 ipi-driver: {error}") from None
    ipi.serve(
        driver,
        args.address,
        unix=args.unix,
        port=args.port,
        sockets_prefix=args.sockets_prefix,
        wait=args.wait,
        verbose=args.verbose,
    )


def _ipi_server(args) -> None:
    """Run i-PI on ``args.input``, corrected where its version needs it (:mod:`ase_tcfp32._ipi_server`)."""
    from pathlib import Path

    try:
        import ipi  # noqa: F401
    except ImportError as error:
        raise SystemExit(f"ase-tcfp32 ipi-server needs i-PI ({error}): pip install 'ase-tcfp32[ipi]'") from None
    from . import _ipi_server

    if not Path(args.input).is_file():
        raise SystemExit(f"ase-tcfp32 ipi-server: no i-PI input file {args.input!r}")
    _ipi_server.run([args.input, *args.options])


def _lammps_input(args) -> None:
    """Write a LAMMPS input and data file for ``args.structure`` (:func:`ase_tcfp32.lammps.write_inputs`)."""
    from ase.io import read

    from .lammps import write_inputs

    try:
        atoms = read(args.structure)
        path = write_inputs(
            atoms,
            args.out,
            model=args.model,
            steps=args.steps,
            timestep=args.timestep,
            ensemble=args.ensemble,
            temperature=args.temperature,
            pressure=args.pressure,
            thermo=args.thermo,
            dump=args.dump,
            skin=args.skin,
        )
    except (OSError, ValueError) as error:
        raise SystemExit(f"ase-tcfp32 lammps-input: {error}") from None
    print(f"wrote {path} and its data file; run it from {args.out}:")
    print(f"  mpirun -np 4 python -m ase_tcfp32.lammps in.lmp --model {args.model}")


def _bytecode_cache() -> str:
    """Whether Python keeps compiled ``.pyc`` files of torch's modules: without them every
    process compiles torch's, metatrain's and our sources again before its first step."""
    import importlib.util
    import os

    import torch

    if sys.dont_write_bytecode:
        return (
            "off (PYTHONDONTWRITEBYTECODE or python -B): every process compiles torch's sources again, "
            "5.7 s of a 192-atom start on the H200; unset it to pay this once"
        )
    cached = importlib.util.cache_from_source(torch.__file__)
    if not os.path.exists(cached) and not os.access(os.path.dirname(torch.__file__), os.W_OK):
        return (
            f"torch has no .pyc files and its folder is read-only: every process compiles its sources again; "
            f"'python -m compileall {os.path.dirname(torch.__file__)}' once, as its owner"
        )
    return "on"


def _info(args) -> None:
    import platform

    import torch

    from ._attention import on_tensor_cores
    from ._engines import choose_engine_for
    from .models import cached_checkpoints, known_models
    from .precision import auto_precision, available_precisions

    print(f"python {platform.python_version()}, torch {torch.__version__}")
    print(f"python bytecode cache: {_bytecode_cache()}")
    try:
        import triton

        from .precision import triton_build_problem, triton_cache_knobs

        problem = triton_build_problem()
        print(f"triton {triton.__version__}" + (f": cannot build its GPU launchers here, {problem}" if problem else ""))
        if (cache := triton_cache_knobs()) is not None:
            print(f"triton kernel cache: {cache.dir}")
    except ImportError:
        print("triton: not installed (GPU kernels unavailable)")
    devices = ["cpu"] + [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    if torch.cuda.is_available():
        from ._kernels.cublas import version

        print(f"CUDA {torch.version.cuda}, cuBLAS {version()}")
    for device in devices:
        name = torch.cuda.get_device_name(device) if device != "cpu" else platform.processor() or platform.machine()
        extra = ""
        if device != "cpu":
            cc = torch.cuda.get_device_capability(device)
            extra = f", compute capability {cc[0]}.{cc[1]}"
        print(f"\n{device}: {name}{extra}")
        rows = available_precisions(device)
        for row in rows:
            mark = "yes" if row.available else "no "
            print(f"  {row.precision:7} {mark}  {row.backend:14} {row.note}")
        chosen, why = auto_precision(device)
        print(f"  auto -> {chosen}: {why}")
        engine, why = choose_engine_for(device)
        print(f"  engine='auto' -> {engine}: {why}")
        accurate = [r.precision for r in rows if r.available and on_tensor_cores(r.precision, device)]
        print(
            f"  attention: tensor cores (TF32x3) in {', '.join(accurate)}; torch SDPA otherwise"
            if accurate
            else "  attention: torch SDPA"
        )
    from ._kernels import autotune

    state = "on" if autotune.enabled() else "off (ASE_TCFP32_AUTOTUNE=0)"
    print(f"\nGEMM tuning: {state}, {len(autotune.known())} tuned shapes in {autotune.cache_file()}")
    from .tcmodel import ALIASES, PRESETS

    print(f"\ntensor-core model (emulate=..., on CPU): {', '.join(PRESETS)} (aliases {', '.join(ALIASES)})")
    cached = cached_checkpoints()
    print("\nmodels by name (uPET):", ", ".join(known_models()))
    print("cached locally:", ", ".join(f"{n} v{v}" for n, vs in cached.items() for v, _ in vs) or "none")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="ase-tcfp32", description="PET in ASE with FP32-accurate tensor-core GEMMs")
    commands = parser.add_subparsers(dest="command", required=True)
    validate = commands.add_parser("validate", help="fidelity tests of the precision modes")
    validate.add_argument(
        "test",
        choices=["single-point", "smoothness", "nve", "relax", "speed", "all", "report"],
        help="a test, all of them, or 'report': report.md from the results already in --out",
    )
    validate.add_argument(
        "--model", help=f"uPET name, checkpoint path, or random:<tiny|xs|s|m> (default: {DEMO_MODEL})"
    )
    validate.add_argument("--precisions", default=None, help="comma-separated (default: every mode the device runs)")
    validate.add_argument("--device", default=None)
    validate.add_argument("--engine", default="auto", choices=ENGINES, help="the calculator's engine (docs/usage.md)")
    validate.add_argument("--out", default="validation")
    validate.add_argument("--quick", action="store_true", help="small systems and short runs (CI, laptops)")
    validate.add_argument("--nve-ps", type=float, default=None, help="NVE length in ps (default 30)")
    validate.add_argument("--relax-steps", type=int, default=None, help="FIRE step limit (default 500)")
    validate.add_argument("--relax-repeats", type=int, default=None, help="FIRE repeats (default 3)")
    validate.add_argument(
        "--jobs", type=int, default=1, help="NVE and FIRE runs at once, in separate processes (small systems on a GPU)"
    )
    validate.set_defaults(func=_validate)
    warmup = commands.add_parser(
        "warmup", help="fill this machine's caches (kernels, GEMM tuning) before a batch of jobs"
    )
    warmup.add_argument("--model", required=True, help="uPET name, checkpoint path, or random:<tiny|xs|s|m>")
    warmup.add_argument("--atoms", type=int, required=True, help="system size (a water box of about this many atoms)")
    warmup.add_argument("--precision", default="auto", choices=("auto",) + PRECISIONS)
    warmup.add_argument("--device", default=None)
    warmup.set_defaults(func=_warmup)
    driver = commands.add_parser("ipi-driver", help="serve an i-PI simulation (docs/scaling.md)")
    driver.add_argument("--address", required=True, help="unix socket name or host name of the i-PI server")
    driver.add_argument("--unix", action="store_true", help="a unix socket (/tmp/ipi_ADDRESS) instead of TCP")
    driver.add_argument("--port", type=int, default=12345, help="TCP port (without --unix)")
    driver.add_argument(
        "--sockets-prefix", default="/tmp/ipi_", help="where i-PI puts unix sockets (its sockets_prefix)"
    )
    driver.add_argument(
        "--template", required=True, help="a file ASE reads with the simulation's atoms, in i-PI's order"
    )
    driver.add_argument("--model", required=True, help="uPET name or checkpoint path")
    driver.add_argument("--precision", default="auto", choices=("auto",) + PRECISIONS)
    driver.add_argument("--engine", default="auto", choices=ENGINES)
    driver.add_argument("--device", default=None, help="cuda:0, or cuda:0;cuda:1 to split each batch across GPUs")
    driver.add_argument("--neighbor-skin", type=float, default=None, help="Verlet skin in Å (default: the engine's)")
    driver.add_argument(
        "--wait",
        type=float,
        default=60.0,
        help="seconds to wait for the server's socket after the model is loaded (default 60)",
    )
    driver.add_argument(
        "--non-conservative",
        nargs="?",
        const="true",
        default="false",
        choices=("true", "forces", "stress", "false"),
        help="direct forces and stress (alone: both; or forces, stress): the direct forcefield of ipi.mts_input",
    )
    driver.add_argument(
        "--uncertainty-threshold",
        default="0.1",
        help="warn past this LLPR energy uncertainty per atom, eV (default 0.1, as upet; none: no check)",
    )
    driver.add_argument("--verbose", action="store_true")
    driver.set_defaults(func=_ipi_driver)
    server = commands.add_parser(
        "ipi-server", help="run i-PI, corrected where a driver dying mid-request stalls it (docs/ipi_patch.md)"
    )
    server.add_argument("input", help="i-PI's input file (XML)")
    server.add_argument("options", nargs=argparse.REMAINDER, help="i-PI's options, after the input file (i-pi --help)")
    server.set_defaults(func=_ipi_server)
    lammps = commands.add_parser(
        "lammps-input", help="write a LAMMPS input for one large system across MPI ranks (docs/scaling.md)"
    )
    lammps.add_argument("structure", help="a periodic structure file ASE reads")
    lammps.add_argument("--model", required=True, help="uPET name or checkpoint path: sets the halo depth")
    lammps.add_argument("--out", default=".", help="folder for in.lmp and system.data (default: here)")
    lammps.add_argument("--steps", type=int, default=1000)
    lammps.add_argument("--timestep", type=float, default=0.5, help="fs (default 0.5)")
    lammps.add_argument("--ensemble", default="nve", choices=("nve", "nvt", "npt"))
    lammps.add_argument("--temperature", type=float, default=None, help="K (and the velocities drawn at it)")
    lammps.add_argument("--pressure", type=float, default=1.0, help="bar, for npt (default 1)")
    lammps.add_argument("--thermo", type=int, default=10, help="thermo output every this many steps")
    lammps.add_argument("--dump", type=int, default=0, help="positions every this many steps (0: none)")
    lammps.add_argument("--skin", type=float, default=1.0, help="neighbor skin, Å (the halo is R_eff + skin)")
    lammps.set_defaults(func=_lammps_input)
    info = commands.add_parser("info", help="versions, GPUs, precisions and what auto picks")
    info.set_defaults(func=_info)
    args = parser.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main(sys.argv[1:])
