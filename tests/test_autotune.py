"""Tuned launch configurations: chosen once, remembered in memory and on disk
(``ase_tcfp32._kernels.autotune``), and the calculator's warm-up. The kernels themselves
under every candidate are checked bit for bit on the GPU (the ``gpu``-marked tests below)."""

import json
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch

from ase_tcfp32 import TCPETCalculator
from ase_tcfp32._kernels import autotune
from ase_tcfp32.precision import support

CANDIDATES = [{"stages": 3}, {"stages": 4}, {"stages": 6}]
TIMES = {3: 2.0, 4: 1.0, 6: 1.5}  # ms per candidate, as a GPU would measure them


class Timer:
    """A measure function with fixed times that counts its calls."""

    def __init__(self, times=TIMES, failing=()):
        self.times, self.failing, self.calls = times, failing, 0

    def __call__(self, config: dict) -> float:
        self.calls += 1
        if config["stages"] in self.failing:
            raise RuntimeError("out of resource: shared memory")
        return self.times[config["stages"]]


def test_fastest_candidate_is_measured_once_and_kept_on_disk(tuning_cache, monkeypatch):
    timer = Timer()
    assert autotune.tuned("gpu|n=8|k=16", CANDIDATES, timer) == {"stages": 4}
    assert timer.calls == 3
    assert autotune.tuned("gpu|n=8|k=16", CANDIDATES, timer) == {"stages": 4}
    assert timer.calls == 3  # remembered
    assert json.loads(tuning_cache.read_text()) == {"gpu|n=8|k=16": {"stages": 4}}

    monkeypatch.setattr(autotune, "_memory", {})  # as a new process would start
    assert autotune.tuned("gpu|n=8|k=16", CANDIDATES, Timer(times={3: 1.0, 4: 2.0, 6: 3.0})) == {"stages": 4}

    timer = Timer(times={3: 1.0, 4: 2.0, 6: 3.0})
    assert autotune.tuned("gpu|n=8|k=32", CANDIDATES, timer) == {"stages": 3}  # another shape: measured
    assert timer.calls == 3
    assert set(json.loads(tuning_cache.read_text())) == {"gpu|n=8|k=16", "gpu|n=8|k=32"}


def test_entries_other_processes_wrote_are_kept(tuning_cache):
    autotune.tuned("a", CANDIDATES, Timer())
    on_disk = json.loads(tuning_cache.read_text())
    on_disk["b"] = {"stages": 6}  # another process tuned "b" meanwhile
    tuning_cache.write_text(json.dumps(on_disk))
    autotune.tuned("c", CANDIDATES, Timer())
    assert set(json.loads(tuning_cache.read_text())) == {"a", "b", "c"}


def test_a_stale_entry_is_tuned_again(tuning_cache):
    tuning_cache.parent.mkdir(parents=True)
    tuning_cache.write_text(json.dumps({"a": {"stages": 5}}))  # not a candidate any more
    timer = Timer()
    assert autotune.tuned("a", CANDIDATES, timer) == {"stages": 4}
    assert timer.calls == 3


def test_failing_candidates_are_skipped_but_not_the_first(tuning_cache):
    assert autotune.tuned("a", CANDIDATES, Timer(failing=(4,))) == {"stages": 6}
    with pytest.raises(RuntimeError, match="shared memory"):
        autotune.tuned("b", CANDIDATES, Timer(failing=(3,)))


def test_damaged_or_unwritable_cache_warns_and_still_tunes(tuning_cache, tmp_path, monkeypatch):
    tuning_cache.parent.mkdir(parents=True)
    tuning_cache.write_text("{not json")
    with pytest.warns(UserWarning, match="ignoring the unreadable autotuning cache"):
        assert autotune.tuned("a", CANDIDATES, Timer()) == {"stages": 4}

    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("ASE_TCFP32_CACHE", str(blocker))  # a file where the folder should be
    with pytest.warns(UserWarning, match="last for this process only"):
        assert autotune.tuned("b", CANDIDATES, Timer()) == {"stages": 4}
    timer = Timer()
    assert autotune.tuned("b", CANDIDATES, timer) == {"stages": 4} and timer.calls == 0


