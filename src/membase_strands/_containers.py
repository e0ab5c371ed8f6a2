"""The Memories in a key's reach: read from ``containers.list()``, matched by name, and checked when an agent is built.

Membase calls a Memory a container; users know it by name, the API wants the id. A name matches in any case (an exact
id also matches); the gateway caches the id, and looks the name up once more before it believes a refusal of it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, NamedTuple

import membase

from . import _runtime
from ._failures import BadResponseError
from ._telemetry import Ledger
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
    rows = [row for row in rows if isinstance(row, dict) and isinstance(row.get("id"), str) and row["id"]]
    return [
        Container(row["id"], row["name"] if isinstance(row.get("name"), str) and row["name"] else row["id"])
        for row in rows
    ]


def names_in_reach(containers: list[Container]) -> str:
    """The Memories' names as a readable list, for error messages and tool sentences."""
    return ", ".join(f"'{clip(c.name, 80)}'" for c in containers) or "none"


def match(wanted: str, containers: list[Container]) -> Container:
    """The Memory ``wanted`` names: an exact id, else a name in any case; ``ValueError`` when none or several do."""
    exact = [c for c in containers if c.id == wanted]
    hits = exact or [c for c in containers if c.name.strip().casefold() == wanted.strip().casefold()]
    if len(hits) == 1:
        return hits[0]
    if hits:
        listed = ", ".join(f"'{clip(c.name, 80)}' (id {c.id})" for c in hits)
        raise ValueError(f"container '{clip(wanted, 80)}' matches several Memories: {listed}; pass the id instead")
    raise ValueError(
        f"container '{clip(wanted, 80)}': no Memory of that name is in this key's reach; "
        f"Memories in reach: {names_in_reach(containers)}"
    )


class SetupCheck:
    """The store's check of its Memories when an agent is built: one per store, within the budget, never in the way.

    A running check is shared, one that ended late is used, one that failed is tried again. Past the budget it goes
    on in the background: agents built meanwhile do not wait for it again, and one outage warns once.
    """

    def __init__(self, check: Callable[[], None], ledger: Ledger) -> None:
        self._check, self._ledger, self._lock = check, ledger, _runtime.new_lock()
        self._running: Future[None] | None = None
        self._waited_out: Future[None] | None = None  # a check an agent waited the whole budget for
        _runtime.forget_in_child(self._forget_parent_checks)

    def _forget_parent_checks(self) -> None:
        self._running = self._waited_out = None  # their threads are the parent's: a forked child checks again

    async def run(self, budget: float) -> None:
        """Wait up to ``budget`` seconds for the check; ``ValueError`` when it finds the configuration cannot work."""
        with self._lock:
            check, start = self._running, False
            if check is None or (check.done() and isinstance(check.exception(), membase.MembaseError)):
                check, start = Future(), True
                self._running = check
            elif check is self._waited_out and not check.done():
                # Building an agent per request during an outage must not cost every request that wait again.
                return
        if start:  # outside the lock (see _runtime.submit)
            _runtime.submit(self._check, name=f"membase-check[{self._ledger.store_name}]", future=check)
        unlisted = "could not list the Memories in reach; checking again at first use"
        try:
            await _runtime.wait_for_future(check, budget)
        except asyncio.TimeoutError:
            with self._lock:
                first, self._waited_out = self._waited_out is not check, check
            if first:  # agents built together during one outage warn once
                self._ledger.log(logging.WARNING, unlisted, reason="no answer in time")
        except membase.MembaseError as error:
            self._ledger.failed(error)
            self._ledger.log(logging.WARNING, unlisted, error=error)
        except Exception:
            with self._lock:
                self._running = None  # the next agent lists the Memories again: they may have changed
            raise
