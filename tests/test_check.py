"""The set-up check: ``run_check`` and ``membase-strands check``, from a key, against the fake Membase served over
loopback (the production path: ``MEMBASE_BASE_URL`` names the server). What the report says is checked on
``run_check``; the command line is checked for its exit codes, flags and environment. Local Membase's check (a real
save and search by the engine) is in ``tests/integration/test_local_directory.py``.
"""

from __future__ import annotations

import json
import re
import runpy
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

import membase_strands
from membase_strands import check
from membase_strands.testing import API_KEY, InMemoryMembase, status
from tests.support.loopback import LoopbackMembase, stall
from tests.support.store_helpers import sdk_client

CLI_KEY = "mb_cli_key_Zq8_n3ver_printed"
TWO_MEMORIES = [{"id": "ctr_main", "name": "Main"}, {"id": "ctr_work", "name": "Work"}]
ALL_ROUTES = [("GET", "/v1/containers"), ("POST", "/v1/search"), ("GET", "/v1/profile"), ("POST", "/v1/memories")]


@pytest.fixture
def server() -> Iterator[LoopbackMembase]:
    with LoopbackMembase() as served:
        yield served


def run_check(server: LoopbackMembase, **options: Any) -> check.CheckReport:
    return check.run_check(api_key=API_KEY, base_url=server.url, **options)


def steps(report: check.CheckReport) -> dict[str, check.Step]:
    return {step.name: step for step in report.steps}


def failed(report: check.CheckReport) -> list[str]:
    return [step.name for step in report.steps if step.required and not step.ok]


def failed_lines(out: str) -> list[str]:
    return re.findall(r"^  \[FAIL\] ([^:]+):", out, re.MULTILINE)


def closed_port() -> str:
    """A loopback URL nothing listens on: a connection is refused at once, and nothing leaves the machine."""
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{free.getsockname()[1]}"


# --- run_check -------------------------------------------------------------------------------------


def test_everything_working_is_ok_searches_once_and_saves_nothing(server):
    fake = server.fake
    fake.containers = list(TWO_MEMORIES)
    fake.remember("We chose Postgres for the ledger.")
    before = list(fake.notes)

    report = run_check(server)

    assert report.ok and report.target == server.url and report.memories == ["Main", "Work"]
    assert [step.name for step in report.steps] == ["reach", "key", "memories in reach", "search", "profile", "save"]
    assert all(step.ok for step in report.steps)
    assert report.search_seconds is not None and f"{report.search_seconds:.2f} s" in steps(report)["search"].detail
    assert len(fake.sent("POST", "/v1/search")) == 1
    # The save probe names a Memory, so a 400 is about the empty note, not about which Memory was meant.
    assert [r.body["content"] for r in fake.sent("POST", "/v1/memories")] == [""]
    assert fake.sent("POST", "/v1/memories")[0].body["container"] == "ctr_main"
    assert fake.notes == before and fake.standing == []


def test_a_ready_client_is_checked_as_it_is_and_left_open(fake: InMemoryMembase):
    client = sdk_client(fake)

    report = check.run_check(client=client)

    assert report.ok and report.target == fake.base_url
    assert client.containers.list()["containers"] == fake.containers  # the check did not close it


def test_the_key_never_appears_in_the_report(server):
    def echo_key(request: httpx.Request) -> httpx.Response:
        return httpx.Response(400, json={"error": {"message": f"{'.' * 280} {API_KEY} {API_KEY[:12]}"}})

    for broken in (None, "GET /v1/containers", "POST /v1/search"):
        server.fake.heal()
        if broken is not None:
            server.fake.always(*broken.split(), echo_key)

        report = run_check(server)

        assert report.ok is (broken is None)
        for text in (report.to_text(), json.dumps(report.to_dict())):
            assert not any(API_KEY[start : start + 8] in text for start in range(len(API_KEY) - 7)), broken


# --- membase-strands check -----------------------------------------------------------------------


