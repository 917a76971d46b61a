"""A traced function and the sliced programs built from it.

`Traced` is one abstract trace of a user function under a harvest: the jaxpr,
the table of its sites (keys, avals) and a bounded cache of compiled programs,
one per requested key set. A program evaluates the jaxpr with the harvest
interpreter asking only for the requested sites, then dead-code-eliminates
the jaxpr, so only the slice that produces those values is compiled.
"""

from __future__ import annotations

import collections
import functools
import inspect
import logging
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import jax
import jax.numpy as jnp
import numpy as np

from lazyharvest import _jax, slicing
from lazyharvest import keys as keys_mod
from lazyharvest._interpreter import (
    Harvest,
    Plant,
    RawKey,
    Run,
    count_occurrences,
    plant_order,
    split_list,
    sub_jaxprs,
)
from lazyharvest.errors import HarvestError, closest
from lazyharvest.interventions import Applied, as_intervention
from lazyharvest.keys import VJP, Label
from lazyharvest.primitive import active_tags, current_scopes, harvesting, sow_p

PROGRAM_CACHE_SIZE = 64
TRACE_CACHE_SIZE = 16


COMPILE_NOTICE_SECONDS = 2.0
logger = logging.getLogger("lazyharvest")


class Program:
    """Compiled slice: `(*args, *plant leaves) -> (*outs?, *site leaves)`."""

    def __init__(self, jaxpr: _jax.Jaxpr, consts: list, what: str = "a leaf"):
        self.jaxpr = jaxpr
        self.consts = consts
        self.what = what
        # (not a bound method: a Program and its jitted function would form a
        # cycle, so JAX's caches of it, and the user's functions and arrays
        # its jaxpr holds, would wait for a second garbage collection)
        self.fn = jax.jit(functools.partial(_jax.eval_jaxpr, jaxpr, consts))
        self.first = True
        self.used = False  # read through `Traced.plain_program` (LRU second chance)
        self.holds_hi_prims = _jax.holds_hi_prims(jaxpr)

    def __call__(self, *flat):
        # JAX runs its DCE where it lowers the slice (the first call; a later
        # one with the same avals hits jit's cache) or transforms it (under a
        # trace), where a custom rule it traces may stage a high-level
        # primitive too
        if self.first or self.holds_hi_prims or not _jax.in_eager_mode():
            with _jax.ref_writing_hi_prims_kept():
                return self._call(flat)
        return self._call(flat)

    def lower(self, *flat):
        with _jax.ref_writing_hi_prims_kept():
            return self.fn.lower(*flat)

    def _call(self, flat):
        if not self.first:
            return self.fn(*flat)
        self.first = False
        start = time.perf_counter()
        out = self.fn(*flat)
        took = time.perf_counter() - start
        if took > COMPILE_NOTICE_SECONDS and not _jax.any_tracer(flat):
            # Silent by default; logging.getLogger("lazyharvest").setLevel(INFO).
            logger.info("lazyharvest: compiling %s took %.1f s (%d eqns)",
                        self.what, took, len(self.jaxpr.eqns))
        return out


@attrs.frozen
class PlantEntry:
    """One planted site: its key, how the plant applies, the planted avals."""

    key: RawKey
    mode: str
    additive: bool  # a cotangent site: the plant is added, not substituted
    avals: tuple
    add: bool = False  # plant(mode="add"): added to the sown value
    applied: Applied | None = None  # an intervention: its function (avals: its operands')


@attrs.frozen(cache_hash=True)  # hashed on every call (program-cache key)
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
        return {e.key: Plant(c, e.mode, e.additive, e.add, applied=e.applied)
                for e, c in zip(self.entries, chunks)}


