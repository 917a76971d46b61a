"""JAX's opt-in next implementations (jax >= 0.12: `jax_scan3`, `jax_remat3`,
`jax_custom_vjp3`, `jax_custom_jvp3`) stage their constructs as high-level
primitives. Sites inside one are not harvested yet: the harvest raises a
`HarvestError` naming the flag instead of leaving them unreaped, and sites
outside the construct are still reaped (docs/compat.md)."""

import jax
import jax.numpy as jnp
import pytest
from jax import lax

import lazyharvest as lh
from helpers import close
from lazyharvest import _jax

FLAGS = ("jax_scan3", "jax_remat3", "jax_custom_vjp3", "jax_custom_jvp3")

pytestmark = pytest.mark.skipif(
    not set(FLAGS) <= set(_jax.HI_PRIM_FLAGS.values()),
    reason=f"jax {jax.__version__} has no jax_*3 implementations")


@pytest.fixture
def flag(request):
    name = request.param
    jax.config.update(name, True)
    try:
        yield name
    finally:
        jax.config.update(name, False)


def _sow(x, name):
    return lh.sow(x, tag="t", name=name)


@jax.custom_jvp
def _cjvp(x):
    return jnp.sin(_sow(x, "inside"))


_cjvp.defjvp(lambda p, t: (_cjvp(p[0]), jnp.cos(p[0]) * t[0]))


@jax.custom_vjp
def _cvjp(x):
    return jnp.sin(_sow(x, "inside"))


_cvjp.defvjp(lambda x: (_cvjp(x), x), lambda r, g: (jnp.cos(r) * g,))


def _scan(x):
    return lax.scan(lambda c, _: (jnp.sin(_sow(c, "inside")), None), x, None, length=2)[0]


CONSTRUCT = {"jax_scan3": _scan, "jax_remat3": jax.checkpoint(lambda x: jnp.sin(_sow(x, "inside"))),
             "jax_custom_vjp3": _cvjp, "jax_custom_jvp3": _cjvp}


def _program(flag_name):
    inner = CONSTRUCT[flag_name]
    return lambda x: inner(_sow(x * 2, "outside")) + 1


@pytest.mark.parametrize("flag", FLAGS, indirect=True)
def test_a_site_inside_the_construct_raises_naming_the_flag(flag):
    f = _program(flag)
    for g in (f, jax.jit(f)) + _differentiated(f, flag):
        with pytest.raises(lh.HarvestError, match=flag):
            lh.reap(g, tag="t")(0.3)["outside"]
    with pytest.raises(lh.HarvestError, match=flag):
        lh.plant(f, tag="t")({"inside": 1.0}, 0.3)


@pytest.mark.parametrize("flag", FLAGS, indirect=True)
def test_sites_outside_the_construct_are_reaped_under_the_flag(flag):
    construct = _no_site(flag)
    eqns = jax.make_jaxpr(construct)(0.3).eqns
    assert _jax.call_hi_primitive_p in [e.primitive for e in eqns], eqns

    def f(x):
        return jnp.cos(_sow(construct(_sow(x * 2, "before")), "after"))
    y = _no_site_plain(flag)(0.6)
    d = lh.reap(f, tag="t")(0.3)
    close(d["before"], 0.6)
    close(d["after"], y)
    close(lh.plant(f, tag="t")({"after": 2.0}, 0.3), jnp.cos(2.0))
    for grad_f in _differentiated(f, flag):
        g = lh.reap(grad_f, tag="t")(0.3)
        close(g["vjp", "after"], -jnp.sin(y))
        close(g["vjp", "before"], jax.grad(lambda v: jnp.cos(_no_site_plain(flag)(v)))(0.6))


def _differentiated(f, flag_name):
    """`(jax.grad(f),)`, or none where JAX 0.12 itself cannot differentiate
    the construct (Scan3 has no reverse-mode rule there)."""
    return () if flag_name == "jax_scan3" else (jax.grad(f),)


def _no_site_plain(flag_name):
    """What `_no_site(flag_name)` computes, written with plain JAX."""
    if flag_name == "jax_scan3":
        return lambda x: jnp.sin(jnp.sin(x))
    return jnp.sin


def _no_site(flag_name):
    """The construct of `flag_name` around `sin`, without sites."""
    if flag_name == "jax_scan3":
        return lambda x: lax.scan(lambda c, _: (jnp.sin(c), None), x, None, length=2)[0]
    if flag_name == "jax_remat3":
        return jax.checkpoint(jnp.sin)
    custom = jax.custom_jvp(jnp.sin) if flag_name == "jax_custom_jvp3" else jax.custom_vjp(jnp.sin)
    if flag_name == "jax_custom_jvp3":
        custom.defjvp(lambda p, t: (jnp.sin(p[0]), jnp.cos(p[0]) * t[0]))
    else:
        custom.defvjp(lambda x: (jnp.sin(x), x), lambda r, g: (jnp.cos(r) * g,))
    return custom
