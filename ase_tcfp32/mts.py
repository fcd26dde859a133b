"""Multiple time stepping (r-RESPA) with PET's direct forces, as ASE dynamics.

The direct (non-conservative) forces of PET-MAD >= 1.1 come from one forward pass, without
the backward pass that the conservative forces (minus the energy's gradient) need; they do
not conserve energy. Multiple time stepping keeps the conservative dynamics and pays for
the conservative forces once per outer step (Tuckerman, Berne and Martyna's r-RESPA, as in
Bigi, Langer and Ceriotti, "The dark side of the forces", 2024):

- fast force: the direct forces ``F_d``, integrated with ``M`` inner steps of ``δt``;
- slow force: the correction ``F_c - F_d`` (conservative minus direct), applied as two
  half kicks of ``M·δt / 2`` around the inner steps.

One outer step from momenta ``p`` and positions ``x``::

    p += (M·δt / 2) (F_c - F_d)                  slow half kick
    M times:  p += (δt / 2) F_d;  move x and p over δt;  p += (δt / 2) F_d
    p += (M·δt / 2) (F_c - F_d)                  slow half kick

where "move" is a drift ``x += δt p / m`` (:class:`MTSVelocityVerlet`), or BAOAB's
drift-thermostat-drift (:class:`MTSLangevin`). The forces after the last inner move are
one evaluation of both kinds (:meth:`TCPETCalculator.evaluate` with ``"forces"`` and
``"non_conservative_forces"``: one forward pass, one backward pass), so an outer step costs
``M - 1`` direct-only evaluations (forward passes) and one of both. With ``M = 1`` this is
velocity Verlet with the conservative forces. The ``M`` inner steps and that evaluation run on
the model's device where the calculator allows it (:mod:`ase_tcfp32._inner_steps`: the host
waits once per outer step, and the calculator keeps the evaluation's results as if it had
made it), else through ASE, one calculator call each.

Conventions (ASE's): ``timestep`` is the inner step ``δt`` in ASE time units; one
:meth:`step` (and one unit of ``run(steps)``, of ``loginterval``, of a trajectory's
interval) is one outer step, so ``dyn.dt`` is the outer step ``M·δt`` and
``dyn.get_time()`` the simulated time. Energies eV, forces eV/Å, momenta amu·Å/(ASE time),
arrays [N, 3]. The potential energy that ``atoms.get_potential_energy()``, the logger and
trajectories report is the conservative model's, at the end of each outer step (the
calculator's cached results: no extra evaluation).
"""

from __future__ import annotations

import functools
import warnings

import numpy as np
import torch
from ase import Atoms, units
from ase.calculators.calculator import all_changes
from ase.md.md import MolecularDynamics

from . import _inner_steps
from ._heads import FORCE
from ._lean import LeanPET
from .calculator import TCPETCalculator

BOTH = ("energy", "forces", "non_conservative_forces")
"""What the outer evaluation asks for: the conservative and the direct forces, one forward pass."""

DIRECT = ("non_conservative_forces",)
"""What an inner evaluation asks for: the direct forces alone, no backward pass."""

ENERGY_DRIFT_WARNING = 0.01
"""eV per atom: how far :class:`MTSVelocityVerlet`'s total energy (the conservative potential
energy plus the kinetic energy) may move from its value at the first step before it warns,
once. 0.01 eV/atom heats a system by ~40 K. With the bundled demo model's direct heads
(192 water atoms from ~300 K, 0.5 fs inner steps) M = 8 crosses it after 0.25 ps (measured);
at the drifts measured over 0.5 ps M = 4 would after ~5 ps and M = 2 after ~35 ps;
velocity Verlet's total energy fluctuates by ~0.5 meV/atom there."""


