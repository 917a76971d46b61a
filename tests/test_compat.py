"""The compatibility layer: only `lazyharvest/_jax/` reaches JAX internals,
the declared JAX range is the one the layer supports, and the accessors that
hide version differences agree with plain JAX on the running version."""

import ast
import pathlib
import re
import subprocess
import sys
import tomllib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import lazyharvest as lh
from helpers import close
from lazyharvest import _jax

ROOT = pathlib.Path(__file__).resolve().parent.parent
INTERNAL = ("jax._src", "jax.extend", "jax.interpreters")
LAYER = ROOT / "lazyharvest" / "_jax"


# --- imports: an ast walk over every file ----------------------------------------------

def _dotted(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


def _internal(name: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in INTERNAL)


def internal_uses(source: str) -> list[tuple[int, str]]:
    """(line, what) for each way `source` reaches jax._src, jax.extend or
    jax.interpreters: imports, `from jax import _src`, attribute access through
    a name bound to the jax module, importlib.import_module / __import__."""
    tree = ast.parse(source)
    jax_names = set()  # names bound to the jax module itself
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "jax" or (a.asname is None and a.name.startswith("jax.")):
                    jax_names.add(a.asname or "jax")
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if _internal(a.name)]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if _internal(node.module):
                found.append((node.lineno, node.module))
            elif node.module == "jax":
                found += [(node.lineno, f"jax.{a.name}") for a in node.names
                          if _internal(f"jax.{a.name}")]
        elif isinstance(node, ast.Attribute):
            name = _dotted(node)
            if name and name.split(".")[0] in jax_names:
                name = "jax." + name.split(".", 1)[1]
                if _internal(name) and not _internal(name.rsplit(".", 1)[0]):
                    found.append((node.lineno, name))
        elif isinstance(node, ast.Call) and node.args:
            fn = node.func
            fname = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", None)
            arg = node.args[0]
            if (fname in ("import_module", "__import__") and isinstance(arg, ast.Constant)
                    and isinstance(arg.value, str) and _internal(arg.value)):
                found.append((node.lineno, arg.value))
    return sorted(found)


def test_the_walk_finds_every_form():
    src = "\n".join([
        "import jax",
        "import jax.extend.core",                      # 2
        "import jax._src.core as c",                   # 3
        "from jax.interpreters import ad",             # 4
        "from jax import _src, numpy",                 # 5
        "from jax import extend as e",                 # 6
        "x = jax.interpreters.batching",               # 7
        "import importlib",
        "m = importlib.import_module('jax._src.config')",  # 9
        "n = __import__('jax.extend')",                # 10
        "import jax as J",
        "y = J._src.core",                             # 12
        "import jax.numpy as jnp, jax.api_util",       # fine
        "z = jax.numpy.sin, jax.tree_util.tree_map",   # fine
    ])
    assert [line for line, _ in internal_uses(src)] == [2, 3, 4, 5, 6, 7, 9, 10, 12]


def _sources() -> list[pathlib.Path]:
    files = [p for d in ("lazyharvest", "tests", "benchmarks", "scripts")
             for p in sorted((ROOT / d).rglob("*.py"))]
    assert (LAYER / "core.py") in files and len(files) > 10
    return files


def test_only_the_compatibility_layer_reaches_jax_internals():
    offenders = {str(p.relative_to(ROOT)): uses for p in _sources() if LAYER not in p.parents
                 for uses in [internal_uses(p.read_text())] if uses}
    assert offenders == {}, (
        f"JAX internals outside lazyharvest/_jax/: {offenders}. Add an accessor "
        f"to the layer (docs/compat.md) and call that.")
    assert internal_uses((LAYER / "core.py").read_text())  # the walk sees the layer's own


# --- the declared range -------------------------------------------------------------

