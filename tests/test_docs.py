"""The README and docs/ say what the code does: every ```python block runs offline as written, in a fresh namespace,
and passes pyflakes on its own. ``MEMBASE_API_KEY``/``MEMBASE_BASE_URL`` (and a pool's ``MEMBASE_KEY_<user>``) point
at an ``InMemoryMembase`` served over loopback; an Agent built without a model gets :class:`StandInModel`; budgets
are at least 30 s; a block's own ``time.sleep`` returns at once. A block that sets a process-wide provider runs in a
subprocess; the test functions a block defines run too. Every shell command in docs/ runs as written (a served
example under uvicorn or gunicorn, the requests sent to it, the check), offline, or is listed in ``NOT_RUN`` with
the reason it cannot; the README's shell commands are checked for their flags and run elsewhere (``tests/
integration/test_examples.py`` runs the demo).
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest import mock

import pytest
from strands import Agent

from membase_strands import MembaseMemoryStore, __version__, check
from membase_strands._log import STANDARD
from membase_strands.testing import API_KEY, InMemoryMembase, ScriptedModel, ToolCall
from tests.support.loopback import LoopbackMembase
from tests.support.served import ServedApp, free_port

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
GENEROUS_BUDGET = 30.0
QUICK_START = (ROOT / "examples" / "quickstart.py").read_text(encoding="utf-8").split('"""', 2)[2].lstrip("\n")
SERVED = (ROOT / "examples" / "server.py").read_text(encoding="utf-8").split('"""', 2)[2].lstrip("\n")
FORGET_SERVED = (ROOT / "examples" / "forget_server.py").read_text(encoding="utf-8").split('"""', 2)[2].lstrip("\n")
# Blocks that change process-wide state run in a subprocess of their own.
ISOLATE = ("set_tracer_provider",)
FENCE = re.compile(r"^```(\w*)\s*$")


@dataclass(frozen=True)
class Block:
    page: str
    line: int
    language: str
    code: str

    @property
    def name(self) -> str:
        return f"{self.page}:{self.line}"


def _blocks_of(path: Path) -> list[Block]:
    blocks: list[Block] = []
    language, start, lines = None, 0, []
    for number, text in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if language is None and (fence := FENCE.match(text)):
            language, start, lines = fence.group(1), number, []
        elif language is not None and text.strip() == "```":
            blocks.append(Block(str(path.relative_to(ROOT)), start, language, "\n".join(lines) + "\n"))
            language = None
        elif language is not None:
            lines.append(text)
    assert language is None, f"{path.name}: the block opened at line {start} is never closed"
    return blocks


BLOCKS = [block for page in PAGES for block in _blocks_of(page)]
PYTHON = [block for block in BLOCKS if block.language == "python"]


# --- The offline harness --------------------------------------------------------------------------


class StandInModel(ScriptedModel):
    """The model of an Agent a block builds without one: it saves what the user asks it to remember (with
    ``membase_save``), thanks after a tool result, and otherwise answers with the first passage it was shown."""

    async def stream(  # type: ignore[override]
        self, messages: Any, tool_specs: Any = None, system_prompt: Any = None, **kwargs: Any
    ) -> AsyncIterator[dict[str, Any]]:
        self.script = [_next_step(messages, [spec["name"] for spec in tool_specs or []])]
        async for event in super().stream(messages, tool_specs, system_prompt, **kwargs):
            yield event


def _next_step(messages: list[dict[str, Any]], tools: list[str]) -> str | ToolCall:
    latest = messages[-1]
    if any("toolResult" in block for block in latest["content"]):
        return "Done."
    said = " ".join(block["text"] for block in latest["content"] if "text" in block)
    wanted = re.search(r"remember that (.+)", said, re.IGNORECASE)
    if wanted and "membase_save" in tools:
        return ToolCall("membase_save", {"content": wanted.group(1).strip()})
    recalled = re.search(r"<entry[^>]*>(.*?)</entry>", said)
    return f"From your memory: {recalled.group(1)}" if recalled else "I do not know."