@pytest.fixture
def account(server: LoopbackMembase, monkeypatch: pytest.MonkeyPatch) -> InMemoryMembase:
    """The CLI key's account on the server; ``MEMBASE_API_KEY`` and ``MEMBASE_BASE_URL`` name them."""
    monkeypatch.delenv("MEMBASE_LOCAL", raising=False)
    monkeypatch.setenv("MEMBASE_API_KEY", CLI_KEY)
    monkeypatch.setenv("MEMBASE_BASE_URL", server.url)
    return server.fake.account(CLI_KEY)


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    code = check.main(["check", *args])
    out, err = capsys.readouterr()
    assert CLI_KEY not in out + err
    return code, out


def refuse(*routes: tuple[str, str]) -> Callable[[InMemoryMembase], None]:
    def setup(account: InMemoryMembase) -> None:
        for route in routes:
            account.always(*route, status(403))

    return setup


REFUSED, AS_IT_IS = refuse(("GET", "/v1/profile"), ("POST", "/v1/memories")), refuse()
# name -> (set-up, run_check options, the command's flags, the steps that fail, what both say)
SCENARIOS: dict[str, tuple[Callable[[InMemoryMembase], None], dict[str, Any], list[str], list[str], list[str]]] = {
    "working": (AS_IT_IS, {}, [], [], ["Main, Work", "Everything needed works."]),
    "key-refused": (
        refuse(*ALL_ROUTES),
        {},
        [],
        ["key"],
        ["[  ok] reach", "[FAIL] key", "403", "the key in MEMBASE_API_KEY", "Connect > Developer keys"],
    ),
    "profile-save-refused": (REFUSED, {}, [], ["profile", "save"], ["may not read the profile", "may not save"]),
    "save-refused": (REFUSED, {"need_profile": False}, ["--no-profile"], ["save"], ["[note] profile", "may not save"]),
    "not-needed": (
        REFUSED,
        {"need_profile": False, "need_save": False},
        ["--no-profile", "--read-only"],
        [],
        ["[note] profile", "[note] save"],
    ),
    "unknown-memory": (
        AS_IT_IS,
        {"container": "Journal"},
        ["--container", "Journal"],
        ["container"],
        ["Journal", "'Main'", "'Work'"],
    ),
    "pinned-memory": (AS_IT_IS, {"container": "work"}, ["--container", "work"], [], ["ctr_work"]),
    "search-fails": (lambda fake: fake.always("POST", "/v1/search", status(422)), {}, [], ["search"], ["cannot run"]),
}


@pytest.mark.parametrize(("setup", "options", "flags", "failing", "said"), SCENARIOS.values(), ids=list(SCENARIOS))
def test_the_report_and_the_command_say_the_same_and_exit_0_only_when_everything_needed_works(
    account, capsys, setup, options, flags, failing, said
):
    account.containers = list(TWO_MEMORIES)
    setup(account)

    report = check.run_check(**options)  # the key and host from MEMBASE_API_KEY and MEMBASE_BASE_URL
    code, out = cli(capsys, *flags)
    json_code, json_out = cli(capsys, *flags, "--json")

    assert failed(report) == failing and code == json_code == (1 if failing else 0)
    assert all(words in report.to_text() and words in out for words in said), (report.to_text(), out)
    ending = "Something needed does not work: see FAIL above." if failing else "Everything needed works."
    assert report.to_text().rstrip().endswith(ending) and out.rstrip().endswith(ending)
    data = json.loads(json_out)
    assert data["ok"] is report.ok and data["memories"] == report.memories
    assert all(steps(report)[name].required is False for name in ("profile", "save") if f"need_{name}" in options)
    assert [(step["name"], step["ok"]) for step in data["steps"]] == [(step.name, step.ok) for step in report.steps]
    assert all({"name", "ok", "detail", "required"} <= set(step) for step in data["steps"])
    assert {r.key for r in account.requests} == {CLI_KEY} and account.notes == [] and account.standing == []
    if failing == ["key"]:
        assert len(account.sent()) == 3  # one request per run: a refused key is not retried, nor asked more
    elif not failing:
        assert report.memories == ["Main", "Work"] and isinstance(data["search_seconds"], float)
    if options.get("container") == "work":
        sent = account.sent("POST", "/v1/search") + account.sent("POST", "/v1/memories")
        assert {r.body["container"] for r in sent} == {"ctr_work"}


