"""One store per user, for apps that serve many people.

One Membase key (or local directory) is one person's memory. :class:`MembaseStorePool` hands
out the store for a user id, built from the credential the app's own function returns for that
user, and keeps it for that user's next turns. Stores built from keys send through the process's
shared connection pool for their Membase host (each request with its own user's key), so users share
warm sockets, never credentials.

The bound on kept stores never breaks a turn. When the pool must make room it lets go of the
least recently used store instead of closing it: whoever still holds that store (an agent mid-turn,
a write still running in the background) keeps using it, and it is collected once nothing does
(a local engine is closed then, after its running writes). Until then the pool remembers it weakly,
so the same user coming back gets that same store, never a second one.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, wait
from typing import Any

from . import _background, _options
from .store import MembaseMemoryStore

logger = logging.getLogger(__name__)

Credential = str | os.PathLike[str]
"""An API key (a ``str``), or a directory for local Membase (a ``pathlib.Path`` or other path object)."""

_PER_USER_OPTIONS = ("client", "api_key", "local")


class MembaseStorePool:
    """Hands out one :class:`MembaseMemoryStore` per user id, reusing each user's store and client.

    Safe to use from several threads and event loops at once. It keeps at most ``max_stores``
    stores for reuse; when it must make room, it lets go of the least recently used one. A store it
    let go of is not closed under whoever still uses it: an agent mid-turn keeps its recall and its
    captured writes, and the store is collected once nothing uses it any more. A user's store is
    only ever built from that user's own credential: there is no shared or fallback key.

    Example:
        ```python
        pool = MembaseStorePool(lambda user_id: vault.membase_key(user_id), recall_timeout=5.0)
        agent = Agent(memory_manager=MemoryManager(stores=[pool.store_for(user_id)]))
        ```
    """

    def __init__(
        self, credential_for: Callable[[str], Credential], *, max_stores: int = 1000, **store_options: Any
    ) -> None:
        """Create an empty pool.

        Args:
            credential_for: Returns a user's Membase API key (a ``str``) or local directory (a path
                object such as ``pathlib.Path``) for a user id.
            max_stores: How many users' stores to keep for their next turns. Past it, the least recently
                used store is let go of: a turn still using it keeps its recall and its captured writes,
                and it is collected once nothing uses it. A user whose store was let go of and collected
                gets a new one on their next turn (over the same shared connections; a local directory's
                engine starts again), so size it to the users active within a few minutes. A smaller
                bound costs rebuilt stores, never a turn's memory; more users in flight than
                ``max_stores`` is fine.
            **store_options: Options for every user's store (``container``, ``recall_timeout``,
                ``capture``, ``base_url``, ...). ``client``, ``api_key`` and ``local`` come from
                ``credential_for``.

        Raises:
            ValueError: ``max_stores`` is not a positive whole number, or a per-user option was given.
        """
        if isinstance(max_stores, bool) or not isinstance(max_stores, int) or max_stores < 1:
            raise ValueError(f"max_stores must be a whole number of at least 1, got {max_stores!r}")
        shared = [option for option in _PER_USER_OPTIONS if option in store_options]
        if shared:
            raise ValueError(f"{', '.join(shared)}: comes from credential_for for each user, not shared by the pool")
        self._credential_for = credential_for
        self._max_stores = max_stores
        self._store_options = store_options
        self._lock = threading.Lock()
        self._stores: OrderedDict[str, MembaseMemoryStore] = OrderedDict()
        # Stores let go of while something may still hold them, by user: alive only as long as someone uses them.
        self._released: weakref.WeakValueDictionary[str, MembaseMemoryStore] = weakref.WeakValueDictionary()
        self._closed = False
        _background.reset_after_fork(self)

    def _after_fork_in_child(self) -> None:
        self._lock = threading.Lock()  # a thread handing out a store may have held it at the fork

    def __len__(self) -> int:
        """How many stores the pool keeps for reuse (at most ``max_stores``)."""
        with self._lock:
            return len(self._stores)

    def __repr__(self) -> str:
        return f"MembaseStorePool(stores={len(self)}, max_stores={self._max_stores})"

    def store_for(self, user_id: str) -> MembaseMemoryStore:
        """The store for ``user_id``: the one from before, or a new one from the user's credential.

        Never waits for another user's store: making room only lets go of a store, it does not close it.

        Raises:
            ValueError: ``user_id`` is blank, or the credential function failed or gave nothing usable for
                this user (the message names the user, never the credential).
            RuntimeError: The pool was closed.
        """
        if not isinstance(user_id, str) or not user_id.strip():
            raise ValueError(f"user_id must be a non-blank string, got {user_id!r}")
        with self._lock:
            self._check_open()
            store = self._take(user_id)
            if store is not None:
                return store
        # Built outside the lock: the app's credential function may be slow (a vault, a database).
        candidate = self._build(user_id)
        with self._lock:
            closed = self._closed
            # Another thread may have built this user's store meanwhile: theirs wins, so there is only one.
            store = None if closed else self._take(user_id)
            if store is None and not closed:
                self._keep(user_id, candidate)
                return candidate
        candidate.close()  # never handed out, so nothing runs on it and this does not wait
        if store is None:
            raise RuntimeError("MembaseStorePool is closed")
        return store

    def close(self) -> None:
        """Close every store the pool handed out that is still alive. Safe to call twice.

        The stores close side by side, each letting its captured writes still running finish first, so
        this returns within about one ``write_timeout`` however many stores there are. This blocks the
        calling thread meanwhile: from async code, use :meth:`aclose` (or ``async with``).
        """
        stores = self._close_pool()
        if not stores:
            return
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            # Side by side on a loop of our own: no thread per store. Not asyncio.run(), which would also
            # replace (and then clear) this thread's current event loop under a caller that set one.
            loop = asyncio.new_event_loop()
            try:
                loop.run_until_complete(self._close_side_by_side(stores))
            finally:
                loop.close()
            return
        # Called from async code (which should await aclose()): each store's close() on a thread of its own
        # waits up to its write_timeout for its own writes; side by side, they all fit in one budget. Daemon
        # threads: a close still waiting must not hold up the interpreter's exit.
        budget = (
            self._store_options.get("write_timeout", _options.DEFAULT_WRITE_TIMEOUT) or _options.WAIT_WITHOUT_BUDGET
        )
        closing: list[Future[None]] = [
            _background.submit(store.close, name=f"membase-close[{store.name}]") for store in stores
        ]
        done, still_closing = wait(closing, timeout=budget)
        for future in done:
            error = future.exception()
            if error is not None:
                logger.warning("reason=<%s> | a store failed to close", type(error).__name__)
        if still_closing:
            logger.warning(
                "stores=<%d>, reason=<writes still running after %.1f s> | pool closed; "
                "those stores finish closing in the background",
                len(still_closing),
                budget,
            )

    async def aclose(self) -> None:
        """:meth:`close` for async code: the same, without blocking the event loop. Safe to call twice.

        Every store the pool handed out that is still alive closes with :meth:`MembaseMemoryStore.aclose`,
        side by side on the running loop, so this returns within about one ``write_timeout`` however many
        stores there are, once each captured write that finished in that time has its outcome logged and
        counted.
        """
        stores = self._close_pool()
        if stores:
            await self._close_side_by_side(stores)

    @staticmethod
    async def _close_side_by_side(stores: list[MembaseMemoryStore]) -> None:
        outcomes = await asyncio.gather(*(store.aclose() for store in stores), return_exceptions=True)
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                logger.warning("reason=<%s> | a store failed to close", type(outcome).__name__)

    def __enter__(self) -> MembaseStorePool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    async def __aenter__(self) -> MembaseStorePool:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def _close_pool(self) -> list[MembaseMemoryStore]:
        """Refuse new stores from now on; the stores handed out that are still alive, now the caller's to close."""
        with self._lock:
            self._closed = True
            stores = [*self._stores.values(), *self._released.values()]
            self._stores.clear()
            self._released.clear()
        return stores

    def _take(self, user_id: str) -> MembaseMemoryStore | None:
        """The user's store, kept or let go of but still alive, now the most recently used. Lock held."""
        store = self._stores.get(user_id)
        if store is not None:
            self._stores.move_to_end(user_id)
            return store
        store = self._released.pop(user_id, None)
        if store is not None:
            logger.debug("user=<%s> | taking back a store still in use instead of building another", user_id)
            self._keep(user_id, store)
        return store

    def _keep(self, user_id: str, store: MembaseMemoryStore) -> None:
        """Keep ``store`` as the most recently used, letting go of the least recently used past the bound. Lock held."""
        self._stores[user_id] = store
        self._stores.move_to_end(user_id)
        while len(self._stores) > self._max_stores:
            old_user, old = self._stores.popitem(last=False)
            # Not closed here: an agent may be mid-turn on it. It is collected once nothing uses it.
            self._released[old_user] = old
            logger.debug("user=<%s> | pool full; letting go of the least recently used store", old_user)

    def _build(self, user_id: str) -> MembaseMemoryStore:
        try:
            credential = self._credential_for(user_id)
        except Exception as error:
            raise ValueError(f"no Membase credential for user {user_id!r}: the credential function failed") from error
        if isinstance(credential, os.PathLike):
            store = MembaseMemoryStore(local=credential, **self._store_options)
        elif not isinstance(credential, str) or not credential.strip():
            raise ValueError(
                f"no Membase credential for user {user_id!r}: the credential function returned "
                f"{type(credential).__name__}, not an API key or a local directory"
            )
        else:
            store = MembaseMemoryStore(api_key=credential, **self._store_options)
        return store  # one let go of and then dropped by its last user is collected (a local engine closed then)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("MembaseStorePool is closed")
