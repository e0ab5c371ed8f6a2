"""MembaseMemoryStore: recall through a real Agent, 403 handling, options, host and key, writes' input, lifecycle."""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from typing import Any

import httpx
import pytest
from membase.requirements import local_unavailable

from membase_strands import MembaseAccessError, MembaseMemoryStore
from membase_strands._local import LOCK_NAME
from membase_strands.testing import API_KEY, InMemoryMembase, ToolCall, status
from tests.support.agents import entries, tool_turn
from tests.support.store_helpers import FACT, QUESTION, make_agent, sdk_client

DEFAULT_HOST = "https://api.app.membase.com"
LONE = "\ud800"


def searches(fake: InMemoryMembase) -> list[dict[str, Any]]:
    return [r.body for r in fake.sent("POST", "/v1/search")]


def saves(fake: InMemoryMembase) -> list[dict[str, Any]]:
    return [r.body for r in fake.sent("POST", "/v1/memories")]


# --- Recall through a real Agent ------------------------------------------------------------------


def test_each_user_turn_recalls_once_with_the_users_words_and_the_history_keeps_only_them(fake, make_store):
    fake.remember(FACT)
    agent, model = make_agent(make_store(), ["One.", "Two.", "Three."])

    for _ in range(3):  # each synchronous call recalls on an event loop of its own
        agent(QUESTION)

    assert searches(fake) == [{"q": QUESTION, "limit": 5}] * 3  # no Memory pinned: every Memory in reach
    for call in range(3):
        assert f'<entry source="membase">[Main] {FACT}</entry>' in (model.memory_block(call) or "")
    user_turns = [[b["text"] for b in m["content"] if "text" in b] for m in agent.messages if m["role"] == "user"]
    assert user_turns == [[QUESTION]] * 3
    assert "<memory>" not in str(agent.messages) and FACT not in str(agent.messages)


def test_nothing_is_injected_when_nothing_matches_and_a_blank_prompt_is_not_searched(fake, make_store):
    fake.remember(FACT)
    agent, model = make_agent(make_store(), ["Hello.", "Hm?"])

    agent("Good morning!")
    assert len(searches(fake)) == 1 and model.memory_block() is None
    agent("   \n ")
    assert len(searches(fake)) == 1 and model.memory_block() is None


def test_passages_name_their_memory_entries_name_the_store_and_memories_that_could_not_answer_are_notices(
    fake, make_store
):
    fake.add_memory("Project decisions", "ctr_dec")
    fake.remember(FACT, container="ctr_dec")
    agent, model = make_agent(make_store(name="work"), ["Postgres.", "I could not look that up."])

    agent(QUESTION)
    assert f'<entry source="work">[Project decisions] {FACT}</entry>' in model.memory_block()
    for memory in ("ctr_main", "ctr_dec"):  # no Memory could answer: that must not be silence
        fake.cannot_answer(memory, "Embeddings need OPENAI_API_KEY")
    agent(QUESTION)
    notice = "[Membase notice] The Memory ({}) could not be searched: Embeddings need OPENAI_API_KEY."
    shown = [entry.split(" Nothing from it")[0] for entry in entries(model.memory_block())]
    assert shown == [notice.format(name) for name in ("Main", "Project decisions")]


async def test_entries_carry_the_hits_fields_and_a_notice_follows_the_passages(fake, make_store):
    fake.add_memory("Docs", "ctr_docs")
    fake.remember(FACT)
    fake.cannot_answer("ctr_docs", f"no model configured for {API_KEY}")  # a server may echo the key

    [passage, notice] = await make_store().search(QUESTION)

    assert passage.content == f"[Main] {FACT}"
    assert passage.metadata["container"] == "ctr_main" and passage.metadata["source"] == "episode:ctr_main:1"
    assert "score" in passage.metadata
    assert notice.content.startswith(
        "[Membase notice] The Memory (Docs) could not be searched: no model configured for [redacted]."
    )
    assert notice.metadata["unsearched"] is True


async def test_a_long_query_is_stripped_then_cut_to_2000_characters(fake, make_store):
    fake.remember("We chose Postgres for the ledger.")
    long = ("ledger postgres decision " * 4000)[:100_000]
    agent, model = make_agent(make_store(), ["ok"])

    await agent.invoke_async(long)
    await make_store().search("   \n" + long)

    assert [len(body["q"]) for body in searches(fake)] == [2000, 2000]
    assert searches(fake)[1]["q"].startswith("ledger")
    assert model.memory_block() is not None


