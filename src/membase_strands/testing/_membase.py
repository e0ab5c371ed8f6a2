"""An in-memory Membase for tests: notes searched by shared words, every request recorded, faults per route."""

import itertools
import json
import re
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import membase

from .. import _http
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
    seeded: bool = False  # put there by InMemoryMembase.remember(), not saved through the API


@dataclass
class InMemoryMembase:
    """The Membase REST API in memory, for the real ``membase.Membase`` client: it tests an agent offline."""

    # The Memories in reach, as Membase lists them: at first one, "Main" (id "ctr_main").
    containers: list[dict[str, Any]] = field(default_factory=lambda: [{"id": "ctr_main", "name": "Main"}])
    notes: list[Note] = field(default_factory=list)  # every note saved, seeded ones too
    standing: list[str] = field(default_factory=list)  # the profile's standing facts
    unsearchable: dict[str, str] = field(default_factory=dict)  # Memory id -> why it cannot answer a search
    requests: list[Recorded] = field(default_factory=list)
    # A host of its own, routed to its httpx.MockTransport while it lives.
    base_url: str = field(init=False, default_factory=lambda: f"https://membase-{next(_NUMBERS)}.test")
    _faults: dict[tuple[str, str], Iterator[Responder]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self._routed = _http.route(self.base_url, httpx.MockTransport(self.handle))  # the route lasts while this does

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
        return [n.content for n in self.notes if not n.seeded and wanted in (None, n.container)]

    def store(self, **options: Any) -> MembaseMemoryStore:
        """A :class:`~membase_strands.MembaseMemoryStore` built from a key, as in production, on this Membase."""
        return MembaseMemoryStore(api_key=API_KEY, base_url=self.base_url, **options)

    def client(self, **kwargs: Any) -> membase.Membase:
        """A real ``membase.Membase`` client whose transport is this fake."""
        http = httpx.Client(base_url=self.base_url, transport=httpx.MockTransport(self.handle))
        return membase.Membase(api_key=API_KEY, base_url=self.base_url, http_client=http, **kwargs)

    def on(self, method: str, path: str, *responders: Responder) -> None:
        """Answer the next requests to ``method path`` with ``responders``, one each, in order."""
        self._faults[(method, path)] = itertools.chain(self._faults.get((method, path), ()), responders)

    def always(self, method: str, path: str, responder: Responder) -> None:
        """Answer every request to ``method path`` with ``responder``."""
        self._faults[(method, path)] = itertools.repeat(responder)

    def heal(self) -> None:
        """Drop every injected fault."""
        self._faults.clear()

    def sent(self, method: str | None = None, path: str | None = None) -> list[Recorded]:
        """The recorded requests, optionally only those to one route."""
        return [r for r in self.requests if method in (None, r.method) and path in (None, r.path)]

    def _id_of(self, container: str) -> str:
        return next((str(c["id"]) for c in self.containers if container in (c["id"], c["name"])), container)

    def handle(self, request: httpx.Request) -> httpx.Response:
        """Record ``request``, then answer it with the route's next injected fault, if any, else as Membase would."""
        with self._lock:
            self.requests.append(Recorded(request.method, request.url.path, _body(request), dict(request.url.params)))
            responder = next(self._faults.get((request.method, request.url.path), iter(())), None)
        return (responder or self.answer)(request)

    def answer(self, request: httpx.Request) -> httpx.Response:
        """Answer ``request`` as the in-memory Membase does, ignoring injected faults (for custom responders)."""
        route, body = (request.method, request.url.path), _body(request)
        if route == ("GET", "/v1/containers"):
            return httpx.Response(200, json={"containers": self.containers})
        if route == ("GET", "/v1/profile"):
            recent = [{"content": n.content, "updated_at": "2026-11-01T00:00:00Z"} for n in self.notes[-3:]]
            profile: dict[str, Any] = {"static": list(self.standing), "dynamic": recent, "available": True}
            if topic := request.url.params.get("q"):
                profile["results"] = self._hits(topic, None, 5)
            return httpx.Response(200, json=profile)
        if route == ("POST", "/v1/search"):
            query, container, limit = body.get("q", ""), body.get("container"), body.get("limit")
            if limit is not None and not 1 <= limit <= 50:
                return error(400, "bad_request", "limit must be 1-50")
            if container is not None and container not in {c["id"] for c in self.containers}:
                return error(403, "unauthorized", f"container {container!r} is not in reach")
            searched = [{"id": c["id"], "name": c["name"]} for c in self.containers if container in (None, c["id"])]
            for row in searched:
                if row["id"] in self.unsearchable:
                    row["error"] = self.unsearchable[row["id"]]
            hits = self._hits(query, container, limit or 8)
            return httpx.Response(200, json={"query": query, "results": hits, "containers": searched})
        if route == ("POST", "/v1/memories"):
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
        return error(404, "not_found", f"no route {request.method} {request.url.path}")

    def _hits(self, query: str, container: str | None, limit: int) -> list[dict[str, Any]]:
        """The notes that share the most words with ``query``, best first, as Membase lists passages."""
        wanted = _words(query)
        names = {c["id"]: c["name"] for c in self.containers}
        notes = [n for n in self.notes if container in (None, n.container) and n.container not in self.unsearchable]
        scored = sorted(((len(wanted & _words(n.content)), n) for n in notes), key=lambda pair: -pair[0])
        return [
            {"content": n.content, "container": n.container, "title": n.title, "source": "episode"}
            | {"container_name": names.get(n.container, n.container), "score": float(overlap)}
            for overlap, n in scored[:limit]
            if overlap
        ]


def error(status: int, code: str, message: str, headers: dict[str, str] | None = None) -> httpx.Response:
    """A Membase error envelope. Retry-After 0 keeps the SDK's retries instant in tests."""
    body = {"error": {"code": code, "message": message, "details": None, "retryable": status == 429, "trace_id": ""}}
    return httpx.Response(status, json=body, headers={"Retry-After": "0", **(headers or {})})


def status(code: int, message: str = "refused", headers: dict[str, str] | None = None) -> Responder:
    """A responder answering ``code`` with Membase's error envelope."""
    return lambda request: error(code, "error", message, headers)


def hang(release: threading.Event, then: Responder | None = None, limit: float = 30.0) -> Responder:
    """A responder that waits for ``release`` (at most ``limit`` s), then answers with ``then``, else times out."""

    def respond(request: httpx.Request) -> httpx.Response:
        release.wait(limit)
        if then is None:
            raise httpx.ReadTimeout("timed out", request=request)
        return then(request)

    return respond


def refuse_connection(request: httpx.Request) -> httpx.Response:
    """A responder that fails as a host refusing the connection would."""
    raise httpx.ConnectError("[Errno 111] Connection refused", request=request)


def _body(request: httpx.Request) -> Any:
    return json.loads(request.read() or "null")


def _words(text: str) -> set[str]:
    return set(re.findall(r"[a-z0-9]{3,}", text.lower()))