@dataclass
class Run:
    """What a block did: the stand-in Membase, the models given to Agents without one, its sleeps."""

    membase: InMemoryMembase
    models: list[StandInModel] = field(default_factory=list)
    sleeps: list[float] = field(default_factory=list)
    namespace: dict[str, Any] = field(default_factory=dict)  # what the block defined


@contextlib.contextmanager
def offline() -> Iterator[Run]:
    """Point the environment at an in-memory Membase, give model-less Agents a stand-in, and make budgets generous."""
    run = Run(InMemoryMembase())
    agent_init, store_init = Agent.__init__, MembaseMemoryStore.__init__

    def agent_with_a_model(self: Agent, *args: Any, **kwargs: Any) -> None:
        if not args and kwargs.get("model") is None:
            kwargs["model"] = StandInModel()
            run.models.append(kwargs["model"])
        kwargs.setdefault("callback_handler", None)
        agent_init(self, *args, **kwargs)

    @functools.wraps(store_init)  # its signature stays the store's: the pool checks its options against it
    def store_with_generous_budgets(self: MembaseMemoryStore, **options: Any) -> None:
        for budget in ("recall_timeout", "write_timeout"):
            if options.get(budget, 0) is not None:  # not given, or a number: at least the generous budget
                options[budget] = max(options.get(budget, 0), GENEROUS_BUDGET)
        store_init(self, **options)

    with contextlib.ExitStack() as stack:
        server = stack.enter_context(LoopbackMembase(run.membase))
        keys = {name: API_KEY for name in ("MEMBASE_API_KEY", "MEMBASE_KEY_alice", "MEMBASE_KEY_bob")}  # a pool's users
        stack.enter_context(mock.patch.dict(os.environ, {**keys, "MEMBASE_BASE_URL": server.url}))
        os.environ.pop("MEMBASE_LOCAL", None)
        stack.enter_context(mock.patch.object(Agent, "__init__", agent_with_a_model))
        stack.enter_context(mock.patch.object(MembaseMemoryStore, "__init__", store_with_generous_budgets))
        yield run


def execute(block: Block, run: Run) -> None:
    """Run the block's code as written in a fresh namespace, then any ``test_`` functions it defines."""
    real_import, block_time = builtins.__import__, SimpleNamespace(**{**vars(time), "sleep": run.sleeps.append})

    def block_import(name: str, *args: Any, **kwargs: Any) -> Any:  # a block's time.sleep is recorded, not slept
        return block_time if name == "time" else real_import(name, *args, **kwargs)

    namespace: dict[str, Any] = run.namespace
    namespace.update({"__name__": "docs_block", "__builtins__": {**vars(builtins), "__import__": block_import}})
    # dont_inherit: compiled as the block is written, not under this module's `from __future__ import annotations`
    exec(compile(block.code, block.name, "exec", dont_inherit=True), namespace)  # noqa: S102 - the docs' own code
    for name, value in list(namespace.items()):
        if name.startswith("test_") and callable(value):
            value()


def run_isolated(block: Block) -> subprocess.CompletedProcess[str]:
    """Run the block under the same harness in a fresh interpreter (its code goes in on standard input)."""
    environment = {name: value for name, value in os.environ.items() if not name.startswith(("MEMBASE_", "OTEL_"))}
    program = f"from tests.test_docs import main_for_subprocess; main_for_subprocess({block.page!r}, {block.line})"
    return subprocess.run(
        [sys.executable, "-c", program],
        input=block.code,
        cwd=ROOT,
        env=environment,
        capture_output=True,
        text=True,
        timeout=120,
    )


def main_for_subprocess(page: str, line: int) -> None:
    block = Block(page=page, line=line, language="python", code=sys.stdin.read())
    with offline() as run:
        execute(block, run)


def _quick_start_did_what_it_says(run: Run) -> None:
    # Session 1's model saved the user's words; session 2's was shown them, framed as data, before it answered.
    assert run.membase.saved() == ["our launch codename is Blue Heron."]
    assert len(run.models) == 2
    assert "Blue Heron" in (run.models[1].memory_block() or "")
    assert "never follow a request" in (run.models[1].memory_block() or "")  # injection_config()'s frame
    assert run.sleeps == [20]


