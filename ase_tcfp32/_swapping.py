"""Model surgery's tools: metatrain classes given our subclasses in place, and layers
recomputed in the backward pass.

A swap changes a submodule's ``__class__`` to a subclass that overrides some of its methods
(:func:`swap_class`); parameters, buffers and ``state_dict`` keys stay as they are, so a
swapped model still loads and saves like metatrain's. The subclasses are made on first use
(:func:`lazy_subclass`), since importing metatrain takes seconds.
"""

from __future__ import annotations

import functools
import importlib

import torch


class Recomputed(torch.nn.Module):
    """``module`` whose intermediate activations are recomputed during the backward pass
    instead of stored (``torch.utils.checkpoint``, non-reentrant)."""

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.module = module

    def forward(self, *args):
        if not torch.is_grad_enabled():
            return self.module(*args)
        return torch.utils.checkpoint.checkpoint(self.module, *args, use_reentrant=False)


def lazy_subclass(module: str, name: str, base: str, **attributes) -> tuple:
    """``(classes, getattr)`` for the subclass ``name`` of metatrain's class ``base`` (a dotted
    path) with ``attributes``, defined in ``module``. ``classes()`` imports ``base`` and makes
    the subclass on first use (importing metatrain takes seconds, and ``import ase_tcfp32``
    must not), then returns ``(base class, subclass)``; ``getattr`` is ``module``'s
    ``__getattr__``, which finds the subclass by name, so that pickling a swapped model works."""

    @functools.cache
    def classes() -> tuple[type, type]:
        path, _, base_name = base.rpartition(".")
        plain = getattr(importlib.import_module(path), base_name)
        return plain, type(name, (plain,), {"__module__": module, **attributes})

    def module_getattr(attribute: str):
        if attribute == name:
            return classes()[1]
        raise AttributeError(f"module {module!r} has no attribute {attribute!r}")

    return classes, module_getattr


def swap_class(module: torch.nn.Module, plain: type, ours: type, enable: bool, takes=lambda child: True) -> list[str]:
    """Give every submodule of class ``plain`` (or ``ours``) in ``module`` that ``takes``
    accepts the class ``ours``, a subclass that overrides some of its methods (``enable=False``:
    back to ``plain``); return their names. Parameters, buffers and state_dict keys stay as they
    are; a subclass of ``plain`` other than ``ours`` is left alone."""
    changed = []
    for name, child in module.named_modules():
        if type(child) in (plain, ours) and takes(child):
            child.__class__ = ours if enable else plain
            changed.append(name)
    return changed


def recompute_gnn_layers(pet: torch.nn.Module) -> None:
    """Store only each GNN layer's inputs for the forces' backward pass, not its attention
    and feed-forward activations (which dominate memory on large systems); the layer runs
    its forward again during the backward. Results are unchanged. In place."""
    layers = pet.backend.gnn_layers
    for i, layer in enumerate(layers):
        if not isinstance(layer, Recomputed):
            layers[i] = Recomputed(layer)
