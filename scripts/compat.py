#!/usr/bin/env python3
"""Runs the test suite on each supported JAX version, one venv per version.

    python scripts/compat.py                      # every tested version: full suite
    python scripts/compat.py --fast 0.8.3 0.9.2   # the fast subset (-m "not slow")
    python scripts/compat.py --fast --parallel 0.8.3 0.9.2 0.11.2   # at once (as CI)
    python scripts/compat.py --extras test,full 0.12.0.1@3.12       # JAX@Python
    python scripts/compat.py 0.9.2 -- -x tests/test_sharding.py   # pytest arguments
    python scripts/compat.py --parallel 0.8.3:fast 0.9.2:layer    # a subset per version
    python scripts/compat.py --extras test,full newest@3.12       # the newest release (as CI)

A version may name its subset after a colon: `:full` (the whole suite),
`:fast` (-m "not slow") or `:layer` (LAYER_TESTS: the tests of what the
compatibility layer reads and of the behaviour that branches on it, about
a minute). Without one, --fast says which. A version may name the Python its
venv is made from: `0.12.0.1@3.12` (a
version found as `python3.12` on PATH or under pyenv's versions), or
`0.12.0.1@/path/to/python`. Without one, jax >= 0.11 (which needs Python
>= 3.12) takes Python 3.12 and older JAX this interpreter (--python).

The version `newest` is not pinned: it installs the newest jax and jaxlib
that pip resolves within the range pyproject.toml declares, and the newest
releases of the `full` extra's libraries (Flax, Equinox, diffrax...: their
pins dropped) and of every other dependency (`pip install -U
--upgrade-strategy eager`), again on every run, so a new release that breaks
something fails the next run. It takes Python 3.12 unless told.

For each version it makes (or reuses) a venv under the cache directory
(--cache-dir, $LAZYHARVEST_COMPAT_DIR, or ~/.cache/lazyharvest-compat),
installs `jax==V jaxlib==V` and this checkout with the extras named by
--extras from PyPI (default `test`: `pip install -e ".[test]"`, so pip also
checks V against the declared range), prints the versions it resolved
(Python, jax, jaxlib, numpy, flax, equinox, diffrax, lineax, optimistix),
then runs pytest from
the repository root. At the end it prints one row per version: passed /
failed / errors / skipped / xfailed / xpassed, the suite's wall-clock seconds
and CPU seconds (user + sys; on a shared machine the wall clock also counts
waiting for a core), and the setup seconds; then the versions each venv
resolved.

Exit status: 0 when every suite passed; 1 when a suite failed; 2 when a venv
could not be set up (a Python that cannot be found says which and how to get
it). Needs Python >= 3.11 with the venv module and access to PyPI. See
docs/compat.md.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import shutil
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
DEFAULT_VERSIONS = ("0.8.3", "0.9.2", "0.10.2", "0.11.2",
                    "0.12.0.1", "0.12.1")  # lazyharvest/_jax/versions.py: TESTED_JAX_VERSIONS
# Not a version: the newest jax/jaxlib pip resolves within the declared range,
# with the newest releases of every other dependency (refreshed on each run).
NEWEST = "newest"
# The distributions whose versions a venv's setup prints.
REPORTED = ("jax", "jaxlib", "numpy", "flax", "equinox", "diffrax", "lineax", "optimistix")
# JAX from 0.11 on needs Python >= 3.12: the Python its venvs are made from
# unless a version names one.
NEWER_JAX_PYTHON = "3.12"
# The `layer` subset: the contract tests of every JAX internal the layer
# reads, the layer's own tests and the JAX flags, and the behaviour that
# branches on its probes (every higher-order primitive under every
# transformation, dead and constant sites, custom rules).
LAYER_TESTS = ("tests/jax_contracts", "tests/test_compat.py", "tests/test_jax_flags.py",
               "tests/test_matrix.py", "tests/test_dead_constant_sites.py",
               "tests/test_custom_compose.py")
SUBSETS = ("full", "fast", "layer")
COUNTS = ("passed", "failed", "errors", "skipped", "xfailed", "xpassed")


def default_cache_dir() -> pathlib.Path:
    env = os.environ.get("LAZYHARVEST_COMPAT_DIR")
    if env:
        return pathlib.Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return pathlib.Path(base) / "lazyharvest-compat"


def run(cmd: list[str], log) -> int:
    """Runs a setup command into the log; prints its output only if it fails."""
    print("$", " ".join(map(str, cmd)), flush=True)
    log.write("$ " + " ".join(map(str, cmd)) + "\n")
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log.write(proc.stdout)
    log.flush()
    if proc.returncode != 0:
        print(proc.stdout[-5000:], flush=True)
    return proc.returncode


def find_python(spec: str) -> str | None:
    """An interpreter for `spec`: a path, or a version such as "3.12" found as
    `python3.12` on PATH or as pyenv's `versions/3.12.*/bin/python`."""
    if os.sep in spec:
        return spec if os.access(spec, os.X_OK) else None
    roots = [os.environ.get("PYENV_ROOT"), str(pathlib.Path.home() / ".pyenv")]
    for root in filter(None, roots):
        versions = pathlib.Path(root) / "versions"
        matches = sorted(versions.glob(f"{spec}.*/bin/python"), reverse=True) + sorted(
            versions.glob(f"{spec}/bin/python"))
        if matches:
            return str(matches[0])
    # (a pyenv shim on PATH runs only the versions pyenv has selected: ask it)
    found = shutil.which(f"python{spec}")
    if found and subprocess.run([found, "-c", ""], capture_output=True).returncode == 0:
        return found
    return None


def python_for(version: str, default: str) -> tuple[str, str | None]:
    """(the JAX version, the interpreter for its venv, or None if missing)."""
    version, _, spec = version.partition("@")
    if not spec and (version == NEWEST
                     or tuple(int(p) for p in version.split(".")[:2]) >= (0, 11)):
        spec = NEWER_JAX_PYTHON
    return version, (find_python(spec) if spec else default)


def unpinned(extras: str) -> list[str]:
    """The requirements of pyproject.toml's `extras` (comma-separated) without
    their version pins and markers: `flax==0.12.12; python_version >= '3.12'`
    gives `flax`."""
    import tomllib
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    names: list[str] = []
    for extra in filter(None, extras.split(",")):
        for req in declared[extra]:
            name = re.match(r"[A-Za-z0-9._-]+", req.strip())
            if name and name.group() not in names:
                names.append(name.group())
    return names


def venv_python(venv: pathlib.Path) -> pathlib.Path:
    return venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def install_command(py: pathlib.Path, version: str, extras: str) -> list[str]:
    """Pinned: this checkout with `extras` and `jax==V jaxlib==V`. `newest`:
    this checkout with the `test` extra, and jax, jaxlib and the other extras'
    libraries unpinned, all upgraded to the newest pip resolves (jax within
    the declared range)."""
    cmd = [str(py), "-m", "pip", "install", "-q"]
    if version != NEWEST:
        return cmd + ["-e", f"{ROOT}[{extras}]", f"jax=={version}", f"jaxlib=={version}"]
    rest = [e for e in extras.split(",") if e and e != "test"]
    return cmd + ["--upgrade", "--upgrade-strategy", "eager",
                  "-e", f"{ROOT}[test]" if "test" in extras.split(",") else str(ROOT),
                  "jax", "jaxlib", *unpinned(",".join(rest))]


_PROBE = ("import importlib.metadata as m, platform, lazyharvest\n"
          "def v(d):\n"
          "    try:\n"
          "        return m.version(d)\n"
          "    except m.PackageNotFoundError:\n"
          "        return '-'\n"
          "print(platform.python_version(), lazyharvest.__file__, "
          f"*(v(d) for d in {REPORTED!r}))")


def setup(version: str, venv: pathlib.Path, python: str, fresh: bool, extras: str,
          log) -> dict[str, str] | None:
    """Makes the venv and installs into it; returns the versions it resolved
    (Python and REPORTED; "-" for one not installed), or None."""
    if fresh and venv.exists():
        shutil.rmtree(venv)
    py = venv_python(venv)
    if not py.exists():
        if run([python, "-m", "venv", str(venv)], log) != 0:
            return None
        run([str(py), "-m", "pip", "install", "-q", "--upgrade", "pip"], log)
    if run(install_command(py, version, extras), log) != 0:
        return None
    probe = subprocess.run([str(py), "-c", _PROBE], cwd=ROOT, capture_output=True, text=True)
    log.write(probe.stdout + probe.stderr)
    if probe.returncode != 0:
        print(probe.stderr)
        return None
    py_v, where, *found = probe.stdout.split()
    resolved = {"Python": py_v, **dict(zip(REPORTED, found))}
    print(f"resolved: {describe(resolved)}; lazyharvest from {where}", flush=True)
    if version not in (NEWEST, resolved["jax"]) or not pathlib.Path(
            where).resolve().is_relative_to(ROOT):
        print(f"expected jax {version} and lazyharvest from {ROOT}")
        return None
    return resolved


