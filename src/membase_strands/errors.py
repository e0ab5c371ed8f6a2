"""The exceptions this library raises besides the Membase SDK's own (``membase.MembaseError`` and subclasses): as
``PermissionError`` and ``TimeoutError``, code (and the Strands ``MemoryManager``, which skips a failing store and keeps
a failed write for a retry) treats them like any other refusal or timeout."""


class MembaseAccessError(PermissionError):
    """Membase refused the key (HTTP 403); the store never sends the same request again at once.

    Attributes:
        refusal: Which of Membase's three refusals it was: ``"level"`` (the action is above the key's access level,
            or the profile is not allowed for it), ``"reach"`` (the Memory is outside the key's reach, or gone) or
            ``"revoked"`` (the key is unknown, expired, or revoked by its owner). docs/access.md says what the store
            does after each.
    """

    def __init__(self, message: str, refusal: str = "revoked") -> None:
        super().__init__(message)
        self.refusal = refusal


class MembaseRecallTimeout(TimeoutError):
    """Automatic recall ran out of its time budget. The request finishes in the background (the memory is awake
    for the next turn) and its outcome is logged; recalls meanwhile return no memory without raising this."""


class MembaseWriteTimeout(TimeoutError):
    """A captured write ran out of its time budget. The manager keeps the batch for a retry; the request goes on
    in the background, and if it succeeds the retry sends nothing new."""
