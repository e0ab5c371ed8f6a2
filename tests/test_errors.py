"""The public exceptions, the sentences given for Membase failures, and ``clip``."""

from __future__ import annotations

import json

import membase
import pytest

from membase_strands import MembaseAccessError, MembaseRecallTimeout
from membase_strands._failures import ACCESS_SENTENCE, BadResponseError, Failure, clip, describe_failure


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


@pytest.mark.parametrize("case", list(CASES))
def test_each_failure_gets_its_kind_and_a_sentence(case: str) -> None:
    error, kind = CASES[case]
    failure = describe_failure(error)
    assert isinstance(failure, Failure)
    assert failure.kind == kind
    assert failure.sentence.endswith(".")
    assert "\n" not in failure.sentence


def test_every_kind_is_distinct_and_so_is_every_sentence() -> None:
    by_kind: dict[str, set[str]] = {}
    for error, kind in CASES.values():
        by_kind.setdefault(kind, set()).add(describe_failure(error).sentence)
    assert len(by_kind) == 12
    # Sentences of different kinds never coincide.
    for kind, sentences in by_kind.items():
        for other, other_sentences in by_kind.items():
            if kind != other:
                assert not sentences & other_sentences


def test_the_wording_users_match_on() -> None:
    def sentence(case: str) -> str:
        return describe_failure(CASES[case][0]).sentence

    assert "this Membase key was narrowed or revoked" in sentence("403")
    assert "not retried" in sentence("403")
    assert sentence("access") == sentence("403") == ACCESS_SENTENCE
    assert "try again in a minute" in sentence("sdk_timeout")
    assert "in time" in sentence("sdk_timeout")
    assert sentence("recall_timeout") == sentence("sdk_timeout")
    assert "try again in a minute" in sentence("connection")
    assert "could not be reached" in sentence("connection")
    assert "Connection refused" in sentence("connection")
    assert sentence("connection") != sentence("sdk_timeout")
    assert "limit must be 1-50" in sentence("400")
    assert "cannot run" in sentence("422") and "no model configured" in sentence("422")
    assert "busy" in sentence("429") and "shortly" in sentence("429")
    assert "500" in sentence("500") and "503" in sentence("503")
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


def test_container_named_changes_only_a_400() -> None:
    for case, (error, kind) in CASES.items():
        if case != "400":
            assert describe_failure(error, container_named=True).kind == kind


def test_a_servers_message_is_folded_and_capped_in_the_sentence() -> None:
    error = status_error(membase.BadRequestError, 400, "line one\nline two\x1b[31m " + "x" * 2000)
    sentence = describe_failure(error).sentence
    assert "\n" not in sentence and "\x1b" not in sentence
    assert "line one line two" in sentence
    assert len(sentence) < 400


def test_an_error_without_a_message_names_its_class() -> None:
    assert "RuntimeError" in describe_failure(RuntimeError()).sentence
    assert "APIConnectionError" in describe_failure(membase.APIConnectionError("")).sentence


def test_public_exceptions_are_the_builtin_kinds() -> None:
    assert issubclass(MembaseAccessError, PermissionError)
    assert issubclass(MembaseRecallTimeout, TimeoutError)
    assert not issubclass(MembaseAccessError, membase.MembaseError)
    assert issubclass(BadResponseError, membase.MembaseError)
    with pytest.raises(PermissionError):
        raise MembaseAccessError(ACCESS_SENTENCE)
    with pytest.raises(TimeoutError):
        raise MembaseRecallTimeout("ran out of time")


# --- clip -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "limit", "expected"),
    [
        ("short", 10, "short"),
        ("exactly10!", 10, "exactly10!"),
        ("eleven char", 10, "eleven ch…"),
        ("word   spaced    out", 50, "word spaced out"),
        ("  lead and trail  ", 50, "lead and trail"),
        ("one\ntwo\r\nthree\tfour", 50, "one two three four"),
        ("nul\x00bell\x07esc\x1bdel\x7fend", 50, "nul bell esc del end"),
        ("", 5, ""),
        ("abc   def", 5, "abc…"),
    ],
)
def test_clip(text: str, limit: int, expected: str) -> None:
    assert clip(text, limit) == expected


def test_clip_never_exceeds_its_limit() -> None:
    for limit in range(1, 30):
        assert len(clip("a b c d e f g h i j k l m n o p q r s t u v w x y z" * 3, limit)) <= limit
