"""The `sow` primitive and its rules for every JAX transformation.

One primitive, `sow_p`, marks every site. Its parameters carry the site's
identity (tag, name, scopes), its mode, the pytree structure of the value, and
its *path*: the differentiation levels it went through, innermost first
(`PRIMAL`, `JVP` or `VJP` at each level).

Two design points keep it both faithful and free:

* While a harvest of its tag is being traced, the eqn carries an unordered
  effect, so no DCE pass of JAX drops it (unused sites, tangent sides of
  `linearize`, bodies of `grad(scan)`...). Outside a harvest, the rules of
  `derivative_sites.py` keep dead and constant sites in the programs JAX's
  differentiation makes.
* Otherwise it is bound without an effect: a top-level `jax.jit` keeps its C++
  dispatch fast path (an effect costs ~10x dispatch) and lowers it to nothing.
  In eager mode it binds nothing at all. The set of harvested tags is part of
  jit's trace-cache key (a JAX user context), so a jitted function is retraced
  when a harvest starts, not reused with the wrong kind of site.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lazyharvest import _jax
from lazyharvest.errors import HarvestError
from lazyharvest.keys import JVP, PRIMAL, VJP

__all__ = ["JVP", "MODES", "PRIMAL", "VJP", "sow", "sow_p"]

MODES = ("strict", "clobber", "append")


class SowEffect(_jax.Effect):
    """Unordered effect that keeps harvested sites alive through DCE."""

    def __repr__(self) -> str:
        return "Sow"

    def __hash__(self) -> int:
        return hash(SowEffect)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SowEffect)


sow_effect = SowEffect()
_jax.register_effect(SowEffect)
_jax.keep_effects_in_cond_partial_eval(SowEffect)
_jax.keep_effects_in_call_partial_eval(SowEffect)


# --- harvest state: which tags are being harvested, which nest scopes apply ---

# (tags harvested, nest scopes, tags whose sows are dropped: `consuming`)
_EMPTY_STATE: tuple[frozenset, tuple, frozenset] = (frozenset(), (), frozenset())
_context = jax.make_user_context(default_value=_EMPTY_STATE)


_jax.keep_ref_writing_hi_prims()  # (JAX's own rule outside the blocks that ask)


@contextlib.contextmanager
def _state(value: tuple[frozenset, tuple, frozenset]) -> Iterator[None]:
    """The harvest state is `value` in this block, and the hooks that act on
    it are in force (outside every such block JAX runs its own rules alone)."""
    with _jax.hooks_in_force(), _jax.ref_writing_hi_prims_kept(), _context(value):
        yield


def _current() -> tuple[frozenset, tuple, frozenset]:
    value = _context.value
    return _EMPTY_STATE if value is None else value


def active_tags() -> frozenset:
    return _current()[0]


def current_scopes() -> tuple[str, ...]:
    return _current()[1]


@contextlib.contextmanager
def harvesting(tag: Hashable) -> Iterator[None]:
    """Sites of `tag` traced inside this block are bound with the effect."""
    tags, scopes, dropped = _current()
    with _state((tags | {tag}, scopes, dropped - {tag})):
        yield


@contextlib.contextmanager
def consuming(tag: Hashable) -> Iterator[None]:
    """Sows of `tag` traced inside this block are dropped: they are in a rule
    JAX runs for a custom function, whose sites a harvest already took."""
    tags, scopes, dropped = _current()
    with _state((tags - {tag}, scopes, dropped | {tag})):
        yield


@contextlib.contextmanager
def scoped(scope: str) -> Iterator[None]:
    tags, scopes, dropped = _current()
    with _state((tags, scopes + (scope,), dropped)):
        yield


# --- sites whose tangent is a zero given to the construct around them ---------
# JAX skips a jit, scan, cond or checkpoint none of whose inputs has a tangent;
# derivative_sites.py gives one input a zero tangent so its sites meet that
# level of differentiation. Their tangent sites, bound while it does so, are
# constant sites (`constant`, as a site whose own inputs have none): their
# tangent is made inside, and the split and backward pass treat it so.

_given_zero = jax.make_user_context(default_value=False)


@contextlib.contextmanager
def given_a_zero_tangent(given: bool) -> Iterator[None]:
    """With `given`: the sites bound in this block are constant sites of the
    level of differentiation being traced (their tangent is a given zero)."""
    if not given:
        yield
        return
    with _given_zero(True):
        yield


def tangent_params(params: dict) -> dict:
    """`params` of a tangent site, marked `constant` in a construct given a
    zero tangent (`given_a_zero_tangent`)."""
    return dict(params, constant=True) if _given_zero.value else params


# --- sows a custom_vjp backward rule makes: recomputations ----------------------
# A backward rule that re-runs the forward body (checkpointing) sows again the
# names its forward pass sowed. Those sows are recomputations, not new
# occurrences (SPEC 9): marked `recompute=RULE_COPY` (custom.py), a harvest
# plants their values as it planted the forward occurrences and does not reap
# them, while the tangents and cotangents the rule's own differentiation gives
# them are sites like any others (`is_recomputed`).

RULE_COPY = "rule"


@contextlib.contextmanager
def at_scopes(scopes: tuple) -> Iterator[None]:
    """Sows traced in this block are under the nest scopes `scopes` exactly
    (a custom call's, which its backward rule, run later by JAX, no longer has)."""
    tags, _, dropped = _current()
    with _state((tags, scopes, dropped)):
        yield


# A custom rule JAX runs for a planted program (the user's forward and
# backward rules of a custom_vjp whose function holds a planted site): its
# sows of the planted names take the planted values as they are bound, so
# that what the rule differentiates or recomputes is the planted program.
# (tag, name) -> [(scopes, leaves, add)]; the context's token is part of jit's
# trace-cache key, so a function jitted inside the rule is traced anew.
_planting = jax.make_user_context(default_value=None)
_PLANTED: dict = {}
_tokens = itertools.count()


@contextlib.contextmanager
def planting(plants: dict, collect: bool = False) -> Iterator[dict]:
    """Sows bound in this block of the names in `plants` ((tag, scopes, name)
    -> value) are replaced by `value(sown leaves)`, the planted leaves.

    With `collect`, a replaced sow stays a site of the differentiation the
    rule runs (a constant one: the plant does not depend on the rule's
    inputs), and the cotangents that differentiation gives it are collected:
    the block yields (tag, scopes, name) -> [cotangent leaves, ...].
    """
    collected: dict = {k: [] for k in plants} if collect else {}
    if not plants:
        yield collected
        return
    token = next(_tokens)
    table: dict = {}
    for (tag, scopes, name), value in plants.items():
        table.setdefault((tag, name), []).append(
            (scopes, value, collected.get((tag, scopes, name))))
    _PLANTED[token] = table
    try:
        with _planting(token):
            yield collected
    finally:
        del _PLANTED[token]


def _planted_entry(params: dict) -> tuple | None:
    """The plant of a sow bound now in a `planting` block, if it sows a
    planted name: same scopes, or the only scopes planted under that name (a
    rule's own `sow` calls run outside the call's nest scopes)."""
    token = _planting.value
    if token is None or is_masked(params):
        return None
    found = _PLANTED.get(token, {}).get((params["tag"], params["name"]))
    if not found:
        return None
    exact = [f for f in found if f[0] == params["scopes"]]
    if not exact and len(found) > 1:
        return None
    return (exact or found)[0]


def planted_value(trace: Any, params: dict, vals: list) -> list | None:
    """The planted leaves for a value sow bound now, at `trace`, in a
    `planting` block."""
    entry = None if params["path"] else _planted_entry(params)
    if entry is None:
        return None
    # (a bind runs its hooks with no current trace: the plant, computed from
    # the sown value and the plant's operands, belongs to the sow's)
    with _jax.current_trace(trace):
        return [jnp.broadcast_to(p, jnp.shape(v)).astype(v.dtype)
                for v, p in zip(vals, entry[1](vals))]


def planting_bind(bind: Callable) -> Callable:
    """sow's bind hook around `bind`: counts the bind (`count_sow`); in a
    `planting` block, a planted sow gives its planted leaves, and a collected
    site's cotangent is kept (`collect`). derivative_sites wraps more around
    it (jax >= 0.9); on jax 0.8 it is the hook."""
    def bind_with_trace(trace, args, avals, params):
        count_sow(params)
        planted = planted_value(trace, params, list(args))
        if planted is not None:  # in a custom rule of a planted program
            if not collects(params):
                return planted
            args = planted  # a (constant) site of the rule's differentiation
        elif params["path"][-1:] == (VJP,) and collects(params):
            collect(params, args)
        return bind(trace, args, avals, params)
    return bind_with_trace


def collects(params: dict) -> bool:
    """Whether the cotangents of this site are collected (`planting`)."""
    entry = _planted_entry(dict(params, path=()))
    return entry is not None and entry[2] is not None


def collect(params: dict, cts: Sequence[Any]) -> None:
    """Keeps the cotangent leaves `cts` of a collected site."""
    entry = _planted_entry(dict(params, path=()))
    if entry is not None and entry[2] is not None:
        entry[2].append(list(cts))


def collected_cotangents(found: list) -> list | None:
    """The sum of the cotangents collected for one site, leaf by leaf, but
    those of traces that have ended (made while a rule was traced, then
    bound again); None if there are none."""
    live = [cts for cts in found if not any(_jax.tracer_is_dead(c) for c in cts)]
    if not live:
        return None
    return [sum(leaves[1:], leaves[0]) for leaves in zip(*live)]


def is_recomputed(params: dict) -> bool:
    """A copy of a site, not an occurrence: rematerialized by jax.checkpoint,
    or recomputed by a custom_vjp backward rule (its value only: the
    derivatives of a rule's recomputation are sites)."""
    if params["recompute"] == RULE_COPY:
        return params["path"][-1:] not in ((JVP,), (VJP,))
    return bool(params["recompute"])


# --- the primitive ---

sow_p = _jax.Primitive("sow")
sow_p.multiple_results = True


def _impl(*xs, **_):
    return list(xs)


def _abstract_eval(*avals, effect, **_):
    return list(avals), ({sow_effect} if effect else set())


def _lowering(ctx, *xs, **_):
    return list(xs)


# A *masked* site (`masked=True`, made by the batching of a cond below) has
# one more operand, last: a bool array over the leading (batch) axes of its
# leaves, true for the elements that sow it. Where it is false the site keeps
# its earlier value (docs/semantics.md section 4). The mask is no value of the
# site: it passes through, and a tangent or cotangent site reads the primal
# mask.

def is_masked(params: dict) -> bool:
    return bool(params.get("masked"))


def _jvp(primals, tangents, *, path, **params):
    outs = sow_p.bind(*primals, path=path + (PRIMAL,), **params)
    mask_t = []
    if is_masked(params):
        *tangents, t = tangents
        mask_t = [t]
    if all(type(t) is _jax.Zero for t in tangents) or not any(
            _jax.differentiable(jax.typeof(x)) for x in primals[:len(tangents)]):
        # (an integer or boolean site has no tangent site, also where its
        # tangent is a float0 value read from an integer Ref's tangent)
        return outs, [*tangents, *mask_t]
    tangents = [_jax.ad.instantiate_zeros(t) for t in tangents]
    mask = outs[-1:] if mask_t else []
    outs_t = sow_p.bind(*tangents, *mask, path=path + (JVP,), **tangent_params(params))
    return outs, [*outs_t[:len(tangents)], *mask_t]


def _transpose(cts, *args, path, **params):
    if is_masked(params):  # the mask is a primal input: it has no cotangent
        return [*_transpose_leaves(cts[:-1], args[:-1], args[-1:], path, params), None]
    return _transpose_leaves(cts, args, [], path, params)


def _transpose_leaves(cts, args, mask, path, params):
    # Transposing "read the tangent here" is "write the cotangent here".
    if (params["tag"] not in active_tags() and not _jax.under_differentiation()
            and not collects(params)):
        # Nothing can record this site (no harvest of its tag is traced, and
        # no differentiation would carry it into another program): it is the
        # identity, and a zero stays symbolic (no FLOPs on zeros). The
        # cotangent of a constant site (`constant`: see derivative_sites.py)
        # reaches nothing upstream: drop it.
        if params.get("constant"):
            return [_jax.Zero(a.aval) if _jax.ad.is_undefined_primal(a) else None
                    for a in args]
        return list(cts)
    cts = [_jax.ad.instantiate_zeros(c) if type(c) is _jax.Zero else c
           for c in cts]
    path = (path[:-1] if path and path[-1] == JVP else path) + (VJP,)
    return sow_p.bind(*cts, *mask, path=path, **params)[:len(cts)]


def _batch(vals, dims, **params):
    # Plain jax.vmap: a batched site is reaped with its batch axis first.
    if is_masked(params) and any(d is not None for d in dims):
        # every operand batched, so the mask stays the leading axes of each leaf
        size = next(v.shape[d] for v, d in zip(vals, dims) if d is not None)
        vals = [jnp.broadcast_to(v, (size, *v.shape)) if d is None else v
                for v, d in zip(vals, dims)]
        dims = [0 if d is None else d for d in dims]
    vals = [v if d is None or d == 0 else jnp.moveaxis(v, d, 0)
            for v, d in zip(vals, dims)]
    return sow_p.bind(*vals, **params), [None if d is None else 0 for d in dims]


_remat_tokens = itertools.count(1)


def _remat_partial_eval(saveable, unks_in, inst_in, eqn):
    # Default remat partial eval saves the outputs of known effectful eqns as
    # residuals. Recompute the site instead. The recomputed copy is marked
    # (`recompute=token`) so a harvest does not count it twice, and the known
    # original lists the token among its `remat` params, so a harvest plants
    # the copy as it planted the original. A policy that saves the site's
    # value (everything_saveable, save_anything_except_these_names) saves it
    # as it would the value the site passes on: no residual is added.
    n = len(eqn.outvars)
    res = [v for v, inst in zip(eqn.invars, inst_in) if not inst]
    if any(unks_in):
        return None, eqn, [True] * n, [True] * n, res
    if _jax.policy_saves(saveable, eqn):
        return eqn, None, [False] * n, [False] * n, []
    token = next(_remat_tokens)
    known = _jax.replace_eqn_params(eqn, remat=eqn.params.get("remat", ()) + (token,))
    staged = _jax.replace_eqn_params(eqn, recompute=token, remat=())
    return known, staged, [False] * n, [True] * n, res


def _recomputed_call(saveable, unks_in, inst_in, eqn):
    # JAX has no remat rule for a custom_jvp/custom_vjp call, nor for
    # `call_hi_primitive` (a custom function's object under the jax_custom_*3
    # flags): it copies a known one whole into the rematerialized part, where
    # the copies of its sites would count as occurrences. This is JAX's
    # default, the copied sites of a custom function marked as
    # `_remat_partial_eval` marks its own (only its function is copied: a
    # derivative the rule makes later is a site). An offloading policy saves
    # the call's outputs instead of offloading them (a rule gives one known
    # eqn: JAX's default adds the copies to memory and back).
    n = len(eqn.outvars)
    res = [v for v, inst in zip(eqn.invars, inst_in)
           if not inst and not isinstance(v, _jax.Literal)]
    if any(unks_in):
        return None, eqn, [True] * n, [True] * n, res
    if _jax.has_effects(eqn) or not _jax.policy_recomputes(saveable, eqn):
        return eqn, None, [False] * n, [False] * n, []
    if not _custom_function_sows(eqn):
        return eqn, eqn, [False] * n, [True] * n, res
    token = next(_remat_tokens)
    known = _jax.map_eqn_params(eqn, sow_p, lambda p: dict(
        p, remat=p.get("remat", ()) + (token,)))
    staged = _jax.map_eqn_params(eqn, sow_p, lambda p: dict(
        p, recompute=p["recompute"] or token, remat=()))
    return known, staged, [False] * n, [True] * n, res


def _custom_function_sows(eqn: _jax.JaxprEqn) -> bool:
    if eqn.primitive is _jax.call_hi_primitive_p and not _jax.is_custom_hi_prim(
            eqn.params["_prim"]):
        return False  # (another high-level primitive: copied as JAX copies it)
    return any(True for j in sub_jaxprs(eqn.params) for _ in _sows(j))


sow_p.def_impl(_impl)
sow_p.def_effectful_abstract_eval(_abstract_eval)
if not _jax.DERIVATIVE_SITES:  # (on jax >= 0.9 derivative_sites' hook wraps this one)
    _jax.register_bind_hook(sow_p, planting_bind)
_jax.mlir.register_lowering(sow_p, _lowering)
_jax.ad.primitive_jvps[sow_p] = _jvp
_jax.ad.primitive_transposes[sow_p] = _transpose
_jax.register_batcher(sow_p, _batch)
_jax.register_remat_rule(sow_p, _remat_partial_eval)
_jax.register_remat_rule(_jax.custom_jvp_call_p, _recomputed_call)
_jax.register_remat_rule(_jax.custom_vjp_call_p, _recomputed_call)
if _jax.CUSTOM_HI_PRIMS and _jax.call_hi_primitive_p is not None:  # (jax >= 0.12)
    _jax.register_remat_rule(_jax.call_hi_primitive_p, _recomputed_call)
_jax.keep_in_scan_loops(sow_p, SowEffect, lambda params: params["effect"])


def _check_leaf(leaf: Any, tag: Hashable, name: str) -> Any:
    if isinstance(leaf, (np.ndarray, np.generic)) and leaf.dtype.kind not in "biufcV":
        raise HarvestError(
            f"sow(tag={tag!r}, name={name!r}): a sown value must hold numbers, got "
            f"a numpy array of dtype {leaf.dtype}. Sow numeric arrays only.")
    if isinstance(leaf, (jax.Array, np.ndarray, np.generic)) or _jax.is_tracer(leaf):
        return leaf
    if isinstance(leaf, (bool, int, float, complex)):
        return jnp.asarray(leaf)
    raise HarvestError(
        f"sow(tag={tag!r}, name={name!r}): a sown value must be a pytree of "
        f"arrays, got a leaf of type {type(leaf).__name__}. Sow arrays or "
        f"Python numbers only.")


_CONTAINERS = (dict, list, tuple)


def _eager_arrays(value: Any, name: Any, mode: str) -> bool:
    """An array, or a dict, list or tuple of arrays, sown with good arguments."""
    return mode in MODES and (isinstance(value, jax.Array) or (
        type(value) in _CONTAINERS and type(name) is str and _all_arrays(value)))


def _all_arrays(value: Any) -> bool:
    items = value.values() if type(value) is dict else value
    if items and all(isinstance(x, jax.Array) for x in items):  # (one level: no flatten)
        return True
    leaves = jax.tree_util.tree_leaves(value)
    return bool(leaves) and all(isinstance(x, jax.Array) for x in leaves)


def _checked_leaves(value: Any, tag: Hashable, name: str, mode: str) -> tuple[list, Any]:
    """The value's leaves as arrays, and its tree, once the arguments are checked."""
    if mode not in MODES:
        raise HarvestError(
            f"sow(tag={tag!r}, name={name!r}): unknown mode {mode!r}; use one "
            f"of {', '.join(map(repr, MODES))}.")
    if not isinstance(name, str):
        raise HarvestError(
            f"sow(tag={tag!r}, name={name!r}): the name must be a string.")
    if value is None:
        raise HarvestError(
            f"sow(tag={tag!r}, name={name!r}): cannot sow None; sow an array "
            f"or a pytree of arrays.")
    leaves, tree = jax.tree_util.tree_flatten(value)
    return [_check_leaf(x, tag, name) for x in leaves], tree


def sow(value: Any, *, tag: Hashable, name: str, mode: str = "strict",
        key: Any = None) -> Any:
    """Marks `value` as the site `name` of the harvests of `tag`; returns `value`.

    Outside a harvest of `tag` it is the identity and costs nothing: nothing
    happens in eager mode, and under `jax.jit` it lowers to no operation.
    Inside `reap`, `call_and_reap`, `plant` or `harvest` of `tag`, its value
    (and, under JAX's differentiation, its tangent or cotangent) can be reaped
    or replaced.

    **Arguments:**

    - `value`: a pytree of arrays (Python numbers are taken as arrays).
    - `tag`: any hashable; the harvests of this tag take the site.
    - `name`: a string, the site's name; its key is `(*labels, *scopes, name)`.
    - `mode`: what a second sow of `name` in one run does: `"strict"` (an
      error), `"clobber"` (the last value wins) or `"append"` (the values are
      stacked along a new leading axis, in program order; by iteration in
      `lax.scan`). Inside `lax.while_loop` only `"clobber"` is allowed.
    - `key`: accepted for compatibility with Oryx's `sow`, and ignored:
      constants are reaped without it.

    **Returns:**

    `value` itself; inside a `plant` or `harvest` that plants this site, the
    planted value.

    **Raises:**

    `lh.HarvestError` if `mode` is not one of the three, if `value` is `None`
    or has a leaf that is not an array or a Python number, or if `name` is not
    a string (checked where the sow is traced). A second `"strict"` sow of one
    name, or one name sown with two modes, is reported by the harvest, when
    the reaped function is called.

    **Example:**

    >>> import lazyharvest as lh
    >>> def f(x):
    ...     for _ in range(3):
    ...         x = lh.sow(x + 1., tag="t", name="h", mode="append")
    ...     return x
    >>> print(f(0.))  # outside a harvest: the identity
    3.0
    >>> print(lh.reap(f, tag="t")(0.)["h"])
    [1. 2. 3.]
    """
    del key
    if _jax.in_eager_mode() and _eager_arrays(value, name, mode):
        return value  # the common case outside any transformation: nothing to do
    leaves, tree = _checked_leaves(value, tag, name, mode)
    # (dropped: in a rule whose sites a harvest took, `consuming`)
    if not leaves or _jax.in_eager_mode() or tag in _current()[2]:
        return value
    tags, scopes, _ = _current()
    effect = tag in tags and _jax.traced_for() not in CHECK_TRACES
    _jax.first_use()  # (the hooks that act on programs holding sites)
    outs = sow_p.bind(*leaves, tag=tag, name=name, mode=mode, scopes=scopes,
                      path=(), tree=tree, effect=effect, recompute=False)
    return jax.tree_util.tree_unflatten(tree, outs)


# Traces a library makes only to check a body, not to run it: it DCEs their
# jaxpr and reads which inputs stay live. A site there is no occurrence, and
# bound with its effect it would keep its inputs live: Flax's nn.scan (flax >=
# 0.12.9) then says a broadcast variable depends on the loop. There a site is
# bound without its effect, so DCE drops it; the body Flax scans is traced
# again, with its sites.
CHECK_TRACES = frozenset({"flax scan"})


_SOWN = threading.local()


def harvested_sows() -> int:
    """How many sows of a harvested tag this thread has bound so far, from
    `sow` or from a jaxpr's eqns (a rule compares it before and after running
    the user's code: `jax.lax.custom_root`'s evaluates traced jaxprs)."""
    return getattr(_SOWN, "count", 0)


def count_sow(params: dict) -> None:
    """Counts a bind of `sow_p` (its bind hook calls this)."""
    if params["tag"] in active_tags():
        _SOWN.count = harvested_sows() + 1


def count_staged_sows() -> None:
    """Counts a bind that stages sows of a harvested tag JAX traced earlier
    (a custom function's object under `jax_custom_*3`: JAX's trace cache may
    not trace its function again, so `sow_p` is not bound)."""
    _SOWN.count = harvested_sows() + 1


# --- vmap of lax.cond with a batched predicate ----------------------------------
# JAX turns such a cond into "run every branch, then select". A site in each
# branch would then be sown once per branch, and a copy sown after the select
# would be dead: reverse mode and plants would not reach the program. Instead
# the branches are cut at their sites (also inside `jax.jit` calls and
# `jax.checkpoint` there),
# merged into one order: stage k runs every branch up to site k, JAX selects
# the value each element's branch sows there, that value is sown once, and the
# sown value is what the later stages of every branch go on with. The site
# then holds each element's taken branch value, and its cotangent and a plant
# flow through the program. A clobber site that only some branches sow is a
# masked site: an element whose branch does not sow it keeps its earlier
# value, as without vmap. Branches this cannot cut (sites inside other
# higher-order primitives, append or strict sites only some branches sow,
# shared sites in different orders) are refused while their tag is harvested
# (JAX's batching would sow every branch's sites) and batched as JAX does
# otherwise.

class _Stop(Exception):
    """Raised when a branch reaches the site where its stage ends."""

    def __init__(self, vals: list):
        super().__init__()
        self.vals = vals


sub_jaxprs = _jax.sub_jaxprs


def _sows(jaxpr: Any) -> Iterator[dict]:
    """The params of every sow in `jaxpr`, nested ones included."""
    for e in jaxpr.eqns:
        if e.primitive is sow_p:
            yield e.params
        for j in sub_jaxprs(e.params):
            yield from _sows(j)


def _body_sows(params: dict) -> bool:
    """A body among `params` holds a site of a harvested tag (its effect)."""
    return any(isinstance(e, SowEffect) for j in sub_jaxprs(params) for e in j.effects)


# A cond, jit, checkpoint or scan holding sites is not hoisted out of a scan
# either (its sites would be sown once, not once per iteration).
for _prim in (_jax.cond_p, _jax.jit_p, _jax.remat_p, _jax.scan_p):
    _jax.keep_in_scan_loops(_prim, SowEffect, _body_sows)


def _inlined(eqn: Any) -> Any:
    """The closed jaxpr of a call the stages look into, else None. A
    `jax.checkpoint` counts as a call: its stages run inline (same values and
    derivatives; inside such a cond the branches save what they compute)."""
    if eqn.primitive is _jax.jit_p:
        return eqn.params["jaxpr"]
    if eqn.primitive is _jax.closed_call_p:
        return eqn.params["call_jaxpr"]
    if eqn.primitive is _jax.remat_p:
        return _jax.ClosedJaxpr(eqn.params["jaxpr"], ())
    remat = _jax.remat_traced_params(eqn.params.get("_prim"))  # (jax_remat3)
    if remat is not None:  # (its inputs in the same order)
        return _jax.ClosedJaxpr(remat["jaxpr"], ())
    return None


def _site_order(jaxpr: Any) -> list | None:
    """The params of the sows a branch runs, in order; None if one sits in a
    higher-order primitive other than a call."""
    out: list = []
    for e in jaxpr.eqns:
        if e.primitive is sow_p:
            out.append(e.params)
        elif any(True for j in sub_jaxprs(e.params) for _ in _sows(j)):
            inner = _inlined(e)
            found = None if inner is None else _site_order(inner.jaxpr)
            if found is None:
                return None
            out += found
    return out


def _run_to(jaxpr: Any, consts: Any, args: list, subs: list, stop: int | None,
            count: list) -> list:
    """Evaluates `jaxpr`; sow j outputs `subs[j]`; sow `stop` raises `_Stop`."""
    def step(eqn: Any, vals: list) -> list:
        inner = _inlined(eqn)
        if eqn.primitive is sow_p:
            j = count[0]
            count[0] += 1
            if j == stop:
                raise _Stop(vals)
            return subs[j]
        if inner is not None and any(True for _ in _sows(inner.jaxpr)):
            return _run_to(inner.jaxpr, inner.consts, vals, subs, stop, count)
        outs = _jax.bind_eqn(eqn, vals)
        return outs if eqn.primitive.multiple_results else [outs]
    return _jax.eval_eqns(jaxpr, consts, args, step)


def _merge(orders: list[list]) -> tuple[list, list] | None:
    """One order of every branch's sites in which each branch's own order is a
    subsequence: (the sites' params, per branch the indexes of its sites).
    None when the branches order shared sites differently."""
    first: dict = {}  # site id -> (params, rank of first appearance)
    ids_per: list = []
    for order in orders:
        seen: dict = {}
        ids = []
        for p in order:
            key = tuple(sorted(_site_identity(p).items()))
            n = seen[key] = seen.get(key, -1) + 1
            ids.append((key, n))
            first.setdefault((key, n), (p, len(first)))
        ids_per.append(ids)
    succ: dict = {i: [] for i in first}
    indeg = dict.fromkeys(first, 0)
    for ids in ids_per:
        for a, b in zip(ids, ids[1:]):
            if b not in succ[a]:
                succ[a].append(b)
                indeg[b] += 1
    out: list = []
    ready = [i for i in first if indeg[i] == 0]
    while ready:
        ready.sort(key=lambda i: first[i][1])
        i = ready.pop(0)
        out.append(i)
        for j in succ[i]:
            indeg[j] -= 1
            if indeg[j] == 0:
                ready.append(j)
    if len(out) < len(first):
        return None
    index = {i: k for k, i in enumerate(out)}
    return [first[i][0] for i in out], [[index[i] for i in ids] for ids in ids_per]


def _stage(closed: Any, own: list[int], k: int | None, site_avals: list) -> Any:
    """A branch as `(*ops, *the leaves of sites 0..k-1) -> the inputs of site
    k` (its outputs when `k` is None; zeros if it does not sow site k).

    Sites are numbered in the merged order; `own` numbers the branch's sites.
    """
    n_in = len(closed.jaxpr.invars)
    before = site_avals if k is None else site_avals[:k]
    sizes = [len(a) for a in before]

    def fn(*args):
        per, i = [], n_in
        for n in sizes:
            per.append(list(args[i:i + n]))
            i += n
        if k is not None and k not in own:
            return [jnp.zeros(a.shape, a.dtype) for a in site_avals[k]]
        stop = None if k is None else own.index(k)
        subs = [per[m] if m < len(per) else None for m in own]
        try:
            return _run_to(closed.jaxpr, closed.consts, list(args[:n_in]), subs, stop, [0])
        except _Stop as at:
            return at.vals

    avals = [v.aval for v in closed.jaxpr.invars] + [a for s in before for a in s]
    jaxpr, consts = _jax.trace_flat(fn, avals)
    return _jax.ClosedJaxpr(jaxpr, consts)


def _site_identity(params: dict) -> dict:
    # Branches pair their rematerialized copies with their originals by
    # tokens of their own; the lifted site is sown once, with branch 0's.
    r = params["recompute"]
    return dict(params, recompute=r if isinstance(r, str) else bool(r), remat=())


_APPLYING = threading.local()


@contextlib.contextmanager
def applying_recorded() -> Iterator[None]:
    """The library is applying a recorded transformation itself: the values of
    the sites it batches are reaped by the harvest's own rules, not from JAX's
    batching of a cond."""
    _APPLYING.depth = getattr(_APPLYING, "depth", 0) + 1
    try:
        yield
    finally:
        _APPLYING.depth -= 1


def is_applying_recorded() -> bool:
    return bool(getattr(_APPLYING, "depth", 0))


def _refuse(branches: tuple, why: str) -> None:
    """Branches the stages cannot cut: JAX would run every branch and sow each
    branch's sites, whatever branch an element takes. Silently wrong values
    for a harvested site: an error instead (sites of other tags are inert)."""
    if is_applying_recorded():
        return
    for b in branches:
        for p in _sows(b.jaxpr):
            if p["effect"]:
                raise HarvestError(
                    f"harvest of tag {p['tag']!r}: site {p['name']!r} is sown in a "
                    f"branch of a lax.cond/switch whose predicate jax.vmap batches, and "
                    f"{why}. JAX would run every branch and sow each one's sites, so "
                    f"the reaped values would be wrong. Use lh.vmap instead of "
                    f"jax.vmap around the harvested code (it keeps the cond), or sow "
                    f"outside the branches.")


def _make_cond_batcher(original: Callable) -> Callable:
    def rule(axis_data: Any, args: list, dims: list, *, branches: tuple,
             **params: Any) -> Any:
        unstaged = lambda: original(axis_data, args, dims, branches=branches, **params)
        if dims[0] is None or not any(True for b in branches for _ in _sows(b.jaxpr)):
            return unstaged()
        found = [_site_order(b.jaxpr) for b in branches]
        if any(o is None for o in found):
            _refuse(branches, "a site in a branch sits inside another higher-order "
                    "primitive (a scan, a loop, a nested cond or a custom rule)")
            return unstaged()
        merged = _merge([o for o in found if o is not None])
        if merged is None:
            _refuse(branches, "the branches sow shared sites in different orders")
            return unstaged()
        sites, owns = merged
        site_avals: list = []  # per site, the avals of its leaves
        sown: list = []  # the sown (batched) leaves of every site so far
        sown_dims: list = []
        for k, p in enumerate(sites):
            having = [i for i, own in enumerate(owns) if k in own]
            if p["mode"] != "clobber" and len(having) < len(branches):
                _refuse(branches, f"only some branches sow the {p['mode']} site "
                        f"{p['name']!r}")
                return unstaged()
            stages = {i: _stage(branches[i], owns[i], k, site_avals) for i in having}
            shapes = [[(a.shape, a.dtype) for a in s.out_avals] for s in stages.values()]
            if any(x != shapes[0] for x in shapes):
                _refuse(branches, f"the branches sow {p['name']!r} with different "
                        f"shapes or dtypes")
                return unstaged()
            site_avals.append(list(stages[having[0]].out_avals))
            stages.update({i: _stage(b, owns[i], k, site_avals)
                           for i, b in enumerate(branches) if i not in stages})
            vals, vdims = original(axis_data, [*args, *sown], [*dims, *sown_dims],
                                   branches=tuple(stages[i] for i in range(len(branches))),
                                   **params)
            if len(having) < len(branches) and not is_masked(p):
                # the elements whose branch sows it (a site masked already
                # selects a false mask where a branch does not sow it)
                mask = jnp.isin(args[0], jnp.asarray(having, args[0].dtype))
                vals, vdims = _batch([*vals, mask], [*vdims, dims[0]], **p, masked=True)
                vals, vdims = vals[:-1], vdims[:-1]
            else:
                vals, vdims = _batch(vals, vdims, **p)
            sown += vals
            sown_dims += vdims
        final = tuple(_stage(b, own, None, site_avals) for b, own in zip(branches, owns))
        return original(axis_data, [*args, *sown], [*dims, *sown_dims], branches=final,
                        **params)
    return rule


_jax.wrap_cond_batcher(_make_cond_batcher)
