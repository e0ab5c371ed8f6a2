"""The gateway: the one door to Membase that the store, the tools and the setup check go through."""

from __future__ import annotations

import logging

import httpx
import membase
import pytest
from membase.requirements import local_unavailable

from membase_strands._gateway import MembaseGateway
from membase_strands.testing import API_KEY, InMemoryMembase, status

SEARCH = ("POST", "/v1/search")
MEMORIES = ("POST", "/v1/memories")


def key_built(fake: InMemoryMembase) -> MembaseGateway:
    """A gateway built from the key, as a store builds it, over the fake."""
    return MembaseGateway(api_key=API_KEY, base_url=fake.base_url)


def test_a_search_for_automatic_recall_makes_one_attempt_and_the_tools_let_the_sdk_retry(fake: InMemoryMembase):
    gateway = key_built(fake)
    fake.on(*SEARCH, status(503), status(503))
    with pytest.raises(membase.InternalServerError):
        gateway.search("ledger", 5, None, retry=False)
    assert len(fake.sent(*SEARCH)) == 1

    fake.remember("We chose Postgres for the ledger.")
    fake.on(*SEARCH, status(503))
    answer = gateway.search("ledger", 5, None, retry=True)
    assert [p.text for p in answer.passages] == ["We chose Postgres for the ledger."]
    assert len(fake.sent(*SEARCH)) == 4  # one attempt, then a 503 and its retry


def test_a_memory_named_by_name_is_looked_up_once_then_cached(fake: InMemoryMembase):
    gateway = MembaseGateway(client=fake.client())
    fake.add_memory("Work", "ctr_work")

    assert gateway.container_id("Work") == "ctr_work"
    gateway.search("ledger", 5, "Work", retry=False)
    gateway.save("A note.", "Work")

    assert len(fake.sent("GET", "/v1/containers")) == 1
    assert [r.body["container"] for r in fake.sent(*SEARCH)] == ["ctr_work"]
    assert fake.saved("Work") == ["A note."]


def test_an_unknown_memory_name_is_a_value_error_that_lists_the_names_in_reach(fake: InMemoryMembase):
    gateway = MembaseGateway(client=fake.client())
    with pytest.raises(ValueError, match="Memories in reach: 'Main'"):
        gateway.save("A note.", "Journal")
    assert fake.sent(*MEMORIES) == []


def test_a_save_is_one_attempt_and_a_2xx_it_cannot_read_counts_as_saved(fake: InMemoryMembase, caplog):
    caplog.set_level(logging.WARNING)
    gateway = key_built(fake)
    fake.on(*MEMORIES, status(503))
    with pytest.raises(membase.InternalServerError):
        gateway.save("I like green tea.", None)
    assert len(fake.sent(*MEMORIES)) == 1  # a POST that failed may be stored: never resent blindly

    fake.on(*MEMORIES, lambda request: httpx.Response(200, content=b'{"memory_id": "\xe2\x82'))
    assert gateway.save("I like green tea.", None) is None
    assert any("counting it as saved" in r.getMessage() for r in caplog.records)


def test_the_profile_and_the_memories_in_reach(fake: InMemoryMembase):
    fake.add_memory("Work")
    fake.standing.append("My name is Ada.")
    gateway = MembaseGateway(client=fake.client())

    assert [c.name for c in gateway.memories_in_reach()] == ["Main", "Work"]
    assert gateway.profile(None)["static"] == ["My name is Ada."]


def test_the_key_is_masked_and_never_part_of_where_membase_is() -> None:
    gateway = MembaseGateway(api_key=API_KEY, base_url="https://membase.example")
    error = membase.BadRequestError(f"bad key {API_KEY}", status=400)

    assert gateway.redact(f"echo {API_KEY}") == "echo [redacted]"
    assert API_KEY not in str(gateway.without_secret(error))
    assert gateway.location == "base_url='https://membase.example'" and gateway.hosted
    gateway.close()


def test_a_client_passed_in_is_used_as_it_is_and_never_closed(fake: InMemoryMembase) -> None:
    given = fake.client()
    gateway = MembaseGateway(client=given)
    assert gateway._client(retry=False) is given and gateway._client(retry=True) is given
    assert not gateway.owns_engine

    fake.on(*SEARCH, status(503))
    gateway.search("ledger", 5, None, retry=False)  # its own retries apply, even where a key-built one has none
    assert len(fake.sent(*SEARCH)) == 2
    gateway.close()

    given.search("ledger")  # still open: the request reaches Membase
    assert len(fake.sent(*SEARCH)) == 3


def test_a_gateway_built_from_a_key_has_nothing_of_its_own_to_close(fake: InMemoryMembase) -> None:
    first, second = key_built(fake), key_built(fake)
    assert not first.owns_engine
    # Both send through the process's one pool for the base URL, handed to the SDK as its http_client.
    assert first._client(retry=True)._http is second._client(retry=False)._http

    first.close()

    # The shared pool stays open: the closed gateway's neighbour, and the closed one itself, still reach Membase.
    second.search("ledger", 5, None, retry=False)
    first.search("ledger", 5, None, retry=False)
    assert len(fake.sent(*SEARCH)) == 2


@pytest.mark.skipif(local_unavailable() is not None, reason=f"local Membase cannot run here: {local_unavailable()}")
def test_a_local_engine_the_gateway_started_is_closed_with_it(tmp_path, monkeypatch) -> None:
    for variable in ("OPENAI_API_KEY", "MEMBASE_API_KEY"):
        monkeypatch.delenv(variable, raising=False)  # starting the engine needs no LLM and no key
    gateway = MembaseGateway(local=tmp_path)
    assert gateway.owns_engine and not gateway.hosted

    gateway.close()

    with pytest.raises(RuntimeError, match="closed"):
        gateway._client(retry=False).containers.list()
