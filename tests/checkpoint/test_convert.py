"""slipstream convert: consolidated safetensors from any checkpoint, streamed, HF-loadable."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file

from slipstream.checkpoint import convert_checkpoint
from slipstream.checkpoint.export import parse_size
from slipstream.cli.main import main as cli
from tests.checkpoint import _workloads as w
from tests.distributed.harness import run_world


def test_hf_checkpoint_converts_to_a_model_from_pretrained_loads(tmp_path):
    """ZeRO-3, bf16, 2 ranks -> `slipstream convert` -> LlamaForCausalLM.from_pretrained."""
    transformers = pytest.importorskip("transformers")
    saved = run_world(w.hf_save, 2, str(tmp_path / "ckpt"))[0]["params"]
    out = tmp_path / "hf"
    assert cli(["convert", str(tmp_path / "ckpt"), str(out), "--max-shard-size", "60KB"]) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2  # really sharded
    model = transformers.LlamaForCausalLM.from_pretrained(out, torch_dtype=torch.bfloat16)
    got = dict(model.named_parameters())
    for name, p in saved.items():
        assert torch.equal(got[name].detach(), p), name
    # fp32 export takes the fp32 masters: rounding them to bf16 gives the bf16 weights back.
    convert_checkpoint(tmp_path / "ckpt", tmp_path / "fp32", dtype="fp32")
    fp32 = load_file(tmp_path / "fp32" / "model.safetensors")
    name = "model.layers.0.mlp.up_proj.weight"
    assert fp32[name].dtype == torch.float32
    assert torch.equal(fp32[name].to(torch.bfloat16), saved[name])
    assert not torch.equal(fp32[name], saved[name].float())  # masters carry more bits


def test_bad_inputs_are_named(tmp_path, capsys):
    assert cli(["convert", str(tmp_path / "nope"), str(tmp_path / "out")]) == 2
    assert "neither a checkpoint tag directory" in capsys.readouterr().err
    with pytest.raises(ValueError, match="'5 parsecs'"):
        parse_size("5 parsecs")
    assert parse_size("2GiB") == 2 * 2**30 and parse_size("500MB") == 500 * 10**6


_PEAK = textwrap.dedent(
    """
    import sys, torch
    from slipstream.checkpoint import convert_checkpoint

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key):
                return int(line.split()[1]) * 1024

    torch.zeros(1)  # allocator warm-up
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak-RSS high-water mark to the current RSS
    base = status("VmRSS:")
    convert_checkpoint(sys.argv[1], sys.argv[2], max_shard_size="1GB")
    print(status("VmHWM:") - base)
    """
)


def _synthetic_checkpoint(path, layers: int, width: int) -> int:
    """A model-only checkpoint written with the format module (no engine): returns bytes."""
    from slipstream.checkpoint.format import (
        FORMAT_VERSION,
        write_manifest,
        write_object,
        write_pieces,
    )

    path.mkdir()
    tensors, pieces, files = {}, [], {}
    chunk = {}
    for i in range(layers):
        name = f"layers.{i}.weight"
        tensors[f"model/{name}"] = {"shape": [width, width], "dtype": "float32"}
        chunk[f"model/{name}@0"] = torch.full((width * width,), float(i))
        pieces.append(
            [f"model/{name}", 0, width * width, "rank-00000.safetensors", f"model/{name}@0"]
        )
    files["rank-00000.safetensors"] = list(write_pieces(path / "rank-00000.safetensors", chunk))
    files["extra.pt"] = list(write_object(path / "extra.pt", {}))
    manifest = {
        "format_version": FORMAT_VERSION,
        "tensors": tensors,
        "pieces": pieces,
        "files": files,
    }
    write_manifest(path / "manifest.json", manifest)
    return layers * width * width * 4


def test_convert_peak_memory_is_bounded_by_the_largest_tensor_not_the_model(tmp_path):
    """48 tensors of 4 MiB (192 MiB model): converting must not hold the model in memory."""
    model_bytes = _synthetic_checkpoint(tmp_path / "ck", layers=48, width=1024)
    out = subprocess.run(
        [sys.executable, "-c", _PEAK, str(tmp_path / "ck"), str(tmp_path / "out")],
        capture_output=True, text=True, check=True, timeout=120,
    )  # fmt: skip
    peak = int(out.stdout.strip().splitlines()[-1])
    largest = 1024 * 1024 * 4
    print(
        f"convert peak RSS growth {peak / 2**20:.1f} MiB for a {model_bytes / 2**20:.0f} MiB model"
    )
    assert peak < 6 * largest < model_bytes / 4
    got = load_file(tmp_path / "out" / "model.safetensors")
    assert len(got) == 48 and torch.equal(got["layers.7.weight"], torch.full((1024, 1024), 7.0))
