"""Which JAX this is: its version, the supported range, and the feature probes
every other module of the layer branches on (docs/compat.md).

Each probe reads the presence of a feature (a signature, an attribute, a
type), not a version number, so a release between the tested ones takes the
right branch. `require` raises a `HarvestError` naming the version a feature
needs.
"""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Sequence

import jax

from lazyharvest.errors import HarvestError


def parse_version(version: str) -> tuple[int, ...]:
    """(major, minor, micro) of a version string: "0.9.0.1" and "0.10.3.dev20260101"
    give (0, 9, 0) and (0, 10, 3)."""
    out = []
    for part in version.split(".")[:3]:
        m = re.match(r"\d+", part)
        if m is None:
            break
        out.append(int(m.group()))
    return tuple(out)


JAX_VERSION = parse_version(jax.__version__)
MIN_JAX_VERSION = (0, 8, 3)  # pyproject.toml: jax>=0.8.3,<0.13
# scripts/compat.py: DEFAULT_VERSIONS (0.12.0 is jax 0.12.0.1)
TESTED_JAX_VERSIONS = ((0, 8, 3), (0, 9, 2), (0, 10, 2), (0, 11, 2), (0, 12, 0), (0, 12, 1))


def _spell(version: Sequence[int]) -> str:
    return ".".join(map(str, version))


def require(version: Sequence[int], feature: str) -> None:
    """Raises a `HarvestError` naming `version` if this JAX is older."""
    if tuple(version) > JAX_VERSION:
        raise HarvestError(
            f"{feature} needs jax >= {_spell(version)}; this is jax "
            f"{jax.__version__}. Upgrade JAX (pip install -U 'jax>={_spell(version)}').")

require(MIN_JAX_VERSION, "lazyharvest")

# --- feature probes (from here on, internals present in every supported version) ---

from jax._src import core as _core  # noqa: E402
from jax._src import custom_derivatives as _custom_derivatives  # noqa: E402
from jax._src.interpreters import ad as _ad  # noqa: E402
from jax._src.interpreters import partial_eval as _pe  # noqa: E402
from jax.extend.core import ClosedJaxpr, Jaxpr, Primitive  # noqa: E402

# Dead and constant sites keep their tangent/cotangent sites through rules that
# use differentiation internals jax 0.8 lacks (LinearizeTrace.is_vjp, bind
# hooks with avals); on it those sites behave as before (docs/compat.md).
DERIVATIVE_SITES = JAX_VERSION >= (0, 9)

# Sites inside a custom function JAX stages as a high-level primitive
# (`CustomJVPTraced`/`CustomVJPTraced`) are harvested on jax >= 0.12, whose
# applications take the function's closure as leading operands and can be
# bound again in another trace; on 0.10 and 0.11 (closure inside the object)
# they are refused, naming the flag (docs/compat.md).
CUSTOM_HI_PRIMS = JAX_VERSION >= (0, 12)

# jax >= 0.11 merged `ClosedJaxpr` into `Jaxpr`: a jaxpr's constvars are its
# leading inputs that have values attached (`jaxpr.consts`); without them
# attached, they are plain leading invars.
MERGED_JAXPR = ClosedJaxpr is Jaxpr


# jax 0.8: `get_bind_params` returns `(subfuns, params)` and `bind` takes the
# subfuns as leading positional arguments. jax >= 0.9: it returns params with
# the subfuns under "subfuns", and `bind` takes them there.
BIND_PARAMS_SPLIT = isinstance(Primitive("lazyharvest_probe").get_bind_params({}),
                                tuple)


# jax >= 0.9: `bind_with_trace(trace, args, avals, params)`; jax 0.8 without avals.
BIND_TAKES_AVALS = "avals" in inspect.signature(
    _core.Primitive.bind_with_trace).parameters


# jax >= 0.9 passes a custom call's functions in `params["subfuns"]`, which a
# bind hook can replace (`replace_subfuns`); jax 0.8 passes them as arguments.
CUSTOM_CALL_HOOKS = BIND_TAKES_AVALS and not BIND_PARAMS_SPLIT


# jax >= 0.11: a custom_vjp call's wrapped backward function returns
# `(cotangents, logs)` (`defvjp_with_logs`); jax < 0.11 the cotangents.
# (`_flatten_bwd` is a `lu.transformation2`: a partial whose first argument is
# the function itself)
def _bwd_returns_logs() -> bool:
    flatten = _custom_derivatives._flatten_bwd
    if isinstance(flatten, functools.partial) and flatten.args:
        flatten = flatten.args[0]
    return "with_logs" in inspect.signature(flatten).parameters


BWD_RETURNS_LOGS = _bwd_returns_logs()


# jax >= 0.11: a linearization rule returns one more value, structured
# residuals (None for ours), and `linearized` takes their binders after the
# residuals; jax < 0.11 returns four values.
LINEARIZE_STRUCTURED = "structured_residuals" in getattr(
    _ad.LinearizeTrace, "__annotations__", {})


# jax >= 0.12 calls a DCE rule as `rule(used_outputs, live_inputs, eqn)`
# (`live_inputs`: which Ref inputs are read after the eqn); jax < 0.12 as
# `rule(used_outputs, eqn)`. The package writes rules in the older form.
DCE_LIVE_INPUTS = len(inspect.signature(_pe._default_dce_rule).parameters) == 3
