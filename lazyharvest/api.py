"""`reap`, `call_and_reap`, `plant`, `harvest` and `nest`."""

from __future__ import annotations

import functools
import threading
import warnings
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import Any

import attrs
import jax

from lazyharvest import _jax
from lazyharvest._interpreter import Harvest
from lazyharvest.delayed import _ARRAYS, _ONE_LEAF, DelayedDict, _aval, _Store
from lazyharvest.errors import HarvestError
from lazyharvest.primitive import scoped
from lazyharvest.program import (
    NO_PLANTS,
    TRACE_CACHE_SIZE,
    Static,
    Traced,
    cached_trace,
    flatten_args,
    resolve_plants,
)


def _harvest(tag: Hashable, allowlist: Iterable[Any] | None,
             blocklist: Iterable[Any], exclusive: bool) -> Harvest:
    try:
        hash(tag)
    except TypeError:
        raise HarvestError(f"harvest tag {tag!r} is not hashable; use a string or "
                           f"another hashable value.") from None
    return Harvest(tag, None if allowlist is None else frozenset(allowlist),
                   frozenset(blocklist), bool(exclusive))


@attrs.frozen
class _Call:
    """How a harvested function is called: what it returns, which arguments
    are static, how plants apply."""

    with_out: bool
    with_dict: bool
    static_argnums: tuple = ()
    static_argnames: tuple = ()
    add: bool = False

    def split_static(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Static arguments wrapped so they are passed by value, as jax.jit does."""
        if not self.static_argnums and not self.static_argnames:
            return args, kwargs
        n = len(args)
        nums = {i % n for i in self.static_argnums if -n <= i < n}
        args = tuple(Static(a) if i in nums else a for i, a in enumerate(args))
        kwargs = {k: Static(v) if k in self.static_argnames else v
                  for k, v in kwargs.items()}
        return args, kwargs


def _call(with_out: bool, with_dict: bool, static_argnums: Any = (),
          static_argnames: Any = (), mode: str = "replace") -> _Call:
    if mode not in ("replace", "add"):
        raise HarvestError(f"plant mode {mode!r}: use 'replace' (the plant replaces "
                           f"the sown value) or 'add' (it is added to it).")
    nums = (static_argnums,) if isinstance(static_argnums, int) else tuple(static_argnums)
    names = ((static_argnames,) if isinstance(static_argnames, str)
             else tuple(static_argnames))
    return _Call(with_out, with_dict, nums, names, mode == "add")


def _run(f: Callable, h: Harvest, plants: Any, args: tuple, kwargs: dict,
         how: _Call, remember: Callable[[Traced], None] | None = None,
         remember_program: Callable[..., None] | None = None) -> Any:
    if plants is not None and not isinstance(plants, Mapping):
        # (before tracing: plants passed in another position would reach the
        # user's function first, and fail there)
        raise HarvestError(
            f"plant for tag {h.tag!r}: plants must be a mapping keyed like the reaped "
            f"keys, got {type(plants).__name__}. The planted function takes the plants "
            f"first: lh.plant(f, tag=...)(plants, *args).")
    flat, arg_spec, avals = flatten_args(*how.split_static(args, kwargs))
    traced, cached = cached_trace(f, h, arg_spec, avals)
    if how.with_dict and not traced.names:
        _warn_no_site(traced)
    if cached and remember is not None:
        remember(traced)
    spec, plant_leaves = NO_PLANTS, list[Any]()
    if plants is not None:
        spec, plant_leaves = resolve_plants(traced, plants, add=how.add)
    if not how.with_out:
        return DelayedDict.from_trace(traced, flat, spec, plant_leaves)
    # Inside a trace (a training step under jax.jit), the output's program
    # also returns every leaf it computes anyway (values, tangents,
    # cotangents): the forward pass runs once, and what is never read is
    # dead code for the enclosing jit. Eagerly, it returns the leaves the
    # previous call's DelayedDict has had read so far (a loop reads the same
    # ones each step), and no others: they do not run their passes again.
    staged = how.with_dict and (_jax.any_tracer(flat) or _jax.any_tracer(plant_leaves))
    keys, reads = [], None
    if staged:
        keys = traced.direct_keys(spec)
    elif how.with_dict:
        before = traced.reads.get(spec)
        keys = [k for k in traced.direct_keys(spec) if k in before] if before else []
        reads = traced.reads[spec] = set()
    prog = traced.program(keys, with_out=True, plants=spec, pass_through=not how.with_dict)
    outs = prog(*flat, *plant_leaves)
    n_out = traced.out_tree.num_leaves
    out = jax.tree_util.tree_unflatten(traced.out_tree, outs[:n_out])
    if not how.with_dict:
        if cached and remember_program is not None:
            remember_program(traced, prog, plant_leaves)
        return out
    d = DelayedDict.from_trace(traced, flat, spec, plant_leaves,
                               computed=(keys, outs[n_out:]), reads=reads)
    return out, d


def _warn_no_site(traced: Traced) -> None:
    """A harvest of a tag no site sows (a typo) says so at once."""
    others = sorted(map(repr, traced.other_tags))
    sown = (f"Tags sown in this program: {', '.join(others)}." if others
            else "No site of any tag is sown in this program.")
    warnings.warn(f"harvest of tag {traced.harvest.tag!r}: no site of this tag is sown; "
                  f"the result is empty. {sown} Check the tag's spelling.", stacklevel=5)


class _Recent:
    """The traces a reaped function's calls found cached, by what a call tells
    cheaply: its argument tree and avals, then JAX's trace context (which
    holds the harvest state, tags and scopes, too), compared, not hashed.

    A hit skips the general path (argument specs, the weak cache's key and
    lock): a call is a flatten, a dict lookup and a `DelayedDict`. The
    function holding this table holds `f` too, so the table needs no weak
    references; what it holds, `cached_trace` holds as well. One context
    per argument signature: a call in another one takes the general path
    (which finds its trace cached) and replaces it here.
    """

    __slots__ = ("table", "lock")

    def __init__(self) -> None:
        # (tree, avals) -> (trace context, the Traced; for `plant`, the program)
        self.table: dict = {}
        self.lock = threading.Lock()

    def get(self, key: Any) -> Any:
        """What a call with this key remembered, in the current trace context; None otherwise."""
        hit = self.table.get(key)
        return hit[1] if hit is not None and hit[0] == _jax.trace_context() else None

    def remember(self, key: Any, traced: Any) -> None:
        with self.lock:
            self.table[key] = (_jax.trace_context(), traced)
            while len(self.table) > TRACE_CACHE_SIZE:
                del self.table[next(iter(self.table))]




def reap(f: Callable, *, tag: Hashable, allowlist: Iterable[Any] | None = None,
         blocklist: Iterable[Any] = (), exclusive: bool = False,
         static_argnums: int | Sequence[int] = (),
         static_argnames: str | Sequence[str] = ()) -> Callable[..., DelayedDict]:
    """Makes `f` return its sites of `tag`, lazily, instead of its output.

    **Arguments:**

    - `f`: the function to harvest; any JAX code may run inside it.
    - `tag`: the tag of the sites to take.
    - `allowlist` / `blocklist`: names, or scoped keys `(*scopes, name)` for
      sites inside `nest`, to take only / not to take; the others behave as
      the identity.
    - `exclusive`: if `True`, sites of other tags inside `f` are hidden from
      harvests outside this one.
    - `static_argnums`, `static_argnames`: arguments passed by value, as
      `jax.jit`'s (hashable, part of the cache key). Leaves that are not
      arrays (functions, strings, Python bools such as a `train` flag) are
      static the same way; Python numbers are traced.

    **Returns:**

    A function with `f`'s arguments that returns a `DelayedDict` of the sites,
    keyed by `(*labels, *scopes, name)` (tangents under `"jvp"` and cotangents
    under `"vjp"` labels when `f` differentiates; see `docs/semantics.md`).
    Calling it traces `f` abstractly, once per argument shapes and dtypes, and
    computes nothing: reading `d[key]` compiles and runs only the slice of
    `f` that computes that leaf; `d.compute()` computes every leaf in one
    program. Not a pytree: return `d.compute()` from `jax.jit`.

    **Raises:**

    `lh.HarvestError`, raised by the call, for errors in `f`'s structure (a
    `"strict"` site sown twice, one name sown with two modes, a site that
    breaks the `scan`/`cond`/`while_loop` rules) and for an argument leaf that
    is not an array. Errors about a key (`lh.HarvestKeyError`, also a
    `KeyError`) are raised when the `DelayedDict` is indexed.

    **Example:**

    >>> import jax
    >>> import lazyharvest as lh
    >>> def f(x):
    ...     return lh.sow(x ** 3, tag="t", name="x3") + 1
    >>> d = lh.reap(f, tag="t")(2.)
    >>> print(d["x3"])
    8.0
    >>> print(lh.reap(jax.grad(f), tag="t")(2.)["vjp", "x3"])
    1.0
    >>> print(jax.jit(lambda x: lh.reap(f, tag="t")(x).compute())(2.)["x3"])
    8.0
    """
    h = _harvest(tag, allowlist, blocklist, exclusive)
    return _reaper(f, h, _call(False, True, static_argnums, static_argnames))


def _reaper(f: Callable, h: Harvest, how: _Call) -> Callable[..., DelayedDict]:
    """`reap(f)`: positional array arguments whose trace this function used
    before take the short path (`_Recent`); every other call, `_run`."""
    recent = _Recent() if not (how.static_argnums or how.static_argnames) else None

    @_jax.api_boundary
    @functools.wraps(f)
    def reaped(*args: Any, **kwargs: Any) -> DelayedDict:
        if kwargs or recent is None:
            return _run(f, h, None, args, kwargs, how)
        concrete, leaves, tree = _arg_leaves(args)
        try:
            key = (tree, tuple(map(_aval, leaves)))
        except AttributeError:  # not all arrays: the general path
            return _run(f, h, None, args, kwargs, how)
        traced = recent.get(key)
        if traced is not None:
            return DelayedDict(_Store(traced, leaves, concrete=concrete))
        return _run(f, h, None, args, kwargs, how, functools.partial(recent.remember, key))
    return reaped


def _arg_leaves(args: tuple) -> tuple[bool, Sequence[Any], Any]:
    """(whether all are jax.Arrays, the leaves, their tree) of positional
    arguments; arrays alone need no flattening (their tree: how many)."""
    if set(map(type, args)) == _ARRAYS:
        return True, args, len(args)
    leaves, tree = _jax.tree_flatten(args)
    return False, leaves, tree


def call_and_reap(f: Callable, *, tag: Hashable,
                  allowlist: Iterable[Any] | None = None,
                  blocklist: Iterable[Any] = (), exclusive: bool = False,
                  static_argnums: int | Sequence[int] = (),
                  static_argnames: str | Sequence[str] = ()
                  ) -> Callable[..., tuple[Any, DelayedDict]]:
    """Makes `f` return its output and its sites of `tag`, lazily.

    **Arguments:**

    - `f`: the function to harvest.
    - `tag`, `allowlist`, `blocklist`, `exclusive`, `static_argnums`,
      `static_argnames`: as for `reap`. Sites of other tags are sown again by
      the program computing the output, so an outer harvest of their tag sees
      them (unless `exclusive`).

    **Returns:**

    A function with `f`'s arguments that returns `(out, d)`: `f`'s output,
    computed by the call (by a program without the sites of `tag`), and the
    lazy `DelayedDict` of the sites, as for `reap`. Reading a leaf of `d`
    runs that leaf's slice; read several with one `d.compute()`. `d` is not a
    pytree: return `d.compute()` from `jax.jit`.

    **Raises:**

    `lh.HarvestError`, raised by the call, for errors in `f`'s structure or
    arguments, as for `reap`. Errors about a key are raised when `d` is
    indexed.

    **Example:**

    >>> import lazyharvest as lh
    >>> def f(x):
    ...     return lh.sow(x ** 3, tag="t", name="x3") + 1
    >>> out, d = lh.call_and_reap(f, tag="t")(2.)
    >>> print(out, d["x3"])
    9.0 8.0
    """
    h = _harvest(tag, allowlist, blocklist, exclusive)
    how = _call(True, True, static_argnums, static_argnames)

    @_jax.api_boundary
    @functools.wraps(f)
    def called(*args: Any, **kwargs: Any) -> tuple[Any, DelayedDict]:
        return _run(f, h, None, args, kwargs, how)
    return called


def plant(f: Callable, *, tag: Hashable, allowlist: Iterable[Any] | None = None,
          blocklist: Iterable[Any] = (), exclusive: bool = False, mode: str = "replace",
          static_argnums: int | Sequence[int] = (),
          static_argnames: str | Sequence[str] = ()) -> Callable[..., Any]:
    """Makes `f` take values for its sites of `tag`, which replace the sown ones.

    **Arguments:**

    - `f`: the function to plant into.
    - `tag`, `allowlist`, `blocklist`, `exclusive`, `static_argnums`,
      `static_argnames`: as for `reap`; a plant for a filtered-out site is
      ignored.
    - `mode`: `"replace"` (the planted value replaces the sown one) or `"add"`
      (it is added to it, broadcasting like `jnp`: a `(D,)` steering vector
      into a `(B, T, D)` site).

    **Returns:**

    A function `g(plants, *args, **kwargs)` that returns `f(*args, **kwargs)`
    with the planted values. `plants` is a mapping keyed like the reaped keys,
    nested (`{"layer": {"x3": v}}`) or with tuple keys
    (`{("layer", "x3"): v}`). A planted value replaces the sown one; on a
    cotangent site (a `"vjp"` key: the backward function of `jax.vjp`, or a
    program that runs `jax.grad`) it is added to the cotangent flowing there.
    Python scalars are cast to the site's dtype. Only the planted sites are
    consumed: a harvest outside `g` still sees the others.

    **Raises:**

    `lh.HarvestError`, raised by the call (there is no `DelayedDict` to index
    later): `plants` is not a mapping; a key that no site of `tag` sows; a
    value of another pytree structure, shape or dtype kind than the site's; a
    derivative leaf of a recorded transform; and the errors in `f`'s
    structure that `reap` reports.

    **Example:**

    >>> import jax
    >>> import lazyharvest as lh
    >>> def f(x):
    ...     return lh.sow(x ** 3, tag="t", name="x3") + 1
    >>> print(lh.plant(f, tag="t")({"x3": 100.}, 2.))
    101.0
    >>> print(lh.plant(jax.grad(f), tag="t")({"vjp": {"x3": 1.}}, 2.))  # 12 + 1 * 12
    24.0
    """
    h = _harvest(tag, allowlist, blocklist, exclusive)
    return _planter(f, h, _call(True, False, static_argnums, static_argnames, mode))


def _planter(f: Callable, h: Harvest, how: _Call) -> Callable[..., Any]:
    """`plant(f)`: a call whose arguments and plant leaves are arrays (no
    tracers, numbers or functions) of the avals of an earlier call, in the
    same trace context, runs that call's program at once (`_Recent`, its
    plant leaves as the earlier call passed them on, uncast: a sweep)."""
    recent = _Recent() if not (how.static_argnums or how.static_argnames) else None

    @_jax.api_boundary
    @functools.wraps(f)
    def planted(plants: Any, *args: Any, **kwargs: Any) -> Any:
        if kwargs or recent is None or type(plants) is not dict:
            return _run(f, h, plants, args, kwargs, how)
        try:
            leaves, tree = _jax.tree_flatten(plants)
        except TypeError:  # (keys JAX cannot sort)
            return _run(f, h, plants, args, kwargs, how)
        concrete, flat, arg_tree = _arg_leaves(args)
        if not (concrete or set(map(type, flat)) == _ARRAYS) or set(map(type, leaves)) - _ARRAYS:
            return _run(f, h, plants, args, kwargs, how)
        key = (tree, arg_tree, tuple(map(_aval, flat)), tuple(map(_aval, leaves)))
        hit = recent.get(key)
        if hit is not None:
            run, out_tree, n_out, perm = hit
            outs = run(*flat, *leaves) if perm is None else run(*flat, *[leaves[i] for i in perm])
            return outs[0] if n_out is None else out_tree.unflatten(outs[:n_out])
        return _run(f, h, plants, args, kwargs, how,
                    remember_program=functools.partial(_remember_plants, recent, key, leaves))
    return planted


def _remember_plants(recent: _Recent, key: Any, given: list, traced: Traced, prog: Any,
                     plant_leaves: list) -> None:
    """Where each plant leaf the program takes is among the leaves of the
    plants given, if each is one of them, passed on as it is."""
    where = {id(x): i for i, x in enumerate(given)}
    perm = [where.get(id(x)) for x in plant_leaves]
    if len(where) == len(given) and None not in perm:
        # (the program has run: its jitted function is called directly; a
        # plain output, one array, and the leaves in their order, unpacked)
        out_tree = traced.out_tree
        recent.remember(key, (prog.fn, out_tree,
                              None if out_tree == _ONE_LEAF else out_tree.num_leaves,
                              None if perm == list(range(len(given))) else perm))


def harvest(f: Callable, *, tag: Hashable, allowlist: Iterable[Any] | None = None,
            blocklist: Iterable[Any] = (), exclusive: bool = False, mode: str = "replace",
            static_argnums: int | Sequence[int] = (),
            static_argnames: str | Sequence[str] = ()
            ) -> Callable[..., tuple[Any, DelayedDict]]:
    """Plants into `f` and reaps the sites of `tag` that were not planted.

    **Arguments:**

    - `f`: the function to harvest and plant into.
    - `tag`, `allowlist`, `blocklist`, `exclusive`, `static_argnums`,
      `static_argnames`, `mode`: as for `reap` and `plant`.

    **Returns:**

    A function `g(plants, *args, **kwargs)` that returns `(out, d)`: `f`'s
    output with the plants applied (as for `plant`), and the lazy
    `DelayedDict` of the sites (as for `call_and_reap`). Planted names do not
    appear in `d`. `d` is not a pytree: return `d.compute()` from `jax.jit`.

    **Raises:**

    `lh.HarvestError`, raised by the call, for the errors of `plant` (about
    `plants`) and of `reap` (about `f`'s structure). Errors about a key are
    raised when `d` is indexed.

    **Example:**

    >>> import lazyharvest as lh
    >>> def f(x):
    ...     a = lh.sow(x, tag="t", name="a")
    ...     return a + lh.sow(2 * a, tag="t", name="b")
    >>> out, d = lh.harvest(f, tag="t")({"a": 10.}, 1.)
    >>> print(out, list(d.keys()), d["b"])
    30.0 ['b'] 20.0
    """
    h = _harvest(tag, allowlist, blocklist, exclusive)
    how = _call(True, True, static_argnums, static_argnames, mode)

    @_jax.api_boundary
    @functools.wraps(f)
    def harvested(plants: Any, *args: Any, **kwargs: Any) -> tuple[Any, DelayedDict]:
        return _run(f, h, plants, args, kwargs, how)
    return harvested


def nest(f: Callable, *, scope: str) -> Callable[..., Any]:
    """Puts the sites inside `f` under `scope`.

    **Arguments:**

    - `f`: the function whose sites get the scope.
    - `scope`: a string, prepended to the scopes of every site `f` sows while
      it runs (so nested `nest` calls give `(outer, inner, ...)`).

    **Returns:**

    A function with `f`'s arguments and output. The key of a site inside it
    is `(*labels, scope, *inner_scopes, name)`; read it as `d[scope, name]` or
    through the sub-view `d[scope][name]`. Plants are looked up under `scope`
    too.

    **Raises:**

    `TypeError`, raised by `nest` itself, if `scope` is not a string.

    **Example:**

    >>> import lazyharvest as lh
    >>> def f(x):
    ...     return lh.sow(x ** 3, tag="t", name="x3") + 1
    >>> layer = lh.nest(f, scope="layer")
    >>> d = lh.reap(layer, tag="t")(2.)
    >>> print(list(d.keys()), d["layer"]["x3"])
    [('layer', 'x3')] 8.0
    >>> print(lh.plant(layer, tag="t")({"layer": {"x3": 0.}}, 2.))
    1.0
    """
    if not isinstance(scope, str):
        raise TypeError(f"nest: scope must be a string, got {scope!r}")

    @functools.wraps(f)
    def nested(*args: Any, **kwargs: Any) -> Any:
        with scoped(scope):
            return f(*args, **kwargs)
    return nested
