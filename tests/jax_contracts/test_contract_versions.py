"""Contracts of `lazyharvest/_jax/versions.py`: each feature probe agrees with
what the running JAX actually does (docs/compat.md).

A probe reads a signature or an attribute; these tests check the behaviour
behind it, so a JAX release that keeps the signature but changes the
behaviour (or the reverse) fails the test naming the probe."""

import inspect

import jax
import jax.numpy as jnp
import pytest
from jax import lax

from lazyharvest._jax import core as layer_core
from lazyharvest._jax import versions

V = jax.__version__


@jax.custom_jvp
def _cjvp(x):
    return jnp.sin(x)


_cjvp.defjvp(lambda p, t: (_cjvp(p[0]), 3. * t[0]))


@jax.custom_vjp
def _cvjp(x):
    return jnp.sin(x)


_cvjp.defvjp(lambda x: (_cvjp(x), x), lambda r, g: (5. * g * r,))


def _only_eqn(fn, *args):
    (eqn,) = jax.make_jaxpr(fn)(*args).jaxpr.eqns
    return eqn


@pytest.mark.usefixtures("default_staging")
def test_bind_params_split_matches_get_bind_params():
    """lazyharvest assumes `Primitive.get_bind_params` returns `(subfuns, params)`
    exactly where `versions.BIND_PARAMS_SPLIT` is set, and otherwise a dict with
    a call's functions under "subfuns" (core.get_bind_params relies on it)."""
    plain = versions.Primitive("lh_contract_probe").get_bind_params({"a": 1})
    eqn = _only_eqn(_cjvp, 1.)
    assert eqn.primitive is layer_core.custom_jvp_call_p
    raw = eqn.primitive.get_bind_params(eqn.params)
    if versions.BIND_PARAMS_SPLIT:
        assert isinstance(plain, tuple) and list(plain[0]) == [] and plain[1] == {"a": 1}, (
            f"Primitive.get_bind_params no longer returns (subfuns, params) on jax {V}: {plain}")
        subfuns, params = raw
        assert len(subfuns) == 2 and "subfuns" not in params, (
            f"custom_jvp_call's get_bind_params changed form on jax {V}: {raw}")
    else:
        assert plain == {"a": 1}, (
            f"Primitive.get_bind_params no longer returns the params dict on jax {V}: {plain}")
        assert isinstance(raw, dict) and len(raw["subfuns"]) == 2, (
            f"custom_jvp_call's get_bind_params has no 'subfuns' on jax {V}: {raw}")


def test_bind_takes_avals_matches_bind_with_trace_calls():
    """lazyharvest assumes `Primitive.bind` calls `prim.bind_with_trace(trace, args,
    avals, params)` (four arguments) exactly where `versions.BIND_TAKES_AVALS` is
    set, else `(trace, args, params)` (differentiation.register_bind_hook relies on it)."""
    prim = versions.Primitive("lh_contract_bind_probe")
    prim.def_impl(lambda x: x + 1.)
    prim.def_abstract_eval(lambda x: x)
    seen = []
    default = type(prim).bind_with_trace

    def spy(*args):
        seen.append(args)
        return default(prim, *args)

    prim.def_bind_with_trace(spy)
    x = jnp.float32(2.)
    assert prim.bind(x) == 3.
    assert jax.make_jaxpr(prim.bind)(x).jaxpr.eqns[0].primitive is prim
    assert len(seen) == 2, f"Primitive.bind no longer calls bind_with_trace on jax {V}"
    arity = {len(a) for a in seen}
    assert arity == ({4} if versions.BIND_TAKES_AVALS else {3}), (
        f"Primitive.bind calls bind_with_trace with {arity} arguments on jax {V}; "
        f"BIND_TAKES_AVALS={versions.BIND_TAKES_AVALS}")
    if versions.BIND_TAKES_AVALS:
        assert list(seen[0][2]) == [jax.typeof(x)], (
            f"bind_with_trace's avals are not the arguments' types on jax {V}: {seen[0][2]}")


