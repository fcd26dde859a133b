"""``ase-tcfp32 ipi-driver`` that kills itself with SIGKILL at a chosen point of a request,
for the tests of a driver that dies under a batched i-PI run (tests/test_ipi.py)::

    python ipi_dying_driver.py {mid-request|between-requests} K MARKER [ipi-driver options]

``mid-request``: in its K-th request's computation, when i-PI's message has been read up
to the ``GETFORCE`` header that follows it, which stays unread: i-PI's next read of the
connection fails with a reset, not with an orderly close. ``between-requests``: once the
K-th request is answered, at the first wait for i-PI's next message with nothing unread.
Of the drivers started with the same MARKER (a file path), the first to get there dies
(it creates the file, and prints ``dying ...`` first); the others serve on.
"""

import os
import select
import signal
import sys

from ase_tcfp32 import cli, ipi


def die_once(marker: str, when: str) -> None:
    """SIGKILL this process, unless another driver has created ``marker`` first."""
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return
    print(f"dying {when}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def main(when: str, at: str, marker: str, *options: str) -> None:
    at = int(at)
    compute, recv = ipi.TCPETDriver.compute, ipi._ClientSocket.recv
    answered = [0]  # requests computed; the answer is sent right after

    def dying_compute(self, cell, pos):
        if when == "mid-request" and self.requests + 1 == at:
            die_once(marker, f"in request {at}")
        result = compute(self, cell, pos)
        answered[0] = self.requests
        return result

    def dying_recv(self, size, *flags):
        if when == "between-requests" and answered[0] >= at and not select.select([self], [], [], 0.0)[0]:
            die_once(marker, f"after request {answered[0]}")
        return recv(self, size, *flags)

    if when not in ("mid-request", "between-requests"):
        raise SystemExit(f"when to die: mid-request or between-requests, not {when!r}")
    ipi.TCPETDriver.compute, ipi._ClientSocket.recv = dying_compute, dying_recv
    cli.main(["ipi-driver", *options])


if __name__ == "__main__":
    main(*sys.argv[1:])
