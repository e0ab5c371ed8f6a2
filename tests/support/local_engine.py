"""The real Membase engine (``unibaseio-membase[local]``, module ``membase_core``, Python 3.12+) offline, its LLM the
stand-in ``examples/standin_llm.py`` on loopback, in the two forms a user meets: in process
(``local=DIR``; the engine keeps the provider it built at its first call, so one stand-in serves the session and
:func:`configure_engine_env` points the engine at it), and over HTTP (:class:`EngineServer`: ``membase serve``'s
server on a thread of this process, the hosted API's routes over real loopback sockets).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import membase

from examples.standin_llm import StandInLLM
from membase_strands import MembaseMemoryStore

# What would send the engine (or an agent) to a real provider or a real Membase: left out of an offline environment.
LLM_KEY_VARS = """OPENAI_API_KEY OPENAI_BASE_URL OPENAI_API_BASE OPENAI_ORG_ID ANTHROPIC_API_KEY AWS_ACCESS_KEY_ID
AWS_SECRET_ACCESS_KEY AWS_SESSION_TOKEN AWS_PROFILE AWS_BEARER_TOKEN_BEDROCK GOOGLE_API_KEY GEMINI_API_KEY
MISTRAL_API_KEY LITELLM_API_KEY""".split()
MEMBASE_VARS = ("MEMBASE_API_KEY", "MEMBASE_BASE_URL", "MEMBASE_LOCAL", "MEMBASE_LOCAL_TOKEN")
ENGINE_VARS = ("MEMBASE_LLM_PROVIDER", "MEMBASE_EMBED_PROVIDER", "MEMBASE_LLM_ENDPOINT")
LOOPBACK = "127.0.0.1"
HTTP_KEY = "local-test-membase-key"  # any value `membase serve` takes without a token
# Budgets a slow, loaded machine cannot run out of, for the tests not about a budget: the engine's first call in a
# process imports it, and a write makes the engine's LLM calls.
GENEROUS_BUDGETS = {"recall_timeout": 30.0, "write_timeout": 30.0}

_configured: str | None = None  # the endpoint configure_engine_env last pointed this process's engine at


def engine_unavailable() -> str | None:
    """Why the local engine cannot run in this interpreter, or ``None`` when it can."""
    if sys.version_info < (3, 12):
        return f"the local Membase engine needs Python 3.12+; this is {sys.version_info[0]}.{sys.version_info[1]}"
    from membase.requirements import local_unavailable

    installed = importlib.util.find_spec("membase_core")
    return local_unavailable() or (None if installed else "the engine (membase_core) is not installed")


def configure_engine_env(llm: StandInLLM) -> dict[str, str | None]:
    """Point this process's engine at ``llm`` before its first call; returns the variables' previous values. Raises
    ``RuntimeError`` if the engine already built its provider for another endpoint, which it would go on using."""
    global _configured
    getter: Any = getattr(sys.modules.get("membase_core.llm"), "get_chat_provider", None)
    built = getter is not None and hasattr(getter, "cache_info") and getter.cache_info().currsize > 0
    if built and _configured not in (None, llm.url):
        raise RuntimeError(f"the in-process engine already talks to {_configured}: start one stand-in per process")
    wanted = llm.engine_env()
    previous = {key: os.environ.get(key) for key in (*wanted, "OPENAI_BASE_URL", "NO_PROXY", "no_proxy")}
    os.environ.pop("OPENAI_BASE_URL", None)  # else a forgotten one may send the engine to the real OpenAI
    os.environ.update({**wanted, "NO_PROXY": _with_loopback(os.environ.get("NO_PROXY"))})
    os.environ["no_proxy"] = _with_loopback(os.environ.get("no_proxy"))
    _configured = llm.url
    return previous


def restore_env(previous: Mapping[str, str | None]) -> None:
    """Undo :func:`configure_engine_env`."""
    for key, value in previous.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def offline_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """A copy of ``base`` (default ``os.environ``) without LLM keys, engine variables or Membase settings."""
    dropped = (*LLM_KEY_VARS, *MEMBASE_VARS, *ENGINE_VARS)
    env = {key: value for key, value in (os.environ if base is None else base).items() if key not in dropped}
    return {**env, "NO_PROXY": _with_loopback(env.get("NO_PROXY")), "no_proxy": _with_loopback(env.get("no_proxy"))}


def _with_loopback(value: str | None) -> str:
    hosts = [host.strip() for host in (value or "").split(",") if host.strip()]
    return ",".join([*hosts, *(host for host in (LOOPBACK, "localhost") if host not in hosts)])


class EngineServer:
    """``membase serve``'s HTTP server on a thread of this process, for one store directory (no token); point the
    engine at the stand-in first. A request still running when it stops runs on in its daemon thread."""

    def __init__(self, store_dir: str | os.PathLike[str]) -> None:
        self.store_dir = Path(store_dir)
        self._httpd: Any = None

    @property
    def base_url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> EngineServer:
        from membase.local.server import make_server

        self.store_dir.mkdir(parents=True, exist_ok=True)
        self._httpd = make_server(LOOPBACK, 0, root=str(self.store_dir), token="")
        serve = functools.partial(self._httpd.serve_forever, poll_interval=0.02)  # stop() waits up to one poll
        threading.Thread(target=serve, name="engine-server", daemon=True).start()
        return self

    def stop(self) -> None:
        """Stop listening and close the engine's files, as ``membase serve`` does when interrupted."""
        httpd, self._httpd = self._httpd, None
        if httpd is not None:
            httpd.shutdown()
            httpd.server_close()
            httpd.backend.close()

    __enter__ = start

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


@dataclass
class EngineMemory:
    """One person's Membase on the real engine, reached over HTTP (``form="http"``) or in process."""

    form: str
    root: Path
    base_url: str | None = None
    stores: list[MembaseMemoryStore] = field(default_factory=list)

    def store(self, **options: Any) -> MembaseMemoryStore:
        """A new store on this memory (closed after the test), with :data:`GENEROUS_BUDGETS` unless given."""
        options = {**GENEROUS_BUDGETS, **options}
        where = {"api_key": HTTP_KEY, "base_url": self.base_url} if self.form == "http" else {"local": self.root}
        self.stores.append(MembaseMemoryStore(**where, **options))
        return self.stores[-1]

    def client(self) -> membase.Membase:
        """A raw ``membase.Membase`` client on this memory (the caller closes it; in process, only while no store is
        open: the directory is one process's)."""
        where = {"api_key": HTTP_KEY, "base_url": self.base_url} if self.form == "http" else {"local": str(self.root)}
        return membase.Membase(**where)

    def seed(self, content: str, container: str | None = None) -> None:
        """Save a note through the raw client, as if saved earlier."""
        with self.client() as client:
            answer = client.memories.add(content, container=container)
        assert answer.get("memory_ids"), f"the engine learned nothing from {content!r}: {answer}"
