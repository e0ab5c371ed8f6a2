"""One store per user, each built from that user's own credential, for apps that serve many people.

To make room the pool drops the least recently used store without closing it: whoever holds it (an agent mid-turn, a
running write) keeps using it, and the same user coming back meanwhile gets that same store, never a second one.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

import membase

from ._calls import Call, reset_in_forked_child
from ._gateway import looks_like_path
from ._log import StoreLog
from ._writes import WriteRecord
from .store import MembaseMemoryStore, begin_closing, join_pool

logger = logging.getLogger(__name__)

Credential = str | os.PathLike[str]
"""An API key (a ``str``), or a directory for local Membase (a ``pathlib.Path`` or other path object)."""


class MembaseStorePool:
    """Hands out one :class:`MembaseMemoryStore` per user id, reusing each user's store; thread-safe. Each store has
    connections of its own (no user's request goes out on one that carried another user's); no key is shared."""

    def __init__(
        self, credential_for: Callable[[str], Credential], *, max_stores: int = 1000, **store_options: Any
    ) -> None:
        """An empty pool.

        Args:
            credential_for: A user's Membase API key (a ``str``) or local directory (a ``pathlib.Path``), by user id.
            max_stores: How many users' stores to keep for their next turns (size it to the users active within a
                few minutes); past it the least recently used is dropped, never closed under a running turn.
            **store_options: Options for every user's store (``container``, ``recall_timeout``, ``capture``, ...);
                ``client``, ``api_key`` and ``local`` come from ``credential_for``.

        Raises:
            ValueError: ``max_stores`` is not a positive whole number, a store option is unknown or invalid, or a
                per-user option was given.
        """
        if isinstance(max_stores, bool) or not isinstance(max_stores, int) or max_stores < 1:
            raise ValueError(f"max_stores must be a whole number of at least 1, got {max_stores!r}")
        if not callable(credential_for):
            raise ValueError(f"credential_for must be a function of the user id, got {type(credential_for).__name__}")
        if shared := [option for option in ("client", "api_key", "local") if option in store_options]:
            raise ValueError(f"{', '.join(shared)}: comes from credential_for for each user, not shared by the pool")
        # Every value checked now (a misspelt name too), by the store's own checks, not at every user's first turn.
        MembaseMemoryStore(api_key="membase-pool-option-check", **store_options).close()
        self._credential_for, self._max_stores, self._store_options = credential_for, max_stores, store_options
        self._stores: OrderedDict[str, MembaseMemoryStore] = OrderedDict()  # least recently used first
        # Every store handed out, by user, while it lives: kept, or let go of and still in use.
        self._alive: weakref.WeakValueDictionary[str, MembaseMemoryStore] = weakref.WeakValueDictionary()
        self._totals = StoreLog("pool")  # counts what every store it built counts, as it counts it
        self._writes: weakref.WeakSet[WriteRecord] = weakref.WeakSet()  # of every store built, alive or still writing
        self._closed, self._lock = False, threading.Lock()
        reset_in_forked_child(self)

    def reset_after_fork(self) -> None:
        self._lock = threading.Lock()  # one a parent's thread held would stay held

    def __len__(self) -> int:
        with self._lock:
            return len(self._stores)

    def __repr__(self) -> str:
        return f"MembaseStorePool(stores={len(self)}, max_stores={self._max_stores})"

    def store_for(self, user_id: str) -> MembaseMemoryStore:
        """The store for ``user_id``: the one from before, or a new one from the user's credential.

        Never waits for another user's store: making room only drops a store, it does not close it.

        Raises:
            ValueError: ``user_id`` is blank, or the credential function failed or gave nothing usable (the
                message names the user, never the credential).
            RuntimeError: The pool was closed, or the user's memory cannot be opened in this process (another process
                holds their local directory, or local Membase cannot run here); the message names the user.
        """
        if not isinstance(user_id, str) or not user_id.strip():
            raise ValueError(f"user_id must be a non-blank string, got {user_id!r}")
        if (store := self._keep(user_id, None)) is not None:
            return store
        candidate = self._build(user_id)  # outside the lock: the app's credential function may be slow
        try:
            # Another thread may have built this user's store meanwhile: theirs wins, so there is only one.
            store = self._keep(user_id, candidate)
        finally:
            if store is not candidate:
                candidate.close()  # never handed out, so nothing runs on it and this does not wait
        assert store is not None  # the candidate, or theirs
        return store

    def counters(self) -> dict[str, int]:
        """The sum of the counters of every store the pool built (see :meth:`MembaseMemoryStore.counters`)."""
        return self._totals.snapshot()

    def close(self) -> None:
        """Close every store the pool built that is still alive, side by side, as :meth:`MembaseMemoryStore.close`
        does, and wait for the writes of stores dropped and gone: within about ``close_timeout``; safe to call twice.
        From async code, use :meth:`aclose`."""
        self._begin_closing()()  # the wait runs on this thread: it needs none of its own

    async def aclose(self) -> None:
        """:meth:`close` for async code, without blocking the loop."""
        closing = Call(self._begin_closing(), name="membase-close[pool]", mask=lambda error: error)
        await closing.start().wait(None, owner=False)

    def __enter__(self) -> MembaseStorePool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    async def __aenter__(self) -> MembaseStorePool:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def _begin_closing(self) -> Callable[[], None]:
        """Refuse new stores and begin closing every store handed out that is still alive, side by side; returns
        the wait for them, and for the writes of stores dropped and collected."""
        with self._lock:
            self._closed = True
            alive = list(self._alive.values())  # before dropping the kept ones, which may be their only holder
            self._stores.clear()
            records = set(self._writes)
        started, closings = time.monotonic(), [begin_closing(store) for store in alive]
        gone = records - {writes for _, writes in closings}  # of stores dropped and collected, still writing

        def wait() -> None:
            _warn_failed(closing.wait_blocking(None, owner=False) for closing, _ in closings)
            for writes in gone:
                writes.drain(started + writes.close_timeout)

        return wait

    def _keep(self, user_id: str, built: MembaseMemoryStore | None) -> MembaseMemoryStore | None:
        """The user's store still alive, else ``built``, now the most recently used (``None``: neither)."""
        with self._lock:
            if self._closed:
                raise RuntimeError("MembaseStorePool is closed")
            store = self._alive.get(user_id, built)
            if store is None:
                return None
            self._alive[user_id] = self._stores[user_id] = store
            self._stores.move_to_end(user_id)
            dropped = None
            if len(self._stores) > self._max_stores:
                old_user, dropped = self._stores.popitem(last=False)
                logger.debug("user=<%s> | pool full; dropping the least recently used store", old_user)
        del dropped  # outside the lock; the garbage collector ends the store (its tools hold it: a cycle)
        return store

    def _build(self, user_id: str) -> MembaseMemoryStore:
        try:
            credential = self._credential_for(user_id)
        except Exception as error:
            raise ValueError(f"no Membase credential for user {user_id!r}: the credential function failed") from error
        if isinstance(credential, str) and looks_like_path(credential):
            raise ValueError(
                f"the credential for user {user_id!r} is a str naming a path; for local Membase, return a "
                "pathlib.Path (a str is sent to the hosted API as a key)"
            )
        if not isinstance(credential, os.PathLike) and not (isinstance(credential, str) and credential.strip()):
            raise ValueError(
                f"no Membase credential for user {user_id!r}: the credential function returned "
                f"{type(credential).__name__}, not an API key or a local directory"
            )
        where = {"local": credential} if isinstance(credential, os.PathLike) else {"api_key": credential}
        try:
            store = MembaseMemoryStore(**where, **self._store_options)
        except ValueError as error:  # the key or directory itself (the message never quotes a key)
            raise ValueError(f"the Membase credential for user {user_id!r} cannot be used: {error}") from error
        except (RuntimeError, membase.MembaseError) as error:  # another process holds the directory, or no engine
            raise RuntimeError(f"user {user_id!r} cannot be served in this process: {error}") from error
        writes = join_pool(store, self._totals)
        with self._lock:
            self._writes.add(writes)
        return store


def _warn_failed(outcomes: Iterable[Any]) -> None:
    for outcome in outcomes:
        if outcome is not None and outcome.error is not None:
            logger.warning("reason=<%s> | a store failed to close", type(outcome.error).__name__)