def describe(resolved: dict[str, str]) -> str:
    return ", ".join(f"{k} {v}" for k, v in resolved.items())


def summary(output: str) -> dict[str, int]:
    """The counts of pytest's last summary line ('284 passed, 3 xfailed in ...')."""
    lines = [line for line in output.splitlines() if re.search(r" in [\d.]+s", line)
             and re.search(r"\d+ (passed|failed|error|skipped|deselected)", line)]
    counts = dict.fromkeys(COUNTS, 0)
    if lines:
        for n, word in re.findall(r"(\d+) (\w+)", lines[-1]):
            word = "errors" if word == "error" else word
            if word in counts:
                counts[word] = int(n)
    return counts


class Suite:
    """One version's pytest run, in its venv; its output also goes to its log.
    Run alone, it streams the output; started with others, its output goes to
    its log only (no pipe to fill) and is printed when it ends."""

    def __init__(self, version: str, venv: pathlib.Path, cache_dir: pathlib.Path,
                 pytest_args: list[str]):
        self.version = version
        self.cmd = [str(venv_python(venv)), "-m", "pytest", *pytest_args]
        self.log_path = cache_dir / f"jax-{version}.log"
        self.proc: subprocess.Popen | None = None
        self.t0 = 0.0
        self.offset = 0

    def start(self, echo: bool) -> None:
        print(f"$ {' '.join(self.cmd)}" + ("" if echo else f"   (jax {self.version}, "
                                             f"output when it ends)"), flush=True)
        self.t0 = time.perf_counter()
        if echo:
            self.proc = subprocess.Popen(self.cmd, cwd=ROOT, stdout=subprocess.PIPE,
                                         stderr=subprocess.STDOUT, text=True)
            return
        with open(self.log_path, "a") as log:
            self.offset = log.tell()
            self.proc = subprocess.Popen(self.cmd, cwd=ROOT, stdout=log,
                                         stderr=subprocess.STDOUT, text=True)

    def finish(self) -> tuple[int, str, float, float]:
        """Waits for the run; returns (exit status, output, seconds, CPU seconds).
        CPU seconds are the process's own (user + sys, from os.wait4; 0
        where the platform lacks it)."""
        assert self.proc is not None
        echo = self.proc.stdout is not None
        out: list[str] = []
        if echo:
            with open(self.log_path, "a") as log:
                for line in self.proc.stdout:  # type: ignore[union-attr]
                    sys.stdout.write(line)
                    log.write(line)
                    out.append(line)
        cpu = 0.0
        if hasattr(os, "wait4"):
            _, wait_status, usage = os.wait4(self.proc.pid, 0)
            self.proc.returncode = os.waitstatus_to_exitcode(wait_status)
            cpu = usage.ru_utime + usage.ru_stime
        rc = self.proc.wait()
        secs = time.perf_counter() - self.t0
        if not echo:
            with open(self.log_path) as log:
                log.seek(self.offset)
                out = [log.read()]
            print(f"\n=== jax {self.version}: pytest output", flush=True)
            sys.stdout.write(out[0])
        sys.stdout.flush()
        return rc, "".join(out), secs, cpu

    def run(self) -> tuple[int, str, float, float]:
        self.start(echo=True)
        return self.finish()