NO_PLANTS = PlantSpec()
_LEAF = jax.tree_util.tree_structure(0)


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
    arg_spec: Any = None  # ArgSpec of the calls this trace serves
    tracer_consts: bool = False  # closes over an outer trace's tracers
    programs: collections.OrderedDict = attrs.field(factory=collections.OrderedDict)
    # (RawKey, ...) -> (their program without plants, spans): `plain_program`
    plain_programs: dict = attrs.field(factory=dict)
    indexes: dict = attrs.field(factory=dict)  # PlantSpec -> key index
    plans: dict = attrs.field(factory=dict)  # (plants, view, keys) -> `compute` plan
    # PlantSpec -> the raw keys read from the DelayedDict of the latest eager
    # call with its output (`call_and_reap`), as they are read
    reads: dict = attrs.field(factory=dict)
    lock: Any = attrs.field(factory=threading.RLock)

    def key_index(self, plants: PlantSpec = NO_PLANTS) -> tuple[dict, list]:
        """(user key -> RawKey of every leaf a DelayedDict offers, aliases
        included and planted sites excluded; the canonical keys, in order)."""
        index = self.indexes.get(None if plants is NO_PLANTS else plants)
        if index is None:
            planted = plants.keys
            keys = {u: r for r, us in self.key_of.items() if r not in planted
                    for u in us}
            index = (keys, canonical_keys(keys))
            self.indexes[None if plants is NO_PLANTS else plants] = index
        return index

    def direct_keys(self, plants: PlantSpec = NO_PLANTS) -> list[RawKey]:
        """Sites whose leaves the program itself computes (no recorded
        transform applied to a slice): free to return with its output."""
        return [k for k in self.sites if k not in plants.keys
                and not any(isinstance(x, Label) for x in k[0])]

    def program(self, raw_keys: Sequence[RawKey], with_out: bool,
                plants: PlantSpec = NO_PLANTS, pass_through: bool = False) -> Program:
        """The compiled slice computing `raw_keys` (and the output, `with_out`);
        with `pass_through`, unplanted sites stay sites of the program."""
        cache_key = (tuple(raw_keys), with_out, plants, pass_through)
        prog = self.programs.get(cache_key)  # lock-free: each step is atomic
        if prog is not None:
            try:  # noqa: SIM105  (contextlib.suppress costs more, on every read)
                self.programs.move_to_end(cache_key)
            except KeyError:  # evicted meanwhile by another thread
                pass
            return prog
        prog = self._build(list(raw_keys), with_out, plants, pass_through)
        with self.lock:
            self.programs[cache_key] = prog
            self._evict()
        return prog

    def plain_program(self, raws: tuple) -> tuple[Program, tuple | None]:
        """`program(raws, False)` without plants, and where each leaf is in
        its output: `(raw, start, stop, tree)` spans, the tree None for a
        leaf that is one array; no spans (None) when every leaf is one array
        (output i is leaf i). A second index into `programs`: reading
        leaves of a cached key set is one lookup."""
        hit = self.plain_programs.get(raws)
        if hit is not None:
            hit[0].used = True  # the LRU order is not updated on this path
            return hit
        prog = self.program(raws, with_out=False)
        spans, start = [], 0
        for raw in raws:
            site = self.sites[raw]
            stop = start + len(site.avals)
            spans.append((raw, start, stop, None if site.tree == _LEAF else site.tree))
            start = stop
        hit = (prog, None if all(t is None for *_, t in spans) else tuple(spans))
        with self.lock:
            if self.programs.get((raws, False, NO_PLANTS, False)) is prog:
                self.plain_programs[raws] = hit
        return hit

    def _evict(self) -> None:
        """Drops the least recently used programs past the cache size; one
        read through `plain_program` since it was last seen earns a second
        chance (that path does not reorder the cache). Under `self.lock`."""
        while len(self.programs) > PROGRAM_CACHE_SIZE:
            key, prog = self.programs.popitem(last=False)
            if prog.used:
                prog.used = False
                self.programs[key] = prog
                continue
            raws, with_out, plants, pass_through = key
            if not with_out and not plants.entries and not pass_through:
                hit = self.plain_programs.get(raws)
                if hit is not None and hit[0] is prog:
                    del self.plain_programs[raws]

    def _build(self, raw_keys: list, with_out: bool, plants: PlantSpec,
               pass_through: bool) -> Program:
        wanted = frozenset(raw_keys)
        n_args = len(self.in_avals)
        closed = self.jaxpr
        # An additive clobber plant goes to the last occurrence: count them.
        counts = (count_occurrences(closed.jaxpr, self.harvest)
                  if any(e.additive and e.mode != "append" for e in plants.entries) else {})
        # A cotangent planted in an outer backward pass over inner ones
        # (a `jax.vjp` of `jax.grad` steps) meets its rows out of order.
        orders = {e.key: plant_order(closed.jaxpr, self.harvest, e.key)
                  for e in plants.entries if e.additive}

        def fn(*flat):
            args, leaves = flat[:n_args], flat[n_args:]
            planted = {k: attrs.evolve(p, count=counts.get(k, 1), order=orders.get(k))
                       for k, p in plants.plants(leaves).items()}
            run = Run(self.harvest, wanted.__contains__, planted,
                      keep_other_tags=with_out, pass_through=pass_through,
                      outputs_needed=with_out)
            outs = run.eval(closed.jaxpr, closed.consts, args)
            site = [x for k in raw_keys for x in run.records[k].leaves()]
            return [*outs, *site] if with_out else site

        with _jax.ref_writing_hi_prims_kept():  # (JAX's rules may run its DCE)
            jaxpr, consts = _jax.trace_flat(fn, [*self.in_avals, *plants.avals])
        what = ", ".join(str(keys_mod.display(self.key_of[k][0])) for k in raw_keys)
        what = ("the output" + (f" and {what}" if what else "")) if with_out else what
        return Program(slicing.dce(jaxpr, [True] * len(jaxpr.outvars)), consts, what)


