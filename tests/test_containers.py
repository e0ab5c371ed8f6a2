"""A pinned Memory: names resolved to ids once, errors that name what is in reach, a second chance on refusal, and
the set-up check when an agent is built (``_containers``)."""

from __future__ import annotations

import logging

import pytest

from membase_strands import MembaseAccessError
from membase_strands._containers import Container, match, parse_containers
from membase_strands._failures import BadResponseError
from membase_strands.testing import API_KEY, ToolCall, hang, refuse_connection, status
from tests.support.agents import tool_turn
from tests.support.store_helpers import FACT, LONG, QUESTION, make_agent, membase_threads, routed, wait_until

TWO = [{"id": "ctr_main", "name": "Main"}, {"id": "ctr_work", "name": "Work"}]
BUDGET = 0.3  # for the set-up checks that must outlast it: held by a gate, not by the clock


def search_containers(fake) -> list[str | None]:
    return [r.body.get("container") for r in fake.sent("POST", "/v1/search")]


def warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_pinned_memory_is_searched_by_its_id_resolved_once_however_many_agents_are_built(fake, make_store):
    fake.containers = TWO
    fake.remember(FACT)
    fake.remember("We chose MySQL for the work ledger.", container="ctr_work")
    for given in ("Main", "main", "MAIN", " main ", "ctr_main"):
        fake.requests.clear()
        store = make_store(container=given)
        [make_agent(store) for _ in range(2)]  # agents built before the turns list nothing again
        agent, model = make_agent(store, ["Postgres."] * 2)

        agent(QUESTION)
        agent(QUESTION)

        assert search_containers(fake) == ["ctr_main"] * 2, given
        assert len(fake.sent("GET", "/v1/containers")) == 1, given
        assert f"[Main] {FACT}" in model.memory_block() and "MySQL" not in model.memory_block()


def test_an_exact_id_wins_over_a_name_that_matches_another_memory(fake, make_store):
    fake.containers = [{"id": "ctr_x", "name": "ctr_y"}, {"id": "ctr_y", "name": "Other"}]
    agent, _ = make_agent(make_store(container="ctr_y"))

    agent(QUESTION)

    assert search_containers(fake) == ["ctr_y"]


async def test_an_unknown_or_ambiguous_name_stops_the_agent_being_built_naming_the_memories(fake, make_store):
    fake.containers = TWO
    with pytest.raises(ValueError, match="Projects") as raised:
        make_agent(make_store(container="Projects"))
    assert "Memories in reach: 'Main', 'Work'" in str(raised.value)
    with pytest.raises(ValueError, match="Memories in reach: 'Main', 'Work'"):
        await make_store(container="Projects").search(QUESTION)  # and from search directly, without an agent

    fake.containers = [{"id": "ctr_a", "name": "Notes"}, {"id": "ctr_b", "name": "NOTES"}]
    with pytest.raises(ValueError, match="several") as raised:
        make_agent(make_store(container="notes"))
    assert all(name in str(raised.value) for name in ("'Notes'", "'NOTES'", "ctr_a", "ctr_b"))
    assert fake.sent("POST", "/v1/search") == []


def test_capture_needs_a_pin_only_with_several_memories_and_without_either_the_check_makes_no_request(fake, make_store):
    make_agent(make_store())
    assert fake.sent() == []  # neither pinned nor capturing: nothing to check
    make_agent(make_store(capture=True))  # one Memory in reach: capture writes there

    fake.containers = TWO
    with pytest.raises(ValueError, match="container=") as raised:
        make_agent(make_store(capture=True))
    assert "'Main'" in str(raised.value) and "'Work'" in str(raised.value)


# A refused connection is sent once more: it could not have reached Membase.
@pytest.mark.parametrize(
    "faults", [[refuse_connection] * 2, [status(403, f"unknown key {API_KEY}")]], ids=["down", "403"]
)
def test_a_memory_list_that_fails_does_not_stop_the_agent_and_first_use_resolves_again(
    fake, make_store, caplog, no_key_in_logs, faults
):
    fake.remember(FACT)
    fake.on("GET", "/v1/containers", *faults)
    agent, model = make_agent(make_store(container="main"), ["Postgres."])

    assert any("could not list the Memories" in w for w in warnings(caplog))
    agent(QUESTION)  # Membase is back: the pinned Memory resolves at first use

    assert search_containers(fake) == ["ctr_main"]
    assert f"[Main] {FACT}" in model.memory_block()


def test_a_membase_that_stays_unreachable_costs_the_turn_no_memory_and_sends_no_search(fake, make_store, caplog):
    fake.always("GET", "/v1/containers", refuse_connection)
    agent, model = make_agent(make_store(container="Main"), ["Answered without memory."])

    assert "Answered without memory." in str(agent(QUESTION))
    assert model.memory_block() is None and fake.sent("POST", "/v1/search") == []


