"""``slipstream tune SCRIPT --config cfg.json --nproc N``: find the fastest layout by
prediction, then by measurement (DeepSpeed's ``deepspeed --autotuning tune``).

The planner ranks every layout the config leaves open (``slipstream.planner.autotune``); the
best few are each run for a few steps through ``slipstream run`` with their own config
(``--deepspeed_config PATH`` in the script's arguments), the step log gives the measured
samples/s, and the best measured config is written. A run that fails (out of memory, an
error in any rank) ends at once and its last output is shown; a run that outlives
``--timeout`` is killed with its whole process group. No process outlives the tuner.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["add_parser", "tune_command"]

_STEP_LINE = re.compile(r"\bstep=(\d+) .*\bsamples/s=([0-9.]+)")
_STOP_GRACE_S = 20.0


def add_parser(subparsers: Any) -> None:
    """Register ``tune`` on the ``slipstream`` subcommand parser."""
    p = subparsers.add_parser(
        "tune", help="autotune a training config: predict, then measure the best layouts",
        description=__doc__, allow_abbrev=False,
        usage="slipstream tune SCRIPT --config CFG.json --nproc N [options] [-- SCRIPT_ARGS]",
    )  # fmt: skip
    _add_options(p)
    p.add_argument("script", help="training script (gets --deepspeed_config PATH)")
    p.add_argument("rest", nargs=argparse.REMAINDER,
                   help="tune options, then -- and the script's own arguments")  # fmt: skip
    p.set_defaults(handler=tune_command)


def _add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=Path, default=None,
                   help="the DeepSpeed/slipstream JSON config (its autotuning block is read)")  # fmt: skip
    p.add_argument("--nproc", type=int, default=None, help="ranks on this machine")
    p.add_argument("--top", type=int, default=None,
                   help="candidates to measure (default: 3 with autotuning.fast, else "
                   "tuner_num_trials)")  # fmt: skip
    p.add_argument("--steps", type=int, default=None,
                   help="steps measured per run after start_profile_step (default: "
                   "end_profile_step - start_profile_step)")  # fmt: skip
    p.add_argument("--hardware", default="local",
                   help="profile for the predictions (default 'local', calibrated with "
                   "--nproc ranks first if missing)")  # fmt: skip
    p.add_argument("--recompute", choices=("none", "selective", "full"), default="none",
                   help="activation recomputation the script's model does")  # fmt: skip
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    p.add_argument("--output", type=Path, default=None,
                   help="best config path (default: results_dir/ds_config_optimal.json)")  # fmt: skip
    p.add_argument("--dry-run", action="store_true", help="print the ranking, run nothing")


def _options_after_script(args: argparse.Namespace) -> None:
    """Tune options may also follow the script (``slipstream tune train.py --config c.json
    --nproc 2 -- --lr 1``): parse what comes before ``--``; the rest is the script's."""
    rest = list(args.rest)
    cut = rest.index("--") if "--" in rest else len(rest)
    options, args.script_args = rest[:cut], rest[cut + 1 :]
    if options:
        parser = argparse.ArgumentParser(prog="slipstream tune", add_help=False,
                                         allow_abbrev=False)  # fmt: skip
        _add_options(parser)
        parsed, unknown = parser.parse_known_args(options)
        if unknown:
            raise ValueError(f"unknown tune option(s) {unknown}: the script's own arguments "
                             "go after --")  # fmt: skip
        defaults = parser.parse_args([])
        for key, value in vars(parsed).items():
            if value != getattr(defaults, key):
                setattr(args, key, value)
    if args.config is None or args.nproc is None:
        raise ValueError("give --config CFG.json and --nproc N")


@dataclass
class Measurement:
    """What one run gave."""

    ok: bool
    samples_per_s: float = 0.0
    step_time_s: float = 0.0
    steps: list[tuple[int, float]] = field(default_factory=list)
    error: str = ""
    log: str = ""


