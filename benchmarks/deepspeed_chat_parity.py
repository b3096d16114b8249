"""DeepSpeed-Chat's real steps 1-3 on DeepSpeed 0.19.8 and on slipstream, side by side.

Usage::

    python benchmarks/deepspeed_chat_parity.py CHECKOUT --tf4 DIR [--steps 1,2,3]
        [--stages 2,3] [--slipstream-comm bf16] [--hybrid] [--work DIR] [--json out.json]

``CHECKOUT`` is a DeepSpeedExamples checkout (``applications/DeepSpeed-Chat`` is read from it;
nothing of it is kept in this repository). ``DIR`` holds transformers 4 and datasets 3, which
DeepSpeed-Chat needs (see tests/compat/test_deepspeed_chat.py for the ``pip install --target``
line); it goes first on ``PYTHONPATH`` of this process and of every rank.

Each step's own ``main.py`` runs unchanged, launched with the ``deepspeed`` command's entry
point (``deepspeed.launcher.runner.main``) at 2 CPU processes, on the tiny OPT and the local
``Dahoas/rm-static``-shaped data of ``tests/compat/_chat_assets.py``, once with the installed
DeepSpeed and once under ``SLIPSTREAM_AS_DEEPSPEED=1``. Step 2 adds ``--eval_interval 1``
(the script's own flag: reward-model accuracy after every step). Step 3 runs without
``--enable_hybrid_engine`` on both sides (DeepSpeed's hybrid engine needs CUDA); ``--hybrid``
turns it on for the slipstream side only. Both sides of step 3 start from the actor and
critic that DeepSpeed's steps 1 and 2 wrote at ZeRO-2, so they consume the same rollouts.

A ``sitecustomize.py`` written to a temporary directory is put on ``PYTHONPATH`` of the ranks:

- on both sides, it wraps ``deepspeed.initialize`` so every ``engine.backward(loss)`` prints
  the loss at full precision (the scripts print step 2's loss only as an epoch mean);
- on DeepSpeed only, what this CPU needs: ``FusedAdam`` becomes ``torch.optim.AdamW`` with the
  same arguments (DeepSpeed JIT-compiles its CPU FusedAdam, which does not finish here), its
  shared-memory all-reduce op is not built, and at ZeRO-3 the parameters made outside
  ``zero.Init`` (DeepSpeed-Chat's ``v_head``, fp32) are cast to the config's dtype before
  ``initialize``: DeepSpeed 0.19.8 no longer casts them and stops in ``defragment`` with an
  ``AssertionError`` (mixed dtypes); DeepSpeed before 0.19 cast the whole module, as
  slipstream does.

``--slipstream-comm bf16`` adds ``"communication_data_type": "bf16"`` to the config of the
slipstream side: DeepSpeed keeps bf16 gradients (reduced and stored in bf16) where slipstream
by default reduces and accumulates them in fp32; with the key the two agree bit for bit here.

It prints, per step and stage, DeepSpeed's and slipstream's per-step values and the largest
difference. Several minutes per step on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

RUNNER = "from deepspeed.launcher.runner import main\nmain()\n"

SITECUSTOMIZE = r'''
import os

if os.environ.get("CHAT_PARITY_SIDE") == "deepspeed":
    import torch
    import deepspeed.comm.torch as _comm_torch
    import deepspeed.ops.adam as _adam
    import deepspeed.runtime.zero.utils as _zero_utils

    class TorchAdamW(torch.optim.AdamW):
        """FusedAdam's constructor on torch's AdamW (no JIT build)."""

        def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999),
                     eps=1e-8, adam_w_mode=True, weight_decay=0.0, amsgrad=False,
                     set_grad_none=True):
            assert adam_w_mode and bias_correction and not amsgrad
            super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)

    _adam.FusedAdam = TorchAdamW
    _zero_utils.ZERO_SUPPORTED_OPTIMIZERS.append(TorchAdamW)
    _comm_torch.build_shm_op = lambda: None

if os.environ.get("CHAT_PARITY_SIDE"):
    import deepspeed as _ds

    _initialize = _ds.initialize

    def _cast_late_params(model, config):
        import torch
        low = config.get("bf16") or config.get("bfloat16") or {}
        want = torch.bfloat16 if low.get("enabled") else (
            torch.float16 if (config.get("fp16") or {}).get("enabled") else None)
        params = list(model.parameters())
        if want is None or not any(hasattr(p, "ds_id") for p in params):
            return
        for p in params:
            if not hasattr(p, "ds_id") and p.dtype == torch.float32:
                p.data = p.data.to(want)

    def initialize(*args, **kwargs):
        config, model = kwargs.get("config"), kwargs.get("model")
        if isinstance(config, dict):
            comm = os.environ.get("CHAT_PARITY_COMM")
            if comm and os.environ["CHAT_PARITY_SIDE"] == "slipstream":
                config["communication_data_type"] = comm
            if os.environ["CHAT_PARITY_SIDE"] == "deepspeed" and model is not None:
                _cast_late_params(model, config)
        out = _initialize(*args, **kwargs)
        engine, backward, seen = out[0], out[0].backward, [0]

        def logged_backward(loss, *a, **k):
            import torch.distributed as dist
            seen[0] += 1
            print(f"\nPARITY_LOSS engine={id(engine)} rank={dist.get_rank()} n={seen[0]} "
                  f"loss={loss.detach().float().item()!r}\n", flush=True)
            return backward(loss, *a, **k)

        engine.backward = logged_backward
        return out

    _ds.initialize = initialize
'''

STEP_DIRS = {
    1: "step1_supervised_finetuning",
    2: "step2_reward_model_finetuning",
    3: "step3_rlhf_finetuning",
}


def _env(side: str, tf4: str, chat: Path, patch_dir: Path, comm: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "SLIPSTREAM_AS_DEEPSPEED"}
    env.update(
        PYTHONPATH=os.pathsep.join([str(patch_dir), tf4, str(chat)]),
        CHAT_PARITY_SIDE=side,
        HF_HUB_OFFLINE="1",
        OMP_NUM_THREADS="1",
        TRANSFORMERS_VERBOSITY="error",
        DS_ACCELERATOR="cpu",
    )
    if side == "slipstream":
        env["SLIPSTREAM_AS_DEEPSPEED"] = "1"
        if comm:
            env["CHAT_PARITY_COMM"] = comm
    return env


def _args(step: int, stage: int, made: dict[str, str], work: Path, hybrid: bool) -> list[str]:
    from tests.compat import _chat_assets as assets

    if step == 1:
        return assets.step1_args(made, work, stage)
    if step == 2:
        return [*assets.step2_args(made, work, stage), "--eval_interval", "1"]
    args = assets.step3_args(made, work, stage, Path(made["trained"]))
    if not hybrid:
        args.remove("--enable_hybrid_engine")
    return args


def _run(cmd: list[str], cwd: Path, env: dict[str, str], log: Path, timeout: int) -> str:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    log.write_text(" ".join(cmd) + "\n" + out)
    if proc.returncode != 0:
        raise SystemExit(f"{log}: exit {proc.returncode}\n{out[-3000:]}")
    return out


def parse(step: int, out: str) -> dict[str, list[float]]:
    """The per-step values a step's output carries (rank 0)."""
    got: dict[str, list[float]] = {}
    losses: dict[str, list[float]] = {}
    for engine, value in re.findall(
        r"PARITY_LOSS engine=(\d+) rank=0 n=\d+ loss=([-+\w.]+?)(?=\s|Epoch|$)", out
    ):
        losses.setdefault(engine, []).append(float(value))
    if step in (1, 2):
        got["loss"] = next(iter(losses.values()), [])
    if step == 1:
        got["ppl"] = [float(x) for x in re.findall(r"ppl: ([\d.e+]+)", out)]
    if step == 2:
        evals = re.findall(r"c_scores: (\S+), r_scores: (\S+), diff: \S+, acc: (\S+)", out)
        got["chosen"] = [float(c) for c, _, _ in evals]
        got["rejected"] = [float(r) for _, r, _ in evals]
        got["acc"] = [float(a) for _, _, a in evals]
    if step == 3:
        got["actor"] = [float(x) for x in re.findall(r"Actor Loss: (\S+) \|", out)]
        got["critic"] = [float(x) for x in re.findall(r"Critic Loss: (\S+) \|", out)]
        got["reward"] = [float(x) for x in re.findall(r"Average reward score: (\S+) \|", out)]
    return got


