"""The setup check (``membase-strands check``, or :func:`run_check`): does Membase answer this key, what may it do?

It never prints the key and saves nothing: it tries saving an empty note, which Membase refuses (403 if the key may
not write, else 400). For local Membase it saves and searches a note in a scratch directory (do the engine's LLM and
embeddings providers work?), then opens the user's directory without writing to it."""

import argparse
import contextlib
import difflib
import json
import os
import re
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import membase

from ._failures import describe_failure
from ._formatting import parse_search
from ._gateway import DEFAULT_BASE_URL, MembaseGateway
from ._local import unavailable
from ._options import is_finite_number
from ._version import __version__

PROBE_QUERY = "membase-strands setup check"
PROBE_LIMIT = 5  # passages per probe search, as many as recall asks for by default
DEFAULT_TIMEOUT = 20.0  # seconds per attempt, well under a minute: a host that never answers is named soon
_LOCAL_LLM_HINT = (
    " (local Membase needs an LLM and an embeddings provider: set OPENAI_API_KEY, or MEMBASE_LLM_PROVIDER, "
    "MEMBASE_EMBED_PROVIDER and MEMBASE_LLM_ENDPOINT for an OpenAI-compatible server)"
)
_PROBE_NOTE = "membase-strands setup check: the heron flies at dawn"
_SAVE_PROBE = "tried with an empty note, which Membase refuses without saving anything"
_FLAGS = "--api-key --local --base-url --container --read-only --no-profile --timeout --json".split()


@dataclass
class Step:
    """One thing the check found out."""

    name: str
    ok: bool
    detail: str
    required: bool = True


@dataclass
class CheckReport:
    """What :func:`run_check` found."""

    target: str  # where Membase was reached (a host, or a local directory); never the key
    steps: list[Step] = field(default_factory=list)
    memories: list[str] = field(default_factory=list)
    search_seconds: float | None = None  # a memory idle for a while wakes up here

    @property
    def ok(self) -> bool:
        """Whether everything needed works."""
        return bool(self.steps) and all(step.ok for step in self.steps if step.required)

    def to_dict(self) -> dict[str, Any]:
        """The report as plain data, for ``--json``."""
        return {**asdict(self), "ok": self.ok}

    def to_text(self) -> str:
        """The report for people."""
        lines = [f"Membase setup check for {self.target}"]
        for step in self.steps:
            mark = "ok" if step.ok else "FAIL" if step.required else "note"
            lines.append(f"  [{mark:>4}] {step.name}: {step.detail}")
        lines.append("Everything needed works." if self.ok else "Something needed does not work: see FAIL above.")
        return "\n".join(lines)


def run_check(
    *,
    api_key: str | None = None,
    base_url: str | None = None,
    local: str | os.PathLike[str] | None = None,
    client: membase.Membase | None = None,
    container: str | None = None,
    need_save: bool = True,
    need_profile: bool = True,
    timeout: float = DEFAULT_TIMEOUT,
) -> CheckReport:
    """Check a Membase key (or local directory) the way the store will use it.

    Args:
        api_key: Defaults to ``MEMBASE_API_KEY``.
        base_url: Defaults to ``MEMBASE_BASE_URL``, else the hosted API.
        local: A local Membase directory instead of a key.
        client: A ready client instead of the three above (its own timeout holds).
        container: The Memory the store will be pinned to, if any.
        need_save: Whether saving must be allowed for the check to pass (``False`` for a read-only key).
        need_profile: Whether reading the profile must be allowed for the check to pass.
        timeout: Seconds one attempt of a request to Membase may take (the search is tried up to 3 times).

    Returns:
        The report: ``report.ok``, whether everything needed works; ``to_text()``; ``to_dict()``.
    """
    options = dict(locals())  # run_check's keywords, as main() passes them
    if local is not None and not Path(local).expanduser().exists():  # not made here: nothing is left behind
        found = [Step("directory", True, "none yet; made at first use", required=False), _engine_step()]
        return CheckReport(f"local Membase in {os.fspath(local)}", found)
    try:
        if not is_finite_number(timeout) or timeout <= 0:
            shown = f"{timeout:g}" if is_finite_number(timeout) else repr(timeout)
            raise ValueError(f"timeout=SECONDS must be a positive number, got {shown}")
        where = {option: options[option] for option in ("client", "api_key", "base_url", "local")}
        gateway = MembaseGateway(**where, request_timeout=timeout, store_name="check")
    except (ValueError, RuntimeError, membase.MembaseError) as error:
        detail = str(error)
        if api_key is None and os.environ.get("MEMBASE_API_KEY"):  # say where the key came from
            detail = re.sub(r"^api_key:", "MEMBASE_API_KEY:", detail)
        return CheckReport("(not configured)", [Step("configuration", False, detail)])
    with contextlib.closing(gateway):
        where_local = "(MEMBASE_LOCAL)" if local is None else f"in {os.fspath(local)}"
        report = CheckReport(gateway.base_url if gateway.hosted else f"local Membase {where_local}")
        needed = {"profile": need_profile, "save": need_save}
        for step in _steps(gateway, report, container, _advice(report.target, timeout, options, gateway.redact)):
            report.steps.append(replace(step, detail=gateway.redact(step.detail), required=needed.get(step.name, True)))
    return report


