"""Forked processes: which thread forked this one, and trials run in a throwaway fork, so that
what might hang or crash (OpenMP threads after a fork) costs that fork alone.

Imported by ``import pagedrag`` (without torch), so that the fork of any process that imported
pagedrag knows which of its threads is the copy of the one that forked it.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import warnings
from collections.abc import Callable

HUNG = -1  # the exit code reported for a trial killed at its deadline
UNKNOWN = -2  # the trial's end could not be read (SIGCHLD ignored: the child was reaped for us)

_forking_thread: int | None = None  # in a forked process: the ident of the thread that forked it


def _note_fork() -> None:
    global _forking_thread
    _forking_thread = threading.get_ident()


os.register_at_fork(after_in_child=_note_fork)


def on_the_forking_thread() -> bool:
    """Whether this process was forked (by a process that had imported pagedrag) and the
    calling thread is the copy of the thread that forked it."""
    return _forking_thread is not None and _forking_thread == threading.get_ident()


def exit_code_in_a_fork(check: Callable[[], int], timeout_s: float) -> int:
    """check()'s return value (an int, else 1; 1 if it raised) as the exit code of a forked
    copy of this process; HUNG if the copy still ran after ``timeout_s`` (it is killed), or
    UNKNOWN. The copy never returns from this call, and is killed and reaped if this call
    is interrupted."""
    with warnings.catch_warnings():  # Python 3.12 warns of fork() in a process with threads:
        warnings.simplefilter("ignore", DeprecationWarning)  # the trial is what the fork is for
        pid = os.fork()
    if pid == 0:
        code = 1
        try:
            result = check()
            code = result if type(result) is int else 1
        except BaseException:
            pass
        finally:
            os._exit(code)
    reaped = False
    try:
        deadline = time.monotonic() + timeout_s
        while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        reaped = done[0] != 0
        return os.waitstatus_to_exitcode(done[1]) if reaped else HUNG
    except ChildProcessError:
        reaped = True
        return UNKNOWN
    finally:
        if not reaped:
            _kill(pid)


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass
