"""Forget, approved over HTTP, with a chat page: a FastAPI app whose agents a Strands session manager keeps between
requests, so a turn that stopped to ask the person whether to forget resumes when their answer comes in a later request.

    MEMBASE_KEY_alice=mbk_... uvicorn forget_server:app --app-dir examples      then open http://127.0.0.1:8000/
    POST /chat    {"text": "Please forget that the launch is in May."}
        -> {"reply": null, "interrupts": [{"id": "...", "name": "membase_forget", "reason": {"memory_id": ...}}]}
    POST /answer  {"interrupt_id": "...", "response": true}        (only a JSON true forgets)
        -> {"reply": "Forgotten, with the user's approval: ...", "interrupts": []}
    GET /questions  -> {"interrupts": [...]}: the questions still waiting for the person (after a page reload, say)
    GET /           the chat page (forget_chat.html, beside this file)

Every error is {"error": {"code": ..., "message": ...}}: 403 no_key, 409 question_waiting (with the question's
"interrupts") or no_such_question, 413 too_large (a body over 64 KiB, refused before it is read whole), 422
malformed, 503 memory_unavailable. X-User-Id names the user, whose key is MEMBASE_KEY_<user id> (or local Membase
directory, MEMBASE_LOCAL_<user id>); MEMBASE_BASE_URL, if set, names the Membase host. Each user's conversation, and
the question waiting for their answer, are files in MEMBASE_EXAMPLE_SESSIONS (by default a directory in the system's
temporary directory). Several workers need one shared directory (or a shared session store, such as Strands'
S3SessionManager) and a user's requests one at a time, as a chat sends them. The model is Strands' default (Amazon
Bedrock: AWS credentials needed); MEMBASE_EXAMPLE_SCRIPTED=1 swaps in a scripted one (the tests do).
"""

import asyncio
import os
import re
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from http import HTTPStatus
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Header, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from strands import Agent
from strands.memory import MemoryManager
from strands.session import FileSessionManager

from membase_strands import MembaseStorePool, injection_config
from membase_strands.testing import ScriptedModel, ToolCall

SESSIONS = os.environ.get("MEMBASE_EXAMPLE_SESSIONS") or os.path.join(tempfile.gettempdir(), "membase-sessions")
WAITING = "waiting_for_answer"  # in the agent's state (kept by the session): the questions the person must answer
MAX_BODY = 64 * 1024  # a request body (a message) over 64 KiB is refused, before the agent runs


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


# --- Errors: every one is {"error": {"code": ..., "message": ...}} -------------------------------------------------


def refused(status: int, code: str, message: str, **more: Any) -> HTTPException:
    return HTTPException(status, detail={"code": code, "message": message, **more})


@app.exception_handler(StarletteHTTPException)  # ours (refused) and FastAPI's own (404 no such route, 405, ...)
async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
    phrase = HTTPStatus(error.status_code).phrase.lower().replace(" ", "_")
    said = error.detail if isinstance(error.detail, dict) else {"code": phrase, "message": str(error.detail)}
    return JSONResponse({"error": said}, status_code=error.status_code, headers=error.headers)


@app.exception_handler(RequestValidationError)  # not JSON, a field missing or of the wrong type, no X-User-Id
async def malformed(request: Request, error: RequestValidationError) -> JSONResponse:
    where = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in error.errors())
    return JSONResponse({"error": {"code": "malformed", "message": where}}, status_code=422)


@app.exception_handler(Exception)  # anything else (the model's service failed, say): logged with its traceback
async def failed(request: Request, error: Exception) -> JSONResponse:
    return JSONResponse({"error": {"code": "internal_error", "message": "the server failed; see its log"}}, 500)


