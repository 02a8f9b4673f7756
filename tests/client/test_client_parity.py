"""The synchronous and the asyncio client have the same API: the same methods, arguments and results.

``mqds.client.Client`` is generated from ``mqds.client.aio.Client``
(``client/generate_sync.py``), and so is the share-group member; the objects
written by hand in each driver (push subscriptions, pipelined-call futures,
the routers under the clients) are twins with the same names.
Each pair of twins is compared with :mod:`inspect`: the same public names;
for each, the same parameters (names, kinds, defaults, annotations) and the
same result, where the asyncio side may say ``Awaitable[X]`` for ``X``,
``AsyncIterator`` for ``Iterator`` and ``AsyncX`` for the twin ``X``; and the
asyncio one a coroutine (or an async iterator) wherever the synchronous one
waits for the network. The few differences that are meant are listed below,
each with why; a listed one that is no longer a difference fails too, so the
lists stay as short as they can be.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import re
from concurrent import futures
from typing import Any

import pytest

import mqds.client
from mqds.client import aio

# (synchronous, asyncio): where each lives, as "module:Class".
TWINS = [
    ("mqds.client:Client", "mqds.client.aio:Client"),
    ("mqds.client:Subscription", "mqds.client.aio:AsyncSubscription"),
    ("mqds.client:SharedSubscription", "mqds.client.aio:AsyncSharedSubscription"),
    ("mqds.client.sync.routing:Router", "mqds.client.aio:AsyncRouter"),
    ("mqds.client.sync.handles:StoreFuture", "mqds.client.aio.handles:AsyncStoreFuture"),
]

# The futures are a concurrent.futures.Future and an asyncio.Future: what those standard classes offer differs
# by design (result(timeout) and a thread's wait, or await and the loop's callbacks), so only what the mqds
# classes add to them is compared.
STANDARD_BASES: dict[str, type] = {
    "mqds.client.sync.handles:StoreFuture": futures.Future,
    "mqds.client.aio.handles:AsyncStoreFuture": asyncio.Future,
}

# The protocols' methods, by the name each side gives them.
PROTOCOL_TWINS = {"__enter__": "__aenter__", "__exit__": "__aexit__", "__iter__": "__aiter__"}

# Names only one side has, on purpose.
ONE_SIDED = {
    ("mqds.client.sync.routing:Router", "submit"): (
        "the thread pool the blocking router fans out on; asyncio makes tasks"
    ),
    ("mqds.client.sync.handles:StoreFuture", "wait"): (
        "a thread blocks until the call is done, or a timeout; asyncio code awaits the future itself"
    ),
    ("mqds.client.aio.handles:AsyncStoreFuture", "create"): (
        "an asyncio.Future is made for its loop first, then given the call; StoreFuture's constructor does both"
    ),
}

# Methods of both sides that wait for nothing (they answer from memory, or only open a channel that connects
# in the background): plain functions on the asyncio side too.
NO_IO = {"pipeline_stats", "channel", "failed_with"}


def resolve(where: str) -> type:
    module_name, _, name = where.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        pytest.fail(f"{where}: {err}")
    found = getattr(module, name, None)
    if not isinstance(found, type):
        pytest.fail(f"{module_name} has no class {name}")
    return found


def public_names(where: str, cls: type, *, asyncio_side: bool) -> set[str]:
    """The names compared: public ones, the constructor and the protocols' methods (by their sync names)."""
    base = STANDARD_BASES.get(where)
    standard = set(dir(base)) if base is not None else set()
    protocols = {a if asyncio_side else s: s for s, a in PROTOCOL_TWINS.items()}
    names = set()
    for name in dir(cls):
        if name in standard:
            continue
        if not name.startswith("_") or name == "__init__":
            names.add(name)
        elif name in protocols:
            names.add(protocols[name])
    return names


def member(cls: type, name: str, *, asyncio_side: bool) -> Any:
    return inspect.getattr_static(cls, PROTOCOL_TWINS.get(name, name) if asyncio_side else name)


def _unwrap(text: str, wrapper: str) -> str:
    """``text`` with every ``wrapper[X]`` replaced by ``X``."""
    while found := re.search(rf"\b{wrapper}\[", text):
        start, depth, i = found.start(), 0, found.end() - 1
        while True:
            depth += {"[": 1, "]": -1}.get(text[i], 0)
            if depth == 0:
                break
            i += 1
        text = text[:start] + text[found.end() : i] + text[i + 1 :]
    return text


def spelling(annotation: Any, *, asyncio_side: bool) -> str:
    """An annotation as the sync side would write it (``Awaitable[X]``: ``X``, ``AsyncX``: ``X``)."""
    text = "" if annotation is inspect.Parameter.empty else str(annotation)
    text = re.sub(r"\b(collections\.abc|typing)\.", "", text)  # an annotation evaluated, not a string
    if asyncio_side:
        text = re.sub(r"\bAsync(?=[A-Z])", "", _unwrap(text, "Awaitable")).replace("grpc.aio.", "grpc.")
    else:
        text = re.sub(r"\bSyncIterator\b", "Iterator", text)  # collections.abc's, named apart from model.Iterator
    return text


def function_of(attribute: Any) -> Any:
    if isinstance(attribute, classmethod | staticmethod):
        return attribute.__func__
    if isinstance(attribute, property):
        return attribute.fget
    return attribute


