"""Forget, approved over HTTP: ``examples/forget_server.py`` under real uvicorn, its Membase a
:class:`LoopbackMembase` and its model scripted. The person's answer comes in a request after the one whose turn
stopped on ``membase_forget``: only a JSON ``true`` with the waiting question's id forgets, and then the note is gone
from the next search; a decline, ``"yes"``, ``1`` or another question's id forgets nothing. ``GET /questions`` gives
the waiting question back. Every error is ``{"error": {"code", "message"}}`` with its status, for a front end: a body
over 64 KiB is refused (413) before the agent runs, whether its length is declared or not.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from membase_strands.testing import InMemoryMembase
from tests.support.loopback import LoopbackMembase
from tests.support.served import WAIT, ServedApp

pytest.importorskip("fastapi", reason="the served example needs the dev dependencies (fastapi, uvicorn)")
pytest.importorskip("uvicorn", reason="the served example needs the dev dependencies (fastapi, uvicorn)")

KEY = "mb_key_of_alice_forgets"
NOTE = "The launch is in May."
FORGET = "Please forget that the launch is in May."
QUESTION = "When is the launch in May?"


def error_of(answer: httpx.Response, status: int, code: str) -> dict[str, Any]:
    """The error an answer carries, checked to be JSON in the one shape, with its status and code."""
    assert answer.status_code == status and answer.headers["content-type"] == "application/json", answer.text
    error = answer.json()["error"]
    assert list(answer.json()) == ["error"] and error["code"] == code and isinstance(error["message"], str), error
    assert set(error) == ({"code", "message", "interrupts"} if code == "question_waiting" else {"code", "message"})
    return dict(error)


@dataclass
class Chat:
    """One person's requests to the served app."""

    http: httpx.Client
    note_id: str

    def recalled(self) -> str:
        """The reply to ``QUESTION``: the scripted model answers with the passages recall showed it."""
        asked = self.http.post("/chat", json={"text": QUESTION})
        assert asked.status_code == 200, asked.text
        return str(asked.json()["reply"])

    def ask_to_forget(self) -> dict[str, Any]:
        """The interrupt the turn stopped on, asking the person about the note."""
        asked = self.http.post("/chat", json={"text": FORGET})
        assert asked.status_code == 200, asked.text
        [interrupt] = asked.json()["interrupts"]
        assert asked.json()["reply"] is None and interrupt["name"] == "membase_forget"
        assert interrupt["reason"]["memory_id"] == self.note_id
        return dict(interrupt)

    def answer(self, interrupt_id: str, response: Any) -> httpx.Response:
        return self.http.post("/answer", json={"interrupt_id": interrupt_id, "response": response})


def test_a_forget_is_approved_in_a_later_request_and_anything_but_true_forgets_nothing(tmp_path: Path) -> None:
    fake = InMemoryMembase()
    membase = fake.account(KEY)
    note_id = membase.remember(NOTE)
    variables = {"MEMBASE_KEY_alice": KEY, "MEMBASE_EXAMPLE_SCRIPTED": "1", "MEMBASE_EXAMPLE_SESSIONS": str(tmp_path)}
    with LoopbackMembase(fake) as server:
        with ServedApp.uvicorn("forget_server:app", {**variables, "MEMBASE_BASE_URL": server.url}) as app:
            app.wait_until_ready()
            with httpx.Client(base_url=app.url, headers={"X-User-Id": "alice"}, timeout=WAIT) as http:
                chat = Chat(http, note_id)
                assert NOTE in chat.recalled()

                assert http.get("/questions").json() == {"interrupts": []}
                question = chat.ask_to_forget()
                assert http.get("/questions").json() == {"interrupts": [question]}  # as a reloaded page asks
                error_of(chat.answer("v1:tool_call:another-question", True), 409, "no_such_question")  # not waiting
                waiting = http.post("/chat", json={"text": "Hello."})  # the question comes again, to be answered
                assert error_of(waiting, 409, "question_waiting")["interrupts"] == [question]
                for response in ("yes", 1, False):
                    declined = chat.answer(question["id"], response)
                    assert declined.status_code == 200 and "did not approve" in declined.json()["reply"]
                    error_of(chat.answer(question["id"], True), 409, "no_such_question")  # that one is answered
                    assert membase.forgotten == [] and NOTE in chat.recalled()  # the next search still finds it
                    question = chat.ask_to_forget()

                approved = chat.answer(question["id"], True)
                assert approved.status_code == 200 and approved.json()["interrupts"] == []
                assert http.get("/questions").json() == {"interrupts": []}
                assert approved.json()["reply"].startswith("Forgotten")
                searches = len(membase.sent("POST", "/v1/search"))
                assert NOTE not in chat.recalled() and len(membase.sent("POST", "/v1/search")) == searches + 1
        assert "Traceback" not in app.output, app.output

    assert [note.content for note in membase.forgotten] == [NOTE] and membase.notes == []
    confirmed = [r for r in membase.sent("DELETE") if r.params.get("confirm") == "true"]
    assert len(confirmed) == 1  # once, with the person's approval


