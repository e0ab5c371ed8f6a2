"""Forget, approved over HTTP: ``examples/forget_server.py`` under real uvicorn, its Membase a
:class:`LoopbackMembase` and its model scripted. The person's answer comes in a request after the one whose turn
stopped on ``membase_forget``: only a JSON ``true`` with the waiting question's id forgets, and then the note is gone
from the next search; a decline, ``"yes"``, ``1`` or another question's id forgets nothing.
"""

from __future__ import annotations

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

                question = chat.ask_to_forget()
                assert chat.answer("v1:tool_call:another-question", True).status_code == 409  # not the waiting one
                waiting = http.post("/chat", json={"text": "Hello."})  # the question comes again, to be answered
                assert waiting.status_code == 409 and waiting.json()["detail"]["interrupts"] == [question]
                for response in ("yes", 1, False):
                    declined = chat.answer(question["id"], response)
                    assert declined.status_code == 200 and "did not approve" in declined.json()["reply"]
                    assert chat.answer(question["id"], True).status_code == 409  # that question is answered
                    assert membase.forgotten == [] and NOTE in chat.recalled()  # the next search still finds it
                    question = chat.ask_to_forget()

                approved = chat.answer(question["id"], True)
                assert approved.status_code == 200 and approved.json()["interrupts"] == []
                assert approved.json()["reply"].startswith("Forgotten")
                searches = len(membase.sent("POST", "/v1/search"))
                assert NOTE not in chat.recalled() and len(membase.sent("POST", "/v1/search")) == searches + 1
        assert "Traceback" not in app.output, app.output

    assert [note.content for note in membase.forgotten] == [NOTE] and membase.notes == []
    confirmed = [r for r in membase.sent("DELETE") if r.params.get("confirm") == "true"]
    assert len(confirmed) == 1  # once, with the person's approval
