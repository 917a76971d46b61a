"""Models as they are written: static arguments, non-array leaves, plants that
add, plants that pass the other sites through, scoped filters, checked
continuations."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lazyharvest as lh
from helpers import CompileCounter, close

COMPILES = CompileCounter()


def model(x, train=False, scale=1.0):
    h = lh.sow(jnp.tanh(x) * scale, tag="t", name="h")
    if train:
        h = h * 0.5
    return jnp.sum(lh.sow(h * 3, tag="t", name="g"))


def test_python_flag_leaves_are_static():
    x = jnp.linspace(-1., 1., 4)
    d = lh.reap(model, tag="t")(x, train=True)
    close(d["g"], jnp.tanh(x) * 0.5 * 3)
    d = lh.reap(model, tag="t")(x, train=False)
    close(d["g"], jnp.tanh(x) * 3)


@pytest.mark.parametrize("how", ["argnums", "argnames"])
def test_static_arguments_are_part_of_the_cache_key(how):
    x = jnp.linspace(-1., 1., 4)
    kw = {"static_argnums": 2} if how == "argnums" else {"static_argnames": "scale"}
    reaped = lh.reap(model, tag="t", **kw)
    call = ((lambda s: reaped(x, False, s)) if how == "argnums"
            else (lambda s: reaped(x, False, scale=s)))
    close(call(2.0)["h"], jnp.tanh(x) * 2.0)
    before = COMPILES.count
    close(call(2.0)["h"], jnp.tanh(x) * 2.0)
    assert COMPILES.count == before           # same static value: cached
    close(call(3.0)["h"], jnp.tanh(x) * 3.0)  # another: a new trace, right value


def test_non_array_leaves_of_a_pytree_argument_are_static():
    params = {"w": jnp.ones(3) * 2, "act": jnp.tanh, "name": "layer"}

    def f(p, x):
        return jnp.sum(lh.sow(p["act"](x * p["w"]), tag="t", name="a"))
    x = jnp.arange(3.)
    close(lh.reap(f, tag="t")(params, x)["a"], jnp.tanh(x * 2))
    close(lh.plant(f, tag="t")({"a": jnp.ones(3)}, params, x), 3.)


def test_unhashable_static_leaf_is_a_clear_error():
    def f(cfg, x):
        return lh.sow(x * len(cfg), tag="t", name="a")
    with pytest.raises(lh.HarvestError, match="hashable"):
        lh.reap(f, tag="t")({1, 2}, 1.)  # a set: a leaf, not hashable


def test_plant_add_broadcasts_a_steering_vector():
    def f(x):
        r = lh.sow(x * 2, tag="t", name="resid")       # (B, T, D)
        return jnp.sum(jnp.tanh(r))
    x = jnp.linspace(-1., 1., 24).reshape(2, 3, 4)
    v = jnp.array([0.1, -0.2, 0.3, 0.0])
    got = lh.plant(f, tag="t", mode="add")({"resid": v}, x)
    close(got, jnp.sum(jnp.tanh(x * 2 + v)))
    with pytest.raises(lh.HarvestError, match="broadcast"):
        lh.plant(f, tag="t", mode="add")({"resid": jnp.ones(3)}, x)
    with pytest.raises(lh.HarvestError, match="mode"):
        lh.plant(f, tag="t", mode="steer")


def test_plant_add_to_an_append_site_in_a_loop():
    def f(x):
        for i in range(3):
            x = lh.sow(jnp.sin(x) + i, tag="t", name="h", mode="append")
        return x
    x = jnp.ones(2)
    got = lh.plant(f, tag="t", mode="add")({"h": jnp.float32(0.5)}, x)
    want = x
    for i in range(3):
        want = jnp.sin(want) + i + 0.5
    close(got, want)


def g(x):
    a = lh.sow(x ** 2, tag="t", name="a")
    return lh.sow(a * 3, tag="t", name="b") + 1


def g_clobber(x):
    a = lh.sow(x ** 2, tag="t", name="a", mode="clobber")
    return lh.sow(a * 3, tag="t", name="b", mode="clobber") + 1


@pytest.mark.parametrize("wrap", ["plain", "jit", "while"])
def test_plant_passes_unplanted_sites_through(wrap):
    site_fn = g_clobber if wrap == "while" else g
    inner = lambda x: lh.plant(site_fn, tag="t")({"a": 10.}, x)
    if wrap == "jit":
        body = jax.jit(inner)
    elif wrap == "while":
        body = lambda x: jax.lax.while_loop(
            lambda c: c[0] < 1, lambda c: (c[0] + 1, inner(c[1])), (0, x))[1]
    else:
        body = inner
    out, d = lh.call_and_reap(body, tag="t")(2.)
    assert list(d.keys()) == ["b"]
    assert float(d["b"]) == 30.
    assert float(out) == 31.


def test_plant_passes_unplanted_append_sites_through_in_scan():
    def h(c, _):
        a = lh.sow(c * 2, tag="t", name="a", mode="append")
        return lh.sow(a + 1, tag="t", name="b", mode="append"), None

    def f(x):
        return jax.lax.scan(h, x, None, length=3)[0]
    planted = lambda x: lh.plant(f, tag="t")({"a": jnp.full((3,), 5.)}, x)
    out, d = lh.call_and_reap(planted, tag="t")(1.)
    assert list(d.keys()) == ["b"]
    close(d["b"], np.full(3, 6.))
    assert float(out) == 6.


def test_filters_accept_scoped_keys():
    def f(x):
        a = lh.nest(lambda x: lh.sow(x * 2, tag="t", name="v"), scope="s1")(x)
        b = lh.nest(lambda x: lh.sow(x * 3, tag="t", name="v"), scope="s2")(x)
        return a + b
    d = lh.reap(f, tag="t", allowlist=[("s1", "v")])(1.)
    assert list(d.keys()) == [("s1", "v")]
    d = lh.reap(f, tag="t", blocklist=[("s1", "v")])(1.)
    assert list(d.keys()) == [("s2", "v")]


def test_continuation_checks_the_argument_structure():
    def f(p, x):
        return lh.sow(p["w"] * x, tag="t", name="y")
    p = {"w": jnp.float32(2.)}
    d = lh.reap(f, tag="t")(p, 3.)
    assert float(d.fn("y")(p, 4.)) == 8.
    assert float(d.fn("y")(p, jnp.float32(4.))) == 8.   # weak type may differ
    with pytest.raises(lh.HarvestError, match="structured"):
        d.fn("y")({"v": jnp.float32(2.)}, 4.)
    with pytest.raises(lh.HarvestError, match="structured"):
        d.fn("y")((jnp.float32(2.),), 4.)


def test_unhashable_tag_and_non_array_plant_are_clear_errors():
    with pytest.raises(lh.HarvestError, match="hashable"):
        lh.reap(g, tag=["t"])
    with pytest.raises(lh.HarvestError, match="array"):
        lh.plant(g, tag="t")({"a": "ten"}, 2.)


def test_partial_still_works_for_closing_over_configuration():
    f = functools.partial(model, train=True)
    x = jnp.ones(2)
    close(lh.reap(f, tag="t")(x)["g"], jnp.tanh(x) * 1.5)
