"""The Membase client the store talks through: built from options, with a no-retry view of it."""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager

import membase

from .errors import BadResponseError

DEFAULT_BASE_URL = "https://api.app.membase.com"


def build_client(
    client: membase.Membase | None, api_key: str | None, base_url: str | None, local: str | os.PathLike[str] | None
) -> tuple[membase.Membase, bool]:
    """The client to use and whether the store owns it (and so must close it).

    Raises:
        ValueError: The options contradict each other, or there is no key.
    """
    if client is not None:
        if api_key is not None or base_url is not None or local is not None:
            raise ValueError("client: pass either a ready client or api_key/base_url/local, not both")
        if not isinstance(client, membase.Membase):
            raise ValueError(f"client must be a membase.Membase, got {type(client).__name__}")
        return client, False
    if local is not None:
        if api_key is not None or base_url is not None:
            raise ValueError("local: local Membase runs on this machine and takes no api_key or base_url")
        return membase.Membase(local=local), True
    key = api_key if api_key is not None else os.environ.get("MEMBASE_API_KEY")
    if key is None and os.environ.get("MEMBASE_LOCAL"):
        return membase.Membase(), True  # the SDK's own convention: MEMBASE_LOCAL names a local store
    if not isinstance(key, str) or not key.strip():
        raise ValueError(
            "api_key: no Membase API key; pass api_key=, set MEMBASE_API_KEY, or pass local=DIR for local memory"
        )
    url = base_url or os.environ.get("MEMBASE_BASE_URL") or DEFAULT_BASE_URL
    return membase.Membase(api_key=key, base_url=url), True


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


@contextmanager
def readable_answers() -> Iterator[None]:
    """Turn a 2xx answer that is not JSON (the SDK lets ``json.JSONDecodeError`` through) into a Membase error."""
    try:
        yield
    except json.JSONDecodeError as error:
        raise BadResponseError(f"Membase answered with a body that is not JSON ({error.msg})") from None
