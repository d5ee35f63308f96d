"""Run something in a forked copy of this process and read how it ended, so that what might
hang or crash (a thread start after a fork) costs that copy alone."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

HUNG = -1  # the exit code reported for a copy killed at its deadline


def exit_code_in_a_fork(check: Callable[[], int], timeout_s: float) -> int:
    """check()'s return value, as the exit code of a forked copy of this process (1 if it
    raised); HUNG if the copy was still running after ``timeout_s``, when it is killed. The
    copy never returns from this call: it ends at once after check()."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = check()
        finally:
            os._exit(code)
    deadline = time.monotonic() + timeout_s
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    if done[0] == 0:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        return HUNG
    return os.waitstatus_to_exitcode(done[1])
