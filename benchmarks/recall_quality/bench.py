"""The recall-quality benchmark: a labelled set, the real Membase engine, a real Strands agent.

Run from the repository root (the engine needs Python 3.12+ and ``unibaseio-membase[local]``)::

    uv run --python 3.12 python -m benchmarks.recall_quality           # print only
    uv run --python 3.12 python -m benchmarks.recall_quality --write   # also replace its part of RESULTS.md

Everything runs offline: the stand-in LLM (``examples/standin_llm.py``) and ``membase serve`` listen on 127.0.0.1, and
the agent's model is scripted. Each question is one turn of a fresh ``strands.Agent`` whose ``MemoryManager`` holds one
store (the manager's defaults: up to 5 entries); what is measured is the memory block the model was sent.
"""

from __future__ import annotations

import argparse
import html
import importlib.util
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import membase
from strands import Agent
from strands.memory import MemoryManager

from benchmarks.common import machine
from examples.standin_llm import StandInLLM
from membase_strands import MembaseMemoryStore, injection_config
from membase_strands.testing import ScriptedModel

ROOT = Path(__file__).resolve().parents[2]
DATASET = Path(__file__).with_name("dataset.json")
RESULTS = ROOT / "benchmarks" / "RESULTS.md"
START = "<!-- recall-quality: start (written by python -m benchmarks.recall_quality --write) -->"
END = "<!-- recall-quality: end -->"
COMMAND = "uv run --python 3.12 python -m benchmarks.recall_quality"
DEFAULT_FLOORS = (0.03, 0.0325, 0.0327)
TIGHT_BUDGET = 200  # max_recall_chars: room for about two passages, so the order decides which survive
PACKAGES = ("membase-strands", "strands-agents", "unibaseio-membase", "unibaseio-membase-core", "httpx")
_LABELS = re.compile(r"^(?:\[[^\[\]\n]*\] )+")
_ENTRY = re.compile(r"<entry[^>]*>(.*?)</entry>", re.S)


# --- The labelled set -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Note:
    id: str
    memory: str
    text: str


@dataclass(frozen=True)
class Question:
    question: str
    answers: tuple[str, ...]
    """Ids of the notes any of which holds the fact the question needs."""


def load_dataset(path: Path = DATASET) -> tuple[list[Note], list[Question]]:
    data = json.loads(path.read_text(encoding="utf-8"))
    notes = [Note(**row) for row in data["notes"]]
    questions = [Question(row["question"], tuple(row["answers"])) for row in data["questions"]]
    ids = {note.id for note in notes}
    unknown = [answer for q in questions for answer in q.answers if answer not in ids]
    if unknown:
        raise ValueError(f"{path.name}: questions name notes that do not exist: {unknown}")
    return notes, questions


def normalised(text: str) -> str:
    return " ".join(text.split())


# --- What one turn injected -----------------------------------------------------------------------


@dataclass
class Turn:
    question: Question
    block: str
    """The memory block as the model was sent it ('' when nothing was injected)."""
    passages: list[str] = field(default_factory=list)
    """The passage texts in the block, without their [Memory] labels; notices left out."""
    found: bool = False

    @property
    def duplicates(self) -> int:
        return len(self.passages) - len({normalised(p) for p in self.passages})


def read_turn(question: Question, sent_texts: list[str], notes: dict[str, Note]) -> Turn:
    blocks = [text.strip() for text in sent_texts if "<memory>" in text]
    block = blocks[0] if blocks else ""
    passages = []
    for entry in _ENTRY.findall(block):
        content = html.unescape(entry)
        if content.startswith("[Membase notice]"):
            continue
        passages.append(_LABELS.sub("", content, count=1))
    wanted = [normalised(notes[answer].text) for answer in question.answers]
    found = any(want in normalised(passage) for want in wanted for passage in passages)
    return Turn(question=question, block=block, passages=passages, found=found)


# --- Configurations -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    key: str
    label: str
    make_store: Callable[..., Any]
    options: dict[str, Any] = field(default_factory=dict)
    framed: bool = False
    against: str = "defaults"
    """The configuration whose facts this one is compared with."""


