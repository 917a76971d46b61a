"""The analysis is linear in sites x nesting depth: deep stacks of recorded
transforms reap quickly and give plain JAX's values."""

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lazyharvest as lh
from helpers import close


def _stack(wrap, depth, reduce=False, plain_wrap=lambda g: g):
    """f_0(x) = sin x; f_i = wrap(x -> 1.1 cos f_{i-1}(x)), one sow per level;
    and the same chain in plain JAX (wrapped by `plain_wrap`)."""
    f = lambda x: lh.sow(jnp.sin(x), tag="t", name="s0")
    plain = jnp.sin
    for i in range(1, depth + 1):
        def level(x, g=f, i=i):
            y = lh.sow(jnp.cos(g(x)) * 1.1, tag="t", name=f"s{i}")
            return jnp.sum(y) if reduce else y
        def plain_level(x, g=plain):
            y = jnp.cos(g(x)) * 1.1
            return jnp.sum(y) if reduce else y
        f, plain = wrap(level), plain_wrap(plain_level)
    return f, plain


@pytest.mark.parametrize("kind,depth", [("jit", 20), ("vmap", 8), ("grad", 5)])
def test_deep_recorded_stacks_reap_quickly(kind, depth):
    wrap = {"jit": lh.jit, "vmap": lh.vmap, "grad": lh.grad}[kind]
    f, _ = _stack(wrap, depth, reduce=kind == "grad")
    x = jnp.full((2,) * depth, 0.3) if kind == "vmap" else jnp.float32(0.3)
    start = time.perf_counter()
    d = lh.reap(f, tag="t")(x)
    elapsed = time.perf_counter() - start
    assert elapsed < 20, elapsed  # was exponential: minutes, or out of memory
    # the innermost site's value is sin(x) whatever wraps it
    close(d["s0"], jnp.sin(x))
    if kind == "jit":
        # level i's value, by plain JAX
        v = jnp.sin(x)
        for i in range(1, depth + 1):
            v = jnp.cos(v) * 1.1
            close(d[f"s{i}"], v)
    if kind == "grad":
        # the top site sits under the outermost grad only: ("grad", s_depth) is
        # the derivative of its slice x -> 1.1 cos(f_{depth-1}(x))
        _, inner = _stack(lh.grad, depth - 1, reduce=True, plain_wrap=jax.grad)
        want = jax.grad(lambda x: jnp.cos(inner(x)) * 1.1)(x)
        close(d["grad", f"s{depth}"], want, rtol=1e-4)


def test_deeply_nested_structural_labels_offer_canonical_and_full_keys():
    f = lambda x: lh.sow(jnp.sin(x), tag="t", name="s")
    for _ in range(12):
        f = lh.jit(f)
    d = lh.reap(f, tag="t")(1.)
    assert list(d.keys()) == ["s"]
    full = ("jit",) * 12 + ("s",)
    assert full in d and d[full] is d["s"]
    assert np.isclose(float(d["s"]), np.sin(1.))
