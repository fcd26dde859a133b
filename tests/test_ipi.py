"""The i-PI driver against a real i-PI server (unix sockets in a temporary folder, on CPU,
the bundled model): path-integral MD served by two drivers, a driver killed mid-run, bad
input. Every process started here is bounded in time and killed at the end."""

import atexit
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import ase.io
import numpy as np
import pytest

pytest.importorskip("ipi")

from ase_tcfp32 import TCPETCalculator  # noqa: E402
from ase_tcfp32.ipi import ENERGY, LENGTH, pimd_input  # noqa: E402
from ase_tcfp32.validation import water_box  # noqa: E402

BIN = Path(sys.executable).parent
MODEL = "pet-demo-chgnet"


@pytest.fixture
def run_folder():
    """A short temporary folder (unix socket paths must stay under ~100 characters)."""
    folder = Path(tempfile.mkdtemp(prefix="tcpet-ipi-"))
    ase.io.write(folder / "water.xyz", water_box(8, seed=1))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


class Processes:
    """Started processes, all killed (with their children) when the test ends."""

    def __init__(self):
        self.started = []

    def start(self, args, folder, name):
        log = open(folder / f"{name}.log", "w")
        # one thread each: drivers that share 2 cores with the server spin their OpenMP threads (20x slower)
        env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
        process = subprocess.Popen(
            args, cwd=folder, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        self.started.append(process)
        return process

    def kill_all(self):
        for process in self.started:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)


@pytest.fixture
def processes():
    started = Processes()
    yield started
    started.kill_all()


def server(processes, folder, steps, batch=4, consolidate=True, beads=4, launcher=(str(BIN / "i-pi"),)):
    xml = pimd_input(
        f"{folder}/water.xyz",
        beads=beads,
        steps=steps,
        batch_size=batch,
        sockets=f"{folder}/",
        prefix=f"{folder}/sim",
        consolidate=consolidate,
    )
    (folder / "input.xml").write_text(xml)
    process = processes.start([*launcher, "input.xml"], folder, "server")
    deadline = time.time() + 60
    while not (folder / "pet").exists():  # the server's socket
        assert process.poll() is None and time.time() < deadline, (folder / "server.log").read_text()
        time.sleep(0.2)
    return process


def driver(processes, folder, name, template="water.xyz", **options):
    options = {"template": str(folder / template), "model": MODEL, "precision": "fp32", "device": "cpu", **options}
    args = [
        sys.executable,
        str(BIN / "i-pi-py_driver"),
        "-m",
        "custom",
        "-P",
        str(Path(ase_tcfp32_ipi())),
        "-u",
        "-a",
        "pet",
        "-S",
        f"{folder}/",
        "-o",
        ",".join(f"{k}={v}" for k, v in options.items()),
    ]
    return processes.start(args, folder, name)


def cli_driver(processes, folder, name, *options, launcher=(str(BIN / "ase-tcfp32"), "ipi-driver")):
    """``ase-tcfp32 ipi-driver`` (or ``launcher``) for the server at ``folder/pet`` (the
    bundled model, fp32 on CPU), with ``options`` after the defaults."""
    command = [
        *launcher,
        "--unix",
        "--address",
        "pet",
        "--sockets-prefix",
        f"{folder}/",
        "--template",
        str(folder / "water.xyz"),
        "--model",
        MODEL,
        "--precision",
        "fp32",
        "--device",
        "cpu",
        *options,
    ]
    return processes.start(command, folder, name)


def wait_until(ready, process, log: Path, seconds: float = 120) -> None:
    """Until ``ready()``, within ``seconds``; ``process`` must stay alive meanwhile (else
    the tail of ``log`` says why)."""
    deadline = time.time() + seconds
    while not ready():
        assert process.poll() is None and time.time() < deadline, log.read_text()[-2000:]
        time.sleep(0.2)


def steps_written(folder: Path) -> int:
    """Rows of i-PI's ``sim.out`` so far (its ``#`` header lines not counted)."""
    out = folder / "sim.out"
    return (
        sum(1 for line in out.read_text().splitlines() if line.strip() and not line.startswith("#"))
        if out.exists()
        else 0
    )


