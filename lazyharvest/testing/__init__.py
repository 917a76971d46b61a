"""The laws of harvesting (docs/laws.md), as checkers anyone can run, and
random programs to run them on.

* ``check_<law>(f, *args, tag=...)`` and ``check_all`` (``laws``) need JAX
  and lazyharvest only::

      from lazyharvest.testing import check_all
      check_all(model, params, x, tag="intermediates")

* ``programs()``, ``transform_stacks(program)`` and ``inputs(program, stack)``
  (``strategies``, needs ``hypothesis``) draw random ``Program`` s
  (``random_programs``, built of ``statements``), stacks of recorded
  transforms (``stacks``) and matching arguments.

Keys are tuples ``(*labels, *scopes, name)`` (a bare string ``"x"`` means
``("x",)``); every checker compares flat dicts keyed by such tuples.
"""

from lazyharvest.keys import Key
from lazyharvest.testing._compare import ATOL, RTOL
from lazyharvest.testing._sites import LABELS, SiteInfo, site_info, split_labels
from lazyharvest.testing.laws import (
    LAWS, LawReport, check_all, check_compute, check_jit, check_jvp, check_lazy,
    check_linearize, check_nest, check_roundtrip, check_vjp, check_vmap)
from lazyharvest.testing.random_programs import Program
from lazyharvest.testing.stacks import DIFFERENTIAL, STRUCTURAL, Stack, Transform
from lazyharvest.testing.statements import (
    BINARY, CONSTRUCTS, OPT_IN, REDUCE, UNARY, B, Bin, Cond, Custom, Jit, Lin, N, Op, Output,
    Passes, Red, Remat, Repeat, Scan, Scope, Sow, While)
from lazyharvest.testing.strategies import inputs, programs, transform_stacks

__all__ = [
    "CONSTRUCTS", "LAWS", "OPT_IN", "Key", "LawReport", "Program", "SiteInfo", "Stack",
    "Transform", "check_all", "check_compute", "check_jit", "check_jvp",
    "check_lazy", "check_linearize", "check_nest", "check_roundtrip", "check_vjp",
    "check_vmap", "inputs", "programs", "site_info", "split_labels",
    "transform_stacks",
]
