"""DeepSpeed's own unit tests, run on real DeepSpeed and on slipstream under the switch.

Usage::

    python benchmarks/deepspeed_unit_tests.py SOURCE [--side both|deepspeed|slipstream]
        [--files SUBSTR,...] [--timeout S] [--json out.json] [--keep DIR]

``SOURCE`` is a DeepSpeed source checkout (a directory holding ``tests/unit``) or a bare git
repository of DeepSpeed (its ``tests/`` is extracted with ``git archive``). DeepSpeed's PyPI
sdist does not ship ``tests/`` (its ``MANIFEST.in`` leaves them out), so a checkout is
needed; nothing of DeepSpeed's test code is kept in this repository. The tests are read from
a fresh copy in a temporary directory.

The chosen tests are listed in ``TESTS`` below: DeepSpeed ``tests/unit`` node ids that pass on
DeepSpeed 0.19.8 (the installed release) on a CPU, measured with the 0.19.6 source's tests.
Each side runs them as DeepSpeed's CPU CI does: ``pytest --forked`` (pytest-forked, from
PyPI) from DeepSpeed's ``tests/`` directory, its ``pytest.ini`` and ``conftest.py`` in force,
with ``DS_ACCELERATOR=cpu`` and ``LOCAL_SIZE=2`` (the CPU accelerator then reports two
devices, so tests of one and two ranks run and those of four skip), ``OMP_NUM_THREADS=1``.

- ``deepspeed``: the installed DeepSpeed (``SLIPSTREAM_AS_DEEPSPEED`` unset).
- ``slipstream``: the same tests with ``SLIPSTREAM_AS_DEEPSPEED=1``, so every ``deepspeed``
  import in them is slipstream.

It prints, by file, how many of the chosen tests passed on each side, then the totals and
slipstream's pass rate over the tests that passed on DeepSpeed in this run, and the
slipstream failures with their first error line. docs/compatibility.md lists the tests that
fail on purpose and why.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

# DeepSpeed tests/unit test names, by file (relative to tests/unit). Chosen by rule, not by
# how slipstream does: every module-level test (one rank, no DistributedTest class; all its
# parameter sets) of 24 files covering config, initialize, ZeRO config and contexts,
# checkpoint files, comm logging, pipeline topology and schedule, lr schedules, launcher,
# utils and accelerator that passed on DeepSpeed 0.19.8 on this project's 2-core CPU machine
# with the settings above (156 of the 161 such tests run there, from 21 files; DeepSpeed's
# DistributedTest classes spawn fresh ranks and took minutes each on that loaded machine).
TESTS: dict[str, list[str]] = {
    "runtime/test_ds_config_dict.py": [
        "test_temp_config_json",
        "test_gradient_allreduce_op[mean-mean]",
        "test_gradient_allreduce_op[SUM-sum]",
        "test_gradient_allreduce_op_default",
        "test_invalid_gradient_allreduce_op",
        "test_sum_gradient_allreduce_rejects_zero3",
        "test_sum_gradient_allreduce_rejects_zenflow",
        "test_sum_gradient_allreduce_rejects_deepcompile[1]",
        "test_sum_gradient_allreduce_rejects_deepcompile[2]",
        "test_gather_16bit_params_on_model_save[stage3_gather_16bit_weights_on_model_save]",
        "test_gather_16bit_params_on_model_save[stage3_gather_fp16_weights_on_model_save]",
        "test_get_bfloat16_enabled[bf16]",
        "test_get_bfloat16_enabled[bfloat16]",
    ],
    "runtime/test_ds_config_model.py": [
        "test_only_required_fields",
        "test_config_duplicate_key",
        "test_config_base",
        "test_config_base_deprecatedfield",
        "test_config_base_aliasfield",
        "test_config_base_literalfail[config_dict0]",
        "test_config_base_literalfail[config_dict1]",
        "test_config_base_literalfail[config_dict2]",
        "test_config_base_deprecatedfail",
    ],
    "runtime/test_ds_initialize.py": [
        "test_start_method_safety[spawn]",
        "test_start_method_safety[fork]",
        "test_start_method_safety[forkserver]",
    ],
    "runtime/test_lr_schedulers.py": [
        "test_warmup_cosine_lr_initializes_all_param_groups",
        "test_warmup_lr_inherits_per_group_lr_when_max_unspecified",
        "test_lr_scheduler_preserves_tensor_lr[LRRangeTest-lr_shape0]",
        "test_lr_scheduler_preserves_tensor_lr[LRRangeTest-lr_shape1]",
        "test_lr_scheduler_preserves_tensor_lr[OneCycle-lr_shape0]",
        "test_lr_scheduler_preserves_tensor_lr[OneCycle-lr_shape1]",
        "test_lr_scheduler_preserves_tensor_lr[WarmupLR-lr_shape0]",
        "test_lr_scheduler_preserves_tensor_lr[WarmupLR-lr_shape1]",
        "test_lr_scheduler_preserves_tensor_lr[WarmupDecayLR-lr_shape0]",
        "test_lr_scheduler_preserves_tensor_lr[WarmupDecayLR-lr_shape1]",
        "test_lr_scheduler_preserves_tensor_lr[WarmupCosineLR-lr_shape0]",
        "test_lr_scheduler_preserves_tensor_lr[WarmupCosineLR-lr_shape1]",
        "test_all_schedulers_covered_by_tensor_lr_contract",
        "test_warmup_cosine_lr_total_num_steps_equals_warmup_num_steps",
        "test_warmup_schedulers_reject_invalid_warmup_num_steps[None-WarmupLR]",
        "test_warmup_schedulers_reject_invalid_warmup_num_steps[None-WarmupDecayLR]",
        "test_warmup_schedulers_reject_invalid_warmup_num_steps[None-WarmupCosineLR]",
        "test_warmup_schedulers_reject_invalid_warmup_num_steps[-5-WarmupLR]",
        "test_warmup_schedulers_reject_invalid_warmup_num_steps[-5-WarmupDecayLR]",
        "test_warmup_schedulers_reject_invalid_warmup_num_steps[-5-WarmupCosineLR]",
        "test_warmup_cosine_lr_unknown_warmup_type_falls_back_to_log",
        "test_warmup_cosine_lr_linear_warmup_type_produces_linear_ratios",
        "test_one_cycle_stair_count_holds_lr_flat",
        "test_one_cycle_stair_count_handles_asymmetric_cycle",
        "test_lr_range_test_rejects_nonpositive_step_size[0]",
        "test_lr_range_test_rejects_nonpositive_step_size[-5]",
        "test_one_cycle_rejects_nonpositive_step_sizes[0-0]",
        "test_one_cycle_rejects_nonpositive_step_sizes[0-None]",
        "test_one_cycle_rejects_nonpositive_step_sizes[-1-None]",
        "test_one_cycle_rejects_nonpositive_step_sizes[0-100]",
        "test_one_cycle_rejects_nonpositive_step_sizes[100--1]",
        "test_one_cycle_allows_zero_second_step_size",
        "test_one_cycle_accepts_per_group_lr_and_momentum_lists",
        "test_one_cycle_rejects_wrong_length_per_group_lists[kwargs0]",
        "test_one_cycle_rejects_wrong_length_per_group_lists[kwargs1]",
        "test_one_cycle_rejects_wrong_length_per_group_lists[kwargs2]",
        "test_one_cycle_rejects_wrong_length_per_group_lists[kwargs3]",
    ],
    "runtime/test_runtime_utils.py": [
        "test_call_to_str",
        "test_count_used_parameters_enables_grad_for_grad_acc_lookup",
    ],
    "runtime/test_data.py": [
        "test_repeating_loader",
    ],
    "runtime/utils/test_partition.py": [
        "test_prefix_sum",
        "test_valid_partition",
        "test_short_partition_uniform",
        "test_short_partition",
        "test_easy_balance_uniform",
        "test_easy_balance_balanced",
        "test_int_balanced",
        "test_float_balanced",
        "test_float_midheavy",
        "test_balance_bert",
    ],
    "runtime/zero/test_zero_config.py": [
        "test_zero_config_deprecatedfields",
        "test_zero_config_aliasfields",
        "test_zero_config_pipeline_loading_checkpoint",
        "test_zero_config_overlapcomm",
        "test_zero_config_offload_configs",
        "test_zero_offload_optimizer_config_pipeline",
    ],
    "runtime/zero/test_zero_context.py": [
        "test_multiple_all_gather_handles_wait_passes_dependency_by_keyword",
    ],
    "runtime/zero/test_zero_leaf_module.py": [
        "test_set_leaf_modules_with_fully_qualified_name",
        "test_set_leaf_modules_no_raise_when_missing",
        "test_set_leaf_modules_by_name",
        "test_set_leaf_modules_by_name_missing",
        "test_set_leaf_modules_by_suffix",
        "test_set_leaf_modules_by_suffix_missing",
        "test_zero_leaf_module_default_config",
        "test_zero_leaf_module_custom_config",
        "test_zero_leaf_module_string_coercion",
    ],
    "checkpoint/test_zero_optimizer.py": [
        "test_elastic_checkpoint_is_deprecated_for_zero3",
    ],
    "comm/test_comms_logger.py": [
        "test_stop_profiling_comms_disables_prof_all",
        "test_get_operation_summary_does_not_reorder_the_stored_records",
        "test_trim_mean_does_not_mutate_its_argument",
    ],
    "runtime/pipe/test_topology.py": [
        "test_topology_2d",
        "test_topology_dims",
        "test_topology_match",
        "test_topology_rank_repr",
        "test_topology_3d",
        "test_topology_comm_list",
        "test_primes",
    ],
    "runtime/pipe/test_pipe_schedule.py": [
        "test_pipe_inference_schedule_singlestage",
        "test_pipe_train_schedule_singlestage",
        "test_pipe_inference_schedule_firststage[1]",
        "test_pipe_inference_schedule_firststage[3]",
        "test_pipe_inference_schedule_firststage[8]",
        "test_pipe_inference_schedule_firststage[10]",
        "test_pipe_inference_schedule_midstage[1]",
        "test_pipe_inference_schedule_midstage[3]",
        "test_pipe_inference_schedule_midstage[8]",
        "test_pipe_inference_schedule_midstage[10]",
        "test_pipe_inference_schedule_laststage[1]",
        "test_pipe_inference_schedule_laststage[3]",
        "test_pipe_inference_schedule_laststage[8]",
        "test_pipe_inference_schedule_laststage[10]",
        "test_pipe_schedule_firststage",
        "test_pipe_schedule_laststage",
        "test_pipe_stagequery",
    ],
    "launcher/test_ds_arguments.py": [
        "test_no_ds_arguments_no_ds_parser",
        "test_no_ds_arguments",
        "test_no_ds_enable_argument",
        "test_no_ds_config_argument",
        "test_no_ds_parser",
        "test_core_deepscale_arguments",
        "test_core_binding_arguments",
    ],
    "launcher/test_multinode_runner.py": [
        "test_pdsh_runner",
        "test_openmpi_runner",
        "test_btl_nic_openmpi_runner",
        "test_btl_nic_two_dashes_openmpi_runner",
        "test_mpich_runner",
        "test_mvapich_runner",
    ],
    "launcher/test_run.py": [
        "test_parser_mutual_exclusive",
        "test_parser_local",
        "test_parser_multinode",
        "test_parser_errors",
        "test_num_plus_parser",
        "test_hostfile_good",
        "test_hostfiles_bad",
    ],
    "utils/test_groups.py": [
        "test_get_expert_parallel_ranks",
    ],
    "utils/test_get_optim_files.py": [
        "test_get_optim_files[1]",
        "test_get_optim_files[2]",
        "test_get_optim_files[12]",
        "test_get_optim_files[24]",
    ],
    "utils/test_partition_balanced.py": [
        "test_partition_balanced",
    ],
    "v1/accelerator/test_accelerator.py": [
        "test_abstract_methods_defined[deepspeed.accelerator.npu_accelerator]",
        "test_abstract_methods_defined[deepspeed.accelerator.sdaa_accelerator]",
        "test_abstract_methods_defined[deepspeed.accelerator.klxpu_accelerator]",
        "test_abstract_methods_defined[deepspeed.accelerator.supa_accelerator]",
        "test_abstract_methods_defined[deepspeed.accelerator.cuda_accelerator]",
        "test_abstract_methods_defined[deepspeed.accelerator.mlu_accelerator]",
        "test_abstract_methods_defined[deepspeed.accelerator.xpu_accelerator]",
        "test_abstract_methods_defined[deepspeed.accelerator.hpu_accelerator]",
        "test_abstract_methods_defined[deepspeed.accelerator.mps_accelerator]",
        "test_abstract_methods_defined[deepspeed.accelerator.cpu_accelerator]",
        "test_pin_memory_torch_backend",
    ],
}

SIDES = ("deepspeed", "slipstream")

# pytest-forked 1.7.5 sends each report from the forked child with marshal, and pytest 9's
# reports carry a NodeId object (``_id``) that marshal refuses, so every forked test "exits
# with status 3". This plugin, loaded with ``-p``, also keeps the chosen tests of the files
# collected (``DS_UNIT_IDS_FILE``), and hands the id over as the ``nodeid`` string
# the report's constructor takes, and any other unmarshallable value as its str.
_FORKED_FIX = """\
import marshal
import os

