"""The CPU thread tuner: it settles on the thread count that runs steps fastest, follows a
machine that turns busy or quiet, keeps its probes rare when they keep losing, and is
what the engine uses by default on CPU (a fixed cpu_threads turns it off)."""

import os
import threading

import pytest
import torch

from pagedrag.worker.cpu_threads import configure_cpu_threads
from pagedrag.worker.fork_trial import exit_code_in_a_fork
from pagedrag.worker.thread_tuner import MAX_PROBE_INTERVAL, ThreadTuner, thread_candidates


class FakeMachine:
    """Seconds a step takes by its thread count; the tuner's clock reads them."""

    def __init__(self, seconds_by_threads: dict[int, float]):
        self.seconds_by_threads = seconds_by_threads
        self.now = 0.0
        self.threads_used: list[int] = []

    def clock(self) -> float:
        return self.now

    def run(self, tuner: ThreadTuner, steps: int, num_tokens: int = 1) -> None:
        for _ in range(steps):
            with tuner.step(num_tokens) as threads:
                self.threads_used.append(threads)
                self.now += self.seconds_by_threads[threads]


def test_candidates_are_one_powers_of_two_and_the_cores():
    assert thread_candidates(2) == [1, 2]
    assert thread_candidates(6) == [1, 2, 4, 6]
    assert thread_candidates(1) == [1]


def test_a_quiet_machine_keeps_all_cores_and_a_busy_one_drops_to_one_thread(monkeypatch):
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    quiet = FakeMachine({1: 0.030, 2: 0.022})
    tuner = ThreadTuner(2, clock=quiet.clock)
    quiet.run(tuner, 200)
    assert tuner.choice(1) == 2
    busy = FakeMachine({1: 0.033, 2: 0.100})  # another process holds a core
    busy.now = quiet.now
    tuner._clock = busy.clock
    busy.run(tuner, 40)
    assert tuner.choice(1) == 1
    assert busy.threads_used.count(2) <= 12  # the slow count runs a few probe steps, no more


def test_probes_that_keep_losing_become_rare(monkeypatch):
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    busy = FakeMachine({1: 0.033, 2: 0.100})
    tuner = ThreadTuner(2, clock=busy.clock)
    busy.run(tuner, 5000)
    later = busy.threads_used[2000:]
    assert later.count(2) / len(later) < 0.01
    assert later.count(2) >= 2  # it still looks, so a machine that turns quiet is noticed
    busy.seconds_by_threads = {1: 0.030, 2: 0.022}
    busy.run(tuner, 2 * MAX_PROBE_INTERVAL)
    assert tuner.choice(1) == 2


def test_a_probe_that_loses_a_little_costs_one_step_not_three(monkeypatch):
    """A busy machine's prefill: two threads lose by 15% (not clearly). Once one thread took
    over (after the start at all cores and its probe), each probe of two threads ends at its
    first losing step: two of the next 12 steps run at two threads (six when a probe ran its
    three steps)."""
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    machine = FakeMachine({1: 0.40, 2: 0.46})
    tuner = ThreadTuner(2, clock=machine.clock)
    machine.run(tuner, 16, num_tokens=1024)
    assert tuner.choice(1024) == 1
    assert machine.threads_used[:4] == [2, 1, 1, 1] and machine.threads_used[4:].count(2) == 2


def test_step_sizes_are_tuned_apart(monkeypatch):
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    machine = FakeMachine({})
    tuner = ThreadTuner(2, clock=machine.clock)
    for _ in range(60):  # decode: one thread wins; prefill of 512 tokens: two threads win
        machine.seconds_by_threads = {1: 0.030, 2: 0.060}
        machine.run(tuner, 1, num_tokens=1)
        machine.seconds_by_threads = {1: 1.0, 2: 0.6}
        machine.run(tuner, 1, num_tokens=512)
    assert (tuner.choice(1), tuner.choice(512)) == (1, 2)


def test_the_tuner_only_runs_by_default_in_a_process_of_its_own():
    before = torch.get_num_threads()
    try:
        assert configure_cpu_threads(1) is None
        assert torch.get_num_threads() == 1
        assert configure_cpu_threads(None, processes=64) is None  # tensor parallel ranks share the cores
        tuned = configure_cpu_threads(None)
        assert tuned is None or tuned.candidates[0] == 1  # None on a one-core machine
    finally:
        torch.set_num_threads(before)


def test_decode_batches_of_different_sizes_do_not_look_like_a_machine_turned_busy(monkeypatch):
    """A decode step's time hardly depends on its rows: steps of 4 to 7 rows each keep their
    own figures, so a losing count stays rare instead of being probed again and again."""
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    machine = FakeMachine({1: 0.033, 2: 0.100})  # busy: one thread wins whatever the rows
    tuner = ThreadTuner(2, clock=machine.clock)
    for step in range(4000):
        machine.run(tuner, 1, num_tokens=4 + step % 4)
    assert machine.threads_used[2000:].count(2) / 2000 < 0.01


def test_the_callers_thread_count_is_kept_across_an_engine_step():
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        with ThreadTuner.caller_threads_kept():
            torch.set_num_threads(1)  # what a step's forward pass may pick
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def _gnu_openmp() -> bool:
    with open("/proc/self/maps") as maps:
        return "libgomp" in maps.read()


@pytest.mark.skipif(not os.path.exists("/proc/self/maps") or not _gnu_openmp(),
                    reason="GNU OpenMP's fork behaviour (torch's Linux CPU build)")
def test_a_fork_of_a_thread_that_ran_openmp_computes_on_one_thread(caplog):
    """gunicorn --preload, Celery prefork: GNU OpenMP's threads never start from the copy of
    the thread that had run them before the fork (the child hung for good loading its engine).
    An engine made on that thread runs on one thread, and says why; one made on another thread
    keeps its threads."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        torch.ones(1 << 20).cos_()  # this thread runs a parallel region, then forks

        def in_the_child() -> int:
            kept = []

            def on_a_new_thread():
                configure_cpu_threads(2)
                torch.ones(1 << 20).cos_()
                kept.append(torch.get_num_threads())

            worker = threading.Thread(target=on_a_new_thread)
            worker.start()
            worker.join()
            if kept != [2] or "OpenMP" in caplog.text:
                return 3
            assert configure_cpu_threads(2) is None and torch.get_num_threads() == 1
            torch.ones(1 << 20).cos_()  # compute works on the forking thread, on one thread
            return 0 if "a trial of 2 OpenMP threads from this thread hung" in caplog.text else 5

        assert exit_code_in_a_fork(in_the_child, timeout_s=120) == 0
    finally:
        torch.set_num_threads(threads)
