"""Run every validation test and write one Markdown report with the plots."""

from __future__ import annotations

import json
from pathlib import Path

from . import nve, relax, single_point, smoothness, speed
from .common import environment

TESTS = {
    "single-point": single_point.run,
    "smoothness": smoothness.run,
    "nve": nve.run,
    "relax": relax.run,
    "speed": speed.run,
}

QUICK = {
    "single-point": dict(molecules=(8,)),
    "smoothness": dict(points=24, size=(2, 2, 3)),
    "nve": dict(ps=0.05, molecules=8, every=5),
    "relax": dict(size=(3, 3, 4), repeats=1, max_steps=150, fmax=0.05),
    "speed": dict(molecules=(8,), warmup=1, repeats=3),
}
"""Small settings for CI and laptops: the same tests on systems of tens of atoms."""


def run(
    test: str, model: str, precisions: list[str], device=None, out="validation", quick=False, engine="auto", **options
) -> dict:
    """Run one test by name (``single-point``, ``smoothness``, ``nve``, ``relax``, ``speed``)
    with the calculators in ``engine`` (``TCPETCalculator(engine=...)``)."""
    if test not in TESTS:
        raise ValueError(f"unknown validation test {test!r}; valid: {', '.join([*TESTS, 'all'])}")
    settings = {**(QUICK[test] if quick else {}), **options}
    return TESTS[test](model, precisions, device=device, out=out, engine=engine, **settings)


def run_all(
    model: str, precisions: list[str], device=None, out="validation", quick=False, options=None, engine="auto"
) -> dict:
    """Every test, then ``report.md`` in ``out``; ``options`` maps test names to settings."""
    options = options or {}
    results = {
        name: run(name, model, precisions, device, out, quick, engine, **options.get(name, {})) for name in TESTS
    }
    Path(out, "report.md").write_text(markdown(results, model, environment(device, engine)))
    return results


def from_files(out="validation") -> dict:
    """``report.md`` in ``out`` from the tests' JSON files there (tests run one by one,
    e.g. in separate jobs); the model and environment are the ones the files record."""
    results = {name: json.loads(path.read_text()) for name in TESTS if (path := Path(out, f"{name}.json")).exists()}
    if not results:
        raise FileNotFoundError(f"no validation results (*.json of {', '.join(TESTS)}) in '{out}'")
    first = next(iter(results.values()))
    Path(out, "report.md").write_text(markdown(results, first["model"], first["environment"]))
    return results


def _verdict(rows) -> str:
    words = {True: "passed", False: "FAILED", None: "no verdict (FP32 itself did not converge)"}
    verdicts = [f"{r['precision']} {words[r['passed']]}" for r in rows if "passed" in r]
    return "; ".join(verdicts) or "no pass criterion applies"


def markdown(results: dict, model: str, env: dict) -> str:
    lines = [
        "# Validation report\n",
        f"Model: `{model}`. Environment: " + ", ".join(f"{k} {v}" for k, v in env.items()) + ".\n",
    ]
    for name, result in results.items():
        lines.append(f"## {name}\n")
        lines.append(f"![{name}]({name}.png)\n")
        groups = result.get("systems") or [{"rows": result["rows"], "atoms": result.get("atoms")}]
        for group in groups:
            rows = group["rows"]
            keys = [k for k in rows[0] if k not in ("precision",)] + [k for r in rows for k in r if k not in rows[0]]
            keys = list(dict.fromkeys(keys))
            if group.get("atoms"):
                lines.append(f"{group['atoms']} atoms. Verdict: {_verdict(rows)}.\n")
            lines.append("| precision | " + " | ".join(keys) + " |")
            lines.append("|---|" + "---|" * len(keys))
            for r in rows:
                cells = [_fmt(r.get(k)) for k in keys]
                lines.append(f"| {r['precision']} | " + " | ".join(cells) + " |")
            lines.append("")
    return "\n".join(lines)


def _fmt(value) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)