def ase_tcfp32_ipi() -> str:
    import ase_tcfp32.ipi

    return ase_tcfp32.ipi.__file__


GRACE = 30.0
"""Seconds the server may take to exit after its last driver has gone: at the end of a run
i-PI closes the sockets (the drivers exit) before it writes its final files and exits."""


def wait(process, folder, seconds, drivers=()):
    """``process``'s exit code, within ``seconds`` and at most :data:`GRACE` seconds after
    the last of ``drivers`` has gone. Waiting for a server with ``drivers``: a failure at
    once if i-PI's polling thread has ended (the run would wait forever: docs/ipi_patch.md)."""
    deadline = time.time() + seconds
    while process.poll() is None:
        log = folder / "server.log"
        if drivers and log.exists() and "Exception in thread poll_" in log.read_text():
            pytest.fail(f"i-PI's polling thread ended: the run cannot go on\n{log.read_text()[-3000:]}")
        if drivers and all(d.poll() is not None for d in drivers):
            deadline = min(deadline, time.time() + GRACE)
            drivers = ()
        if time.time() > deadline:
            logs = "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in folder.glob("*.log"))
            pytest.fail(f"no end within {seconds} s, or {GRACE:.0f} s after every driver had gone\n{logs}")
        time.sleep(0.2)
    return process.returncode


CORRECTED = (str(BIN / "ase-tcfp32"), "ipi-server")
"""i-PI with the correction for drivers that die mid-request (ase_tcfp32._ipi_server)."""
BEADS, STEPS = 8, 4
"""The runs of two or three drivers: path-integral NVT of 8 water molecules, 8 beads, 4 steps."""


def run_of(folder: Path) -> dict:
    """A finished run's steps, bead potentials (eV), and each bead's positions (Å) and forces
    (eV/Å) at every step, as arrays [bead, step, atom, 3]."""
    out = np.loadtxt(folder / "sim.out", ndmin=2)
    arrays = {
        what: np.array(
            [
                [f.positions if what == "pos" else f.get_forces() for f in ase.io.read(path, ":")]
                for path in sorted(folder.glob(f"sim.{what}_*"))
            ]
        )
        for what in ("pos", "for")
    }
    return {"steps": out[:, 0], "potentials": out[:, 2:], **arrays}


@pytest.fixture(scope="module")
def two_driver_run():
    """PIMD NVT, batches of 8, two drivers, through ``ase-tcfp32 ipi-server``: the run
    (its arrays, :func:`run_of`, and its drivers' exit codes and logs) that
    :func:`test_pimd_served_by_two_drivers_matches_direct_evaluation` checks and the
    killed-driver runs are compared with. The drivers load their model first and wait for
    the server, so both serve the run (a driver started after the run's end would find no
    server)."""
    folder = Path(tempfile.mkdtemp(prefix="tcpet-ipi-"))
    started = Processes()
    try:
        ase.io.write(folder / "water.xyz", water_box(8, seed=1))
        drivers = [cli_driver(started, folder, name) for name in ("driver-a", "driver-b")]
        for name, process in zip(("driver-a", "driver-b"), drivers):
            log = folder / f"{name}.log"
            wait_until(lambda log=log: "serving i-PI at" in log.read_text(), process, log)
        ipi = server(started, folder, STEPS, batch=BEADS, beads=BEADS, launcher=CORRECTED)
        assert wait(ipi, folder, 240, drivers) == 0, (folder / "server.log").read_text()[-2000:]
        codes = [process.wait(timeout=30) for process in drivers]
        logs = [(folder / f"{name}.log").read_text() for name in ("driver-a", "driver-b")]
        yield {"server_log": (folder / "server.log").read_text(), "codes": codes, "logs": logs, **run_of(folder)}
    finally:
        started.kill_all()
        shutil.rmtree(folder, ignore_errors=True)


