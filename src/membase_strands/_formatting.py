"""What the model reads: Membase answers turned into memory entries and tool text.

Everything that comes from Membase (Memory names, passages, a server's error text) is treated as
data. Names are folded onto one line and cannot close the brackets that frame them; passages lose
control characters and unpaired surrogates; a Memory that could not answer becomes a clearly framed
notice, never text that reads like a remembered fact.

An answer can be far larger than what the model is shown (500,000 hits, or 50 passages of a megabyte
against a recall budget of 20,000 characters), so the store's own work is bounded by what it can show:

- Hits: :func:`parse_search` reads the first ``limit`` hits for each Memory the answer lists (at most
  50 Memories): every hit of a server that sends at most ``limit`` per Memory searched, as asked. The
  list of Memories is read whole: each one that could not answer is shown.
- Text: of a passage, at most what the budget could show is read: its first ``max_recall_chars``
  characters (all, without a budget). A longer passage is never shown whole; the best one is cut.
- Folding: passages are the same when what could be shown of them is the same: those first characters,
  cleaned and whitespace-normalised, are equal, and either both passages go on past them or neither.
  A read identical character for character is the same without being cleaned; otherwise passages are
  told apart by their first 256 normalised characters, read further (twice as far) only while equal.

Cleaning maps each character on its own, so a cleaned start of a text is a start of the cleaned text.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, replace
from typing import Any

from strands.memory import MemoryEntry

from ._failures import BadResponseError
from ._text import clean_text, clip

CUT_MARKER = " [... cut: this passage is longer than the recall budget]"
_MEMORIES_READ = 50  # how many of the Memories an answer lists earn `limit` hits each
_FOLD_START = 256
_BRACKETS = str.maketrans({"[": "(", "]": ")"})


@dataclass
class Passage:
    """One passage: the Memory it came from, its text and the hit's other fields.

    Parsed, ``content`` is the text as Membase sent it; arranged, the text as shown (cleaned, perhaps
    cut), and ``also_in`` names the other Memories that returned the same text.
    """

    memory: str
    content: str
    metadata: dict[str, Any] = field(default_factory=dict)
    also_in: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        """The prefix the model reads: ``[Memory] ``, or ``[Work] [Home] `` for a passage from several."""
        return "".join(f"[{memory}] " for memory in (self.memory, *self.also_in))

    @property
    def text(self) -> str:
        """The text without control characters or unpaired surrogates."""
        return clean_text(self.content)

    @property
    def score(self) -> float | None:
        """Membase's score for the passage, or ``None`` when it has no usable one."""
        value = self.metadata.get("score")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return None
        return float(value)


@dataclass(frozen=True)
class Unsearched:
    """A Memory that could not answer a search, and why."""

    memory: str
    reason: str


@dataclass(frozen=True)
class SearchAnswer:
    """A search answer: its passages and the Memories that could not answer.

    ``none_answered``: every Memory searched reported that it could not answer. :func:`arrange` sets the
    rest: the relevance ``floor`` it applied, and how many passages it left out for scoring below it
    (``below_floor``) or as copies of a passage shown once (``folded``).
    """

    passages: list[Passage]
    unsearched: list[Unsearched]
    none_answered: bool = False
    floor: float | None = None
    below_floor: int = 0
    folded: int = 0


def memory_label(name: str) -> str:
    """A Memory name fit to stand inside ``[...]``: one line, no brackets, at most 80 characters (of the
    name's first 4,096: a server's megabyte of a name is not read)."""
    return _label_of(name[:4096])


@functools.lru_cache(maxsize=1024)  # the same few Memory names come back on every search
def _label_of(name: str) -> str:
    return clip(clean_text(name), 80).translate(_BRACKETS) or "unnamed Memory"


