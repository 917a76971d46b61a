"""Contracts of `lazyharvest/_jax/differentiation.py`: JAX's linearization
rules and traces, bind hooks and custom calls' functions, tangents and zeros
on differentiation traces, remat rules and the transposes of jit/scan/cond
(docs/compat.md)."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from helpers import close, load_module
from lazyharvest._jax import core as layer_core
from lazyharvest._jax import differentiation as layer
from lazyharvest._jax import partial_eval as layer_pe
from lazyharvest._jax import versions

V = jax.__version__
C = jnp.float32(3.)

needs_derivative_sites = pytest.mark.skipif(
    not versions.DERIVATIVE_SITES,
    reason=f"jax {V}: derivative sites are off, the package does not use this internal")
needs_custom_call_hooks = pytest.mark.skipif(
    not versions.CUSTOM_CALL_HOOKS,
    reason=f"jax {V}: custom calls' functions are not in params, the package does not hook them")


def _current():
    return layer._core.trace_ctx.trace


def _sin_like(name):
    """A fresh primitive computing sin, with no differentiation rule."""
    prim = layer_core.Primitive(name)
    prim.def_impl(jnp.sin)
    prim.def_abstract_eval(lambda x: x)
    return prim


def _with_jvp(name, calls=None):
    """A fresh sin primitive with a JVP rule (recording its calls in `calls`)."""
    prim = _sin_like(name)

    def jvp(primals, tangents):
        (x,), (t,) = primals, tangents
        if calls is not None:
            calls.append(type(t).__name__)
        return prim.bind(x), jnp.cos(x) * layer_core.ad.instantiate_zeros(t)

    layer_core.ad.primitive_jvps[prim] = jvp
    return prim


# --- linearization rules ---------------------------------------------------------------

@needs_derivative_sites
def test_primitive_linearizations_rule_convention(monkeypatch):
    """lazyharvest assumes JAX calls `ad.primitive_linearizations[prim](is_vjp,
    nonzeros, *primals, **params)` and runs the returned `linearized(residuals,
    *tangents)` (after structured residuals where LINEARIZE_STRUCTURED) on the
    tangent trace (differentiation.register_linearization)."""
    prim = _sin_like("lh_contract_lin")
    seen = []

    def rule(is_vjp, nonzeros, x):
        seen.append((is_vjp, list(nonzeros)))
        return prim.bind(x), nonzeros[0], [jnp.cos(x)], lambda res, t: res[0] * t

    monkeypatch.setitem(layer.linearization_rules, prim, None)
    layer.register_linearization(prim, rule)
    y, f_lin = jax.linearize(prim.bind, 0.5)
    close([y, f_lin(2.)], [jnp.sin(0.5), 2. * jnp.cos(0.5)])
    close(jax.grad(prim.bind)(0.5), jnp.cos(0.5))
    assert seen == [(False, [True]), (True, [True])], (
        f"ad.primitive_linearizations rules are called as {seen} on jax {V}")


def test_ad_fallback_linearize_rule(monkeypatch):
    """lazyharvest assumes `functools.partial(ad.fallback_linearize_rule, prim)` is the
    linearization JAX uses for a primitive with only a JVP rule, callable as a
    linearization rule (differentiation.wrap_linearization of while_p)."""
    calls = []
    prim = _with_jvp("lh_contract_fallback", calls)
    assert prim not in layer.linearization_rules
    monkeypatch.setitem(layer.linearization_rules, prim, None)
    monkeypatch.delitem(layer.linearization_rules, prim)
    layer.wrap_linearization(prim, lambda eqn: False)
    assert getattr(layer.linearization_rules[prim], "_lazyharvest", False)
    y, f_lin = jax.linearize(prim.bind, 0.5)
    close([y, f_lin(2.)], [jnp.sin(0.5), 2. * jnp.cos(0.5)])
    close(jax.grad(prim.bind)(0.5), jnp.cos(0.5))
    assert calls, f"ad.fallback_linearize_rule no longer runs the JVP rule on jax {V}"


# Factories of fresh functions: JAX caches linearizations (on jax 0.12 a jit's
# transpose under jax.vjp is a `vjp_node(jit_p)` copying the transpose rule in
# force when it was first linearized).
def _jit_fn():
    return lambda x: jax.jit(lambda y: jnp.sin(y))(x)


def _scan_fn():
    return lambda x: lax.scan(lambda c, _: (jnp.sin(c), None), x, None, length=2)[0]


def _cond_fn():
    return lambda x: lax.cond(x > 0., lambda y: jnp.sin(y), jnp.cos, x)


def _while_fn():
    return lambda x: lax.while_loop(lambda c: c[0] < 2, lambda c: (c[0] + 1, jnp.sin(c[1])),
                                    (0, x))[1]


BODIES = {"jit_p": _jit_fn, "scan_p": _scan_fn, "cond_p": _cond_fn, "while_p": _while_fn}


@needs_derivative_sites
@pytest.mark.parametrize("name", sorted(BODIES))
def test_primitive_linearizations_of_control_flow(name, monkeypatch):
    """lazyharvest assumes jax.linearize linearizes jit/scan/cond/while eqns through
    `ad.primitive_linearizations[prim]` (where the package wraps them) and calls
    the rule's last value, `linearized`, on the tangent trace
    (differentiation.wrap_linearization)."""
    prim = getattr(layer_core, name)
    table = layer.linearization_rules
    installed = table.get(prim)
    assert getattr(installed, "_lazyharvest", False), (
        f"the package's linearization of {name} is not in ad.primitive_linearizations "
        f"on jax {V}")
    seen = []

    def spy(*args, **params):
        *head, linearized = installed(*args, **params)

        def lin(*a, **k):
            trace = _current()
            seen.append(getattr(getattr(trace, "frame", None), "auto_dce", None))
            return linearized(*a, **k)
        return (*head, lin)

    monkeypatch.setitem(table, prim, spy)
    fn = BODIES[name]()
    _, f_lin = jax.linearize(fn, 0.5)
    close(f_lin(1.), jax.jvp(fn, (0.5,), (1.,))[1])
    assert seen == [True], (
        f"jax.linearize no longer runs {name}'s linearized function on the tangent "
        f"trace on jax {V}: {seen}")


# --- differentiation traces ---------------------------------------------------------------

def test_linearize_trace_is_vjp():
    """lazyharvest assumes jax.jvp traces on an `ad.JVPTrace`, and jax.linearize,
    jax.vjp and jax.grad on an `ad.LinearizeTrace` whose `is_vjp` tells the last
    two apart (differentiation.differentiation_kind)."""
    traces = []
    record = lambda x: traces.append(_current()) or x * 2.  # noqa: E731
    jax.jvp(record, (1.,), (1.,))
    jax.linearize(record, 1.)
    jax.vjp(record, 1.)
    jax.grad(record)(1.)
    jax.jit(record)(1.)
    kinds = [type(t).__name__ for t in traces]
    assert kinds == ["JVPTrace", "LinearizeTrace", "LinearizeTrace", "LinearizeTrace",
                     "DynamicJaxprTrace"], f"the differentiation traces changed on jax {V}: {kinds}"
    if not versions.DERIVATIVE_SITES:
        assert not hasattr(traces[1], "is_vjp"), (
            f"LinearizeTrace has is_vjp on jax {V}, but DERIVATIVE_SITES is off")
        return
    assert [layer.differentiation_kind(t) for t in traces] == [
        "jvp", "linearize", "vjp", "vjp", None], (
        f"LinearizeTrace.is_vjp no longer tells jax.vjp from jax.linearize on jax {V}")


def _partial_eval(fn):
    avals = [jax.typeof(1.)]
    dbg = jax.api_util.debug_info("lh_contract", fn, tuple(avals), {})
    pvals = [layer.pe.PartialVal.unknown(a) for a in avals]
    layer.pe.trace_to_jaxpr_nounits(layer.lu.wrap_init(fn, debug_info=dbg), pvals)


def test_jaxpr_trace_is_partial_evaluation():
    """lazyharvest assumes JAX's partial evaluation traces on a `pe.JaxprTrace`, seen
    below differentiation like `ad.JVPTrace`/`ad.LinearizeTrace`
    (differentiation.under_differentiation, under_linearization)."""
    seen = []

    def record(x):
        seen.append((type(_current()).__name__, layer.under_differentiation(),
                     layer.under_linearization(_current())))
        return x * 2.

    _partial_eval(lambda x: [record(x)])
    jax.jvp(record, (1.,), (1.,))
    jax.linearize(record, 1.)
    jax.jit(record)(1.)
    assert seen == [("JaxprTrace", True, True), ("JVPTrace", True, False),
                    ("LinearizeTrace", True, True), ("DynamicJaxprTrace", False, False)], (
        f"pe.JaxprTrace / ad traces changed on jax {V}: {seen}")


def test_trace_to_primal_tangent_pair():
    """lazyharvest assumes `trace.to_primal_tangent_pair(x)` of a differentiation
    trace gives (primal, tangent), the tangent an `ad.Zero` for a value without
    one (differentiation.has_tangent, primal_of)."""
    seen = []

    def f(x):
        trace = _current()
        seen.append((layer.has_tangent(trace, x), layer.has_tangent(trace, C),
                     layer.primal_of(trace, C) is C,
                     type(trace.to_primal_tangent_pair(C)[1]) is layer.Zero,
                     layer_core.is_tracer(layer.primal_of(trace, x))))
        return x * C

    jax.jvp(f, (1.,), (1.,))
    jax.linearize(f, 1.)
    assert seen == [(True, False, True, True, False), (True, False, True, True, False)], (
        f"Trace.to_primal_tangent_pair changed on jax {V}: {seen}")


def test_aval_to_tangent_aval():
    """lazyharvest assumes `aval.to_tangent_aval()` has dtype float0 exactly for
    values without tangents (ints, bools) (differentiation.differentiable)."""
    got = [layer.differentiable(jax.typeof(x)) for x in
           (jnp.float32(1.), jnp.ones(2, jnp.bfloat16), jnp.complex64(1.), jnp.int32(1),
            jnp.bool_(True))]
    assert got == [True, True, True, False, False], (
        f"ShapedArray.to_tangent_aval changed on jax {V}: {got}")


def test_linearize_trace_tangent_trace():
    """lazyharvest assumes a `LinearizeTrace` computes tangents on its `tangent_trace`
    (a jaxpr trace) and a `JVPTrace` on its parent trace
    (differentiation.tangent_trace)."""
    seen = []

    def f(x):
        trace = _current()
        seen.append((trace, layer.tangent_trace(trace)))
        return x * 2.

    jax.linearize(f, 1.)
    jax.jvp(f, (1.,), (1.,))
    (lin, lin_tangent), (jvp, jvp_tangent) = seen
    assert lin_tangent is lin.tangent_trace, f"LinearizeTrace.tangent_trace changed on jax {V}"
    assert isinstance(lin_tangent, layer._pe.DynamicJaxprTrace), (
        f"LinearizeTrace.tangent_trace is no jaxpr trace on jax {V}: {lin_tangent}")
    assert jvp_tangent is jvp.parent_trace


def test_ad_jvp_tracer_constructor():
    """lazyharvest assumes `ad.JVPTracer(trace, primal, tangent)` makes a value of the
    jvp trace, so ops on it go through JVP rules (differentiation.with_zero_tangent)."""
    calls = []
    prim = _with_jvp("lh_contract_jvp_tracer", calls)

    def f(x):
        trace = _current()
        plain = prim.bind(C)
        zero = layer.with_zero_tangent(trace, C, linear=False)
        assert isinstance(zero, layer._ad.JVPTracer) and zero._trace is trace
        return x + plain + prim.bind(zero)

    y, t = jax.jvp(f, (1.,), (1.,))
    close([y, t], [1. + 2. * jnp.sin(C), 1.])
    assert calls == ["ArrayImpl"], (
        f"ops on an ad.JVPTracer with zero tangent no longer go through JVP rules on "
        f"jax {V}: {calls}")


@needs_derivative_sites
def test_ad_linearize_tracer_constructor():
    """lazyharvest assumes `ad.LinearizeTracer(trace, primal, tangent)` (the tangent
    on `trace.tangent_trace`) makes a value of the linearize trace with that
    tangent (differentiation.with_tangent, with_zero_tangent)."""
    def f(x):
        trace = _current()
        primal, tangent = trace.to_primal_tangent_pair(x)
        with layer_core.current_trace(layer.tangent_trace(trace)):
            tangent3 = tangent * 3.
        y = layer.with_tangent(trace, primal * 2., tangent3)
        zero = layer.with_zero_tangent(trace, C, linear=False)
        assert isinstance(y, layer._ad.LinearizeTracer) and isinstance(
            zero, layer._ad.LinearizeTracer)
        return y + zero * 5.

    y, f_lin = jax.linearize(f, 1.)
    close([y, f_lin(2.)], [2. + 5. * C, 6.])


def test_jvp_trace_over_eval_trace():
    """lazyharvest assumes an eager jax.jvp's traces are `ad.JVPTrace`s down to the
    `core.EvalTrace` (differentiation.records_program)."""
    seen = []

    def f(x):
        seen.append(layer.records_program(_current()))
        return x * 2.

    jax.jvp(f, (1.,), (1.,))
    jax.jvp(lambda x: jax.jvp(f, (x,), (x,))[1], (1.,), (1.,))
    jax.jit(lambda x: jax.jvp(f, (x,), (x,))[1])(1.)
    assert seen == [False, False, True], f"JVPTrace.parent_trace chains changed on jax {V}: {seen}"


@needs_derivative_sites
def test_core_new_ref_freeze_is_linear():
    """lazyharvest assumes a value read from a fresh reference (`core.freeze(
    core.new_ref(zeros))`) on a jax.vjp's tangent trace is linear: the eqns using
    it are transposed in the backward pass (differentiation.linear_zero)."""
    q = layer_core.Primitive("lh_contract_linear")
    q.def_impl(lambda x: x)
    q.def_abstract_eval(lambda x: x)
    transposed = []
    layer_core.ad.primitive_transposes[q] = lambda ct, x: transposed.append(1) or [ct]

    def make(linear):
        def f(x):
            trace = _current()
            zero = layer.with_zero_tangent(trace, C, linear=linear)
            primal, tangent = trace.to_primal_tangent_pair(zero)
            with layer_core.current_trace(layer.tangent_trace(trace)):
                t = q.bind(tangent)
            return x + layer.with_tangent(trace, primal, t)
        return f

    for linear in (False, True):
        transposed.clear()
        y, f_vjp = jax.vjp(make(linear), 1.)
        close([y, f_vjp(1.)[0]], [1. + C, 1.])
        assert transposed == ([1] if linear else []), (
            f"core.freeze(core.new_ref(...)) is {'not ' if linear else ''}linear in the "
            f"backward pass on jax {V}: {transposed}")


# --- bind hooks and custom calls ---------------------------------------------------------

def test_primitive_def_bind_with_trace(tmp_path):
    """lazyharvest assumes `prim.def_bind_with_trace(rule)` makes every bind of `prim`
    call `rule`, and `type(prim).bind_with_trace` is JAX's default
    (differentiation.register_bind_hook)."""
    prim = _sin_like("lh_contract_hook")
    seen = []
    hooks, _ = load_module(tmp_path, "lh_contract_hooks", (
        "def make(seen):\n"
        "    def make_rule(default):\n"
        "        def rule(trace, args, avals, params):\n"
        "            seen.append((type(trace).__name__, list(avals)))\n"
        "            return default(trace, args, avals, params)\n"
        "        return rule\n"
        "    return make_rule\n"))
    layer.register_bind_hook(prim, hooks.make(seen))
    close(prim.bind(jnp.float32(0.5)), jnp.sin(0.5))
    jax.make_jaxpr(prim.bind)(jnp.float32(0.5))
    aval = jax.typeof(jnp.float32(0.5))
    assert seen == [("EvalTrace", [aval]), ("DynamicJaxprTrace", [aval])], (
        f"Primitive.def_bind_with_trace no longer hooks every bind on jax {V}: {seen}")


def test_primitive_without_a_bind_with_trace_of_its_own(tmp_path):
    """lazyharvest assumes JAX's primitives (custom calls included) hold no
    `bind_with_trace` of their own (`vars(prim)`), so that removing the one
    `def_bind_with_trace` set makes binds go to JAX's default again
    (differentiation.register_bind_hook, `only_in_force`)."""
    for prim in (layer_core.custom_jvp_call_p, layer_core.custom_vjp_call_p):
        with layer.hooks_in_force():
            pass
        assert "bind_with_trace" not in vars(prim), (
            f"{prim} has a bind_with_trace of its own on jax {V}")
    prim = _sin_like("lh_contract_unhook")
    seen = []
    default = type(prim).bind_with_trace
    prim.def_bind_with_trace(lambda *rest: seen.append(1) or default(prim, *rest))
    prim.bind(jnp.float32(0.5))
    del vars(prim)["bind_with_trace"]
    close(prim.bind(jnp.float32(0.5)), jnp.sin(0.5))
    assert seen == [1], f"a removed bind_with_trace still hooks binds on jax {V}: {seen}"


def test_source_info_register_exclusion(tmp_path):
    """lazyharvest assumes `source_info_util.register_exclusion(path)` (listed in
    `_exclude_paths`), made before eqns are staged from files under `path`, keeps
    their frames out of the user frame of those eqns' source info
    (differentiation.register_bind_hook). (`user_frame` caches per traceback
    from jax 0.9: a path registered later may still show.)"""
    sources = layer._source_info_util
    source = "import jax.numpy as jnp\n\ndef stage(x):\n    return jnp.sin(x)\n"
    mods = {}
    for name in ("shown", "hidden"):
        (tmp_path / name).mkdir()
        mods[name] = load_module(tmp_path / name, f"lh_contract_staging_{name}", source)
    sources.register_exclusion(str(tmp_path / "hidden"))
    assert str(tmp_path / "hidden") in sources._exclude_paths

    def user_file(mod):
        (eqn,) = jax.make_jaxpr(lambda x: mod.stage(x))(1.).jaxpr.eqns
        return sources.user_frame(eqn.source_info.traceback).file_name

    assert user_file(mods["shown"][0]) == mods["shown"][1]
    assert user_file(mods["hidden"][0]) == __file__, (
        f"source_info_util.register_exclusion no longer hides frames from eqns' source "
        f"info on jax {V}")


@jax.custom_jvp
def _cjvp(x):
    return jnp.sin(x)


_cjvp.defjvp(lambda p, t: (_cjvp(p[0]), 3. * t[0]))


@needs_custom_call_hooks
@pytest.mark.usefixtures("default_staging")
def test_custom_jvp_call_subfuns_are_replaceable(monkeypatch):
    """lazyharvest assumes a bind hook of `custom_jvp_call_p` may replace the `jvp` in
    `params["subfuns"]` (a WrappedFun of `(*primals, *tangents) -> (*primals_out,
    *tangents_out)`) by `lu.wrap_init(fn, debug_info=jvp.debug_info)`, and JAX
    uses it (differentiation.replace_subfuns, wrapped_like)."""
    prim = layer_core.custom_jvp_call_p
    default = type(prim).bind_with_trace

    def scaled(fun, jvp):
        def rule(*xs):
            out = jvp.call_wrapped(*xs)
            n = len(out) // 2
            return [*out[:n], *(t * 10. for t in out[n:])]
        return fun, layer.wrapped_like(rule, jvp)

    def hook(trace, args, avals, params):
        return default(prim, trace, args, avals, layer.replace_subfuns(params, scaled))

    monkeypatch.setattr(prim, "bind_with_trace", hook)
    y, t = jax.jvp(_cjvp, (0.5,), (1.,))
    close([y, t], [jnp.sin(0.5), 30.])


@needs_custom_call_hooks
@pytest.mark.usefixtures("default_staging")
def test_wrapped_fun_stores_reset(monkeypatch):
    """lazyharvest assumes a custom call's WrappedFun records its output trees in
    `fun.stores` (each with `.reset()`, via `._store` where wrapped) and may be
    traced once more and called by JAX after they are emptied
    (differentiation.trace_wrapped, trace_wrapped_avals)."""
    prim = layer_core.custom_jvp_call_p
    default = type(prim).bind_with_trace
    seen = {}

    def hook(trace, args, avals, params):
        fun, _ = params["subfuns"]
        stores = [s for s in fun.stores if s is not None]
        seen["empty_before"] = not any(layer._store_full(s) for s in stores)
        layer_core.trace_flat(lambda *a: list(fun.call_wrapped(*a)), list(avals))
        seen["filled"] = any(layer._store_full(s) for s in stores)
        for s in stores:
            getattr(s, "_store", s).reset()
        jaxpr, _ = layer.trace_wrapped(fun, args)
        seen["traced"] = [e.primitive.name for e in jaxpr.eqns]
        seen["empty_after"] = not any(layer._store_full(s) for s in stores)
        return default(prim, trace, args, avals, params)

    monkeypatch.setattr(prim, "bind_with_trace", hook)
    close(_cjvp(0.5), jnp.sin(0.5))
    assert seen == {"empty_before": True, "filled": True, "traced": ["sin"],
                    "empty_after": True}, (
        f"lu.WrappedFun.stores / Store.reset changed on jax {V}: {seen}")


@jax.custom_vjp
def _cvjp(x):
    return jnp.sin(x)


_cvjp.defvjp(lambda x: (_cvjp(x), x * 2.), lambda r, g: (5. * g * r,))


@pytest.mark.usefixtures("default_staging")
def test_custom_vjp_fwd_subfun_and_out_trees():
    """lazyharvest assumes a custom_vjp call's `fwd` subfun takes (value, perturbed)
    pairs and returns the residuals then the outputs, after which the eqn's
    `out_trees()` gives (out_tree, res_tree, forwards) (_interpreter/custom.py
    with differentiation.trace_wrapped_avals and call_bwd)."""
    (eqn,) = jax.make_jaxpr(_cvjp)(1.).jaxpr.eqns
    fun, fwd, bwd = layer_core.bind_params(eqn)["subfuns"]
    out = fwd.call_wrapped(jnp.float32(0.5), True)
    close(out, [1., jnp.sin(0.5)])  # (the residuals first)
    out_tree, res_tree, forwards = eqn.params["out_trees"]()
    assert (out_tree.num_leaves, res_tree.num_leaves, list(forwards)) == (1, 1, [None]), (
        f"custom_vjp_call's out_trees() changed on jax {V}: {out_tree, res_tree, forwards}")
    jaxpr, _ = layer.trace_wrapped_avals(fun, [jax.typeof(1.)])
    assert [e.primitive.name for e in jaxpr.eqns] == ["sin"]


# --- remat and transposes ----------------------------------------------------------------

@pytest.mark.usefixtures("default_staging")
def test_partial_eval_jaxpr_custom_rules_calling_convention(monkeypatch):
    """lazyharvest assumes jax.checkpoint's split calls `pe.partial_eval_jaxpr_custom_rules[
    prim](saveable, unks_in, inst_in, eqn)` and takes (known eqn, staged eqn,
    unks_out, inst_out, residuals) back (differentiation.register_remat_rule,
    remat_rule)."""
    prim = _with_jvp("lh_contract_remat")
    calls = []

    def rule(saveable, unks_in, inst_in, eqn):
        calls.append((callable(saveable), list(unks_in), len(inst_in), eqn.primitive))
        n = len(eqn.outvars)
        res = [v for v, inst in zip(eqn.invars, inst_in) if not inst]
        if any(unks_in):
            return None, eqn, [True] * n, [True] * n, res
        return eqn, eqn, [False] * n, [True] * n, res

    rules = layer.pe.partial_eval_jaxpr_custom_rules
    monkeypatch.setitem(rules, prim, None)
    layer.register_remat_rule(prim, rule)
    assert layer.remat_rule(prim) is rule
    f = jax.checkpoint(lambda x: prim.bind(x) * x)
    close(jax.grad(f)(0.5), jnp.cos(0.5) * 0.5 + jnp.sin(0.5))
    assert calls and calls[0] == (True, [False], 1, prim), (
        f"pe.partial_eval_jaxpr_custom_rules are called as {calls} on jax {V}")


@pytest.mark.parametrize("policy", [None, "dots"])
def test_the_remat_rule_of_call_hi_primitive_is_jaxs_default_for_an_object_without_sites(
        policy, monkeypatch):
    """JAX has no remat rule for `call_hi_primitive`; on jax >= 0.12
    lazyharvest registers one (primitive.py, `_recomputed_call`: a custom
    function's sites copied into the rematerialized part are marked) that
    must split an object without sites as JAX's default does: the same
    linearized jaxpr with the rule as with none."""
    if not layer_core.CUSTOM_HI_PRIMS or layer_core.call_hi_primitive_p is None:
        pytest.skip(f"jax {V}: no rule registered for call_hi_primitive")
    from helpers import jax_flag
    prim = layer_core.call_hi_primitive_p
    pol = None if policy is None else jax.checkpoint_policies.checkpoint_dots
    with jax_flag("jax_custom_jvp3"):
        g = jax.custom_jvp(lambda u: jnp.sin(u) * 2.0)
        g.defjvp(lambda p, t: (g(p[0]), 2.0 * jnp.cos(p[0]) * t[0]))
        f = jax.checkpoint(lambda x, c: g(c) * jnp.sum(jnp.cos(x @ x)) + g(x[0, 0]),
                           policy=pol)
        x = jnp.ones((3, 3))

        def linear_jaxpr():
            return str(jax.make_jaxpr(lambda x: jax.linearize(lambda x: f(x, 0.7), x)[1](x))(x))
        assert layer.remat_rule(prim).__module__ == "lazyharvest.primitive"
        with_rule = linear_jaxpr()
        monkeypatch.delitem(layer.pe.partial_eval_jaxpr_custom_rules, prim)
        without = linear_jaxpr()
    assert "call_hi_primitive" in with_rule or "CustomJVPTraced" in with_rule
    assert _without_gensym(with_rule) == _without_gensym(without), (
        f"lazyharvest's remat rule of call_hi_primitive splits differently from JAX's "
        f"default on jax {V}")


def _without_gensym(text):
    import re
    return re.sub(r"0x[0-9a-f]+", "0x", text)


@needs_derivative_sites
@pytest.mark.parametrize("name", ["jit_p", "scan_p", "cond_p"])
def test_ad_fancy_transposes_calling_convention(name, monkeypatch):
    """lazyharvest assumes JAX's backward pass transposes jit/scan/cond eqns through
    `ad.fancy_transposes[prim](cts_in, *args, **params)` (on jax >= 0.12 a jit's
    tangent eqn under jax.vjp is `ad.vjp_node(jit_p)`, whose rule is copied from
    `fancy_transposes[jit_p]` once, when first made), cotangents one per output
    (differentiation.wrap_transpose)."""
    prim = getattr(layer_core, name)
    table = layer._ad.fancy_transposes
    keys = [prim]
    vjp_node = getattr(layer._ad, "vjp_node", None)  # (jax >= 0.12; cached per primitive)
    if vjp_node is not None:
        keys.append(vjp_node(prim))
    seen = []
    for key in keys:
        installed = table.get(key)
        assert getattr(installed, "_lazyharvest", False), (
            f"the package's transpose of {name} is not ad.fancy_transposes[{key}] on jax {V}")

        def spy(cts_in, *args, installed=installed, **params):
            seen.append((len(cts_in), sorted(params)))
            return installed(cts_in, *args, **params)

        monkeypatch.setitem(table, key, spy)
    fn = BODIES[name]()
    close(jax.grad(fn)(0.5), jax.jvp(fn, (0.5,), (1.,))[1])
    assert seen, f"jax.grad no longer transposes {name} through ad.fancy_transposes on jax {V}"
    n_cts, params = seen[0]
    eqn = [e for e in jax.make_jaxpr(fn)(0.5).jaxpr.eqns if e.primitive is prim][0]
    assert n_cts == len(eqn.outvars) or (n_cts >= 1 and name == "scan_p"), (
        f"{name}'s fancy transpose gets {n_cts} cotangents on jax {V}")
    assert "jaxpr" in params or "branches" in params


def test_ad_instantiate_zeros():
    """lazyharvest assumes `ad.instantiate_zeros` turns an `ad.Zero(aval)` into zeros of
    that aval and passes other values through (differentiation.wrap_transpose)."""
    aval = jax.typeof(jnp.ones(2))
    z = layer._ad.instantiate_zeros(layer.Zero(aval))
    assert jax.typeof(z) == aval and not np.any(np.asarray(z)), (
        f"ad.instantiate_zeros changed on jax {V}: {z}")
    x = jnp.ones(2)
    assert layer._ad.instantiate_zeros(x) is x


def test_jaxpr_replace_effects():
    """lazyharvest assumes `jaxpr.replace(effects=...)` gives the same jaxpr with other
    effects, closed again by `ClosedJaxpr(inner, consts)` (wrap_transpose's `shown`)."""
    c = jnp.array([1., 2.])
    closed = jax.make_jaxpr(lambda x: x * c)(1.)
    inner = closed.jaxpr.replace(effects=closed.jaxpr.effects | {layer_pe.keep_effect})
    shown = layer.ClosedJaxpr(inner, closed.consts)
    assert layer_pe.keep_effect in shown.jaxpr.effects and shown.jaxpr.eqns == closed.jaxpr.eqns, (
        f"Jaxpr.replace(effects=...) changed on jax {V}")
    close(jax.core.eval_jaxpr(shown.jaxpr, shown.consts, 2.), [[2., 4.]])


def test_a_remat_rule_gets_the_policy_as_saveable():
    # policy_saves: a jax.checkpoint policy called as (prim, *avals, **params),
    # returning a bool or pe.SaveableType / RecomputeType
    from lazyharvest._jax import differentiation as dl
    eqn = jax.make_jaxpr(jnp.sin)(1.).jaxpr.eqns[0]
    assert dl.policy_saves(jax.checkpoint_policies.everything_saveable, eqn)
    assert not dl.policy_saves(jax.checkpoint_policies.nothing_saveable, eqn)
    assert not dl.policy_saves(jax.checkpoint_policies.dots_saveable, eqn)


@needs_derivative_sites
@pytest.mark.usefixtures("default_staging")
def test_remat_jvp_rule_gets_partial_eval_tangents_under_reverse_mode(monkeypatch):
    """lazyharvest assumes `jax.checkpoint` has no linearization rule: reverse
    mode and jax.linearize call `ad.primitive_jvps[remat_p]` with tangents that
    are `pe.JaxprTracer`s, forward mode with others
    (differentiation._wrap_checkpoint_jvp, `splitting_checkpoint`)."""
    remat_p = layer_core.remat_p
    installed = layer._ad.primitive_jvps[remat_p]
    assert getattr(installed, "_lazyharvest", False), (
        f"the package's jvp of remat is not ad.primitive_jvps[remat_p] on jax {V}")
    assert remat_p not in layer._ad.primitive_linearizations or getattr(
        layer._ad.primitive_linearizations[remat_p], "_lazyharvest", False), (
        f"jax {V} has its own linearization rule for remat")
    seen = []

    def spy(primals, tangents, **params):
        seen.append([isinstance(t, layer._pe.JaxprTracer) for t in tangents])
        return installed(primals, tangents, **params)

    monkeypatch.setitem(layer._ad.primitive_jvps, remat_p, spy)
    f = jax.checkpoint(jnp.sin)
    jax.grad(f)(0.5)
    assert seen and all(seen[-1]), f"grad of remat: tangents {seen} on jax {V}"
    seen.clear()
    jax.jvp(f, (0.5,), (1.,))
    assert seen and not any(seen[-1]), f"jvp of remat: tangents {seen} on jax {V}"


@pytest.mark.usefixtures("default_staging")
@needs_custom_call_hooks
def test_custom_lin_transpose_gets_the_backward_function_as_bwd(monkeypatch):
    """lazyharvest assumes the transpose of `ad.custom_lin_p` (in
    `ad.fancy_transposes` from jax 0.11, `ad.primitive_transposes` before)
    runs the custom_vjp rule's backward function passed as `bwd=`, a wrapped
    function with `call_wrapped` (differentiation.wrap_custom_lin_bwd)."""
    prim = layer._ad.custom_lin_p
    table = (layer._ad.fancy_transposes if prim in layer._ad.fancy_transposes
             else layer._ad.primitive_transposes)
    with layer.hooks_in_force():  # (JAX's own outside)
        installed = table[prim]
    assert getattr(installed, "_lazyharvest", False), (
        f"the package's transpose of custom_lin is not in the table it reads on jax {V}")
    seen = []

    def spy(cts, *args, **params):
        seen.append(hasattr(params.get("bwd"), "call_wrapped"))
        return installed(cts, *args, **params)

    monkeypatch.setitem(table, prim, spy)
    g = jax.custom_vjp(jnp.sin)
    g.defvjp(lambda x: (jnp.sin(x), x), lambda x, ct: (jnp.cos(x) * ct,))
    close(jax.grad(g)(0.5), jnp.cos(0.5))
    assert seen == [True], f"custom_lin's transpose saw {seen} on jax {V}"


@pytest.mark.usefixtures("default_staging")
def test_custom_vjp_forward_thunk_is_a_memoized_wrapped_function():
    """lazyharvest assumes a custom_vjp call's `fwd_jaxpr_thunk` is a wrapped
    function over JAX's `_memoize` (a closure over `cells`, `fn`, `sentinel`),
    whose cache `unshared_thunks` can leave alone (custom.py plants a rule's
    function without poisoning it)."""
    g = jax.custom_vjp(lambda x: jnp.sin(x) * 2.)
    g.defvjp(lambda x: (jnp.sin(x) * 2., x), lambda x, ct: (2. * jnp.cos(x) * ct,))
    eqn = next(e for e in jax.make_jaxpr(g)(0.5).jaxpr.eqns if "fwd_jaxpr_thunk" in e.params)
    thunk = eqn.params["fwd_jaxpr_thunk"]
    fresh = layer_core.unshared_thunks(eqn.params)["fwd_jaxpr_thunk"]
    assert fresh is not thunk, f"the forward thunk is not JAX's _memoize on jax {V}"
    cells = thunk.f.__closure__[thunk.f.__code__.co_freevars.index("cells")].cell_contents
    before = dict(cells)
    jaxpr, _ = fresh.call_wrapped(True)
    assert dict(cells) == before, f"the fresh thunk wrote the eqn's cache on jax {V}"
    assert [e.primitive.name for e in jaxpr.eqns][:1] == ["sin"]


@pytest.mark.usefixtures("default_staging")
def test_a_custom_vjp_call_bound_again_keeps_count_of_its_closed_over_values():
    """lazyharvest assumes that binding a custom_vjp call again from a jaxpr
    (`get_bind_params`) wraps its backward function with JAX's
    `_handle_consts_in_bwd` transformation, given the closed-over values'
    avals (jax <= 0.12.0), or with the `_prepend_input_cts` transformation,
    given a `Zero` per closed-over value (jax 0.12.1), and that JAX's DCE of
    the call wraps the backward function in a closure over `bwd`
    (differentiation.closed_over_operands): the closed-over values are then
    ordinary operands of the new call."""
    w = jnp.array([1.2, 0.7])
    g = jax.custom_vjp(lambda u: (jnp.sin(u) * w, u))
    g.defvjp(lambda u: (g(u), u), lambda u, ct: (jnp.cos(u) * w * ct[0] + ct[1],))

    def call(jaxpr):
        return next(e for e in jaxpr.eqns if e.primitive is layer_core.custom_vjp_call_p)
    first = jax.make_jaxpr(g)(jnp.ones(2))
    n = call(first.jaxpr).params["num_consts"]
    assert n == 1, f"jax {V}: the closed-over array is not a const of the call ({n})"
    again = jax.make_jaxpr(lambda u: layer_core.eval_jaxpr(first.jaxpr, first.consts, u))(
        jnp.ones(2))
    params = call(again.jaxpr).params
    assert params["num_consts"] == 0, f"jax {V}: the rebound call kept its consts"
    assert layer.closed_over_operands(params) == 1, (
        f"jax {V}: the rebound call's backward function does not record them")
    dced, _ = layer_pe.dce(again.jaxpr, [True, False])
    params = call(dced).params
    assert params["bwd"] is not call(again.jaxpr).params["bwd"], (
        f"jax {V}: JAX's DCE no longer wraps the backward function")
    assert layer.closed_over_operands(params) == 1, (
        f"jax {V}: the DCE'd call's backward function hides them")


@pytest.mark.usefixtures("default_staging")
@pytest.mark.skipif(not hasattr(jax.custom_vjp(lambda u: u), "defvjp_with_accums"),
                    reason=f"jax {V} has no custom_vjp.defvjp_with_accums")
def test_a_custom_vjp_call_with_accumulators_bound_again_keeps_count_of_its_closed_over_values():
    """lazyharvest assumes that binding again a custom_vjp call whose rule
    takes gradient accumulators (`defvjp_with_accums`) records its
    closed-over values as `test_a_custom_vjp_call_bound_again_...` does: with
    `_handle_consts_in_bwd` (jax <= 0.12.0), or, as the backward function
    itself, a `_PrependCtsBwdWithAccums` holding a `Zero` per closed-over
    value (jax 0.12.1), also under JAX's DCE of the call
    (differentiation.closed_over_operands)."""
    w = jnp.array([1.2, 0.7])
    g = jax.custom_vjp(lambda u: (jnp.sin(u) * w, u))

    def bwd(u, ct, acc):
        acc.accum(jnp.cos(u) * w * ct[0] + ct[1])
    g.defvjp_with_accums(lambda u: (g(u), u), bwd)

    def call(jaxpr):
        return next(e for e in jaxpr.eqns if e.primitive is layer_core.custom_vjp_call_p)
    first = jax.make_jaxpr(g)(jnp.ones(2))
    assert call(first.jaxpr).params["num_consts"] == 1, (
        f"jax {V}: the closed-over array is not a const of the call")
    again = jax.make_jaxpr(lambda u: layer_core.eval_jaxpr(first.jaxpr, first.consts, u))(
        jnp.ones(2))
    params = call(again.jaxpr).params
    assert params["num_consts"] == 0, f"jax {V}: the rebound call kept its consts"
    assert layer.closed_over_operands(params) == 1, (
        f"jax {V}: the rebound call's backward function (with accumulators: "
        f"{params['bwd'].f!r}) does not record them")
    dced, _ = layer_pe.dce(again.jaxpr, [True, False])
    assert layer.closed_over_operands(call(dced).params) == 1, (
        f"jax {V}: the DCE'd call's backward function hides them")
    # (and the rebound call still differentiates, through its backward function)
    rebound = jax.grad(lambda u: layer_core.eval_jaxpr(
        again.jaxpr, again.consts, u)[0].sum())(jnp.array([0.3, 0.9]))
    close(rebound, jnp.cos(jnp.array([0.3, 0.9])) * w)


def test_backward_pass3_skips_a_jaxpr_whose_cotangents_are_all_zero(monkeypatch):
    """lazyharvest assumes `jax.vjp`'s backward function runs `ad.backward_pass3`
    (a module attribute, looked up when called), which returns at once when
    every cotangent is a symbolic zero and the jaxpr has no effect
    (differentiation.show_to_backward_pass shows it an effect instead)."""
    ran = []
    original = layer._ad.backward_pass3
    monkeypatch.setattr(layer._ad, "backward_pass3", lambda jaxpr, *a: (
        ran.append(len(jaxpr.eqns)), original(jaxpr, *a))[1])
    jax.vjp(lambda x: jnp.sum(lax.stop_gradient(x)), jnp.ones(3))[1](1.0)
    assert ran, f"jax.vjp's backward function no longer calls ad.backward_pass3 on jax {V}"
    assert callable(layer._ad.backward_pass3)