def _engine_step() -> Step:
    """A real save and search by the local engine, in a scratch directory: whether its LLM and embeddings work."""
    with tempfile.TemporaryDirectory(prefix="membase-check-") as scratch:
        try:
            engine = membase.Membase(local=scratch)
        except membase.MembaseError:
            return Step("engine", False, unavailable())
        with contextlib.closing(engine):
            try:
                engine.memories.add(_PROBE_NOTE)
                answer = parse_search(engine.search("heron dawn", limit=5), 5)
            except Exception as error:  # noqa: BLE001 - every failure becomes a step with what to fix
                failed = describe_failure(error).sentence
                return Step("engine", False, f"a note could not be saved and searched: {failed}{_LOCAL_LLM_HINT}")
    if answer.unsearched:
        failed = "search could not run: " + "; ".join(failed.reason for failed in answer.unsearched)
    elif not any(_PROBE_NOTE in passage.content for passage in answer.passages):
        failed = "a search did not find it"
    else:
        return Step("engine", True, "a note was saved and found again (in a scratch directory, not yours)")
    return Step("engine", False, f"a note was saved, but {failed}{_LOCAL_LLM_HINT}")


def _advice(
    target: str, timeout: float, options: dict[str, Any], redact: Callable[[str], str]
) -> Callable[[BaseException], str]:
    """What to do about a failure (redacted before anything is cut), naming each setting where it was given."""

    def source(option: str, variable: str) -> str:  # its keyword, else the variable, else (neither) either
        if options[option] is not None:
            return f"{option}="
        return variable if os.environ.get(variable) else f"{option}= or {variable}"

    def advice(error: BaseException) -> str:
        failure = describe_failure(error, redact=redact)
        host, key = source("base_url", "MEMBASE_BASE_URL"), source("api_key", "MEMBASE_API_KEY")
        return {
            "timeout": f"{target} did not answer within {timeout:g} s. A memory idle for a while can take up to a "
            f"minute to wake up: try again with timeout=90. If it never answers, check the host in {host} and the "
            "network.",
            "connection": f"{failure.sentence} Check the host in {host} and the network.",
            "not_found": f"{failure.sentence} {target} may not be Membase's API ({DEFAULT_BASE_URL} is): check the "
            f"host in {host}.",
            "access": "Membase refused the key (403): it is unknown or expired, or was narrowed or revoked by its "
            f"owner. Check it in Connect > Developer keys, and the key in {key}.",
            "unauthenticated": f"Membase received no usable key (401): check the key in {key} (a key from Connect > "
            "Developer keys).",
        }.get(failure.kind, failure.sentence)

    return advice


