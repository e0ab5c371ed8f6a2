"""Writes still running when the interpreter exits: a bounded chance to finish, and a line for each that did not.

A write that ran out of its budget goes on in a daemon thread (see ``_writes``), and the interpreter
joins no daemon thread: at exit such a write would just stop, saved or not, with nothing in the logs.
So every write is watched here while it runs, and one ``atexit`` hook (registered once per process,
by its first write) gives the writes still running at exit a grace: each may take up to its store's
``write_timeout`` more, counted from the moment the interpreter starts exiting, all side by side, so
the whole wait is at most the longest ``write_timeout`` of the stores concerned. A write that ends in
that time reports its outcome as any late write does (``_writes``); each one still running after it
is logged at WARNING with its store's name (never its text), so nothing the user trusted is lost
without a line saying so.

Nothing here holds a store: only the futures of running writes, and only until they end. A forked
child starts watching nothing (its parent's writes have no thread in the child, and its exit must
neither wait for them nor report them) and with a fresh lock (a parent thread may have held the old
one at the fork). The hook itself is inherited with the rest of the parent's ``atexit`` state.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from concurrent.futures import Future, wait
from dataclasses import dataclass
from typing import Any

from . import _options

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Watched:
    store_name: str
    grace: float
    parts: int


_lock = threading.Lock()
_running: dict[Future[Any], _Watched] = {}
_hooked = False  # copied into a forked child together with the atexit registration it records
_exiting = False


def watch(future: Future[Any], store_name: str, budget: float | None, parts: int) -> None:
    """Watch a write until ``future`` settles, so that interpreter exit waits for it a while and reports it.

    Args:
        future: Settled by the write's thread once the outcome is recorded (and, if nobody waits for it
            any more, logged).
        store_name: The store's name, for the log lines.
        budget: The store's ``write_timeout``: how long exit waits for this write. ``None``: the wait
            ``close()`` uses then.
        parts: How many messages or facts the write carries, for the log line (never their text).
    """
    global _hooked
    grace = budget if budget is not None else _options.WAIT_WITHOUT_BUDGET
    with _lock:
        if not _hooked:
            # Registered late, after logging's own hook: atexit runs hooks last-in first-out, so this
            # one runs while the log handlers are still there.
            atexit.register(_drain_at_exit)
            _hooked = True
        _running[future] = _Watched(store_name, grace, parts)
    future.add_done_callback(_forget)


def exiting() -> bool:
    """Whether the interpreter is exiting: a write that fails now gets no retry from the manager."""
    return _exiting


def _forget(future: Future[Any]) -> None:
    with _lock:
        _running.pop(future, None)


def _drain_at_exit() -> None:
    """The ``atexit`` hook: wait a bounded time for the writes still running, and report each one that did not end.

    Daemon threads still run while ``atexit`` hooks do, so a write may also start now (an agent on a
    daemon thread's event loop flushing its memory): it is waited for the same way, within the grace
    counted from the start of exit, and reported if it does not end.
    """
    global _exiting
    with _lock:
        _exiting = True
    started = time.monotonic()
    seen: dict[Future[Any], _Watched] = {}
    while True:
        with _lock:
            fresh = {future: watched for future, watched in _running.items() if future not in seen}
        fresh = {future: watched for future, watched in fresh.items() if not future.done()}
        if not fresh:
            break
        seen.update(fresh)
        _announce(fresh)
        try:
            for future, watched in sorted(fresh.items(), key=lambda item: item[1].grace):
                remaining = started + watched.grace - time.monotonic()
                if remaining > 0:
                    wait([future], timeout=remaining)
        except BaseException:
            _report_unfinished(seen)  # the wait was cut short (a second Ctrl-C): every write left gets its line
            raise
        if time.monotonic() >= started + max(watched.grace for watched in seen.values()):
            break  # the grace is over, whatever starts from now on
    with _lock:
        seen.update({future: watched for future, watched in _running.items() if future not in seen})
    _report_unfinished(seen)


def _announce(writes: dict[Future[Any], _Watched]) -> None:
    by_store: dict[str, list[_Watched]] = {}
    for watched in writes.values():
        by_store.setdefault(watched.store_name, []).append(watched)
    for store_name, watched_writes in by_store.items():
        logger.info(
            "store=<%s>, writes=<%d> | the interpreter is exiting; waiting up to %g s for writes still running",
            store_name,
            len(watched_writes),
            max(watched.grace for watched in watched_writes),
        )


def _report_unfinished(writes: dict[Future[Any], _Watched]) -> None:
    for future, watched in writes.items():
        if not future.done():
            logger.warning(
                "store=<%s>, parts=<%d>, reason=<interpreter exiting> | a write still running at exit did not "
                "finish within %g s; it was not confirmed saved",
                watched.store_name,
                watched.parts,
                watched.grace,
            )


def _after_fork_in_child() -> None:
    # Runs in the child's only thread, before anything else: no lock is taken here.
    global _lock, _running, _exiting
    _lock = threading.Lock()
    _running = {}
    _exiting = False


if hasattr(os, "register_at_fork"):  # not on Windows, which has no fork
    os.register_at_fork(after_in_child=_after_fork_in_child)
