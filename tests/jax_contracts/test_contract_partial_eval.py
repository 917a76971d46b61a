"""Contracts of `lazyharvest/_jax/partial_eval.py`: JAX's DCE and its rules,
the jaxpr trace's staged eqns, JAX's partial evaluation (`JaxprTrace`) and its
rules, and scan's loop-invariant hoisting (docs/compat.md)."""

import jax
import jax.numpy as jnp
import pytest
from jax import lax

from helpers import jax_flag
from lazyharvest._jax import core as layer_core
from lazyharvest._jax import partial_eval as layer
from lazyharvest._jax import versions

V = jax.__version__
XS = jnp.arange(1., 3.)
C = jnp.float32(3.)


def _prim(name, multiple_results=False):
    """A fresh primitive `name(x, **params) -> x` (`[x]` with `multiple_results`)."""
    prim = layer_core.Primitive(name)
    prim.multiple_results = multiple_results
    wrap = (lambda x: [x]) if multiple_results else (lambda x: x)
    prim.def_impl(lambda x, **_: wrap(x))
    prim.def_abstract_eval(lambda x, **_: wrap(x))
    return prim


def _partial_eval(fn, n_in=1):
    """JAX's partial evaluation (`JaxprTrace`, as in jax.linear_transpose and the
    transpose of jax.checkpoint) of `fn(*xs) -> list` with unknown float inputs."""
    avals = [jax.typeof(1.)] * n_in
    dbg = jax.api_util.debug_info("lh_contract", fn, tuple(avals), {})
    pvals = [layer.pe.PartialVal.unknown(a) for a in avals]
    jaxpr, _, _ = layer.pe.trace_to_jaxpr_nounits(
        layer_core.lu.wrap_init(fn, debug_info=dbg), pvals)
    return jaxpr


def _all_eqns(jaxpr):
    """The eqns of `jaxpr` and of the jaxprs in their params, at any depth."""
    out = []
    for eqn in jaxpr.eqns:
        out.append(eqn)
        for v in eqn.params.values():
            for j in (v if isinstance(v, tuple) else (v,)):
                if isinstance(j, (layer_core.Jaxpr, layer_core.ClosedJaxpr)):
                    out += _all_eqns(getattr(j, "jaxpr", j))
    return out


def _current():
    return layer._core.trace_ctx.trace


# --- DCE -----------------------------------------------------------------------------

def test_pe_dce_jaxpr():
    """lazyharvest assumes `pe.dce_jaxpr(jaxpr, used_outputs, instantiate=...)` returns
    (the jaxpr computing the used outputs, which inputs it uses) (partial_eval.dce,
    the slicing of harvested programs)."""
    jaxpr = jax.make_jaxpr(lambda x, y: (jnp.sin(x), jnp.cos(y)))(1., 2.).jaxpr
    dced, used = layer.dce(jaxpr, [True, False], instantiate=False)
    assert used == [True, False] and [e.primitive.name for e in dced.eqns] == ["sin"], (
        f"pe.dce_jaxpr's result changed on jax {V}: {used}, {dced}")
    assert len(dced.outvars) == 1 and len(dced.invars) == 1
    _, used = layer.dce(jaxpr, [True, False], instantiate=[False, True])
    assert used == [True, True], f"pe.dce_jaxpr's instantiate changed on jax {V}"


@pytest.mark.skipif(not versions.DCE_LIVE_INPUTS, reason="no live inputs before jax 0.12")
def test_pe_dce_jaxpr_live_inputs():
    """lazyharvest assumes `pe.dce_jaxpr(..., live_inputs=...)` drops the writes
    into a Ref input marked not live that nothing in the jaxpr reads, and
    keeps those into a live one (partial_eval._dce_keeping_binders)."""
    def body(x, r):
        r[...] = x * 2
        return [x + 1]
    jaxpr = jax.make_jaxpr(body)(1., jax.new_ref(0.)).jaxpr
    dced, used = layer.pe.dce_jaxpr(jaxpr, [True], instantiate=[False, False],
                                    live_inputs=[True, False])
    assert used == [True, False] and len(dced.eqns) == 1, (
        f"pe.dce_jaxpr's live_inputs changed on jax {V}: {used}, {dced}")
    _, used = layer.pe.dce_jaxpr(jaxpr, [True], instantiate=[False, False],
                                 live_inputs=[True, True])
    assert used == [True, True], f"pe.dce_jaxpr's live_inputs changed on jax {V}"


