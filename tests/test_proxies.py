"""Proxies, as httpx reads them and beyond what httpx bounds: the environment's proxy variables route a store as they
route a plain ``httpx.Client()`` (compared side by side through real proxies on loopback), a proxy URL httpx cannot
use is refused when the store is built (naming the variable, never its value), a tunnel the proxy refused or stalled
never counts as a note that may have arrived, a proxy that drips what comes back is cut off at ``request_timeout``,
and an https:// proxy to an https:// Membase (TLS inside TLS, which no deadline bounds) is refused when built.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import itertools
import logging
import socket
import threading
import traceback
from collections.abc import Callable, Iterator

import httpx
import membase
import pytest

from membase_strands import MembaseMemoryStore, MembaseStorePool
from membase_strands.testing import API_KEY, InMemoryMembase, ToolCall
from tests.support.loopback import LoopbackMembase
from tests.support.proxy import LoopbackProxy
from tests.support.store_helpers import FACT, LONG, QUESTION, make_agent

NOTE = "Remember that the ledger runs on Postgres."
FOUND = [f"[Main] {FACT}"]


def recall(store: MembaseMemoryStore) -> list[str]:
    return [entry.content for entry in asyncio.run(store.search(QUESTION))]


def port_of(url: str) -> int:
    return int(url.split("//")[1].split("/")[0].rsplit(":", 1)[1])


# --- Read once, when the store is built ---------------------------------------------------------------------------
def test_a_stores_recall_and_tools_go_through_the_proxy_the_environment_named_when_it_was_built(
    loopback, built, clean_network_env
):
    """``HTTP_PROXY`` is read once, when a store is built: set after a store was built, it changes neither that
    store's recall route nor its tools'; a store built while it is set sends both through it, even once it is unset."""
    with LoopbackMembase(InMemoryMembase()) as proxy:  # answers what it is sent as a proxy from its own memory
        proxy.fake.remember(f"Through the proxy: {FACT}")
        through = f"Through the proxy: {FACT}"

        def recalls_and_tool_find(store: MembaseMemoryStore, found: str) -> None:
            assert recall(store) == [f"[Main] {found}"]
            agent, model = make_agent(store, [ToolCall("membase_search", {"query": "ledger"}), "done"], injection=False)
            agent("go")
            assert found in model.tool_result_text()

        before = built(recall_timeout=LONG)
        clean_network_env.setenv("HTTP_PROXY", proxy.url.rsplit("/", 1)[0])
        proxied = built(recall_timeout=LONG)
        recalls_and_tool_find(before, FACT)
        recalls_and_tool_find(proxied, through)
        clean_network_env.delenv("HTTP_PROXY")
        recalls_and_tool_find(built(recall_timeout=LONG), FACT)
        recalls_and_tool_find(proxied, through)
        assert (len(proxy.fake.sent()), len(loopback.fake.sent())) == (4, 4)


# --- The same route as httpx --------------------------------------------------------------------------------------
NO_PROXY_FORMS = [  # as people write them; {port} is Membase's
    "",
    "*",
    "127.0.0.1",
    "127.0.0.1:{port}",
    "127.0.0.1:1",
    "127.0.0.0/8",
    "127.0.0.1/32",
    ".0.0.1",
    "0.0.1",
    "*.0.0.1",
    "localhost",
    "localhost,*",
    "::1",
    "example.com, 127.0.0.1 ",
    "example.com",
    "http://",
    "https://",
    "all://",
    "http://127.0.0.1",
    "https://127.0.0.1:{port}",
    "http://*:{port}",
    "https://*:{port}",
    "all://*:{port}",
    "all://*:1",
    "all://127.0.0.1",
    "https://*.0.0.1",
]


@pytest.mark.parametrize(
    "chosen", list(itertools.product([False, True], repeat=3)), ids=lambda c: "".join("-+"[x] for x in c)
)
@pytest.mark.parametrize("scheme", ["http", "https"])
def test_every_proxy_setting_routes_a_store_as_it_routes_a_plain_httpx_client(
    scheme, chosen, clean_network_env, certificates
):
    """Each combination of HTTP_PROXY (written without a scheme), HTTPS_PROXY and ALL_PROXY, each set or not, each
    a proxy of its own on loopback, with each NO_PROXY form: one recall of a store built then, and one request of an
    ``httpx.Client()`` built then, reach Membase (http:// or https://) through the same proxy, or both around them."""
    clean_network_env.setenv("SSL_CERT_FILE", str(certificates.ca_file))
    with (
        LoopbackMembase(tls=certificates.server() if scheme == "https" else None) as server,
        LoopbackProxy() as http_proxy,
        LoopbackProxy() as https_proxy,
        LoopbackProxy() as all_proxy,
    ):
        server.fake.remember(FACT)
        proxies = {"HTTP_PROXY": http_proxy, "HTTPS_PROXY": https_proxy, "ALL_PROXY": all_proxy}

        def route_taken(send: Callable[[], object]) -> str:
            before = {name: len(proxy.asked) for name, proxy in proxies.items()}
            assert send()
            return ",".join(name for name, proxy in proxies.items() if len(proxy.asked) > before[name]) or "direct"

        def store_recall() -> bool:
            with MembaseMemoryStore(api_key=API_KEY, base_url=server.url, recall_timeout=LONG) as store:
                return recall(store) == FOUND

        def plain_httpx() -> bool:
            with httpx.Client() as client:
                answer = client.get(f"{server.url}/v1/containers", headers={"Authorization": f"Bearer {API_KEY}"})
                return answer.status_code == 200

        differ, routes = [], set()
        for name, on in zip(proxies, chosen, strict=True):
            if on:  # HTTP_PROXY as people often write it, without a scheme
                clean_network_env.setenv(name, proxies[name].address if name == "HTTP_PROXY" else proxies[name].url)
            else:
                clean_network_env.delenv(name, raising=False)
        for form in NO_PROXY_FORMS:
            clean_network_env.setenv("NO_PROXY", form.format(port=port_of(server.url)))
            ours, theirs = route_taken(store_recall), route_taken(plain_httpx)
            routes.add(theirs)
            if ours != theirs:
                differ.append(f"NO_PROXY={form!r}: {ours} vs {theirs}")
        assert differ == [], f"{len(differ)} settings route the store unlike httpx, e.g. {differ[:5]}"
        set_now = {name for name, on in zip(proxies, chosen, strict=True) if on}
        for_scheme = "HTTP_PROXY" if scheme == "http" else "HTTPS_PROXY"
        expected = for_scheme if for_scheme in set_now else "ALL_PROXY" if "ALL_PROXY" in set_now else "direct"
        assert routes == {"direct", expected}  # the proxy httpx takes was taken, and NO_PROXY="*" went around it


# --- Proxy URLs httpx cannot use --------------------------------------------------------------------------------
def pieces(secret: str) -> set[str]:
    return {secret[at : at + 3] for at in range(len(secret) - 2)}


def shown_anywhere(error: BaseException) -> str:
    """What ``error`` and every error chained to it say (not the traceback's file paths: a checkout's own path may
    hold three characters of a password)."""
    said: list[str] = []
    seen: BaseException | None = error
    while seen is not None and len(said) < 64:
        said += [*traceback.format_exception_only(seen), repr(seen)]
        seen = seen.__cause__ or seen.__context__
    return "".join(said)


@pytest.mark.parametrize("password", ["Xk9#pa/ss?w0rd", "Xk9#p4ss", "Xk9/p4ss", "Xk9?p4ss"])
def test_a_proxy_url_httpx_cannot_parse_is_refused_when_a_store_or_pool_is_built_naming_its_variable(
    clean_network_env, password
):
    """A password holding '#', '/' or '?' (not percent-encoded) makes a proxy URL httpx cannot parse: httpx refuses to
    build a client, and so does the store, and the pool's store for a user, with an error that names the variable
    and holds no three characters of the password."""
    for variable in ("HTTPS_PROXY", "HTTP_PROXY", "ALL_PROXY"):
        clean_network_env.setenv(variable, f"http://user:{password}@127.0.0.1:3128")
        with pytest.raises(Exception):  # noqa: B017, PT011 - httpx's own refusal, whatever its kind
            httpx.Client()
        with pytest.raises(ValueError, match=variable) as store_refused:
            MembaseMemoryStore(api_key=API_KEY, base_url="https://membase.test")
        with pytest.raises(ValueError, match=variable) as pool_refused:
            MembaseStorePool(lambda user: API_KEY, base_url="https://membase.test").store_for("someone")
        for refused in (store_refused.value, pool_refused.value):
            assert not [piece for piece in pieces(password) if piece in shown_anywhere(refused)], refused
        clean_network_env.delenv(variable)


def test_a_proxy_password_shows_nowhere_and_a_proxy_scheme_httpx_cannot_use_is_refused_when_built(
    built, clean_network_env, caplog
):
    caplog.set_level(logging.DEBUG)
    password = "pr0xy-s3cret-pass"
    with socket_nobody_answers() as dead:
        clean_network_env.setenv("HTTP_PROXY", f"http://user:{password}@{dead}")
        store = built(recall_timeout=LONG, request_timeout=1.0)
        with pytest.raises(membase.APIConnectionError) as raised:
            recall(store)
        agent, model = make_agent(store, [ToolCall("membase_search", {"query": "ledger"}), "done"])
        agent("go")
    shown = [shown_anywhere(raised.value), repr(store), model.tool_result_text(), caplog.text]
    assert not [text for text in shown if password in text or "s3cret" in text]
    clean_network_env.setenv("HTTP_PROXY", f"ftp://user:{password}@127.0.0.1:1")
    with pytest.raises(ValueError, match="HTTP_PROXY: the scheme 'ftp'") as refused:
        built()
    assert password not in shown_anywhere(refused.value)
    clean_network_env.setenv("HTTP_PROXY", f"user:{password}@proxy.test:3128/?via=http://x")  # no scheme of its own
    with pytest.raises(ValueError, match="HTTP_PROXY: it names no scheme httpx takes") as refused:
        built()
    assert "s3cret" not in shown_anywhere(refused.value)


@pytest.mark.skipif(importlib.util.find_spec("socksio") is not None, reason="socksio is installed here")
def test_a_socks5_proxy_without_socksio_is_refused_when_the_store_is_built(clean_network_env):
    """httpx refuses to build a client for a socks5 proxy without the socksio package; so does the store, naming the
    variable, rather than failing every call later with an error the model would read."""
    for scheme in ("socks5", "socks5h"):
        clean_network_env.setenv("ALL_PROXY", f"{scheme}://user:s0cks-pa55@127.0.0.1:1080")
        with pytest.raises(ImportError):
            httpx.Client()
        with pytest.raises(ValueError, match="ALL_PROXY: .*socksio") as refused:
            MembaseMemoryStore(api_key=API_KEY, base_url="https://membase.test")
        assert "s0cks-pa55" not in shown_anywhere(refused.value)


@contextlib.contextmanager
def socket_nobody_answers() -> Iterator[str]:
    """``host:port`` of a port that refuses connections (bound, never listening)."""
    with socket.socket() as bound:
        bound.bind(("127.0.0.1", 0))
        yield f"127.0.0.1:{bound.getsockname()[1]}"


# --- A tunnel refused, stalled or dripped -------------------------------------------------------------------------
@pytest.mark.parametrize("refusal", ["403", "502", "stall"])
def test_a_note_whose_tunnel_the_proxy_refused_or_stalled_is_sent_by_the_retry_and_stored_once(
    built, clean_network_env, certificates, refusal
):
    """HTTPS_PROXY names a proxy that refuses the CONNECT (403, 502: twice, so the transport's own second try fails
    too) or holds it unanswered past request_timeout. The note never reached Membase: the write fails for sure, the
    manager's retry sends it, and it is stored once."""
    release = threading.Event()
    with LoopbackMembase(tls=certificates.server()) as server, LoopbackProxy() as proxy:
        clean_network_env.setenv("SSL_CERT_FILE", str(certificates.ca_file))
        clean_network_env.setenv("HTTPS_PROXY", proxy.url)
        proxy.on_connect += [release] if refusal == "stall" else [int(refusal)] * 2
        store = built(base_url=server.url, capture=True, write_timeout=LONG, request_timeout=1.0)
        try:
            with pytest.raises(membase.MembaseError) as failed:
                asyncio.run(store.add(NOTE))
        finally:
            release.set()
        assert "may or may not" not in str(failed.value)
        assert asyncio.run(store.add(NOTE)) is not None  # the manager's retry sends it
        assert server.fake.saved().count(NOTE) == 1
        tunnels = [line for line in proxy.asked if line.startswith("CONNECT ")]
        assert len(tunnels) == (2 if refusal == "stall" else 3), proxy.asked
        assert (store.counters()["writes_unknown"], store.counters()["writes_saved"]) == (0, 1)


@pytest.mark.parametrize(
    ("proxy_scheme", "membase_scheme", "dripped"),
    [
        ("http", "https", "from the first byte"),  # Membase's TLS handshake, through the CONNECT tunnel
        ("http", "https", "near the end of the answer"),
        ("https", "http", "from the first byte"),  # the answer the proxy passes on, inside the proxy's own TLS
        ("https", "http", "near the end of the answer"),
    ],
)
def test_a_proxy_dripping_what_comes_back_is_cut_off_within_request_timeout(
    built, clean_network_env, certificates, proxy_scheme, membase_scheme, dripped
):
    """Once a first recall went through whole, the proxy drips what comes back from Membase, a byte every 0.3 s, from
    the first byte or from 50 bytes before the end of the answer. A recall with request_timeout=2 ends having read
    a few of them, and the proxy finds the client gone."""
    attempt = 2.0
    variable = "HTTPS_PROXY" if membase_scheme == "https" else "HTTP_PROXY"
    with (
        LoopbackMembase(tls=certificates.server() if membase_scheme == "https" else None) as server,
        LoopbackProxy(tls=certificates.server() if proxy_scheme == "https" else None) as proxy,
    ):
        server.fake.remember(FACT)
        clean_network_env.setenv("SSL_CERT_FILE", str(certificates.ca_file))
        clean_network_env.setenv(variable, proxy.url)
        with MembaseMemoryStore(api_key=API_KEY, base_url=server.url, recall_timeout=LONG) as first:
            assert recall(first) == FOUND
        assert proxy.wait_for(lambda: len(proxy.ended) == 1)
        whole = proxy.ended[0].sent  # what one connection sends back, the answer last
        proxy.drip, proxy.fast = 0.3, (0 if dripped == "from the first byte" else whole - 50)

        store = built(base_url=server.url, recall_timeout=LONG, request_timeout=attempt)
        with pytest.raises(membase.APITimeoutError):
            recall(store)
        assert proxy.wait_for(lambda: len(proxy.ended) == 2) and proxy.ended[1].hung_up, proxy.ended
        # Counted, not timed: a byte per 0.3 s, so the bytes dripped before the hang-up bound how long the recall
        # read (generously: a busy machine notices late); the answer held 50 more than this bound lets through.
        assert proxy.ended[1].sent - proxy.fast <= 3 * attempt / proxy.drip, proxy.ended


def test_an_https_proxy_to_an_https_membase_is_refused_when_the_store_is_built_naming_its_variable(clean_network_env):
    """Membase's TLS inside an https:// proxy's TLS: httpcore gives every socket receive of it the whole timeout
    again, so a proxy dripping that tunnel would hold a call without end. The store is refused when it is built,
    naming the variables and never the password; an http:// proxy (CONNECT) or an http:// Membase is taken."""
    for variable in ("HTTPS_PROXY", "ALL_PROXY"):
        clean_network_env.setenv(variable, "https://user:tls-1n-tls@127.0.0.1:3128")
        with pytest.raises(ValueError, match="HTTPS_PROXY or ALL_PROXY: an https:// proxy") as refused:
            MembaseMemoryStore(api_key=API_KEY, base_url="https://membase.test")
        assert "tls-1n-tls" not in shown_anywhere(refused.value)
        MembaseMemoryStore(api_key=API_KEY, base_url="http://membase.test").close()
        clean_network_env.setenv(variable, "http://127.0.0.1:3128")
        MembaseMemoryStore(api_key=API_KEY, base_url="https://membase.test").close()
        clean_network_env.delenv(variable)