@pytest.mark.usefixtures("default_staging")
def test_custom_call_hooks_matches_custom_jvp_bind():
    """lazyharvest assumes a `custom_jvp` call reaches `custom_jvp_call_p.bind_with_trace`
    with its functions in `params["subfuns"]` exactly where `versions.CUSTOM_CALL_HOOKS`
    is set (else as leading arguments), so a bind hook can replace them
    (_interpreter/custom.py through differentiation.replace_subfuns)."""
    prim = layer_core.custom_jvp_call_p
    default = type(prim).bind_with_trace
    seen = []

    def spy(trace, args, *rest):
        seen.append((args, rest[-1]))
        return default(prim, trace, args, *rest)

    # (not monkeypatch: its undo would leave an instance attribute, which is
    # how lazyharvest's hooks are told in force: test_import_changes_nothing)
    assert "bind_with_trace" not in vars(prim)
    prim.bind_with_trace = spy
    try:
        assert abs(float(_cjvp(1.)) - float(jnp.sin(1.))) < 1e-6
    finally:
        del prim.bind_with_trace
    assert seen, f"a custom_jvp call no longer binds custom_jvp_call_p on jax {V}"
    args, params = seen[0]
    if versions.CUSTOM_CALL_HOOKS:
        assert len(params.get("subfuns", ())) == 2 and len(args) == 1, (
            f"custom_jvp_call's bind has no params['subfuns'] (fun, jvp) on jax {V}: "
            f"{sorted(params)}")
    else:
        assert "subfuns" not in params and len(args) == 3, (
            f"custom_jvp_call's bind passes its functions in params on jax {V}, but "
            f"CUSTOM_CALL_HOOKS is False")
    hooks = versions.BIND_TAKES_AVALS and not versions.BIND_PARAMS_SPLIT
    assert hooks == versions.CUSTOM_CALL_HOOKS


@pytest.mark.usefixtures("default_staging")
def test_bwd_returns_logs_matches_custom_vjp_bwd():
    """lazyharvest assumes a custom_vjp call's wrapped backward function (its third
    subfun) returns `(cotangents, logs)` exactly where `versions.BWD_RETURNS_LOGS` is
    set, else the cotangents (differentiation.call_bwd relies on it)."""
    eqn = _only_eqn(_cvjp, 1.)
    assert eqn.primitive is layer_core.custom_vjp_call_p
    fun, fwd, bwd = layer_core.bind_params(eqn)["subfuns"]
    # the forward rule fills the trees the backward function reads
    layer_core.trace_flat(lambda x: list(fwd.call_wrapped(x, True)), [jax.typeof(1.)])
    out = bwd.call_wrapped(jnp.float32(2.), jnp.float32(1.))
    if versions.BWD_RETURNS_LOGS:
        assert isinstance(out, tuple) and len(out) == 2 and list(out[0]) == [10.], (
            f"custom_vjp's wrapped bwd no longer returns (cotangents, logs) on jax {V}: {out}")
    else:
        assert list(out) == [10.], (
            f"custom_vjp's wrapped bwd no longer returns the cotangents on jax {V}: {out}")


def test_linearize_structured_matches_scan_linearization(monkeypatch):
    """lazyharvest assumes JAX's linearization rules return five values (structured
    residuals fourth) exactly where `versions.LINEARIZE_STRUCTURED` is set, else
    four (differentiation.register_linearization/wrap_linearization rely on it)."""
    table = versions._ad.primitive_linearizations
    original = table[layer_core.scan_p]
    sizes = []

    def spy(*args, **params):
        out = original(*args, **params)
        sizes.append(len(out))
        return out

    monkeypatch.setitem(table, layer_core.scan_p, spy)
    f = lambda x: lax.scan(lambda c, a: (jnp.sin(c) * a, None), x, jnp.arange(2.))[0]  # noqa: E731
    _, f_lin = jax.linearize(f, 0.5)
    f_lin(1.)
    assert sizes, f"jax.linearize no longer consults ad.primitive_linearizations on jax {V}"
    assert set(sizes) == ({5} if versions.LINEARIZE_STRUCTURED else {4}), (
        f"scan's linearization rule returns {sizes} values on jax {V}; "
        f"LINEARIZE_STRUCTURED={versions.LINEARIZE_STRUCTURED}")


