"""The public exceptions, the kind and sentence of every Membase failure (``_failures``), redaction and ``clip``."""

from __future__ import annotations

import json
import random

import membase
import pytest

from membase_strands import MembaseAccessError, MembaseRecallTimeout, MembaseWriteTimeout
from membase_strands._failures import (
    ACCESS_SENTENCE,
    PIECE,
    BadResponseError,
    Failure,
    Refused,
    describe_failure,
    redact,
    refusal_of,
)
from membase_strands._text import clip
from membase_strands.testing import API_KEY


def status_error(cls: type[membase.APIStatusError], status: int, message: str = "refused") -> membase.APIStatusError:
    body = {"error": {"code": "error", "message": message, "details": None, "retryable": False, "trace_id": ""}}
    return cls(message, status=status, body=body)


# One example of every failure the tools can meet, with the kind it must get.
CASES: dict[str, tuple[BaseException, str]] = {
    "403": (status_error(membase.PermissionDeniedError, 403), "access"),
    "access": (MembaseAccessError(ACCESS_SENTENCE), "access"),
    "401": (status_error(membase.AuthenticationError, 401), "unauthenticated"),
    "sdk_timeout": (membase.APITimeoutError("POST /v1/search timed out"), "timeout"),
    "recall_timeout": (MembaseRecallTimeout("ran out of time"), "timeout"),
    "write_timeout": (MembaseWriteTimeout("ran out of time"), "timeout"),
    "connection": (membase.APIConnectionError("POST /v1/search: [Errno 111] Connection refused"), "connection"),
    "400": (status_error(membase.BadRequestError, 400, "limit must be 1-50"), "bad_request"),
    "422": (status_error(membase.UnprocessableEntityError, 422, "no model configured"), "unavailable"),
    "429": (status_error(membase.RateLimitError, 429), "rate_limited"),
    "404": (status_error(membase.NotFoundError, 404, "no such memory"), "not_found"),
    "500": (status_error(membase.InternalServerError, 500, "boom"), "server_error"),
    "503": (status_error(membase.InternalServerError, 503, "warming"), "server_error"),
    "bad_response": (BadResponseError("the search answer has no 'results' list"), "bad_response"),
    "json": (json.JSONDecodeError("Expecting value", "<html>", 0), "bad_response"),
    "409": (status_error(membase.ConflictError, 409, "busy elsewhere"), "http_error"),
    "418": (status_error(membase.APIStatusError, 418, "teapot"), "http_error"),
    "other": (RuntimeError("something odd"), "error"),
}


def sentence(case: str) -> str:
    return describe_failure(CASES[case][0]).sentence


def test_each_failure_has_its_kind_and_one_sentence_and_kinds_never_share_a_sentence() -> None:
    by_kind: dict[str, set[str]] = {}
    for case, (error, kind) in CASES.items():
        failure = describe_failure(error)
        assert failure.kind == kind, case
        assert failure.sentence.endswith(".") and "\n" not in failure.sentence, case
        by_kind.setdefault(kind, set()).add(failure.sentence)
        if case != "400":  # naming a Memory changes only what a 400 is about
            assert describe_failure(error, container_named=True).kind == kind, case
    assert len(by_kind) == 12
    for kind, sentences in by_kind.items():
        assert all(not sentences & other for name, other in by_kind.items() if name != kind)


def test_the_wording_users_match_on() -> None:
    assert "this Membase key was narrowed or revoked" in sentence("403") and "not retried" in sentence("403")
    assert sentence("access") == sentence("403") == ACCESS_SENTENCE
    assert "try again in a minute" in sentence("sdk_timeout") and "in time" in sentence("sdk_timeout")
    assert sentence("recall_timeout") == sentence("write_timeout") == sentence("sdk_timeout")
    assert "try again in a minute" in sentence("connection") and "could not be reached" in sentence("connection")
    assert "Connection refused" in sentence("connection")
    assert "limit must be 1-50" in sentence("400")
    assert "cannot run" in sentence("422") and "no model configured" in sentence("422")
    assert "busy" in sentence("429") and "shortly" in sentence("429")
    assert "404" in sentence("404") and "500" in sentence("500") and "503" in sentence("503")
    assert "could not be read" in sentence("bad_response")
    assert "RuntimeError" in sentence("other")