@pytest.mark.skipif(not hasattr(jax, "new_ref"), reason="no jax.new_ref")
def test_tangent_of_an_integer_ref_is_a_float0_ref():
    """lazyharvest assumes the tangent of an integer Ref is a Ref whose aval's
    `dtype` is float0, as for an integer value's tangent, and a float Ref's
    tangent is not (partial_eval._no_cotangent)."""
    int_ref = jax.typeof(jax.new_ref(jnp.zeros((), jnp.int32)))
    float_ref = jax.typeof(jax.new_ref(jnp.zeros(())))
    assert int_ref.dtype == jnp.int32, f"a Ref's aval has no dtype on jax {V}"
    assert int_ref.to_tangent_aval().dtype == jax.dtypes.float0, (
        f"an integer Ref's tangent changed on jax {V}: {int_ref.to_tangent_aval()}")
    assert float_ref.to_tangent_aval().dtype == jnp.float32


def test_pe_dce_rules_calling_convention(monkeypatch):
    """lazyharvest assumes `pe.dce_jaxpr` calls `pe.dce_rules[prim](used_outputs,
    live_inputs, eqn)` exactly where `versions.DCE_LIVE_INPUTS` is set, else
    `(used_outputs, eqn)`, and drops the eqn when the rule returns None
    (partial_eval.register_dce_rule, extra_dce_rules, wrap_dce_rule)."""
    prim = _prim("lh_contract_dce")
    fn = lambda x: (prim.bind(x), x * 2.)[1]  # noqa: E731
    jaxpr = jax.make_jaxpr(fn)(1.).jaxpr
    calls = []

    def raw(*args):
        calls.append(len(args))
        return [True] * len(args[-1].invars), args[-1]

    monkeypatch.setitem(layer.pe.dce_rules, prim, raw)
    kept, _ = layer.dce(jaxpr, [True])
    assert calls == [3 if versions.DCE_LIVE_INPUTS else 2], (
        f"pe.dce_rules are called with {calls} arguments on jax {V}; "
        f"DCE_LIVE_INPUTS={versions.DCE_LIVE_INPUTS}")
    assert prim in [e.primitive for e in kept.eqns]
    monkeypatch.delitem(layer.pe.dce_rules, prim)
    seen = []
    drop = lambda used, eqn: (seen.append(eqn.primitive) or [False], None)  # noqa: E731
    with layer.extra_dce_rules({prim: drop}):  # (a new jaxpr: JAX caches traces and DCE)
        dropped, _ = layer.dce(jax.make_jaxpr(lambda x: fn(x))(1.).jaxpr, [True])
    assert seen == [prim] and prim not in [e.primitive for e in dropped.eqns], (
        f"a DCE rule returning None no longer drops its eqn on jax {V}")
    assert prim not in layer.pe.dce_rules


def test_pe_default_dce_rule_result():
    """lazyharvest assumes `partial_eval._default_dce_rule` drops an effect-free eqn
    none of whose outputs is used (`([False]*n, None)`) and otherwise returns the
    eqn itself (partial_eval.default_dce_rule, wrap_dce_rule's `new_eqn is shown`)."""
    (eqn,) = jax.make_jaxpr(lambda x, y: x * y)(1., 2.).jaxpr.eqns
    assert layer.default_dce_rule([False], eqn) == ([False, False], None), (
        f"partial_eval._default_dce_rule keeps an unused eqn on jax {V}")
    used, new = layer.default_dce_rule([True], eqn)
    assert used == [True, True] and new is eqn, (
        f"partial_eval._default_dce_rule no longer returns the eqn itself on jax {V}")
    shown = layer_core.new_jaxpr_eqn(eqn.invars, eqn.outvars, eqn.primitive, eqn.params,
                                     eqn.effects | {layer.keep_effect}, eqn.source_info,
                                     eqn.ctx)
    used, new = layer.default_dce_rule([False], shown)
    assert used == [True, True] and new is shown, (
        f"partial_eval._default_dce_rule drops an eqn with an effect on jax {V}")


