"""The harvest interpreter: evaluates a traced jaxpr, reaping and planting sites.

* `run.py` — `Run` (one evaluation) and `EVAL_RULES`, the table of rules
  keyed by primitive object;
* `sites.py` — `Harvest` (what a harvest takes), site discovery and
  counting (`COUNT_RULES`);
* `plumbing.py` — re-tracing a body with its sites as extra outputs and
  plants as extra operands, shared by every rule;
* one module per family of rules: `calls.py` (jit, closed_call, remat),
  `loops.py` (scan, while), `cond.py`, `custom.py` (custom_jvp/vjp),
  `shard_map.py`. The rule for recorded transforms lives with their
  primitive, in `lazyharvest/recorded.py`.
"""

from lazyharvest._interpreter import calls, cond, custom, loops, shard_map  # noqa: F401  (registers rules)
from lazyharvest._interpreter.plumbing import (
    Body,
    PlantOperands,
    finish,
    invar_avals,
    merge,
    per_site,
    split_list,
    trace_body,
    zeros,
)
from lazyharvest._interpreter.run import EVAL_RULES, Plant, Record, Run, Site, bind, plant_order
from lazyharvest._interpreter.sites import (
    ANY_TAG,
    COUNT_RULES,
    Counts,
    Harvest,
    RawKey,
    add_counts,
    contains_sites,
    count_occurrences,
    describe,
    handled_as,
    jaxpr_has_sites,
    raw_key,
    sub_jaxprs,
)

__all__ = [
    "ANY_TAG", "COUNT_RULES", "EVAL_RULES", "Body", "Counts", "Harvest", "Plant",
    "PlantOperands", "RawKey", "Record", "Run", "Site", "add_counts", "bind", "handled_as",
    "contains_sites", "count_occurrences", "describe", "jaxpr_has_sites", "finish", "invar_avals",
    "merge", "per_site", "plant_order", "raw_key", "split_list", "strip_all_sites",
    "sub_jaxprs", "trace_body", "zeros",
]


def strip_all_sites(closed):
    """`closed` with every site of every tag removed (made the identity)."""
    run = Run(Harvest(ANY_TAG), lambda k: False, keep_other_tags=False)
    return run.stripped(closed)
