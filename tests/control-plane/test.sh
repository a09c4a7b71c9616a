#!/usr/bin/env bash
# Entry point for the control-plane tests: builds (or reuses) the cached
# binaries, then runs the pytest suite next to this file.
#   tests/control-plane/test.sh [pytest args...]
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)
"$repo/scripts/control-plane" build
cd "$repo"
PYTHONDONTWRITEBYTECODE=1 exec python3 -m pytest -p no:cacheprovider -v -s "$@" tests/control-plane