def canonical_keys(leaves: dict) -> list:
    """One key per leaf, the shortest of its aliases, in first-seen order."""
    best: dict = {}
    for k, r in leaves.items():
        if r not in best or len(k) < len(best[r]):
            best[r] = k
    return list(best.values())


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


def _check_output(out: Any, harvest: Harvest, f: Callable) -> Any:
    """A harvested function returns a pytree of arrays (like a jitted one)."""
    if inspect.isgenerator(out):
        out = [out]  # reported below, before JAX flattens it (a deprecated leaf)
    for leaf in jax.tree_util.tree_leaves(out, is_leaf=inspect.isgenerator):
        if not (hasattr(leaf, "aval") or isinstance(leaf, (*_ARRAY_TYPES, bool))):
            what = ("a generator (harvested functions must return their values)"
                    if inspect.isgenerator(leaf) else f"a {type(leaf).__name__}")
            raise HarvestError(
                f"harvest of tag {harvest.tag!r}: {getattr(f, '__name__', f)!r} returned "
                f"{what}; a harvested function returns a pytree of arrays. Return "
                f"arrays, and pass other values out through a closure.")
    return out


def trace(f: Callable, harvest: Harvest, spec: ArgSpec, in_avals: tuple) -> Traced:
    """Traces `f` abstractly once and finds its sites (no FLOPs)."""
    def call(*dynamic):
        args, kwargs = spec.rebuild(dynamic)
        return _check_output(f(*args, **kwargs), harvest, f)

    flat_tree = jax.tree_util.tree_structure(tuple(range(len(in_avals))))
    with harvesting(harvest.tag):
        closed, out_tree = _jax.trace_pytree(
            call, flat_tree, in_avals, name=getattr(f, "__name__", "harvested"))
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
                  frozenset(names), frozenset(tags), spec, _jax.any_tracer(closed.consts))


