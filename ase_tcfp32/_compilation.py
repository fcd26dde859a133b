"""``torch.compile`` as the calculator uses it: dynamic shapes, PET's Dynamo options
set only while a compiled function runs (no process-wide change)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from . import _progress as progress

_DYNAMO_OPTIONS = dict(capture_scalar_outputs=True, capture_dynamic_output_shape_ops=True, specialize_int=True)
"""What PET's data-dependent shapes need (metatrain's own torch.compile recipe)."""
_INDUCTOR_OPTIONS = {"triton.coalesce_tiling_analysis": False}
"""torch 2.11's coalescing analysis asserted on PET's dynamic shapes on an H200."""


def compiled(function: Callable) -> Callable:
    """``function`` through ``torch.compile(dynamic=True)``: moving atoms do not recompile."""
    compiled_function = torch.compile(function, dynamic=True, options=_INDUCTOR_OPTIONS)
    name = f"torch.compile of {getattr(function, '__name__', 'the model')} (first call; cached on disk)"

    def call(*args, **kwargs):
        with torch._dynamo.config.patch(**_DYNAMO_OPTIONS), progress.doing(name):  # scoped: no global change
            return compiled_function(*args, **kwargs)

    return call


def compile_backend(backend: torch.nn.Module) -> None:
    """Compile the three tensor-only stages of metatrain's ``PETBackend`` in place."""
    for name in ("preprocess", "calculate_features", "predict"):
        setattr(backend, name, compiled(getattr(backend, name)))
