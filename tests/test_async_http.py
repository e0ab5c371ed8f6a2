"""Awaited requests on the I/O loop: what the SDK would send, its errors, deadlines, closing and idle connections."""

from __future__ import annotations

import functools
import json
import ssl
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import membase
import pytest
import trustme

from membase_strands import _client
from membase_strands._async_http import RECENTLY_USED_SECONDS, AsyncMembaseHTTP
from membase_strands._io_loop import IOLoop
from membase_strands.testing import API_KEY
from tests.support.loopback import LoopbackMembase, closing, drip, ok_json, reset
from tests.support.store_helpers import route_hosted_clients, wait_until

SEARCH = {"q": "Which database?", "container": "ctr_main", "limit": 5}
DEADLINE = 0.6  # the client's timeout in the deadline tests, so a drip outlasts it many times over
SLACK = 2.0


@pytest.fixture
def io() -> IOLoop:
    return IOLoop(idle_seconds=0.2, sweep_seconds=0.05)


@pytest.fixture
def loopback() -> Iterator[LoopbackMembase]:
    with LoopbackMembase() as server:
        yield server


@pytest.fixture
def tls_loopback(monkeypatch: pytest.MonkeyPatch) -> Iterator[LoopbackMembase]:
    """The loopback server over TLS, with a certificate from a throwaway authority that the awaited client trusts."""
    authority = trustme.CA()
    served = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    authority.issue_cert("127.0.0.1").configure_cert(served)
    trusted = ssl.create_default_context()
    authority.configure_trust(trusted)
    monkeypatch.setattr(
        _client, "new_async_http_client", functools.partial(_client.new_async_http_client, verify=trusted)
    )
    with LoopbackMembase(tls=served) as server:
        yield server


def call(http: AsyncMembaseHTTP, method: str, path: str, **kwargs: Any) -> Any:
    """Send one request on the loop and wait for its outcome, as the store's recall does."""
    return http.io.submit(lambda: http.request(method, path, **kwargs)).result(timeout=30)


def recording(status: int, **answer: Any) -> tuple[list[httpx.Request], Any]:
    """The requests seen, and a responder answering each with a new ``httpx.Response(status, **answer)``."""
    seen: list[httpx.Request] = []

    def handle(request: httpx.Request) -> httpx.Response:
        request.read()
        seen.append(request)
        return httpx.Response(status, **answer)

    return seen, handle


def test_it_sends_what_the_sdk_sends(io, monkeypatch):
    seen, handle = recording(200, json={"results": []})
    route_hosted_clients(monkeypatch, handle)
    sdk = membase.Membase(
        api_key=API_KEY, base_url="https://membase.example", http_client=_client.new_http_client("https://x")
    )
    http = AsyncMembaseHTTP("https://membase.example", API_KEY, io=io)

    sdk.search(SEARCH["q"], container=SEARCH["container"], limit=SEARCH["limit"])
    call(http, "POST", "/v1/search", json=SEARCH)
    sdk.containers.list()
    call(http, "GET", "/v1/containers")

    by_sdk, awaited = seen[0::2], seen[1::2]
    for theirs, ours in zip(by_sdk, awaited, strict=True):
        assert (ours.method, ours.url.path, ours.url.params) == (theirs.method, theirs.url.path, theirs.url.params)
        for header in ("authorization", "accept", "user-agent", "content-type"):
            assert ours.headers.get(header) == theirs.headers.get(header), header
        assert ours.content == theirs.content
    assert json.loads(awaited[0].content) == SEARCH


@pytest.mark.parametrize(
    ("status", "body", "error", "text"),
    [
        (403, {"error": {"message": "key revoked"}}, membase.PermissionDeniedError, "key revoked"),
        (404, {"error": {"message": "no such Memory"}}, membase.NotFoundError, "no such Memory"),
        (429, {"error": {"message": "slow down"}}, membase.RateLimitError, "slow down"),
        (503, "upstream is down", membase.InternalServerError, "upstream is down"),
    ],
)
def test_a_refusal_raises_the_sdks_error_for_its_status(io, monkeypatch, status, body, error, text):
    answer = {"json": body} if isinstance(body, dict) else {"text": body}
    route_hosted_clients(monkeypatch, recording(status, **answer)[1])
    http = AsyncMembaseHTTP("https://membase.example", API_KEY, io=io)

    with pytest.raises(error, match=text) as raised:
        call(http, "POST", "/v1/search", json=SEARCH)
    assert raised.value.status == status


def test_an_empty_2xx_answer_is_none_and_an_unreadable_one_raises_like_the_sdk(io, monkeypatch):
    answers = iter([httpx.Response(204), httpx.Response(200, content=b"\xff\xfe not json")])
    route_hosted_clients(monkeypatch, lambda request: next(answers))
    http = AsyncMembaseHTTP("https://membase.example", API_KEY, io=io)

    assert call(http, "GET", "/v1/containers") is None
    with pytest.raises(ValueError):  # the gateway turns it into BadResponseError, as for the blocking client
        call(http, "GET", "/v1/containers")


def test_a_dripping_answer_ends_at_the_clients_timeout_with_the_sdks_timeout_error(io, loopback, monkeypatch):
    monkeypatch.setattr(
        _client, "new_async_http_client", functools.partial(_client.new_async_http_client, timeout=DEADLINE)
    )
    loopback.on("POST", "/v1/search", drip(every=0.1, limit=20 * DEADLINE))
    http = AsyncMembaseHTTP(loopback.url, API_KEY, io=io)

    started = time.monotonic()
    with pytest.raises(membase.APITimeoutError, match="timed out"):
        call(http, "POST", "/v1/search", json=SEARCH)
    assert time.monotonic() - started < DEADLINE + SLACK
    assert wait_until(lambda: loopback.open_connections == 0, timeout=SLACK), "the request was abandoned, not ended"


