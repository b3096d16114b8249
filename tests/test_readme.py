"""The README's quick-start example runs as written (one process)."""

from __future__ import annotations

import re
from pathlib import Path

from tests.distributed.harness import run_script

ROOT = Path(__file__).resolve().parents[1]


def test_readme_quick_start_runs(tmp_path):
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    quick = next(b for b in blocks if "import slipstream as deepspeed" in b)
    script = tmp_path / "train.py"
    script.write_text(
        quick
        + "\nassert engine.global_steps == 10, engine.global_steps\nprint('OK', float(loss))\n"
    )
    proc = run_script(script, cwd=tmp_path, timeout_s=120)  # `python train.py`, forked warm
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "OK" in proc.stdout