# --- the trace cache: weak in the user's function ---------------------------
#
# Keyed by the function's identity, held weakly: dropping the function frees
# its traces and programs. A recorded-transform wrapper (`lh.grad(f)`, built
# anew on every call of a training loop) is keyed by what it *is* — the
# function it wraps plus its transform and parameters (`__lazyharvest_key__`)
# — so rebuilding it retraces and recompiles nothing.


class _Owner:
    """The traces of one function, and a weak reference that drops them."""

    def __init__(self, ref: Any):
        self.ref = ref
        self.traces: collections.OrderedDict = collections.OrderedDict()


_TRACES: dict[int, _Owner] = {}
# Reentrant: a traced function's weakref callback (`_forget`) may run in the
# middle of a locked region, when a garbage collection happens there.
_TRACES_LOCK = threading.RLock()
_WARNED: set = set()


def _owner_of(f: Callable) -> tuple[Any, Any]:
    """(the object the cache is kept for, the key of `f` relative to it)."""
    key = getattr(f, "__lazyharvest_key__", None)
    if key is not None:
        return f.__lazyharvest_base__, key  # type: ignore[attr-defined]
    return f, None


def _traces_for(base: Any) -> collections.OrderedDict | None:
    owner = _TRACES.get(id(base))
    if owner is not None and owner.ref() is base:
        return owner.traces
    key = id(base)
    try:
        ref = weakref.ref(base, functools.partial(_forget, key))
    except TypeError:
        return None
    owner = _Owner(ref)
    _TRACES[id(base)] = owner
    return owner.traces


def _forget(i: int, ref: Any) -> None:
    if _TRACES_LOCK is None:  # (interpreter shutdown: module globals are gone)
        return
    with _TRACES_LOCK:
        owner = _TRACES.get(i)
        if owner is not None and owner.ref is ref:
            del _TRACES[i]


def _warn_uncached(f: Callable) -> None:
    name = type(f).__name__
    if name not in _WARNED:
        _WARNED.add(name)
        warnings.warn(
            f"lazyharvest cannot cache traces of a {name} (it cannot be weakly "
            f"referenced): every call retraces and recompiles. Wrap it in a "
            f"function defined once (def g(*a): return f(*a)).", stacklevel=4)


def cached_trace(f: Callable, harvest: Harvest, spec: ArgSpec, in_avals: tuple
                 ) -> tuple[Traced, bool]:
    """The trace of `f` for these arguments, from the cache when possible, and
    whether it is cached (later calls with these arguments may reuse it)."""
    base, fkey = _owner_of(f)
    key = (fkey, harvest, spec, in_avals, active_tags(), current_scopes(),
           _jax.trace_context())
    with _TRACES_LOCK:
        per_fn = _traces_for(base)
        try:
            hit = per_fn.get(key) if per_fn is not None else None
        except TypeError:  # unhashable key parts (a static argument)
            per_fn = hit = None
    if per_fn is None:
        _warn_uncached(f)
        return trace(f, harvest, spec, in_avals), False
    if hit is not None:
        return hit, True
    traced = trace(f, harvest, spec, in_avals)
    if traced.tracer_consts:  # closes over a tracer: this trace only
        return traced, False
    with _TRACES_LOCK:
        per_fn[key] = traced
        while len(per_fn) > TRACE_CACHE_SIZE:
            per_fn.popitem(last=False)
    return traced, True


@attrs.frozen
class Static:
    """An argument passed by value (`static_argnums`/`static_argnames`):
    part of the cache key, never traced."""

    value: Any


@attrs.frozen
class ArgSpec:
    """How a call's arguments split into traced arrays and static values.

    Hashable: the trace cache keys on it. `static` holds `(leaf index,
    value)` for every leaf that is not an array (functions, strings, flags,
    `Static` arguments), as `equinox.filter_jit` does.
    """

    in_tree: Any  # of (args, kwargs), every leaf
    static: tuple = ()

    def rebuild(self, dynamic: Sequence[Any]) -> tuple[tuple, dict]:
        """The call's (args, kwargs), from its traced leaves."""
        leaves = list(dynamic)
        for i, value in self.static:
            leaves.insert(i, value)
        args, kwargs = jax.tree_util.tree_unflatten(self.in_tree, leaves)
        args = tuple(a.value if isinstance(a, Static) else a for a in args)
        kwargs = {k: v.value if isinstance(v, Static) else v for k, v in kwargs.items()}
        return args, kwargs