def _declared(package: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (spec,) = [d for d in deps if re.match(rf"{package}\b(?![-_])", d)]
    m = re.fullmatch(rf"{package}\s*>=\s*([\d.]+)\s*,\s*<\s*([\d.]+)", spec.replace(" ", ""))
    assert m, f"{spec!r} is not of the form {package}>=LOW,<HIGH"
    return _jax.parse_version(m.group(1)), _jax.parse_version(m.group(2))


def test_declared_range_is_the_layers():
    low, high = _declared("jax")
    assert _declared("jaxlib") == (low, high)
    assert low == _jax.MIN_JAX_VERSION
    assert all(low <= v < high for v in _jax.TESTED_JAX_VERSIONS)
    assert low == min(_jax.TESTED_JAX_VERSIONS)
    assert low <= _jax.JAX_VERSION < high, f"running on jax {jax.__version__}"
    assert _jax.parse_version(jax.__version__) == _jax.JAX_VERSION


def test_parse_version():
    assert _jax.parse_version("0.8.3") == (0, 8, 3)
    assert _jax.parse_version("0.9.0.1") == (0, 9, 0)
    assert _jax.parse_version("0.10.3.dev20260101") == (0, 10, 3)
    assert _jax.parse_version("0.11.0rc1") == (0, 11, 0)


def test_require_names_the_version_needed():
    _jax.require(_jax.MIN_JAX_VERSION, "lazyharvest")
    _jax.require(_jax.JAX_VERSION, "this feature")
    with pytest.raises(lh.HarvestError,
                       match=rf"a feature needs jax >= 99\.1; this is jax "
                             rf"{re.escape(jax.__version__)}"):
        _jax.require((99, 1), "a feature")


def test_import_on_an_older_jax_names_the_version_needed():
    code = ("import jax; jax.__version__ = '0.8.2'\n"
            "try:\n    import lazyharvest\n"
            "except Exception as e:\n    print(type(e).__name__, e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(
        "HarvestError lazyharvest needs jax >= 0.8.3; this is jax 0.8.2."), out.stdout


# --- accessors that hide version differences, against plain JAX -----------------------

@jax.custom_jvp
def _cjvp(x):
    return jnp.sin(x)


_cjvp.defjvp(lambda p, t: (_cjvp(p[0]), 3. * t[0]))  # a rule that is not sin's


@jax.custom_vjp
def _cvjp(x):
    return jnp.cos(x)


_cvjp.defvjp(lambda x: (_cvjp(x), x), lambda x, g: (5. * g * x,))


def _program(x):
    y = jax.jit(lambda a: a * 2.)(x)
    y = lax.cond(y > 0., lambda a: a + 1., lambda a: a - 1., y)
    z, _ = lax.scan(lambda c, a: (c * a, None), y, jnp.arange(1., 3.))
    return _cjvp(z) + _cvjp(x) + _jax.closed_call(lambda a: [a * a], x)[0]


def _rebound(fn):
    """`fn` evaluated eqn by eqn through `_jax.bind_eqn`."""
    closed = jax.make_jaxpr(fn)(1.)

    def run(*args):
        env = dict(zip(closed.jaxpr.constvars, closed.consts))
        env.update(zip(closed.jaxpr.invars, args))
        read = lambda v: v.val if isinstance(v, _jax.Literal) else env[v]  # noqa: E731
        for eqn in closed.jaxpr.eqns:
            outs = _jax.bind_eqn(eqn, [read(v) for v in eqn.invars])
            outs = outs if eqn.primitive.multiple_results else [outs]
            env.update(zip(eqn.outvars, outs))
        return read(closed.jaxpr.outvars[0])
    return run, {e.primitive.name for e in closed.jaxpr.eqns}


@pytest.mark.usefixtures("default_staging")
def test_bind_eqn_rebinds_calls_with_their_rules():
    run, prims = _rebound(_program)
    assert {"custom_jvp_call", "custom_vjp_call", _jax.closed_call_p.name, "jit", "cond",
            "scan"} <= prims
    for x in (0.7, -0.4):
        close(run(x), _program(x))
        close(jax.grad(run)(x), jax.grad(_program)(x))
        close(jax.vjp(run, x)[1](2.), jax.vjp(_program, x)[1](2.))
        close(jax.jit(run)(x), _program(x))
    # the custom rules are in force, not the derivatives of sin and cos:
    # z = 2 * (2x + 1) for x > 0, so d/dx = 3 * 4 (custom_jvp) + 5x (custom_vjp) + 2x
    x = 0.7
    close(jax.grad(run)(x), 3. * 4. + 5. * x + 2. * x)


@pytest.mark.usefixtures("default_staging")
def test_bind_params_has_the_subfuns_of_a_call():
    closed = jax.make_jaxpr(_cjvp)(1.)
    (eqn,) = closed.jaxpr.eqns
    params = _jax.bind_params(eqn)
    assert isinstance(params, dict) and len(params["subfuns"]) == 2
    closed = jax.make_jaxpr(jnp.sin)(1.)
    assert "subfuns" not in _jax.bind_params(closed.jaxpr.eqns[0])


needs_8 = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices")


@needs_8
@pytest.mark.parametrize("check_vma", [True, False])
def test_shard_map_params_and_varying_axes(check_vma):
    auto = jax.sharding.AxisType.Auto
    mesh = jax.make_mesh((4, 2), ("x", "y"), axis_types=(auto, auto))
    sm = jax.shard_map(lambda a, b: (a * 2., b), mesh=mesh, in_specs=(P("x"), P()),
                       out_specs=(P("x"), P()), check_vma=check_vma)
    closed = jax.make_jaxpr(sm)(jnp.arange(8.), jnp.ones(3))
    (eqn,) = [e for e in closed.jaxpr.eqns if e.primitive.name == "shard_map"]
    body, m, manual, check = _jax.shard_map_params(eqn)
    assert m == mesh and manual == frozenset({"x", "y"}) and check is check_vma
    a, b = (v.aval for v in body.invars)
    assert a.shape == (2,) and b.shape == (3,)
    assert _jax.varying_axes(a) == (frozenset({"x"}) if check_vma else frozenset())
    assert _jax.varying_axes(b) == frozenset()
    assert _jax.varying_axes(jax.typeof(np.float32(1.))) == frozenset()


def test_transposes_wrapped_even_if_jax_differentiated_a_jit_before_the_import():
    """jax >= 0.12 copies jit's transpose rule into a VJP node the first time
    `jax.vjp` meets a jit; lazyharvest's rule must be in force there too when
    that happened before `import lazyharvest`."""
    code = "\n".join([
        "import jax, jax.numpy as jnp",
        "jax.vjp(jax.jit(jnp.sin), 1.0)[1](1.0)",  # before the import
        "import lazyharvest",
        "from lazyharvest import _jax",
        "from lazyharvest._jax import differentiation as d",
        "node = getattr(d._ad, 'vjp_node', None)",
        "if node is not None:",
        "    rule = d._ad.fancy_transposes[node(_jax.jit_p)]",
        "    assert getattr(rule, '_lazyharvest', False), rule",
        "print('ok', node is not None)",
    ])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert out.returncode == 0 and out.stdout.startswith("ok"), out.stderr[-2000:]