def check_calculator(calc) -> TCPETCalculator:
    """``calc`` if multiple time stepping can use it: a :class:`TCPETCalculator` whose
    ``forces`` are the conservative ones and whose model has a direct force head; else a
    clear error."""
    if not isinstance(calc, TCPETCalculator):
        raise TypeError(
            "multiple time stepping with direct forces needs atoms.calc to be a TCPETCalculator, "
            f"not {type(calc).__name__}"
        )
    if calc.non_conservative in (True, "forces"):
        raise ValueError(
            f"multiple time stepping needs the conservative forces from atoms.calc, built here with "
            f"non_conservative={calc.non_conservative!r}: build it with non_conservative=False (the direct "
            "forces are read on the side)"
        )
    if FORCE not in calc.heads.heads:
        raise ValueError(
            f"multiple time stepping needs direct forces, and the model {calc.model_name!r} has no direct "
            f"force head (no '{FORCE}' output; PET-MAD has one from version 1.1)"
        )
    return calc


def _check_constraints(atoms: Atoms) -> None:
    """Constraints act on positions and momenta as in ASE's VelocityVerlet; those that add
    a potential or redistribute forces would need the forces adjusted: refused."""
    for constraint in atoms.constraints:
        if hasattr(constraint, "adjust_potential_energy") or hasattr(constraint, "redistribute_forces_md"):
            raise ValueError(f"multiple time stepping does not support the constraint {type(constraint).__name__}")


