"""The recorded-transform primitive: `lh.grad`, `lh.vmap`, ... as one eqn.

While a harvest is being traced, a recorded transformation (see
`transforms.py`) stages one `recorded_transform` eqn instead of applying
itself: its parameters hold the transformation (`Transform`) and the jaxpr of
the function it transforms, untransformed, so the traced program alone says
which transformations enclose each site. Every JAX transformation treats the
eqn as the transformed function it stands for (its rules apply the JAX
transformation to the inner jaxpr). The harvest rule for the eqn, registered
here next to the primitive, builds the leaves described in
`docs/semantics.md` ("Transformed slices").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs
import jax
import jax.numpy as jnp
import numpy as np

from lazyharvest import _jax
from lazyharvest._interpreter import (
    COUNT_RULES,
    EVAL_RULES,
    Counts,
    Harvest,
    PlantOperands,
    Run,
    add_counts,
    count_occurrences,
    jaxpr_has_sites,
)
from lazyharvest.errors import HarvestError
from lazyharvest.keys import Label
from lazyharvest.primitive import active_tags, applying_recorded, is_applying_recorded

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
            def batched(*a, **kw):
                user, ex = a[:n_args], a[n_args:]
                return flat_fn(*consts, *jax.tree_util.tree_leaves((user, kw)), *ex)
            return batched, (*args, *extra), kwargs

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
            return jax.tree_util.tree_map(
                lambda o: jnp.zeros_like(o) if _inexact(o) else _float0(o.shape), primal)
        wrt = self._wrt(self.split(flat)[1])
        order = 2 if self.name == "hessian" else 1
        return jax.tree_util.tree_map(lambda o: _jacobian_zeros(o, wrt, order, like=True),
                                      primal)

    def has_derivative(self, primal: Any, flat: Sequence[Any]) -> bool:
        """Whether a site of value `primal` has a leaf for this transform
        chosen: only sites with a float or complex leaf have derivatives
        (docs/semantics.md, "Integer, boolean and complex sites"), and a
        complex site needs real inputs, or `holomorphic=True`."""
        leaves = jax.tree_util.tree_leaves(primal)
        if not any(_inexact(o) for o in leaves):
            return False
        if self.name == "jvp" or self.kwargs.get("holomorphic"):
            return True
        real_wrt = not any(jnp.iscomplexobj(a) for a in jax.tree_util.tree_leaves(
            self._wrt(self.split(flat)[1])))
        return real_wrt or not any(jnp.iscomplexobj(o) for o in leaves)

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
        return _jacobian(fn, args, kwargs, self._argnums(len(args)), self._wrt(args),
                         self.name, k)


def _inexact(x: Any) -> bool:
    return jnp.issubdtype(x.dtype, jnp.inexact)


def _float0(shape: tuple) -> Any:
    return np.zeros(shape, jax.dtypes.float0)


def _jacobian_zeros(o: Any, wrt: Any, order: int, like: bool = False) -> Any:
    """Zeros shaped like the Jacobian (order 1) or Hessian (order 2) of an
    output `o` w.r.t. `wrt`: float0 for an integer or boolean output, as JAX
    gives integer values; with `like`, of the derivative's dtype."""
    def dtype(a):
        if not _inexact(o):
            return jax.dtypes.float0
        return a.dtype if jnp.iscomplexobj(a) and not jnp.iscomplexobj(o) else o.dtype

    def zeros(*ins, a):
        shape = (*o.shape, *ins, *a.shape)
        return (jnp.zeros if like and _inexact(o) else np.zeros)(shape, dtype(a))
    if order == 1:
        return jax.tree_util.tree_map(lambda a: zeros(a=a), wrt)
    return jax.tree_util.tree_map(
        lambda a: jax.tree_util.tree_map(lambda b: zeros(*a.shape, a=b), wrt), wrt)


