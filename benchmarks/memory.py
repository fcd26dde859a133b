"""Peak memory of one energy+forces evaluation, with and without ``low_memory``.

    python benchmarks/memory.py [--models xs,s,m] [--molecules 64] [--precisions fp32,tf32x3]
                                [--device cuda] [--largest] [--per-atom 2880,5760] [--out FILE.json]

For PET-MAD-shaped models with random weights on a water box: the peak memory allocated
during ``get_forces()`` above what the model itself holds (CUDA: the caching allocator's
peak; CPU: the peak of the allocations torch's profiler records), the time of that call,
and the ratios low_memory / default. ``--largest`` (CUDA) doubles the box until it runs
out of memory, then bisects, and reports the largest water box that fits per model,
precision and setting. ``--per-atom A,B`` (CUDA) measures the peak at two box sizes (water
molecules) and records the slope, bytes per atom, and the intercept: what the calculator's
out-of-memory advice (``ase_tcfp32/_memory.py``) is built from.
"""

from __future__ import annotations

import argparse
import time
import warnings

import _results
import torch

from ase_tcfp32 import TCPETCalculator
from ase_tcfp32.testing import random_checkpoint
from ase_tcfp32.validation import water_box


def _calculator(shape: str, precision: str, device: str, low_memory: bool) -> TCPETCalculator:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # CPU emulation notes
        return TCPETCalculator(random_checkpoint(shape), precision=precision, device=device, low_memory=low_memory)


def _cpu_peak(run) -> int:
    """Peak bytes allocated by torch on the CPU while ``run()`` executes."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    events = sorted(
        (e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"), key=lambda e: e.start_ns()
    )
    total = peak = 0
    for event in events:
        total += event.nbytes()
        peak = max(peak, total)
    return peak


def measure(calc: TCPETCalculator, molecules: int) -> dict:
    """Peak memory (GB) and time (s) of one forces call on a fresh ``molecules`` water box."""
    atoms = water_box(molecules, seed=0)
    atoms.calc = calc
    atoms.get_forces()  # warm-up: kernels compiled and tuned, weights split (forward and backward)
    calc.reset()
    start = time.perf_counter()
    if calc.device.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        atoms.get_forces()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = _cpu_peak(atoms.get_forces)
    return {"atoms": len(atoms), "peak_GB": peak / 1e9, "s": time.perf_counter() - start}


def per_atom(shape: str, precision: str, low_memory: bool, sizes: list[int]) -> dict:
    """Peak bytes per atom between two water boxes of ``sizes`` molecules, and the intercept (GB)."""
    calc = _calculator(shape, precision, "cuda", low_memory)
    small, large = (measure(calc, molecules) for molecules in sizes)
    slope = (large["peak_GB"] - small["peak_GB"]) * 1e9 / (large["atoms"] - small["atoms"])
    return {"bytes_per_atom": slope, "intercept_GB": small["peak_GB"] - slope * small["atoms"] / 1e9}


def largest(shape: str, precision: str, low_memory: bool, start: int = 1024) -> int:
    """The most water molecules (within 5%) whose forces fit in CUDA memory."""
    calc = _calculator(shape, precision, "cuda", low_memory)

    def fits(molecules: int) -> bool:
        try:
            measure(calc, molecules)
            ok = True
        except (torch.OutOfMemoryError, torch.AcceleratorError) as error:  # a kernel launch can fail for memory too
            if not isinstance(error, torch.OutOfMemoryError) and "out of memory" not in str(error):
                raise
            ok = False
        torch.cuda.empty_cache()
        print(
            f"  {shape} {precision} low_memory={low_memory}: {3 * molecules} atoms {'fit' if ok else 'out of memory'}",
            flush=True,
        )
        return ok

    good, bad = 0, start
    while fits(bad):
        good, bad = bad, 2 * bad
    while bad - good > max(1, good // 20):
        middle = (good + bad) // 2
        good, bad = (middle, bad) if fits(middle) else (good, middle)
    return good


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="xs,s,m")
    parser.add_argument("--molecules", type=int, default=64)
    parser.add_argument("--precisions", default="fp32,tf32x3")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--largest", action="store_true", help="search the largest water box that fits (CUDA)")
    parser.add_argument("--per-atom", default=None, help="two box sizes (water molecules): peak bytes per atom")
    parser.add_argument("--start", type=int, default=1024, help="--largest: the first box tried (water molecules)")
    parser.add_argument("--out", default=None, help="results file (default: benchmarks/results/memory_<gpu>.json)")
    args = parser.parse_args()
    rows = []
    print(f"{'model':>5} {'atoms':>6} {'precision':>9} {'peak GB':>8} {'low_memory':>10} {'ratio':>6} {'time x':>6}")
    for shape in args.models.split(","):
        for precision in args.precisions.split(","):
            default, low = (
                measure(_calculator(shape, precision, args.device, m), args.molecules) for m in (False, True)
            )
            row = {
                "model": f"random-{shape}",
                "precision": precision,
                "atoms": default["atoms"],
                "peak_GB": default["peak_GB"],
                "peak_GB_low_memory": low["peak_GB"],
                "memory_ratio": low["peak_GB"] / default["peak_GB"],
                "time_ratio": low["s"] / default["s"],
            }
            if args.per_atom:
                sizes = [int(n) for n in args.per_atom.split(",")]
                for suffix, low in (("", False), ("_low_memory", True)):
                    row.update({f"{k}{suffix}": v for k, v in per_atom(shape, precision, low, sizes).items()})
                    torch.cuda.empty_cache()
            print(row, flush=True)
            if args.largest:
                row["largest_molecules"] = largest(shape, precision, False, args.start)
                row["largest_molecules_low_memory"] = largest(shape, precision, True, args.start)
            print(
                f"{shape:>5} {row['atoms']:>6} {precision:>9} {row['peak_GB']:8.2f} {row['peak_GB_low_memory']:10.2f} "
                f"{row['memory_ratio']:6.2f} {row['time_ratio']:6.2f}"
                + (
                    f"  largest box: {3 * row['largest_molecules']} / {3 * row['largest_molecules_low_memory']} atoms"
                    if args.largest
                    else ""
                ),
                flush=True,
            )
            rows.append(row)
            _results.write(
                "memory", rows, ("model", "precision", "atoms"), env=_results.environment(args.device), out=args.out
            )


if __name__ == "__main__":
    main()
