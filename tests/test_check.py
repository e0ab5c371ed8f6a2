"""The setup check: ``run_check`` over the fake Membase, and ``python -m membase_strands check``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from membase.requirements import local_unavailable

import membase_strands
from membase_strands import _http, check
from membase_strands.testing import API_KEY, InMemoryMembase, refuse_connection, status

CLI_KEY = "mb_cli_key_Zq8_n3ver_printed"
TWO_MEMORIES = [{"id": "ctr_main", "name": "Main"}, {"id": "ctr_work", "name": "Work"}]
ALL_ROUTES = [("GET", "/v1/containers"), ("POST", "/v1/search"), ("GET", "/v1/profile"), ("POST", "/v1/memories")]


def steps(report: check.CheckReport) -> dict[str, check.Step]:
    return {step.name: step for step in report.steps}


def failed(report: check.CheckReport) -> list[check.Step]:
    return [step for step in report.steps if step.required and not step.ok]


def run_check(fake: InMemoryMembase, **options: Any) -> check.CheckReport:
    """The check as the CLI runs it: from a key, against the fake's host (the production path)."""
    return check.run_check(api_key=API_KEY, base_url=fake.base_url, **options)


def ticking(*times: float):
    """A clock that returns ``times`` in order."""
    values = iter(times)
    return lambda: next(values)


# --- run_check ----------------------------------------------------------------------------------


def test_everything_working_is_ok_and_says_what_is_in_reach(fake: InMemoryMembase):
    fake.containers = TWO_MEMORIES

    report = run_check(fake)

    assert report.ok
    assert report.memories == ["Main", "Work"]
    assert [step.name for step in report.steps] == ["reach", "memories in reach", "search", "profile", "save"]
    assert all(step.ok for step in report.steps)
    assert report.first_search_seconds is not None and report.second_search_seconds is not None
    assert report.suggested_recall_timeout == 2.0  # a fast warm search: the floor
    text = report.to_text()
    assert "Main, Work" in text
    assert "first" in text and "second" in text
    assert "suggested recall_timeout: 2 s" in text
    assert text.rstrip().endswith("Everything needed works.")
    assert report.target == fake.base_url


def test_a_ready_client_is_checked_as_it_is_and_left_open(fake: InMemoryMembase):
    client = fake.client()

    report = check.run_check(client=client)

    assert report.ok and report.target == fake.base_url
    assert client.containers.list()["containers"] == fake.containers  # the check did not close it


def test_the_search_probe_runs_twice_and_the_save_probe_writes_nothing(fake: InMemoryMembase):
    fake.remember("We chose Postgres for the ledger.")
    before = list(fake.notes)

    report = run_check(fake)

    assert report.ok
    assert len(fake.sent("POST", "/v1/search")) == 2
    saves = fake.sent("POST", "/v1/memories")
    assert len(saves) == 1 and saves[0].body["content"] == ""
    assert fake.notes == before and fake.standing == []


@pytest.mark.parametrize(("warm", "suggested"), [(0.05, 2.0), (1.1, 6.0), (3.0, 15.0), (10.0, 30.0)])
def test_the_suggested_recall_timeout_covers_five_warm_searches_within_2_to_30_s(fake, warm, suggested):
    # reach start/end, first search start/end (a 40 s cold start), second search start/end
    clock = ticking(0.0, 0.1, 1.0, 41.0, 50.0, 50.0 + warm)

    report = run_check(fake, clock=clock)

    assert report.first_search_seconds == pytest.approx(40.0)
    assert report.second_search_seconds == pytest.approx(warm)
    assert report.suggested_recall_timeout == suggested
    assert "first 40.00 s" in steps(report)["search"].detail


def test_a_key_refused_everywhere_is_not_ok_and_says_what_to_fix(fake):
    for method, path in ALL_ROUTES:
        fake.always(method, path, status(403))

    report = run_check(fake)

    assert not report.ok
    (reach,) = failed(report)
    assert reach.name == "reach"
    assert "403" in reach.detail and "MEMBASE_API_KEY" in reach.detail
    assert "[FAIL] reach" in report.to_text()
    assert report.to_text().rstrip().endswith("Something needed does not work: see FAIL above.")
    assert len(fake.requests) == 1  # a refused key is not retried and nothing else is tried


def test_a_refused_profile_fails_unless_it_is_not_needed(fake):
    fake.always("GET", "/v1/profile", status(403))

    needed = run_check(fake)
    optional = run_check(fake, need_profile=False)

    assert not needed.ok
    assert [step.name for step in failed(needed)] == ["profile"]
    assert "may not read the profile" in steps(needed)["profile"].detail
    assert optional.ok
    assert steps(optional)["profile"].ok is False and steps(optional)["profile"].required is False
    assert "[note] profile" in optional.to_text()


