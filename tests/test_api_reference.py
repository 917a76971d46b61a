"""docs/api.md covers every public name, with the signatures the code has, and
its examples run."""

import ast
import importlib
import importlib.util
import inspect
import pathlib
import re

import jax
import pytest

import lazyharvest as lh

API = pathlib.Path(__file__).parent.parent / "docs" / "api.md"
HEADING = re.compile(r"^(#{3,4}) `(?P<name>[\w.]+)(?P<params>\(.*\))?`\s*$", flags=re.M)
BLOCK = re.compile(r"(?:^<!-- needs: (?P<needs>[\w.]+) -->\n)?^```python\n(?P<code>.*?)^```",
                   flags=re.S | re.M)
OWNERS = {"lh": "lazyharvest", "testing": "lazyharvest.testing", "plot": "lazyharvest.plot"}


def headings():
    return [(m["name"], m["params"]) for m in HEADING.finditer(API.read_text())]


def resolve(dotted):
    """The object a heading names, and whether its first parameter (self) is dropped."""
    owner, attr = dotted.split(".", 1)
    if owner == "d":
        return getattr(lh.DelayedDict, attr), True
    return getattr(importlib.import_module(OWNERS[owner]), attr), False


def written(params):
    """(name, kind, default) of each parameter of a signature as written."""
    args = ast.parse(f"def _{params}: pass").body[0].args
    kind = inspect.Parameter
    out = []
    pos = args.posonlyargs + args.args
    defaults = [inspect.Parameter.empty] * (len(pos) - len(args.defaults)) + [
        ast.literal_eval(d) for d in args.defaults]
    for i, (a, d) in enumerate(zip(pos, defaults)):
        k = kind.POSITIONAL_ONLY if i < len(args.posonlyargs) else kind.POSITIONAL_OR_KEYWORD
        out.append((a.arg, k, d))
    if args.vararg:
        out.append((args.vararg.arg, kind.VAR_POSITIONAL, kind.empty))
    for a, d in zip(args.kwonlyargs, args.kw_defaults):
        out.append((a.arg, kind.KEYWORD_ONLY,
                    kind.empty if d is None else ast.literal_eval(d)))
    if args.kwarg:
        out.append((args.kwarg.arg, kind.VAR_KEYWORD, kind.empty))
    return out


def actual(obj, drop_self):
    params = list(inspect.signature(obj).parameters.values())
    return [(p.name, p.kind, p.default) for p in params[1 if drop_self else 0:]]


def test_every_public_name_has_a_heading():
    documented = {name.split(".", 1)[1] for name, _ in headings() if name.startswith("lh.")}
    missing = set(lh.__all__) - {"__version__"} - documented
    assert not missing, f"docs/api.md has no ### heading for {sorted(missing)}"


def test_methods_testing_and_plot_are_documented():
    documented = {name for name, _ in headings()}
    for name in ("compute", "lower", "fn", "thunk", "aliases", "is_computed", "summary",
                 "keys", "_repr_html_"):
        assert f"d.{name}" in documented
    for name in ("check_all", "check_linearize", "check_jvp", "check_vmap", "check_jit",
                 "check_vjp", "check_roundtrip", "check_lazy", "check_compute",
                 "check_nest", "programs", "inputs", "transform_stacks"):
        assert f"testing.{name}" in documented
    assert {"plot.site_norms", "plot.attention_grid"} <= documented


@pytest.mark.parametrize("name,params", [h for h in headings() if h[1]],
                         ids=[h[0] for h in headings() if h[1]])
def test_signature_matches_the_code(name, params):
    obj, drop_self = resolve(name)
    wrapped = getattr(obj, "__wrapped__", None)
    if wrapped is not None and wrapped is getattr(jax, name.split(".")[-1], None) and \
            jax.__version__ != "0.10.2":
        # docs/api.md writes jax 0.10.2's signature; on another JAX a recorded
        # transform takes that JAX's own
        assert actual(obj, drop_self) == actual(wrapped, False), (
            f"{name} does not take jax {jax.__version__}'s signature of {wrapped.__name__}")
        return
    assert written(params) == actual(obj, drop_self), (
        f"{name}{params} in docs/api.md; the code has {inspect.signature(obj)}")


def test_examples_run_in_order():
    namespace: dict = {"__name__": "api_reference"}
    found = [(m["needs"], m["code"]) for m in BLOCK.finditer(API.read_text())]
    assert len(found) >= 25
    for needs, code in found:
        if needs and importlib.util.find_spec(needs) is None:
            continue
        exec(compile(code, str(API), "exec"), namespace)  # noqa: S102
