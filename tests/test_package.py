"""The public API, the package metadata, and the store as the Strands MemoryManager sees it."""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.resources
import inspect
import re
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from strands.memory import MemoryManager, MemoryStore
from strands.memory.types import _has_method, _has_write_sink

import membase_strands
from membase_strands import MembaseAccessError, MembaseMemoryStore, MembaseRecallTimeout, check
from membase_strands.testing import InMemoryMembase

DOCUMENTED = {"MembaseMemoryStore", "MembaseAccessError", "MembaseRecallTimeout", "__version__", "injection_config"}


def test_public_api_exports_the_documented_names() -> None:
    exported = set(membase_strands.__all__)
    assert DOCUMENTED <= exported
    assert len(membase_strands.__all__) == len(exported)  # no name listed twice
    assert membase_strands.MembaseMemoryStore is MembaseMemoryStore
    assert membase_strands.MembaseAccessError is MembaseAccessError
    assert membase_strands.MembaseRecallTimeout is MembaseRecallTimeout
    assert membase_strands.injection_config.__module__ == "membase_strands.injection"
    assert membase_strands.injection_config.__doc__


def test_every_exported_name_is_a_documented_public_object_of_this_package() -> None:
    # Anything beyond the documented names must be a public class of membase_strands itself,
    # never a private helper or something re-exported from strands or membase.
    for name in set(membase_strands.__all__) - DOCUMENTED:
        assert not name.startswith("_"), name
        value = getattr(membase_strands, name)
        assert inspect.isclass(value), name
        assert value.__module__.startswith("membase_strands."), name
        assert value.__doc__, name


PUBLIC_MODULES = {"check", "errors", "injection", "pool", "store", "testing"}
"""The submodules users may import; every other module is private (its name starts with ``_``)."""


def test_the_public_private_line_is_visible_in_module_names() -> None:
    package = Path(membase_strands.__file__).parent
    modules = {path.stem for path in package.glob("*.py")} | {path.name for path in package.iterdir() if path.is_dir()}
    public = {name for name in modules if not name.startswith("_") and name != "__pycache__"}

    assert public == PUBLIC_MODULES
    for name in PUBLIC_MODULES:
        assert importlib.import_module(f"membase_strands.{name}").__doc__, f"{name} says what it is for"


def test_star_import_gives_exactly_all() -> None:
    namespace: dict[str, object] = {}
    exec("from membase_strands import *", namespace)
    assert {name for name in namespace if name != "__builtins__"} == set(membase_strands.__all__)
    assert namespace["__version__"] == membase_strands.__version__


def test_version_matches_the_installed_distribution() -> None:
    assert isinstance(membase_strands.__version__, str)
    assert membase_strands.__version__ == importlib.metadata.version("membase-strands")


def test_the_distribution_declares_its_dependencies() -> None:
    requires = importlib.metadata.requires("membase-strands") or []
    names = {req.split(";")[0].split("[")[0].split(">")[0].split("<")[0].split("=")[0].strip() for req in requires}
    assert {"strands-agents", "unibaseio-membase"} <= names


def test_the_local_extra_installs_the_engine_only_on_python_3_12_and_later() -> None:
    # The engine runs on 3.12+ only: below, the extra installs nothing, and the check and the store say why.
    requires = [Requirement(text) for text in importlib.metadata.requires("membase-strands") or []]
    on_3_12 = {"extra": "local", "python_version": "3.12"}
    [local] = [req for req in requires if req.marker is not None and req.marker.evaluate(on_3_12)]

    assert (local.name, local.extras) == ("unibaseio-membase", {"local"})
    assert not local.marker.evaluate({"extra": "local", "python_version": "3.11"})
    assert local.marker.evaluate({"extra": "local", "python_version": "3.12"})
    assert not local.marker.evaluate({"extra": "", "python_version": "3.13"})  # only with [local]


def test_the_membase_strands_command_runs_the_setup_check() -> None:
    [command] = importlib.metadata.entry_points(group="console_scripts", name="membase-strands")
    assert command.load() is check.main


