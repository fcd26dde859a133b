"""An i-PI driver: PET with FP32-accurate tensor-core GEMMs behind an i-PI server.

i-PI integrates the nuclei (path integrals, replica exchange, ...) and sends the force
evaluations over a socket; this driver answers them with :class:`TCPETCalculator`, a whole
batch of structures (i-PI's ``<batch_size>``: the beads of a path integral) in one model
call (:meth:`TCPETCalculator.evaluate`)::

    i-pi-py_driver -m custom -P $(python -c "import ase_tcfp32.ipi as m; print(m.__file__)") \\
        -u -a water -o template=water.xyz,model=pet-mad-s,precision=auto,device=cuda:0
    ase-tcfp32 ipi-driver --unix --address water --template water.xyz --model pet-mad-s

``ase-tcfp32 ipi-driver`` (:func:`serve`) loads the model first, then waits for the server's
socket (``--wait`` seconds), so drivers may be started before i-PI.

Options: ``template`` (a file ASE reads: the atoms' species and order, which i-PI does not
send), ``model`` (uPET name or checkpoint), ``precision``, ``engine``, ``neighbor_skin`` (Å)
and ``device`` (``"cuda:0;cuda:1"`` splits each batch across GPUs, one calculator and one
thread per GPU), as for :class:`TCPETCalculator`. A batch that i-PI pads with copies of its
last structure (sent before enough requests were queued) goes, without its copies, to a
second calculator per device that records no CUDA graphs (:meth:`TCPETDriver.compute`).
``non_conservative`` (``true``, ``forces`` or ``stress``: :func:`non_conservative_option`)
reads the model's direct heads: the direct forcefield of multiple time stepping (:func:`mts_input`).
``uncertainty_threshold`` (eV per atom, or ``none``) is the calculator's: past it, the
driver warns which atoms' LLPR energy uncertainty is above it (default 0.1, as upet).
Units and conventions are i-PI's: atomic units, the cell's lattice vectors as columns, and
the virial ``-dE/dstrain`` (``-stress * volume``) in Hartree.
"""

from __future__ import annotations

__DRIVER_NAME__ = "tcpet"
__DRIVER_CLASS__ = "TCPETDriver"

import atexit
import runpy
import select
import shutil
import signal
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import numpy as np
from ipi.pes.dummy import Dummy_driver
from ipi.utils.units import unit_to_internal

LENGTH, ENERGY, FORCE = (
    unit_to_internal(kind, unit, 1.0)
    for kind, unit in (("length", "angstrom"), ("energy", "electronvolt"), ("force", "ev/ang"))
)
"""i-PI's atomic units per Å, eV and eV/Å (its own constants)."""


PIMD_INPUT = """<simulation verbosity='low' sockets_prefix='{sockets}' safe_stride='100000'>
  <output prefix='{prefix}'>
    <properties stride='1' filename='out'> [ step, time{{picosecond}}, bead_potentials{{electronvolt}} ] </properties>
    <trajectory filename='pos' stride='{trajectory_stride}' format='ase'> positions{{ase}} </trajectory>
    <trajectory filename='for' stride='{trajectory_stride}' format='ase'> forces{{ase}} </trajectory>
    <checkpoint stride='100000'/>
  </output>
  <total_steps>{steps}</total_steps>
  <prng><seed>31415</seed></prng>
  <ffsocket name='pet' mode='unix' pbc='false'>
    <address>{address}</address> <latency>1e-4</latency> <batch_size>{batch_size}</batch_size>
    <consolidate_messages>{consolidate}</consolidate_messages>
  </ffsocket>
  <system>
    <initialize nbeads='{beads}'>
      <file mode='ase'> {structure} </file>
      <velocities mode='thermal' units='kelvin'> {temperature} </velocities>
    </initialize>
    <forces><force forcefield='pet'> </force></forces>
    <motion mode='dynamics'>
      <dynamics mode='nvt'>
        <timestep units='femtosecond'> {timestep_fs} </timestep>
        <thermostat mode='pile_l'><tau units='femtosecond'> 100 </tau></thermostat>
      </dynamics>
    </motion>
    <ensemble><temperature units='kelvin'> {temperature} </temperature></ensemble>
  </system>
</simulation>
"""


