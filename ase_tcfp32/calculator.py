"""``TCPETCalculator``: an ASE calculator running PET with tensor-core FP32 GEMMs.

Energies, forces and stress come from the metatrain PET module whose Linear layers run in
the chosen precision (:func:`ase_tcfp32._prepare.prepare_model`), evaluated by an engine
(:mod:`ase_tcfp32._engines`: ``engine="auto"``, the default, picks the fastest for the
device and system). The calculator checks input, converts units and conventions to ASE's
and reports what it chose; every evaluation, of one structure or many, is one call of the
engine's ``compute``.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator

import numpy as np
import torch
from ase import Atoms
from ase.calculators.calculator import Calculator, PropertyNotImplementedError, all_changes
from ase.data import chemical_symbols
from ase.stress import full_3x3_to_voigt_6_stress

from . import _consistency, _rotations, _uncertainty, watchdog
from ._engines import DIRECT, PROPERTIES, check_engine, make_engine
from ._heads import FORCE, LLPR, STRESS, Heads
from ._llpr_methods import LLPRMethods
from ._memory import out_of_memory_message
from ._prepare import prepare_model
from ._progress import enabled as show_progress
from ._progress import shown
from .layers import EMULATED
from .models import load_model
from .precision import check_name, ieee_fp32_matmul, resolve_precision, support, triton_build_problem
from .tcmodel import tensor_core

ENSEMBLES = ("forces_ensemble", "stress_ensemble")
"""What :meth:`TCPETCalculator.evaluate` also computes for a model with an LLPR ensemble: of
the energy's gradients, or of the direct heads where the calculator reads them."""


