"""The one door to Membase: every call the library makes goes through a :class:`MembaseGateway`.

It holds the SDK clients a store calls through, all built with the SDK's own constructor, and says what their
answers mean (parsed searches, Memory names resolved to ids, unreadable 2xx bodies, error texts with the key
masked). Every call blocks; the store decides where it runs and how long it waits.

- From a key: two ``membase.Membase`` clients over the process's shared pool for the base URL (``_http``). One
  retries as the SDK does (the tools, which should wait out a waking memory); one makes a single attempt (recall,
  whose late request must hold the in-flight guard for one attempt, not three; and writes, since a POST that
  timed out may be stored already).
- ``local=DIR``: the SDK's local engine, closed with the store. ``client=``: used as it is, never closed.

In a forked child the store's own clients are rebuilt over the child's pools, so no process reads another's
socket. A client passed in cannot be rebuilt: used before the fork, it is refused in the child.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future, wait
from typing import Any, TypeVar

import membase

from . import _background
from ._containers import Container, ContainerResolver, match, names_in_reach, parse_containers
from ._failures import BadResponseError, redact, without_secret
from ._formatting import SearchAnswer, parse_search
from ._http import shared_client
from ._text import sendable

logger = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_BASE_URL = "https://api.app.membase.com"
# What the SDK lets through for a 2xx whose body it cannot decode (``response.json()`` raises either).
_UNREADABLE = (json.JSONDecodeError, UnicodeDecodeError)


class MembaseGateway:
    """One store's access to one person's Membase: its clients, its calls, and what their answers mean.

    Attributes: ``hosted`` (reached over HTTP with a key, not a local engine), ``owns_engine`` (it started a local
    engine, which :meth:`close` closes), ``base_url``, and ``location`` (for messages and ``repr``; never the key).
    """

    def __init__(
        self,
        *,
        client: membase.Membase | None = None,
        api_key: str | None = None,
        base_url: str | None = None,
        local: str | os.PathLike[str] | None = None,
        store_name: str = "membase",
    ) -> None:
        """Build the clients (a local engine starts here); no network call. ``ValueError``: bad options, no key."""
        self._store_name = store_name
        self._given = client
        self._local = local
        self._key = self._url = ""
        if client is not None:
            if api_key is not None or base_url is not None or local is not None:
                raise ValueError("client: pass either a ready client or api_key/base_url/local, not both")
            if not isinstance(client, membase.Membase):
                raise ValueError(f"client must be a membase.Membase, got {type(client).__name__}")
        elif local is not None:
            if api_key is not None or base_url is not None:
                raise ValueError("local: local Membase runs on this machine and takes no api_key or base_url")
        else:
            key = api_key if api_key is not None else os.environ.get("MEMBASE_API_KEY")
            if key is not None or not os.environ.get("MEMBASE_LOCAL"):  # else the SDK's MEMBASE_LOCAL convention
                self._key = _checked_key(key)
                self._url = (base_url or os.environ.get("MEMBASE_BASE_URL") or DEFAULT_BASE_URL).rstrip("/")
        self.hosted = bool(self._secret)
        self.owns_engine = client is None and not self._key
        self.base_url = self._url or (str(client.base_url) if client is not None else "")
        where = f"base_url={self.base_url!r}" if self.hosted else "local (MEMBASE_LOCAL)"
        self.location = f"local={os.fspath(local)!r}" if local is not None else where
        self._lock = threading.Lock()
        self._resolver = ContainerResolver()
        self._used = self._refused = False  # a client passed in: called yet; refused (forked after it was called)
        self._clients: tuple[membase.Membase, membase.Membase] | None = self._build()
        _background.reset_after_fork(self)

    def _build(self) -> tuple[membase.Membase, membase.Membase]:
        """The clients: (the one that retries, the one that makes a single attempt)."""
        if self._given is not None:
            return self._given, self._given
        if self._key:
            http = shared_client(self._url, self._key)
            return (
                membase.Membase(api_key=self._key, base_url=self._url, http_client=http),
                membase.Membase(api_key=self._key, base_url=self._url, max_retries=0, http_client=http),
            )
        try:
            engine = membase.Membase(local=self._local) if self._local is not None else membase.Membase()
        except membase.MissingDependencyError as error:  # the SDK names its own package, not this one's extra
            raise membase.MissingDependencyError(_local_unavailable()) from error
        return engine, engine  # the local engine makes one attempt

    def _after_fork_in_child(self) -> None:
        self._lock = threading.Lock()
        self._resolver = ContainerResolver()
        if self._given is None:
            self._clients = None  # rebuilt at the first call, over this process's own pools
        elif self._used:
            self._refused = True

    def close(self, after: Callable[[], list[Future[Any]]] = list) -> None:
        """Close the local engine the gateway started, once the writes ``after`` lists end (so none loses it); a
        hosted or passed-in client has nothing of its own. Blocks while it waits."""
        writes = after()
        if writes:
            logger.debug("store=<%s> | closing its local engine once its running writes end", self._store_name)
            wait(writes)
        try:
            if self.owns_engine and self._clients is not None:
                self._clients[0].close()
        except Exception as error:
            logger.warning(
                "store=<%s>, reason=<%s> | could not close its local engine", self._store_name, type(error).__name__
            )

    def search(self, query: str, limit: int, container: str | None, *, retry: bool) -> SearchAnswer:
        """Search one Memory (a name or id) or every one in reach; ``retry``: let the SDK retry (the tools).

        Raises:
            ValueError: ``container`` names no Memory in reach, or several.
            membase.MembaseError: The call failed, or the answer could not be read.
        """

        def search(client: membase.Membase) -> Any:
            return self._resolver.call(
                client, container, lambda cid: client.search(sendable(query), container=cid, limit=limit)
            )

        return parse_search(self._call(search, retry=retry), limit)

    def save(self, content: str, container: str | None, *, static: bool = False, title: str = "") -> Any:
        """Save one note (``static``: a standing fact) in one attempt, since a POST that timed out may be stored.

        A 2xx whose body cannot be read means Membase took the note: it counts as saved (``None``).
        """

        def save(client: membase.Membase) -> Any:
            def send(container_id: str | None) -> Any:
                try:
                    return client.memories.add(sendable(content), container=container_id, static=static, title=title)
                except _UNREADABLE as error:
                    logger.warning(
                        "store=<%s>, reason=<2xx answer is %s> | Membase accepted the note; counting it as saved",
                        self._store_name,
                        _unreadable(error),
                    )
                    return None

            return self._resolver.call(client, container, send)

        return self._call(save, retry=False)

    def profile(self, topic: str | None) -> Any:
        """The profile: standing facts, recent changes and, with ``topic``, relevant results (SDK retries)."""
        return self._call(lambda client: client.profile(q=sendable(topic) if topic else None), retry=True)

    def memories_in_reach(self) -> list[Container]:
        """The Memories this key reaches, in one attempt."""
        return parse_containers(self._call(lambda client: client.containers.list(), retry=False))

    def container_id(self, name: str) -> str:
        """The id of the Memory ``name`` names (``ValueError`` if none or several), cached after the first lookup."""
        return self._call(lambda client: self._resolver.resolve(client, name), retry=True)

    def check_setup(self, container: str | None) -> None:
        """The store's set-up check: the pinned Memory's id, remembered; or, with none pinned, one Memory at most
        (capture must know where to write). ``ValueError`` when not."""
        containers = self.memories_in_reach()
        if container is not None:
            self._resolver.remember(container, match(container, containers).id)
        elif len(containers) > 1:
            raise ValueError(
                f"capture=True with several Memories in reach ({names_in_reach(containers)}) needs container= naming "
                "the one to write to"
            )

    def _call(self, call: Callable[[membase.Membase], T], *, retry: bool) -> T:
        """``call`` with the client that retries (or not); a 2xx body that cannot be read becomes a Membase error."""
        client = self._client(retry=retry)
        try:
            return call(client)
        except _UNREADABLE as error:  # a ValueError of the library's own (a Memory name) passes
            raise BadResponseError(f"Membase answered with a body that is {_unreadable(error)}") from None

    def _client(self, *, retry: bool) -> membase.Membase:
        if self._refused:
            raise RuntimeError(
                f"store '{self._store_name}': its Membase client (client=) was used before this process was forked, "
                "and sharing its connections would mix up the two processes' answers; build the client after the "
                "fork (for gunicorn, in post_fork), or let the store build it from the key"
            )
        clients = self._clients
        if clients is None:
            with self._lock:
                clients = self._clients = self._clients or self._build()
        self._used = True
        return clients[0] if retry else clients[1]

    @property
    def _secret(self) -> str:
        return self._key or (self._given.api_key if self._given is not None else "") or ""

    def redact(self, text: str) -> str:
        """``text`` with the API key masked."""
        return redact(text, self._secret)

    def without_secret(self, error: BaseException) -> BaseException:
        """``error``, or a copy without the API key when it (or an error chained to it) carries the key."""
        return without_secret(error, self._secret)


def _checked_key(key: str | None) -> str:
    if not isinstance(key, str) or not key.strip():
        raise ValueError(
            "api_key: no Membase API key; pass api_key=, set MEMBASE_API_KEY, or pass local=DIR for local memory"
        )
    key = key.strip()  # a key read from a file or a vault often ends in a newline
    if not key.isascii() or not key.isprintable() or " " in key:
        # It could not go into an HTTP header, and the transport's error would quote it back.
        raise ValueError("api_key: the Membase API key has spaces or characters a key cannot have; check its value")
    return key


def _local_unavailable() -> str:
    """What to do when local Membase cannot start here."""
    major, minor = sys.version_info[:2]
    if (major, minor) < (3, 12):
        return (
            f"local Membase needs Python 3.12+; this is Python {major}.{minor}. "
            "With a key (MEMBASE_API_KEY), hosted Membase works on Python 3.10+."
        )
    return 'local Membase needs its engine: pip install "membase-strands[local]"'


def _unreadable(error: ValueError) -> str:
    """Why a 2xx body could not be read, in a few words."""
    if isinstance(error, UnicodeDecodeError):
        return f"not valid UTF-8: {error.reason} at byte {error.start}"
    return f"not JSON: {error.msg}" if isinstance(error, json.JSONDecodeError) else type(error).__name__
