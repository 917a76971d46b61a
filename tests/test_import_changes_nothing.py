"""Importing lazyharvest changes nothing (SPEC section 9, docs/semantics.md).

In this process: the hooks that act only in a harvest are in force only
then, and the programs of issue 32 that leaked traces. Then two subprocesses
run the same corpus of programs, no harvest anywhere, one after `import
lazyharvest` and one without it (tests/import_differential.py says what each
records). Everything they record must be identical: the jaxprs of jit, grad,
vjp, jvp, linearize, vmap and checkpoint traced with `jax_check_tracer_leaks`
on (or the errors), their values, the device arrays left alive, stack depths
inside the functions JAX calls and filtered tracebacks. The random programs
run there with `sow` the identity; run again with lazyharvest's `sow`
(outside any harvest, so the identity too) they must give the same values;
their jaxprs hold the sites (and, under differentiation, the dead and
constant sites of docs/semantics.md section 2a), so only values and
outcomes are compared.
"""

import functools
import os
import pickle
import re
import subprocess
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from import_differential import WITHOUT_MODULES
from jax import lax

import lazyharvest as lh
from helpers import (
    jax_ignores_scan3_reverse,
    jax_jits_scan3_wrongly,
    jax_reports_ref_writing_scans_as_leaks,
    skip_where_jax_checkpoints_scan3_wrongly,
)
from lazyharvest import _jax
from lazyharvest import testing as T
from lazyharvest.primitive import harvesting

# --- in this process ----------------------------------------------------------------

def _hooked(prim) -> bool:
    return "bind_with_trace" in vars(prim)


def test_custom_call_hooks_are_in_force_only_inside_a_harvest_or_scope():
    # outside, JAX binds its custom calls with no frame of ours (its own
    # tests count the frames inside a custom_vjp's functions)
    prims = (_jax.custom_jvp_call_p, _jax.custom_vjp_call_p)
    if not _jax.CUSTOM_CALL_HOOKS:
        pytest.skip(f"jax {jax.__version__}: the custom calls are not hooked")
    assert not any(map(_hooked, prims))
    seen = []
    lh.nest(lambda: seen.append(all(map(_hooked, prims))), scope="s")()
    with harvesting("t"):
        seen.append(all(map(_hooked, prims)))
    assert seen == [True, True] and not any(map(_hooked, prims))
    # in force while any thread is inside such a block
    inside, leave = threading.Event(), threading.Event()

    def other():
        with harvesting("t"):
            inside.set()
            leave.wait(30)
    t = threading.Thread(target=other)
    t.start()
    inside.wait(30)
    with harvesting("t"):
        pass
    seen.append(all(map(_hooked, prims)))
    leave.set()
    t.join()
    assert seen[-1] and not any(map(_hooked, prims))


def _scan_closing_over(a):
    return lambda x: lax.scan(lambda c, y: (c * jnp.sum(a) + jnp.sin(y), None), x,
                              jnp.ones(4))[0]


@skip_where_jax_checkpoints_scan3_wrongly()
def test_regression_checkpoint_of_a_scan_leaks_no_trace():
    # (issue 32) the recipes a checkpoint's partial evaluation collected
    # outlived the traces of the scan body inside it: JAX's leak checks
    # reported them, under jax.grad of a program that never sows
    f = _scan_closing_over(jnp.arange(3.0))
    with jax.checking_leaks():
        g = jax.grad(jax.checkpoint(f))(1.0)
    np.testing.assert_allclose(g, 3.0 ** 4)  # four steps c -> 3 c + sin(1)


@skip_where_jax_checkpoints_scan3_wrongly()
def test_regression_checkpointed_sites_around_a_scan_leak_no_trace():
    # a dead site in nested checkpoints (the rule that keeps its tangent
    # half collects recipes) around a scan closing over an array, outside a
    # harvest: its value, and the gradient of the program written without it
    f = _scan_closing_over(jnp.arange(3.0))

    def program(x, site=lambda v: lh.sow(v, tag="t", name="k")):
        def outer(x, v):
            return f(x) + 0.0 * lax.stop_gradient(jax.checkpoint(lambda v: site(f(v)))(v))
        return jax.checkpoint(outer)(x, jnp.cos(x))
    want = jax.grad(lambda x: program(x, site=lambda v: v))(1.0)
    with jax.checking_leaks():
        got = jax.grad(program)(1.0)
        linear = jax.linearize(program, 1.0)[1]
    np.testing.assert_allclose(got, want, rtol=1e-6)
    # the dead site of the linear function (SPEC 9): its tangent
    tangent = jax.jvp(lambda x: f(jnp.cos(x)), (1.0,), (1.0,))[1]
    if _jax.DERIVATIVE_SITES:  # jax 0.8 loses dead sites (docs/compat.md)
        np.testing.assert_allclose(lh.reap(linear, tag="t")(1.0)["k"], tangent, rtol=1e-6)


