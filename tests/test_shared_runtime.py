"""The runtime every user of a process shares keeps them apart and bounded (issue 25), over a real loopback server.

One test (or two) per finding of the issue, each through the public API only: stores built from keys with
``base_url=`` the loopback server's URL, ``MembaseStorePool``, ``store.search``, the tools of ``store.get_tools()``
driven by a real ``strands.Agent`` with ``ScriptedModel``, ``run_check`` and the ``membase-strands check`` command,
log records, spans and counters. The faults live in the transport, so the server is real
(``tests/support/loopback.py``):

1. A server that sets a cookie per user: no request carries a cookie set for another user.
2. A server that closes each connection 20 ms after each answer: no recall fails, every write is saved once.
3. Hung writes and one user's hung tool calls: other users' recalls still reach Membase; a close does not queue.
4. ``MembaseStorePool.close()`` waits for the writes of a store only the pool holds, as the store's own close would.
5. A key echoed in an error at any offset: no 8 characters of it in any log, error, tool result, span or report.
6. An endless or huge answer: reading stops at ``max_response_bytes``; peak memory stays within 4 times it.
(Headers dripped a line at a time and proxy settings read once are in ``test_transport.py``.)

Waits are on the server's records (:meth:`LoopbackMembase.wait_for`) or on events, with generous limits; no test
asserts how long something took.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import json
import logging
import resource
import threading
import weakref
from collections import Counter
from collections.abc import Awaitable, Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

import membase
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from strands import Agent

from membase_strands import MembaseMemoryStore, MembaseRecallTimeout, MembaseStorePool, MembaseWriteTimeout
from membase_strands.check import main as check_main
from membase_strands.check import run_check
from membase_strands.testing import InMemoryMembase, ScriptedModel, ToolCall
from tests.support.leaks import error_texts, span_texts
from tests.support.loopback import (
    LoopbackMembase,
    arrived,
    as_usual,
    echo_key,
    endless,
    huge,
    stall,
)
from tests.support.store_helpers import drain_began, until, wait_until

LONG = 30.0  # a wait, or a budget, no loaded machine runs out of
HELD = 4 * LONG  # the longest the server holds a request for a test: past every wait on it, so none ends a wait
MiB = 1024 * 1024
QUESTION = "Where does this user keep the ledger?"


def key_of(user: str) -> str:
    """A user's key: ``mb_`` and 32 characters no text in the suite shares by chance."""
    return "mb_" + hashlib.sha256(user.encode()).hexdigest()[:32]


def fact_of(user: str) -> str:
    return f"The ledger of {user} is kept in vault-{user}."


def with_memories(users: list[str]) -> InMemoryMembase:
    """A fake Membase where each user's key reaches a memory holding that user's own fact."""
    fake = InMemoryMembase()
    for user in users:
        fake.account(key_of(user)).remember(fact_of(user))
    return fake


def tool_turn(store: MembaseMemoryStore, query: str) -> str:
    """One agent turn in which the model calls ``membase_search``; the text of the tool result the model was sent."""
    model = ScriptedModel([ToolCall("membase_search", {"query": query}), "ok"])
    Agent(model=model, tools=store.get_tools(), callback_handler=None)("Look it up.")
    return model.tool_result_text()


def recalled(entries: list[Any]) -> str:
    return "\n".join(str(entry.content) for entry in entries)


# --- 1. Cookies ------------------------------------------------------------------------------------------------


