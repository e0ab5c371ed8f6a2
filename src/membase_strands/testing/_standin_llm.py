"""A deterministic OpenAI-compatible stand-in for the LLM behind the local Membase engine.

The local engine (``membase serve`` or ``Membase(local=DIR)``) needs a chat model and an
embedding model. Offline, it is pointed at this server on loopback instead
(``MEMBASE_LLM_PROVIDER=openai-compat``, ``MEMBASE_LLM_ENDPOINT=<url>``). The answers are
deterministic and make the engine really learn and rank:

- ``POST /v1/embeddings``: 1536-dimensional, L2-normalised hashed bag-of-words vectors, so texts
  that share words are close and unrelated texts are nearly orthogonal.
- ``POST /v1/chat/completions``: each engine prompt is recognised by a phrase in it:
  boundary detection answers "no boundaries"; episodic memory generation echoes the user's own
  words as the episode (with a short title; anyone else's words follow as ``speaker: words``);
  the multi-round search steering picks the candidates that share words with the QUESTION and
  stops. A prompt it does not recognise is logged as a warning, recorded in
  :attr:`StandInLLM.unknown_prompts` and answered ``{}``, so a test can assert that none arrived.

It can be made to fail (:meth:`StandInLLM.failing`: every request answers 500, or the status you
give, e.g. 401) or really go down: :meth:`StandInLLM.stop` closes the port (connections are
refused) and :meth:`StandInLLM.start` brings it back on the same port. What the engine does then
(measured with unibaseio-membase-core 0.3.3): it retries 5xx and connection errors for minutes
(tenacity, 8 attempts, random exponential waits up to 90 s) before it reports a container as
unable to answer; a 401 it reports at once.

Standard library only; importable without pytest::

    with StandInLLM() as llm:
        os.environ.update(llm.engine_env())
        ...
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

logger = logging.getLogger("standin_llm")

DIMENSIONS = 1536
"""The width of the engine's FAISS index; any other width fails inside the engine."""

BOUNDARY_PHRASE = "episodic memory boundary detection expert"
EPISODE_PHRASE = "episodic memory generation expert"
STEERING_PHRASE = "You steer a multi-round memory search"

STOPWORDS = frozenset(
    """a an and are as at be been but by can could did do does for from had has have he her hers him his how i
    if in into is it its me my mine of on or our ours she so than that the their them then there these they
    this to too us was we were what when where which who whom why will with would you your yours about
    user assistant please remember note""".split()
)

_WORD = re.compile(r"[a-z0-9]+")
# The episode prompt shows each message as a block: "speaker": NAME, then "content": TEXT (unquoted,
# possibly several lines) up to the block's closing brace.
_MESSAGE_BLOCK = re.compile(r'"speaker":\s*(?P<speaker>[^\n]*?),?\s*\n\s*"content":\s*(?P<content>.*?)\n\s*\}', re.S)
_CANDIDATE_LINE = re.compile(r"^\s*(\d+):\s*(.*)$")


def words(text: str) -> list[str]:
    """The content words of ``text``: lower case, alphanumeric, without stop words."""
    return [w for w in _WORD.findall(text.lower()) if w not in STOPWORDS]


def embed(text: str) -> list[float]:
    """A deterministic hashed bag-of-words vector, L2-normalised.

    Each content word adds +-1 at a position chosen by a stable hash, so texts sharing words have a
    high cosine similarity. A text with no content word gets a fixed unit vector.
    """
    vector = [0.0] * DIMENSIONS
    for word in words(text):
        digest = hashlib.blake2b(word.encode(), digest_size=8).digest()
        index = int.from_bytes(digest[:4], "big") % DIMENSIONS
        vector[index] += 1.0 if digest[4] & 1 else -1.0
    norm = math.sqrt(sum(v * v for v in vector))
    if norm == 0.0:
        vector[0] = 1.0
        return vector
    return [v / norm for v in vector]


@dataclass
class Seen:
    """One request the stand-in answered."""

    path: str
    kind: str
    status: int
    prompt: str = ""


