"""DeepSpeed-Chat's real step 1, 2 and 3 ``main.py`` (from a DeepSpeedExamples checkout),
launched unchanged with the ``deepspeed`` command under SLIPSTREAM_AS_DEEPSPEED=1 at 2
processes, ZeRO-2 and ZeRO-3, on a tiny offline OPT and a local ``Dahoas/rm-static``-shaped
dataset; step 3 with ``--enable_hybrid_engine``.

Opt-in: set ``DEEPSPEED_EXAMPLES`` to a checkout (nothing of it is in this repository).
DeepSpeed-Chat imports names transformers 5 removed, so it runs on transformers 4; point
``DEEPSPEED_CHAT_PYTHONPATH`` at a directory holding transformers 4.57 (with tokenizers
0.22, huggingface-hub < 1 and datasets 3), e.g. ``pip install --target DIR --no-deps
transformers==4.57.1 'tokenizers<0.23' 'huggingface-hub<1' datasets==3.6.0``. Without
them the test skips (CI has no checkout). It takes several minutes on 2 CPU cores.
"""

from __future__ import annotations

import importlib.util
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.compat import _chat_assets as assets

CHECKOUT = os.environ.get("DEEPSPEED_EXAMPLES", "")
EXTRA_PATH = os.environ.get("DEEPSPEED_CHAT_PYTHONPATH", "")
CONSOLE_SCRIPT = "from deepspeed.launcher.runner import main\nmain()\n"  # DeepSpeed's bin


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "SLIPSTREAM_AS_DEEPSPEED"}
    path = [p for p in (EXTRA_PATH, str(assets.chat_dir(CHECKOUT))) if p]
    env.update(
        SLIPSTREAM_AS_DEEPSPEED="1",
        PYTHONPATH=os.pathsep.join(path),
        HF_HUB_OFFLINE="1",
        OMP_NUM_THREADS="1",
        TRANSFORMERS_VERBOSITY="error",
    )
    return env


def _usable() -> str | None:
    """Why the test cannot run here, or None."""
    if not CHECKOUT or not (assets.chat_dir(CHECKOUT) / "training").is_dir():
        return "set DEEPSPEED_EXAMPLES to a DeepSpeedExamples checkout"
    if importlib.util.find_spec("datasets") is None:  # _chat_assets builds the data here
        return "the local dataset is built in this process: put datasets on its PYTHONPATH too"
    probe = "import datasets\nfrom transformers.modeling_utils import no_init_weights\n"
    proc = subprocess.run([sys.executable, "-c", probe], env=_env(), capture_output=True)
    if proc.returncode != 0:
        return "DeepSpeed-Chat needs transformers 4 and datasets: set DEEPSPEED_CHAT_PYTHONPATH"
    return None


pytestmark = pytest.mark.skipif(_usable() is not None, reason=str(_usable()))


def _launch(step_dir: str, args: list[str], log: Path) -> str:
    cwd = assets.chat_dir(CHECKOUT) / "training" / step_dir
    cmd = [sys.executable, "-c", CONSOLE_SCRIPT, "--num_gpus", "2", *args]
    proc = subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=1200)
    out = proc.stdout + proc.stderr
    log.write_text(" ".join(cmd) + "\n" + out)
    assert proc.returncode == 0, out[-4000:]
    return out


def _floats(pattern: str, text: str) -> list[float]:
    return [float(x) for x in re.findall(pattern, text)]


@pytest.mark.parametrize("stage", [2, 3])
def test_three_steps_run_unchanged(tmp_path: Path, stage: int) -> None:
    """Each step exits 0 and saves its model; losses are finite; step 1's loss falls."""
    made = assets.build(tmp_path)
    out1 = _launch(
        "step1_supervised_finetuning", assets.step1_args(made, tmp_path, stage), tmp_path / "1"
    )
    sft = _floats(r"Rank: 0, loss = ([-\d.e]+)", out1)
    assert len(sft) >= 2 and all(math.isfinite(x) for x in sft)
    ppl = _floats(r"ppl: ([\d.e+]+)", out1)
    assert ppl[-1] < ppl[0]  # evaluated before and after the epoch
    out2 = _launch(
        "step2_reward_model_finetuning", assets.step2_args(made, tmp_path, stage), tmp_path / "2"
    )
    assert all(math.isfinite(x) for x in _floats(r"with loss ([-\d.e]+)", out2))
    for model in ("actor", "critic"):
        assert (tmp_path / model / "pytorch_model.bin").stat().st_size > 10_000
    out3 = _launch(
        "step3_rlhf_finetuning", assets.step3_args(made, tmp_path, stage, tmp_path), tmp_path / "3"
    )
    actor = _floats(r"Actor Loss: ([-\d.e]+)", out3)
    critic = _floats(r"Critic Loss: ([-\d.e]+)", out3)
    assert actor and critic and all(math.isfinite(x) for x in actor + critic)
    assert (tmp_path / "rlhf" / "actor" / "pytorch_model.bin").is_file()
