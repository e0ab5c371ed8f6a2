"""One module per section of RESULTS.md; each has its section ``NUMBER`` and a ``run``.

1. :mod:`.recall_overhead`: what ``await store.search(q)`` adds to the raw SDK call, step by step.
2. :mod:`.injected_turn`: a whole ``strands.Agent`` turn with the store against one without memory.
3. :mod:`.stalled_memory`: turns while Membase's search hangs (the time box and the in-flight guard).
4. :mod:`.many_users`: many users over real HTTP on loopback, a fresh store per turn or one per user.
5. :mod:`.idle_memory`: resident memory and build time of idle stores, each trial in a fresh process.
6. :mod:`.hung_capture`: a capturing turn while Membase's write hangs (the write budget).
7. :mod:`.regression`: every figure against the previous RESULTS.md (always last).
8. :mod:`.idle_sockets`: the sockets many pooled users' stores keep open to Membase once idle.
"""
