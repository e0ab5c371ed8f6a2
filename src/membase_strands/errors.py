"""The exceptions this library raises besides the Membase SDK's own (``membase.MembaseError`` and subclasses).

:class:`MembaseAccessError` is a ``PermissionError`` so code that already handles permission
problems catches it; :class:`MembaseRecallTimeout` and :class:`MembaseWriteTimeout` are
``TimeoutError`` so the Strands ``MemoryManager`` (which logs and skips a failing store, and keeps a
failed write for a retry) treats a slow memory like any other timeout.
"""


class MembaseAccessError(PermissionError):
    """Membase refused the key (HTTP 403).

    The key is unknown or expired, its owner narrowed or revoked it, the Memory is outside its
    reach, or the action is above its access level. The store never retries a 403.
    """


class MembaseRecallTimeout(TimeoutError):
    """Automatic recall ran out of its time budget.

    The request that ran out of time is not abandoned: it finishes in the background so the
    memory is awake for the next turn, and its outcome is logged. While it runs, later recalls
    are skipped: they return no memory without raising this.
    """


class MembaseWriteTimeout(TimeoutError):
    """A captured write ran out of its time budget.

    The manager keeps the batch and retries it later; the request itself goes on in the
    background, and if it succeeds the retry sends nothing new.
    """


__all__ = ["MembaseAccessError", "MembaseRecallTimeout", "MembaseWriteTimeout"]
