"""Transformations that record themselves: `lh.jit`, `lh.vmap`, `lh.grad`, ...

Each takes exactly JAX's arguments and returns exactly what JAX returns.
Outside a harvest it *is* the JAX transformation. While a harvest is being
traced, it stages one `recorded_transform` eqn instead (`recorded.py`), so
the sites inside get the transformation's label on their path.

Their docstrings are built from one template and an entry of `_DOCS` each;
the function transforms keep `__wrapped__`, so `inspect.signature` shows
JAX's parameters.
"""

from __future__ import annotations

import functools
import inspect
import textwrap
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


# --- docstrings: one template, a sentence and an example per transform ----------

_TEMPLATE = """`jax.{name}`, recorded: {summary}

{intro}

{chosen}

**Arguments:**

{arguments}

**Returns:**

{returns}

**Raises:**

{raises}

**Example:**

{example}"""

_INTRO = ("Takes exactly the arguments of `jax.{name}` and returns exactly what it "
          "returns; outside a harvest it is `jax.{name}`. Called inside a function "
          "being reaped, planted or harvested (wrapping it directly, inside a lambda "
          "or helper, nested in other recorded transforms, under `jax.jit`), it adds "
          "the label `\"{name}\"` to the path of every site inside it. A key may "
          "choose the label (write it) or see through it (leave it out); labels come "
          "innermost first, before the `nest` scopes.")

_RAISES = ("What `jax.{name}` raises for the same arguments, and, while a harvest "
           "is traced, the `lh.HarvestError`s of that harvest (see `lh.reap`).")

_DIFFERENTIAL_SEEN = ("Leaving it out gives the site's plain (primal) value. When "
                      "two keys would collide (`lh.grad(lh.grad(f))`), the unchosen "
                      "levels are spelled `\"~{name}\"`; `d.keys()` shows the keys.")

# Every example starts from the same site: f(x) = x**3 sown as "x3", plus 1.
_F = """\
>>> import jax.numpy as jnp
>>> import lazyharvest as lh
>>> def f(x):
...     return lh.sow(x ** 3, tag="t", name="x3") + 1
"""

