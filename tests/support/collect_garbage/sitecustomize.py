"""Loaded by a server process a test starts with this directory on ``PYTHONPATH``: once the file named in
``MEMBASE_TEST_COLLECT_AFTER`` exists (the test creates it just before SIGTERM), a full garbage collection every
0.1 s in this process and in every process it forks (gunicorn's workers).

A busy server runs a full collection at moments nobody chooses, and the first one destroys a task that nothing
references (a server's lifespan task awaiting a close that holds it only weakly). Collecting often during shutdown
makes that certain instead of occasional. Standard library only; it does nothing without the variable.
"""

import gc
import os
import threading
import time

_TRIGGER = os.environ.get("MEMBASE_TEST_COLLECT_AFTER")


def _collect_once_triggered(trigger: str) -> None:
    while not os.path.exists(trigger):
        time.sleep(0.02)
    while True:
        gc.collect()
        time.sleep(0.1)


def _start() -> None:
    if _TRIGGER:
        threading.Thread(target=_collect_once_triggered, args=(_TRIGGER,), name="collect-garbage", daemon=True).start()


_start()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_start)
