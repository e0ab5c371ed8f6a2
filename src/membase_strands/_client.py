"""The Membase client the store talks through: built from options, with a no-retry view of it."""

from __future__ import annotations

import copy
import functools
import json
import os
import ssl
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import httpx
import membase
from membase.client import DEFAULT_TIMEOUT

from .errors import BadResponseError

DEFAULT_BASE_URL = "https://api.app.membase.com"


def build_client(
    client: membase.Membase | None, api_key: str | None, base_url: str | None, local: str | os.PathLike[str] | None
) -> tuple[membase.Membase, Callable[[], None] | None]:
    """The client to use, and how to close what the store built (``None`` for a client passed in).

    Raises:
        ValueError: The options contradict each other, or there is no key.
    """
    if client is not None:
        if api_key is not None or base_url is not None or local is not None:
            raise ValueError("client: pass either a ready client or api_key/base_url/local, not both")
        if not isinstance(client, membase.Membase):
            raise ValueError(f"client must be a membase.Membase, got {type(client).__name__}")
        return client, None
    if local is not None:
        if api_key is not None or base_url is not None:
            raise ValueError("local: local Membase runs on this machine and takes no api_key or base_url")
        built = membase.Membase(local=local)
        return built, built.close
    key = api_key if api_key is not None else os.environ.get("MEMBASE_API_KEY")
    if key is None and os.environ.get("MEMBASE_LOCAL"):
        built = membase.Membase()  # the SDK's own convention: MEMBASE_LOCAL names a local store
        return built, built.close
    if not isinstance(key, str) or not key.strip():
        raise ValueError(
            "api_key: no Membase API key; pass api_key=, set MEMBASE_API_KEY, or pass local=DIR for local memory"
        )
    key = key.strip()  # a key read from a file or a vault often ends in a newline
    if not key.isascii() or not key.isprintable() or " " in key:
        # It could not go into an HTTP header, and the transport's error would quote it back.
        raise ValueError("api_key: the Membase API key has spaces or characters a key cannot have; check its value")
    url = (base_url or os.environ.get("MEMBASE_BASE_URL") or DEFAULT_BASE_URL).rstrip("/")
    # The SDK would build an httpx.Client with an SSL context of its own: ~0.8 MiB and ~20 ms per store
    # (measured in benchmarks/). Stores share one context instead; the SDK then leaves closing to us.
    http = new_http_client(url)
    return membase.Membase(api_key=key, base_url=url, http_client=http), http.close


def new_http_client(base_url: str) -> httpx.Client:
    """The connection pool for one hosted store: the SDK's timeout, and TLS settings shared by all stores."""
    return httpx.Client(base_url=base_url, timeout=DEFAULT_TIMEOUT, verify=_shared_ssl_context())


@functools.cache
def _shared_ssl_context() -> ssl.SSLContext:
    """httpx's default TLS settings (certifi's CA bundle, SSL_CERT_FILE/SSL_CERT_DIR honoured), built once."""
    return httpx.create_ssl_context()


def without_retries(client: membase.Membase) -> membase.Membase:
    """A view of ``client`` that makes one attempt per call, sharing its connections.

    The SDK retries timeouts, connection errors, 429 and 5xx twice for every method. A recall
    that ran out of time must hold the in-flight guard for one attempt, not three, and a POST
    that timed out may already be stored, so neither is retried blindly. The SDK keeps its retry
    count in ``max_retries`` and its namespaces (``containers``, ``memories``, ...) point back at
    their client, so the view gets namespaces of its own.
    """
    view = copy.copy(client)
    view.max_retries = 0
    for namespace in ("containers", "memories", "documents"):
        if hasattr(client, namespace):
            setattr(view, namespace, type(getattr(client, namespace))(view))
    return view


UNREADABLE = (json.JSONDecodeError, UnicodeDecodeError)
"""What the SDK lets through for a 2xx whose body it cannot decode (``response.json()`` raises either)."""


def unreadable_reason(error: ValueError) -> str:
    """Why a 2xx body could not be read, in a few words (for log lines and :class:`BadResponseError`)."""
    if isinstance(error, UnicodeDecodeError):
        return f"not valid UTF-8: {error.reason} at byte {error.start}"
    if isinstance(error, json.JSONDecodeError):
        return f"not JSON: {error.msg}"
    return type(error).__name__


@contextmanager
def readable_answers() -> Iterator[None]:
    """Turn a 2xx answer that cannot be decoded (not UTF-8, or not JSON) into a Membase error.

    Only the decoding errors the SDK lets through are caught: a ``ValueError`` of the library's own
    (an unknown Memory name, say) passes unchanged.
    """
    try:
        yield
    except UNREADABLE as error:
        raise BadResponseError(f"Membase answered with a body that is {unreadable_reason(error)}") from None
