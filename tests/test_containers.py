"""A pinned Memory: names resolved to ids once, errors that name what is in reach, a second chance on refusal."""

from __future__ import annotations

import logging

import pytest
from strands import Agent
from strands.memory import MemoryManager

from membase_strands import MembaseAccessError, MembaseMemoryStore
from membase_strands._containers import Container, ContainerResolver, match, parse_containers
from membase_strands.testing import API_KEY, ScriptedModel, ToolCall, hang, refuse_connection, status
from tests.support.store_helpers import FACT, QUESTION, make_agent

TWO = [{"id": "ctr_main", "name": "Main"}, {"id": "ctr_work", "name": "Work"}]


def search_containers(fake) -> list[str | None]:
    return [r.body.get("container") for r in fake.sent("POST", "/v1/search")]


# --- Through a real Agent -----------------------------------------------------------------------


@pytest.mark.parametrize("given", ["Main", "main", "MAIN", " main ", "ctr_main"])
def test_a_pinned_memory_is_searched_by_its_id(fake, make_store, given):
    fake.containers = TWO
    fake.remember(FACT)
    fake.remember("We chose MySQL for the work ledger.", container="ctr_work")
    agent, model = make_agent(make_store(container=given), ["Postgres."])

    agent(QUESTION)

    assert search_containers(fake) == ["ctr_main"]
    block = model.memory_block()
    assert f"[Main] {FACT}" in block
    assert "MySQL" not in block


def test_the_id_is_resolved_once_and_cached(fake, make_store):
    fake.remember(FACT)
    agent, _ = make_agent(make_store(container="main"))

    for _ in range(3):
        agent(QUESTION)

    assert len(fake.sent("GET", "/v1/containers")) == 1
    assert search_containers(fake) == ["ctr_main"] * 3


def test_an_unknown_name_stops_the_agent_being_built_and_lists_the_names(fake, make_store):
    fake.containers = TWO
    store = make_store(container="Projects")

    with pytest.raises(ValueError, match="Projects") as raised:
        make_agent(store)

    assert "'Main'" in str(raised.value) and "'Work'" in str(raised.value)
    assert fake.sent("POST", "/v1/search") == []


def test_an_ambiguous_name_stops_the_agent_being_built_and_names_both(fake, make_store):
    fake.containers = [{"id": "ctr_a", "name": "Notes"}, {"id": "ctr_b", "name": "NOTES"}]
    store = make_store(container="notes")

    with pytest.raises(ValueError, match="several") as raised:
        make_agent(store)

    message = str(raised.value)
    assert "'Notes'" in message and "'NOTES'" in message
    assert "ctr_a" in message and "ctr_b" in message


def test_an_exact_id_wins_over_a_name_that_matches_another_memory(fake, make_store):
    fake.containers = [{"id": "ctr_x", "name": "ctr_y"}, {"id": "ctr_y", "name": "Other"}]
    agent, _ = make_agent(make_store(container="ctr_y"))

    agent(QUESTION)

    assert search_containers(fake) == ["ctr_y"]


def test_an_unreachable_membase_does_not_stop_the_agent_being_built(fake, make_store, caplog, no_key_in_logs):
    fake.always("GET", "/v1/containers", refuse_connection)
    store = make_store(container="Main")

    agent, model = make_agent(store, ["Answered without memory."])

    assert any("could not list the Memories" in r.getMessage() for r in caplog.records)
    # The turn still goes on (the check is left for the first real call, which also fails here).
    assert "Answered without memory." in str(agent(QUESTION))
    assert model.memory_block() is None
    assert fake.sent("POST", "/v1/search") == []


def test_a_hung_membase_holds_agent_construction_no_longer_than_the_budget(fake, make_store, gates, caplog):
    fake.remember(FACT)
    gate = gates.new()
    answered = []
    held = hang(gate, then=status(503))

    def list_held_until_the_test_ends(request):
        response = held(request)
        answered.append(response)
        return response

    fake.on("GET", "/v1/containers", list_held_until_the_test_ends)
    store = make_store(container="Main", recall_timeout=0.3)

    agent, model = make_agent(store, [ToolCall("membase_search", {"query": "ledger"}), "Postgres."], injection=False)

    # Built while Membase was still holding the list: the budget, not Membase, ended the wait.
    assert answered == [] and len(fake.sent("GET", "/v1/containers")) == 1
    assert any("could not list the Memories" in r.getMessage() for r in caplog.records)
    agent(QUESTION)  # the check is made again at first use (no budget: a tool), and Membase answers now
    assert search_containers(fake) == ["ctr_main"]
    assert f"[Main] {FACT}" in model.tool_result_text()


def test_once_membase_is_back_the_pinned_memory_resolves_at_first_use(fake, make_store):
    fake.remember(FACT)
    fake.on("GET", "/v1/containers", refuse_connection)
    agent, model = make_agent(make_store(container="main"), ["Postgres."])

    agent(QUESTION)

    assert search_containers(fake) == ["ctr_main"]
    assert f"[Main] {FACT}" in model.memory_block()


def test_a_renamed_memory_is_resolved_again_once(fake, make_store):
    fake.remember(FACT, container="ctr_main_v2")
    agent, model = make_agent(make_store(container="Main"), ["Postgres."])
    assert len(fake.sent("GET", "/v1/containers")) == 1  # resolved and cached while building

    # The Memory was made anew: the cached id is now refused with a 403.
    fake.containers = [{"id": "ctr_main_v2", "name": "Main"}]
    agent(QUESTION)

    assert search_containers(fake) == ["ctr_main", "ctr_main_v2"]
    assert len(fake.sent("GET", "/v1/containers")) == 2
    assert f"[Main] {FACT}" in model.memory_block()