def _holding(prim_name, q):
    """A jit, scan or cond eqn with two outputs whose body holds `q` (unused)."""
    def body(x):
        q.bind(x)
        return jnp.sin(x), jnp.cos(x)

    fns = {
        "jit_p": lambda x: jax.jit(body)(x),
        "scan_p": lambda x: lax.scan(lambda c, _: body(c), x, None, length=2),
        "cond_p": lambda x: lax.cond(x > 0., body, lambda y: (y, y), x),
    }
    jaxpr = jax.make_jaxpr(fns[prim_name])(1.).jaxpr
    (eqn,) = [e for e in jaxpr.eqns if e.primitive is getattr(layer_core, prim_name)]
    return eqn


@pytest.mark.usefixtures("default_staging")  # (lax.scan staging scan_p)
@pytest.mark.parametrize("prim_name", ["jit_p", "scan_p", "cond_p"])
def test_dce_rules_of_jit_scan_cond_look_inside_an_eqn_with_an_effect(prim_name):
    """lazyharvest assumes JAX's DCE rule of jit/scan/cond drops an effect-free eqn
    none of whose outputs is used without looking inside, but runs the DCE of
    its body (keeping what the body's rules keep) when the eqn shows an effect
    (partial_eval.wrap_dce_rule's `keep_effect`)."""
    q = _prim(f"lh_contract_inside_{prim_name}")
    seen = []
    keep = lambda used, eqn: (seen.append(1) or [True], eqn)  # noqa: E731
    prim = getattr(layer_core, prim_name)
    rule = layer.pe.dce_rules[prim]
    if versions.DERIVATIVE_SITES:
        assert getattr(rule, "_lazyharvest", False), (
            f"the package's DCE rule of {prim_name} is not installed on jax {V}")
    with layer.extra_dce_rules({q: keep}):
        eqn = _holding(prim_name, q)
        n = len(eqn.outvars)
        _, dropped = layer._call_jax_dce(rule, [False] * n, eqn)
        assert dropped is None and not seen, (
            f"{prim_name}'s DCE rule keeps an unused effect-free eqn on jax {V}")
        shown = layer_core.new_jaxpr_eqn(eqn.invars, eqn.outvars, eqn.primitive, eqn.params,
                                         eqn.effects | {layer.keep_effect},
                                         eqn.source_info, eqn.ctx)
        used_inputs, kept = layer._call_jax_dce(rule, [False] * n, shown)
    assert seen and kept is not None and any(used_inputs), (
        f"{prim_name}'s DCE rule no longer looks inside an eqn with an effect on jax {V}")
    bodies = [kept.params["jaxpr"]] if "jaxpr" in kept.params else list(kept.params["branches"])
    inner = [e.primitive for b in bodies for e in _all_eqns(b.jaxpr)]
    assert q in inner, f"{prim_name}'s DCE rule dropped what the body's rules keep on jax {V}"


def test_jaxpr_stack_frame_auto_dce_and_tracing_eqns():
    """lazyharvest assumes a linearize tangent trace's `frame.auto_dce` is on and
    holds effect-free eqns in `frame.tracing_eqns` by weak reference (dropped when
    unused), strongly when auto_dce is off (the eqn, or `lambda: eqn` before jax
    0.10) (partial_eval.keep_staged)."""
    q = _prim("lh_contract_staged")
    seen = {}

    def f(x):
        trace = _current()
        tangent = trace.to_primal_tangent_pair(x)[1]
        frame = trace.tangent_trace.frame
        seen["auto_dce"] = frame.auto_dce
        with layer_core.current_trace(trace.tangent_trace):
            with layer.keep_staged(lambda eqn: eqn.params["k"] == "kept"):
                q.bind(tangent, k="kept")
                q.bind(tangent, k="not selected")
            q.bind(tangent, k="outside")
        seen["auto_dce_after"] = frame.auto_dce
        return x * 2.

    with layer.extra_dce_rules({q: lambda used, eqn: ([True], eqn)}):
        _, f_lin = jax.linearize(f, 1.)
        staged = [e.params["k"] for e in _all_eqns(jax.make_jaxpr(f_lin)(1.).jaxpr)
                  if e.primitive is q]
    assert seen == {"auto_dce": True, "auto_dce_after": True}, (
        f"the tangent trace's frame.auto_dce changed on jax {V}: {seen}")
    assert staged == ["kept"], (
        f"frame.tracing_eqns / auto_dce no longer hold or drop staged eqns as assumed "
        f"on jax {V}: {staged}")


