#!/usr/bin/env bash
# The suite on each supported JAX version, one venv each, and a table of the
# results: see scripts/compat.py (all arguments go to it) and docs/compat.md.
#   scripts/compat.sh                       # full suite on 0.8.3, 0.9.2, 0.10.2
#   scripts/compat.sh --fast 0.8.3 0.9.2    # the fast subset (-m "not slow")
set -euo pipefail
exec "${PYTHON:-python3}" "$(dirname "$0")/compat.py" "$@"
