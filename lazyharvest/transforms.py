"""Transformations that record themselves: `lh.jit`, `lh.vmap`, `lh.grad`, ...

Each takes exactly JAX's arguments and returns exactly what JAX returns.
Outside a harvest it *is* the JAX transformation. While a harvest is being
traced, it stages one `recorded_transform` eqn instead: its parameters hold
the transformation and the jaxpr of the function it transforms (untransformed),
so the traced program alone says which transformations enclose each site. The
harvest interpreter (`interpreter.py`) reads that eqn to build the leaves of
SPEC 3.3; every other JAX transformation treats the eqn as the transformed
function it stands for (it is transparent: its rules apply the JAX
transformation to the inner jaxpr).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import attrs
import jax
import jax.numpy as jnp
import numpy as np

from lazyharvest import _jax
from lazyharvest.primitive import active_tags

DIFFERENTIAL = ("grad", "value_and_grad", "jacfwd", "jacrev", "hessian")
STRUCTURAL = ("jit", "vmap")


@attrs.define(eq=False)
class Transform:
    """One recorded transformation: its label and JAX's arguments for it.

    Compared by identity, so eqn parameters stay hashable whatever the user
    passed (pytrees of axes, shardings...).
    """

    name: str
    kwargs: dict
    in_tree: Any  # of (args, kwargs) as the transformed function receives them
    out_tree: Any  # of what the transformed function returns
    n_consts: int  # leading inputs that are values the function closed over

    @property
    def structural(self) -> bool:
        return self.name in STRUCTURAL

    def split(self, flat: Sequence[Any]) -> tuple[list, tuple, dict]:
        consts, rest = list(flat[:self.n_consts]), flat[self.n_consts:]
        n = self.in_tree.num_leaves
        args, kwargs = jax.tree_util.tree_unflatten(self.in_tree, rest[:n])
        return consts, args, kwargs

    def tangents(self, flat: Sequence[Any]) -> tuple:
        rest = flat[self.n_consts + self.in_tree.num_leaves:]
        args, _ = jax.tree_util.tree_unflatten(self.in_tree, list(rest))
        return args

    def _prepare(self, flat_fn: Callable, flat: Sequence[Any], extra: Sequence[Any],
                 extra_axes: Sequence[Any]) -> tuple[Callable, tuple, dict]:
        """`flat_fn(*flat, *extra)` as a function of the user's arguments.

        `extra` (planted values) are closed over, except under vmap where they
        are batched along `extra_axes`.
        """
        consts, args, kwargs = self.split(flat)
        n_args, extra = len(args), list(extra)
        if self.name == "vmap" and extra:
            def fn(*a, **kw):
                user, ex = a[:n_args], a[n_args:]
                return flat_fn(*consts, *jax.tree_util.tree_leaves((user, kw)), *ex)
            return fn, (*args, *extra), kwargs

        def fn(*a, **kw):
            return flat_fn(*consts, *jax.tree_util.tree_leaves((a, kw)), *extra)
        return fn, tuple(args), kwargs

    def _vmap(self, fn: Callable, n_args: int, extra_axes: Sequence[Any],
              out_axes: Any) -> Callable:
        k = dict(self.kwargs, out_axes=out_axes)
        if extra_axes:
            in_axes = k["in_axes"]
            k["in_axes"] = ((*in_axes,) if isinstance(in_axes, (list, tuple))
                            else (in_axes,) * (n_args - len(extra_axes))) + tuple(extra_axes)
        return jax.vmap(fn, **k)

    def call(self, flat_fn: Callable, flat: Sequence[Any], extra: Sequence[Any] = (),
             extra_axes: Sequence[Any] = ()) -> Any:
        """Applies the JAX transformation to `flat_fn`, as the user's call did."""
        structured = lambda *a: jax.tree_util.tree_unflatten(self.out_tree, flat_fn(*a))
        fn, args, kwargs = self._prepare(structured, flat, extra, extra_axes)
        k = self.kwargs
        if self.name == "jvp":
            return jax.jvp(lambda *a: fn(*a), args, self.tangents(flat), **k)
        if self.name in ("linearize", "vjp"):  # the primal part; see linearize()
            return fn(*args, **kwargs)
        if self.name == "vmap":
            return self._vmap(fn, len(args), extra_axes, k.get("out_axes", 0))(
                *args, **kwargs)
        return _JAX[self.name](fn, **k)(*args, **kwargs)

    def site_axis(self) -> Any:
        """Where vmap puts a site's batch axis: an int out_axes, else 0."""
        out_axes = self.kwargs.get("out_axes", 0)
        return out_axes if isinstance(out_axes, int) or out_axes is None else 0

    def _argnums(self, n_args: int) -> Any:
        if self.name in ("vjp", "linearize"):  # w.r.t. every primal
            return tuple(range(n_args)) if n_args > 1 else 0
        return self.kwargs.get("argnums", 0)

    def _wrt(self, args: tuple) -> Any:
        """The arguments a chosen differential label differentiates."""
        argnums = self._argnums(len(args))
        return args[argnums] if isinstance(argnums, int) else tuple(args[i] for i in argnums)

    def site_placeholder(self, primal: Any, flat: Sequence[Any]) -> Any:
        """Zeros with the avals `site_value(..., chosen=True)` has, from the
        primal value alone: abstract traces need the avals, not the work."""
        if self.name == "jvp":
            return jax.tree_util.tree_map(jnp.zeros_like, primal)
        wrt = self._wrt(self.split(flat)[1])
        jac = lambda o, *ins: jax.tree_util.tree_map(
            lambda a: jnp.zeros((*o.shape, *ins, *a.shape), o.dtype), wrt)
        if self.name == "hessian":
            return jax.tree_util.tree_map(
                lambda o: jax.tree_util.tree_map(
                    lambda a: jac(o, *a.shape), wrt), primal)
        return jax.tree_util.tree_map(lambda o: jac(o), primal)

    def site_value(self, leaf_fn: Callable, flat: Sequence[Any], chosen: bool,
                   extra: Sequence[Any] = (), extra_axes: Sequence[Any] = ()) -> Any:
        """The value of a site's leaf function (flat inputs -> pytree) here.

        Chosen differential transforms are applied to the slice (a Jacobian
        for grad-like labels, picking forward or reverse mode by size); the
        others contribute the primal value; vmap batches either way.
        """
        fn, args, kwargs = self._prepare(leaf_fn, flat, extra, extra_axes)
        k = self.kwargs
        if self.name == "vmap":
            return self._vmap(fn, len(args), extra_axes, self.site_axis())(*args, **kwargs)
        if not chosen or self.name == "jit":
            return fn(*args, **kwargs)
        if self.name == "jvp":
            return jax.jvp(lambda *a: fn(*a), args, self.tangents(flat))[1]
        argnums = self._argnums(len(args))
        jac_kw = {n: k[n] for n in ("holomorphic",) if n in k}
        if self.name == "hessian":
            return jax.hessian(fn, argnums, **jac_kw)(*args, **kwargs)
        if self.name == "jacfwd":
            return jax.jacfwd(fn, argnums, **jac_kw)(*args, **kwargs)
        if k.get("allow_int"):
            jac_kw["allow_int"] = True
        in_size = sum(int(np.size(x)) for x in jax.tree_util.tree_leaves(self._wrt(args)))
        out_size = sum(int(np.prod(s.shape)) for s in jax.tree_util.tree_leaves(
            jax.eval_shape(fn, *args, **kwargs)))
        if in_size < out_size and self.name != "jacrev" and not k.get("allow_int"):
            return jax.jacfwd(fn, argnums, **jac_kw)(*args, **kwargs)
        return jax.jacrev(fn, argnums, **jac_kw)(*args, **kwargs)