class _RESPA(MolecularDynamics):
    """The outer step shared by the integrators (module doc); subclasses define the inner
    move of positions and momenta over ``δt``."""

    def __init__(self, atoms: Atoms, timestep: float, inner_steps: int, *, device_inner_steps: bool = True, **kwargs):
        if isinstance(inner_steps, bool) or not isinstance(inner_steps, (int, np.integer)) or inner_steps < 1:
            raise ValueError(
                f"inner_steps is a whole number of inner steps per outer step, 1 or more, not {inner_steps!r}"
            )
        if not timestep > 0:
            raise ValueError(f"timestep is the inner time step, more than 0, not {timestep!r}")
        self._calc = check_calculator(atoms.calc)
        _check_constraints(atoms)
        self.inner_steps = int(inner_steps)
        self.inner_dt = timestep
        self.device_inner_steps = bool(device_inner_steps)
        self.redone_steps = 0
        """Outer steps whose inner steps on the device could not be trusted (an atom moved
        out of the neighbor list's reach) and were redone through ASE."""
        super().__init__(atoms, self.inner_steps * timestep, **kwargs)

    def todict(self) -> dict:
        return {**super().todict(), "inner_steps": self.inner_steps, "inner_timestep": self.inner_dt}

    def _calculator(self) -> TCPETCalculator:
        """``atoms.calc``, checked again if it was replaced since the last step."""
        if self.atoms.calc is not self._calc:
            self._calc = check_calculator(self.atoms.calc)
        return self._calc

    def outer_forces(self) -> tuple[np.ndarray, np.ndarray]:
        """Conservative and direct forces [N, 3] (eV/Å) at the current positions: the
        calculator's cached results when they hold both for these atoms, else one evaluation
        of both whose results the calculator keeps (what ``atoms.get_forces()``,
        ``get_potential_energy()``, the logger and trajectories then read)."""
        calc = self._calculator()
        if calc.check_state(self.atoms) or not all(name in calc.results for name in BOTH):
            calc.calculate(self.atoms, list(BOTH), all_changes)
        return calc.results["forces"], calc.results["non_conservative_forces"]

    def _refresh_properties(self) -> None:
        """After each step (and before the first): both kinds of forces cached for the
        logger, observers and the next step (ASE's base class asks for the forces alone,
        which before the first step would cost an evaluation more)."""
        self.outer_forces()

    def direct_forces(self) -> np.ndarray:
        """The direct forces [N, 3] (eV/Å) at the current positions: one forward pass."""
        return self._calculator().evaluate([self.atoms], DIRECT)[0]["non_conservative_forces"]

    def _drift(self, p: np.ndarray, dt: float) -> np.ndarray:
        """Positions moved by ``dt`` at momenta ``p``; with constraints, the momenta that
        the constrained move implies (the first half of RATTLE, as in ASE's VelocityVerlet)."""
        atoms = self.atoms
        r = atoms.get_positions()
        atoms.set_positions(r + dt * p / self.masses)
        if atoms.constraints:
            p = (atoms.get_positions() - r) * self.masses / dt
        return p

    def _move(self, p: np.ndarray) -> np.ndarray:
        """Positions (and momenta, returned) moved over one inner step ``δt``."""
        raise NotImplementedError

    def _on_device(self, p: np.ndarray, direct: np.ndarray) -> bool:
        """Whether the inner steps and the outer evaluation at their end ran on the model's
        device (:mod:`ase_tcfp32._inner_steps`): then the atoms hold the new positions and
        momenta and the calculator the outer evaluation's results. Not with
        ``device_inner_steps=False``, constraints, rotational averaging, the consistency
        checks, an engine that cannot, or an evaluation that could not be trusted."""
        calc, atoms = self._calculator(), self.atoms
        if not self.device_inner_steps or atoms.constraints or calc.rotational_average_order:
            return False
        if calc.check_consistency or not isinstance(calc._engine, LeanPET):
            return False
        outer = calc._asked_of_engine(atoms, BOTH)
        with calc._evaluating(len(atoms)):
            evaluations = _inner_steps.evaluations_on_device(calc._engine, [atoms], outer)
            if evaluations is None:
                return False
            masses = torch.tensor(self.masses, dtype=torch.float64, device=calc.device)
            move = functools.partial(self._device_move, masses=masses, **self._device_terms(calc.device))
            moved = _inner_steps.run(
                evaluations,
                p,
                atoms.get_positions(),
                direct,
                self.inner_dt,
                self.inner_steps,
                move,
                calc.device,
            )
        self.redone_steps += moved is None
        if moved is None:
            return False
        atoms.set_positions(moved[0])
        atoms.set_momenta(moved[1], apply_constraint=False)
        calc._adopt(atoms, BOTH, moved[2])
        return True

    def _device_terms(self, device: torch.device) -> dict:
        """What :meth:`_device_move` needs beside the masses for an outer step's inner moves,
        on ``device`` (keyword arguments; none here)."""
        return {}

    def _device_move(self, x: torch.Tensor, p: torch.Tensor, k: int, masses: torch.Tensor, **terms) -> torch.Tensor:
        """:meth:`_move` on device tensors: positions ``x`` updated in place, momenta returned."""
        raise NotImplementedError

    def step(self) -> None:
        """One outer step: ``inner_steps`` inner steps between two slow half kicks."""
        atoms, dt, steps = self.atoms, self.inner_dt, self.inner_steps
        conservative, direct = self.outer_forces()
        p = atoms.get_momenta() + 0.5 * steps * dt * (conservative - direct)
        moved = self._on_device(p, direct)
        for inner in range(0 if moved else steps):
            p = p + 0.5 * dt * direct
            p = self._move(p)
            atoms.set_momenta(p, apply_constraint=False)  # atoms may migrate with their momenta (as in ASE)
            if inner < steps - 1:
                direct = self.direct_forces()
                atoms.set_momenta(atoms.get_momenta() + 0.5 * dt * direct)
                p = atoms.get_momenta()
        conservative, direct = self.outer_forces()
        atoms.set_momenta(atoms.get_momenta() + 0.5 * dt * direct + 0.5 * steps * dt * (conservative - direct))