_DOCS: dict[str, dict[str, str]] = {
    "grad": dict(
        summary="the gradient, and the gradient of each site.",
        chosen="Choosing `\"grad\"` gives the derivative of the site's slice with "
               "respect to `argnums` (its Jacobian, as `jacrev` would, when the site "
               "is not a scalar). " + _DIFFERENTIAL_SEEN,
        returns=": the function computing the gradient of `fun`",
        example=_F + """\
>>> print(lh.grad(f)(2.))
12.0
>>> d = lh.reap(lh.grad(f), tag="t")(2.)
>>> print(d["x3"], d["grad", "x3"], d.fn("grad", "x3")(3.))
8.0 12.0 27.0"""),
    "value_and_grad": dict(
        summary="the value and gradient, and the gradient of each site.",
        chosen="Choosing `\"value_and_grad\"` gives the derivative of the site's "
               "slice with respect to `argnums` (not a pair; the value is the key "
               "without the label). " + _DIFFERENTIAL_SEEN,
        returns=": the function computing `(value, gradient)`",
        example=_F + """\
>>> value, g = lh.value_and_grad(f)(2.)
>>> print(value, g)
9.0 12.0
>>> d = lh.reap(lh.value_and_grad(f), tag="t")(2.)
>>> print(d["x3"], d["value_and_grad", "x3"])
8.0 12.0"""),
    **{name: dict(
        summary=f"the {mode}-mode Jacobian, and the Jacobian of each site.",
        chosen=f"Choosing `\"{name}\"` gives the Jacobian of the site's slice with "
               f"respect to `argnums`, in {mode} mode. " + _DIFFERENTIAL_SEEN,
        returns=": the function computing the Jacobian of `fun`",
        example=_F + f"""\
>>> d = lh.reap(lh.{name}(f), tag="t")(jnp.array([1., 2.]))
>>> print(d["x3"])
[1. 8.]
>>> print(d["{name}", "x3"])
[[ 3.  0.]
 [ 0. 12.]]""") for name, mode in (("jacfwd", "forward"), ("jacrev", "reverse"))},
    "hessian": dict(
        summary="the Hessian, and the Hessian of each site.",
        chosen="Choosing `\"hessian\"` gives `jax.hessian` of the site's slice "
               "with respect to `argnums`. " + _DIFFERENTIAL_SEEN,
        returns=": the function computing the Hessian of `fun`",
        example=_F + """\
>>> d = lh.reap(lh.hessian(f), tag="t")(2.)
>>> print(d["x3"], d["hessian", "x3"])
8.0 12.0
>>> print(lh.hessian(f)(2.))  # outside a harvest: jax.hessian
12.0"""),
    "vmap": dict(
        summary="batching that batches each site like the output.",
        chosen="`\"vmap\"` is structural: keys with and without it are aliases of "
               "one leaf, the batched site. It follows `in_axes` and `out_axes` (an "
               "integer `out_axes` applies to every site; with a pytree `out_axes` "
               "sites are batched along axis 0), and a site that does not depend on "
               "the batched inputs is broadcast, so `reap(vmap(f)) = vmap(reap(f))` "
               "(plain `jax.vmap` always puts a site's batch axis first).",
        returns=": the batched function",
        example=_F + """\
>>> d = lh.reap(lh.vmap(f, in_axes=0, out_axes=-1), tag="t")(jnp.ones((3, 7)))
>>> print(d["x3"].shape, d["vmap", "x3"].shape)
(7, 3) (7, 3)"""),
    "jit": dict(
        summary="compiles `fun`; its sites are reaped as usual.",
        chosen="`\"jit\"` is structural: keys with and without it are aliases of "
               "one leaf, the site's value.",
        returns=": the jitted function, with the attributes of `jax.jit`'s "
                "(`lower`, `trace`, ...)",
        example=_F + """\
>>> d = lh.reap(lh.jit(lh.vmap(lh.grad(f))), tag="t")(jnp.array([2., 3.]))
>>> print(d["x3"], d["grad", "x3"], d["grad", "vmap", "jit", "x3"])
[ 8. 27.] [12. 27.] [12. 27.]"""),
    "jvp": dict(
        summary="a Jacobian-vector product, and the tangent of each site.",
        chosen="Choosing `\"jvp\"` gives the site's tangent for the call's "
               "`tangents`; leaving it out gives the site's plain (primal) value.",
        returns=": `(primals_out, tangents_out)`, and `aux` when `has_aux=True`",
        example=_F + """\
>>> print(*lh.jvp(f, (2.,), (1.,)))  # outside a harvest: jax.jvp
9.0 12.0
>>> d = lh.reap(lambda x: lh.jvp(f, (x,), (1.,)), tag="t")(2.)
>>> print(d["x3"], d["jvp", "x3"])
8.0 12.0"""),
    "linearize": dict(
        summary="linearization, and the Jacobian of each site.",
        chosen="Choosing `\"linearize\"` gives the Jacobian of the site with "
               "respect to all the primals (the linear map, materialized); leaving "
               "it out gives the site's plain (primal) value. The returned linear "
               "function is JAX's, built for `fun` without its sites.",
        returns=": `(primals_out, f_jvp)`, and `aux` when `has_aux=True`",
        example=_F + """\
>>> d = lh.reap(lambda x: lh.linearize(f, x)[0], tag="t")(2.)
>>> print(d["x3"], d["linearize", "x3"])
8.0 12.0
>>> out, f_jvp = lh.linearize(f, 2.)
>>> print(out, f_jvp(1.))
9.0 12.0"""),
    "vjp": dict(
        summary="a vector-Jacobian product, and the Jacobian of each site.",
        chosen="Choosing `\"vjp\"` gives the Jacobian of the site with respect to "
               "all the primals; leaving it out gives the site's plain (primal) "
               "value. The returned backward function is JAX's, built for `fun` "
               "without its sites.",
        returns=": `(primals_out, f_vjp)`, and `aux` when `has_aux=True`",
        example="""\
>>> import jax.numpy as jnp
>>> import lazyharvest as lh
>>> def g(x, y):
...     return jnp.sum(lh.sow(x * y, tag="t", name="xy"))
>>> d = lh.reap(lambda x, y: lh.vjp(g, x, y)[0], tag="t")(jnp.ones(2), 3.)
>>> print(d["vjp", "xy"][0].shape, d["vjp", "xy"][1].shape)  # d xy / d x, d xy / d y
(2, 2) (2,)
>>> out, g_vjp = lh.vjp(g, jnp.ones(2), 3.)
>>> print(out, g_vjp(1.)[1])
6.0 2.0"""),
}


def _doc(name: str, signature_of: Callable) -> str:
    """The docstring of the recorded `name`; arguments from `signature_of`'s."""
    doc = _DOCS[name]
    params = list(inspect.signature(signature_of).parameters.values())
    rest = ", ".join(f"`*{p.name}`" if p.kind is p.VAR_POSITIONAL else f"`{p.name}`"
                     for p in params[1:])
    arguments = ("- `fun`: the function to transform.\n"
                 + textwrap.fill(f"- {rest}: as for `jax.{name}`.", width=76,
                                 subsequent_indent="  "))
    fill = functools.partial(textwrap.fill, width=76)
    return _TEMPLATE.format(
        name=name, summary=doc["summary"], intro=fill(_INTRO.format(name=name)),
        chosen=fill(doc["chosen"].format(name=name)), arguments=arguments,
        returns=fill(f"What `jax.{name}` returns{doc['returns']}."),
        raises=fill(_RAISES.format(name=name) + doc.get("raises", "")),
        example=doc["example"])


# Transforms JAX builds with no check but that `fun` is callable: built when
# first called outside a harvest (a harvest records the call instead), so a
# wrapper rebuilt on every loop iteration costs little (`jax.grad` alone
# costs tens of µs to build).
_BUILT_WHEN_CALLED = frozenset({"grad", "value_and_grad"})


