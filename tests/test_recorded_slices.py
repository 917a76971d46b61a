"""First access through recorded transforms (issue #10 item 5): the trace of
a reaped function and a leaf's slice do not trace the transformed body for
outputs nobody reads, and a scalar's gradient leaf is jax.grad's program.
Counted (traces, FLOPs, HLO ops), never timed."""

import jax
import jax.numpy as jnp
import pytest

import lazyharvest as lh
from helpers import close
from lazyharvest import recorded


def make_params(n=3, width=8):
    ks = jax.random.split(jax.random.PRNGKey(0), n)
    return [(jax.random.normal(k, (width, width)) / width ** 0.5, jnp.full(width, 0.1))
            for k in ks]


def loss(params, x):
    h = x
    for w, b in params:
        h = jnp.tanh(h @ w + b)
    return lh.sow(jnp.mean(h ** 2), tag="t", name="loss")


def plain_loss(params, x):
    h = x
    for w, b in params:
        h = jnp.tanh(h @ w + b)
    return jnp.mean(h ** 2)


PARAMS = make_params()
XS = jax.random.normal(jax.random.PRNGKey(1), (5, 8))


@pytest.fixture
def calls(monkeypatch):
    """How many times a recorded transformation is applied to its body."""
    n = {"call": 0}
    original = recorded.Transform.call

    def counting(self, *a, **k):
        n["call"] += 1
        return original(self, *a, **k)
    monkeypatch.setattr(recorded.Transform, "call", counting)
    return n


def test_a_leaf_slice_applies_no_transform_for_unread_outputs(calls):
    f = lh.vmap(lh.grad(lambda p, x: loss(p, x)), in_axes=(None, 0))
    d = lh.reap(f, tag="t")(PARAMS, XS)
    # The output types of lh.vmap and lh.grad follow from the function's
    # (recorded._known_out_types): the user's trace applies neither; the
    # analysis of the trace adds none, nor does the leaf's slice.
    assert calls["call"] == 0
    got = d["grad", "loss"]
    assert calls["call"] == 0
    close(got, jax.vmap(jax.grad(plain_loss), in_axes=(None, 0))(PARAMS, XS))


def test_outputs_are_still_computed_where_read():
    f = lh.vmap(lh.grad(lambda p, x: loss(p, x)), in_axes=(None, 0))
    want = jax.vmap(jax.grad(plain_loss), in_axes=(None, 0))(PARAMS, XS)
    out, d = lh.call_and_reap(f, tag="t")(PARAMS, XS)
    close(out, want)
    close(d["grad", "loss"], want)

    def after(p, xs):  # a site reads the recorded transform's outputs
        g = lh.grad(lambda p: loss(p, xs[0]))(p)
        return lh.sow(jax.tree_util.tree_map(lambda a: 2 * a, g), tag="t", name="after")
    close(lh.reap(after, tag="t")(PARAMS, XS)["after"],
          jax.tree_util.tree_map(lambda a: 2 * a, jax.grad(plain_loss)(PARAMS, XS[0])))


def test_scalar_gradient_leaf_is_the_size_of_jax_grad():
    f = lh.vmap(lh.grad(lambda p, x: loss(p, x)), in_axes=(None, 0))
    lazy = lh.reap(f, tag="t")(PARAMS, XS).lower(("grad", "loss")).compile()
    hand = jax.jit(jax.vmap(jax.grad(plain_loss), in_axes=(None, 0))).lower(
        PARAMS, XS).compile()

    def flops(c):
        cost = c.cost_analysis()
        return (cost[0] if isinstance(cost, (list, tuple)) else cost)["flops"]
    assert flops(lazy) <= flops(hand)
    ops = lambda c: sum(1 for line in c.as_text().splitlines() if " = " in line)
    assert ops(lazy) <= ops(hand)


def test_outputs_read_outside_a_call_body_are_computed():
    """A rule that evaluates a call's body with the same run (closed_call):
    the body's outputs are read outside it."""
    from lazyharvest import _jax

    def h(x):
        return lh.sow(jnp.sin(x) * x, tag="t", name="s")

    def f(x):
        g = _jax.closed_call(lambda v: [lh.grad(h)(v)], x)[0]
        return lh.sow(2 * g, tag="t", name="after")

    x = jnp.float32(1.5)
    want = 2 * jax.grad(lambda v: jnp.sin(v) * v)(x)
    close(lh.reap(f, tag="t")(x)["after"], want)
    close(lh.reap(f, tag="t")(x).compute("after", ("grad", "s"))["after"], want)
