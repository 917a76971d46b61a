"""A traced function and the sliced programs built from it.

`Traced` is one abstract trace of a user function under a harvest: the jaxpr,
the table of its sites (keys, avals) and a bounded cache of compiled programs,
one per requested key set. A program evaluates the jaxpr with the harvest
interpreter asking only for the requested sites, then dead-code-eliminates
the jaxpr, so only the slice that produces those values is compiled.
"""

from __future__ import annotations

import collections
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import jax
import jax.numpy as jnp
import numpy as np

from lazyharvest import _jax
from lazyharvest import keys as keys_mod
from lazyharvest._interpreter import (
    Harvest,
    Plant,
    RawKey,
    Run,
    count_occurrences,
    split_list,
    sub_jaxprs,
)
from lazyharvest.errors import HarvestError, closest
from lazyharvest.keys import VJP, Label
from lazyharvest.primitive import active_tags, current_scopes, harvesting, sow_p

PROGRAM_CACHE_SIZE = 64
TRACE_CACHE_SIZE = 16


class Program:
    """Compiled slice: `(*args, *plant leaves) -> (*outs?, *site leaves)`."""

    def __init__(self, jaxpr: _jax.Jaxpr, consts: list):
        self.jaxpr = jaxpr
        self.consts = consts
        self.fn = jax.jit(self._eval)

    def _eval(self, *flat):
        return _jax.eval_jaxpr(self.jaxpr, self.consts, *flat)

    def __call__(self, *flat):
        return self.fn(*flat)


@attrs.frozen
class PlantEntry:
    """One planted site: its key, how the plant applies, the planted avals."""

    key: RawKey
    mode: str
    additive: bool  # a cotangent site: the plant is added, not substituted
    avals: tuple


@attrs.frozen
class PlantSpec:
    """Which sites a call plants, and how: hashable, and free of values.

    Programs are cached by it, so calls that plant new values at the same
    sites with the same shapes reuse one compiled program.
    """

    entries: tuple = ()  # (PlantEntry, ...)

    @property
    def keys(self) -> frozenset:
        return frozenset(e.key for e in self.entries)

    @property
    def avals(self) -> list:
        return [a for e in self.entries for a in e.avals]

    def plants(self, leaves: Sequence[Any]) -> dict[RawKey, Plant]:
        """The `Plant`s of a run, given the planted leaves in order."""
        *chunks, _ = split_list(leaves, [len(e.avals) for e in self.entries])
        return {e.key: Plant(c, e.mode, e.additive)
                for e, c in zip(self.entries, chunks)}


NO_PLANTS = PlantSpec()


@attrs.frozen(eq=False)
class Traced:
    """One trace of a user function under one harvest, and its programs.

    Immutable; its caches (programs, key indexes) are keyed by what they
    depend on, plants included.
    """

    harvest: Harvest
    jaxpr: _jax.ClosedJaxpr
    in_avals: tuple
    out_tree: Any
    sites: dict  # RawKey -> Site, program order
    key_of: dict  # RawKey -> [user key], canonical first, then aliases
    raw_of: dict  # user key -> RawKey
    names: frozenset  # every name the tag sows, filtered or not
    other_tags: frozenset  # tags of the other sites in the program (for errors)
    programs: collections.OrderedDict = attrs.field(factory=collections.OrderedDict)
    indexes: dict = attrs.field(factory=dict)  # PlantSpec -> key index
    lock: Any = attrs.field(factory=threading.RLock)

    def key_index(self, plants: PlantSpec = NO_PLANTS) -> dict:
        """User key -> RawKey of every leaf a DelayedDict offers (aliases
        included, planted sites excluded)."""
        index = self.indexes.get(plants)
        if index is None:
            planted = plants.keys
            index = {u: r for r, us in self.key_of.items() if r not in planted
                     for u in us}
            self.indexes[plants] = index
        return index

    def program(self, raw_keys: Sequence[RawKey], with_out: bool,
                plants: PlantSpec = NO_PLANTS) -> Program:
        cache_key = (tuple(raw_keys), with_out, plants)
        with self.lock:
            prog = self.programs.get(cache_key)
            if prog is not None:
                self.programs.move_to_end(cache_key)
                return prog
        prog = self._build(list(raw_keys), with_out, plants)
        with self.lock:
            self.programs[cache_key] = prog
            while len(self.programs) > PROGRAM_CACHE_SIZE:
                self.programs.popitem(last=False)
        return prog

    def _build(self, raw_keys: list, with_out: bool, plants: PlantSpec) -> Program:
        wanted = frozenset(raw_keys)
        n_args = len(self.in_avals)
        closed = self.jaxpr
        # An additive clobber plant goes to the last occurrence: count them.
        counts = (count_occurrences(closed.jaxpr, self.harvest)
                  if any(e.additive and e.mode != "append" for e in plants.entries) else {})

        def fn(*flat):
            args, leaves = flat[:n_args], flat[n_args:]
            planted = {k: attrs.evolve(p, count=counts.get(k, 1))
                       for k, p in plants.plants(leaves).items()}
            run = Run(self.harvest, wanted.__contains__, planted,
                      keep_other_tags=with_out)
            outs = run.eval(closed.jaxpr, closed.consts, args)
            site = [x for k in raw_keys for x in run.records[k].leaves()]
            return [*outs, *site] if with_out else site

        jaxpr, consts = _jax.trace_flat(fn, [*self.in_avals, *plants.avals])
        jaxpr, _ = _jax.dce(jaxpr, [True] * len(jaxpr.outvars))
        return Program(jaxpr, consts)


