"""Local Membase: one engine per directory in a process, and one process per directory.

The engine keeps its search index in memory and writes it back: two engines on one directory (in one process or two)
overwrite each other's index, and saved notes stop being found. So a process opens a directory once for all its
stores, locked (the file :data:`LOCK_NAME` in it) while any uses it; the lock goes when the process ends, or crashes."""

from __future__ import annotations

import os
import sys
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import IO

import membase

LOCK_NAME = ".membase-strands.lock"

_Opened = tuple[membase.Membase, IO[str]]
_open: dict[Path, tuple[Future[_Opened], list[int]]] = {}  # directory -> engine, users
_lock = threading.Lock()


def _reset_after_fork() -> None:
    global _lock
    _lock = threading.Lock()  # one a parent's thread held would stay held
    _open.clear()  # a forked child's engines are its own: the parent's hold the parent's lock on the directory


if hasattr(os, "register_at_fork"):  # not on Windows, which has no fork
    os.register_at_fork(after_in_child=_reset_after_fork)


def directory_of(local: str | os.PathLike[str] | bool) -> Path:
    """The directory ``local`` names (``True``: the engine's default); ``ValueError`` if it is a file."""
    path = Path("~/.membase" if local is True else os.fspath(local)).expanduser().resolve()  # type: ignore[arg-type]
    if path.exists() and not path.is_dir():
        raise ValueError(f"local: {os.fspath(path)!r} is a file; pass the directory local Membase keeps its memory in")
    return path


def open_engine(directory: Path) -> membase.Membase:
    """This process's engine for ``directory``, opened (and the directory locked) by its first user.
    ``RuntimeError`` when another process holds the directory; ``membase.MissingDependencyError`` when it cannot run."""
    with _lock:
        first = directory not in _open
        opened, users = _open.setdefault(directory, (Future(), [0]))
        users[0] += 1
    if first:
        try:
            opened.set_result(_start(directory))
        except BaseException as error:
            with _lock:
                del _open[directory]  # the next user tries again
            opened.set_exception(error)
    return opened.result()[0]


def close_engine(directory: Path) -> None:
    """One user less of ``directory``'s engine; the last closes it and lets go of the directory."""
    with _lock:
        opened, users = _open[directory]
        users[0] -= 1
        if users[0]:
            return
        del _open[directory]
    engine, lock_file = opened.result()
    try:
        engine.close()
    finally:
        lock_file.close()  # lets go of the lock


def _start(directory: Path) -> _Opened:
    directory.mkdir(parents=True, exist_ok=True)
    lock_file = (directory / LOCK_NAME).open("a+")
    try:
        try:
            if sys.platform == "win32":
                import msvcrt

                msvcrt.locking(lock_file.fileno(), msvcrt.LK_NBLCK, 1)
            else:
                import fcntl

                fcntl.flock(lock_file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)  # this process's, or OSError at once
        except OSError:
            lock_file.seek(0)
            raise RuntimeError(
                f"local Membase in {os.fspath(directory)!r} is in use by another process (pid "
                f"{lock_file.read().strip() or 'unknown'}); its engine serves one process per directory. For several "
                "processes or workers, use hosted Membase (an API key), or route each user to one worker."
            ) from None
        lock_file.truncate(0)  # in append mode the pid is written at the end, which is now the start
        lock_file.write(str(os.getpid()))
        lock_file.flush()
        try:
            return membase.Membase(local=directory), lock_file
        except membase.MissingDependencyError as error:  # the SDK names its own package, not this one's extra
            raise membase.MissingDependencyError(unavailable()) from error
    except BaseException:
        lock_file.close()
        raise


def unavailable() -> str:
    """What to do when local Membase cannot start here."""
    if sys.version_info < (3, 12):
        return (
            f"local Membase needs Python 3.12+; this is Python {sys.version_info[0]}.{sys.version_info[1]}. "
            "With a key (MEMBASE_API_KEY), hosted Membase works on Python 3.10+."
        )
    return 'local Membase needs its engine: pip install "membase-strands[local]"'
