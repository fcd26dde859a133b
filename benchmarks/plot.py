"""The figures of the README and docs/performance.md, drawn from benchmarks/results.

    python benchmarks/plot.py    # or: make plots (also rewrites the tables of performance.md)

Writes ``docs/images/md_step.png`` (ms per MD step against atoms, per precision and FP32,
PET-S and PET-M shapes), ``docs/images/gemm.png`` (speed-up of each PET layer's GEMM against
cuBLAS FP32) and ``docs/images/accuracy.png`` (errors against FP64 per precision: the
GEMMs, and the forces of ``ase-tcfp32 validate single-point``, docs/validation).
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import _results  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
from report import METHODS, milliseconds, shape  # noqa: E402

ROOT = Path(__file__).parents[1]
IMAGES = ROOT / "docs" / "images"
VALIDATION = ROOT / "docs" / "validation" / "demo-model" / "single-point.json"
COLOURS = {"fp16x3": "tab:blue", "tf32x3": "tab:green", "bf16x9": "tab:purple", "tf32": "tab:orange", "fp32": "black"}
"""One colour per precision in every figure."""


def subtitle(data: dict) -> str:
    """The GPU, versions and dates of a results file, for a figure's foot."""
    env = data["runs"][0]["environment"]
    dates = sorted({run["date"] for run in data["runs"]})
    return (
        f"{env.get('gpu', 'CPU')}, torch {env.get('torch', '?')}, Triton {env.get('triton', '?')}, "
        f"CUDA {env.get('cuda', '?')}; {dates[0]}" + (f" to {dates[-1]}" if len(dates) > 1 else "")
    )


def md_step() -> Path:
    """ms per MD step against atoms, one line per configuration, a panel per model shape."""
    data = _results.read("md_step_h200")
    models = list(dict.fromkeys(r["model"] for r in data["rows"]))
    fig, axes = plt.subplots(1, len(models), figsize=(5.5 * len(models), 4.6), squeeze=False, sharey=True)
    for ax, model in zip(axes[0], models):
        rows = [r for r in data["rows"] if r["model"] == model and "ms" in r and r.get("kind") == "conservative"]
        # the same precision on the lean engine at one size and engine auto at another is one line:
        # what the calculator runs at each size
        lines: dict[str, list[dict]] = {}
        for r in rows:
            label = (
                "FP32, metatomic + compile (best FP32 at 17,280)"
                if r["compiled"]
                else {
                    "fp16x3": "fp16x3 (FP32-accurate, Hopper default)",
                    "fp32": "FP32, same engine",
                    "tf32": "tf32, 1 pass (not FP32-accurate)",
                }.get(r["precision"], r["precision"])
            )
            lines.setdefault(label, []).append(r)
        labels = []
        for label, points in lines.items():
            points.sort(key=lambda r: r["atoms"])
            colour = COLOURS.get(points[0]["precision"], "grey")
            style = "--" if points[0]["compiled"] else "-"
            ax.plot(
                [p["atoms"] for p in points],
                [p["ms"] for p in points],
                style,
                marker="s" if points[0]["compiled"] else "o",
                color=colour,
                label=label,
            )
            labels += [(p["atoms"], p["ms"], colour) for p in points]
        for atoms in {x for x, _, _ in labels}:  # values beside their points, spread so that none overlap
            here = sorted((ms, colour) for x, ms, colour in labels if x == atoms)
            ys = [here[0][0]]
            for ms, _ in here[1:]:
                ys.append(max(ms, ys[-1] * 1.4))
            for (ms, colour), y in zip(here, ys):
                ax.annotate(
                    f"{milliseconds(ms)} ms",
                    (atoms, ms),
                    xytext=(atoms * 1.25, y),
                    fontsize=8,
                    color=colour,
                    va="center",
                )
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlim(100, 80000)
        ax.set_ylim(2, 5000)
        ax.set_xlabel("water atoms")
        ax.set_ylabel("ms per MD step (lower is better)")
        ax.set_title(f"{shape(model)} shape")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8, loc="upper left")
    fig.suptitle("One ASE velocity-Verlet step, forces included", fontsize=12)
    fig.text(0.5, 0.01, subtitle(data) + "; python benchmarks/md_step.py", ha="center", fontsize=8, color="dimgrey")
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    return save(fig, "md_step.png")