def test_tuning_can_be_turned_off(tuning_cache, monkeypatch):
    monkeypatch.setenv("ASE_TCFP32_AUTOTUNE", "0")
    timer = Timer()
    assert autotune.tuned("a", CANDIDATES, timer) == {"stages": 3}
    assert timer.calls == 0 and not tuning_cache.exists()


def test_narrow_products_run_cublas_fp32_at_any_size_and_are_not_tuned():
    """Fewer than 16 outputs or 8 terms (PET's heads' last layers and their input gradients)
    never reach the tensor-core kernels on a GPU; wider products do from a few hundred rows;
    on a CPU the emulation takes every product."""
    from ase_tcfp32._kernels.triton_gemm import NEVER, min_rows

    gpu, cpu = torch.device("cuda"), torch.device("cpu")
    for n, k in [(1, 256), (3, 256), (9, 256), (15, 1024), (256, 1), (256, 3), (256, 7)]:
        assert min_rows(n, k, gpu) == NEVER, (n, k)
        assert min_rows(n, k, cpu) == 0
    if torch.cuda.is_available():
        assert min_rows(16, 8, gpu) < 10**7 and min_rows(256, 9, gpu) < 10**7


def test_small_products_are_summed_in_parts_that_fill_the_gpu(monkeypatch):
    """fp16x3 with 132 multiprocessors (an H200), below the tuned tiles' min_rows: 64-row
    tiles in parts of the K-tiles, up to one work unit per multiprocessor (PET-S's node
    update at 192 atoms as measured best), no part empty or shorter than PART_TILES; light
    and narrow products to cuBLAS FP32."""
    from ase_tcfp32._kernels import fp16x3, triton_gemm

    monkeypatch.setattr(triton_gemm, "sm_count", lambda device: 132)
    gpu, small = torch.device("cuda"), fp16x3.SMALL
    assert triton_gemm.parts(192, 4096, 1024, gpu, small) == 1  # 96 tiles of 64 rows
    assert triton_gemm.parts(192, 1024, 2048, gpu, small) == 4  # 24 tiles, 64 K-tiles
    assert triton_gemm.parts(192, 1024, 4096, gpu, small) == 4
    assert triton_gemm.parts(192, 2048, 1024, gpu, small) == 2
    assert triton_gemm.parts(64, 1024, 2048, gpu, small) == 16  # 8 tiles
    assert triton_gemm.parts(192, 256, 256, gpu, small) == 0  # too light for the kernel
    assert triton_gemm.parts(192, 256, 1024, gpu, small) == 0  # tf32x3: cuBLAS FP32 under 2^27
    assert triton_gemm.parts(192, 256, 1024, gpu, small, fp16x3.MIN_SMALL_WORK) == 8  # fp16x3: from 2^20
    assert triton_gemm.parts(192, 64, 256, gpu, small, fp16x3.MIN_SMALL_WORK) >= 1  # the demo model's heads
    assert triton_gemm.parts(192, 64, 64, gpu, small, fp16x3.MIN_SMALL_WORK) == 0  # 786,432 multiply-adds
    assert triton_gemm.parts(7296, 9, 256, gpu, small) == 0  # narrow
    for m in (1, 64, 192, 700, 3000):
        for n in (16, 128, 1000, 4096):
            for k in (8, 40, 264, 1000, 1056, 4128):
                count, depth = triton_gemm.parts(m, n, k, gpu, small), -(-k // small["BK"])
                if count:
                    chunk = -(-depth // count)
                    assert (count - 1) * chunk < depth and (count == 1 or chunk >= triton_gemm.PART_TILES), (
                        m,
                        n,
                        k,
                        count,
                    )
                    assert count * -(-m // 64) * -(-n // 128) <= 132 or count == 1


def test_warm_up_evaluates_a_copy_and_the_next_call_agrees(tiny_ckpt, water):
    calc = TCPETCalculator(tiny_ckpt, precision="fp32", device="cpu")
    atoms = water.copy()
    atoms.calc = calc
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        seconds = calc.warm_up(atoms)
    assert seconds > 0
    np.testing.assert_array_equal(atoms.positions, water.positions)  # the user's atoms untouched
    fresh = water.copy()
    fresh.calc = TCPETCalculator(tiny_ckpt, precision="fp32", device="cpu")
    np.testing.assert_allclose(atoms.get_forces(), fresh.get_forces(), atol=1e-6)


TUNER = """
import signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C as at a terminal, even if the launcher ignores it
from ase_tcfp32._kernels import autotune
key, pause = sys.argv[1], float(sys.argv[2])
def measure(config):
    print("measuring", flush=True)
    time.sleep(pause)  # a GPU timing a candidate
    return {3: 2.0, 4: 1.0, 6: 1.5}[config["stages"]]
print(autotune.tuned(key, [{"stages": 3}, {"stages": 4}, {"stages": 6}], measure), flush=True)
"""


def tuner(key: str, pause: float, cache) -> subprocess.Popen:
    env = dict(os.environ, ASE_TCFP32_CACHE=str(cache.parent))
    env.pop("ASE_TCFP32_AUTOTUNE", None)
    return subprocess.Popen([sys.executable, "-c", TUNER, key, str(pause)], env=env, stdout=subprocess.PIPE, text=True)


def test_two_processes_filling_an_empty_cache_at_once_keep_both_entries(tuning_cache):
    processes = [tuner(key, 0.3, tuning_cache) for key in ("a", "b")]  # both read an empty cache
    for process in processes:
        assert process.wait(timeout=120) == 0
    assert json.loads(tuning_cache.read_text()) == {"a": {"stages": 4}, "b": {"stages": 4}}


def test_an_interrupted_tuning_leaves_a_cache_the_next_process_uses(tuning_cache):
    import signal

    assert tuner("a", 0.0, tuning_cache).wait(timeout=120) == 0
    before = tuning_cache.read_text()
    process = tuner("b", 30.0, tuning_cache)
    assert process.stdout.readline().strip() == "measuring"
    process.send_signal(signal.SIGINT)  # Ctrl-C while it measures
    assert process.wait(timeout=60) != 0
    assert tuning_cache.read_text() == before  # whole, and without the unfinished entry
    assert tuner("b", 0.0, tuning_cache).wait(timeout=120) == 0
    assert set(json.loads(tuning_cache.read_text())) == {"a", "b"}


def test_a_tuned_entry_is_keyed_by_gpu_software_and_shape(monkeypatch):
    """Another GPU model, Triton or package version, kernel or layer shape: another key, so
    no process ever reuses an entry tuned for something else."""
    import torch

    import ase_tcfp32._version

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    h200 = autotune.device_key(torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    h100 = autotune.device_key(torch.device("cuda"))
    monkeypatch.setattr(ase_tcfp32._version, "__version__", "0.2.0")
    newer = autotune.device_key(torch.device("cuda"))
    assert len({h200, h100, newer}) == 3 and "triton" in h200
    keys = set()

    def remember(key, candidates, measure):
        keys.add(key)
        return candidates[0]

    monkeypatch.setattr(autotune, "tuned", remember)
    for kernel, n, k in [("fp16x3", 256, 768), ("fp16x3", 768, 256), ("triton tf32x3", 256, 768)]:
        autotune.tuned_gemm(kernel, n, k, torch.device("cuda"), CANDIDATES, launcher=None)
    assert len(keys) == 3


def test_tritons_installation_hash_is_read_back_and_never_taken_from_another_installation(tmp_path, monkeypatch):
    """The hash Triton computes of its own files at the first kernel of a process (0.44 s on
    the H200's host) is kept in the cache folder under a fingerprint of those files: a second
    process reads the kept value, a value kept for other files is never used, and a damaged
    file is replaced by the computed one."""
    cache = pytest.importorskip("triton.runtime.cache")
    from ase_tcfp32._kernels.context import remember_triton_key

    monkeypatch.setenv("ASE_TCFP32_CACHE", str(tmp_path))
    monkeypatch.setattr(cache, "triton_key", cache.triton_key)  # restored after the test
    computed = cache.triton_key()
    path = tmp_path / "triton_key.json"

    def process(content):  # what a new process finds and what its Triton then uses
        if content is not None:
            path.write_text(content)
        monkeypatch.setattr(cache, "triton_key", computed_function)
        remember_triton_key.__wrapped__()
        return cache.triton_key()

    computed_function = cache.triton_key
    assert process("not json") == computed  # damaged: computed, written again
    (fingerprint,) = json.loads(path.read_text())
    assert process(json.dumps({fingerprint: "kept"})) == "kept"  # read back, not recomputed
    assert process(json.dumps({"other files": "kept"})) == computed  # another installation's
    assert json.loads(path.read_text()) == {"other files": "kept", fingerprint: computed}


# --- on the GPU (pytest -m gpu tests; skipped without CUDA) ---


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["tf32x3", "bf16x9", "fp16x3"])
def test_every_tuning_candidate_gives_the_same_bits(tuning_cache, precision):
    """Tuning changes tiles, stages and warps, never the K-tile: each candidate computes
    the same bits, forward and backward; prepare() tunes both directions and writes the
    choice to the cache file."""
    import json

    from ase_tcfp32._backends import get_backend
    from ase_tcfp32._kernels import fp16x3
    from ase_tcfp32._kernels.triton_gemm import TritonBackend, tile_candidates

    if precision == "fp16x3" and not support("fp16x3", "cuda").available:
        pytest.skip("fp16x3 needs Hopper")
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(20_011, 256, device="cuda", generator=g)
    w = torch.randn(384, 256, device="cuda", generator=g)
    b = torch.randn(384, device="cuda", generator=g)
    if precision == "fp16x3":
        words = fp16x3.split_weight(w)
        outputs = [fp16x3.launch(x, words, b, config) for config in fp16x3.CANDIDATES]
    else:
        backend = TritonBackend(precision)
        outputs = [backend.launch(x, backend.gemm(w, config=config), b) for config in tile_candidates(384, 256)]
    assert all(torch.equal(y, outputs[0]) for y in outputs[1:])

    backend = get_backend(precision, torch.device("cuda"))
    prepared = backend.prepare(w)
    assert torch.equal(backend.forward(x, prepared, b), outputs[0])
    tuned = json.loads(tuning_cache.read_text())
    assert sorted(key.rsplit("|", 2)[1:] for key in tuned) == [["n=256", "k=384"], ["n=384", "k=256"]]


@pytest.mark.gpu
def test_warm_up_tunes_every_layer_before_the_first_step(tuning_cache, tiny_ckpt, water192):
    """After warm_up() the MD steps tune nothing more (the cache file stays as it was)
    and give what a calculator without warm-up gives."""
    atoms = water192.copy()
    atoms.calc = TCPETCalculator(tiny_ckpt, device="cuda")
    assert atoms.calc.warm_up(atoms) > 0
    tuned = tuning_cache.read_text()
    atoms.positions += 0.01
    forces = atoms.get_forces()
    assert tuning_cache.read_text() == tuned
    fresh = atoms.copy()
    fresh.calc = TCPETCalculator(tiny_ckpt, device="cuda")
    assert np.abs(fresh.get_forces() - forces).max() < 3e-5
