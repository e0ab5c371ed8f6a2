"""What the model reads: Membase answers turned into memory entries and tool text.

Everything from Membase is data: names stay on one line inside their brackets, passages lose control characters and
unpaired surrogates, the key is masked in what is shown (a server may echo it). Cleaning maps each character on its
own, so a passage is cleaned (and masked) only as far as it takes to show it or to tell it from the others.
"""

from __future__ import annotations

import functools
import sys
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from strands.memory import MemoryEntry

from ._failures import BadResponseError
from ._options import is_finite_number
from ._text import clean_text, clip

CUT_MARKER = " [... cut: this passage is longer than the recall budget]"
_PLAIN = (str, int, float, type(None))  # the hit's fields a passage keeps
PROFILE_LABEL = "Membase profile"
_PROFILE_CUT_MARKER = "[... cut: the profile is longer than the recall budget]"
_SILENCE = "Nothing from it is included, so its silence is not evidence that it holds nothing relevant."
_NOT_SEARCHED = "Not searched (these Memories could not answer, so a missing result is not evidence of absence):"
_NO_ID = (
    "(A passage shown without an id cannot be forgotten with membase_forget: the user can remove it in the Membase "
    "app, on its Memory's page.)"
)
_MEMORIES_READ = 50  # how many of the Memories an answer lists earn `limit` hits each
_COMPARED_FIRST = 256  # characters of two passages compared first to tell whether they are the same text


@dataclass
class Passage:
    """A passage: parsed, its text as sent; arranged, its text as shown and the other Memories that returned it."""

    memory: str
    content: str
    metadata: dict[str, Any] = field(default_factory=dict)
    also_in: tuple[str, ...] = ()

    def texts(self) -> list[str]:
        """Everything of the passage the model or a span may see that came from Membase."""
        return [self.content, self.memory, *self.also_in, *(v for v in self.metadata.values() if isinstance(v, str))]

    def masked(self, redact: Callable[[str], str]) -> Passage:
        """The passage with each of its texts passed through ``redact``."""
        metadata = {key: redact(value) if isinstance(value, str) else value for key, value in self.metadata.items()}
        return Passage(redact(self.memory), redact(self.content), metadata, tuple(map(redact, self.also_in)))

    @property
    def label(self) -> str:
        """The prefix the model reads: ``[Memory] ``, or ``[Work] [Home] `` for a passage from several."""
        return "".join(f"[{memory}] " for memory in (self.memory, *self.also_in))

    @property
    def text(self) -> str:
        return clean_text(self.content)

    @property
    def score(self) -> float | None:
        value: Any = self.metadata.get("score")
        return float(value) if is_finite_number(value) else None


@dataclass(frozen=True)
class Unsearched:
    """A Memory that could not answer a search, and why."""

    memory: str
    reason: str


@dataclass(frozen=True)
class SearchAnswer:
    """A search answer; :func:`arrange` adds the ``min_score`` it applied and how many passages it left out."""

    passages: list[Passage]
    unsearched: list[Unsearched]
    none_answered: bool = False
    min_score: float | None = None
    below_min_score: int = 0
    duplicates_merged: int = 0


def memory_label(name: str) -> str:
    """A Memory name fit to stand inside ``[...]``: one line, no brackets, at most 80 characters."""
    return _label_of(name[:4096])  # a server's megabyte of a name is not read


@functools.lru_cache(maxsize=1024)  # the same few Memory names come back on every search
def _label_of(name: str) -> str:
    return clip(clean_text(name), 80).translate(str.maketrans("[]", "()")) or "unnamed Memory"


