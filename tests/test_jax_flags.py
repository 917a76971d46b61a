"""JAX's opt-in next implementations (`jax_scan3`, `jax_remat3`,
`jax_custom_vjp3`, `jax_custom_jvp3`: all four from jax 0.11, three in 0.10)
stage their constructs as high-level primitives. Sites inside one are not
harvested yet: the harvest raises a `HarvestError` naming the flag instead of
leaving them unreaped, and sites outside the construct are still reaped
(docs/compat.md)."""

import jax
import jax.numpy as jnp
import pytest
from jax import lax

import lazyharvest as lh
from helpers import close
from lazyharvest import _jax
from lazyharvest._interpreter import sub_jaxprs

FLAGS = ("jax_scan3", "jax_remat3", "jax_custom_vjp3", "jax_custom_jvp3")

# each flag where this JAX has it and stages a high-level primitive for it
FLAG_PARAMS = [pytest.param(f, marks=pytest.mark.skipif(
    f not in _jax.HI_PRIM_FLAGS.values(), reason=f"jax {jax.__version__} has no {f}"))
    for f in FLAGS]


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


def _construct(flag_name):
    """The construct `flag_name` changes, around a site. Made after the flag is
    set: some JAX versions choose the implementation when it is made."""
    if flag_name == "jax_scan3":
        return lambda x: lax.scan(lambda c, _: (jnp.sin(_sow(c, "inside")), None), x, None,
                                  length=2)[0]
    if flag_name == "jax_remat3":
        return jax.checkpoint(lambda x: jnp.sin(_sow(x, "inside")))
    if flag_name == "jax_custom_jvp3":
        cjvp = jax.custom_jvp(lambda x: jnp.sin(_sow(x, "inside")))
        cjvp.defjvp(lambda p, t: (cjvp(p[0]), jnp.cos(p[0]) * t[0]))
        return cjvp
    cvjp = jax.custom_vjp(lambda x: jnp.sin(_sow(x, "inside")))
    cvjp.defvjp(lambda x: (cvjp(x), x), lambda r, g: (jnp.cos(r) * g,))
    return cvjp


def _program(flag_name):
    inner = _construct(flag_name)
    return lambda x: inner(_sow(x * 2, "outside")) + 1


@pytest.mark.parametrize("flag", FLAG_PARAMS, indirect=True)
def test_a_site_inside_the_construct_raises_naming_the_flag(flag):
    f = _program(flag)
    eqns = jax.make_jaxpr(f)(0.3).eqns
    assert _jax.call_hi_primitive_p in [e.primitive for e in eqns], eqns
    for g in (f, jax.jit(f)) + _differentiated(f, flag):
        if _stages_hi_prim(jax.make_jaxpr(g)(0.3).jaxpr):
            with pytest.raises(lh.HarvestError, match=flag):
                lh.reap(g, tag="t")(0.3)["outside"]
        else:  # JAX lowered the construct (jax 0.10's grad of remat3): plain sites
            d = lh.reap(g, tag="t")(0.3)
            close(d["outside"], 0.6)
            close(d["inside"], 0.6)
            close(d["vjp", "inside"], jnp.cos(0.6))
    with pytest.raises(lh.HarvestError, match=flag):
        lh.plant(f, tag="t")({"inside": 1.0}, 0.3)


@pytest.mark.parametrize("flag", FLAG_PARAMS, indirect=True)
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


def _stages_hi_prim(jaxpr):
    """Whether a high-level primitive is staged in `jaxpr`, at any depth."""
    return any(e.primitive is _jax.call_hi_primitive_p
               or any(_stages_hi_prim(j) for j in sub_jaxprs(e.params)) for e in jaxpr.eqns)


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
