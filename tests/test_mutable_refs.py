"""Programs that use mutable array references (`jax.new_ref`, `ref[...] = v`),
as Flax NNX does: values, cotangents and plants against plain JAX.

Each expected value is computed with JAX alone: the same program with a zero
perturbation argument added at the site (or the site's downstream function
differentiated directly) for cotangents, and written with the planted value in
place of the site for plants."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import lazyharvest as lh
from helpers import close

pytestmark = pytest.mark.skipif(not hasattr(jax, "new_ref"), reason="no jax.new_ref")

X = 0.7


def counter(x, eps=0.0, planted=None):
    """A state ref written, read through a site, and written again."""
    r = jax.new_ref(jnp.zeros(()))
    r[...] = x * 2
    y = r[...] ** 2
    y = lh.sow(y, tag="t", name="y") if planted is None else planted
    r[...] = y + eps + 1
    return jnp.sin(r[...]) * x


def test_value_tangent_cotangent_and_plant_through_a_ref():
    close(lh.reap(counter, tag="t")(X)["y"], (2 * X) ** 2)
    close(lh.reap(jax.jit(counter), tag="t")(X)["y"], (2 * X) ** 2)
    # cotangent: d out / d y for out = sin(y + 1) * x, with plain JAX (no ref:
    # jax 0.10 cannot differentiate a perturbation written into a local ref)
    expected = jax.grad(lambda y: jnp.sin(y + 1) * X)((2 * X) ** 2)
    close(lh.reap(jax.grad(counter), tag="t")(X)["vjp", "y"], expected)
    close(lh.reap(jax.jit(jax.grad(counter)), tag="t")(X)["vjp", "y"], expected)
    # tangent: the site's own
    d = lh.reap(lambda x: jax.jvp(counter, (x,), (1.0,)), tag="t")(X)
    close(d["jvp", "y"], jax.jvp(lambda x: (2 * x) ** 2, (X,), (1.0,))[1])
    # plant: the program with 3.0 in place of the site, and its gradient
    close(lh.plant(counter, tag="t")({"y": 3.0}, X), counter(X, planted=3.0))


def _jax_differentiates_constant_ref_writes() -> bool:
    try:
        jax.grad(lambda x: counter(x, planted=3.0))(X)
    except AttributeError:  # (jax 0.10: "DynamicJaxprTracer has no attribute accum")
        return False
    return True


@pytest.mark.skipif(not _jax_differentiates_constant_ref_writes(),
                    reason=f"jax {jax.__version__} itself cannot differentiate a program "
                           f"writing a constant into a local ref")
def test_gradient_of_a_planted_ref_program():
    close(jax.grad(lambda x: lh.plant(counter, tag="t")({"y": 3.0}, x))(X),
          jax.grad(lambda x: counter(x, planted=3.0))(X))


def accumulate(xs, eps=None, planted=None):
    """A ref carried through a scan as its accumulator; one site per step."""
    acc = jax.new_ref(jnp.zeros(()))

    def body(_, i):
        h = jnp.tanh(xs[i] + acc[...])
        if planted is not None:
            h = planted[i]
        else:
            h = lh.sow(h, tag="t", name="h", mode="append")
        if eps is not None:
            h = h + eps[i]
        acc[...] = acc[...] + h
        return None, None

    lax.scan(body, None, jnp.arange(xs.shape[0]))
    return acc[...] ** 2


XS = jnp.array([0.3, -0.5, 0.8])


def _rows_by_hand(xs):
    acc, rows = 0.0, []
    for x in np.asarray(xs):
        h = np.tanh(x + acc)
        rows.append(h)
        acc += h
    return np.array(rows)


def test_append_site_in_a_scan_over_a_ref():
    close(lh.reap(accumulate, tag="t")(XS)["h"], _rows_by_hand(XS))
    expected = jax.grad(lambda e: accumulate(XS, eps=e))(jnp.zeros(3))
    d = lh.reap(jax.grad(accumulate), tag="t")(XS)
    close(d["h"], _rows_by_hand(XS))
    close(d["vjp", "h"], expected)
    planted = jnp.array([1.0, 2.0, -1.0])
    close(lh.plant(accumulate, tag="t")({"h": planted}, XS), accumulate(XS, planted=planted))
    close(jax.grad(lambda xs: lh.plant(accumulate, tag="t")({"h": planted}, xs))(XS),
          jax.grad(lambda xs: accumulate(xs, planted=planted))(XS))


def test_cotangent_planted_into_the_backward_pass_of_a_ref_program():
    """A cotangent planted at a site adds to the cotangent flowing there: the
    gradient of the program plus `ct` times the site's value."""
    ct = 0.25
    expected = jax.grad(lambda x: counter(x) + ct * (2 * x) ** 2)(X)
    close(lh.plant(jax.grad(counter), tag="t")({("vjp", "y"): ct}, X), expected)