def test_every_error_is_json_in_one_shape_and_a_large_body_is_refused_before_the_agent_runs(tmp_path: Path) -> None:
    fake = InMemoryMembase()
    membase = fake.account(KEY)
    note_id = membase.remember(NOTE)
    variables = {"MEMBASE_KEY_alice": KEY, "MEMBASE_EXAMPLE_SCRIPTED": "1", "MEMBASE_EXAMPLE_SESSIONS": str(tmp_path)}
    large = "Please remember this: " + "x" * 200_000  # 200 KB; the model would save it
    with LoopbackMembase(fake) as server:
        with ServedApp.uvicorn("forget_server:app", {**variables, "MEMBASE_BASE_URL": server.url}) as app:
            app.wait_until_ready()
            with httpx.Client(base_url=app.url, headers={"X-User-Id": "alice"}, timeout=WAIT) as http:
                error_of(http.post("/chat", json={"text": large}), 413, "too_large")  # its Content-Length says so

                def in_pieces() -> Iterator[bytes]:  # no Content-Length: refused once 64 KiB have come
                    yield b'{"text": "Please remember this: '
                    for _ in range(20):
                        yield b"x" * 10_000
                    yield b'"}'

                headers = {"Content-Type": "application/json"}
                error_of(http.post("/chat", content=in_pieces(), headers=headers), 413, "too_large")
                assert fake.requests == []  # the agent never ran: nothing reached Membase
                assert sum(file.stat().st_size for file in tmp_path.rglob("*") if file.is_file()) < 64 * 1024

                error_of(http.post("/chat", content=b'{"text": ', headers=headers), 422, "malformed")
                error_of(http.post("/chat", json={"words": "Hello."}), 422, "malformed")
                wrong_id = {"interrupt_id": "v1:tool_call:none", "response": True}
                error_of(http.post("/answer", json=wrong_id), 409, "no_such_question")
                error_of(http.post("/chat", json={"text": "Hello."}, headers={"X-User-Id": "mallory"}), 403, "no_key")
                error_of(http.get("/questions", headers={"X-User-Id": "mallory"}), 403, "no_key")
                error_of(http.get("/no-such-page"), 404, "not_found")

                question = Chat(http, note_id).ask_to_forget()
                waiting = error_of(http.post("/chat", json={"text": "Hi."}), 409, "question_waiting")
                assert waiting["interrupts"] == [question]
                assert http.get("/questions").json() == {"interrupts": [question]}

                openapi = http.get("/openapi.json").json()
        assert "Traceback" not in app.output, app.output

    assert membase.forgotten == [] and len(membase.notes) == 1  # nothing was saved or forgotten by the errors
    error_schema = {"$ref": "#/components/schemas/Error"}
    for path in ("/chat", "/answer"):
        responses = openapi["paths"][path]["post"]["responses"]
        assert {"200", "403", "409", "413", "422", "503"} <= set(responses)
        assert all(
            responses[s]["content"]["application/json"]["schema"] == error_schema for s in responses if s != "200"
        )
    assert "/questions" in openapi["paths"] and "/" not in openapi["paths"]