# --- two processes ---------------------------------------------------------------------

_SCANS = """
import sys
import jax, jax.numpy as jnp
from jax import lax
jax.config.update("jax_scan3", True)
f = lambda x: lax.scan(lambda c, y: (c * y + 1.0, None), x, jnp.arange(3.0))[0]
if sys.argv[1] == "with":  # every module loaded, a harvest of a scan read before
    import lazyharvest as lh
    import lazyharvest.testing  # noqa: F401
    sown = lambda x: lax.scan(lambda c, y: (lh.sow(c * y, tag="t", name="k", mode="clobber") + 1.0,
                                                      None),
                              x, jnp.arange(3.0))[0]
    assert float(lh.reap(sown, tag="t")(1.0)["k"]) == 4.0  # (the last step's)
print(jax.jit(f)(1.0), jax.jit(lambda x: jax.jvp(f, (x,), (1.0,)))(1.0), f(1.0))
"""


def _printed(code: str, *argv: str) -> str:
    """What `python -c code *argv` prints, in a fresh process (on the CPU,
    this checkout's lazyharvest importable)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.path.dirname(HERE))
    run = subprocess.run([sys.executable, "-c", code, *argv], env=env, text=True,
                         capture_output=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout


def test_jit_of_a_scan_under_jax_scan3_computes_what_it_computes_without_lazyharvest():
    # jax 0.12's DCE drops a `Scan3` that only writes its carry's Ref, so
    # `jax.jit` of a scan under jax_scan3 returns the initial carry. The
    # harvest keeps such an eqn in the programs it slices and compiles, not
    # in a user's: importing lazyharvest neither fixes nor breaks a program
    # (the rule was once installed at import, and changed this one)
    if "jax_scan3" not in jax.config.values:
        pytest.skip(f"jax {jax.__version__} has no jax_scan3")
    assert _printed(_SCANS, "with") == _printed(_SCANS, "without")


_RULE_DEPTH = """
import inspect, sys
import jax
jax.config.update("jax_custom_jvp3", True)
if sys.argv[1] == "with":
    import lazyharvest
depth = []

@jax.custom_jvp
def f(x):
    return x * 2.0

@f.defjvp
def f_jvp(primals, tangents):
    depth.append(len(inspect.stack()))
    return f(primals[0]), 2.0 * tangents[0]