def test_pimd_served_by_two_drivers_matches_direct_evaluation(two_driver_run):
    """PIMD NVT, batches of 8, two drivers (:func:`two_driver_run`): for every bead and step,
    i-PI's forces and bead energies are those of a direct ASE evaluation of the positions
    i-PI sent; ``ase-tcfp32 ipi-server`` says what it corrected."""
    run = two_driver_run
    assert (
        "ase-tcfp32 ipi-server: i-PI " in run["server_log"]
        and run["server_log"].count("Handshaking was successful") == 2
    )
    assert list(run["steps"]) == list(range(STEPS + 1))  # step 0 and every step after
    served = 0
    for code, log in zip(run["codes"], run["logs"]):  # each says at exit what it served
        assert code == 0
        found = re.search(r"tcpet driver: (\d+) requests, (\d+) of them ending in repeated structures", log)
        served += int(found[1]) if found else 0
    assert served >= STEPS + 1  # at least a request per step, some steps split between the drivers
    template = water_box(8, seed=1)
    assert run["pos"].shape == run["for"].shape == (BEADS, STEPS + 1, len(template), 3)
    structures = []
    for positions in run["pos"].reshape(-1, len(template), 3):  # bead-major, as the arrays
        structures.append(template.copy())
        structures[-1].positions = positions
    direct = TCPETCalculator(MODEL, precision="fp32", device="cpu").evaluate(structures)
    for (bead, step), result in zip(np.ndindex(BEADS, STEPS + 1), direct):
        forces = result["forces"]
        assert np.abs(run["for"][bead, step] - forces).max() <= 1e-4 * max(1.0, np.abs(forces).max())
        assert run["potentials"][step, bead] == pytest.approx(result["energy"], abs=1e-4)


def test_a_killed_driver_loses_no_step(run_folder, processes):
    """One of two drivers dies mid-run: i-PI requeues its request, the other finishes the run.
    Plain i-PI's classic message exchange (``consolidate_messages`` false, one structure per
    request): in 3.3.1 the consolidated exchange, which batching needs, survives only with
    ``ase-tcfp32 ipi-server``'s correction (:func:`test_a_batched_run_survives_a_killed_driver`,
    docs/ipi_patch.md)."""
    steps = 12
    ipi = server(processes, run_folder, steps, batch=1, consolidate=False)
    victim = driver(processes, run_folder, "driver-a")
    survivor = driver(processes, run_folder, "driver-b")
    wait_until(lambda: steps_written(run_folder) >= 3, ipi, run_folder / "server.log", 180)  # a few steps done by both
    os.killpg(victim.pid, signal.SIGKILL)
    assert wait(ipi, run_folder, 240, [survivor]) == 0, (run_folder / "server.log").read_text()[-2000:]
    done = np.loadtxt(run_folder / "sim.out", ndmin=2)
    assert list(done[:, 0]) == list(range(steps + 1))
    assert np.all(np.isfinite(done[:, 1:]))


def test_a_server_that_dies_stops_its_driver_with_a_clear_error(run_folder, processes):
    """i-PI killed mid-run: the driver exits saying so (i-PI 3.3.1's own client loop, idle
    when its server dies, reads empty headers forever). The server is stopped first so
    that the driver is usually waiting for its next request when the server goes; a driver
    still computing meets the closed socket when it answers, with the same message."""
    ipi = server(processes, run_folder, steps=1000)
    process = cli_driver(processes, run_folder, "cli-driver")
    wait_until(lambda: steps_written(run_folder) >= 3, process, run_folder / "cli-driver.log")
    os.killpg(ipi.pid, signal.SIGSTOP)
    time.sleep(1.0)
    os.killpg(ipi.pid, signal.SIGKILL)
    assert wait(process, run_folder, 60) != 0
    assert f"the i-PI server at {run_folder}/pet closed the connection" in (run_folder / "cli-driver.log").read_text()


def test_a_connection_closed_without_exit_stops_the_driver(run_folder, processes):
    """A server that accepts the driver and closes the connection without a word: the
    driver reads an empty header and exits saying so (i-PI 3.3.1's own loop would read
    empty headers forever)."""
    import socket

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(run_folder / "pet"))
    listener.listen(1)
    listener.settimeout(120)
    try:
        process = cli_driver(processes, run_folder, "cli-driver")
        connection, _ = listener.accept()
        connection.close()
        assert wait(process, run_folder, 60) != 0
    finally:
        listener.close()
    assert f"the i-PI server at {run_folder}/pet closed the connection" in (run_folder / "cli-driver.log").read_text()


