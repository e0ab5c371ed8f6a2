"""MembaseMemoryStore: injection through a real Agent, 403 handling, options, lifecycle and protocol."""

from __future__ import annotations

import asyncio
import logging

import pytest
from membase.requirements import local_unavailable
from strands.memory import MemoryManager

from membase_strands import MembaseAccessError, MembaseMemoryStore
from membase_strands.testing import API_KEY, ToolCall, status
from tests.support.loopback import LoopbackMembase
from tests.support.store_helpers import FACT, QUESTION, client_of, make_agent

DEFAULT_HOST = "https://api.app.membase.com"


def text_of(message: dict) -> str:
    return "\n".join(block["text"] for block in message["content"] if "text" in block)


# --- Injection ----------------------------------------------------------------------------------


def test_a_user_turn_recalls_once_with_the_users_words_and_limit_5(fake, make_store):
    fake.remember(FACT)
    agent, model = make_agent(make_store(), ["Postgres."])

    agent(QUESTION)

    searches = fake.sent("POST", "/v1/search")
    assert len(searches) == 1
    assert searches[0].body["q"] == QUESTION
    assert searches[0].body["limit"] == 5
    assert "container" not in searches[0].body  # no Memory pinned: every Memory in reach
    block = model.memory_block()
    assert block is not None
    assert f'<entry source="membase">[Main] {FACT}</entry>' in block
    assert QUESTION in model.sent_text()


def test_history_keeps_only_what_the_user_said(fake, make_store):
    fake.remember(FACT)
    agent, model = make_agent(make_store(), ["Postgres."])

    agent(QUESTION)

    assert model.memory_block() is not None
    user_turns = [m for m in agent.messages if m["role"] == "user"]
    assert [text_of(m) for m in user_turns] == [QUESTION]
    assert all("<memory>" not in text_of(m) and FACT not in text_of(m) for m in agent.messages)


def test_nothing_is_injected_when_nothing_matches(fake, make_store):
    fake.remember(FACT)
    agent, model = make_agent(make_store(), ["Hello."])

    agent("Good morning!")

    assert len(fake.sent("POST", "/v1/search")) == 1
    assert model.memory_block() is None


def test_each_synchronous_call_recalls_on_its_own_event_loop(fake, make_store):
    fake.remember(FACT)
    agent, model = make_agent(make_store(), ["One.", "Two.", "Three."])

    for _ in range(3):
        agent(QUESTION)

    assert len(fake.sent("POST", "/v1/search")) == 3
    for call in range(3):
        assert f"[Main] {FACT}" in (model.memory_block(call) or "")


def test_passages_name_their_memory_and_keep_the_hits_other_fields(fake, make_store):
    fake.containers = [{"id": "ctr_main", "name": "Main"}, {"id": "ctr_dec", "name": "Project decisions"}]
    fake.remember(FACT, container="ctr_dec")
    agent, model = make_agent(make_store(), ["Postgres."])

    agent(QUESTION)

    assert f"[Project decisions] {FACT}" in model.memory_block()


async def test_entry_metadata_carries_the_hit_fields(fake, make_store):
    fake.remember(FACT)
    entries = await make_store().search(QUESTION)

    assert [e.content for e in entries] == [f"[Main] {FACT}"]
    metadata = entries[0].metadata
    assert metadata["container"] == "ctr_main"
    assert metadata["source"] == "episode"
    assert "score" in metadata


def test_a_memory_that_could_not_answer_is_a_framed_notice(fake, make_store):
    fake.remember(FACT)
    fake.unsearchable = {"ctr_main": "Embeddings need OPENAI_API_KEY"}
    agent, model = make_agent(make_store(), ["I could not look that up."])

    agent(QUESTION)

    block = model.memory_block()
    assert block is not None, "a Memory that could not answer must not be silence"
    assert "Main" in block
    assert "could not be searched: Embeddings need OPENAI_API_KEY" in block
    # Framed as a notice, never as a remembered passage of that Memory.
    assert "[Main] Embeddings need" not in block
    assert "[Membase notice]" in block


