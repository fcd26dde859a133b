import pytest
import torch

from ase_tcfp32 import PRECISIONS, UnsupportedPrecisionError, auto_precision, available_precisions
from ase_tcfp32 import precision as precision_module
from ase_tcfp32.precision import ieee_fp32_matmul, resolve_precision, support


@pytest.fixture
def fake_gpu(monkeypatch):
    """Pretend a CUDA device of a given compute capability exists (selection logic only)."""

    def install(cc):
        monkeypatch.setattr(precision_module, "_capability", lambda device: cc if device.type == "cuda" else None)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: f"GPU {cc[0]}.{cc[1]}")

    return install


@pytest.mark.parametrize(
    "cc,expected",
    [
        ((7, 0), "fp32"),
        ((7, 5), "fp32"),
        ((8, 0), "tf32x3"),
        ((8, 9), "tf32x3"),
        ((9, 0), "fp16x3"),
        ((10, 0), "bf16x9"),
        ((10, 3), "bf16x9"),
        ((12, 0), "fp32"),
    ],
)
def test_auto_selection_table(fake_gpu, cc, expected):
    fake_gpu(cc)
    chosen, why = auto_precision("cuda")
    assert chosen == expected and f"{cc[0]}.{cc[1]}" in why
    if expected == "fp32":
        with pytest.warns(UserWarning, match="precision='auto' uses fp32"):
            assert resolve_precision("auto", "cuda") == "fp32"
    else:
        assert resolve_precision("auto", "cuda") == expected


def test_precision_the_gpu_cannot_run_is_a_clear_error(fake_gpu):
    fake_gpu((7, 0))
    with pytest.raises(UnsupportedPrecisionError, match="compute capability 7.0 has no TF32/BF16 tensor cores"):
        resolve_precision("tf32x3", "cuda")
    assert resolve_precision("fp32", "cuda") == "fp32"


def test_backends_per_generation(fake_gpu):
    fake_gpu((9, 0))
    assert support("bf16x9", "cuda").backend == "triton"
    assert support("fp16x3", "cuda").backend == "gluon"
    fake_gpu((10, 0))
    assert support("bf16x9", "cuda").backend == "cuBLAS BF16x9"
    assert support("tf32x3", "cuda").backend == "triton"


def test_hopper_without_gluon_falls_back_to_tf32x3(fake_gpu, monkeypatch):
    fake_gpu((9, 0))
    monkeypatch.setattr(precision_module, "_has_gluon", lambda: False)
    assert auto_precision("cuda")[0] == "tf32x3"
    with pytest.raises(UnsupportedPrecisionError, match="Gluon"):
        resolve_precision("fp16x3", "cuda")


@pytest.mark.parametrize("cc", [(8, 0), (8, 9), (10, 0)])
def test_fp16x3_outside_hopper_is_a_clear_error(fake_gpu, cc):
    fake_gpu(cc)
    with pytest.raises(
        UnsupportedPrecisionError, match=r"fp16x3 has a kernel for Hopper \(compute capability 9.0\) only"
    ):
        resolve_precision("fp16x3", "cuda")


def test_available_precisions_lists_every_mode_on_cpu():
    rows = available_precisions("cpu")
    assert [r.precision for r in rows] == list(PRECISIONS)
    assert all(r.available for r in rows)
    assert [r.backend for r in rows] == ["CPU BLAS", "reference", "reference", "reference", "reference"]


def test_ieee_guard_restores_the_callers_setting():
    matmul = torch.backends.cuda.matmul
    saved = matmul.fp32_precision
    try:
        matmul.fp32_precision = "tf32"
        with ieee_fp32_matmul():
            assert matmul.fp32_precision == "ieee"
        assert matmul.fp32_precision == "tf32"
        with pytest.raises(RuntimeError):
            with ieee_fp32_matmul():
                raise RuntimeError("model failure")
        assert matmul.fp32_precision == "tf32"
    finally:
        matmul.fp32_precision = saved