def tune_command(args: argparse.Namespace) -> int:
    """Handler of ``slipstream tune``: 0 when a candidate ran, 1 when all failed, 2 for bad
    input."""
    try:
        _options_after_script(args)
        return _tune(args)
    except (ValueError, OSError) as err:
        print(f"slipstream tune: error: {err}", file=sys.stderr)
        return 2


def _read(path: Path) -> dict[str, Any]:
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"--config {path}: not JSON ({err})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"--config {path}: a config is a JSON object")
    return raw


def _tune(args: argparse.Namespace) -> int:
    from slipstream.config import ConfigError
    from slipstream.config.autotuning import ModelInfoConfig
    from slipstream.config.loader import read_config
    from slipstream.planner.autotune import (
        model_from_info,
        rank_candidates,
        select_for_measurement,
    )

    if args.nproc < 1:
        raise ValueError(f"--nproc {args.nproc}: must be at least 1")
    if not os.path.isfile(args.script):
        raise ValueError(f"script not found: {args.script}")
    base = _read(args.config)
    try:
        at = read_config(base).autotuning
    except ConfigError as err:
        raise ValueError(f"--config {args.config}: {err}") from None
    info = at.model_info
    if at.model_info_path is not None:
        info = ModelInfoConfig.model_validate(_read(Path(at.model_info_path)))
    if info is None:
        raise ValueError(
            f"--config {args.config}: autotuning.model_info (or model_info_path) is needed: "
            "the model's hidden_size, num_layers, num_attention_heads, vocab_size, seq_length"
        )
    if args.steps is not None:
        if args.steps < 1:
            raise ValueError(f"--steps {args.steps}: must be at least 1")
        at = at.model_copy(update={"end_profile_step": at.start_profile_step + args.steps})
    model = model_from_info(info)
    hardware = _hardware(args.hardware, args.nproc)
    ranked, enumerated, rejected = rank_candidates(model, hardware, base, at, args.nproc,
                                                   recompute=args.recompute)  # fmt: skip
    if not ranked:
        raise ValueError(f"none of the {enumerated} layouts fits in "
                         f"{hardware.usable_memory / 2**30:.1f} GiB per rank ({hardware.name})")  # fmt: skip
    chosen = select_for_measurement(ranked, at, args.top)
    _say(f"{enumerated} layouts, {rejected} do not fit, {len(ranked)} ranked; measuring "
         f"{len(chosen)} ({at.tuner_type}, metric {at.metric}, steps "
         f"{at.start_profile_step + 1}-{at.end_profile_step})")  # fmt: skip
    if args.dry_run:
        print(_table([(c, None) for c in chosen], at.metric))
        return 0
    exps, results = Path(at.exps_dir), Path(at.results_dir)
    rows = []
    for cand in chosen:
        rows.append((cand, _measure(cand, args, at, exps / cand.name)))
        m = rows[-1][1]
        _say(f"{cand.name}: " + (f"{m.samples_per_s:.2f} samples/s measured, "
             f"{cand.prediction.samples_per_s:.2f} predicted" if m.ok else f"failed: {m.error}"))  # fmt: skip
    print(_table(rows, at.metric))
    return _write_results(rows, base, at, results, args.output)


def _hardware(name: str, nproc: int) -> Any:
    from slipstream.planner import load_hardware
    from slipstream.planner.hardware import local_profile_path

    if name == "local" and not local_profile_path().is_file():
        from slipstream.planner.calibrate import calibrate

        _say(f"no 'local' profile yet: calibrating this machine with {max(2, nproc)} ranks")
        return calibrate(nproc=max(2, nproc))
    return load_hardware(name)