@pytest.mark.parametrize(
    "options,message",
    [
        ({"template": "wrong.xyz"}, "i-PI sent 24 atoms but the template"),
        ({"model": "no-such-model"}, "unknown model 'no-such-model'"),
        ({"precision": "fp64"}, "unknown precision 'fp64'"),
        ({"colour": "blue"}, "unknown tcpet driver option(s) colour"),
    ],
)
def test_bad_input_stops_the_driver_with_a_clear_error(run_folder, processes, options, message):
    ase.io.write(run_folder / "wrong.xyz", water_box(4, seed=1))  # 12 atoms, not 24
    server(processes, run_folder, steps=2)
    if "template" in options:
        options = dict(options, template=str(run_folder / options["template"]))
    process = driver(processes, run_folder, "driver", **options)
    assert wait(process, run_folder, 120) != 0
    assert message in (run_folder / "driver.log").read_text()


def test_driver_options_reach_the_calculator(tmp_path):
    """i-PI passes options as text: the skin becomes a number for the calculator, or a clear
    error (no server needed: the driver checks its options when it is made)."""
    from ase_tcfp32.ipi import TCPETDriver

    ase.io.write(tmp_path / "water.xyz", water_box(8, seed=0))
    options = dict(template=str(tmp_path / "water.xyz"), model=MODEL, precision="fp32", device="cpu")
    assert TCPETDriver(**options, neighbor_skin="0.5").calculators[0]._engine.skins == (0.5, 0.5)
    with pytest.raises(ValueError, match="neighbor_skin is a distance in Å, not 'wide'"):
        TCPETDriver(**options, neighbor_skin="wide")
    with pytest.raises(ValueError, match="neighbor_skin is a distance in Å, 0 or more, not -1.0"):
        TCPETDriver(**options, neighbor_skin="-1")


def test_a_padded_batch_is_answered_from_its_real_structures(tmp_path):
    """i-PI pads a batch sent short of requests with copies of its last structure: the real
    ones are evaluated by the short-batch calculator (the full batches' calculator, and its
    recorded state, untouched), the copies get the last one's answer, and every answer is
    that of a direct evaluation; a full batch goes to the full-batch calculator."""
    from ase_tcfp32.ipi import ENERGY, FORCE, LENGTH, TCPETDriver

    box = water_box(8, seed=0)
    ase.io.write(tmp_path / "water.xyz", box)
    drv = TCPETDriver(template=str(tmp_path / "water.xyz"), model=MODEL, precision="fp32", device="cpu")
    beads = []
    for seed in range(3):
        bead = box.copy()
        bead.rattle(0.05, seed=seed)
        beads.append(bead)
    cells = [b.cell.array.T * LENGTH for b in beads]
    positions = [b.positions * LENGTH for b in beads]
    full = drv.calculators[0]
    answers = drv.compute(cells + cells[-1:] * 2, positions + positions[-1:] * 2)  # 3 real, 2 copies
    assert len(answers) == 5 and full._engine.evaluations == 0 and drv._short[0]._engine.evaluations == 1
    direct = TCPETCalculator(MODEL, precision="fp32", device="cpu")
    for k, answer in enumerate(answers):
        atoms = beads[min(k, 2)].copy()
        atoms.calc = direct
        assert answer[0] == pytest.approx(atoms.get_potential_energy() * ENERGY, abs=1e-4 * ENERGY)
        assert np.abs(answer[1] - atoms.get_forces() * FORCE).max() <= 1e-4 * FORCE
    assert answers[3][0] == answers[2][0] and np.array_equal(answers[4][1], answers[2][1])
    drv.compute(cells, positions)
    assert full._engine.evaluations == 1 and drv._short[0]._engine.evaluations == 1
    assert (drv.requests, drv.padded) == (2, 1)
    atexit.unregister(drv._report)  # its exit report is for driver processes


