"""lazyharvest: reap and plant intermediate values of JAX programs, lazily.

`sow` marks a value; `reap(f)` returns a `DelayedDict` keyed by
transformation path whose leaves are computed only when read.
"""

import os as _os

from lazyharvest import _jax

if _jax.DERIVATIVE_SITES:  # dead and constant sites under JAX's differentiation
    from lazyharvest import derivative_sites as _derivative_sites  # noqa: F401  (registers rules)
from lazyharvest._version import __version__
from lazyharvest.api import call_and_reap, harvest, nest, plant, reap
from lazyharvest.delayed import DelayedDict, HarvestKeyError
from lazyharvest.errors import HarvestError
from lazyharvest.interventions import intervention
from lazyharvest.models import sow_modules
from lazyharvest.primitive import sow
from lazyharvest.transforms import (
    grad,
    hessian,
    jacfwd,
    jacrev,
    jit,
    jvp,
    linearize,
    value_and_grad,
    vjp,
    vmap,
)

# Users' tracebacks skip the library's frames, as they skip JAX's.
_jax.hide_frames_below(_os.path.dirname(__file__))

__all__ = [
    "DelayedDict", "HarvestError", "HarvestKeyError", "__version__",
    "call_and_reap", "grad", "harvest", "hessian", "intervention", "jacfwd", "jacrev", "jit",
    "jvp", "linearize", "nest",
    "plant", "reap", "sow", "sow_modules", "value_and_grad", "vjp", "vmap",
]