def configurations(floors: tuple[float, ...]) -> list[Config]:
    tight = {"max_recall_chars": TIGHT_BUDGET}
    configs = [Config("defaults", "defaults (best first, copies folded)", MembaseMemoryStore)]
    configs += [
        Config(f"floor={floor:g}", f"... + min_score={floor:g}", MembaseMemoryStore, {"min_score": floor})
        for floor in floors
    ]
    configs += [
        Config("framed", "... + injection_config() (block framed as data)", MembaseMemoryStore, framed=True),
        Config("tight", f"defaults, max_recall_chars={TIGHT_BUDGET}", MembaseMemoryStore, tight),
    ]
    return configs


@dataclass
class Outcome:
    config: Config
    turns: list[Turn]

    @property
    def found(self) -> int:
        return sum(turn.found for turn in self.turns)

    @property
    def share(self) -> float:
        return self.found / len(self.turns)

    @property
    def chars(self) -> list[int]:
        return [len(turn.block) for turn in self.turns]

    @property
    def mean_chars(self) -> float:
        return statistics.fmean(self.chars)

    @property
    def duplicates(self) -> int:
        return sum(turn.duplicates for turn in self.turns)

    @property
    def mean_passages(self) -> float:
        return statistics.fmean(len(turn.passages) for turn in self.turns)

    def lost_against(self, baseline: Outcome) -> list[str]:
        return [b.question.question for b, t in zip(baseline.turns, self.turns, strict=True) if b.found and not t.found]

    def gained_against(self, baseline: Outcome) -> list[str]:
        return [b.question.question for b, t in zip(baseline.turns, self.turns, strict=True) if t.found and not b.found]


# --- The run --------------------------------------------------------------------------------------


def run(floors: tuple[float, ...]) -> tuple[list[Outcome], dict[str, list[float]], float]:
    """Seed the set into a fresh engine and ask every question in every configuration."""
    notes, questions = load_dataset()
    by_id = {note.id: note for note in notes}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="membase-recall-quality-") as tmp:
        with StandInLLM() as llm, served_engine(Path(tmp) / "membase", llm) as url:
            with membase.Membase(api_key="mb_benchmark_key", base_url=url) as client:
                for note in notes:
                    answer = client.memories.add(note.text, container=note.memory)
                    if not answer.get("memory_ids"):
                        raise RuntimeError(f"the engine learned nothing from note {note.id}: {answer}")
                scores = _raw_scores(client, questions, by_id)

            outcomes = []
            for config in configurations(floors):
                store = config.make_store(api_key="mb_benchmark_key", base_url=url, **config.options)
                turns = []
                with store:
                    for question in questions:
                        model = ScriptedModel(["ok"])
                        manager = MemoryManager(stores=[store], injection=injection_config() if config.framed else True)
                        Agent(model=model, memory_manager=manager, callback_handler=None)(question.question)
                        sent = [b["text"] for m in model.calls[0]["messages"] for b in m["content"] if "text" in b]
                        turns.append(read_turn(question, sent, by_id))
                outcomes.append(Outcome(config, turns))
            unknown = list(llm.unknown_prompts)
    if unknown:
        raise RuntimeError(f"the engine sent prompts the stand-in does not recognise: {[p[:200] for p in unknown]}")
    return outcomes, scores, time.perf_counter() - started


def engine_unavailable() -> str | None:
    """Why the real engine cannot run here, or ``None``."""
    if sys.version_info < (3, 12):
        return "the local Membase engine needs Python 3.12+ (run with `uv run --python 3.12 ...`)"
    if importlib.util.find_spec("membase_core") is None:
        return "the local Membase engine is not installed: pip install 'unibaseio-membase[local]'"
    return None


@contextmanager
def served_engine(directory: Path, llm: StandInLLM) -> Iterator[str]:
    """``membase --store DIR serve`` on a free loopback port, its LLM the stand-in; yields its base URL."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    offline = ("MEMBASE_", "OPENAI_", "ANTHROPIC_", "AWS_", "GOOGLE_", "GEMINI_", "MISTRAL_", "LITELLM_")
    env = {key: value for key, value in os.environ.items() if not key.startswith(offline)}
    env.update(llm.engine_env(), NO_PROXY="127.0.0.1,localhost", no_proxy="127.0.0.1,localhost")
    directory.mkdir(parents=True)
    log = directory.parent / "membase-serve.log"
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "membase", "--store", str(directory), "serve", "--host", "127.0.0.1"]
    with log.open("wb") as output:
        process = subprocess.Popen(
            [*command, "--port", str(port)], env=env, cwd=directory, stdout=output, stderr=subprocess.STDOUT
        )
        try:
            deadline = time.monotonic() + 60
            while not _answers(url):
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"membase serve did not start:\n{log.read_text(errors='replace')[-3000:]}")
                time.sleep(0.1)
            yield url
        finally:
            process.send_signal(signal.SIGINT)  # the engine closes its stores on an interrupt
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(5)


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/v1/containers", timeout=2) as answer:
            return bool(answer.status == 200)
    except OSError:
        return False


def _raw_scores(client: Any, questions: list[Question], notes: dict[str, Any]) -> dict[str, list[float]]:
    """The engine's scores for the passages it returns (limit 5), split by whether they answer the question."""
    scores: dict[str, list[float]] = {"answer": [], "other": []}
    for question in questions:
        wanted = [normalised(notes[answer].text) for answer in question.answers]
        for hit in client.search(question.question, limit=5)["results"]:
            kind = "answer" if any(w in normalised(hit["content"]) for w in wanted) else "other"
            scores[kind].append(float(hit["score"]))
    return scores


# --- The report -----------------------------------------------------------------------------------


def report(outcomes: list[Outcome], scores: dict[str, list[float]], seconds: float) -> str:
    notes, questions = load_dataset()
    defaults = outcomes[0]
    memories = sorted({note.memory for note in notes})
    shared = len(
        {normalised(n.text) for n in notes if sum(normalised(m.text) == normalised(n.text) for m in notes) > 1}
    )
    paraphrased = sum(len(q.answers) > 1 for q in questions)
    lines = [
        START,
        "",
        "## Recall quality (order, duplicate folding, a relevance floor)",
        "",
        f"Produced by `{COMMAND}` in {seconds:.0f} s. It seeds "
        f"[`recall_quality/dataset.json`](recall_quality/dataset.json) ({len(notes)} notes in {len(memories)} "
        f"Memories: {', '.join(memories)}; {shared} facts saved word for word in two Memories, and paraphrases) into "
        "a fresh real Membase engine (`membase serve` on 127.0.0.1, with the deterministic stand-in LLM on "
        f"127.0.0.1), then asks its {len(questions)} questions ({paraphrased} of which two notes can answer). Each "
        "question is one turn of a fresh `strands.Agent` with `MemoryManager(stores=[store])` (injection defaults: "
        "up to 5 entries) and a scripted model; what is measured is the memory block the model was sent. A fact "
        "counts as injected when the text of a note that answers the question is in the block.",
        "",
        "| | |",
        "| --- | --- |",
        *(f"| {key} | {value} |" for key, value in machine(PACKAGES).items()),
        "",
        "| configuration | facts injected | characters injected per turn (mean / max) | passages per turn "
        "| duplicate passages injected | facts lost vs defaults | facts gained vs defaults |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    by_key = {outcome.config.key: outcome for outcome in outcomes}
    for outcome in outcomes:
        against = by_key[outcome.config.against]
        if outcome is against:
            lost_cell = gained_cell = "-"
        else:
            suffix = f" (vs {against.config.key})" if against is not defaults else ""
            lost_cell = f"{len(outcome.lost_against(against))}{suffix}"
            gained_cell = f"{len(outcome.gained_against(against))}{suffix}"
        lines.append(
            f"| {outcome.config.label} | {outcome.found}/{len(outcome.turns)} ({outcome.share:.0%}) "
            f"| {outcome.mean_chars:.0f} / {max(outcome.chars)} | {outcome.mean_passages:.2f} | {outcome.duplicates} "
            f"| {lost_cell} | {gained_cell} |"
        )
    targets = [
        (
            "no duplicate passage is injected (a fact saved in two Memories is shown once)",
            defaults.duplicates == 0,
            f"{defaults.duplicates} duplicate passages",
        ),
        (
            "with the defaults every question's fact is injected",
            defaults.found == len(defaults.turns),
            f"{defaults.found}/{len(defaults.turns)}",
        ),
    ]
    lines += ["", "| target | result | detail |", "| --- | --- | --- |"]
    lines += [f"| {text} | {'met' if met else '**missed**'} | {detail} |" for text, met, detail in targets]
    lines += [
        "",
        "Scores the engine gave the passages it returned for these questions (`client.search(q, limit=5)`), "
        "to read the floors against:",
        "",
        "| passages | count | min | median | max |",
        "| --- | --- | --- | --- | --- |",
    ]
    for kind, label in (("answer", "that answer the question"), ("other", "that do not")):
        values = scores[kind]
        if values:
            lines.append(
                f"| {label} | {len(values)} | {min(values):.5f} | {statistics.median(values):.5f} | {max(values):.5f} |"
            )
    lines += ["", *_findings(by_key), "", END]
    return "\n".join(lines) + "\n"


def _findings(by_key: dict[str, Outcome]) -> list[str]:
    defaults, framed, tight = by_key["defaults"], by_key["framed"], by_key["tight"]
    lines = [
        "- The engine applies the search `limit` itself, after interleaving its Memories by rank, so the store "
        "orders and folds (and its recall budget, the notices and the manager cut) only what it was sent.",
        "- This engine's scores are reciprocal-rank fusion within each Memory (about 0.016 to 0.033): a Memory's "
        "best passage scores high whether or not it is relevant, so here a floor trades facts for characters "
        "rather than removing only noise. Hosted Membase may score differently: choose `min_score` from the scores in "
        "the metadata of what `store.search()` returns for your own Memories.",
    ]
    for outcome in by_key.values():
        if "min_score" not in outcome.config.options:
            continue
        lost = outcome.lost_against(defaults)
        listed = "; ".join(lost[:4]) + (f"; and {len(lost) - 4} more" if len(lost) > 4 else "")
        lines.append(
            f"- `min_score={outcome.config.options['min_score']:g}`: {outcome.found}/{len(outcome.turns)} facts, "
            f"{outcome.mean_chars:.0f} characters per turn; {len(lost)} lost against the defaults"
            + (f" ({listed})" if lost else "")
            + "."
        )
    lines += [
        f"- Under a tight recall budget (`max_recall_chars={TIGHT_BUDGET}`) the best passages are the ones kept: "
        f"{tight.found}/{len(tight.turns)} facts, {tight.mean_chars:.0f} characters per turn.",
        f"- `injection_config()` adds the data frame's sentence: {framed.mean_chars - defaults.mean_chars:.0f} "
        "characters per turn on average (nothing on a turn with nothing to inject).",
    ]
    return lines


def write(section: str, path: Path = RESULTS) -> None:
    """Replace this benchmark's section of RESULTS.md, or add it at the end."""
    text = path.read_text(encoding="utf-8") if path.exists() else ""
    if START in text and END in text:
        head, rest = text.split(START, 1)
        tail = rest.split(END, 1)[1].lstrip("\n")
        text = head + section + (("\n" + tail) if tail else "")
    else:
        text = text.rstrip("\n") + ("\n\n" if text else "") + section
    path.write_text(text, encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.recall_quality", description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="replace this benchmark's part of RESULTS.md")
    parser.add_argument(
        "--floor",
        type=float,
        action="append",
        help=f"a min_score to measure (repeatable; default {', '.join(map(str, DEFAULT_FLOORS))})",
    )
    args = parser.parse_args(argv)

    reason = engine_unavailable()
    if reason:
        print(f"the recall-quality benchmark needs the real Membase engine: {reason}", file=sys.stderr)
        return 2
    outcomes, scores, seconds = run(tuple(args.floor or DEFAULT_FLOORS))
    section = report(outcomes, scores, seconds)
    print(section)
    if args.write:
        write(section)
        print(f"written to {RESULTS.relative_to(ROOT)}")
    return 0
