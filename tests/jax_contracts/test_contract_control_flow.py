"""Contracts of `lazyharvest/_jax/control_flow.py`: the params of scan eqns
the package rewrites, and cond's vmap rule (docs/compat.md)."""

import jax
import jax.numpy as jnp
import pytest
from jax import lax

from helpers import close, jax_flag
from lazyharvest._jax import control_flow as layer
from lazyharvest._jax import core as layer_core

V = jax.__version__
C = jnp.float32(3.)
XS = jnp.arange(1., 3.)


def _body(h, a):
    return h * a + C, h


def _scan_eqn():
    """A scan of one const (C), one carry and one xs, and its eqn."""
    f = lambda h: lax.scan(_body, h, XS)  # noqa: E731
    (eqn,) = [e for e in jax.make_jaxpr(f)(1.).jaxpr.eqns if e.primitive is layer_core.scan_p]
    return f, eqn


@pytest.mark.usefixtures("default_staging")
def test_scan_p_params_count_consts_and_carries():
    """lazyharvest assumes a scan eqn's operands are (consts, carries, xs), counted by
    params `num_consts`/`num_carry` (jax < 0.11, with a per-input `linear`) or by
    the flat tree `ft_in` (jax >= 0.11, with `ft_out`), its body in `jaxpr`
    (control_flow.scan_counts, scan_params)."""
    _, eqn = _scan_eqn()
    p = eqn.params
    assert isinstance(p["jaxpr"], layer_core.ClosedJaxpr) and len(p["jaxpr"].in_avals) == 3
    assert len(eqn.invars) == 3 and len(eqn.outvars) == 2
    if "num_consts" in p:
        assert (p["num_consts"], p["num_carry"]) == (1, 1), (
            f"scan's num_consts/num_carry changed on jax {V}: {p}")
        assert len(p.get("linear", (False,) * 3)) == 3
        assert "ft_in" not in p
    else:
        assert "ft_in" in p and "ft_out" in p, (
            f"scan eqns have neither num_consts nor ft_in on jax {V}: {sorted(p)}")
        consts, carry, xs = p["ft_in"].unpack()
        assert (len(consts), len(carry), len(xs)) == (1, 1, 1), (
            f"scan's ft_in.unpack() is no longer (consts, carry, xs) on jax {V}")
        carry_out, ys = p["ft_out"].unpack()
        assert (len(carry_out), len(ys)) == (1, 1)
    assert layer.scan_counts(p) == (1, 1)


@pytest.mark.usefixtures("default_staging")
def test_flattree_pack_nones():
    """lazyharvest assumes `flattree.pack(tuple of flattree.nones(n))` builds the
    `ft_in`/`ft_out` a flat scan has, where scans have them (jax >= 0.11;
    control_flow.scan_params)."""
    _, eqn = _scan_eqn()
    has_ft = "ft_in" in eqn.params
    ft = layer.internals().get("jax._src.flattree")
    assert (ft is not None) == has_ft, (
        f"jax._src.flattree {'is missing' if ft is None else 'exists'} on jax {V}, "
        f"but scan eqns {'have' if has_ft else 'lack'} ft_in")
    if ft is None:
        assert "num_consts" in eqn.params
        return
    rebuilt = layer.scan_params(eqn.params, eqn.params["jaxpr"], 1, 1)
    for k, counts in (("ft_in", [1, 1, 1]), ("ft_out", [1, 1])):
        # (JAX's own ft_out keeps the ys' pytree; only the grouping matters)
        assert type(rebuilt[k]) is type(eqn.params[k]), (
            f"flattree.pack no longer builds scan's {k} type on jax {V}")
        assert [len(g) for g in rebuilt[k].unpack()] == counts, (
            f"flattree.pack/nones no longer group scan's {k} on jax {V}: {rebuilt[k]}")
    assert rebuilt["ft_in"] == eqn.params["ft_in"]
    assert [len(g) for g in ft.pack((ft.nones(2), ft.nones(0))).unpack()] == [2, 0]


@pytest.mark.usefixtures("default_staging")
def test_scan_p_binds_with_rebuilt_params():
    """lazyharvest assumes a scan eqn re-bound with `scan_params(params, body, n_consts,
    n_carry)` for a body with other counts computes that body's scan (the
    interpreter's scan rule, partial_eval._keeping_inputs)."""
    f, eqn = _scan_eqn()

    def body2(h, c, a):  # the const as a second carry, passed through
        return [h * a + c, c, h]

    avals = [jax.typeof(jnp.float32(1.))] * 3
    jaxpr, consts = layer_core.trace_flat(body2, avals)
    params = layer.scan_params(eqn.params, layer_core.ClosedJaxpr(jaxpr, consts), 0, 2)
    assert layer.scan_counts(params) == (0, 2)
    with jax.enable_checks(True):
        outs = layer_core.bind_eqn(eqn, [jnp.float32(1.), C, XS], params)
        staged = jax.make_jaxpr(lambda h: layer_core.bind_eqn(eqn, [h, C, XS], params))(1.)
    h, ys = f(1.)
    close(outs, [h, C, ys])
    assert [e.primitive for e in staged.jaxpr.eqns] == [layer_core.scan_p], (
        f"a scan re-bound with scan_params no longer stages one scan on jax {V}")


def _replaced(jaxpr, eqn, new_eqn):
    """The function `jaxpr` computes, `eqn` bound as `new_eqn`."""
    def run(*args):
        env = {}

        def read(v):
            return v.val if isinstance(v, layer_core.Literal) else env[v]
        env.update(zip(jaxpr.jaxpr.constvars, jaxpr.consts))
        env.update(zip(jaxpr.jaxpr.invars, args))
        for e in jaxpr.jaxpr.eqns:
            if e is eqn:
                e = new_eqn
            outs = layer_core.bind_eqn(e, [read(v) for v in e.invars])
            outs = outs if e.primitive.multiple_results else [outs]
            env.update(zip(e.outvars, outs))
        return [read(v) for v in jaxpr.jaxpr.outvars]
    return run


@pytest.mark.skipif(layer.SCAN3 is None, reason=f"jax {V} has no Scan3")
@pytest.mark.usefixtures("default_staging")  # (the flags as they were, after it)
@pytest.mark.parametrize("reverse", [False, True])
def test_scan3_stands_for_the_scan_as_ordinary_eqn_builds(reverse):
    """lazyharvest assumes that with `jax_scan3` on `lax.scan` stages a
    `call_hi_primitive` eqn whose `_prim` is a `Scan3` with `extensives`,
    `length`, `jaxpr` (no carry: the carry is a Ref input the body reads
    and writes), `reverse` and `unroll`, and that the scan `as_ordinary_eqn`
    builds from it (non-extensive inputs as consts, extensive ones as xs)
    computes what `lax.scan` does with the flag off (_interpreter/calls.py)."""
    f = lambda h: lax.scan(_body, h, XS, reverse=reverse)  # noqa: E731
    want = f(jnp.float32(1.))  # the flag off
    with jax_flag("jax_scan3"):
        jaxpr = jax.make_jaxpr(f)(1.)
    (eqn,) = [e for e in jaxpr.eqns if isinstance(e.params.get("_prim"), layer.SCAN3)]
    prim = eqn.params["_prim"]
    # (inputs: the body's const C and the carry's Ref, then the xs)
    assert (prim.length, prim.reverse, list(prim.extensives)) == (
        2, reverse, [False, False, True]), f"Scan3's params changed on jax {V}"
    scan_eqn, order = layer.as_ordinary_eqn(eqn)
    assert scan_eqn.primitive is layer_core.scan_p and layer.scan_counts(scan_eqn.params) == (2, 0)
    close(jax.jit(_replaced(jaxpr, eqn, scan_eqn))(jnp.float32(1.)),
          list(jax.tree.leaves(want)))
    assert [eqn.invars[i] for i in order] == scan_eqn.invars