def _script_args(script_args: list[str], config_path: Path, cand: Any, at: Any) -> list[str]:
    """The script's arguments with ``--deepspeed_config`` pointing at the candidate's config
    (replaced, or appended), plus ``arg_mappings``."""
    out, skip = [], False
    replaced = False
    for i, arg in enumerate(script_args):
        if skip:
            skip = False
            continue
        if arg in ("--deepspeed_config", "--deepspeed-config") and i + 1 < len(script_args):
            out += [arg, str(config_path)]
            skip = replaced = True
        elif arg.startswith(("--deepspeed_config=", "--deepspeed-config=")):
            out.append(f"{arg.split('=', 1)[0]}={config_path}")
            replaced = True
        else:
            out.append(arg)
    if not replaced:
        out += ["--deepspeed_config", str(config_path)]
    for key, flag in (at.arg_mappings or {}).items():
        if key not in cand.config:
            raise ValueError(f"autotuning.arg_mappings: {key!r} is not a config key the "
                             f"candidates have ({sorted(cand.config)})")  # fmt: skip
        out += [flag, str(cand.config[key])]
    return out


def _measure(cand: Any, args: argparse.Namespace, at: Any, exp_dir: Path) -> Measurement:
    """Run one candidate; stop it after ``end_profile_step``."""
    result_path = exp_dir / "result.json"
    if not at.overwrite and result_path.is_file():
        _say(f"{cand.name}: reusing {result_path} (autotuning.overwrite = false)")
        return Measurement(**json.loads(result_path.read_text()))
    exp_dir.mkdir(parents=True, exist_ok=True)
    config_path = (exp_dir / "ds_config.json").resolve()
    config = dict(cand.config, steps_per_print=1)  # the step log is the measurement
    config_path.write_text(json.dumps(config, indent=2))
    cmd = [sys.executable, "-m", "slipstream.cli.main", "run", "--nproc", str(args.nproc),
           args.script, *_script_args(list(args.script_args), config_path, cand, at)]  # fmt: skip
    m = _run(cmd, exp_dir / "log.txt", at.start_profile_step, at.end_profile_step,
             cand.prediction.layout.batch, args.timeout)  # fmt: skip
    result_path.write_text(json.dumps(m.__dict__, indent=2))
    return m


def _run(cmd: list[str], log_path: Path, start: int, end: int, batch: int,
         timeout: float) -> Measurement:  # fmt: skip
    """Start ``cmd`` in its own process group, read its output until step ``end`` is logged,
    then stop the group (SIGTERM, SIGKILL after a grace period). Fail on an exit before that,
    or on ``timeout`` (the group is killed)."""
    rates: list[tuple[int, float]] = []
    lines: list[str] = []
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env=env)  # fmt: skip
    timed_out = threading.Event()

    def on_timeout() -> None:
        timed_out.set()
        _stop_group(proc, 0.0)

    timer = threading.Timer(timeout, on_timeout)
    timer.start()
    reached = False
    try:
        with log_path.open("w") as log:
            assert proc.stdout is not None
            for line in proc.stdout:
                log.write(line)
                lines.append(line)
                match = _STEP_LINE.search(line)
                if match:
                    step, rate = int(match.group(1)), float(match.group(2))
                    if start < step <= end:
                        rates.append((step, rate))
                    if step >= end:
                        reached = True
                        break
        _stop_group(proc, _STOP_GRACE_S)
    finally:
        timer.cancel()
        _stop_group(proc, 0.0)
        if proc.stdout is not None:
            proc.stdout.close()
    if reached and len(rates) == end - start:
        step_time = sum(batch / r for _, r in rates) / len(rates)
        return Measurement(True, batch / step_time, step_time, rates, log=str(log_path))
    if timed_out.is_set():
        error = f"timed out after {timeout:.0f} s (before step {end}); killed"
    elif reached:
        error = f"steps {start + 1}-{end} not all logged: {rates} (steps_per_print overridden?)"
    else:
        error = _first_error(lines) or f"exited with code {proc.returncode} before step {end}"
    return Measurement(False, error=error, log=str(log_path))


