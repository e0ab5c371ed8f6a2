"""The package as it is installed: its public names, modules, metadata, command and type marker, and the store as the
Strands ``MemoryManager`` sees it."""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.resources
import inspect
import re
from pathlib import Path

from packaging.requirements import Requirement
from strands.memory import MemoryManager, MemoryStore
from strands.memory.types import _has_method, _has_write_sink

import membase_strands
from membase_strands import MembaseMemoryStore, check

DOCUMENTED = {"MembaseMemoryStore", "MembaseAccessError", "MembaseRecallTimeout", "__version__", "injection_config"}
PUBLIC_MODULES = {"check", "errors", "injection", "pool", "store", "testing"}  # every other module's name starts "_"
ROOT = Path(__file__).resolve().parents[1]


def test_all_is_the_documented_names_and_public_classes_of_this_package_and_a_star_import_gives_exactly_it():
    exported = set(membase_strands.__all__)
    assert DOCUMENTED <= exported and len(membase_strands.__all__) == len(exported)
    for name in exported - DOCUMENTED:  # never a private helper, nor a name re-exported from strands or membase
        value = getattr(membase_strands, name)
        assert inspect.isclass(value) and value.__module__.startswith("membase_strands.") and value.__doc__, name
    assert membase_strands.injection_config.__module__ == "membase_strands.injection"
    namespace: dict[str, object] = {}
    exec("from membase_strands import *", namespace)  # noqa: S102
    assert set(namespace) - {"__builtins__"} == exported


def test_the_public_private_line_is_visible_in_module_names_and_each_module_says_what_it_is_for():
    package = Path(membase_strands.__file__).parent
    modules = {path.stem for path in package.glob("*.py")} | {path.name for path in package.iterdir() if path.is_dir()}

    assert {name for name in modules if not name.startswith("_")} == PUBLIC_MODULES
    for name in PUBLIC_MODULES:
        assert importlib.import_module(f"membase_strands.{name}").__doc__, name
    assert membase_strands.__doc__ and "MembaseMemoryStore" in membase_strands.__doc__


def test_the_distribution_has_the_version_dependencies_command_and_type_marker_it_says():
    assert membase_strands.__version__ == importlib.metadata.version("membase-strands")
    requires = [Requirement(text) for text in importlib.metadata.requires("membase-strands") or []]
    assert {"strands-agents", "unibaseio-membase"} <= {req.name for req in requires if req.marker is None}
    # The engine runs on 3.12+ only: below, the local extra installs nothing, and the check and the store say why.
    on_312 = {"extra": "local", "python_version": "3.12"}
    [local] = [req for req in requires if req.marker is not None and req.marker.evaluate(on_312)]
    assert (local.name, local.extras) == ("unibaseio-membase", {"local"})
    assert not local.marker.evaluate({"extra": "local", "python_version": "3.11"})
    assert not local.marker.evaluate({"extra": "", "python_version": "3.13"})
    [command] = importlib.metadata.entry_points(group="console_scripts", name="membase-strands")
    assert command.load() is check.main
    assert importlib.resources.files("membase_strands").joinpath("py.typed").is_file()


def test_the_store_is_a_memory_store_as_the_manager_checks_one(make_store):
    for method in ("search", "add", "add_messages", "initialize", "get_tools"):
        ours, theirs = getattr(MembaseMemoryStore, method), getattr(MemoryStore, method)
        assert inspect.iscoroutinefunction(ours) == inspect.iscoroutinefunction(theirs), method
        assert list(inspect.signature(ours).parameters) == list(inspect.signature(theirs).parameters), method
        assert _has_method(make_store(), method), method
    fields = {name for name in MemoryStore.__annotations__ if not name.startswith("_")}
    assert fields == set("name description max_search_results writable extraction".split())
    capturing = make_store(capture=True, extraction=True)
    assert _has_write_sink(capturing) and capturing.writable
    assert "add_memory" in [tool.tool_name for tool in MemoryManager(stores=[capturing], add_tool_config=True).tools]


def test_nothing_outside_the_store_reaches_into_a_stores_private_attributes():
    sources = [*(ROOT / "src" / "membase_strands").rglob("*.py"), *(ROOT / "examples").glob("*.py")]
    sources += [*(ROOT / "benchmarks").rglob("*.py")]
    reaching_in = re.compile(r"\b(store|stores?\[\w*\]|pool\.store_for\([^)]*\))\._[a-z]")
    offenders = [
        f"{path.relative_to(ROOT)}:{number}"
        for path in sources
        if path.name != "store.py"
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1)
        if reaching_in.search(line)
    ]
    assert offenders == []
