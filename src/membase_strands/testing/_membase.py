"""An in-memory Membase for tests: notes searched by shared words, every request recorded, faults per route; as the
local engine answers, or as hosted Membase documents it (key levels, the profile tick, queued notes)."""

from __future__ import annotations

import itertools
import json
import re
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx

from ..pool import MembaseStorePool
from ..store import MembaseMemoryStore

API_KEY = "mb_test_key_5ecr3t_do_not_log"
"""The key the in-memory Membase's clients send: a test can assert it never shows up anywhere."""

Responder = Callable[[httpx.Request], httpx.Response]
_NUMBERS = itertools.count(1)
LEVELS = ("read", "read_write", "full")  # a key's access levels: Read, Read & write, Full access


@dataclass
class Recorded:
    """One request that reached the fake, and the key it carried."""

    method: str
    path: str
    body: Any
    params: dict[str, str]
    key: str = ""


@dataclass
class Note:
    """One note saved to a Memory; ``id`` is what ``forget`` takes (``<Memory id>:<n>``)."""

    content: str
    container: str
    title: str = ""
    seeded: bool = False  # put there by InMemoryMembase.remember(), not saved through the API
    id: str = ""


class InMemoryMembase:
    """The Membase REST API in memory, for the real ``membase.Membase`` client: it tests an agent offline.

    It is the account of one key (:data:`API_KEY` unless named); :meth:`account` is another key's account on the same
    host, and a request is answered from the account of the key it carries, as Membase keeps one memory per key.

    Args:
        key: The key whose account this is.
        level: The key's access level, ``"read"``, ``"read_write"`` or ``"full"``: a verb above it is refused with
            403 as Membase words it ("... not in this agent's capability profile").
        profile: Whether the key's owner ticked the profile (else reading it is refused the same way).
        hosted: Answer as hosted Membase documents it, not as the local engine: a note is accepted with 202
            ``queued`` (a standing fact 202 ``recorded``), and a forget's confirmation has no content, only ``how``.

    Attributes:
        base_url: The fake's own host (no request leaves the process).
        transport: The ``httpx`` transport that reaches this host: a store's ``transport=``.
        requests: Every request that reached this host, whichever key it carried.
        sources: Whether a hit carries its ``source`` (where its id lives; hosted Membase may leave it out).
        revoked: Set it to answer every request with 403, as for a key revoked or expired.
    """

    def __init__(self, *, key: str = API_KEY, level: str = "full", profile: bool = True, hosted: bool = False) -> None:
        if level not in LEVELS:
            raise ValueError(f"level must be one of {LEVELS}, got {level!r}")
        self.key, self.level, self.profile, self.hosted = key, level, profile, hosted
        self.sources, self.revoked = True, False
        self.containers: list[dict[str, Any]] = [{"id": "ctr_main", "name": "Main"}]  # the Memories in reach
        self.notes: list[Note] = []  # the notes in its Memories, seeded ones too
        self.forgotten: list[Note] = []  # the notes forgotten through the API
        self.standing: list[str] = []  # the profile's standing facts
        self.unsearchable: dict[str, str] = {}  # Memory id -> why it cannot answer a search
        self._faults: dict[tuple[str, str], Iterator[Responder]] = {}
        self._numbers = itertools.count(1)
        # What the accounts of one host share (account() hands them to each): address, transport, log, accounts.
        self.base_url = f"https://membase-{next(_NUMBERS)}.test"
        self.transport = httpx.MockTransport(self.handle)
        self.requests: list[Recorded] = []
        self._accounts = {key: self}
        self._lock = threading.Lock()

    def account(self, key: str) -> InMemoryMembase:
        """The account of ``key`` on this host (made on first use, with one Memory, "Main")."""
        with self._lock:
            if key not in self._accounts:
                other = self._accounts[key] = InMemoryMembase(key=key)
                for shared in ("base_url", "transport", "requests", "_accounts", "_lock"):
                    setattr(other, shared, getattr(self, shared))
            return self._accounts[key]

    def add_memory(self, name: str, memory_id: str | None = None) -> str:
        """Add a Memory to the key's reach; returns its id."""
        new_id = memory_id or f"ctr_{len(self.containers) + 1}"
        self.containers.append({"id": new_id, "name": name})
        return new_id

    def remember(self, content: str, container: str = "ctr_main") -> str:
        """Seed a note, as if saved earlier, in the Memory with this id or name; returns its id."""
        return self._keep(Note(content=content, container=self._id_of(container), seeded=True)).id

    def cannot_answer(self, container: str, reason: str = "the memory is not available") -> None:
        """Make one Memory (by id or name) report that it could not answer searches."""
        self.unsearchable[self._id_of(container)] = reason

    def saved(self, container: str | None = None) -> list[str]:
        """The text of the notes saved through the API (not seeded or forgotten ones), optionally in one Memory."""
        wanted = None if container is None else self._id_of(container)
        return [n.content for n in self.notes if not n.seeded and wanted in (None, n.container)]

    def store(self, **options: Any) -> MembaseMemoryStore:
        """A :class:`~membase_strands.MembaseMemoryStore` built from this account's key, as in production."""
        return MembaseMemoryStore(api_key=self.key, base_url=self.base_url, transport=self.transport, **options)

    def pool(self, credential_for: Callable[[str], str], **options: Any) -> MembaseStorePool:
        """A :class:`~membase_strands.MembaseStorePool` whose users' keys (``credential_for``) reach this host."""
        return MembaseStorePool(credential_for, base_url=self.base_url, transport=self.transport, **options)

    def on(self, method: str, path: str, *responders: Responder) -> None:
        """Answer the next requests of this key to ``method path`` with ``responders``, one each, in order (a path
        that ends in an id is named ``/v1/memories/{id}``)."""
        self._faults[(method, path)] = itertools.chain(self._faults.get((method, path), ()), responders)

    def always(self, method: str, path: str, responder: Responder) -> None:
        """Answer every request of this key to ``method path`` with ``responder``."""
        self._faults[(method, path)] = itertools.repeat(responder)

    def heal(self) -> None:
        """Drop every injected fault."""
        self._faults.clear()

    def sent(self, method: str | None = None, path: str | None = None) -> list[Recorded]:
        """The requests this account's key sent, optionally only those to one route."""
        return [r for r in self.requests if r.key == self.key and method in (None, r.method) and path in (None, r.path)]

    def _id_of(self, container: str) -> str:
        return next((str(c["id"]) for c in self.containers if container in (c["id"], c["name"])), container)

    def handle(self, request: httpx.Request) -> httpx.Response:
        """Record ``request``, then answer it from the account of the key it carries: with the route's next injected
        fault, if any, else as Membase would."""
        account = self.account(request.headers.get("authorization", "").removeprefix("Bearer "))
        recorded = Recorded(request.method, request.url.path, _body(request), dict(request.url.params), account.key)
        route = (request.method, re.sub(r"^(/v1/(?:memories|documents))/.+$", r"\1/{id}", request.url.path))
        with self._lock:
            self.requests.append(recorded)
            responder = next(account._faults.get(route, iter(())), None)
        return (responder or account.answer)(request)

    def answer(self, request: httpx.Request) -> httpx.Response:
        """Answer ``request`` as the in-memory Membase does, ignoring injected faults (for custom responders)."""
        route, body = (request.method, request.url.path), _body(request)
        if self.revoked:
            return error(403, "unauthorized", "invalid, expired or revoked key")
        if verb := self._above_the_key(request):
            return error(403, "unauthorized", f"tool '{verb}' is not in this agent's capability profile")
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
                return error(403, "unauthorized", f"container {container!r}: may not use that container")
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
                recorded = {"static": True, "status": "recorded", "content": content}
                return httpx.Response(202 if self.hosted else 200, json=recorded)
            container = body.get("container")
            if container is None:
                if len(self.containers) != 1:
                    return error(400, "bad_request", "several containers are in reach; name one")
                container = self.containers[0]["id"]
            elif container not in {c["id"] for c in self.containers}:
                return error(403, "unauthorized", f"container {container!r}: may not use that container")
            note = self._keep(Note(content=content, container=container, title=body.get("title") or ""))
            if self.hosted:  # accepted, learned later
                queued = {"memory_id": note.id, "document_id": f"doc_{note.id}", "status": "queued"}
                return httpx.Response(202, json={**queued, "learning_run": {"status": "queued"}})
            return httpx.Response(200, json={"memory_id": note.id, "memory_ids": [note.id], "container": container})
        if request.method == "DELETE" and request.url.path.startswith("/v1/memories/"):
            return self._forget(request.url.path.removeprefix("/v1/memories/"), request.url.params.get("confirm"))
        return error(404, "not_found", f"no route {request.method} {request.url.path}")

    def _above_the_key(self, request: httpx.Request) -> str | None:
        """The verb ``request`` asks for, when the key may not use it: above its level, or the profile not ticked."""
        route = (request.method, request.url.path)
        if route == ("GET", "/v1/profile"):
            return None if self.profile else "get_profile"
        verb, needed = ("forget_memory", "full") if request.method == "DELETE" else ("add_memory", "read_write")
        writes = request.method == "DELETE" or route == ("POST", "/v1/memories")
        return verb if writes and LEVELS.index(self.level) < LEVELS.index(needed) else None

    def _keep(self, note: Note) -> Note:
        note.id = f"{note.container}:{next(self._numbers)}"
        self.notes.append(note)
        return note

    def _forget(self, memory_id: str, confirm: str | None) -> httpx.Response:
        """Forget a note as Membase does: only with ``confirm=true``, else say what would be forgotten."""
        note = next((n for n in self.notes if n.id == memory_id), None)
        if note is None:
            return error(404, "not_found", "memory not found")
        if confirm != "true" and self.hosted:  # no content: the how sentence is for the person
            how = "Forgetting removes it from your Memory for good: a search will not find it again."
            return httpx.Response(200, json={"status": "confirmation_required", "verb": "forget_memory", "how": how})
        if confirm != "true":
            body = {"status": "confirmation_required", "memory_id": note.id, "content": note.content}
            return httpx.Response(200, json={**body, "how": "Pass confirm=true to remove it."})
        self.notes.remove(note)
        self.forgotten.append(note)
        return httpx.Response(200, json={"status": "forgotten", "memory_id": note.id})

    def _hits(self, query: str, container: str | None, limit: int) -> list[dict[str, Any]]:
        """The notes that share the most words with ``query``, best first, as Membase lists passages."""
        wanted = _words(query)
        names = {c["id"]: c["name"] for c in self.containers}
        notes = [n for n in self.notes if container in (None, n.container) and n.container not in self.unsearchable]
        scored = sorted(((len(wanted & _words(n.content)), n) for n in notes), key=lambda pair: -pair[0])
        return [
            {"content": n.content, "container": n.container, "title": n.title}
            | {"container_name": names.get(n.container, n.container), "score": float(overlap)}
            | ({"source": f"episode:{n.id}"} if self.sources else {})
            for overlap, n in scored[:limit]
            if overlap
        ]


def error(status: int, code: str, message: str, headers: dict[str, str] | None = None) -> httpx.Response:
    """A Membase error envelope. Retry-After 0 keeps the SDK's retries instant in tests."""
    body = {"error": {"code": code, "message": message, "details": None, "retryable": status == 429, "trace_id": ""}}
    return httpx.Response(status, json=body, headers={"Retry-After": "0", **(headers or {})})


def rate_limited(request: httpx.Request) -> httpx.Response:
    """A responder answering as hosted Membase does when the account already runs two agent turns (a standing fact,
    a forget): 429 ``rate_limited``, with no Retry-After."""
    response = error(429, "rate_limited", "the account already runs two agent turns")
    del response.headers["Retry-After"]
    return response


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
