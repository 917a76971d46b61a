"""Importing lazyharvest changes nothing (SPEC section 9, docs/semantics.md)."""

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import lazyharvest as lh
from lazyharvest import _jax
from lazyharvest.primitive import harvesting


def _hooked(prim) -> bool:
    return "bind_with_trace" in vars(prim)


def test_custom_call_hooks_are_in_force_only_inside_a_harvest_or_scope():
    # outside, JAX binds its custom calls with no frame of ours (its own
    # tests count the frames inside a custom_vjp's functions)
    prims = (_jax.custom_jvp_call_p, _jax.custom_vjp_call_p)
    if not _jax.CUSTOM_CALL_HOOKS:
        pytest.skip(f"jax {jax.__version__}: the custom calls are not hooked")
    assert not any(map(_hooked, prims))
    seen = []
    lh.nest(lambda: seen.append(all(map(_hooked, prims))), scope="s")()
    with harvesting("t"):
        seen.append(all(map(_hooked, prims)))
    assert seen == [True, True] and not any(map(_hooked, prims))
    # in force while any thread is inside such a block
    inside, leave = threading.Event(), threading.Event()

    def other():
        with harvesting("t"):
            inside.set()
            leave.wait(30)
    t = threading.Thread(target=other)
    t.start()
    inside.wait(30)
    with harvesting("t"):
        pass
    seen.append(all(map(_hooked, prims)))
    leave.set()
    t.join()
    assert seen[-1] and not any(map(_hooked, prims))


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