def _jacobian(fn: Callable, args: tuple, kwargs: dict, argnums: Any, wrt: Any,
              name: str, k: dict) -> Any:
    """A chosen differential label applied to a slice `fn` (a pytree of site
    values): per leaf, the Jacobian (Hessian for `hessian`) w.r.t. `argnums`.

    Float leaves: forward or reverse mode by size (`jacrev`/`jacfwd` keep
    their mode); complex leaves: forward mode when the inputs are real (where
    `jacrev` cannot), else the user's `holomorphic=True`; integer and boolean
    leaves: float0 zeros (docs/semantics.md).
    """
    shape = jax.eval_shape(fn, *args, **kwargs)
    outs, tree = jax.tree_util.tree_flatten(shape)
    real_wrt = not any(jnp.iscomplexobj(a) for a in jax.tree_util.tree_leaves(wrt))
    jac_kw = {n: k[n] for n in ("holomorphic",) if n in k}
    groups: dict = {}
    for i, o in enumerate(outs):
        if _inexact(o):
            groups.setdefault("complex" if jnp.iscomplexobj(o) else "float", []).append(i)
    result: list = [None] * len(outs)
    for kind, idx in groups.items():
        def part(*a, idx=idx, **kw):
            leaves = jax.tree_util.tree_leaves(fn(*a, **kw))
            return [leaves[i] for i in idx]
        mode = _mode(name, kind, real_wrt, k, wrt, [outs[i] for i in idx])
        if name == "hessian":
            inner = jax.jacrev if mode == "rev" else jax.jacfwd
            vals = jax.jacfwd(inner(part, argnums, **jac_kw), argnums, **jac_kw)(
                *args, **kwargs)
        else:
            kw = dict(jac_kw, allow_int=True) if mode == "rev" and k.get("allow_int") else jac_kw
            if mode == "rev" and kind == "float" and len(idx) == 1 and outs[idx[0]].shape == ():
                # One scalar: its Jacobian is its gradient; jax.grad's backward
                # pass has no basis axis for jacrev's vmap (a smaller program).
                one = lambda *a, **kw_: part(*a, **kw_)[0]
                vals = [jax.grad(one, argnums, **kw)(*args, **kwargs)]
            else:
                jac = jax.jacrev if mode == "rev" else jax.jacfwd
                vals = jac(part, argnums, **kw)(*args, **kwargs)
        for i, v in zip(idx, vals):
            result[i] = v
    order = 2 if name == "hessian" else 1
    for i, o in enumerate(outs):
        if result[i] is None:
            result[i] = _jacobian_zeros(o, wrt, order)
    return jax.tree_util.tree_unflatten(tree, result)


def _mode(name: str, kind: str, real_wrt: bool, k: dict, wrt: Any, outs: list) -> str:
    """Forward ("fwd") or reverse ("rev") mode for one group of leaves."""
    if kind == "complex" and real_wrt and not k.get("holomorphic"):
        return "fwd"  # jacrev needs real outputs; jacfwd does not, given real inputs
    if name == "jacfwd":
        return "fwd"
    if name in ("jacrev", "hessian") or k.get("allow_int") or not real_wrt:
        return "rev"
    in_size = sum(int(np.size(x)) for x in jax.tree_util.tree_leaves(wrt))
    out_size = sum(int(np.prod(o.shape)) for o in outs)
    return "fwd" if in_size < out_size else "rev"


