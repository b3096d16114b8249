"""Rank side of the ZeRO-3 tests for parameters made outside ``zero.Init``: a Hugging Face
model loaded with ``from_pretrained`` under ``HfDeepSpeedConfig`` (so through ``zero.Init``),
then changed the way real code changes it: ``resize_token_embeddings`` (which rebuilds the
embedding, and an untied ``lm_head``, as plain modules) or a head added after loading
(DeepSpeed-Chat's reward model ``v_head``). The test process trains the same model built
without ``zero.Init`` from the same starting values and compares."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import slipstream
from slipstream.zero import GatheredParameters

STEPS = 3
MICRO = 2
SEQ = 8
VOCAB = 64
ADDED = 6  # tokens resize_token_embeddings adds
LR = 1e-2


def save_tiny_llama(path: str, tie: bool) -> None:
    """A 2-layer LLaMA with random weights, saved as a from_pretrained directory."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tie,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(path)


def config(dtype: str = "fp32") -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "bf16": {"enabled": dtype == "bf16"},
        "gradient_clipping": 0.0,  # the torch reference does not clip
    }


class ValueHead(nn.Module):
    """DeepSpeed-Chat's reward model in miniature: a base model and a ``v_head`` added after
    loading it (so outside ``zero.Init``)."""

    def __init__(self, base: nn.Module, hidden: int) -> None:
        super().__init__()
        self.rwtransformer = base
        self.v_head = nn.Linear(hidden, 1, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.rwtransformer(input_ids=input_ids).last_hidden_state
        return self.v_head(hidden).squeeze(-1)

    def forward_value(self, input_ids: torch.Tensor) -> torch.Tensor:
        """DeepSpeed-Chat's scoring entry point: a method other than ``forward``, called on
        the engine, that runs the submodules itself (so no hook of the root module fires)."""
        hidden = self.rwtransformer(input_ids=input_ids)[0]
        return self.v_head(hidden).squeeze(-1)


def batches(world: int, vocab: int) -> list[torch.Tensor]:
    """One global batch per step (rank ``r`` reads rows ``r*MICRO:(r+1)*MICRO``)."""
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, vocab, (MICRO * world, SEQ), generator=g) for _ in range(STEPS)]


def vocab_of(case: str) -> int:
    """The token ids a case trains on (the head cases keep the loaded vocabulary)."""
    return VOCAB if case.startswith("head") else VOCAB + ADDED


def loss_of(model: nn.Module, case: str, x: torch.Tensor) -> torch.Tensor:
    if case.startswith("head"):
        values = model.forward_value(x) if case == "head_value" else model(x)
        return ((values.float() - x.float() / VOCAB) ** 2).mean()
    return model(input_ids=x, labels=x).loss


def build(case: str, model_dir: str, ds_config: dict[str, Any]) -> nn.Module:
    """Load under ``HfDeepSpeedConfig`` (ZeRO-3: through ``zero.Init``), then change it."""
    from transformers import AutoModel, AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    keep = HfDeepSpeedConfig(ds_config)  # transformers holds a weak reference
    if case.startswith("head"):
        base = AutoModel.from_pretrained(model_dir)
        model: nn.Module = ValueHead(base, base.config.hidden_size)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir)
        model.resize_token_embeddings(VOCAB + ADDED)
    del keep
    return model


def _gathered(model: nn.Module) -> dict[str, torch.Tensor]:
    with GatheredParameters(list(model.parameters())):
        return {n: p.detach().float().clone() for n, p in model.named_parameters()}


def run_case(case: str, model_dir: str) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = config("bf16" if case.endswith("bf16") else "fp32")
    torch.manual_seed(100 + rank)  # ranks draw different new rows: initialize must agree them
    model = build(case, model_dir, cfg)
    late = sorted(n for n, p in model.named_parameters() if not hasattr(p, "ds_id"))
    engine, *_ = slipstream.initialize(model=model, config=cfg)
    params = dict(engine.module.named_parameters())
    dtypes = {n: str(p.dtype) for n, p in params.items()}
    start = _gathered(engine.module)
    losses = []
    for x in batches(world, vocab_of(case)):
        loss = loss_of(engine, case, x[rank * MICRO : (rank + 1) * MICRO])
        engine.backward(loss)
        engine.step()
        every = [torch.zeros(()) for _ in range(world)]
        dist.all_gather(every, loss.detach().float())
        losses.append(torch.stack(every).mean().item())
    scored = None
    if case == "head_value":  # then score as generate_experience does: eval, no_grad
        engine.eval()
        with torch.no_grad():
            scored = engine.forward_value(x[rank * MICRO : (rank + 1) * MICRO]).float()
        released = [n for n, p in params.items() if p.numel() == 0 and p.ds_numel > 0]
        scored = {"x": x[rank * MICRO : (rank + 1) * MICRO], "values": scored, "released": released}
    tied = None
    if hasattr(engine.module, "lm_head"):
        tied = engine.module.lm_head.weight is engine.module.get_input_embeddings().weight
    out = {
        "late": late,
        "partitioned": all(hasattr(p, "ds_id") for p in params.values()),
        "dtypes": dtypes,
        "start": start,
        "losses": losses,
        "final": _gathered(engine.module),
        "tied": tied,
        "scored": scored,
    }
    engine.destroy()
    return out


def all_cases(dirs: dict[str, str]) -> dict[str, Any]:
    cases = {
        "resize_tied": dirs["tied"],
        "resize_untied": dirs["untied"],
        "head": dirs["untied"],
        "head_value": dirs["untied"],
        "head_bf16": dirs["untied"],
    }
    out: dict[str, Any] = {}
    for case, path in cases.items():
        try:
            out[case] = run_case(case, path)
        except Exception as exc:  # report per case; the test names it
            out[case] = f"{type(exc).__name__}: {exc}"
    return out
