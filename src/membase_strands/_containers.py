"""Resolving Memory names to container ids, once, with one second chance.

Membase calls a Memory a container. Users know their Memories by name; the API wants the id.
A name is matched case-insensitively (an exact id also matches) against ``containers.list()``
and the id is cached. If Membase later refuses a cached id (the Memory was renamed or made
anew), the name is resolved once more before the refusal is believed.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import membase

from ._failures import BadResponseError
from ._text import clip

T = TypeVar("T")

_REFUSED = (membase.PermissionDeniedError, membase.NotFoundError)


@dataclass(frozen=True)
class Container:
    """One Memory in the key's reach."""

    id: str
    name: str


def parse_containers(body: Any) -> list[Container]:
    """Read the answer of ``containers.list()``.

    Raises:
        BadResponseError: The answer is not a list of containers with ids.
    """
    rows = body.get("containers") if isinstance(body, dict) else None
    if not isinstance(rows, list):
        raise BadResponseError("the container list has no 'containers' list")
    found = []
    for row in rows:
        if isinstance(row, dict) and isinstance(row.get("id"), str) and row["id"]:
            name = row.get("name")
            found.append(Container(id=row["id"], name=name if isinstance(name, str) and name else row["id"]))
    return found


def names_in_reach(containers: list[Container]) -> str:
    """The Memories' names as a readable list, for error messages and tool sentences."""
    return ", ".join(f"'{clip(c.name, 80)}'" for c in containers) or "none"


def match(wanted: str, containers: list[Container]) -> Container:
    """Pick the container ``wanted`` names: an exact id, else a case-insensitive name.

    Raises:
        ValueError: No Memory matches (the message lists the names in reach), or several do
            (the message names each of them).
    """
    for container in containers:
        if container.id == wanted:
            return container
    key = wanted.strip().casefold()
    hits = [c for c in containers if c.name.strip().casefold() == key]
    if len(hits) == 1:
        return hits[0]
    if hits:
        listed = ", ".join(f"'{clip(c.name, 80)}' (id {c.id})" for c in hits)
        raise ValueError(f"container '{clip(wanted, 80)}' matches several Memories: {listed}; pass the id instead")
    raise ValueError(
        f"container '{clip(wanted, 80)}': no Memory of that name is in this key's reach; "
        f"Memories in reach: {names_in_reach(containers)}"
    )


class ContainerResolver:
    """Caches name-to-id resolutions for one client; safe to share between threads."""

    def __init__(self) -> None:
        """Create an empty cache."""
        self._lock = threading.Lock()
        self._ids: dict[str, str] = {}

    def resolve(self, client: membase.Membase, wanted: str) -> str:
        """The id of the Memory ``wanted`` names, from the cache or from ``containers.list()``."""
        with self._lock:
            cached = self._ids.get(wanted)
        if cached is not None:
            return cached
        container = match(wanted, parse_containers(client.containers.list()))
        with self._lock:
            self._ids[wanted] = container.id
        return container.id

    def remember(self, wanted: str, container_id: str) -> None:
        """Cache an id found by another route (the store's set-up check)."""
        with self._lock:
            self._ids[wanted] = container_id

    def call(self, client: membase.Membase, wanted: str | None, request: Callable[[str | None], T]) -> T:
        """Run ``request`` with the id of ``wanted`` (or ``None``), resolving again once if it is refused.

        A 403 or 404 for an id that came from the cache may mean the Memory was renamed or made
        anew: the name is looked up again and, if it now names another id, the request is sent
        once more. Otherwise the original refusal stands.
        """
        if wanted is None:
            return request(None)
        with self._lock:
            was_cached = wanted in self._ids
        container_id = self.resolve(client, wanted)
        try:
            return request(container_id)
        except _REFUSED:
            if not was_cached:
                raise
            with self._lock:
                self._ids.pop(wanted, None)
            fresh_id = self.resolve(client, wanted)
            if fresh_id == container_id:
                raise
        return request(fresh_id)
