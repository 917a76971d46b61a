"""`reap`, `call_and_reap`, `plant`, `harvest` and `nest`."""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable, Iterable
from typing import Any

import jax

from lazyharvest import _jax
from lazyharvest._interpreter import Harvest
from lazyharvest.delayed import DelayedDict
from lazyharvest.primitive import scoped
from lazyharvest.program import NO_PLANTS, cached_trace, flatten_args, resolve_plants


def _harvest(tag: Hashable, allowlist: Iterable[str] | None,
             blocklist: Iterable[str], exclusive: bool) -> Harvest:
    return Harvest(tag, None if allowlist is None else frozenset(allowlist),
                   frozenset(blocklist), bool(exclusive))


def _run(f: Callable, h: Harvest, plants: Any, args: tuple, kwargs: dict,
         with_out: bool, with_dict: bool) -> Any:
    flat, in_tree, avals = flatten_args(args, kwargs)
    traced = cached_trace(f, h, in_tree, avals)
    spec, plant_leaves = NO_PLANTS, list[Any]()
    if plants is not None:
        spec, plant_leaves = resolve_plants(traced, plants)
    out = None
    if with_out:
        prog = traced.program([], with_out=True, plants=spec)
        out = jax.tree_util.tree_unflatten(traced.out_tree,
                                           prog(*flat, *plant_leaves))
    if not with_dict:
        return out
    d = DelayedDict.from_trace(traced, flat, spec, plant_leaves)
    return (out, d) if with_out else d


def reap(f: Callable, *, tag: Hashable, allowlist: Iterable[str] | None = None,
         blocklist: Iterable[str] = (), exclusive: bool = False
         ) -> Callable[..., DelayedDict]:
    """`reap(f, tag=t)(*args)` -> the `DelayedDict` of `f`'s sites of tag `t`."""
    h = _harvest(tag, allowlist, blocklist, exclusive)

    @_jax.api_boundary
    @functools.wraps(f)
    def reaped(*args: Any, **kwargs: Any) -> DelayedDict:
        return _run(f, h, None, args, kwargs, with_out=False, with_dict=True)
    return reaped


def call_and_reap(f: Callable, *, tag: Hashable,
                  allowlist: Iterable[str] | None = None,
                  blocklist: Iterable[str] = (), exclusive: bool = False
                  ) -> Callable[..., tuple[Any, DelayedDict]]:
    """`call_and_reap(f, tag=t)(*args)` -> `(f(*args), DelayedDict)`."""
    h = _harvest(tag, allowlist, blocklist, exclusive)

    @_jax.api_boundary
    @functools.wraps(f)
    def called(*args: Any, **kwargs: Any) -> tuple[Any, DelayedDict]:
        return _run(f, h, None, args, kwargs, with_out=True, with_dict=True)
    return called


def plant(f: Callable, *, tag: Hashable, allowlist: Iterable[str] | None = None,
          blocklist: Iterable[str] = (), exclusive: bool = False
          ) -> Callable[..., Any]:
    """`plant(f, tag=t)(plants, *args)` -> `f(*args)` with planted sites.

    `plants` is a (nested) mapping keyed like the reaped keys. A planted value
    replaces the sown one; on a cotangent site (a backward pass) it is added.
    """
    h = _harvest(tag, allowlist, blocklist, exclusive)

    @_jax.api_boundary
    @functools.wraps(f)
    def planted(plants: Any, *args: Any, **kwargs: Any) -> Any:
        return _run(f, h, plants, args, kwargs, with_out=True, with_dict=False)
    return planted


def harvest(f: Callable, *, tag: Hashable, allowlist: Iterable[str] | None = None,
            blocklist: Iterable[str] = (), exclusive: bool = False
            ) -> Callable[..., tuple[Any, DelayedDict]]:
    """`harvest(f, tag=t)(plants, *args)` -> `(out, DelayedDict)`.

    Planted names do not appear among the reaped ones.
    """
    h = _harvest(tag, allowlist, blocklist, exclusive)

    @_jax.api_boundary
    @functools.wraps(f)
    def harvested(plants: Any, *args: Any, **kwargs: Any) -> tuple[Any, DelayedDict]:
        return _run(f, h, plants, args, kwargs, with_out=True, with_dict=True)
    return harvested


def nest(f: Callable, *, scope: str) -> Callable[..., Any]:
    """Prepends `scope` to the scopes of every site inside `f`."""
    if not isinstance(scope, str):
        raise TypeError(f"nest: scope must be a string, got {scope!r}")

    @functools.wraps(f)
    def nested(*args: Any, **kwargs: Any) -> Any:
        with scoped(scope):
            return f(*args, **kwargs)
    return nested