def gemm() -> Path:
    """Forward and backward speed-up against cuBLAS FP32 of each PET layer at 17,280 atoms."""
    data = _results.read("gemm_h200")
    rows = [r for r in data["rows"] if r["atoms"] == 17280]
    models = list(dict.fromkeys(r["model"] for r in rows))
    methods = [m for m in METHODS if m != "cublas_tf32"]
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 5.6), squeeze=False, sharex=True)
    for ax, model in zip(axes[0], models):
        layers = list(dict.fromkeys(r["layer"] for r in rows if r["model"] == model))
        height = 0.8 / len(methods)
        for i, method in enumerate(methods):
            by = {r["layer"]: r for r in rows if r["model"] == model and r["method"] == method}
            ys = [j + (i - (len(methods) - 1) / 2) * height for j in range(len(layers))]
            speed = [by[layer]["fp32_fwd_ms"] / by[layer]["fwd_ms"] for layer in layers]
            backward = [by[layer]["fp32_bwd_ms"] / by[layer]["bwd_ms"] for layer in layers]
            precision = METHODS[method]
            ax.barh(ys, speed, height=height, color=COLOURS[precision], label=f"{precision} forward")
            ax.scatter(
                backward,
                ys,
                marker="|",
                s=60,
                color="black",
                zorder=3,
                label="backward (input gradient)" if i == 0 else None,
            )
        ax.axvline(1.0, color="black", linewidth=1)
        ax.set_yticks(range(len(layers)), layers, fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel("speed-up against cuBLAS FP32 (higher is better)")
        ax.set_title(f"{shape(model)} layers, 17,280 water atoms")
        ax.grid(True, axis="x", alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=9, bbox_to_anchor=(0.5, 0.04))
    fig.suptitle("FP32-accurate GEMMs of PET's layers against cuBLAS FP32", fontsize=12)
    fig.text(0.5, 0.01, subtitle(data) + "; python benchmarks/gemm.py", ha="center", fontsize=8, color="dimgrey")
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    return save(fig, "gemm.png")


def accuracy() -> Path:
    """Errors against FP64 per precision: each GEMM's (17,280-atom layers, both models) and the forces'."""
    data = _results.read("gemm_h200")
    rows = [r for r in data["rows"] if r["atoms"] == 17280]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.6))
    names = ["fp32", "tf32", "tf32x3", "bf16x9", "fp16x3"]
    method = {"tf32": "cublas_tf32", "tf32x3": "triton_tf32x3", "bf16x9": "triton_bf16x9", "fp16x3": "gluon_fp16x3"}
    for i, name in enumerate(names):
        if name == "fp32":
            errors = list({r["layer"] + r["model"]: r["fp32_err_fwd"] for r in rows}.values())
        else:
            errors = [r["err_fwd"] for r in rows if r["method"] == method[name]]
        left.scatter([i] * len(errors), errors, color=COLOURS[name], alpha=0.7)
    left.set_xticks(range(len(names)), ["FP32\n(cuBLAS)", "tf32\n(1 pass)", "tf32x3", "bf16x9", "fp16x3"])
    left.set_yscale("log")
    left.set_ylabel("relative error of y = x W^T + b vs FP64")
    left.set_title("GEMMs: PET-S and PET-M layers, 17,280 atoms")
    left.grid(True, axis="y", which="both", alpha=0.3)
    validation = json.loads(VALIDATION.read_text())
    systems = validation["systems"]
    width = 0.8 / len(systems)
    shown = ["fp32", "tf32", "tf32x3", "bf16x9", "fp16x3"]
    for j, system in enumerate(systems):
        by = {r["precision"]: r for r in system["rows"]}
        xs = [i + (j - (len(systems) - 1) / 2) * width for i in range(len(shown))]
        values = [by[p]["vs_fp64_force_rms"] for p in shown]
        bars = right.bar(
            xs,
            values,
            width=width,
            color=[COLOURS[p] for p in shown],
            alpha=1.0 if j else 0.55,
            edgecolor="black",
            label=f"{system['atoms']:,} atoms",
        )
        right.bar_label(bars, [f"{v:.1e}" for v in values], fontsize=7, rotation=90, padding=2)
    right.set_xticks(range(len(shown)), ["FP32", "tf32\n(1 pass)", "tf32x3", "bf16x9", "fp16x3"])
    right.set_yscale("log")
    right.set_ylim(top=0.2)
    right.set_ylabel("force RMS error vs FP64 (eV/Å)")
    right.set_title(f"Forces: {validation['model']} on water (light: 192 atoms)")
    right.grid(True, axis="y", which="both", alpha=0.3)
    fig.suptitle("Error against FP64: the emulated precisions sit at or below FP32's", fontsize=12)
    foot = (
        subtitle(data) + "; python benchmarks/gemm.py | forces: ase-tcfp32 validate single-point, "
        f"{validation['date'][:10]}"
    )
    fig.text(0.5, 0.01, foot, ha="center", fontsize=8, color="dimgrey")
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    return save(fig, "accuracy.png")


def save(fig, name: str) -> Path:
    IMAGES.mkdir(parents=True, exist_ok=True)
    path = IMAGES / name
    fig.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(fig)
    return path


def main() -> None:
    for figure in (md_step, gemm, accuracy):
        print(figure())


if __name__ == "__main__":
    main()