class MTSVelocityVerlet(_RESPA):
    """NVE multiple time stepping: r-RESPA with velocity Verlet inner steps on PET's
    direct forces and the conservative correction on the outer step (module doc).

    >>> atoms.calc = TCPETCalculator("pet-mad-s")  # doctest: +SKIP
    >>> dyn = MTSVelocityVerlet(atoms, 0.5 * units.fs, inner_steps=8, logfile="-")  # doctest: +SKIP
    >>> dyn.run(100)  # 100 outer steps: 400 fs, 100 conservative evaluations  # doctest: +SKIP

    :param atoms: atoms whose ``calc`` is a :class:`TCPETCalculator` with conservative
        forces (``non_conservative`` False or ``"stress"``) of a model with a direct force
        head; checked here, before any step.
    :param timestep: the inner time step ``δt`` (ASE time units: ``0.5 * ase.units.fs``).
    :param inner_steps: ``M``, inner steps per outer step; one :meth:`step` advances ``M·δt``.
    :param device_inner_steps: run the inner steps and the outer evaluation at their end on
        the model's device, without ASE and the host in between
        (:mod:`ase_tcfp32._inner_steps`: the same trajectory to rounding), wherever the
        calculator allows it (its default lean engines, no rotational averaging, no
        constraints on the atoms); False: through ASE, one calculator call per inner step.
        ``uncertainty_threshold`` is checked on every outer step either way, and on every
        inner step through ASE.
    :param energy_drift_warning: eV per atom: warn, once, when the total energy (conservative
        potential plus kinetic) has moved by more than this since the first step
        (:data:`ENERGY_DRIFT_WARNING`); None: never. After changing the energy on purpose
        (rescaled momenta, moved atoms), ``dyn.initial_energy = None`` measures from the next step.
    :param kwargs: ASE's ``MolecularDynamics`` options: ``trajectory``, ``logfile``,
        ``loginterval`` (in outer steps), ...
    """

    def __init__(
        self,
        atoms: Atoms,
        timestep: float,
        inner_steps: int = 4,
        *,
        energy_drift_warning: float | None = ENERGY_DRIFT_WARNING,
        **kwargs,
    ):
        if energy_drift_warning is not None and not energy_drift_warning > 0:
            raise ValueError(f"energy_drift_warning is more than 0 eV/atom, or None, not {energy_drift_warning!r}")
        self.energy_drift_warning, self._warned = energy_drift_warning, False
        self.initial_energy: float | None = None
        """The total energy (eV) when the first step began: conservative potential plus kinetic."""
        super().__init__(atoms, timestep, inner_steps, **kwargs)

    def todict(self) -> dict:
        return {**super().todict(), "energy_drift_warning": self.energy_drift_warning}

    def total_energy(self) -> float:
        """The conservative potential energy plus the kinetic energy (eV) at the current
        positions and momenta (the calculator's cached results: no extra evaluation)."""
        self.outer_forces()
        return float(self._calculator().results["energy"]) + self.atoms.get_kinetic_energy()

    def step(self) -> None:
        """One outer step (:class:`_RESPA`), then the energy check: a warning, once, when the
        total energy has moved by more than ``energy_drift_warning`` eV/atom since the first step."""
        if self.initial_energy is None:
            self.initial_energy = self.total_energy()
        super().step()
        if self.energy_drift_warning is None or self._warned:
            return
        moved = (self.total_energy() - self.initial_energy) / len(self.atoms)
        if abs(moved) > self.energy_drift_warning:
            self._warned = True
            outer_fs = self.dt / units.fs
            ps = (self.nsteps + 1) * self.dt / (1000 * units.fs)  # nsteps counts the steps before this one
            warnings.warn(
                f"multiple time stepping does not conserve energy here: the total energy has moved by "
                f"{1000 * moved:+.1f} meV/atom in {ps:.3f} ps (M = "
                f"{self.inner_steps}, outer step {outer_fs:g} fs). The direct forces are too far from the "
                "conservative ones for this outer step: use fewer inner steps, MTSLangevin (a thermostat absorbs "
                "the heat) or velocity Verlet (energy_drift_warning=None silences this)",
                stacklevel=2,
            )

    def _move(self, p: np.ndarray) -> np.ndarray:
        return self._drift(p, self.inner_dt)

    def _device_move(self, x: torch.Tensor, p: torch.Tensor, k: int, masses: torch.Tensor) -> torch.Tensor:
        x.add_(self.inner_dt * p / masses)
        return p


