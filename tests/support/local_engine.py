"""Run the real Membase engine on this machine, offline, for tests and the quick start.

The engine comes with ``unibaseio-membase[local]`` (module ``membase_core``, Python 3.12+). It
needs an LLM for chat and embeddings; offline it is pointed at the stand-in in
:mod:`tests.support.standin_llm` on loopback. Two forms, as a user would meet them:

- in process, ``membase.Membase(local=DIR)``: call :func:`configure_engine_env` before the
  engine's first call. The engine caches its LLM provider (and so the stand-in's URL) per
  process, so start ONE stand-in per process at a stable port and keep it for the session. The
  variables may be restored after each test (:func:`restore_env`); the cached provider stays.
- over HTTP, ``membase --store DIR serve --port N``: :class:`ServedEngine` starts it as a
  subprocess on 127.0.0.1 with the engine's environment, waits until it answers, and stops it.
  :class:`EngineServer` runs the same server (the SDK's ``make_server``) on a thread of this process
  instead: the same routes over real loopback sockets, without a fresh process importing the engine
  (about 1.5 s, and several times that on a loaded machine) for every fresh memory.

Standard library (plus ``membase`` for the availability check); importable without pytest.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from membase_strands import MembaseMemoryStore

ENGINE_ENV_KEYS = ("MEMBASE_LLM_PROVIDER", "MEMBASE_EMBED_PROVIDER", "MEMBASE_LLM_ENDPOINT", "OPENAI_API_KEY")

# Variables that would send the engine (or an agent) to a real provider or a real Membase, or
# change how `membase serve` answers. Scrubbed from subprocess environments in offline runs.
LLM_KEY_VARS = (
    "OPENAI_API_KEY",
    "OPENAI_BASE_URL",
    "OPENAI_API_BASE",
    "OPENAI_ORG_ID",
    "ANTHROPIC_API_KEY",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_PROFILE",
    "AWS_BEARER_TOKEN_BEDROCK",
    "GOOGLE_API_KEY",
    "GEMINI_API_KEY",
    "MISTRAL_API_KEY",
    "LITELLM_API_KEY",
)
MEMBASE_VARS = (
    "MEMBASE_API_KEY",
    "MEMBASE_BASE_URL",
    "MEMBASE_LOCAL",
    "MEMBASE_LOCAL_TOKEN",
    "MEMBASE_LLM_PROVIDER",
    "MEMBASE_EMBED_PROVIDER",
    "MEMBASE_LLM_ENDPOINT",
)
LOOPBACK = "127.0.0.1"

_configured_endpoint: str | None = None  # what configure_engine_env last pointed this process's engine at


def engine_unavailable() -> str | None:
    """Why the local engine cannot run in this interpreter, or ``None`` when it can."""
    if sys.version_info < (3, 12):
        return (
            f"the local Membase engine needs Python 3.12+; this is Python {sys.version_info[0]}.{sys.version_info[1]} "
            "(run with `uv run -p 3.12 ...`)"
        )
    if importlib.util.find_spec("membase") is None:
        return "the Membase SDK is not installed (pip install 'unibaseio-membase[local]')"
    try:
        from membase.requirements import local_unavailable
    except ImportError:  # an SDK without the helper: check the engine module ourselves
        local_unavailable = None
    reason = local_unavailable() if local_unavailable is not None else None
    if reason:
        return reason
    if importlib.util.find_spec("membase_core") is None:
        return "the local Membase engine (membase_core) is not installed: pip install 'unibaseio-membase[local]'"
    return None


def engine_env(endpoint: str) -> dict[str, str]:
    """The variables that point the engine's chat and embeddings at an OpenAI-compatible ``endpoint``."""
    return {
        "MEMBASE_LLM_PROVIDER": "openai-compat",
        "MEMBASE_EMBED_PROVIDER": "openai-compat",
        "MEMBASE_LLM_ENDPOINT": endpoint,
        # The openai client refuses to start without a key; the stand-in ignores it.
        "OPENAI_API_KEY": "standin-not-a-real-key",
    }


