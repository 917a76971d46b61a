"""Sharded inputs and shard_map, on 8 simulated CPU devices (see conftest)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import lazyharvest as lh
from helpers import close

sow = lh.sow

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices")


@pytest.fixture(scope="module", params=["explicit", "auto"])
def mesh(request):
    # The default axis types differ between versions (jax 0.8: Auto; from 0.9:
    # Explicit): test both everywhere.
    kind = {"explicit": jax.sharding.AxisType.Explicit,
            "auto": jax.sharding.AxisType.Auto}[request.param]
    return jax.make_mesh((4, 2), ("x", "y"), axis_types=(kind, kind))


def test_sharded_inputs_keep_shardings(mesh):
    x = jax.device_put(jnp.arange(16.).reshape(8, 2), NamedSharding(mesh, P("x", "y")))

    def f(x):
        h = sow(jnp.sin(x) * 2, tag="t", name="h")
        return jnp.sum(h ** 2)
    out, d = lh.call_and_reap(f, tag="t")(x)
    close(out, jnp.sum((jnp.sin(x) * 2) ** 2), rtol=1e-4)
    close(d["h"], jnp.sin(x) * 2)
    assert d["h"].sharding.is_equivalent_to(NamedSharding(mesh, P("x", "y")), 2)
    g = lh.reap(jax.grad(f), tag="t")(x)
    close(g["vjp", "h"], 2 * jnp.sin(x) * 2)
    close(lh.plant(f, tag="t")({"h": jnp.ones((8, 2))}, x), 16.)


def body(a):
    b = sow(jnp.sin(a), tag="t", name="inside")
    c = sow(jnp.ones(3), tag="t", name="invariant")
    return b * 2 + c.sum()


def sm_fn(mesh):
    sm = jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"))

    def f(x):
        y = sow(x * 2, tag="t", name="before")
        z = sm(y)
        return sow(z + 1, tag="t", name="after")
    return f


def test_shard_map_sites_before_inside_after(mesh):
    x = jax.device_put(jnp.arange(8.), NamedSharding(mesh, P("x")))
    d = lh.reap(sm_fn(mesh), tag="t")(x)
    y = np.arange(8.) * 2
    close(d["before"], y)
    # varies over "x" only: stacked over the 4 devices of "x" -> (4, 2)
    close(d["inside"], np.sin(y).reshape(4, 2))
    close(d["invariant"], np.ones(3))  # varies over no axis: as is
    close(d["after"], np.sin(y) * 2 + 3 + 1)


def test_shard_map_plant_inside_and_outside(mesh):
    x = jax.device_put(jnp.arange(8.), NamedSharding(mesh, P("x")))
    f = sm_fn(mesh)
    close(lh.plant(f, tag="t")({"inside": jnp.zeros((4, 2))}, x), np.full(8, 4.))
    close(lh.plant(f, tag="t")({"before": jnp.zeros(8)}, x), np.full(8, 4.))
    p = jnp.arange(8.).reshape(4, 2)
    close(lh.plant(f, tag="t")({"inside": p}, x), np.arange(8.) * 2 + 4)
    with pytest.raises(lh.HarvestError, match="shape"):
        lh.plant(f, tag="t")({"inside": jnp.zeros((3, 2))}, x)


def test_shard_map_all_axes_varying_and_grad(mesh):
    sm = jax.shard_map(lambda a: sow(jnp.sin(a), tag="t", name="s") * 3,
                       mesh=mesh, in_specs=P(("x", "y")), out_specs=P(("x", "y")))
    x = jax.device_put(jnp.arange(16.), NamedSharding(mesh, P(("x", "y"))))
    d = lh.reap(jax.grad(lambda v: jnp.sum(sm(v))), tag="t")(x)
    close(d["s"], np.sin(np.arange(16.)).reshape(8, 2))
    close(d["vjp", "s"], np.full((8, 2), 3.))


def test_shard_map_inside_jit_and_check_vma_off(mesh):
    sm = jax.shard_map(lambda a: sow(a * 2, tag="t", name="s"), mesh=mesh,
                       in_specs=P("x"), out_specs=P("x"), check_vma=False)
    x = jax.device_put(jnp.arange(8.), NamedSharding(mesh, P("x")))
    d = lh.reap(jax.jit(sm), tag="t")(x)
    # without varying-axis types every manual axis counts: 4 x 2 devices
    assert d["s"].shape == (8, 2)
    close(np.asarray(d["s"])[::2], (np.arange(8.) * 2).reshape(4, 2))


def test_append_inside_shard_map(mesh):
    def inner(a):
        for k in range(3):
            a = sow(a + k, tag="t", name="a", mode="append")
        return a
    sm = jax.shard_map(inner, mesh=mesh, in_specs=P("x"), out_specs=P("x"))
    x = jax.device_put(jnp.arange(8.), NamedSharding(mesh, P("x")))
    got = lh.reap(sm, tag="t")(x)["a"]
    assert got.shape == (12, 2)
    close(np.asarray(got)[:3], np.array([[0., 1.], [1., 2.], [3., 4.]]))


def test_recorded_transforms_inside_shard_map_body(mesh):
    # lh.grad / lh.vmap / lh.jit inside a shard_map body crashed with JAX's
    # "pvary is a invariant->variant collective" error: the recorded eqn's
    # output types lacked the mesh axes its values vary over.
    def inner(a):
        return jnp.sum(sow(jnp.sin(a), tag="t", name="s") ** 2)
    bodies = {
        "grad": lambda a: lh.grad(inner)(a),
        "vmap": lambda a: jnp.concatenate([lh.vmap(inner)(a.reshape(2, 2))] * 2),
        "jit": lambda a: lh.jit(inner)(a) * jnp.ones(4),
    }
    x = jax.device_put(jnp.arange(16.) / 8, NamedSharding(mesh, P("x")))
    blocks = np.asarray(x).reshape(4, 4)  # one row per device along "x"
    for name, body in bodies.items():
        sm = jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"))
        out, d = lh.call_and_reap(sm, tag="t")(x)
        close(out, jax.jit(sm)(x))  # (eager shard_map of a grad fails on jax 0.8)
        if name == "vmap":
            close(d["s"], np.sin(blocks).reshape(4, 2, 2))
        else:
            close(d["s"], np.sin(blocks))
        if name == "grad":  # the Jacobian of each device's site, stacked
            close(d["grad", "s"], np.stack([np.diag(np.cos(b)) for b in blocks]))
        planted = lh.plant(sm, tag="t")({"s": jnp.ones_like(d["s"])}, x)
        # a planted site is a constant: no gradient flows through it
        want = {"grad": 0., "vmap": 2., "jit": 4.}[name]
        close(planted, np.full(16, want))