async def test_odd_text_is_sent_intact_and_a_passage_reaches_the_model_without_controls_or_lone_surrogates(
    fake, make_store
):
    emoji = "ledger 🚀👩🏽‍💻 دفتر الحسابات שלום"
    odd = f"the ledger \x00nul \x1b[31mred\x1b[0m \x9b2J csi \x07bell {LONE} lone \udfff end"
    hits = [{"content": text, "container": "ctr_main", "container_name": "Main"} for text in (emoji, odd)]
    body = json.dumps({"results": hits}).encode("ascii")  # escaped, as a server may send lone surrogates
    store = make_store()
    for query in (emoji, "ledger\x00db \u202edlrow"):
        await store.search(query)
        assert searches(fake)[-1] == {"q": query, "limit": 5}  # JSON escapes a NUL; Membase decides
    fake.on("POST", "/v1/search", lambda request: httpx.Response(200, content=body))
    shown = [entry.content for entry in await store.search(f"ledger {LONE} database")]

    assert LONE not in searches(fake)[-1]["q"] and "ledger" in searches(fake)[-1]["q"]
    assert shown == [f"[Main] {emoji}", "[Main] the ledger nul [31mred[0m 2J csi bell ? lone ? end"]


async def test_the_number_of_passages_is_checked_and_past_50_asks_for_50(fake, make_store):
    store = make_store(max_search_results=7)
    for bad in (0, -1, 2.5, "5", True):
        with pytest.raises(ValueError, match="max_search_results"):
            await store.search(QUESTION, {"max_search_results": bad})
    assert fake.sent() == []
    await store.search("ledger")
    await store.search("ledger", {"max_search_results": 999})
    assert [body["limit"] for body in searches(fake)] == [7, 50]


def test_the_managers_search_tool_uses_the_stores_number_skips_a_bad_one_and_caps_a_big_one(fake, make_store, caplog):
    fake.remember(FACT)
    calls = [ToolCall("search_memory", {"query": "ledger database", "max_search_results": n}) for n in (0, -3, 80)]
    model = tool_turn(make_store(max_search_results=12), ToolCall("search_memory", {"query": "ledger"}), *calls)

    assert [body["limit"] for body in searches(fake)] == [12, 50]
    assert FACT in str(model.tool_results()[0])
    assert [r["content"][0]["text"] for r in model.tool_results()[1:3]] == ["[]", "[]"]
    failed = [r.getMessage() for r in caplog.records if "store search failed" in r.getMessage()]
    assert len(failed) == 2 and all("max_search_results must be a whole number from 1 to 50" in m for m in failed)


# --- A 403 on recall --------------------------------------------------------------------------------


@pytest.mark.parametrize("recall_timeout", [30.0, None], ids=["budget", "sdk-timeout"])
def test_a_403_on_recall_skips_memory_logs_why_and_is_not_retried(
    fake, make_store, caplog, no_key_in_logs, recall_timeout
):
    fake.remember(FACT)
    fake.always("POST", "/v1/search", status(403, f"key {API_KEY} revoked"))
    agent, model = make_agent(make_store(recall_timeout=recall_timeout), ["I can't recall that, sorry."])

    assert "sorry" in str(agent(QUESTION))

    assert model.memory_block() is None and len(searches(fake)) == 1
    assert any("narrowed or revoked" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)


async def test_a_403_raises_membase_access_error_without_the_key(fake, make_store):
    fake.on("POST", "/v1/search", status(403, f"key {API_KEY} revoked"))

    with pytest.raises(MembaseAccessError, match="narrowed or revoked") as raised:
        await make_store().search(QUESTION)

    assert isinstance(raised.value, PermissionError) and API_KEY not in str(raised.value)
    assert len(searches(fake)) == 1


# --- Options ------------------------------------------------------------------------------------------

BAD_OPTIONS: dict[str, list[Any]] = {
    "max_search_results": [0, -1, 2.5, True, False, "5", [5], float("nan")],
    "recall_timeout": [0, -1, float("nan"), float("inf"), True, "8"],
    "write_timeout": [0, -2.5, "5"],
    "request_timeout": [0, -1, None, float("inf"), "90"],
    "access_cooldown": [0, -1, "60"],
    "max_recall_chars": [0, 199, -1, True, False, "x", "300", 250.0, 1.5],
    "min_score": [True, False, "0.5", float("nan"), float("inf"), float("-inf"), [0.5], {}],
    "max_response_bytes": [1023, 0, 2048.0, True, "16MiB", None],
    "recall_profile": [1, "yes", None],
    "profile_ttl": [0, -5, None, "300"],
    "capture_roles": [("robot",), ("user", "robot"), ()],
    "tools": [("delete",), ("search", "erase"), ("Search",), "search"],
    "capture": ["yes", 1, None],
    "container": ["", "   ", 7],
    "name": ["", "  ", None],
    "base_url": ["api.app.membase.com", "ftp://membase.example", "https://", 7],
}
GOOD_OPTIONS: dict[str, list[Any]] = {
    "max_search_results": [1, 50],
    "recall_timeout": [0.1, None],
    "max_recall_chars": [200, 20_000, 10**9, None],
    "min_score": [0, -1, 0.5, 3, -0.25],
    "max_response_bytes": [1024, 16 * 1024 * 1024],
    "recall_profile": [True, False],
    "profile_ttl": [0.01, 3600],
    "request_timeout": [0.5, 90],
    "tools": [(), ("search", "forget"), ("search", "search")],
    "base_url": ["http://127.0.0.1:9", "https://membase.example/"],
}