def configure_engine_env(endpoint: str, environ: dict[str, str] | None = None) -> dict[str, str | None]:
    """Point this process's engine at ``endpoint``, before its first call; returns the previous values.

    Raises:
        RuntimeError: The engine in this process already built its LLM provider for another
            endpoint (it caches it per process), so the new endpoint would be silently ignored.
    """
    global _configured_endpoint
    env = os.environ if environ is None else environ
    cached = _cached_engine_endpoint()
    if cached is not None and cached != endpoint:
        raise RuntimeError(
            f"the in-process Membase engine already talks to {cached}; its LLM provider is cached per process, "
            f"so it cannot be pointed at {endpoint}. Start the stand-in once per process, at a stable port."
        )
    wanted = engine_env(endpoint)
    previous = {key: env.get(key) for key in (*wanted, "OPENAI_BASE_URL", "NO_PROXY", "no_proxy")}
    env.pop("OPENAI_BASE_URL", None)  # else a forgotten one may send the engine to the real OpenAI
    env.update(wanted)
    for key in ("NO_PROXY", "no_proxy"):
        env[key] = _with_loopback(env.get(key))
    if environ is None:
        _configured_endpoint = endpoint
    return previous


def restore_env(previous: Mapping[str, str | None], environ: dict[str, str] | None = None) -> None:
    """Undo :func:`configure_engine_env`."""
    env = os.environ if environ is None else environ
    for key, value in previous.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value


