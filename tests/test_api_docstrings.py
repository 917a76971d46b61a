"""Public docstrings: Arguments/Returns/Raises sections, and examples that run."""

import doctest
import inspect

import jax
import pytest

import lazyharvest as lh

# Not functions, or documented in their own style elsewhere: `DelayedDict`
# (delayed.py). `sow_modules`'s example needs equinox: run only when installed.
NOT_HERE = {"__version__", "HarvestError", "HarvestKeyError", "DelayedDict"}
try:
    import equinox  # noqa: F401
except ImportError:
    NOT_HERE.add("sow_modules")
PUBLIC = sorted(set(lh.__all__) - NOT_HERE)
FUNCTION_TRANSFORMS = ["grad", "value_and_grad", "jacfwd", "jacrev", "hessian", "vmap"]


def test_public_names_are_functions_or_classes():
    for name in PUBLIC:
        obj = getattr(lh, name)
        assert inspect.isfunction(obj) or inspect.isclass(obj), name


@pytest.mark.parametrize("name", PUBLIC)
def test_docstring_has_sections_and_an_example(name):
    doc = getattr(lh, name).__doc__
    assert doc, name
    for section in ("**Arguments:**", "**Returns:**", "**Raises:**", "**Example:**"):
        assert section in doc, (name, section)
    assert "\n>>> " in inspect.cleandoc(doc), name


@pytest.mark.parametrize("name", PUBLIC)
def test_docstring_examples_run(name):
    tests = doctest.DocTestFinder(recurse=False).find(
        getattr(lh, name), name=f"lazyharvest.{name}", globs={})
    assert sum(len(t.examples) for t in tests) > 0, name
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE)
    report: list[str] = []
    for t in tests:
        runner.run(t, out=report.append)
    assert runner.summarize(verbose=False).failed == 0, "".join(report)


@pytest.mark.parametrize("name", FUNCTION_TRANSFORMS)
def test_function_transforms_keep_jax_signature(name):
    ours, theirs = getattr(lh, name), getattr(jax, name)
    assert ours.__wrapped__ is theirs
    assert inspect.signature(ours) == inspect.signature(theirs)
    assert ours.__doc__ != theirs.__doc__


DELAYED_METHODS = ["thunk", "fn", "is_computed", "aliases", "compute", "lower", "avals",
                   "summary"]


@pytest.mark.parametrize("name", [None, *DELAYED_METHODS])
def test_delayed_dict_docstrings_have_a_running_example(name):
    obj = lh.DelayedDict if name is None else getattr(lh.DelayedDict, name)
    obj = obj.fget if isinstance(obj, property) else obj
    assert "Example" in obj.__doc__, name
    if name in (None, "summary"):
        return  # the class example runs below; summary's is prose
    tests = doctest.DocTestFinder(recurse=False).find(obj, name=str(name), globs={})
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE)
    report: list[str] = []
    for t in tests:
        runner.run(t, out=report.append)
    results = runner.summarize(verbose=False)
    assert results.attempted > 0 and results.failed == 0, "".join(report)


def test_delayed_dict_class_example_runs():
    tests = doctest.DocTestFinder(recurse=False).find(lh.DelayedDict, globs={})
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE)
    for t in tests:
        runner.run(t)
    assert runner.summarize(verbose=False).failed == 0
