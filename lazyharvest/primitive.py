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
from collections.abc import Hashable, Iterator
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


# --- harvest state: which tags are being harvested, which nest scopes apply ---

_EMPTY_STATE: tuple[frozenset, tuple] = (frozenset(), ())
_state = jax.make_user_context(default_value=_EMPTY_STATE)


def _current() -> tuple[frozenset, tuple]:
    value = _state.value
    return _EMPTY_STATE if value is None else value


def active_tags() -> frozenset:
    return _current()[0]


def current_scopes() -> tuple[str, ...]:
    return _current()[1]


@contextlib.contextmanager
def harvesting(tag: Hashable) -> Iterator[None]:
    """Sites of `tag` traced inside this block are bound with the effect."""
    tags, scopes = _current()
    with _state((tags | {tag}, scopes)):
        yield


@contextlib.contextmanager
def scoped(scope: str) -> Iterator[None]:
    tags, scopes = _current()
    with _state((tags, scopes + (scope,))):
        yield


# --- the primitive ---

sow_p = _jax.Primitive("sow")
sow_p.multiple_results = True


def _impl(*xs, **_):
    return list(xs)


def _abstract_eval(*avals, effect, **_):
    return list(avals), ({sow_effect} if effect else set())


def _lowering(ctx, *xs, **_):
    return list(xs)


def _jvp(primals, tangents, *, path, **params):
    outs = sow_p.bind(*primals, path=path + (PRIMAL,), **params)
    if all(type(t) is _jax.Zero for t in tangents):
        return outs, list(tangents)
    tangents = [_jax.ad.instantiate_zeros(t) for t in tangents]
    return outs, sow_p.bind(*tangents, path=path + (JVP,), **params)


def _transpose(cts, *args, path, **params):
    # Transposing "read the tangent here" is "write the cotangent here".
    if params["tag"] not in active_tags() and not _jax.under_differentiation():
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
    return sow_p.bind(*cts, path=path, **params)


def _batch(vals, dims, **params):
    # Plain jax.vmap: a batched site is reaped with its batch axis first.
    vals = [v if d is None or d == 0 else jnp.moveaxis(v, d, 0)
            for v, d in zip(vals, dims)]
    return sow_p.bind(*vals, **params), [None if d is None else 0 for d in dims]


def _remat_partial_eval(saveable, unks_in, inst_in, eqn):
    # Default remat partial eval saves the outputs of known effectful eqns as
    # residuals. Recompute the site instead; the recomputed copy is marked so
    # a harvest does not count it twice.
    del saveable
    n = len(eqn.outvars)
    res = [v for v, inst in zip(eqn.invars, inst_in) if not inst]
    if any(unks_in):
        return None, eqn, [True] * n, [True] * n, res
    staged = _jax.replace_eqn_params(eqn, recompute=True)
    return eqn, staged, [False] * n, [True] * n, res


sow_p.def_impl(_impl)
sow_p.def_effectful_abstract_eval(_abstract_eval)
_jax.mlir.register_lowering(sow_p, _lowering)
_jax.ad.primitive_jvps[sow_p] = _jvp
_jax.ad.primitive_transposes[sow_p] = _transpose
_jax.register_batcher(sow_p, _batch)
_jax.register_remat_rule(sow_p, _remat_partial_eval)


def _check_leaf(leaf: Any, tag: Hashable, name: str) -> Any:
    if isinstance(leaf, (jax.Array, np.ndarray, np.generic)) or _jax.is_tracer(leaf):
        return leaf
    if isinstance(leaf, (bool, int, float, complex)):
        return jnp.asarray(leaf)
    raise HarvestError(
        f"sow(tag={tag!r}, name={name!r}): a sown value must be a pytree of "
        f"arrays, got a leaf of type {type(leaf).__name__}. Sow arrays or "
        f"Python numbers only.")


def sow(value: Any, *, tag: Hashable, name: str, mode: str = "strict",
        key: Any = None) -> Any:
    """Marks `value` as the site `name` of harvest `tag`; returns `value`.

    Outside a harvest of `tag` it is the identity: nothing in eager mode, an
    eqn that lowers to no HLO under `jit`. `mode` says what a second sow of the
    same name in one run does: "strict" (an error), "clobber" (the last value
    wins) or "append" (values are stacked along a new leading axis).
    `key` is accepted for compatibility with Oryx and not needed: constants are
    reaped without it.
    """
    del key
    if _jax.in_eager_mode() and isinstance(value, jax.Array) and mode in MODES:
        return value  # the common case outside any transformation: nothing to do
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
    leaves = [_check_leaf(x, tag, name) for x in leaves]
    if not leaves or _jax.in_eager_mode():
        return value
    tags, scopes = _current()
    outs = sow_p.bind(*leaves, tag=tag, name=name, mode=mode, scopes=scopes,
                      path=(), tree=tree, effect=tag in tags, recompute=False)
    return jax.tree_util.tree_unflatten(tree, outs)


# --- vmap of lax.cond with a batched predicate ----------------------------------
# JAX turns such a cond into "run every branch, then select". A site in each
# branch would then be sown once per branch. Instead, lift the branches' sites
# out as outputs, let JAX select them like any output, and sow the selected
# value once: the site holds the taken branch's value, element by element.

def _lift_sites(closed):
    found: list = []

    def fn(*args):
        env: dict = {}
        read = lambda v: v.val if isinstance(v, _jax.Literal) else env[v]
        for v, x in zip(closed.jaxpr.invars, args):
            env[v] = x
        for v, x in zip(closed.jaxpr.constvars, closed.consts):
            env[v] = x
        lifted = []
        for eqn in closed.jaxpr.eqns:
            vals = [read(v) for v in eqn.invars]
            if eqn.primitive is sow_p:
                found.append(eqn.params)
                lifted += vals
                outs = vals
            else:
                outs = eqn.primitive.bind(*vals, **_jax.bind_params(eqn))
                outs = outs if eqn.primitive.multiple_results else [outs]
            for v, x in zip(eqn.outvars, outs):
                env[v] = x
        return [read(v) for v in closed.jaxpr.outvars] + lifted

    jaxpr, consts = _jax.trace_flat(fn, [v.aval for v in closed.jaxpr.invars])
    return _jax.ClosedJaxpr(jaxpr, consts), found


def _make_cond_batcher(original):
    def rule(axis_data, args, dims, *, branches, **params):
        if dims[0] is None or not any(
                e.primitive is sow_p for b in branches for e in b.jaxpr.eqns):
            return original(axis_data, args, dims, branches=branches, **params)
        lifted = [_lift_sites(b) for b in branches]
        first = lifted[0][1]
        same = all(ps == first and b.out_avals == lifted[0][0].out_avals
                   for b, ps in lifted)
        if not same:  # the harvest reports mismatched branches
            return original(axis_data, args, dims, branches=branches, **params)
        outs, out_dims = original(axis_data, args, dims,
                                  branches=tuple(b for b, _ in lifted), **params)
        n = len(branches[0].out_avals)
        site_vals, site_dims = list(outs[n:]), list(out_dims[n:])
        for p in first:
            k = p["tree"].num_leaves
            vals, dms = site_vals[:k], site_dims[:k]
            del site_vals[:k], site_dims[:k]
            _batch(vals, dms, **p)
        return list(outs[:n]), list(out_dims[:n])
    return rule


_jax.wrap_cond_batcher(_make_cond_batcher)