import pytest_forked

_serialize = pytest_forked.serialize_report


def serialize_report(rep):
    d = _serialize(rep)
    if "_id" in d and "nodeid" not in d:
        d["nodeid"] = str(d.pop("_id"))
    for key, value in list(d.items()):
        try:
            marshal.dumps(value)
        except ValueError:
            d[key] = str(value)
    return d


pytest_forked.serialize_report = serialize_report


def pytest_collection_modifyitems(config, items):
    # The files are collected whole (a node id inside a file that fails to import would stop
    # pytest with "found no collectors"); keep the chosen tests only.
    path = os.environ.get("DS_UNIT_IDS_FILE")
    if not path:
        return
    with open(path) as f:
        wanted = {"unit/" + line.strip() for line in f if line.strip()}
    keep = [item for item in items if item.nodeid in wanted]
    config.hook.pytest_deselected(items=[item for item in items if item.nodeid not in wanted])
    items[:] = keep
"""


@dataclass
class Outcome:
    """One test's result on one side."""

    status: str  # passed, failed, error, skipped, missing
    message: str = ""


@dataclass
class SideRun:
    """All results of one side."""

    side: str
    outcomes: dict[str, Outcome] = field(default_factory=dict)
    seconds: float = 0.0


def extract_tests(source: Path, into: Path) -> Path:
    """Copy DeepSpeed's ``tests/`` from a checkout or a bare git repository into ``into``.

    Returns:
        The ``tests`` directory of the copy.

    Raises:
        SystemExit: ``source`` is neither a checkout with ``tests/unit`` nor a git repository.
    """
    if (source / "tests" / "unit").is_dir():
        shutil.copytree(source / "tests", into / "tests", symlinks=True)
    elif (source / "HEAD").is_file() and (source / "objects").is_dir():
        archive = subprocess.run(
            ["git", f"--git-dir={source}", "archive", "HEAD", "tests"],
            check=True,
            capture_output=True,
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    else:
        raise SystemExit(
            f"{source}: not a DeepSpeed checkout (no tests/unit) nor a bare git repository of "
            "DeepSpeed; clone https://github.com/deepspeedai/DeepSpeed and pass its path"
        )
    plugins = into / "tests" / "_plugins"
    plugins.mkdir()
    (plugins / "_forked_marshal_fix.py").write_text(_FORKED_FIX)
    return into / "tests"


def _node_id(case: ET.Element) -> str:
    """``file::Class::name`` relative to ``tests/unit`` from a junit (xunit1) test case."""
    file = case.get("file", "")
    classname = case.get("classname", "")
    name = case.get("name", "")
    module_parts = file.removesuffix(".py").replace("/", ".")
    cls = classname[len(module_parts) :].lstrip(".") if classname.startswith(module_parts) else ""
    rel = file.removeprefix("unit/")
    return "::".join(p for p in (rel, cls, name) if p)


def _read_junit(path: Path) -> dict[str, Outcome]:
    outcomes: dict[str, Outcome] = {}
    if not path.is_file():
        return outcomes
    for case in ET.parse(path).getroot().iter("testcase"):
        status, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            child = case.find(tag)
            if child is not None:
                status = {"failure": "failed"}.get(tag, tag)
                text = (child.text or child.get("message") or "").strip()
                errors = [ln[1:].strip() for ln in text.splitlines() if ln.startswith("E ")]
                message = (errors or text.splitlines() or [""])[-1][:200]
                break
        node = _node_id(case)
        # A setup error and a call failure of one test both land here; keep the worst.
        if outcomes.get(node, Outcome("passed")).status == "passed":
            outcomes[node] = Outcome(status, message)
    return outcomes


_VERDICT = re.compile(r"^unit/(\S.*?) (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\b")


def _read_log(path: Path) -> dict[str, Outcome]:
    """Verdicts from pytest's verbose lines, for a run stopped before it wrote its junit file."""
    outcomes: dict[str, Outcome] = {}
    ansi = re.compile(r"\x1b\[[0-9;]*m")
    for line in ansi.sub("", path.read_text(errors="replace")).splitlines():
        match = _VERDICT.match(line)
        if match:
            status = {"PASSED": "passed", "FAILED": "failed", "SKIPPED": "skipped"}
            outcomes[match[1]] = Outcome(status.get(match[2], "error"))
    return outcomes


def run_side(
    side: str,
    tests_dir: Path,
    ids: Sequence[str],
    timeout: float,
    time_limit: float | None = None,
) -> SideRun:
    """Run ``ids`` (relative to ``tests/unit``) with pytest --forked on one side, stopping
    after ``time_limit`` seconds (the tests not reached count as missing)."""
    import time

    env = dict(os.environ)
    env.pop("SLIPSTREAM_AS_DEEPSPEED", None)
    env.update(
        DS_ACCELERATOR="cpu",
        LOCAL_SIZE="2",
        OMP_NUM_THREADS="1",
        DS_UNITTEST_TIMEOUT=str(int(timeout)),
        PYTHONDONTWRITEBYTECODE="1",
        HF_HUB_OFFLINE="1",
        # DeepSpeed JIT-builds its CPU ops (fused_adam, shm comm) on first use; a cache of
        # our own keeps those builds apart from other users of ~/.cache/torch_extensions.
        TORCH_EXTENSIONS_DIR=str(Path.home() / ".cache" / "slipstream" / "ds_unit_extensions"),
        PYTHONPATH=os.pathsep.join(
            p for p in (str(tests_dir / "_plugins"), env.get("PYTHONPATH", "")) if p
        ),
    )
    if side == "slipstream":
        env["SLIPSTREAM_AS_DEEPSPEED"] = "1"
    junit = tests_dir / f"junit-{side}.xml"
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "--forked",
        "-p",
        "_forked_marshal_fix",
        "-p",
        "no:cacheprovider",
        # A file that fails to import fails its own tests, not the whole run.
        "--continue-on-collection-errors",
        "-q",
        "-o",
        "junit_family=xunit1",
        f"--junitxml={junit}",
        *sorted({f"unit/{i.split('::')[0]}" for i in ids}),
    ]
    ids_file = tests_dir / f"ids-{side}.txt"
    ids_file.write_text("\n".join(ids) + "\n")
    env["DS_UNIT_IDS_FILE"] = str(ids_file)
    start = time.perf_counter()
    log = tests_dir / f"pytest-{side}.log"
    # Stopped by the time limit: the tests reached so far are read from the log.
    with log.open("w") as out, contextlib.suppress(subprocess.TimeoutExpired):
        subprocess.run(
            cmd, cwd=tests_dir, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=time_limit
        )
    run = SideRun(side, seconds=time.perf_counter() - start)
    found = _read_junit(junit) or _read_log(log)
    for node in ids:
        run.outcomes[node] = found.get(node, Outcome("missing", "not collected (import error?)"))
    if any(o.status == "missing" for o in run.outcomes.values()):
        _explain_missing(run, log)
    return run