def test_agents_built_during_an_outage_each_wait_for_the_one_set_up_check(fake, make_store, gates, caplog):
    fake.remember(FACT)
    outage = gates.new()
    fake.on("GET", "/v1/containers", hang(outage, then=routed(fake)))
    store = make_store(name="outage", container="Main", recall_timeout=BUDGET)

    for _ in range(3):  # each waits the budget for the same late check, then is built without it
        make_agent(store)

    assert sum("could not list the Memories" in w for w in warnings(caplog)) == 3
    assert len(fake.sent("GET", "/v1/containers")) == 1 and not outage.is_set()
    # The check ends: the next agent and first use (a tool, whatever the budget) use its answer, listing nothing.
    outage.set()
    assert wait_until(lambda: not membase_threads(f"membase-check[{store.name}]"), timeout=LONG)
    model = tool_turn(store, ToolCall("membase_search", {"query": "ledger"}))
    assert len(fake.sent("GET", "/v1/containers")) == 1
    assert search_containers(fake) == ["ctr_main"] and f"[Main] {FACT}" in model.tool_result_text()


def test_a_late_set_up_check_that_finds_an_unknown_memory_stops_the_next_agent(fake, make_store, gates):
    outage = gates.new()
    fake.on("GET", "/v1/containers", hang(outage, then=routed(fake)))
    store = make_store(name="late-check", container="Projects", recall_timeout=BUDGET)
    make_agent(store)  # built without the check: Membase did not answer in time

    outage.set()
    assert wait_until(lambda: not membase_threads(f"membase-check[{store.name}]"), timeout=LONG)
    with pytest.raises(ValueError, match="Memories in reach: 'Main'"):
        make_agent(store)
    assert len(fake.sent("GET", "/v1/containers")) == 1


# --- A second chance when Membase refuses a cached id --------------------------------------------


def test_a_memory_made_anew_is_resolved_again_once(fake, make_store):
    fake.remember(FACT, container="ctr_main_v2")
    agent, model = make_agent(make_store(container="Main"), ["Postgres."])
    assert len(fake.sent("GET", "/v1/containers")) == 1  # resolved and cached while building

    fake.containers = [{"id": "ctr_main_v2", "name": "Main"}]  # the cached id is now refused with a 403
    agent(QUESTION)

    assert search_containers(fake) == ["ctr_main", "ctr_main_v2"]
    assert len(fake.sent("GET", "/v1/containers")) == 2
    assert f"[Main] {FACT}" in model.memory_block()


@pytest.mark.parametrize("renamed", [True, False], ids=["made-anew", "same-id"])
async def test_a_refusal_that_survives_the_second_chance_is_an_access_error(fake, make_store, renamed):
    store = make_store(container="Main")
    await store.initialize()
    if renamed:
        fake.containers = [{"id": "ctr_main_v2", "name": "Main"}]
    fake.on("POST", "/v1/search", status(403), status(403))

    with pytest.raises(MembaseAccessError, match="narrowed or revoked"):
        await store.search(QUESTION)

    # Listed again once; a Memory that still resolves to the refused id is not searched again.
    assert search_containers(fake) == (["ctr_main", "ctr_main_v2"] if renamed else ["ctr_main"])
    assert len(fake.sent("GET", "/v1/containers")) == 2


async def test_a_refusal_of_a_fresh_resolution_is_believed_at_once(fake, make_store):
    fake.on("POST", "/v1/search", status(403))

    with pytest.raises(MembaseAccessError):
        await make_store(container="Main").search(QUESTION)

    assert search_containers(fake) == ["ctr_main"]
    assert len(fake.sent("GET", "/v1/containers")) == 1


# --- Units ----------------------------------------------------------------------------------------


def test_parse_containers_reads_ids_and_names_and_refuses_a_body_without_a_list():
    body = {"containers": [{"id": "a", "name": "A"}, {"id": "b"}, {"name": "no id"}, "junk", {"id": ""}]}
    assert parse_containers(body) == [Container("a", "A"), Container("b", "b")]
    for bad in (None, [], {"containers": None}, {"items": []}):
        with pytest.raises(BadResponseError):
            parse_containers(bad)


def test_match_is_case_insensitive_prefers_an_exact_id_and_says_when_none_is_in_reach():
    containers = [Container("ctr_1", "Main"), Container("ctr_2", "ctr_1")]
    assert match("MAIN", containers).id == "ctr_1"
    assert match("ctr_1", containers).id == "ctr_1"
    with pytest.raises(ValueError, match="Memories in reach: none"):
        match("Main", [])