@pytest.fixture
def no_toolchain(monkeypatch, tmp_path):
    """A machine without a C compiler (PATH holds no gcc or clang, $CC unset), as slim
    CUDA runtime containers are: Triton cannot build its launchers there."""
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    precision_module.triton_build_problem.cache_clear()
    yield
    precision_module.triton_build_problem.cache_clear()


def test_a_machine_without_a_c_compiler_is_told_so_and_runs_fp32(fake_gpu, no_toolchain):
    from ase_tcfp32._attention import on_tensor_cores

    assert "no C compiler" in precision_module.triton_build_problem()
    for cc, fallback in (((9, 0), "fp32"), ((8, 0), "fp32"), ((10, 0), "bf16x9")):
        fake_gpu(cc)
        chosen, why = auto_precision("cuda")
        assert chosen == fallback, (cc, chosen, why)
        if fallback == "fp32":
            assert "no C compiler" in why
            with pytest.warns(UserWarning, match="precision='auto' uses fp32: .*Triton.*no C compiler"):
                resolve_precision("auto", "cuda")
            with pytest.raises(UnsupportedPrecisionError, match="need Triton to build its launchers.*no C compiler"):
                resolve_precision("tf32x3", "cuda")
        assert not on_tensor_cores(chosen, "cuda")  # bf16x9's GEMMs are cuBLAS's; its attention would be Triton's
    assert support("fp32", "cuda").available


def test_the_toolchain_check_follows_tritons_rules(monkeypatch, tmp_path):
    """$CC first (it must be an executable), and Python's headers where Triton looks."""
    import os
    import sysconfig

    monkeypatch.setenv("PATH", str(tmp_path))
    check = precision_module.triton_build_problem
    check.cache_clear()
    try:
        monkeypatch.setenv("CC", str(tmp_path / "missing-cc"))
        assert "is not an executable" in check()
        compiler = tmp_path / "cc"
        compiler.write_text("#!/bin/sh\n")
        compiler.chmod(0o755)
        monkeypatch.setenv("CC", str(compiler))
        check.cache_clear()
        if os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")):
            assert check() is None
        monkeypatch.setattr(sysconfig, "get_paths", lambda scheme=None: {"include": str(tmp_path)})
        check.cache_clear()
        assert "Python.h" in check()
    finally:
        check.cache_clear()


def test_without_a_c_compiler_the_cutoffs_run_in_torch_with_a_warning(no_toolchain):
    from ase_tcfp32._kernels.context import cutoff_kernel_usable

    with pytest.warns(UserWarning, match="adaptive cutoffs run in metatrain's torch code.*no C compiler"):
        assert not cutoff_kernel_usable(torch.device("cuda"))
    assert not cutoff_kernel_usable(torch.device("cpu"))


def test_an_unwritable_triton_cache_moves_to_the_temporary_folder_with_a_warning(monkeypatch, tmp_path):
    """A container whose home folder cannot be written: Triton's cache goes to the
    temporary folder instead of every kernel failing to compile (a path under a file: not
    writable even for root)."""
    from triton import knobs

    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(blocked / "cache"))
    monkeypatch.setattr(precision_module.tempfile, "gettempdir", lambda: str(tmp_path))
    precision_module.triton_build_problem.cache_clear()
    try:
        with pytest.warns(UserWarning, match="Triton's cache folder .*a-file/cache cannot be written"):
            precision_module.triton_build_problem()
        assert knobs.cache.dir.startswith(str(tmp_path / "triton-cache-"))
        assert precision_module._writable(knobs.cache.dir)
    finally:
        del knobs.cache.dir  # back to $TRITON_CACHE_DIR, which monkeypatch restores
        precision_module.triton_build_problem.cache_clear()


# --- on the GPU (pytest -m gpu tests; skipped without CUDA) ---


@pytest.mark.gpu
def test_auto_picks_fp16x3_on_hopper_and_tf32x3_on_ampere():
    cc = torch.cuda.get_device_capability()
    if cc[0] not in (8, 9):
        pytest.skip("table rows for 8.x / 9.x")
    assert auto_precision("cuda")[0] == ("fp16x3" if cc == (9, 0) else "tf32x3")