def test_pe_default_dce_rule_arity():
    """lazyharvest assumes `partial_eval._default_dce_rule` takes `(used_outputs,
    live_inputs, eqn)` exactly where `versions.DCE_LIVE_INPUTS` is set, else
    `(used_outputs, eqn)` (partial_eval.default_dce_rule and every DCE rule the
    package registers rely on it)."""
    params = list(inspect.signature(versions._pe._default_dce_rule).parameters)
    expected = 3 if versions.DCE_LIVE_INPUTS else 2
    assert len(params) == expected, (
        f"jax._src.interpreters.partial_eval._default_dce_rule takes {params} on jax {V}; "
        f"DCE_LIVE_INPUTS={versions.DCE_LIVE_INPUTS} expects {expected} parameters")


def test_merged_jaxpr_matches_make_jaxpr():
    """lazyharvest assumes `ClosedJaxpr is Jaxpr` (`versions.MERGED_JAXPR`) exactly
    where a traced jaxpr carries its consts itself and `ClosedJaxpr(jaxpr, ())`
    turns them into leading invars (core._open, _interpreter/calls.py rely on it)."""
    c = jnp.array([1., 2.])
    closed = jax.make_jaxpr(lambda x: x + c)(1.)
    assert len(closed.consts) == 1 and len(closed.jaxpr.constvars) == 1
    assert isinstance(closed, versions.ClosedJaxpr)
    if versions.MERGED_JAXPR:
        assert isinstance(closed, versions.Jaxpr) and closed.jaxpr is closed, (
            f"ClosedJaxpr and Jaxpr are one type on jax {V}, but make_jaxpr's result "
            f"is not its own jaxpr")
        reopened = versions.ClosedJaxpr(closed.jaxpr, ())
        assert len(reopened.in_avals) == 2 and not reopened.constvars, (
            f"ClosedJaxpr(jaxpr, ()) no longer makes the consts leading invars on jax {V}")
    else:
        assert not isinstance(closed, versions.Jaxpr) and closed.jaxpr is not closed, (
            f"make_jaxpr returns a Jaxpr on jax {V}, but MERGED_JAXPR is False")
        assert closed.in_avals == [jax.typeof(1.)]


def test_derivative_sites_matches_linearize_trace_is_vjp(monkeypatch):
    """lazyharvest enables derivative sites (`versions.DERIVATIVE_SITES`) exactly
    where linearization rules are told `is_vjp` first and bind hooks get avals
    (lazyharvest/__init__.py imports derivative_sites on it)."""
    table = versions._ad.primitive_linearizations
    original = table[layer_core.scan_p]
    firsts = []

    def spy(*args, **params):
        firsts.append(args[0])
        return original(*args, **params)

    monkeypatch.setitem(table, layer_core.scan_p, spy)
    f = lambda x: lax.scan(lambda c, a: (jnp.sin(c) * a, None), x, jnp.arange(2.))[0]  # noqa: E731
    jax.linearize(f, 0.5)
    jax.grad(f)(0.5)
    told_is_vjp = firsts == [False, True]
    assert firsts and (told_is_vjp or all(isinstance(a, list) for a in firsts)), (
        f"linearization rules get {firsts} first on jax {V}")
    enabled = told_is_vjp and versions.BIND_TAKES_AVALS
    assert enabled == versions.DERIVATIVE_SITES, (
        f"DERIVATIVE_SITES={versions.DERIVATIVE_SITES} on jax {V}, but rules told "
        f"is_vjp: {told_is_vjp}, BIND_TAKES_AVALS: {versions.BIND_TAKES_AVALS}")