_JAX = {
    "jit": lambda fn, **k: jax.jit(fn),
    "grad": jax.grad,
    "value_and_grad": jax.value_and_grad,
    "jacfwd": jax.jacfwd,
    "jacrev": jax.jacrev,
    "hessian": jax.hessian,
}


# --- the recorded-transform primitive -----------------------------------------

recorded_p = _jax.Primitive("recorded_transform")
recorded_p.multiple_results = True


def _evaluate(*flat, jaxpr, transform, out_avals):
    del out_avals
    inner = lambda *a: _jax.eval_jaxpr(jaxpr, (), *a)
    return jax.tree_util.tree_leaves(transform.call(inner, flat))


def _abstract_eval(*avals, jaxpr, transform, out_avals):
    del avals, transform
    return list(out_avals), _jax.effects_of(jaxpr)


def _jvp(primals, tangents, **params):
    tangents = [_jax.ad.instantiate_zeros(t) for t in tangents]
    return jax.jvp(lambda *a: _evaluate(*a, **params), list(primals), tangents)


def _batch(vals, dims, **params):
    outs = jax.vmap(lambda *a: _evaluate(*a, **params), in_axes=list(dims))(*vals)
    return outs, [0] * len(outs)


recorded_p.def_impl(_evaluate)
recorded_p.def_effectful_abstract_eval(_abstract_eval)
_jax.mlir.register_lowering(recorded_p, _jax.mlir.lower_fun(_evaluate, multiple_results=True))
_jax.ad.primitive_jvps[recorded_p] = _jvp
_jax.register_batcher(recorded_p, _batch)


