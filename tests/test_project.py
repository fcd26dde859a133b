"""The project's own pages and results stay current: no work-log numbering in tracked files,
one results file per benchmark and GPU, each naming the command that made it, and the
performance page's tables equal to what the results files give."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
RESULTS = ROOT / "benchmarks" / "results"
WORK_LOG = re.compile(r"session ?[0-9]|\bround ?[0-9]|_run[0-9]|\brun[0-9]\b", re.I)
"""Numbered work rounds (the words session or round followed by a number, or _run and a digit
in a name): history belongs in git and CHANGELOG.md."""

sys.path.insert(0, str(ROOT / "benchmarks"))
import _results  # noqa: E402
import report  # noqa: E402


def tracked_files() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [ROOT / name for name in out.decode().split("\0") if name]


def test_no_work_log_numbering_in_tracked_files():
    found = []
    for path in tracked_files():
        name = str(path.relative_to(ROOT))
        if WORK_LOG.search(name):
            found.append(f"{name} (its name)")
        if not path.is_file() or path.suffix in {".png", ".ckpt", ".pt", ".gz", ".npz"}:
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if WORK_LOG.search(line):
                found.append(f"{name}:{number}: {line.strip()[:100]}")
    assert not found, "work-log numbering (use git history and CHANGELOG.md):\n" + "\n".join(found[:20])


def test_results_are_one_file_per_benchmark_and_device_each_naming_its_command():
    files = sorted(RESULTS.rglob("*"))
    assert len(files) <= 20, f"{len(files)} files in benchmarks/results (at most 20: a list a reader scans)"
    for path in files:
        assert path.is_file() and path.suffix == ".json", f"{path.name}: only JSON files, no folders"
        benchmark, device = path.stem.rsplit("_", 1)
        script = ROOT / "benchmarks" / f"{benchmark}.py"
        assert script.exists(), f"{path.name}: no benchmarks/{benchmark}.py writes it"
        assert f'"{benchmark}"' in script.read_text(), f"{path.name}: {script.name} does not write it"
        data = json.loads(path.read_text())
        assert data["benchmark"] == benchmark and data["runs"] and data["rows"], path.name
        for run in data["runs"]:
            assert run["command"].startswith(f"python benchmarks/{benchmark}.py"), (path.name, run["command"])
            assert re.fullmatch(r"\d{4}-\d\d-\d\d", run["date"]), (path.name, run["date"])
            env = run["environment"]
            tag = _results.device_tag(env)
            assert tag == device, f"{path.name}: measured on {env.get('gpu', 'a CPU')}, named {device}"
        assert {row["run"] for row in data["rows"]} == set(range(len(data["runs"]))), f"{path.name}: runs without rows"
        keys = [_results.identity(row, data["key"]) for row in data["rows"]]
        assert len(keys) == len(set(keys)), f"{path.name}: two rows with the same key"


def test_results_files_named_in_tracked_files_exist():
    missing = []
    for path in tracked_files():
        if path.suffix not in {".md", ".py", ".yml", ".toml"} or not path.is_file():
            continue
        for name in re.findall(r"benchmarks/results/([\w-]+\.\w+)", path.read_text()):
            if not (RESULTS / name).exists():
                missing.append(f"{path.relative_to(ROOT)}: benchmarks/results/{name}")
    assert not missing, "\n".join(missing)


@pytest.mark.parametrize("page", report.PAGES, ids=lambda page: page.name)
def test_pages_tables_are_the_results_files(page):
    text = page.read_text()
    assert report.render(text, report.PAGES[page], page) == text, (
        f"docs/{page.name} differs from benchmarks/results: run python benchmarks/report.py"
    )
    assert len(text.splitlines()) < 300


@pytest.mark.parametrize("page", report.PAGES, ids=lambda page: page.name)
def test_pages_figures_outside_the_tables_are_in_them(page):
    """Every 'N ms' and 'N.NNx' written by hand on a page is a figure of a generated table."""
    text = page.read_text()
    generated = "\n".join(re.findall(r"<!-- report:\w+ -->\n(.*?)<!-- /report", text, re.S))
    prose = re.sub(r"<!-- report:\w+ -->\n.*?<!-- /report:\w+ -->", "", text, flags=re.S)
    for figure in re.findall(r"\b(\d+\.\d+) ms\b", prose):
        assert figure in generated, f"{figure} ms is in no table of the page"
    for figure in re.findall(r"\*\*(\d+\.\d+)x\*\*", prose):
        value = float(figure)
        assert any(abs(float(x) - value) < 1e-9 for x in re.findall(r"(\d+\.\d+)x", generated)), f"{figure}x"


def test_plots_are_shown_in_readme_and_docs():
    for name in ("md_step.png", "gemm.png", "accuracy.png"):
        assert (ROOT / "docs" / "images" / name).exists()
        assert f"docs/images/{name}" in (ROOT / "README.md").read_text()
        assert f"images/{name}" in report.PAGE.read_text()


def test_write_merges_rows_by_key(tmp_path, monkeypatch):
    out = tmp_path / "bench_h200.json"
    env = {"gpu": "NVIDIA H200"}
    monkeypatch.setattr(_results, "STARTED", "2026-01-01T00:00:00")
    _results.write("bench", [{"atoms": 192, "ms": 5.0}, {"atoms": 17280, "ms": 140.0}], ("atoms",), env=env, out=out)
    _results.write("bench", [{"atoms": 192, "ms": 4.9}], ("atoms",), env=env, out=out)  # the same run, saved again
    monkeypatch.setattr(_results, "STARTED", "2026-01-02T00:00:00")
    _results.write("bench", [{"atoms": 17280, "ms": 136.0}], ("atoms",), env=env, out=out)
    data = json.loads(out.read_text())
    rows = {row["atoms"]: row for row in data["rows"]}
    assert rows[192]["ms"] == 4.9 and rows[17280]["ms"] == 136.0
    assert len(data["runs"]) == 2 and data["runs"][rows[17280]["run"]]["date"] == "2026-01-02"
    monkeypatch.setattr(_results, "STARTED", "2026-01-03T00:00:00")
    _results.write("bench", [{"atoms": 192, "ms": 4.8}], ("atoms",), env=env, out=out)
    data = json.loads(out.read_text())
    assert [run["date"] for run in data["runs"]] == ["2026-01-02", "2026-01-03"]  # the first run named no row any more
    assert _results.device_tag(env) == "h200" and _results.device_tag({}) == "cpu"
