"""The one door to Membase: every call the library makes goes through a :class:`MembaseGateway`.

It holds the SDK clients a store calls through and says what their answers mean: search answers parsed, a
2xx body that cannot be read, Memory names resolved to ids, error texts with the key masked. Every call here
blocks; the store decides where it runs (``_background``) and how long it waits.

The clients, all built through the SDK's own constructor:

- From a key, two ``membase.Membase`` clients over the process's shared connection pool for the base URL
  (``_http``): one retries as the SDK does (the tools, which should wait out a waking memory), one makes a
  single attempt (automatic recall, whose late request must hold the in-flight guard for one attempt, not
  three; and writes, since a POST that timed out may be stored already).
- ``local=DIR``: the SDK's local engine, closed with the store.
- ``client=``: used as it is (its retries and timeout included), never changed or closed.

In a forked child a store's own clients are rebuilt over the child's own pools, so no process reads another's
socket. A client passed in cannot be rebuilt: used before the fork, it is refused in the child with a
sentence saying to build it after the fork.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import membase

from . import _background
from ._containers import Container, ContainerResolver, parse_containers
from ._failures import BadResponseError, redact, without_secret
from ._formatting import SearchAnswer, parse_search
from ._http import shared_client
from ._text import sendable

logger = logging.getLogger(__name__)

DEFAULT_BASE_URL = "https://api.app.membase.com"


class MembaseGateway:
    """One store's access to one person's Membase: its clients, its calls, and what their answers mean."""

    def __init__(
        self,
        *,
        client: membase.Membase | None = None,
        api_key: str | None = None,
        base_url: str | None = None,
        local: str | os.PathLike[str] | None = None,
        store_name: str = "membase",
    ) -> None:
        """Build the clients (a local engine starts here). Makes no network call.

        Raises:
            ValueError: The options contradict each other, or there is no key.
        """
        self._store_name = store_name
        self._given = client
        self._local = local
        self._key = ""
        self._url = ""
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
        self._lock = threading.Lock()
        self._resolver = ContainerResolver()
        self._used = False  # whether a client passed in was called (to refuse it in a forked child)
        self._refused = False
        self._clients: tuple[membase.Membase, membase.Membase] | None = self._build()
        _background.reset_after_fork(self)

    def _build(self) -> tuple[membase.Membase, membase.Membase]:
        """The clients: (the one that retries, the one that makes a single attempt)."""
        if self._given is not None:
            return self._given, self._given
        if not self._key:
            try:
                engine = membase.Membase(local=self._local) if self._local is not None else membase.Membase()
            except membase.MissingDependencyError as error:  # the SDK names its own package, not this one's extra
                raise membase.MissingDependencyError(_local_unavailable()) from error
            return engine, engine  # the local engine makes one attempt
        http = shared_client(self._url)
        return (
            membase.Membase(api_key=self._key, base_url=self._url, http_client=http),
            membase.Membase(api_key=self._key, base_url=self._url, max_retries=0, http_client=http),
        )

    # --- What it is connected to ---------------------------------------------------------------

    @property
    def hosted(self) -> bool:
        """Whether Membase is reached over HTTP with a key (not the local engine)."""
        return bool(self._key) or (self._given is not None and bool(self._given.api_key))

    @property
    def owns_engine(self) -> bool:
        """Whether the gateway started a local engine, which :meth:`close` closes."""
        return self._given is None and not self._key

    @property
    def base_url(self) -> str:
        """The Membase host (meaningful when :attr:`hosted`)."""
        return self._url or str(self._given.base_url if self._given is not None else "")

    @property
    def location(self) -> str:
        """Where Membase is, for messages and ``repr``: the base URL, or the local directory. Never the key."""
        if self._local is not None:
            return f"local={os.fspath(self._local)!r}"
        return f"base_url={self.base_url!r}" if self.hosted else "local (MEMBASE_LOCAL)"

    def close(self) -> None:
        """Close the local engine the gateway started; a hosted or passed-in client has nothing of its own to close."""
        clients = self._clients
        if self.owns_engine and clients is not None:
            clients[0].close()

    def _after_fork_in_child(self) -> None:
        self._lock = threading.Lock()
        self._resolver = ContainerResolver()
        if self._given is None:
            self._clients = None  # rebuilt at the first call, over this process's own pools
        elif self._used:
            self._refused = True

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

    # --- Calls ---------------------------------------------------------------------------------

    def search(self, query: str, limit: int, container: str | None, *, retry: bool) -> SearchAnswer:
        """Search one Memory (by name or id) or all in reach.

        Args:
            query: The text to search for.
            limit: Passages to ask for (1-50).
            container: A Memory's name or id, or ``None`` for every Memory in reach.
            retry: Let the SDK retry (the tools); without, one attempt (automatic recall).

        Raises:
            ValueError: ``container`` names no Memory in reach, or several.
            membase.MembaseError: The call failed, or the answer could not be read.
        """
        client = self._client(retry=retry)
        with readable_answers():
            body = self._resolver.call(
                client, container, lambda cid: client.search(sendable(query), container=cid, limit=limit)
            )
        return parse_search(body, limit)

    def save(self, content: str, container: str | None, *, static: bool = False, title: str = "") -> Any:
        """Save one note (or, with ``static``, a standing fact), in one attempt.

        A POST that timed out may already be stored, so it is never retried blindly. A 2xx whose body cannot
        be read means Membase took the note: that counts as saved (``None``), not as a failure that would make
        a caller send it again.

        Raises:
            ValueError: ``container`` names no Memory in reach, or several.
            membase.MembaseError: The call failed.
        """
        client = self._client(retry=False)

        def send(container_id: str | None) -> Any:
            try:
                return client.memories.add(sendable(content), container=container_id, static=static, title=title)
            except UNREADABLE as error:
                logger.warning(
                    "store=<%s>, reason=<2xx answer is %s> | Membase accepted the note; counting it as saved",
                    self._store_name,
                    unreadable_reason(error),
                )
                return None

        with readable_answers():
            return self._resolver.call(client, container, send)

    def profile(self, topic: str | None) -> Any:
        """The profile: standing facts, recent changes and, with ``topic``, relevant results (SDK retries)."""
        with readable_answers():
            return self._client(retry=True).profile(q=sendable(topic) if topic else None)

    def memories_in_reach(self) -> list[Container]:
        """The Memories this key reaches, in one attempt."""
        with readable_answers():
            return parse_containers(self._client(retry=False).containers.list())

    def container_id(self, name: str) -> str:
        """The id of the Memory ``name`` names (cached after the first lookup).

        Raises:
            ValueError: No Memory of that name is in reach, or several are.
        """
        with readable_answers():
            return self._resolver.resolve(self._client(retry=True), name)

    def remember_container(self, name: str, container_id: str) -> None:
        """Cache an id found by another route (the store's set-up check)."""
        self._resolver.remember(name, container_id)

    # --- Secrets -------------------------------------------------------------------------------

    @property
    def _secret(self) -> str:
        return self._key or (self._given.api_key if self._given is not None else "") or ""

    def redact(self, text: str) -> str:
        """``text`` with the API key masked."""
        return redact(text, self._secret)

    def without_secret(self, error: BaseException) -> BaseException:
        """``error``, or a copy without the API key when it (or an error chained to it) carries the key."""
        return without_secret(error, self._secret)


def _local_unavailable() -> str:
    """What to do when local Membase cannot start here."""
    major, minor = sys.version_info[:2]
    if (major, minor) < (3, 12):
        return (
            f"local Membase needs Python 3.12+; this is Python {major}.{minor}. "
            "With a key (MEMBASE_API_KEY), hosted Membase works on Python 3.10+."
        )
    return 'local Membase needs its engine: pip install "membase-strands[local]"'


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


# --- Answers that cannot be read ---------------------------------------------------------------

UNREADABLE = (json.JSONDecodeError, UnicodeDecodeError)
"""What the SDK lets through for a 2xx whose body it cannot decode (``response.json()`` raises either)."""


def unreadable_reason(error: ValueError) -> str:
    """Why a 2xx body could not be read, in a few words."""
    if isinstance(error, UnicodeDecodeError):
        return f"not valid UTF-8: {error.reason} at byte {error.start}"
    if isinstance(error, json.JSONDecodeError):
        return f"not JSON: {error.msg}"
    return type(error).__name__


@contextmanager
def readable_answers() -> Iterator[None]:
    """Turn a 2xx answer that cannot be decoded into a Membase error; a ``ValueError`` of the library's own passes."""
    try:
        yield
    except UNREADABLE as error:
        raise BadResponseError(f"Membase answered with a body that is {unreadable_reason(error)}") from None