def test_a_reset_connection_raises_the_sdks_connection_error(io, loopback):
    loopback.on("POST", "/v1/search", reset)
    http = AsyncMembaseHTTP(loopback.url, API_KEY, io=io)

    with pytest.raises(membase.APIConnectionError) as raised:
        call(http, "POST", "/v1/search", json=SEARCH)
    assert not isinstance(raised.value, membase.APITimeoutError)
    assert API_KEY not in str(raised.value)


def test_close_ends_the_connection_and_later_requests_say_the_client_is_closed(io, loopback):
    loopback.on("POST", "/v1/search", ok_json({"results": []}))
    http = AsyncMembaseHTTP(loopback.url, API_KEY, io=io)
    call(http, "POST", "/v1/search", json=SEARCH)
    assert loopback.open_connections == 1  # kept alive for the next request

    http.close()

    assert wait_until(lambda: loopback.open_connections == 0, timeout=SLACK)
    with pytest.raises(RuntimeError, match="closed"):
        call(http, "POST", "/v1/search", json=SEARCH)


def test_a_connection_idle_past_its_keep_alive_expiry_is_closed_without_another_request(io, loopback, monkeypatch):
    monkeypatch.setattr(
        _client,
        "new_async_http_client",
        functools.partial(_client.new_async_http_client, limits=httpx.Limits(keepalive_expiry=0.3)),
    )
    loopback.on("POST", "/v1/search", ok_json({"results": []}))
    http = AsyncMembaseHTTP(loopback.url, API_KEY, io=io)

    call(http, "POST", "/v1/search", json=SEARCH)
    assert loopback.open_connections == 1

    # A pool used within RECENTLY_USED_SECONDS is left to tidy itself at its next request; then the sweep comes.
    idle_for = RECENTLY_USED_SECONDS + SLACK
    assert wait_until(lambda: loopback.open_connections == 0, timeout=idle_for), "the idle connection stayed open"
    assert wait_until(lambda: not io.running, timeout=SLACK)  # and with nothing left to do, the loop retired


def test_the_key_is_never_in_its_repr():
    http = AsyncMembaseHTTP("https://membase.example", API_KEY)

    assert API_KEY not in repr(http) and "membase.example" in repr(http)


def test_many_threads_share_one_client_per_store(io, monkeypatch):
    built = route_hosted_clients(monkeypatch, recording(200, json={"results": []})[1])
    http = AsyncMembaseHTTP("https://membase.example", API_KEY, io=io)
    errors: list[BaseException] = []

    def search() -> None:
        try:
            call(http, "POST", "/v1/search", json=SEARCH)
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=search) for _ in range(10)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)

    assert errors == []
    assert len(built.awaited) == 1


def test_over_tls_requests_share_one_connection_and_get_their_answers(io, tls_loopback):
    tls_loopback.on("POST", "/v1/search", ok_json({"results": [{"content": "first"}]}))
    tls_loopback.on("POST", "/v1/search", ok_json({"results": [{"content": "second"}]}))
    http = AsyncMembaseHTTP(tls_loopback.url, API_KEY, io=io)

    assert call(http, "POST", "/v1/search", json=SEARCH)["results"][0]["content"] == "first"
    assert call(http, "POST", "/v1/search", json=SEARCH)["results"][0]["content"] == "second"

    assert tls_loopback.url.startswith("https://")
    assert tls_loopback.connections == 1
    http.close()
    assert wait_until(lambda: tls_loopback.open_connections == 0, timeout=SLACK)


def test_over_tls_a_certificate_nobody_vouched_for_is_a_connection_error(io, loopback):
    with LoopbackMembase(tls=_self_vouched()) as untrusted:
        http = AsyncMembaseHTTP(untrusted.url, API_KEY, io=io)

        with pytest.raises(membase.APIConnectionError, match="CERTIFICATE_VERIFY_FAILED"):
            call(http, "POST", "/v1/search", json=SEARCH)
        assert untrusted.fake.sent() == []


@pytest.mark.parametrize("scheme", ["http", "https"])
def test_a_connection_the_server_closed_after_answering_is_not_reused(io, loopback, tls_loopback, scheme):
    server = tls_loopback if scheme == "https" else loopback
    server.on("POST", "/v1/search", closing(ok_json({"results": []})))
    http = AsyncMembaseHTTP(server.url, API_KEY, io=io)
    call(http, "POST", "/v1/search", json=SEARCH)
    assert wait_until(lambda: server.open_connections == 0, timeout=SLACK)

    assert call(http, "POST", "/v1/search", json=SEARCH)["results"] == []  # on a new connection, no error

    assert server.connections == 2


def _self_vouched() -> ssl.SSLContext:
    """A server context whose certificate comes from an authority no client was told to trust."""
    served = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    trustme.CA().issue_cert("127.0.0.1").configure_cert(served)
    return served


def test_over_tls_close_does_not_wait_for_a_close_notify_the_server_never_sends(io, tls_loopback):
    # The loopback server closes its end without a TLS close_notify, as many servers and proxies do.
    tls_loopback.on("POST", "/v1/search", ok_json({"results": []}))
    http = AsyncMembaseHTTP(tls_loopback.url, API_KEY, io=io)
    call(http, "POST", "/v1/search", json=SEARCH)

    started = time.monotonic()
    http.close()

    assert time.monotonic() - started < 1.0  # waiting for the server's close_notify took the whole close budget
    assert wait_until(lambda: tls_loopback.open_connections == 0, timeout=SLACK)
