"""Harvesting in a loop compiles once: plants, rebuilt recorded wrappers,
unhashable callables; caches stay weak in the user's function."""

import gc
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lazyharvest as lh
from helpers import CompileCounter, close

COMPILES = CompileCounter()


def mlp(x):
    h = x
    for i in range(3):
        h = lh.sow(jnp.tanh(h * (i + 1.5) + 0.1), tag="t", name=f"h{i}")
    return jnp.sum(h ** 2)


def hand_patched(x, i, value):
    h = x
    for j in range(3):
        h = jnp.tanh(h * (j + 1.5) + 0.1)
        if j == i:
            h = value
    return jnp.sum(h ** 2)


def _count(fn, calls):
    outs = []
    counts = []
    for args in calls:
        before = COMPILES.count
        outs.append(fn(*args))
        jax.block_until_ready(jax.tree_util.tree_leaves(outs[-1]))
        counts.append(COMPILES.count - before)
    return outs, counts


def test_repeated_plant_calls_compile_nothing_after_the_first():
    x = jnp.linspace(-1., 1., 8)
    planted = lh.plant(mlp, tag="t")
    calls = [({"h1": jnp.full(8, float(v))}, x + v) for v in range(4)]
    outs, counts = _count(planted, calls)
    assert counts[0] >= 1 and counts[1:] == [0, 0, 0]
    for (plants, xv), out in zip(calls, outs):
        close(out, hand_patched(xv, 1, plants["h1"]))


def test_repeated_harvest_and_call_and_reap_compile_nothing_after_the_second():
    x = jnp.linspace(-1., 1., 8)
    harvested = lh.harvest(mlp, tag="t")
    _, counts = _count(lambda p, x: harvested(p, x)[1]["h2"],
                       [({"h0": jnp.full(8, float(v))}, x * v) for v in range(4)])
    # the second call compiles once the program of its output and the leaves
    # the first call's dict read (docs/semantics.md, "Eager call_and_reap")
    assert counts[1:] == [1, 0, 0]
    car = lh.call_and_reap(mlp, tag="t")
    outs, counts = _count(lambda x: car(x)[1].compute(), [(x * v,) for v in range(4)])
    assert counts[1:] == [1, 0, 0]
    close(outs[2]["h0"], jnp.tanh(x * 2 * 1.5 + 0.1))


def test_rebuilt_recorded_wrappers_compile_nothing_after_the_first():
    def step(x):
        d = lh.reap(lh.jit(lh.vmap(lh.grad(mlp), in_axes=0)), tag="t")(x)
        return d["grad", "h0"]
    xs = [jnp.ones((2, 8)) * v for v in (0.1, 0.2, 0.3)]
    outs, counts = _count(step, [(x,) for x in xs])
    assert counts[1:] == [0, 0]
    want = jax.vmap(jax.jacrev(lambda x: jnp.tanh(x * 1.5 + 0.1)))(xs[2])
    close(outs[2], want)


def test_unhashable_callable_is_cached_by_identity():
    class Unhashable:
        __hash__ = None  # like Equinox's filter_grad wrappers

        def __call__(self, x):
            return mlp(x)
    f = Unhashable()
    reaped = lh.reap(f, tag="t")
    _, counts = _count(lambda x: reaped(x)["h0"], [(jnp.ones(8) * v,) for v in range(3)])
    assert counts[1:] == [0, 0]


def test_uncacheable_callable_warns_once():
    class Slotted:
        __slots__ = ()

        def __call__(self, x):
            return lh.sow(x * 2, tag="t", name="y")
    with pytest.warns(UserWarning, match="cannot cache"):
        lh.reap(Slotted(), tag="t")(1.)["y"]


def test_dropping_the_function_frees_its_traces():
    def make():
        def f(x):
            return lh.sow(x * 3, tag="t", name="y")
        return f
    f = make()
    wrapped = lh.grad(f)
    d = lh.reap(wrapped, tag="t")(2.)
    assert float(d["grad", "y"]) == 3.
    ref = weakref.ref(f)
    del f, wrapped, d
    gc.collect()
    assert ref() is None


def test_wrappers_with_different_parameters_do_not_share_traces():
    def f(x, y):
        return lh.sow(x * y ** 2, tag="t", name="p")
    a, b = jnp.float32(2.), jnp.float32(3.)
    d0 = lh.reap(lh.grad(f, argnums=0), tag="t")(a, b)
    d1 = lh.reap(lh.grad(f, argnums=1), tag="t")(a, b)
    assert np.isclose(float(d0["grad", "p"]), 9.) and np.isclose(float(d1["grad", "p"]), 12.)


def test_a_collection_inside_the_trace_cache_lock_does_not_deadlock():
    """A traced function collected while the trace cache's lock is held (a
    garbage collection can run anywhere) has its entry dropped by a weakref
    callback that takes the same lock: it must be reentrant."""
    from lazyharvest import program

    def g(x):
        return lh.sow(x * 2, tag="t", name="y")

    lh.reap(g, tag="t")(1.0)["y"]
    key = id(g)
    assert key in program._TRACES
    ref = program._TRACES[key].ref
    with program._TRACES_LOCK:
        acquired = program._TRACES_LOCK.acquire(blocking=False)
        assert acquired, "the trace cache's lock is not reentrant"
        program._TRACES_LOCK.release()
        program._forget(key, ref)  # as the callback would, mid-region
    assert key not in program._TRACES


