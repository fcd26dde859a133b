"""The figure tables of docs/performance.md and docs/speed_of_light.md, written from benchmarks/results.

    python benchmarks/report.py            # rewrite the tables in the pages
    python benchmarks/report.py --check    # exit 1 if a table differs from its results file

Each table sits between ``<!-- report:NAME -->`` and ``<!-- /report:NAME -->`` in the page
and is followed by the GPU, versions, date and commands of the runs it shows, so every
figure on the page is the one in its results file. ``make plots`` runs this and
``benchmarks/plot.py``.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import _results

PAGE = Path(__file__).parents[1] / "docs" / "performance.md"
FLOORS_PAGE = PAGE.parent / "speed_of_light.md"

METHODS = {
    "gluon_fp16x3": "fp16x3",
    "triton_tf32x3": "tf32x3",
    "triton_bf16x9": "bf16x9",
    "cublas_tf32": "TF32, 1 pass (cuBLAS)",
}
"""The GEMM methods of the table, in its order, and their names there."""


def measured(data: dict, runs: set[int] | None = None) -> str:
    """Where, with what and how the rows of ``runs`` were measured: device, versions, dates, commands."""
    chosen = [run for i, run in enumerate(data["runs"]) if runs is None or i in runs]
    env = chosen[0]["environment"]
    versions = ", ".join(
        f"{name} {env[key]}"
        for name, key in (
            ("torch", "torch"),
            ("Triton", "triton"),
            ("CUDA", "cuda"),
            ("cuBLAS", "cublas"),
            ("i-PI", "ipi"),
        )
        if key in env
    )
    device = env.get("gpu") or env.get("cpu", "CPU")
    dates = sorted({run["date"] for run in chosen})
    lines = [
        f"Measured on {device}"
        + (f" ({versions})" if versions else "")
        + f", {' to '.join(dict.fromkeys([dates[0], dates[-1]]))}:",
        "",
    ]
    lines += [f"    {run['command']}" for run in chosen]
    return "\n".join(lines)


def table(head: list[str], rows: list[list[str]]) -> str:
    """A Markdown table."""
    return "\n".join(
        ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(r) + " |" for r in rows]
    )


def shape(model: str) -> str:
    """``random-s`` or ``pet-mad-s`` -> ``PET-S``."""
    return "PET-" + model.rsplit("-", 1)[-1].upper()


def milliseconds(ms: float) -> str:
    """Three significant figures for steps under 10 ms, one decimal above."""
    return f"{ms:.2f}" if ms < 10 else f"{ms:.1f}"


def configuration(row: dict) -> str:
    """A row of md_step: precision, engine, compilation."""
    engine = {"auto": "the default engine (auto)", "lean": "lean engine", "metatomic": "metatomic engine"}[
        row["engine"]
    ]
    name = {"fp32": "FP32", "tf32": "tf32 (1 pass, not FP32-accurate)"}.get(row["precision"], row["precision"])
    kind = {
        "conservative": "",
        "direct": ", direct forces and stress",
        "energy": ", energy-only call",
        "energy_forces": ", energy + forces call",
    }[row.get("kind", "conservative")]
    unfused = ", GEMM epilogues unfused" if row.get("epilogues") == "unfused" else ""
    return f"{name}, {engine}" + (" + compile" if row["compiled"] else "") + kind + unfused


def md_step() -> str:
    data = _results.read("md_step_h200")
    out = []
    for model, atoms in dict.fromkeys((r["model"], r["atoms"]) for r in data["rows"]):
        group = [r for r in data["rows"] if (r["model"], r["atoms"]) == (model, atoms)]
        best = min(r["ms"] for r in group if r["precision"] == "fp32" and "ms" in r and r.get("kind") == "conservative")
        for r in sorted(group, key=lambda r: r.get("ms", float("inf"))):
            if "ms" not in r:
                cells = [r["error"], "", ""]
            elif r.get("kind", "conservative") == "conservative":
                cells = [milliseconds(r["ms"]), f"{best / r['ms']:.2f}x", f"{r['peak_GB']:.1f}"]
            else:  # not an MD step of conservative forces: its cost against the same configuration's
                same = [  # step (an energy-only call: against its energy + forces call), same run
                    q
                    for q in group
                    if "ms" in q
                    and (q["engine"], q["compiled"], q["precision"], q["run"], q.get("epilogues"))
                    == (r["engine"], r["compiled"], r["precision"], r["run"], r.get("epilogues"))
                ]
                against = {q.get("kind", "conservative"): q["ms"] for q in same}
                if r["kind"] == "energy" and "energy_forces" in against:
                    ratio = f"{r['ms'] / against['energy_forces']:.2f} of an energy + forces call"
                elif "conservative" in against:
                    ratio = f"{r['ms'] / against['conservative']:.2f} of the step"
                else:
                    ratio = ""
                cells = [milliseconds(r["ms"]), ratio, f"{r['peak_GB']:.1f}"]
            out.append([shape(model), f"{atoms:,}", configuration(r), *cells])
    head = ["model shape", "atoms", "configuration", "ms per MD step (or call)", "vs the best FP32", "peak GB"]
    return table(head, out) + "\n\n" + measured(data)


def gemm() -> str:
    data = _results.read("gemm_h200")
    rows = [r for r in data["rows"] if r["atoms"] == 17280]
    out = []
    for model, layer in dict.fromkeys((r["model"], r["layer"]) for r in rows):
        by = {r["method"]: r for r in rows if (r["model"], r["layer"]) == (model, layer)}
        first = next(iter(by.values()))
        cells = []
        for method in METHODS:
            r = by.get(method)
            cells.append(
                f"{r['fp32_fwd_ms'] / r['fwd_ms']:.2f} / {r['fp32_bwd_ms'] / r['bwd_ms']:.2f}x, "
                f"err {r['err_fwd'] / r['fp32_err_fwd']:.2g}x"
                if r
                else ""
            )
        fp32 = by.get("gluon_fp16x3", first)["fp32_fwd_ms"]
        out.append([shape(model), layer, f"{first['M']}x{first['K']}x{first['N']}", f"{fp32:.2f}", *cells])
    head = ["model", "layer", "M x K x N", "FP32 ms", *METHODS.values()]
    runs = {r["run"] for r in rows}
    return table(head, out) + "\n\n" + measured(data, runs)


def attention() -> str:
    data = _results.read("attention_h200")
    out = []
    for model, atoms in dict.fromkeys((r["model"], r["atoms"]) for r in data["rows"]):
        rows = [r for r in data["rows"] if (r["model"], r["atoms"]) == (model, atoms)]

        def pick(kernel, what="fwd+bwd"):
            return next(r for r in rows if r["kernel"] == kernel and r["pass"] == what)

        def cell(kernel):
            return f"{pick(kernel, 'fwd')['ms']:.2f} / {pick(kernel)['ms']:.2f}"

        speedup = pick("sdpa")["ms"] / pick("tc_attention_packed")["ms"]
        out.append(
            [
                shape(model),
                f"{atoms:,}",
                cell("sdpa"),
                cell("tc_attention"),
                cell("tc_attention_packed"),
                f"**{speedup:.2f}x**",
                f"{pick('sdpa')['error']:.1e} / {pick('tc_attention_packed')['error']:.1e}",
            ]
        )
    head = [
        "model",
        "atoms",
        "torch SDPA FP32, ms fwd / fwd+bwd",
        "ours, padded table",
        "ours, packed rows",
        "fwd+bwd vs SDPA (packed)",
        "error vs FP64: SDPA / ours",
    ]
    return table(head, out) + "\n\n" + measured(data)


DEFAULTS = {
    "default": "default calculator",
    "fp32-default": 'FP32\'s defaults (`precision="fp32"`)',
    "fp32-metatomic+compile": "FP32, metatomic + compile (the best FP32)",
    "graphs+compile": "fp16x3, CUDA graphs + compile (the fastest)",
}


def defaults() -> str:
    data = _results.read("defaults_h200")
    out = []
    for r in sorted(data["rows"], key=lambda r: (r["atoms"], r["ms"])):
        out.append(
            [
                f"{shape(r['model'])}, {r['atoms']:,} atoms",
                DEFAULTS[r["config"]],
                r["precision"],
                f"{r['ms']:.1f}",
                f"{r['first_s_cold']:.1f}",
                f"{r['first_s_warm']:.1f}",
                data["runs"][r["run"]]["date"],
            ]
        )
    head = [
        "system",
        "configuration",
        "precision",
        "ms per MD step",
        "first step, empty caches (s)",
        "first step, second process (s)",
        "date",
    ]
    return table(head, out) + "\n\n" + measured(data)


def batch() -> str:
    data = _results.read("batch_h200")
    out = [
        [
            r["config"],
            f"{r['copies']} x {r['atoms']}",
            f"{r['batch_ms']:.1f}",
            f"{r['single_ms']:.2f}",
            f"{r['throughput_vs_single']:.2f}x",
            f"{r['rebuild_ms']:.1f}",
        ]
        for r in data["rows"]
    ]
    head = [
        "configuration",
        "structures x atoms",
        "one `evaluate` (ms)",
        "one structure per call (ms)",
        "throughput vs one at a time",
        "pair-list rebuild of the batch (ms)",
    ]
    return table(head, out) + "\n\n" + measured(data)


def ipi() -> str:
    data = _results.read("ipi_h200")
    out = []
    for r in data["rows"]:
        if r["engine"] == "dummy":
            what = "i-PI's dummy driver (no model)"
        elif r.get("large"):
            what = f"one {r['atoms']:,}-atom box, {'fp16x3 (auto)' if r['precision'] == 'auto' else r['precision']}"
        else:
            what = f"{r['beads']} beads x {r['atoms']} atoms, {'fp16x3 (auto)' if r['precision'] == 'auto' else r['precision']}"
        rate = lambda k: f"{r[k]:,.0f}" if k in r else ""  # noqa: E731
        out.append(
            [
                what,
                str(r["batch_size"]),
                f"{r['ms_per_step']:.1f}",
                f"{r['ms_per_step_mean']:.1f}",
                rate("bead_steps_per_s") if r["engine"] != "dummy" else "",
                rate("atom_steps_per_s") if r["engine"] != "dummy" else "",
            ]
        )
    head = ["run", "batch_size", "median ms per step", "mean ms", "bead-steps/s", "atom-steps/s"]
    return table(head, out) + "\n\n" + measured(data)


def memory() -> str:
    data = _results.read("memory_h200")

    def largest(row, key):
        return f"{3 * row[key]:,}" if key in row else "not measured"

    def per_atom(row, key):
        return f"{row[key] / 1e6:.2f}" if key in row else ""

    out = [
        [
            shape(r["model"]),
            r["precision"],
            largest(r, "largest_molecules"),
            largest(r, "largest_molecules_low_memory"),
            f"{per_atom(r, 'bytes_per_atom')} / {per_atom(r, 'bytes_per_atom_low_memory')}",
        ]
        for r in sorted(data["rows"], key=lambda r: r["model"][-1] == "m")
    ]
    head = [
        "model shape",
        "precision",
        "largest water box (atoms)",
        "with `low_memory=True`",
        "MB per atom, default / low_memory",
    ]
    return table(head, out) + "\n\n" + measured(data)


def profile_step() -> str:
    data = _results.read("profile_step_h200")
    out = [
        [
            shape(r["model"].replace(":", "-")),
            f"{r['atoms']:,}",
            r["precision"],
            r["engine"],
            r["kind"],
            f"{r['wall_ms']:.1f}",
            f"{r['gpu_busy_ms']:.1f}",
            f"{r['idle_ms_per_step']:.1f}" if "idle_ms_per_step" in r else "",
            f"{r['kernels_per_step']:.0f}",
        ]
        for r in data["rows"]
    ]
    head = [
        "model shape",
        "atoms",
        "precision",
        "engine",
        "step",
        "wall ms per step",
        "GPU busy ms",
        "GPU idle ms (gaps >= 10 µs, `--gaps`)",
        "kernels per step",
    ]
    return table(head, out) + "\n\n" + measured(data)


def checkpoint_note(row: dict) -> str:
    """Nothing when ``row`` was measured with the bundled model's current checkpoint (or
    a downloaded one); otherwise which checkpoint it was (:func:`_results.checkpoint_digest`)."""
    from ase_tcfp32.models import BUNDLED

    if row["model"] not in BUNDLED:
        return ""
    if row.get("checkpoint_sha256") == _results.checkpoint_digest(row["model"]):
        return ""
    return f" (an earlier version of it: checkpoint sha256 {row.get('checkpoint_sha256', 'not recorded')}...)"


def long_runs() -> str:
    soak, watchdog = _results.read("soak_h200"), _results.read("watchdog_cost_h200")
    s, w = soak["rows"][0], watchdog["rows"][0]
    first, last = s["records"][0], s["records"][-1]
    out = [
        [
            f"`benchmarks/soak.py`: {s['model']}{checkpoint_note(s)}, {s['atoms']} atoms, {s['timestep_fs']} fs",
            f"{s['steps']:,} steps at a median {s['median_ms']:.2f} ms; energy drift {s['drift_meV_per_atom_per_ps']:.4f} meV/atom/ps; "
            f"{last['list_rebuilds']:,} pair-list rebuilds, {last['widenings']} widenings of the neighbor table, "
            f"{last['graph_recordings']} CUDA-graph recordings; GPU memory {first['allocated_GB']:.2f} GB at step {first['step']:,}, "
            f"{last['allocated_GB']:.2f} GB at step {last['step']:,} (it grows when the table widens)",
        ],
        [
            f"`benchmarks/watchdog_cost.py`: {shape(w['model'])}, {w['atoms']:,} atoms",
            f"a checked step {w['ms_every_step_checked']:.1f} ms against {w['ms_unchecked']:.1f} ms; at the default "
            f"(every {w['default_every']:,}th evaluation) {100 * w['cost_at_default']:.4f}% of the run",
        ],
    ]
    return table(["run", "result"], out) + "\n\n" + measured(soak) + "\n\n" + measured(watchdog)


TABLES = {
    "md_step": md_step,
    "gemm": gemm,
    "attention": attention,
    "defaults": defaults,
    "batch": batch,
    "ipi": ipi,
    "memory": memory,
    "profile_step": profile_step,
    "long_runs": long_runs,
}


def floors_data() -> dict:
    """speed_of_light's results: the H200's (floors and measurements) where they exist,
    else the floors computed on a CPU."""
    name = "speed_of_light_h200" if (_results.RESULTS / "speed_of_light_h200.json").exists() else "speed_of_light_cpu"
    return _results.read(name)


def floor_ms(ms: float | None) -> str:
    """A floor or a measured time: 3 decimals under 1 ms, 2 under 10, 1 above; "" for none."""
    if ms is None:
        return ""
    return f"{ms:.3f}" if ms < 1 else milliseconds(ms)


def computed(data: dict) -> str:
    """:func:`measured`, or for floors computed without a GPU what was computed, when, and how."""
    if data["device"] != "cpu":
        return measured(data)
    dates = sorted({run["date"] for run in data["runs"]})
    lines = [
        f"Floors only, computed on a CPU (no GPU measurement), {' to '.join(dict.fromkeys([dates[0], dates[-1]]))}:"
    ]
    return "\n".join(lines + [""] + [f"    {run['command']}" for run in data["runs"]])


def speed_of_light() -> str:
    data = floors_data()
    out = []
    for r in data["rows"]:
        launch = r.get("launch_floor_ms")
        floor = max(r["stage_floor_ms"], launch or 0.0)
        out.append(
            [
                shape(r["model"]),
                f"{r['atoms']:,}",
                r["precision"],
                f"{r['mean_neighbors']:.1f}",
                floor_ms(r["tensor_core_floor_ms"]),
                floor_ms(r["memory_floor_ms"]),
                floor_ms(r["stage_floor_ms"]),
                floor_ms(launch) or "not measured",
                floor_ms(r.get("step_ms")) or "not measured",
                f"{r['step_ms'] / floor:.1f}x" if "step_ms" in r else "",
            ]
        )
    head = [
        "model shape",
        "atoms",
        "precision",
        "kept neighbors per atom",
        "tensor-core floor (ms)",
        "memory floor (ms)",
        "sum of stage floors (ms)",
        "launch floor (ms)",
        "measured step (ms)",
        "step / floor",
    ]
    return table(head, out) + "\n\n" + computed(data)


KERNEL_COLUMNS = {
    "gemm": "GEMMs",
    "attention": "attention",
    "combination": "message combination",
    "norm": "norms",
    "swiglu": "SwiGLU",
    "elementwise": "elementwise",
    "index and reductions": "index, reductions",
}
"""The kernel categories (``speed_of_light.CATEGORIES``) that :func:`speed_of_light_kernels`
gives a column each, and the columns' titles; the rest are summed as "other"."""


