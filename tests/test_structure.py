"""The package's shape: imports run one way (no cycle, no module importing a module that
imports it), each job in its own module, internals private."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parents[1] / "ase_tcfp32"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def imports(name: str, package: bool, source: str, known) -> set[str]:
    """The package's modules that module ``name`` (a package's ``__init__`` when
    ``package``), whose code is ``source``, imports anywhere (function-level imports
    included), each with the packages above it that importing it runs; ``known``: the
    package's module names."""
    base = name if package else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(source)):
        targets = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = base.split(".")[: len(base.split(".")) - node.level + 1]
                source = ".".join(anchor + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            targets = [
                f"{source}.{alias.name}" if f"{source}.{alias.name}" in known else source for alias in node.names
            ]
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if not target.startswith("ase_tcfp32"):
                continue
            if target != name:
                found.add(target)
            parent = target.rpartition(".")[0]
            while parent.startswith("ase_tcfp32."):  # packages that importing the target runs first,
                if parent != name and not name.startswith(parent + "."):  # unless the module is inside them
                    found.add(parent)
                parent = parent.rpartition(".")[0]
    return found


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, is_package(path), path.read_text(), known) for name, path in known.items()}


def test_the_import_graph_has_no_cycle():
    arrows, state, order = graph(), {}, []

    def visit(name, path):
        state[name] = "open"
        for target in sorted(arrows[name]):
            if state.get(target) == "open":
                pytest.fail("import cycle: " + " -> ".join([*path, name, target]))
            if target not in state:
                visit(target, [*path, name])
        state[name] = "done"
        order.append(name)

    for name in sorted(arrows):
        if name not in state:
            visit(name, [])
    assert "ase_tcfp32.calculator" in order and len(order) == len(arrows)


def test_the_graph_sees_imports_that_would_run_back_up():
    """The check above can fail: the package's version read through its ``__init__`` (which
    imports the calculator, which imports the kernels) is an arrow back up to the root, and a
    package's modules imported by name count with their package."""
    known = set(modules())
    found = imports("ase_tcfp32._kernels.autotune", False, "from .. import __version__\n", known)
    assert found == {"ase_tcfp32"}
    found = imports("ase_tcfp32.layers", False, "def f():\n    from ._kernels.split import round_tf32\n", known)
    assert found == {"ase_tcfp32._kernels.split", "ase_tcfp32._kernels"}


JOBS = {
    "neighbor search": ("from vesin", "NeighborList("),
    "graph capture": ("CUDAGraph", "torch.cuda.graph("),
    "class swaps": ("__class__ =",),
    "downloads": ("huggingface_hub", "_resolve_and_download_checkpoint"),
}
"""Words only the module that does a job writes."""


@pytest.mark.parametrize("job", JOBS)
def test_each_job_lives_in_one_module(job):
    users = sorted(name for name, path in modules().items() if any(word in path.read_text() for word in JOBS[job]))
    assert len(users) == 1, f"{job} in {users}"


def test_the_lean_engine_stays_small():
    assert len((PACKAGE / "_lean.py").read_text().splitlines()) < 400


def test_public_modules_are_the_documented_ones():
    """Every module without a leading underscore is on the API page (or is the command line)."""
    api = (PACKAGE.parent / "docs" / "api.md").read_text()
    public = {name for name in modules() if not any(part.startswith("_") for part in name.split("."))}
    public -= {"ase_tcfp32", "ase_tcfp32.cli"}
    undocumented = sorted(
        name
        for name in public
        if f"::: {name}" not in api
        and not any(f"::: {parent}" in api for parent in [name.rpartition(".")[0]] if parent != "ase_tcfp32")
    )
    assert not undocumented