_JAX: dict[str, Callable] = {
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
    with applying_recorded():
        return jax.tree_util.tree_leaves(transform.call(inner, flat))


def _refuse_outer_jax_transform(what: str, jaxpr: _jax.Jaxpr, transform: Transform) -> None:
    """A JAX transformation applied around a recorded one while a harvest is
    traced would give the sites JAX's labels, silently: say what to write.

    `lh.jit` is exempt: its label is structural (keys differing only in it
    are aliases), so the keys JAX's labels give are the recorded ones.
    """
    if is_applying_recorded() or transform.name == "jit":
        return
    tags = [t for t in active_tags() if jaxpr_has_sites(jaxpr, t)]
    if tags:
        raise HarvestError(
            f"harvest of tag {tags[0]!r}: {what} is applied around "
            f"lh.{transform.name}(...) inside the reaped function, so its sites "
            f"would get JAX's labels, not the recorded ones. Use the recorded "
            f"transformations (lh.jvp, lh.grad, lh.vmap, ...) for every "
            f"transformation around a recorded one, or apply {what} outside the "
            f"harvest.")


def _abstract_eval(*avals, jaxpr, transform, out_avals):
    del avals, transform
    return list(out_avals), _jax.effects_of(jaxpr)


def _jvp(primals, tangents, **params):
    _refuse_outer_jax_transform("a JAX differentiation (jax.jvp, jax.grad, ...)",
                                params["jaxpr"], params["transform"])
    tangents = [_jax.ad.instantiate_zeros(t) for t in tangents]
    return jax.jvp(lambda *a: _evaluate(*a, **params), list(primals), tangents)


def _batch(vals, dims, **params):
    _refuse_outer_jax_transform("jax.vmap", params["jaxpr"], params["transform"])
    outs = jax.vmap(lambda *a: _evaluate(*a, **params), in_axes=list(dims))(*vals)
    return outs, [0] * len(outs)


recorded_p.def_impl(_evaluate)
recorded_p.def_effectful_abstract_eval(_abstract_eval)
_jax.mlir.register_lowering(recorded_p, _jax.mlir.lower_fun(_evaluate, multiple_results=True))
_jax.ad.primitive_jvps[recorded_p] = _jvp
_jax.register_batcher(recorded_p, _batch)


def record(name: str, f: Callable, kwargs: dict, args: tuple, fkwargs: dict,
            extra: Sequence[Any] = ()) -> Any:
    """Stages `name(f)(*args, **fkwargs)` as one recorded_transform eqn."""
    flat, in_tree = jax.tree_util.tree_flatten((args, fkwargs))
    avals = [jax.typeof(x) for x in flat]
    axes: list = []
    size: int | None = None
    if name == "vmap":
        avals, size = _per_example_avals(kwargs, args, fkwargs)
        if kwargs.get("axis_name") is not None:  # collectives inside need the axis
            axes = [(kwargs["axis_name"], size)]
    with _jax.axis_env(axes):
        closed, f_out_tree = _jax.trace_pytree(lambda a, k: f(*a, **k), in_tree, avals,
                                               name=getattr(f, "__name__", name))
    consts = list(closed.consts)
    jaxpr = _jax.consts_as_invars(closed.jaxpr)
    transform = Transform(name, kwargs, in_tree, f_out_tree, len(consts))
    operands = [*consts, *flat, *jax.tree_util.tree_leaves(extra)]
    known = _known_out_types(transform, closed.out_avals, f_out_tree, avals, size)
    if known is None:
        inner = lambda *a: _jax.eval_jaxpr(jaxpr, (), *a)
        with applying_recorded():
            # the output types as JAX gives them, with the mesh axes they vary
            # over inside a shard_map body (eval_shape's shapes would drop them)
            traced, shape = jax.make_jaxpr(lambda *a: transform.call(inner, a),
                                           return_shape=True)(*operands)
        known = jax.tree_util.tree_structure(shape), traced.out_avals
    out_tree, out_avals = known
    outs = recorded_p.bind(*operands, jaxpr=jaxpr, transform=transform,
                           out_avals=tuple(out_avals))
    return jax.tree_util.tree_unflatten(out_tree, outs)


def _known_out_types(t: Transform, f_avals: Sequence[Any], f_tree: Any,
                     in_avals: Sequence[Any], size: int | None) -> tuple[Any, list] | None:
    """(out tree, out avals) of `t` applied to a function of these types,
    where they follow from the types alone (`_OUT_TYPES`), nothing sharded;
    None elsewhere (a trace of the transformation tells). Tracing it would
    trace the transformed function once more per recorded level, at every
    reap."""
    rule = _OUT_TYPES.get(t.name)
    if rule is None or not all(map(_jax.is_unsharded_array_type, (*in_avals, *f_avals))):
        return None
    return rule(t, f_avals, f_tree, in_avals, size)


def _jit_types(t: Transform, f_avals: Sequence[Any], f_tree: Any, in_avals: Sequence[Any],
               size: int | None) -> tuple[Any, list] | None:
    return f_tree, list(f_avals)


def _vmap_types(t: Transform, f_avals: Sequence[Any], f_tree: Any, in_avals: Sequence[Any],
                size: int | None) -> tuple[Any, list] | None:
    """An int `out_axes`, no named axis: every output gains the axis there."""
    axis, k = t.kwargs.get("out_axes", 0), t.kwargs
    if (type(axis) is not int or size is None or k.get("axis_name") is not None
            or k.get("spmd_axis_name") is not None):
        return None
    return f_tree, [_jax.with_batch_axis(a, size, axis % (a.ndim + 1)) for a in f_avals]


def _gradient_types(t: Transform, f_avals: Sequence[Any], f_tree: Any,
                    in_avals: Sequence[Any], size: int | None) -> tuple[Any, list] | None:
    """`grad` / `value_and_grad` of a real scalar with respect to real
    floating arguments: the gradient has their types (weak types kept)."""
    if t.kwargs.get("holomorphic") or t.kwargs.get("allow_int"):
        return None
    argnums, has_aux = t.kwargs.get("argnums", 0), bool(t.kwargs.get("has_aux"))
    value = jax.tree_util.tree_unflatten(f_tree, list(f_avals))
    aux = None
    if has_aux:
        if type(value) is not tuple or len(value) != 2:
            return None  # (JAX's error, from the trace)
        value, aux = value
    if (jax.tree_util.tree_leaves(value) != [value] or value.shape != ()
            or not jnp.issubdtype(value.dtype, jnp.floating)):
        return None
    args, _ = jax.tree_util.tree_unflatten(t.in_tree, list(in_avals))
    picked = (argnums,) if type(argnums) is int else argnums
    if not all(type(i) is int and 0 <= i < len(args) for i in picked):
        return None
    wrt = t._wrt(args)
    if not all(jnp.issubdtype(a.dtype, jnp.floating) for a in jax.tree_util.tree_leaves(wrt)):
        return None
    out: Any = wrt
    if has_aux:
        out = ((value, aux), wrt) if t.name == "value_and_grad" else (wrt, aux)
    elif t.name == "value_and_grad":
        out = (value, wrt)
    leaves, tree = jax.tree_util.tree_flatten(out)
    return tree, leaves


_OUT_TYPES: dict[str, Callable[..., tuple[Any, list] | None]] = {
    "jit": _jit_types,
    "vmap": _vmap_types,
    "grad": _gradient_types,
    "value_and_grad": _gradient_types,
}


def _per_example_avals(vmap_kwargs: dict, args: tuple, fkwargs: dict) -> tuple[list, int]:
    """The avals the function inside `vmap` sees, and the axis size: vmap tells."""
    seen: list = []

    def probe(*a, **k):
        seen.append([jax.typeof(x) for x in jax.tree_util.tree_leaves((a, k))])
        return 0
    kw = {n: v for n, v in vmap_kwargs.items() if n != "out_axes"}
    size = jax.eval_shape(lambda *a, **k: jax.vmap(probe, **kw)(*a, **k), *args, **fkwargs)
    return seen[0], size.shape[0]


# --- the harvest rules for recorded_p ---------------------------------------------

def labels_of(t: Transform) -> tuple:
    """The path entries a recorded transformation adds to the sites inside."""
    if t.structural:
        return (Label(t.name, True, True),)
    return (Label(t.name, True, False), Label(t.name, False, False))


def _count_recorded(harvest: Harvest, *, jaxpr, transform, **_) -> Counts:
    counts: Counts = {}
    for (path, scopes, name), n in count_occurrences(jaxpr, harvest).items():
        for label in labels_of(transform):
            add_counts(counts, {(path + (label,), scopes, name): n})
    return counts


COUNT_RULES[recorded_p] = _count_recorded


def _inner_plants(run: Run, labels: tuple, inner: Counts) -> tuple[dict, dict]:
    """Plants addressed to sites inside, keyed as the inner jaxpr knows them,
    and where each one's occurrences start (the outer run's cursor, which
    moves past them: a layer called repeatedly takes the next rows)."""
    plants: dict = {}
    cursor: dict = {}
    for (path, scopes, name), plant in run.plants.items():
        if path and isinstance(path[-1], Label) and path[-1] in labels:
            ik = (path[:-1], scopes, name)
            if ik in inner:
                ok = (path, scopes, name)
                plants[ik] = plant
                cursor[ik] = run.cursor.get(ok, 0)
                run.cursor[ok] = cursor[ik] + inner[ik]
    return plants, cursor


def _wanted(run: Run, labels: tuple, inner: Counts, plants: dict) -> dict:
    """Outer keys asked for -> (inner key, whether the label is chosen)."""
    wanted: dict = {}
    for ik in inner:
        if ik in plants:
            continue
        for label in labels:
            ok = (ik[0] + (label,), ik[1], ik[2])
            if run.want(ok):
                wanted[ok] = (ik, label.chosen)
    return wanted


def _recorded(run: Run, eqn: _jax.JaxprEqn, invals: list, *, jaxpr, transform,
              **_) -> list:
    """A site under a recorded transformation T has one key per choice of
    "apply T to its slice" or "see through T".

    The outputs are T of the inner function with its sites consumed. A leaf
    is T (or not) applied to the inner leaf function, the slice of the inner
    jaxpr producing that site as a function of T's inputs.
    """
    t, labels = transform, labels_of(transform)
    inner = count_occurrences(jaxpr, run.harvest)
    plants, cursor = _inner_plants(run, labels, inner)
    ops = PlantOperands(tuple(plants), tuple(len(p.leaves) for p in plants.values()),
                        tuple(x for p in plants.values() for x in p.leaves))
    extra = list(ops.leaves)
    extra_axes = [t.site_axis()] * len(extra) if t.name == "vmap" else []

    def inner_run(ex: Sequence[Any], want: Callable, outputs_needed: bool = True) -> Run:
        return run.nested(ops.plants(plants, ex), cursor, want=want,
                          outputs_needed=outputs_needed)

    def plain(*flat):
        n = len(flat) - len(extra)
        return inner_run(flat[n:], lambda k: False).eval(jaxpr, (), flat[:n])

    if run.abstract or run.outputs_unused(eqn):
        # Only avals matter (an abstract run), or nothing reads the outputs
        # (a leaf's slice): stand-ins, instead of tracing T of the body.
        outs = [_jax.zeros_like_aval(v.aval) for v in eqn.outvars]
    else:
        outs = jax.tree_util.tree_leaves(t.call(plain, invals, extra, extra_axes))
    wanted = _wanted(run, labels, inner, plants)
    if wanted:
        _record_leaves(run, t, jaxpr, invals, wanted, inner_run, extra, extra_axes)
    return outs


EVAL_RULES[recorded_p] = _recorded


def _record_leaves(run: Run, t: Transform, jaxpr: _jax.Jaxpr, invals: list,
                   wanted: dict, inner_run: Callable, extra: list,
                   extra_axes: list) -> None:
    request = list(dict.fromkeys(ik for ik, _ in wanted.values()))
    modes: dict = {}

    def leaf_fn(*flat):
        n = len(flat) - len(extra)
        child = inner_run(flat[n:], set(request).__contains__, outputs_needed=False)
        child.eval(jaxpr, (), flat[:n])
        for k in request:
            modes[k] = child.records[k].mode
        return tuple(jax.tree_util.tree_unflatten(child.records[k].tree,
                                                  child.records[k].leaves())
                     for k in request)

    for chosen in (False, True):
        group = [ok for ok, (_, c) in wanted.items() if c == chosen]
        if not group:
            continue
        idx = [request.index(wanted[ok][0]) for ok in group]
        if chosen and run.abstract and not t.structural:
            primal = t.site_value(leaf_fn, invals, False, extra, extra_axes)
            # Only sites with a derivative get a key (integer sites do not).
            keep = [j for j, i in enumerate(idx) if t.has_derivative(primal[i], invals)]
            group, idx = [group[j] for j in keep], [idx[j] for j in keep]
            values = [t.site_placeholder(primal[i], invals) for i in idx]
        else:
            pick = lambda *f, idx=idx: _pick(leaf_fn(*f), idx)  # one evaluation
            values = t.site_value(pick, invals, chosen, extra, extra_axes)
        for ok, value in zip(group, values):
            leaves, tree = jax.tree_util.tree_flatten(value)
            run.record(ok, modes[wanted[ok][0]], tree, leaves)


def _pick(values: tuple, idx: list) -> tuple:
    return tuple(values[i] for i in idx)
