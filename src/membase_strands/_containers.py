"""The Memories in a key's reach, read from ``containers.list()`` and matched by name: Membase calls a Memory a
container; users know it by name, the API wants the id (the gateway caches it)."""

from __future__ import annotations

from typing import Any, NamedTuple

from ._failures import BadResponseError
from ._text import clip


class Container(NamedTuple):
    """One Memory in the key's reach."""

    id: str
    name: str


def parse_containers(body: Any) -> list[Container]:
    """The Memories in the answer of ``containers.list()``; ``BadResponseError`` when it has no list of them."""
    rows = body.get("containers") if isinstance(body, dict) else None
    if not isinstance(rows, list):
        raise BadResponseError("the container list has no 'containers' list")
    return [
        Container(row["id"], row["name"] if isinstance(row.get("name"), str) and row["name"] else row["id"])
        for row in rows
        if isinstance(row, dict) and isinstance(row.get("id"), str) and row["id"]
    ]


def names_in_reach(containers: list[Container]) -> str:
    """The Memories' names as a readable list, for error messages and tool sentences."""
    return ", ".join(f"'{clip(c.name, 80)}'" for c in containers) or "none"


def match(wanted: str, containers: list[Container], *, local: bool = False) -> Container:
    """The Memory ``wanted`` names: an exact id, else a name in any case; ``ValueError`` when none or several do
    (``local``: said of local Membase, which has Memories, not a key's reach)."""
    exact = [c for c in containers if c.id == wanted]
    hits = exact or [c for c in containers if c.name.strip().casefold() == wanted.strip().casefold()]
    if len(hits) == 1:
        return hits[0]
    if hits:
        listed = ", ".join(f"'{clip(c.name, 80)}' (id {c.id})" for c in hits)
        raise ValueError(f"container '{clip(wanted, 80)}' matches several Memories: {listed}; pass the id instead")
    where = "no Memory of that name is in this key's reach; Memories in reach"
    if local:
        where = "local Membase has no Memory of that name; its Memories"
    raise ValueError(f"container '{clip(wanted, 80)}': {where}: {names_in_reach(containers)}")