def test_py_typed_ships_in_the_package() -> None:
    marker = importlib.resources.files("membase_strands").joinpath("py.typed")
    assert marker.is_file()


def test_the_package_has_a_docstring() -> None:
    assert membase_strands.__doc__ and "MembaseMemoryStore" in membase_strands.__doc__


# --- The MemoryStore protocol as the manager uses it ------------------------------------------------


@pytest.fixture
def store(fake: InMemoryMembase, make_store) -> MembaseMemoryStore:
    return make_store()


def test_store_has_the_protocol_attributes(store: MembaseMemoryStore) -> None:
    attributes = {name for name in MemoryStore.__annotations__ if not name.startswith("_")}
    assert attributes == {"name", "description", "max_search_results", "writable", "extraction"}
    for name in attributes:
        assert hasattr(store, name), name
    assert store.name == "membase"
    assert isinstance(store.description, str) and store.description
    assert store.max_search_results == 5
    assert store.writable is False
    assert store.extraction is None


def test_store_methods_match_the_protocol_signatures() -> None:
    for method in ("search", "add", "add_messages", "initialize", "get_tools"):
        ours = getattr(MembaseMemoryStore, method)
        theirs = getattr(MemoryStore, method)
        assert inspect.iscoroutinefunction(ours) == inspect.iscoroutinefunction(theirs), method
        assert list(inspect.signature(ours).parameters) == list(inspect.signature(theirs).parameters), method


def test_the_manager_sees_every_method_as_implemented(store: MembaseMemoryStore) -> None:
    for method in ("search", "add", "add_messages", "initialize", "get_tools"):
        assert _has_method(store, method), method
    assert _has_write_sink(store)


def test_the_manager_accepts_a_read_only_store(store: MembaseMemoryStore) -> None:
    manager = MemoryManager(stores=[store])
    names = [tool.tool_name for tool in manager.tools]
    assert names == ["search_memory", "membase_search", "membase_save", "membase_profile"]
    [search_memory] = [tool for tool in manager.tools if tool.tool_name == "search_memory"]
    assert store.description in search_memory.tool_spec["description"]


def test_the_manager_refuses_its_add_tool_on_a_read_only_store(store: MembaseMemoryStore) -> None:
    with pytest.raises(ValueError, match="no writable stores"):
        MemoryManager(stores=[store], add_tool_config=True)


def test_the_manager_accepts_a_capturing_store_with_extraction_and_the_add_tool(make_store) -> None:
    store = make_store(capture=True, extraction=True)
    assert store.writable is True
    manager = MemoryManager(stores=[store], add_tool_config=True)
    assert "add_memory" in [tool.tool_name for tool in manager.tools]


def test_two_stores_with_different_names_share_one_manager(fake: InMemoryMembase, make_store) -> None:
    first = make_store(name="work", tools=("search",))
    second = make_store(name="home", tools=())
    manager = MemoryManager(stores=[first, second])
    assert [tool.tool_name for tool in manager.tools] == ["search_memory", "membase_search"]


async def test_the_manager_searches_the_store(fake: InMemoryMembase, store: MembaseMemoryStore) -> None:
    fake.remember("We chose Postgres for the ledger.")
    manager = MemoryManager(stores=[store])
    entries = await manager.search("ledger")
    assert [(e.store_name, e.content) for e in entries] == [("membase", "[Main] We chose Postgres for the ledger.")]
    [sent] = fake.sent("POST", "/v1/search")
    assert sent.body["limit"] == 5


def test_nothing_outside_the_store_reaches_into_a_stores_private_attributes() -> None:
    root = Path(__file__).resolve().parents[1]
    sources = [
        *(root / "src" / "membase_strands").rglob("*.py"),
        *(root / "examples").glob("*.py"),
        *(root / "benchmarks").rglob("*.py"),
    ]
    reaching_in = re.compile(r"\b(store|stores?\[\w*\]|pool\.store_for\([^)]*\))\._[a-z]")
    offenders = [
        f"{path.relative_to(root)}:{number}"
        for path in sources
        if path.name != "store.py"
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1)
        if reaching_in.search(line)
    ]
    assert offenders == []
