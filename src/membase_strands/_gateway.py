"""The one door to Membase: a store's :class:`MembaseGateway` holds the SDK clients, looks Memory names up as ids,
says what a refusal means, and runs each call as a ``_calls.Call``.

From a key, three SDK clients over the store's own connections (``_http.clients``): the tools' retries as the SDK does
(to wait out a waking memory); recall's makes one attempt (a late request holds recall back for one attempt, not
three); writes' makes one attempt on a fresh connection (a POST that timed out may be stored already). A ``client=``
is used as it is, and must not retry if it writes."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
import urllib.parse
import weakref
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

import httpx
import membase

from . import _http, _local
from ._calls import Call, OnEnd, OnLateEnd, Outcome, reset_in_forked_child, run
from ._containers import Container, match, names_in_reach, parse_containers
from ._failures import ACCESS_SENTENCE, LEVEL, REACH, BadResponseError, Refused, masking, refusal_of
from ._formatting import SearchAnswer, facts, memory_label, parse_search
from ._log import StoreLog
from ._text import sendable

T = TypeVar("T")

DEFAULT_BASE_URL = "https://api.app.membase.com"
# What the SDK lets through for a 2xx whose body it cannot decode (``response.json()`` raises either).
_UNREADABLE = (json.JSONDecodeError, UnicodeDecodeError)
MAX_NOTE_BYTES = 32 * 1024 * 1024  # Membase takes uploads of up to 32 MiB a file, and a note is one
_SLICE = 1024 * 1024  # characters encoded at a time to measure a note

# Membase's verbs that a key's level may refuse, and automatic recall (paused after a 403), by the names Membase uses.
SAVE, FORGET, PROFILE, RECALL = "add_memory", "forget_memory", "get_profile", "recall"
# verb -> (what the key may not do, as the model reads it; what the store does while the verb is disabled)
_LEVELS = {
    SAVE: (
        "may not save notes: saving needs a key with Read & write access",
        "captured writes are not sent (their words are not saved; capture=False stops capturing) and membase_save "
        "answers without a request; recall goes on",
    ),
    FORGET: ("may not forget or delete: that needs a key with Full access", "membase_forget answers without a request"),
    PROFILE: (
        "may not read the profile: its owner did not allow it (the 'Your profile' tick)",
        "recall_profile and membase_profile leave the profile out",
    ),
}
_OWNER = "Its owner can change that on the key's page in the Membase app (Connect › Developer keys)."


class MembaseGateway:
    """One store's access to one person's Membase. ``hosted``: reached with a key; ``local``: the local directory, if
    any; ``location``: where, for messages and ``repr`` (never the key); ``log``: the store's counters and log lines."""

    def __init__(
        self,
        *,
        client: membase.Membase | None = None,
        api_key: str | None = None,
        base_url: str | None = None,
        local: str | os.PathLike[str] | None = None,
        transport: httpx.BaseTransport | None = None,
        request_timeout: float = 90.0,
        max_response_bytes: int = 16 * 1024 * 1024,
        access_cooldown: float | None = 60.0,
        store_name: str = "membase",
    ) -> None:
        """Check the options and start a local engine, if any; no network call. ``ValueError``: bad options."""
        self._given, self._secret, self.base_url = client, "", ""
        self._route: _http.Route | None = None
        self.local: Path | None = None
        if client is not None:
            if any(option is not None for option in (api_key, base_url, local, transport)):
                raise ValueError("client: pass either a ready client or api_key/base_url/local/transport, not both")
            if not isinstance(client, membase.Membase):
                raise ValueError(f"client must be a membase.Membase, got {type(client).__name__}")
            self._secret, self.base_url = client.api_key or "", str(client.base_url)
        elif local is not None:
            if any(option is not None for option in (api_key, base_url, transport)):
                raise ValueError(
                    "local: local Membase runs on this machine and takes no api_key, base_url or transport"
                )
            self.local = _local.directory_of(local)
        else:
            key = api_key if api_key is not None else os.environ.get("MEMBASE_API_KEY")
            if key is None and (env := os.environ.get("MEMBASE_LOCAL", "").strip()):  # the SDK's convention
                self.local = _local.directory_of(True if env.lower() in ("1", "true", "yes") else env)
            else:
                self._secret = _checked_key(key)
                self.base_url = _checked_url(base_url or os.environ.get("MEMBASE_BASE_URL") or DEFAULT_BASE_URL)
                self._route = _http.route(self.base_url, transport, request_timeout, max_response_bytes)
        self.hosted = bool(self._secret)
        self.location = f"local={os.fspath(self.local)!r}" if self.local is not None else f"base_url={self.base_url!r}"
        self.key_hint, self.redact, self.mask = masking(self._secret)
        self.log = StoreLog(store_name, self.redact, self.key_hint)
        self._cooldown = access_cooldown
        self._disabled: dict[str, tuple[float, Refused]] = {}  # verb -> (until when, its refusal); one dict step each
        self._container_ids: dict[str, str] = {}  # Memory name -> id; one dict step each: no lock
        self._opened = _Opened(self.local)  # the clients, once built; let go of when closed and idle
        # A store dropped unclosed lets go of its connections too (not at exit: writes may still run then).
        weakref.finalize(self, self._opened.close).atexit = False
        self._lock = threading.Lock()
        self._running, self._closed, self._given_used_before_fork = 0, False, False
        reset_in_forked_child(self)
        if self.local is not None:
            self._client("one_read")  # the engine starts now, or says why it cannot

    def reset_after_fork(self) -> None:
        """In a forked child: the parent's connections, engine and calls are not this process's."""
        self._given_used_before_fork = self._given is not None and self._opened.clients is not None
        self._opened.forget()
        self._lock, self._running = threading.Lock(), 0

    def new_call(
        self, call: Callable[[], T], *, name: str, on_end: OnEnd | None = None, on_late_end: OnLateEnd | None = None
    ) -> Call[T]:
        """``call`` (this gateway's blocking work) as a :class:`~._calls.Call` on a thread named ``name``, to start."""

        def ended(outcome: Outcome[Any]) -> None:
            try:
                if on_end is not None:
                    on_end(outcome)
            finally:
                self._call_ended()

        with self._lock:
            self._running += 1
        return Call(call, name=name, mask=self.mask, on_end=ended, on_late_end=on_late_end)

    def run(self, call: Callable[[], T]) -> Outcome[T]:
        """Run ``call`` on this thread (the tools, the set-up check of the command line)."""
        with self._lock:
            self._running += 1
        try:
            return run(call, self.mask)
        finally:
            self._call_ended()

    def _call_ended(self) -> None:
        with self._lock:
            self._running -= 1
            opened = self._opened.taken() if self._closed and not self._running else None
        self._let_go(opened)

    def close(self) -> None:
        """Let go of the connections and the local engine: now, or once the calls still running have ended."""
        with self._lock:
            self._closed = True
            opened = None if self._running else self._opened.taken()
        self._let_go(opened)

    def _let_go(self, opened: _Opened | None) -> None:
        try:
            if opened is not None:
                opened.close()
        except Exception as error:  # nothing the user trusted is in a connection by now: say so, and go on
            self.log.log(logging.WARNING, "connections or the local engine did not close cleanly", error=error)

    def search(self, query: str, limit: int, container: str | None, *, retry: bool) -> SearchAnswer:
        """Search one Memory (a name or id) or every one in reach; ``retry``: let the SDK retry (the tools).
        ``ValueError`` when ``container`` names no Memory in reach, or several."""

        def send(client: membase.Membase, container_id: str | None) -> Any:
            if container is not None and container_id is None:  # a local Memory not made yet holds nothing
                return {"results": [], "containers": []}
            return client.search(sendable(query), container=container_id, limit=limit)

        answer = self._ask("search", self._resolved(container, send), use=_use(retry), container=container)
        return parse_search(answer, limit, self.redact)

    def save(self, content: str, container: str | None, *, static: bool = False, title: str = "") -> Any:
        """Save one note in one attempt; a 2xx whose body cannot be read counts as saved (``None``)."""
        if too_large([content]):
            raise ValueError(f"the note is larger than Membase takes ({MAX_NOTE_BYTES // 2**20} MiB); nothing was sent")

        def send(client: membase.Membase, container_id: str | None) -> Any:
            target = container if container_id is None else container_id  # a local Memory is made by its first save
            try:
                return client.memories.add(sendable(content), container=target, static=static, title=title)
            except _UNREADABLE as error:
                why = _unreadable(error)
            except BadResponseError as error:
                if not 200 <= (error.status or 0) < 300:
                    raise
                why = f"unreadable ({error.message})"  # too large, or compressed
            said = "Membase accepted the note; counting it as saved"
            self.log.log(logging.WARNING, said, reason=f"2xx answer is {why}")
            return None

        return self._ask(SAVE, self._resolved(container, send), use="one_write", container=container)

    def profile(self, topic: str | None, *, retry: bool = True) -> dict[str, Any]:
        """The profile: standing facts and recent changes (as text, masked) and, with ``topic``, relevant results."""
        body = self._ask(PROFILE, lambda client: client.profile(q=sendable(topic) if topic else None), use=_use(retry))
        if not isinstance(body, dict):
            raise BadResponseError("the profile answer is not an object")
        masked = {key: [self.redact(fact) for fact in facts(body.get(key))] for key in ("static", "dynamic")}
        return {**body, **masked}

    def forget(self, passage_id: str, *, confirm: bool) -> dict[str, Any]:
        """Forget the passage ``_formatting.passage_id`` named; unconfirmed, Membase says what it would forget."""

        def forget(client: membase.Membase) -> Any:
            if passage_id.startswith("document:"):
                document = passage_id.removeprefix("document:")
                return client.documents.delete(urllib.parse.quote(document, safe=""), confirm=confirm)
            return client.memories.forget(urllib.parse.quote(passage_id, safe=":"), confirm=confirm)

        answer = self._ask(FORGET, forget, use="one_write")
        if not isinstance(answer, dict):
            raise BadResponseError("the answer to a forget is not an object")
        return answer

    def memories_in_reach(self) -> list[Container]:
        """The Memories this key reaches, in one attempt, their names masked."""
        listed = parse_containers(self._ask("list_containers", lambda client: client.containers.list(), use="one_read"))
        return [Container(container.id, self.redact(container.name)) for container in listed]

    def container_id(self, name: str) -> str | None:
        """The id of the Memory ``name`` names (see :meth:`_looked_up`); ``ValueError`` if none or several."""
        return self._ask("list_containers", lambda client: self._looked_up(client, name), use="retried_read")

    def check_setup(self, container: str | None) -> None:
        """The store's set-up check, in one attempt: the pinned Memory's id; or, with none pinned, one Memory at most
        (capture must know where to write). ``ValueError`` when not."""
        if container is not None:
            self._ask("list_containers", lambda client: self._looked_up(client, container), use="one_read")
        elif len(containers := self.memories_in_reach()) > 1:
            raise ValueError(
                f"capture=True with several Memories in reach ({names_in_reach(containers)}) needs container= naming "
                "the one to write to"
            )

    def disabled(self, verb: str) -> Refused | None:
        """The refusal that disables ``verb`` (or :data:`RECALL`) for now, so that nothing is sent for it; or None."""
        until, refused = self._disabled.get(verb, (0.0, None))
        return refused if time.monotonic() < until else None

    def pause_recall(self, refused: Refused) -> None:
        """Pause automatic recall for ``access_cooldown`` after it met ``refused``."""
        self._disable(RECALL, refused)

    def _disable(self, verb: str, refused: Refused) -> bool:
        """Disable ``verb`` for ``access_cooldown``; whether it is news: not refused since it last succeeded."""
        entry = (time.monotonic() + (self._cooldown or 0.0), refused)
        news = self._disabled.setdefault(verb, entry) is entry  # one step: two refusals at once are news once
        self._disabled[verb] = entry
        return news

    def _client(self, use: str) -> membase.Membase:
        """The SDK client for ``use``: ``"retried_read"`` (the SDK's retries: the tools), ``"one_read"`` (one attempt:
        recall) or ``"one_write"`` (one attempt, on a connection of its own)."""
        opened = self._opened
        if (clients := opened.clients) is None:
            with self._lock:  # one build, and none while a close takes what was open
                if (clients := opened.clients) is None:
                    clients = opened.clients = self._build(opened)
        return clients[use]

    def _build(self, opened: _Opened) -> dict[str, membase.Membase]:
        if self._route is not None:
            reads, writes = opened.http = _http.clients(self._route)
            key, url = self._secret, self.base_url
            return {
                "retried_read": membase.Membase(api_key=key, base_url=url, http_client=reads),
                "one_read": membase.Membase(api_key=key, base_url=url, max_retries=0, http_client=reads),
                "one_write": membase.Membase(api_key=key, base_url=url, max_retries=0, http_client=writes),
            }
        if self.local is not None:
            engine = _local.open_engine(self.local)  # it makes one attempt
            return dict.fromkeys(("retried_read", "one_read", "one_write"), engine)
        assert self._given is not None
        if self._given_used_before_fork:
            raise RuntimeError(
                f"store '{self.log.store_name}': its Membase client (client=) was used before this process was "
                "forked, and sharing its connections would mix up the two processes' answers; build the client "
                "after the fork (for gunicorn, in post_fork), or let the store build it from the key"
            )
        return dict.fromkeys(("retried_read", "one_read", "one_write"), self._given)

    def _looked_up(self, client: membase.Membase, name: str, *, again: bool = False) -> str | None:
        """The id of the Memory ``name`` names: cached, or (first, or ``again``) from ``containers.list()``."""
        if again:
            self._container_ids.pop(name, None)
        if (container_id := self._container_ids.get(name)) is None:
            listed = parse_containers(client.containers.list())
            if self.local is not None and not listed:
                return None  # a new directory: its first save makes the Memory it names ("default", say)
            container_id = self._container_ids[name] = match(name, listed, local=self.local is not None).id
        return container_id

    def _resolved(self, wanted: str | None, send: Callable[[membase.Membase, str | None], T]) -> Callable[..., T]:
        """``send`` with the id of the Memory ``wanted`` names (or None). A cached id Membase refuses (404, or a 403 not
        about the key's level: the Memory was renamed or made anew) is looked up again and, if it changed, resent."""

        def call(client: membase.Membase) -> T:
            if wanted is None:
                return send(client, None)
            was_cached = wanted in self._container_ids
            try:
                container_id = self._looked_up(client, wanted)
            except membase.MembaseError as error:  # nothing of ``send`` went out: a copy with no body or chain says so
                raise type(error)(error.message, status=error.status) from None  # (_http.may_have_arrived)
            try:
                return send(client, container_id)
            except (membase.PermissionDeniedError, membase.NotFoundError) as error:
                above_level = isinstance(error, membase.PermissionDeniedError) and refusal_of(error) == LEVEL
                if above_level or not was_cached or self._looked_up(client, wanted, again=True) == container_id:
                    raise  # a verb above the key's level is not about the Memory: no lookup again
            return send(client, self._looked_up(client, wanted))

        return call

    def _ask(self, verb: str, call: Callable[[membase.Membase], T], *, use: str, container: str | None = None) -> T:
        """``call`` (Membase's ``verb``) with the client for ``use``, unless the verb is disabled: a 403 becomes a
        :class:`Refused`, a 2xx body that cannot be read a Membase error; a Memory name's error is masked."""
        if (refused := self.disabled(verb)) is not None:
            raise refused
        client = self._client(use)
        try:
            answer = call(client)
        except _UNREADABLE as error:
            raise BadResponseError(f"Membase answered with a body that is {_unreadable(error)}") from None
        except ValueError as error:  # the library's own, about a Memory name: it may list names Membase sent
            raise ValueError(self.redact(str(error))) from None
        except membase.PermissionDeniedError as error:
            raise self._refused(verb, error, container) from error
        self._disabled.pop(verb, None)  # allowed (again): a later refusal is news
        return answer

    def _refused(self, verb: str, error: membase.PermissionDeniedError, container: str | None) -> Refused:
        """The :class:`Refused` of a 403 to ``verb``; one above the key's level disables the verb, said once."""
        refusal = refusal_of(error)
        if refusal == REACH:
            named = f"the Memory '{memory_label(container)}'" if container else "a Memory the request named"
            outside = f"Membase refused {named}: it is outside this Membase key's reach, or no longer exists"
            return Refused(self.redact(f"{outside}; the other Memories in reach still work."), REACH)
        if refusal != LEVEL or verb not in _LEVELS:  # reading is every key's level: narrowed, if refused
            return Refused(ACCESS_SENTENCE, refusal)
        may_not, meanwhile = _LEVELS[verb]
        refused = Refused(f"This Membase key {may_not}. {_OWNER}", LEVEL)
        news = self._disable(verb, refused)
        pause = f"; for {self._cooldown:g} s {meanwhile}, then it is tried again" if self._cooldown else ""
        self.log.log(logging.WARNING if news else logging.INFO, f"this Membase key {may_not}{pause}")
        return refused


