"""docs/inference.md's example runs as written."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_inference_doc_example_runs(tmp_path):
    text = (ROOT / "docs" / "inference.md").read_text()
    block = re.findall(r"```python\n(.*?)```", text, flags=re.S)[0]
    script = tmp_path / "example.py"
    script.write_text("import torch\ntorch.set_num_threads(1)\n" + block + "\nprint('OK')\n")
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("OK") and proc.stdout.count("[") >= 8
