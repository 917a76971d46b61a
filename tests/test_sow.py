"""`sow` outside a harvest is free; inside one it survives every transform."""

import io
from contextlib import redirect_stdout

import jax
import jax.ad_checkpoint
import jax.numpy as jnp
import pytest
from jax import lax

import lazyharvest as lh
from helpers import close
from lazyharvest.primitive import harvesting, sow_p

sow = lh.sow


def f(x):
    return jnp.sum(sow(jnp.sin(x), tag="t", name="s") * 2)


def sows_in(jaxpr, found=None):
    found = [] if found is None else found
    for e in jaxpr.eqns:
        if e.primitive is sow_p:
            found.append(e)
        for v in e.params.values():
            for j in (v if isinstance(v, (tuple, list)) else (v,)):
                inner = getattr(j, "jaxpr", j)
                if hasattr(inner, "eqns"):
                    sows_in(inner, found)
    return found


def test_identity_in_eager_mode_binds_nothing():
    x = jnp.arange(3.)
    assert sow(x, tag="t", name="a") is x
    tree = {"a": x, "b": (x, 2.)}
    assert sow(tree, tag="t", name="a") is tree
    arrays = {"a": x, "b": [x, x]}
    assert sow(arrays, tag="t", name="a") is arrays


def test_eager_sows_of_containers_still_check_their_arguments():
    x = jnp.arange(3.)
    with pytest.raises(lh.HarvestError, match="the name must be a string"):
        sow({"a": x}, tag="t", name=3)
    with pytest.raises(lh.HarvestError, match="unknown mode"):
        sow([x, x], tag="t", name="a", mode="last")
    with pytest.raises(lh.HarvestError, match="Sow arrays or"):
        sow({"a": x, "b": "text"}, tag="t", name="a")


def test_outside_harvest_jit_has_no_effects_and_no_hlo():
    x = jnp.arange(3.)
    jaxpr = jax.make_jaxpr(jax.jit(f))(x)
    inner = jaxpr.eqns[0].params["jaxpr"]
    assert not inner.effects
    assert all(not e.params["effect"] for e in sows_in(inner.jaxpr))
    hlo_with = jax.jit(f).lower(x).as_text()
    hlo_without = jax.jit(lambda x: jnp.sum(jnp.sin(x) * 2)).lower(x).as_text()
    count = lambda t: sum(1 for line in t.splitlines() if "stablehlo." in line)
    assert count(hlo_with) == count(hlo_without)


def test_harvest_makes_sites_effectful_and_jit_retraces():
    traces = {"n": 0}

    @jax.jit
    def g(x):
        traces["n"] += 1
        return sow(x * 2, tag="t", name="a")
    g(1.)
    with harvesting("t"):
        eqns = sows_in(jax.make_jaxpr(g)(1.).jaxpr)
    assert [e.params["effect"] for e in eqns] == [True]
    g(1.)
    assert traces["n"] == 2  # once without, once with the harvest


SITE_TRANSFORMS = {
    "jit": lambda h: jax.jit(h),
    "vmap": lambda h: jax.vmap(h),
    "grad": lambda h: jax.grad(lambda x: jnp.sum(h(x))),
    "jvp": lambda h: (lambda x: jax.jvp(h, (x,), (jnp.ones_like(x),))),
    "linearize": lambda h: (lambda x: jax.linearize(h, x)[1](jnp.ones_like(x))),
    "jacfwd": lambda h: jax.jacfwd(h),
    "jacrev": lambda h: jax.jacrev(h),
    "hessian": lambda h: jax.hessian(lambda x: jnp.sum(h(x))),
    "grad_jit": lambda h: jax.grad(lambda x: jnp.sum(jax.jit(h)(x))),
    "grad_checkpoint": lambda h: jax.grad(lambda x: jnp.sum(jax.checkpoint(h)(x))),
    "grad_scan": lambda h: jax.grad(lambda x: lax.scan(
        lambda c, v: (c + jnp.sum(h(v)), None), 0., x[None])[0]),
    "grad_cond": lambda h: jax.grad(lambda x: lax.cond(
        True, lambda v: jnp.sum(h(v)), lambda v: jnp.sum(h(v) * 2), x)),
}


def test_unused_site_survives_every_transform():
    def h(x):
        sow(jnp.cos(x), tag="t", name="unused", mode="clobber")
        return jnp.sin(x)
    x = jnp.array([0.1, 0.2])
    for name, transform in SITE_TRANSFORMS.items():
        d = lh.reap(transform(h), tag="t")(x)
        assert "unused" in d or any(
            isinstance(k, tuple) and k[-1] == "unused" for k in d), name
        values = [v for k, v in d.compute().items()]
        assert values, name


def test_site_inside_checkpoint_adds_no_residual():
    def g(x):
        return jnp.sum(jax.checkpoint(
            lambda y: jnp.sin(sow(jnp.sin(y), tag="t", name="a")))(x))

    def g0(x):
        return jnp.sum(jax.checkpoint(lambda y: jnp.sin(jnp.sin(y)))(x))

    def residuals(fn):
        buf = io.StringIO()
        with redirect_stdout(buf):
            jax.ad_checkpoint.print_saved_residuals(fn, jnp.ones(3))
        return buf.getvalue()
    with harvesting("t"):
        with_site = residuals(g)
    assert with_site == residuals(g0)
    assert "sow" not in with_site
    # and the site is still reaped once, with its cotangent
    d = lh.reap(jax.grad(g), tag="t")(jnp.ones(3))
    close(d["a"], jnp.sin(jnp.ones(3)))
    close(d["vjp", "a"], jnp.cos(jnp.sin(jnp.ones(3))))


def test_plain_vmap_puts_batch_axis_first():
    def h(x):
        return sow(x * 2, tag="t", name="a").sum()
    d = lh.reap(jax.vmap(h, in_axes=1), tag="t")(jnp.ones((3, 5)))
    assert d["a"].shape == (5, 3)