def test_the_command_line_driver_serves_a_run(run_folder, processes):
    """'ase-tcfp32 ipi-driver' is the same driver with friendlier flags: it serves a short
    run; with no server it gives up after --wait seconds saying so; a template it cannot
    read and a negative --wait stop it with a clear error."""
    ipi = server(processes, run_folder, steps=2)
    driver_process = cli_driver(processes, run_folder, "cli-driver")
    assert wait(ipi, run_folder, 240, [driver_process]) == 0 and driver_process.wait(timeout=30) == 0
    assert len(np.loadtxt(run_folder / "sim.out", ndmin=2)) == 3
    late = cli_driver(processes, run_folder, "cli-late", "--wait", "0.5")  # the run is over: nobody listens
    assert wait(late, run_folder, 120) != 0
    assert f"no i-PI server listening at {run_folder}/pet after 0.5 s" in (run_folder / "cli-late.log").read_text()
    broken = cli_driver(processes, run_folder, "cli-broken", "--template", str(run_folder / "missing.xyz"))
    assert wait(broken, run_folder, 120) != 0
    assert (
        "ase-tcfp32 ipi-driver: the tcpet driver could not read template="
        in (run_folder / "cli-broken.log").read_text()
    )
    negative = cli_driver(processes, run_folder, "cli-negative", "--wait", "-1")
    assert wait(negative, run_folder, 60) != 0
    assert "--wait is a number of seconds, 0 or more, not -1.0" in (run_folder / "cli-negative.log").read_text()


DYING = Path(__file__).parent / "ipi_dying_driver.py"
"""A driver that kills itself mid-request or between requests (see its docstring)."""
U = 2.0**-24
"""FP32's unit roundoff."""


@pytest.mark.parametrize("drivers,batch,when", [(3, 8, "mid-request"), (2, 2, "between-requests")])
def test_a_batched_run_survives_a_killed_driver(run_folder, processes, two_driver_run, drivers, batch, when):
    """``ase-tcfp32 ipi-server`` with several drivers and batches; the first driver to reach
    its second request dies by SIGKILL in it (``mid-request``: i-PI 3.3.1 alone would wait
    forever) or after answering it (``between-requests``). Its request goes to the others:
    every step is written once, and the trajectory is :func:`two_driver_run`'s, to FP32 rounding
    (the drivers evaluate the beads in other batches: 2^7 rounding units of the largest
    value) and the 8 decimals of the files."""
    ipi = server(processes, run_folder, STEPS, batch=batch, beads=BEADS, launcher=CORRECTED)
    dying = (sys.executable, str(DYING), when, "2", str(run_folder / "died"))
    started = [cli_driver(processes, run_folder, f"driver-{k}", launcher=dying) for k in range(drivers)]
    assert wait(ipi, run_folder, 240, started) == 0, (run_folder / "server.log").read_text()[-2000:]
    logs = [(run_folder / f"driver-{k}.log").read_text() for k in range(drivers)]
    assert sum("dying" in log for log in logs) == 1
    assert sorted(process.wait(timeout=30) for process in started) == [-signal.SIGKILL] + [0] * (drivers - 1)
    log = (run_folder / "server.log").read_text()
    assert "ase-tcfp32 ipi-server: i-PI " in log and "died or got unresponsive" in log
    if when == "mid-request":  # the reset that stalls i-PI 3.3.1, read by the corrected method
        assert "its request goes back to the queue (ase-tcfp32 ipi-server's correction)" in log
    run = run_of(run_folder)
    assert list(run["steps"]) == list(range(STEPS + 1)) and run["pos"].shape == two_driver_run["pos"].shape
    printed = 1e-8  # the files' last decimal
    for what in ("pos", "for", "potentials"):  # batches of 2: forces 11 roundings apart, the rest as printed
        scale = np.abs(two_driver_run[what]).max()
        assert np.abs(run[what] - two_driver_run[what]).max() <= 2**7 * U * scale + printed, what