def resolve_device(device: str | torch.device | None) -> torch.device:
    """CUDA when available for ``None``; an explicit device is checked to exist."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"device '{device}' requested, but CUDA is not available")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise RuntimeError(f"device '{device}' requested, but only {torch.cuda.device_count()} GPU(s) exist")
    elif device.type != "cpu":
        raise ValueError(f"unsupported device '{device}': use 'cpu', 'cuda' or 'cuda:N'")
    return device


def _check_emulation(emulate: str, precision: str, device) -> None:
    tensor_core(emulate)  # an unknown GPU name fails here, listing the presets
    if precision not in EMULATED:
        names = ", ".join(map(repr, EMULATED[:-1])) + f" or {EMULATED[-1]!r}"
        raise ValueError(f"emulate={emulate!r} needs precision {names}, not {precision!r}")
    if device is not None and torch.device(device).type != "cpu":
        raise ValueError(f"emulate={emulate!r} runs the tensor-core model on CPU; pass device='cpu' or None")


def _check_dtype(dtype, precision: str, emulate: str | None) -> bool:
    """Whether ``dtype`` (upet's keyword) asks for a float64 model; a clear error for a
    dtype we do not run or a precision that contradicts it."""
    names = {None: False, "float32": False, torch.float32: False, "float64": True, torch.float64: True}
    if dtype not in names:
        raise ValueError(f"dtype is 'float32' or 'float64' (or the torch dtypes), not {dtype!r}")
    if names[dtype] and (precision not in ("auto", "fp32", "fp64") or emulate is not None):
        raise ValueError(
            f"dtype=float64 runs every product in FP64: it cannot be combined with precision={precision!r}"
            + (f" or emulate={emulate!r}" if emulate else "")
        )
    return names[dtype]


class TCPETCalculator(LLPRMethods, Calculator):
    """PET / PET-MAD in ASE with FP32-accurate tensor-core matrix products.

    >>> atoms.calc = TCPETCalculator("pet-mad-s", precision="tf32x3")  # doctest: +SKIP

    The first seven parameters are upet's ``UPETCalculator``'s, with the same meaning
    (docs/upet.md, "Coming from upet"); a keyword neither has is refused (``TypeError``).

    :param model: a uPET name (``"pet-mad-s"``), a metatrain ``.ckpt`` path, or a loaded
        metatrain PET model (modified in place).
    :param version: uPET model version when ``model`` is a name.
    :param dtype: ``"float32"`` (default) or ``"float64"`` (or the torch dtypes): the
        model's floating type. In float64 every product runs in plain FP64 (the reference
        the tensor-core precisions are measured against); ``precision`` is then ``"fp64"``.
    :param checkpoint_path: a metatrain checkpoint to load instead of ``model``.
    :param variants: which output of each quantity to read, as in upet and metatomic-ase:
        ``{"energy": "r2scan"}`` reads ``energy/r2scan`` (and the direct heads in the same
        variant unless given: keys ``"non_conservative_force"``,
        ``"non_conservative_stress"``); ``None`` values mean the default output.
    :param rotational_average_order: average every prediction over rotations of the input
        (a Lebedev grid of this order times ``2 * order + 1`` in-plane angles, with
        inversion: metatomic-ase's quadrature), storing the spread as ``energy_rot_std``,
        ``forces_rot_std``, ``stress_rot_std`` in ``results``. The rotated copies go through
        batched evaluations.
    :param rotational_average_batch_size: rotated copies per batched evaluation (default:
        all at once, or where they would be evaluated in pieces for the GPU's memory
        (``piece_atoms``), the fewest equal batches that fit whole).
    :param non_conservative: ``False`` (default), ``True``, ``"forces"`` or ``"stress"``:
        forces and/or stress from the model's direct heads (one forward pass, no backward;
        PET-MAD >= 1.1), as in upet. They do not conserve energy: see :mod:`ase_tcfp32.mts`
        for molecular dynamics with them.
    :param uncertainty_threshold: as in upet and metatomic-ase: with a model that carries an
        LLPR uncertainty, every energy calculation (``calculate``, :meth:`evaluate`) warns
        when an atom's energy uncertainty exceeds this many eV, naming the atoms (default
        0.1; read in the same forward pass). ``None``: no check. Ignored for other models.
    :param check_consistency: as in upet and metatomic-ase, for debugging: every evaluation
        checks its inputs and outputs (:mod:`ase_tcfp32._consistency`: the neighbor list
        against a fresh search, results finite and of their shapes; metatomic's own checks
        in the metatomic engine) and raises where they are wrong. Slower.
    :param precision: ``"auto"``, ``"fp32"``, ``"tf32"``, ``"tf32x3"``, ``"fp16x3"`` or ``"bf16x9"``
        (see :mod:`ase_tcfp32.precision`).
    :param device: ``"cpu"``, ``"cuda"``, ``"cuda:N"``; default CUDA when available.
    :param emulate: a GPU name (``"A100"``, ``"H100"``, ``"B200"``... see
        :mod:`ase_tcfp32.tcmodel`): run every Linear layer on CPU through the bit-accurate
        model of that GPU's tensor cores (slow; for previews of small systems).
    :param neighbor_skin: Verlet skin in Å of the cached neighbor lists (default: 2 Å, or
        with ``engine="auto"`` 2 Å for systems that replay CUDA graphs and 0.5 Å for the
        others: larger systems, ``low_memory=True``, CPUs).
    :param compile: run PET's tensor code through ``torch.compile`` (dynamic shapes, so
        moving atoms do not recompile; the first call compiles for tens of seconds).
        Fuses elementwise work and cuts kernel launches; the emulated GEMMs stay our
        kernels (a custom op the compiler does not look into).
    :param low_memory: keep only each GNN layer's inputs for the backward pass and
        recompute the rest there (``torch.utils.checkpoint``): much less memory for
        forces on large systems, one extra forward pass of the GNN layers per step.
    :param piece_atoms: evaluate systems of more atoms than this in pieces of this many,
        one GNN layer at a time (:mod:`ase_tcfp32._layerwise`: results equal the whole
        evaluation's to rounding; ~4x the largest system that fits whole, at 1.5-1.8x its
        cost per atom); 0: never. Default: on a GPU, the systems too large to fit whole
        (estimated from measured memory per atom, docs/scaling.md), in pieces sized from
        the GPU's memory.
    :param engine: ``"auto"`` (default: the fastest for the device and system, see
        :func:`ase_tcfp32._engines.choose_engine`; ``repr(calc)`` says what it picked and why),
        ``"metatomic"`` (metatomic-ase's calculator around the model), ``"lean"`` (the
        model on plain tensors: a Verlet list on the device, no per-step host round trips;
        see :mod:`ase_tcfp32._lean`) or ``"graphs"`` (``"lean"`` recorded as a CUDA graph
        per neighbor-table size and replayed; CUDA only). All give the same results to
        FP32 rounding.
    :param progress: show what a first evaluation lasting over 2 s is doing (compiling,
        tuning, recording graphs) on standard error; default ``$ASE_TCFP32_PROGRESS``, else on.
    :param check_accuracy: the accuracy watchdog (:mod:`ase_tcfp32.watchdog`): every N-th
        evaluation, starting with the first, checks sampled rows of every emulated layer
        against FP64 and warns (:class:`ase_tcfp32.PrecisionWarning`) where the emulated
        error exceeds FP32's several times over. Default ``$ASE_TCFP32_CHECK_ACCURACY``,
        else :data:`ase_tcfp32.watchdog.CALCULATOR_EVERY`; 0 turns it off.

    Units: energy eV, forces eV/Å, stress eV/Å³ in Voigt order (xx, yy, zz, yz, xz, xy),
    positive under tension. Stress needs periodicity in all three directions.
    """

    implemented_properties = ["energy", "free_energy", "energies", "forces", "stress"]

    def __init__(
        self,
        model: str | os.PathLike | torch.nn.Module = "pet-mad-s",
        version: str = "latest",
        dtype: str | torch.dtype | None = None,
        checkpoint_path: str | os.PathLike | None = None,
        variants: dict | None = None,
        rotational_average_order: int | None = None,
        rotational_average_batch_size: int | None = None,
        *,
        non_conservative: bool | str = False,
        uncertainty_threshold: float | None = 0.1,
        check_consistency: bool = False,
        precision: str = "auto",
        device: str | torch.device | None = None,
        emulate: str | None = None,
        neighbor_skin: float | None = None,
        compile: bool = False,
        low_memory: bool = False,
        piece_atoms: int | None = None,
        engine: str = "auto",
        check_accuracy: int | None = None,
        progress: bool | None = None,
    ):
        super().__init__()
        float64 = _check_dtype(dtype, precision, emulate)
        if non_conservative not in (False, True, "forces", "stress"):
            raise ValueError(f"non_conservative is False, True, 'forces' or 'stress', not {non_conservative!r}")
        if variants is not None and not isinstance(variants, dict):
            raise TypeError(f"variants is a dict such as {{'energy': 'r2scan'}}, not {variants!r}")
        _rotations.check(rotational_average_order, rotational_average_batch_size)
        self.uncertainty_threshold = _uncertainty.check_threshold(uncertainty_threshold)
        if not isinstance(check_consistency, bool):
            raise TypeError(f"check_consistency is True or False, not {check_consistency!r}")
        self.check_consistency = check_consistency
        self.rotational_average_order = rotational_average_order or None  # 0 or None: no averaging, as upet
        self.rotational_average_batch_size = rotational_average_batch_size
        self.non_conservative = non_conservative
        direct = (FORCE,) * (non_conservative in (True, "forces")) + (STRESS,) * (non_conservative in (True, "stress"))
        if checkpoint_path is not None:
            model = checkpoint_path
        check_name(precision)
        self.progress = show_progress(progress)
        self._evaluations = 0
        number = isinstance(neighbor_skin, (int, float)) and not isinstance(neighbor_skin, bool)
        if neighbor_skin is not None and not (number and 0 <= neighbor_skin < np.inf):
            raise ValueError(f"neighbor_skin is a distance in Å, 0 or more, not {neighbor_skin!r}")
        if float64:
            self.device, self.precision, self.backend = resolve_device(device), "fp64", "torch (float64)"
            check_accuracy = 0  # nothing emulated to watch
        elif emulate is None:
            self.device = resolve_device(device)
            self.precision = resolve_precision(precision, self.device)
            self.backend = support(self.precision, self.device).backend
        else:
            _check_emulation(emulate, precision, device)
            self.device, self.precision = torch.device("cpu"), precision
            self.backend = f"tcmodel:{tensor_core(emulate).name}"
        check_engine(engine, self.device, low_memory)
        if piece_atoms is not None and (
            isinstance(piece_atoms, bool) or not isinstance(piece_atoms, int) or piece_atoms < 0
        ):
            raise ValueError(f"piece_atoms is a number of atoms (0: never evaluate in pieces), not {piece_atoms!r}")
        if compile and self.device.type == "cuda" and (problem := triton_build_problem()) is not None:
            raise RuntimeError(f"compile=True needs Triton, which cannot build its GPU launchers here: {problem}")
        self.emulate = emulate
        if self.precision == "tf32" and not check_accuracy:
            check_accuracy = 0  # not FP32-accurate by design: nothing to watch (explicit N > 0 is refused)
        self.check_accuracy = watchdog.check_every(check_accuracy, watchdog.CALCULATOR_EVERY)

        self.pet, wrapper = load_model(model, version)
        self._llpr = LLPR.of(wrapper)  # the energy's uncertainty, where the checkpoint has one
        if float64:
            self.pet = self.pet.double()
        dtype = next(self.pet.parameters()).dtype
        if self.precision not in ("fp32", "fp64") and dtype != torch.float32:
            raise ValueError(f"precision {self.precision!r} needs a float32 model, this one is {dtype}")
        self.heads = heads = Heads(self.pet, variants, direct)  # a missing head or variant fails here, before any work
        self._direct_forces, self._direct_stress = FORCE in direct, STRESS in direct
        ours = float64 is False and prepare_model(
            self.pet,
            self.precision,
            self.device,
            emulate=emulate,
            check_accuracy=self.check_accuracy,
            low_memory=low_memory,
            compile=compile,
        )
        self.attention = "tensor cores, TF32x3 (ase_tcfp32._attention)" if ours else "torch SDPA"
        self.low_memory, self.compiled = low_memory, compile
        self.atomic_types = frozenset(int(t) for t in self.pet.atomic_types)
        self._checked_numbers = np.zeros(0, dtype=int)  # the last atomic numbers found known
        self.cutoff = float(self.pet.cutoff)
        self.engine = engine
        self._engine, self.engine_used, self.engine_reason = make_engine(
            self.pet,
            self.device,
            engine,
            neighbor_skin=neighbor_skin,
            low_memory=low_memory,
            compile=compile,
            check_every=self.check_accuracy,
            packed=ours,
            heads=heads,
            piece_atoms=piece_atoms,
            check_consistency=check_consistency,
            llpr=self._llpr,
        )
        if isinstance(model, torch.nn.Module):
            self.model_name = self.pet.metadata.name or type(model).__name__
        else:
            self.model_name = os.path.basename(os.fspath(model))

    def __repr__(self) -> str:
        flags = (", compile=True" if self.compiled else "") + (", low_memory=True" if self.low_memory else "")
        flags += f", engine={self.engine!r}"
        if self.engine == "auto":
            flags += f" ({self.engine_used}: {self.engine_reason})"
        return (
            f"TCPETCalculator(model={self.model_name!r}, precision={self.precision!r}, "
            f"backend={self.backend!r}, device='{self.device}'{flags})"
        )

    def _repr_html_(self) -> str:
        rows = {
            "model": self.model_name,
            "precision": self.precision,
            "backend": self.backend,
            "device": str(self.device),
            "attention": self.attention,
            "engine": f"{self.engine_used} ({self.engine_reason})",
            "edge rows": "packed" if getattr(self._engine, "packed", False) else "neighbor table",
            "elements": len(self.atomic_types),
            "cutoff": f"{self.cutoff} Å",
        }
        cells = "".join(f"<tr><th style='text-align:left'>{k}</th><td>{v}</td></tr>" for k, v in rows.items())
        return f"<b>TCPETCalculator</b><table>{cells}</table>"

    def warm_up(self, atoms: Atoms) -> float:
        """Evaluate ``atoms`` once (a copy) and return the seconds it took.

        The first evaluation compiles the GPU kernels (and, with ``compile=True``, the
        model), tunes each layer's GEMM configuration on this GPU (:mod:`ase_tcfp32._kernels.autotune`,
        remembered on disk: later runs skip it) and splits the weights; with
        ``engine="graphs"`` it records the step. Call it before timing or running MD so
        that the first step is not the slow one.
        """
        start = time.perf_counter()
        probe = atoms.copy()
        probe.calc = self
        probe.get_forces()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - start

    def check_state(self, atoms: Atoms, tol: float = 1e-15) -> list[str]:
        """What changed since the last calculation: ASE's ``compare_atoms`` answer, from
        cheaper comparisons (:func:`_changes`). ASE's MD drivers ask three times per step;
        its tolerant comparison of every array took 0.23 ms for 17,280 moved atoms on a
        2-core CPU, this one 0.04 ms."""
        if self.atoms is None:
            return all_changes[:]
        return _changes(self.atoms, atoms, tol, set(all_changes) - set(self.ignored_changes))

    def check_atoms(self, atoms: Atoms, properties: list[str]) -> None:
        """Raise a clear error for input the model cannot evaluate."""
        if len(atoms) == 0:
            raise ValueError("cannot evaluate an empty Atoms object")
        if not np.all(np.isfinite(atoms.positions)):
            raise ValueError("atoms.positions contain NaN or infinite values")
        if not np.all(np.isfinite(atoms.cell.array)):
            raise ValueError("atoms.cell contains NaN or infinite values")
        if not np.array_equal(atoms.numbers, self._checked_numbers):  # a set of 17,280 numbers: 0.24 ms
            unknown = sorted(set(atoms.numbers.tolist()) - self.atomic_types)
            if unknown:
                names = ", ".join(chemical_symbols[z] if 0 < z < len(chemical_symbols) else str(z) for z in unknown)
                raise ValueError(f"the model does not know element(s) {names}")
            self._checked_numbers = atoms.numbers.copy()
        if "stress" in properties and not atoms.pbc.all():
            raise PropertyNotImplementedError(
                f"stress needs a system periodic in all three directions (pbc={atoms.pbc.tolist()})"
            )

    def evaluate(self, structures: list[Atoms], properties=PROPERTIES) -> list[dict]:
        """Energies, forces and stresses of many structures in one batched model call.

        ``structures`` may differ in size, cell and periodicity; same-size copies (the
        beads of a path integral, replicas) are the fast case: one evaluation of the whole
        batch keeps a GPU busy where one small structure leaves it idle. Returns, per
        structure, a dict like :attr:`results`: ``energy`` and ``free_energy`` (eV),
        ``energies`` [n] (eV), ``forces`` [n, 3] (eV/Å) and, for 3D-periodic structures,
        ``stress`` (eV/Å³, Voigt order). The same evaluation as one structure's
        ``get_forces()``: a single structure is a batch of one.

        ``properties`` chooses what is computed: ``("energy",)`` runs no backward pass;
        ``"forces"`` and ``"stress"`` follow ``non_conservative``; the direct heads' results
        can also be asked by name, ``"non_conservative_forces"`` and
        ``"non_conservative_stress"``, next to the conservative ones from the same forward
        pass (what :mod:`ase_tcfp32.mts` asks for). With an LLPR ensemble,
        ``"forces_ensemble"`` [n, 3, K] (eV/Å) and ``"stress_ensemble"`` [6, K] (eV/Å³,
        Voigt; 3D-periodic structures) are :meth:`get_forces_ensemble`'s and
        :meth:`get_stress_ensemble`'s in the calculator's regime (the energy ensemble's
        gradients, or the direct heads' ensembles where it reads the heads), and
        ``"non_conservative_forces_ensemble"`` / ``"non_conservative_stress_ensemble"`` the
        direct heads' ensembles by name (not re-centred on conservative forces); none is
        rotationally averaged (not with ``rotational_average_order``).
        ``uncertainty_threshold`` is checked for every structure.

        >>> results = calc.evaluate([atoms.copy() for _ in range(32)])  # doctest: +SKIP
        """
        structures = list(structures)
        known = PROPERTIES + DIRECT + ENSEMBLES + tuple(_uncertainty.DIRECT_ENSEMBLES)
        unknown = sorted(set(properties) - set(known))
        if unknown:
            raise ValueError(f"unknown properties {unknown}: evaluate computes {', '.join(known)}")
        ensembles = [name for name in (*ENSEMBLES, *_uncertainty.DIRECT_ENSEMBLES) if name in properties]
        if ensembles and self.rotational_average_order:
            raise ValueError(f"{', '.join(ensembles)} are not rotationally averaged: use a calculator without it")
        for name in ensembles:
            self._ensemble_regime(name.split("_")[-2], True if name.startswith("non_") else None)
        if not structures:
            return []
        for atoms in structures:
            self.check_atoms(atoms, [p for p in properties if p == "energy" or p == "forces"])
        results = self._checked(structures, properties)
        for result in results:
            for name in ("stress_ensemble", "non_conservative_stress_ensemble"):
                if name in result:
                    result[name] = _uncertainty.voigt(result[name])
        return results

    def _watching(self) -> bool:
        """Whether every evaluation reads the energy uncertainty for ``uncertainty_threshold``."""
        return self._llpr is not None and self.uncertainty_threshold is not None

    def _watched(self, properties) -> tuple:
        """``properties`` plus the energy uncertainty where :meth:`_watching`."""
        return (*properties, "energy_uncertainty") if self._watching() else tuple(properties)

    def _checked(self, structures: list[Atoms], properties, computed: list[dict] | None = None) -> list[dict]:
        """``properties`` of ``structures`` (rotationally averaged where asked), each
        structure's per-atom energy uncertainty checked against ``uncertainty_threshold``, read
        in the same forward pass (averaged: each atom's largest over the rotated copies).
        ``computed``: the engine's results for them already (:meth:`_adopt`)."""
        watch, asked = self._watching(), self._watched(properties)
        if computed is not None:
            results = self._converted(computed, asked)
        elif self.rotational_average_order:
            results = [self._averaged(atoms, asked) for atoms in structures]
        else:
            results = self._compute(structures, asked)
        if watch:
            _uncertainty.warn_above(
                self.uncertainty_threshold, [result.pop("energy_uncertainty") for result in results]
            )
        return results

    def _engine_properties(self, properties, periodic: bool) -> set[str]:
        """What the engine computes for the calculator's ``properties``: energies always;
        ``forces`` and ``stress`` from the direct heads where ``non_conservative`` says so,
        else from one backward pass, which gives a periodic system's stress with its forces
        for free (as metatomic-ase does); a periodic system's direct forces and stress come
        together too (two small heads on the same pass)."""
        passed = {"energies", "energy_features", "energy_uncertainty", *DIRECT, *_uncertainty.DIRECT_ENSEMBLES}
        wanted = {"energy", *(set(properties) & passed)}
        for name, direct, used in (
            ("forces", DIRECT[0], self._direct_forces),
            ("stress", DIRECT[1], self._direct_stress),
        ):
            if name in properties:
                wanted.add(direct if used else name)
            if f"{name}_ensemble" in properties:  # the direct head's, or the energy ensemble's gradients (autograd)
                wanted |= {f"{direct}_ensemble"} if used else {"energy_ensemble", "forces", name}
        if "forces" in wanted and periodic and not self._direct_stress:
            wanted.add("stress")
        direct = {"non_conservative_forces", "non_conservative_stress"}
        if self._direct_forces and self._direct_stress and periodic and direct & wanted:
            wanted |= direct  # both heads read the same features: one pass for ASE's forces then stress
        if "stress" in wanted:
            wanted.add("forces")
        return wanted

    def _compute(self, structures: list[Atoms], properties) -> list[dict]:
        """The engine's results for ``structures`` (checked), in ASE's conventions: the
        direct heads' results under ``forces`` and ``stress`` where the calculator reads them
        (and under their own names where asked by them)."""
        wanted = self._engine_properties(properties, any(atoms.pbc.all() for atoms in structures))
        with self._evaluating(sum(map(len, structures))):
            results = self._engine.compute(structures, wanted)
        if self.check_consistency:
            _consistency.check(self._engine, structures, results)
        return self._converted(results, properties)

    def _converted(self, results: list[dict], properties) -> list[dict]:
        """The engine's ``results`` for ``properties`` in ASE's conventions (:meth:`_compute`)."""
        for result in results:
            for name, direct, used in (
                ("forces", DIRECT[0], self._direct_forces),
                ("stress", DIRECT[1], self._direct_stress),
            ):
                for ours, theirs in ((name, direct), (f"{name}_ensemble", f"{direct}_ensemble")):
                    if theirs in result:  # the direct head's: under our name where read, under its own where asked
                        value = result[theirs] if theirs in properties else result.pop(theirs)
                        if used:
                            result[ours] = value
            result["free_energy"] = result["energy"]
            if "energy_ensemble_forces" in result:  # no net force per member, as upet makes them
                members = result.pop("energy_ensemble_forces")
                if "forces_ensemble" in properties:
                    result["forces_ensemble"] = members - members.mean(0)
            if "energy_ensemble_stress" in result:
                members = result.pop("energy_ensemble_stress")
                if "stress_ensemble" in properties:
                    result["stress_ensemble"] = members  # [3, 3, K]: Voigt for evaluate's callers
            for name in ("stress", DIRECT[1]):
                if name in result:
                    result[name] = full_3x3_to_voigt_6_stress(result[name])
        return results

    def _averaged(self, atoms: Atoms, properties) -> dict:
        """``properties`` of ``atoms`` averaged over rotations (:mod:`ase_tcfp32._rotations`:
        the copies in batched evaluations)."""

        def evaluate(copies):
            return self._compute(copies, properties)

        order, batch_size = self.rotational_average_order, self.rotational_average_batch_size
        pieces = getattr(self._engine, "pieces", None)  # copies that fit whole: no layer computed twice
        return _rotations.evaluate_averaged(evaluate, atoms, order, batch_size, pieces and pieces.above)

    @contextlib.contextmanager
    def _evaluating(self, atoms: int) -> Iterator[None]:
        """Around every evaluation of ``atoms`` atoms: the model's device current, IEEE FP32
        matmuls, the watchdog's checks read once at the end, the progress line of the first
        evaluation and of those in pieces (:mod:`ase_tcfp32._progress`), and an out-of-memory
        error that says what fits."""
        self._evaluations += 1
        first = self._evaluations == 1 and self.progress
        pieces = getattr(self._engine, "pieces", None)
        otherwise = "compiling GPU kernels on first use" if self.device.type == "cuda" else "evaluating"
        if first:
            status = shown(f"ase-tcfp32: first evaluation ({atoms} atoms)", otherwise)
        elif self.progress and pieces is not None and atoms > pieces.above:  # long: seconds per call
            status = shown(f"ase-tcfp32: {atoms:,} atoms in pieces", "evaluating")
        else:
            status = contextlib.nullcontext()
        on_device = torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()
        try:
            with status, on_device, ieee_fp32_matmul(), watchdog.deferred():
                yield
        except (torch.OutOfMemoryError, torch.AcceleratorError) as error:  # a kernel launch may fail for memory too
            if not isinstance(error, torch.OutOfMemoryError) and "out of memory" not in str(error):
                raise
            raise torch.OutOfMemoryError(self._out_of_memory(atoms)) from error

    def _out_of_memory(self, atoms: int) -> str:
        properties = torch.cuda.get_device_properties(self.device)
        return out_of_memory_message(self.pet, atoms, properties.total_memory, properties.name, self.low_memory)

    def calculate(self, atoms=None, properties=("energy",), system_changes=all_changes):
        if atoms is not None:
            self.check_atoms(atoms, list(properties))
        super().calculate(atoms, properties, system_changes)
        self.results = self._checked([self.atoms], properties)[0]

    def _asked_of_engine(self, atoms: Atoms, properties) -> set[str]:
        """What the engine computes when :meth:`calculate` is asked for ``properties`` of
        ``atoms`` (the energy uncertainty included where ``uncertainty_threshold`` reads it):
        what :meth:`_adopt` takes, as multiple time stepping's outer steps on the device
        compute it."""
        return self._engine_properties(self._watched(properties), bool(atoms.pbc.all()))

    def _adopt(self, atoms: Atoms, properties, computed: dict) -> None:
        """The results of :meth:`calculate` for ``properties`` of ``atoms`` from the engine's
        results ``computed`` (of :meth:`_asked_of_engine`, for these atoms: one structure's
        dict as the engine's ``compute`` gives it), without an evaluation: the uncertainty
        checked, the results and atoms kept for ASE's ``get_*`` calls as after
        :meth:`calculate`."""
        super().calculate(atoms, properties, all_changes)
        self.results = self._checked([self.atoms], properties, [computed])[0]


def _changes(old: Atoms, new: Atoms, tol: float, names: set[str]) -> list[str]:
    """ASE's ``compare_atoms(old, new, tol)`` restricted to ``names`` (among ``all_changes``):
    the same answer, each array compared exactly first, and a changed one's first differing
    element checked against the tolerance before all of them (an MD step moves every atom:
    its first difference settles it)."""
    changes = [
        name for name in ("cell", "pbc") if name in names and not _close(getattr(old, name), getattr(new, name), tol)
    ]
    shared = names & set(old.arrays) & set(new.arrays)
    changes += sorted(names & (set(old.arrays) ^ set(new.arrays)))
    return changes + [name for name in sorted(shared) if not _close(old.arrays[name], new.arrays[name], tol)]


def _close(a, b, tol: float) -> bool:
    """``np.allclose(a, b, rtol=tol, atol=tol)`` for arrays of the same shape (False for
    different shapes), as ASE's ``equal`` answers; exact equality and a first difference
    beyond the tolerance answer without comparing every element with it."""
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape:
        return False
    if a.size == 0:
        return True
    differ = a != b
    first = int(np.argmax(differ))  # the first difference (0 where there is none)
    if not differ.flat[first]:
        return True
    x, y = a.flat[first].item(), b.flat[first].item()
    if not abs(x - y) <= tol + tol * abs(y):  # np.isclose's test on Python numbers: ~10x faster for one pair
        return False
    return bool(np.allclose(a, b, rtol=tol, atol=tol))
