"""``MembaseMemoryStore``: a Strands ``MemoryStore`` over a person's Membase memory."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from concurrent.futures import Future, wait
from typing import TYPE_CHECKING, Any, NoReturn

import membase
from strands.memory import MemoryEntry, SearchOptions
from strands.types.content import Message

from . import _background, _options, _telemetry
from ._background import wait_for_future
from ._containers import Container, match, names_in_reach
from ._counters import Counters
from ._failures import ACCESS_SENTENCE, describe_failure, detail_of
from ._formatting import SearchAnswer, arrange, memory_entries
from ._gateway import MembaseGateway
from ._recall import RecallSkipped, TimeBoxedRecall
from ._tools import ToolContext, build_tools
from ._writes import Part, WriteRecord, fingerprint
from .errors import MembaseAccessError, MembaseRecallTimeout, MembaseWriteTimeout

if TYPE_CHECKING:
    from strands.memory import ExtractionConfig, MemoryStore
    from strands.types.tools import AgentTool

logger = logging.getLogger(__name__)


class MembaseMemoryStore:
    """A Strands memory store backed by Membase.

    Put it into ``MemoryManager(stores=[...])``. Before each user turn the manager asks it for
    memory: that recall is time-boxed (``recall_timeout``) and fails open, so a slow or unreachable
    Membase costs a turn at most the budget. The model also gets three tools (``membase_search``,
    ``membase_save``, ``membase_profile``). Writing every turn is opt-in (``capture=True``).

    Building a store makes no network call. All arguments are keyword-only.
    """

    def __init__(
        self,
        *,
        client: membase.Membase | None = None,
        api_key: str | None = None,
        base_url: str | None = None,
        local: str | os.PathLike[str] | None = None,
        container: str | None = None,
        name: str = "membase",
        description: str | None = None,
        max_search_results: int | None = None,
        max_recall_chars: int | None = _options.DEFAULT_RECALL_CHARS,
        min_score: float | None = None,
        recall_timeout: float | None = 8.0,
        write_timeout: float | None = _options.DEFAULT_WRITE_TIMEOUT,
        access_cooldown: float | None = 60.0,
        capture: bool = False,
        extraction: ExtractionConfig | bool | None = None,
        capture_roles: Iterable[str] | str = ("user",),
        tools: Iterable[str] = _options.TOOL_NAMES,
    ) -> None:
        """Create a store.

        Args:
            client: A ready ``membase.Membase`` client. The store never closes a client it was given.
            api_key: The Membase API key, when no ``client`` is given. Defaults to ``MEMBASE_API_KEY``.
            base_url: The Membase host. Defaults to ``MEMBASE_BASE_URL``, else ``https://api.app.membase.com``.
            local: A directory for local Membase (needs Python 3.12+ and ``membase-strands[local]``).
            container: One Memory, by name (any case) or id, to search and write to. ``None``
                searches every Memory in the key's reach.
            name: The store's name in the ``MemoryManager``.
            description: The sentence the manager shows the model about this store.
            max_search_results: Passages per search when the caller gives no number (1-50; default 5).
            max_recall_chars: A cap on the passage text one search returns to the model, in characters
                (default 20,000, about 5,000 tokens): whole passages, best first; a passage that alone
                exceeds it is cut with a visible marker. ``None``: no cap.
            min_score: A relevance floor: passages Membase scored below it are left out of recall and
                ``membase_search`` (which says how many). ``None`` (the default) keeps every passage.
                Scores depend on the Membase deployment; ``python -m membase_strands check`` shows
                the range it sees.
            recall_timeout: Seconds the automatic recall may take before the turn goes on without
                memory; ``None`` waits as long as the SDK does.
            write_timeout: Seconds a captured write (``add``, ``add_messages``) may hold the caller
                before it raises so the manager keeps the batch for a retry; the request goes on
                in the background and is never sent twice. ``None`` waits for one full attempt.
            access_cooldown: Seconds automatic recall pauses after Membase refuses the key (403), so a
                revoked key is not hit on every turn; the tools still try. ``None``: never pause.
            capture: Let the manager write to Membase (its ``add_memory`` tool, extraction).
            extraction: The manager's extraction config (``True`` for its defaults); needs ``capture=True``.
            capture_roles: Whose words a captured conversation keeps: ``"user"``, ``"assistant"`` or both.
            tools: Which of ``"search"``, ``"save"`` and ``"profile"`` to give the model.

        Raises:
            ValueError: An option is invalid; the message names it.
        """
        self.name = _options.check_name(name)
        self._container = _options.check_container(container)
        # Typed as the MemoryStore protocol declares them, so the store type-checks as one.
        self.description: str | None = description if description is not None else _options.describe(container)
        self.max_search_results: int | None = _options.passages_wanted(max_search_results, "max_search_results")
        self._max_recall_chars = _options.check_recall_chars(max_recall_chars)
        self._min_score = _options.check_min_score(min_score)
        self._recall_timeout = _options.check_timeout("recall_timeout", recall_timeout)
        self._write_timeout = _options.check_timeout("write_timeout", write_timeout)
        self._access_cooldown = _options.check_timeout("access_cooldown", access_cooldown)
        self._refused_until = 0.0  # monotonic time until which automatic recall is paused after a 403
        if not isinstance(capture, bool):
            raise ValueError(f"capture must be True or False, got {capture!r}")
        if extraction not in (None, False) and not capture:
            raise ValueError("extraction needs capture=True: without capture the store accepts no writes")
        self._capture = capture
        self.extraction = extraction
        self._capture_roles = _options.check_roles(capture_roles)
        self._tool_names = _options.check_tools(tools)

        self._gateway = MembaseGateway(
            client=client, api_key=api_key, base_url=base_url, local=local, store_name=self.name
        )
        if capture and client is not None and client.max_retries > 0:
            logger.warning(
                "store=<%s>, reason=<client retries> | the client passed in retries (max_retries=%d), so a captured "
                "write that timed out may be saved twice; build it with max_retries=0, or pass api_key= instead",
                self.name,
                client.max_retries,
            )
        self._counters = Counters()
        _telemetry.register_store(self)  # its counters as OpenTelemetry metrics, if a meter provider is set
        redact = self._gateway.redact
        self._recall = TimeBoxedRecall(self.name, self._counters, redact, is_closed=self._engine_closed)
        self._writes = WriteRecord(self.name, self._counters, redact, budget=self._write_timeout)
        self._closed = False
        self._close_lock = threading.Lock()
        self._closing: Future[None] | None = None  # settled once the first close() or aclose() has finished
        self._setup_lock = threading.Lock()
        self._setup_check: Future[list[Container]] | None = None
        self._setup_check_late: Future[list[Container]] | None = None  # a check an agent already waited out
        self._setup_checked = False
        self._tools: list[AgentTool] | None = None
        _background.reset_after_fork(self)
        # A store dropped without close() (say, one a pool let go of) must not keep its local engine: close it
        # once the store is collected, after the writes still running on it (a write whose caller was cancelled
        # holds no store). The callback holds the gateway and the write record, never the store.
        self._finalizer: weakref.finalize[Any, Any] | None = None
        if self._gateway.owns_engine:
            running = self._writes.running
            self._finalizer = weakref.finalize(self, _close_unused, self._gateway.close, self.name, running)
            self._finalizer.atexit = False  # at exit the process lets go of everything; a daemon write may run

    @property
    def writable(self) -> bool:
        """Whether the manager may write to this store; the same thing as ``capture``."""
        return self._capture

    @writable.setter
    def writable(self, value: bool) -> None:
        # The protocol declares a plain attribute; writing is decided once, by capture= and extraction=.
        raise AttributeError("writable follows capture=; build the store with capture=True to let the manager write")

    def __repr__(self) -> str:
        return (
            f"MembaseMemoryStore(name={self.name!r}, {self._gateway.location}, container={self._container!r}, "
            f"capture={self._capture}, recall_timeout={self._recall_timeout!r})"
        )

    # --- The MemoryStore protocol -------------------------------------------------------------

    async def initialize(self) -> None:
        """Check the configuration against Membase before the agent runs, without depending on it.

        With a pinned ``container`` (or capture on) the Memories in reach are listed once, within
        the recall budget. An unknown or ambiguous Memory name, or capture with several Memories in
        reach and none pinned, raises here so the mistake shows when the agent is built. If
        Membase does not answer, the check is left for the first real call. While that late check
        is still running, agents built on this store do not wait for it again; the first one built
        after it ends uses its answer.

        Raises:
            ValueError: The configuration cannot work with the Memories this key reaches.
        """
        if self._container is None and not self._capture:
            return
        self._check_open()
        with self._setup_lock:
            if self._setup_checked:
                return  # one check per store, however many agents are built on it
            check = self._setup_check
            if check is not None and check is self._setup_check_late and not check.done():
                # An agent already waited the whole budget for this check during this outage; building an
                # agent per request must not cost every request that wait again.
                logger.debug(
                    "store=<%s>, reason=<Membase did not answer in time> | set-up check is still running; "
                    "not waiting for it again, checking at first use",
                    self.name,
                )
                return
            if check is None or (check.done() and check.exception() is not None):
                # A check still running (Membase slow to answer) is shared, never started twice; one that
                # ended late with an answer is used below; one that failed tells nothing, so ask again.
                check = _background.submit(
                    self._gateway.memories_in_reach, name=f"membase-check[{self.name}]", lane=self._gateway
                )
                self._setup_check = check
        try:
            containers = await wait_for_future(check, self._recall_timeout or _options.WAIT_WITHOUT_BUDGET)
        except asyncio.TimeoutError:
            with self._setup_lock:
                first = self._setup_check_late is not check
                self._setup_check_late = check
            if first:  # agents built together during one outage warn once
                logger.warning(
                    "store=<%s>, reason=<no answer in time> | could not list the Memories in reach; "
                    "checking again at first use",
                    self.name,
                )
            return
        except membase.MembaseError as error:
            logger.warning(
                "store=<%s>, reason=<%s> | could not list the Memories in reach; checking again at first use",
                self.name,
                self._gateway.redact(detail_of(error)),
            )
            return
        try:
            if self._container is not None:
                self._gateway.remember_container(self._container, match(self._container, containers).id)
            elif len(containers) > 1:
                raise ValueError(
                    f"capture=True with several Memories in reach ({names_in_reach(containers)}) needs container= "
                    "naming the one to write to"
                )
        except ValueError:
            with self._setup_lock:
                if self._setup_check is check:
                    self._setup_check = None  # the next agent lists the Memories again: they may have changed
            raise
        self._setup_checked = True

    async def search(self, query: str, options: SearchOptions | None = None) -> list[MemoryEntry]:
        """Recall passages for ``query``, within ``recall_timeout``.

        A recall skipped because an earlier one is still running late (the memory is waking) or
        because recall is paused after a 403 is not a failure: it returns ``[]`` without a request
        and logs at DEBUG, so a long outage costs one warning, not one per turn.

        Args:
            query: What to recall; a blank query returns ``[]`` without a request.
            options: ``max_search_results`` (1-50; more is capped at 50).

        Returns:
            One entry per passage, ``[Memory name] text``, best first (when Membase scored them), a text
            several Memories returned shown once, none scored below ``min_score``; then one notice per
            Memory that could not answer. ``[]`` for a skipped recall.

        Raises:
            MembaseRecallTimeout: The budget ran out (the request goes on in the background).
            MembaseAccessError: Membase refused the key (403); automatic recall then pauses for
                ``access_cooldown`` seconds.
            RuntimeError: The store is closed, or was closed while the recall was running.
            ValueError: ``max_search_results`` is not a positive whole number.
            asyncio.CancelledError: The caller's task was cancelled; the request goes on in the
                background, and the next recalls skip while it runs.
        """
        with _telemetry.operation(_telemetry.RECALL, self.name) as operation:
            entries = await self._search(query, options)
            operation.text(_telemetry.PASSAGES_TEXT, [entry.content for entry in entries])
            return entries

    async def _search(self, query: str, options: SearchOptions | None) -> list[MemoryEntry]:
        self._check_open()
        if not isinstance(query, str) or not query.strip():
            _telemetry.annotate("skipped", reason="blank query")
            return []
        _telemetry.current_text(_telemetry.QUERY_TEXT, query)
        wanted = options.get("max_search_results") if options else None
        limit = _options.passages_wanted(wanted, "max_search_results", self._default_limit)
        # With a budget, one attempt: a late request must hold the in-flight guard for one attempt, not three.
        retry = self._recall_timeout is None
        text = _options.query_text(query)
        self._counters.add("recalls")
        if time.monotonic() < self._refused_until:
            self._counters.add("recall_skipped")
            logger.debug("store=<%s>, reason=<key refused (403)> | recall skipped while recall is paused", self.name)
            _telemetry.annotate("skipped", reason="key refused (403)")
            return []
        try:
            answer = await self._recall.run(
                lambda: _background.submit(
                    lambda: self._gateway.search(text, limit, self._container, retry=retry),
                    name=f"membase-recall[{self.name}]",
                    lane=self._gateway,
                ),
                self._recall_timeout,
            )
        except RecallSkipped:
            _telemetry.annotate("skipped", reason="memory waking")
            return []  # counted and logged at DEBUG by the guard
        except MembaseRecallTimeout:
            raise
        except Exception as error:
            if self._engine_closed():
                # close() closed the local engine under the request: report that, not the engine's error.
                self._counters.add("recall_errors")
                self._counters.add("errors.closed")
                logger.debug("store=<%s>, reason=<store closed> | recall ended by close()", self.name)
                _telemetry.annotate("error", error_kind="closed")
                raise RuntimeError(
                    f"MembaseMemoryStore '{self.name}' was closed while the recall was running; nothing was recalled"
                ) from None
            pause = ""
            if isinstance(error, membase.PermissionDeniedError) and self._access_cooldown is not None:
                self._refused_until = time.monotonic() + self._access_cooldown
                pause = f"; automatic recall paused for {self._access_cooldown:g} s"
            # The manager logs the raised error as a warning; the store's own line would be a second one.
            self._fail("recall", error, pause, level=logging.INFO)
        # The manager keeps only the first `limit` entries: make room for the notices, so a Memory that
        # could not answer is never dropped silently behind a full page of passages.
        answer = self._arrange(answer, max(0, limit - len(answer.unsearched)))
        self._counters.add("recall_hits" if answer.passages else "recall_empty")
        entries = memory_entries(answer)
        _telemetry.annotate(
            "hit" if answer.passages else "empty",
            passages=len(entries) - len(answer.unsearched),
            chars_injected=sum(len(entry.content) for entry in entries),
            unanswered=len(answer.unsearched),
        )
        return entries

    async def add(self, content: str, metadata: dict[str, Any] | None = None) -> Any:
        """Save one note (the manager's ``add_memory`` tool and extractor write through this).

        Args:
            content: The note.
            metadata: Optional ``title`` (a string) and ``static`` (a bool: ``True`` records a
                standing fact in the profile). Other keys are ignored.

        Returns:
            Membase's answer.

        Raises:
            ValueError: Capture is off, the content is blank, or a metadata flag has the wrong type.
            MembaseAccessError: Membase refused the key (403).
            membase.MembaseError: Any other failure, so the manager keeps the write for a retry.
        """
        self._require_capture("add")
        if not isinstance(content, str) or not content.strip():
            raise ValueError("add needs non-blank text content")
        title, static = _options.write_flags(metadata)
        target = None if static else self._container
        part = Part(key=fingerprint("add", target, static, title, content), text=content)
        gateway = self._gateway  # not self: a batch kept for sending again must not keep the store alive
        return await self._write([part], lambda parts: gateway.save(parts[0].text, target, static=static, title=title))

    async def add_messages(self, messages: list[Message], context: Any = None) -> Any:
        """Save the text of a conversation batch as one note (extraction without an extractor).

        Only messages whose role is in ``capture_roles`` are kept; with both roles, each line
        starts with its role. A batch with no text left sends nothing.

        Returns:
            Membase's answer, or ``None`` when nothing was sent.

        Raises:
            ValueError: Capture is off.
            MembaseAccessError: Membase refused the key (403).
            membase.MembaseError: Any other failure, so the manager keeps the batch for a retry.
        """
        self._require_capture("add_messages")
        parts = self._parts_of(messages, getattr(context, "sequence_numbers", None))
        if not parts:
            with _telemetry.operation(_telemetry.WRITE, self.name, parts=0) as operation:
                operation.outcome("empty", decision="nothing to send")
            return None
        gateway, container = self._gateway, self._container  # not self: see add()
        return await self._write(
            parts,
            lambda todo: gateway.save("\n".join(p.text for p in todo), container),
        )

    def counters(self) -> dict[str, int]:
        """A snapshot of what this store has done since it was built, for logs or metrics.

        Always present: ``recalls`` and their outcomes (``recall_hits``, ``recall_empty``,
        ``recall_timeouts``, ``recall_skipped``, ``recall_cancelled``, ``recall_errors``),
        ``recall_late_completions``, ``writes_saved``, ``writes_deduplicated``, ``write_timeouts``,
        ``write_cancellations`` and ``write_errors``. Present once they happen: ``errors.<kind>`` for each
        kind of Membase failure, ``tool_calls.<tool>``, and the passages recall left out:
        ``recall_passages_folded`` (copies of a text several Memories returned) and
        ``recall_passages_below_floor`` (scored below ``min_score``).
        Cheap and safe to call from any thread.
        """
        return self._counters.snapshot()

    def get_tools(self) -> list[AgentTool]:
        """The model's Membase tools chosen with ``tools=``, built once per store."""
        if self._tools is None:
            built = build_tools(self._tool_context(), self._tool_names)
            with self._setup_lock:  # agents built at the same moment all get the tools kept first
                if self._tools is None:
                    self._tools = built
        return list(self._tools)

    def _tool_context(self) -> ToolContext:
        return ToolContext(
            gateway=self._gateway,
            counters=self._counters,
            store_name=self.name,
            container=self._container,
            default_limit=self._default_limit,
            max_recall_chars=self._max_recall_chars,
            min_score=self._min_score,
            is_closed=lambda: self._closed,
        )

    # --- Lifecycle ----------------------------------------------------------------------------

    def close(self) -> None:
        """Close the store; safe to call twice. A client passed in is left open.

        A captured write still running (one that ran out of its budget) gets up to ``write_timeout`` more
        seconds to finish first; when it does, its outcome is logged and counted before this returns. This
        blocks the calling thread meanwhile: from async code, use :meth:`aclose` (or ``async with``). If another
        thread is already closing the store, this waits (as long) for it to finish.
        """
        first, closed = self._begin_close()
        if not first:
            wait([closed], timeout=self._drain_budget())
            return
        try:
            self._writes.drain()
        finally:
            closing = self._release()
            closed.set_result(None)
        if closing is not None:
            closing.result()

    async def aclose(self) -> None:
        """:meth:`close` for async code: the same, without blocking the event loop. Safe to call twice.

        Captured writes still running get up to ``write_timeout`` more seconds to finish, awaited on the
        running loop (any loop), and each one that does has its outcome logged and counted before this
        returns. If this is cancelled, the store still ends closed, and the writes still running go on (their
        outcome is logged when they end). If another task or thread is already closing the store, this waits
        (as long) for it to finish.
        """
        first, closed = self._begin_close()
        if not first:
            with contextlib.suppress(asyncio.TimeoutError):
                await wait_for_future(closed, self._drain_budget())
            return
        try:
            await self._writes.drain_async()
        finally:
            closing = self._release()  # also when cancelled: the store never ends half closed
            closed.set_result(None)
        if closing is not None:
            await wait_for_future(closing, None)

    def __enter__(self) -> MembaseMemoryStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    async def __aenter__(self) -> MembaseMemoryStore:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def _begin_close(self) -> tuple[bool, Future[None]]:
        """Mark the store closed; whether this caller is the first (and closes it), and a future settled once closed."""
        with self._close_lock:
            if self._closing is not None:
                return False, self._closing
            self._closed = True
            self._closing = Future()
            return True, self._closing

    def _drain_budget(self) -> float:
        return self._write_timeout or _options.WAIT_WITHOUT_BUDGET

    def _release(self) -> Future[None] | None:
        """Close the local engine this store started, on a thread, once no write still uses it.

        A hosted store has nothing of its own to close: its connections belong to the process's shared pool.
        Returns the close's future when no write was running (the caller waits for it), else ``None``: the
        engine closes after the last write ends, so no write loses the engine under it.
        """
        if not self._gateway.owns_engine:
            return None
        if self._finalizer is not None:
            self._finalizer.detach()
        running = self._writes.running()
        gateway = self._gateway

        def close_engine() -> None:
            wait(running)
            gateway.close()

        closing = _background.submit(close_engine, name=f"membase-close[{self.name}]")
        return None if running else closing

    # --- Private helpers ----------------------------------------------------------------------

    def _arrange(self, answer: SearchAnswer, most: int) -> SearchAnswer:
        """Recall's passages best first, each text once, none below ``min_score``, at most ``most`` within
        the recall budget; counts what was left out.

        (``benchmarks/recall_quality`` overrides this to measure the store as it was without it.)
        """
        arranged = arrange(answer, most, min_score=self._min_score, budget=self._max_recall_chars)
        if arranged.folded:
            self._counters.add("recall_passages_folded", arranged.folded)
        if arranged.below_floor:
            self._counters.add("recall_passages_below_floor", arranged.below_floor)
        if arranged.folded or arranged.below_floor:
            logger.debug(
                "store=<%s>, folded=<%d>, below_floor=<%d> | passages left out of recall",
                self.name,
                arranged.folded,
                arranged.below_floor,
            )
        return arranged

    def _after_fork_in_child(self) -> None:
        # The guard, the write record, the counters and the gateway reset themselves; these are the store's own.
        self._setup_lock = threading.Lock()
        self._close_lock = threading.Lock()
        if self._setup_check is not None and not self._setup_check.done():
            self._setup_check = None  # its thread is the parent's: it will never finish here

    def _engine_closed(self) -> bool:
        """Whether close() closed the local engine this store started (a failure then is the close's doing)."""
        return self._closed and self._gateway.owns_engine

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"MembaseMemoryStore '{self.name}' is closed; create a new store to use Membase again")

    @property
    def _default_limit(self) -> int:
        """Passages to ask for when the caller gives no number (``max_search_results`` is a plain attribute)."""
        return self.max_search_results or _options.DEFAULT_SEARCH_RESULTS

    def _require_capture(self, method: str) -> None:
        self._check_open()
        if not self._capture:
            raise ValueError(
                f"{method}: capture is off for store '{self.name}'; "
                "pass capture=True to let the manager write to Membase"
            )

    async def _write(self, parts: list[Part], send: Any) -> Any:
        with _telemetry.operation(_telemetry.WRITE, self.name, parts=len(parts)) as operation:
            operation.text(_telemetry.NOTE_TEXT, [part.text for part in parts])
            try:
                result = await self._writes.write(parts, send)
            except MembaseWriteTimeout:
                raise
            except Exception as error:
                self._fail("write", error)
            operation.outcome("saved")
            return result

    def _fail(
        self, action: str, error: Exception, after_refusal: str = "", *, level: int = logging.WARNING
    ) -> NoReturn:
        """Count a failed recall or write and raise it for the manager: a 403 as ``MembaseAccessError``,
        anything else as it came, unless a server echoed the API key in it, then as a masked copy."""
        self._counters.add(f"{action}_errors")
        self._counters.add(f"errors.{describe_failure(error).kind}")
        clean = self._gateway.without_secret(error)
        if isinstance(error, membase.PermissionDeniedError):
            logger.log(
                level,
                "store=<%s>, reason=<403> | %s refused: this Membase key was narrowed or revoked by its owner%s",
                self.name,
                action,
                after_refusal,
            )
            raise MembaseAccessError(ACCESS_SENTENCE) from clean
        if clean is error:
            raise error
        raise clean from None

    def _parts_of(self, messages: list[Message], sequence_numbers: list[int] | None) -> list[Part]:
        """The captured lines of a batch, each with the identity that survives the manager's retries."""
        numbers = sequence_numbers if sequence_numbers and len(sequence_numbers) == len(messages) else None
        prefix = len(self._capture_roles) > 1
        parts = []
        for index, message in enumerate(messages):
            role = message.get("role")
            blocks = [block for block in message.get("content", []) if "text" in block]
            text = "\n".join(block["text"] for block in blocks).strip()
            if role not in self._capture_roles or not text:
                continue
            sequence = numbers[index] if numbers is not None else None
            # The first text block is the same object on every retry of this batch and a new one in a
            # new agent run; the record holds it, so its id stays unique while the record stands.
            anchor = blocks[0]
            key = fingerprint("message", sequence, id(anchor), role, text)
            line = f"{role}: {text}" if prefix else text
            parts.append(Part(key=key, text=line, anchor=anchor, anchor_bytes=sys.getsizeof(anchor["text"])))
        return parts


