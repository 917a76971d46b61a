"""lazyharvest: reap and plant intermediate values of JAX programs, lazily.

`sow` marks a value; `reap(f)` returns a `DelayedDict` keyed by
transformation path whose leaves are computed only when read.
"""

from lazyharvest.api import call_and_reap, harvest, nest, plant, reap
from lazyharvest.delayed import DelayedDict
from lazyharvest.errors import HarvestError
from lazyharvest.models import sow_modules
from lazyharvest.primitive import sow
from lazyharvest.transforms import (
    grad, hessian, jacfwd, jacrev, jit, jvp, linearize, value_and_grad, vjp, vmap)

__version__ = "0.1.0"

__all__ = [
    "DelayedDict", "HarvestError", "call_and_reap", "grad", "harvest", "hessian",
    "jacfwd", "jacrev", "jit", "jvp", "linearize", "nest", "plant", "reap", "sow",
    "sow_modules",
    "value_and_grad", "vjp", "vmap",
]
