"""A program that exits with captured writes still running: three stores over three loopback servers (``argv[1:4]``),
one used only in a child forked before any use (gunicorn ``--preload``), one whose write's caller hung up, one whose
turn's write outlived its 0.5 s budget, and a child forked while the parent's writes run. Each process prints its
stores' counters last, as JSON; a test reads the log lines as they come."""

from __future__ import annotations

import json
import os
import queue
import re
import subprocess
import sys
import threading
import time

PROGRAM = r"""
import asyncio, atexit, json, logging, os, sys, warnings

warnings.simplefilter("ignore", DeprecationWarning)  # os.fork() in a process that has threads
stores = {}
# Registered before the library's exit hook (importing the library registers that one), so it runs after it.
report = lambda: {"pid": os.getpid(), "counters": {name: store.counters() for name, store in stores.items()}}
atexit.register(lambda: print(json.dumps(report()), flush=True))
logging.basicConfig(level=logging.INFO, format="%(process)d %(relativeCreated)d %(levelname)s %(name)s %(message)s")

from strands import Agent
from strands.memory import MemoryManager

from membase_strands import MembaseMemoryStore
from membase_strands.testing import API_KEY, ScriptedModel

for name, url in zip(("preloaded", "graced", "cut"), sys.argv[1:4]):
    budget = 0.5 if name == "cut" else 30.0
    options = dict(container="Main", capture=True, extraction=True, write_timeout=budget, close_timeout=budget)
    stores[name] = MembaseMemoryStore(api_key=API_KEY, base_url=url, name=name, **options)


async def write_then_hang_up(store):  # a web handler whose client hung up: the write goes on in the background
    task = asyncio.ensure_future(store.add("I like green tea."))
    await asyncio.sleep(0)
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass


if os.fork() == 0:  # as gunicorn --preload: the store is built before the fork and used in the child only
    logging.getLogger("program").info("preloaded child")
    asyncio.run(write_then_hang_up(stores["preloaded"]))
    sys.exit(0)
os.wait()
asyncio.run(write_then_hang_up(stores["graced"]))
manager = MemoryManager(stores=[stores["cut"]])
# Its captured write outlives its budget: the server holds it.
Agent(model=ScriptedModel(["Noted."]), memory_manager=manager, callback_handler=None)("I like green tea.")
if os.fork() == 0:
    logging.getLogger("program").info("forked child")
    sys.exit(0)  # a normal exit: the atexit hooks run in the child too
os.wait()
"""


class Program:
    """The program above, run in a subprocess; its log lines (stderr) read as they come, its reports once it ends."""

    def __init__(self, *urls: str) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("MEMBASE_")}
        pipes = {"stdin": subprocess.DEVNULL, "stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
        self.process = subprocess.Popen([sys.executable, "-c", PROGRAM, *urls], text=True, env=env, **pipes)
        self.err: list[str] = []
        self.out: list[str] = []
        self._arriving: queue.Queue[str] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.process.stderr:  # type: ignore[union-attr]
            line = re.sub(r", key=<[^>]*>", "", line)  # the key's hint: test_access.py checks it
            self.err.append(line.rstrip("\n"))
            self._arriving.put(line)

    def wait_for_line(self, text: str, timeout: float = 60.0) -> bool:
        """Wait until a log line containing ``text`` arrives (or the program ends, or ``timeout`` passes)."""
        deadline = time.monotonic() + timeout
        while (remaining := deadline - time.monotonic()) > 0:
            try:
                if text in self._arriving.get(timeout=min(remaining, 0.5)):
                    return True
            except queue.Empty:
                if self.process.poll() is not None and self._arriving.empty():
                    return False
        return False

    def finish(self, timeout: float = 60.0) -> int:
        try:
            self.process.wait(timeout)
            self.out = self.process.stdout.read().splitlines()  # type: ignore[union-attr] # a few lines: no pipe fills
        finally:
            if self.process.poll() is None:
                self.process.kill()  # our own child, by its handle
                self.process.wait(10)
        self._reader.join(10)
        return self.process.returncode

    def pid_of(self, line_end: str) -> int:
        return int(next(line for line in self.err if line.endswith(line_end)).split()[0])

    def counters(self, pid: int) -> dict[str, dict[str, int]]:
        reports = (json.loads(line) for line in self.out if line.startswith("{"))
        return next(report["counters"] for report in reports if report["pid"] == pid)

    def lines(self, pid: int) -> list[str]:
        return [line for line in self.err if line.startswith(f"{pid} ")]

    def output(self) -> str:
        return "\n".join([*self.err, *self.out])