async def test_a_refusal_that_survives_the_second_chance_is_an_access_error(fake, make_store):
    store = make_store(container="Main")
    await store.initialize()
    fake.containers = [{"id": "ctr_main_v2", "name": "Main"}]
    fake.on("POST", "/v1/search", status(403), status(403))

    with pytest.raises(MembaseAccessError, match="narrowed or revoked"):
        await store.search(QUESTION)

    assert search_containers(fake) == ["ctr_main", "ctr_main_v2"]


async def test_a_refused_id_that_still_resolves_the_same_is_not_sent_again(fake, make_store):
    store = make_store(container="Main")
    await store.initialize()
    fake.on("POST", "/v1/search", status(403))

    with pytest.raises(MembaseAccessError):
        await store.search(QUESTION)

    assert search_containers(fake) == ["ctr_main"]
    assert len(fake.sent("GET", "/v1/containers")) == 2


async def test_a_refusal_of_a_fresh_resolution_is_believed_at_once(fake, make_store):
    fake.on("POST", "/v1/search", status(403))

    with pytest.raises(MembaseAccessError):
        await make_store(container="Main").search(QUESTION)

    assert search_containers(fake) == ["ctr_main"]
    assert len(fake.sent("GET", "/v1/containers")) == 1


async def test_an_unknown_name_raises_from_search_directly(fake, make_store):
    fake.containers = TWO

    with pytest.raises(ValueError, match="Memories in reach: 'Main', 'Work'"):
        await make_store(container="Projects").search(QUESTION)

    assert fake.sent("POST", "/v1/search") == []


def test_without_a_pin_and_without_capture_initialize_makes_no_request(fake, make_store):
    make_agent(make_store())
    assert fake.sent() == []


def test_capture_with_several_memories_and_no_pin_stops_the_agent_being_built(fake, make_store):
    fake.containers = TWO
    store = make_store(capture=True)

    with pytest.raises(ValueError, match="container=") as raised:
        Agent(model=ScriptedModel(), memory_manager=MemoryManager(stores=[store]), callback_handler=None)

    assert "'Main'" in str(raised.value) and "'Work'" in str(raised.value)


def test_capture_with_one_memory_and_no_pin_is_fine(fake, make_store):
    agent, _ = make_agent(make_store(capture=True))
    assert agent is not None


def test_a_403_while_listing_memories_is_logged_without_the_key(fake, make_store, caplog, no_key_in_logs):
    fake.on("GET", "/v1/containers", status(403, f"unknown key {API_KEY}"))

    make_agent(make_store(container="Main"))

    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("could not list the Memories" in w for w in warnings)


@pytest.mark.parametrize("bad", ["", "   ", 7])
def test_a_blank_or_non_string_container_is_an_option_error(fake, bad):
    with pytest.raises(ValueError, match="container"):
        MembaseMemoryStore(client=fake.client(), container=bad)


# --- Units ----------------------------------------------------------------------------------------


def test_parse_containers_reads_ids_and_names_and_skips_rows_without_ids():
    body = {"containers": [{"id": "a", "name": "A"}, {"id": "b"}, {"name": "no id"}, "junk", {"id": ""}]}
    assert parse_containers(body) == [Container("a", "A"), Container("b", "b")]


@pytest.mark.parametrize("body", [None, [], {"containers": None}, {"items": []}])
def test_parse_containers_rejects_a_body_without_a_list(body):
    from membase_strands._failures import BadResponseError

    with pytest.raises(BadResponseError):
        parse_containers(body)


def test_match_is_case_insensitive_and_prefers_an_exact_id():
    containers = [Container("ctr_1", "Main"), Container("ctr_2", "ctr_1")]
    assert match("MAIN", containers).id == "ctr_1"
    assert match("ctr_1", containers).id == "ctr_1"


def test_match_with_no_memories_in_reach_says_none():
    with pytest.raises(ValueError, match="Memories in reach: none"):
        match("Main", [])


class Listing:
    """A stand-in client whose containers.list() answers from a list that tests can change."""

    def __init__(self, rows: list[dict[str, str]]) -> None:
        self.rows = rows
        self.lists = 0
        self.containers = self

    def list(self) -> dict[str, object]:
        self.lists += 1
        return {"containers": list(self.rows)}


def test_the_resolver_passes_none_through_without_listing():
    client = Listing([])
    assert ContainerResolver().call(client, None, lambda cid: cid) is None
    assert client.lists == 0


def test_the_resolver_caches_and_remembers():
    client = Listing([{"id": "ctr_main", "name": "Main"}])
    resolver = ContainerResolver()

    assert resolver.resolve(client, "main") == "ctr_main"
    assert resolver.resolve(client, "main") == "ctr_main"
    assert client.lists == 1

    resolver.remember("Work", "ctr_work")
    assert resolver.resolve(client, "Work") == "ctr_work"
    assert client.lists == 1


def test_the_resolver_retries_a_refused_cached_id_once_with_the_new_id():
    import membase

    client = Listing([{"id": "ctr_old", "name": "Main"}])
    resolver = ContainerResolver()
    resolver.resolve(client, "Main")
    client.rows = [{"id": "ctr_new", "name": "Main"}]
    sent: list[str | None] = []

    def request(cid: str | None) -> str:
        sent.append(cid)
        if cid == "ctr_old":
            raise membase.NotFoundError("gone", status=404, body=None)
        return f"ok:{cid}"

    assert resolver.call(client, "Main", request) == "ok:ctr_new"
    assert sent == ["ctr_old", "ctr_new"]
    assert resolver.resolve(client, "Main") == "ctr_new"