class _Opened:
    """What a gateway opened in this process: its SDK clients, its httpx clients, and, with clients, a local engine."""

    def __init__(self, local: Path | None) -> None:
        self.local = local
        self.clients: dict[str, membase.Membase] | None = None
        self.http: tuple[httpx.Client, ...] = ()

    def forget(self) -> None:
        """Drop all of it unclosed (in a forked child: the sockets and the engine are the parent's)."""
        self.clients, self.http = None, ()

    def taken(self) -> _Opened:
        """What is open, moved to an ``_Opened`` of its own to close; this one is left empty."""
        taken = _Opened(self.local)
        taken.clients, taken.http = self.clients, self.http
        self.forget()
        return taken

    def close(self) -> None:
        opened, http = self.clients is not None, self.http
        self.forget()
        with contextlib.ExitStack() as closing:  # each closed even when one before it fails; last in, first out
            if opened and self.local is not None:
                closing.callback(_local.close_engine, self.local)
            for client in http:
                closing.callback(client.close)


def _use(retry: bool) -> str:
    return "retried_read" if retry else "one_read"


def too_large(texts: Iterable[str]) -> bool:
    """Whether ``texts`` together are more UTF-8 bytes than Membase takes in a note, measured without a copy of any
    whole: by length where that settles it (``str.isascii()`` costs nothing), else a slice at a time."""
    size = 0
    for text in texts:
        if text.isascii() or size + len(text) > MAX_NOTE_BYTES:  # a character is a byte at least
            size += len(text)
        else:
            size += sum(
                len(text[at : at + _SLICE].encode("utf-8", "surrogatepass")) for at in range(0, len(text), _SLICE)
            )
        if size > MAX_NOTE_BYTES:
            return True
    return False