def parse_search(body: Any, limit: int, redact: Callable[[str], str] = str) -> SearchAnswer:
    """A ``client.search()`` answer read for ``limit`` passages: its passages in Membase's order, their text unread
    (arrange() drops blank ones and masks what it shows), and its Memories that report an ``error``, masked."""
    results = body.get("results") if isinstance(body, dict) else None
    if not isinstance(results, list):
        raise BadResponseError("the search answer has no 'results' list")
    rows = [row for row in _as_list(body.get("containers")) if isinstance(row, dict)]
    names = {row["id"]: row["name"] for row in rows if all(isinstance(row.get(key), str) for key in ("id", "name"))}
    passages = []
    for hit in results[: limit * min(max(1, len(rows)), _MEMORIES_READ)]:
        if isinstance(hit, dict) and isinstance(content := hit.get("content"), str) and content:
            container = hit.get("container") if isinstance(hit.get("container"), str) else None
            name = hit.get("container_name") or names.get(container) or container or "Membase"
            metadata = {key: value for key, value in hit.items() if key != "content"}
            passages.append(Passage(memory_label(str(name)), content, metadata))
    unsearched = []
    for row in rows:
        if error := row.get("error"):
            reason = clip(clean_text(redact(str(error)[:4096])), 200) or "no reason given"
            unsearched.append(Unsearched(redact(memory_label(str(row.get("name") or row.get("id") or ""))), reason))
    none_answered = bool(rows) and len(unsearched) == len(rows) and not passages
    return SearchAnswer(passages, unsearched, none_answered)


def arrange(
    answer: SearchAnswer,
    most: int,
    *,
    min_score: float | None = None,
    budget: int | None = None,
    redact: Callable[[str], str] = str,
) -> SearchAnswer:
    """What the model is shown of a parsed answer: at most ``most`` passages, cleaned, best first when all are scored,
    each text once naming every Memory that returned it, none blank or below ``min_score``, masked by ``redact``. One
    that does not fit in ``budget`` (labels included) is skipped; only a best one alone longer than it is cut, with
    :data:`CUT_MARKER`."""
    readings = _readings(answer.passages, budget)
    if all(reading.score is not None for reading in readings):
        readings.sort(key=lambda reading: reading.score or 0.0, reverse=True)  # a stable sort: ties keep their order
    first = {reading: same[0] for same in _same_texts(readings, _COMPARED_FIRST) for reading in same}
    for reading in readings:  # in order: the first copy of a text is shown, naming every Memory that returned it
        first[reading].memories.setdefault(reading.passage.memory)
    shown = [reading for reading in readings if first[reading] is reading]
    kept = [reading for reading in shown if min_score is None or reading.score is None or reading.score >= min_score]
    below, merged = len(shown) - len(kept), len(readings) - len(shown)
    passages = _fit(kept[:most], budget, redact)
    return SearchAnswer(passages, answer.unsearched, answer.none_answered, min_score, below, merged)


class _Reading:
    """A passage as read: its first ``cap`` characters (all for ``None``), cleaned and whitespace-normalised only as
    far as asked; the Memories that returned its text."""

    def __init__(self, passage: Passage, cap: int | None) -> None:
        self.passage, self.score, self.memories = passage, passage.score, {passage.memory: None}
        self.capped = passage.content[:cap]  # the text itself when it is shorter: no copy
        self.truncated = len(self.capped) < len(passage.content)
        self._read, self._cleaned, self._normal = 0, "", ""

    def start(self, size: int) -> str:
        """The first ``size`` characters of the capped text, cleaned and whitespace-normalised (all, if shorter)."""
        while len(self._normal) < size and self._read < len(self.capped):
            end = max(size, 2 * self._read)  # reading twice as far each time: each character is cleaned once
            self._cleaned += clean_text(self.capped[self._read : end])
            self._read, self._normal = end, " ".join(self._cleaned.split())
        return self._normal[:size]

    def cleaned(self) -> str:
        """The whole capped text, cleaned (once)."""
        if self._read < len(self.capped):
            self._cleaned, self._read = self._cleaned + clean_text(self.capped[self._read :]), len(self.capped)
        return self._cleaned


def _readings(passages: list[Passage], cap: int | None) -> list[_Reading]:
    return [reading for reading in (_Reading(passage, cap) for passage in passages) if reading.start(_COMPARED_FIRST)]


