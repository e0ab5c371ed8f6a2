"""What went wrong with a Membase call, said plainly: failure kinds, the sentences the model reads, key redaction.

A server may echo what it was sent: every error text that leaves the library goes through redact() or without_secret().
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import traceback
from collections.abc import Callable
from typing import NamedTuple

import membase

from ._text import clip
from .errors import MembaseAccessError, MembaseRecallTimeout, MembaseWriteTimeout

ACCESS_SENTENCE = (
    "Membase refused this key: this Membase key was narrowed or revoked by its owner, or it expired. "
    "The request was not retried."
)
LEVEL, REACH, REVOKED = "level", "reach", "revoked"  # Membase's three 403s (see Refused)
_TRY_LATER = "; try again in a minute."  # the advice for a failure that may pass
PIECE = 8  # no run of this many characters of a key ever leaves the library


class BadResponseError(membase.MembaseError):
    """Membase answered 2xx with a body this library cannot read (not JSON, or the wrong shape)."""


class Refused(membase.PermissionDeniedError):
    """A 403 told apart (``refusal``: :data:`LEVEL`, :data:`REACH` or :data:`REVOKED`), its message the sentence the
    model reads; Membase's own text stays on its (masked) cause. The gateway raises it, also without a request for a
    verb that is off for the store after a refusal."""

    def __init__(self, sentence: str, refusal: str) -> None:
        super().__init__(sentence, status=403)
        self.refusal = refusal


def refusal_of(error: membase.PermissionDeniedError) -> str:
    """Which of the three refusals a 403 is, by Membase's message as its documentation words them: "... not in this
    agent's capability profile" (:data:`LEVEL`), "may not use that container" (:data:`REACH`), else :data:`REVOKED`."""
    text = error.message[:4096].lower()
    return LEVEL if "capability profile" in text else REACH if "may not use that container" in text else REVOKED


class Failure(NamedTuple):
    """What went wrong with one Membase call: a ``kind`` for logs and counters, a ``sentence`` the model can relay."""

    kind: str
    sentence: str


def detail_of(error: BaseException, redact: Callable[[str], str] = str) -> str:
    """The server's own message for an error, ``redact``-ed before it is cut to one line of at most 300 characters."""
    text = error.message if isinstance(error, membase.MembaseError) else str(error)
    return clip(redact(text[:4096]) or type(error).__name__, 300)


def redact(text: str, secret: str) -> str:
    """``text`` with each piece of ``secret`` that is :data:`PIECE` characters or longer masked, wherever it is, in one
    pass: every such piece holds one of the secret's aligned 4-character blocks whole, so ``str.find`` looks for those
    and only the few windows around each find are compared."""
    if len(secret) < PIECE:
        return text.replace(secret, "[redacted]") if secret else text
    pieces, blocks = _pieces(secret)
    runs = []  # (start, end) of each masked piece
    for block in blocks:
        at = text.find(block)
        while at >= 0:
            runs += [(s, s + PIECE) for s in range(max(0, at - 4), at + 1) if text[s : s + PIECE] in pieces]
            at = text.find(block, at + 1)
    if not runs:  # the common case
        return text
    kept: list[str] = []  # the text and the masks so far
    end = 0  # where the last masked run ends
    for start, stop in sorted(runs):
        if start > end or not kept:  # a run of its own (runs that overlap or touch are one)
            kept += [text[end:start], "[redacted]"]
        end = max(end, stop)
    return "".join([*kept, text[end:]])


@functools.lru_cache(maxsize=1024)
def _pieces(secret: str) -> tuple[frozenset[str], tuple[str, ...]]:
    """The :data:`PIECE`-character pieces of ``secret`` and of its quoted form (transports quote what they reject:
    ``b'Bearer ...\\n'``), and their aligned 4-character blocks."""
    forms = (secret, repr(secret)[1:-1])
    pieces = frozenset(form[start : start + PIECE] for form in forms for start in range(len(form) - PIECE + 1))
    return pieces, tuple({form[start : start + 4] for form in forms for start in range(0, len(form) - 3, 4)})


def masking(key: str) -> tuple[str, Callable[[str], str], Callable[[BaseException], BaseException]]:
    """What logs, spans and ``repr`` show of ``key`` (``mbk_<key id>…`` for a developer key, as the Membase app shows
    it; a digest for any other; ``""`` for none), and :func:`redact` and :func:`without_secret` of what must never be
    shown (a developer key's token, any other key whole): functions of it alone, so the store's log can hold them."""
    kind, _, rest = key.partition("_")
    key_id, _, token = rest.partition("_")
    if kind == "mbk" and key_id and len(token) >= PIECE:  # a token too short to mask alone: the whole key is
        hint, secret = f"mbk_{key_id}…", token
    else:
        hint, secret = ("sha256:" + hashlib.sha256(key.encode()).hexdigest()[:8] if key else ""), key
    return hint, functools.partial(redact, secret=secret), functools.partial(without_secret, secret=secret)


def without_secret(error: BaseException, secret: str) -> BaseException:
    """``error`` itself or, when it or any error chained to it (the SDK chains the transport's) carries ``secret``,
    a masked copy: of the same class (so callers still catch it) and status, with no body, cause or traceback."""
    chain = "".join(traceback.format_exception(error))
    if redact(chain, secret) == chain:
        return error
    if isinstance(error, Refused):  # its sentence is the library's; a Memory's name in it may not be
        return Refused(redact(error.message, secret), error.refusal)
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
        said = (
            error.message if isinstance(error, Refused) else str(error) if isinstance(error, MembaseAccessError) else ""
        )
        return Failure("access", said or ACCESS_SENTENCE)
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