def test_a_weakly_typed_plant_after_a_strong_one_compiles_nothing():
    # plants are cast to the site's dtype before the program cache is asked
    x = jnp.linspace(-1., 1., 8)
    planted = lh.plant(mlp, tag="t")
    weak = jnp.full(8, 3.)
    assert jax.typeof(weak).weak_type
    calls = [({"h1": jnp.full(8, 2., dtype=jnp.float32)}, x),
             ({"h1": weak}, x),
             ({"h1": np.full(8, 5., np.float32)}, x)]
    # JAX compiles its own eager ops (the cast, a numpy transfer) once per
    # shape: done here, with another planted function
    _count(lh.plant(lambda x: mlp(x), tag="t"), calls)
    outs, counts = _count(planted, calls)
    assert counts[1:] == [0, 0]
    for (plants, xv), out in zip(calls, outs):
        close(out, hand_patched(xv, 1, jnp.asarray(plants["h1"], jnp.float32)))


def _closing_over_a_jit(big):
    return lambda x: jax.jit(lambda y: lh.sow(big @ y, tag="t", name="a"))(x)


def _grad_of_a_jit(big):
    return jax.grad(lambda x: jax.jit(lambda y: lh.sow(big @ y, tag="t", name="a").sum())(x))


def _grad_of_a_custom_vjp(big, site_inside=False):
    def fun(u):
        v = jnp.sin(big @ u)
        return lh.sow(v, tag="t", name="inner") if site_inside else v
    g = jax.custom_vjp(fun)
    g.defvjp(lambda u: (g(u), u), lambda u, ct: (big.T @ (jnp.cos(big @ u) * ct),))
    return jax.grad(lambda x: lh.sow(g(x), tag="t", name="a").sum())


def _linearized_outside(big):
    inner = jax.jit(lambda z: lh.sow(big @ z, tag="t", name="a"))

    def f(x):
        _, lin = jax.linearize(inner, x)
        return lin(x)
    return f


@pytest.mark.parametrize("make", [
    _closing_over_a_jit, _grad_of_a_jit, _grad_of_a_custom_vjp,
    lambda big: _grad_of_a_custom_vjp(big, site_inside=True), _linearized_outside,
], ids=["jit", "grad_of_jit", "grad_of_custom_vjp", "grad_of_custom_vjp_with_a_site",
        "linearized_outside"])
def test_arrays_the_function_closes_over_are_freed_with_it(make):
    """The caches of what a jaxpr or a custom rule holds (keyed by identity)
    hold them weakly: on jax >= 0.11 a jaxpr holds its constants, and a
    custom_vjp's functions their closures."""
    def run():
        big = jnp.ones((64, 64)) * 2
        f = make(big)
        d = lh.reap(f, tag="t")(jnp.ones(64))
        for k in d.keys():  # (every program compiled and run)
            jax.block_until_ready(d[k])
        return weakref.ref(big)
    ref = run()
    gc.collect()
    assert ref() is None, "an array the reaped function closed over outlived it"


def test_a_leaf_continuation_called_in_a_loop_runs_its_slice_without_compiling():
    # d.fn(key): the hot-loop form (after its first call, a call of arrays of
    # the first call's types runs the compiled slice at once)
    def f(x, y):
        return mlp(x * y)
    x0 = jnp.linspace(-1.0, 1.0, 8)
    d = lh.reap(f, tag="t")(x0, x0)
    step = d.fn("h1")
    tree_step = lh.reap(lambda x, y: (lh.sow({"a": x, "b": (x * y, y)}, tag="t", name="p"),
                                      x)[1], tag="t")(x0, x0).fn("p")
    step(x0, x0)  # (compiles)
    tree_step(x0, x0)
    inputs, wanted = [], []
    for i in range(5):
        x, y = x0 + 0.1 * i, jnp.full(8, 0.5 + i, jnp.float32)
        h = x * y
        for j in range(2):
            h = jnp.tanh(h * (j + 1.5) + 0.1)
        inputs.append((x, y))
        wanted.append((h, {"a": x, "b": (x * y, y)}))
    before = COMPILES.count
    got = [(step(x, y), tree_step(x, y)) for x, y in inputs]
    jax.block_until_ready(got)
    assert COMPILES.count == before
    for (h, p), (want_h, want_p) in zip(got, wanted):
        close(h, want_h)
        close(p, want_p)
    # other types, other structures: refused as before
    with pytest.raises(lh.HarvestError, match="shaped like"):
        step(jnp.ones(3), jnp.ones(3))
    with pytest.raises(lh.HarvestError, match="shaped like"):
        step(x0.astype(jnp.int32), x0)
    with pytest.raises(lh.HarvestError, match="shaped like"):
        step((x0, x0))
    close(step(1.0 + x0, x0), jnp.tanh(jnp.tanh((1.0 + x0) * x0 * 1.5 + 0.1) * 2.5 + 0.1))