_ARRAY_TYPES = (np.ndarray, np.generic, int, float, complex)


def _is_static_leaf(x: Any) -> bool:
    # Python flags are static (they steer control flow, as with
    # equinox.filter_jit); numbers are traced, as jax.jit traces them.
    return isinstance(x, bool) or not isinstance(x, _ARRAY_TYPES)


def flatten_args(args: tuple, kwargs: dict) -> tuple[list, ArgSpec, tuple]:
    """Traced leaves, their `ArgSpec` and avals, for a call's arguments."""
    leaves, in_tree = jax.tree_util.tree_flatten((args, kwargs))
    try:  # arrays and tracers carry their aval: much cheaper than typeof
        return leaves, ArgSpec(in_tree), tuple([x.aval for x in leaves])
    except AttributeError:
        pass
    dynamic, avals, static = [], [], []
    for i, x in enumerate(leaves):
        aval = getattr(x, "aval", None)
        if aval is None and _is_static_leaf(x):
            static.append((i, _hashable(x, i)))
            continue
        dynamic.append(x)
        avals.append(jax.typeof(x) if aval is None else aval)
    return dynamic, ArgSpec(in_tree, tuple(static)), tuple(avals)


def _hashable(x: Any, i: int) -> Any:
    try:
        hash(x)
    except TypeError:
        shown = x.value if isinstance(x, Static) else x
        raise HarvestError(
            f"harvested functions treat arguments that are not arrays as static "
            f"(part of the compile-cache key, as jax.jit's static arguments), so "
            f"they must be hashable; argument leaf #{i} of type "
            f"{type(shown).__name__} is not. Pass it as an array, make it "
            f"hashable, or close over it (functools.partial).") from None
    return x


# --- plants ------------------------------------------------------------------

def _no_site_hint(traced: Traced) -> str:
    """What a plant of a tag no site sows says: the tags that are sown."""
    others = sorted(map(repr, traced.other_tags))
    return (f" No site of tag {traced.harvest.tag!r} is sown: check the tag's spelling. "
            + (f"Tags sown in this program: {', '.join(others)}." if others
               else "No site of any tag is sown in this program."))


def resolve_plants(traced: Traced, plants: Any, add: bool = False
                   ) -> tuple[PlantSpec, list]:
    """Checks `plants` against the sites; returns their spec and leaves.

    With `add`, a plant is added to the sown value and may be of any shape
    that broadcasts to the site's (a `(D,)` vector into a `(B, T, D)` site).
    """
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
            hint = "" if shown else _no_site_hint(traced)
            raise HarvestError(
                f"plant for tag {h.tag!r}: no site is sown as "
                f"{keys_mod.display(prefix)!r}. Sites of this tag: {shown}. "
                f"Closest: {closest(str(keys_mod.display(prefix)), map(str, shown))}.{hint}")

    if plants is None:
        plants = {}
    if not isinstance(plants, Mapping):
        raise HarvestError(
            f"plant for tag {h.tag!r}: plants must be a mapping keyed like the "
            f"reaped keys, got {type(plants).__name__}.")
    walk((), plants)
    spec, leaves = [], []
    for ukey, value in found.items():
        entry, planted = _plant_entry(traced, ukey, value, add)
        spec.append(entry)
        leaves += planted
    return PlantSpec(tuple(spec)), leaves


