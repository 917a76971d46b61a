"""Every bad input of SPEC 7 raises HarvestError naming the tag and site."""

import jax
import jax.numpy as jnp
import pytest
from jax import lax

import lazyharvest as lh
from lazyharvest.primitive import active_tags, current_scopes

sow = lh.sow


def raises(match_words, fn, *args, exc=lh.HarvestError):
    with pytest.raises(exc) as info:
        fn(*args)
    msg = str(info.value)
    for w in match_words:
        assert w in msg, (w, msg)
    return info.value


def test_harvest_error_is_value_error():
    assert issubclass(lh.HarvestError, ValueError)


def test_strict_duplicate():
    def f(x):
        return sow(x, tag="t", name="a") + sow(x, tag="t", name="a")
    raises(["'t'", "'a'", "strict", "clobber", "append"], lh.reap(f, tag="t"), 1.)


def test_unknown_mode():
    raises(["'t'", "'a'", "unknown mode", "'bogus'"],
           lambda: sow(1., tag="t", name="a", mode="bogus"))


@pytest.mark.parametrize("mode", ["strict", "append"])
def test_while_requires_clobber(mode):
    def f(x):
        return lax.while_loop(lambda c: c < 3., lambda c: sow(c + 1, tag="t", name="w",
                                                               mode=mode), x)
    raises(["'t'", "'w'", mode, "while_loop", "clobber"], lh.reap(f, tag="t"), 0.)


def test_strict_in_scan():
    def f(x):
        return lax.scan(lambda c, v: (sow(c + v, tag="t", name="s"), None), 0., x)[0]
    raises(["'t'", "'s'", "strict", "scan", "append"], lh.reap(f, tag="t"), jnp.ones(3))


@pytest.mark.parametrize("other", [
    lambda v: lh.sow(v, tag="t", name="other"),                 # name
    lambda v: (lh.sow(jnp.stack([v, v]), tag="t", name="b"), v)[1],  # shape
    lambda v: lh.sow(v.astype(jnp.int32), tag="t", name="b").astype(v.dtype),  # dtype
])
def test_cond_branches_must_match(other):
    def f(x):
        return lax.cond(x > 0, lambda v: sow(v, tag="t", name="b"), other, x)
    raises(["'t'", "branches", "same names"], lh.reap(f, tag="t"), 1.)


def test_plant_unknown_name_lists_sites():
    def f(x):
        return sow(x, tag="t", name="alpha") + sow(x, tag="t", name="beta")
    raises(["'t'", "'gamma'", "alpha", "beta"],
           lambda: lh.plant(f, tag="t")({"gamma": 1.}, 1.))


def test_plant_shape_and_dtype():
    def f(x):
        return sow(x, tag="t", name="a")
    x = jnp.ones(3)
    raises(["'t'", "'a'", "shape", "(2,)", "(3,)"],
           lambda: lh.plant(f, tag="t")({"a": jnp.ones(2)}, x))
    raises(["'t'", "'a'", "dtype", "int32", "float32"],
           lambda: lh.plant(f, tag="t")({"a": jnp.ones(3, jnp.int32)}, x))
    raises(["'t'", "'a'", "dtype", "complex"],
           lambda: lh.plant(lambda v: sow(v, tag="t", name="a"), tag="t")(
               {"a": jnp.ones(3, jnp.complex64)}, x))
    # Python scalars and weakly typed values are cast
    assert lh.plant(lambda v: sow(v, tag="t", name="a"), tag="t")({"a": 2}, 1.) == 2.


def test_unknown_key_suggests_closest():
    d = lh.reap(lambda x: sow(x, tag="t", name="activation"), tag="t")(1.)
    err = raises(["'t'", "'activaton'", "activation"], lambda: d["activaton"],
                 exc=KeyError)
    assert isinstance(err, lh.HarvestError)
    assert "activaton" not in d
    assert d.get("activaton") is None


def test_forcing_after_trace_ended():
    box = {}

    @jax.jit
    def g(x):
        box["d"] = lh.reap(lambda v: sow(v * 2, tag="t", name="a"), tag="t")(x)
        return x
    g(1.)
    raises(["'t'", "'a'", "trace has ended", "inside"], lambda: box["d"]["a"])


@pytest.mark.parametrize("bad", ["text", None, object()])
def test_non_array_leaf(bad):
    raises(["'t'", "'a'", "array"], lambda: sow(bad, tag="t", name="a"))


def test_python_scalars_are_sown_as_arrays():
    d = lh.reap(lambda x: x + sow(3, tag="t", name="c"), tag="t")(1.)
    assert d["c"] == 3


def test_exception_in_user_function_leaves_no_state():
    def bad(x):
        sow(x, tag="t", name="a")
        raise RuntimeError("boom")
    with pytest.raises(RuntimeError):
        lh.reap(lh.nest(bad, scope="s"), tag="t")(1.)
    assert active_tags() == frozenset()
    assert current_scopes() == ()
    # a sow outside any harvest is the identity again, in eager mode and jit
    assert sow(2., tag="t", name="a") == 2.
    assert "sow" not in str(jax.make_jaxpr(jax.jit(lambda x: x + 1))(1.))


def test_errors_do_not_corrupt_caches():
    calls = {"n": 0}

    def f(x):
        calls["n"] += 1
        y = sow(x * 2, tag="t", name="a")
        if calls["n"] == 1:
            sow(x, tag="t", name="a")  # strict duplicate on the first trace only
        return y
    with pytest.raises(lh.HarvestError):
        lh.reap(f, tag="t")(1.)
    assert lh.reap(f, tag="t")(1.)["a"] == 2.
    with pytest.raises(lh.HarvestError):
        lh.plant(f, tag="t")({"nope": 1.}, 1.)
    assert lh.plant(f, tag="t")({"a": 5.}, 1.) == 5.


def test_plants_must_be_a_mapping():
    raises(["'t'", "mapping"], lambda: lh.plant(lambda x: sow(x, tag="t", name="a"),
                                                tag="t")([1.], 1.))


def test_plant_with_wrong_scope_is_an_error():
    def f(x):
        return lh.nest(lambda v: sow(v, tag="t", name="s"), scope="a")(x)
    raises(["'t'", "('zz', 's')", "('a', 's')"],
           lambda: lh.plant(f, tag="t")({("zz", "s"): 1.}, 1.))
    assert lh.plant(f, tag="t")({"a": {"s": 3.}}, 1.) == 3.
