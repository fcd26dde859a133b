import gzip
import os
import shutil
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no 20 s network retries in tests

import ase.build  # noqa: E402
import metatrain  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from ase_tcfp32.testing import random_pet  # noqa: E402
from ase_tcfp32.validation import water_box  # noqa: E402

METATRAIN = Path(metatrain.__file__).parent
SHIPPED = {
    "pet-v16": METATRAIN / "pet/tests/checkpoints/model-v16_trainer-v15.ckpt.gz",
    "pet-v8": METATRAIN / "pet/tests/checkpoints/model-v8_trainer-v10.ckpt.gz",
    "pet-v3": METATRAIN / "pet/tests/checkpoints/model-v3_trainer-v2.ckpt.gz",
    "llpr-v4": METATRAIN / "llpr/tests/checkpoints/model-v4_trainer-v7.ckpt.gz",
}


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def shipped(tmp_path_factory):
    """Path of a small checkpoint shipped in metatrain's tests, by short name."""
    folder = tmp_path_factory.mktemp("shipped")

    def get(name: str) -> Path:
        target = folder / SHIPPED[name].name.removesuffix(".gz")
        if not target.exists():
            with gzip.open(SHIPPED[name]) as src, open(target, "wb") as dst:
                shutil.copyfileobj(src, dst)
        return target

    return get


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory) -> Path:
    """A PET-MAD-shaped (architecture rule, 3 heads, 102 types) tiny random checkpoint."""
    path = tmp_path_factory.mktemp("models") / "tiny-pet-mad-rule.ckpt"
    torch.save(random_pet("tiny", seed=7).get_checkpoint(), path)
    return path


@pytest.fixture
def one_thread():
    """torch on one thread for the test: on 2 cores shared with other work (MPI ranks, other
    jobs) its spinning OpenMP threads made small evaluations several to 30x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def ethanol():
    atoms = ase.build.molecule("CH3CH2OH")
    atoms.center(vacuum=3.0)
    atoms.rattle(0.05, seed=3)
    return atoms


@pytest.fixture
def water():
    """A small periodic water box (8 molecules, 24 atoms)."""
    return water_box(8, seed=1)


@pytest.fixture(scope="session")
def water192():
    """The GPU tests' periodic water box (64 molecules, 192 atoms), made once: copy it
    before changing it."""
    return water_box(64, seed=0)


@pytest.fixture
def pt_bulk():
    atoms = ase.build.bulk("Pt", "fcc", a=3.92, cubic=True)
    atoms.rattle(0.05, seed=2)
    return atoms


@pytest.fixture
def tuning_cache(tmp_path, monkeypatch) -> Path:
    """The GEMM autotuning cache file, in a fresh folder, with this process's memory of
    tuned configurations forgotten and tuning on."""
    from ase_tcfp32._kernels import autotune

    monkeypatch.setenv("ASE_TCFP32_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("ASE_TCFP32_AUTOTUNE", raising=False)
    monkeypatch.setattr(autotune, "_memory", {})
    return autotune.cache_file()
