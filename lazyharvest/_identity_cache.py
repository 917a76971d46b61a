"""A cache of results about objects (jaxprs, functions) keyed by their identity,
which holds them weakly: an entry goes when one of its objects does, so the
cache never keeps a user's function, program or arrays alive (a jaxpr holds
its constants from jax 0.11 on, and a function its closure).

Keyed by `id` (jaxprs and functions are compared by identity; hashing a
jaxpr's contents would cost what the cached walk does), and bounded: past
`limit` entries it starts again empty.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Hashable, Sequence
from typing import Any

MISSING = object()


class IdentityCache:
    """`get(objs, extra)` is what `put(objs, extra, value)` stored while each
    of `objs` is alive (the same objects, not others at the same address),
    else `MISSING`. Objects that cannot be referenced weakly are not cached."""

    def __init__(self, limit: int = 4096):
        self._limit = limit
        self._entries: dict = {}  # (ids, extra) -> (weak references, value)

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, objs: Sequence[Any], extra: Hashable = None) -> Any:
        hit = self._entries.get((tuple(map(id, objs)), extra))
        if hit is None or any(r() is not o for r, o in zip(hit[0], objs)):
            return MISSING
        return hit[1]

    def put(self, objs: Sequence[Any], extra: Hashable, value: Any) -> None:
        key = (tuple(map(id, objs)), extra)
        try:
            refs = tuple(weakref.ref(o, functools.partial(_drop, self._entries, key))
                         for o in objs)
        except TypeError:
            return
        if len(self._entries) >= self._limit:
            self._entries.clear()
        self._entries[key] = (refs, value)

    def clear(self) -> None:
        self._entries.clear()


def _drop(entries: dict, key: tuple, ref: Any) -> None:
    """Removes the entry at `key` if `ref` is one of its references (not one
    of an entry it replaced). (A weak reference's callback runs as its object
    dies, before another object can take its address.)"""
    hit = entries.get(key)
    if hit is not None and any(r is ref for r in hit[0]):
        entries.pop(key, None)
