"""DelayedDict keys read well and keep their promises (canonical keys, aliases,
prefixes, not-an-array, unknown tags, reads inside and after traces)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lazyharvest as lh
from helpers import close


def f(x):
    return lh.sow(x ** 3, tag="t", name="x3") + 1


def test_each_leaf_listed_once_under_its_shortest_key():
    d = lh.reap(lh.jit(lh.vmap(lh.grad(f))), tag="t")(jnp.array([2., 3.]))
    assert sorted(map(str, d.keys())) == sorted(map(str, ["x3", ("grad", "x3")]))
    assert len(d) == 2 and len(list(iter(d))) == 2 and set(d.avals) == set(d.keys())
    assert "vmap" not in repr(d) and "jit" not in repr(d)
    # every alias still indexes the same leaf
    x = jnp.array([2., 3.])
    want = jax.vmap(jax.grad(lambda x: x ** 3))(x)
    for k in [("grad", "x3"), ("grad", "vmap", "x3"), ("grad", "jit", "x3"),
              ("grad", "vmap", "jit", "x3")]:
        assert k in d
        close(d[k], want)
    assert d["grad", "x3"] is d["grad", "vmap", "jit", "x3"]


def test_aliases_lists_every_key_of_a_leaf_canonical_first():
    d = lh.reap(lh.jit(lh.vmap(lh.grad(f))), tag="t")(jnp.array([2., 3.]))
    al = d.aliases(("grad", "vmap", "x3"))
    assert al[0] == ("grad", "x3") and len(al) == 4
    assert set(al) == {("grad", "x3"), ("grad", "vmap", "x3"), ("grad", "jit", "x3"),
                       ("grad", "vmap", "jit", "x3")}


def test_prefix_is_in_exactly_when_indexing_succeeds():
    d = lh.reap(jax.grad(f), tag="t")(2.)
    assert "vjp" in d and isinstance(d["vjp"], lh.DelayedDict)
    assert ("vjp", "x3") in d and "x3" in d
    assert "nope" not in d and ("vjp", "nope") not in d
    with pytest.raises(KeyError):
        d["nope"]


def test_single_key_methods_take_one_key_argument():
    d = lh.reap(lh.grad(f), tag="t")(2.)
    assert float(d.thunk(("grad", "x3"))()) == 12.
    assert float(d.fn(("grad", "x3"))(3.)) == 27.
    assert float(d.fn("grad", "x3")(3.)) == 27.   # the older spelling still works
    assert d.is_computed(("grad", "x3"))


@pytest.mark.parametrize("use", [np.asarray, jnp.asarray,
                                 lambda d: jax.jit(lambda: d)()])
def test_array_uses_raise_type_error_pointing_to_compute(use):
    d = lh.reap(f, tag="t")(2.)
    with pytest.raises(TypeError, match=r"compute\(\)"):
        use(d)


def test_unknown_tag_lists_the_tags_that_were_sown():
    def g(x):
        return lh.sow(x * 2, tag="activations", name="h") + 1
    d = lh.reap(g, tag="acts")(1.)
    assert len(d) == 0
    with pytest.raises(lh.HarvestError, match="activations"):
        d["h"]


def test_eager_dict_read_inside_jit_is_not_poisoned():
    def g(x):
        return lh.sow(jnp.sin(x), tag="t", name="a") * 2
    d = lh.reap(g, tag="t")(2.)
    assert float(jax.jit(lambda y: d["a"] * y)(3.)) == pytest.approx(3 * np.sin(2.), rel=1e-6)
    assert float(d["a"] + 1) == pytest.approx(np.sin(2.) + 1, rel=1e-6)


def test_leaf_forced_inside_jit_and_read_after_raises():
    box = {}

    def outer(x):
        d = lh.reap(f, tag="t")(x)
        d["x3"]
        box["d"] = d
        return x
    jax.jit(outer)(2.)
    with pytest.raises(lh.HarvestError, match="trace has ended"):
        box["d"]["x3"]


def test_reaped_closure_over_a_tracer_forced_after_the_trace_raises():
    box = {}

    def outer(y):
        g = lambda x: lh.sow(x * y, tag="t", name="p")
        box["d"] = lh.reap(g, tag="t")(jnp.ones(2))
        return y
    jax.jit(outer)(3.)
    with pytest.raises(lh.HarvestError, match="trace has ended"):
        box["d"]["p"]