def _same_texts(readings: list[_Reading], size: int) -> Iterator[list[_Reading]]:
    """The readings grouped by text, each group led by its first, each read only as far as it takes to tell: the same
    text when their capped texts, cleaned and whitespace-normalised, are equal and both or neither go past the cap."""
    alike: dict[tuple[bool, str], list[_Reading]] = defaultdict(list)
    for reading in readings:
        alike[reading.truncated, reading.start(size)].append(reading)
    for (_, start), group in alike.items():
        if len(group) == 1 or len(start) < size:  # alone, or all read to their end: one text
            yield group
        else:
            copies: dict[str, list[_Reading]] = defaultdict(list)  # the same as sent: no need to read on
            for reading in group:
                copies[reading.capped].append(reading)
            firsts = [first for first, *_ in copies.values()]
            for same in _same_texts(firsts, 2 * size) if len(firsts) > 1 else [firsts]:
                yield [copy for first in same for copy in copies[first.capped]]


def _fit(readings: list[_Reading], budget: int | None, redact: Callable[[str], str] = str) -> list[Passage]:
    kept: list[Passage] = []
    left = sys.maxsize if budget is None else budget
    for reading in readings:
        room = left - sum(len(name) + 3 for name in reading.memories)  # the label: "[name] " for each
        text = reading.cleaned() if not reading.truncated and room >= 0 else None
        if text is not None and len(text) <= room:
            kept.append(_shown(reading, text))
            left = room - len(text)
        elif not kept:  # the best passage alone is longer than the budget: it is shown cut, alone
            text = redact(text or reading.cleaned())[: max(0, room - len(CUT_MARKER))].rstrip() + CUT_MARKER
            kept = [_shown(reading, text, cut=True)]  # masked before the cut: no part of the key is left
            break
    shown = "\x00".join(text for passage in kept for text in passage.texts())
    if redact(shown) is shown:  # nothing to mask: one look at all of it, the common case
        return kept
    return [passage.masked(redact) for passage in kept]


def _shown(reading: _Reading, text: str, **extra: Any) -> Passage:
    """A passage as the model is shown it: ``text``, the Memories that returned it, its hit's plain fields."""
    memory, *others = reading.memories
    plain = {key: value for key, value in reading.passage.metadata.items() if isinstance(value, _PLAIN)}
    return Passage(memory, text, {**plain, **extra}, tuple(others))


def memory_entries(answer: SearchAnswer) -> list[MemoryEntry]:
    """The manager's entries for what :func:`arrange` returned, then a notice per Memory that could not answer."""
    entries = []
    for passage in answer.passages:
        several = {"memories": [passage.memory, *passage.also_in]} if passage.also_in else {}
        metadata = {**passage.metadata, "memory": passage.memory, **several}  # the label, not a hit's own "memory"
        entries.append(MemoryEntry(content=passage.label + passage.text, metadata=metadata))
    for failed in answer.unsearched:
        notice = f"[Membase notice] The Memory ({failed.memory}) could not be searched: {failed.reason}. {_SILENCE}"
        metadata = {"memory": failed.memory, "unsearched": True, "reason": failed.reason}
        entries.append(MemoryEntry(content=notice, metadata=metadata))
    return entries


def search_text(query: str, answer: SearchAnswer, *, ids: bool = False) -> str:
    """The ``membase_search`` tool's answer to what :func:`arrange` returned; ``ids``: each passage's id too (and
    how to remove those that have none)."""
    quoted, below, count = f'"{clip(query, 120)}"', answer.below_min_score, len(answer.passages)
    weaker = (
        f"{below} weaker passage{'s' if below != 1 else ''} scored below the relevance floor "
        f"(min_score={answer.min_score:g}) and {'are' if below != 1 else 'is'} not shown"
        if below
        else ""
    )
    if answer.passages:
        found = f"Membase found {count} passage{'s' if count != 1 else ''} for {quoted}:"
        lines = [found, *_numbered(answer.passages, ids)]
        lines += ["", f"({weaker}.)"] if below else []
        if ids and not all(passage_id(passage.metadata) for passage in answer.passages):
            lines += ["", _NO_ID]
    elif below:
        lines = [f"Nothing matched {quoted} above the relevance floor: {weaker}."]
    elif answer.unsearched:
        lines = [f"Nothing matched {quoted} in the Memories that answered."]
    else:
        lines = [f"Nothing in Membase matched {quoted}."]
    if answer.unsearched:
        lines += ["", _NOT_SEARCHED, *(f"- {failed.memory}: {failed.reason}" for failed in answer.unsearched)]
    return "\n".join(lines)


