"""The rule for `shard_map`: per-device sites come out stacked over devices.

A per-device value that varies over manual mesh axes A (all manual axes when
`check_vma=False`) is reaped with a new leading axis of size prod(A), in mesh
order; a value that varies over none is reaped as is. Plants inside the body
take the same layout.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import PartitionSpec as P

from lazyharvest import _jax
from lazyharvest._interpreter.plumbing import (
    PlantOperands,
    invar_avals,
    merge_leading,
    per_site,
    trace_body,
)
from lazyharvest._interpreter.run import EVAL_RULES, Run, bind
from lazyharvest._interpreter.sites import count_occurrences
from lazyharvest.errors import HarvestError


def layout_of_aval(aval: Any, axes: tuple, check_vma: bool) -> tuple:
    """The manual axes a per-device value varies over (all, without vma types)."""
    if not check_vma:
        return axes
    varying = _jax.varying_axes(aval)
    return tuple(a for a in axes if a in varying)


def _spec(axes: tuple) -> Any:
    return P(axes if len(axes) > 1 else axes[0]) if axes else P()


def _planted_layouts(run: Run, ops: PlantOperands, jaxpr: _jax.Jaxpr, inside,
                     axes: tuple, check: bool) -> list[tuple]:
    """Each planted leaf's layout, learnt from a plain trace of the body."""
    for k in ops.keys:
        if run.plants[k].mode == "append":
            raise HarvestError(
                f"{run.harvest.where(k)}: planting an append site inside "
                f"shard_map is not supported; plant it outside the shard_map.")
    if not ops.keys:
        return []
    with inside():
        learn = run.nested({}, {}, want=lambda k: True, pass_through=False)
        plain, _inner = trace_body(learn, jaxpr, (), invar_avals(jaxpr))
    inner = {s.key: s for s in plain.sites}
    return [layout_of_aval(a, axes, check) for k in ops.keys for a in inner[k].avals]


def _shard_map(run: Run, eqn: _jax.JaxprEqn, invals: list, *, in_specs, out_specs,
               **_) -> list:
    # The manual axes' param is named by JAX version: read through _jax.
    jaxpr, mesh, manual, check = _jax.shard_map_params(eqn)
    axes = tuple(a for a in mesh.axis_names if a in manual)
    inside = lambda: _jax.shard_map_body_context(mesh, manual, check)
    ops = PlantOperands.of(run, [k for k in count_occurrences(jaxpr, run.harvest)
                                 if k in run.plants])
    plant_axes = _planted_layouts(run, ops, jaxpr, inside, axes, check)
    plant_specs = [_spec(ax) for ax in plant_axes]
    drop_device_axis = lambda i, x: x[0] if plant_axes[i] else x
    in_avals = invar_avals(jaxpr) + [
        _jax.local_aval(mesh, manual, check, sp, x)
        for sp, x in zip(plant_specs, ops.leaves)]
    with inside():
        body, inner = trace_body(
            run, jaxpr, (), in_avals,
            lambda extra: run.nested(ops.plants(run.plants, extra, drop_device_axis)),
            len(ops.leaves))
    run.cursor.update(inner.cursor)  # the body's occurrences are counted
    out_axes: list = []

    def fn(*args):
        outs, leaves = body.split_outs(_jax.eval_jaxpr(body.jaxpr, (), *args))
        out_axes[:] = [layout_of_aval(jax.typeof(x), axes, check) for x in leaves]
        return [*outs, *[x[None] if ax else x for x, ax in zip(leaves, out_axes)]]

    const_avals = [_jax.local_aval(mesh, manual, check, P(), c) for c in body.consts]
    with inside():
        new_jaxpr, k = _jax.trace_flat(fn, const_avals + in_avals)
    assert not k
    nc = len(body.consts)
    params = dict(eqn.params, jaxpr=new_jaxpr,
                  in_specs=(P(),) * nc + tuple(in_specs) + tuple(plant_specs),
                  out_specs=tuple(out_specs) + tuple(_spec(a) for a in out_axes))
    outs = bind(eqn, [*body.consts, *invals, *ops.leaves], params)
    own, leaves = body.split_outs(outs)
    _record_stacked(run, body.sites, leaves, out_axes)
    return own


def _record_stacked(run: Run, sites: list, leaves: list, out_axes: list) -> None:
    axes_per_site = per_site(sites, out_axes)
    for s, ls, axs in zip(sites, per_site(sites, leaves), axes_per_site):
        if s.mode == "append":  # (devices, n, ...) -> (devices * n, ...)
            ls = [merge_leading(x) if ax else x for x, ax in zip(ls, axs)]
        run.record(s.key, s.mode, s.tree, ls)


EVAL_RULES[_jax.shard_map_p] = _shard_map
