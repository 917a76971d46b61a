"""shard_map: its eqn params, the context its body is traced in, the mesh
axes a value varies over, and per-device avals."""

from __future__ import annotations

import contextlib
from typing import Any

import jax
from jax._src import config as _config
from jax._src import core as _core

from lazyharvest._jax.core import Jaxpr, JaxprEqn


def shard_map_body_context(mesh: Any, manual_axes: frozenset, check_vma: bool):
    """The context JAX traces a shard_map body in (axis names, manual mesh)."""

    from jax._src import mesh as _mesh
    from jax._src import shard_map as _shard_map

    stack = contextlib.ExitStack()
    stack.enter_context(_shard_map._extend_axis_env(mesh, manual_axes))
    stack.enter_context(_mesh.use_abstract_mesh(
        _shard_map._as_manual_mesh(mesh, manual_axes)))
    stack.enter_context(_config._check_vma(check_vma))
    return stack


def shard_map_params(eqn: JaxprEqn) -> tuple[Jaxpr, Any, frozenset, bool]:
    """A shard_map eqn's (body jaxpr, mesh, manual axes, check_vma).

    jax 0.10 calls the manual axes `newly_manual_axes`; 0.8 and 0.9 call them
    `manual_axes`.
    """
    p = eqn.params
    manual = p["newly_manual_axes"] if "newly_manual_axes" in p else p["manual_axes"]
    return p["jaxpr"], p["mesh"], manual, p["check_vma"]


def varying_axes(aval: Any) -> frozenset:
    """Mesh axes over which a value (given by its aval) varies inside shard_map.

    jax 0.10 keeps them in `aval.manual_axis_type.varying`; 0.8 and 0.9 in
    `aval.vma`.
    """
    mat = getattr(aval, "manual_axis_type", None)
    if mat is not None:
        return frozenset(getattr(mat, "varying", ()))
    return frozenset(getattr(aval, "vma", ()))


def local_aval(mesh: Any, manual_axes: frozenset, check_vma: bool, spec: Any,
               value: Any) -> Any:
    """The per-device aval, inside shard_map, of a global value with `spec`."""
    return _core.shard_aval(mesh, manual_axes, check_vma, spec, jax.typeof(value))


def under_eager_shard_map(trace: Any) -> bool:
    """Whether an eager (un-jitted) `shard_map` is among the traces below."""
    from jax._src import shard_map as _shard_map

    while trace is not None:
        if isinstance(trace, _shard_map.ShardMapTrace):
            return True
        trace = getattr(trace, "parent_trace", None)
    return False


def internals() -> dict[str, Any]:
    """The JAX modules this module imports inside functions, by dotted name
    (for the contract tests, tests/jax_contracts/)."""
    from jax._src import mesh as _mesh
    from jax._src import shard_map as _shard_map

    return {"jax._src.mesh": _mesh, "jax._src.shard_map": _shard_map}


def is_unsharded_array_type(aval: Any) -> bool:
    """Whether `aval` is a plain array type: a `ShapedArray` on no mesh,
    varying over no mesh axis (its derived types follow from shape, dtype
    and weak type alone)."""
    if type(aval) is not _core.ShapedArray or varying_axes(aval):
        return False
    sharding = getattr(aval, "sharding", None)
    return sharding is None or sharding.mesh.empty


def with_batch_axis(aval: Any, size: int, axis: int) -> Any:
    """The unsharded array type `aval` with a new axis of `size` at `axis`."""
    shape = list(aval.shape)
    shape.insert(axis, size)
    return aval.update(shape=tuple(shape))
