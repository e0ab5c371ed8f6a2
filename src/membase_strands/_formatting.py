"""What the model reads: Membase answers turned into memory entries and tool text.

Everything that comes from Membase (Memory names, passages, a server's error text) is treated as
data. Names are folded onto one line and cannot close the brackets that frame them; passages
lose control characters and unpaired surrogates; a Memory that could not answer becomes a clearly
framed notice, never text that reads like a remembered fact.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field, replace
from typing import Any

from strands.memory import MemoryEntry

from ._text import clip, sendable
from .errors import BadResponseError

_NAME_LIMIT = 80
_REASON_LIMIT = 200
_BRACKETS = str.maketrans({"[": "(", "]": ")"})
# C0 controls but newline and tab, DEL, and the C1 controls (terminal escapes such as CSI U+009B).
_NEEDS_CLEANING = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\ud800-\udfff]")
_DROP = {c: None for c in [*range(32), *range(0x7F, 0xA0)] if chr(c) not in "\n\t"}


@dataclass(frozen=True)
class Passage:
    """One passage Membase returned, with the Memory it came from."""

    memory: str
    text: str
    metadata: dict[str, Any] = field(default_factory=dict)


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


@functools.lru_cache(maxsize=1024)  # the same few Memory names come back on every search
def memory_label(name: str) -> str:
    """A Memory name fit to stand inside ``[...]``: one line, no brackets, at most 80 characters."""
    return clip(clean_text(name), _NAME_LIMIT).translate(_BRACKETS) or "unnamed Memory"


def clean_text(text: str) -> str:
    """Text without control characters (newlines and tabs stay) or unpaired surrogates."""
    if not _NEEDS_CLEANING.search(text):  # the common case, on the recall hot path
        return text
    return sendable(text).translate(_DROP)


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
        if not isinstance(hit, dict) or not isinstance(hit.get("content"), str) or not hit["content"].strip():
            continue
        container = hit.get("container") if isinstance(hit.get("container"), str) else None
        name = hit.get("container_name") or (names.get(container) if container else None) or container or "Membase"
        metadata = {key: value for key, value in hit.items() if key != "content"}
        passages.append(Passage(memory=memory_label(str(name)), text=clean_text(hit["content"]), metadata=metadata))

    unsearched = [
        Unsearched(
            memory=memory_label(str(row.get("name") or row.get("id") or "unnamed Memory")),
            reason=clip(clean_text(str(row["error"])), _REASON_LIMIT) or "no reason given",
        )
        for row in rows
        if row.get("error")
    ]
    none_answered = bool(rows) and len(unsearched) == len(rows) and not passages
    return SearchAnswer(passages=passages, unsearched=unsearched, none_answered=none_answered)


def at_most(answer: SearchAnswer, limit: int) -> SearchAnswer:
    """``answer`` with at most ``limit`` passages, the first ones: a server may send more than it was asked for.

    Apply it to passages in the order they are shown, so the best ones are the ones kept.
    """
    return answer if len(answer.passages) <= limit else replace(answer, passages=answer.passages[:limit])


def memory_entries(answer: SearchAnswer) -> list[MemoryEntry]:
    """The entries the manager injects: ``[Memory] passage``, then a notice per Memory that could not answer."""
    entries = [
        MemoryEntry(content=f"[{p.memory}] {p.text}", metadata={"memory": p.memory, **p.metadata})
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
        size = len(passage.memory) + 3 + len(passage.text)
        if used + size <= limit:
            kept.append(passage)
            used += size
        elif not kept:
            room = max(0, limit - len(passage.memory) - 3 - len(CUT_MARKER))
            cut = passage.text[:room].rstrip() + CUT_MARKER
            kept.append(Passage(memory=passage.memory, text=cut, metadata={**passage.metadata, "cut": True}))
            used = limit
    return SearchAnswer(passages=kept, unsearched=answer.unsearched, none_answered=answer.none_answered)


def search_text(query: str, answer: SearchAnswer) -> str:
    """The ``membase_search`` tool's answer: numbered passages and a "Not searched" list."""
    shown = clip(query, 120)
    lines: list[str] = []
    if answer.passages:
        count = len(answer.passages)
        lines.append(f'Membase found {count} passage{"s" if count != 1 else ""} for "{shown}":')
        lines += _numbered(answer.passages)
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
    return [f"{i}. [{p.memory}] " + p.text.replace("\n", "\n   ") for i, p in enumerate(passages, start=1)]


def _as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _fact_text(item: Any) -> str:
    if isinstance(item, dict):
        item = item.get("content") or item.get("description") or item.get("text")
    return clean_text(item).strip() if isinstance(item, str) else ""