def pimd_input(
    structure: str,
    *,
    beads: int,
    steps: int,
    batch_size: int = 1,
    address: str = "pet",
    sockets: str = "/tmp/ipi_",
    prefix: str = "simulation",
    temperature: float = 300.0,
    timestep_fs: float = 0.5,
    trajectory_stride: int = 1,
    consolidate: bool = True,
) -> str:
    """An i-PI input (XML) for path-integral NVT of ``structure`` (a file ASE reads) with
    ``beads`` beads, served over the unix socket ``sockets + address`` in batches of
    ``batch_size`` structures; writes ``prefix.out`` (step, time, each bead's potential in eV)
    and every ``trajectory_stride`` steps each bead's positions and forces (extended XYZ).
    ``consolidate=False`` selects i-PI's classic message exchange (one structure per request),
    the one that survives a driver dying mid-request in plain i-PI 3.3.1; ``ase-tcfp32
    ipi-server`` corrects the consolidated one (docs/ipi_patch.md)."""
    return PIMD_INPUT.format(
        structure=structure,
        beads=beads,
        steps=steps,
        batch_size=batch_size,
        address=address,
        sockets=sockets,
        prefix=prefix,
        temperature=temperature,
        timestep_fs=timestep_fs,
        trajectory_stride=trajectory_stride,
        consolidate=consolidate,
    )


MTS_INPUT = """<simulation verbosity='low' sockets_prefix='{sockets}' safe_stride='100000'>
  <output prefix='{prefix}'>
    <properties stride='1' filename='out'>
      [ step, time{{picosecond}}, conserved{{electronvolt}}, potential{{electronvolt}}, kinetic_md{{electronvolt}} ]
    </properties>
    <trajectory filename='pos' stride='{trajectory_stride}' format='ase'> positions{{ase}} </trajectory>
    <trajectory filename='vel' stride='{trajectory_stride}' format='ase'> velocities{{ase}} </trajectory>
    <checkpoint stride='100000'/>
  </output>
  <total_steps>{steps}</total_steps>
  <prng><seed>{seed}</seed></prng>
  <ffsocket name='direct' mode='unix' pbc='false'>
    <address>{address}-direct</address> <latency>1e-4</latency>
  </ffsocket>
  <ffsocket name='conservative' mode='unix' pbc='false'>
    <address>{address}-conservative</address> <latency>1e-4</latency>
  </ffsocket>
  <system>
    <initialize nbeads='1'>
      <file mode='ase'> {structure} </file>
      <velocities mode='thermal' units='kelvin'> {temperature} </velocities>
    </initialize>
    <forces>
      <force forcefield='conservative'> <mts_weights>[1, 0]</mts_weights> </force>
      <force forcefield='direct'> <mts_weights>[-1, 1]</mts_weights> </force>
    </forces>
    <motion mode='dynamics'>
      <dynamics mode='{mode}'>
        <timestep units='femtosecond'> {outer_fs} </timestep>
        <nmts>[1, {inner_steps}]</nmts>{thermostat}
      </dynamics>
    </motion>
    <ensemble><temperature units='kelvin'> {temperature} </temperature></ensemble>
  </system>
</simulation>
"""


