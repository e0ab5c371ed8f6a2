"""Live smoke test against the hosted Membase API.

Run it with a real key to see every path of the store work against your account:

    MEMBASE_API_KEY=... uv run python examples/live_smoke.py

It recalls, calls the three tools, and captures one small conversation. The saving steps write two
short notes marked "membase-strands live smoke"; they go to the Memory named by
MEMBASE_SMOKE_CONTAINER, or to the only Memory in reach, and are skipped (with a sentence) when several
Memories are in reach and none is named. Without MEMBASE_API_KEY it says so and exits 0.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from typing import Any

from membase_strands import MembaseMemoryStore
from membase_strands.check import run_check


async def main() -> int:
    if not os.environ.get("MEMBASE_API_KEY"):
        print("MEMBASE_API_KEY is not set, so the live smoke test has nothing to talk to; skipping it.")
        return 0

    failures = 0

    def report(step: str, ok: bool, detail: str) -> None:
        nonlocal failures
        failures += not ok
        print(f"[{'ok' if ok else 'FAIL'}] {step}: {detail}")

    container = os.environ.get("MEMBASE_SMOKE_CONTAINER") or None
    with MembaseMemoryStore(container=container, recall_timeout=60.0) as reader:
        tools = {tool.tool_name: tool for tool in reader.get_tools()}
        check = run_check(container=container)  # reach, the Memories in reach, profile and save, timed
        for step in check.steps:
            report(step.name, step.ok or not step.required, step.detail)
        if not check.memories and not check.ok:
            return 1
        in_reach = check.memories

        started = time.monotonic()
        try:
            entries = await reader.search("what do I prefer?")
            report("recall", True, f"{len(entries)} entries in {time.monotonic() - started:.1f} s")
        except Exception as error:  # noqa: BLE001
            report("recall", False, f"{type(error).__name__}: {error}")

        for name, arguments in (("membase_search", {"query": "preferences"}), ("membase_profile", {})):
            result = await _call(tools[name], arguments)
            report(name, result["status"] == "success", result["content"][0]["text"].splitlines()[0])

        if container is None and len(in_reach) > 1:
            print("[skip] saving: several Memories are in reach; set MEMBASE_SMOKE_CONTAINER to one of them")
            return 1 if failures else 0
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        result = await _call(tools["membase_save"], {"content": f"membase-strands live smoke {stamp}: tool save"})
        report("membase_save", result["status"] == "success", result["content"][0]["text"])

    with MembaseMemoryStore(container=container or in_reach[0], capture=True) as writer:
        try:
            note = [{"role": "user", "content": [{"text": f"membase-strands live smoke {stamp}: capture"}]}]
            await writer.add_messages(note)  # type: ignore[arg-type]
            report("capture", True, "one note saved")
        except Exception as error:  # noqa: BLE001
            report("capture", False, f"{type(error).__name__}: {error}")

    print("live smoke test passed" if not failures else f"live smoke test: {failures} step(s) failed")
    return 1 if failures else 0


async def _call(tool: Any, arguments: dict[str, Any]) -> dict[str, Any]:
    """Call one tool's function off the event loop, as Strands does, and return its result."""
    result: dict[str, Any] = await asyncio.to_thread(tool, **arguments)
    return result


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