def parse_search(body: Any, limit: int) -> SearchAnswer:
    """The passages of a ``client.search()`` answer in Membase's order (their text not read yet; hits
    without text skipped), and an :class:`Unsearched` per Memory reported with an ``error``.

    Args:
        body: Membase's answer.
        limit: The passages asked for; it bounds the hits read (see the module doc).

    Raises:
        BadResponseError: The answer has no ``results`` list.
    """
    results = body.get("results") if isinstance(body, dict) else None
    if not isinstance(results, list):
        raise BadResponseError("the search answer has no 'results' list")
    containers = body.get("containers")
    rows = [row for row in containers if isinstance(row, dict)] if isinstance(containers, list) else []
    names = {
        row["id"]: row["name"] for row in rows if isinstance(row.get("id"), str) and isinstance(row.get("name"), str)
    }

    passages = []
    for hit in results[: limit * min(max(1, len(rows)), _MEMORIES_READ)]:
        content = hit.get("content") if isinstance(hit, dict) else None
        if isinstance(content, str) and content:  # blank text is dropped by arrange(), which reads little of it
            container = hit.get("container") if isinstance(hit.get("container"), str) else None
            name = hit.get("container_name") or names.get(container) or container or "Membase"
            metadata = {key: value for key, value in hit.items() if key != "content"}
            passages.append(Passage(memory_label(str(name)), content, metadata))

    unsearched = [
        Unsearched(
            memory_label(str(row.get("name") or row.get("id") or "unnamed Memory")),
            # clip() of a normalised start a little longer than it keeps is clip() of the whole reason.
            clip(_Reading(Passage("", str(row["error"])), None).start(202), 200) or "no reason given",
        )
        for row in rows
        if row.get("error")
    ]
    none_answered = bool(rows) and len(unsearched) == len(rows) and not passages
    return SearchAnswer(passages=passages, unsearched=unsearched, none_answered=none_answered)


def arrange(
    answer: SearchAnswer, most: int, *, min_score: float | None = None, budget: int | None = None
) -> SearchAnswer:
    """What the model is shown of a parsed answer (text cleaned), with ``floor``, ``below_floor`` and ``folded``.

    Order: when every passage carries a score, best first across Memories (ties keep Membase's order),
    else Membase's order. A passage several Memories (or one, twice) returned is shown once, where it
    first appears, naming each (``[Work] [Home] text``); blank ones are dropped.

    Args:
        answer: What :func:`parse_search` returned.
        most: How many passages to show at most.
        min_score: A passage scored below it is left out (one without a score is kept).
        budget: The characters to show at most, labels included: passages best first, each whole; one
            that does not fit is skipped and smaller ones after it may fit. Only a best passage alone
            longer than the budget is cut, with :data:`CUT_MARKER`.
    """
    readings = _readings(answer.passages, budget)
    if readings and all(reading.score is not None for reading in readings):
        readings.sort(key=lambda reading: -(reading.score or 0.0))  # sort() is stable: ties keep their order
    shown = _fold(readings)
    kept = [r for r in shown if min_score is None or r.score is None or r.score >= min_score]
    passages = _fit(kept[: max(0, most)], budget)
    below, folded = len(shown) - len(kept), len(readings) - len(shown)
    return replace(answer, passages=passages, floor=min_score, below_floor=below, folded=folded)


class _Reading:
    """A passage as far as the store reads it: its first ``cap`` characters (all for ``None``)."""

    def __init__(self, passage: Passage, cap: int | None) -> None:
        self.passage, self.score, self.memories = passage, passage.score, [passage.memory]
        self.end = len(passage.content) if cap is None else min(len(passage.content), cap)
        self.long = self.end < len(passage.content)
        self._read, self._normal, self._gap = 0, "", False  # _gap: what was read ends with whitespace

    @functools.cached_property
    def head(self) -> str:
        """The characters that may be read (copied only when needed: a copy of a long text costs)."""
        return self.passage.content[: self.end]

    def start(self, size: int) -> str:
        """The first ``size`` characters of the head cleaned and whitespace-normalised (all, if shorter).

        Reads each character once, and only as far as that takes: a start of the normalised text is the
        normalised start of the text (a word the cut splits is only a start of that word).
        """
        while len(self._normal) < size and self._read < self.end:
            end = min(self.end, max(size, 2 * self._read))
            piece, self._read = clean_text(self.passage.content[self._read : end]), end
            plain = piece.isprintable() and "  " not in piece  # spaced singly, no tab or newline: normal already
            if words := piece.strip(" ") if plain else " ".join(piece.split()):
                joint = " " if self._normal and (self._gap or piece[0].isspace()) else ""
                self._normal += joint + words
            self._gap = piece[-1].isspace() if piece else self._gap
        return self._normal[:size]


