"""The pysyncobj adapter (raft/pysyncobj_adapter.py) against the installed pysyncobj.

An upgrade of pysyncobj must fail here, in one place, before it fails a
Raft group in some subtler way: the version is the one the adapter was
checked against, pyproject.toml pins it, and every private name the adapter
relies on still exists with the kind it expects.
"""

from __future__ import annotations

import importlib.metadata
import tomllib
from collections.abc import Iterator
from typing import Any

import pysyncobj.syncobj
import pysyncobj.version
import pytest
from pysyncobj import SyncObj, SyncObjConf
from pysyncobj.transport import Transport
from repo_paths import ROOT

from mqds.server.raft import pysyncobj_adapter as adapter


class _Ready(Transport):
    """A transport that needs nothing to get ready, and sends nowhere."""

    def __init__(self) -> None:
        super().__init__(None, None, None)

    @property
    def ready(self) -> bool:
        return True

    def send(self, node: Any, message: Any) -> bool:
        return True


@pytest.fixture(scope="module")
def fresh() -> Iterator[Any]:
    """A plain pysyncobj SyncObj, as the library makes it (not the adapter's subclass)."""
    obj = SyncObj("self:1", [], SyncObjConf(autoTick=False), transport=_Ready())
    yield obj
    obj.destroy()


def test_the_installed_pysyncobj_is_the_one_checked_and_pinned() -> None:
    assert pysyncobj.version.VERSION == adapter.CHECKED_VERSION
    assert importlib.metadata.version("pysyncobj") == adapter.CHECKED_VERSION
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert f"pysyncobj=={adapter.CHECKED_VERSION}" in project["dependencies"]


def test_another_version_is_refused_naming_the_checked_one() -> None:
    adapter.check_version(adapter.CHECKED_VERSION)
    with pytest.raises(RuntimeError, match=rf"checked against pysyncobj {adapter.CHECKED_VERSION}.*0\.4\.0"):
        adapter.check_version("0.4.0")


@pytest.mark.parametrize("name", adapter.MANGLED_ATTRIBUTES)
def test_each_private_field_is_a_field_of_a_fresh_syncobj(fresh: Any, name: str) -> None:
    mangled = f"_SyncObj__{name}"
    assert mangled in vars(fresh), f"pysyncobj no longer sets {mangled} on a SyncObj"
    assert not callable(vars(fresh)[mangled])


@pytest.mark.parametrize("name", adapter.MANGLED_METHODS)
def test_each_private_method_is_a_method_of_syncobj(name: str) -> None:
    mangled = f"_SyncObj__{name}"
    assert callable(vars(SyncObj).get(mangled)), f"pysyncobj's SyncObj has no method {mangled}"


def test_every_private_override_of_the_adapter_replaces_a_method_of_syncobj() -> None:
    overrides = [name for name in vars(adapter.RaftCore) if name.startswith("_SyncObj__")]
    assert overrides  # applyLogEntries, doApplyCommand, parseChangeClusterRequest (and a field's default)
    for name in overrides:
        assert name in vars(SyncObj) or name.removeprefix("_SyncObj__") in adapter.MANGLED_ATTRIBUTES, name
        if callable(vars(adapter.RaftCore)[name]):
            assert callable(vars(SyncObj)[name]), name


@pytest.mark.parametrize("name", adapter.PROTECTED_METHODS + adapter.PUBLIC_METHODS)
def test_each_method_called_is_a_method_of_syncobj(name: str) -> None:
    assert callable(getattr(SyncObj, name, None)), f"pysyncobj's SyncObj has no method {name}"


@pytest.mark.parametrize("name", adapter.PUBLIC_PROPERTIES)
def test_each_property_read_is_a_property_of_syncobj(name: str) -> None:
    assert isinstance(getattr(SyncObj, name, None), property), f"pysyncobj's SyncObj.{name} is not a property"


@pytest.mark.parametrize("name", adapter.TRANSPORT_METHODS)
def test_each_transport_hand_in_is_a_method_of_transport(name: str) -> None:
    assert callable(getattr(Transport, name, None)), f"pysyncobj's Transport has no method {name}"


def test_the_status_holds_the_keys_read(fresh: Any) -> None:
    status = fresh.getStatus()
    for key in adapter.STATUS_KEYS:
        assert key in status, key


def test_the_patched_module_globals_exist_and_are_patched() -> None:
    for name in adapter.PATCHED_GLOBALS:
        assert hasattr(pysyncobj.syncobj, name), name
    assert pysyncobj.syncobj.PIPE_NOTIFIER_ENABLED is False
    assert pysyncobj.syncobj.createJournal is not adapter._original_create_journal


def test_the_adapter_is_the_only_subclass_of_syncobj() -> None:
    import mqds.server.raft.group  # noqa: F401  (every part of a group imported)

    def subclasses(cls: type) -> set[type]:
        found = set(cls.__subclasses__())
        for sub in list(found):
            found |= subclasses(sub)
        return found

    ours = {c for c in subclasses(SyncObj) if c.__module__.startswith("mqds")}
    assert ours == {adapter.RaftCore}


def test_pysyncobj_reads_its_clock_through_the_alias_the_raft_clock_replaces() -> None:
    """raft/clock.py points ``pysyncobj.syncobj.monotonicTime`` at the Raft clock, so a simulation's
    clock drives pysyncobj's election deadlines and heartbeats too. A release that read the time
    another way would leave the simulation's groups on the real clock, silently: fail here instead."""
    from mqds.server.raft import clock

    assert pysyncobj.syncobj.monotonicTime is clock.now
    names = {name: getattr(getattr(member, "__code__", None), "co_names", ()) for name, member in vars(SyncObj).items()}
    readers = {name for name, used in names.items() if "monotonicTime" in used}
    assert {"_onTick", "_SyncObj__onMessageReceived", "_SyncObj__sendAppendEntries"} <= readers, readers
    others = [name for name, used in names.items() if "monotonic" in used]
    assert not others, f"SyncObj.{others} read a clock other than monotonicTime"