async def test_the_notice_follows_the_passages_of_memories_that_answered(fake, make_store):
    fake.containers = [{"id": "ctr_main", "name": "Main"}, {"id": "ctr_docs", "name": "Docs"}]
    fake.remember(FACT)
    fake.unsearchable = {"ctr_docs": "no model configured"}

    entries = await make_store().search(QUESTION)

    assert entries[0].content == f"[Main] {FACT}"
    assert "(Docs) could not be searched: no model configured" in entries[1].content
    assert entries[1].metadata["unsearched"] is True


async def test_a_blank_query_returns_nothing_without_a_request(fake, make_store):
    store = make_store()
    assert await store.search("") == []
    assert await store.search("   \n") == []
    assert fake.sent() == []


def test_the_managers_injection_size_is_sent_as_the_limit(fake, make_store):
    agent, _ = make_agent(make_store(max_search_results=20), ["ok"], injection={"max_entries": 2})

    agent(QUESTION)

    assert [r.body["limit"] for r in fake.sent("POST", "/v1/search")] == [2]


async def test_a_very_long_query_is_cut_before_it_is_sent(fake, make_store):
    await make_store().search("ledger " * 1000)

    (sent,) = fake.sent("POST", "/v1/search")
    assert 0 < len(sent.body["q"]) <= 2000


def test_the_search_memory_tool_uses_the_stores_own_limit(fake, make_store):
    fake.remember(FACT)
    store = make_store(max_search_results=12)
    agent, _ = make_agent(store, [ToolCall("search_memory", {"query": "ledger database"}), "Done."], injection=False)

    agent("Look it up.")

    assert [r.body["limit"] for r in fake.sent("POST", "/v1/search")] == [12]


def test_a_tool_limit_above_50_is_capped_at_50(fake, make_store):
    store = make_store()
    call = ToolCall("search_memory", {"query": "ledger database", "max_search_results": 80})
    agent, _ = make_agent(store, [call, "Done."], injection=False)

    agent("Look it up.")

    assert [r.body["limit"] for r in fake.sent("POST", "/v1/search")] == [50]


@pytest.mark.parametrize("limit", [0, -3, 2.5, True, "5"])
async def test_a_bad_search_limit_is_an_error_not_a_silent_default(fake, make_store, limit):
    with pytest.raises(ValueError, match="max_search_results"):
        await make_store().search(QUESTION, {"max_search_results": limit})
    assert fake.sent() == []


# --- 403 on recall ------------------------------------------------------------------------------


def test_a_403_on_recall_skips_memory_warns_and_is_not_retried(fake, make_store, caplog, no_key_in_logs):
    fake.remember(FACT)
    fake.always("POST", "/v1/search", status(403, "key revoked"))
    agent, model = make_agent(make_store(), ["I can't recall that, sorry."])

    result = agent(QUESTION)

    assert "sorry" in str(result)
    assert model.memory_block() is None
    assert len(fake.sent("POST", "/v1/search")) == 1
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("narrowed or revoked" in w for w in warnings)


def test_a_403_with_the_sdk_timeout_is_not_retried_either(fake, make_store, caplog, no_key_in_logs):
    fake.always("POST", "/v1/search", status(403))
    agent, model = make_agent(make_store(recall_timeout=None), ["ok"])

    agent(QUESTION)

    assert model.memory_block() is None
    assert len(fake.sent("POST", "/v1/search")) == 1
    assert any("narrowed or revoked" in r.getMessage() for r in caplog.records)


async def test_a_403_raises_membase_access_error(fake, make_store):
    fake.on("POST", "/v1/search", status(403))

    with pytest.raises(MembaseAccessError, match="narrowed or revoked") as raised:
        await make_store().search(QUESTION)

    assert isinstance(raised.value, PermissionError)
    assert API_KEY not in str(raised.value)
    assert len(fake.sent("POST", "/v1/search")) == 1


# --- Options ------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [0, -1, 2.5, True, "5"])
def test_max_search_results_must_be_a_whole_number_of_at_least_1(fake, value):
    with pytest.raises(ValueError, match="max_search_results"):
        MembaseMemoryStore(client=fake.client(), max_search_results=value)


@pytest.mark.parametrize("value", [1, 50])
def test_max_search_results_bounds_are_accepted(fake, value):
    assert MembaseMemoryStore(client=fake.client(), max_search_results=value).max_search_results == value