def profile_text(body: Any, topic: str | None, limit: int | None = None, redact: Callable[[str], str] = str) -> str:
    """The ``membase_profile`` tool's answer: standing facts, recent changes and the first 50 results on ``topic``,
    fitted to ``limit`` as by :func:`arrange` in the profile's order, masked, and cut at a line past ``limit``."""
    standing, recent = _bulleted(standing_facts(body)), _bulleted(facts(body.get("dynamic")))
    results = parse_search({"results": _as_list(body.get("results"))}, 50).passages if topic else []
    topical = _numbered(_fit(_readings(results, limit), limit, redact))
    about = f'"{clip(topic or "", 120)}"'
    if not (standing or recent or topical):
        if topic:
            return f"The Membase profile is empty: no standing facts, recent changes or results on {about}."
        return "The Membase profile is empty: no standing facts or recent changes are recorded yet."
    sections = {"Standing facts:": standing, "Recent changes:": recent}
    if topic:
        sections[f"On {about}:"] = topical or ["Nothing in the profile matched this topic."]
    text = "\n\n".join("\n".join([heading, *lines]) for heading, lines in sections.items() if lines)
    if limit is None or len(text) <= limit:
        return text
    head = text[: max(0, limit - len(_PROFILE_CUT_MARKER) - 1)]
    head = head.rpartition("\n")[0] or head  # cut at a line
    return f"{head}\n{_PROFILE_CUT_MARKER}"


def standing_facts(body: Any) -> list[str]:
    """The standing facts of a ``client.profile()`` answer, as text."""
    if not isinstance(body, dict):
        raise BadResponseError("the profile answer is not an object")
    return facts(body.get("static"))


def profile_entry(facts: list[str], budget: int | None) -> MemoryEntry:
    """The memory entry of the user's standing facts, first in a recall, cut to ``budget`` characters."""
    text = "\n".join([f"[{PROFILE_LABEL}] Standing facts about the user:", *_bulleted(facts)])
    if budget is not None and len(text) > budget:
        text = text[: max(0, budget - len(CUT_MARKER))].rstrip() + CUT_MARKER
    return MemoryEntry(content=text, metadata={"memory": PROFILE_LABEL, "profile": True, "standing_facts": len(facts)})


def facts(items: Any) -> list[str]:
    """The text of each profile fact (a string, or an object with its text under a few names)."""
    facts = []
    for item in _as_list(items):
        fact = item.get("content") or item.get("description") or item.get("text") if isinstance(item, dict) else item
        if isinstance(fact, str) and (text := clean_text(fact).strip()):
            facts.append(text)
    return facts


def _bulleted(facts: list[str]) -> list[str]:
    """Profile facts as bullets; continuation lines are indented, so a fact never passes for a heading or another."""
    return ["- " + fact.replace("\n", "\n  ") for fact in facts]


def _numbered(passages: list[Passage], ids: bool = False) -> list[str]:
    lines = []
    for rank, passage in enumerate(passages, 1):
        known = passage_id(passage.metadata) if ids else None
        line = f"{rank}. {passage.label}{passage.text}{f' (id: {known})' if known else ''}"
        lines.append(line.replace("\n", "\n   "))
    return lines


def passage_id(metadata: dict[str, Any]) -> str | None:
    """The id ``membase_forget`` takes for a passage: its learned memory (``episode:<Memory>:<n>`` is ``<Memory>:<n>``)
    or ``document:<id>``, from its ``source``; else its own ``memory_id`` or ``id``."""
    source = metadata.get("source")
    if isinstance(source, str):
        kind, _, rest = source.partition(":")
        if kind == "episode" and rest:
            return clip(rest, 120)
        if kind == "document" and rest:
            return clip(f"document:{rest.partition('#')[0]}", 120)
    known = metadata.get("memory_id") or metadata.get("id")
    return clip(known, 120) if isinstance(known, str) and known else None


def _as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []
