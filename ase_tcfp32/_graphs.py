"""CUDA-graph capture of one evaluation step, replayed while the shapes stay the same.

Small systems are bound by kernel launches; a recorded step replays all its kernels with one
call and runs no Python. :class:`Graph` records ``step(*inputs)`` once (after two warm-up
calls on a side stream: kernels compiled, weight splits cached, workspaces allocated) and
replays it for new inputs of the same shapes, copied into the recorded ones.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Callable

import torch

_RECORDING = threading.Lock()
"""One graph recorded at a time in the process (calculators on several GPUs in threads)."""


@contextlib.contextmanager
def _no_garbage_collection():
    """Python's cyclic garbage collector off: a collection during a capture can free an old
    calculator's recorded graph, and destroying a graph is a CUDA call that a capture
    forbids. The likely cause of a capture seen failing once on an H200 ("operation not
    permitted when stream is capturing" raised inside a layer, in ``validate all --quick``
    when FIRE's second calculator recorded its step, the first one just dropped); not
    reproduced in two later runs."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class Graph:
    """``step(*inputs)`` recorded on ``device`` for tensors of the shapes of ``inputs``.

    :param step: a function of tensors returning tensors (the recorded outputs, in any
        container, overwritten by every replay).
    :param inputs: example inputs; copies become the graph's input buffers.
    """

    def __init__(self, step: Callable, inputs: tuple, device: torch.device):
        self.inputs = tuple(t.clone() for t in inputs)
        self._sources = inputs  # what the input buffers were last copied from
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up: kernels compiled, weight splits cached, workspaces made
                step(*self.inputs)
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with _RECORDING, _no_garbage_collection():
            # thread-local capture: other threads (a calculator on another GPU) keep working
            with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
                self.outputs = step(*self.inputs)

    def replay(self, *inputs):
        """The recorded outputs for ``inputs`` (same shapes, dtypes and device as recorded).
        An input that is the very tensor the last replay (or the recording) had is not
        copied again: the engine's per-system tensors (atomic numbers, structure indices,
        unit weights) are replaced when they change, never written in place."""
        for static, new, last in zip(self.inputs, inputs, self._sources):
            if new is not last:
                static.copy_(new)
        self._sources = inputs
        self.graph.replay()
        return self.outputs
