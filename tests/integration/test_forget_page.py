"""The chat page of ``examples/forget_server.py`` (``GET /``) in headless Chromium, driven by Playwright as a person
uses it: the app under real uvicorn, its Membase a :class:`LoopbackMembase`, its model scripted. The person saves a
note, asks to forget it and sees the passage, its Memory and Membase's words; a reload shows the question again;
Approve forgets it once (gone from the next search); Decline, for another note, forgets nothing. Every request the
page makes goes to the app on 127.0.0.1.

Debian's Chromium (``apt-get install -y chromium``), never a browser Playwright downloads: where it is missing the
test skips and says how to install it, except under ``CI=true``, where it fails. It waits on what the page shows and
on the answers it gets, never on the clock.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from membase_strands.testing import InMemoryMembase
from tests.support.loopback import LoopbackMembase
from tests.support.served import START_WAIT, WAIT, ServedApp

pytest.importorskip("fastapi", reason="the served example needs the dev dependencies (fastapi, uvicorn)")
pytest.importorskip("uvicorn", reason="the served example needs the dev dependencies (fastapi, uvicorn)")

KEY = "mb_key_of_alice_uses_the_page"
MAY = "Please remember that the launch is in May."
FRIDAYS = "Please remember that the team meets on Fridays."
# Chromium here runs as root with no route out: no sandbox, no GPU, no call home, a fresh profile (the fixture's).
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
]
INSTALL = "apt-get install -y chromium (Debian's package; CI installs it)"


def missing(reason: str) -> None:
    """Skip for want of ``reason``; under CI, fail: CI installs what this test needs."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason} (CI must run the browser test)")
    pytest.skip(reason)


@pytest.fixture
def page(tmp_path: Path) -> Iterator[Any]:
    """A page of a fresh headless Chromium, its default waits ``WAIT``."""
    executable = shutil.which("chromium")
    if executable is None:
        missing(f"Chromium is not installed: {INSTALL}")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        missing("Playwright is not installed: uv sync --python 3.12 (it is a dev dependency)")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch_persistent_context(
            tmp_path / "chromium-profile",
            executable_path=executable,
            headless=True,
            args=FLAGS,
            timeout=START_WAIT * 1000,
        )
        try:
            browser.set_default_timeout(WAIT * 1000)
            yield browser.pages[0] if browser.pages else browser.new_page()
        finally:
            browser.close()


def test_the_chat_page_asks_before_forgetting_and_approve_forgets_once(page: Any, tmp_path: Path) -> None:
    from playwright.sync_api import expect

    expect.set_options(timeout=WAIT * 1000)
    fake = InMemoryMembase()
    membase = fake.account(KEY)
    requested: list[str] = []
    page.on("request", lambda request: requested.append(request.url))
    variables = {"MEMBASE_KEY_alice": KEY, "MEMBASE_EXAMPLE_SCRIPTED": "1", "MEMBASE_EXAMPLE_SESSIONS": str(tmp_path)}
    log, question = page.locator("#log"), page.locator("#question")

    def done(route: str, action: Callable[[], object]) -> None:
        """``action``, then wait for the app's answer on ``route`` and for the page to have shown it."""
        with page.expect_response(f"**{route}"):
            action()
        expect(page.locator("body")).to_have_attribute("aria-busy", "false")

    def send(text: str) -> None:
        page.fill("#message", text)
        done("/chat", lambda: page.click("#send"))

    def agent_said() -> str:
        return str(log.locator("p.agent").last.text_content())

    def answer(button: str) -> None:
        done("/answer", lambda: page.click(button))
        expect(question).to_be_hidden()

    def confirmed_deletes() -> int:
        return len([r for r in membase.sent("DELETE") if r.params.get("confirm") == "true"])

    with LoopbackMembase(fake) as server:
        with ServedApp.uvicorn("forget_server:app", {**variables, "MEMBASE_BASE_URL": server.url}) as app:
            app.wait_until_ready()
            done("/questions", lambda: page.goto(app.url + "/"))
            expect(page.locator("#user")).to_have_value("alice")
            expect(question).to_be_hidden()

            send(MAY)
            assert membase.saved() == [MAY] and "Saved" in agent_said()

            send("Please forget that the launch is in May.")
            expect(question).to_be_visible()
            with httpx.Client(base_url=app.url, headers={"X-User-Id": "alice"}, timeout=WAIT) as http:
                [waiting] = http.get("/questions").json()["interrupts"]
            reason = waiting["reason"]
            assert reason["content"] == MAY and reason["memory"] == "Main" and reason["how"]
            expect(page.locator("#passage")).to_have_text(MAY)
            expect(page.locator("#memory")).to_have_text("Main")
            expect(page.locator("#how")).to_have_text(reason["how"])
            expect(page.locator("#send")).to_be_disabled()  # the question comes first

            done("/questions", page.reload)  # the question is the session's, not the page's: it comes back
            expect(question).to_be_visible()
            expect(page.locator("#passage")).to_have_text(MAY)
            assert membase.forgotten == [] and confirmed_deletes() == 0

            answer("#approve")
            assert agent_said().startswith("Forgotten, with the user's approval")
            assert [note.content for note in membase.forgotten] == [MAY] and confirmed_deletes() == 1
            send("When is the launch in May?")
            assert agent_said().startswith("Recalled:") and "May" not in agent_said()  # gone from the search

            send(FRIDAYS)
            send("Please forget that the team meets on Fridays.")
            expect(page.locator("#passage")).to_have_text(FRIDAYS)
            answer("#decline")
            assert "did not approve" in agent_said()
            send("When does the team meet on Fridays?")
            assert FRIDAYS in agent_said()  # still found
            assert [note.content for note in membase.forgotten] == [MAY] and confirmed_deletes() == 1

            send("Please remember " + "x" * 70_000)  # over 64 KiB: the page says the app's refusal
            expect(log.locator("p.error").last).to_have_text("a message is at most 64 KiB")
        assert "Traceback" not in app.output, app.output

    assert membase.saved() == [FRIDAYS]
    assert requested and all(url.startswith(app.url + "/") for url in requested), requested  # nothing from elsewhere
    asked = {url.removeprefix(app.url) for url in requested}
    assert {"/", "/questions", "/chat", "/answer"} <= asked, asked