# --- partial evaluation (JaxprTrace) ---------------------------------------------------

def test_pe_custom_partial_eval_rules_calling_convention(monkeypatch):
    """lazyharvest assumes JAX's partial evaluation calls `pe.custom_partial_eval_rules[
    prim](trace, *tracers, **params)` with `JaxprTracer`s (`t.pval.is_known()`), and
    `trace.default_process_primitive(prim, tracers, params)` is its default
    (partial_eval.register_partial_eval_rule)."""
    prim = _prim("lh_contract_pe")
    seen = []

    def make_rule(previous):
        def rule(trace, *tracers, **params):
            seen.append((isinstance(trace, layer._pe.JaxprTrace),
                         [t.pval.is_known() for t in tracers], params))
            return previous(trace, *tracers, **params)
        return rule

    monkeypatch.setitem(layer._pe.custom_partial_eval_rules, prim, None)
    monkeypatch.delitem(layer._pe.custom_partial_eval_rules, prim)
    layer.register_partial_eval_rule(prim, make_rule)
    jaxpr = _partial_eval(lambda x: [prim.bind(x, k=1) + prim.bind(C, k=2)])
    assert seen == [(True, [False], {"k": 1}), (True, [True], {"k": 2})], (
        f"pe.custom_partial_eval_rules is not called as (trace, *tracers, **params) on "
        f"jax {V}: {seen}")
    staged = [e.params["k"] for e in jaxpr.eqns if e.primitive is prim]
    assert staged == [1], (
        f"JaxprTrace.default_process_primitive no longer stages unknowns only on jax {V}")


def test_jaxpr_trace_instantiate_const(monkeypatch):
    """lazyharvest assumes `trace.instantiate_const(t)` turns a known `JaxprTracer` into
    an unknown one, so the eqn is staged rather than evaluated (the rule
    keep_in_scan_loops registers)."""
    prim = _prim("lh_contract_instantiate")

    def make_rule(previous):
        def rule(trace, *tracers, **params):
            tracers = tuple(trace.instantiate_const(t) for t in tracers)
            assert not any(t.pval.is_known() for t in tracers)
            return previous(trace, *tracers, **params)
        return rule

    fn = lambda x: [x + prim.bind(C)]  # noqa: E731
    assert prim not in [e.primitive for e in _partial_eval(fn).eqns]
    monkeypatch.setitem(layer._pe.custom_partial_eval_rules, prim, None)
    monkeypatch.delitem(layer._pe.custom_partial_eval_rules, prim)
    layer.register_partial_eval_rule(prim, make_rule)
    assert prim in [e.primitive for e in _partial_eval(fn).eqns], (
        f"JaxprTrace.instantiate_const no longer stages a known value on jax {V}")


def test_linear_unknown_is_staged_and_transposed(monkeypatch):
    """lazyharvest assumes a partial-eval rule of a primitive without inputs may
    return `trace.new_const(x)` instantiated and read from a fresh reference
    (`linear_unknown`): staged, and treated as linear by the backward pass of
    the staged jaxpr (derivative_sites.given_zero_p)."""
    prim = layer_core.Primitive("lh_contract_zero")
    prim.def_impl(lambda: jnp.zeros((), "float32"))
    prim.def_abstract_eval(lambda: layer_core.ShapedArray((), jnp.float32))
    monkeypatch.setitem(layer._pe.custom_partial_eval_rules, prim,
                        lambda trace: layer.linear_unknown(trace, jnp.zeros((), "float32")))
    names = [e.primitive.name for e in _partial_eval(lambda x: [x * 2. + prim.bind()]).eqns]
    assert names[names.index("new_ref") + 1] == "freeze" and names[-1] != "freeze", (
        f"linear_unknown no longer stages a value read from a fresh reference on jax {V}: "
        f"{names}")