@pytest.mark.parametrize("value", [0, -1, float("nan"), float("inf"), True, "8"])
def test_recall_timeout_must_be_a_positive_number(fake, value):
    with pytest.raises(ValueError, match="recall_timeout"):
        MembaseMemoryStore(client=fake.client(), recall_timeout=value)


@pytest.mark.parametrize("roles", [("robot",), ("user", "robot"), ()])
def test_capture_roles_must_be_user_or_assistant(fake, roles):
    with pytest.raises(ValueError, match="capture_roles"):
        MembaseMemoryStore(client=fake.client(), capture=True, capture_roles=roles)


@pytest.mark.parametrize("tools", [("delete",), ("search", "forget"), "search"])
def test_tools_must_be_a_list_of_known_tool_names(fake, tools):
    with pytest.raises(ValueError, match="tools"):
        MembaseMemoryStore(client=fake.client(), tools=tools)


@pytest.mark.parametrize("capture", ["yes", 1, None])
def test_capture_must_be_a_bool(fake, capture):
    with pytest.raises(ValueError, match="capture"):
        MembaseMemoryStore(client=fake.client(), capture=capture)


def test_a_client_and_an_api_key_together_are_an_error(fake):
    with pytest.raises(ValueError, match="client"):
        MembaseMemoryStore(client=fake.client(), api_key="another-key")


def test_an_error_about_options_never_shows_the_key(fake):
    with pytest.raises(ValueError) as raised:
        MembaseMemoryStore(client=fake.client(), api_key=API_KEY)
    assert API_KEY not in str(raised.value)


def test_options_are_keyword_only(fake):
    with pytest.raises(TypeError):
        MembaseMemoryStore(fake.client())  # type: ignore[misc]


def test_building_a_store_makes_no_request(fake):
    MembaseMemoryStore(client=fake.client(), container="Main", capture=True, extraction=True)
    assert fake.sent() == []


# --- Host and key -------------------------------------------------------------------------------


