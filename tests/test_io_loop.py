"""The I/O loop: one thread for every store's awaited calls, started on demand, retired when idle, new after fork."""

from __future__ import annotations

import asyncio
import contextvars
import os
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest

from membase_strands._io_loop import THREAD_NAME, IOLoop
from tests.support.store_helpers import wait_until

TRACE: contextvars.ContextVar[str] = contextvars.ContextVar("TRACE", default="none")
QUICK = {"idle_seconds": 0.2, "sweep_seconds": 0.05}


def io_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == THREAD_NAME and t.is_alive()]


@pytest.fixture
def io() -> Iterator[IOLoop]:
    """A loop of the test's own that retires quickly; the test waits for its thread to end."""
    before = set(io_threads())
    loop = IOLoop(**QUICK)
    yield loop
    assert wait_until(lambda: not (set(io_threads()) - before), timeout=5.0), "the loop's thread did not retire"


class Pool:
    """A stand-in for a client's connection pool: reports ``open`` connections, records sweeps and retirement."""

    def __init__(self, open_connections: int) -> None:
        self.open = open_connections
        self.sweeps = 0
        self.retired = threading.Event()

    @property
    def open_connections(self) -> int:
        return self.open

    async def sweep(self) -> int:
        self.sweeps += 1
        return self.open

    async def retire(self) -> None:
        self.retired.set()


def test_calls_from_many_threads_run_on_one_thread_with_their_callers_context(io):
    release = threading.Event()

    async def where() -> tuple[int, str, str]:
        await asyncio.sleep(0)
        # Held until every caller has submitted, so all eight run on the same loop (it cannot retire meanwhile).
        await asyncio.get_running_loop().run_in_executor(None, release.wait, 10)
        return threading.get_ident(), threading.current_thread().name, TRACE.get()

    def caller(number: int) -> tuple[int, str, str]:
        TRACE.set(f"caller-{number}")
        return io.submit(where).result(timeout=15)

    results: list[tuple[int, str, str]] = []
    threads = [threading.Thread(target=lambda n=n: results.append(caller(n))) for n in range(8)]
    for thread in threads:
        thread.start()
    assert wait_until(lambda: io._calls == 8, timeout=5.0)
    release.set()
    for thread in threads:
        thread.join(15)

    assert sorted(context for _, _, context in results) == sorted(f"caller-{n}" for n in range(8))
    assert {(ident, name) for ident, name, _ in results} == {(results[0][0], THREAD_NAME)}


def test_an_exception_reaches_the_caller_unchanged(io):
    class Refused(Exception):
        pass

    async def fail() -> None:
        raise Refused("no")

    with pytest.raises(Refused, match="no"):
        io.submit(fail).result(timeout=5)


def test_the_thread_retires_when_idle_and_a_later_call_starts_a_new_loop(io):
    async def answer() -> int:
        return 42

    assert io.submit(answer).result(timeout=5) == 42
    first = io.generation
    assert wait_until(lambda: not io.running, timeout=5.0)

    assert io.submit(answer).result(timeout=5) == 42
    assert io.generation == first + 1


def test_a_running_call_keeps_the_loop_alive_past_the_idle_time(io):
    release = asyncio.Event()
    started = threading.Event()

    async def long_call() -> str:
        started.set()
        await release.wait()
        return "done"

    future = io.submit(long_call)
    assert started.wait(5)
    # Several idle periods pass while the call runs: the loop must not retire under it.
    assert not wait_until(lambda: not io.running, timeout=4 * QUICK["idle_seconds"])
    loop = io._loop
    assert loop is not None
    loop.call_soon_threadsafe(release.set)
    assert future.result(timeout=5) == "done"


def test_a_pool_with_open_connections_is_swept_and_keeps_the_loop_alive_until_it_has_none(io):
    pool = Pool(open_connections=1)

    async def register() -> None:
        io.register_sweep(pool)

    io.submit(register).result(timeout=5)
    assert wait_until(lambda: pool.sweeps >= 4, timeout=5.0)
    assert io.running and not pool.retired.is_set()

    pool.open = 0
    assert pool.retired.wait(5), "the loop retired without retiring its pool"
    assert wait_until(lambda: not io.running, timeout=5.0)


def test_a_pool_that_fails_to_sweep_does_not_stop_the_others(io):
    class Broken(Pool):
        async def sweep(self) -> int:
            raise OSError("gone")

    broken, healthy = Broken(0), Pool(open_connections=1)

    async def register() -> None:
        io.register_sweep(broken)
        io.register_sweep(healthy)

    io.submit(register).result(timeout=5)
    assert wait_until(lambda: healthy.sweeps >= 3, timeout=5.0)
    healthy.open = 0


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no os.fork() on this platform")
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_a_forked_child_runs_calls_on_a_loop_of_its_own(io):
    async def pid() -> int:
        return os.getpid()

    assert io.submit(pid).result(timeout=5) == os.getpid()  # the parent's loop is running at the fork
    child = os.fork()
    if child == 0:  # pragma: no cover - runs in the child, whose exit code is the assertion
        try:
            ok = io.submit(pid).result(timeout=5) == os.getpid()
        except BaseException:
            ok = False
        os._exit(0 if ok else 1)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_the_shared_loop_is_not_started_by_importing_the_package():
    code = "import membase_strands, threading; print(sum(t.name == 'membase-io' for t in threading.enumerate()))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "0"


def test_a_pool_that_connects_again_after_the_loop_retired_is_swept_by_the_next_loop(io):
    pool = Pool(open_connections=1)
    io.watch(pool)
    assert wait_until(lambda: pool.sweeps >= 1, timeout=5.0)
    pool.open = 0
    assert wait_until(lambda: not io.running, timeout=5.0)
    swept_before = pool.sweeps

    pool.open = 1  # it opened a connection again: the same pool registers again
    io.watch(pool)

    assert wait_until(lambda: pool.sweeps > swept_before, timeout=5.0), "the pool was not swept after the retirement"
    assert io.running
    pool.open = 0


def test_the_loop_does_not_retire_while_a_watched_pool_holds_a_connection_it_has_not_swept_yet(io):
    class Unswept(Pool):
        async def sweep(self) -> int:
            self.sweeps += 1
            return 0  # as if the sweep ran just before the connection opened

    pool = Unswept(open_connections=1)
    io.watch(pool)

    # The sweeps say "nothing open", but the pool holds a connection: the loop must not retire under it.
    assert not wait_until(lambda: not io.running, timeout=4 * QUICK["idle_seconds"])
    pool.open = 0


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_loop_that_dies_fails_the_calls_it_held_and_the_next_loop_still_retires(io):
    release = threading.Event()

    async def held() -> str:
        await asyncio.get_running_loop().run_in_executor(None, release.wait, 10)
        return "never"

    async def exits() -> None:
        raise SystemExit  # escapes the loop's run_forever(), as a KeyboardInterrupt would

    stranded = io.submit(held)
    assert wait_until(lambda: io._calls == 1, timeout=5.0)
    io.submit(exits)

    with pytest.raises(RuntimeError, match="loop stopped"):
        stranded.result(timeout=5)
    release.set()

    async def answer() -> int:
        return 42

    assert io.submit(answer).result(timeout=5) == 42  # a new loop, with a clean count
    assert wait_until(lambda: not io.running, timeout=5.0)
