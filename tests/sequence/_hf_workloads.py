"""Rank bodies and single-process references for Ulysses on Hugging Face causal LMs."""

from __future__ import annotations

import shutil
import tempfile
from typing import Any

import torch
import torch.distributed as dist

STEPS = 3
SEQ = 16
SAMPLES = 16
BATCH = 4
VOCAB = 64
# SGD, not Adam: Adam is invariant to a constant gradient scale, which would hide P-fold errors.
LR = 0.5

# name -> (family, num_attention_heads, num_key_value_heads, attention implementation)
MODELS = {
    "llama_gqa2": ("llama", 4, 2, "sdpa"),
    "llama_eager": ("llama", 4, 4, "eager"),
    "qwen2_kv1": ("qwen2", 4, 1, "sdpa"),  # GQA with fewer KV heads than P=2: replicated
    "llama_heads3": ("llama", 3, 3, "sdpa"),  # 3 heads over P=2: refused
    "mistral_gqa2": ("mistral", 4, 2, "sdpa"),
    "qwen3_gqa2": ("qwen3", 4, 2, "sdpa"),  # q/k norms before RoPE
    "gpt2": ("gpt2", 4, 4, "sdpa"),  # learned absolute positions, fused QKV
    "opt": ("opt", 4, 4, "sdpa"),  # learned positions with OPT's offset of 2
}


