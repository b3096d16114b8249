"""MoE checkpoints save each expert once by its global expert id and load at another world
size, ep_size and ZeRO stage: saved at ep_size 2 on 2 ranks (ZeRO-3) and loaded at ep_size 1
on one process (ZeRO-2), and the reverse, the parameters are equal and training continues
with the same losses. zero_to_fp32 of an AutoEP checkpoint gives the plain Hugging Face state
dict, and its safetensors export loads with Mixtral's from_pretrained."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.distributed.harness import run_world
from tests.moe import _autoep_workloads as aw
from tests.moe import _ckpt_workloads as w

pytest.importorskip("transformers")


def _cases(root: Path) -> dict[str, Any]:
    """For each kind: ep2 (world 2, ZeRO-3: experts partitioned over their expert-data-parallel
    group) saves, ep1 (world 1, ZeRO-0) saves; each loads the other's checkpoint (ep1 at
    ZeRO-2, ep2 at ZeRO-3). Four worlds, both kinds in each."""
    a, b = str(root / "ep2"), str(root / "ep1")
    ep1_saves = run_world(w.both, 1, 1, 0, None, b)[0]
    ep2_saves = run_world(w.both, 2, 2, 3, None, a)
    ep1_loads = run_world(w.both, 1, 1, 2, a, None)[0]
    ep2_loads = run_world(w.both, 2, 2, 3, b, None)
    out: dict[str, Any] = {"ep2_dir": a}
    for kind in ("autoep", "deepspeed"):
        out[kind] = {
            "ep1_saves": ep1_saves[kind],
            "ep2_saves": [r[kind] for r in ep2_saves],
            "ep1_loads_ep2": ep1_loads[kind],
            "ep2_loads_ep1": [r[kind] for r in ep2_loads],
            "export": w.export(f"{a}/{kind}"),
        }
    return out


@pytest.fixture(scope="module")
def cases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _cases(tmp_path_factory.mktemp("moeckpt"))


def _rows(full: torch.Tensor, local: torch.Tensor, rank: int) -> torch.Tensor:
    n = local.shape[0]
    return full[rank * n : (rank + 1) * n] if full.shape != local.shape else full


@pytest.mark.parametrize("kind", ["autoep", "deepspeed"])
def test_reshard_between_ep_sizes(cases: dict[str, Any], kind: str) -> None:
    c = cases[kind]
    ep1, ep2 = c["ep1_saves"], c["ep2_saves"]
    # Training before the save was the same at both sizes, so both checkpoints hold the
    # same model; every continuation from either checkpoint gives the same losses.
    ref = ep1["continued"]
    for run in (ep2[0], c["ep1_loads_ep2"], c["ep2_loads_ep1"][0], c["ep2_loads_ep1"][1]):
        assert run["continued"] == pytest.approx(ref, rel=1e-4, abs=1e-6)
    # ep1 loading the ep2 checkpoint: every expert, from both ranks, in place.
    loaded = c["ep1_loads_ep2"]["params"]
    assert loaded.keys() == ep1["params"].keys()
    for name, p in loaded.items():
        torch.testing.assert_close(p, ep1["params"][name], rtol=1e-4, atol=1e-6)
    # ep2 loading the ep1 checkpoint: each rank its own experts.
    for rank, res in enumerate(c["ep2_loads_ep1"]):
        for name, p in res["params"].items():
            saved = ep2[rank]["params"][name]
            torch.testing.assert_close(p, saved, rtol=1e-4, atol=1e-6)


def test_export_to_deepspeed_is_refused(cases: dict[str, Any]) -> None:
    """DeepSpeed's expert files are not written: the ep_size 2 checkpoint is refused by name."""
    from slipstream.checkpoint.format import CheckpointError
    from slipstream.checkpoint.to_deepspeed import export_deepspeed

    with pytest.raises(CheckpointError, match=r"MoE expert parallelism \(ep_size \[2\]\)"):
        export_deepspeed(cases["ep2_dir"] + "/deepspeed/t", cases["ep2_dir"] + "/ds-out")


def test_export_is_a_plain_hf_state_dict(cases: dict[str, Any]) -> None:
    """zero_to_fp32 of the ep2 AutoEP checkpoint: Mixtral's own keys and shapes, all
    experts, loadable with strict=True; the values are the trained ones."""
    sd = cases["autoep"]["export"]
    model = aw.build("mixtral")
    want = model.state_dict()
    assert {k: tuple(v.shape) for k, v in sd.items() if k in want} == {
        k: tuple(v.shape) for k, v in want.items() if k in sd
    }
    model.load_state_dict(sd, strict=True)
    trained = cases["autoep"]["ep1_loads_ep2"]["params"]
    for name, p in trained.items():
        torch.testing.assert_close(sd[name], p, rtol=0, atol=0)


def test_safetensors_export_loads_with_from_pretrained(
    cases: dict[str, Any], tmp_path: Path
) -> None:
    """convert_zero_checkpoint_to_fp32_state_dict(safe_serialization=True) of the ep2 AutoEP
    checkpoint writes model.safetensors and the model's config.json: Mixtral's
    from_pretrained reads the directory with every expert, nothing missing or unexpected,
    its parameters are the trained ones, and AutoEP converts it again with the same logits."""
    from transformers import MixtralForCausalLM

    from slipstream.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict

    out = tmp_path / "hf"
    ckpt = cases["ep2_dir"] + "/autoep"
    convert_zero_checkpoint_to_fp32_state_dict(ckpt, out, safe_serialization=True, tag="t")
    assert {p.name for p in out.iterdir()} >= {"model.safetensors", "config.json"}
    model, info = MixtralForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched keys
    trained = cases["autoep"]["ep1_loads_ep2"]["params"]
    got = dict(model.named_parameters())
    assert got.keys() == trained.keys()
    for name, p in trained.items():
        torch.testing.assert_close(got[name].detach(), p, rtol=0, atol=0)
    assert got["model.layers.0.mlp.experts.gate_up_proj"].shape[0] == 4  # both ranks' experts
    # The round trip closes: AutoEP converts the from_pretrained model, with the same logits.
    from slipstream.config.expert import ExpertParallelConfig
    from slipstream.moe.autoep import convert_hf_moe_

    model.eval()
    ids = aw.batch(0, 0)
    ref = model(input_ids=ids).logits
    assert convert_hf_moe_(model, ExpertParallelConfig(enabled=True), 0)
    torch.testing.assert_close(model(input_ids=ids).logits, ref, rtol=1e-5, atol=1e-5)
