"""Contracts of `lazyharvest/_jax/core.py`: the JAX internals behind jaxpr
types, JAX's primitives as objects, tracing, re-binding eqns, traces and
tracers, effects and batchers (docs/compat.md). One test per internal; each
names the internal and the JAX version when it fails."""

import os
import traceback

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

from helpers import close, jax_flag, load_module
from lazyharvest._jax import core as layer
from lazyharvest._jax import versions

V = jax.__version__
JAX_DIR = os.path.dirname(jax.__file__)


def _eqns(fn, *args):
    return jax.make_jaxpr(fn)(*args).jaxpr.eqns


def _only(eqns, name):
    found = [e for e in eqns if e.primitive.name == name]
    assert len(found) == 1, [e.primitive.name for e in eqns]
    return found[0]


def _effectful(name):
    """A fresh effect type, an instance, and a primitive with that effect."""
    effect_type = type(f"{name}Effect", (layer.Effect,), {})
    effect = effect_type()
    prim = layer.Primitive(name)
    prim.def_impl(lambda x: x)
    prim.def_effectful_abstract_eval(lambda x: (x, {effect}))
    return effect_type, effect, prim


def _partial_eval(fn, n_in=1):
    """JAX's partial evaluation (`JaxprTrace`) of `fn(*xs) -> list` with unknown
    float inputs: the staged jaxpr."""
    avals = [jax.typeof(1.)] * n_in
    dbg = jax.api_util.debug_info("lh_contract", fn, tuple(avals), {})
    pvals = [layer.pe.PartialVal.unknown(a) for a in avals]
    jaxpr, _, _ = layer.pe.trace_to_jaxpr_nounits(layer.lu.wrap_init(fn, debug_info=dbg), pvals)
    return jaxpr


# --- jaxpr types ---------------------------------------------------------------------

def test_extend_core_jaxpr_types():
    """lazyharvest assumes `jax.extend.core`'s ClosedJaxpr, Jaxpr, JaxprEqn, Var,
    Literal and Primitive are the types `jax.make_jaxpr` builds (every
    isinstance check of the package relies on it)."""
    closed = jax.make_jaxpr(lambda x: jnp.sin(x) + 2.)(1.)
    assert isinstance(closed, layer.ClosedJaxpr) and isinstance(closed.jaxpr, layer.Jaxpr), (
        f"jax.extend.core.ClosedJaxpr/Jaxpr are not make_jaxpr's types on jax {V}")
    eqns = closed.jaxpr.eqns
    assert all(isinstance(e, layer.JaxprEqn) for e in eqns), (
        f"jax.extend.core.JaxprEqn is not the eqn type on jax {V}")
    assert all(isinstance(e.primitive, layer.Primitive) for e in eqns)
    assert isinstance(closed.jaxpr.invars[0], layer.Var), f"jax.extend.core.Var changed on jax {V}"
    literals = [a for e in eqns for a in e.invars if isinstance(a, layer.Literal)]
    assert [float(a.val) for a in literals] == [2.], (
        f"jax.extend.core.Literal (with .val) changed on jax {V}: {eqns}")


def test_new_jaxpr_eqn_signature():
    """lazyharvest assumes `new_jaxpr_eqn(invars, outvars, primitive, params, effects,
    source_info, ctx)` builds an eqn (core.replace_eqn_params, identity_eqn and the
    DCE wrappers rely on it)."""
    (eqn,) = _eqns(lambda x: jnp.sum(x, axis=0), jnp.ones((2, 3)))
    new = layer.replace_eqn_params(eqn, axes=(1,))
    assert isinstance(new, layer.JaxprEqn)
    assert (new.invars, new.outvars, new.primitive) == (eqn.invars, eqn.outvars, eqn.primitive)
    assert new.source_info is eqn.source_info and new.ctx is eqn.ctx, (
        f"new_jaxpr_eqn no longer keeps source_info and ctx on jax {V}")
    assert new.params == dict(eqn.params, axes=(1,)) and new.effects == eqn.effects
    close(layer.bind_eqn(new, [jnp.ones((2, 3))]), jnp.full((2,), 3.))


# --- JAX's primitives as objects -----------------------------------------------------

@jax.custom_jvp
def _cjvp(x):
    return jnp.sin(x)


_cjvp.defjvp(lambda p, t: (_cjvp(p[0]), 3. * t[0]))


@jax.custom_vjp
def _cvjp(x):
    return jnp.cos(x)


_cvjp.defvjp(lambda x: (_cvjp(x), x), lambda r, g: (5. * g * r,))


@jax.custom_vjp
def _cvjp_remat(x):
    return jnp.sin(x)


_cvjp_remat.defvjp(lambda x: (_cvjp_remat(x), x), lambda r, g: (g,), optimize_remat=True)


def _custom_vmapped(x):
    f = jax.custom_batching.custom_vmap(jnp.sin)
    f.def_vmap(lambda size, in_batched, xs: (jnp.sin(xs), in_batched[0]))
    return f(x)


