"""Section 8, idle stores hold no sockets: many pooled users take one turn each, then nobody does anything.

Every user's store comes from one ``MembaseStorePool`` big enough to keep them all, and each user takes
one turn through ``strands.Agent`` against the loopback server (``benchmarks/_server.py``), a bounded
number at a time on one event loop. Then the loop idles, the pool still open, for longer than httpx's
keep-alive expiry, and the sockets still open to Membase are counted from both ends:

- the server's ``open_now``: the connections it has accepted that the client has not closed (a
  connection leaves the count as soon as the server reads its end; the control requests that ask for
  the count are left out of it);
- this process's own: the inodes of its open descriptors that are sockets (``/proc/self/fd``), matched
  with the TCP table of its network namespace (``/proc/self/net/tcp``) on the server's port as the
  remote port. That is exact where counting ``socket:`` links alone is not: the event loop's self-pipe
  is a socket pair, and the TCP table also lists the server's ends, which belong to the child process.
  It is Linux-only, as section 5 is.
"""

from __future__ import annotations

import asyncio
import gc
import os
import resource
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from report import Section, fmt
from strands import Agent
from strands.memory import MemoryManager
from support import QUESTION, Plan, ServerProcess, no_library_threads, wait_until

from membase_strands import MembaseStorePool
from membase_strands.testing import ScriptedModel

NUMBER = 8
SERVER_LATENCY_MS = 3.0
AT_A_TIME = 50
"""Users taking their turn at once; no more sockets than this can be in use at any moment."""
SOCKETS_TARGET = AT_A_TIME
KEEPALIVE_S = httpx.Limits().keepalive_expiry or 5.0
"""How long httpx keeps an idle connection for reuse by default (what the library's clients use)."""
TCP_STATES = {
    "01": "ESTABLISHED",
    "02": "SYN_SENT",
    "03": "SYN_RECV",
    "04": "FIN_WAIT1",
    "05": "FIN_WAIT2",
    "06": "TIME_WAIT",
    "07": "CLOSE",
    "08": "CLOSE_WAIT",
    "09": "LAST_ACK",
    "0A": "LISTEN",
    "0B": "CLOSING",
}