def mts_input(
    structure: str,
    *,
    inner_steps: int,
    steps: int,
    address: str = "pet",
    sockets: str = "/tmp/ipi_",
    prefix: str = "simulation",
    temperature: float = 300.0,
    timestep_fs: float = 0.5,
    thermostat_tau_fs: float | None = None,
    trajectory_stride: int = 1,
    seed: int = 31415,
) -> str:
    """An i-PI input (XML) for multiple time stepping (r-RESPA) of ``structure`` (a file ASE
    reads) with PET's direct forces, what :class:`ase_tcfp32.mts.MTSVelocityVerlet` does in
    ASE: ``inner_steps`` inner steps of ``timestep_fs`` on the direct forces per outer step
    of ``inner_steps * timestep_fs`` (i-PI's ``<timestep>`` is the outer one, its
    ``<nmts>[1, M]</nmts>`` the inner steps per outer step), and the correction
    (conservative minus direct) as half kicks of the outer step around them.

    Two forcefields, each served by a driver over the unix socket ``sockets + address``
    with the suffix ``-direct`` or ``-conservative``: ``direct`` (``ase-tcfp32 ipi-driver
    --non-conservative``: direct forces and stress, a forward pass) with the MTS weights
    ``[-1, 1]`` (minus on the outer level, plus on the inner one) and ``conservative`` (the
    plain driver) with ``[1, 0]``. The potential and virial i-PI reports are the
    conservative ones (the direct forcefield's weights sum to zero). Per outer step:
    ``inner_steps`` direct evaluations, one conservative.

    NVE from velocities drawn at ``temperature`` (K) with i-PI's random seed ``seed``; with
    ``thermostat_tau_fs``, NVT with i-PI's Langevin thermostat of that time constant
    (applied on the outer step, around the slow kicks). Writes ``prefix.out`` (step, time,
    conserved, potential and kinetic energies in eV) and every ``trajectory_stride`` steps
    positions and velocities (extended XYZ, ASE's units)."""
    thermostat = (
        ""
        if thermostat_tau_fs is None
        else f"\n        <thermostat mode='langevin'><tau units='femtosecond'> {thermostat_tau_fs} </tau></thermostat>"
    )
    return MTS_INPUT.format(
        structure=structure,
        inner_steps=inner_steps,
        steps=steps,
        address=address,
        sockets=sockets,
        prefix=prefix,
        temperature=temperature,
        outer_fs=inner_steps * timestep_fs,
        mode="nve" if thermostat_tau_fs is None else "nvt",
        thermostat=thermostat,
        trajectory_stride=trajectory_stride,
        seed=seed,
    )


def non_conservative_option(value: str | bool) -> bool | str:
    """The driver's ``non_conservative`` option (text from i-PI) as
    :class:`TCPETCalculator` takes it: ``true`` (direct forces and stress: one forward pass,
    no backward; what :func:`mts_input`'s direct forcefield needs), ``forces`` (direct forces,
    conservative virial: a backward pass for periodic systems), ``stress``, ``false``."""
    names = {"false": False, "true": True, "forces": "forces", "stress": "stress"}
    key = str(value).lower()
    if key not in names:
        raise ValueError(f"the tcpet driver's non_conservative is true, forces, stress or false, not {value!r}")
    return names[key]


def threshold_option(value: str | float | None) -> float | None:
    """The driver's ``uncertainty_threshold`` option (text from i-PI): eV per atom, or
    ``none`` (no check), as :class:`TCPETCalculator` takes it."""
    if value is None or str(value).lower() == "none":
        return None
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"the tcpet driver's uncertainty_threshold is eV per atom or none, not {value!r}") from None


def driver_script() -> str:
    """i-PI's Python driver launcher, ``i-pi-py_driver``: on the PATH, or next to this Python."""
    return shutil.which("i-pi-py_driver") or str(Path(sys.executable).parent / "i-pi-py_driver")


class _Stopped(Exception):
    """A SIGTERM or SIGINT stopped the driver between requests (its connection closed)."""


class _ClientSocket(socket.socket):
    """i-PI's client socket, except that reading nothing (the server has gone) is an error:
    i-PI 3.3.1's client loop would read empty headers forever, at full CPU; and that once
    :attr:`stop` is set, it closes the connection when it next waits for a message with
    nothing unread, between requests, and raises :class:`_Stopped`."""

    stop: int | None = None
    """The signal that asked the driver to stop (set by :func:`serve`'s handler)."""

    def recv(self, size: int, *flags) -> bytes:  # i-PI's loop reads each message's header with recv
        while not select.select([self], [], [], 0.0 if _ClientSocket.stop else STOP_POLL)[0]:
            if _ClientSocket.stop:
                self.close()
                raise _Stopped()
        data = super().recv(size, *flags)
        if size and not data:
            raise ConnectionResetError("the server closed the connection")
        return data