def test_a_refused_save_fails_unless_the_key_is_read_only(fake):
    fake.always("POST", "/v1/memories", status(403))

    needed = run_check(fake)
    read_only = run_check(fake, need_save=False)

    assert not needed.ok
    assert [step.name for step in failed(needed)] == ["save"]
    assert "may not save" in steps(needed)["save"].detail
    assert read_only.ok
    assert all(request.body["content"] == "" for request in fake.sent("POST", "/v1/memories"))
    assert fake.notes == []


def test_a_refused_connection_is_not_ok_and_points_at_the_base_url(fake):
    fake.always("GET", "/v1/containers", refuse_connection)

    report = run_check(fake)

    assert not report.ok
    (reach,) = failed(report)
    assert "could not be reached" in reach.detail
    assert "MEMBASE_BASE_URL" in reach.detail


def test_an_unknown_container_is_not_ok_and_lists_the_memories_in_reach(fake):
    fake.containers = TWO_MEMORIES

    report = run_check(fake, container="Journal")

    assert not report.ok
    (step,) = failed(report)
    assert step.name == "container"
    assert "Journal" in step.detail and "'Main'" in step.detail and "'Work'" in step.detail
    assert fake.sent("POST", "/v1/search") == []


def test_a_known_container_is_resolved_and_searched(fake):
    fake.containers = TWO_MEMORIES

    report = run_check(fake, container="work")

    assert report.ok
    assert "ctr_work" in steps(report)["container"].detail
    assert [request.body["container"] for request in fake.sent("POST", "/v1/search")] == ["ctr_work", "ctr_work"]
    assert fake.sent("POST", "/v1/memories")[0].body["container"] == "ctr_work"


def test_a_failing_search_is_reported(fake):
    fake.always("POST", "/v1/search", status(422, "no model configured"))

    report = run_check(fake)

    assert not report.ok
    (step,) = failed(report)
    assert step.name == "search" and "cannot run" in step.detail


def test_no_configuration_is_a_sentence_naming_the_key_variable(monkeypatch):
    for variable in ("MEMBASE_API_KEY", "MEMBASE_LOCAL", "MEMBASE_BASE_URL"):
        monkeypatch.delenv(variable, raising=False)

    report = check.run_check()

    assert not report.ok
    assert "MEMBASE_API_KEY" in failed(report)[0].detail


def echo_key(request: httpx.Request) -> httpx.Response:
    raise httpx.ConnectError(f"Connection refused while sending {API_KEY}", request=request)


@pytest.mark.parametrize("broken", [None, "reach", "search"])
def test_the_key_never_appears_in_the_report(fake, broken):
    if broken == "reach":
        fake.always("GET", "/v1/containers", echo_key)
    elif broken == "search":
        fake.always("POST", "/v1/search", status(400, f"bad key {API_KEY}"))

    report = run_check(fake)

    assert API_KEY not in report.to_text()
    assert API_KEY not in json.dumps(report.to_dict())
    assert report.ok is (broken is None)


# --- python -m membase_strands check, in process ------------------------------------------------