class MTSLangevin(_RESPA):
    """NVT multiple time stepping: r-RESPA whose inner steps are BAOAB Langevin steps on
    PET's direct forces (module doc).

    The inner move is BAOAB's middle (Leimkuhler and Matthews): a drift of ``δt / 2``, the
    exact Ornstein-Uhlenbeck step of the momenta over ``δt``,
    ``p = c p + sqrt((1 - c²) m kT) ξ`` with ``c = exp(-friction·δt)`` and ``ξ`` standard
    normal, and a drift of ``δt / 2``. The thermostat thus acts at every inner step and the
    slow kicks are those of :class:`MTSVelocityVerlet`; with ``inner_steps=1`` this is BAOAB
    on the conservative forces. The center of mass is thermostatted like every other degree
    of freedom (ASE's ``FixCom`` constraint keeps it still: its momentum is removed where
    momenta are set).

    :param atoms: as for :class:`MTSVelocityVerlet`.
    :param timestep: the inner time step ``δt`` (ASE time units).
    :param temperature_K: the thermostat's temperature (K).
    :param friction: the friction ``γ`` in inverse ASE time units (``0.01 / ase.units.fs``:
        a relaxation time of 100 fs).
    :param inner_steps: ``M``, inner steps per outer step.
    :param rng: a numpy random generator (``standard_normal(size=...)``); default a fresh
        ``numpy.random.default_rng()``. On the device (``device_inner_steps``) an outer
        step's numbers are drawn at once, the same stream.
    :param kwargs: ``device_inner_steps`` (as for :class:`MTSVelocityVerlet`) and ASE's
        ``MolecularDynamics`` options.
    """

    def __init__(
        self,
        atoms: Atoms,
        timestep: float,
        temperature_K: float,
        friction: float,
        inner_steps: int = 4,
        *,
        rng=None,
        **kwargs,
    ):
        if not temperature_K >= 0:
            raise ValueError(f"temperature_K is 0 or more, not {temperature_K!r}")
        if not friction >= 0:
            raise ValueError(f"friction is 0 or more (inverse ASE time units), not {friction!r}")
        self.temperature_K, self.friction = temperature_K, friction
        self.rng = np.random.default_rng() if rng is None else rng
        super().__init__(atoms, timestep, inner_steps, **kwargs)

    def todict(self) -> dict:
        return {**super().todict(), "temperature_K": self.temperature_K, "friction": self.friction}

    def _ornstein_uhlenbeck(self) -> tuple[float, np.ndarray]:
        """The momenta's decay ``c`` over one inner step and the noise's spread [N, 1]."""
        decay = np.exp(-self.friction * self.inner_dt)
        return decay, np.sqrt((1 - decay**2) * self.masses * units.kB * self.temperature_K)

    def _noise(self, size: tuple) -> np.ndarray:
        """Standard normal numbers of ``size``, the same on every MPI rank."""
        noise = self.rng.standard_normal(size=size)
        self.comm.broadcast(noise, 0)
        return noise

    def _move(self, p: np.ndarray) -> np.ndarray:
        p = self._drift(p, 0.5 * self.inner_dt)
        decay, spread = self._ornstein_uhlenbeck()
        noise = self._noise(p.shape)
        self.atoms.set_momenta(decay * p + spread * noise)  # constraints act on the new momenta
        return self._drift(self.atoms.get_momenta(), 0.5 * self.inner_dt)

    def _device_terms(self, device: torch.device) -> dict:
        """The outer step's random numbers [M, N, 3] (drawn at once: the same stream) and the
        noise's spread [N, 1], copied to the device once, and the momenta's decay (a float)."""
        noise = self._noise((self.inner_steps, *self.atoms.positions.shape))
        decay, spread = self._ornstein_uhlenbeck()
        return {
            "noise": torch.from_numpy(noise).to(device),
            "spread": torch.from_numpy(spread).to(device),
            "decay": decay,
        }

    def _device_move(
        self,
        x: torch.Tensor,
        p: torch.Tensor,
        k: int,
        masses: torch.Tensor,
        noise: torch.Tensor,
        spread: torch.Tensor,
        decay: float,
    ) -> torch.Tensor:
        half = 0.5 * self.inner_dt
        x.add_(half * p / masses)
        p = decay * p + spread * noise[k]
        x.add_(half * p / masses)
        return p
