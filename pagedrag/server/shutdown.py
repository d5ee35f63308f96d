"""A bounded graceful shutdown for `pagedrag serve`, on top of uvicorn's own.

On the first SIGTERM or SIGINT uvicorn stops listening, closes idle connections and
waits for the requests in flight. DrainingServer bounds that wait: after the grace
period (--shutdown-timeout) it calls ``engine.abort_all()``, which ends every engine
request with finish_reason "abort", so streams still send their last chunk and
[DONE] and whole responses still return. The process then exits 0. A second signal
exits at once, without waiting for anything.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from types import FrameType

import uvicorn
from uvicorn.server import HANDLED_SIGNALS

from pagedrag.entrypoints.async_engine import AsyncLLMEngine

logger = logging.getLogger("pagedrag")

ABORT_REASON = "the server is shutting down"
# After abort_all, how long ended requests get to send their final bytes before uvicorn
# cancels their tasks (which cuts a stream without a finish reason). Only a request that
# abort_all cannot end (a client that stopped reading) should ever need this backstop.
ABORT_DRAIN_S = 5.0
# abort_all runs again this often until uvicorn is done: a request whose body was still
# arriving when it first ran reaches the engine afterwards and must be ended too.
ABORT_REPEAT_S = 0.5
# A second signal this soon after the first is the same stop, sent twice (a service manager
# signals a whole process group, and the router signals its replicas too): not "exit now".
SAME_SIGNAL_S = 1.0


class SignalledServer(uvicorn.Server):
    """uvicorn.Server whose shutdown on SIGTERM or SIGINT exits 0: the first signal begins the
    graceful shutdown, a second one exits at once, and a shutdown begun by a signal is not
    turned back into that signal afterwards (uvicorn re-raises SIGTERM, which would end the
    process with -15 instead of 0)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """Route SIGINT and SIGTERM to handle_exit inside the block (main thread only:
        elsewhere signals cannot be set, and the block runs unchanged).

        The previous handlers are restored on the way out and, unlike uvicorn's, no
        captured signal is raised again.
        """
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in HANDLED_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    _signalled_at = -math.inf  # when the first signal came (monotonic time)

    @contextlib.contextmanager
    def exiting(self) -> Iterator[None]:
        """For the caller's teardown after serving (stopping the engine): any SIGINT or
        SIGTERM inside the block exits at once, as a second signal does while draining."""
        self.should_exit = True
        self._signalled_at = -math.inf
        with self.capture_signals():
            yield

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """First signal: begin the graceful shutdown (uvicorn's main loop sees should_exit
        within 0.1 s). A later one: exit now, unless it came within SAME_SIGNAL_S of the first
        (one stop sent twice: by a service manager to the whole group, and by a parent router)."""
        if self.should_exit and time.monotonic() - self._signalled_at > SAME_SIGNAL_S:
            self._exit_now(sig)
        if not self.should_exit:
            self._signalled_at = time.monotonic()
        self.should_exit = True

    def abandoned(self) -> str:
        """What a signal that exits now abandons, for its log line."""
        return f"{len(self.server_state.tasks)} HTTP requests in flight"

    def _exit_now(self, sig: int) -> None:
        """End the process at once, skipping every cleanup (it is what was asked for).

        The exit status is 128 + the signal's number, as a shell reports a process
        killed by that signal: the requests in flight did not end cleanly.
        """
        logger.warning("%s received while shutting down: exiting now, abandoning %s", signal.Signals(sig).name,
                       self.abandoned())
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(128 + sig)


class DrainingServer(SignalledServer):
    """uvicorn.Server whose graceful shutdown is bounded by ``grace`` seconds.

    Invariants:
    - From the first signal on, no new connection is accepted (uvicorn closes the
      listening sockets before waiting).
    - ``grace`` seconds after shutdown begins, every engine request still in flight is
      aborted with finish_reason "abort"; uvicorn cancels whatever is left only
      ABORT_DRAIN_S later, so shutdown() returns within ``grace + ABORT_DRAIN_S`` (plus
      uvicorn's own 0.1 s pause).
    - A signal after the first one ends the process at once (os._exit), whatever is
      still running; a shutdown begun by a signal exits 0 (SignalledServer).
    """

    def __init__(self, app, engine: AsyncLLMEngine, grace: float, **config):
        if grace < 0:
            raise ValueError(f"the grace period must be >= 0 seconds, not {grace}")
        super().__init__(uvicorn.Config(app, timeout_graceful_shutdown=grace + ABORT_DRAIN_S, **config))
        self.engine = engine
        self.grace = grace

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's shutdown (stop listening, wait for connections), with the requests
        still in flight after the grace period aborted."""
        logger.info("shutting down: %d HTTP requests in flight (%d engine requests); they get %gs to "
                    "finish (--shutdown-timeout), then are aborted; a second signal exits at once",
                    len(self.server_state.tasks), self.engine.num_in_flight, self.grace)
        deadline = asyncio.create_task(self._abort_after_grace())
        try:
            await super().shutdown(sockets)
        finally:
            deadline.cancel()

    async def _abort_after_grace(self) -> None:
        """Sleep out the grace period, then abort what is left until cancelled (when
        uvicorn's wait is over). Aborting nothing is harmless, so it runs even when
        nothing seems in flight: a request may still be on its way to the engine."""
        await asyncio.sleep(self.grace)
        if self.server_state.tasks or self.engine.num_in_flight:
            logger.warning("the %gs grace period ran out: aborting %d HTTP requests still in flight "
                           "(%d engine requests)", self.grace, len(self.server_state.tasks),
                           self.engine.num_in_flight)
        while True:
            try:
                self.engine.abort_all(ABORT_REASON)
            except Exception:  # uvicorn's backstop still cancels the requests ABORT_DRAIN_S later
                logger.exception("aborting the requests in flight failed")
                return
            await asyncio.sleep(ABORT_REPEAT_S)

    def abandoned(self) -> str:
        return f"{self.engine.num_in_flight} engine requests in flight"