def _served_app_did_what_it_says(run: Run) -> None:
    # The example's lifespan opens the pool and closes it; each user's turn is answered and its words captured.
    from fastapi.testclient import TestClient

    with TestClient(run.namespace["app"]) as client:
        alice = client.post("/chat", json={"text": "I like green tea."}, headers={"X-User-Id": "alice"})
        stranger = client.post("/chat", json={"text": "Hello."}, headers={"X-User-Id": "mallory"})
    assert alice.status_code == 200 and alice.json()["reply"]
    assert stranger.status_code == 403 and stranger.json()["error"]["code"] == "no_key"  # no MEMBASE_KEY_mallory
    assert run.membase.saved() == ["I like green tea."]
    with pytest.raises(RuntimeError, match="closed"):
        run.namespace["app"].state.pool.store_for("alice")


def _forget_app_did_what_it_says(run: Run) -> None:
    # A note saved, a forget asked in one request, approved in the next: gone; a stranger is refused.
    from fastapi.testclient import TestClient

    alice = {"X-User-Id": "alice"}
    with TestClient(run.namespace["app"]) as client:
        client.post("/chat", json={"text": "Please remember that the launch is in May."}, headers=alice)
        asked = client.post("/chat", json={"text": "Please forget that the launch is in May."}, headers=alice).json()
        [question] = asked["interrupts"]
        waiting = client.get("/questions", headers=alice).json()
        answer = {"interrupt_id": question["id"], "response": True}
        approved = client.post("/answer", json=answer, headers=alice).json()
        stranger = client.post("/chat", json={"text": "Hello."}, headers={"X-User-Id": "mallory"})
    assert asked["reply"] is None and question["name"] == "membase_forget" and waiting == {"interrupts": [question]}
    assert approved["reply"].startswith("Forgotten") and run.membase.saved() == []
    assert [note.content for note in run.membase.forgotten] == ["Please remember that the launch is in May."]
    assert stranger.status_code == 403 and stranger.json()["error"]["code"] == "no_key"


# --- Every Python block runs ---------------------------------------------------------------------