def _shard_mapped(x):
    mesh = jax.make_mesh((1,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    return jax.shard_map(jnp.sin, mesh=mesh, in_specs=P(), out_specs=P())(x)


# (the layer's name, the JAX API that stages it, the eqn name)
STAGED = {
    "jit_p": (jax.jit(jnp.sin), "jit"),
    "scan_p": (lambda x: lax.scan(lambda c, _: (jnp.sin(c), None), x, None, length=2)[0],
               "scan"),
    "while_p": (lambda x: lax.while_loop(lambda c: c < 3., lambda c: c + 1., x), "while"),
    "cond_p": (lambda x: lax.cond(x > 0., jnp.sin, jnp.cos, x), "cond"),
    "remat_p": (jax.checkpoint(jnp.sin), None),
    "custom_jvp_call_p": (_cjvp, "custom_jvp_call"),
    "custom_vjp_call_p": (_cvjp, "custom_vjp_call"),
    "custom_vmap_p": (_custom_vmapped, "custom_vmap_call"),
    "shard_map_p": (_shard_mapped, "shard_map"),
    "remat_opt_p": (jax.grad(_cvjp_remat), "remat_opt"),
}


@pytest.mark.usefixtures("default_staging")
@pytest.mark.parametrize("name", sorted(STAGED))
def test_primitive_is_the_one_the_api_stages(name):
    """lazyharvest assumes each primitive object it imports (jax.extend.core.primitives,
    jax._src.shard_map, jax._src.custom_batching, jax._src.custom_derivatives) is
    the one the matching public API stages (the interpreter's rules are keyed
    on them)."""
    fn, eqn_name = STAGED[name]
    prim = getattr(layer, name)
    found = {e.primitive for e in _eqns(fn, 1.)}
    assert prim in found, (
        f"{name} ({prim}) is not what the public API stages on jax {V}: {found}")
    if eqn_name is not None:
        assert prim.name == eqn_name


def test_closed_call_p_takes_call_jaxpr():
    """lazyharvest assumes `closed_call_p` is bound with a ClosedJaxpr `call_jaxpr`
    (through get_bind_params) and its eqns hold it there (core.closed_call,
    core.identity_eqn, the interpreter's call rule)."""
    close(layer.closed_call(lambda a: [a * 2.], 3.), [6.])
    eqn = _only(_eqns(lambda x: layer.closed_call(lambda a: [a * 2.], x)[0], 1.),
                layer.closed_call_p.name)
    assert eqn.primitive is layer.closed_call_p
    assert isinstance(eqn.params["call_jaxpr"], layer.ClosedJaxpr), (
        f"closed_call_p's call_jaxpr param changed on jax {V}: {eqn.params}")
    (sin,) = _eqns(jnp.sin, 1.)
    ident = layer.identity_eqn(sin)
    assert ident.primitive is layer.closed_call_p
    close(layer.bind_eqn(ident, [jnp.float32(0.5)]), [0.5])


def test_call_p_takes_call_jaxpr():
    """lazyharvest assumes `call_p` is bound with a `call_jaxpr` param (an open
    Jaxpr; jax >= 0.11 makes it closed_call_p) and its eqns hold it there (the
    interpreter's call rule evaluates it in place)."""
    body, consts = layer.trace_flat(lambda a: [jnp.sin(a)], [jax.typeof(1.)])
    assert not consts
    params = layer.get_bind_params(layer.call_p, {"call_jaxpr": body})
    close(layer.bind_with_params(layer.call_p, [jnp.float32(0.5)], params), [jnp.sin(0.5)])
    staged = jax.make_jaxpr(lambda x: layer.bind_with_params(layer.call_p, [x], params))(1.)
    (eqn,) = staged.jaxpr.eqns
    assert eqn.primitive is layer.call_p
    call_jaxpr = eqn.params["call_jaxpr"]
    assert isinstance(call_jaxpr, (layer.Jaxpr, layer.ClosedJaxpr)), (
        f"call_p's call_jaxpr param changed on jax {V}: {eqn.params}")


def test_sharding_impls_unspecified_is_jits_default():
    """lazyharvest assumes `sharding_impls.UNSPECIFIED` is what jit puts in
    `in_shardings`/`out_shardings` for an unannotated value (the interpreter's jit
    rule pads new inputs and outputs with it)."""
    eqn = _only(_eqns(jax.jit(jnp.sin), 1.), "jit")
    assert eqn.params["in_shardings"] == (layer.UNSPECIFIED,), (
        f"jit's default in_shardings is not sharding_impls.UNSPECIFIED on jax {V}: "
        f"{eqn.params['in_shardings']}")
    assert eqn.params["out_shardings"] == (layer.UNSPECIFIED,)


def test_jit_p_params_are_per_input_and_per_output():
    """lazyharvest assumes jit eqns take per-input `in_shardings`, `in_layouts`,
    `donated_invars` and per-output `out_shardings`, `out_layouts`, and that a
    body with more inputs and outputs binds once they are padded (the
    interpreter's jit rule, partial_eval._keeping_inputs)."""
    c = jnp.float32(3.)
    eqn = _only(_eqns(jax.jit(lambda x: x * c), 1.), "jit")
    p = eqn.params
    for k, n in (("in_shardings", 1), ("in_layouts", 1), ("donated_invars", 1),
                 ("out_shardings", 1), ("out_layouts", 1)):
        assert len(p[k]) == n, f"jit's {k} param changed on jax {V}: {p}"
    # the body with its const as a leading input and one more output, padded
    jaxpr, consts = layer.trace_flat(lambda k, x: [x * k, x + 1.], [jax.typeof(c)] * 2)
    params = dict(p, jaxpr=layer.ClosedJaxpr(jaxpr, consts),
                  in_shardings=(layer.UNSPECIFIED,) * 2, in_layouts=(None,) * 2,
                  donated_invars=(False,) * 2, out_shardings=(layer.UNSPECIFIED,) * 2,
                  out_layouts=(None,) * 2)
    close(layer.bind_eqn(eqn, [c, jnp.float32(2.)], params), [6., 3.])


def test_primitive_bind_takes_subfuns_where_the_layer_puts_them():
    """lazyharvest assumes a call's primitive binds with the functions `get_bind_params`
    gave (as leading arguments on jax 0.8, else as params["subfuns"]) and keeps
    its custom rule (core.bind_eqn, bind_with_params)."""
    for fn, dfn in ((_cjvp, lambda x: 3.), (_cvjp, lambda x: 5. * x)):
        (eqn,) = _eqns(fn, 1.)
        rebound = lambda x, eqn=eqn: layer.bind_eqn(eqn, [x])[0]  # noqa: E731
        close(rebound(0.7), fn(0.7))
        close(jax.grad(rebound)(0.7), dfn(0.7))


# --- tracebacks -------------------------------------------------------------------

@pytest.fixture
def filtering():
    old = jax.config.jax_traceback_filtering
    jax.config.update("jax_traceback_filtering", "quiet_remove_frames")
    try:
        yield
    finally:
        jax.config.update("jax_traceback_filtering", old)


def _raised_files(fn):
    with pytest.raises(ValueError, match="lh_contract") as info:
        fn()
    return [f.f_code.co_filename for f, _ in traceback.walk_tb(info.value.__traceback__)]


def _raise(*_):
    raise ValueError("lh_contract")


def test_traceback_util_register_exclusion(tmp_path, filtering):
    """lazyharvest assumes `traceback_util.register_exclusion(path)` drops frames of
    files under `path` from the tracebacks JAX's API boundaries filter
    (core.hide_frames_below, called for the package's own directory)."""
    (tmp_path / "lh_hidden").mkdir()
    mod, path = load_module(tmp_path / "lh_hidden", "lh_contract_hidden",
                      "def call(f, x):\n    return f(x)\n")
    run = lambda: jax.jit(lambda x: mod.call(_raise, x))(1.)  # noqa: E731
    assert path in _raised_files(run)
    layer.hide_frames_below(str(tmp_path / "lh_hidden"))
    files = _raised_files(run)
    assert path not in files and __file__ in files, (
        f"traceback_util.register_exclusion no longer hides frames on jax {V}: {files}")


def test_traceback_util_api_boundary(filtering):
    """lazyharvest assumes `traceback_util.api_boundary(f)` filters JAX-internal
    frames out of exceptions raised below `f` (the package's entry points)."""
    run = lambda: jax.tree_util.tree_map(_raise, [1.])  # noqa: E731
    assert any(f.startswith(JAX_DIR) for f in _raised_files(run))
    files = _raised_files(layer.api_boundary(run))
    assert not any(f.startswith(JAX_DIR) for f in files) and __file__ in files, (
        f"traceback_util.api_boundary no longer filters JAX's frames on jax {V}: {files}")


# --- effects and batchers -------------------------------------------------------------

def test_effects_control_flow_allowed_effects():
    """lazyharvest assumes `effects.control_flow_allowed_effects` is the set cond, scan
    and while consult before accepting an effect in a body (core.register_effect)."""
    effect_type, _, prim = _effectful("lh_contract_cf")
    body = lambda x: lax.cond(x > 0., prim.bind, lambda y: y, x)  # noqa: E731
    with pytest.raises(NotImplementedError, match="Effects not supported"):
        jax.make_jaxpr(body)(1.)
    layer._effects.control_flow_allowed_effects.add_type(effect_type)
    jax.make_jaxpr(body)(1.)
    jax.make_jaxpr(lambda x: lax.scan(lambda c, _: (prim.bind(c), None), x, None, length=2))(1.)


@pytest.mark.usefixtures("default_staging")
def test_effects_custom_derivatives_allowed_effects():
    """lazyharvest assumes `effects.custom_derivatives_allowed_effects` is the set a
    custom_jvp call's type check consults for effects in its function
    (core.register_effect)."""
    effect_type, _, prim = _effectful("lh_contract_cd")
    f = jax.custom_jvp(prim.bind)
    f.defjvp(lambda p, t: (f(p[0]), t[0]))
    closed = jax.make_jaxpr(f)(1.)
    check = lambda: layer._core.check_jaxpr(closed.jaxpr)  # noqa: E731
    with pytest.raises(NotImplementedError, match="Effects not supported in `custom_jvp`"):
        check()
    layer._effects.custom_derivatives_allowed_effects.add_type(effect_type)
    check()


@pytest.mark.usefixtures("default_staging")
def test_effects_remat_allowed_effects():
    """lazyharvest assumes `effects.remat_allowed_effects` is the set the partial
    evaluation of `jax.checkpoint` consults for effects in its body
    (core.register_effect)."""
    effect_type, _, prim = _effectful("lh_contract_remat")
    fn = lambda x: [jax.checkpoint(prim.bind)(x)]  # noqa: E731
    with pytest.raises(NotImplementedError, match="checkpoint"):
        _partial_eval(fn)
    layer._effects.remat_allowed_effects.add_type(effect_type)
    _partial_eval(fn)


def test_effects_partial_eval_kept_effects():
    """lazyharvest assumes `effects.partial_eval_kept_effects` is the set whose
    effects keep an unused eqn in JAX's partial evaluation (core.register_effect;
    partial_eval.keep_effects_in_cond_partial_eval filters by it)."""
    effect_type, effect, prim = _effectful("lh_contract_kept")
    fn = lambda x: [(prim.bind(x), x * 2.)[1]]  # noqa: E731
    assert prim not in [e.primitive for e in _partial_eval(fn).eqns]
    kept = layer._effects.partial_eval_kept_effects
    assert not kept.filter_in({effect})
    kept.add_type(effect_type)
    assert list(kept.filter_in({effect})) == [effect], (
        f"effects.partial_eval_kept_effects.filter_in changed on jax {V}")
    assert prim in [e.primitive for e in _partial_eval(fn).eqns], (
        f"effects.partial_eval_kept_effects no longer keeps unused eqns on jax {V}")


def test_mlir_lowerable_effects():
    """lazyharvest assumes `mlir.lowerable_effects` is the set lowering consults
    before lowering a jaxpr with an effect (core.register_effect)."""
    effect_type, _, prim = _effectful("lh_contract_lower")
    layer.mlir.register_lowering(prim, layer.mlir.lower_fun(lambda x: x, multiple_results=False))
    with pytest.raises(ValueError, match="Cannot lower jaxpr with effects"):
        jax.jit(prim.bind).lower(1.)
    layer.mlir.lowerable_effects.add_type(effect_type)
    jax.jit(prim.bind).lower(1.)


def test_jaxpr_effects():
    """lazyharvest assumes `jaxpr.effects` holds the effects of its eqns
    (core.effects_of)."""
    _, effect, prim = _effectful("lh_contract_effects")
    closed = jax.make_jaxpr(lambda x: prim.bind(x) * 2.)(1.)
    assert effect in layer.effects_of(closed.jaxpr), (
        f"Jaxpr.effects no longer collects its eqns' effects on jax {V}")
    assert not layer.effects_of(jax.make_jaxpr(jnp.sin)(1.).jaxpr)


def test_batching_primitive_batchers():
    """lazyharvest assumes `batching.primitive_batchers[prim]` is the vmap rule,
    called as `rule(batched_args, batch_dims, **params) -> (out, out_dim)`
    (core.register_batcher)."""
    prim = layer.Primitive("lh_contract_batch")
    prim.def_impl(lambda x, *, k: x * k)
    prim.def_abstract_eval(lambda x, *, k: x)
    seen = []

    def rule(args, dims, **params):
        seen.append((dims, params))
        return prim.bind(*args, **params), dims[0]

    layer.register_batcher(prim, rule)
    close(jax.vmap(lambda x: prim.bind(x, k=2.))(jnp.arange(3.)), [0., 2., 4.])
    assert seen and seen[0][1] == {"k": 2.} and tuple(seen[0][0]) == (0,), (
        f"batching.primitive_batchers is not called as (args, dims, **params) on jax {V}: "
        f"{seen}")


# --- traces and tracers ------------------------------------------------------------------

def _current():
    return layer._core.trace_ctx.trace


def test_core_trace_ctx_is_an_eval_trace_when_eager():
    """lazyharvest assumes `core.trace_ctx.trace` is an `EvalTrace` exactly when no
    transformation or tracing is active (core.in_eager_mode)."""
    assert isinstance(_current(), layer._core.EvalTrace) and layer.in_eager_mode(), (
        f"core.trace_ctx.trace is not an EvalTrace at top level on jax {V}: {_current()}")
    seen = []
    jax.jit(lambda x: seen.append(layer.in_eager_mode()) or x)(1.)
    jax.vmap(lambda x: seen.append(layer.in_eager_mode()) or x)(jnp.ones(2))
    jax.grad(lambda x: seen.append(layer.in_eager_mode()) or x)(1.)
    assert seen == [False, False, False], (
        f"core.trace_ctx.trace is an EvalTrace under a transformation on jax {V}")


def test_core_tracer_class():
    """lazyharvest assumes the values a transformation traces are instances of
    `core.Tracer` and concrete arrays are not (core.is_tracer, any_tracer)."""
    seen = []
    record = lambda x: seen.append(layer.is_tracer(x)) or x  # noqa: E731
    jax.jit(record)(1.)
    jax.vmap(record)(jnp.ones(2))
    jax.grad(record)(1.)
    jax.jvp(record, (1.,), (1.,))
    assert seen == [True] * 4, f"core.Tracer is not the tracers' class on jax {V}"
    assert not layer.any_tracer([jnp.ones(2), np.ones(2), 1.])


def test_tracer_trace_is_valid():
    """lazyharvest assumes `tracer._trace.is_valid()` is True while its trace is
    active and False once a vmap trace ended (jvp and jaxpr traces stay valid:
    core.tracer_is_dead then finds them missing from the active traces)."""
    leaked, alive = {}, []

    def keep(name):
        def f(x):
            leaked[name] = x
            alive.append((x._trace.is_valid(), layer.tracer_is_dead(x)))
            return x
        return f

    jax.vmap(keep("vmap"))(jnp.ones(2))
    jax.jvp(keep("jvp"), (1.,), (1.,))
    jax.jit(keep("jit"))(1.)
    assert alive == [(True, False)] * 3, f"Tracer._trace.is_valid changed on jax {V}: {alive}"
    assert not leaked["vmap"]._trace.is_valid(), (
        f"a tracer leaked from vmap has _trace.is_valid() True on jax {V}")
    assert all(layer.tracer_is_dead(x) for x in leaked.values())


def test_trace_parent_trace():
    """lazyharvest assumes a transformation's trace points to the trace below it
    through `parent_trace`, down to the eval trace, which has none
    (core.parent_trace, traces_below, tracer_is_dead)."""
    seen = {}

    def body(x):
        seen["chain"] = layer.traces_below(_current())
        return x * 2.

    jax.jit(jax.vmap(lambda x: jax.jvp(body, (x,), (x,))[1]))(jnp.ones(2))
    chain = seen["chain"]
    names = [type(t).__name__ for t in chain]
    assert names == ["JVPTrace", "BatchTrace", "DynamicJaxprTrace", "EvalTrace"], (
        f"the parent_trace chain changed on jax {V}: {names}")
    assert layer.parent_trace(chain[0]) is chain[1] and layer.parent_trace(chain[1]) is chain[2]
    assert isinstance(chain[-1], layer._core.EvalTrace)


def test_core_set_current_trace():
    """lazyharvest assumes `core.set_current_trace(trace)` makes ops bind to `trace`
    inside the block (core.current_trace)."""
    eager = _current()
    seen = []

    def f(x):
        with layer.current_trace(eager):
            seen.append((_current() is eager, layer.is_tracer(jnp.sin(1.))))
        seen.append(layer.is_tracer(x * 2.))
        return x

    jax.jit(f)(1.)
    assert seen == [(True, False), True], (
        f"core.set_current_trace no longer sets the trace ops bind to on jax {V}: {seen}")


def test_config_trace_context_includes_user_contexts():
    """lazyharvest assumes `config.trace_context()` (what jit keys its caches on)
    changes with a `jax.make_user_context` value (api.py, program.py key their
    caches on it)."""
    ctx = jax.make_user_context(default_value=0)
    outside = layer.trace_context()
    with ctx(1):
        inside = layer.trace_context()
    hash(inside)
    assert inside != outside and layer.trace_context() == outside, (
        f"config.trace_context() ignores user contexts on jax {V}")


def test_array_impl_is_the_array_type():
    """lazyharvest assumes concrete jax.Arrays are `array.ArrayImpl` instances
    (api.py treats them as leaves)."""
    for x in (jnp.ones(2), jax.device_put(np.ones(2)), jnp.float32(1.) + 1.):
        assert type(x) is layer.ArrayImpl, (
            f"array.ArrayImpl is not the type of concrete arrays on jax {V}: {type(x)}")


def test_tree_util_default_registry_flatten():
    """lazyharvest assumes `tree_util.default_registry.flatten(tree)` is
    `jax.tree_util.tree_flatten(tree)` (core.tree_flatten, the call path)."""
    tree = {"a": (1., [2., None]), "b": jnp.ones(2)}
    leaves, treedef = layer.tree_flatten(tree)
    want_leaves, want_def = jax.tree_util.tree_flatten(tree)
    assert treedef == want_def and len(leaves) == len(want_leaves) == 3, (
        f"tree_util.default_registry.flatten differs from tree_flatten on jax {V}")
    assert all(a is b for a, b in zip(leaves, want_leaves))


# --- tracing and evaluating jaxprs --------------------------------------------------------

def test_pe_trace_to_jaxpr_dynamic():
    """lazyharvest assumes `pe.trace_to_jaxpr_dynamic(lu.wrap_init(fn, debug_info=
    api_util.debug_info(...)), avals)` returns (jaxpr, out_avals, consts) with the
    closed-over values as consts, leading invars where the jaxpr is merged
    (core.trace_flat and core._open rely on it)."""
    c = jnp.array([1., 2.])
    fn = lambda x: [x + c]  # noqa: E731
    avals = [jax.typeof(1.)]
    dbg = layer._debug_info("lh_contract", fn, tuple(avals), {})
    out = layer.pe.trace_to_jaxpr_dynamic(layer.lu.wrap_init(fn, debug_info=dbg), avals)
    assert len(out) == 3, f"pe.trace_to_jaxpr_dynamic returns {len(out)} values on jax {V}"
    jaxpr, out_avals, consts = out
    assert len(consts) == 1 and consts[0] is c and out_avals == [jax.typeof(c)]
    if versions.MERGED_JAXPR:
        assert not jaxpr.consts and len(jaxpr.invars) == 2, (
            f"trace_to_jaxpr_dynamic's jaxpr attaches its consts on jax {V}")
    else:
        assert len(jaxpr.constvars) == 1 and len(jaxpr.invars) == 1
    opened, consts = layer.trace_flat(fn, avals)
    assert len(opened.constvars) == 1 and len(opened.invars) == 1
    close(layer.eval_jaxpr(opened, consts, 1.), [[2., 3.]])


def test_api_util_flatten_fun_nokwargs():
    """lazyharvest assumes `api_util.flatten_fun_nokwargs(wrapped, in_tree)` gives a
    flat function and a thunk of the output tree (core.trace_pytree)."""
    args = ({"a": 1.}, 2.)
    leaves, in_tree = jax.tree_util.tree_flatten(args)
    closed, out_tree = layer.trace_pytree(lambda d, y: (d["a"] * y, [y]), in_tree,
                                          [jax.typeof(x) for x in leaves])
    assert out_tree == jax.tree_util.tree_structure((0., [0.])), (
        f"api_util.flatten_fun_nokwargs' output tree changed on jax {V}: {out_tree}")
    close(layer.eval_jaxpr(closed.jaxpr, closed.consts, 3., 2.), [6., 2.])


def test_pe_convert_constvars_jaxpr():
    """lazyharvest assumes `pe.convert_constvars_jaxpr(jaxpr)` moves the constvars to
    the front of the invars (core.consts_as_invars)."""
    c = jnp.array([1., 2.])
    jaxpr, consts = layer.trace_flat(lambda x: [x * c], [jax.typeof(1.)])
    opened = layer.consts_as_invars(jaxpr)
    assert not opened.constvars and opened.invars == [*jaxpr.constvars, *jaxpr.invars], (
        f"pe.convert_constvars_jaxpr changed on jax {V}")
    close(layer.eval_jaxpr(opened, [], c, 3.), [[3., 6.]])


def test_jax_core_eval_jaxpr():
    """lazyharvest assumes `jax.core.eval_jaxpr(jaxpr, consts, *args)` evaluates a
    jaxpr with its constvars bound to `consts` (core.eval_jaxpr, used throughout)."""
    c = jnp.array([1., 2.])
    closed = jax.make_jaxpr(lambda x, y: (x * c, y - x))(2., 5.)
    close(jax.core.eval_jaxpr(closed.jaxpr, closed.consts, 2., 5.), [[2., 4.], 3.])


def test_primitive_def_impl_sets_impl():
    """lazyharvest assumes `Primitive.def_impl(f)` keeps `f` as the primitive's
    `impl` attribute, which a library's primitive sets to its own function
    (core.primitive_origin: where a primitive comes from, for errors)."""
    def impl(x):
        return x
    prim = layer.Primitive("contract_impl")
    prim.def_impl(impl)
    assert prim.impl is impl, f"Primitive.def_impl no longer sets .impl on jax {V}"
    assert layer.primitive_origin(prim) == __name__
    assert layer.primitive_origin(lax.sin_p) is None  # (JAX's own)


def test_implementation_traces_a_python_impl_and_not_a_dispatching_one():
    """lazyharvest assumes a primitive's `impl` can be traced at an eqn's input
    avals (a library's primitive runs its bodies there), and that JAX's own
    primitives' `impl` binds the primitive again (dispatch), so only the
    former are looked through (core.implementation: the generic path)."""
    prim = layer.Primitive("contract_generic")
    prim.def_impl(lambda x, *, k: jnp.sin(x) * k)
    prim.def_abstract_eval(lambda x, *, k: x)
    found = layer.implementation(_only(_eqns(lambda x: prim.bind(x, k=2.), 1.),
                                       "contract_generic"))
    assert found is not None, f"a Python impl could not be traced on jax {V}"
    close(jax.core.eval_jaxpr(found.jaxpr, found.consts, 0.5)[0], 2 * np.sin(0.5))
    for name, fn in [("sin", jnp.sin), ("cumsum", lax.cumsum)]:
        eqn = _only(_eqns(fn, jnp.ones(3)), name)
        assert layer.implementation(eqn) is None, (
            f"jax {V}: {name}'s impl no longer binds {name} again")


def test_replace_jaxprs_keeps_an_open_jaxprs_constvars():
    """lazyharvest assumes an open jaxpr in params (a closure-converted function
    with `constvars`, as Equinox keeps in `static`) moves its constvars to
    leading invars with `pe.convert_constvars_jaxpr` and back with
    `Jaxpr.replace(constvars=, invars=)` (core.replace_jaxprs)."""
    c = jnp.array([1., 2.])
    closed = jax.make_jaxpr(lambda x: x * c)(jnp.ones(2))
    open_ = closed.jaxpr
    new = layer.replace_jaxprs({"f": (open_, 3)}, lambda cj: cj, lambda j: True)
    assert new is not None and new["f"][1] == 3
    close(jax.core.eval_jaxpr(new["f"][0], closed.consts, jnp.ones(2))[0], c)
    assert list(layer.sub_jaxprs({"a": {"b": [closed]}})) == [closed.jaxpr]


def test_traced_for_reads_the_debug_info_of_the_jaxpr_being_traced():
    """lazyharvest assumes the trace a library opens with
    `pe.trace_to_jaxpr_dynamic` under `jax.api_util.debug_info(label, ...)`
    is the current trace while its function runs, and its `frame.debug_info`
    carries `traced_for == label` (core.traced_for: Flax's "flax scan" check,
    primitive.CHECK_TRACES)."""
    seen = []

    def f(x):
        seen.append(layer.traced_for())
        return [x * 2]
    dbg = jax.api_util.debug_info("lh contract check", f, (1.,), {})
    layer.pe.trace_to_jaxpr_dynamic(layer.lu.wrap_init(f, debug_info=dbg), [jax.typeof(1.)])
    assert seen == ["lh contract check"], f"traced_for reads {seen} on jax {V}"
    assert layer.traced_for() is None


def test_source_info_user_context():
    """lazyharvest assumes re-binding an eqn inside `source_info_util.user_context(
    traceback, name_stack=...)` gives the new eqn the old one's name stack and
    traceback (core.eqn_source, eval_eqns with in_context)."""
    def f(x):
        with jax.named_scope("lh_scope"):
            return jnp.sin(x)

    (eqn,) = _eqns(f, 1.)
    assert "lh_scope" in str(eqn.source_info.name_stack)
    (plain,) = _eqns(lambda x: layer.bind_eqn(eqn, [x]), 1.)
    assert "lh_scope" not in str(plain.source_info.name_stack)

    def rebind(x):
        with layer.eqn_source(eqn):
            return layer.bind_eqn(eqn, [x])

    (new,) = _eqns(rebind, 1.)
    assert "lh_scope" in str(new.source_info.name_stack), (
        f"source_info_util.user_context no longer sets the name stack on jax {V}")
    assert new.source_info.traceback is eqn.source_info.traceback, (
        f"source_info_util.user_context no longer sets the traceback on jax {V}")


def test_eqn_ctx_manager():
    """lazyharvest assumes `eqn.ctx.manager` re-establishes an eqn's context (xla
    metadata, compute type) for a re-bind (core.eqn_context, eval_eqns)."""
    from jax.experimental.xla_metadata import set_xla_metadata

    with set_xla_metadata(lh_contract="1"):
        (eqn,) = _eqns(jnp.sin, 1.)
    assert eqn.ctx.xla_metadata == {"lh_contract": "1"}
    (plain,) = _eqns(lambda x: layer.bind_eqn(eqn, [x]), 1.)
    assert not plain.ctx.xla_metadata

    def rebind(x):
        with layer.eqn_context(eqn):
            return layer.bind_eqn(eqn, [x])

    (new,) = _eqns(rebind, 1.)
    assert new.ctx.xla_metadata == {"lh_contract": "1"}, (
        f"JaxprEqn.ctx.manager no longer restores the eqn's context on jax {V}")


def test_core_extend_axis_env_nd():
    """lazyharvest assumes `core.extend_axis_env_nd([(name, size)])` binds vmap axis
    names for collectives while tracing (core.axis_env, recorded.py)."""
    fn = lambda x: lax.psum(x, "lh_i")  # noqa: E731
    with pytest.raises(NameError):
        jax.make_jaxpr(fn)(1.)
    with layer.axis_env([("lh_i", 3)]):
        eqns = _eqns(fn, 1.)
    assert [e.primitive.name for e in eqns][-1] in ("psum", "psum_invariant"), (
        f"core.extend_axis_env_nd no longer binds axis names on jax {V}: {eqns}")


def test_ad_util_zeros_like_aval():
    """lazyharvest assumes `ad_util.zeros_like_aval(aval)` gives zeros of exactly
    `aval` (weak type, float0, key dtypes) on the current trace (core.zeros_like_aval)."""
    assert "jax._src.ad_util" in layer.internals()
    avals = [jax.typeof(jnp.ones(2)), jax.typeof(1.), jax.typeof(jnp.int32(1)),
             jax.typeof(jnp.int32(1)).to_tangent_aval()]
    for aval in avals:
        z = layer.zeros_like_aval(aval)
        assert jax.typeof(z) == aval, (
            f"ad_util.zeros_like_aval({aval}) gives {jax.typeof(z)} on jax {V}")
    assert not np.any(np.asarray(layer.zeros_like_aval(avals[0])))
    staged = jax.make_jaxpr(lambda x: x + layer.zeros_like_aval(jax.typeof(x)))(1.)
    assert staged.jaxpr.eqns, f"ad_util.zeros_like_aval no longer stages on jax {V}"


# Found false on every tested version: for a PRNG key aval, zeros_like_aval
# gives float0 zeros (the key's tangent type), not a key; the layer's
# docstring promises key dtypes (a site sowing a key inside a custom rule would
# get float0 placeholders).
@pytest.mark.xfail(strict=True, reason="ad_util.zeros_like_aval gives float0 for key avals")
def test_ad_util_zeros_like_aval_of_a_key():
    """lazyharvest assumes `ad_util.zeros_like_aval` of a PRNG key aval is a key of
    that aval (core.zeros_like_aval's docstring; custom.py's placeholder outputs)."""
    aval = jax.typeof(jax.random.key(0))
    z = layer.zeros_like_aval(aval)
    assert jax.typeof(z) == aval, (
        f"ad_util.zeros_like_aval({aval}) gives {jax.typeof(z)} on jax {V}")


def test_config_eager_constant_folding():
    """lazyharvest assumes a `DynamicJaxprTrace` evaluates ops on non-tracers right
    away while `config.eager_constant_folding` is on (jax.ensure_compile_time_eval)
    and stages them when it is turned off (core.folds_constants, no_constant_folding)."""
    seen = {}

    def f(x):
        trace = _current()
        seen["trace"] = isinstance(trace, layer._pe.DynamicJaxprTrace)
        seen["outside"] = layer.folds_constants(trace, [1.])
        with jax.ensure_compile_time_eval():
            seen["folds"] = (layer.folds_constants(trace, [1.]),
                             layer.folds_constants(trace, [x]))
            seen["folded"] = not layer.is_tracer(jnp.sin(1.))
            with layer.no_constant_folding():
                seen["off"] = layer.folds_constants(trace, [1.])
                seen["staged"] = layer.is_tracer(jnp.sin(1.))
        return x

    jax.make_jaxpr(f)(1.)
    assert seen == {"trace": True, "outside": False, "folds": (True, False), "folded": True,
                    "off": False, "staged": True}, (
        f"config.eager_constant_folding / DynamicJaxprTrace folding changed on jax {V}: "
        f"{seen}")


def test_dynamic_jaxpr_trace_default_process_primitive():
    """lazyharvest assumes `trace.default_process_primitive(prim, [trace.to_jaxpr_tracer(
    x, source_info)], params, source_info)` stages `prim` on a jaxpr trace even
    while constant folding is on (core.stage_unfolded)."""
    out = {}

    def f(x):
        trace = _current()
        with jax.ensure_compile_time_eval():
            out["y"] = layer.stage_unfolded(trace, lax.neg_p, [jnp.float32(2.)], {})
            out["tracer"] = layer.is_tracer(out["y"])
        return x + out["y"]

    eqns = _eqns(f, 1.)
    assert out["tracer"] and "neg" in [e.primitive.name for e in eqns], (
        f"DynamicJaxprTrace.default_process_primitive / to_jaxpr_tracer changed on jax {V}")


# --- high-level primitives (jax_*3 flags) --------------------------------------------------

def _construct(flag):
    if flag == "jax_scan3":
        return lambda x: lax.scan(lambda c, _: (jnp.sin(c), None), x, None, length=2)[0]
    if flag == "jax_remat3":
        return jax.checkpoint(jnp.sin)
    if flag == "jax_custom_jvp3":
        f = jax.custom_jvp(jnp.sin)
        f.defjvp(lambda p, t: (jnp.sin(p[0]), jnp.cos(p[0]) * t[0]))
        return f
    f = jax.custom_vjp(jnp.sin)
    f.defvjp(lambda x: (jnp.sin(x), x), lambda r, g: (jnp.cos(r) * g,))
    return f


@pytest.mark.parametrize("flag", ["jax_scan3", "jax_remat3", "jax_custom_vjp3",
                                  "jax_custom_jvp3"])
def test_hijax_call_hi_primitive(flag):
    """lazyharvest assumes that under a `jax_*3` flag the construct stages a
    `hijax.call_hi_primitive_p` eqn whose `_prim` param is an instance of the
    class the layer maps to the flag (Scan3, RematTraced, CustomVJPTraced,
    CustomJVPTraced; base HiPrim or VJPHiPrimitive), holding the body's jaxprs
    (core.hi_prim_jaxprs, hi_prim_flag, _interpreter/calls.py)."""
    if flag not in jax.config.values:
        if versions.JAX_VERSION < (0, 12):
            pytest.skip(f"jax {V} has no {flag}: nothing stages it")
        raise AssertionError(f"jax {V} has no config option {flag}")
    assert flag in layer.HI_PRIM_FLAGS.values(), (
        f"jax {V} has the flag {flag}, but the layer finds no class for it")
    assert layer.call_hi_primitive_p is not None
    with jax_flag(flag):
        eqns = _eqns(_construct(flag), 1.)
    (eqn,) = [e for e in eqns if e.primitive is layer.call_hi_primitive_p]
    hi = eqn.params["_prim"]
    assert isinstance(hi, layer._HI_PRIM) and layer.hi_prim_flag(hi) == flag, (
        f"call_hi_primitive's _prim under {flag} is a {type(hi)} on jax {V}")
    inner = [e.primitive.name for j in layer.hi_prim_jaxprs(hi)
             for e in getattr(j, "jaxpr", j).eqns]
    assert "sin" in inner, (
        f"the jaxprs of a {type(hi).__name__} (hijax._pp_hi_subjaxprs, or its "
        f"attributes before 0.12) no longer hold the body on jax {V}: {inner}")


@pytest.mark.parametrize("flag", ["jax_scan3", "jax_remat3"])
def test_scan3_and_remat_traced_are_built_again_from_their_params(flag):
    """lazyharvest assumes a `Scan3` and a `RematTraced` are built from
    their `params` (`type(x)(**x.params)`, as JAX rebuilds them), so a body
    rewritten in place gives one that computes what the rewrite says
    (core.rebuilt_hi_prim, map_params: a custom rule's recomputed sites)."""
    if flag not in layer.HI_PRIM_FLAGS.values():
        pytest.skip(f"jax {V} has no {flag}")
    with jax_flag(flag):
        closed = jax.make_jaxpr(_construct(flag))(1.)
    (eqn,) = [e for e in closed.jaxpr.eqns if e.primitive is layer.call_hi_primitive_p]
    hi = eqn.params["_prim"]
    assert layer.rebuilt_hi_prim(hi, lambda v: v) is hi
    cos = jax.make_jaxpr(jnp.cos)(1.)

    def swap(v):  # the body's sin replaced by cos
        if not isinstance(v, layer.ClosedJaxpr):
            return v
        eqns = [e.replace(primitive=cos.jaxpr.eqns[0].primitive) if e.primitive.name == "sin"
                else e for e in v.jaxpr.eqns]
        return layer.ClosedJaxpr(v.jaxpr.replace(eqns=eqns), v.consts)
    new = layer.rebuilt_hi_prim(hi, swap)
    assert type(new) is type(hi) and new is not hi, (
        f"a {type(hi).__name__} is no longer built from its params on jax {V}")
    jaxpr = closed.jaxpr.replace(eqns=[e.replace(params=dict(e.params, _prim=new))
                                       if e is eqn else e for e in closed.jaxpr.eqns])
    got = jax.core.eval_jaxpr(jaxpr, closed.consts, jnp.float32(1.))[0]
    want = jnp.cos(jnp.cos(1.)) if flag == "jax_scan3" else jnp.cos(1.)
    close(got, want)


@pytest.mark.usefixtures("default_staging")  # (CustomRoot as staged with every flag off)
def test_implementation_of_a_high_level_primitive_is_its_expansion():
    """lazyharvest assumes a `call_hi_primitive` eqn's `_prim` object has
    `in_tree` and `expand(*args)` (its lowering), so `core.implementation`
    traces it; checked with `lax.custom_root`, which jax >= 0.12 stages as a
    `CustomRoot` with every flag off (_interpreter/calls.py)."""
    def f(a):
        newton = lambda g, y0: lax.fori_loop(0, 8, lambda _, y: y - g(y) / (2 * y), y0)  # noqa: E731
        return lax.custom_root(lambda y: y ** 2 - a, 1.0, newton, lambda g, y: y / g(1.0))
    eqns = jax.make_jaxpr(f)(2.).jaxpr.eqns
    hi = [e for e in eqns if e.primitive is layer.call_hi_primitive_p]
    if layer.call_hi_primitive_p is None or not hi:
        assert versions.JAX_VERSION < (0, 12), f"jax {V} no longer stages CustomRoot"
        pytest.skip(f"jax {V} stages custom_root as ordinary primitives")
    impl = layer.implementation(hi[0])
    assert impl is not None, f"jax {V}: the CustomRoot object has no expand/in_tree"
    (out,) = layer.eval_jaxpr(impl.jaxpr, impl.consts, *[jnp.float32(2.)] * len(impl.jaxpr.invars))
    close(out, np.sqrt(2.), rtol=1e-5)


def test_jaxpr_and_eqn_replace_rewrite_params_in_nested_bodies():
    # map_params: Jaxpr.replace(eqns=...), JaxprEqn.replace(params=...), bodies
    # as ClosedJaxpr params (a while loop's)
    def f(x, power):
        return lax.while_loop(lambda c: c < 3., lambda c: c ** power + 1., x)
    closed = jax.make_jaxpr(lambda x: f(x, 2))(0.5)
    prim = lax.integer_pow_p
    assert layer.map_params(closed.jaxpr, prim, lambda p: p) is closed.jaxpr, (
        f"jax {V}: an unchanged jaxpr is not shared")
    new = layer.map_params(closed.jaxpr, prim, lambda p: dict(p, y=3))
    assert isinstance(_only(new.eqns, "while").params["body_jaxpr"], layer.ClosedJaxpr)
    close(layer.eval_jaxpr(new, closed.consts, 0.5)[0], f(0.5, 3))
    close(layer.eval_jaxpr(closed.jaxpr, closed.consts, 0.5)[0], f(0.5, 2))


@pytest.mark.parametrize("flag", ["jax_custom_vjp3", "jax_custom_jvp3"])
def test_custom_hi_prim_leading_counts_the_operands_that_are_not_arguments(flag):
    """lazyharvest assumes the flat operands of a `CustomVJPTraced` /
    `CustomJVPTraced` application are `custom_hi_prim_leading(prim)` leaves
    that are not the user's arguments (the closure, a custom_vjp's forward
    constants), then the arguments' leaves (custom.py's planted rule)."""
    from lazyharvest._jax.versions import CUSTOM_HI_PRIMS
    if flag not in layer.HI_PRIM_FLAGS.values() or not CUSTOM_HI_PRIMS:
        pytest.skip(f"jax {jax.__version__} has no {flag}, or its sites are refused")
    c = jnp.array([1.0, 2.0])  # closed over
    with jax_flag(flag):
        if flag == "jax_custom_vjp3":
            f = jax.custom_vjp(lambda x, y: jnp.sin(x) * y + c)
            f.defvjp(lambda x, y: (f(x, y), (x, y)), lambda r, g: (g, g))
        else:
            f = jax.custom_jvp(lambda x, y: jnp.sin(x) * y + c)
            f.defjvp(lambda p, t: (f(*p), t[0] + t[1]))
        jaxpr = jax.make_jaxpr(f)(jnp.ones(2), (jnp.ones(2)))
    (eqn,) = [e for e in jaxpr.eqns if e.primitive is layer.call_hi_primitive_p]
    n = layer.custom_hi_prim_leading(eqn.params["_prim"])
    assert len(eqn.invars) - n == 2, (
        f"the operands of {type(eqn.params['_prim']).__name__} changed on jax {jax.__version__}")


@pytest.mark.parametrize("flag", ["jax_custom_vjp3", "jax_custom_jvp3"])
def test_a_custom_hi_prim_rebuilt_with_wrapped_rules_runs_them(flag):
    """lazyharvest assumes a `CustomJVPTraced` / `CustomVJPTraced` holds its
    rules as params (`custom_hi_rules`: `jvp_rule`, or `fwd` and `bwd`), that
    `with_custom_rules` rebuilds it with some replaced (JAX's differentiation
    then calls those), that `custom_hi_function` / `custom_hi_primal` give its
    function over its flat operands from its rules' arguments, that
    `custom_hi_tree` unflattens them, and that `is_zero` / `dense_tangent`
    read the zeros JAX gives the rules (custom.py's bind rule)."""
    from jax.custom_derivatives import SymbolicZero

    from lazyharvest._jax.versions import CUSTOM_HI_PRIMS
    if flag not in layer.HI_PRIM_FLAGS.values() or not CUSTOM_HI_PRIMS:
        pytest.skip(f"jax {jax.__version__} has no {flag}, or its sites are refused")
    c = jnp.array([1.0, 2.0])  # closed over
    x = jnp.array([0.3, -0.4])
    with jax_flag(flag):
        if flag == "jax_custom_vjp3":
            f = jax.custom_vjp(lambda x: jnp.sin(x) * c)
            f.defvjp(lambda x: (f(x), x), lambda r, g: (7.0 * g,))
        else:
            f = jax.custom_jvp(lambda x: jnp.sin(x) * c)
            f.defjvp(lambda p, t: (f(*p), 7.0 * t[0]))
        jaxpr = jax.make_jaxpr(f)(x)
    (eqn,) = [e for e in jaxpr.eqns if e.primitive is layer.call_hi_primitive_p]
    prim, seen = eqn.params["_prim"], []
    rules = layer.custom_hi_rules(prim)
    assert set(rules) == ({"fwd", "bwd"} if flag == "jax_custom_vjp3" else {"jvp_rule"})

    def spy(name):
        def rule(*args):
            seen.append(name)
            if name == "jvp_rule":  # (the closure's tangent is a zero)
                assert any(layer.is_zero(t) for t in layer.custom_hi_primal(prim, args[1])[1])
            return rules[name](*args)
        return rule
    new = layer.with_custom_rules(prim, **{k: spy(k) for k in rules})
    assert type(new) is type(prim)
    assert layer.custom_hi_function(new) is layer.custom_hi_function(prim)
    values = dict(zip(jaxpr.jaxpr.constvars, jaxpr.consts))

    def operands(x):
        return [values.get(v, x) for v in eqn.invars]

    def g(x):
        return jnp.sum(layer.call_hi_primitive_p.bind(*operands(x), _prim=new)[0])
    close(jax.grad(g)(x), jnp.full(2, 7.0))
    assert seen[:1] == (["fwd"] if flag == "jax_custom_vjp3" else ["jvp_rule"]), (
        f"jax {V}: the rebuilt object's rules ran as {seen}")
    tree = layer.custom_hi_tree(prim)
    function, leaves = layer.custom_hi_primal(prim, tree.unflatten(operands(x)))
    close(layer.eval_jaxpr(function, [], *leaves)[0], jnp.sin(x) * c)
    assert layer.is_zero(SymbolicZero(jax.typeof(x))) and not layer.is_zero(x)
    close(layer.dense_tangent(SymbolicZero(jax.typeof(x))), jnp.zeros(2))


@pytest.mark.skipif(not hasattr(jax, "new_ref"), reason=f"jax {V} has no jax.new_ref")
def test_without_internal_refs_discharges_the_refs_a_jaxpr_makes():
    # jax._src.state.discharge.discharge_state and core.InternalMutableArrayEffect
    def f(x):
        r = jax.new_ref(x)
        r[...] = jnp.sin(r[...]) * 2.0
        return [r[...] + 1.0]
    jaxpr, consts = layer.trace_flat(f, [jax.typeof(jnp.ones(3))])
    closed = layer.ClosedJaxpr(jaxpr, consts)
    assert closed.jaxpr.effects, f"jax {V}: a jaxpr making a Ref has no effect to say so"
    pure = layer.without_internal_refs(closed)
    assert not pure.jaxpr.effects
    assert [v.aval for v in pure.jaxpr.invars] == [v.aval for v in jaxpr.invars]
    assert not any("ref" in e.primitive.name or e.primitive.name in ("get", "swap")
                   for e in pure.jaxpr.eqns), pure
    x = jnp.array([0.1, 0.5, -2.0])
    close(layer.eval_jaxpr(pure.jaxpr, pure.consts, x)[0], jnp.sin(x) * 2.0 + 1.0)
    close(layer.without_internal_refs_fn(f)(x)[0], jnp.sin(x) * 2.0 + 1.0)
    assert layer.without_internal_refs(pure) is pure  # (nothing to discharge)


@pytest.mark.parametrize("flag", ["jax_custom_vjp3", "jax_custom_jvp3"])
def test_a_custom_hi_prim_rebuilt_around_a_rewritten_function_runs_it(flag):
    """lazyharvest assumes a custom function's object holds its function as
    a `stages.Traced` whose `_params["jaxpr"]` it runs (JAX's own
    `with_consts_as_arg` swaps it the same way), so `rebuilt_hi_prim` gives
    an object whose function is the rewritten one, its rules kept (a sow's
    params rewritten inside a custom function a rule calls: custom.py's
    `_rewritten`)."""
    from lazyharvest._jax.versions import CUSTOM_HI_PRIMS
    if flag not in layer.HI_PRIM_FLAGS.values() or not CUSTOM_HI_PRIMS:
        pytest.skip(f"jax {V} has no {flag}, or its sites are refused")
    with jax_flag(flag):
        if flag == "jax_custom_vjp3":
            f = jax.custom_vjp(jnp.sin)
            f.defvjp(lambda x: (f(x), x), lambda r, g: (7.0 * g,))
        else:
            f = jax.custom_jvp(jnp.sin)
            f.defjvp(lambda p, t: (f(*p), 7.0 * t[0]))
        closed = jax.make_jaxpr(f)(1.)
    (eqn,) = [e for e in closed.jaxpr.eqns if e.primitive is layer.call_hi_primitive_p]
    hi = eqn.params["_prim"]
    assert layer.rebuilt_hi_prim(hi, lambda v: v) is hi
    cos = jax.make_jaxpr(jnp.cos)(1.).jaxpr.eqns[0].primitive

    def swap(v):  # the function's sin replaced by cos
        return _with_cos(v, cos) if isinstance(v, (layer.Jaxpr, layer.ClosedJaxpr)) else v
    new = layer.rebuilt_hi_prim(hi, swap)
    assert type(new) is type(hi) and new is not hi, (
        f"a {type(hi).__name__}'s Traced could not be rebuilt on jax {V}")
    jaxpr = closed.jaxpr.replace(eqns=[e.replace(params=dict(e.params, _prim=new))
                                       if e is eqn else e for e in closed.jaxpr.eqns])
    run = lambda x: jax.core.eval_jaxpr(jaxpr, closed.consts, x)[0]  # noqa: E731
    close(run(jnp.float32(1.)), jnp.cos(1.))
    close(jax.grad(run)(jnp.float32(1.)), 7.0)  # (the rule, kept)
    assert cos in [e.primitive for e in layer.custom_hi_function(new).eqns]


def _with_cos(v, cos):
    inner = v.jaxpr if isinstance(v, layer.ClosedJaxpr) and v.jaxpr is not v else v
    eqns = [e.replace(primitive=cos) if e.primitive.name == "sin" else e for e in inner.eqns]
    new = inner.replace(eqns=eqns)
    return layer.ClosedJaxpr(new, v.consts) if inner is not v else new


def test_custom_hi_remat_rules_are_the_objects_defremat_rules():
    """`custom_hi_remat_rules` gives a `defremat` object's `(fwd, rem, bwd)`
    as the object calls them (`remat_rules` param), and `with_custom_rules`
    rebuilds it with them replaced: jax.checkpoint under `jax_remat3` runs
    the replacements (fwd forward, rem and bwd backward)."""
    from lazyharvest._jax.versions import CUSTOM_HI_PRIMS
    if (not CUSTOM_HI_PRIMS or not hasattr(jax.custom_vjp, "defremat")
            or "jax_remat3" not in layer.HI_PRIM_FLAGS.values()):
        pytest.skip(f"jax {V} has no custom_vjp.defremat or jax_remat3, or custom "
                    f"functions' sites are refused")
    f = jax.custom_vjp(jnp.sin)
    f.defremat(lambda x: (f(x), x), lambda x, x_again: (jnp.sin(x_again), x_again),
               lambda x, g: (3.0 * g,), generic_batching=True)
    closed = jax.make_jaxpr(f)(1.)
    (eqn,) = [e for e in closed.jaxpr.eqns if e.primitive is layer.call_hi_primitive_p]
    hi = eqn.params["_prim"]
    rules = layer.custom_hi_remat_rules(hi)
    assert rules is not None and len(rules) == 3 and all(map(callable, rules)), rules
    seen = []

    def spy(i):
        def rule(*args):
            seen.append(i)
            return rules[i](*args)
        return rule
    new = layer.with_custom_rules(hi, remat_rules=tuple(spy(i) for i in range(3)))
    assert layer.custom_hi_remat_rules(new) is not None
    jaxpr = closed.jaxpr.replace(eqns=[e.replace(params=dict(e.params, _prim=new))
                                       if e is eqn else e for e in closed.jaxpr.eqns])
    run = lambda x: jax.core.eval_jaxpr(jaxpr, closed.consts, x)[0]  # noqa: E731
    with jax_flag("jax_remat3"):
        close(jax.grad(jax.checkpoint(run))(jnp.float32(1.)), 3.0)
    assert set(seen) == {0, 1, 2}, seen