def offline_env(endpoint: str | None = None, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """A copy of ``base`` (default ``os.environ``) without LLM keys or Membase settings.

    With ``endpoint``, the engine variables for it are added, for a subprocess that runs the engine.
    """
    env = {k: v for k, v in (os.environ if base is None else base).items() if k not in (*LLM_KEY_VARS, *MEMBASE_VARS)}
    for key in ("NO_PROXY", "no_proxy"):
        env[key] = _with_loopback(env.get(key))
    if endpoint is not None:
        env.update(engine_env(endpoint))
    return env


def free_port() -> int:
    """A port that was free on 127.0.0.1 a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        return int(sock.getsockname()[1])


class ServedEngine:
    """``membase --store DIR serve --port N`` on loopback, as a subprocess.

    Its output goes to ``DIR/../membase-serve-N.log`` (shown in the error if it does not start).
    """

    def __init__(self, store_dir: str | os.PathLike[str], endpoint: str, port: int | None = None) -> None:
        self.store_dir = Path(store_dir)
        self.endpoint = endpoint
        self.port = port or free_port()
        self.log_path = self.store_dir.parent / f"membase-serve-{self.port}.log"
        self._process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def start(self, timeout: float = 120.0) -> ServedEngine:
        """Start the server and wait until ``GET /v1/containers`` answers."""
        self.store_dir.mkdir(parents=True, exist_ok=True)
        self._log = self.log_path.open("wb")
        command = [sys.executable, "-m", "membase", "--store", str(self.store_dir), "serve"]
        command += ["--host", LOOPBACK, "--port", str(self.port)]
        self._process = subprocess.Popen(
            command,
            env=offline_env(self.endpoint),
            cwd=self.store_dir,  # the engine reads a .env in its working directory or a parent
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + timeout
        while True:
            if self._process.poll() is not None:
                output = self.output()
                self.stop()
                raise RuntimeError(f"membase serve exited with {self._process.returncode}:\n{output}")
            if self._answers():
                return self
            if time.monotonic() > deadline:
                output = self.output()
                self.stop()
                raise RuntimeError(f"membase serve did not answer on {self.base_url} within {timeout:g} s:\n{output}")
            time.sleep(0.05)

    def _answers(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.base_url}/v1/containers", timeout=2) as answer:
                return answer.status == 200 and "containers" in json.loads(answer.read())
        except (OSError, urllib.error.URLError, ValueError):
            return False

    def output(self) -> str:
        """What the server printed so far."""
        if self._log is not None:
            self._log.flush()
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def stop(self, timeout: float = 5.0) -> None:
        """Interrupt the server (it closes its engines), killing it if it does not exit in time."""
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout)
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> ServedEngine:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


class EngineServer:
    """``membase serve``'s HTTP server on a thread of this process, for one store directory.

    The engine and its LLM provider are this process's: point them at the stand-in first
    (:func:`configure_engine_env`). A request still running when the server stops (the engine retrying
    an LLM that is down) runs on in its daemon thread.
    """

    def __init__(self, store_dir: str | os.PathLike[str]) -> None:
        self.store_dir = Path(store_dir)
        self._httpd: Any = None

    @property
    def base_url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> EngineServer:
        """Listen on a free loopback port and serve on a daemon thread; no token, whatever the environment says."""
        from membase.local.server import make_server

        self.store_dir.mkdir(parents=True, exist_ok=True)
        self._httpd = make_server(LOOPBACK, 0, root=str(self.store_dir), token="")
        # A short poll: stop() waits for the serving loop to notice (up to this long).
        serve = functools.partial(self._httpd.serve_forever, poll_interval=0.02)
        threading.Thread(target=serve, name="engine-server", daemon=True).start()
        return self

    def stop(self) -> None:
        """Stop listening and close the engine's files (as ``membase serve`` does when interrupted)."""
        httpd, self._httpd = self._httpd, None
        if httpd is not None:
            httpd.shutdown()
            httpd.server_close()
            httpd.backend.close()

    def __enter__(self) -> EngineServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def _cached_engine_endpoint() -> str | None:
    """The endpoint the in-process engine's cached LLM provider uses, if it has built one."""
    llm = sys.modules.get("membase_core.llm")
    getter: Any = getattr(llm, "get_chat_provider", None)
    if getter is None or not hasattr(getter, "cache_info") or getter.cache_info().currsize == 0:
        return None
    return _configured_endpoint or os.environ.get("MEMBASE_LLM_ENDPOINT") or "the provider chosen from the environment"


def _with_loopback(value: str | None) -> str:
    hosts = [h.strip() for h in (value or "").split(",") if h.strip()]
    hosts += [h for h in (LOOPBACK, "localhost") if h not in hosts]
    return ",".join(hosts)


HTTP_KEY = "local-test"
# Budgets a slow, loaded machine cannot run out of, for the tests that are not about a budget: the engine's first
# call in a process imports it (~1.5 s idle, several times that beside busy processes), and a write makes the
# engine's LLM calls (a fresh `membase serve`'s first write took 5.4 s in a loaded run).
GENEROUS_BUDGETS = {"recall_timeout": 30.0, "write_timeout": 30.0}


@dataclass
class EngineMemory:
    """One person's Membase, backed by the real engine, reached in one of the two forms."""

    form: str
    root: Path
    base_url: str | None = None
    stores: list[MembaseMemoryStore] = field(default_factory=list)

    def store(self, **options: Any) -> MembaseMemoryStore:
        """A new store on this memory (in process: close the previous one first, as a user would).

        Budgets not given are :data:`GENEROUS_BUDGETS`, not the store's defaults.
        """
        options = {**GENEROUS_BUDGETS, **options}
        if self.form == "http":
            built = MembaseMemoryStore(api_key=HTTP_KEY, base_url=self.base_url, **options)
        else:
            built = MembaseMemoryStore(local=str(self.root), **options)
        self.stores.append(built)
        return built

    def client(self) -> Any:
        """A raw ``membase.Membase`` client on this memory (the caller closes it)."""
        import membase

        if self.form == "http":
            return membase.Membase(api_key=HTTP_KEY, base_url=self.base_url)
        return membase.Membase(local=str(self.root))

    def seed(self, content: str, container: str | None = None) -> dict[str, Any]:
        """Save a note through the raw client, as if saved earlier."""
        with self.client() as client:
            answer: dict[str, Any] = client.memories.add(content, container=container)
        assert answer.get("memory_ids"), f"the engine learned nothing from {content!r}: {answer}"
        return answer
