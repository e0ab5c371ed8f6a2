"""A deterministic OpenAI-compatible stand-in for the LLM the local Membase engine needs (standard library only):
the demo, ``many_users.py``, the tests and the recall-quality benchmark run the real engine offline with it.

Its answers make the engine really learn and rank: embeddings are hashed bag-of-words vectors, an episode is the
conversation's own words, and the search steering keeps the candidates that share a word with the question.

In Python: ``with StandInLLM() as llm: os.environ.update(llm.engine_env())`` before local Membase's first call. As a
command, it runs another one with those variables set, and serves until that one ends:

    uv run --python 3.12 examples/standin_llm.py python my_agent.py
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

logger = logging.getLogger("standin_llm")

DIMENSIONS = 1536  # the width of the engine's FAISS index; any other width fails inside the engine

STOPWORDS = frozenset(
    """a an and are as at be been but by can could did do does for from had has have he her hers him his how i if in
    into is it its me my mine of on or our ours she so than that the their them then there these they this to too us
    was we were what when where which who whom why will with would you your yours about user assistant please remember
    note""".split()
)

# In the episode prompt a message is "speaker": NAME, then "content": TEXT (unquoted, maybe several lines), then "}".
_MESSAGE_BLOCK = re.compile(r'"speaker":\s*(?P<speaker>[^\n]*?),?\s*\n\s*"content":\s*(?P<content>.*?)\n\s*\}', re.S)


def words(text: str) -> list[str]:
    """The content words of ``text``: lower case, alphanumeric, without stop words."""
    return [w for w in re.findall(r"[a-z0-9]+", text.lower()) if w not in STOPWORDS]


def embed(text: str) -> list[float]:
    """A unit vector to which each content word adds +-1 where a stable hash puts it (no content word: a fixed one)."""
    vector = [0.0] * DIMENSIONS
    for word in words(text):
        digest = hashlib.blake2b(word.encode(), digest_size=8).digest()
        vector[int.from_bytes(digest[:4], "big") % DIMENSIONS] += 1.0 if digest[4] & 1 else -1.0
    norm = math.sqrt(sum(v * v for v in vector))
    return [v / norm for v in vector] if norm else [1.0, *vector[1:]]


class StandInLLM:
    """The stand-in server. ``port=0`` picks a free port on first start; restarts reuse it."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.host = host
        self.port = port
        self.seen: list[str] = []  # the kind of each request answered, in order (see count())
        self.unknown_prompts: list[str] = []  # the chat prompts it did not recognise (answered {}), in order
        self._failing: int | None = None
        self._server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        """The OpenAI-style base URL, ``http://127.0.0.1:PORT/v1``."""
        if not self.port:
            raise RuntimeError("the stand-in has no port yet: start() it first")
        return f"http://{self.host}:{self.port}/v1"

    def engine_env(self) -> dict[str, str]:
        """The variables that point the Membase engine here; set them before its first call (it caches them)."""
        return {
            "MEMBASE_LLM_PROVIDER": "openai-compat",
            "MEMBASE_EMBED_PROVIDER": "openai-compat",
            "MEMBASE_LLM_ENDPOINT": self.url,
            "OPENAI_API_KEY": "standin-not-a-real-key",
        }

    def start(self) -> StandInLLM:
        """Start serving (again) in a daemon thread; a restart binds the same port."""
        if self._server is None:
            handler = type("BoundHandler", (_Handler,), {"standin": self})
            self._server = server = ThreadingHTTPServer((self.host, self.port), handler)
            self.port = server.server_address[1]
            threading.Thread(target=server.serve_forever, args=(0.05,), name="standin-llm", daemon=True).start()
        return self

    def stop(self) -> None:
        """Stop serving and close the socket: connections to the port are then refused."""
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()

    def __enter__(self) -> StandInLLM:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def set_failing(self, status: int | None = 500) -> None:
        """Answer every request with ``status`` (an OpenAI-style error) until ``set_failing(None)``.

        The engine (unibaseio-membase-core 0.3.3) retries a 5xx, or a refused connection after :meth:`stop`, for
        minutes before it reports a Memory as unable to answer; a 401 it reports at once.
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

    def count(self, kind: str | None = None) -> int:
        """How many requests of ``kind`` ("embeddings", "boundary", "episode", "steering", "unknown", "failed")."""
        return len(self.seen) if kind is None else self.seen.count(kind)

    def reset(self) -> None:
        """Forget the requests seen so far."""
        self.seen.clear()
        self.unknown_prompts.clear()

    def answer(self, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """The status and JSON body for one request, whose kind is recorded in :attr:`seen`."""
        status = self._failing or 200
        if self._failing is not None:
            kind, payload = "failed", _error(status, f"stand-in LLM is failing on purpose ({status})")
        elif path.endswith("/embeddings"):
            kind, payload = "embeddings", _embeddings(body)
        elif path.endswith("/chat/completions"):
            kind, payload = self._chat(body)
        else:
            logger.warning("stand-in LLM: no route for %s", path)
            status, kind, payload = 404, "unknown", _error(404, f"stand-in LLM has no route {path}")
        self.seen.append(kind)  # from the server's threads: list appends are atomic
        return status, payload

    def _chat(self, body: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        prompt = "\n".join(_message_text(message) for message in body.get("messages", []))
        kind, reply = next(((kind, reply) for marker, kind, reply in _PROMPTS if marker in prompt), ("unknown", None))
        if reply is None:
            logger.warning("stand-in LLM: UNKNOWN PROMPT answered {} (add a rule to standin_llm.py): %r", prompt[:300])
            self.unknown_prompts.append(prompt)
        message = {"role": "assistant", "content": json.dumps(reply(prompt) if reply else {})}
        return kind, {
            "id": f"standin-{time.monotonic_ns()}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.get("model", "standin-chat"),
            "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
        }


def _error(status: int, message: str) -> dict[str, Any]:
    kind = "invalid_api_key" if status in (401, 403) else "server_error" if status >= 500 else "invalid_request_error"
    return {"error": {"message": message, "type": kind, "code": kind}}


def _embeddings(body: dict[str, Any]) -> dict[str, Any]:
    raw = body.get("input")
    texts = [raw] if isinstance(raw, str) else list(raw or [])
    data = [{"object": "embedding", "index": i, "embedding": embed(text)} for i, text in enumerate(texts)]
    usage = {"prompt_tokens": 0, "total_tokens": 0}
    return {"object": "list", "data": data, "model": body.get("model", "standin-embed"), "usage": usage}


def _message_text(message: dict[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, list):
        return "\n".join(part.get("text", "") for part in content)
    return content if isinstance(content, str) else ""


def _episode(prompt: str) -> dict[str, Any]:
    """An episode of the conversation's own words: the user's verbatim, anyone else's as ``speaker: words``."""
    # The prompt's worked example also has "content" fields; the conversation comes after this heading.
    conversation = prompt.partition("Conversation content:")[2].partition("Custom instructions:")[0]
    messages = [(found["speaker"].strip(), found["content"].strip()) for found in _MESSAGE_BLOCK.finditer(conversation)]
    said = [text if speaker.lower() == "user" else f"{speaker}: {text}" for speaker, text in messages if text]
    if not said:
        logger.warning("stand-in LLM: episode prompt without recognisable conversation: %r", prompt[-300:])
    content = " ".join(said)
    return {"title": " ".join(content.split()[:6]) or "Conversation", "content": content}


