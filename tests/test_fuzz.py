"""Malformed input never ends in anything but a clear HarvestError or TypeError
that names the tag or the key, and never spoils a cache."""

import jax.numpy as jnp
import numpy as np
from hypothesis import given
from hypothesis import strategies as st

import lazyharvest as lh


def model(x):
    h = lh.sow(jnp.tanh(x), tag="tag_t", name="h")
    return jnp.sum(lh.sow(h * 2, tag="tag_t", name="g"))


X = jnp.linspace(-1., 1., 4)
WANT_H = np.tanh(np.linspace(-1., 1., 4))

junk = st.one_of(
    st.none(), st.text(max_size=4), st.integers(-3, 3), st.floats(allow_nan=False),
    st.lists(st.integers(0, 2), max_size=3), st.just(object()), st.just({1, 2}),
    st.just(np.array(["a", "b"])), st.just(jnp.ones((2, 3))), st.just(jnp.ones(4, jnp.int32)),
    st.just(jnp.ones(4, jnp.complex64)), st.just(lambda: 0),
)
keys = st.one_of(st.text(max_size=5), st.tuples(st.text(max_size=3), st.text(max_size=3)),
                 st.just(("vjp",)), st.just(("h", "g")), st.integers(0, 3))


def _still_works():
    assert np.allclose(lh.reap(model, tag="tag_t")(X)["h"], WANT_H, atol=1e-6)
    assert np.isclose(float(lh.plant(model, tag="tag_t")({"h": jnp.zeros(4)}, X)), 0.)


def _clear(err, *names):
    text = str(err.args[0] if err.args else err)
    assert any(str(n) in text for n in names), text


@given(plant_key=keys, value=junk)
def test_malformed_plants(plant_key, value):
    try:
        lh.plant(model, tag="tag_t")({plant_key: value}, X)
    except (lh.HarvestError, TypeError) as e:
        _clear(e, "tag_t", plant_key if not isinstance(plant_key, tuple) else plant_key[0])
    _still_works()


@given(key=keys)
def test_malformed_keys(key):
    d = lh.reap(model, tag="tag_t")(X)
    for op in (lambda: d[key], lambda: d.fn(key), lambda: d.compute(key),
               lambda: d.is_computed(key)):
        try:
            op()
        except (lh.HarvestError, TypeError) as e:
            _clear(e, "tag_t")
    _still_works()


@given(arg=junk)
def test_malformed_arguments(arg):
    try:
        lh.reap(model, tag="tag_t")(arg)["h"]
    except (lh.HarvestError, TypeError) as e:
        text = str(e)
        assert text  # JAX's own shape errors for arrays of the wrong rank are TypeErrors too
    _still_works()


@given(tag=st.one_of(st.just(["list"]), st.just({"a": 1}), st.text(max_size=3), st.none()))
def test_malformed_tags(tag):
    try:
        d = lh.reap(model, tag=tag)(X)
        if tag != "tag_t":
            assert len(d) == 0
            try:
                d["h"]
            except lh.HarvestError as e:
                _clear(e, "tag_t")   # names the tags that were sown
    except lh.HarvestError as e:
        _clear(e, repr(tag))
    _still_works()
