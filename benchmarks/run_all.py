"""Runs every benchmark script in this folder, one after the other.

    python benchmarks/run_all.py

Each script prints its own table; this prints them in sequence and, at the
end, how long each took. It exits non-zero only if a script crashed (a value
mismatch, an exception); ratios above target are reported, not failures.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
SCRIPTS = ["dispatch.py", "leaves.py", "loops.py"]


def main() -> int:
    missing = sorted(p.name for p in HERE.glob("*.py")
                     if not p.name.startswith("_") and p.name != "run_all.py"
                     and p.name not in SCRIPTS)
    if missing:
        print(f"note: not in run_all.SCRIPTS: {missing}")
    failed, took = [], []
    for name in SCRIPTS:
        t0 = time.perf_counter()
        rc = subprocess.call([sys.executable, str(HERE / name)], cwd=HERE.parent)
        took.append((name, time.perf_counter() - t0, rc))
        if rc != 0:
            failed.append(name)
        print(flush=True)
    print("=" * 78)
    for name, secs, rc in took:
        print(f"{name:<20} {secs:6.1f} s   {'ok' if rc == 0 else f'FAILED (exit {rc})'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