def _first_error(lines: list[str]) -> str:
    """The launcher's one-line failure report, or the last exception line. The ranks and the
    launcher share one pipe, so a report may follow a rank's unfinished line, and a rank's
    exception line may carry torch's ``[rankN]:`` prefix."""
    for line in lines:
        at = line.find("slipstream run: rank")
        if at >= 0 and "secondary" not in line:
            return line[at:].strip()
    for line in reversed(lines):
        text = re.sub(r"^\s*\[rank\d+\]:\s*", "", line).strip()
        if re.match(r"^\w*(Error|Exception)\b", text):
            return text
    return ""


def _stop_group(proc: subprocess.Popen[str], grace: float) -> None:
    """SIGTERM the run's process group, SIGKILL it after ``grace`` seconds if still alive."""
    if proc.poll() is not None:
        _kill_group(proc.pid, signal.SIGKILL)  # stragglers of an exited launcher
        return
    _kill_group(proc.pid, signal.SIGTERM if grace > 0 else signal.SIGKILL)
    try:
        proc.wait(timeout=grace if grace > 0 else 10)
    except subprocess.TimeoutExpired:
        _kill_group(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    _kill_group(proc.pid, signal.SIGKILL)


def _kill_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _table(rows: list[tuple[Any, Any]], metric: str) -> str:
    lines = [f"{'candidate':<30} {'pred mem MiB':>12} {'pred samples/s':>15} "
             f"{'meas samples/s':>15} {'error':>7}"]  # fmt: skip
    for cand, m in rows:
        p = cand.prediction
        mem = p.memory_per_rank_bytes / 2**20
        if m is None:
            lines.append(f"{cand.name:<30} {mem:>12.1f} {p.samples_per_s:>15.2f}")
        elif m.ok:
            err = 100 * (p.samples_per_s / m.samples_per_s - 1)
            lines.append(f"{cand.name:<30} {mem:>12.1f} {p.samples_per_s:>15.2f} "
                         f"{m.samples_per_s:>15.2f} {err:>+6.1f}%")  # fmt: skip
        else:
            lines.append(f"{cand.name:<30} {mem:>12.1f} {p.samples_per_s:>15.2f} "
                         f"{'failed':>15}  {m.error.splitlines()[0] if m.error else ''}")  # fmt: skip
    return "\n".join(lines)


def _write_results(rows: list[tuple[Any, Measurement]], base: dict[str, Any], at: Any,
                   results: Path, output: Path | None) -> int:  # fmt: skip
    from slipstream.planner.autotune import metric_value
    from slipstream.planner.flops import model_flops

    def score(row: tuple[Any, Measurement]) -> float:
        cand, m = row
        batch = cand.prediction.layout.batch
        return metric_value(at.metric, m.samples_per_s, model_flops(cand.prediction.model,
                            batch), batch)  # fmt: skip

    done = [r for r in rows if r[1].ok]
    results.mkdir(parents=True, exist_ok=True)
    summary = {
        "metric": at.metric,
        "candidates": [
            {
                "name": c.name,
                "layout": c.prediction.layout.to_dict(),
                "predicted_samples_per_s": c.prediction.samples_per_s,
                "predicted_step_time_s": c.prediction.step_time_s,
                "predicted_memory_bytes": c.prediction.memory_per_rank_bytes,
                "measured": m.__dict__,
            }
            for c, m in rows
        ],
    }
    if not done:
        (results / "summary.json").write_text(json.dumps(summary, indent=2))
        print("slipstream tune: every candidate failed; see the logs above", file=sys.stderr)
        return 1
    best, m = max(done, key=score)
    summary["best"] = best.name
    (results / "summary.json").write_text(json.dumps(summary, indent=2))
    target = output or results / "ds_config_optimal.json"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(best.config, indent=2) + "\n")
    _say(f"best: {best.name} at {m.samples_per_s:.2f} samples/s measured; config written to "
         f"{target}")  # fmt: skip
    return 0


def _say(msg: str) -> None:
    print(f"[slipstream tune] {msg}", file=sys.stderr, flush=True)