jax.jvp(f, (1.0,), (1.0,))
print(depth)
"""


def test_a_custom_rule_runs_as_deep_under_jax_custom_jvp3_as_without_lazyharvest():
    # (JAX's own tests count the frames inside a custom function's rules.)
    # Under the flag, JAX binds a custom function as a `call_hi_primitive`,
    # which lazyharvest hooks for the programs holding sites; installed at
    # import, the hook put 2 frames of its own under every rule
    if "jax_custom_jvp3" not in jax.config.values or not _jax.CUSTOM_HI_PRIMS:
        pytest.skip(f"jax {jax.__version__}: custom functions are no high-level primitives")
    assert _printed(_RULE_DEPTH, "with") == _printed(_RULE_DEPTH, "without")


def test_the_high_level_primitive_hook_is_installed_at_the_first_site():
    # what a program holding sites needs outside a harvest (docs/semantics.md,
    # section 10d) is there once a site is sown, not before
    if _jax.call_hi_primitive_p is None:
        pytest.skip(f"jax {jax.__version__} has no call_hi_primitive")
    code = ("import jax, lazyharvest as lh\n"
            "from lazyharvest import _jax\n"
            "hooked = lambda: 'bind_with_trace' in vars(_jax.call_hi_primitive_p)\n"
            "seen = [hooked()]\n"
            "lh.sow(jax.numpy.ones(2), tag='t', name='x')  # (eager: no site)\n"
            "seen.append(hooked())\n"
            "jax.make_jaxpr(lambda x: lh.sow(x, tag='t', name='x'))(1.0)\n"
            "print(seen + [hooked()])\n")
    assert _printed(code).strip() == "[False, False, True]"


slow = pytest.mark.slow  # the two processes: about a minute on two cores

HERE = os.path.dirname(os.path.abspath(__file__))
HELPER = os.path.join(HERE, "import_differential.py")
N_RANDOM = 12  # random programs, and a third as many with several backward passes
SOWN = "sown: "


def _draw(strategy, n: int) -> list:
    drawn: list = []

    @settings(max_examples=n, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def collect(p):
        drawn.append(p)
    collect()
    return drawn[:n]


@functools.cache
def _programs() -> list:
    """Random programs, deterministic: (body, output, tree_input, tag) each."""
    progs = _draw(T.programs(), N_RANDOM) + _draw(T.programs(include=T.OPT_IN), N_RANDOM // 3)
    return [(p.body, p.output, p.tree_input, p.tag) for p in progs]


@pytest.fixture(scope="module")
def records(tmp_path_factory) -> tuple[dict, dict, int]:
    """(with lazyharvest, without it, how many random programs)."""
    tmp = tmp_path_factory.mktemp("import")
    programs = _programs()
    (tmp / "programs.pkl").write_bytes(pickle.dumps(programs))
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_TRACEBACK_FILTERING="remove_frames",
               PYTHONPATH=os.path.dirname(HERE))
    procs = {side: subprocess.Popen(
        [sys.executable, HELPER, side, str(tmp / "programs.pkl"), str(tmp / f"{side}.pkl")],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for side in ("with", "without")}
    for side, p in procs.items():
        log = p.communicate(timeout=900)[0]
        assert p.returncode == 0, f"the {side!r} side failed:\n{log[-4000:]}"
    got, want = (pickle.loads((tmp / f"{s}.pkl").read_bytes()) for s in ("with", "without"))
    return got, want, len(programs)


def _same_values(a, b, exact: bool) -> bool:
    la, lb = _leaves(a), _leaves(b)
    if len(la) != len(lb):
        return False
    for x, y in zip(la, lb):
        x, y = np.asarray(x), np.asarray(y)
        if x.dtype != y.dtype or x.shape != y.shape:
            return False
        if not (np.array_equal(x, y, equal_nan=True) if exact
                else np.allclose(x, y, rtol=1e-6, atol=1e-6, equal_nan=True)):
            return False
    return True


def _leaves(tree) -> list:
    if isinstance(tree, dict):
        return [v for k in sorted(tree) for v in _leaves(tree[k])]
    if isinstance(tree, (tuple, list)):
        return [v for x in tree for v in _leaves(x)]
    return [tree]


def _first_difference(a: str, b: str) -> str:
    for i, (x, y) in enumerate(zip(a.splitlines(), b.splitlines())):
        if x != y:
            return f"line {i}: {x.strip()[:200]!r} != {y.strip()[:200]!r}"
    return "lengths differ"


def _differences(name: str, got: dict, want: dict) -> list[str]:
    """How one program's records differ (`got`: with lazyharvest)."""
    if set(got) != set(want):
        return [f"{name}: transformations {sorted(got)} != {sorted(want)}"]
    bad = []
    for t, g in got.items():
        w = want[t]
        if not isinstance(g, dict):  # an issue program's measure
            if g != w:
                bad.append(f"{name} [{t}]: {g!r} != {w!r}")
        elif g["jaxpr"] != w["jaxpr"]:  # (or the errors, leaked traces among them)
            bad.append(f"{name} [{t}] jaxpr: {_first_difference(g['jaxpr'], w['jaxpr'])}")
        elif isinstance(g.get("value"), str) or isinstance(w.get("value"), str):
            if g.get("value") != w.get("value"):
                bad.append(f"{name} [{t}] value: {g.get('value')!r} != {w.get('value')!r}")
        elif "value" in g and not _same_values(g["value"], w["value"], exact=True):
            bad.append(f"{name} [{t}] values differ")
    return bad


