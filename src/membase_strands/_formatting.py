"""What the model reads: Membase answers turned into memory entries and tool text.

Everything that comes from Membase (Memory names, passages, a server's error text) is treated as
data. Names are folded onto one line and cannot close the brackets that frame them; passages
lose control characters and unpaired surrogates; a Memory that could not answer becomes a clearly
framed notice, never text that reads like a remembered fact.

Before anything is cut to the entry limit or the recall budget, :func:`arrange` puts the passages
best first across Memories, shows a passage that several Memories returned once, and drops those
scored below the store's relevance floor.

An answer can be far larger than what the model is shown (50 passages of a megabyte each, against a
recall budget of 20,000 characters), so no step here reads text it is about to drop: a passage is
cleaned when it is shown, and only as far as the budget reaches; folding compares the start of
passages and reads on only where two starts are the same. Cleaning maps each character on its own
(kept, dropped or replaced), so the cleaned start of a text is the start of the cleaned text and
the output is the same as cleaning everything first.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, replace
from typing import Any

from strands.memory import MemoryEntry

from ._failures import BadResponseError
from ._text import clean_text, clip

_NAME_LIMIT = 80
_REASON_LIMIT = 200
_BRACKETS = str.maketrans({"[": "(", "]": ")"})


@dataclass(frozen=True)
class Passage:
    """One passage Membase returned, with the Memory it came from."""

    memory: str
    content: str
    """The passage as Membase sent it; :attr:`text` is what the model reads."""
    metadata: dict[str, Any] = field(default_factory=dict)
    also_in: tuple[str, ...] = ()
    """Other Memories that returned the same text (see :func:`arrange`)."""
    label: str = field(init=False, repr=False, compare=False)
    """The passage's prefix: ``[Memory] ``, or ``[Work] [Home] `` for a passage from several Memories."""
    score: float | None = field(init=False, repr=False, compare=False)
    """Membase's score for the passage, or ``None`` when it has no usable one."""

    def __post_init__(self) -> None:
        # Read several times per recall (ordering, the budget, the entries): worked out once, here.
        object.__setattr__(self, "label", "".join(f"[{memory}] " for memory in self.memories))
        value = self.metadata.get("score")
        usable = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        object.__setattr__(self, "score", float(value) if usable and isinstance(value, (int, float)) else None)

    @functools.cached_property
    def text(self) -> str:
        """The passage without control characters or unpaired surrogates, cleaned on first use."""
        return clean_text(self.content)

    @property
    def memories(self) -> tuple[str, ...]:
        """Every Memory this passage came from, the one it scored best in first."""
        return (self.memory, *self.also_in)


@dataclass(frozen=True)
class Unsearched:
    """A Memory that could not answer a search, and why."""

    memory: str
    reason: str


@dataclass(frozen=True)
class SearchAnswer:
    """A search answer: the passages, best first, and the Memories that could not answer."""

    passages: list[Passage]
    unsearched: list[Unsearched]
    none_answered: bool = False
    """Every Memory searched reported that it could not answer."""
    floor: float | None = None
    """The relevance floor :func:`arrange` applied, if any."""
    below_floor: int = 0
    """How many passages :func:`arrange` left out for scoring below ``floor``."""
    folded: int = 0
    """How many copies of passages shown once :func:`arrange` left out."""


@functools.lru_cache(maxsize=1024)  # the same few Memory names come back on every search
def memory_label(name: str) -> str:
    """A Memory name fit to stand inside ``[...]``: one line, no brackets, at most 80 characters."""
    return clip(clean_text(name), _NAME_LIMIT).translate(_BRACKETS) or "unnamed Memory"


