"""What went wrong with a Membase call, said plainly: failure kinds, the sentences the model reads, key redaction.

A server may echo what it was sent: every error text that leaves the library goes through redact() or without_secret().
"""

from __future__ import annotations

import contextlib
import json
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import membase

from ._text import clip
from .errors import MembaseAccessError, MembaseRecallTimeout, MembaseWriteTimeout

ACCESS_SENTENCE = (
    "Membase refused this key: this Membase key was narrowed or revoked by its owner, "
    "or the action is above what the key may do. The request was not retried."
)
_TRY_LATER = "; try again in a minute."  # the advice for a failure that may pass
PIECE = 8  # no run of this many characters of a key ever leaves the library


class BadResponseError(membase.MembaseError):
    """Membase answered 2xx with a body this library cannot read (not JSON, or the wrong shape)."""


@dataclass(frozen=True)
class Failure:
    """What went wrong with one Membase call: a ``kind`` for logs and counters, a ``sentence`` the model can relay."""

    kind: str
    sentence: str


def detail_of(error: BaseException, redact: Callable[[str], str] = str) -> str:
    """The server's own message for an error, ``redact``-ed before it is cut to one line of at most 300 characters."""
    text = error.message if isinstance(error, membase.MembaseError) else str(error)
    return clip(redact(text[:4096]) or type(error).__name__, 300)


def redact(text: str, secret: str) -> str:
    """``text`` with each piece of ``secret`` that is :data:`PIECE` characters or longer masked, wherever it is."""
    if len(secret) < PIECE:
        return text.replace(secret, "[redacted]") if secret else text
    forms = (secret, repr(secret)[1:-1])  # transports quote what they reject (b'Bearer ...\n')
    pieces = {form[start : start + PIECE] for form in forms for start in range(len(form) - PIECE + 1)}
    if not any(piece in text for piece in pieces):  # the common case
        return text
    kept: list[str] = []  # the text and the masks so far
    end = 0  # where the last masked run ends
    for start in range(len(text) - PIECE + 1):
        if text[start : start + PIECE] in pieces:
            if start > end or not kept:  # a run of its own (runs that overlap or touch are one)
                kept += [text[end:start], "[redacted]"]
            end = start + PIECE
    return "".join([*kept, text[end:]])


def without_secret(error: BaseException, secret: str) -> BaseException:
    """``error`` itself or, when it or any error chained to it (the SDK chains the transport's) carries ``secret``,
    a masked copy: of the same class (so callers still catch it) and status, with no body, cause or traceback."""
    chain = "".join(traceback.format_exception(error))
    if redact(chain, secret) == chain:
        return error
    if isinstance(error, membase.MembaseError):
        with contextlib.suppress(TypeError):  # a subclass with another signature gets the fallback
            return type(error)(redact(error.message, secret), status=error.status)
    return BadResponseError(redact(str(error), secret), status=getattr(error, "status", None))


def describe_failure(
    error: BaseException, *, container_named: bool = False, redact: Callable[[str], str] = str
) -> Failure:
    """The :class:`Failure` of an exception from a Membase call (or of this library, for an unreadable answer);
    ``container_named``: the request named a Memory, so a 400 is about it; ``redact`` masks the key in its text."""
    detail = detail_of(error, redact)
    # Order matters: APITimeoutError is an APIConnectionError, every status error an APIStatusError.
    if isinstance(error, (membase.PermissionDeniedError, MembaseAccessError)):
        return Failure("access", ACCESS_SENTENCE)
    if isinstance(error, membase.AuthenticationError):
        return Failure("unauthenticated", "Membase did not receive a usable API key (401); check MEMBASE_API_KEY.")
    if isinstance(error, (membase.APITimeoutError, MembaseRecallTimeout, MembaseWriteTimeout)):
        return Failure("timeout", "Membase did not answer in time (the memory may still be waking up)" + _TRY_LATER)
    if isinstance(error, membase.APIConnectionError):
        return Failure("connection", f"Membase could not be reached (the connection failed: {detail})" + _TRY_LATER)
    if isinstance(error, membase.BadRequestError):
        if container_named or "container" in detail.lower():
            return Failure("bad_container", f"Membase rejected the Memory named in the request: {detail}.")
        return Failure("bad_request", f"Membase rejected the request as invalid: {detail}.")
    if isinstance(error, membase.UnprocessableEntityError):
        return Failure("unavailable", f"This Memory cannot run right now (Membase answered 422: {detail}).")
    if isinstance(error, membase.RateLimitError):
        return Failure("rate_limited", "Membase is busy right now (rate limited, 429); try again shortly.")
    if isinstance(error, membase.NotFoundError):
        return Failure("not_found", f"Membase could not find what was asked for (404: {detail}).")
    if isinstance(error, membase.InternalServerError):
        return Failure("server_error", f"Membase had an internal error ({error.status}: {detail})" + _TRY_LATER)
    if isinstance(error, (BadResponseError, json.JSONDecodeError)):
        return Failure("bad_response", f"Membase sent an answer that could not be read ({detail}).")
    if isinstance(error, membase.APIStatusError):
        return Failure("http_error", f"Membase answered with an error ({error.status}: {detail}).")
    return Failure("error", f"The Membase call failed ({type(error).__name__}: {detail}).")
