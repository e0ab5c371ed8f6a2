"""An in-memory Membase that answers the REST routes the SDK uses, over ``httpx.MockTransport``.

It really stores notes and searches them (by shared words), so tests assert on behaviour, and it
records every request. Faults are injected per route with :meth:`InMemoryMembase.on`.
"""

from __future__ import annotations

import itertools
import json
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import httpx
import membase

from .. import _http

if TYPE_CHECKING:
    from ..store import MembaseMemoryStore

API_KEY = "mb_test_key_5ecr3t_do_not_log"
"""The key the in-memory Membase's clients send: a test can assert it never shows up anywhere."""

Responder = Callable[[httpx.Request], httpx.Response]
_NUMBERS = itertools.count(1)


@dataclass
class Recorded:
    """One request that reached the fake."""

    method: str
    path: str
    body: Any
    params: dict[str, str]


@dataclass
class Note:
    """One note saved to a Memory."""

    content: str
    container: str
    title: str = ""
    seeded: bool = False
    """Put there by :meth:`InMemoryMembase.remember`, not saved through the API."""


@dataclass
class InMemoryMembase:
    """The Membase REST API, in memory, for testing an agent offline.

    The real ``membase.Membase`` client talks to it over ``httpx.MockTransport``, so everything between
    your agent and the HTTP request is the real thing. It starts with one Memory, ``Main`` (id
    ``ctr_main``); add more with :meth:`add_memory`.

    Example:
        ```python
        membase = InMemoryMembase()
        membase.remember("We chose Postgres for the ledger.")
        store = membase.store()  # a MembaseMemoryStore on it
        ...
        assert membase.saved() == ["I like green tea."]
        ```

    Attributes:
        containers: The Memories in reach, as Membase lists them (``{"id": ..., "name": ...}``).
        notes: Every note saved, in order (seeded ones too).
        standing: The profile's standing facts.
        unsearchable: Memory id -> the reason it cannot answer a search.
        requests: Every request that reached it, in order.
    """

    containers: list[dict[str, Any]] = field(default_factory=lambda: [{"id": "ctr_main", "name": "Main"}])
    notes: list[Note] = field(default_factory=list)
    standing: list[str] = field(default_factory=list)
    unsearchable: dict[str, str] = field(default_factory=dict)
    requests: list[Recorded] = field(default_factory=list)
    base_url: str = field(init=False)
    """Where stores reach this Membase: a host of its own, served through ``httpx.MockTransport``."""
    _faults: dict[tuple[str, str], list[Responder]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.base_url = f"https://membase-{next(_NUMBERS)}.test"
        # Stores built for base_url send here while this Membase lives: the production path, minus the sockets.
        self._routed = _http.route(self.base_url, httpx.MockTransport(self.handle))

    # --- Test controls --------------------------------------------------------------------------

    def add_memory(self, name: str, memory_id: str | None = None) -> str:
        """Add a Memory to the key's reach; returns its id."""
        new_id = memory_id or f"ctr_{len(self.containers) + 1}"
        self.containers.append({"id": new_id, "name": name})
        return new_id

    def remember(self, content: str, container: str = "ctr_main") -> None:
        """Seed a note, as if saved earlier, in the Memory with this id or name."""
        self.notes.append(Note(content=content, container=self._id_of(container), seeded=True))

    def cannot_answer(self, container: str, reason: str = "the memory is not available") -> None:
        """Make one Memory (by id or name) report that it could not answer searches."""
        self.unsearchable[self._id_of(container)] = reason

    def saved(self, container: str | None = None) -> list[str]:
        """The text of the notes saved through the API (not seeded ones), optionally in one Memory."""
        wanted = None if container is None else self._id_of(container)
        with self._lock:
            return [n.content for n in self.notes if not n.seeded and wanted in (None, n.container)]

    def store(self, **options: Any) -> MembaseMemoryStore:
        """A :class:`~membase_strands.MembaseMemoryStore` built from a key, as in production, on this Membase."""
        from ..store import MembaseMemoryStore  # here, so the kit imports without a cycle

        return MembaseMemoryStore(api_key=API_KEY, base_url=self.base_url, **options)

    def _id_of(self, container: str) -> str:
        for row in self.containers:
            if container in (row["id"], row["name"]):
                return str(row["id"])
        return container

    def on(self, method: str, path: str, *responders: Responder) -> None:
        """Answer the next requests to ``method path`` with ``responders``, one each, in order."""
        self._faults.setdefault((method, path), []).extend(responders)

    def always(self, method: str, path: str, responder: Responder) -> None:
        """Answer every request to ``method path`` with ``responder``."""
        self._faults[(method, path)] = _Repeat(responder)  # type: ignore[assignment]

    def heal(self) -> None:
        """Drop every injected fault."""
        self._faults.clear()

    def sent(self, method: str | None = None, path: str | None = None) -> list[Recorded]:
        """The recorded requests, optionally only those to one route."""
        with self._lock:
            return [r for r in self.requests if (method in (None, r.method)) and (path in (None, r.path))]

    def client(self, **kwargs: Any) -> membase.Membase:
        """A real ``membase.Membase`` client whose transport is this fake."""
        http = httpx.Client(base_url=self.base_url, transport=httpx.MockTransport(self.handle))
        return membase.Membase(api_key=API_KEY, base_url=self.base_url, http_client=http, **kwargs)

    # --- The transport --------------------------------------------------------------------------

    def handle(self, request: httpx.Request) -> httpx.Response:
        raw = request.read()
        body = json.loads(raw) if raw else None
        with self._lock:
            self.requests.append(
                Recorded(request.method, request.url.path, body, dict(request.url.params.multi_items()))
            )
            queued = self._faults.get((request.method, request.url.path))
            responder = None
            if isinstance(queued, _Repeat):
                responder = queued.responder
            elif queued:
                responder = queued.pop(0)
        if responder is not None:
            return responder(request)
        return self._route(request.method, request.url.path, body, dict(request.url.params))

    def answer(self, request: httpx.Request) -> httpx.Response:
        """Answer ``request`` as the in-memory Membase does, ignoring injected faults (for custom responders)."""
        raw = request.read()
        return self._route(request.method, request.url.path, json.loads(raw) if raw else None, dict(request.url.params))

    def _route(self, method: str, path: str, body: Any, params: dict[str, str]) -> httpx.Response:
        if (method, path) == ("GET", "/v1/containers"):
            return httpx.Response(200, json={"containers": self.containers})
        if (method, path) == ("POST", "/v1/search"):
            return self._search(body)
        if (method, path) == ("POST", "/v1/memories"):
            return self._add(body)
        if (method, path) == ("GET", "/v1/profile"):
            topic = params.get("q")
            out: dict[str, Any] = {"static": list(self.standing), "dynamic": [], "available": True}
            out["dynamic"] = [{"content": n.content, "updated_at": "2026-11-01T00:00:00Z"} for n in self.notes[-3:]]
            if topic:
                out["results"] = self._hits(topic, None, 5)
            return httpx.Response(200, json=out)
        return error(404, "not_found", f"no route {method} {path}")

    def _search(self, body: dict[str, Any]) -> httpx.Response:
        q, container, limit = body.get("q", ""), body.get("container"), body.get("limit")
        if limit is not None and not 1 <= limit <= 50:
            return error(400, "bad_request", "limit must be 1-50")
        if container is not None and container not in {c["id"] for c in self.containers}:
            return error(403, "unauthorized", f"container {container!r} is not in reach")
        targets = [c for c in self.containers if container in (None, c["id"])]
        return httpx.Response(
            200,
            json={
                "query": q,
                "results": self._hits(q, container, limit or 8),
                "containers": [self._answered(c) for c in targets],
            },
        )

    def _answered(self, container: dict[str, Any]) -> dict[str, Any]:
        row = {"id": container["id"], "name": container["name"]}
        if container["id"] in self.unsearchable:
            row["error"] = self.unsearchable[container["id"]]
        return row

    def _hits(self, q: str, container: str | None, limit: int) -> list[dict[str, Any]]:
        words = set(_words(q))
        names = {c["id"]: c["name"] for c in self.containers}
        scored = []
        for note in self.notes:
            if container not in (None, note.container) or note.container in self.unsearchable:
                continue
            overlap = len(words & set(_words(note.content)))
            if overlap:
                scored.append((overlap, note))
        scored.sort(key=lambda pair: -pair[0])
        return [
            {
                "content": note.content,
                "container": note.container,
                "container_name": names.get(note.container, note.container),
                "score": float(overlap),
                "source": "episode",
                "title": note.title,
            }
            for overlap, note in scored[:limit]
        ]

    def _add(self, body: dict[str, Any]) -> httpx.Response:
        content = body.get("content") or ""
        if not content.strip():
            return error(400, "bad_request", "content is required")
        if body.get("static"):
            self.standing.append(content)
            return httpx.Response(200, json={"static": True, "status": "recorded", "content": content})
        container = body.get("container")
        if container is None:
            if len(self.containers) != 1:
                return error(400, "bad_request", "several containers are in reach; name one")
            container = self.containers[0]["id"]
        elif container not in {c["id"] for c in self.containers}:
            return error(403, "unauthorized", f"container {container!r} is not in reach")
        self.notes.append(Note(content=content, container=container, title=body.get("title") or ""))
        return httpx.Response(200, json={"memory_id": f"{container}:{len(self.notes)}", "container": container})


@dataclass
class _Repeat:
    responder: Responder


def error(status: int, code: str, message: str, headers: dict[str, str] | None = None) -> httpx.Response:
    """A Membase error envelope. Retry-After 0 keeps the SDK's retries instant in tests."""
    body = {"error": {"code": code, "message": message, "details": None, "retryable": status == 429, "trace_id": ""}}
    return httpx.Response(status, json=body, headers={"Retry-After": "0", **(headers or {})})


def status(code: int, message: str = "refused", headers: dict[str, str] | None = None) -> Responder:
    """A responder answering ``code`` with Membase's error envelope."""
    return lambda request: error(code, "error", message, headers)


def hang(release: threading.Event, then: Responder | None = None, limit: float = 30.0) -> Responder:
    """A responder that blocks until ``release`` is set (at most ``limit`` s), then answers with ``then``.

    Without ``then`` it raises a read timeout, as httpx would for a host that never answered.
    """

    def respond(request: httpx.Request) -> httpx.Response:
        release.wait(limit)
        if then is None:
            raise httpx.ReadTimeout("timed out", request=request)
        return then(request)

    return respond


def refuse_connection(request: httpx.Request) -> httpx.Response:
    """A responder that fails as a host refusing the connection would."""
    raise httpx.ConnectError("[Errno 111] Connection refused", request=request)


def _words(text: str) -> list[str]:
    return [w for w in re.findall(r"[a-z0-9]+", text.lower()) if len(w) > 2]