def _readings(passages: list[Passage], cap: int | None) -> list[_Reading]:
    return [reading for reading in (_Reading(p, cap) for p in passages) if reading.start(_FOLD_START)]


def _fold(readings: list[_Reading]) -> list[_Reading]:
    """One reading per text (see the module doc), the first copy kept, naming every Memory that returned it."""
    shown: list[_Reading] = []
    # A start of some size -> the one shown reading that starts so, or None once several do (each of them
    # is then filed under its start twice that size): a reading is read only as far as it starts like another.
    starts: dict[tuple[bool, int, str], _Reading | None] = {}
    copies: dict[tuple[str, bool], _Reading] = {}  # a head as sent -> the shown reading it is a copy of
    for reading in readings:
        size, key = _FOLD_START, (reading.long, _FOLD_START, reading.start(_FOLD_START))
        alike = key in starts  # only then may it be a copy as sent, found without reading on
        if alike and (other := starts[key]) is not None:
            copies.setdefault((other.head, other.long), other)
        twin = copies.get((reading.head, reading.long)) if alike else None
        while twin is None:
            if key not in starts:
                starts[key] = twin = reading
                shown.append(reading)
            elif len(key[2]) < size and starts[key] is not None:  # both read to their end: the same text
                twin = starts[key]
            else:
                if (other := starts[key]) is not None:
                    starts[key] = None
                    starts[(other.long, 2 * size, other.start(2 * size))] = other
                size *= 2
                key = (reading.long, size, reading.start(size))
        if alike:
            copies.setdefault((reading.head, reading.long), twin)
        if reading.passage.memory not in twin.memories:
            twin.memories.append(reading.passage.memory)
    return shown


def _fit(readings: list[_Reading], budget: int | None) -> list[Passage]:
    """The passages that fit in ``budget`` (see :func:`arrange`), their text cleaned."""
    kept: list[Passage] = []
    used = 0
    for reading in readings:
        passage = Passage(reading.memories[0], "", reading.passage.metadata, tuple(reading.memories[1:]))
        label = len(passage.label)
        room = math.inf if budget is None else budget - used - label
        text = "" if reading.long or room < 0 else clean_text(reading.head)
        if not reading.long and len(text) <= room:
            used += label + len(text)
        elif kept or budget is None:
            continue
        else:
            room = max(0, budget - label - len(CUT_MARKER))
            text = (text or clean_text(reading.head))[:room].rstrip() + CUT_MARKER
            passage.metadata, used = {**passage.metadata, "cut": True}, budget
        passage.content = text
        kept.append(passage)
    return kept


def memory_entries(answer: SearchAnswer) -> list[MemoryEntry]:
    """The entries the manager injects for what :func:`arrange` returned: ``[Memory] passage`` (the
    metadata of one from several Memories lists them under ``memories``), then a notice per Memory
    that could not answer."""
    entries = [
        MemoryEntry(
            content=f"{p.label}{p.text}",
            metadata={"memory": p.memory, **p.metadata, **({"memories": [p.memory, *p.also_in]} if p.also_in else {})},
        )
        for p in answer.passages
    ]
    return entries + [
        MemoryEntry(
            content=f"[Membase notice] The Memory ({u.memory}) could not be searched: {u.reason}. Nothing from "
            "it is included, so its silence is not evidence that it holds nothing relevant.",
            metadata={"memory": u.memory, "unsearched": True, "reason": u.reason},
        )
        for u in answer.unsearched
    ]