class Cli:
    """The CLI's view of the world: hosts that the fake Membase answers, and what reached them."""

    def __init__(self, fake: InMemoryMembase) -> None:
        self.fake = fake
        self.authorizations: list[str] = []
        self.hosts: list[str] = []
        self._routes: list[httpx.Client] = []  # a host is routed to the fake while its client lives

    def serve(self, base_url: str) -> str:
        """Answer requests to ``base_url`` with the fake, for the rest of the test; returns ``base_url``."""
        self._routes.append(_http.route(base_url, httpx.MockTransport(self.handle)))
        return base_url

    def handle(self, request: httpx.Request) -> httpx.Response:
        self.authorizations.append(request.headers.get("authorization", ""))
        self.hosts.append(f"{request.url.scheme}://{request.url.host}")
        return self.fake.handle(request)

    def run(self, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
        code = check.main(["check", *args])
        out, err = capsys.readouterr()
        assert CLI_KEY not in out and CLI_KEY not in err
        return code, out

    def close(self) -> None:
        self._routes.clear()


@pytest.fixture
def cli(fake: InMemoryMembase, monkeypatch: pytest.MonkeyPatch) -> Iterator[Cli]:
    """``MEMBASE_API_KEY`` and ``MEMBASE_BASE_URL`` set, the host answered by the fake over the production path."""
    monkeypatch.delenv("MEMBASE_LOCAL", raising=False)
    world = Cli(fake)
    monkeypatch.setenv("MEMBASE_API_KEY", CLI_KEY)
    monkeypatch.setenv("MEMBASE_BASE_URL", world.serve("https://membase-cli.test"))
    yield world
    world.close()


def test_cli_everything_ok_exits_0_and_prints_the_report(cli, capsys):
    cli.fake.containers = TWO_MEMORIES

    code, out = cli.run(capsys)

    assert code == 0
    assert "Main, Work" in out
    assert "first" in out and "second" in out
    assert "suggested recall_timeout:" in out
    assert "Everything needed works." in out
    assert cli.authorizations and set(cli.authorizations) == {f"Bearer {CLI_KEY}"}


def test_cli_json_parses_and_has_ok_steps_and_memories(cli, capsys):
    code, out = cli.run(capsys, "--json")

    data = json.loads(out)
    assert code == 0
    assert data["ok"] is True
    assert data["memories"] == ["Main"]
    assert {step["name"] for step in data["steps"]} >= {"reach", "search", "profile", "save"}
    assert all({"name", "ok", "detail", "required"} <= set(step) for step in data["steps"])
    assert isinstance(data["suggested_recall_timeout"], float)


def test_cli_json_failure_exits_1(cli, capsys):
    for method, path in ALL_ROUTES:
        cli.fake.always(method, path, status(403))

    code, out = cli.run(capsys, "--json")

    data = json.loads(out)
    assert code == 1 and data["ok"] is False
    assert any("MEMBASE_API_KEY" in step["detail"] for step in data["steps"] if not step["ok"])


def test_cli_refused_everywhere_exits_1_with_what_to_fix(cli, capsys):
    for method, path in ALL_ROUTES:
        cli.fake.always(method, path, status(403))

    code, out = cli.run(capsys)

    assert code == 1
    assert "[FAIL] reach" in out and "Connect > Developer keys" in out


def test_cli_profile_refused_passes_with_no_profile(cli, capsys):
    cli.fake.always("GET", "/v1/profile", status(403))

    assert cli.run(capsys)[0] == 1
    assert cli.run(capsys, "--no-profile")[0] == 0


def test_cli_save_refused_passes_only_with_read_only(cli, capsys):
    cli.fake.always("POST", "/v1/memories", status(403))

    code, out = cli.run(capsys)
    assert code == 1 and "[FAIL] save" in out
    assert cli.run(capsys, "--read-only")[0] == 0
    assert cli.fake.notes == []


def test_cli_unknown_container_exits_1_listing_the_names(cli, capsys):
    cli.fake.containers = TWO_MEMORIES

    code, out = cli.run(capsys, "--container", "Journal")

    assert code == 1
    assert "'Main'" in out and "'Work'" in out


def test_cli_connection_refused_points_at_the_base_url(cli, capsys):
    cli.fake.always("GET", "/v1/containers", refuse_connection)

    code, out = cli.run(capsys, "--base-url", cli.serve("https://membase-from-flag.test"))

    assert code == 1
    assert "MEMBASE_BASE_URL" in out
    assert cli.hosts == ["https://membase-from-flag.test"]  # the flag wins over MEMBASE_BASE_URL
    assert "https://membase-from-flag.test" in out


def test_cli_takes_the_base_url_from_the_environment(cli, capsys, monkeypatch):
    monkeypatch.setenv("MEMBASE_BASE_URL", cli.serve("https://membase-from-env.test"))

    code, out = cli.run(capsys)

    assert code == 0
    assert set(cli.hosts) == {"https://membase-from-env.test"}


def test_cli_api_key_option_is_used_when_the_environment_has_none(cli, capsys, monkeypatch):
    monkeypatch.delenv("MEMBASE_API_KEY")

    code, _ = cli.run(capsys, "--api-key", CLI_KEY)

    assert code == 0
    assert set(cli.authorizations) == {f"Bearer {CLI_KEY}"}


@pytest.mark.skipif(local_unavailable() is not None, reason=f"local Membase cannot run here: {local_unavailable()}")
@pytest.mark.parametrize(
    "setting",
    [
        "directory",
        "1",
        "true",
    ],
)
def test_cli_checks_the_local_directory_membase_local_names(fake, monkeypatch, capsys, tmp_path, setting):
    """``MEMBASE_LOCAL`` follows the SDK's convention: a directory, or 1/true/yes for the default one."""
    import membase.local

    roots: list[Any] = []

    class RecordingTransport(httpx.MockTransport):  # the fake answers in place of the local engine
        BASE_URL = "http://membase.local"

        def __init__(self, root: Any = None, backend: Any = None) -> None:
            roots.append(root)
            super().__init__(fake.handle)

    monkeypatch.setattr(membase.local, "LocalTransport", RecordingTransport)
    monkeypatch.delenv("MEMBASE_API_KEY", raising=False)
    monkeypatch.chdir(tmp_path)
    directory = str(tmp_path / "memory")
    monkeypatch.setenv("MEMBASE_LOCAL", directory if setting == "directory" else setting)

    code = check.main(["check"])

    out = capsys.readouterr().out
    assert code == 0, out
    assert roots == [directory if setting == "directory" else None]  # None: the SDK's default, ~/.membase


# --- The command line itself: --version, no command, local Membase that cannot start -------------


def test_version_prints_the_package_version_and_exits_0(capsys):
    with pytest.raises(SystemExit) as exited:
        check.main(["--version"])

    assert exited.value.code == 0
    assert capsys.readouterr().out == f"membase-strands {membase_strands.__version__}\n"


def test_no_command_prints_the_help_naming_check_and_exits_2_as_a_usage_error(capsys):
    code = check.main([])

    out, err = capsys.readouterr()
    assert code == 2
    assert out == ""
    assert err.startswith("usage: membase-strands")
    assert "check the key (MEMBASE_API_KEY) or local directory" in err
    assert "required" not in err  # not argparse's "the following arguments are required: command"


@pytest.fixture
def no_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Python where the local engine (``membase_core``) was never installed: imports of it find nothing."""
    monkeypatch.delenv("MEMBASE_API_KEY", raising=False)
    monkeypatch.setitem(sys.modules, "membase_core", None)


@pytest.mark.skipif(sys.version_info < (3, 12), reason="below Python 3.12 the check names the Python version instead")
def test_check_local_without_the_engine_says_to_install_the_local_extra(no_engine, capsys, tmp_path):
    code = check.main(["check", "--local", str(tmp_path)])

    out = capsys.readouterr().out
    assert code == 1
    assert "[FAIL] configuration" in out
    assert 'pip install "membase-strands[local]"' in out
    assert "unibaseio-membase" not in out


def test_check_local_below_python_3_12_says_local_membase_needs_3_12(no_engine, monkeypatch, capsys, tmp_path):
    if sys.version_info >= (3, 12):  # play an older Python (the SDK refuses local mode there, as without the engine)
        monkeypatch.setattr(sys, "version_info", (3, 11, 9, "final", 0))

    code = check.main(["check", "--local", str(tmp_path)])

    out = capsys.readouterr().out
    assert code == 1
    assert "local Membase needs Python 3.12+; this is Python 3.1" in out
    assert "MEMBASE_API_KEY" in out and "Python 3.10+" in out
    assert "pip install" not in out


# --- python -m membase_strands check, for real ---------------------------------------------------


def scrubbed_env(**extra: str) -> dict[str, str]:
    keep = {
        name: value
        for name, value in os.environ.items()
        if not name.startswith("MEMBASE_") and not name.lower().endswith("_proxy")
    }
    return {**keep, **extra}


def test_the_module_without_a_key_exits_1_naming_the_variable():
    done = subprocess.run(
        [sys.executable, "-m", "membase_strands", "check"],
        env=scrubbed_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )

    assert done.returncode == 1, done.stderr
    assert "MEMBASE_API_KEY" in done.stdout
    assert "[FAIL] configuration" in done.stdout


def test_the_module_never_prints_a_key_it_could_not_use():
    # A closed loopback port: the connection is refused at once and no request leaves the machine.
    done = subprocess.run(
        [sys.executable, "-m", "membase_strands", "check", "--json"],
        env=scrubbed_env(MEMBASE_API_KEY=CLI_KEY, MEMBASE_BASE_URL="http://127.0.0.1:9"),
        capture_output=True,
        text=True,
        timeout=120,
    )

    assert done.returncode == 1, done.stderr
    data = json.loads(done.stdout)
    assert data["ok"] is False
    assert any("MEMBASE_BASE_URL" in step["detail"] for step in data["steps"])
    assert CLI_KEY not in done.stdout and CLI_KEY not in done.stderr


def test_the_save_probe_names_a_memory_so_a_400_is_about_the_empty_note(fake):
    fake.containers = [{"id": "ctr_a", "name": "A"}, {"id": "ctr_b", "name": "B"}]
    report = run_check(fake)

    [probe] = [r.body for r in fake.sent("POST", "/v1/memories")]
    assert probe["container"] == "ctr_a" and probe["content"] == ""
    assert report.ok and fake.notes == []