def test_pe_effect_handles_keep_unused_eqns(monkeypatch):
    """lazyharvest assumes an output of `trace.default_process_primitive` carries its
    `JaxprEqnRecipe` as `.recipe` (with `.in_tracers`), and appending
    `EffectHandle(in_tracers, recipe)` to `trace.effect_handles` keeps the eqn
    though nothing uses it (partial_eval.partial_eval_kept, partial_eval_keeping)."""
    prim = _prim("lh_contract_handles", multiple_results=True)
    fn = lambda x: [(prim.bind(x), x * 2.)[1]]  # noqa: E731
    assert prim not in [e.primitive for e in _partial_eval(fn).eqns]
    rules = layer._pe.custom_partial_eval_rules  # (a multiple-results primitive, as sow_p)
    monkeypatch.setitem(rules, prim, lambda trace, *ts, **ps: layer.partial_eval_kept(
        trace, prim, ts, ps))
    assert prim in [e.primitive for e in _partial_eval(fn).eqns], (
        f"pe.EffectHandle / JaxprTrace.effect_handles / JaxprEqnRecipe no longer keep an "
        f"unused eqn on jax {V}")

    def default(trace, *tracers, **params):
        return trace.default_process_primitive(prim, list(tracers), params)

    monkeypatch.setitem(rules, prim, layer.partial_eval_keeping(default, lambda ps: ps["k"]))
    fn = lambda x: [(prim.bind(x, k=True), prim.bind(x, k=False), x * 2.)[2]]  # noqa: E731
    assert [e.params["k"] for e in _partial_eval(fn).eqns if e.primitive is prim] == [True]


def test_cond_partial_eval_rule_calling_convention(monkeypatch):
    """lazyharvest assumes cond's rule in `pe.custom_partial_eval_rules` is called as
    `rule(trace, *tracers, branches=..., **params)` (predicate first, tracers with
    `.pval` and a ShapedArray `.aval`), and its unknown outputs share the recipe of
    the one eqn it stages (partial_eval.keep_effects_in_cond_partial_eval)."""
    rules = layer.pe.custom_partial_eval_rules
    installed = rules[layer_core.cond_p]  # (the package's wrappers around JAX's rule)
    seen = {}

    def spy(trace, *tracers, branches, **params):
        seen["in"] = [(t.pval.is_known(), isinstance(t.aval, layer._core.ShapedArray))
                      for t in tracers]
        seen["branches"] = branches
        outs = installed(trace, *tracers, branches=branches, **params)
        seen["recipes"] = [o.recipe for o in outs]
        seen["handles"] = trace.effect_handles
        return outs

    monkeypatch.setitem(rules, layer_core.cond_p, spy)
    pred = jnp.bool_(True)
    _partial_eval(lambda x: list(lax.cond(pred, lambda y: (jnp.sin(y), y * 2.),
                                          lambda y: (y, y), x)))
    assert seen, f"JAX's partial evaluation no longer calls cond's rule on jax {V}"
    assert seen["in"] == [(True, True), (False, True)], (
        f"cond's partial-eval rule gets other tracers on jax {V}: {seen['in']}")
    assert all(isinstance(b, layer_core.ClosedJaxpr) for b in seen["branches"])
    first, second = seen["recipes"]
    assert isinstance(first, layer._pe.JaxprEqnRecipe) and first is second, (
        f"cond's unknown outputs no longer share one JaxprEqnRecipe on jax {V}: "
        f"{seen['recipes']}")
    assert isinstance(first.effects, (set, frozenset)) and len(first.in_tracers) >= 1
    assert isinstance(seen["handles"], list)


def test_util_weakref_lru_cache():
    """lazyharvest assumes `util.weakref_lru_cache` memoizes on a weakly held first
    argument and the others (partial_eval._with_empty_output)."""
    calls = []

    @layer._util.weakref_lru_cache
    def f(jaxpr, k):
        calls.append(k)
        return object()

    closed = jax.make_jaxpr(jnp.sin)(1.)
    a, b, c = f(closed, 1), f(closed, 1), f(closed, 2)
    assert a is b and a is not c and calls == [1, 2], (
        f"util.weakref_lru_cache no longer memoizes on jax {V}: {calls}")
    branch = layer._with_empty_output(closed, 0)
    assert branch is layer._with_empty_output(closed, 0)
    assert [a.shape for a in branch.out_avals] == [(), (0,)]


# --- scan's loop-invariant hoisting ------------------------------------------------------

def _scan(x):
    return lax.scan(lambda h, a: (jnp.sin(h) * a + jnp.cos(C), h), x, XS)[0]


