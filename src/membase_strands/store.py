"""``MembaseMemoryStore``: a Strands ``MemoryStore`` over a person's Membase memory.

Recall, captured writes, the set-up check and closing run Membase's blocking calls as a ``_calls.Call`` on a library
thread, the caller waiting at most its budget (each attempt ends at ``request_timeout`` in ``_http``); the tools run
theirs on the thread Strands gives them.
"""

from __future__ import annotations

import inspect
import logging
import os
import threading
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import httpx
import membase
from strands.memory import MemoryEntry, SearchOptions
from strands.types.content import Message

from . import _options
from ._calls import Call, reset_in_forked_child
from ._gateway import MAX_NOTE_BYTES, SAVE, MembaseGateway, too_large
from ._log import StoreLog
from ._recall import Recall
from ._tools import StoreTools, build_tools
from ._writes import Part, WriteRecord, fingerprint, message_parts
from .errors import MembaseAccessError

if TYPE_CHECKING:
    from strands.memory import ExtractionConfig, MemoryStore
    from strands.types.tools import AgentTool


class MembaseMemoryStore:
    """A Strands memory store backed by Membase: put it into ``MemoryManager(stores=[...])``.

    Before each user turn the manager asks it for memory, within ``recall_timeout`` (it fails open). The model gets
    the tools ``membase_search``, ``membase_save`` and ``membase_profile``. Writing every turn is opt-in.
    """

    def __init__(
        self,
        *,
        client: membase.Membase | None = None,
        api_key: str | None = None,
        base_url: str | None = None,
        local: str | os.PathLike[str] | None = None,
        transport: httpx.BaseTransport | None = None,
        container: str | None = None,
        name: str = "membase",
        description: str | None = None,
        max_search_results: int | None = None,
        max_recall_chars: int | None = _options.DEFAULT_RECALL_CHARS,
        min_score: float | None = None,
        recall_timeout: float | None = 8.0,
        write_timeout: float | None = _options.DEFAULT_WRITE_TIMEOUT,
        request_timeout: float = _options.DEFAULT_REQUEST_TIMEOUT,
        max_response_bytes: int = _options.DEFAULT_RESPONSE_BYTES,
        access_cooldown: float | None = 60.0,
        close_timeout: float = _options.DEFAULT_CLOSE_TIMEOUT,
        capture: bool = False,
        extraction: ExtractionConfig | bool | None = None,
        capture_roles: Iterable[str] | str = ("user",),
        tools: Iterable[str] = _options.TOOL_NAMES,
        recall_profile: bool = False,
        profile_ttl: float = _options.DEFAULT_PROFILE_TTL,
        **unknown_options: Any,
    ) -> None:
        """Create a store; building it makes no network call.

        Args:
            client: A ready ``membase.Membase``, used as is and never closed; built with ``max_retries=0`` if it writes
                (capture, ``membase_save``, ``membase_forget``).
            api_key: The key when no ``client`` is given (default: ``MEMBASE_API_KEY``).
            base_url: The Membase host (default: ``MEMBASE_BASE_URL``, else ``https://api.app.membase.com``).
            local: A directory for local Membase (Python 3.12+ and ``membase-strands[local]``); one process each.
            transport: An ``httpx`` transport to send through instead of httpx's own (the testing kit's, say).
            container: The one Memory (name in any case, or id) to search and write to; ``None``: all in reach.
            name: The store's name in the ``MemoryManager``.
            description: What the manager tells the model about this store.
            max_search_results: Passages per search when the caller gives no number (1-50; default 5).
            max_recall_chars: The most passage text a search shows: whole passages, best first; ``None``: no cap.
            min_score: Leave out passages scored below this (an entry's ``metadata["score"]`` shows its score).
            recall_timeout: Seconds a recall may hold the turn (``None``: the SDK's whole wait, retries too).
            write_timeout: Seconds a captured write may hold its caller (``None``: one whole attempt).
            request_timeout: Seconds one attempt of a request may take, headers and body (the tools try up to 3 times).
            max_response_bytes: The largest answer read from Membase; a larger one fails the call unread.
            access_cooldown: Seconds recall pauses after a 403, and an action refused as above the key's level stays
                disabled; ``None``: never.
            close_timeout: Seconds closing waits for captured writes still running (gunicorn's grace period: 30 s).
            capture: Let the manager write to Membase (its ``add_memory`` tool, extraction).
            extraction: The manager's extraction config (``True`` for its defaults); needs ``capture=True``.
            capture_roles: Whose words a captured conversation keeps: ``"user"``, ``"assistant"`` or both.
            tools: Which of ``"search"``, ``"save"``, ``"profile"`` and ``"forget"`` to give the model.
            recall_profile: Recall also puts the profile's standing facts first in the memory block.
            profile_ttl: Seconds the standing facts read for recall are used before they are read again.
            **unknown_options: None is taken: a misspelt option is a ``ValueError`` naming the one meant.

        Raises:
            ValueError: An option is invalid or unknown; the message names it.
            RuntimeError: ``local`` is a directory another process holds.
        """
        if unknown_options:
            raise ValueError(_options.unknown_option(min(unknown_options), STORE_OPTIONS))
        _options.check(locals())  # the arguments, each by its rule in _options, before anything is built
        self.name, self._container = name, container
        # Typed as the MemoryStore protocol declares them, so the store type-checks as one.
        self.description: str | None = description if description is not None else _options.describe(container)
        self.max_search_results: int | None = _options.passages_wanted(max_search_results, "max_search_results")
        self._recall_timeout, self._close_timeout = recall_timeout, close_timeout
        self.writable: bool = _options.check_capture(capture, extraction)
        self.extraction = extraction
        self._capture_roles = _options.check_roles(capture_roles)
        self._tool_names = _options.check_tools(tools)

        self._gateway = gateway = MembaseGateway(
            client=client,
            api_key=api_key,
            base_url=base_url,
            local=local,
            transport=transport,
            request_timeout=request_timeout,
            max_response_bytes=max_response_bytes,
            access_cooldown=access_cooldown,
            store_name=self.name,
        )
        self._log = gateway.log
        writing_tools = [name for name in ("save", "forget") if name in self._tool_names]
        writing = ["capture=True"] * capture + [f"membase_{name}" for name in writing_tools]
        if client is not None and client.max_retries > 0 and writing:
            leave_out = " and ".join(repr(name) for name in writing_tools)
            raise ValueError(
                f"client: it retries (max_retries={client.max_retries}), so a write Membase took but answered late "
                f"would be sent again by {' and '.join(writing)}; build it with membase.Membase(..., max_retries=0), "
                "or pass api_key= instead" + ("" if capture else f", or leave {leave_out} out of tools=")
            )
        self._recall = Recall(
            gateway,
            container=container,
            budget=recall_timeout,
            request_timeout=request_timeout,
            access_cooldown=access_cooldown,
            min_score=min_score,
            max_chars=max_recall_chars,
            profile_ttl=profile_ttl if recall_profile else None,
        )
        self._writes = WriteRecord(gateway, write_timeout, close_timeout)
        self._store_tools = StoreTools(
            gateway=gateway,
            log=self._log,
            container=container,
            default_limit=lambda: self._default_limit,  # a tool held by an agent keeps its store, settings and all
            max_recall_chars=max_recall_chars,
            min_score=min_score,
            is_closed=lambda: self._closed,
            ids="forget" in self._tool_names,
        )
        self._tools: list[AgentTool] | None = None
        self._setup_check: Call[None] | None = None  # the latest check of the Memories in reach
        self._closed = False
        self._closing: Call[None] | None = None  # once closing began
        self._turns_not_captured = 0  # recalls since the last captured batch, when extraction hands the batches
        self._lock = threading.Lock()
        reset_in_forked_child(self)

    def reset_after_fork(self) -> None:
        self._lock, self._setup_check, self._closing = threading.Lock(), None, None  # the parent's threads

    def __repr__(self) -> str:
        key = f"key={self._gateway.key_hint!r}, " if self._gateway.key_hint else ""
        return (
            f"MembaseMemoryStore(name={self.name!r}, {key}{self._gateway.location}, container={self._container!r}, "
            f"capture={self.writable}, recall_timeout={self._recall_timeout!r})"
        )

    async def initialize(self) -> None:
        """Check a pinned ``container`` (or capture) against the Memories in reach when an agent is built, within
        ``recall_timeout``; past it, the check goes on in the background and first use checks the Memory too.

        Raises:
            ValueError: The pinned Memory is unknown or ambiguous, or capture is on with several Memories in reach
                and none pinned.
        """
        if self._container is None and not self.writable:
            return
        self._check_open()
        gateway, container = self._gateway, self._container
        with self._lock:
            check = self._setup_check
            if check is None or (check.outcome is not None and isinstance(check.outcome.error, membase.MembaseError)):
                check = self._setup_check = gateway.new_call(
                    lambda: gateway.check_setup(container), name=f"membase-check[{self.name}]"
                ).start()
        outcome = await check.wait(self._recall_timeout or _options.WAIT_WITHOUT_BUDGET, owner=False)
        unlisted = "could not list the Memories in reach; checking again at first use"
        if outcome is None:
            self._log.log(logging.WARNING, unlisted, reason="no answer in time")
        elif isinstance(outcome.error, ValueError):
            with self._lock:
                self._setup_check = None  # the next agent lists the Memories again: they may have changed
            raise outcome.error
        elif outcome.error is not None:
            self._log.failed(outcome.error)
            self._log.log(logging.WARNING, unlisted, error=outcome.error)

    async def search(self, query: str, options: SearchOptions | None = None) -> list[MemoryEntry]:
        """Recall passages for ``query`` within ``recall_timeout`` (the manager calls this before each turn).

        Returns:
            ``[Memory name] text`` per passage, best first (with ``recall_profile``, the standing facts first), then a
            notice per Memory that could not answer; ``[]`` for a blank query or while recall is skipped.

        Raises:
            MembaseRecallTimeout: The budget ran out; the search goes on in the background.
            MembaseAccessError: Membase refused the key (403); automatic recall pauses for ``access_cooldown``.
            RuntimeError: The store is closed.
            ValueError: ``options["max_search_results"]`` is not a whole number of at least 1.
            asyncio.CancelledError: The task was cancelled; the search goes on, and recalls skip while it runs.
        """
        self._check_open()
        if not isinstance(query, str) or not query.strip():
            self._log.annotate(outcome="skipped")
            return []
        wanted = options.get("max_search_results") if options else None
        limit = _options.passages_wanted(wanted, "max_search_results", self._default_limit)
        self._log.count("recalls")
        if self.extraction:
            self._turns_not_captured += 1
        return await self._recall.run(_options.query_text(query), limit)

    async def add(self, content: str, metadata: dict[str, Any] | None = None) -> Any:
        """Save the note ``content`` within ``write_timeout`` (the manager's ``add_memory`` tool and extractor call
        this); ``metadata`` may carry a ``title`` and ``static=True`` (a standing fact, for the profile).

        Returns:
            Membase's answer, or ``None`` when this store has saved the same note already.

        Raises:
            ValueError: Capture is off, the content is blank or over 32 MiB, or a metadata flag has the wrong type.
            MembaseWriteTimeout: The budget ran out; the request goes on in the background, never sent twice.
            MembaseAccessError: Membase refused the key (403), or saving is disabled after a refusal (no request).
            membase.MembaseError: Any other failure, so the manager keeps the write for a retry.
        """
        self._require_capture("add")
        if not isinstance(content, str) or not content or content.isspace():  # no copy: it may be too large
            raise ValueError("add needs non-blank text content")
        title, static = _options.write_flags(metadata)
        if too_large([content]):
            raise ValueError(f"add: the note is larger than Membase takes ({MAX_NOTE_BYTES // 2**20} MiB); not sent")
        if (refused := self._saving_disabled(1)) is not None:
            raise MembaseAccessError(refused.message, refused.refusal)
        target, gateway = None if static else self._container, self._gateway  # not self: see add_messages
        part = Part(key=fingerprint("add", target, static, title, content), text=content)
        return await self._writes.write([part], lambda _: gateway.save(content, target, static=static, title=title))

    async def add_messages(self, messages: list[Message], context: Any = None) -> Any:
        """Save a conversation batch as one note, as :meth:`add` does: the text of the messages of ``capture_roles``,
        each line starting with its role when both are captured.

        Returns:
            Membase's answer, or ``None`` when nothing was left to send, or it was not sent: over 32 MiB (a WARNING),
            or while saving is disabled after a refusal (counted in ``writes_refused``).

        Raises:
            ValueError: Capture is off.
            MembaseWriteTimeout, MembaseAccessError, membase.MembaseError: As for :meth:`add`.
        """
        self._require_capture("add_messages")
        self._turns_not_captured = 0
        kept = [message for message in messages if message.get("role") in self._capture_roles]
        if too_large(block["text"] for message in kept for block in message.get("content", []) if "text" in block):
            said = f"a captured batch is larger than Membase takes ({MAX_NOTE_BYTES // 2**20} MiB): not sent"
            self._log.count("writes_lost", amount=len(kept))
            self._log.log(logging.WARNING, f"{said}, so its words are not saved", messages=len(kept))
            return None
        parts = message_parts(messages, getattr(context, "sequence_numbers", None), self._capture_roles)
        if parts and self._saving_disabled(len(parts)) is not None:
            return None
        gateway, container = self._gateway, self._container  # not self: a running write must not keep the store alive
        return await self._writes.write(parts, lambda todo: gateway.save("\n".join(p.text for p in todo), container))

    def counters(self) -> dict[str, int]:
        """A snapshot of what this store has done since it was built, by counter (docs/observability.md); safe from
        any thread. The standard counters are always present, the others (``errors.<kind>``, ...) once they happen."""
        return self._log.snapshot()

    def get_tools(self) -> list[AgentTool]:
        """The model's Membase tools chosen with ``tools=``, built once per store."""
        with self._lock:  # agents built at the same moment all get the same tools
            if self._tools is None:
                self._tools = build_tools(self._store_tools, self._tool_names)
            return list(self._tools)

    def close(self) -> None:
        """Close the store, blocking (from async code, use :meth:`aclose`); safe to call twice, a client passed in is
        left open. Waits up to ``close_timeout`` for captured writes still running (then logged by count); a second
        caller waits for the first, up to ``close_timeout``."""
        closing, first = self._begin_closing()
        closing.wait_blocking(None if first else self._close_timeout, owner=False)

    async def aclose(self) -> None:
        """:meth:`close` without blocking the event loop. Cancelled, it still leaves the store closed, and the
        closing goes on in the background (each outcome is logged when its write ends)."""
        closing, first = self._begin_closing()
        await closing.wait(None if first else self._close_timeout, owner=False)

    def __enter__(self) -> MembaseMemoryStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    async def __aenter__(self) -> MembaseMemoryStore:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    @property
    def _default_limit(self) -> int:
        return self.max_search_results or _options.DEFAULT_SEARCH_RESULTS  # a plain attribute: a user may set None

    def _begin_closing(self) -> tuple[Call[None], bool]:
        """The store's closing, started by its first caller, and whether this is it."""
        writes, gateway, log, unflushed = self._writes, self._gateway, self._log, self._turns_not_captured

        def close() -> None:  # not self: a store dropped while it closes must be collectable
            writes.drain(time.monotonic() + writes.close_timeout)
            if unflushed:
                log.log(logging.WARNING, _UNFLUSHED.format(unflushed), turns=unflushed)
            gateway.close()

        with self._lock:
            self._closed, first = True, self._closing is None
            if self._closing is None:
                self._closing = gateway.new_call(close, name=f"membase-close[{self.name}]").start()
            return self._closing, first

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"MembaseMemoryStore '{self.name}' is closed; create a new store to use Membase again")

    def _require_capture(self, method: str) -> None:
        self._check_open()
        if not self.writable:
            raise ValueError(
                f"{method}: capture is off for store '{self.name}'; pass capture=True to let the manager "
                "write to Membase"
            )

    def _saving_disabled(self, parts: int) -> Any:
        """The refusal that keeps saving disabled, counting the ``parts`` not sent; None when saving is allowed."""
        if (refused := self._gateway.disabled(SAVE)) is not None:
            self._log.count("writes_refused", amount=parts)
            self._log.log(logging.DEBUG, "captured write not sent: saving is disabled, so its words are not saved")
        return refused


_UNFLUSHED = (
    "closed with {} turn(s) recalled since the last captured batch: their words never reached this store, and are "
    "not saved. The manager hands a batch over when it flushes: a synchronous agent call does it at its end; after "
    "invoke_async, call `await agent.shutdown_async()` (strands-agents 1.61+) or `await agent.memory_manager.flush()` "
    "before closing the store"
)


STORE_OPTIONS = [name for name in inspect.signature(MembaseMemoryStore).parameters if name != "unknown_options"]


def begin_closing(store: MembaseMemoryStore) -> tuple[Call[None], WriteRecord]:
    """Begin closing ``store`` (a pool closes its stores side by side); the call to wait for, and the store's writes."""
    return store._begin_closing()[0], store._writes


def join_pool(store: MembaseMemoryStore, totals: StoreLog) -> WriteRecord:
    """Count what ``store`` does in ``totals`` too (a pool's), even after the store is gone (a write of it runs); its
    writes, for the pool's close to wait for when the store was dropped and is gone."""
    store._log.totals = totals
    return store._writes


if TYPE_CHECKING:
    # mypy checks here that the store satisfies the protocol the MemoryManager is typed against.
    _as_memory_store: MemoryStore = MembaseMemoryStore()