def shape(fn: Any, *, asyncio_side: bool) -> list[tuple[str, str, str, str]]:
    """Each parameter's name, kind, default and annotation, then the result's annotation."""
    sig = inspect.signature(fn)
    params = [
        (p.name, p.kind.name, repr(p.default), spelling(p.annotation, asyncio_side=asyncio_side))
        for p in sig.parameters.values()
    ]
    return [*params, ("->", "", "", spelling(sig.return_annotation, asyncio_side=asyncio_side))]


def is_async(fn: Any) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn)


def twins() -> list[Any]:
    return [pytest.param(s, a, id=s.rpartition(":")[2]) for s, a in TWINS]


def one_sided(where: str) -> set[str]:
    return {name for (owner, name) in ONE_SIDED if owner == where}


@pytest.mark.parametrize(("sync_where", "async_where"), twins())
def test_the_twins_have_the_same_public_names(sync_where: str, async_where: str) -> None:
    sync_names = public_names(sync_where, resolve(sync_where), asyncio_side=False) - one_sided(sync_where)
    async_names = public_names(async_where, resolve(async_where), asyncio_side=True) - one_sided(async_where)
    assert not sync_names - async_names, f"{async_where} lacks {sorted(sync_names - async_names)}"
    assert not async_names - sync_names, f"{sync_where} lacks {sorted(async_names - sync_names)}"


@pytest.mark.parametrize(("sync_where", "async_where"), twins())
def test_each_twin_method_takes_the_same_arguments_and_gives_the_same_result(sync_where: str, async_where: str) -> None:
    sync_cls, async_cls = resolve(sync_where), resolve(async_where)
    common = public_names(sync_where, sync_cls, asyncio_side=False) & public_names(
        async_where, async_cls, asyncio_side=True
    )
    differ = []
    for name in sorted(common):
        s = member(sync_cls, name, asyncio_side=False)
        a = member(async_cls, name, asyncio_side=True)
        if s is a:
            continue  # one definition, from a base both share
        if type(s) is not type(a):
            differ.append(f"{name}: a {type(s).__name__} here, a {type(a).__name__} there")
            continue
        s_fn, a_fn = function_of(s), function_of(a)
        if not callable(s_fn):
            continue  # a slot: only its name counts
        sync_shape, async_shape = shape(s_fn, asyncio_side=False), shape(a_fn, asyncio_side=True)
        if sync_shape != async_shape:
            differ.append(f"{name}{inspect.signature(s_fn)} != {name}{inspect.signature(a_fn)}")
    assert not differ, f"{sync_where} and {async_where} differ:\n" + "\n".join(differ)


@pytest.mark.parametrize(("sync_where", "async_where"), twins())
def test_the_asyncio_twin_is_async_wherever_the_sync_one_waits_for_the_network(
    sync_where: str, async_where: str
) -> None:
    sync_cls, async_cls = resolve(sync_where), resolve(async_where)
    common = public_names(sync_where, sync_cls, asyncio_side=False) & public_names(
        async_where, async_cls, asyncio_side=True
    )
    wrong = []
    for name in sorted(common - {"__init__", "__iter__"}):  # a constructor, and __aiter__ hands out the iterator
        s = member(sync_cls, name, asyncio_side=False)
        a = member(async_cls, name, asyncio_side=True)
        if s is a or isinstance(s, property) or not callable(function_of(s)):
            continue
        s_fn, a_fn = function_of(s), function_of(a)
        if is_async(s_fn):
            wrong.append(f"{name} is a coroutine in the synchronous {sync_where}")
        elif name in NO_IO and is_async(a_fn):
            wrong.append(f"{name} waits for nothing, yet is a coroutine in {async_where}")
        elif name not in NO_IO and not is_async(a_fn):
            wrong.append(f"{name} does I/O, yet {async_where}.{name} is not a coroutine or an async iterator")
    assert not wrong, "\n".join(wrong)


def test_every_class_the_asyncio_module_exports_has_a_checked_sync_twin_exported_alike() -> None:
    pairs = {resolve(a): resolve(s) for s, a in TWINS}
    exported = [getattr(aio, name) for name in aio.__all__ if isinstance(getattr(aio, name), type)]
    assert not [cls for cls in exported if cls not in pairs], "an asyncio class without a twin in TWINS"
    # A synchronous twin mqds.client exports has its asyncio twin exported by mqds.client.aio.
    for sync_cls, async_cls in ((resolve(s), resolve(a)) for s, a in TWINS):
        if sync_cls in vars(mqds.client).values() and sync_cls.__name__ in mqds.client.__all__:
            assert async_cls in exported, f"mqds.client.aio does not export the twin of {sync_cls.__name__}"


def test_the_tables_of_deliberate_differences_name_only_real_differences() -> None:
    sides = {where: (s, a) for s, a in TWINS for where in (s, a)}
    for (where, name), why in ONE_SIDED.items():
        sync_where, async_where = sides[where]
        other = async_where if where == sync_where else sync_where
        mine = public_names(where, resolve(where), asyncio_side=where == async_where)
        theirs = public_names(other, resolve(other), asyncio_side=other == async_where)
        assert name in mine and name not in theirs, f"{where}.{name} is listed as one-sided ({why}) but is not"
    for name in NO_IO:
        assert any(name in public_names(a, resolve(a), asyncio_side=True) for _, a in TWINS), (
            f"{name} is listed as doing no I/O but no twin has it"
        )