def _spy_hoisting(monkeypatch):
    loops = layer.internals()["jax._src.lax.control_flow.loops"]
    installed = loops._scan_known_hoisting
    assert getattr(installed, "_lazyharvest", False), (
        f"the package's hook is not loops._scan_known_hoisting on jax {V}")
    calls = []

    def spy(jaxpr_known, *args):
        out = installed(jaxpr_known, *args)
        calls.append((jaxpr_known, len(args), len(out)))
        return out

    monkeypatch.setattr(loops, "_scan_known_hoisting", spy)
    return calls


def _check_hoisting_calls(calls, path):
    assert calls, f"loops._scan_known_hoisting is no longer called by {path} on jax {V}"
    jaxpr_known, n_args, n_out = calls[0]
    assert isinstance(jaxpr_known, layer_core.ClosedJaxpr) and hasattr(jaxpr_known, "effects")
    assert n_args in (2, 3) and n_out == 4, (
        f"loops._scan_known_hoisting's signature changed on jax {V}: {n_args + 1} "
        f"arguments, {n_out} results")


@pytest.mark.usefixtures("default_staging")  # (lax.scan staging scan_p)
def test_scan_known_hoisting_is_called_by_scan_partial_eval(monkeypatch):
    """lazyharvest assumes JAX's partial evaluation of a scan (`_scan_partial_eval`)
    calls the module attribute `loops._scan_known_hoisting(jaxpr_known, consts,
    num_res[, num_sres])` (partial_eval.keep_in_scan_loops patches it)."""
    calls = _spy_hoisting(monkeypatch)
    _partial_eval(lambda x: [_scan(x)])
    _check_hoisting_calls(calls, "_scan_partial_eval")


def test_scan_known_hoisting_is_called_by_scan_linearize(monkeypatch):
    """lazyharvest assumes scan's linearization rule (`_scan_linearize`, under
    jax.linearize and jax.grad) calls the module attribute
    `loops._scan_known_hoisting` (partial_eval.keep_in_scan_loops patches it)."""
    calls = _spy_hoisting(monkeypatch)
    jax.linearize(_scan, 0.5)
    _check_hoisting_calls(calls, "_scan_linearize")


@pytest.mark.usefixtures("default_staging")
def test_scan_partial_eval_jaxpr_custom_rule_calling_convention(monkeypatch):
    """lazyharvest assumes jax.checkpoint's split of a scan calls
    `pe.partial_eval_jaxpr_custom_rules[scan_p](saveable, unks_in, inst_in, eqn)`
    and takes five values back (partial_eval.keep_in_scan_loops wraps it;
    differentiation.register_remat_rule)."""
    rules = layer.pe.partial_eval_jaxpr_custom_rules
    installed = rules[layer_core.scan_p]
    calls = []

    def spy(*args):
        out = installed(*args)
        calls.append((args, out))
        return out

    monkeypatch.setitem(rules, layer_core.scan_p, spy)
    g = jax.grad(jax.checkpoint(_scan))(0.5)
    assert abs(float(g) - float(jax.grad(_scan)(0.5))) < 1e-5
    assert calls, (
        f"jax.checkpoint no longer splits a scan through pe.partial_eval_jaxpr_custom_rules "
        f"on jax {V}")
    args, out = calls[0]
    assert len(args) == 4 and isinstance(args[3], layer_core.JaxprEqn), (
        f"partial_eval_jaxpr_custom_rules are called with {len(args)} arguments on jax {V}")
    assert len(out) == 5, f"partial_eval_jaxpr_custom_rules return {len(out)} values on jax {V}"


# --- high-level primitives -------------------------------------------------------------

def test_state_types_abstract_ref():
    """lazyharvest assumes `state.types.AbstractRef` is the aval type of a Ref
    (`jax.new_ref`) (partial_eval.ref_writing_hi_prims_kept)."""
    types = layer.internals()["jax._src.state.types"]
    seen = []
    jax.make_jaxpr(lambda x: seen.append(jax.typeof(jax.new_ref(x))) or x)(1.)
    assert isinstance(seen[0], types.AbstractRef), (
        f"state.types.AbstractRef is not a Ref's aval type on jax {V}: {type(seen[0])}")
    assert not isinstance(jax.typeof(1.), types.AbstractRef)


