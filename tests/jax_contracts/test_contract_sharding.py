"""Contracts of `lazyharvest/_jax/sharding.py`: shard_map's eqn params, the
context its body is traced in, varying axes and per-device avals
(docs/compat.md)."""

import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

from lazyharvest._jax import core as layer_core
from lazyharvest._jax import sharding as layer

V = jax.__version__

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices")


def _mesh():
    auto = jax.sharding.AxisType.Auto
    return jax.make_mesh((4, 2), ("x", "y"), axis_types=(auto, auto))


def _shard_map_eqn(check_vma, body=lambda a, b: (a * 2., b)):
    mesh = _mesh()
    sm = jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P()), out_specs=(P("x"), P()),
                       check_vma=check_vma)
    closed = jax.make_jaxpr(sm)(jnp.arange(8.), jnp.ones(3))
    (eqn,) = [e for e in closed.jaxpr.eqns if e.primitive is layer_core.shard_map_p]
    return mesh, eqn


@pytest.mark.parametrize("check_vma", [True, False])
def test_shard_map_p_params(check_vma):
    """lazyharvest assumes a shard_map eqn holds its body (an open Jaxpr) in `jaxpr`,
    the mesh in `mesh`, the manual axes in `newly_manual_axes` (jax >= 0.10) or
    `manual_axes`, and `check_vma` (sharding.shard_map_params)."""
    mesh, eqn = _shard_map_eqn(check_vma)
    p = eqn.params
    assert ("newly_manual_axes" in p) != ("manual_axes" in p), (
        f"shard_map's manual axes param changed on jax {V}: {sorted(p)}")
    body, m, manual, check = layer.shard_map_params(eqn)
    assert isinstance(body, layer_core.Jaxpr) and len(body.invars) == 2, (
        f"shard_map's jaxpr param changed on jax {V}: {type(body)}")
    assert m == mesh and manual == frozenset({"x", "y"}) and check is check_vma, (
        f"shard_map's mesh / manual axes / check_vma params changed on jax {V}: {p}")


def test_aval_varying_axes():
    """lazyharvest assumes the avals inside a checked shard_map body name the mesh
    axes a value varies over in `aval.manual_axis_type.varying` (jax >= 0.10) or
    `aval.vma` (sharding.varying_axes)."""
    _, eqn = _shard_map_eqn(True)
    a, b = (v.aval for v in eqn.params["jaxpr"].invars)
    where = [k for k in ("manual_axis_type", "vma") if getattr(a, k, None) is not None]
    assert where, f"shard_map body avals have neither manual_axis_type nor vma on jax {V}: {a}"
    assert layer.varying_axes(a) == frozenset({"x"}), (
        f"aval.{where[0]} no longer names the varying axes on jax {V}: {a}")
    assert layer.varying_axes(b) == frozenset()
    _, eqn = _shard_map_eqn(False)
    assert layer.varying_axes(eqn.params["jaxpr"].invars[0].aval) == frozenset()


@pytest.mark.parametrize("check_vma", [True, False])
def test_core_shard_aval(check_vma):
    """lazyharvest assumes `core.shard_aval(mesh, manual_axes, check_vma, spec, aval)`
    is the per-device aval shard_map gives its body for a global value
    (sharding.local_aval)."""
    mesh, eqn = _shard_map_eqn(check_vma)
    body, m, manual, check = layer.shard_map_params(eqn)
    got = [layer.local_aval(m, manual, check, spec, x)
           for spec, x in ((P("x"), jnp.arange(8.)), (P(), jnp.ones(3)))]
    assert got == [v.aval for v in body.invars], (
        f"core.shard_aval differs from shard_map's body avals on jax {V}: {got} vs "
        f"{[v.aval for v in body.invars]}")


def test_shard_map_body_context():
    """lazyharvest assumes `shard_map._extend_axis_env(mesh, manual_axes)`,
    `mesh.use_abstract_mesh(shard_map._as_manual_mesh(mesh, manual_axes))` and
    `config._check_vma(check_vma)` give the context JAX traces a shard_map body in
    (sharding.shard_map_body_context)."""
    mods = layer.internals()
    assert {"jax._src.mesh", "jax._src.shard_map"} <= set(mods)
    inside = {}

    def body(a, b):
        inside["mesh"] = jax.sharding.get_abstract_mesh()
        inside["check_vma"] = layer._config._check_vma.value
        return a * 2., b

    _, eqn = _shard_map_eqn(True, body)
    _, m, manual, check = layer.shard_map_params(eqn)
    psum = lambda a: lax.psum(a, "x")  # noqa: E731
    with pytest.raises(NameError):
        jax.make_jaxpr(psum)(1.)
    with layer.shard_map_body_context(m, manual, check):
        ours = {"mesh": jax.sharding.get_abstract_mesh(),
                "check_vma": layer._config._check_vma.value}
        jax.make_jaxpr(psum)(1.)
    assert ours == inside, (
        f"shard_map._extend_axis_env/_as_manual_mesh/config._check_vma no longer give "
        f"shard_map's body context on jax {V}: {ours} vs {inside}")


def test_shard_map_trace_is_eager_shard_map():
    """lazyharvest assumes an eager (un-jitted) shard_map runs its body on a
    `shard_map.ShardMapTrace`, a jitted one on a jaxpr trace
    (sharding.under_eager_shard_map)."""
    seen = []

    def body(a):
        seen.append(layer.under_eager_shard_map(layer_core._core.trace_ctx.trace))
        return a * 2.

    sm = jax.shard_map(body, mesh=_mesh(), in_specs=P("x"), out_specs=P("x"))
    sm(jnp.arange(8.))
    jax.jit(sm)(jnp.arange(8.))
    assert seen == [True, False], (
        f"shard_map.ShardMapTrace is not the eager shard_map's trace on jax {V}: {seen}")


def test_unsharded_array_types_and_their_batched_types():
    """lazyharvest assumes a plain array's type is a `core.ShapedArray` whose
    sharding is on the empty mesh, that a value inside a checked shard_map
    body or sharded on a mesh has another type, and that `aval.update(shape=)`
    keeps dtype and weak type: what `vmap` makes of a per-example output type
    (sharding.is_unsharded_array_type, with_batch_axis)."""
    for x in (jnp.ones((2, 3), jnp.bfloat16), 2.0, jnp.int32(3)):
        a = jax.typeof(x)
        assert layer.is_unsharded_array_type(a), f"jax {V}: {a} is not a plain type"
        for axis in range(a.ndim + 1):
            want = jax.make_jaxpr(jax.vmap(lambda v: v * 1, out_axes=axis))(
                jnp.broadcast_to(jnp.asarray(x), (5, *a.shape)).astype(a.dtype)
                if not a.weak_type else jnp.full((5,), x)).out_avals[0]
            got = layer.with_batch_axis(a, 5, axis)
            assert (got.shape, got.dtype, got.weak_type) == (want.shape, want.dtype,
                                                             want.weak_type), (
                f"jax {V}: vmap's output type {want} is not {got}")
    _, eqn = _shard_map_eqn(True)
    assert not layer.is_unsharded_array_type(eqn.params["jaxpr"].invars[0].aval)
    explicit = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,))
    sharded = jax.device_put(jnp.arange(8.), jax.sharding.NamedSharding(explicit, P("x")))
    assert not layer.is_unsharded_array_type(jax.typeof(sharded)), (
        f"jax {V}: an explicitly sharded array's type {jax.typeof(sharded)} looks plain")