def test_a_cookie_a_server_set_for_one_user_is_never_sent_with_another_users_request() -> None:
    """A server (or a load balancer before Membase) answers every request with ``Set-Cookie: s=<user>``; 50 users'
    recalls (asyncio) and tool calls (threads) run at once, two rounds. Whatever the clients keep of cookies,
    none set for one user may travel with another user's request: a front end that trusts its session cookie
    would answer with someone else's memory."""
    users = [f"user{n:02d}" for n in range(50)]
    user_of = {key_of(user): user for user in users}
    with LoopbackMembase(with_memories(users)) as server:
        server.cookie_for = lambda key: f"s={user_of.get(key, 'nobody')}"
        with MembaseStorePool(key_of, base_url=server.url, recall_timeout=LONG, name="cookies") as pool:
            stores = {user: pool.store_for(user) for user in users}

            async def recall_all() -> list[list[Any]]:
                return await asyncio.gather(*(stores[user].search(QUESTION) for user in users))

            with ThreadPoolExecutor(max_workers=8) as threads:
                for _ in range(2):
                    turns = {user: threads.submit(tool_turn, stores[user], "ledger vault") for user in users}
                    recalls = dict(zip(users, asyncio.run(recall_all()), strict=True))
                    tool_texts = {user: turn.result(LONG) for user, turn in turns.items()}
                    for user in users:
                        assert fact_of(user) in recalled(recalls[user]), user
                        assert fact_of(user) in tool_texts[user], user

        foreign = [
            (user_of[request.key], value)
            for request in server.seen
            for name, _, value in (pair.strip().partition("=") for pair in (request.cookie or "").split(";"))
            if name == "s" and value != user_of[request.key]
        ]
        sent = len(server.seen)
        assert foreign == [], f"{len(foreign)} of {sent} requests carried another user's cookie, e.g. {foreign[:5]}"
        assert sent >= 50 * 2 * 2


# --- 2. A connection the server closes just after answering ------------------------------------------------------