def _record(name: str, f: Callable, kwargs: dict, args: tuple, fkwargs: dict,
            extra: Sequence[Any] = ()) -> Any:
    """Stages `name(f)(*args, **fkwargs)` as one recorded_transform eqn."""
    flat, in_tree = jax.tree_util.tree_flatten((args, fkwargs))
    avals = [jax.typeof(x) for x in flat]
    if name == "vmap":
        avals = _per_example_avals(kwargs, args, fkwargs)
    closed, f_out_tree = _jax.trace_pytree(lambda a, k: f(*a, **k), in_tree, avals,
                                           name=getattr(f, "__name__", name))
    consts = list(closed.consts)
    jaxpr = _jax.consts_as_invars(closed.jaxpr)
    transform = Transform(name, kwargs, in_tree, f_out_tree, len(consts))
    operands = [*consts, *flat, *jax.tree_util.tree_leaves(extra)]
    inner = lambda *a: _jax.eval_jaxpr(jaxpr, (), *a)
    shape = jax.eval_shape(lambda *a: transform.call(inner, a), *operands)
    leaves, out_tree = jax.tree_util.tree_flatten(shape)
    outs = recorded_p.bind(*operands, jaxpr=jaxpr, transform=transform,
                           out_avals=tuple(jax.typeof(x) if not isinstance(
                               x, jax.ShapeDtypeStruct) else _jax_aval(x)
                               for x in leaves))
    return jax.tree_util.tree_unflatten(out_tree, outs)


def _per_example_avals(vmap_kwargs: dict, args: tuple, fkwargs: dict) -> list:
    """The avals the function inside `vmap` sees: vmap itself tells."""
    seen: list = []

    def probe(*a, **k):
        seen.append([jax.typeof(x) for x in jax.tree_util.tree_leaves((a, k))])
        return 0
    kw = {n: v for n, v in vmap_kwargs.items() if n != "out_axes"}
    jax.eval_shape(lambda *a, **k: jax.vmap(probe, **kw)(*a, **k), *args, **fkwargs)
    return seen[0]


def _jax_aval(s: jax.ShapeDtypeStruct) -> Any:
    return jax.core.ShapedArray(s.shape, s.dtype, weak_type=getattr(s, "weak_type", False))


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
            return _record(name, fun, params, args, kwargs)
        return wrapped
    transform.__doc__ = (f"`jax.{name}`, recorded: sites inside get the label "
                         f"{name!r} on their path while a harvest is traced.")
    return transform


def _bind_signature(jax_fn: Callable, fun: Callable, targs: tuple, tkwargs: dict) -> dict:
    import inspect
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
        return _record("jit", fun, {}, args, kwargs)

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
    return _record("jvp", fun, {"has_aux": has_aux}, tuple(primals), {},
                   extra=tuple(tangents))


def _without_sites(fun: Callable, primals: tuple) -> Callable:
    """`fun` with every site removed (the identity), for its linear part."""
    from lazyharvest.interpreter import strip_all_sites

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
        return jax.linearize(fun, *primals, has_aux=has_aux)
    out = _record("linearize", fun, {"has_aux": has_aux}, primals, {})
    lin = jax.linearize(_without_sites(fun, primals), *primals, has_aux=has_aux)
    return (out[0], lin[1], out[1]) if has_aux else (out, lin[1])


def vjp(fun: Callable, *primals: Any, has_aux: bool = False) -> Any:
    """`jax.vjp`, recorded: sites inside get the label "vjp".

    The primal computation is recorded (a chosen "vjp" label gives the site's
    Jacobian with respect to the primals); the returned backward function is
    JAX's, of the function without sites.
    """
    if not _recording():
        return jax.vjp(fun, *primals, has_aux=has_aux)
    out = _record("vjp", fun, {"has_aux": has_aux}, primals, {})
    back = jax.vjp(_without_sites(fun, primals), *primals, has_aux=has_aux)
    return (out[0], back[1], out[1]) if has_aux else (out, back[1])