class StandInLLM:
    """The stand-in server. ``port=0`` picks a free port on first start; restarts reuse it."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.host = host
        self.port = port
        self.seen: list[Seen] = []
        self.unknown_prompts: list[str] = []
        self._failing: int | None = None
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # --- Lifecycle ----------------------------------------------------------------------------

    @property
    def url(self) -> str:
        """The OpenAI-style base URL, ``http://127.0.0.1:PORT/v1``."""
        if not self.port:
            raise RuntimeError("the stand-in has no port yet: start() it first")
        return f"http://{self.host}:{self.port}/v1"

    @property
    def running(self) -> bool:
        return self._server is not None

    def start(self) -> StandInLLM:
        """Start serving (again) in a daemon thread; a restart binds the same port."""
        if self._server is not None:
            return self
        server = _Server((self.host, self.port), _Handler)
        server.standin = self
        self.port = server.server_address[1]
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.05}, name="standin-llm", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and close the socket: connections to the port are then refused."""
        server, self._server = self._server, None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        if self._thread is not None:
            self._thread.join(5)

    def __enter__(self) -> StandInLLM:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def engine_env(self) -> dict[str, str]:
        """The environment the Membase engine needs to use this stand-in for chat and embeddings."""
        return {
            "MEMBASE_LLM_PROVIDER": "openai-compat",
            "MEMBASE_EMBED_PROVIDER": "openai-compat",
            "MEMBASE_LLM_ENDPOINT": self.url,
            "OPENAI_API_KEY": "standin-not-a-real-key",
        }

    # --- Faults -------------------------------------------------------------------------------

    @property
    def failing_status(self) -> int | None:
        """The status every request is answered with while failing, else ``None``."""
        return self._failing

    def set_failing(self, status: int | None = 500) -> None:
        """Answer every request with ``status`` (an OpenAI-style error) until ``set_failing(None)``.

        500/503 are errors the engine retries (for minutes); 401 is one it reports at once.
        """
        if status is not None and not 400 <= status <= 599:
            raise ValueError(f"a failing status is 400-599, got {status!r}")
        self._failing = status

    @contextlib.contextmanager
    def failing(self, status: int = 500) -> Iterator[StandInLLM]:
        """Answer every request with ``status`` inside the block."""
        self.set_failing(status)
        try:
            yield self
        finally:
            self.set_failing(None)

    # --- What it saw --------------------------------------------------------------------------

    def count(self, kind: str | None = None) -> int:
        """How many requests of ``kind`` ("embeddings", "boundary", "episode", "steering", "unknown", "failed")."""
        with self._lock:
            return sum(1 for s in self.seen if kind in (None, s.kind))

    def reset(self) -> None:
        with self._lock:
            self.seen.clear()
            self.unknown_prompts.clear()

    def _record(self, seen: Seen) -> None:
        with self._lock:
            self.seen.append(seen)
            if seen.kind == "unknown":
                self.unknown_prompts.append(seen.prompt)

    # --- Answers ------------------------------------------------------------------------------

    def answer(self, path: str, body: Any) -> tuple[int, Any]:
        """The status and JSON body for one request."""
        status = self._failing
        if status is not None:
            self._record(Seen(path, "failed", status))
            kind = "invalid_api_key" if status in (401, 403) else "server_error" if status >= 500 else "invalid_request"
            message = f"stand-in LLM is failing on purpose ({status})"
            return status, {"error": {"message": message, "type": kind, "code": kind}}
        if path.endswith("/embeddings"):
            return self._embeddings(path, body)
        if path.endswith("/chat/completions"):
            return self._chat(path, body)
        self._record(Seen(path, "unknown", 404))
        logger.warning("stand-in LLM: no route for %s", path)
        return 404, {"error": {"message": f"stand-in LLM has no route {path}", "type": "invalid_request_error"}}

    def _embeddings(self, path: str, body: Any) -> tuple[int, Any]:
        raw = body.get("input") if isinstance(body, dict) else None
        texts = [raw] if isinstance(raw, str) else list(raw or [])
        if not all(isinstance(t, str) for t in texts):
            self._record(Seen(path, "unknown", 400, prompt=repr(raw)[:500]))
            logger.warning("stand-in LLM: embeddings input is not text (token ids?): %r", repr(raw)[:200])
            return 400, {"error": {"message": "stand-in embeds text input only", "type": "invalid_request_error"}}
        self._record(Seen(path, "embeddings", 200))
        data = [{"object": "embedding", "index": i, "embedding": embed(t)} for i, t in enumerate(texts)]
        model = body.get("model", "standin-embed") if isinstance(body, dict) else "standin-embed"
        return 200, {"object": "list", "data": data, "model": model, "usage": {"prompt_tokens": 0, "total_tokens": 0}}

    def _chat(self, path: str, body: Any) -> tuple[int, Any]:
        messages = body.get("messages", []) if isinstance(body, dict) else []
        prompt = "\n".join(_message_text(m) for m in messages if isinstance(m, dict))
        if isinstance(body, dict) and body.get("stream"):
            self._record(Seen(path, "unknown", 400, prompt=f"(streamed) {prompt}"))
            logger.warning("stand-in LLM: a streamed chat request; the stand-in answers whole replies only")
            return 400, {"error": {"message": "stand-in does not stream", "type": "invalid_request_error"}}
        reply: dict[str, Any]
        if BOUNDARY_PHRASE in prompt:
            kind, reply = "boundary", {"reasoning": "stand-in: one episode", "boundaries": [], "should_wait": False}
        elif EPISODE_PHRASE in prompt:
            kind, reply = "episode", _episode(prompt)
        elif STEERING_PHRASE in prompt:
            kind, reply = "steering", _steer(prompt)
        else:
            kind, reply = "unknown", {}
            logger.warning(
                "stand-in LLM: UNKNOWN PROMPT, answered {} (add a rule to membase_strands/testing/_standin_llm.py): %r",
                prompt[:300],
            )
        self._record(Seen(path, kind, 200, prompt=prompt if kind == "unknown" else ""))
        text = json.dumps(reply)
        model = body.get("model", "standin-chat") if isinstance(body, dict) else "standin-chat"
        return 200, {
            "id": f"standin-{time.monotonic_ns()}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model,
            "choices": [
                {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"},
            ],
            "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
        }


def _message_text(message: dict[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(part.get("text", "") for part in content if isinstance(part, dict))
    return ""


def _episode(prompt: str) -> dict[str, str]:
    """The episode is the conversation's own words, so what the engine stores is exactly what was added.

    The user's words come verbatim; anyone else's follow as ``speaker: words``, so a note that
    carried the assistant's words shows them (a real model would summarise both, too).
    """
    # The prompt's worked example also has a "content" field; the conversation comes before it.
    start = prompt.find("Conversation content:")
    end = prompt.find("Custom instructions:", start)
    section = prompt[start : end if end > start else len(prompt)] if start >= 0 else ""
    said = []
    for found in _MESSAGE_BLOCK.finditer(section):
        speaker, text = found["speaker"].strip(), found["content"].strip()
        if text:
            said.append(text if speaker.lower() == "user" else f"{speaker}: {text}")
    if not said:
        logger.warning("stand-in LLM: episode prompt without recognisable conversation: %r", prompt[-300:])
        return {"title": "Conversation", "content": ""}
    content = " ".join(said)
    title = " ".join(content.split()[:6])
    return {"title": title, "content": content}


def _steer(prompt: str) -> dict[str, Any]:
    """Keep the candidates that share a content word with the QUESTION; stop after this round."""
    # The prompt shows worked examples first; the real question and candidates are the last ones.
    tail = prompt[prompt.rfind("QUESTION:") + len("QUESTION:") :]
    question, _, rest = tail.partition("CORE SO FAR:")
    _, _, candidates = rest.partition("CANDIDATES THIS ROUND:")
    candidates = candidates.split("Reply with ONLY", 1)[0]
    wanted = set(words(question))
    core = []
    for line in candidates.splitlines():
        found = _CANDIDATE_LINE.match(line)
        if found and wanted & set(words(found.group(2))):
            core.append(int(found.group(1)))
    return {"core": core, "next_queries": []}


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    standin: StandInLLM


class _Handler(BaseHTTPRequestHandler):
    # HTTP/1.0: one request per connection. A kept-alive connection would be served by its handler
    # thread even after stop(), so a stopped stand-in would not really be down.
    server: _Server
    protocol_version = "HTTP/1.0"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        logger.debug("stand-in LLM: " + format, *args)

    def do_POST(self) -> None:  # noqa: N802 - http.server's naming
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        try:
            body = json.loads(raw) if raw else {}
        except json.JSONDecodeError:
            self._send(400, {"error": {"message": "body is not JSON", "type": "invalid_request_error"}})
            return
        status, payload = self.server.standin.answer(self.path.split("?", 1)[0], body)
        self._send(status, payload)

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        status, payload = self.server.standin.answer(self.path.split("?", 1)[0], None)
        self._send(status, payload)

    def _send(self, status: int, payload: Any) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


if __name__ == "__main__":  # run it by hand: python -m membase_strands.testing._standin_llm
    logging.basicConfig(level=logging.INFO)
    with StandInLLM() as standin:
        print("Stand-in LLM running. Point the engine at it with:")
        for key, value in standin.engine_env().items():
            print(f"  export {key}={value}")
        print("Ctrl-C to stop.")
        with contextlib.suppress(KeyboardInterrupt):
            threading.Event().wait()
