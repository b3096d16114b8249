"""Rank body of the tensor-parallel inference tests (2 gloo ranks)."""

from __future__ import annotations

from typing import Any

import torch

from slipstream.distributed import comm
from slipstream.inference import init_inference, paged_generate
from slipstream.models import GPT, GPTConfig
from tests._tiny_models import PAD, VOCAB, left_padded, tiny_llama

LENGTHS = [3, 8, 5]
NEW = 8
SAMPLE = dict(do_sample=True, temperature=0.9, top_k=30, top_p=0.95)


def tiny_gpt() -> torch.nn.Module:
    torch.manual_seed(0)
    return GPT(GPTConfig.preset("tiny", vocab_size=VOCAB)).eval()


MODELS = {"gpt": tiny_gpt, "llama": tiny_llama}


def generations(engine: Any) -> dict[str, torch.Tensor]:
    """Greedy and seeded sampled generations of one engine (the same calls at any TP size)."""
    ids, mask = left_padded(LENGTHS)
    kw = dict(attention_mask=mask, max_new_tokens=NEW)
    return {
        "greedy": engine.generate(ids, **kw),
        "sampled": engine.generate(ids, seed=11, **kw, **SAMPLE),
        "sampled_again": engine.generate(ids, seed=11, **kw, **SAMPLE),
        "generator": engine.generate(
            ids, generator=torch.Generator().manual_seed(11), **kw, **SAMPLE
        ),
    }


class _Recorded(paged_generate.ContinuousBatchingEngine):
    """The paged engine, each instance kept to check where its blocks are afterwards."""

    made: list[paged_generate.ContinuousBatchingEngine] = []

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.made.append(self)


def _paged_runs(engine: Any, ids: torch.Tensor, **kw: Any) -> tuple[torch.Tensor, list[Any]]:
    """``engine.generate(ids, **kw)`` and the paged engines it ran (forwards, blocks)."""
    _Recorded.made = []
    real = paged_generate.ContinuousBatchingEngine
    sync, broadcasts = engine._sync, []
    tokens = sync.tokens
    sync.tokens = lambda t: broadcasts.append(t.numel()) or tokens(t)  # TP rank 0's tokens
    paged_generate.ContinuousBatchingEngine = _Recorded  # type: ignore[misc]
    try:
        out = engine.generate(ids, **kw)
    finally:
        paged_generate.ContinuousBatchingEngine = real  # type: ignore[misc]
        del sync.tokens
    runs = [(e.num_forwards, len(broadcasts), e.free_blocks(), e.total_blocks())
            for e in _Recorded.made]  # fmt: skip
    return out, runs


def paged_and_static(engine: Any, static: Any) -> dict[str, Any]:
    """Greedy on the paged engine (``kv_cache`` auto) and the static loop ("dynamic"), the
    plain batch and one whose rows stop at an EOS at different steps (rows leave the batch)."""
    ids, mask = left_padded(LENGTHS)
    kw: dict[str, Any] = dict(attention_mask=mask, max_new_tokens=NEW)
    res: dict[str, Any] = {}
    res["paged"], res["paged_runs"] = _paged_runs(engine, ids, **kw)
    res["static"] = static.generate(ids, **kw)
    eos = int(res["static"][1, ids.shape[1] + 2])  # row 1 ends at its third new token
    kw.update(eos_token_id=eos, pad_token_id=PAD)
    res["eos"] = eos
    res["paged_eos"], res["paged_eos_runs"] = _paged_runs(engine, ids, **kw)
    res["static_eos"] = static.generate(ids, **kw)
    return res


def tp_generation() -> dict[str, Any]:
    rank = comm.get_rank()
    out: dict[str, Any] = {}
    for name, build in MODELS.items():
        model = build()
        key = "mp_size" if name == "gpt" else "tensor_parallel"
        value: Any = 2 if name == "gpt" else {"tp_size": 2}
        engine = init_inference(model, **{key: value})
        res = generations(engine)
        static = init_inference(build(), **{key: value}, kv_cache="dynamic")
        res.update(paged_and_static(engine, static))
        # Each rank's global RNG differs: sampling without a seed must still agree.
        torch.manual_seed(100 + rank)
        ids, mask = left_padded(LENGTHS)
        res["unseeded"] = engine.generate(ids, attention_mask=mask, max_new_tokens=NEW, **SAMPLE)
        res["local_heads"] = engine.module.get_submodule(
            "layers.0.attn.q_proj" if name == "gpt" else "model.layers.0.self_attn.q_proj"
        ).weight.shape[0]
        out[name] = res
    # A rank asking for something else is an error on every rank, not a hang.
    ids, mask = left_padded(LENGTHS, seed=1 + rank)
    try:
        engine.generate(ids, attention_mask=mask, max_new_tokens=NEW)
        out["mismatch"] = None
    except RuntimeError as err:
        out["mismatch"] = str(err)
    return out
