"""``ase-tcfp32 ipi-server INPUT.xml [i-PI options]``: i-PI's own ``i-pi`` command, run in
this process, with a correction for the i-PI versions whose batched exchange stops for
good when a driver dies in the middle of a request (docs/ipi_patch.md).

In i-PI 3.3.0 and 3.3.1 the consolidated exchange (``<consolidate_messages>``, on by
default, which ``<batch_size>`` needs) reads a driver's answer on i-PI's polling thread.
A driver that dies while it computes leaves the request's ``GETFORCE`` header unread in
its socket, so its end of the connection is reset, not closed: i-PI's read raises
``ConnectionResetError``, which ``Driver.dispatch_recv`` and ``Driver.dispatch_recv_batch``
do not catch (they catch i-PI's own ``Disconnected``, an orderly close). The polling thread
ends, and the run waits forever for forces that nobody will ask for. The correction treats
a connection error there as the disconnection it is: the request goes back to the queue,
the dead driver is dropped, and the other drivers serve the request.
"""

from __future__ import annotations

import functools
import runpy
import shutil
import sys
from importlib.metadata import version
from pathlib import Path

PATCHED_VERSIONS = ("3.3.0", "3.3.1")
"""The i-PI versions checked to have the bug, and the correction to fix it (by a run
with a driver killed mid-request); any other version runs unchanged."""

PATCHED_METHODS = ("dispatch_recv", "dispatch_recv_batch")
"""The methods of ``ipi.interfaces.sockets.Driver`` that the correction wraps."""


def _disconnect_on_error(receive):
    """``receive`` (``Driver.dispatch_recv`` or ``dispatch_recv_batch``: True when the
    request's answer was read, False when the driver disconnected before it was) that also
    answers False, with the driver marked disconnected and the request untouched, when
    reading raises a connection error (``OSError``, e.g. ``ConnectionResetError``): the
    caller puts the request back on the queue, as for any disconnection. Says so in
    i-PI's log."""
    from ipi.interfaces.sockets import Status
    from ipi.utils.messages import verbosity, warning

    @functools.wraps(receive)
    def dispatch_recv(self, request):
        try:
            return receive(self, request)
        except OSError as error:  # raised by the read of the answer, before the request is changed
            warning(
                f" @SOCKET:   Client {self.peername} failed while its answer was read ({error!r}): its request "
                "goes back to the queue (ase-tcfp32 ipi-server's correction)",
                verbosity.low,
            )
            self.status = Status.Disconnected
            return False

    dispatch_recv.corrected = True
    return dispatch_recv


def patch_ipi() -> str:
    """Correct the installed i-PI in this process if its version is in
    :data:`PATCHED_VERSIONS` (every driver socket of the servers it then makes); returns a
    line that says what was done, or that nothing was."""
    installed = version("ipi")
    if installed not in PATCHED_VERSIONS:
        return (
            f"i-PI {installed}: no correction applied (made for i-PI {', '.join(PATCHED_VERSIONS)}; "
            "docs/ipi_patch.md says how to check whether a driver that dies mid-request stalls a batched run)"
        )
    from ipi.interfaces.sockets import Driver

    for name in PATCHED_METHODS:
        if not getattr(getattr(Driver, name), "corrected", False):  # once per process
            setattr(Driver, name, _disconnect_on_error(getattr(Driver, name)))
    return (
        f"i-PI {installed}: corrected Driver.{' and Driver.'.join(PATCHED_METHODS)}: a driver that dies "
        "mid-request has its request given to the other drivers (docs/ipi_patch.md)"
    )


def server_script() -> str:
    """i-PI's server launcher, ``i-pi``: on the PATH, or next to this Python."""
    return shutil.which("i-pi") or str(Path(sys.executable).parent / "i-pi")


def run(arguments: list[str]) -> None:
    """Correct i-PI (:func:`patch_ipi`), print what was done, then run its ``i-pi`` script
    in this process with ``arguments`` (the input file and i-PI's options), as ``i-pi``
    would; i-PI ends the process when the simulation ends."""
    script = server_script()
    if not Path(script).exists():
        raise SystemExit("i-PI's server script i-pi was not found: pip install 'ase-tcfp32[ipi]'")
    print(f"ase-tcfp32 ipi-server: {patch_ipi()}", flush=True)
    sys.argv = [script, *arguments]
    runpy.run_path(script, run_name="__main__")