def compare(ds: dict[str, list[float]], ss: dict[str, list[float]]) -> dict[str, float | None]:
    """Largest absolute difference per series (None: lengths differ)."""
    diff: dict[str, float | None] = {}
    for key, ref in ds.items():
        got = ss.get(key, [])
        same = len(got) == len(ref) and bool(ref)
        diff[key] = max(abs(a - b) for a, b in zip(ref, got, strict=True)) if same else None
    return diff


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkout", help="a DeepSpeedExamples checkout")
    parser.add_argument("--tf4", required=True, help="directory with transformers 4, datasets 3")
    parser.add_argument("--steps", default="1,2,3")
    parser.add_argument("--stages", default="2,3")
    parser.add_argument("--slipstream-comm", default="", choices=["", "bf16", "fp32"])
    parser.add_argument("--hybrid", action="store_true", help="step 3 on slipstream: hybrid")
    parser.add_argument("--work", default="", help="keep assets and logs here")
    parser.add_argument("--timeout", type=int, default=2400, help="seconds per run")
    parser.add_argument("--json", default="")
    opts = parser.parse_args()
    sys.path.insert(0, opts.tf4)  # the assets are built with transformers 4 too
    from tests.compat import _chat_assets as assets

    chat = assets.chat_dir(opts.checkout)
    work = Path(opts.work or tempfile.mkdtemp(prefix="chat_parity_"))
    patch_dir = work / "site"
    patch_dir.mkdir(parents=True, exist_ok=True)
    (patch_dir / "sitecustomize.py").write_text(SITECUSTOMIZE)
    if not (work / "tiny-opt").is_dir():
        assets.build(work)
    made = {
        "model": str(work / "tiny-opt"),
        "data": str(work / "Dahoas" / "rm-static"),
        "trained": str(work / "deepspeed-z2"),
    }
    steps = [int(s) for s in opts.steps.split(",")]
    stages = [int(s) for s in opts.stages.split(",")]
    if 3 in steps and not (work / "deepspeed-z2" / "critic").is_dir():
        for step in (1, 2):  # step 3's actor and critic: DeepSpeed's, at ZeRO-2
            run_dir = work / "deepspeed-z2"
            run_dir.mkdir(exist_ok=True)
            cmd = [sys.executable, "-c", RUNNER, "--num_gpus", "2"]
            cmd += _args(step, 2, made, run_dir, hybrid=False)
            env = _env("deepspeed", opts.tf4, chat, patch_dir, "")
            _run(cmd, chat / "training" / STEP_DIRS[step], env, run_dir / f"log{step}.txt",
                 opts.timeout)  # fmt: skip
    results: list[dict[str, object]] = []
    for step in steps:
        for stage in stages:
            got: dict[str, dict[str, list[float]]] = {}
            for side in ("deepspeed", "slipstream"):
                run_dir = work / f"{side}-step{step}-z{stage}"
                run_dir.mkdir(exist_ok=True)
                hybrid = opts.hybrid and side == "slipstream"
                cmd = [sys.executable, "-c", RUNNER, "--num_gpus", "2"]
                cmd += _args(step, stage, made, run_dir, hybrid)
                env = _env(side, opts.tf4, chat, patch_dir, opts.slipstream_comm)
                out = _run(cmd, chat / "training" / STEP_DIRS[step], env, run_dir / "log.txt",
                           opts.timeout)  # fmt: skip
                got[side] = parse(step, out)
            diff = compare(got["deepspeed"], got["slipstream"])
            results.append({"step": step, "stage": stage, **got, "max_abs_diff": diff})
            print(f"\nstep {step}, ZeRO-{stage}")
            for key, ref in got["deepspeed"].items():
                print(f"  {key:9s} deepspeed  {' '.join(f'{x:.6g}' for x in ref)}")
                mine = got["slipstream"].get(key, [])
                print(f"  {'':9s} slipstream {' '.join(f'{x:.6g}' for x in mine)}")
                print(f"  {'':9s} max |diff| {diff[key]}")
    if opts.json:
        Path(opts.json).write_text(json.dumps(results, indent=1))
    print(f"\nlogs under {work}")


if __name__ == "__main__":
    main()