def _function_transform(name: str, jax_fn: Callable):
    signature = inspect.signature(jax_fn)

    @functools.wraps(jax_fn)
    def transform(fun: Callable, *targs: Any, **tkwargs: Any) -> Callable:
        params = _bind_signature(signature, fun, targs, tkwargs)
        if name not in _BUILT_WHEN_CALLED or tkwargs:
            plain = jax_fn(fun, *targs, **tkwargs)
        elif not callable(fun):
            raise TypeError(f"Expected a callable value, got {fun}")
        else:
            plain = _built_when_called(jax_fn, fun, targs)

        @functools.wraps(fun, updated=())
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if not _recording():
                return plain(*args, **kwargs)
            return record(name, fun, params, args, kwargs)
        _identify(wrapped, name, params, fun)
        return wrapped
    transform.__doc__ = _doc(name, jax_fn)
    transform.__module__ = __name__  # help() names lazyharvest, not JAX
    return transform


def _identify(wrapper: Any, name: str, params: dict, fun: Callable) -> None:
    """Says what `wrapper` is, so traces cached for an equal wrapper are reused.

    The key is (transform, its parameters, the key of what it wraps), relative
    to the innermost function, which the trace cache holds weakly. Parameters
    that are not hashable leave the wrapper keyed by its own identity.
    """
    leaves, tree = jax.tree_util.tree_flatten(params)
    try:
        hash((tree, *leaves))
    except TypeError:
        return
    inner = getattr(fun, "__lazyharvest_key__", None)
    wrapper.__lazyharvest_key__ = (name, tree, tuple(leaves), inner)
    wrapper.__lazyharvest_base__ = (fun if inner is None
                                    else fun.__lazyharvest_base__)  # type: ignore[attr-defined]


def _built_when_called(jax_fn: Callable, fun: Callable, targs: tuple) -> Callable:
    built: list = []

    def plain(*args: Any, **kwargs: Any) -> Any:
        if not built:
            built.append(jax_fn(fun, *targs))
        return built[0](*args, **kwargs)
    return plain


def _bind_signature(signature: inspect.Signature, fun: Callable, targs: tuple,
                    tkwargs: dict) -> dict:
    bound = signature.bind(fun, *targs, **tkwargs)
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
        _identify(self, "jit", kwargs, fun)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not _recording():
            return self._jitted(*args, **kwargs)
        fun, args, kwargs = _bind_static(self._fun, self._kwargs, args, kwargs)
        return record("jit", fun, {}, args, kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._jitted, name)


def jit(fun: Callable | None = None, /, **kwargs: Any) -> Any:
    # docstring: _DOCS["jit"], set below
    if fun is None:
        return lambda f: jit(f, **kwargs)
    return _RecordedJit(fun, kwargs)


jit.__doc__ = _doc("jit", jax.jit)


def _static_names_and_nums(fun: Callable, kwargs: dict) -> tuple[tuple, tuple]:
    """`jit`'s static arguments by position and by name, each completed from
    the other through `fun`'s signature, as `jax.jit` does."""
    nums = kwargs.get("static_argnums") or ()
    names = kwargs.get("static_argnames") or ()
    nums = (nums,) if isinstance(nums, int) else tuple(nums)
    names = (names,) if isinstance(names, str) else tuple(names)
    try:
        params = list(inspect.signature(fun).parameters.values())
    except (TypeError, ValueError):
        return nums, names
    named = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    positional = [p.name for p in params
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if "static_argnames" not in kwargs:
        names = tuple(positional[i] for i in nums if -len(positional) <= i < len(positional)
                      and positional[i] in named)
    if "static_argnums" not in kwargs:
        nums = tuple(positional.index(n) for n in names if n in positional)
    return nums, names


def _bind_static(fun: Callable, kwargs: dict, args: tuple, fkwargs: dict):
    nums, names = _static_names_and_nums(fun, kwargs)
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
    # docstring: _DOCS["jvp"], set at the end of the module
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


def _primal_recorded(name: str, jax_fn: Callable, fun: Callable, primals: tuple,
                     has_aux: bool) -> Any:
    """`jax_fn(fun, *primals)` (linearize or vjp) whose primal computation is
    recorded; the returned linear or backward function is JAX's, of `fun`
    without its sites."""
    if not _recording():
        return jax_fn(fun, *primals, has_aux=has_aux)
    out = record(name, fun, {"has_aux": has_aux}, primals, {})
    made = jax_fn(_without_sites(fun, primals), *primals, has_aux=has_aux)
    return (out[0], made[1], out[1]) if has_aux else (out, made[1])


def linearize(fun: Callable, *primals: Any, has_aux: bool = False) -> Any:
    # docstring: _DOCS["linearize"], set at the end of the module
    return _primal_recorded("linearize", jax.linearize, fun, primals, has_aux)


def vjp(fun: Callable, *primals: Any, has_aux: bool = False) -> Any:
    # docstring: _DOCS["vjp"], set at the end of the module
    return _primal_recorded("vjp", jax.vjp, fun, primals, has_aux)


jvp.__doc__ = _doc("jvp", jvp)
linearize.__doc__ = _doc("linearize", linearize)
vjp.__doc__ = _doc("vjp", vjp)