def own_sockets_to(port: int) -> Counter[str]:
    """This process's open TCP sockets whose remote port is ``port``, by state (``ESTABLISHED``, ...)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the listing's own descriptor, closed by now
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    states: Counter[str] = Counter()
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:  # no IPv6 table
            continue
        for line in lines:
            # sl local_address rem_address st tx_queue:rx_queue tr:tm->when retrnsmt uid timeout inode ...
            fields = line.split()
            if int(fields[2].rsplit(":", 1)[1], 16) == port and fields[9] in inodes:
                states[TCP_STATES.get(fields[3], fields[3])] += 1
    return states


@dataclass(frozen=True)
class Count:
    """The sockets open to Membase at one moment, seen from this process and from the server."""

    at_s: float  # seconds since the turns ended
    own: Counter[str]
    server: dict[str, int]

    @property
    def here(self) -> int:
        return sum(self.own.values())

    @property
    def there(self) -> int:
        return self.server["open_now"]


def _count(server: ServerProcess, port: int, since: float) -> Count:
    own = own_sockets_to(port)  # first: the stats request below opens (and closes) a socket of its own
    return Count(time.monotonic() - since, own, server.stats())


@dataclass
class Outcome:
    """What the turns did and the counts taken after them."""

    turns: int = 0
    injected: int = 0
    turns_s: float = 0.0
    counts: list[Count] = field(default_factory=list)  # right after the turns, then once a second while idle
    closed: Count | None = None  # after pool.close()


async def _turns_then_idle(users: int, idle_s: float, server: ServerProcess, port: int) -> Outcome:
    """One turn per user, at most AT_A_TIME at once, then ``idle_s`` idle with the pool open; then the pool closes."""
    outcome = Outcome()
    gate = asyncio.Semaphore(AT_A_TIME)
    pool = MembaseStorePool(lambda user_id: user_id, base_url=server.url, max_stores=users)

    async def user(number: int) -> None:
        async with gate:
            model = ScriptedModel()
            store = pool.store_for(f"user-{number}")  # the user's id is its key here
            agent = Agent(model=model, memory_manager=MemoryManager(stores=[store]), callback_handler=None)
            await agent.invoke_async(QUESTION)
            outcome.turns += 1
            outcome.injected += model.memory_block() is not None

    try:
        started = time.monotonic()
        await asyncio.gather(*(user(n) for n in range(users)))
        ended = time.monotonic()
        outcome.turns_s = ended - started
        outcome.counts.append(_count(server, port, ended))
        # Idle on the loop, as a server between requests does, counting once a second.
        for second in range(1, int(idle_s) + 1):
            await asyncio.sleep(max(0.0, ended + second - time.monotonic()))
            outcome.counts.append(_count(server, port, ended))
        if idle_s > int(idle_s):
            await asyncio.sleep(max(0.0, ended + idle_s - time.monotonic()))
            outcome.counts.append(_count(server, port, ended))
    finally:
        pool.close()
    closed = time.monotonic()
    # The server sees a closed connection a moment after the client closes it.
    wait_until(lambda: server.stats()["open_now"] == 0, timeout=2.0, step=0.05)
    outcome.closed = _count(server, port, closed)
    return outcome


@contextmanager
def _descriptors_for(sockets: int) -> Iterator[None]:
    """Raise this process's soft limit on open files to fit ``sockets`` more (the server started inside inherits
    it), within the hard limit; restored after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = sockets + 256
    if soft == resource.RLIM_INFINITY or soft >= wanted:
        yield
        return
    resource.setrlimit(resource.RLIMIT_NOFILE, (wanted if hard == resource.RLIM_INFINITY else min(wanted, hard), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _states(count: Count) -> str:
    return ", ".join(f"{n} {state}" for state, n in count.own.most_common()) or "none"


def run(plan: Plan) -> Section:
    """One turn per pooled user, then an idle wait with the pool open; count the sockets left open to Membase."""
    users = plan.idle_users
    idle_s = max(plan.idle_s, KEEPALIVE_S + 1)
    section = Section(
        NUMBER,
        "Idle stores hold no sockets",
        f"The loopback server of section 4 ({SERVER_LATENCY_MS:g} ms per request) in a child process. {users} users, "
        "each with its store from one `MembaseStorePool(credential_for, base_url=..., "
        f"max_stores={users})` (big enough to keep every store), take one turn each through `strands.Agent` "
        f"(scripted model, `invoke_async`), at most {AT_A_TIME} users at a time on one event loop. Then the loop "
        f"idles for {idle_s:g} s (httpx lets an idle connection expire after {KEEPALIVE_S:g} s) without closing "
        "the pool, and the sockets still open to Membase are counted from both ends: the connections the server "
        "holds open, and this process's open TCP sockets to the server's port (its descriptors in `/proc/self/fd` "
        "matched with `/proc/self/net/tcp`). Last, the pool closes and they are counted once more.",
        ["when", "sockets open in this process", "connections open at the server", "connections accepted", "requests"],
    )
    with _descriptors_for(users):
        server = ServerProcess(SERVER_LATENCY_MS)
        try:
            port = int(server.url.rsplit(":", 1)[1])
            gc.collect()  # first: collecting earlier sections' stores closes their clients on library threads
            no_library_threads()
            server.reset()
            outcome = asyncio.run(_turns_then_idle(users, idle_s, server, port))
        finally:
            server.stop()
    after_turns, idle = outcome.counts[0], outcome.counts[-1]
    assert outcome.closed is not None
    for when, count in (
        (f"right after the turns ({fmt(outcome.turns_s)} s for {outcome.turns} turns)", after_turns),
        (f"after {fmt(idle.at_s)} s idle, the pool open", idle),
        ("after `pool.close()`", outcome.closed),
    ):
        section.row(when, count.here, count.there, count.server["connections"], count.server["requests"])
    name = f"{users} pooled users after one turn each"
    section.figure(
        "after_turns_sockets",
        f"open sockets to Membase right after the turns, {name}",
        after_turns.here,
        "sockets",
        better="info",
    )
    section.figure(
        "idle_sockets", f"open sockets to Membase after {idle_s:g} s idle, {name}", idle.here, "sockets", floor=10
    )
    section.figure(
        "idle_server_open",
        f"connections the server holds open after {idle_s:g} s idle, {name}",
        idle.there,
        "connections",
        floor=10,
    )
    section.figure(
        "connections", f"TCP connections accepted, {name}", idle.server["connections"], "connections", floor=10
    )
    most = max(idle.here, idle.there)
    section.target(
        f"{users:,} pooled users after one turn each and {idle_s:g} s idle: at most {SOCKETS_TARGET} open sockets "
        "to Membase",
        most <= SOCKETS_TARGET,
        f"{idle.here} open in this process and {idle.there} at the server after {fmt(idle.at_s)} s idle "
        f"({after_turns.here} and {after_turns.there} right after the turns)",
    )
    section.target(
        "every turn recalled and injected memory",
        outcome.injected == users,
        f"{outcome.injected} of {users}",
    )
    section.notes.append(
        "Over the idle wait (seconds since the turns ended: sockets open in this process / at the server): "
        + ", ".join(f"{c.at_s:.1f} s: {c.here}/{c.there}" for c in outcome.counts)
        + f". This process's sockets after the idle wait, by TCP state: {_states(idle)}."
    )
    if outcome.closed.here or outcome.closed.there:
        section.notes.append(
            f"After `pool.close()` {outcome.closed.here} sockets were still open in this process "
            f"({_states(outcome.closed)}) and {outcome.closed.there} at the server."
        )
    return section
