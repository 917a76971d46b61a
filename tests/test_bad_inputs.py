"""Issue-9 regressions: keys never collide, DelayedDict refuses pickling,
odd leaves show, and bad inputs end in a clear HarvestError."""

import copy
import pickle

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lazyharvest as lh
from helpers import close


def label_like(x):
    a = lh.sow(x * 2, tag="t", name="x")
    b = lh.nest(lambda x: lh.sow(x * 3, tag="t", name="x"), scope="vjp")(x)
    c = lh.nest(lh.nest(lambda x: lh.sow(x * 5, tag="t", name="x"), scope="vjp"),
                scope="primal")(x)
    return a * 1. + b * 10. + c * 100.


def test_scopes_spelled_like_labels_never_collide():
    d = lh.reap(jax.grad(label_like), tag="t")(1.)
    assert len(d) == 6                       # three values, three cotangents
    values = sorted(float(d[k]) for k in d.keys())
    # values 2, 3, 5; cotangents d out / d site = 1, 10, 100 (plain arithmetic)
    assert values == [1., 2., 3., 5., 10., 100.]
    flat = d.compute()
    assert len(jax.tree_util.tree_leaves(flat)) == 6
    assert "pending" in repr(lh.reap(jax.grad(label_like), tag="t")(1.))


def test_a_key_both_leaf_and_prefix_computes_and_reprs():
    def f(x):
        a = lh.nest(lambda x: lh.sow(x * 2, tag="t", name="b"), scope="a")(x)
        return a + lh.sow(x * 3, tag="t", name="a")
    d = lh.reap(f, tag="t")(1.)
    out = d.compute()  # string keys only: the leaf at a prefix is under ""
    assert float(out["a"]["b"]) == 2. and float(out["a"][""]) == 3.
    jax.tree_util.tree_structure(out)
    assert float(d["a"]) == 3. and float(d["a", "b"]) == 2.
    repr(d)


def test_delayed_dict_refuses_pickle_and_copy_with_advice():
    d = lh.reap(lambda x: lh.sow(x, tag="t", name="a"), tag="t")(1.)
    for op in (pickle.dumps, copy.deepcopy, copy.copy):
        with pytest.raises(TypeError, match=r"compute\(\)"):
            op(d)
    pickle.loads(pickle.dumps(jax.device_get(d.compute())))


def test_prng_key_leaf_shows_in_repr():
    d = lh.reap(lambda k: lh.sow(jax.random.split(k), tag="t", name="k"), tag="t")(
        jax.random.key(0))
    d["k"]
    assert "key<fry>[2]" in repr(d)


@pytest.mark.parametrize("bad", ["string_array", "string_return", "generator"])
def test_bad_values_are_harvest_errors(bad):
    fns = {
        "string_array": lambda x: lh.sow(np.array(["a"]), tag="t", name="s"),
        "string_return": lambda x: (lh.sow(x, tag="t", name="a"), "text"),
        "generator": lambda x: (lh.sow(x, tag="t", name="a") for _ in range(2)),
    }
    with pytest.raises(lh.HarvestError):
        lh.reap(fns[bad], tag="t")(1.)


def test_zero_size_append_in_scan():
    def body(c, _):
        return c, lh.sow(jnp.zeros((0,)), tag="t", name="z", mode="append")
    d = lh.reap(lambda x: jax.lax.scan(body, x, None, length=3)[0], tag="t")(1.)
    assert d["z"].shape == (3, 0)


@pytest.mark.parametrize("kw,call", [
    ({"static_argnums": 1}, lambda g: g(2., n=3)),
    ({"static_argnames": "n"}, lambda g: g(2., 3)),
])
def test_recorded_jit_static_arguments_by_keyword_or_position(kw, call):
    def f(x, n):
        return lh.sow(x * n, tag="t", name="y")
    assert float(call(lh.jit(f, **kw))) == float(call(jax.jit(f, **kw))) == 6.
    d = lh.reap(lambda x: call(lh.jit(f, **kw)), tag="t")(2.)
    assert float(d["y"]) == 6.


def test_plant_of_another_width_is_refused_with_both_dtypes():
    f = lambda x: jnp.sum(lh.sow(x.astype(jnp.bfloat16), tag="t", name="h"))
    x = jnp.ones(3)
    with pytest.raises(lh.HarvestError, match=r"float32.*bfloat16"):
        lh.plant(f, tag="t")({"h": jnp.ones(3, jnp.float32)}, x)
    close(lh.plant(f, tag="t")({"h": jnp.full(3, 2, jnp.bfloat16)}, x), 6.)
