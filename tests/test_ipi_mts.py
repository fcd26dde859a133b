"""i-PI's multiple time stepping served by our drivers (ase_tcfp32.ipi.mts_input): a real
i-PI server on CPU, two drivers (direct and conservative forces) of a tiny random
PET-MAD-shaped model, every process bounded in time and killed at the end (test_ipi's
fixtures)."""

import re
import shutil
import tempfile
from pathlib import Path

import ase.io
import numpy as np
import pytest

pytest.importorskip("ipi")

from ase import units  # noqa: E402
from ase.md.velocitydistribution import Stationary  # noqa: E402
from test_ipi import BIN, Processes, wait, wait_until  # noqa: E402

from ase_tcfp32 import TCPETCalculator  # noqa: E402
from ase_tcfp32.ipi import mts_input  # noqa: E402
from ase_tcfp32.mts import MTSVelocityVerlet  # noqa: E402
from ase_tcfp32.testing import random_checkpoint  # noqa: E402
from ase_tcfp32.validation import water_box  # noqa: E402

AGREEMENT = 1e-6
"""Å: i-PI's and ASE's positions after 3 outer steps (3 fs) from the same start. i-PI's
splitting with ``nmts [1, M]`` is ours (half outer kick, M velocity Verlet steps, half outer
kick); its masses are ASE's (i-PI reads them from the structure's file); its 8-digit unit
constants agree with ASE's to 1e-7. What differs is FP32 rounding: the drivers ask for
other properties than ASE's MTS does, and FP32 evaluations by different paths differ by up
to a few hundred rounding units (tests/test_upet.py), here up to 3.5e-6 eV/Å, which over
t = 0.29 ASE time units moves an H atom by about t² / 2 · 3.5e-6 = 1.5e-7 Å. Measured:
1.3e-7 Å. (i-PI's own hydrogen mass, 6e-5 lighter, would give 3e-6 Å.)"""


@pytest.fixture
def processes():
    started = Processes()
    yield started
    started.kill_all()


@pytest.fixture
def run_folder():
    """A short temporary folder (unix socket paths must stay under ~100 characters)."""
    folder = Path(tempfile.mkdtemp(prefix="tcpet-mts-"))
    ase.io.write(folder / "water.xyz", water_box(8, seed=1))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def test_ipi_mts_matches_ase_mts(run_folder, processes):
    """NVE MTS, M = 2, 0.5 fs inner steps, 3 outer steps: i-PI completes, each driver
    serves its forcefield (the direct one M evaluations per outer step, the conservative
    one), and i-PI's positions are those of MTSVelocityVerlet from i-PI's start."""
    steps, inner, model = 3, 2, str(random_checkpoint("tiny", seed=3))
    xml = mts_input(
        str(run_folder / "water.xyz"),
        inner_steps=inner,
        steps=steps,
        sockets=f"{run_folder}/",
        prefix=f"{run_folder}/sim",
        timestep_fs=0.5,
    )
    (run_folder / "input.xml").write_text(xml)
    server = processes.start([str(BIN / "i-pi"), "input.xml"], run_folder, "server")
    sockets = [run_folder / "pet-direct", run_folder / "pet-conservative"]
    wait_until(lambda: all(s.exists() for s in sockets), server, run_folder / "server.log", 60)
    drivers = []
    for kind, extra in (("direct", ["--non-conservative"]), ("conservative", [])):
        command = [str(BIN / "ase-tcfp32"), "ipi-driver", "--unix", "--address", f"pet-{kind}"]
        command += ["--sockets-prefix", f"{run_folder}/", "--template", str(run_folder / "water.xyz")]
        command += ["--model", model, "--precision", "fp32", "--device", "cpu", *extra]
        drivers.append(processes.start(command, run_folder, kind))
    assert wait(server, run_folder, 240, drivers) == 0, (run_folder / "server.log").read_text()[-2000:]
    assert (run_folder / "server.log").read_text().count("Handshaking was successful") == 2
    served = []
    for kind, process in zip(("direct", "conservative"), drivers):
        assert process.wait(timeout=30) == 0
        found = re.search(r"tcpet driver: (\d+) requests", (run_folder / f"{kind}.log").read_text())
        served.append(int(found[1]))
    assert served[0] >= 1 + steps * inner and served[1] >= 1 + steps

    positions = ase.io.read(next(run_folder.glob("sim.pos_0.*")), ":")
    velocities = ase.io.read(next(run_folder.glob("sim.vel_0.*")), ":")
    assert len(positions) == len(velocities) == steps + 1
    atoms = ase.io.read(run_folder / "water.xyz")  # i-PI's start, and its masses (ASE's: i-PI reads them there)
    assert np.abs(atoms.positions - positions[0].positions).max() < 1e-8
    atoms.set_velocities(velocities[0].arrays["velocities"])
    Stationary(atoms)  # i-PI's fixcom removes the center of mass's velocity (here 5e-7 Å/ASE time) at its first kick
    assert atoms.get_temperature() > 100
    atoms.calc = TCPETCalculator(model, precision="fp32", device="cpu", progress=False)
    dyn = MTSVelocityVerlet(atoms, 0.5 * units.fs, inner_steps=inner)
    for step in range(1, steps + 1):
        dyn.run(1)
        assert np.abs(atoms.positions - positions[step].positions).max() < AGREEMENT


def test_the_driver_option_non_conservative_reaches_the_calculator(tmp_path):
    """i-PI passes options as text: true, forces, stress, false (any case), or a clear error."""
    import atexit

    from ase_tcfp32.ipi import TCPETDriver

    ase.io.write(tmp_path / "water.xyz", water_box(8, seed=0))
    options = dict(template=str(tmp_path / "water.xyz"), model=str(random_checkpoint("tiny", seed=3)), device="cpu")
    for text, value in (("true", True), ("Forces", "forces"), ("false", False)):
        driver = TCPETDriver(**options, precision="fp32", non_conservative=text)
        assert driver.calculators[0].non_conservative == value
        atexit.unregister(driver._report)
    with pytest.raises(ValueError, match="non_conservative is true, forces, stress or false, not 'yes'"):
        TCPETDriver(**options, non_conservative="yes")


def test_the_driver_option_uncertainty_threshold_reaches_the_calculator(tmp_path):
    """eV per atom as text, or none; anything else a clear error before anything is served."""
    import atexit

    from ase_tcfp32.ipi import TCPETDriver

    ase.io.write(tmp_path / "water.xyz", water_box(8, seed=0))
    options = dict(template=str(tmp_path / "water.xyz"), model=str(random_checkpoint("tiny", seed=3)), device="cpu")
    for text, value in (("0.7", 0.7), ("None", None), (None, None)):
        driver = TCPETDriver(**options, precision="fp32", uncertainty_threshold=text)
        assert driver.calculators[0].uncertainty_threshold == value
        atexit.unregister(driver._report)
    with pytest.raises(ValueError, match="uncertainty_threshold is eV per atom or none, not 'high'"):
        TCPETDriver(**options, uncertainty_threshold="high")
