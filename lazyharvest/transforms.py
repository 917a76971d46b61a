"""Transformations that record themselves: `lh.jit`, `lh.vmap`, `lh.grad`, ...

Each takes exactly JAX's arguments and returns exactly what JAX returns.
Outside a harvest it *is* the JAX transformation. While a harvest is being
traced, it stages one `recorded_transform` eqn instead (`recorded.py`), so
the sites inside get the transformation's label on their path.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import jax

from lazyharvest import _jax
from lazyharvest._interpreter import strip_all_sites
from lazyharvest.primitive import active_tags
from lazyharvest.recorded import record

__all__ = ["grad", "hessian", "jacfwd", "jacrev", "jit", "jvp", "linearize",
           "value_and_grad", "vjp", "vmap"]


def _recording() -> bool:
    return bool(active_tags())


def _function_transform(name: str, jax_fn: Callable):
    @functools.wraps(jax_fn)
    def transform(fun: Callable, *targs: Any, **tkwargs: Any) -> Callable:
        params = _bind_signature(jax_fn, fun, targs, tkwargs)
        plain = jax_fn(fun, *targs, **tkwargs)

        @functools.wraps(fun, updated=())
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if not _recording():
                return plain(*args, **kwargs)
            return record(name, fun, params, args, kwargs)
        return wrapped
    transform.__doc__ = (f"`jax.{name}`, recorded: sites inside get the label "
                         f"{name!r} on their path while a harvest is traced.")
    return transform


def _bind_signature(jax_fn: Callable, fun: Callable, targs: tuple, tkwargs: dict) -> dict:
    bound = inspect.signature(jax_fn).bind(fun, *targs, **tkwargs)
    bound.apply_defaults()
    out = dict(bound.arguments)
    out.pop("fun", None)
    out.pop("reduce_axes", None)
    return out


grad = _function_transform("grad", jax.grad)
value_and_grad = _function_transform("value_and_grad", jax.value_and_grad)
jacfwd = _function_transform("jacfwd", jax.jacfwd)
jacrev = _function_transform("jacrev", jax.jacrev)
hessian = _function_transform("hessian", jax.hessian)
vmap = _function_transform("vmap", jax.vmap)


class _RecordedJit:
    """`jax.jit(f, ...)`, recorded; other attributes (`lower`, `trace`...)
    are the jitted function's."""

    def __init__(self, fun: Callable, kwargs: dict):
        functools.update_wrapper(self, fun, updated=())  # copy no attributes
        self._fun = fun
        self._kwargs = kwargs
        self._jitted = jax.jit(fun, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not _recording():
            return self._jitted(*args, **kwargs)
        fun, args, kwargs = _bind_static(self._fun, self._kwargs, args, kwargs)
        return record("jit", fun, {}, args, kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._jitted, name)


def jit(fun: Callable | None = None, /, **kwargs: Any) -> Any:
    """`jax.jit`, recorded: sites inside get the label "jit"."""
    if fun is None:
        return lambda f: jit(f, **kwargs)
    return _RecordedJit(fun, kwargs)


def _bind_static(fun: Callable, kwargs: dict, args: tuple, fkwargs: dict):
    nums = kwargs.get("static_argnums") or ()
    names = kwargs.get("static_argnames") or ()
    nums = (nums,) if isinstance(nums, int) else tuple(nums)
    names = (names,) if isinstance(names, str) else tuple(names)
    nums = tuple(i % len(args) for i in nums if -len(args) <= i < len(args))
    if not nums and not names:
        return fun, args, fkwargs
    statics = {i: args[i] for i in nums}
    static_kw = {n: v for n, v in fkwargs.items() if n in names}
    dyn_args = tuple(a for i, a in enumerate(args) if i not in statics)
    dyn_kw = {n: v for n, v in fkwargs.items() if n not in names}

    def bound(*dargs, **dkw):
        it = iter(dargs)
        full = [statics[i] if i in statics else next(it)
                for i in range(len(dargs) + len(statics))]
        return fun(*full, **dkw, **static_kw)
    return bound, dyn_args, dyn_kw


def jvp(fun: Callable, primals: Any, tangents: Any, has_aux: bool = False) -> Any:
    """`jax.jvp`, recorded: sites inside get the label "jvp" (their tangent)."""
    if not _recording():
        return jax.jvp(fun, primals, tangents, has_aux=has_aux)
    return record("jvp", fun, {"has_aux": has_aux}, tuple(primals), {},
                   extra=tuple(tangents))


def _without_sites(fun: Callable, primals: tuple) -> Callable:
    """`fun` with every site removed (the identity), for its linear part."""
    flat, in_tree = jax.tree_util.tree_flatten((primals, {}))
    closed, out_tree = _jax.trace_pytree(lambda a, k: fun(*a, **k), in_tree,
                                         [jax.typeof(x) for x in flat])
    stripped = strip_all_sites(closed)

    def plain(*args):
        leaves = jax.tree_util.tree_leaves((args, {}))
        return jax.tree_util.tree_unflatten(
            out_tree, _jax.eval_jaxpr(stripped.jaxpr, stripped.consts, *leaves))
    return plain


def linearize(fun: Callable, *primals: Any, has_aux: bool = False) -> Any:
    """`jax.linearize`, recorded: sites inside get the label "linearize".

    The primal computation is recorded (a chosen "linearize" label gives the
    site's Jacobian with respect to the primals, the linear map materialized);
    the returned linear function is JAX's, of the function without sites.
    """
    if not _recording():
        return jax.linearize(fun, *primals, has_aux=has_aux)  # type: ignore[call-overload]
    out = record("linearize", fun, {"has_aux": has_aux}, primals, {})
    lin = jax.linearize(_without_sites(fun, primals), *primals,  # type: ignore[call-overload]
                         has_aux=has_aux)
    return (out[0], lin[1], out[1]) if has_aux else (out, lin[1])


def vjp(fun: Callable, *primals: Any, has_aux: bool = False) -> Any:
    """`jax.vjp`, recorded: sites inside get the label "vjp".

    The primal computation is recorded (a chosen "vjp" label gives the site's
    Jacobian with respect to the primals); the returned backward function is
    JAX's, of the function without sites.
    """
    if not _recording():
        return jax.vjp(fun, *primals, has_aux=has_aux)  # type: ignore[call-overload]
    out = record("vjp", fun, {"has_aux": has_aux}, primals, {})
    back = jax.vjp(_without_sites(fun, primals), *primals,  # type: ignore[call-overload]
                   has_aux=has_aux)
    return (out[0], back[1], out[1]) if has_aux else (out, back[1])
