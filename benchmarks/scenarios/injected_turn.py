"""Section 2, a full injected turn: one ``strands.Agent`` turn with a MemoryManager over the store, and without.

The model is the testing kit's scripted model (it answers at once) and the store's client answers
a fixed three-passage search at zero latency, so the difference is everything memory adds to a turn.
"""

from __future__ import annotations

import asyncio
import gc
import time

from report import Section, fmt
from support import Plan, async_turns_ms, fixed_answer, make_agent, median, mock_client, sync_turn_ms, time_calls_us

from membase_strands import MembaseMemoryStore

NUMBER = 2
TOOLS_AGAIN_TARGET_US = 50.0


def run(plan: Plan) -> Section:
    """Time synchronous and async turns with the store and without memory, interleaved."""
    section = Section(
        NUMBER,
        "A full injected turn through `strands.Agent`",
        "A real `strands.Agent` with the scripted model (answers at once), with a `MemoryManager` over the "
        "store (zero-latency fixed search answer; the three passages are injected) and without any "
        f"`MemoryManager`. The history is emptied before each turn. {plan.turn_trials} trials x "
        f"{plan.turns} turns per variant, interleaved; median over trials of the per-trial median.",
        ["turn", "without memory (ms)", "with the store (ms)", "store's share"],
    )
    with mock_client(fixed_answer) as client:
        store = MembaseMemoryStore(client=client)
        try:
            with_store, with_model = make_agent(store)
            bare, bare_model = make_agent(None)
            for _ in range(3):  # warm-up
                sync_turn_ms(with_store, with_model)
                sync_turn_ms(bare, bare_model)
            injected = "Postgres" in (with_model.memory_block() or "")
            sync_bare, sync_store, async_bare, async_store = [], [], [], []
            for _ in range(plan.turn_trials):
                gc.collect()
                sync_bare.append(median([sync_turn_ms(bare, bare_model) for _ in range(plan.turns)]))
                sync_store.append(median([sync_turn_ms(with_store, with_model) for _ in range(plan.turns)]))
                async_bare.append(median(asyncio.run(async_turns_ms(bare, bare_model, plan.turns))))
                async_store.append(median(asyncio.run(async_turns_ms(with_store, with_model, plan.turns))))
        finally:
            store.close()
    for label, key, bare_runs, store_runs in (
        ('synchronous `agent("...")`', "sync", sync_bare, sync_store),
        ("`await agent.invoke_async(...)`", "async", async_bare, async_store),
    ):
        without, with_ = median(bare_runs), median(store_runs)
        share = (with_ - without) / with_ * 100
        section.row(label, fmt(without), fmt(with_), f"{fmt(with_ - without)} ms ({share:.0f} %)")
        section.figure(f"{key}_without_ms", f"{key} turn without memory", without, "ms", better="info", floor=0.5)
        section.figure(
            f"{key}_with_ms", f"{key} turn with the store", with_, "ms", floor=0.5, reference=f"2.{key}_without_ms"
        )
    section.notes.append(
        "The store's share is everything memory adds to the turn: the MemoryManager's injection middleware "
        "and its tools (`search_memory` and the three `membase_*` tools in every model call), the recall "
        "(section 1) and rendering the `<memory>` block. A synchronous call also pays Strands' own new "
        "thread and event loop per call, with or without memory."
    )
    section.notes.append(
        f"Memory was injected into the model's input: {'yes' if injected else 'NO (check the setup)'}."
    )
    _building(plan, section)
    return section


def _building(plan: Plan, section: Section) -> None:
    """What building an Agent over the store costs the store: its tools, the first time and again."""
    count = 200 if plan.quick else 1000
    with mock_client(fixed_answer) as client:
        stores = [MembaseMemoryStore(client=client) for _ in range(count)]
        first: list[float] = []
        for store in stores:
            started = time.perf_counter_ns()
            store.get_tools()
            first.append((time.perf_counter_ns() - started) / 1000)
        again = time_calls_us(stores[0].get_tools, count * 10)
        agent_ms = [time_calls_us(lambda: make_agent(stores[0]), 1)[0] / 1000 for _ in range(count // 10)]
        for store in stores:
            store.close()
    first_us, again_us = median(first), median(again)
    section.extra += [
        f"Building an `Agent` over the store: the store's share is its tools (`get_tools()`), asked for by every "
        f"`Agent` built over it (an app that builds an agent per request asks on every request). Medians of {count} "
        "stores and of repeated calls.",
        "",
        "| step | median |",
        "| --- | --- |",
        f"| `get_tools()` of a new store (binds the three tools to it) | {fmt(first_us)} µs |",
        f"| `get_tools()` again on a store that built them (the same tool objects) | {fmt(again_us)} µs |",
        f"| a whole `Agent(model, memory_manager=MemoryManager(stores=[store]))` | {fmt(median(agent_ms))} ms |",
        "",
    ]
    section.figure("first_tools_us", "get_tools() of a new store", first_us, "µs", floor=20)
    section.figure("tools_again_us", "get_tools() again on the same store", again_us, "µs", floor=5)
    section.figure("agent_build_ms", "building an Agent over the store", median(agent_ms), "ms", floor=0.5)
    section.target(
        f"`get_tools()` on a store that already built them: at most {TOOLS_AGAIN_TARGET_US:g} µs",
        again_us <= TOOLS_AGAIN_TARGET_US,
        f"{fmt(again_us)} µs (the first call on a new store: {fmt(first_us)} µs)",
    )
