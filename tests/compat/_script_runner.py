"""Run the DeepSpeedExamples-style scripts of ``tests/compat/scripts`` inside spawned ranks.

Every script runs in the same two processes, one after the other (process start-ups, not the
few training steps, are what costs time), in one of three modes:

- ``"import"``: the script's ``deepspeed`` imports rewritten to slipstream (``import
  slipstream as deepspeed``, ``from slipstream.pipe import ...``), with ``deepspeed`` made
  unimportable: it must run where DeepSpeed is not installed;
- ``"switch"``: the script unchanged, in ranks started with ``SLIPSTREAM_AS_DEEPSPEED=1``;
- ``"deepspeed"``: the script unchanged under the installed DeepSpeed (CPU accelerator).

Each script writes its losses (JSON) to ``--loss_file``; a run that raises gives the
traceback instead, so one broken script does not hide the others' results.
"""

from __future__ import annotations

import json
import re
import sys
import traceback
from pathlib import Path
from typing import Any

SCRIPTS = Path(__file__).parent / "scripts"

CONFIGS: dict[str, dict[str, Any]] = {
    # training/cifar/ds_config.json, in fp32 and smaller batches
    "cifar10": {
        "train_batch_size": 16,
        "steps_per_print": 2000,
        "optimizer": {
            "type": "Adam",
            "params": {"lr": 0.001, "betas": [0.8, 0.999], "eps": 1e-8, "weight_decay": 3e-7},
        },
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.001, "warmup_num_steps": 3},
        },
        "gradient_clipping": 1.0,
        "prescale_gradients": False,
        "zero_optimization": {"stage": 2},
    },
    # training/gan/gan_deepspeed_config.json (no gradient_clipping: 1.0 by default)
    "dcgan": {
        "train_batch_size": 8,
        "optimizer": {"type": "Adam", "params": {"lr": 0.0002, "betas": [0.5, 0.999]}},
        "steps_per_print": 10,
    },
    # training/pipeline_parallelism/ds_config.json, smaller batches
    "alexnet": {
        "train_batch_size": 16,
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {
            "type": "Adam",
            "params": {"lr": 0.001, "betas": [0.9, 0.999], "eps": 1e-8},
        },
        "steps_per_print": 10,
        "wall_clock_breakdown": False,
    },
    # the getting-started tutorial's config
    "getting_started": {
        "train_batch_size": 8,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
        "zero_optimization": {"stage": 1},
    },
}


def jobs(workdir: str, mode: str) -> dict[str, list[str]]:
    """Script file -> its command-line arguments, for one mode (its own output paths)."""
    w = Path(workdir)
    cfg = {name: str(w / f"{name}.json") for name in CONFIGS}
    out = w / mode
    return {
        "cifar10_deepspeed.py": ["--deepspeed", "--deepspeed_config", cfg["cifar10"], "-e", "2"],
        "getting_started.py": [
            "--deepspeed_config",
            cfg["getting_started"],
            "--save_dir",
            str(out / "gs"),
        ],
        "dcgan.py": ["--deepspeed_config", cfg["dcgan"]],
        "bert_mlm.py": ["--checkpoint_dir", str(out / "bert")],
        "sft_opt.py": [
            "--model_name_or_path",
            str(w / "tiny-opt"),
            "--zero_stage",
            "2" if mode == "import" else "3",
            "--output_dir",
            str(out / "sft"),
        ],
        # Last: DeepSpeed keeps the pipeline's model-parallel groups for the rest of the
        # process. Dropout on (0.5): both loaders draw one seed from the global RNG when an
        # epoch starts, so the masks agree.
        "pipeline_alexnet.py": ["--deepspeed_config", cfg["alexnet"], "-s", "3"],
    }


def prepare(workdir: str) -> None:
    """Write the configs and save the tiny OPT (random weights) with ``save_pretrained``."""
    from transformers import OPTConfig, OPTForCausalLM

    w = Path(workdir)
    for name, config in CONFIGS.items():
        (w / f"{name}.json").write_text(json.dumps(config))
    import torch

    torch.manual_seed(0)
    config = OPTConfig(
        vocab_size=64,
        hidden_size=16,
        num_hidden_layers=2,
        ffn_dim=32,
        num_attention_heads=2,
        max_position_embeddings=32,
        word_embed_proj_dim=16,
        dropout=0.0,
        attention_dropout=0.0,
    )
    OPTForCausalLM(config).save_pretrained(w / "tiny-opt")


_IMPORT = re.compile(r"^(\s*)import deepspeed(\.[\w.]+)?( as \w+)?$")
_FROM = re.compile(r"^(\s*)from deepspeed((\.[\w.]+)?) import ")


def with_slipstream_imports(source: str) -> str:
    """The only edit a user makes: every import of ``deepspeed`` names slipstream instead."""
    lines = []
    for line in source.splitlines():
        m = _IMPORT.match(line)
        if m:
            indent, sub, alias = m.group(1), m.group(2) or "", m.group(3)
            if alias or not sub:
                line = f"{indent}import slipstream{sub}{alias or ' as deepspeed'}"
            else:  # `import deepspeed.x` binds `deepspeed` too
                line = f"{indent}import slipstream{sub}\n{indent}import slipstream as deepspeed"
        else:
            line = _FROM.sub(lambda m: f"{m.group(1)}from slipstream{m.group(2)} import ", line)
        lines.append(line)
    return "\n".join(lines) + "\n"


def _run(path: Path, argv: list[str], rewrite: bool) -> None:
    source = path.read_text()
    if rewrite:
        source = with_slipstream_imports(source)
    old_argv = sys.argv
    sys.argv = [str(path), *argv]
    try:
        exec(compile(source, str(path), "exec"), {"__name__": "__main__", "__file__": str(path)})
    finally:
        sys.argv = old_argv


def _without_deepspeed() -> dict[str, Any]:
    """Make ``deepspeed`` unimportable; returns what to put back."""
    saved = {n: m for n, m in sys.modules.items() if n == "deepspeed" or n.startswith("deepspeed.")}
    for name in saved:
        del sys.modules[name]
    sys.modules["deepspeed"] = None  # type: ignore[assignment]
    return saved


def run_mode(workdir: str, mode: str, only: list[str] | None = None) -> dict[str, Any]:
    """Run every script (or those in ``only``) in this rank; script -> losses or error."""
    import torch.distributed as dist

    results: dict[str, Any] = {}
    for script, argv in jobs(workdir, mode).items():
        if only is not None and script not in only:
            continue
        loss_file = Path(workdir) / mode / f"{script}.losses.json"
        loss_file.parent.mkdir(parents=True, exist_ok=True)
        saved = _without_deepspeed() if mode == "import" else None
        try:
            _run(SCRIPTS / script, [*argv, "--loss_file", str(loss_file)], rewrite=mode == "import")
            dist.barrier()
            results[script] = json.loads(loss_file.read_text())
        except BaseException:  # reported per script: the others still run
            results[script] = "error: " + traceback.format_exc()
        finally:
            if saved is not None:
                del sys.modules["deepspeed"]
                sys.modules.update(saved)
    return results


def slipstream_modes(workdir: str) -> dict[str, Any]:
    """In ranks started with SLIPSTREAM_AS_DEEPSPEED=1: unchanged scripts, then the
    import-rewritten ones with ``deepspeed`` unimportable."""
    return {"switch": run_mode(workdir, "switch"), "import": run_mode(workdir, "import")}


def deepspeed_mode(workdir: str) -> dict[str, Any]:
    from tests.compat._deepspeed import import_deepspeed

    import_deepspeed()
    return {"deepspeed": run_mode(workdir, "deepspeed")}