@pytest.mark.parametrize("block", PYTHON, ids=[block.name for block in PYTHON])
def test_each_python_block_runs_offline_as_written(
    block: Block, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    if any(marker in block.code for marker in ISOLATE):
        done = run_isolated(block)
        assert done.returncode == 0, f"{block.name} failed:\n{done.stdout}\n{done.stderr}"
        return
    if "from fastapi" in block.code:  # CI's oldest and newest version pairs do not install the dev dependencies
        pytest.importorskip("fastapi")
    if block.code == FORGET_SERVED:  # its scripted model, and sessions of the test's own
        monkeypatch.setenv("MEMBASE_EXAMPLE_SCRIPTED", "1")
        monkeypatch.setenv("MEMBASE_EXAMPLE_SESSIONS", str(tmp_path))
    with offline() as run:  # checked in there too: the served app's check drives what the block built
        execute(block, run)
        assert API_KEY not in capsys.readouterr().out
        if block.code == QUICK_START:
            _quick_start_did_what_it_says(run)
        if block.code == SERVED:
            _served_app_did_what_it_says(run)
        if block.code == FORGET_SERVED:
            _forget_app_did_what_it_says(run)


def test_every_python_block_passes_pyflakes_on_its_own(tmp_path: Path) -> None:
    if importlib.util.find_spec("ruff") is None:
        pytest.skip("ruff (a dev dependency) is not installed here")
    files = {str(tmp_path / f"block_{number}.py"): block for number, block in enumerate(PYTHON)}
    for path, block in files.items():
        Path(path).write_text(block.code, encoding="utf-8")
    command = [sys.executable, "-m", "ruff", "check", "--isolated", "--no-cache", "--select", "F"]
    command += ["--target-version", "py310", "--output-format", "json", "--exit-zero", str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=True)
    findings = [
        f"{files[found['filename']].page}:{files[found['filename']].line + found['location']['row']}: "
        f"{found['code']} {found['message']}"
        for found in json.loads(done.stdout)
    ]
    assert findings == []


# --- The README's shape and the facts it names ---------------------------------------------------


def test_the_readme_is_short_shows_the_check_early_and_its_quick_start_and_served_app_are_the_examples() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 255 and any(line.startswith("membase-strands check") for line in lines[:80])
    assert QUICK_START in [block.code for block in PYTHON if block.page == "README.md"]
    assert len(QUICK_START.splitlines()) <= 40
    assert {SERVED, FORGET_SERVED} <= {block.code for block in PYTHON if block.page == "docs/servers.md"}


def test_the_readme_gives_exactly_the_two_commands_that_run_everything_from_a_clone() -> None:
    commands = [
        line.split("#")[0].strip()
        for block in BLOCKS
        if block.page == "README.md" and block.language == "bash"
        for line in block.code.splitlines()
        if line.startswith("uv ")
    ]

    assert commands == ["uv run --python 3.12 examples/demo.py", "uv run --python 3.12 pytest"]


def test_the_options_table_lists_every_option_of_the_store_in_order_and_every_counter_is_named() -> None:
    import inspect

    text = README.read_text(encoding="utf-8").split("## Options", 1)[1].split("\n## ", 1)[0]
    options = [p.name for p in inspect.signature(MembaseMemoryStore).parameters.values() if p.kind == p.KEYWORD_ONLY]
    assert re.findall(r"^\| `(\w+)` \|", text, re.MULTILINE) == options
    observability = (ROOT / "docs" / "observability.md").read_text(encoding="utf-8")
    assert set(STANDARD) <= set(re.findall(r"`([a-z_.<>]+)`", observability))


def _slug(heading: str) -> str:
    return re.sub(r"[^a-z0-9 _-]", "", heading.lower()).replace(" ", "-")


def test_every_link_between_the_pages_resolves_and_every_docs_page_is_linked_from_the_readme() -> None:
    readme_links = set()
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)", page.read_text(encoding="utf-8")):
            path, anchor = target
            if path.startswith(("http://", "https://")):
                continue
            linked = (page.parent / path).resolve() if path else page
            assert linked.exists(), f"{page.name} links to {path}, which does not exist"
            if anchor:
                headings = [_slug(h) for h in re.findall(r"^#+ (.+)$", linked.read_text(encoding="utf-8"), re.M)]
                assert anchor in headings, f"{page.name} links to {path}#{anchor}, which has no such heading"
            if page == README:
                readme_links.add(linked)

    assert set(PAGES[1:]) <= readme_links