def _site_names(jaxpr: _jax.Jaxpr, tag: Any, names: set, tags: set) -> tuple[set, set]:
    """Every name `tag` sows, and every other tag sown, anywhere in `jaxpr`."""
    for e in jaxpr.eqns:
        if e.primitive is sow_p:
            if e.params["tag"] == tag:
                names.add(e.params["name"])
            else:
                tags.add(e.params["tag"])
        for j in sub_jaxprs(e.params):
            _site_names(j, tag, names, tags)
    return names, tags


def trace(f: Callable, harvest: Harvest, in_tree: Any, in_avals: tuple) -> Traced:
    """Traces `f` abstractly once and finds its sites (no FLOPs)."""
    with harvesting(harvest.tag):
        closed, out_tree = _jax.trace_pytree(
            lambda args, kwargs: f(*args, **kwargs), in_tree, in_avals,
            name=getattr(f, "__name__", "harvested"))
    run = Run(harvest, lambda k: True, abstract=True)
    found: list = []

    def analyse(*args):
        outs = run.eval(closed.jaxpr, closed.consts, args)
        found.extend(run.sites())
        return outs

    _jax.trace_flat(analyse, in_avals)
    sites = {s.key: s for s in found}
    key_of = keys_mod.assign(sites)
    names, tags = _site_names(closed.jaxpr, harvest.tag, set(), set())
    return Traced(harvest, closed, in_avals, out_tree, sites, key_of,
                  {u: k for k, us in key_of.items() for u in us},
                  frozenset(names), frozenset(tags))


# --- the trace cache: weak in the user's function ---------------------------

_TRACES: weakref.WeakKeyDictionary[Any, collections.OrderedDict] = weakref.WeakKeyDictionary()
_TRACES_LOCK = threading.Lock()


def cached_trace(f: Callable, harvest: Harvest, in_tree: Any, in_avals: tuple) -> Traced:
    key = (harvest, in_tree, in_avals, active_tags(), current_scopes(),
           _jax.trace_context())
    try:
        with _TRACES_LOCK:
            per_fn = _TRACES.setdefault(f, collections.OrderedDict())
            hit = per_fn.get(key)
    except TypeError:  # not weakly referenceable, or unhashable key parts
        return trace(f, harvest, in_tree, in_avals)
    if hit is not None:
        return hit
    traced = trace(f, harvest, in_tree, in_avals)
    if _jax.any_tracer(traced.jaxpr.consts):  # closes over a tracer: this trace only
        return traced
    with _TRACES_LOCK:
        per_fn[key] = traced
        while len(per_fn) > TRACE_CACHE_SIZE:
            per_fn.popitem(last=False)
    return traced