def speed_of_light_kernels() -> str:
    """The measured steps' GPU time by kernel category (ms per step), from the profiler."""
    data = floors_data()
    out = []
    for r in data["rows"]:
        if "categories_ms" not in r:
            continue
        categories = r["categories_ms"]
        rest = sum(ms for name, ms in categories.items() if name not in KERNEL_COLUMNS)
        out.append(
            [shape(r["model"]), f"{r['atoms']:,}", r["precision"], floor_ms(r["step_ms"]), floor_ms(r["gpu_busy_ms"])]
            + [f"{r['kernels_per_step']:.0f}"]
            + [floor_ms(categories.get(name, 0.0)) for name in KERNEL_COLUMNS]
            + [floor_ms(rest)]
        )
    head = [
        "model shape",
        "atoms",
        "precision",
        "step (ms)",
        "GPU busy (ms)",
        "kernels",
        *KERNEL_COLUMNS.values(),
        "other",
    ]
    return table(head, out) + "\n\n" + computed(data)


def speed_of_light_stages() -> str:
    data = floors_data()
    parts = []
    for r in data["rows"]:
        if r["precision"] != "fp16x3":
            continue
        out = [
            [
                k["stage"],
                k["direction"],
                f"{k['gflop']:.1f}" if k["gflop"] >= 10 else f"{k['gflop']:.2f}",
                f"{k['gb']:.2f}" if k["gb"] >= 0.1 else f"{k['gb']:.3f}",
                floor_ms(k["floor_ms"]),
                floor_ms(k.get("measured_ms")),
                f"{k['measured_ms'] / k['floor_ms']:.1f}x" if "measured_ms" in k else "",
            ]
            for k in r["kinds"]
        ]
        head = ["stage", "pass", "GFLOP (tensor cores)", "GB moved", "floor (ms)", "measured (ms)", "measured / floor"]
        title = f"**{shape(r['model'])}, {r['atoms']:,} atoms, {r['precision']}**"
        above = sorted((k for k in r["kinds"] if "measured_ms" in k), key=lambda k: k["floor_ms"] - k["measured_ms"])
        note = (
            "\n\nFurthest above their floors: "
            + "; ".join(
                f"{k['stage']}, {k['direction']} (+{floor_ms(k['measured_ms'] - k['floor_ms'])} ms)" for k in above[:3]
            )
            + "."
            if above
            else ""
        )
        parts.append(title + "\n\n" + table(head, out) + note)
    return "\n\n".join(parts) + "\n\n" + computed(data)


PAGES = {
    PAGE: TABLES,
    FLOORS_PAGE: {
        "speed_of_light": speed_of_light,
        "speed_of_light_kernels": speed_of_light_kernels,
        "speed_of_light_stages": speed_of_light_stages,
    },
}
"""Each page and the tables it holds."""


def render(text: str, tables: dict = TABLES, page: Path = PAGE) -> str:
    """``text`` (of ``page``) with every marked table of ``tables`` rewritten from the results files."""
    for name, make in tables.items():
        pattern = re.compile(rf"(<!-- report:{name} -->\n)(?:.*?\n)?(<!-- /report:{name} -->)", re.S)
        if not pattern.search(text):
            raise ValueError(f"{page.name} has no <!-- report:{name} --> block")
        text = pattern.sub(lambda m: m.group(1) + make() + "\n" + m.group(2), text)
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the pages' tables differ from the results")
    args = parser.parse_args()
    for page, tables in PAGES.items():
        text = page.read_text()
        new = render(text, tables, page)
        if args.check:
            if new != text:
                sys.exit(f"{page} differs from benchmarks/results: run python benchmarks/report.py")
            continue
        page.write_text(new)


if __name__ == "__main__":
    main()
