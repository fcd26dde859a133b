"""The metatomic engine: metatomic-ase's ``MetatomicCalculator`` around the exported model.

Neighbor lists are vesin's, through metatomic-ase (with its own Verlet skin), forces and
the strain-derivative stress from autograd in TorchScript, the direct heads' forces and
stress from a second calculator on the same model with ``non_conservative`` set. Slower per
step than the lean engine, but it evaluates every PET the lean engine cannot (long-range
modules, charge/spin conditioning, other additive models or units).
"""

from __future__ import annotations

import numpy as np
import torch
from ase import Atoms
from ase.calculators.calculator import all_changes
from ase.stress import voigt_6_to_full_3x3_stress

from ._heads import FORCE, LLPR, Heads
from ._uncertainty import DIRECT_ENSEMBLES, LLPR_OUTPUTS, Uncertainty
from .models import import_dependencies

DIRECT = {"non_conservative_forces": "forces", "non_conservative_stress": "stress"}
"""The engine's names of the direct heads' results, and metatomic-ase's names for them."""


class MetatomicEngine:
    """Energies, forces and stress of metatrain ``pet`` through metatomic-ase.

    :param pet: a metatrain PET (its Linear layers in any precision).
    :param device: where to evaluate it.
    :param skin: Verlet skin (Å) of metatomic-ase's neighbor lists.
    :param variants: metatomic-ase's ``variants`` (which output of each quantity to read).
    :param llpr: the checkpoint's LLPR (:mod:`ase_tcfp32._uncertainty`); the energy's features
        then come with every single-structure evaluation, as metatomic-ase's additional output.
    :param heads: the heads read (:class:`ase_tcfp32._heads.Heads`), for the direct heads'
        ensembles (default: from ``variants``).
    """

    FEATURES = "mtt::aux::energy_last_layer_features"

    def __init__(
        self,
        pet: torch.nn.Module,
        device: torch.device,
        skin: float,
        variants: dict | None = None,
        llpr: LLPR | None = None,
        check_consistency: bool = False,
        heads: Heads | None = None,
    ):
        import_dependencies(metatomic_ase=True)
        from metatomic.torch import ModelOutput
        from metatomic_ase import MetatomicCalculator

        self.model = model = pet.export().eval()
        if llpr is not None and llpr.direct and heads is None:
            heads = Heads(pet, variants)
        self.uncertainty = Uncertainty(llpr, device, next(pet.parameters()).dtype, pet.backend, heads)
        energy = (variants or {}).get("energy")
        self.energy = "energy" if energy is None else f"energy/{energy}"
        features = {self.FEATURES: ModelOutput(sample_kind="atom")} if llpr is not None else None

        def calculator(non_conservative):
            return MetatomicCalculator(
                model,
                device=str(device),
                do_gradients_with_energy=False,
                variants=variants,
                non_conservative=non_conservative,
                uncertainty_threshold=None,
                neighbor_skin=skin,
                check_consistency=check_consistency,
                additional_outputs=features if non_conservative is False else None,
            )

        self._calculator = calculator
        self.calculator = calculator(False)
        self.model, self.variants, self.skin, self.check_consistency = model, variants, skin, check_consistency
        self._neighbor_lists = None  # vesin's calculators for the systems built here, made when first asked
        self._direct: dict = {}  # non_conservative setting -> its calculator, made when first asked

    def compute(self, structures: list[Atoms], properties, weights: list | None = None) -> list[dict]:
        """Per structure: ``energy`` (eV), ``energies`` [n] (eV; for one structure only when
        asked), ``forces`` [n, 3] (eV/Å) when ``"forces"`` or ``"stress"`` is asked,
        ``stress`` [3, 3] (eV/Å³) of each 3D-periodic structure when ``"stress"`` is asked,
        the direct heads' ``non_conservative_forces`` / ``non_conservative_stress`` and the
        LLPR outputs (:data:`ase_tcfp32._uncertainty.LLPR_OUTPUTS`: the direct heads' ensembles
        from one more model call per structure) when asked. One structure goes
        through metatomic-ase's ``calculate``, which keeps its
        neighbor list between calls; several through one batched model call. With
        ``weights`` ([n] per structure): ``energy``, ``energies``, ``forces`` and ``stress`` of
        the per-atom energies' weighted sum (:meth:`weighted`)."""
        if weights is not None:
            unknown = sorted(set(properties) - {"energy", "energies", "forces", "stress"})
            if unknown:
                raise ValueError(f"with weights, the metatomic engine computes no {', '.join(unknown)}")
            return [self.weighted(atoms, np.asarray(w, float), properties) for atoms, w in zip(structures, weights)]
        self.uncertainty.check(name for name in LLPR_OUTPUTS if name in properties)
        direct = [name for name in DIRECT if name in properties or f"{name}_ensemble" in properties]
        alone = {"energy", "energies", *DIRECT, *(f"{name}_ensemble" for name in DIRECT)}
        one_pass = bool(direct) and set(properties) <= alone  # the energy from the direct heads' pass
        answers = self._direct_run(structures, direct, properties if one_pass else ()) if direct else []
        if one_pass:
            results = [{key: answer[key] for key in ("energy", "energies") if key in answer} for answer in answers]
        else:
            results = self._conservative(structures, properties)
        for result, answer in zip(results, answers):
            result.update({name: answer[DIRECT[name]] for name in direct if DIRECT[name] in answer})
        ensembles = [name for name in DIRECT_ENSEMBLES if name in properties]
        for result, atoms in zip(results, structures) if ensembles else ():
            result.update(self._direct_members(atoms, result, ensembles))
        return results

    def _conservative(self, structures: list[Atoms], properties) -> list[dict]:
        """:meth:`compute`'s results of metatomic-ase's conservative calculator: energy,
        energies, forces and stress as asked, and the energy's LLPR outputs."""
        grad = "forces" in properties or "stress" in properties
        results = self._run(self.calculator, structures, properties, grad, "stress" in properties)
        if "energy_features" in properties or "energy_uncertainty" in properties:
            for result, atoms in zip(results, structures):
                features = self._features(atoms, len(structures) == 1)
                if "energy_features" in properties:
                    result["energy_features"] = features.double().cpu().numpy()
                if "energy_uncertainty" in properties:
                    result["energy_uncertainty"] = self.uncertainty.atoms(features).cpu().numpy()
        if "energy_ensemble" in properties:
            for result, atoms in zip(results, structures):
                members = self._members(atoms)
                result.update(
                    {key: value for key, value in members.items() if "stress" in properties or "forces" in key}
                )
        return results

    def _direct_run(self, structures: list[Atoms], direct: list[str], properties=()) -> list[dict]:
        """The calculator reading the ``direct`` heads (made when first asked) on
        ``structures``: its energy (and ``energies`` where in ``properties``) with the heads'
        forces and stress under metatomic-ase's names: in one model call, all that
        :meth:`compute` needs where nothing else is asked."""
        setting = True if len(direct) == 2 else DIRECT[direct[0]]
        if setting not in self._direct:
            self._direct[setting] = self._calculator(setting)
        wanted = [DIRECT[name] for name in direct] + (["energies"] if "energies" in properties else [])
        return self._run(self._direct[setting], structures, wanted, True, "stress" in wanted)

    def weighted(self, atoms: Atoms, weights: np.ndarray, properties) -> dict:
        """``energy`` = sum of ``weights`` [n] times the per-atom ``energies`` [n] (eV) of
        ``atoms``, and with ``"forces"`` / ``"stress"`` in ``properties`` its negative gradient
        ``forces`` [n, 3] (eV/Å) and strain derivative over the volume, ``stress`` [3, 3] (eV/Å³,
        3D-periodic ``atoms``): the exported model's per-atom energies, differentiated here."""
        from metatomic.torch import ModelEvaluationOptions, ModelOutput, pick_output

        model = self.model
        extra = list(model.requested_inputs(use_new_names=True))
        if extra:
            raise ValueError(f"weighted energies need a model without extra inputs ({extra})")
        key = pick_output("energy", model.capabilities().outputs, (self.variants or {}).get("energy"))
        grad = "forces" in properties or "stress" in properties
        stress = "stress" in properties and bool(atoms.pbc.all())
        system, positions, strain = self._system(atoms, grad, stress)
        with torch.set_grad_enabled(grad):
            options = ModelEvaluationOptions(
                length_unit="angstrom", outputs={key: ModelOutput(unit="eV", sample_kind="atom")}
            )
            block = model([system], options, check_consistency=self.check_consistency)[key].block()
            energies = torch.zeros(len(atoms), dtype=torch.float64, device=positions.device)
            energies = energies.index_add(0, block.samples.column("atom"), block.values[:, 0].double())
            energy = (energies * torch.from_numpy(weights).to(energies)).sum()
            gradients = torch.autograd.grad(energy, [positions, strain] if stress else [positions]) if grad else []
        result = {"energy": float(energy.detach()), "energies": energies.detach().cpu().numpy()}
        if grad:
            result["forces"] = -gradients[0].double().cpu().numpy()
        if stress:
            result["stress"] = gradients[1].double().cpu().numpy() / atoms.get_volume()
        return result

    def _members(self, atoms: Atoms) -> dict:
        """The LLPR energy ensemble's forces [n, 3, K] (eV/Å) and, for a 3D-periodic
        structure, its stress [3, 3, K] (eV/Å³) of ``atoms``: the exported model evaluated
        once for its energy and last-layer features on a :meth:`_system` whose positions and
        strain autograd differentiates by, then :meth:`ase_tcfp32._uncertainty.Uncertainty.jacobians`."""
        from metatomic.torch import ModelEvaluationOptions, ModelOutput

        system, positions, strain = self._system(atoms, True, True)
        outputs = {self.energy: ModelOutput(sample_kind="system"), self.FEATURES: ModelOutput(sample_kind="system")}
        options = ModelEvaluationOptions(length_unit="angstrom", outputs=outputs)
        with torch.enable_grad():
            out = self.model([system], options, check_consistency=self.check_consistency)
            inputs = [positions, strain]
            energy_grads = torch.autograd.grad(out[self.energy].block().values.sum(), inputs, retain_graph=True)
            jacobians = self.uncertainty.jacobians(out[self.FEATURES].block().values, inputs)
        forces = -energy_grads[0].double()[..., None] - self.uncertainty.spread(jacobians[0])
        result = {"energy_ensemble_forces": forces.cpu().numpy()}
        if atoms.pbc.all():
            virial = energy_grads[1].double()[..., None] + self.uncertainty.spread(jacobians[1])
            result["energy_ensemble_stress"] = virial.cpu().numpy() / atoms.get_volume()
        return result

    def _direct_members(self, atoms: Atoms, result: dict, names: list[str]) -> dict:
        """The direct heads' ensembles ``names`` of ``atoms``
        (:meth:`ase_tcfp32._uncertainty.Uncertainty.direct_members`) from their last-layer features
        (one model call) and the direct results in ``result``: the forces' [n, 3, K], net
        force removed per member, and the stress's [3, 3, K] of a 3D-periodic structure."""
        from metatomic.torch import ModelOutput

        heads = {DIRECT_ENSEMBLES[name]: name for name in names if "forces" in name or atoms.pbc.all()}
        keys = {quantity: f"mtt::aux::{self.uncertainty.targets[quantity]}_last_layer_features" for quantity in heads}
        kinds = {quantity: "atom" if quantity == FORCE else "system" for quantity in heads}
        found = self.calculator.run_model(atoms, {keys[q]: ModelOutput(sample_kind=kinds[q]) for q in heads})
        members = {}
        for quantity, name in heads.items():
            features = found[keys[quantity]].block().values.detach()
            prediction = torch.as_tensor(result[name.removesuffix("_ensemble")], device=features.device)
            if quantity == FORCE:  # [n, 3]
                ensemble = self.uncertainty.direct_members(quantity, features, prediction)
                members[name] = (ensemble - ensemble.mean(0)).cpu().numpy()
            else:  # [3, 3], the structure's
                members[name] = self.uncertainty.direct_members(quantity, features, prediction[None])[0].cpu().numpy()
        return members

    def _system(self, atoms: Atoms, grad: bool, stress: bool) -> tuple:
        """``atoms`` as a metatomic ``System`` in the exported model's dtype and on its device,
        with the neighbor lists it asks for (vesin's, registered with autograd), built from
        positions [n, 3] (Å) and a strain [3, 3] (the identity) that autograd differentiates
        by where asked (``grad``: the positions, ``stress``: the strain): ``(system,
        positions, strain)``, as metatomic-ase builds them for forces and stress."""
        from metatomic.torch import System

        from ._neighbors import model_neighbor_lists, uploaded

        if self._neighbor_lists is None:
            self._neighbor_lists = model_neighbor_lists(self.model, self.skin)
        parameter = next(self.model.parameters())
        tensor = {"dtype": parameter.dtype, "device": parameter.device}
        positions = uploaded(atoms.positions, parameter.device, parameter.dtype).requires_grad_(grad)
        strain = torch.eye(3, **tensor, requires_grad=stress)
        cell = uploaded(atoms.cell.array * atoms.pbc[:, None], parameter.device, parameter.dtype)
        types = torch.tensor(atoms.numbers, dtype=torch.int32, device=parameter.device)
        with torch.set_grad_enabled(grad or stress):
            system = System(types, positions @ strain, cell @ strain, torch.tensor(atoms.pbc, device=parameter.device))
            for neighbors in self._neighbor_lists:
                neighbors.add_neighbor_list(system)
        return system, positions, strain

    def _features(self, atoms: Atoms, evaluated: bool) -> torch.Tensor:
        """The energy head's last-layer features [n, F] of ``atoms``: those of the
        evaluation just done where it was ``atoms``' alone (``evaluated``) and computed them,
        else from a model call of their own."""
        from metatomic.torch import ModelOutput

        found = self.calculator.additional_outputs if evaluated else {}
        if self.FEATURES not in found:
            found = self.calculator.run_model(atoms, {self.FEATURES: ModelOutput(sample_kind="atom")})
        return found[self.FEATURES].block().values.detach()

    @staticmethod
    def _run(calculator, structures: list[Atoms], properties, grad: bool, stress: bool) -> list[dict]:
        """``calculator``'s energy, energies, forces (with ``grad``) and stress (with
        ``stress``, for 3D-periodic structures) of ``structures``, stress as [3, 3]."""
        if len(structures) == 1:
            atoms = structures[0]
            wanted = ["energy"] + (["forces"] if grad else []) + (["energies"] if "energies" in properties else [])
            calculator.calculate(atoms, wanted + (["stress"] if stress and atoms.pbc.all() else []), all_changes)
            result = {
                key: value for key, value in calculator.results.items() if key in ("energy", "energies", "forces")
            }
            if stress and "stress" in calculator.results:
                result["stress"] = voigt_6_to_full_3x3_stress(calculator.results["stress"])
            return [result]
        periodic = all(atoms.pbc.all() for atoms in structures)
        out = calculator.compute_energy(structures, compute_forces_and_stresses=grad, per_atom=True)
        results = []
        for k in range(len(structures)):
            result = {"energy": float(out["energy"][k]), "energies": np.asarray(out["energies"][k], float)}
            if grad:
                result["forces"] = np.asarray(out["forces"][k], float)
            if grad and stress and periodic:
                result["stress"] = np.asarray(out["stress"][k], float).reshape(3, 3)
            results.append(result)
        if grad and stress and not periodic:  # metatomic-ase gives stress only for all-periodic batches
            for k, atoms in enumerate(structures):
                if atoms.pbc.all():
                    results[k]["stress"] = MetatomicEngine._run(calculator, [atoms], ("energy",), True, True)[0][
                        "stress"
                    ]
        return results
