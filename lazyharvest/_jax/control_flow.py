"""Params of the control-flow primitives the package rewrites (scan's
counts of consts and carries), the ordinary primitives the `jax_*3` flags'
high-level primitives stand for, and the vmap rule of `lax.cond`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lazyharvest._identity_cache import MISSING, IdentityCache
from lazyharvest._jax.core import (
    HI_PRIM_FLAGS,
    ClosedJaxpr,
    JaxprEqn,
    Primitive,
    eval_jaxpr,
    new_jaxpr_eqn,
    remat_p,
    scan_p,
    trace_flat,
)
from lazyharvest._jax.versions import JAX_VERSION


def scan_counts(params: dict) -> tuple[int, int]:
    """A scan eqn's (number of consts, number of carries).

    jax < 0.11 has them as params `num_consts`, `num_carry`; jax >= 0.11
    describes the operands by a flat tree `ft_in` of (consts, carry, xs).
    """
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    consts, carry, _xs = params["ft_in"].unpack()
    return len(consts), len(carry)


def scan_params(params: dict, jaxpr: Any, num_consts: int, num_carry: int,
                linear: Callable[[tuple], tuple] | None = None) -> dict:
    """`params` of a scan with the body `jaxpr` (closed), `num_consts` consts
    and `num_carry` carries (the rest of its inputs are xs, of its outputs
    ys). `linear(old)` gives the new per-input `linear` flags where JAX has
    them (jax < 0.11; all False if not given)."""
    if "num_consts" in params:
        out = dict(params, jaxpr=jaxpr, num_consts=num_consts, num_carry=num_carry)
        if "linear" in params:
            n = len(jaxpr.in_avals)
            out["linear"] = (tuple(linear(tuple(params["linear"]))) if linear
                             else (False,) * n)
        return out
    # (jax >= 0.11 only)
    from jax._src import flattree as _ft  # type: ignore[attr-defined]

    n_xs = len(jaxpr.in_avals) - num_consts - num_carry
    n_ys = len(jaxpr.out_avals) - num_carry
    return dict(params, jaxpr=jaxpr,
                ft_in=_ft.pack((_ft.nones(num_consts), _ft.nones(num_carry),
                                _ft.nones(n_xs))),
                ft_out=_ft.pack((_ft.nones(num_carry), _ft.nones(n_ys))))


SCAN3: type | None = next((c for c, f in HI_PRIM_FLAGS.items() if f == "jax_scan3"), None)
_AS_SCAN = IdentityCache()  # (Scan3 object,) -> (scan params, order)


def scan3_params(prim: Any) -> tuple[dict, list[int]] | None:
    """For a `Scan3` object (`jax_scan3`), the params of the `scan` it
    stands for, and `order`: which of the `Scan3`'s inputs each of the
    scan's is; None for any other object. `Scan3` has no carry (the carry
    is a Ref among its non-extensive inputs, which the body reads and
    writes): its non-extensive inputs become the scan's consts, its
    extensive ones the xs, in that order. Unlike `Scan3.expand` in jax
    0.12, the scan honours `reverse`."""
    if SCAN3 is None or not isinstance(prim, SCAN3):
        return None
    hit = _AS_SCAN.get((prim,))
    if hit is MISSING:
        hit = _scan_params_of(prim)
        _AS_SCAN.put((prim,), None, hit)
    return hit


REMAT_TRACED: Any = next(  # (a class, or None)
    (c for c, f in HI_PRIM_FLAGS.items() if f == "jax_remat3"), None)


def remat_traced_params(prim: Any) -> dict | None:
    """For a `RematTraced` object (`jax_remat3`), the params of the `remat2`
    (`jax.checkpoint` with the flag off) it stands for: the same body,
    policy (None, as both spell "save nothing") and `prevent_cse`, inputs in
    the same order; None for any other object, and for one whose body is a
    jaxpr with consts (jax 0.10 and 0.11 hold a closed jaxpr; `jax.checkpoint`
    passes its consts as inputs, so they hold none)."""
    if REMAT_TRACED is None or not isinstance(prim, REMAT_TRACED):
        return None
    params = prim.params
    body = params["jaxpr"]
    if isinstance(body, ClosedJaxpr):
        if body.consts:
            return None
        body = body.jaxpr
    return {"jaxpr": body, "prevent_cse": params.get("prevent_cse", True),
            "differentiated": False, "policy": params["policy"]}


def stands_for(prim: Any) -> tuple[Primitive, dict, list[int]] | None:
    """For a high-level primitive object that a `jax_*3` flag makes JAX stage
    in place of an ordinary primitive with the same semantics, that
    primitive, its params, and `order`: which of the object's inputs each of
    the primitive's is. `Scan3`: `scan` (`scan3_params`); `RematTraced`:
    `remat2` (`remat_traced_params`); None for any other object."""
    scan = scan3_params(prim)
    if scan is not None:
        return scan_p, scan[0], scan[1]
    remat = remat_traced_params(prim)
    if remat is not None:
        return remat_p, remat, list(range(len(remat["jaxpr"].invars)))
    return None


def as_ordinary_eqn(eqn: JaxprEqn) -> tuple[JaxprEqn, list[int]] | None:
    """For a `call_hi_primitive` eqn `stands_for` maps, the eqn of the
    ordinary primitive it stands for, and `order`; None for any other eqn."""
    found = stands_for(eqn.params.get("_prim"))
    if found is None:
        return None
    prim, params, order = found
    return new_jaxpr_eqn([eqn.invars[i] for i in order], eqn.outvars, prim, params,
                         eqn.effects, eqn.source_info, eqn.ctx), order


def _scan_params_of(prim: Any) -> tuple[dict, list[int]]:
    body = prim.jaxpr
    consts = list(getattr(body, "consts", ()) or ())
    ext = list(prim.extensives)
    order = [i for i, e in enumerate(ext) if not e] + [i for i, e in enumerate(ext) if e]
    in_avals = list(body.in_avals)

    def permuted(*args: Any) -> list:
        full: list = [None] * len(args)
        for pos, i in enumerate(order):
            full[i] = args[pos]
        return eval_jaxpr(body, consts, *full)
    jaxpr, new_consts = trace_flat(permuted, [in_avals[i] for i in order])
    n_consts = ext.count(False)
    base: dict = {"reverse": prim.reverse, "length": prim.length, "unroll": prim.unroll}
    if JAX_VERSION < (0, 11):  # (0.10: the counts as params)
        base.update(num_consts=n_consts, num_carry=0)
    return scan_params(base, ClosedJaxpr(jaxpr, new_consts), n_consts, 0), order


def wrap_cond_batcher(make_rule: Callable[[Callable], Callable]) -> None:
    """Replaces the vmap rule of `lax.cond` by `make_rule(original_rule)`."""
    from jax._src.lax.control_flow import conditionals as _cond

    batchers = _jax_batching_private().fancy_primitive_batchers
    original = batchers[_cond.cond_p]
    if getattr(original, "_lazyharvest", False):
        return
    rule = make_rule(original)
    rule._lazyharvest = True  # type: ignore[attr-defined]
    batchers[_cond.cond_p] = rule


def _jax_batching_private():
    from jax._src.interpreters import batching as _batching
    return _batching


def internals() -> dict[str, Any]:
    """The JAX modules this module imports inside functions, by dotted name
    (for the contract tests, tests/jax_contracts/); `jax._src.flattree` only
    where it exists (jax >= 0.11)."""
    from jax._src.lax.control_flow import conditionals as _cond

    out: dict[str, Any] = {"jax._src.lax.control_flow.conditionals": _cond,
                           "jax._src.interpreters.batching": _jax_batching_private()}
    try:
        from jax._src import flattree as _ft  # type: ignore[attr-defined]
    except ImportError:  # jax < 0.11
        return out
    out["jax._src.flattree"] = _ft
    return out