def _cast_plant(v: Any, aval: Any, where: str, add: bool = False) -> Any:
    if (isinstance(v, jax.Array) and v.shape == aval.shape and v.dtype == aval.dtype
            and not jax.typeof(v).weak_type):
        return v  # the common case in a sweep: nothing to convert, no device op
    if not hasattr(v, "dtype") and not isinstance(v, (bool, int, float, complex)):
        arr = np.asarray(v) if not isinstance(v, (str, bytes)) else None
        if arr is None or arr.dtype.kind not in "biufc":
            raise HarvestError(f"{where}: a planted value must be an array or a "
                               f"number, got {type(v).__name__}.")
        v = arr
    shape, dtype = tuple(np.shape(v)), jnp.result_type(v)
    weak = isinstance(v, (int, float, complex, bool)) or getattr(
        jax.typeof(v), "weak_type", False)
    if add and shape != tuple(aval.shape):
        try:
            broadcast = np.broadcast_shapes(shape, tuple(aval.shape))
        except ValueError:
            broadcast = None
        if broadcast != tuple(aval.shape):
            raise HarvestError(
                f"{where}: an added plant of shape {shape} does not broadcast to "
                f"the site's shape {tuple(aval.shape)}.")
        v, shape = jnp.broadcast_to(v, aval.shape), tuple(aval.shape)
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
    # strongly typed (`jnp.full(4, 2.)` is weak) before the program cache is
    # asked, so a sweep mixing weak and strong plants compiles once
    return jax.lax.convert_element_type(jnp.asarray(v), aval.dtype)


def _plant_entry(traced: Traced, ukey: tuple, value: Any, add: bool
                 ) -> tuple[PlantEntry, list]:
    """The spec entry of one plant and its leaves (checked and cast)."""
    raw = traced.raw_of[ukey]
    site = traced.sites[raw]
    where = traced.harvest.where(raw)
    if any(isinstance(x, Label) and x.chosen and not x.structural for x in raw[0]):
        raise HarvestError(
            f"{where}: {keys_mod.display(ukey)!r} is a transformed leaf (a "
            f"derivative of the site), not a value the program computes; "
            f"plant the site's own key instead.")
    iv = as_intervention(value)
    if iv is not None:
        return _intervention_entry(raw, site, iv, where, add)
    vals, tree = jax.tree_util.tree_flatten(value)
    if tree != site.tree:
        raise HarvestError(
            f"{where}: planted value has structure {tree}, the site sows "
            f"{site.tree}. Plant a value of the same pytree structure.")
    cast = [_cast_plant(v, aval, where, add) for v, aval in zip(vals, site.avals)]
    return (PlantEntry(raw, site.mode, bool(raw[0]) and raw[0][-1] == VJP,
                       tuple(jax.typeof(x) for x in cast), add), cast)


def _intervention_entry(raw: RawKey, site: Any, iv: Any, where: str, add: bool
                        ) -> tuple[PlantEntry, list]:
    """A plant that is a function: applied at every occurrence, to the value
    or the cotangent there (a "clobber" entry, never sliced into rows); its
    operands are the planted leaves."""
    ops, op_tree = jax.tree_util.tree_flatten(iv.operands)
    ops = [_strong(x) for x in ops]
    return (PlantEntry(raw, "clobber", False, tuple(jax.typeof(x) for x in ops), add,
                       Applied(iv.fn, site.tree, op_tree, where)), ops)


def _strong(x: Any) -> Any:
    """`x` as a strongly typed array: weak and strong operands of one sweep
    (`jnp.full(4, 2.)`, `jnp.ones(4)`) share one program."""
    if isinstance(x, jax.Array):
        return x if not jax.typeof(x).weak_type else jax.lax.convert_element_type(x, x.dtype)
    # (numbers and numpy arrays: no device op, so nothing compiles in a sweep)
    arr = np.asarray(x)
    return arr.astype(jax.dtypes.canonicalize_dtype(arr.dtype), copy=False)


def _kind(dtype: Any) -> type:
    for k in (np.bool_, np.integer, np.floating, np.complexfloating):
        if jnp.issubdtype(dtype, k):
            return k
    return np.generic