@pytest.fixture
def clean_env(monkeypatch):
    for name in ("MEMBASE_API_KEY", "MEMBASE_BASE_URL", "MEMBASE_LOCAL"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_the_default_host_is_api_app_membase_com(clean_env):
    with MembaseMemoryStore(api_key=API_KEY) as store:
        assert client_of(store).base_url == DEFAULT_HOST


def test_membase_base_url_overrides_the_default_host(clean_env):
    clean_env.setenv("MEMBASE_BASE_URL", "https://membase.example")
    with MembaseMemoryStore(api_key=API_KEY) as store:
        assert client_of(store).base_url == "https://membase.example"


def test_base_url_overrides_the_environment(clean_env):
    clean_env.setenv("MEMBASE_BASE_URL", "https://membase.example")
    with MembaseMemoryStore(api_key=API_KEY, base_url="https://other.example") as store:
        assert client_of(store).base_url == "https://other.example"


def test_the_key_comes_from_membase_api_key(clean_env):
    clean_env.setenv("MEMBASE_API_KEY", API_KEY)
    with MembaseMemoryStore() as store:
        assert client_of(store).api_key == API_KEY
        assert client_of(store).base_url == DEFAULT_HOST


def test_no_key_anywhere_is_an_error_naming_membase_api_key(clean_env):
    with pytest.raises(ValueError, match="MEMBASE_API_KEY"):
        MembaseMemoryStore()


# --- Lifecycle ----------------------------------------------------------------------------------


def test_close_leaves_a_client_that_was_passed_in_open(fake):
    client = fake.client()
    store = MembaseMemoryStore(client=client)
    store.close()

    client.search("ledger")  # the client still sends: the request reaches Membase
    assert len(fake.sent("POST", "/v1/search")) == 1


def test_a_store_built_from_a_key_shares_the_pool_and_closing_it_leaves_the_pool_open():
    # Its connections belong to the process's one pool for the base URL: nothing of the store's own to close.
    with LoopbackMembase() as server:
        server.fake.remember(FACT)
        first, second = (MembaseMemoryStore(api_key=API_KEY, base_url=server.url, recall_timeout=30.0) for _ in "ab")
        first_agent, first_model = make_agent(first, ["ok"])
        second_agent, second_model = make_agent(second, ["ok"])

        first_agent(QUESTION)
        first.close()
        first.close()  # twice is harmless
        second_agent(QUESTION)
        second.close()

        assert f"[Main] {FACT}" in first_model.memory_block()
        assert f"[Main] {FACT}" in second_model.memory_block()
        assert len(server.fake.sent("POST", "/v1/search")) == 2
        # The second store's recall went over the connection the first one opened, still open after its close.
        assert server.connections == 1


def test_the_context_manager_closes_the_store(fake):
    fake.remember(FACT)
    with fake.store() as store:
        assert asyncio.run(store.search(QUESTION))

    with pytest.raises(RuntimeError, match="closed"):
        asyncio.run(store.search(QUESTION))
    assert len(fake.sent("POST", "/v1/search")) == 1


@pytest.mark.skipif(local_unavailable() is not None, reason=f"local Membase cannot run here: {local_unavailable()}")
def test_close_closes_a_local_engine_the_store_started(tmp_path, clean_env):
    clean_env.delenv("OPENAI_API_KEY", raising=False)  # starting the engine needs no LLM
    store = MembaseMemoryStore(local=tmp_path)
    engine = client_of(store)

    store.close()

    with pytest.raises(RuntimeError, match="closed"):
        engine.containers.list()


async def test_a_closed_store_raises_a_clear_runtime_error(fake, make_store):
    store = make_store(capture=True)
    store.close()

    with pytest.raises(RuntimeError, match="closed"):
        await store.search(QUESTION)
    with pytest.raises(RuntimeError, match="closed"):
        await store.add("I like green tea")
    with pytest.raises(RuntimeError, match="closed"):
        await store.add_messages([{"role": "user", "content": [{"text": "I like green tea"}]}])
    assert fake.sent() == []


def test_repr_and_str_never_show_the_key(fake, clean_env):
    built = MembaseMemoryStore(api_key=API_KEY)
    given = MembaseMemoryStore(client=fake.client(), container="Main")
    try:
        for store in (built, given):
            assert API_KEY not in repr(store)
            assert API_KEY not in str(store)
            assert "MembaseMemoryStore" in repr(store)
    finally:
        built.close()
        given.close()


# --- Protocol attributes ------------------------------------------------------------------------


def test_protocol_attributes_and_their_defaults(fake):
    store = MembaseMemoryStore(client=fake.client())

    assert store.name == "membase"
    assert isinstance(store.description, str) and store.description.strip()
    assert store.max_search_results == 5
    assert store.writable is False
    assert store.extraction is None


def test_the_name_is_the_stores_name_in_the_manager(fake, make_store):
    fake.remember(FACT)
    agent, model = make_agent(make_store(name="work"), ["ok"])

    agent(QUESTION)

    assert f'<entry source="work">[Main] {FACT}</entry>' in model.memory_block()


def test_the_store_goes_into_a_memory_manager_with_its_tools(fake, make_store):
    manager = MemoryManager(stores=[make_store()])
    names = [tool.tool_name for tool in manager.tools]
    assert "search_memory" in names
    assert {"membase_search", "membase_save", "membase_profile"} <= set(names)
    assert not any("delete" in n or "forget" in n for n in names)


# --- Keys read from files, and one set-up check per store ------------------------------------------


def test_whitespace_around_the_key_is_stripped_and_a_key_with_control_characters_is_refused():
    store = MembaseMemoryStore(api_key=f"  {API_KEY}\n", base_url="http://127.0.0.1:9")
    assert client_of(store).api_key == API_KEY
    store.close()
    with pytest.raises(ValueError, match="api_key") as refused:
        MembaseMemoryStore(api_key=f"{API_KEY}\x01x", base_url="http://127.0.0.1:9")
    assert API_KEY not in str(refused.value)


def test_the_quoted_form_of_the_key_is_masked_too():
    from membase_strands._failures import redact

    assert redact(f"Illegal header value b'Bearer {API_KEY}\\n'", f"{API_KEY}\n") == (
        "Illegal header value b'Bearer [redacted]'"
    )


def test_the_memories_are_listed_once_per_store_however_many_agents_are_built(fake, make_store):
    store = make_store(container="Main")
    for _ in range(3):
        make_agent(store)
    assert len(fake.sent("GET", "/v1/containers")) == 1
