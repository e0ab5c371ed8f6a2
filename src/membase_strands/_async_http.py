"""Hosted Membase requests awaited on the I/O loop (``_io_loop``): the SDK's request, in one attempt.

The SDK has no async client, so this sends exactly what ``membase.Membase`` sends for one attempt
(the same headers, JSON body and query parameters) through an ``httpx.AsyncClient``, reads the answer
the same way, and raises the SDK's own errors: ``APITimeoutError`` and ``APIConnectionError`` from the
transport, ``membase.errors.error_for(status, body)`` for a refusal. Nothing is retried, as with the
store's no-retry view of its client. The whole attempt ends within the SDK's timeout, however slowly
the server drips its answer: one ``asyncio`` timeout (the client's longest phase timeout, as for the
blocking client) covers connecting, sending and every read.

A store's client lives on the loop it was built on. When that loop retires (idle) or the process is
a forked child, the next request builds a new one: a forked child never touches its parent's sockets.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from concurrent.futures import Future
from typing import Any

import httpcore
import httpx
import membase
from membase.errors import error_for

from . import _client
from ._io_loop import IO, IOLoop, PoolSweep

_USER_AGENT = f"unibaseio-membase-python/{membase.__version__}"

RECENTLY_USED_SECONDS = 2.0
"""A pool that sent a request this recently is left to tidy itself at its next request."""
CLOSE_WAIT = 2.0
"""The longest :meth:`AsyncMembaseHTTP.close` waits for the loop to close the connections."""


class AsyncMembaseHTTP:
    """One hosted store's requests on the I/O loop. Its ``repr`` shows where, never the key."""

    def __init__(self, base_url: str, api_key: str, *, io: IOLoop = IO) -> None:
        """Prepare the requests; nothing is built or sent until the first one.

        Args:
            base_url: The Membase host.
            api_key: The key, sent as a bearer token.
            io: The loop the requests run on.
        """
        self._base_url = base_url
        self._headers = {
            "Authorization": f"Bearer {api_key}",
            "Accept": "application/json",
            "User-Agent": _USER_AGENT,
        }
        self._io = io
        # Read and replaced only on the loop's thread, so no lock: see close().
        self._pooled: _PooledClient | None = None
        self._closed = False

    def __repr__(self) -> str:
        return f"AsyncMembaseHTTP(base_url={self._base_url!r})"

    @property
    def io(self) -> IOLoop:
        """The loop the requests run on."""
        return self._io

    async def request(self, method: str, path: str, *, json: Any = None, params: dict[str, Any] | None = None) -> Any:
        """One attempt, on the I/O loop; the decoded JSON answer (``None`` for an empty 2xx body).

        Raises:
            membase.APITimeoutError: The attempt ran past the SDK's timeout.
            membase.APIConnectionError: The request could not be sent or its answer not received.
            membase.APIStatusError: Membase refused it (the subclass for its status).
            ValueError: A 2xx answer is not valid UTF-8 or not JSON (as the SDK lets it through).
            RuntimeError: The store was closed.
        """
        pooled = self._client_here()
        pooled.last_used = time.monotonic()
        client = pooled.client
        try:
            response = await asyncio.wait_for(
                client.request(method, path, json=json, params=params, headers=self._headers),
                _client.attempt_seconds(client.timeout),
            )
        except (asyncio.TimeoutError, httpx.TimeoutException) as error:
            raise membase.APITimeoutError(f"{method} {path} timed out") from error
        except httpx.HTTPError as error:
            raise membase.APIConnectionError(f"{method} {path}: {error}") from error
        if 200 <= response.status_code < 300:
            return response.json() if response.content else None
        try:
            body = response.json()
        except ValueError:
            body = {"error": {"message": response.text}}
        raise error_for(response.status_code, body)

    def close(self) -> None:
        """Close the connections (waiting up to :data:`CLOSE_WAIT` s); later requests raise ``RuntimeError``.

        Safe from any thread.
        """
        closing = self.close_soon()
        if not closing.done() and not self._io.on_loop_thread():
            with contextlib.suppress(Exception):
                closing.result(timeout=CLOSE_WAIT)

    def close_soon(self) -> Future[None]:
        """Start closing (see :meth:`close`) and return at once; the future settles once the connections are closed."""
        self._closed = True  # first: a request that starts on the loop after this sees it
        if self._io.running:  # a retired loop closed its clients; none is built without a running loop
            try:
                # On the loop, after anything already queued there: a request building the client right now too.
                return self._io.submit(self._close_here)
            except RuntimeError:
                pass  # no thread to be had for the loop: its connections close when the client is collected
        done: Future[None] = Future()
        done.set_result(None)
        return done

    async def _close_here(self) -> None:
        pooled, self._pooled = self._pooled, None
        if pooled is not None and pooled.generation == self._io.generation:
            with contextlib.suppress(Exception):  # closing: as for the blocking client, nothing to report
                await pooled.retire()

    def _client_here(self) -> _PooledClient:
        """The client for the loop this runs on, built on first use (on the loop's thread)."""
        if self._closed:
            raise RuntimeError("Cannot send a request, as the client has been closed.")
        pooled = self._pooled
        if pooled is None or pooled.generation != self._io.generation:
            # A client of a retired loop was closed with it; one of a forked parent's is dropped unclosed.
            # Looked up at call time, like the blocking client's, so tests can route both to a fake.
            pooled = self._pooled = _PooledClient(_client.new_async_http_client(self._base_url), self._io.generation)
            self._io.register_sweep(pooled)
        return pooled


class _PooledClient:
    """An ``httpx.AsyncClient`` built on one loop, which the loop sweeps and retires."""

    __slots__ = ("__weakref__", "client", "generation", "last_used", "_sweep")

    def __init__(self, client: httpx.AsyncClient, generation: int) -> None:
        self.client = client
        self.generation = generation
        self.last_used = time.monotonic()
        transport = getattr(client, "_transport", None)
        pool = getattr(transport, "_pool", None) if isinstance(transport, httpx.AsyncHTTPTransport) else None
        self._sweep = PoolSweep(pool) if isinstance(pool, httpcore.AsyncConnectionPool) else None

    @property
    def open_connections(self) -> int:
        """How many connections the client's pool holds."""
        return 0 if self._sweep is None else self._sweep.open_connections

    async def sweep(self) -> int:
        """Close the pooled connections whose keep-alive expiry has passed; how many stay open.

        A pool in use tidies itself (httpcore closes expired connections on each request), and checking a
        connection costs about as much as a request's own bookkeeping: only a pool idle for a while is swept.
        """
        if self._sweep is None:
            return 0
        if time.monotonic() - self.last_used < RECENTLY_USED_SECONDS:
            return self._sweep.open_connections
        return await self._sweep.sweep()

    async def retire(self) -> None:
        """Close the client."""
        await self.client.aclose()