def _steps(
    gateway: MembaseGateway, report: CheckReport, container: str | None, advice: Callable[[BaseException], str]
) -> Iterator[Step]:
    """The checks, in order, each a call of the gateway's; a failure the next checks need ends them."""
    if not gateway.hosted:
        yield _engine_step()
    started = time.perf_counter()
    listed = gateway.run(gateway.memories_in_reach)
    if listed.error is not None and describe_failure(listed.error).kind not in ("access", "unauthenticated"):
        yield Step("reach", False, advice(listed.error))
        return
    yield Step("reach", True, f"Membase answered in {time.perf_counter() - started:.2f} s")
    if gateway.hosted:
        yield Step("key", listed.error is None, "Membase accepted it" if listed.error is None else advice(listed.error))
    if listed.error is not None:
        return  # Membase answered: the key is what failed
    report.memories = [memory.name for memory in listed.result()]
    yield Step("memories in reach", True, ", ".join(report.memories) or "none yet")
    container_id = None
    if container is not None:
        found = gateway.run(lambda: gateway.container_id(container))
        if isinstance(found.error, ValueError):
            yield Step("container", False, str(found.error))
            return
        container_id = found.value
        made = f"is in reach (id {container_id})" if container_id else "is made by the first save to it"
        yield Step("container", True, f"'{container}' {made}")
    started = time.perf_counter()
    searched = gateway.run(lambda: gateway.search(PROBE_QUERY, PROBE_LIMIT, container_id or container, retry=True))
    if searched.error is not None:
        yield Step("search", False, f"the search failed: {advice(searched.error)}")
        return
    report.search_seconds = time.perf_counter() - started
    if unsearched := searched.result().unsearched:
        unable = "; ".join(f"'{u.memory}': {u.reason}" for u in unsearched)
        hint = "" if gateway.hosted else _LOCAL_LLM_HINT
        yield Step("search", False, f"Membase answered, but these Memories could not search: {unable}{hint}")
        return
    yield Step("search", True, f"{report.search_seconds:.2f} s (a memory idle for a while wakes up first: slower)")
    profile = gateway.run(lambda: gateway.profile(None))
    if isinstance(profile.error, membase.PermissionDeniedError):
        yield Step("profile", False, "the key may not read the profile (403): its owner did not allow it")
    else:
        yield Step("profile", profile.error is None, advice(profile.error) if profile.error else "it can be read")
    if not gateway.hosted:
        return  # the engine's own save was checked in a scratch directory
    # Name a Memory in the probe, so a 400 is about the empty note and not about which Memory was meant.
    target = container_id or (listed.result()[0].id if listed.result() else None)
    saved = gateway.run(lambda: gateway.save("", target))
    if saved.error is None:
        yield Step("save", True, f"saving is allowed ({_SAVE_PROBE}: Membase accepted it, with nothing in it)")
    elif isinstance(saved.error, membase.PermissionDeniedError):
        yield Step("save", False, f"the key may not save ({_SAVE_PROBE}: it answered 403)")
    elif describe_failure(saved.error).kind == "bad_request":  # a 400 about the note, not about the Memory named
        yield Step("save", True, f"saving is allowed ({_SAVE_PROBE}: it answered 400 for the empty note, not 403)")
    else:
        yield Step("save", False, f"could not tell ({_SAVE_PROBE}): {advice(saved.error)}")


def _as_flags(message: str) -> str:
    """A message that names run_check()'s keywords (``api_key=``, ``local=DIR``) in the command's flags instead."""
    message = re.sub(r"\blocal=DIR\b|^local(?=:)", lambda found: "--local" + found[0][5:].replace("=", " "), message)
    flag = r"\b(api_key|base_url)\b=?|\b(timeout)(?==)"
    return re.sub(flag, lambda found: f"--{found[1] or found[2]}".replace("_", "-"), message)


def main(argv: list[str] | None = None, prog: str = "membase-strands") -> int:
    """``membase-strands check``: print the report; return 0 if everything needed works, else 1 (2: a usage error)."""
    parser = argparse.ArgumentParser(prog=prog, description="Check a Membase setup.")
    parser.add_argument("--version", action="version", version=f"membase-strands {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="command")
    check = commands.add_parser("check", help="check the key (MEMBASE_API_KEY) or local directory")
    # Each option's dest is run_check's keyword; without --api-key or --local, MEMBASE_API_KEY or MEMBASE_LOCAL.
    check.add_argument("--api-key", help="the key (safer: set MEMBASE_API_KEY, which stays out of shell history)")
    check.add_argument("--local", metavar="DIR", help="check local Membase in DIR instead of a key")
    check.add_argument("--base-url", help="the Membase host (default: MEMBASE_BASE_URL, else the hosted API)")
    check.add_argument("--container", help="the Memory the store will be pinned to")
    check.add_argument("--read-only", dest="need_save", action="store_false", help="the key need not save")
    check.add_argument("--no-profile", dest="need_profile", action="store_false", help="the profile is not needed")
    timeout = "how long each request may take (default 20; a memory idle for a while can take a minute to wake up)"
    check.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT, metavar="SECONDS", help=timeout)
    check.add_argument("--json", action="store_true", help="print the report as JSON")
    parsed, unknown = parser.parse_known_args(argv)
    options = vars(parsed)
    if options.pop("command") is None:  # a usage error, as argparse reports one: exit 2, on stderr
        parser.print_help(sys.stderr)
        return 2
    if unknown:  # the flag meant, as Python 3.14's argparse suggests it
        meant = difflib.get_close_matches(unknown[0], _FLAGS, n=1)
        check.error(f"unrecognized argument {unknown[0]}" + (f"; did you mean {meant[0]}?" if meant else ""))
    as_json = options.pop("json")
    report = run_check(**options)
    for step in report.steps:  # --json's output stays JSON; and each step in the command's own words
        step.detail = _as_flags(step.detail)
    print(json.dumps(report.to_dict(), indent=2) if as_json else report.to_text())
    return 0 if report.ok else 1
