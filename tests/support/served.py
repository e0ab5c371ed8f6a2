"""An app served as a user starts it: uvicorn (or a documented command) in a subprocess on a free port of 127.0.0.1,
from ``examples/``, with the environment a test gives it (nothing of Membase's or an LLM's from this process; loopback
kept off any proxy), its output read line by line as it comes. Every wait is bounded; :meth:`ServedApp.close` stops
the server (SIGTERM, then, past ``WAIT``, kill).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from tests.support.local_engine import offline_env

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
START_WAIT = 120.0  # importing Strands and FastAPI took up to 46 s beside three busy processes on 2 loaded cores
WAIT = 60.0  # the longest any other wait here lasts


def free_port() -> int:
    """A port that was free on 127.0.0.1 a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class ServedApp:
    """A server started with ``command`` in ``cwd`` (default ``examples/``), with ``env`` on top of an offline
    environment, listening on ``port``; :meth:`uvicorn` starts an example under uvicorn."""

    def __init__(
        self,
        command: list[str],
        env: dict[str, str],
        port: int,
        cwd: Path = EXAMPLES,
        on_line: Callable[[str], None] | None = None,
    ) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.lines: list[str] = []
        self._on_line = on_line  # called with each line of output as it comes
        base = {name: value for name, value in offline_env().items() if not name.startswith(("MEMBASE_", "OTEL_"))}
        self.process = subprocess.Popen(
            command,
            env={**base, "PYTHONUNBUFFERED": "1", **env},
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # its own process group: a Ctrl-C meant for pytest is not its
        )
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, name="served-output", daemon=True)
        self._reader.start()

    @classmethod
    def uvicorn(cls, app: str, env: dict[str, str], *arguments: str) -> ServedApp:
        """``uvicorn <app> --app-dir . <arguments>`` in ``examples/``, on a free port."""
        port = free_port()
        command = [sys.executable, "-m", "uvicorn", app, "--app-dir", ".", "--host", "127.0.0.1", "--port", str(port)]
        return cls([*command, "--no-access-log", *arguments], env, port)

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if self._on_line is not None:
                self._on_line(line)
            with self._changed:
                self.lines.append(line.rstrip("\n"))
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()  # the output ended: nobody waits for a line any more

    @property
    def output(self) -> str:
        with self._changed:
            return "\n".join(self.lines)

    def count(self, text: str) -> int:
        with self._changed:
            return sum(text in line for line in self.lines)

    def wait_until_ready(self, processes: int = 1) -> ServedApp:
        """Wait until every process has started its app and the port listens."""

        def ready() -> bool:
            listening = self.count("Uvicorn running on") + self.count("Listening at:")  # uvicorn's, gunicorn's
            return self.count("Application startup complete.") >= processes and listening > 0

        with self._changed:
            self._changed.wait_for(lambda: ready() or not self._reader.is_alive(), START_WAIT)
        assert ready(), f"the server never got {processes} processes ready:\n{self.output}"
        return self

    def close(self) -> None:
        """SIGTERM, as a user's Ctrl-C or a supervisor stops it; a server still running ``WAIT`` s later is killed."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(WAIT)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)  # the process group our own child leads, by its id
                self.process.wait(WAIT)
        self._reader.join(WAIT)

    def __enter__(self) -> ServedApp:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