STOP_POLL = 0.25
"""Seconds between checks for a stop while a driver waits for i-PI's next message."""


def _stop_between_requests(signum: int, frame) -> None:
    """The first SIGTERM or SIGINT lets the request in progress be answered, then closes
    the connection (:class:`_ClientSocket`); a second one acts at once."""
    _ClientSocket.stop = signum
    for other in (signal.SIGTERM, signal.SIGINT):
        signal.signal(other, _HANDLERS[other])
    print(
        f"tcpet driver: {signal.Signals(signum).name}: stopping between requests "
        "(after answering the one in progress; again to stop at once)",
        flush=True,
    )


_HANDLERS: dict = {}
"""SIGTERM's and SIGINT's handlers before :func:`serve` replaced them."""


def serve(
    driver: TCPETDriver,
    address: str,
    *,
    unix: bool = False,
    port: int = 12345,
    sockets_prefix: str = "/tmp/ipi_",
    wait: float = 60.0,
    verbose: bool = False,
) -> None:
    """Answer the i-PI server at ``address`` (a unix socket ``sockets_prefix + address``, or
    a host name and TCP ``port``) with ``driver`` until the server says exit, through i-PI's
    own client loop (``run_driver`` of its ``i-pi-py_driver`` script). A server not
    listening yet is tried again every 0.1 s for ``wait`` seconds, then a clear error: the
    model is loaded before the first try, so drivers started with the server connect
    together as soon as its socket opens. A server that goes away without saying exit
    (stopped, killed, failed) stops the driver with an error that says so. Called from the
    main thread, a SIGTERM or Ctrl-C stops the driver between requests: the request in
    progress is answered, then the connection is closed (within :data:`STOP_POLL` s), so
    i-PI gives the next requests to its other drivers; the exit status is 128 + the
    signal's number. A second one stops it at once."""
    script = driver_script()
    if not Path(script).exists():
        raise SystemExit("i-PI's driver script i-pi-py_driver was not found: pip install 'ase-tcfp32[ipi]'")
    if not wait >= 0:
        raise ValueError(f"wait is a number of seconds, 0 or more, not {wait!r}")
    run_driver = runpy.run_path(script, run_name="i-pi-py_driver")["run_driver"]
    run_driver.__globals__["socket"] = SimpleNamespace(**{**vars(socket), "socket": _ClientSocket})
    where = sockets_prefix + address if unix else f"{address}:{port}"
    print(f"tcpet driver: {driver.calculators[0]!r}; serving i-PI at {where}", flush=True)
    _ClientSocket.stop = None
    if threading.current_thread() is threading.main_thread():
        _HANDLERS.update({s: signal.signal(s, _stop_between_requests) for s in (signal.SIGTERM, signal.SIGINT)})
    try:
        _connect_and_serve(
            run_driver,
            driver,
            where,
            wait,
            unix=unix,
            address=address,
            port=port,
            f_verbose=verbose,
            sockets_prefix=sockets_prefix,
        )
    except _Stopped:
        print(
            f"tcpet driver: stopped by {signal.Signals(_ClientSocket.stop).name} between requests, after "
            f"{driver.requests} requests; its connection to i-PI closed",
            flush=True,
        )
        raise SystemExit(128 + _ClientSocket.stop) from None
    finally:
        for s, handler in _HANDLERS.items():
            signal.signal(s, handler)
        _HANDLERS.clear()


