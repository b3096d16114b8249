#!/usr/bin/env bash
# Set up (if needed) and run the main job: `slipstream demo` (2 processes, embedded corpus).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
exec .venv/bin/slipstream demo "$@"
