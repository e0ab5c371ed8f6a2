"""The one door to Membase: every call the library makes goes through a :class:`MembaseGateway`, which holds the SDK
clients and says what their answers mean. Every call blocks; the store decides where it runs and how long it waits.

From a key, two clients over the process's shared client for the store's route (``_http``): one retries as the SDK
does (the tools, which should wait out a waking memory); one makes a single attempt (recall, whose late request must
hold the in-flight guard for one attempt, not three; and writes, since a POST that timed out may be stored already).
A forked child builds its own at its first call; a client passed in (``client=``) cannot be rebuilt, so one used
before the fork is refused in the child.
"""

from __future__ import annotations

import json
import logging
import os
import urllib.parse
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import httpx
import membase

from . import _http, _local
from ._background import LOCK
from ._containers import Container, ContainerResolver, match, names_in_reach, parse_containers
from ._failures import BadResponseError, redact, without_secret
from ._formatting import SearchAnswer, parse_search
from ._text import sendable

logger = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_BASE_URL = "https://api.app.membase.com"
# What the SDK lets through for a 2xx whose body it cannot decode (``response.json()`` raises either).
_UNREADABLE = (json.JSONDecodeError, UnicodeDecodeError)


class MembaseGateway:
    """One store's access to one person's Membase. ``hosted``: reached with a key, not a local engine; ``local``: the
    local directory, if any; ``location``: where, for messages and ``repr`` (never the key)."""

    def __init__(
        self,
        *,
        client: membase.Membase | None = None,
        api_key: str | None = None,
        base_url: str | None = None,
        local: str | os.PathLike[str] | None = None,
        transport: httpx.BaseTransport | None = None,
        request_timeout: float = 90.0,
        max_response_bytes: int = 16 * 1024 * 1024,
        store_name: str = "membase",
    ) -> None:
        """Check the options and start a local engine, if any; no network call. ``ValueError``: bad options."""
        self._store_name, self._given = store_name, client
        self._secret, self.base_url = "", ""
        self._route: _http.Route | None = None
        self.local: Path | None = None
        if client is not None:
            if any(option is not None for option in (api_key, base_url, local, transport)):
                raise ValueError("client: pass either a ready client or api_key/base_url/local/transport, not both")
            if not isinstance(client, membase.Membase):
                raise ValueError(f"client must be a membase.Membase, got {type(client).__name__}")
            self._secret, self.base_url = client.api_key or "", str(client.base_url)
        elif local is not None:
            if api_key is not None or base_url is not None or transport is not None:
                raise ValueError(
                    "local: local Membase runs on this machine and takes no api_key, base_url or transport"
                )
            self.local = _local.directory_of(local)
        else:
            key = api_key if api_key is not None else os.environ.get("MEMBASE_API_KEY")
            if key is None and (env := os.environ.get("MEMBASE_LOCAL", "").strip()):  # the SDK's convention
                self.local = _local.directory_of(True if env.lower() in ("1", "true", "yes") else env)
            else:
                self._secret = _checked_key(key)
                url = _checked_url(base_url or os.environ.get("MEMBASE_BASE_URL") or DEFAULT_BASE_URL)
                self._route = _http.route(url, transport, request_timeout, max_response_bytes)
                self.base_url = self._route.base_url
        self.hosted = bool(self._secret)
        self.location = f"local={os.fspath(self.local)!r}" if self.local is not None else f"base_url={self.base_url!r}"
        self._resolver = ContainerResolver()
        # The clients by the process they were built in: (the one that retries, the one that makes a single attempt).
        self._clients: dict[int, tuple[membase.Membase, membase.Membase]] = {}
        if self.local is not None:
            self._client(retry=False)  # the engine starts now, or says why it cannot

    def _build(self) -> tuple[membase.Membase, membase.Membase]:
        if self._route is not None:
            http = _http.client_for(self._route)
            return (
                membase.Membase(api_key=self._secret, base_url=self.base_url, http_client=http),
                membase.Membase(api_key=self._secret, base_url=self.base_url, max_retries=0, http_client=http),
            )
        if self.local is not None:
            engine = _local.open_engine(self.local)  # the engine makes one attempt
            return engine, engine
        assert self._given is not None
        if self._clients.keys() - {os.getpid()}:  # used in the process this one was forked from
            raise RuntimeError(
                f"store '{self._store_name}': its Membase client (client=) was used before this process was "
                "forked, and sharing its connections would mix up the two processes' answers; build the client "
                "after the fork (for gunicorn, in post_fork), or let the store build it from the key"
            )
        return self._given, self._given

    def _client(self, *, retry: bool) -> membase.Membase:
        clients = self._clients.get(os.getpid())
        if clients is None:
            built = self._build()  # outside the lock: a local engine may take a while to start
            with LOCK:
                clients = self._clients.setdefault(os.getpid(), built)
            if clients is not built and self.local is not None:
                _local.close_engine(self.local)  # another thread opened it first: one user less
        return clients[0] if retry else clients[1]

    def close(self) -> None:
        """Let go of the local engine this gateway opened in this process, if any (blocking)."""
        if self.local is not None and self._clients.pop(os.getpid(), None) is not None:
            try:
                _local.close_engine(self.local)
            except Exception as error:
                reason = type(error).__name__
                logger.warning("store=<%s>, reason=<%s> | could not close its local engine", self._store_name, reason)

    def search(self, query: str, limit: int, container: str | None, *, retry: bool) -> SearchAnswer:
        """Search one Memory (a name or id) or every one in reach; ``retry``: let the SDK retry (the tools).
        ``ValueError`` when ``container`` names no Memory in reach, or several."""

        def send(client: membase.Membase, container_id: str | None) -> Any:
            return client.search(sendable(query), container=container_id, limit=limit)

        answer = self._call(lambda client: self._resolver.call(client, container, partial(send, client)), retry=retry)
        return parse_search(answer, limit, self.redact)

    def save(self, content: str, container: str | None, *, static: bool = False, title: str = "") -> Any:
        """Save one note (``static``: a standing fact) in one attempt, since a POST that timed out may be stored. A 2xx
        whose body cannot be read means Membase took the note: it counts as saved (``None``)."""

        def send(client: membase.Membase, container_id: str | None) -> Any:
            try:
                return client.memories.add(sendable(content), container=container_id, static=static, title=title)
            except _UNREADABLE as error:
                why = _unreadable(error)
            except BadResponseError as error:
                if not 200 <= (error.status or 0) < 300:
                    raise
                why = f"unreadable ({error.message})"  # too large, or compressed
            message = "store=<%s>, reason=<2xx answer is %s> | Membase accepted the note; counting it as saved"
            logger.warning(message, self._store_name, why)
            return None

        return self._call(lambda client: self._resolver.call(client, container, partial(send, client)), retry=False)

    def profile(self, topic: str | None, *, retry: bool = True) -> Any:
        """The profile: standing facts, recent changes and, with ``topic``, relevant results."""
        return self._call(lambda client: client.profile(q=sendable(topic) if topic else None), retry=retry)

    def forget(self, passage_id: str, *, confirm: bool) -> dict[str, Any]:
        """Forget the passage ``passage_id`` names (as :func:`~._formatting.passage_id` gives it); without
        ``confirm``, Membase only says what would be forgotten."""

        def forget(client: membase.Membase) -> Any:
            if passage_id.startswith("document:"):
                document = passage_id.removeprefix("document:")
                return client.documents.delete(urllib.parse.quote(document, safe=""), confirm=confirm)
            return client.memories.forget(urllib.parse.quote(passage_id, safe=":"), confirm=confirm)

        answer = self._call(forget, retry=False)  # a confirmed forget is sent once
        if not isinstance(answer, dict):
            raise BadResponseError("the answer to a forget is not an object")
        return answer

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

    def redact(self, text: str) -> str:
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
    # Every developer key has "mbk_", its 8-character key id and "_" (13 characters) before its token (a consent
    # token is an OAuth token): a shorter value is a placeholder or a typo, whose redaction would mask words.
    if len(key) < 13:
        raise ValueError(
            "api_key: the value is too short to be a Membase API key (a developer key's mbk_<key id>_ alone is 13 "
            "characters; `membase serve` without a token takes any value of 13 or more); check its value"
        )
    return key


def _checked_url(url: str) -> str:
    parts = urllib.parse.urlsplit(url.strip()) if isinstance(url, str) else None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(
            f"base_url must be http(s)://host (e.g. {DEFAULT_BASE_URL!r}), got {url!r}; "
            "check base_url= or MEMBASE_BASE_URL"
        )
    return url.strip().rstrip("/")


def _unreadable(error: json.JSONDecodeError | UnicodeDecodeError) -> str:
    if isinstance(error, UnicodeDecodeError):
        return f"not valid UTF-8: {error.reason} at byte {error.start}"
    return f"not JSON: {error.msg}"