def _connect_and_serve(run_driver, driver: TCPETDriver, where: str, wait: float, **options) -> None:
    """:func:`serve`'s loop: ``run_driver(driver=driver, **options)``, tried again every
    0.1 s for ``wait`` seconds while nobody listens at ``where``."""
    deadline = time.monotonic() + wait
    while True:
        try:
            return run_driver(driver=driver, **options)
        except (FileNotFoundError, ConnectionRefusedError) as error:  # its connect's, before any request
            if driver.requests:
                raise
            if time.monotonic() >= deadline:
                raise SystemExit(
                    f"tcpet driver: no i-PI server listening at {where} after {wait:g} s ({error}); "
                    "start i-pi with this address, or give the driver a longer --wait"
                ) from None
            if _ClientSocket.stop:
                raise _Stopped() from None
            time.sleep(0.1)
        except ConnectionError as error:
            raise SystemExit(
                f"tcpet driver: the i-PI server at {where} closed the connection without saying exit "
                f"({error}): it stopped or failed (its output says why)"
            ) from None


class TCPETDriver(Dummy_driver):
    """i-PI's driver interface around :class:`ase_tcfp32.TCPETCalculator` (see module doc)."""

    def __init__(
        self,
        template: str,
        model: str = "pet-mad-s",
        precision: str = "auto",
        device: str | None = None,
        engine: str = "auto",
        neighbor_skin: str | float | None = None,
        non_conservative: str | bool = False,
        uncertainty_threshold: str | float | None = 0.1,
        *args,
        **kwargs,
    ):
        self.template_file, self.model, self.precision = str(template), str(model), str(precision)
        self.device, self.engine, self.neighbor_skin = device, str(engine), neighbor_skin
        self.non_conservative, self.uncertainty_threshold = non_conservative, uncertainty_threshold
        super().__init__(*args, **kwargs)  # calls check_parameters()

    def check_parameters(self) -> None:
        """Read the template and build one calculator per device: every bad option fails
        here, before i-PI sends anything."""
        import ase.io

        if self.args:
            raise ValueError(f"the tcpet driver takes key=value options only, not {self.args!r}")
        if self.kwargs:
            known = "template, model, precision, device, engine, neighbor_skin, non_conservative, uncertainty_threshold"
            raise ValueError(f"unknown tcpet driver option(s) {', '.join(self.kwargs)}; known: {known}")
        try:
            self.template = ase.io.read(self.template_file)
        except Exception as error:
            raise ValueError(f"the tcpet driver could not read template={self.template_file!r}: {error}") from error
        skin = self.neighbor_skin
        if isinstance(skin, str):  # i-PI passes options as text
            try:
                skin = float(skin)
            except ValueError:
                raise ValueError(f"the tcpet driver's neighbor_skin is a distance in Å, not {skin!r}") from None
        self._devices = (
            [d.strip() for d in str(self.device).split(";")] if self.device not in (None, "", "None") else [None]
        )
        self._skin = skin
        self._non_conservative = non_conservative_option(self.non_conservative)
        self._threshold = threshold_option(self.uncertainty_threshold)
        self.calculators = self._calculators(self.engine, skin, "calculators")
        self.calculators[0].check_atoms(self.template, ["energy", "forces"])
        self._short: list | None = None  # the calculators of batches short of requests, made when one comes
        self.requests, self.padded = 0, 0
        atexit.register(self._report)
        self._pool = ThreadPoolExecutor(len(self._devices)) if len(self._devices) > 1 else None
        self._slots: list = []  # one Atoms per place in a batch, refilled by each request

    def _calculators(self, engine: str, skin: float | None, what: str) -> list:
        """One calculator of the driver's model and precision per device (printed as
        ``what`` with ``verbose``)."""
        from ase_tcfp32.calculator import TCPETCalculator  # absolute: i-PI loads this file by its path

        calculators = [
            TCPETCalculator(
                self.model,
                precision=self.precision,
                device=d,
                engine=engine,
                neighbor_skin=skin,
                non_conservative=self._non_conservative,
                uncertainty_threshold=self._threshold,
            )
            for d in self._devices
        ]
        if self.verbose:
            print(f"tcpet driver: {what}:", *map(repr, calculators), sep="\n  ", flush=True)
        return calculators

    def _structure(self, k: int, cell: np.ndarray, positions: np.ndarray):
        """i-PI's cell (Bohr, vectors as columns) and positions (Bohr) of the ``k``-th
        structure of a request as ASE Atoms (Å): the ``k``-th slot, refilled in place."""
        if len(positions) != len(self.template):
            raise ValueError(
                f"i-PI sent {len(positions)} atoms but the template {self.template_file!r} has {len(self.template)}: "
                "the driver's template must hold the simulation's atoms in i-PI's order"
            )
        while len(self._slots) <= k:
            self._slots.append(self.template.copy())
        atoms = self._slots[k]
        np.divide(positions, LENGTH, out=atoms.positions)
        cell = np.asarray(cell, float).T / LENGTH
        atoms.cell[:] = cell
        atoms.pbc = np.linalg.norm(cell, axis=1) > 0
        return atoms

    def _answer(self, atoms, result: dict) -> tuple:
        """(potential Ha, forces Ha/Bohr [n, 3], virial Ha [3, 3], extras) for i-PI."""
        virial = np.zeros((3, 3))
        if "stress" in result:
            from ase.stress import voigt_6_to_full_3x3_stress

            virial = -voigt_6_to_full_3x3_stress(result["stress"]).T * (atoms.get_volume() * ENERGY)
        return result["energy"] * ENERGY, result["forces"] * FORCE, virial, "{}"

    def compute_structure(self, cell, pos) -> tuple:
        return self.compute([cell], [pos])[0]

    def compute(self, cell, pos):
        """One structure (i-PI's arrays) or a batch (lists of them): one batched model call
        per device, the batch split in contiguous chunks across devices.

        i-PI pads a batch that it sends before enough requests are queued with copies of its
        last structure (in i-PI 3.3.1, about one path-integral step in eight is sent as two
        such batches: docs/scaling.md). The copies are answered with the last real
        structure's results, and the real ones go to the calculators of short batches
        (:meth:`_short_calculators`): their sizes change from batch to batch, so these
        calculators run without CUDA graphs, which a new size would record again, and the
        full batches keep theirs."""
        if not isinstance(cell, list):
            return self.compute([cell], [pos])[0]
        if not isinstance(pos, list) or len(cell) != len(pos):
            raise ValueError("a batch needs lists of cells and positions of the same length")
        self.requests += 1
        real = len(pos)
        while (
            real > 1 and np.array_equal(pos[real - 1], pos[real - 2]) and np.array_equal(cell[real - 1], cell[real - 2])
        ):
            real -= 1  # identical structures have identical results
        structures = [self._structure(k, c, p) for k, (c, p) in enumerate(zip(cell[:real], pos[:real]))]
        self.padded += real < len(pos)
        calculators = self.calculators if real == len(pos) else self._short_calculators()
        chunk = -(-real // len(calculators))
        parts = [structures[k : k + chunk] for k in range(0, real, chunk)]
        if self._pool is None:
            results = calculators[0].evaluate(parts[0])
        else:
            jobs = [self._pool.submit(calc.evaluate, part) for calc, part in zip(calculators, parts)]
            results = [result for job in jobs for result in job.result()]
        answers = [self._answer(atoms, result) for atoms, result in zip(structures, results)]
        return answers + answers[-1:] * (len(pos) - real)

    def _report(self) -> None:
        """At exit: how many requests came, and how many ended in repeated structures."""
        if self.requests:
            print(
                f"tcpet driver: {self.requests} requests, {self.padded} of them ending in repeated structures (i-PI "
                "pads a batch it sends before enough requests are queued; a first step's beads are all alike)",
                flush=True,
            )

    def _short_calculators(self) -> list:
        """One calculator per device for batches with repeated trailing structures: the same
        model and precision, without CUDA graphs (``engine="lean"``, or the metatomic engine
        if the full batches use it) and a 0.5 Å skin unless one was given."""
        if self._short is None:
            from ase_tcfp32._engines import LARGE_SKIN

            engine = "metatomic" if self.calculators[0].engine_used == "metatomic" else "lean"
            skin = LARGE_SKIN if self._skin is None else self._skin
            self._short = self._calculators(engine, skin, "calculators for short batches")
        return self._short