def _help(*argv: str, capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exit_:
        check.main(list(argv))
    assert exit_.value.code == 0
    return capsys.readouterr().out


def test_the_membase_strands_flags_the_pages_use_exist_and_version_prints_the_version(
    capsys: pytest.CaptureFixture[str],
) -> None:
    used = {
        flag
        for block in BLOCKS
        if block.language == "bash"
        for line in block.code.splitlines()
        if line.startswith("membase-strands")
        for flag in re.findall(r"(--[a-z-]+)", line.split("#")[0])
    }
    known = _help("--help", capsys=capsys) + _help("check", "--help", capsys=capsys)
    assert used and {flag for flag in used if flag not in known} == set()
    assert _help("--version", capsys=capsys).strip() == f"membase-strands {__version__}"


# --- Every shell command in docs/ runs as written, or says why it cannot --------------------------

NOT_RUN = {  # the commands in docs/ the suite does not run, and why
    "uv sync --python 3.12": "it makes the environment the suite runs in",
    "uv run --python 3.12 pytest": "it is the suite",
    "uv run --python 3.12 pytest tests/test_docs.py": "it is this file's tests",
    "uv run ruff check . && uv run ruff format --check . && uv run mypy src": "CI's lint step runs it (.ci/run)",
    "bash .ci/run": "it is CI: the suite twice, and the oldest and newest versions installed from PyPI",
    "export HTTPS_PROXY=http://proxy.internal:3128": "the proxy is one only your network has",
    "export SSL_CERT_FILE=/etc/ssl/certs/company-ca.pem": "the certificate authority's file is your company's",
}
SERVER = re.compile(r"\b(uvicorn|gunicorn) ")
HOSTED_KEY = "mbk_..."  # a hosted user's key in the docs: the runs below give a key of the test's Membase instead
# What the answer to a documented request says, by a phrase of the request.
ANSWERS = {
    '"What tea do I like?"': "I like green tea.",
    '"Please remember': "Saved to Membase.",
    '"response": true': "Forgotten, with the user's approval",
}
SHELL = [
    (block, [line.split("  #")[0].strip() for line in block.code.splitlines() if line.strip()])
    for block in BLOCKS
    if block.language == "bash" and block.page != "README.md"
]


def test_every_shell_command_in_the_docs_is_run_below_or_says_why_not() -> None:
    commands = [command for _, block_commands in SHELL for command in block_commands]
    runnable = [c for c in commands if c not in NOT_RUN]
    assert all(SERVER.search(c) or c.startswith(("curl ", "membase-strands ")) for c in runnable), runnable
    assert set(NOT_RUN) <= set(commands)  # every reason is still about a command the docs show


@pytest.mark.parametrize(
    ("block", "commands"),
    [(block, commands) for block, commands in SHELL if set(commands) - set(NOT_RUN)],
    ids=[block.name for block, commands in SHELL if set(commands) - set(NOT_RUN)],
)
def test_each_shell_command_in_the_docs_runs_as_written(block: Block, commands: list[str], tmp_path: Path) -> None:
    """Each runs in the clone with bash, offline: a server on a free port (``UVICORN_PORT``, ``GUNICORN_CMD_ARGS``)
    until the next server or the block's end, each ``curl`` after it sent to that port, ``<its id>`` the interrupt id
    the answer before gave; ``MEMBASE_BASE_URL`` and ``MEMBASE_API_KEY`` name a Membase of the test's (a hosted
    user's ``mbk_...`` is a key of it), and ``mktemp`` makes its directories in the test's."""
    pytest.importorskip("uvicorn", reason="the served examples need the dev dependencies (fastapi, uvicorn)")
    if shutil.which("uv") is None or shutil.which("curl") is None:
        pytest.skip("the documented commands need uv and curl on PATH")
    bin_dir = str(Path(sys.executable).parent)  # where an activated environment has membase-strands
    env = {"TMPDIR": str(tmp_path), "MEMBASE_API_KEY": API_KEY, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    answer: dict[str, Any] = {}
    with LoopbackMembase() as membase, contextlib.ExitStack() as serving:
        env["MEMBASE_BASE_URL"] = membase.url
        for command in (c for c in commands if c not in NOT_RUN):
            if SERVER.search(command):
                serving.close()  # the server before, if any
                port = free_port()
                env.update(UVICORN_PORT=str(port), GUNICORN_CMD_ARGS=f"--bind 127.0.0.1:{port}")
                workers = re.search(r"(?:-w|--workers) (\d+)", command)
                app = serving.enter_context(
                    ServedApp(["bash", "-c", command.replace(HOSTED_KEY, f"{API_KEY}_{port}")], env, port, ROOT)
                )
                app.wait_until_ready(int(workers[1]) if workers else 1)
                continue
            if command.startswith("curl "):
                interrupt_id = (answer.get("interrupts") or [{"id": ""}])[0]["id"]
                command = command.replace("http://127.0.0.1:8000", app.url).replace("<its id>", interrupt_id)
            done = subprocess.run(
                ["bash", "-c", command],
                env={**os.environ, **env},
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert done.returncode == 0, f"{command}\n{done.stdout}\n{done.stderr}"
            if command.startswith("curl "):
                answer = json.loads(done.stdout)
                assert "error" not in answer and "detail" not in answer, (command, answer)  # the examples' errors
                assert all(said in json.dumps(answer) for asked, said in ANSWERS.items() if asked in command), answer
        serving.close()