@slow
def test_importing_lazyharvest_changes_nothing(records):
    got, want, n_random = records
    assert got["jax"] == want["jax"]
    # the `without` side never ran the package (only the programs' description)
    assert set(want["lazyharvest modules"]) <= WITHOUT_MODULES
    assert "lazyharvest.derivative_sites" in got["lazyharvest modules"]
    assert set(got["programs"]) == set(want["programs"]) | {
        SOWN + name for name in want["programs"] if name.startswith("random ")}
    bad: list[str] = []
    for name, w in want["programs"].items():
        bad += _differences(name, got["programs"][name], w)
    for what in ("depths", "tracebacks", "live arrays at the end"):
        if got[what] != want[what]:
            bad.append(f"{what}: {got[what]!r} != {want[what]!r}")
    others = len(want["programs"]) - n_random
    print(f"compared {len(want['programs'])} programs ({n_random} random ones, {others} "
          f"models and issue programs), {len(want['depths'])} stack depths, "
          f"{len(want['tracebacks'])} filtered tracebacks")
    assert n_random >= 12 and others >= 10 and len(want["depths"]) >= 10
    assert not bad, "importing lazyharvest changed:\n" + "\n".join(bad)


def _sown_pairs(records):
    got, want, _ = records
    for name, rec in got["programs"].items():
        if name.startswith(SOWN):
            plain = want["programs"][name[len(SOWN):]]
            for t, g in rec.items():
                yield f"{name} [{t}]", t, g, plain[t]


def _outcome(r: dict) -> str | None:
    """The error tracing or running it raised, None if it ran."""
    if r["primitives"] is None:
        return r["jaxpr"]
    return r["value"] if isinstance(r["value"], str) else None


def _index(where: str) -> int:
    return int(where.split("random ")[1].split(" ")[0])


def _program(where: str):
    """The random program a record's name (`sown: random 3 [jvp]`) names."""
    return T.random_programs.Program(*_programs()[_index(where)])


def _value_jax_means(where: str, t: str):
    """The sow-free random program of `where` under transformation `t`, run
    here with the harvest's DCE rule (`_jax.ref_writing_hi_prims_kept`): what
    JAX computes where its DCE does not drop a scan that only writes its
    carry (`jax_jits_scan3_wrongly`)."""
    from import_differential import _IDENTITY, transforms

    from lazyharvest.testing import _oracle
    prog, i = _program(where), _index(where)
    real, _oracle.lh = _oracle.lh, _IDENTITY
    try:
        with _jax.ref_writing_hi_prims_kept():
            fn, args = prog.fn, prog.example_args(i)
            return jax.jit(lambda *a: transforms()[t](lambda *b: fn(*b), a))(*args)
    finally:
        _oracle.lh = real


@slow
def test_sow_outside_a_harvest_changes_no_value(records):
    """Where both run, a program with lazyharvest's sites computes what it
    computes without them, under every transformation (where JAX drops a
    scan, what it computes without dropping it)."""
    compared, bad, dropped, reversed_ = 0, [], 0, 0
    for where, t, g, w in _sown_pairs(records):
        if _outcome(g) is None and _outcome(w) is None:
            compared += 1
            if _same_values(g["value"], w["value"], exact=False):
                continue
            if jax_ignores_scan3_reverse() and "reverse_scan" in _program(where).constructs:
                reversed_ += 1  # (the sites' Scan3 runs as a scan, which honours `reverse`)
            elif jax_jits_scan3_wrongly() and _same_values(
                    g["value"], _value_jax_means(where, t), exact=False):
                dropped += 1
            else:
                bad.append(where)
    print(f"compared the values of {compared} transformed programs with and without sites "
          f"({dropped} where JAX without sites dropped a scan, {reversed_} where it ran a "
          f"reverse scan forward)")
    assert compared >= 50
    assert not bad, "sites outside a harvest changed values:\n" + "\n".join(bad)


ANY_OUTCOME = "(ran or raised)"


def _matches(outcome: str | None, pattern: str | None) -> bool:
    """Whether `outcome` (an error, None if it ran) is the one `pattern`
    names (a regular expression; None: it ran; `ANY_OUTCOME`)."""
    if pattern == ANY_OUTCOME:
        return True
    if pattern is None or outcome is None:
        return pattern is None and outcome is None
    return re.search(pattern, outcome) is not None


