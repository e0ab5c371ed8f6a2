"""Forget, approved over HTTP: a FastAPI app whose agents a Strands session manager keeps between requests, so a turn
that stopped to ask the person whether to forget resumes when their answer comes in a later request.

    MEMBASE_KEY_alice=mbk_... uvicorn forget_server:app --app-dir examples
    POST /chat    {"text": "Please forget that the launch is in May."}
        -> {"reply": null, "interrupts": [{"id": "...", "name": "membase_forget", "reason": {"memory_id": ...}}]}
    POST /answer  {"interrupt_id": "...", "response": true}        (only a JSON true forgets)
        -> {"reply": "Forgotten, with the user's approval: ...", "interrupts": []}

X-User-Id names the user, whose key is MEMBASE_KEY_<user id> (or local Membase directory, MEMBASE_LOCAL_<user id>);
MEMBASE_BASE_URL, if set, names the Membase host. Each user's conversation, and the question waiting for their answer,
are files in MEMBASE_EXAMPLE_SESSIONS (by default a directory in the system's temporary directory). Several workers
need one shared directory (or a shared session store, such as Strands' S3SessionManager) and a user's requests one at
a time, as a chat sends them. The model is Strands' default (Amazon Bedrock: AWS credentials needed);
MEMBASE_EXAMPLE_SCRIPTED=1 swaps in a scripted one (the tests do).
"""

import asyncio
import os
import re
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Header, HTTPException, Request
from pydantic import BaseModel
from strands import Agent
from strands.memory import MemoryManager
from strands.session import FileSessionManager

from membase_strands import MembaseStorePool, injection_config
from membase_strands.testing import ScriptedModel, ToolCall

SESSIONS = os.environ.get("MEMBASE_EXAMPLE_SESSIONS") or os.path.join(tempfile.gettempdir(), "membase-sessions")
WAITING = "waiting_for_answer"  # in the agent's state (kept by the session): the questions the person must answer


def membase_key(user_id: str) -> str | Path:
    if directory := os.environ.get(f"MEMBASE_LOCAL_{user_id}"):  # local Membase: a Path (one process per directory)
        return Path(directory)
    return os.environ[f"MEMBASE_KEY_{user_id}"]  # a user with no key is refused (403 below)


def new_model(words: str | None) -> ScriptedModel | None:
    """Strands' default model; offline, one that plays its part: asked to forget, it searches for the words and
    forgets the passage found, by the id membase_search shows; asked to remember, it saves the words; then it passes
    on what the last tool said."""
    if os.environ.get("MEMBASE_EXAMPLE_SCRIPTED") != "1":
        return None

    def pass_on(sent: str) -> str:  # the text sent ends with the latest tool result
        return sent.splitlines()[-1]

    def forget_what_was_found(sent: str) -> str | ToolCall:
        found = re.findall(r"\(id: ([^)]+)\)", sent.rpartition(words or "")[2])  # this turn's search, after the words
        return ToolCall("membase_forget", {"memory_id": found[0]}) if found else "I found nothing like that."

    if words is None:  # resumed with the person's answer
        return ScriptedModel([pass_on])
    if "forget" in words.lower():
        return ScriptedModel([ToolCall("membase_search", {"query": words, "limit": 1}), forget_what_was_found, pass_on])
    if "remember" in words.lower():
        return ScriptedModel([ToolCall("membase_save", {"content": words}), pass_on])
    return ScriptedModel([lambda sent: "Recalled: " + " | ".join(re.findall(r"<entry[^>]*>(.*?)</entry>", sent))])


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    # No capture: "please forget that ..." must not be saved as a note. The model saves with membase_save instead.
    app.state.pool = MembaseStorePool(membase_key, tools=("search", "save", "profile", "forget"))
    app.state.turns = {}  # user id -> asyncio.Lock: one turn at a time over a user's session
    try:
        yield
    finally:
        await app.state.pool.aclose()


app = FastAPI(lifespan=lifespan)


class Turn(BaseModel):
    text: str


class Answer(BaseModel):
    interrupt_id: str
    response: Any  # the person's answer as JSON: only true forgets


@app.post("/chat")
async def chat(turn: Turn, request: Request, x_user_id: str = Header()) -> dict[str, Any]:
    return await take_turn(request, x_user_id, turn.text)


@app.post("/answer")
async def answer(given: Answer, request: Request, x_user_id: str = Header()) -> dict[str, Any]:
    return await take_turn(request, x_user_id, None, given)


async def take_turn(request: Request, user_id: str, words: str | None, given: Answer | None = None) -> dict[str, Any]:
    try:
        store = request.app.state.pool.store_for(user_id)
    except ValueError:
        raise HTTPException(status_code=403, detail="no Membase key for this user") from None
    except RuntimeError:  # the pool is closing, or the user's local directory is another process's
        raise HTTPException(status_code=503, detail="this user's memory cannot be served here now") from None
    async with request.app.state.turns.setdefault(user_id, asyncio.Lock()):
        session = FileSessionManager(session_id=user_id, storage_dir=SESSIONS)
        memory = MemoryManager(stores=[store], search_tool_config=False, injection=injection_config())
        agent = Agent(model=new_model(words), memory_manager=memory, session_manager=session, callback_handler=None)
        waiting = agent.state.get(WAITING) or []
        if given is None and waiting:  # the question comes again, to be answered first
            raise HTTPException(status_code=409, detail={"error": "answer this question first", "interrupts": waiting})
        if given is not None and given.interrupt_id not in {interrupt["id"] for interrupt in waiting}:
            raise HTTPException(status_code=409, detail="no question with this id is waiting; nothing was forgotten")
        if given is None:
            result = await agent.invoke_async(words)
        else:  # Strands resumes the interrupted tool with the answer
            response = {"interruptId": given.interrupt_id, "response": given.response}
            result = await agent.invoke_async([{"interruptResponse": response}])
        interrupts = [{"id": i.id, "name": i.name, "reason": i.reason} for i in result.interrupts or []]
        agent.state.set(WAITING, interrupts)
        session.sync_agent(agent)  # the state changed after the turn's own save
    return {"reply": None if interrupts else str(result).strip(), "interrupts": interrupts}
