"""The shape of the code: rule tables keyed by primitives, no import cycle,
one place for JAX internals, names kept in the HLO, short user tracebacks."""

import ast
import pathlib
import traceback

import jax
import jax.numpy as jnp
import pytest

import lazyharvest as lh
from lazyharvest import _interpreter, _jax
from lazyharvest.recorded import recorded_p

PKG = pathlib.Path(lh.__file__).parent


def _modules():
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        yield ".".join(parts), path


def _imports(name, path, modules=None):
    """Modules of lazyharvest that `name` imports, in functions too."""
    modules = modules or dict(_modules())
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                out.add(sub if sub in modules else node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {m for m in out if m.startswith("lazyharvest")}


def test_no_import_cycle_among_modules():
    mods = dict(_modules())
    graph = {m: sorted(i for i in _imports(m, p) if i in mods and i != m)
             for m, p in mods.items()}
    state: dict = {}

    def visit(m, stack):
        state[m] = "open"
        for n in graph[m]:
            if state.get(n) == "open":
                raise AssertionError(f"import cycle: {' -> '.join(stack + [m, n])}")
            if n not in state:
                visit(n, stack + [m])
        state[m] = "done"

    for m in graph:
        if m not in state:
            visit(m, [])


def test_rule_tables_are_keyed_by_primitive_objects():
    tables = {"EVAL_RULES": _interpreter.EVAL_RULES, "COUNT_RULES": _interpreter.COUNT_RULES}
    for name, table in tables.items():
        assert table, name
        for prim, rule in table.items():
            assert isinstance(prim, _jax.Primitive), (name, prim)
            assert callable(rule)
    expected = {_jax.jit_p, _jax.scan_p, _jax.while_p, _jax.cond_p, _jax.remat_p,
                _jax.closed_call_p, _jax.custom_jvp_call_p, _jax.custom_vjp_call_p,
                _jax.shard_map_p, recorded_p}
    assert expected <= set(_interpreter.EVAL_RULES)


def test_no_dispatch_on_primitive_name_strings():
    for _, path in _modules():
        src = path.read_text()
        assert "primitive.name ==" not in src and ".name in (" not in src.replace(
            "self.name in (", ""), path


def test_only_the_compatibility_layer_imports_jax_internals():
    internal = ("jax._src", "jax.extend", "jax.interpreters")
    offenders = []
    for name, path in _modules():
        if name == "lazyharvest._jax" or name.startswith("lazyharvest._jax."):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            mods = []
            if isinstance(node, ast.ImportFrom) and node.module:
                mods = [node.module]
            elif isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            offenders += [(name, m) for m in mods if m.startswith(internal)]
    assert not offenders


def _scoped(x):
    with jax.named_scope("block_a"):
        h = lh.sow(jnp.sin(x) * 2, tag="t", name="h")
    with jax.named_scope("block_b"):
        return jnp.cos(h).sum()


@pytest.mark.parametrize("which", ["plant", "call_and_reap"])
def test_named_scopes_survive_in_harvested_hlo(which):
    x = jnp.ones(3)
    if which == "plant":
        g = lambda x: lh.plant(_scoped, tag="t")({}, x)
    else:
        g = lambda x: lh.call_and_reap(_scoped, tag="t")(x)[0]
    text = jax.jit(g).lower(x).as_text(debug_info=True)
    assert "block_a" in text and "block_b" in text


def test_named_scopes_survive_in_a_leaf_program():
    d = lh.reap(_scoped, tag="t")(jnp.ones(3))
    assert "block_a" in d.lower("h").as_text(debug_info=True)


def test_user_tracebacks_hide_library_frames():
    def f(x):
        lh.sow(x, tag="t", name="a")
        lh.sow(x, tag="t", name="a")
        return x
    with pytest.raises(lh.HarvestError) as info:
        lh.reap(f, tag="t")(1.)
    files = [fr.filename for fr in traceback.extract_tb(info.value.__traceback__)]
    assert not [f for f in files if f.startswith(str(PKG))], files


def test_version_comes_from_package_metadata():
    from importlib import metadata
    assert lh.__version__ == metadata.version("lazyharvest")


def test_public_names_are_exported():
    assert lh.HarvestKeyError is not None and issubclass(lh.HarvestKeyError, KeyError)
    for name in lh.__all__:
        assert hasattr(lh, name), name
