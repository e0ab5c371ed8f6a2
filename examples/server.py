"""A served agent with memory: FastAPI, one MembaseStorePool for all users, each user's turns captured.

    MEMBASE_KEY_alice=mbk_... uvicorn server:app --app-dir examples
    curl -H 'X-User-Id: alice' -H 'Content-Type: application/json' -d '{"text": "I like green tea."}' \
        http://127.0.0.1:8000/chat

Each user's own key is read from MEMBASE_KEY_<user id> (in production: your secrets manager or user database), or a
local Membase directory from MEMBASE_LOCAL_<user id>; MEMBASE_BASE_URL, if set, names the Membase host. A user with
neither is answered 403; one whose directory another process holds, 503. The model is Strands' default (Amazon
Bedrock: AWS credentials needed); MEMBASE_EXAMPLE_SCRIPTED=1 swaps in a scripted model that answers with what it
recalled (the tests do). Under gunicorn: gunicorn -k uvicorn.workers.UvicornWorker -w 2 --chdir examples server:app.
"""

import os
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Header, HTTPException, Request
from pydantic import BaseModel
from strands import Agent
from strands.memory import MemoryManager

from membase_strands import MembaseStorePool, injection_config
from membase_strands.testing import ScriptedModel


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


class Turn(BaseModel):
    text: str


@app.post("/chat")
async def chat(turn: Turn, request: Request, x_user_id: str = Header()) -> dict[str, str]:
    try:
        store = request.app.state.pool.store_for(x_user_id)
    except ValueError:
        raise HTTPException(status_code=403, detail="no Membase key for this user") from None
    except RuntimeError:  # the pool is closing, or the user's local directory is another process's
        raise HTTPException(status_code=503, detail="this user's memory cannot be served here now") from None
    memory = MemoryManager(stores=[store], search_tool_config=False, injection=injection_config())
    agent = Agent(model=new_model(), memory_manager=memory, callback_handler=None)
    try:
        result = await agent.invoke_async(turn.text)
    finally:
        await agent.shutdown_async()  # writes the captured words before the answer goes out (strands-agents 1.58+)
    return {"reply": str(result).strip()}


@app.get("/health")
async def health() -> dict[str, str]:
    return {"status": "ok"}
