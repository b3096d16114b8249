"""Per-rank bodies of the hybrid-engine tests (run on 2 gloo ranks by tests/rlhf)."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from tests._tiny_models import EOS, PAD, VOCAB


def tiny_llama(seed: int = 0) -> nn.Module:
    from tests._tiny_models import tiny_llama as build

    return build(seed, layers=3, eval=False)


def config(stage: int, pin: bool = True) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "hybrid_engine": {"enabled": True, "max_out_tokens": 40, "pin_parameters": pin},
    }


def prompts(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompts, different on each rank (ranks generate their own)."""
    g = torch.Generator().manual_seed(100 + rank)
    lengths = [5, 3 + rank]
    ids = torch.full((2, 5), PAD)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, -n:] = torch.randint(EOS + 1, VOCAB, (n,), generator=g)
        mask[i, -n:] = 1
    return ids, mask


def all_gathers() -> int:
    from slipstream.distributed import comm

    return sum(e.calls for (_, op), e in comm.comm_counters.stats.items() if op == "all_gather")


def shard_state(engine: Any) -> list[int]:
    """Bytes of every partitioned parameter's storage this rank holds right now."""
    from slipstream.zero.sharded_store import unit_owner

    return [p.numel() for p in engine.module.parameters() if unit_owner(p) is not None]


def train_step(engine: Any, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(EOS + 1, VOCAB, (2, 9), generator=g)
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()


def full_params(engine: Any) -> dict[str, torch.Tensor]:
    import slipstream

    with slipstream.zero.GatheredParameters(list(engine.module.parameters())):
        return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def generation_checks(stage: int) -> dict[str, Any]:
    """ZeRO-``stage`` hybrid generation vs the unsharded model; gather counts; shards after."""
    import slipstream
    from slipstream.distributed import comm
    from slipstream.inference import generate
    from slipstream.rlhf import HybridEngine

    rank = comm.get_rank()
    model = tiny_llama()
    reference = copy.deepcopy(model).eval()
    engine, *_ = slipstream.initialize(model=model, config=config(stage))
    ids, mask = prompts(rank)
    new = 6 + 4 * rank  # different lengths per rank
    want = generate(reference, input_ids=ids, attention_mask=mask, max_new_tokens=new)
    hf_want = reference.generate(
        ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=PAD
    )
    out: dict[str, Any] = {"want": want, "hf_want": hf_want, "shards_before": shard_state(engine)}
    engine.eval()
    before = all_gathers()
    out["pinned"] = engine.generate(ids, attention_mask=mask, max_new_tokens=new)
    out["pinned_gathers"] = all_gathers() - before
    out["module_generate"] = engine.module.generate(
        ids, attention_mask=mask, max_new_tokens=new, do_sample=False, synced_gpus=True
    )
    unpinned_cfg = engine.config.hybrid_engine.model_copy(update={"pin_parameters": False})
    unpinned = HybridEngine(engine, unpinned_cfg)
    before = all_gathers()
    out["unpinned"] = unpinned.generate(ids, attention_mask=mask, max_new_tokens=new)
    out["unpinned_gathers"] = all_gathers() - before
    engine.train()
    out["shards_after"] = shard_state(engine)
    seqs = out["pinned"]  # generated ids feed the training forward (not inference tensors)
    engine.backward(engine(input_ids=seqs, labels=seqs).loss)
    engine.step()
    out["stats"] = engine.hybrid_engine.stats
    return out


def round_trip_checks(stage: int) -> dict[str, Any]:
    """A training step after 5 generate/train cycles equals one without them."""
    import slipstream
    from slipstream.distributed import comm

    rank = comm.get_rank()
    plain, *_ = slipstream.initialize(model=tiny_llama(), config=config(stage))
    cycled, *_ = slipstream.initialize(model=tiny_llama(), config=config(stage))
    train_step(plain, 1)
    train_step(cycled, 1)
    ids, mask = prompts(rank)
    layouts = []
    for i in range(5):
        cycled.eval()
        cycled.generate(ids, attention_mask=mask, max_new_tokens=4 + i)
        cycled.train()
        layouts.append(shard_state(cycled))
    train_step(plain, 2)
    train_step(cycled, 2)
    return {
        "plain": full_params(plain),
        "cycled": full_params(cycled),
        "layouts": layouts,
        "reference_layout": shard_state(plain),
    }


def refusals() -> dict[str, str]:
    """initialize refuses, on every rank and before training, what the engine cannot serve."""
    import slipstream

    errors = {}
    cases = {
        "not_causal": (nn.Linear(4, 4), config(3)),
        "tp": (tiny_llama(), {**config(1), "tensor_parallel": {"autotp_size": 2}}),
    }
    for name, (model, cfg) in cases.items():
        try:
            slipstream.initialize(model=model, config=cfg)
        except slipstream.ConfigError as e:
            errors[name] = str(e)
    return errors


def tiny_gpt(seed: int = 0) -> nn.Module:
    from slipstream.models.gpt import GPT, GPTConfig

    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=VOCAB, hidden_size=64, num_layers=3, num_heads=4,
                         num_kv_heads=2, max_seq_len=64))  # fmt: skip