def make_model(name: str) -> torch.nn.Module:
    """A tiny fp32 LlamaForCausalLM / Qwen2ForCausalLM built from a config, seeded."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    if name == "bert_mlm":  # not a causal LM: refused
        from transformers import BertConfig, BertForMaskedLM

        torch.manual_seed(0)
        config = BertConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=1,
            num_attention_heads=4,
            intermediate_size=48,
        )
        return BertForMaskedLM(config)
    family, heads, kv, attn = MODELS[name]
    common = dict(
        vocab_size=VOCAB,
        hidden_size=8 * heads,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        attn_implementation=attn,
    )
    torch.manual_seed(0)
    if family == "llama":
        return LlamaForCausalLM(LlamaConfig(**common))
    if family == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**common))
    return _other_family(family, common)


def _other_family(family: str, common: dict[str, Any]) -> torch.nn.Module:
    """Mistral, Qwen3, GPT-2 and OPT of the same size, dropout off (the parity is exact)."""
    import transformers as tf

    if family in ("mistral", "qwen3"):
        config_cls, model_cls = {
            "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
            "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
        }[family]
        return model_cls(config_cls(**common, head_dim=8))
    heads, attn = common["num_attention_heads"], common["attn_implementation"]
    if family == "gpt2":
        config = tf.GPT2Config(vocab_size=VOCAB, n_embd=8 * heads, n_layer=2, n_head=heads,
                               n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                               tie_word_embeddings=False, attn_implementation=attn)  # fmt: skip
        return tf.GPT2LMHeadModel(config)
    config = tf.OPTConfig(vocab_size=VOCAB, hidden_size=8 * heads, num_hidden_layers=2,
                          ffn_dim=48, num_attention_heads=heads, max_position_embeddings=64,
                          word_embed_proj_dim=8 * heads, dropout=0.0, attention_dropout=0.0,
                          tie_word_embeddings=False, attn_implementation=attn)  # fmt: skip
    return tf.OPTForCausalLM(config)


class LMData(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Token rows whose labels are ignored (-100) on a varying prefix, so the sequence shards
    hold different numbers of counted tokens (a mean of per-shard means would be wrong)."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(1234)
        self.ids = torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=g)
        self.labels = self.ids.clone()
        for i in range(SAMPLES):
            self.labels[i, : (3 * i) % 11] = -100

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def _config(stage: int, sp: int) -> dict[str, Any]:
    return {
        "train_batch_size": BATCH,
        "optimizer": {"type": "SGD", "params": {"lr": LR, "momentum": 0.9}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "sequence_parallel_size": sp,
        "seed": 7,
        "gradient_clipping": 0.0,
    }


def engine_run(name: str, stage: int) -> dict[str, Any]:
    """SP = world through ``slipstream.initialize`` and the loader it builds."""
    import slipstream

    sp = dist.get_world_size()
    model = make_model(name)
    engine, _, loader, _ = slipstream.initialize(
        model=model, config=_config(stage, sp), training_data=LMData()
    )
    losses, shapes, attn = [], set(), model.config._attn_implementation
    for _, batch in zip(range(STEPS), loader):
        shapes.add(tuple(batch["input_ids"].shape))
        loss = engine(**batch).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    with slipstream.zero.GatheredParameters(list(engine.module.parameters())):
        params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    engine.destroy()
    return {"losses": losses, "params": params, "shapes": sorted(shapes), "attn": attn}


def refusal(name: str) -> str:
    import slipstream

    try:
        slipstream.initialize(model=make_model(name), config=_config(0, dist.get_world_size()))
    except ValueError as err:
        return str(err)
    return "no error"


def world(runs: list[tuple[str, int]], refused: list[str]) -> dict[str, Any]:
    return {
        "training": {r: engine_run(*r) for r in runs},
        "refused": {n: refusal(n) for n in refused},
    }


def reference_run(name: str) -> dict[str, Any]:
    """One process, the whole batch, the sampler's order (seed 7), the model's own loss."""
    model = make_model(name)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    losses = []
    for batch in _global_batches()[:STEPS]:
        loss = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return {"losses": losses, "params": {n: p.detach() for n, p in model.named_parameters()}}


# ------------------------------------------------------------------ DeepSpeed's ALST names
def alst_run(name: str, stage: int) -> dict[str, Any]:
    """DeepSpeed's ALST script shape: register, initialize(mpu=), the loader adapter, and the
    loss from shift_labels weighted by each shard's token count (differentiable all-gather)."""
    import torch.distributed.nn.functional as dist_fn

    import slipstream
    from slipstream.runtime.sequence_parallel.ulysses_sp import (
        UlyssesSPAttentionHF,
        UlyssesSPDataLoaderAdapter,
    )

    sp = dist.get_world_size()
    model = make_model(name)
    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model,
        core_attn_implementation="sdpa",
        sequence_parallel_size=sp,
        micro_batch_size=BATCH,
        seq_length_is_variable=True,
    )
    assert mpu is not None
    engine, _, _, _ = slipstream.initialize(model=model, config=_config(stage, sp), mpu=mpu)
    group, rank = mpu.get_sequence_parallel_group(), mpu.get_sequence_parallel_rank()
    # Rank r reads global batches r, r+P, ...: the adapter serves them in global order.
    batches = _global_batches()
    mine = [batches[k] for k in range(rank, len(batches), sp)]
    loader = UlyssesSPDataLoaderAdapter(mine, rank, group, sp, engine.device)
    losses = []
    for _, batch in zip(range(STEPS), loader):
        shift_labels = batch.pop("shift_labels")
        logits = engine(**batch).logits
        local = engine.module.loss_function(
            logits=logits, labels=None, shift_labels=shift_labels, vocab_size=VOCAB
        )
        good = (shift_labels != -100).sum()
        per_rank = dist_fn.all_gather(local, group=group)
        counts = [int(c) for c in dist_fn.all_gather(good, group=group)]
        loss = sum(lo * c for lo, c in zip(per_rank, counts)) / sum(counts)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    with slipstream.zero.GatheredParameters(list(engine.module.parameters())):
        params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    engine.destroy()
    return {"losses": losses, "params": params}


