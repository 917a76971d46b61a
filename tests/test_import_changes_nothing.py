"""Importing lazyharvest changes nothing (SPEC section 9, docs/semantics.md)."""

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import lazyharvest as lh


def _scan_closing_over(a):
    return lambda x: lax.scan(lambda c, y: (c * jnp.sum(a) + jnp.sin(y), None), x,
                              jnp.ones(4))[0]


def test_regression_checkpoint_of_a_scan_leaks_no_trace():
    # (issue 32) the recipes a checkpoint's partial evaluation collected
    # outlived the traces of the scan body inside it: JAX's leak checks
    # reported them, under jax.grad of a program that never sows
    f = _scan_closing_over(jnp.arange(3.0))
    with jax.checking_leaks():
        g = jax.grad(jax.checkpoint(f))(1.0)
    np.testing.assert_allclose(g, 3.0 ** 4)  # four steps c -> 3 c + sin(1)


def test_regression_checkpointed_sites_around_a_scan_leak_no_trace():
    # a dead site in nested checkpoints (the rule that keeps its tangent
    # half collects recipes) around a scan closing over an array, outside a
    # harvest: its value, and the gradient of the program written without it
    f = _scan_closing_over(jnp.arange(3.0))

    def program(x, site=lambda v: lh.sow(v, tag="t", name="k")):
        def outer(x, v):
            return f(x) + 0.0 * lax.stop_gradient(jax.checkpoint(lambda v: site(f(v)))(v))
        return jax.checkpoint(outer)(x, jnp.cos(x))
    want = jax.grad(lambda x: program(x, site=lambda v: v))(1.0)
    with jax.checking_leaks():
        got = jax.grad(program)(1.0)
        linear = jax.linearize(program, 1.0)[1]
    np.testing.assert_allclose(got, want, rtol=1e-6)
    # the dead site of the linear function (SPEC 9): its tangent
    tangent = jax.jvp(lambda x: f(jnp.cos(x)), (1.0,), (1.0,))[1]
    np.testing.assert_allclose(lh.reap(linear, tag="t")(1.0)["k"], tangent, rtol=1e-6)