def tp_config(stage: int, tp: int = 2, layers_at_a_time: int = 1) -> dict[str, Any]:
    cfg = config(stage)
    cfg["hybrid_engine"] = {
        **cfg["hybrid_engine"], "inference_tp_size": tp,
        "tp_gather_partition_size": layers_at_a_time,
    }  # fmt: skip
    return cfg


def tp_prompts(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompts of a different width, count and content on each rank."""
    g = torch.Generator().manual_seed(200 + rank)
    rows, width = 2 + rank, 5 + rank
    ids = torch.full((rows, width), PAD)
    mask = torch.zeros_like(ids)
    for i in range(rows):
        n = width - i
        ids[i, -n:] = torch.randint(EOS + 1, VOCAB, (n,), generator=g)
        mask[i, -n:] = 1
    return ids, mask


def tp_generation_checks() -> dict[str, Any]:
    """inference_tp_size 2 at world 2: the LLaMA (ZeRO-3, one layer gathered at a time, and
    ZeRO-1), the reference GPT (ZeRO-3, two layers at a time) and the LLaMA with LoRA
    adapters (ZeRO-3; fused into the TP copy) generate each rank's own prompts as the
    unsharded model does; the training layout is back afterwards."""
    import slipstream
    from slipstream.distributed import comm
    from slipstream.inference import generate
    from tests.rlhf._lora_workloads import lora_llama

    rank = comm.get_rank()
    ids, mask = tp_prompts(rank)
    new = 6 + 4 * rank  # different lengths per rank: the group decodes the longest
    out: dict[str, Any] = {}
    cases = {
        "llama3": (tiny_llama, tp_config(3, layers_at_a_time=1)),
        "llama1": (tiny_llama, tp_config(1, layers_at_a_time=8)),
        "gpt3": (tiny_gpt, tp_config(3, layers_at_a_time=2)),
        "lora3": (lora_llama, tp_config(3, layers_at_a_time=2)),
    }
    for name, (build, cfg) in cases.items():
        model = build()
        reference = copy.deepcopy(model).eval()
        want = generate(reference, input_ids=ids, attention_mask=mask, max_new_tokens=new)
        engine, *_ = slipstream.initialize(model=model, config=cfg)
        before = shard_state(engine)
        engine.eval()
        tokens_before = tp_token_broadcasts()
        with gathered_layers_spy(engine) as gathered:
            got = engine.module.generate(ids, attention_mask=mask, max_new_tokens=new)
        out[name] = {"want": want, "got": got, "steps": tp_token_broadcasts() - tokens_before}
        out[name]["gathered"] = gathered
        if name == "llama3":
            eos = early_eos(reference)
            out["eos"] = {
                "token": eos,
                "want": generate(reference, input_ids=ids, attention_mask=mask,
                                 max_new_tokens=new, eos_token_id=eos),
                "got": engine.generate(ids, attention_mask=mask, max_new_tokens=new,
                                       eos_token_id=eos),
            }  # fmt: skip
        engine.train()
        out[name].update(before=before, after=shard_state(engine))
        out[name]["stats"] = engine.hybrid_engine.stats
    return out


@contextlib.contextmanager
def gathered_layers_spy(engine: Any) -> Iterator[list[list[int]]]:
    """Record, at each gather the hybrid engine's TP build makes, which transformer layers
    of the training module are whole at that moment (ZeRO-3: a released parameter holds 0
    elements here)."""
    from slipstream.rlhf import hybrid_tp
    from slipstream.zero.sharded_store import unit_owner

    real = hybrid_tp.GatheredParameters
    seen: list[list[int]] = []

    @contextlib.contextmanager
    def spy(params: list[Any]) -> Iterator[None]:
        with real(params):
            whole = {
                int(name.split("layers.")[1].split(".")[0])
                for name, p in engine.module.named_parameters()
                if "layers." in name and unit_owner(p) is not None and p.numel() > 0
            }
            seen.append(sorted(whole))
            yield

    hybrid_tp.GatheredParameters = spy  # type: ignore[assignment,misc]
    try:
        yield seen
    finally:
        hybrid_tp.GatheredParameters = real  # type: ignore[misc]


def tp_token_broadcasts() -> int:
    """Broadcasts so far: a tensor-parallel group's decode agrees on each step's tokens with
    one (TPRankSync); nothing else in a generate call broadcasts."""
    from slipstream.distributed import comm

    return sum(e.calls for (_, op), e in comm.comm_counters.stats.items() if op == "broadcast")


def early_eos(reference: nn.Module) -> list[int]:
    """EOS tokens that end every row of rank 0 early while a row of rank 1 goes on
    (computed alike on both ranks, from greedy runs without EOS: an EOS only cuts a greedy
    row), so the group decodes on after rank 0's rows have ended."""
    from slipstream.inference import generate

    answers = []
    for rank in (0, 1):
        ids, mask = tp_prompts(rank)
        free = generate(reference, input_ids=ids, attention_mask=mask, max_new_tokens=6 + 4 * rank)
        answers.append(free[:, ids.shape[1] :])

    def new_tokens(rank: int, eos: list[int]) -> int:
        hits = torch.isin(answers[rank], torch.tensor(eos))
        if not bool(hits.any(1).all()):
            return answers[rank].shape[1]
        return int((hits.int().argmax(1) + 1).max())

    for step in range(answers[0].shape[1] - 1):
        eos = sorted(set(answers[0][:, step].tolist()))
        ends = new_tokens(0, eos)
        if ends < answers[0].shape[1] and new_tokens(1, eos) > ends:
            return eos
    raise AssertionError("no tokens end rank 0's rows early; change the prompts' seed")


@contextlib.contextmanager
def paged_engines_spy() -> Iterator[list[Any]]:
    """Record every continuous-batching engine the rollouts build (to read their block
    accounting and forward counts after the call)."""
    from slipstream.inference import paged_generate

    real = paged_generate.ContinuousBatchingEngine
    built: list[Any] = []

    class Recorded(real):  # type: ignore[misc,valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            built.append(self)

    paged_generate.ContinuousBatchingEngine = Recorded  # type: ignore[misc]
    try:
        yield built
    finally:
        paged_generate.ContinuousBatchingEngine = real  # type: ignore[misc]


def paged_rollout_checks() -> dict[str, Any]:
    """Rollouts on the continuous-batching engine where the static loop ran before:
    unpinned ZeRO-3 (every forward a collective: lock-step) and inference_tp_size 2. Ragged
    rows per rank (rank 0: 2 prompts of width 5, 6 new tokens; rank 1: 3 prompts of width 6,
    10 new tokens), EOS tokens that end rank 0's rows early, two copies per prompt; greedy
    against the static loop and the unsharded model, sampled twice with one seed."""
    import slipstream
    from slipstream.distributed import comm
    from slipstream.inference import generate

    rank = comm.get_rank()
    ids, mask = tp_prompts(rank)
    model = tiny_llama()
    reference = copy.deepcopy(model).eval()
    eos = early_eos(reference)
    greedy = {"attention_mask": mask, "max_new_tokens": 6 + 4 * rank, "eos_token_id": eos,
              "num_return_sequences": 2}  # fmt: skip
    sampled = {"attention_mask": mask, "max_new_tokens": 6 + 4 * rank, "do_sample": True,
               "top_k": 20, "seed": 7}  # fmt: skip
    out: dict[str, Any] = {"want": generate(reference, input_ids=ids, **greedy)}
    cases = {"z3": (model, config(3, pin=False)), "tp": (tiny_llama(), tp_config(3))}
    for name, (build, cfg) in cases.items():
        engine, *_ = slipstream.initialize(model=build, config=cfg)
        engine.eval()
        gathers, broadcasts = all_gathers(), tp_token_broadcasts()
        with paged_engines_spy() as engines:
            paged = engine.generate(ids, **greedy)
            gathers, broadcasts = all_gathers() - gathers, tp_token_broadcasts() - broadcasts
            draws = [engine.generate(ids, **sampled) for _ in range(2)]
        engine.hybrid_engine.rollouts = "static"
        static = engine.generate(ids, **greedy)
        out[name] = {
            "paged": paged, "static": static, "draws": draws,
            "gathers": gathers, "broadcasts": broadcasts,
            "forwards": engines[0].num_forwards,
            "blocks": [(e.free_blocks(), e.total_blocks()) for e in engines],
            "stats": engine.hybrid_engine.stats,
        }  # fmt: skip
    return out


def tp_round_trip_checks() -> dict[str, Any]:
    """ZeRO-3 with inference_tp_size 2: a training step after 3 generate/train cycles
    equals one without them."""
    import slipstream
    from slipstream.distributed import comm

    rank = comm.get_rank()
    plain, *_ = slipstream.initialize(model=tiny_llama(), config=tp_config(3))
    cycled, *_ = slipstream.initialize(model=tiny_llama(), config=tp_config(3))
    train_step(plain, 1)
    train_step(cycled, 1)
    ids, mask = tp_prompts(rank)
    for i in range(3):
        cycled.eval()
        cycled.generate(ids, attention_mask=mask, max_new_tokens=3 + i)
        cycled.train()
    train_step(plain, 2)
    train_step(cycled, 2)
    return {"plain": full_params(plain), "cycled": full_params(cycled)}


def tp_refusals() -> dict[str, str]:
    """inference_tp_size not dividing the world (3 at 2) or the heads (2 with 3 heads), a
    model its class cannot rebuild, and bad generate requests."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import slipstream
    from slipstream.distributed import comm

    three_heads = LlamaForCausalLM(
        LlamaConfig(vocab_size=VOCAB, hidden_size=48, intermediate_size=64,
                    num_hidden_layers=1, num_attention_heads=3, num_key_value_heads=3)
    )  # fmt: skip
    adapted = tiny_llama()
    adapted.model.layers[0].mlp.extra = nn.Linear(2, 2)  # a parameter the class lacks
    errors = {}
    cases = {
        "world": (tiny_llama(), tp_config(3, tp=3)),
        "heads": (three_heads, tp_config(3)),
        "adapted": (adapted, tp_config(3)),
    }
    for name, (model, cfg) in cases.items():
        try:
            slipstream.initialize(model=model, config=cfg)
        except slipstream.ConfigError as e:
            errors[name] = str(e)
    # Requests that fail on one rank, or only jointly, fail on both before any gather.
    rank = comm.get_rank()
    engine, *_ = slipstream.initialize(model=tiny_llama(), config=tp_config(3))
    wide = torch.randint(EOS + 1, VOCAB, (1, 30 if rank == 0 else 5))
    requests = {
        "one_rank": {"input_ids": wide[:, :5], "max_new_tokens": 4 if rank == 0 else -1},
        "joint_length": {"input_ids": wide, "max_new_tokens": 2 if rank == 0 else 20},
    }
    for name, kwargs in requests.items():
        try:
            engine.generate(**kwargs)
        except slipstream.ConfigError as e:
            errors[name] = str(e)
    return errors


def grpo_demo(steps: int = 15) -> dict[str, float]:
    """examples/rlhf_grpo.py at 2 ranks, 4 prompts each (its 8-prompt batch split over them)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "rlhf_grpo.py"
    spec = importlib.util.spec_from_file_location("rlhf_grpo_example", path)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    result: dict[str, float] = example.run(steps=steps, prompts=4)
    return result


def grpo_ragged_checks(steps: int = 2, stage: int = 3) -> dict[str, Any]:
    """GRPOTrainer at 2 ranks, ZeRO-3, scoring in length-sorted chunks on shared prompts
    (each rank its own prompts and ragged answers, so its own number of forwards) and
    scoring the padded batch in one forward: the metrics of each step, the updated weights,
    and the forward counts the ranks brought to the agreement. SGD, not Adam: Adam's first
    step moves a parameter by the learning rate whatever its gradient's size, so rounding
    noise in a near-zero gradient would move the two runs apart by a full step."""
    import slipstream
    from slipstream.rlhf import GRPOConfig, GRPOTrainer

    base = tiny_llama(3)
    with torch.no_grad():
        base.lm_head.weight[EOS] += 0.5 * base.model.norm.weight.sign()  # early EOS, at times
    config = {
        "train_micro_batch_size_per_gpu": 8,
        "optimizer": {"type": "SGD", "params": {"lr": 0.01}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "hybrid_engine": {"enabled": True, "max_out_tokens": 32},
    }
    cfg = GRPOConfig(group_size=4, max_new_tokens=20, top_k=0, updates_per_batch=2, temperature=0.9)
    ids, mask = prompts(comm_rank())
    out: dict[str, Any] = {}
    for ragged in (False, True):
        engine, *_ = slipstream.initialize(model=copy.deepcopy(base).train(), config=config)
        trainer = GRPOTrainer(
            engine, lambda p, c: [float(len(x)) for x in c], cfg, reference=copy.deepcopy(base)
        )
        counts: list[tuple[int, int]] = []
        if ragged:  # rank 1 asks for one forward more: some rank always pads, on any CPU
            trainer._agree_forwards = _recording(trainer._agree_forwards, counts, comm_rank())  # type: ignore[method-assign]
        else:
            trainer._ragged = lambda: False  # type: ignore[method-assign]
        metrics = [trainer.step(ids, mask) for _ in range(steps)]
        out["ragged" if ragged else "padded"] = {
            "metrics": [m.__dict__ for m in metrics],
            "params": full_params(engine),
            "counts": counts,
        }
    return out


def _recording(agree: Any, counts: list[tuple[int, int]], extra: int = 0) -> Any:
    """``agree`` that appends each (this rank's count, agreed count) to ``counts``, asking
    for ``extra`` forwards more than this rank needs (so the padding forwards run whatever
    answer lengths this CPU's sampling drew)."""

    def wrapped(n: int) -> int:
        counts.append((n, agree(n + extra)))
        return counts[-1][1]

    return wrapped


def comm_rank() -> int:
    from slipstream.distributed import comm

    return comm.get_rank()


def checks() -> dict[str, Any]:
    """Every engine-level RLHF check of the 2-rank world, by name (what the tests mark with
    ``@pytest.mark.rlhf_checks(name)`` and read with :func:`result`)."""
    from tests.rlhf import _chat_workloads as chat
    from tests.rlhf import _lora_workloads as lora

    return {
        "refusals": refusals,
        "dpo": chat.dpo_checks,
        "chat": chat.chat_checks,
        "ppo_extras": chat.ppo_extras_checks,
        "empty_answers": chat.empty_answers_checks,
        "gen3": lambda: generation_checks(3),
        "trip3": lambda: round_trip_checks(3),
        "grpo": grpo_demo,
        "grpo_ragged": grpo_ragged_checks,
        **lora.CHECKS,
        "tp_gen": tp_generation_checks,
        "tp_trip": tp_round_trip_checks,
        "tp_refusals": tp_refusals,
        "paged_rollouts": paged_rollout_checks,
    }


def run_checks(names: tuple[str, ...]) -> dict[str, Any]:
    """The checks ``names`` in one 2-rank world (its start-up, importing torch and
    transformers in two processes, costs more than most checks, so the selected tests share
    it). A failing check records its error instead of its result, so the other tests still
    report."""
    import time
    import traceback

    table = checks()
    out: dict[str, Any] = {"seconds": {}}
    for name in names:
        started = time.perf_counter()
        try:
            out[name] = table[name]()
        except Exception:
            out[name] = CheckFailed(traceback.format_exc())
        out["seconds"][name] = time.perf_counter() - started
    return out


class CheckFailed(str):
    """The traceback of a check that raised (a test reading it fails with this text)."""


def result(ranks: list[dict[str, Any]], name: str) -> list[Any]:
    """Each rank's result of check ``name``; fails the calling test with the traceback of a
    check that raised."""
    import pytest

    for r in ranks:
        if name not in r:
            pytest.fail(
                f"check {name!r} did not run in the RLHF world: mark the test "
                f"@pytest.mark.rlhf_checks({name!r})"
            )
        if isinstance(r[name], CheckFailed):
            pytest.fail(f"check {name!r} raised on a rank:\n{r[name]}")
    return [r[name] for r in ranks]
