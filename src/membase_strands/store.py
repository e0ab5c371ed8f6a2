"""``MembaseMemoryStore``: a Strands ``MemoryStore`` over a person's Membase memory.

Recall, captured writes and the set-up check run on ``_runtime``'s daemon threads while their caller waits within a
budget, so a slow or unreachable Membase costs a turn at most its budget; the tools run on the thread Strands gives
them. Every attempt ends at ``request_timeout`` in its socket (``_http``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, Any, TypeVar

import httpx
import membase
from strands.memory import MemoryEntry, SearchOptions
from strands.types.content import Message

from . import _options, _runtime, _telemetry
from ._closing import Closing
from ._containers import SetupCheck
from ._failures import LEVEL, Refused
from ._gateway import MAX_NOTE_BYTES, SAVE, MembaseGateway, too_large
from ._http import may_have_arrived
from ._recall import Recall
from ._telemetry import Ledger
from ._tools import ToolContext, build_tools
from ._writes import UNKNOWN_FATE, Part, WriteRecord, fingerprint, message_parts
from .errors import MembaseAccessError, MembaseRecallTimeout, MembaseWriteTimeout

if TYPE_CHECKING:
    from strands.memory import ExtractionConfig, MemoryStore
    from strands.types.tools import AgentTool

T = TypeVar("T")
_RETRYING_CLIENT = (
    "the client passed in retries (max_retries={}), so a captured write that timed out may be saved twice; build it "
    "with max_retries=0, or pass api_key= instead"
)


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
    ) -> None:
        """Create a store; building it makes no network call.

        Args:
            client: A ready ``membase.Membase``, used as it is (its retries too) and never closed.
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
            recall_timeout: Seconds a recall may hold the turn, which then goes on without memory (``None``: as long
                as the SDK waits, retries too).
            write_timeout: Seconds a captured write may hold its caller (``None``: one whole attempt).
            request_timeout: Seconds one attempt of a request may take, headers and body (the tools try up to 3 times).
            max_response_bytes: The largest answer read from Membase; a larger one fails the call unread.
            access_cooldown: Seconds automatic recall pauses after a 403 (the tools still try), and a verb Membase
                refused as above the key's level (saving, forgetting, the profile) is off; ``None``: never.
            close_timeout: Seconds closing waits for captured writes still running (gunicorn's grace period: 30 s).
            capture: Let the manager write to Membase (its ``add_memory`` tool, extraction).
            extraction: The manager's extraction config (``True`` for its defaults); needs ``capture=True``.
            capture_roles: Whose words a captured conversation keeps: ``"user"``, ``"assistant"`` or both.
            tools: Which of ``"search"``, ``"save"``, ``"profile"`` and ``"forget"`` to give the model.
            recall_profile: Recall also puts the profile's standing facts first in the memory block.
            profile_ttl: Seconds the standing facts read for recall are used before they are read again.

        Raises:
            ValueError: An option is invalid; the message names it.
            RuntimeError: ``local`` is a directory another process holds.
        """
        _options.check(locals())  # the arguments, each by its rule in _options, before anything is built
        self.name, self._container = name, container
        # Typed as the MemoryStore protocol declares them, so the store type-checks as one.
        self.description: str | None = description if description is not None else _options.describe(container)
        self.max_search_results: int | None = _options.passages_wanted(max_search_results, "max_search_results")
        self._recall_timeout, self._access_cooldown = recall_timeout, access_cooldown
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
        self._ledger = gateway.ledger
        if capture and client is not None and client.max_retries > 0:
            self._ledger.log(logging.WARNING, _RETRYING_CLIENT.format(client.max_retries))
        self._recall = Recall(
            gateway,
            container=self._container,
            budget=self._recall_timeout,
            hold_limit=request_timeout,
            min_score=min_score,
            max_chars=max_recall_chars,
            profile_ttl=profile_ttl if recall_profile else None,
        )
        self._writes = WriteRecord(self._ledger, write_timeout, close_timeout)
        self._tool_context = ToolContext(
            gateway=gateway,
            ledger=self._ledger,
            container=self._container,
            default_limit=lambda: self._default_limit,
            max_recall_chars=max_recall_chars,
            min_score=min_score,
            is_closed=lambda: self._closing.closed,
            ids=("forget" in self._tool_names),
        )
        self._tools: list[AgentTool] | None = None
        self._tools_lock = _runtime.new_lock()
        self._setup = SetupCheck(lambda: gateway.check_setup(container), self._ledger)  # not self: see add()
        self._closing = Closing(self, self._writes, gateway, self.name)

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
        if self._container is not None or self.writable:
            self._check_open()
            await self._setup.run(self._recall_timeout or _options.WAIT_WITHOUT_BUDGET)

    async def search(self, query: str, options: SearchOptions | None = None) -> list[MemoryEntry]:
        """Recall passages for ``query`` within ``recall_timeout`` (the manager calls this before each turn).

        Returns:
            ``[Memory name] text`` per passage, best first, then a notice per Memory that could not answer (with
            ``recall_profile``, the standing facts first); ``[]`` for a blank query, or while recall is skipped (an
            earlier recall still runs late, or after a 403).

        Raises:
            MembaseRecallTimeout: The budget ran out; the request goes on in the background.
            MembaseAccessError: Membase refused the key (403); automatic recall pauses for ``access_cooldown``.
            RuntimeError: The store is closed.
            ValueError: ``options["max_search_results"]`` is not a whole number of at least 1.
            asyncio.CancelledError: The task was cancelled; the request goes on, and recalls skip while it runs.
        """
        with _telemetry.operation(_telemetry.RECALL, self._ledger):
            self._check_open()
            if not isinstance(query, str) or not query.strip():
                _telemetry.mark("skipped", reason="blank query")
                return []
            query = _options.query_text(query)  # what is sent, from here down to the request
            wanted = options.get("max_search_results") if options else None
            limit = _options.passages_wanted(wanted, "max_search_results", self._default_limit)
            self._ledger.count("recalls")
            return await self._await_or_report("recall", self._recall.run(query, limit))

    async def add(self, content: str, metadata: dict[str, Any] | None = None) -> Any:
        """Save the note ``content`` within ``write_timeout`` (the manager's ``add_memory`` tool and extractor call
        this); ``metadata`` may carry a ``title`` and ``static=True`` (a standing fact, for the profile).

        Returns:
            Membase's answer, or ``None`` when this store has saved the same note already.

        Raises:
            ValueError: Capture is off, the content is blank or larger than Membase takes (32 MiB), or a metadata
                flag has the wrong type.
            MembaseWriteTimeout: The budget ran out; the request goes on in the background, never sent twice.
            MembaseAccessError: Membase refused the key (403); while saving is off after a refusal above the key's
                level, at once, with no request.
            membase.MembaseError: Any other failure, so the manager keeps the write for a retry.
        """
        self._require_capture("add")
        if not isinstance(content, str) or not content or content.isspace():  # no copy: it may be too large
            raise ValueError("add needs non-blank text content")
        title, static = _options.write_flags(metadata)
        if too_large([content]):
            raise ValueError(f"add: the note is larger than Membase takes ({MAX_NOTE_BYTES // 2**20} MiB); not sent")
        if (refused := self._saving_off(1)) is not None:
            raise MembaseAccessError(refused.message, refused.refusal)
        target = None if static else self._container
        part = Part(key=fingerprint("add", target, static, title, content), text=content)
        gateway = self._gateway  # not self: a thread or a kept batch must not keep the store alive
        return await self._write([part], lambda parts: gateway.save(parts[0].text, target, static=static, title=title))

    async def add_messages(self, messages: list[Message], context: Any = None) -> Any:
        """Save a conversation batch as one note, as :meth:`add` does: the text of the messages of ``capture_roles``,
        each line starting with its role when both are captured.

        Returns:
            Membase's answer, or ``None`` when no text was left to send, all of it was saved already, or it was not
            sent: larger than Membase takes (32 MiB; a WARNING says so), or while saving is off after a refusal
            above the key's level (a DEBUG line; counted in ``writes_refused``).

        Raises:
            ValueError: Capture is off.
            MembaseWriteTimeout, MembaseAccessError, membase.MembaseError: As for :meth:`add`.
        """
        self._require_capture("add_messages")
        kept = [message for message in messages if message.get("role") in self._capture_roles]
        if too_large(block["text"] for message in kept for block in message.get("content", []) if "text" in block):
            said = f"a captured batch is larger than Membase takes ({MAX_NOTE_BYTES // 2**20} MiB): not sent"
            self._ledger.count("writes_lost", amount=len(kept))
            self._ledger.log(logging.WARNING, f"{said}, so its words are not saved", messages=len(kept))
            return None
        parts = message_parts(messages, getattr(context, "sequence_numbers", None), self._capture_roles)
        if parts and self._saving_off(len(parts)) is not None:
            return None
        gateway, container = self._gateway, self._container  # not self: see add()
        return await self._write(parts, lambda todo: gateway.save("\n".join(p.text for p in todo), container))

    def counters(self) -> dict[str, int]:
        """A snapshot of what this store has done since it was built, for logs or metrics; safe from any thread.

        The standard counters (``recalls``, ``writes_saved``, ...) are always present, the others (``errors.<kind>``,
        ``tool_calls.<tool>``, ...) once they happen: docs/observability.md says what each one counts.
        """
        return self._ledger.snapshot()

    def get_tools(self) -> list[AgentTool]:
        """The model's Membase tools chosen with ``tools=``, built once per store."""
        with self._tools_lock:  # agents built at the same moment all get the same tools
            if self._tools is None:
                self._tools = build_tools(self._tool_context, self._tool_names)
            return list(self._tools)

    def close(self) -> None:
        """Close the store, blocking (from async code, use :meth:`aclose`); safe to call twice, a client passed in is
        left open. Waits up to ``close_timeout`` for captured writes still running, sending once more a batch that
        failed with no manager retry left to bring it back; each outcome waited for is logged and counted when this
        returns, and writes still running then are logged by count. A second caller waits for the first."""
        self._closing.close()

    async def aclose(self) -> None:
        """:meth:`close` without blocking the event loop. Cancelled, it still leaves the store closed, and the
        closing goes on in the background (each outcome is logged when its write ends)."""
        await self._closing.aclose()

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

    def _check_open(self) -> None:
        if self._closing.closed:
            raise RuntimeError(f"MembaseMemoryStore '{self.name}' is closed; create a new store to use Membase again")

    def _require_capture(self, method: str) -> None:
        self._check_open()
        if not self.writable:
            raise ValueError(
                f"{method}: capture is off for store '{self.name}'; pass capture=True to let the manager "
                "write to Membase"
            )

    async def _write(self, parts: list[Part], send: Callable[[list[Part]], Any]) -> Any:
        with _telemetry.operation(_telemetry.WRITE, self._ledger, parts=len(parts)) as operation:
            if not parts:
                operation.outcome("empty", decision="nothing to send")
                return None
            result = await self._await_or_report("write", self._writes.write(parts, send))
            operation.outcome("saved")
            return result

    def _saving_off(self, parts: int) -> Refused | None:
        """The refusal that keeps saving off (above the key's level, said once at WARNING), counting the ``parts``
        not sent; None when saving is on."""
        if (refused := self._gateway.off(SAVE)) is not None:
            self._ledger.count("writes_refused", amount=parts)
            self._ledger.log(logging.DEBUG, "captured write not sent: saving is off, so its words are not saved")
        return refused

    async def _await_or_report(self, action: str, running: Awaitable[T]) -> T:
        """Await a recall or write; a failure but a time-out is counted and raised for the manager: a 403 as
        ``MembaseAccessError`` (pausing automatic recall), anything else as it came, masked if it echoes the key."""
        try:
            return await running
        except (MembaseRecallTimeout, MembaseWriteTimeout):
            raise
        except Exception as error:
            failed = error
        # Raised outside the except: no context carries the server's text.
        clean = self._gateway.without_secret(failed)
        self._ledger.failed(failed, f"{action}_errors")
        if not isinstance(failed, Refused):
            if action == "write" and isinstance(clean, membase.MembaseError) and may_have_arrived(failed):
                said = type(clean)(f"{clean.message}: {UNKNOWN_FATE}", status=clean.status)  # what the manager shows
                said.__cause__ = clean
                raise said
            raise clean
        if action == "recall":
            paused = ""
            if self._access_cooldown is not None:
                self._gateway.pause_recall(failed)
                paused = f"; automatic recall paused for {self._access_cooldown:g} s"
            # INFO: the manager logs a failed recall as a warning, and once is enough.
            self._ledger.log(logging.INFO, f"recall refused by Membase{paused}", error=failed)
        elif failed.refusal != LEVEL:  # the gateway said a refusal above the key's level once
            self._ledger.log(logging.WARNING, "write refused by Membase", error=failed)
        refused = MembaseAccessError(failed.message, failed.refusal)
        refused.__cause__ = clean
        raise refused


def ledger_of(store: MembaseMemoryStore) -> Ledger:
    """The store's record of what it did (it outlives the store while a write of its runs)."""
    return store._ledger


if TYPE_CHECKING:
    # mypy checks here that the store satisfies the protocol the MemoryManager is typed against.
    _as_memory_store: MemoryStore = MembaseMemoryStore()
