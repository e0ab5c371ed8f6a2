"""The one door to Membase: every blocking call the library makes goes through a :class:`MembaseGateway`.

It owns the SDK client (built from options, or passed in and guarded; see ``_client``), its
no-retry view, the cache of Memory names resolved to container ids, and what the library makes of
Membase's answers: parsed search answers, a 2xx whose body cannot be read, and error texts with the
key masked. The store, the tools, the setup check and the benchmarks all call Membase through it;
none of them touches the SDK client or the store's internals.

Everything here blocks, except the ``start_...`` calls, which return a future at once: the automatic
recall and the set-up check of a hosted store run on the I/O loop (``_io_loop``, ``_async_http``),
anything else on a worker thread (``_workers``). The store waits for those within its time budgets.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import membase

from ._async_http import AsyncMembaseHTTP
from ._client import UNREADABLE, build_client, readable_answers, unreadable_reason, without_retries
from ._containers import Container, ContainerResolver, parse_containers
from ._failures import redact, without_secret
from ._formatting import SearchAnswer, parse_search
from ._text import sendable
from ._workers import start_daemon

logger = logging.getLogger(__name__)


class MembaseGateway:
    """One store's access to one person's Membase: the client, its calls, and what their answers mean."""

    def __init__(
        self,
        *,
        client: membase.Membase | None = None,
        api_key: str | None = None,
        base_url: str | None = None,
        local: str | os.PathLike[str] | None = None,
        store_name: str = "membase",
    ) -> None:
        """Build (or guard) the client. Makes no network call.

        Raises:
            ValueError: The options contradict each other, or there is no key.
        """
        self._store_name = store_name
        self._client, self._close_client = build_client(client, api_key, base_url, local, store_name=store_name)
        # One attempt per call: the caller chooses when a request may be sent again.
        self._once = without_retries(self._client)
        self._resolver = ContainerResolver()
        self._local = local
        # A hosted client the gateway built: its budgeted calls are awaited on the I/O loop, not a thread each.
        self._async = (
            AsyncMembaseHTTP(self.base_url, self._client.api_key)
            if self._close_client is not None and self.hosted and local is None
            else None
        )

    # --- What it is connected to ---------------------------------------------------------------

    @property
    def client(self) -> membase.Membase:
        """The SDK client every call goes through (guarded: whole-call deadlines, fork-safe connections)."""
        return self._client

    @property
    def owns_client(self) -> bool:
        """Whether the gateway built its client (and so closes it), rather than being given one."""
        return self._close_client is not None

    @property
    def hosted(self) -> bool:
        """Whether Membase is reached over HTTP with a key (not the local engine)."""
        return bool(self._client.api_key)

    @property
    def location(self) -> str:
        """Where Membase is, for messages and ``repr``: the base URL, or the local directory. Never the key."""
        if self._local is not None:
            return f"local={os.fspath(self._local)!r}"
        return f"base_url={str(self._client.base_url)!r}" if self.hosted else "local (MEMBASE_LOCAL)"

    @property
    def base_url(self) -> str:
        """The Membase host (meaningful when :attr:`hosted`)."""
        return str(self._client.base_url)

    def closer(self) -> Callable[[], None] | None:
        """How to close the client the gateway built, without holding the gateway; ``None`` for a client passed in."""
        close_client, awaited = self._close_client, self._async
        if close_client is None or awaited is None:
            return close_client

        def close_both() -> None:
            awaited.close()
            close_client()

        return close_both

    def close(self) -> None:
        """Close the client if the gateway built it; a client passed in is left open."""
        closer = self.closer()
        if closer is not None:
            closer()

    def close_soon(self) -> Future[None]:
        """:meth:`close` without waiting for the I/O loop: the blocking client closes now, the awaited one on the
        loop; the future settles once both are closed."""
        if self._async is not None:
            closing = self._async.close_soon()  # first: marked closed whatever closing the blocking client does
        else:
            closing = Future()
            closing.set_result(None)
        if self._close_client is not None:
            self._close_client()
        return closing

    def after_fork_in_child(self) -> None:
        """Forget what a parent's threads may have been in the middle of (the client resets its own pool)."""
        self._resolver = ContainerResolver()

    # --- Calls ---------------------------------------------------------------------------------

    def search(self, query: str, limit: int, container: str | None, *, retry: bool) -> SearchAnswer:
        """Search one Memory (by name or id) or all in reach.

        Args:
            query: The text to search for.
            limit: Passages to ask for (1-50).
            container: A Memory's name or id, or ``None`` for every Memory in reach.
            retry: Let the SDK retry (the tools); without, one attempt (automatic recall, whose late
                request must not hold the in-flight guard for three attempts).

        Raises:
            ValueError: ``container`` names no Memory in reach, or several.
            membase.MembaseError: The call failed, or the answer could not be read.
        """
        client = self._client if retry else self._once
        with readable_answers():
            body = self._resolver.call(
                client, container, lambda cid: client.search(sendable(query), container=cid, limit=limit)
            )
        return parse_search(body, limit)

    def start_search(self, query: str, limit: int, container: str | None, *, retry: bool) -> Future[SearchAnswer]:
        """Start :meth:`search` and return its future at once: awaited on the I/O loop for a hosted store in
        one attempt, else on a worker thread named for the recall."""
        awaited = self._async
        if awaited is None or retry:
            return start_daemon(
                lambda: self.search(query, limit, container, retry=retry), name=f"membase-recall[{self._store_name}]"
            )

        async def search() -> SearchAnswer:
            async def send(container_id: str | None) -> Any:
                body: dict[str, Any] = {"q": sendable(query)}  # the SDK's search body, in its order
                if container_id is not None:
                    body["container"] = container_id
                body["limit"] = limit
                return await awaited.request("POST", "/v1/search", json=body)

            with readable_answers():
                answer = await self._resolver.call_async(self._list_awaited, container, send)
            return parse_search(answer, limit)

        return awaited.io.submit(search)

    def start_memories_in_reach(self) -> Future[list[Container]]:
        """Start :meth:`memories_in_reach` and return its future at once (on the I/O loop for a hosted store)."""
        if self._async is None:
            return start_daemon(self.memories_in_reach, name=f"membase-check[{self._store_name}]")
        return self._async.io.submit(self._list_awaited)

    async def _list_awaited(self) -> list[Container]:
        assert self._async is not None
        with readable_answers():
            return parse_containers(await self._async.request("GET", "/v1/containers"))

    def save(self, content: str, container: str | None, *, static: bool = False, title: str = "") -> Any:
        """Save one note (or, with ``static``, a standing fact), in one attempt.

        A POST that timed out may already be stored, so it is never retried blindly. A 2xx whose
        body cannot be read means Membase took the note: that counts as saved (``None``), not as a
        failure that would make a caller send it again.

        Raises:
            ValueError: ``container`` names no Memory in reach, or several.
            membase.MembaseError: The call failed.
        """

        def send(container_id: str | None) -> Any:
            try:
                return self._once.memories.add(sendable(content), container=container_id, static=static, title=title)
            except UNREADABLE as error:
                logger.warning(
                    "store=<%s>, reason=<2xx answer is %s> | Membase accepted the note; counting it as saved",
                    self._store_name,
                    unreadable_reason(error),
                )
                return None

        with readable_answers():
            return self._resolver.call(self._once, container, send)

    def profile(self, topic: str | None) -> Any:
        """The profile: standing facts, recent changes and, with ``topic``, relevant results (SDK retries)."""
        with readable_answers():
            return self._client.profile(q=sendable(topic) if topic else None)

    def memories_in_reach(self) -> list[Container]:
        """The Memories this key reaches, in one attempt."""
        with readable_answers():
            return parse_containers(self._once.containers.list())

    def container_id(self, name: str) -> str:
        """The id of the Memory ``name`` names (cached after the first lookup).

        Raises:
            ValueError: No Memory of that name is in reach, or several are.
        """
        with readable_answers():
            return self._resolver.resolve(self._client, name)

    def remember_container(self, name: str, container_id: str) -> None:
        """Cache an id found by another route (the store's set-up check)."""
        self._resolver.remember(name, container_id)

    # --- Secrets -------------------------------------------------------------------------------

    def redact(self, text: str) -> str:
        """``text`` with the API key masked."""
        return redact(text, self._client.api_key or "")

    def without_secret(self, error: BaseException) -> BaseException:
        """``error``, or a copy without the API key when it (or an error chained to it) carries the key."""
        return without_secret(error, self._client.api_key or "")
