"""Dead-code elimination for the slicer: JAX's own, plus a rule for `while`.

JAX has no DCE rule for `while_loop`: if any output is used, every carry and
every body eqn stays. A leaf inside a loop would then compile the whole loop.
The rule here keeps the carries the wanted outputs need — through the body,
to a fixed point, and every carry the condition reads, so the trip count is
exact — and drops the rest. It is installed only while the slicer runs.

JAX 0.12's DCE also drops a high-level primitive that only writes a Ref read
later (`Scan3`, under `jax_scan3`); inside `_jax.ref_writing_hi_prims_kept`
JAX's DCE keeps it, so a slice computes what the eager program does.
"""

from __future__ import annotations

from collections.abc import Sequence

from lazyharvest import _jax


def _needed_carries(eqn: _jax.JaxprEqn, used_outputs: Sequence[bool]) -> list[bool]:
    p = eqn.params
    cond, body = p["cond_jaxpr"].jaxpr, p["body_jaxpr"].jaxpr
    cnc, bnc = p["cond_nconsts"], p["body_nconsts"]
    _, cond_in = _jax.dce(cond, [True], instantiate=False)
    used = [u or c for u, c in zip(used_outputs, cond_in[cnc:])]
    while True:
        _, body_in = _jax.dce(body, used, instantiate=False)
        grown = [u or b for u, b in zip(used, body_in[bnc:])]
        if grown == used:
            return used
        used = grown


def _while_rule(used_outputs: list[bool], eqn: _jax.JaxprEqn
                ) -> tuple[list[bool], _jax.JaxprEqn | None]:
    p = eqn.params
    cond, body = p["cond_jaxpr"], p["body_jaxpr"]
    cnc, bnc = p["cond_nconsts"], p["body_nconsts"]
    if _jax.effects_of(cond.jaxpr) or _jax.effects_of(body.jaxpr):
        return [True] * len(eqn.invars), eqn
    carry = _needed_carries(eqn, used_outputs)
    if all(carry):
        return [True] * len(eqn.invars), eqn
    new_cond, cond_used = _jax.dce(cond.jaxpr, [True], instantiate=[False] * cnc + carry)
    new_body, body_used = _jax.dce(body.jaxpr, carry, instantiate=[False] * bnc + carry)
    cond_c, body_c = cond_used[:cnc], body_used[:bnc]
    used_inputs = [*cond_c, *body_c, *carry]
    params = dict(p, cond_jaxpr=_jax.ClosedJaxpr(new_cond, cond.consts),
                  body_jaxpr=_jax.ClosedJaxpr(new_body, body.consts),
                  cond_nconsts=sum(cond_c), body_nconsts=sum(body_c))
    new_eqn = _jax.new_jaxpr_eqn(
        [v for v, u in zip(eqn.invars, used_inputs) if u],
        [v for v, u in zip(eqn.outvars, carry) if u],
        eqn.primitive, params, eqn.effects, eqn.source_info, eqn.ctx)
    return used_inputs, new_eqn


def dce(jaxpr: _jax.Jaxpr, used_outputs: Sequence[bool]) -> _jax.Jaxpr:
    """`jaxpr` with what `used_outputs` do not need removed, loops included."""
    with _jax.ref_writing_hi_prims_kept(), _jax.extra_dce_rules({_jax.while_p: _while_rule}):
        new, _ = _jax.dce(jaxpr, used_outputs, instantiate=True)
    return new
