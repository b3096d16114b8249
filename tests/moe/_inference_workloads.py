"""Expert-parallel generation on 2 ranks against one process holding every expert."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from tests.moe import _autoep_workloads as aw

NEW = 6


def _gpt(ep: int) -> Any:
    from slipstream.models import GPT, GPTConfig, GPTMoEConfig

    torch.manual_seed(0)
    moe = GPTMoEConfig(num_experts=4, every=1, k=2, capacity_factor=None, ep_size=ep)
    return GPT(GPTConfig.preset("tiny", moe=moe)).eval()


def _local_state(full: dict[str, torch.Tensor], local: Any, rank: int) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in local.state_dict().items():
        src = full[name]
        if src.shape != t.shape:  # stacked experts: this rank's rows
            n = t.shape[0]
            src = src[rank * n : (rank + 1) * n]
        out[name] = src
    return out


def world() -> dict[str, Any]:
    import slipstream

    rank = dist.get_rank()
    out: dict[str, Any] = {}
    # The reference GPT with dropless experts, 2 per rank. The ranks of an expert-parallel
    # group generate one request (it is checked), so both get the same prompt.
    ids = torch.randint(0, 256, (2, 5), generator=torch.Generator().manual_seed(7))
    ref = _gpt(1)
    want = ref.generate(ids, NEW, temperature=0)
    gpt = _gpt(2)
    gpt.load_state_dict(_local_state(ref.state_dict(), gpt, rank))
    engine = slipstream.init_inference(gpt, config={"moe": {"enabled": True, "ep_size": 2}})
    got = engine.generate(ids, max_new_tokens=NEW, do_sample=False)
    out["gpt"] = (got, want)
    # A Hugging Face Mixtral with all its experts: AutoEP keeps this rank's half.
    hf = aw.build("mixtral").eval()
    ids = torch.randint(0, aw.VOCAB, (2, 5), generator=torch.Generator().manual_seed(8))
    kw = {"max_new_tokens": NEW, "do_sample": False, "pad_token_id": 0}
    want = hf.generate(ids, **kw)
    conv = aw.build("mixtral").eval()
    engine = slipstream.init_inference(conv, config={"ep_size": 2, "moe_experts": [4]})
    experts = conv.model.layers[0].mlp.experts
    out["hf"] = (engine.generate(ids, **kw), want, tuple(experts.gate_up_proj.shape))
    # tp 2 with every expert on both ranks (ep 1): attention and the dense layers split over
    # the two ranks, each MoE layer replicated on both. Shapes: (q_proj, experts' first weight).
    gpt = _gpt(1)
    engine = slipstream.init_inference(gpt, tensor_parallel={"tp_size": 2}, moe={"ep_size": 1})
    got = engine.generate(out["gpt"][0][:, :5], max_new_tokens=NEW, do_sample=False)
    layer = gpt.layers[0]
    shapes = (tuple(layer.attn.q_proj.weight.shape), tuple(layer.mlp.moe.experts.w1.shape))
    out["gpt_tp"] = (got, out["gpt"][1], shapes)
    conv = aw.build("mixtral").eval()
    engine = slipstream.init_inference(conv, tensor_parallel={"tp_size": 2}, moe_experts=[4])
    layer = conv.model.layers[0]
    attn, experts = layer.self_attn, layer.mlp.experts
    shapes = (tuple(attn.q_proj.weight.shape), tuple(experts.gate_up_proj.shape))
    out["hf_tp"] = (engine.generate(ids, **kw), want, shapes)
    return out