def test_a_bad_option_is_refused_naming_it_and_never_showing_the_key(fake, tmp_path):
    for option, values in BAD_OPTIONS.items():
        for value in values:
            extra = {"capture": True} if option == "capture_roles" else {}
            with pytest.raises(ValueError, match=option) as raised:
                MembaseMemoryStore(api_key=API_KEY, transport=fake.transport, **extra, **{option: value})
            assert API_KEY not in str(raised.value), (option, value)
    for options in (
        {"client": sdk_client(fake), "api_key": API_KEY},
        {"client": sdk_client(fake), "transport": fake.transport},
    ):
        with pytest.raises(ValueError, match="client") as raised:
            MembaseMemoryStore(**options)
        assert API_KEY not in str(raised.value)
    for extraction in (True, {}):
        with pytest.raises(ValueError, match="extraction needs capture=True"):
            MembaseMemoryStore(client=sdk_client(fake), extraction=extraction)
    with pytest.raises(TypeError):
        MembaseMemoryStore(sdk_client(fake))  # type: ignore[misc]  # options are keyword only
    (tmp_path / "a-file").write_text("not a directory")
    with pytest.raises(ValueError, match="local"):
        MembaseMemoryStore(local=tmp_path / "a-file")


def test_a_misspelt_option_or_a_path_given_as_a_key_is_a_value_error_that_names_it_and_sends_nothing(fake, tmp_path):
    with pytest.raises(ValueError, match="unknown option 'recal_timeout': did you mean 'recall_timeout'"):
        MembaseMemoryStore(api_key=API_KEY, transport=fake.transport, recal_timeout=3.0)  # type: ignore[call-arg]
    for path in ("/srv/membase/users/alice", "~/membase", "./memory", str(tmp_path)):
        with pytest.raises(ValueError, match=r"a filesystem path, not a Membase API key.*local=pathlib.Path"):
            MembaseMemoryStore(api_key=path, transport=fake.transport)
    assert fake.requests == []


def test_good_options_are_accepted_and_building_a_store_makes_no_request(fake):
    for option, values in GOOD_OPTIONS.items():
        for value in values:
            MembaseMemoryStore(api_key=API_KEY, transport=fake.transport, **{option: value}).close()
    MembaseMemoryStore(client=sdk_client(fake), container="Main", capture=True, extraction=True)
    store = MembaseMemoryStore(client=sdk_client(fake))
    assert (store.name, store.max_search_results, store.writable, store.extraction) == ("membase", 5, False, None)
    assert isinstance(store.description, str) and store.description.strip()
    # One rule for every number of passages: above Membase's maximum it asks for 50.
    assert MembaseMemoryStore(client=sdk_client(fake), max_search_results=10**9).max_search_results == 50
    assert fake.sent() == []


# --- Host and key -------------------------------------------------------------------------------------


@pytest.fixture
def clean_env(monkeypatch):
    for name in ("MEMBASE_API_KEY", "MEMBASE_BASE_URL", "MEMBASE_LOCAL"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


async def test_the_host_and_key_come_from_the_options_else_the_environment_else_the_defaults(fake, clean_env):
    seen: list[tuple[str, str]] = []

    def recording(request: httpx.Request) -> httpx.Response:
        seen.append((f"{request.url.scheme}://{request.url.host}", request.headers["authorization"]))
        return fake.handle(request)

    transport = httpx.MockTransport(recording)
    with pytest.raises(ValueError, match="MEMBASE_API_KEY"):
        MembaseMemoryStore(transport=transport)
    async with MembaseMemoryStore(api_key=f"  {API_KEY}\n", transport=transport) as store:  # read from a file
        await store.search(QUESTION)
    clean_env.setenv("MEMBASE_API_KEY", API_KEY)
    clean_env.setenv("MEMBASE_BASE_URL", "https://membase.example")
    async with MembaseMemoryStore(transport=transport) as store:
        await store.search(QUESTION)
    async with MembaseMemoryStore(base_url="https://other.example", transport=transport) as store:
        await store.search(QUESTION)
        assert "base_url='https://other.example'" in repr(store) and API_KEY not in repr(store) + str(store)

    bearer = f"Bearer {API_KEY}"
    assert seen == [(DEFAULT_HOST, bearer), ("https://membase.example", bearer), ("https://other.example", bearer)]
    with pytest.raises(ValueError, match="api_key") as refused:
        MembaseMemoryStore(api_key=f"{API_KEY}\x01x", transport=transport)
    assert API_KEY not in str(refused.value)


# --- What a write takes -------------------------------------------------------------------------------


async def test_a_note_and_its_metadata_are_checked_before_anything_is_sent(fake, make_store):
    store = make_store(capture=True)
    bad_metadata = [{"static": v} for v in ("false", "true", 1, None)] + [{"title": v} for v in (5, None, ["a"])]
    for metadata, option in [*((m, next(iter(m))) for m in bad_metadata), ("static", "metadata"), ([1], "metadata")]:
        with pytest.raises(ValueError, match=option):
            await store.add("I like green tea", metadata)  # type: ignore[arg-type]
    for content in ["", "   ", "\n\t", None, 5, b"bytes"]:
        with pytest.raises(ValueError, match="non-blank text"):
            await store.add(content)  # type: ignore[arg-type]
    assert saves(fake) == []

    await store.add("I like green tea", {"static": False, "title": "Tea", "other": object()})
    await store.add("I am vegetarian", {"static": True})
    first, second = saves(fake)
    assert (first["static"], first["title"], second["static"]) == (False, "Tea", True)
    assert [note.content for note in fake.notes] == ["I like green tea"] and fake.standing == ["I am vegetarian"]


async def test_a_note_is_sent_whole_as_given_and_a_lone_surrogate_is_replaced(fake, make_store):
    store = make_store(capture=True)
    note = ("ledger postgres decision " * 8001)[:200_000]  # notes are not cut (only queries are)

    await store.add(note)
    await store.add_messages([{"role": "user", "content": [{"text": note + " again"}]}])
    await store.add("note\x00with nul")
    await store.add_messages([{"role": "user", "content": [{"text": f"I like tea {LONE}"}]}])
    await store.add_messages([{"role": "user", "content": [{"text": "I live in Lisbon"}]}])

    sent = [body["content"] for body in saves(fake)]
    assert sent[:3] == [note, note + " again", "note\x00with nul"]
    assert sent[3].startswith("I like tea") and LONE not in sent[3] and sent[4] == "I live in Lisbon"


# --- Lifecycle ------------------------------------------------------------------------------------------


def test_close_leaves_a_client_that_was_passed_in_and_other_stores_on_the_host_open(fake):
    client = sdk_client(fake)
    MembaseMemoryStore(client=client).close()
    client.search("ledger")  # the client still sends
    fake.remember(FACT)
    first, second = fake.store(recall_timeout=30.0), fake.store(recall_timeout=30.0)

    assert asyncio.run(first.search(QUESTION))
    first.close()
    first.close()  # twice is harmless
    assert asyncio.run(second.search(QUESTION))  # closing one store built from a key leaves the others working
    second.close()

    assert len(searches(fake)) == 3


async def test_a_closed_store_refuses_recalls_and_writes_plainly(fake):
    fake.remember(FACT)
    with fake.store(capture=True, recall_timeout=30.0) as store:
        assert await store.search(QUESTION)

    for call in (store.search(QUESTION), store.add("tea"), store.add_messages([{"role": "user", "content": []}])):
        with pytest.raises(RuntimeError, match="closed; create a new store"):
            await call
    assert len(fake.sent()) == 1


@pytest.mark.skipif(local_unavailable() is not None, reason=f"local Membase cannot run here: {local_unavailable()}")
@pytest.mark.skipif(sys.platform == "win32", reason="flock")
def test_closing_a_local_store_lets_go_of_its_directory(tmp_path, clean_env):
    import fcntl

    clean_env.delenv("OPENAI_API_KEY", raising=False)  # starting the engine needs no LLM

    def held() -> bool:
        """Whether the directory is held, as another process would find it (flock: open files never share)."""
        with open(tmp_path / LOCK_NAME) as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                return True
            return False

    store = MembaseMemoryStore(local=tmp_path)
    assert held()
    store.close()
    assert not held()
