"""What a long first evaluation is doing, shown once it has lasted :data:`DELAY` seconds.

The first evaluation of a calculator compiles GPU kernels, tunes each layer's GEMM
configuration (once per machine: :mod:`ase_tcfp32._kernels.autotune`), records CUDA graphs
and, with ``compile=True``, runs ``torch.compile``: seconds to minutes on a fresh machine.
While it runs past :data:`DELAY` seconds, standard error says for how long and what is going
on: a status line redrawn in place (tqdm) on a terminal or in Jupyter, plain lines in a log
file (a line per change of work and one at the end, not a redraw every 0.25 s).
``TCPETCalculator(progress=False)`` or ``ASE_TCFP32_PROGRESS=0`` silence it.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Iterator

DELAY = 2.0
"""Seconds before the status line appears (shorter first calls show nothing)."""

_doing: list[str] = []
"""What the running first evaluation is doing now, innermost last (any thread appends)."""


def enabled(value: bool | None) -> bool:
    """``value`` when given, else ``$ASE_TCFP32_PROGRESS`` (default on; ``0`` off)."""
    return value if value is not None else os.environ.get("ASE_TCFP32_PROGRESS", "1") != "0"


@contextlib.contextmanager
def doing(what: str) -> Iterator[None]:
    """Name the work of this block in the status line (tuning, recording, compiling)."""
    _doing.append(what)
    try:
        yield
    finally:
        _doing.remove(what)


def _live() -> bool:
    """Whether standard error shows a status line redrawn in place: a terminal or a
    Jupyter kernel (a log file or a batch job's output gets plain lines instead)."""
    isatty = getattr(sys.stderr, "isatty", None)
    return bool(isatty and isatty()) or "ipykernel" in sys.modules


@contextlib.contextmanager
def shown(label: str, otherwise: str = "compiling GPU kernels on first use") -> Iterator[None]:
    """Show ``label``, the elapsed time and what is being done (``otherwise`` when no
    :func:`doing` block names it), from :data:`DELAY` seconds into the block until its end:
    one line redrawn in place (tqdm) on a terminal or in Jupyter; elsewhere (a log file) a
    line when the work starts or changes and one when it ends."""
    stop = threading.Event()

    def redrawn() -> None:
        from tqdm.auto import tqdm

        with tqdm(desc=label, bar_format="{desc} {elapsed}{postfix}", file=sys.stderr, leave=False) as line:
            while not stop.wait(0.25):
                line.set_postfix_str(_doing[-1] if _doing else otherwise, refresh=True)

    def logged() -> None:
        start, said = time.perf_counter() - DELAY, None
        while True:
            now = _doing[-1] if _doing else otherwise
            if now != said:
                print(f"{label}: {now} ({time.perf_counter() - start:.0f} s)", file=sys.stderr, flush=True)
                said = now
            if stop.wait(0.25):
                break
        print(f"{label}: done in {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)

    def watch() -> None:
        if not stop.wait(DELAY):
            (redrawn if _live() else logged)()

    thread = threading.Thread(target=watch, name="ase-tcfp32 progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