LEAK_REPORT = "a Scan3 with sites runs as a scan writing a Ref, which JAX's leak checker reports"
CONSTANT_SCAN3 = "a constant Scan3 kept for its sites in a checkpoint, which JAX cannot split"
SCAN3_HAS_NO_RULE = r"subclass <class '[\w.]*Scan3'> must implement"

# Open (found by this test, docs/semantics.md section 2a): a program with
# sites raises where it runs without them, outside any harvest, when a site
# keeps JAX from dropping or skipping a part it cannot differentiate, or
# keeps a trace's tracers where JAX keeps the trace. Any other difference
# fails.
DIFFERENTIATING = {"grad", "vjp", "jvp", "linearize", "checkpoint"}
KNOWN_ERRORS = {  # (transformations, the sown side's error, the plain side's or None)
    # a dead site keeps the tangent of a custom_vjp call JAX would drop (or a
    # zero tangent given to a constant construct reaches one): forward mode
    # cannot run it
    "forward mode through a custom_vjp call kept for a site": (
        {"jvp", "linearize"}, r"can't apply forward-mode autodiff \(jvp\) to a custom_vjp",
        None),
    # a zero tangent given to a constant construct holding sites keeps every
    # input of it, the output of a while loop JAX skipped among them
    "reverse mode through a while loop feeding a constant construct with sites": (
        {"grad", "vjp", "checkpoint"},
        r"Reverse-mode differentiation does not work for lax\.while_loop", None),
    # JAX's memoized thunks of a custom rule keep the partial evaluation's
    # trace alive (in its caches), and with it the effect handles that keep
    # the sites' eqns, which hold tracers of traces that ended
    "leak checks: JAX's memoized custom-rule thunks keep the sites' effect handles": (
        DIFFERENTIATING,
        r"Leaked trace .*\(via .*(jvp_jaxpr_thunk|fwd_jaxpr_from_zeros|fwd_jaxpr_thunk)", None),
    # (jax_scan3) a Scan3 holding sites is bound as the scan it stands for
    # (section 10d), which JAX can batch and differentiate where it has no
    # rule for Scan3: the program with sites runs...
    "a Scan3 with sites runs as a scan where JAX has no rule for Scan3": (
        DIFFERENTIATING | {"vmap"}, None, SCAN3_HAS_NO_RULE),
    # ...but that scan writes its carry Ref, and JAX's leak checker reports
    # such a scan under differentiation (JAX alone, every flag off, where
    # `jax_reports_ref_writing_scans_as_leaks`), where JAX alone raises that
    # Scan3 has no rule, or differentiates the Scan3 in a checkpoint
    LEAK_REPORT: (DIFFERENTIATING, r"Leaked trace JaxprTrace", ANY_OUTCOME),
    # a constant site gives a tangent to a constant Scan3 in a checkpoint
    # (JAX alone leaves it to the known half), whose carry Ref the
    # checkpoint's partial evaluation then cannot split (the flag-off scan
    # has no Ref)
    CONSTANT_SCAN3: (
        {"checkpoint"}, r"Mutating a reference with unknown/differentiated values", None),
}
SCAN3_ONLY = {LEAK_REPORT, CONSTANT_SCAN3}  # (their errors are known with jax_scan3 on only)


@slow
def test_sow_outside_a_harvest_raises_only_known_errors(records):
    """A program with lazyharvest's sites, outside a harvest, raises where
    it raises without them, or (open) an error of `KNOWN_ERRORS`."""
    scan3 = bool(jax.config.values.get("jax_scan3"))
    known_errors = {k: v for k, v in KNOWN_ERRORS.items() if k not in SCAN3_ONLY or scan3 and (
        k != LEAK_REPORT or jax_reports_ref_writing_scans_as_leaks())}
    bad, known = [], {k: 0 for k in known_errors}
    for where, t, g, w in _sown_pairs(records):
        err, plain = _outcome(g), _outcome(w)
        if err == plain:
            continue
        kind = next((k for k, (ts, sown, alone) in known_errors.items()
                     if t in ts and _matches(err, sown) and _matches(plain, alone)), None)
        if kind is None:
            bad.append(f"{where}: {err!r} != {plain!r}")
        else:
            known[kind] += 1
    print(f"known open differences: {known}")
    assert not bad, "sites outside a harvest changed what raises:\n" + "\n".join(bad)