@pytest.mark.skipif(layer.REMAT_TRACED is None, reason=f"jax {V} has no RematTraced")
@pytest.mark.usefixtures("default_staging")
@pytest.mark.parametrize("prevent_cse", [True, False])
def test_remat_traced_stands_for_the_remat2_as_ordinary_eqn_builds(prevent_cse):
    """lazyharvest assumes that with `jax_remat3` on `jax.checkpoint` stages a
    `call_hi_primitive` eqn whose `_prim` is a `RematTraced` whose `params`
    hold `jaxpr` (a jaxpr without consts: `jax.checkpoint` passes what its
    function closes over as inputs), `policy` and (jax >= 0.11)
    `prevent_cse`, and that the `remat2` eqn `as_ordinary_eqn` builds from
    it computes, and differentiates, as `jax.checkpoint` does with the flag
    off, policy kept (_interpreter/calls.py)."""
    policy = jax.checkpoint_policies.dots_saveable

    def make():  # (jax 0.10 picks the implementation when the function is made)
        return jax.checkpoint(lambda x, w: jnp.sin(C * x) @ w, policy=policy,
                              prevent_cse=prevent_cse)
    f = make()
    x, w = jnp.ones(2), jnp.ones((2, 2))
    want = f(x, w), jax.grad(lambda x: f(x, w).sum())(x)  # the flag off
    with jax_flag("jax_remat3"):
        jaxpr = jax.make_jaxpr(make())(x, w)
    (eqn,) = [e for e in jaxpr.eqns if isinstance(e.params.get("_prim"), layer.REMAT_TRACED)]
    remat_eqn, order = layer.as_ordinary_eqn(eqn)
    assert remat_eqn.primitive is layer_core.remat_p and order == [0, 1, 2]
    assert remat_eqn.params["policy"] is policy, f"RematTraced's policy changed on jax {V}"
    run = _replaced(jaxpr, eqn, remat_eqn)
    close(run(x, w)[0], want[0])
    close(jax.grad(lambda x: run(x, w)[0].sum())(x), want[1])
    staged = jax.make_jaxpr(jax.grad(lambda x: run(x, w)[0].sum()))(x)
    assert any(e.primitive is layer_core.remat_p for e in staged.jaxpr.eqns)


def test_cond_fancy_batcher_signature(monkeypatch):
    """lazyharvest assumes vmap of `lax.cond` calls `batching.fancy_primitive_batchers[
    conditionals.cond_p](axis_data, args, dims, branches=..., **params)` and takes
    `(outs, out_dims)` back, with `dims[0]` None for an unbatched predicate
    (control_flow.wrap_cond_batcher; primitive.py's cond rule)."""
    mods = layer.internals()
    cond_p = mods["jax._src.lax.control_flow.conditionals"].cond_p
    assert cond_p is layer_core.cond_p
    batchers = mods["jax._src.interpreters.batching"].fancy_primitive_batchers
    installed = batchers[cond_p]
    assert getattr(installed, "_lazyharvest", False), (
        f"the package's cond batcher is not in batching.fancy_primitive_batchers on jax {V}")
    seen = []

    def spy(axis_data, args, dims, *, branches, **params):
        seen.append((dims, branches))
        outs, out_dims = installed(axis_data, args, dims, branches=branches, **params)
        return outs, out_dims

    monkeypatch.setitem(batchers, cond_p, spy)
    f = lambda p, x: lax.cond(p, jnp.sin, jnp.cos, x)  # noqa: E731
    close(jax.vmap(f)(jnp.array([True, False]), jnp.ones(2)), [jnp.sin(1.), jnp.cos(1.)])
    close(jax.vmap(f, in_axes=(None, 0))(True, jnp.ones(2)), jnp.sin(jnp.ones(2)))
    assert len(seen) == 2, (
        f"vmap of lax.cond no longer calls batching.fancy_primitive_batchers[cond_p] on "
        f"jax {V}")
    (dims0, branches0), (dims1, _) = seen
    assert dims0[0] == 0 and dims1[0] is None, f"cond batcher dims changed on jax {V}: {seen}"
    assert len(branches0) == 2 and all(isinstance(b, layer_core.ClosedJaxpr) for b in branches0)