def _explain_missing(run: SideRun, log: Path) -> None:
    """Attach the collection error of a test's file to the tests pytest never reached."""
    text = log.read_text(errors="replace")
    for node, outcome in run.outcomes.items():
        if outcome.status != "missing":
            continue
        file = node.split("::")[0]
        marker = f"ERROR collecting unit/{file}"
        at = text.find(marker)
        if at >= 0:
            lines = text[at:].splitlines()[1:60]
            errors = [ln for ln in lines if ln.startswith("E   ") and "Error" in ln]
            if errors:
                outcome.message = errors[0][4:].strip()[:200]


def report(runs: dict[str, SideRun], ids: Sequence[str]) -> dict[str, object]:
    """Print the by-file table and the totals; return them as a dict."""
    by_file: dict[str, list[str]] = {}
    for node in ids:
        by_file.setdefault(node.split("::")[0], []).append(node)
    sides = [s for s in SIDES if s in runs]
    header = f"{'file':58s} {'tests':>5s} " + " ".join(f"{s:>10s}" for s in sides)
    print(header)
    print("-" * len(header))
    rows = {}
    for file, nodes in by_file.items():
        counts = {s: sum(runs[s].outcomes[n].status == "passed" for n in nodes) for s in sides}
        rows[file] = {"tests": len(nodes), **counts}
        print(f"{file:58s} {len(nodes):5d} " + " ".join(f"{counts[s]:10d}" for s in sides))
    totals = {s: sum(o.status == "passed" for o in runs[s].outcomes.values()) for s in sides}
    print("-" * len(header))
    print(
        f"{'total (' + str(len(by_file)) + ' files)':58s} {len(ids):5d} "
        + " ".join(f"{totals[s]:10d}" for s in sides)
    )
    summary: dict[str, object] = {"files": rows, "totals": totals, "tests": len(ids)}
    for s in sides:
        print(f"{s}: {runs[s].seconds:.0f} s")
    if "slipstream" in runs:
        base = (
            [n for n in ids if runs["deepspeed"].outcomes[n].status == "passed"]
            if "deepspeed" in runs
            else list(ids)
        )
        ok = sum(runs["slipstream"].outcomes[n].status == "passed" for n in base)
        rate = ok / len(base) if base else 0.0
        what = "passed on DeepSpeed in this run" if "deepspeed" in runs else "chosen"
        print(f"slipstream passes {ok}/{len(base)} of the tests {what}: {rate:.1%}")
        summary["slipstream_rate"] = rate
        failing = [n for n in base if runs["slipstream"].outcomes[n].status != "passed"]
        if failing:
            print("\nnot passing on slipstream:")
            for n in failing:
                o = runs["slipstream"].outcomes[n]
                print(f"  {n}\n      {o.status}: {o.message}")
    if "deepspeed" in runs:
        broken = [n for n in ids if runs["deepspeed"].outcomes[n].status != "passed"]
        if broken:
            print("\nnot passing on DeepSpeed here (the list assumes they do):")
            for n in broken:
                o = runs["deepspeed"].outcomes[n]
                print(f"  {n}\n      {o.status}: {o.message}")
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", type=Path, help="DeepSpeed checkout or bare git repository")
    parser.add_argument("--side", choices=("both", *SIDES), default="both")
    parser.add_argument("--files", default="", help="only files containing one of these (comma)")
    parser.add_argument("--ids", nargs="*", default=None, help="run these node ids instead")
    parser.add_argument("--ids-file", type=Path, default=None, help="node ids, one a line")
    parser.add_argument("--timeout", type=float, default=300, help="DS_UNITTEST_TIMEOUT (s)")
    parser.add_argument(
        "--time-limit", type=float, default=None, help="stop each side after this many seconds"
    )
    parser.add_argument("--json", type=Path, default=None, help="write the summary here")
    parser.add_argument("--keep", type=Path, default=None, help="work here and keep the logs")
    args = parser.parse_args(argv)

    try:
        import pytest_forked  # noqa: F401
    except ImportError:
        raise SystemExit("pytest --forked needs pytest-forked: pip install pytest-forked") from None

    if args.ids_file is not None:
        ids = [ln.strip() for ln in args.ids_file.read_text().splitlines() if ln.strip()]
    elif args.ids is not None:
        ids = list(args.ids)
    else:
        wanted = [w for w in args.files.split(",") if w]
        ids = [
            i
            for f, names in TESTS.items()
            if not wanted or any(w in f for w in wanted)
            for i in (f"{f}::{n}" for n in names)
        ]
    work = args.keep or Path(tempfile.mkdtemp(prefix="ds_unit_"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        tests_dir = extract_tests(args.source.resolve(), work)
        sides = SIDES if args.side == "both" else (args.side,)
        runs = {s: run_side(s, tests_dir, ids, args.timeout, args.time_limit) for s in sides}
        summary = report(runs, ids)
        summary["outcomes"] = {
            s: {n: [o.status, o.message] for n, o in r.outcomes.items()} for s, r in runs.items()
        }
        if args.json:
            args.json.write_text(json.dumps(summary, indent=1))
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