def looks_like_path(text: str) -> bool:
    """Whether ``text``, given where a key is expected, is a filesystem path (no Membase key looks like one)."""
    text = text.strip()
    return os.path.isabs(text) or text.startswith(("~", ".")) or os.path.exists(text)


def _checked_key(key: str | None) -> str:
    if not isinstance(key, str) or not key.strip():
        raise ValueError(
            "api_key: no Membase API key; pass api_key=, set MEMBASE_API_KEY, or pass local=DIR for local memory"
        )
    key = key.strip()  # a key read from a file or a vault often ends in a newline
    if looks_like_path(key):
        raise ValueError(
            "api_key: the value is a filesystem path, not a Membase API key (nothing was sent); for local Membase, "
            "pass the directory as local=pathlib.Path(...)"
        )
    if not key.isascii() or not key.isprintable() or " " in key:
        # It could not go into an HTTP header, and the transport's error would quote it back.
        raise ValueError("api_key: the Membase API key has spaces or characters a key cannot have; check its value")
    # Every developer key has "mbk_", its 8-character key id and "_" (13 characters) before its token (a consent
    # token is an OAuth token): a shorter value is a placeholder or a typo, whose redaction would mask words.
    if len(key) < 13:
        raise ValueError(
            "api_key: the value is too short to be a Membase API key (a developer key's mbk_<key id>_ alone is 13 "
            "characters; `membase serve` without a token takes any value of 13 or more); check its value"
        )
    return key


def _checked_url(url: str) -> str:
    parts = urllib.parse.urlsplit(url.strip()) if isinstance(url, str) else None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(
            f"base_url must be http(s)://host (e.g. {DEFAULT_BASE_URL!r}), got {url!r}; "
            "check base_url= or MEMBASE_BASE_URL"
        )
    return url.strip().rstrip("/")


def _unreadable(error: json.JSONDecodeError | UnicodeDecodeError) -> str:
    if isinstance(error, UnicodeDecodeError):
        return f"not valid UTF-8: {error.reason} at byte {error.start}"
    return f"not JSON: {error.msg}"