def test_a_400_about_the_container_is_told_apart() -> None:
    plain = status_error(membase.BadRequestError, 400, "q is required")
    about_container = status_error(membase.BadRequestError, 400, "ambiguous Container name")
    assert describe_failure(plain).kind == "bad_request"
    assert describe_failure(plain, container_named=True).kind == "bad_container"
    assert describe_failure(about_container).kind == "bad_container"
    assert "Memory" in describe_failure(about_container).sentence
    assert describe_failure(plain).sentence != describe_failure(plain, container_named=True).sentence


def test_a_servers_message_is_folded_and_capped_and_a_missing_one_names_the_class() -> None:
    error = status_error(membase.BadRequestError, 400, "line one\nline two\x1b[31m " + "x" * 2000)
    folded = describe_failure(error).sentence
    assert "\n" not in folded and "\x1b" not in folded and "line one line two" in folded
    assert len(folded) < 400
    assert "RuntimeError" in describe_failure(RuntimeError()).sentence
    assert "APIConnectionError" in describe_failure(membase.APIConnectionError("")).sentence


def test_public_exceptions_are_the_builtin_kinds() -> None:
    assert issubclass(MembaseAccessError, PermissionError) and not issubclass(MembaseAccessError, membase.MembaseError)
    assert issubclass(MembaseRecallTimeout, TimeoutError) and issubclass(MembaseWriteTimeout, TimeoutError)
    assert issubclass(BadResponseError, membase.MembaseError)


def test_redact_masks_the_key_and_its_quoted_form() -> None:
    assert redact(f"echo {API_KEY} twice {API_KEY}", API_KEY) == "echo [redacted] twice [redacted]"
    assert redact(f"Illegal header value b'Bearer {API_KEY}\\n'", f"{API_KEY}\n") == (
        "Illegal header value b'Bearer [redacted]'"
    )
    assert API_KEY[4:20] not in redact(f"a piece: {API_KEY[4:20]}", API_KEY)
    assert redact("nothing secret here", API_KEY) == "nothing secret here"


CLIPS = [("short", 10, "short"), ("exactly10!", 10, "exactly10!"), ("eleven char", 10, "eleven ch…"), ("", 5, "")]
CLIPS += [("word   spaced    out", 50, "word spaced out"), ("  lead and trail  ", 50, "lead and trail")]
CLIPS += [("one\ntwo\r\nthree\tfour", 50, "one two three four"), ("abc   def", 5, "abc…")]
CLIPS += [("nul\x00bell\x07esc\x1bdel\x7fend", 50, "nul bell esc del end")]


@pytest.mark.parametrize(("text", "limit", "expected"), CLIPS)
def test_clip(text: str, limit: int, expected: str) -> None:
    assert clip(text, limit) == expected
    assert all(len(clip("a b c d e f g h i j k l m n o p q r s t u v w x y z" * 3, n)) <= n for n in range(1, 30))


def test_the_three_403s_are_told_apart_by_membases_words() -> None:
    level = status_error(
        membase.PermissionDeniedError, 403, "tool 'add_memory' is not in this agent's capability profile"
    )
    reach = status_error(membase.PermissionDeniedError, 403, "container 'mv-1': may not use that container")
    assert [refusal_of(error) for error in (level, reach, CASES["403"][0])] == ["level", "reach", "revoked"]
    refused = Refused("This Membase key may not save notes.", "level")
    assert describe_failure(refused) == Failure("access", "This Membase key may not save notes.")
    assert MembaseAccessError("x").refusal == "revoked" and MembaseAccessError("x", "reach").refusal == "reach"


def _redact_by_every_window(text: str, secret: str) -> str:
    """The plain reading of redact(): every window of PIECE characters that is a piece of the secret (or of its quoted
    form) is masked, runs that overlap or touch as one."""
    forms = (secret, repr(secret)[1:-1])
    pieces = {form[i : i + PIECE] for form in forms for i in range(len(form) - PIECE + 1)}
    kept, end = [], 0
    for start in range(len(text) - PIECE + 1):
        if text[start : start + PIECE] in pieces:
            if start > end or not kept:
                kept += [text[end:start], "[redacted]"]
            end = start + PIECE
    return "".join([*kept, text[end:]])


def test_redact_finds_every_piece_through_the_keys_aligned_blocks() -> None:
    chooser = random.Random(7)
    secret = f"{API_KEY}\n"
    for _ in range(2000):
        parts = [secret[a : a + chooser.randint(1, 12)] for a in (chooser.randrange(len(secret)) for _ in range(4))]
        text = "".join(chooser.choice(["x", " ", "Bearer ", "\\n", *parts]) for _ in range(chooser.randint(0, 30)))
        assert redact(text, secret) == _redact_by_every_window(text, secret), text
