"""The fused projections' repacking cost in RLHF rollouts (issue 37, item 3).

The paged engine's LLaMA forward on the CPU multiplies by oneDNN-packed copies of the fp32
projections (``slipstream/inference/fused.py``), packed when the engine is built. The hybrid
engine builds one per ``generate`` call, and a training step changes every weight between
two calls anyway, so an RLHF rollout packs every projection once per call. This script
times, in one process, on :func:`benchmarks.rlhf.build_model`'s LLaMA (``--eos-weight``
makes answers ragged, as ``benchmarks/rlhf.py --parts b`` does) and a GRPO step's rollout
(``--prompts`` prompts x ``--group`` sampled answers of up to ``--new-tokens`` tokens, top-k
off):

* ``pack``: packing every projection (``fuse_llama``), after an in-place change of every
  weight (what an optimizer step does);
* ``rollout (packed)``: the whole rollout on the paged engine as the hybrid engine runs it
  (packing included);
* ``rollout (unpacked)``: the same rollout with the projections run as the modules are
  (``F.linear`` on the ``[out, in]`` weights, no packing).

Each repeat changes the weights first; the variants alternate order every repeat. Times are
process CPU seconds (``--clock cpu``, the default: less distorted by other processes on a
shared machine) or wall seconds (``--clock wall``); the report gives medians.

Usage::

    python benchmarks/rlhf_repack.py --repeats 9
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.rlhf import Options, build_model, random_prompts


def _touch(model: Any) -> None:
    """An in-place change of every weight (a no-op value, a new version), as a step makes."""
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.0)


def _rollout(model: Any, ids: torch.Tensor, opts: argparse.Namespace, packed: bool) -> Any:
    from slipstream.inference.paged_generate import run_paged
    from slipstream.inference.paged_models import runner_for
    from slipstream.models.decoding import generation_request
    from slipstream.models.sampling import SamplingPolicy

    req = generation_request(ids.repeat_interleave(opts.group, 0), opts.new_tokens, 1.0, None)
    req = dataclasses.replace(req, sampling=SamplingPolicy(do_sample=True), eos_token_ids=(2,),
                              pad_token_id=0)  # fmt: skip
    runner = runner_for(model, fuse=packed)
    return run_paged(model, req, runner=runner)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--eos-weight", type=float, default=0.8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    opts = parser.parse_args(argv)
    torch.set_num_threads(opts.threads)
    now = time.process_time if opts.clock == "cpu" else time.perf_counter

    from slipstream.inference.fused import fuse_llama

    bench = Options(eos_weight=opts.eos_weight, grpo_new_tokens=opts.new_tokens)
    model = build_model(bench, ragged=True).eval()
    ids = random_prompts(bench, opts.prompts, seed=2000)
    if fuse_llama(model) is None:
        print("no oneDNN packing on this torch/CPU: nothing to measure")
        return 1
    times: dict[str, list[float]] = {"pack": [], "rollout (packed)": [], "rollout (unpacked)": []}
    lengths: list[float] = []
    for i in range(opts.repeats + 1):  # the first repeat warms up, untimed
        order = [True, False] if i % 2 else [False, True]
        _touch(model)
        start = now()
        fuse_llama(model)
        pack = now() - start
        for packed in order:
            _touch(model)
            torch.manual_seed(i)
            start = now()
            out = _rollout(model, ids, opts, packed)
            took = now() - start
            if i:
                times["rollout (packed)" if packed else "rollout (unpacked)"].append(took)
        if i:
            times["pack"].append(pack)
            answers = out[:, bench.prompt_len :]
            lengths.append(float(((answers != 0).sum(1)).float().mean()))
    load = " ".join(f"{x:.2f}" for x in _loadavg())
    print(f"rlhf_repack: {opts.prompts} prompts x {opts.group} answers of up to "
          f"{opts.new_tokens} tokens (mean {statistics.median(lengths):.1f}), "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M-parameter LLaMA, "
          f"{opts.threads} thread(s), {opts.clock} clock, medians of {opts.repeats}; "
          f"load average {load}")  # fmt: skip
    med = {k: statistics.median(v) for k, v in times.items()}
    for name, value in med.items():
        print(f"  {name:20s} {value * 1e3:9.1f} ms")
    print(f"  pack / rollout (packed): {med['pack'] / med['rollout (packed)']:.3f}; "
          f"rollout packed / unpacked: {med['rollout (packed)'] / med['rollout (unpacked)']:.3f}")  # fmt: skip
    return 0


def _loadavg() -> tuple[float, float, float]:
    import os

    return os.getloadavg()


if __name__ == "__main__":
    sys.exit(main())