@pytest.mark.usefixtures("default_staging")  # (the flags as they were, after it)
def test_call_hi_primitive_dce_rule_keeps_ref_writers():
    """lazyharvest assumes JAX's DCE consults `pe.dce_rules[call_hi_primitive_p]` for a
    high-level primitive's eqn, so the package's rule keeps one writing a live
    Ref inside `ref_writing_hi_prims_kept` (partial_eval.keep_ref_writing_hi_prims)."""
    hi = layer_core.call_hi_primitive_p
    if hi is None or "jax_scan3" not in jax.config.values:
        pytest.skip(f"jax {V} stages no high-level scans")
    table = layer.pe.dce_rules
    rule = table[hi]
    assert getattr(rule, "_lazyharvest", False), (
        f"the package's DCE rule of call_hi_primitive is not installed on jax {V}")

    def f(r):
        def body(c, _):
            r[...] = r[...] + 1.
            return c, None
        lax.scan(body, 0., None, length=2)
        return []

    with jax_flag("jax_scan3"):
        jaxpr = jax.make_jaxpr(f)(jax.new_ref(jnp.float32(0.))).jaxpr
    assert hi in [e.primitive for e in jaxpr.eqns]
    calls = []

    def spy(*args):
        calls.append(len(args))
        return rule(*args)
    table[hi] = spy
    try:
        with layer.ref_writing_hi_prims_kept():
            dced, _ = layer.dce(jaxpr, [])
    finally:
        table[hi] = rule
    assert calls, f"JAX's DCE no longer consults pe.dce_rules[call_hi_primitive_p] on jax {V}"
    assert hi in [e.primitive for e in dced.eqns], (
        f"a Ref-writing call_hi_primitive eqn is dropped by DCE on jax {V}")


@pytest.mark.usefixtures("default_staging")
def test_checkpoint_partial_eval_makes_its_staged_eqn_with_new_eqn_recipe(monkeypatch):
    """lazyharvest assumes JAX's partial-eval rule for `jax.checkpoint` stages its
    unknown half with `pe.new_eqn_recipe`, looked up when it runs, and does not
    register it with the trace's effect handles: an unused half is dropped
    unless the layer registers it (`partial_eval_keeping_staged`, which
    records the recipes the rule makes)."""
    from lazyharvest import _jax
    assert layer._pe.new_eqn_recipe is layer._recording_new_eqn_recipe
    fn = lambda x: [(jax.checkpoint(jnp.sin)(x), x * 2.)[1]]  # noqa: E731
    remats = lambda j: [e for e in j.eqns if e.primitive is _jax.remat_p]  # noqa: E731
    assert not remats(_partial_eval(fn))
    rules = layer._pe.custom_partial_eval_rules
    monkeypatch.setitem(rules, _jax.remat_p,
                        layer.partial_eval_keeping_staged(rules[_jax.remat_p], lambda j: True))
    assert remats(_partial_eval(fn)), (
        f"jax.checkpoint's partial evaluation no longer makes its staged eqn with "
        f"pe.new_eqn_recipe, or effect handles no longer keep it, on jax {V}")


def test_process_call_keeps_a_call_holding_an_effect():
    """jax < 0.11 partially evaluates a call (`closed_call`) in
    `JaxprTrace.process_call` and stages its unknown half without registering
    it with the trace's effect handles, so a half with no used output is
    lost; lazyharvest wraps `process_call` to register it when its effects
    hold the site's (partial_eval.keep_effects_in_call_partial_eval, reading
    `JaxprEqnRecipe.primitive` and `.effects`). jax >= 0.11 has no
    `process_call`: calls are primitives with rules of their own."""
    import lazyharvest as lh
    from lazyharvest.primitive import harvesting

    original = getattr(layer._pe.JaxprTrace, "process_call", None)
    if versions.JAX_VERSION >= (0, 11):
        assert original is None, f"JaxprTrace.process_call is back on jax {V}"
        return
    assert getattr(original, "_lazyharvest", False), (
        f"lazyharvest's wrapper of JaxprTrace.process_call is not installed on jax {V}")

    def body(y):
        lh.sow(y * 2., tag="lh_contract", name="a")
        return []

    def fn(x):
        layer_core.closed_call(body, x)
        return [x * 3.]
    with harvesting("lh_contract"):
        kept = [e.primitive for e in _partial_eval(fn).eqns]
    assert layer_core.closed_call_p in kept, (
        f"a call holding a site, none of whose outputs is used, is dropped by "
        f"JaxprTrace.process_call on jax {V}")
