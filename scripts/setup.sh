#!/usr/bin/env bash
# Idempotent set-up: a virtualenv in .venv with torch (CPU build pinned) and slipstream[dev].
# Sourced by scripts/demo.sh, scripts/test.sh and .ci/run; safe to run again.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv with $($PY --version)"
  "$PY" -m venv .venv
fi
stamp=".venv/.slipstream-setup"
want="$(cat pyproject.toml | sha256sum | cut -c1-16)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
export PIP_DISABLE_PIP_VERSION_CHECK=1
# torch first and pinned: an unpinned torch pulled in by another package would fetch a
# multi-GB CUDA build. A machine that already has a CUDA torch keeps it.
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  echo "[setup] installing torch==${TORCH_VERSION:-2.13.0}"
  .venv/bin/pip install -q "torch==${TORCH_VERSION:-2.13.0}"
fi
echo "[setup] installing slipstream[dev] (editable)"
.venv/bin/pip install -q -e ".[dev]"
echo "$want" > "$stamp"
echo "[setup] done; \`source .venv/bin/activate\` puts its python and the slipstream command on PATH"
