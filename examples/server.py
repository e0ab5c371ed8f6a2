"""A served agent with memory: FastAPI, one MembaseStorePool for all users, each user's turns captured.

    MEMBASE_KEY_alice=mbk_... uvicorn server:app --app-dir examples
    curl -H 'X-User-Id: alice' -H 'Content-Type: application/json' -d '{"text": "I like green tea."}' \
        http://127.0.0.1:8000/chat

Each user's own key is read from MEMBASE_KEY_<user id> (in production: your secrets manager or user database), or a
local Membase directory from MEMBASE_LOCAL_<user id>; MEMBASE_BASE_URL, if set, names the Membase host. Every error is
{"error": {"code": ..., "message": ...}}, never a bare 500: a user with neither is answered 403 no_key; one whose
memory cannot be served (their directory is another process's, or MEMBASE_CONTAINER names no Memory of their key),
503 memory_unavailable; a body over 64 KiB, 413 too_large; malformed JSON, 422 malformed. The model is Strands'
default (Amazon Bedrock: AWS credentials needed); MEMBASE_EXAMPLE_SCRIPTED=1 swaps in a scripted model that answers
with what it recalled (the tests do). Under gunicorn: gunicorn -k uvicorn.workers.UvicornWorker -w 2 --chdir examples
server:app.
"""

import logging
import os
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from http import HTTPStatus
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Header, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from strands import Agent
from strands.memory import MemoryManager

from membase_strands import MembaseStorePool, injection_config
from membase_strands.testing import ScriptedModel

MAX_BODY = 64 * 1024  # a request body (a message) over 64 KiB is refused, before the agent runs


def membase_key(user_id: str) -> str | Path:
    if directory := os.environ.get(f"MEMBASE_LOCAL_{user_id}"):  # local Membase: a Path (one process per directory)
        return Path(directory)
    return os.environ[f"MEMBASE_KEY_{user_id}"]  # a user with no key is refused (403 below)


def new_model() -> ScriptedModel | None:
    if os.environ.get("MEMBASE_EXAMPLE_SCRIPTED") != "1":
        return None  # Strands' default model
    return ScriptedModel([lambda sent: "Noted. " + " | ".join(re.findall(r"<entry[^>]*>(.*?)</entry>", sent))])


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    # One pool for the process. Close it here: uvicorn re-raises SIGTERM after its shutdown, so atexit never runs.
    app.state.pool = MembaseStorePool(
        membase_key,
        capture=True,  # the manager writes each turn's user words to the user's Membase
        extraction=True,
        container=os.environ.get("MEMBASE_CONTAINER"),  # one Memory to write to; None: the key's only one
        write_timeout=float(os.environ.get("MEMBASE_WRITE_TIMEOUT", "5")),
    )
    try:
        yield
    finally:
        await app.state.pool.aclose()  # waits for writes still running, up to close_timeout (20 s)


app = FastAPI(lifespan=lifespan)


# --- Errors: every one is {"error": {"code": ..., "message": ...}} -------------------------------------------------


def refused(status: int, code: str, message: str) -> HTTPException:
    return HTTPException(status, detail={"code": code, "message": message})


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


class Problem(BaseModel):
    code: str
    message: str


class Error(BaseModel):
    error: Problem


ERRORS: dict[int | str, dict[str, Any]] = {
    403: {"model": Error, "description": "no_key: no Membase key for this user"},
    413: {"model": Error, "description": "too_large: a body over 64 KiB, refused before the agent runs"},
    422: {"model": Error, "description": "malformed: not JSON, a field missing or of the wrong type, no X-User-Id"},
    503: {"model": Error, "description": "memory_unavailable: this user's memory cannot be served here now"},
}


@app.post("/chat", responses=ERRORS)
async def chat(turn: Turn, request: Request, x_user_id: str = Header()) -> dict[str, str]:
    try:
        store = request.app.state.pool.store_for(x_user_id)
    except ValueError:
        raise refused(403, "no_key", "no Membase key for this user") from None
    except RuntimeError:  # the pool is closing, or the user's local directory is another process's
        raise refused(503, "memory_unavailable", "this user's memory cannot be served here now") from None
    memory = MemoryManager(stores=[store], search_tool_config=False, injection=injection_config())
    try:  # building the agent checks MEMBASE_CONTAINER against the Memories this user's key reaches
        agent = Agent(model=new_model(), memory_manager=memory, callback_handler=None)
    except ValueError as error:  # it names none of them (or several): the server's setting, not the user's doing
        logging.getLogger("uvicorn.error").warning("user %r: %s", x_user_id, error)
        raise refused(503, "memory_unavailable", "this user's memory cannot be served here now") from None
    try:
        result = await agent.invoke_async(turn.text)
    finally:
        await agent.shutdown_async()  # writes the captured words before the answer goes out (strands-agents 1.58+)
    return {"reply": str(result).strip()}


@app.get("/health")
async def health() -> dict[str, str]:
    return {"status": "ok"}