class BodyLimit:
    """Refuses a body over MAX_BODY with a 413 when the app reads it: at once if its Content-Length says so, else as
    soon as that much has come. Nothing past it is read into memory, and the agent never runs."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        declared = int(dict(scope.get("headers", [])).get(b"content-length", 0))
        received = 0

        async def receive_at_most() -> Message:
            nonlocal received
            if declared <= MAX_BODY and received <= MAX_BODY:
                message = await receive()
                received += len(message.get("body", b""))
                if received <= MAX_BODY:
                    return message
            raise refused(413, "too_large", f"a message is at most {MAX_BODY // 1024} KiB")

        await self.app(scope, receive_at_most, send)


app.add_middleware(BodyLimit)


# --- The routes ----------------------------------------------------------------------------------------------------


class Turn(BaseModel):
    text: str


class Answer(BaseModel):
    interrupt_id: str
    response: Any  # the person's answer as JSON: only true forgets


class Question(BaseModel):
    id: str
    name: str  # "membase_forget"
    reason: dict[str, Any]  # memory_id, content (the passage), memory (its Memory's name), how (Membase's words)


class Waiting(BaseModel):
    interrupts: list[Question]  # the questions waiting for the person's answer


class Reply(Waiting):
    reply: str | None  # None while a question waits


class Problem(BaseModel):
    code: str
    message: str
    interrupts: list[Question] | None = None  # with question_waiting: the question to answer first


class Error(BaseModel):
    error: Problem


ERRORS: dict[int | str, dict[str, Any]] = {
    403: {"model": Error, "description": "no_key: no Membase key for this user"},
    409: {"model": Error, "description": "question_waiting: answer it first; no_such_question: nothing forgotten"},
    413: {"model": Error, "description": "too_large: a body over 64 KiB, refused before the agent runs"},
    422: {"model": Error, "description": "malformed: not JSON, a field missing or of the wrong type, no X-User-Id"},
    503: {"model": Error, "description": "memory_unavailable: this user's memory cannot be served here now"},
}


@app.get("/", include_in_schema=False)
async def page() -> FileResponse:
    return FileResponse(Path(__file__).with_name("forget_chat.html"))  # plain HTML and JavaScript, beside this file


@app.post("/chat", responses=ERRORS)
async def chat(turn: Turn, request: Request, x_user_id: str = Header()) -> Reply:
    return await take_turn(request, x_user_id, turn.text)


@app.post("/answer", responses=ERRORS)
async def answer(given: Answer, request: Request, x_user_id: str = Header()) -> Reply:
    return await take_turn(request, x_user_id, None, given)


@app.get("/questions", responses={status: ERRORS[status] for status in (403, 422, 503)})
async def questions(request: Request, x_user_id: str = Header()) -> Waiting:
    async with request.app.state.turns.setdefault(x_user_id, asyncio.Lock()):
        agent, _ = open_agent(request, x_user_id, None)
        return Waiting(interrupts=agent.state.get(WAITING) or [])


def open_agent(request: Request, user_id: str, words: str | None) -> tuple[Agent, FileSessionManager]:
    """The user's agent as their session left it."""
    try:
        store = request.app.state.pool.store_for(user_id)
    except ValueError:
        raise refused(403, "no_key", "no Membase key for this user") from None
    except RuntimeError:  # the pool is closing, or the user's local directory is another process's
        raise refused(503, "memory_unavailable", "this user's memory cannot be served here now") from None
    session = FileSessionManager(session_id=user_id, storage_dir=SESSIONS)
    memory = MemoryManager(stores=[store], search_tool_config=False, injection=injection_config())
    agent = Agent(model=new_model(words), memory_manager=memory, session_manager=session, callback_handler=None)
    return agent, session


async def take_turn(request: Request, user_id: str, words: str | None, given: Answer | None = None) -> Reply:
    async with request.app.state.turns.setdefault(user_id, asyncio.Lock()):
        agent, session = open_agent(request, user_id, words)
        waiting = agent.state.get(WAITING) or []
        if given is None and waiting:  # the question comes again, to be answered first
            raise refused(409, "question_waiting", "answer the waiting question first", interrupts=waiting)
        if given is not None and given.interrupt_id not in {interrupt["id"] for interrupt in waiting}:
            raise refused(409, "no_such_question", "no question with this id is waiting; nothing was forgotten")
        if given is None:
            result = await agent.invoke_async(words)
        else:  # Strands resumes the interrupted tool with the answer
            response = {"interruptId": given.interrupt_id, "response": given.response}
            result = await agent.invoke_async([{"interruptResponse": response}])
        interrupts = [{"id": i.id, "name": i.name, "reason": i.reason} for i in result.interrupts or []]
        agent.state.set(WAITING, interrupts)
        session.sync_agent(agent)  # the state changed after the turn's own save
    return Reply(reply=None if interrupts else str(result).strip(), interrupts=interrupts)
