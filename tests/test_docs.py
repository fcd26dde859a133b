"""The documentation site builds with warnings as errors (MkDocs Material + mkdocstrings)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mkdocs")
pytest.importorskip("mkdocstrings")
ROOT = Path(__file__).parents[1]


def test_docs_build_strict(tmp_path):
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    assert "resolve_precision" in api and "swap_linear_layers" in api and "emulated_matmul" in api
    assert (tmp_path / "site" / "validation" / "smoothness.png").exists()