@pytest.mark.scale
def test_a_server_closing_each_connection_20_ms_after_its_answer_costs_no_recall_and_no_write() -> None:
    """Over a real network a server closes an idle keep-alive connection just after its answer (here 20 ms later,
    reading nothing sent meanwhile). A request sent on such a connection never reached Membase: 1,000 recalls
    (sequential, then 20 at once over eight stores) fail none, and every captured write (``add`` and ``add_messages``,
    some at once) is saved exactly once by the time the stores are closed."""
    users = [f"user{n}" for n in range(8)]
    fake = with_memories(users)
    with LoopbackMembase(fake) as server:
        server.close_after = 0.02
        stores = [
            MembaseMemoryStore(
                api_key=key_of(user),
                base_url=server.url,
                name=user,
                capture=True,
                recall_timeout=LONG,
                write_timeout=LONG,
            )
            for user in users
        ]
        failed: list[str] = []
        written: dict[str, list[str]] = {user: [] for user in users}

        async def recall(index: int) -> None:
            try:
                entries = await stores[index].search(QUESTION)
            except Exception as error:  # noqa: BLE001 - counted: the test is that there are none
                failed.append(f"recall: {type(error).__name__}: {error}")
                return
            if fact_of(users[index]) not in recalled(entries):
                failed.append(f"recall of {users[index]} came back without its memory")

        async def write(index: int, n: int) -> None:
            note = f"Note {n} of {users[index]}: the ledger moved to shelf {n}."
            written[users[index]].append(note)
            try:
                if n % 2:
                    await stores[index].add(note)
                else:
                    await stores[index].add_messages([{"role": "user", "content": [{"text": note}]}])
            except Exception as error:  # noqa: BLE001 - counted: the test is that there are none
                failed.append(f"write: {type(error).__name__}: {error}")

        async def traffic() -> None:
            # Each request sent on a connection the server is about to close waits out the rest of its 20 ms: the
            # sequential part is short, the rest goes in waves of 20 (1,000 recalls, 130 writes in all).
            for n in range(100):
                await recall(n % len(stores))
                if n % 10 == 0:
                    await write(n // 10 % len(stores), n)
            for wave in range(45):
                work = [recall(n % len(stores)) for n in range(20)]
                if wave % 3 == 0:
                    work += [write(index, 100 + wave) for index in range(len(stores))]
                await asyncio.gather(*work)

        try:
            asyncio.run(traffic())
        finally:
            for store in stores:
                store.close()

        assert sum(map(len, written.values())) == 130
        assert failed == [], f"{len(failed)} of 1,000 recalls and 130 writes failed, e.g. {failed[:3]}"
        for user, store in zip(users, stores, strict=True):
            saved = Counter(fake.account(key_of(user)).saved())
            assert saved == Counter(written[user]), (
                f"{user}: not saved exactly once each: {saved - Counter(written[user])}"
            )
            counters = store.counters()
            assert counters["recall_errors"] == counters["write_errors"] == counters["writes_lost"] == 0


# --- 3. Starvation ----------------------------------------------------------------------------------------------


async def test_hung_writes_and_one_users_hung_tool_calls_never_keep_fresh_users_recalls_from_membase() -> None:
    """40 users' captured writes and one user's six ``membase_search`` calls hang at Membase. 49 fresh users' recalls
    all still reach Membase and return their memory while those hang, and closing an idle store returns without
    waiting for them."""
    writers = [f"writer{n:02d}" for n in range(40)]
    fresh = [f"fresh{n:02d}" for n in range(49)]
    hog = "hog"
    release = threading.Event()
    with LoopbackMembase(with_memories(fresh)) as server:
        for user in writers:
            server.on("POST", "/v1/memories", stall(release, as_usual, limit=HELD), key=key_of(user))
        server.on("POST", "/v1/search", *[stall(release, as_usual, limit=HELD) for _ in range(6)], key=key_of(hog))
        # Each write runs out of its budget (the server holds it), so all 40 are running or waiting their turn
        # before any recall starts; the budget ending is certain, not a race.
        pool = MembaseStorePool(key_of, base_url=server.url, capture=True, recall_timeout=LONG, write_timeout=0.5)
        idle = MembaseMemoryStore(api_key=key_of("idle"), base_url=server.url, name="idle")
        held_keys = {key_of(user) for user in [*writers, hog]}
        hog_turns: list[Future[str]] = []
        recalls: list[asyncio.Future[list[Any]]] = []
        threads = ThreadPoolExecutor(max_workers=6)
        try:
            # The hog's tool calls first, while nothing else hangs: all six are certain to reach the server.
            hog_store = pool.store_for(hog)
            hog_turns = [threads.submit(tool_turn, hog_store, f"hog question {n}") for n in range(6)]
            hog_in = lambda: len(server.requests("POST", "/v1/search", {key_of(hog)})) == 6  # noqa: E731
            assert await asyncio.to_thread(server.wait_for, hog_in, LONG), "the hog's six searches never arrived"
            writes = await asyncio.gather(
                *(pool.store_for(user).add(f"A note of {user}.") for user in writers), return_exceptions=True
            )
            assert all(isinstance(outcome, MembaseWriteTimeout) for outcome in writes), writes
            writes_in = lambda: bool(server.requests("POST", "/v1/memories"))  # noqa: E731
            assert await asyncio.to_thread(server.wait_for, writes_in, LONG), "no write reached the server"

            fresh_keys = {key_of(user) for user in fresh}
            recalls = [asyncio.ensure_future(pool.store_for(user).search(QUESTION)) for user in fresh]
            all_in = lambda: len(server.requests("POST", "/v1/search", fresh_keys)) == len(fresh)  # noqa: E731
            reached = await asyncio.to_thread(server.wait_for, all_in, LONG)
            arrived_count = len(server.requests("POST", "/v1/search", fresh_keys))
            try:
                await asyncio.wait_for(idle.aclose(), LONG)
                closed = "returned"
            except asyncio.TimeoutError:
                closed = f"had not returned after {LONG:g} s"
            assert server.answers("POST", "/v1/memories", held_keys) == []  # all this while they still hang
            assert server.answers("POST", "/v1/search", held_keys) == []
            assert (reached, closed) == (True, "returned"), (
                f"{arrived_count} of {len(fresh)} fresh recalls reached Membase while 40 writes and 6 tool calls hung, "
                f"and an idle store's aclose() {closed}"
            )
            answers = await asyncio.gather(*recalls)
            for user, entries in zip(fresh, answers, strict=True):
                assert fact_of(user) in recalled(entries), user
        finally:
            release.set()
            wait(hog_turns, LONG)
            threads.shutdown()
            await asyncio.gather(*recalls, return_exceptions=True)
            everyone = lambda: len(server.answers("POST", "/v1/memories", held_keys)) == len(writers)  # noqa: E731
            await asyncio.to_thread(server.wait_for, everyone, LONG)
            await pool.aclose()
            await idle.aclose()


@pytest.mark.parametrize("route", ["search", "profile"])
@pytest.mark.parametrize("hung", [16, 40])
async def test_users_whose_recalls_hang_never_keep_fresh_users_recalls_from_being_served(hung: int, route: str) -> None:
    """``hung`` users' recalls (or, with ``recall_profile``, their profile reads) hang at Membase past their budget;
    30 fresh users' recalls are then all sent and served within theirs (the issue asks for 95 %: here, every one)."""
    stuck = [f"stuck{n:02d}" for n in range(hung)]
    fresh = [f"fresh{n:02d}" for n in range(30)]
    path, release = "/v1/search" if route == "search" else "/v1/profile", threading.Event()
    with LoopbackMembase(with_memories(stuck + fresh)) as server:
        for user in stuck:
            server.on("POST" if route == "search" else "GET", path, stall(release, as_usual, HELD), key=key_of(user))
        # The stuck users' recalls run out of their budget (their request held), the fresh ones get a long one.
        options = {"recall_profile": route == "profile", "profile_ttl": HELD}
        stuck_pool = MembaseStorePool(key_of, base_url=server.url, recall_timeout=0.5, **options)  # type: ignore[arg-type]
        pool = MembaseStorePool(key_of, base_url=server.url, recall_timeout=LONG, **options)  # type: ignore[arg-type]
        try:
            outcomes = await asyncio.gather(
                *(stuck_pool.store_for(user).search(QUESTION) for user in stuck), return_exceptions=True
            )
            held_keys = {key_of(user) for user in stuck}
            assert server.answers("POST" if route == "search" else "GET", path, held_keys) == []  # still held
            if route == "search":
                assert all(isinstance(outcome, MembaseRecallTimeout) for outcome in outcomes), outcomes

            answers = await asyncio.gather(*(pool.store_for(user).search(QUESTION) for user in fresh))

            served = [user for user, entries in zip(fresh, answers, strict=True) if fact_of(user) in recalled(entries)]
            assert served == fresh, f"{len(served)} of {len(fresh)} fresh recalls served while {hung} users hung"
        finally:
            release.set()
            stuck_pool.close()
            pool.close()


# --- 4. The pool's close ----------------------------------------------------------------------------------------


def start_write_then_walk_away(
    pool: MembaseStorePool, user: str, at_server: threading.Event
) -> weakref.ref[MembaseMemoryStore]:
    """Start a captured write for ``user`` and, once it is at the server, cancel its caller and drop every reference
    to the store: the write goes on in the background, and only the pool holds the store. Returns a weak reference."""
    store = pool.store_for(user)

    async def walk_away() -> None:
        task = asyncio.ensure_future(store.add(f"A note of {user}."))
        try:
            assert await asyncio.to_thread(at_server.wait, LONG), "the write never reached the server"
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, MembaseWriteTimeout):
                await task

    asyncio.run(walk_away())
    return weakref.ref(store)


@pytest.mark.parametrize("closing", ["close", "aclose"])
@pytest.mark.parametrize("holder", ["only the pool", "its caller, after the pool let go of it"])
def test_closing_the_pool_waits_for_a_running_write_of_every_store_it_built_that_is_alive(
    holder: str, closing: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A write is running at Membase on a store held by ``holder``; the pool's close returns only once that write's
    outcome is known, as the store's own close would. The server holds the write until a close starts waiting for
    it (its log line), or else until the pool's close has returned: so it ends during a close that waits for it,
    and after one that does not."""
    caplog.set_level(logging.INFO)
    user = "writer"
    at_server, answering, release, returned = (threading.Event() for _ in range(4))
    with LoopbackMembase(InMemoryMembase()) as server:
        held = stall(release, arrived(answering, as_usual), limit=HELD)  # `answering`: set before the answer goes
        server.on("POST", "/v1/memories", arrived(at_server, held), key=key_of(user))
        pool = MembaseStorePool(
            key_of, max_stores=1, base_url=server.url, capture=True, recall_timeout=LONG, write_timeout=LONG
        )
        writer = start_write_then_walk_away(pool, user, at_server)
        keep: list[MembaseMemoryStore | None] = []  # the caller's reference, when it holds the store
        if holder != "only the pool":
            keep.append(writer())
            pool.store_for("someone else")  # past max_stores: the pool lets go of the writer's store, not closing it
        assert writer() is not None, "the writer's store was collected before the pool's close"

        def release_once_a_close_waits() -> None:
            wait_until(lambda: drain_began(caplog)() or returned.is_set(), LONG)
            release.set()

        releaser = threading.Thread(target=release_once_a_close_waits, daemon=True)
        releaser.start()
        try:
            if closing == "close":
                pool.close()
            else:
                asyncio.run(pool.aclose())
            known_at_return = answering.is_set()
        finally:
            returned.set()
            releaser.join(LONG)
        assert known_at_return, f"the pool's {closing}() returned before the write it should wait for had ended"
        assert server.wait_for(lambda: len(server.answers("POST", "/v1/memories")) == 1)
        assert pool.counters()["writes_saved"] == 1


# --- 5. A key echoed in an error --------------------------------------------------------------------------------


def _reached(count: Callable[[], int], wanted: int) -> bool:
    return count() == wanted


def _late_ended(stores: list[MembaseMemoryStore], rounds: int) -> bool:
    return all(store.counters()["recall_late_completions"] == rounds for store in stores)


@pytest.mark.scale
def test_a_key_membase_echoes_at_any_offset_leaves_no_8_characters_of_itself_anywhere(
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    spans: InMemorySpanExporter,
) -> None:
    """A 400 whose message quotes the bearer key at every offset from 0 to 400, on each way an error reaches someone:
    no 8 consecutive characters of the key in the exception a recall raises (str, repr, traceback and the errors
    chained as shown), the log line of a recall that failed after its caller left, the tool result the model is
    sent (and all else it was sent), the ``run_check`` report (text and ``to_dict()``), the output of
    ``membase-strands check`` (text at even offsets, ``--json`` at odd ones), any span, or any log record (every
    logger at INFO, the library's and the SDK's at DEBUG: other libraries' DEBUG records only cost time here).

    Each way gets every offset, one request each; calls of one way run side by side where they can (recalls
    gathered, tool turns on eight agents, ``run_check`` on eight threads), each taking the next offset queued."""
    caplog.set_level(logging.INFO)
    for name in ("membase_strands", "membase"):
        caplog.set_level(logging.DEBUG, logger=name)
    key = key_of("echoed")
    pieces = {key[i : i + 8] for i in range(len(key) - 7)}
    offsets = range(401)
    found: Counter[str] = Counter()
    lock = threading.Lock()

    def check(where: str, *texts: str) -> None:
        if any(piece in text for text in texts for piece in pieces):
            with lock:
                found[where] += 1

    def echoes(method: str, path: str) -> None:
        server.on(method, path, *[echo_key(offset) for offset in offsets], key=key)

    with LoopbackMembase(InMemoryMembase()) as server, ThreadPoolExecutor(max_workers=8) as threads:
        searches = lambda: len(server.requests("POST", "/v1/search", {key}))  # noqa: E731
        store = MembaseMemoryStore(api_key=key, base_url=server.url, name="echo", recall_timeout=LONG)
        late = [MembaseMemoryStore(api_key=key, base_url=server.url, name=f"late{n}") for n in range(6)]
        try:

            async def recall() -> None:
                try:
                    await store.search(QUESTION)
                except Exception as error:  # noqa: BLE001 - what the caller reads of it is checked
                    check("the error a recall raised", *error_texts(error))
                else:
                    raise AssertionError("a recall answered with a 400 did not fail")

            async def late_recalls() -> None:
                """Recalls whose callers are cancelled once they are at Membase, six at a time (six stores of one
                key); each fails after, and the library logs why."""
                for rounds, first in enumerate(range(0, len(offsets), len(late)), start=1):
                    batch, stores = offsets[first : first + len(late)], late[: len(offsets[first:])]
                    go = threading.Event()
                    server.on("POST", "/v1/search", *[stall(go, echo_key(o), limit=HELD) for o in batch], key=key)
                    sent = searches() + len(batch)
                    tasks = [asyncio.ensure_future(late_store.search(QUESTION)) for late_store in stores]
                    assert await asyncio.to_thread(server.wait_for, functools.partial(_reached, searches, sent), LONG)
                    for task in tasks:
                        task.cancel()
                    await asyncio.gather(*tasks, return_exceptions=True)
                    go.set()
                    assert await until(functools.partial(_late_ended, stores, rounds), LONG), "a late recall hung"

            async def tool_turns(count: int) -> None:
                model = ScriptedModel()
                agent = Agent(model=model, tools=store.get_tools(), callback_handler=None)
                for _ in range(count):
                    model.script += [ToolCall("membase_search", {"query": "ledger"}), "ok"]
                    agent.messages.clear()
                    await agent.invoke_async("Look it up.")
                    check("the tool result the model was sent", model.tool_result_text())
                    check("what the model was sent", json.dumps(model.calls[-1], default=str))

            async def side_by_side(*calls: Awaitable[None]) -> None:
                await asyncio.gather(*calls)

            echoes("POST", "/v1/search")
            asyncio.run(side_by_side(*(recall() for _ in offsets)))
            asyncio.run(late_recalls())
            echoes("POST", "/v1/search")
            asyncio.run(side_by_side(*(tool_turns(len(offsets[i::8])) for i in range(8))))  # on eight agents
        finally:
            for each in [store, *late]:
                each.close()

        echoes("GET", "/v1/containers")
        for report in threads.map(lambda _: run_check(api_key=key, base_url=server.url), offsets):
            assert not report.ok
            check("run_check's report", report.to_text(), json.dumps(report.to_dict()))
        echoes("GET", "/v1/containers")
        monkeypatch.setenv("MEMBASE_API_KEY", key)
        for offset in offsets:
            assert check_main(["check", "--base-url", server.url, *(["--json"] if offset % 2 else [])]) == 1
            captured = capsys.readouterr()
            check("membase-strands check's output", captured.out, captured.err)
        assert searches() == 3 * len(offsets)  # each a single request: none was retried
        assert len(server.requests("GET", "/v1/containers", {key})) == 2 * len(offsets)

    for record in caplog.records:
        check(f"a log record ({record.name})", record.getMessage(), record.exc_text or "")
    check("the captured log text", caplog.text)
    for span in spans.get_finished_spans():
        check(f"a span ({span.name})", *span_texts(span))
    assert found == {}, f"8 or more characters of the key appear (so many times) in: {dict(found)}"


# --- 6. Answers too large to read ---------------------------------------------------------------------------------


def _socket_slack() -> int:
    """The most a stream can have sent past what the client read: the client's largest receive buffer and the
    server's send buffer (which the kernel doubles), with room to spare."""
    try:
        receive = int(Path("/proc/sys/net/ipv4/tcp_rmem").read_text().split()[2])
    except (OSError, ValueError, IndexError):
        receive = 8 * MiB
    return receive + 1 * MiB


SLACK = _socket_slack()


class PeakMemory:
    """This process's peak resident memory from a reset on: Linux's VmHWM, reset through ``/proc/self/clear_refs``
    (else the lifetime peak, ``ru_maxrss``, which only shows growth above any earlier peak)."""

    def reset(self) -> int:
        """Start measuring; the resident memory (KiB) growth is measured from."""
        try:
            Path("/proc/self/clear_refs").write_text("5")
            return _status_kib("VmRSS")
        except OSError:
            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

    def growth(self, since: int) -> int:
        """Bytes the peak grew by since ``since`` (a :meth:`reset`)."""
        try:
            peak = _status_kib("VmHWM")
        except OSError:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return max(0, peak - since) * 1024


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise OSError(f"no {field} in /proc/self/status")


def abandoned_recall_over_an_endless_body(cap: int, **options: Any) -> tuple[int, str, int]:
    """A recall that runs out of its budget while Membase holds it, then gets an endless chunked body that nobody
    waits for. Returns what the server managed to send, why its stream ended, and the peak memory growth."""
    user = "endless"
    come = threading.Event()
    stop = threading.Event()
    peak = PeakMemory()
    with LoopbackMembase(with_memories([user])) as server:
        warm = MembaseMemoryStore(
            api_key=key_of(user), base_url=server.url, name="warm", recall_timeout=LONG, **options
        )
        late = MembaseMemoryStore(
            api_key=key_of(user), base_url=server.url, name="late", recall_timeout=0.05, **options
        )
        try:
            # Threads, a pooled connection and every import are warm before memory is measured.
            assert fact_of(user) in recalled(asyncio.run(warm.search(QUESTION)))
            # The server's own bound on the stream: far past the cap, so a client that reads it all fails here.
            server.on("POST", "/v1/search", stall(come, endless(most=cap + SLACK + 64 * MiB, stop=stop)))
            since = peak.reset()
            with pytest.raises(MembaseRecallTimeout):
                asyncio.run(late.search(QUESTION))
            come.set()  # nobody waits for the recall any more: now the body starts, and never ends
            assert server.wait_for(lambda: len(server.streams) == 1, LONG), "the stream never ended"
            growth = peak.growth(since)
            [streamed] = server.streams
            return streamed.sent, streamed.ended, growth
        finally:
            come.set()
            stop.set()
            warm.close()
            late.close()


def test_an_abandoned_recall_reads_an_endless_body_only_up_to_max_response_bytes() -> None:
    """At a small cap (2 MiB rather than 1 leaves room for the allocator's own noise under 4x) and at the documented
    default of ``max_response_bytes``, 16 MiB."""
    for cap, options in [(2 * MiB, {"max_response_bytes": 2 * MiB}), (16 * MiB, {})]:
        sent, ended, growth = abandoned_recall_over_an_endless_body(cap, **options)
        said = f"the server sent {sent / MiB:.0f} MiB ({ended}); peak memory grew by {growth / MiB:.1f} MiB"
        assert ended == "hung up" and sent <= cap + SLACK, said
        assert growth < 4 * cap, said


def test_a_400_mb_answer_fails_a_recall_and_a_tool_search_clearly_without_being_read() -> None:
    """An answer announcing 400 MB (streamed, never built): the recall raises a Membase error and the tool tells the
    model the answer could not be read, and neither reads much past ``max_response_bytes``."""
    cap = 1 * MiB
    user = "huge"
    stop = threading.Event()
    with LoopbackMembase(with_memories([user])) as server:
        store = MembaseMemoryStore(
            api_key=key_of(user), base_url=server.url, name="huge", recall_timeout=LONG, max_response_bytes=cap
        )
        try:
            server.on("POST", "/v1/search", huge(400_000_000, stop=stop))
            with pytest.raises(membase.MembaseError) as raised:
                asyncio.run(store.search(QUESTION))
            assert not isinstance(raised.value, MembaseRecallTimeout)
            server.on("POST", "/v1/search", *[huge(400_000_000, stop=stop) for _ in range(3)])  # one per attempt
            text = tool_turn(store, "ledger")
            assert "could not be read" in text or "too large" in text, text
            searches = lambda: len(server.requests("POST", "/v1/search"))  # noqa: E731
            assert server.wait_for(lambda: len(server.streams) == searches(), LONG), "a stream never ended"
            too_much = [(s.sent, s.ended) for s in server.streams if s.ended != "hung up" or s.sent > cap + SLACK]
            assert too_much == [], f"answers read well past the cap: {too_much}"
        finally:
            stop.set()
            store.close()