def _close_unused(
    close_engine: Callable[[], None], store_name: str, running: Callable[[], list[Future[Any]]] = list
) -> None:
    """Close the local engine of a store nothing uses any more, once the writes still ``running`` on it end; called
    when the store is garbage-collected.

    Garbage collection runs on whatever thread happens to allocate (an async app's event loop, a thread inside a
    lock): the close, which may wait for writes or the engine's disk, goes to a daemon thread of its own.
    """

    def close() -> None:
        writes = running()
        if writes:
            logger.debug(
                "store=<%s>, writes=<%d> | a store nothing uses: closing its local engine once its running writes end",
                store_name,
                len(writes),
            )
            wait(writes)
        try:
            close_engine()
        except Exception as error:
            logger.warning(
                "store=<%s>, reason=<%s> | could not close the local engine of a store nothing uses",
                store_name,
                type(error).__name__,
            )
        else:
            logger.debug("store=<%s> | closed the local engine of a store nothing uses any more", store_name)

    try:
        _background.submit(close, name=f"membase-close[{store_name}]")
    except RuntimeError:
        close()  # no thread to be had (the interpreter is shutting down, or at its thread limit)


if TYPE_CHECKING:
    # mypy checks here that the store satisfies the protocol the MemoryManager is typed against.
    _as_memory_store: MemoryStore = MembaseMemoryStore()
