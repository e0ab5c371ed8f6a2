"""One store per user, for apps that serve many people.

One Membase key (or local directory) is one person's memory. :class:`MembaseStorePool` hands
out the store for a user id, built from the credential the app's own function returns for that
user, and keeps it (and its client's warm connection pool) for that user's next turns.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from .store import MembaseMemoryStore

logger = logging.getLogger(__name__)

Credential = str | os.PathLike[str]
"""An API key (a ``str``), or a directory for local Membase (a ``pathlib.Path`` or other path object)."""

_PER_USER_OPTIONS = ("client", "api_key", "local")


class MembaseStorePool:
    """Hands out one :class:`MembaseMemoryStore` per user id, reusing each user's store and client.

    Safe to use from several threads and event loops at once. It keeps at most ``max_stores``
    stores; when it must drop one, the least recently used goes first and is closed. A user's store
    is only ever built from that user's own credential: there is no shared or fallback client.

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
            max_stores: How many users' stores to keep open at most. Make it larger than the number of
                users active at the same moment: a store dropped while its agent is mid-turn is closed.
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
        self._closed = False

    def __len__(self) -> int:
        with self._lock:
            return len(self._stores)

    def __repr__(self) -> str:
        return f"MembaseStorePool(stores={len(self)}, max_stores={self._max_stores})"

    def store_for(self, user_id: str) -> MembaseMemoryStore:
        """The store for ``user_id``: the one kept from before, or a new one from the user's credential.

        Raises:
            ValueError: ``user_id`` is blank, or the credential function failed or gave nothing usable for
                this user (the message names the user, never the credential).
            RuntimeError: The pool was closed.
        """
        if not isinstance(user_id, str) or not user_id.strip():
            raise ValueError(f"user_id must be a non-blank string, got {user_id!r}")
        with self._lock:
            self._check_open()
            store = self._stores.get(user_id)
            if store is not None:
                self._stores.move_to_end(user_id)
                return store
        # Built outside the lock: the app's credential function may be slow (a vault, a database).
        candidate = self._build(user_id)
        with self._lock:
            closed = self._closed
            store = candidate if closed else self._stores.setdefault(user_id, candidate)
            if not closed:
                self._stores.move_to_end(user_id)
            dropped = self._over_bound() if store is candidate and not closed else []
        if closed or store is not candidate:
            candidate.close()  # the pool closed meanwhile, or another thread built this user's store first
            self._check_open()
        for old in dropped:
            old.close()
        return store

    def close(self) -> None:
        """Close every store the pool holds. Safe to call twice."""
        with self._lock:
            self._closed = True
            stores = list(self._stores.values())
            self._stores.clear()
        for store in stores:
            store.close()

    def __enter__(self) -> MembaseStorePool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _build(self, user_id: str) -> MembaseMemoryStore:
        try:
            credential = self._credential_for(user_id)
        except Exception as error:
            raise ValueError(f"no Membase credential for user {user_id!r}: the credential function failed") from error
        if isinstance(credential, os.PathLike):
            return MembaseMemoryStore(local=credential, **self._store_options)
        if not isinstance(credential, str) or not credential.strip():
            raise ValueError(
                f"no Membase credential for user {user_id!r}: the credential function returned "
                f"{type(credential).__name__}, not an API key or a local directory"
            )
        return MembaseMemoryStore(api_key=credential, **self._store_options)

    def _over_bound(self) -> list[MembaseMemoryStore]:
        dropped = []
        while len(self._stores) > self._max_stores:
            user_id, store = self._stores.popitem(last=False)
            logger.debug("user=<%s> | pool full; closing the least recently used store", user_id)
            dropped.append(store)
        return dropped

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("MembaseStorePool is closed")