def flatten_args(args: tuple, kwargs: dict) -> tuple[list, Any, tuple]:
    """Leaves, tree and avals of a call's arguments (checked to be arrays)."""
    leaves, in_tree = jax.tree_util.tree_flatten((args, kwargs))
    try:  # arrays and tracers carry their aval: much cheaper than typeof
        return leaves, in_tree, tuple([x.aval for x in leaves])
    except AttributeError:
        pass
    avals = []
    for x in leaves:
        aval = getattr(x, "aval", None)
        if aval is None:
            if not isinstance(x, (np.ndarray, np.generic, bool, int, float, complex)):
                raise HarvestError(
                    f"harvested functions take pytrees of arrays; got an argument "
                    f"leaf of type {type(x).__name__}. Close over non-array "
                    f"arguments (functools.partial) instead.")
            aval = jax.typeof(x)
        avals.append(aval)
    return leaves, in_tree, tuple(avals)


# --- plants ------------------------------------------------------------------

def resolve_plants(traced: Traced, plants: Any) -> tuple[PlantSpec, list]:
    """Checks `plants` against the sites; returns their spec and leaves."""
    h = traced.harvest
    found: dict = {}

    # A name only filtered-out sites sow is ignored (SPEC: filtered sites are
    # still sites); any other unknown key is an error, typos included.
    filtered = traced.names - {name for _, _, name in traced.sites}

    def walk(prefix: tuple, value: Any) -> None:
        if prefix in traced.raw_of:
            found[prefix] = value
        elif prefix and prefix[-1] in filtered:
            return
        elif isinstance(value, Mapping):
            for k, v in value.items():
                walk(prefix + keys_mod.normalize(k), v)
        else:
            shown = [keys_mod.display(k) for k in traced.raw_of]
            raise HarvestError(
                f"plant for tag {h.tag!r}: no site is sown as "
                f"{keys_mod.display(prefix)!r}. Sites of this tag: {shown}. "
                f"Closest: {closest(str(keys_mod.display(prefix)), map(str, shown))}.")

    if plants is None:
        plants = {}
    if not isinstance(plants, Mapping):
        raise HarvestError(
            f"plant for tag {h.tag!r}: plants must be a mapping keyed like the "
            f"reaped keys, got {type(plants).__name__}.")
    walk((), plants)
    spec, leaves = [], []
    for ukey, value in found.items():
        raw = traced.raw_of[ukey]
        site = traced.sites[raw]
        where = h.where(raw)
        if any(isinstance(x, Label) and x.chosen and not x.structural for x in raw[0]):
            raise HarvestError(
                f"{where}: {keys_mod.display(ukey)!r} is a transformed leaf (a "
                f"derivative of the site), not a value the program computes; "
                f"plant the site's own key instead.")
        vals, tree = jax.tree_util.tree_flatten(value)
        if tree != site.tree:
            raise HarvestError(
                f"{where}: planted value has structure {tree}, the site sows "
                f"{site.tree}. Plant a value of the same pytree structure.")
        cast = []
        for v, aval in zip(vals, site.avals):
            cast.append(_cast_plant(v, aval, where))
        spec.append(PlantEntry(raw, site.mode, bool(raw[0]) and raw[0][-1] == VJP,
                               tuple(jax.typeof(x) for x in cast)))
        leaves += cast
    return PlantSpec(tuple(spec)), leaves


def _cast_plant(v: Any, aval: Any, where: str) -> Any:
    shape, dtype = tuple(np.shape(v)), jnp.result_type(v)
    weak = isinstance(v, (int, float, complex, bool)) or getattr(
        jax.typeof(v), "weak_type", False)
    if shape != tuple(aval.shape):
        raise HarvestError(
            f"{where}: planted value has shape {shape}, the site has shape "
            f"{tuple(aval.shape)}. Plant a value of the site's shape.")
    if dtype != aval.dtype:
        same_kind = jnp.issubdtype(dtype, _kind(aval.dtype))
        if not (weak and same_kind) and not (weak and _kind(dtype) is np.integer
                                             and _kind(aval.dtype) is not np.bool_):
            raise HarvestError(
                f"{where}: planted value has dtype {dtype}, the site has dtype "
                f"{aval.dtype}. Plant a value of the site's dtype (Python "
                f"scalars are cast).")
    return jnp.asarray(v, aval.dtype)


def _kind(dtype: Any) -> type:
    for k in (np.bool_, np.integer, np.floating, np.complexfloating):
        if jnp.issubdtype(dtype, k):
            return k
    return np.generic