def search_text(query: str, answer: SearchAnswer) -> str:
    """The ``membase_search`` tool's answer to what :func:`arrange` returned: numbered passages, what the
    floor left out, and the Memories that could not answer under "Not searched"."""
    shown, below, count = clip(query, 120), answer.below_floor, len(answer.passages)
    weaker = (
        f"{below} weaker passage{'s' if below != 1 else ''} scored below the relevance floor "
        f"(min_score={answer.floor:g}) and {'are' if below != 1 else 'is'} not shown"
        if below
        else ""
    )
    if answer.passages:
        lines = [f'Membase found {count} passage{"s" if count != 1 else ""} for "{shown}":']
        lines += _numbered(answer.passages) + (["", f"({weaker}.)"] if weaker else [])
    elif weaker:
        lines = [f'Nothing matched "{shown}" above the relevance floor: {weaker}.']
    elif answer.unsearched:
        lines = [f'Nothing matched "{shown}" in the Memories that answered.']
    else:
        lines = [f'Nothing in Membase matched "{shown}".']
    if answer.unsearched:
        lines += [
            "",
            "Not searched (these Memories could not answer, so a missing result is not evidence of absence):",
            *(f"- {u.memory}: {u.reason}" for u in answer.unsearched),
        ]
    return "\n".join(lines)


def profile_text(body: Any, topic: str | None, limit: int | None = None) -> str:
    """The ``membase_profile`` tool's answer: standing facts, recent changes and topic results.

    Args:
        body: Membase's answer to ``client.profile()``.
        topic: The topic asked about, if any.
        limit: The recall budget in characters. Topic results (the first 50) are fitted to it as by
            :func:`arrange`, in the profile's order; a longer answer is cut at a line, with a marker.

    Raises:
        BadResponseError: The answer is not a JSON object.
    """
    if not isinstance(body, dict):
        raise BadResponseError("the profile answer is not an object")
    standing = [fact for fact in map(_fact_text, _as_list(body.get("static"))) if fact]
    recent = [fact for fact in map(_fact_text, _as_list(body.get("dynamic"))) if fact]
    results = parse_search({"results": _as_list(body.get("results"))}, 50).passages if topic else []
    topical = _fit(_readings(results, limit), limit)

    if not (standing or recent or topical):
        if topic:
            return (
                f'The Membase profile is empty: no standing facts, recent changes or results on "{clip(topic, 120)}".'
            )
        return "The Membase profile is empty: no standing facts or recent changes are recorded yet."
    lines: list[str] = []
    if standing:
        lines += ["Standing facts:", *_bulleted(standing)]
    if recent:
        lines += [*([""] if lines else []), "Recent changes:", *_bulleted(recent)]
    if topic:
        lines += [*([""] if lines else []), f'On "{clip(topic, 120)}":']
        lines += _numbered(topical) if topical else ["Nothing in the profile matched this topic."]
    return _cut_at_line("\n".join(lines), limit)


def _bulleted(facts: list[str]) -> list[str]:
    # Continuation lines are indented, so a fact can never pass for a heading or another fact.
    return ["- " + fact.replace("\n", "\n  ") for fact in facts]


def _cut_at_line(text: str, limit: int | None) -> str:
    if limit is None or len(text) <= limit:
        return text
    marker = "[... cut: the profile is longer than the recall budget]"
    head = text[: max(0, limit - len(marker) - 1)]
    head = head[: head.rfind("\n")] if "\n" in head else head
    return f"{head}\n{marker}"


def _numbered(passages: list[Passage]) -> list[str]:
    return [f"{i}. {p.label}" + p.text.replace("\n", "\n   ") for i, p in enumerate(passages, start=1)]


def _as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _fact_text(item: Any) -> str:
    if isinstance(item, dict):
        item = item.get("content") or item.get("description") or item.get("text")
    return clean_text(item).strip() if isinstance(item, str) else ""