def _global_batches() -> list[dict[str, torch.Tensor]]:
    order = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(7)).tolist()
    data = LMData()
    out = []
    for step in range(SAMPLES // BATCH):
        idx = order[step * BATCH : (step + 1) * BATCH]
        ids = torch.stack([data[i]["input_ids"] for i in idx])
        labels = torch.stack([data[i]["labels"] for i in idx])
        pos = torch.arange(SEQ).unsqueeze(0).expand(BATCH, -1)
        out.append({"input_ids": ids, "labels": labels, "position_ids": pos})
    return out


def hub_kernel_registration() -> dict[str, Any]:
    """``register_with_transformers`` with a Hub kernel name: transformers' lazy loader is
    called first (mocked here: it registers sdpa under the name, as loading would) and the
    name, not sdpa, is wrapped; the groups are objects, not None (DeepSpeed's contract)."""
    import transformers.modeling_flash_attention_utils as fa
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from slipstream.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    name, calls, real = "kernels-community/flash-attn2", [], fa.lazy_import_flash_attention
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]

    def lazy(implementation: str, *args: Any, **kwargs: Any) -> None:
        calls.append(implementation)
        ALL_ATTENTION_FUNCTIONS.register(implementation, sdpa)

    path = tempfile.mkdtemp(prefix="hub_kernel_")  # a path, as DeepSpeed's test passes
    make_model("llama_gqa2").config.save_pretrained(path)
    fa.lazy_import_flash_attention = lazy
    try:
        mpu = UlyssesSPAttentionHF.register_with_transformers(path, name, dist.get_world_size(), 1)
        wrapped = ALL_ATTENTION_FUNCTIONS[name] is not sdpa
    finally:
        fa.lazy_import_flash_attention = real
        ALL_ATTENTION_FUNCTIONS.pop(name, None)
        shutil.rmtree(path, ignore_errors=True)
    assert mpu is not None
    return {
        "calls": calls,
        "wrapped": wrapped,
        "sdpa_kept": ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa,
        "groups_not_none": mpu.get_sequence_parallel_group() is not None
        and mpu.get_sequence_data_parallel_group() is not None,
    }


def adapter_refusals() -> dict[str, str]:
    """UlyssesSPDataLoaderAdapter's errors: a batch without position_ids, a length (15) that
    does not split over the group, a tensor shorter than input_ids."""
    from slipstream.runtime.sequence_parallel import parallel_state_sp
    from slipstream.runtime.sequence_parallel.ulysses_sp import UlyssesSPDataLoaderAdapter

    group, rank = parallel_state_sp.get_sequence_parallel_group(), dist.get_rank()
    ids = torch.arange(15)[None]
    bad = {
        "no_positions": {"input_ids": ids, "labels": ids},
        "odd_length": {"input_ids": ids, "labels": ids, "position_ids": ids},
        "short_labels": {"input_ids": ids, "labels": ids[:, :7], "position_ids": ids},
    }
    out = {}
    for key, batch in bad.items():
        loader = UlyssesSPDataLoaderAdapter([batch], rank, group, dist.get_world_size(), "cpu")
        try:
            next(iter(loader))
            out[key] = "no error"
        except ValueError as err:
            out[key] = str(err)
    return out


def alst_world(name: str, stage: int) -> dict[str, Any]:
    run = alst_run(name, stage)
    return {**run, "hub": hub_kernel_registration(), "adapter": adapter_refusals()}


# ------------------------------------ the HF Trainer on Accelerate's DeepSpeed Ulysses path
def trainer_losses(outdir: str, sp: int) -> list[float]:
    """The Trainer with ``ParallelismConfig(sp_size=sp, sp_backend="deepspeed")`` (sp > 1;
    Accelerate calls ``UlyssesSPAttentionHF.register_with_transformers``, passes ``mpu=`` and
    wraps the loader in ``UlyssesSPDataLoaderAdapter``) or plain (sp == 1); SGD, 3 steps."""
    from transformers import Trainer, TrainingArguments

    extra: dict[str, Any] = {}
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": "auto",
        "train_batch_size": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": {"stage": 2},
    }
    if sp > 1:
        from accelerate.parallelism_config import ParallelismConfig
        from accelerate.utils import DeepSpeedSequenceParallelConfig

        handler = DeepSpeedSequenceParallelConfig(
            sp_seq_length_is_variable=True, sp_attn_implementation="sdpa"
        )
        extra["parallelism_config"] = ParallelismConfig(
            sp_size=sp, sp_backend="deepspeed", sp_handler=handler
        )
        cfg["sequence_parallel_size"] = sp
    args = TrainingArguments(
        output_dir=outdir,
        deepspeed=cfg,
        max_steps=STEPS,
        per_device_train_batch_size=BATCH,
        learning_rate=LR,
        optim="sgd",
        lr_scheduler_type="constant",
        max_grad_norm=0.0,
        logging_steps=1,
        report_to=[],
        seed=0,
        use_cpu=True,
        disable_tqdm=True,
        save_strategy="no",
        **extra,
    )
    data = [dict(LMData()[i], position_ids=torch.arange(SEQ)) for i in range(SAMPLES)]
    trainer = Trainer(model=make_model("qwen2_kv1"), args=args, train_dataset=data)
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]