def parse_search(body: Any) -> SearchAnswer:
    """Read the answer of ``client.search()``.

    Hits without text are skipped; Memories reported with an ``error`` become :class:`Unsearched`.

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
    for hit in results:
        content = hit.get("content") if isinstance(hit, dict) else None
        # isspace() stops at the first other character; strip() could copy a whole passage to find out.
        if not isinstance(content, str) or not content or content.isspace():
            continue
        container = hit.get("container") if isinstance(hit.get("container"), str) else None
        name = hit.get("container_name") or (names.get(container) if container else None) or container or "Membase"
        metadata = {key: value for key, value in hit.items() if key != "content"}
        # Not cleaned here: most of a large answer is never shown (see fit_to_budget).
        passages.append(Passage(memory=memory_label(str(name)), content=content, metadata=metadata))

    unsearched = [
        Unsearched(
            memory=memory_label(str(row.get("name") or row.get("id") or "unnamed Memory")),
            reason=_clip_start(str(row["error"]), _REASON_LIMIT) or "no reason given",
        )
        for row in rows
        if row.get("error")
    ]
    none_answered = bool(rows) and len(unsearched) == len(rows) and not passages
    return SearchAnswer(passages=passages, unsearched=unsearched, none_answered=none_answered)


def arrange(answer: SearchAnswer, min_score: float | None = None) -> SearchAnswer:
    """The passages as the model should see them: best first, each text once, none below the floor.

    - Order: when every passage carries a score, they are sorted best first across Memories (ties keep
      Membase's order); when any lacks one, Membase's order stands, as scores cannot be compared then.
    - Duplicates: passages with the same text once whitespace is normalised are shown once, where the
      text first appears (the best-scored copy once ordered), naming every Memory that returned it.
    - Floor: with ``min_score``, a passage whose (best) score is below it is left out. A passage
      without a score is kept: there is nothing to hold against the floor.

    Args:
        answer: The parsed search answer, in Membase's order.
        min_score: The relevance floor, or ``None`` to keep every passage.

    Returns:
        The answer with its passages arranged, and counts of what was folded and left out.
    """
    passages = answer.passages
    if passages and all(p.score is not None for p in passages):
        passages = sorted(passages, key=lambda p: -(p.score or 0.0))  # sorted() is stable: ties keep their order
    shown = _fold(passages)
    kept = shown if min_score is None else [p for p in shown if p.score is None or p.score >= min_score]
    return replace(
        answer,
        passages=kept,
        floor=min_score,
        below_floor=len(shown) - len(kept),
        folded=len(passages) - len(shown),
    )


def _fold(passages: list[Passage]) -> list[Passage]:
    """One passage per text (whitespace normalised), the first copy kept, naming every Memory that returned it.

    Passages are told apart by the start of their normalised text. Only while a passage starts like
    some shown ones is it read further (four times as far each time), and so are they, each as far as
    once: a passage is read to where it differs from every other, never to its end unless it is a copy.
    """
    shown: list[Passage] = []
    starts: list[dict[int, str]] = []  # for each shown passage, its normalised starts read so far, by length
    by_start: dict[str, list[int]] = {}  # the shortest start -> where the passages starting so are shown
    for passage in passages:
        size = _FOLD_START
        mine = {size: _normalised_start(passage, size)}
        alike = by_start.get(mine[size], [])
        at = None
        while alike:
            if len(mine[size]) < size:  # the whole normalised text, and theirs are the same: a copy
                at = alike[0]
                break
            size *= 4
            mine[size] = _normalised_start(passage, size)
            alike = [index for index in alike if _start_of(shown[index], starts[index], size) == mine[size]]
        if at is None:
            by_start.setdefault(mine[_FOLD_START], []).append(len(shown))
            shown.append(passage)
            starts.append(mine)
        elif passage.memory not in shown[at].memories:
            shown[at] = replace(shown[at], also_in=(*shown[at].also_in, passage.memory))
    return shown


def at_most(answer: SearchAnswer, limit: int) -> SearchAnswer:
    """``answer`` with at most ``limit`` passages, the first ones: a server may send more than it was asked for.

    Apply it to passages in the order they are shown, so the best ones are the ones kept.
    """
    return answer if len(answer.passages) <= limit else replace(answer, passages=answer.passages[:limit])


def _start_of(passage: Passage, known: dict[int, str], size: int) -> str:
    if size not in known:
        known[size] = _normalised_start(passage, size)
    return known[size]


_FOLD_START = 256
"""How much of a passage's normalised text tells passages apart before any is read further."""


def _normalised(text: str) -> str:
    return " ".join(text.split())


def _normalised_start(passage: Passage, size: int) -> str:
    """The first ``size`` characters of the passage's whitespace-normalised text, reading little more.

    Shorter than ``size`` only when that is the whole normalised text. The normalised cleaned start of
    a text is a start of its normalised cleaned text (a word the cut splits is only a start of that
    word), so reading further only lengthens it.
    """
    content = passage.content
    if len(content) <= size:  # the usual passage: clean it whole, once (Passage.text keeps it for the budget)
        return _normalised(passage.text)[:size]
    read = size
    while True:
        head = content[:read]
        normal = _normalised(clean_text(head))
        if len(normal) >= size or len(head) == len(content):
            return normal[:size]
        read *= 4


def memory_entries(answer: SearchAnswer) -> list[MemoryEntry]:
    """The entries the manager injects: ``[Memory] passage``, then a notice per Memory that could not answer.

    A passage from several Memories starts with each of their names (``[Work] [Home] ...``) and its
    metadata lists them under ``memories``.
    """
    entries = [
        MemoryEntry(
            content=f"{p.label}{p.text}",
            metadata={"memory": p.memory, **p.metadata, **({"memories": list(p.memories)} if p.also_in else {})},
        )
        for p in answer.passages
    ]
    entries += [
        MemoryEntry(
            content=(
                f"[Membase notice] The Memory ({u.memory}) could not be searched: {u.reason}. Nothing from it is "
                "included, so its silence is not evidence that it holds nothing relevant."
            ),
            metadata={"memory": u.memory, "unsearched": True, "reason": u.reason},
        )
        for u in answer.unsearched
    ]
    return entries


CUT_MARKER = " [... cut: this passage is longer than the recall budget]"


def fit_to_budget(answer: SearchAnswer, limit: int | None) -> SearchAnswer:
    """Keep the passages that fit in ``limit`` characters (counting their ``[Memory]`` label), best first, each whole.

    A passage that does not fit in the room left is skipped, and smaller ones after it may still
    fit. Only when not even the best passage fits on its own is it cut, with a visible marker, so
    the budget never empties a recall. Memories that could not answer are always reported.
    """
    if limit is None:
        return answer
    kept: list[Passage] = []
    used = 0
    for passage in answer.passages:
        room = limit - used - len(passage.label)
        known: str | None = vars(passage).get("text")  # cleaned already (while folding), or not yet
        if known is not None:
            text, fits = known, 0 <= room and len(known) <= room
        else:
            text, fits = _clean_within(passage.content, room)
        if fits:
            vars(passage)["text"] = text  # what Passage.text computes; cleaned once, here
            kept.append(passage)
            used += len(passage.label) + len(text)
        elif not kept:
            room = max(0, limit - len(passage.label) - len(CUT_MARKER))
            cut = text[:room].rstrip() + CUT_MARKER
            kept.append(_with_text(replace(passage, content=cut, metadata={**passage.metadata, "cut": True}), cut))
            used = limit
    return replace(answer, passages=kept)


_CLEAN_STEP = 4096


def _clean_within(content: str, room: int) -> tuple[str, bool]:
    """The cleaned ``content`` and ``True`` if it is at most ``room`` characters long.

    Otherwise ``False`` and a cleaned start of it longer than ``room`` (or the whole cleaned text): the
    text beyond is never read.
    """
    if room < 0:
        return "", False
    if len(content) <= room:  # cleaning only ever removes characters
        return clean_text(content), True
    pieces: list[str] = []
    cleaned = read = 0
    while read < len(content) and cleaned <= room:
        step = max(room - cleaned + 1, _CLEAN_STEP)
        piece = clean_text(content[read : read + step])
        pieces.append(piece)
        cleaned += len(piece)
        read += step
    return "".join(pieces), read >= len(content) and cleaned <= room


def _with_text(passage: Passage, text: str) -> Passage:
    vars(passage)["text"] = text  # the cached value of Passage.text, known already
    return passage


def _clip_start(text: str, limit: int) -> str:
    """``clip(clean_text(text), limit)``, reading only as much of ``text`` as that needs.

    Folding a start of a text gives a start of the folded text; once that start is longer than
    ``limit``, the rest of the text cannot change what is kept.
    """
    read = 4 * limit
    while True:
        head = text[:read]
        cleaned = clean_text(head)
        if len(head) == len(text) or len(_normalised(cleaned)) > limit:
            return clip(cleaned, limit)
        read *= 4


def search_text(query: str, answer: SearchAnswer) -> str:
    """The ``membase_search`` tool's answer: numbered passages, what the floor left out, "Not searched"."""
    shown = clip(query, 120)
    lines: list[str] = []
    weaker = ""
    if answer.below_floor:
        count = answer.below_floor
        weaker = (
            f"{count} weaker passage{'s' if count != 1 else ''} scored below the relevance floor "
            f"(min_score={answer.floor:g}) and {'are' if count != 1 else 'is'} not shown"
        )
    if answer.passages:
        count = len(answer.passages)
        lines.append(f'Membase found {count} passage{"s" if count != 1 else ""} for "{shown}":')
        lines += _numbered(answer.passages)
        if weaker:
            lines += ["", f"({weaker}.)"]
    elif weaker:
        lines.append(f'Nothing matched "{shown}" above the relevance floor: {weaker}.')
    elif answer.unsearched:
        lines.append(f'Nothing matched "{shown}" in the Memories that answered.')
    else:
        lines.append(f'Nothing in Membase matched "{shown}".')
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
        limit: The recall budget in characters; a longer answer is cut at a line, with a marker.

    Raises:
        BadResponseError: The answer is not a JSON object.
    """
    if not isinstance(body, dict):
        raise BadResponseError("the profile answer is not an object")
    standing = [fact for fact in (_fact_text(item) for item in _as_list(body.get("static"))) if fact]
    recent = [fact for fact in (_fact_text(item) for item in _as_list(body.get("dynamic"))) if fact]
    topical = parse_search({"results": _as_list(body.get("results"))}).passages if topic else []
    topical = fit_to_budget(SearchAnswer(passages=topical, unsearched=[]), limit).passages

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