def pytest_args(subset: str, extra: list[str]) -> list[str]:
    args = ["-q", "-p", "no:cacheprovider"]
    if subset == "fast":
        args += ["-m", "not slow"]
    elif subset == "layer":
        args += list(LAYER_TESTS)
    return args + extra


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("versions", nargs="*", default=list(DEFAULT_VERSIONS),
                    help=f"JAX versions (default: {' '.join(DEFAULT_VERSIONS)})")
    ap.add_argument("--fast", action="store_true",
                    help='the fast subset: pytest -m "not slow"')
    ap.add_argument("--cache-dir", type=pathlib.Path, default=default_cache_dir(),
                    help="where the venvs live (default: %(default)s)")
    ap.add_argument("--fresh", action="store_true", help="recreate the venvs")
    ap.add_argument("--parallel", action="store_true",
                    help="run the versions' suites at once (one process each); each "
                         "suite's output is printed when it ends")
    ap.add_argument("--python", default=sys.executable,
                    help="interpreter the venvs of jax < 0.11 are made from (default: "
                         "this one)")
    ap.add_argument("--extras", default="test",
                    help="the extras installed with this checkout (default: %(default)s)")
    ap.add_argument("--which-python", metavar="VERSION",
                    help="print the interpreter found for VERSION (e.g. 3.12) and exit; "
                         "exit 2 naming what is missing if there is none")
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    args = ap.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    if args.which_python:
        found = find_python(args.which_python)
        if found is None:
            print(f"no Python {args.which_python} found (neither python{args.which_python} on "
                  f"PATH nor under pyenv's versions); jax >= 0.11 needs it: install it (e.g. "
                  f"`pyenv install {args.which_python}`)", file=sys.stderr)
            return 2
        print(found)
        return 0
    args.cache_dir.mkdir(parents=True, exist_ok=True)
    check = subprocess.run([args.python, "-c", "import sys; print(sys.version_info >= (3, 11))"],
                           capture_output=True, text=True)
    if check.stdout.strip() != "True":
        print(f"{args.python}: JAX >= 0.8 needs Python >= 3.11; pass --python", file=sys.stderr)
        return 2

    rows, status, t_start = [], 0, time.perf_counter()
    ready = []  # (version, venv, resolved versions, setup seconds, subset)
    for spec in args.versions:
        head, colon, tail = spec.rpartition(":")
        spec, subset = (head, tail) if colon and not set("/\\") & set(tail) else (spec, "")
        subset = subset or ("fast" if args.fast else "full")
        if subset not in SUBSETS:
            print(f"{spec}: no subset {subset!r} (one of {', '.join(SUBSETS)})",
                  file=sys.stderr)
            return 2
        version, python = python_for(spec, args.python)
        if python is None:
            print(f"jax {version}: no Python {spec.partition('@')[2] or NEWER_JAX_PYTHON} "
                  f"found (neither python{NEWER_JAX_PYTHON} on PATH nor under pyenv's "
                  f"versions): install it (e.g. `pyenv install {NEWER_JAX_PYTHON}`) or "
                  f"name one, as {version}@/path/to/python", file=sys.stderr, flush=True)
            rows.append((version, "-", subset, dict.fromkeys(COUNTS, 0), 0.0, 0.0, 0.0,
                         "NO PYTHON"))
            status = max(status, 2)
            continue
        py_v = subprocess.run([python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                              capture_output=True, text=True).stdout.strip()
        extras_tag = "" if args.extras == "test" else "-" + args.extras.replace(",", "-")
        venv = args.cache_dir / f"venv-jax-{version}-py{py_v}{extras_tag}"
        print(f"\n=== jax {version} on Python {py_v}: {venv}", flush=True)
        with open(args.cache_dir / f"jax-{version}.log", "w") as log:
            t0 = time.perf_counter()
            resolved = setup(version, venv, python, args.fresh, args.extras, log)
        if resolved is None:
            rows.append((version, "-", subset, dict.fromkeys(COUNTS, 0), 0.0, 0.0,
                         time.perf_counter() - t0, "SETUP FAILED"))
            status = max(status, 2)
        else:
            ready.append((version, venv, resolved, time.perf_counter() - t0, subset))
    suites = [Suite(v, venv, args.cache_dir, pytest_args(sub, extra))
              for v, venv, _, _, sub in ready]
    if args.parallel:
        for suite in suites:
            suite.start(echo=False)
    for suite, (version, _, resolved, t_setup, subset) in zip(suites, ready):
        subset += "+args" if extra else ""
        rc, out, secs, cpu = suite.finish() if args.parallel else suite.run()
        result = "ok" if rc == 0 else f"FAILED (pytest exit {rc})"
        if rc != 0:
            status = max(status, 1)
        shown = resolved["jax"] if version == NEWEST else version
        rows.append((shown, resolved["jaxlib"], subset, summary(out), secs, cpu, t_setup,
                     result))

    print("\n" + "=" * 100)
    head = (f"{'jax':<8} {'jaxlib':<8} {'subset':<10} "
            + " ".join(f"{c:>7}" for c in COUNTS)
            + f" {'seconds':>8} {'cpu s':>8} {'setup s':>8}  result")
    print(head)
    print("-" * len(head))
    for version, jaxlib_v, sub, counts, secs, cpu, t_setup, result in rows:
        print(f"{version:<8} {jaxlib_v:<8} {sub:<10} "
              + " ".join(f"{counts[c]:>7}" for c in COUNTS)
              + f" {secs:>8.1f} {cpu:>8.1f} {t_setup:>8.1f}  {result}")
    for version, _, resolved, _, _ in ready:
        print(f"{version}: {describe(resolved)}")
    print(f"total {time.perf_counter() - t_start:.0f} s; logs in {args.cache_dir}")
    return status


if __name__ == "__main__":
    sys.exit(main())