def test_without_the_correction_a_driver_killed_mid_request_stalls_batched_i_pi(run_folder, processes):
    """What ``ase-tcfp32 ipi-server`` corrects, in plain ``i-pi`` of a version it corrects:
    batches of 8, two drivers, the first to reach its second request killed in it. The
    driver's end of the connection is reset (i-PI's GETFORCE stays unread), i-PI's polling
    thread ends on the ConnectionResetError, and no step follows while the server and the
    other driver wait, alive (until the test kills them)."""
    from importlib.metadata import version

    from ase_tcfp32._ipi_server import PATCHED_VERSIONS

    if version("ipi") not in PATCHED_VERSIONS:
        pytest.skip(f"i-PI {version('ipi')} is not a version ase-tcfp32 ipi-server corrects")
    ipi = server(processes, run_folder, STEPS, batch=8, beads=BEADS)
    dying = (sys.executable, str(DYING), "mid-request", "2", str(run_folder / "died"))
    started = [cli_driver(processes, run_folder, f"driver-{k}", launcher=dying) for k in range(2)]
    log = run_folder / "server.log"
    wait_until(lambda: "ConnectionResetError" in log.read_text(), ipi, log)
    assert "Exception in thread poll_pet" in log.read_text()
    stalled = steps_written(run_folder)
    time.sleep(3.0)  # nothing left to write any step
    assert steps_written(run_folder) == stalled < STEPS + 1
    assert ipi.poll() is None and sum(p.poll() is None for p in started) == 1


def header(name: str) -> bytes:
    """An i-PI message header: the name in capitals, 12 bytes."""
    return name.upper().ljust(12).encode()


def test_sigterm_stops_the_driver_between_requests(run_folder, processes):
    """SIGTERM while the driver has a request: it answers it, then closes its connection
    (i-PI reads an orderly end, not a reset) and exits with 128 + 15. A fake server sends
    the request (i-PI's classic exchange: INIT, positions, GETFORCE) before the signal."""
    import socket

    atoms = ase.io.read(run_folder / "water.xyz")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(run_folder / "pet"))
    listener.listen(1)
    listener.settimeout(120)
    try:
        process = cli_driver(processes, run_folder, "cli-driver")
        connection, _ = listener.accept()
        positions = atoms.positions * LENGTH
        connection.sendall(
            header("init")
            + np.int32(0).tobytes()
            + np.int32(2).tobytes()
            + b"{}"
            + header("posdata")
            + np.zeros(18).tobytes()
            + np.int32(len(atoms)).tobytes()
            + positions.tobytes()
            + header("getforce")
        )
        os.kill(process.pid, signal.SIGTERM)
        connection.settimeout(120)
        answer = b""
        while chunk := connection.recv(1 << 16):  # up to the driver's orderly close
            answer += chunk
        assert process.wait(timeout=60) == 128 + signal.SIGTERM
    finally:
        listener.close()
    assert answer[:12] == header("forceready") and len(answer) == 12 + 8 + 4 + 24 * len(atoms) + 72 + 4 + 2
    atoms.pbc, atoms.calc = False, TCPETCalculator(MODEL, precision="fp32", device="cpu")  # a zero cell was sent
    assert np.frombuffer(answer[12:20])[0] == pytest.approx(atoms.get_potential_energy() * ENERGY, abs=1e-4 * ENERGY)
    assert (
        "tcpet driver: stopped by SIGTERM between requests, after 1 requests"
        in (run_folder / "cli-driver.log").read_text()
    )


def test_ipi_server_corrects_known_i_pi_versions_only(monkeypatch, tmp_path):
    """The correction wraps i-PI's two methods for a listed version (once, however often it
    is asked for) and says so; any other version is left as it is, and the line says that
    nothing was applied. A missing input file stops ``ipi-server`` before i-PI starts."""
    from ipi.interfaces.sockets import Driver

    from ase_tcfp32 import _ipi_server, cli

    originals = {name: getattr(Driver, name) for name in _ipi_server.PATCHED_METHODS}
    for name, method in originals.items():
        monkeypatch.setattr(Driver, name, method)  # restored after the test
    monkeypatch.setattr(_ipi_server, "version", lambda package: "9.9.9")
    assert _ipi_server.patch_ipi().startswith("i-PI 9.9.9: no correction applied")
    assert all(getattr(Driver, name) is method for name, method in originals.items())
    monkeypatch.setattr(_ipi_server, "version", lambda package: _ipi_server.PATCHED_VERSIONS[-1])
    for _ in range(2):
        assert "corrected Driver.dispatch_recv and Driver.dispatch_recv_batch" in _ipi_server.patch_ipi()
    assert all(getattr(Driver, name).__wrapped__ is method for name, method in originals.items())
    with pytest.raises(SystemExit, match="ase-tcfp32 ipi-server: no i-PI input file"):
        cli.main(["ipi-server", str(tmp_path / "missing.xml")])