def test_the_command_takes_the_key_and_host_from_its_flags_before_the_environment(account, server, capsys, monkeypatch):
    monkeypatch.delenv("MEMBASE_API_KEY")
    code, out = cli(capsys)
    assert code == 1 and "[FAIL] configuration" in out and "MEMBASE_API_KEY" in out
    assert failed(check.run_check()) == ["configuration"]

    assert cli(capsys, "--api-key", CLI_KEY)[0] == 0
    assert {r.key for r in account.requests} == {CLI_KEY}

    sent, elsewhere = len(account.requests), closed_port()
    code, out = cli(capsys, "--api-key", CLI_KEY, "--base-url", elsewhere)
    assert code == 1 and elsewhere in out and "Check the host in --base-url and the network." in out
    assert "MEMBASE_BASE_URL" not in out  # the flag named the host, not the variable
    assert len(account.requests) == sent  # the flag's host was tried, not MEMBASE_BASE_URL's


def test_the_command_speaks_in_its_flags_and_run_check_in_its_keywords(account, server, capsys, monkeypatch):
    monkeypatch.delenv("MEMBASE_API_KEY")
    told = {
        "no key": ([], {}, "pass --api-key, set MEMBASE_API_KEY, or pass --local DIR", "pass api_key=, set"),
        "a short key": (["--api-key", "k"], {"api_key": "k"}, "--api-key: the value is too short", "api_key: the"),
        "a bad host": (["--base-url", "ftp://x"], {"base_url": "ftp://x"}, "check --base-url or", "check base_url= or"),
        "no timeout": (["--timeout", "0"], {"timeout": 0}, "--timeout=SECONDS must be", "timeout=SECONDS must be"),
    }
    for flags, keywords, in_flags, in_keywords in told.values():
        if flags:  # a key from the environment, so that the flag is what is wrong
            monkeypatch.setenv("MEMBASE_API_KEY", CLI_KEY)
        code, out = cli(capsys, *flags)
        detail = steps(check.run_check(**keywords))["configuration"].detail

        assert code == 1 and in_flags in out and "api_key=" not in out and "local=DIR" not in out, out
        assert in_keywords in detail and "--" not in detail, detail
        if keywords.get("api_key") == "k":  # a key is never echoed, however short
            assert not re.search(r"\bk\b", out.replace("--api-key", "")) and "[redacted]" not in out
    monkeypatch.setenv("MEMBASE_API_KEY", "k")  # the key where it came from: the variable, not a flag
    assert "[FAIL] configuration: MEMBASE_API_KEY: the value is too short" in cli(capsys)[1]
    assert account.requests == []


def test_a_refused_or_missing_key_is_the_key_step_and_a_404_says_the_host_may_not_be_membase(server, monkeypatch):
    monkeypatch.delenv("MEMBASE_BASE_URL", raising=False)
    for code, said in ((401, "no usable key (401): check the key in api_key="), (403, "refused the key (403)")):
        server.fake.on("GET", "/v1/containers", status(code))
        report = run_check(server)
        assert failed(report) == ["key"] and steps(report)["reach"].ok and said in steps(report)["key"].detail

    server.fake.on("GET", "/v1/containers", status(404, "no route GET /v1/containers"))
    report = run_check(server)
    assert failed(report) == ["reach"] and "key" not in steps(report)
    assert f"{server.url} may not be Membase's API (https://api.app.membase.com is): check the host in base_url=" in (
        steps(report)["reach"].detail
    )


def test_a_host_that_never_answers_is_named_after_one_attempt_of_timeout_seconds(capsys, monkeypatch):
    """``check --timeout 3`` against a host that takes the request and never answers: one attempt, bounded by the
    timeout (the elapsed time is only checked against a generous bound)."""
    monkeypatch.delenv("MEMBASE_BASE_URL", raising=False)
    release = threading.Event()
    with LoopbackMembase() as hanging:
        hanging.always("GET", "/v1/containers", stall(release))  # holds the request until the test ends
        started = time.monotonic()
        try:
            code = check.main(["check", "--api-key", CLI_KEY, "--base-url", hanging.url, "--timeout", "3"])
        finally:
            release.set()
        elapsed = time.monotonic() - started
        assert len(hanging.requests("GET", "/v1/containers")) == 1 and len(hanging.seen) == 1  # one attempt in all

    out = capsys.readouterr().out
    assert code == 1 and failed_lines(out) == ["reach"]
    assert f"[FAIL] reach: {hanging.url} did not answer within 3 s." in out and "--timeout=90" in out
    assert elapsed < 60  # a generous bound: the attempt's own (3 s) is shown by the single request above


def test_a_misspelt_flag_is_a_usage_error_that_names_the_flag_meant_and_a_number_is_said_as_given(capsys):
    with pytest.raises(SystemExit) as exited:
        check.main(["check", "--timout", "2"])
    out, err = capsys.readouterr()
    assert exited.value.code == 2 and out == ""
    assert "unrecognized argument --timout; did you mean --timeout?" in err
    assert check.main(["check", "--api-key", CLI_KEY, "--timeout", "0"]) == 1
    assert "[FAIL] configuration: --timeout=SECONDS must be a positive number, got 0\n" in capsys.readouterr().out


def test_a_local_directory_that_does_not_exist_is_said_first_and_nothing_is_made(capsys, tmp_path, monkeypatch):
    monkeypatch.delenv("MEMBASE_API_KEY", raising=False)
    check.main(["check", "--local", str(tmp_path / "no-such-dir")])
    said = re.findall(r"^  \[[ a-zA-Z]+\] (\w+):", capsys.readouterr().out, re.MULTILINE)
    assert said[:2] == ["directory", "engine"] and not (tmp_path / "no-such-dir").exists()


def test_version_prints_the_package_version_and_no_command_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exited:
        check.main(["--version"])
    assert exited.value.code == 0 and capsys.readouterr().out == f"membase-strands {membase_strands.__version__}\n"

    code = check.main([])

    out, err = capsys.readouterr()
    assert code == 2 and out == "" and err.startswith("usage: membase-strands")
    assert "check the key (MEMBASE_API_KEY) or local directory" in err
    assert "required" not in err  # not argparse's "the following arguments are required: command"


def test_checking_local_membase_where_it_cannot_run_says_what_to_install_or_which_python(monkeypatch, capsys, tmp_path):
    monkeypatch.delenv("MEMBASE_API_KEY", raising=False)
    monkeypatch.setitem(sys.modules, "membase_core", None)  # a Python where the engine was never installed
    if sys.version_info >= (3, 12):
        assert check.main(["check", "--local", str(tmp_path)]) == 1
        out = capsys.readouterr().out
        assert "[FAIL]" in out and 'pip install "membase-strands[local]"' in out and "unibaseio-membase" not in out
        monkeypatch.setattr(sys, "version_info", (3, 11, 9, "final", 0))  # play an older Python

    assert check.main(["check", "--local", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "local Membase needs Python 3.12+; this is Python 3.1" in out
    assert "MEMBASE_API_KEY" in out and "Python 3.10+" in out and "pip install" not in out


def test_the_module_runs_the_check_and_never_prints_a_key_it_could_not_use(monkeypatch, capsys):
    """``python -m membase_strands check``, run as ``-m`` runs it (``runpy``), in this process: a child interpreter
    would only add the seconds it takes to import strands."""
    monkeypatch.delenv("MEMBASE_LOCAL", raising=False)
    monkeypatch.setenv("MEMBASE_API_KEY", CLI_KEY)
    monkeypatch.setenv("MEMBASE_BASE_URL", closed_port())
    monkeypatch.setattr(sys, "argv", ["membase_strands", "check", "--json"])
    monkeypatch.delitem(sys.modules, "membase_strands.__main__", raising=False)
    with pytest.raises(SystemExit) as exited:
        runpy.run_module("membase_strands", run_name="__main__", alter_sys=True)

    out, err = capsys.readouterr()
    assert exited.value.code == 1, err
    report = json.loads(out)
    assert report["ok"] is False and "could not be reached" in report["steps"][0]["detail"]
    assert [step["name"] for step in report["steps"] if step["required"] and not step["ok"]] == ["reach"]
    assert "MEMBASE_BASE_URL" in report["steps"][0]["detail"]
    assert CLI_KEY not in out + err
