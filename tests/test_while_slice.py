"""A leaf inside while_loop compiles only its slice: unneeded carries and
their body eqns are dropped, the trip count stays exact."""

import jax
import jax.numpy as jnp

import lazyharvest as lh
from helpers import close


def f(x):
    def body(c):
        i, a, b, k = c
        a2 = lh.sow(jnp.sin(a) * 1.01 + k, tag="t", name="a", mode="clobber")
        b2 = jnp.tanh(b @ jnp.ones((64, 64)) * 0.01)  # costly, and a never needs it
        return i + 1, a2, b2, k * 0.5                  # a needs k: kept
    c0 = (0, x, jnp.ones((64, 64)), jnp.float32(0.1))
    _, a, b, _ = jax.lax.while_loop(lambda c: c[0] < 5, body, c0)
    return jnp.sum(a) + jnp.sum(b)


def hand_a(x):
    a, k = x, 0.1
    for _ in range(5):
        a, k = jnp.sin(a) * 1.01 + k, k * 0.5
    return a


def test_leaf_in_while_lowers_without_unneeded_carries():
    x = jnp.linspace(0., 1., 3)
    d = lh.reap(f, tag="t")(x)
    text = d.lower("a").as_text()
    assert "dot_general" not in text and "tanh" not in text
    assert text.count("stablehlo.while") == 1
    close(d["a"], hand_a(x))


def test_leaf_in_while_inside_jit_and_vmap():
    xs = jnp.linspace(0., 1., 6).reshape(2, 3)
    d = lh.reap(jax.jit(jax.vmap(f)), tag="t")(xs)
    assert "dot_general" not in d.lower("a").as_text()
    close(d["a"], jax.vmap(hand_a)(xs))


def test_while_slice_keeps_the_carries_the_condition_reads():
    def g(x):
        def body(c):
            a, stop = c
            return lh.sow(a * 2., tag="t", name="a", mode="clobber"), stop + a
        return jax.lax.while_loop(lambda c: c[1] < 10., body, (x, 0.))[0]
    d = lh.reap(g, tag="t")(1.)
    # a: 2, 4, 8 with stop 1, 3, 7, then 15 -> stops after 4 iterations: 16
    assert float(d["a"]) == 16.


def _while_carry_types(text):
    """The element types of the first stablehlo.while's carry, as spelled."""
    line = next(ln for ln in text.splitlines() if "stablehlo.while" in ln)
    return line.split(":", 1)[1].count("tensor<")


def test_site_the_loop_carries_gets_no_carry_of_its_own():
    # A clobber site the body returns unchanged as a carry is that carry's
    # last value (or its earlier value if the body never ran): no extra
    # carry, so the slice holds what the hand-written slice holds.
    def g(x, n):
        lh.sow(x * 7., tag="t", name="a", mode="clobber")  # the earlier value

        def body(c):
            i, a = c
            return i + 1, lh.sow(jnp.sin(a) + 1., tag="t", name="a", mode="clobber")
        return jax.lax.while_loop(lambda c: c[0] < n, body, (0, x))[1]

    x = jnp.linspace(0., 1., 3)
    d = lh.reap(g, tag="t")(x, 3)
    assert _while_carry_types(d.lower("a").as_text()) == 3  # n, i, a: no copy of a
    close(d["a"], jnp.sin(jnp.sin(jnp.sin(x) + 1.) + 1.) + 1.)
    close(lh.reap(g, tag="t")(x, 0)["a"], x * 7.)  # zero trips: the earlier value
    close(lh.reap(jax.vmap(g, (0, None)), tag="t")(x[:, None], 0)["a"], x[:, None] * 7.)
    # forward mode through the loop: the value is still the last one
    d = lh.reap(jax.jacfwd(lambda v: g(v, 2)), tag="t")(x)
    close(d["a"], jnp.sin(jnp.sin(x) + 1.) + 1.)