def _steer(prompt: str) -> dict[str, Any]:
    """Keep the candidates that share a content word with the QUESTION; stop after this round."""
    # The prompt shows worked examples first; the real question and candidates are the last ones.
    question, _, rest = prompt.rpartition("QUESTION:")[2].partition("CORE SO FAR:")
    candidates = rest.partition("CANDIDATES THIS ROUND:")[2].partition("Reply with ONLY")[0]
    wanted = set(words(question))
    lines = (re.match(r"\s*(\d+):\s*(.*)$", line) for line in candidates.splitlines())
    return {"core": [int(line[1]) for line in lines if line and wanted & set(words(line[2]))], "next_queries": []}


_ONE_EPISODE = {"reasoning": "stand-in: one episode", "boundaries": [], "should_wait": False}
# How each engine prompt is told apart (a phrase in it), the kind recorded for it, and the answer to it.
_PROMPTS: list[tuple[str, str, Callable[[str], dict[str, Any]]]] = [
    ("episodic memory boundary detection expert", "boundary", lambda _: _ONE_EPISODE),
    ("episodic memory generation expert", "episode", _episode),
    ("You steer a multi-round memory search", "steering", _steer),
]


class _Handler(BaseHTTPRequestHandler):
    # One request per connection: a kept-alive connection would still be served by its thread after stop().
    protocol_version = "HTTP/1.0"
    standin: StandInLLM  # set by StandInLLM.start() on a subclass of its own

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("stand-in LLM: " + format, *args)

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or "{}")
        status, payload = self.standin.answer(self.path.split("?")[0], body)
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def main(command: list[str]) -> int:
    """Run ``command`` with local Membase pointed at a stand-in LLM, serving it until the command ends."""
    if not command:
        print("usage: standin_llm.py COMMAND [ARGUMENT...]  (runs COMMAND with local Membase's LLM a stand-in)")
        return 2
    with StandInLLM() as llm:
        child = subprocess.Popen(command, env={**os.environ, **llm.engine_env()})
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the command too: the stand-in waits for its end
        signal.signal(signal.SIGTERM, lambda signum, frame: child.terminate())
        return child.wait()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
