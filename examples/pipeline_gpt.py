"""Pipeline-parallel training of the reference GPT, optionally with tensor and data parallelism.

    slipstream run --nproc 2 examples/pipeline_gpt.py                       # PP=2, 1F1B
    slipstream run --nproc 4 examples/pipeline_gpt.py --schedule interleaved
    slipstream run --nproc 8 examples/pipeline_gpt.py --tp 2 --zero 2       # TP2 x PP2 x DP2

Prints the schedule's timeline (the bubble made visible), then the loss per step and, at the
end, this stage's activation memory and measured idle share. Data: random tokens (the example
is about the machinery; `examples/train_gpt.py` trains on text).
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

import slipstream
from slipstream.distributed.mesh import dp_group
from slipstream.models import GPTConfig
from slipstream.models.gpt_pipeline import gpt_loss, gpt_pipeline_layers
from slipstream.pipe import PipelineModule


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--schedule", default="1f1b", choices=("1f1b", "gpipe", "interleaved"))
    parser.add_argument("--micro-batches", type=int, default=4, help="per step per dp rank")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    parser.add_argument("--zero", type=int, default=1, choices=(0, 1, 2))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--local_rank", type=int, default=0)  # passed by `slipstream run`
    args = parser.parse_args()
    virtual = 2 if args.schedule == "interleaved" else 1

    slipstream.init_distributed()
    config = GPTConfig.preset("tiny", vocab_size=256, num_layers=4, tie_embeddings=True)
    torch.manual_seed(0)  # every rank builds its own layers from the same seed
    module = PipelineModule(
        layers=gpt_pipeline_layers(config),  # embedding, blocks, norm, tied head
        num_stages=args.stages,
        loss_fn=gpt_loss,
        partition_method="type:GPTBlockLayer",  # balance the transformer blocks
        virtual_stages=virtual,
        seed_layers=True,  # initialization independent of the partitioning
    )
    engine, *_ = slipstream.initialize(
        model=module,
        config={
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": args.micro_batches,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": args.zero},
            "tensor_parallel": {"autotp_size": args.tp},
            "pipeline": {"schedule": args.schedule, "virtual_stages": virtual},
        },
    )
    rank = dist.get_rank()
    if rank == 0:
        print(engine.timeline().to_text(width=72))

    def micro_batches():  # this data-parallel rank's stream of (inputs, labels)
        gen = torch.Generator().manual_seed(1 + dist.get_rank(dp_group(engine.mesh)))
        while True:  # arithmetic sequences mod the vocabulary: learnable next tokens
            start = torch.randint(0, config.vocab_size, (2, 1), generator=gen)
            stride = torch.randint(1, 5, (2, 1), generator=gen)
            tokens = (start + stride * torch.arange(65)) % config.vocab_size
            yield tokens[:, :-1], tokens[:, 1:]

    data = micro_batches()
    for step in range(args.steps):
        loss = engine.train_batch(data)  # the same mean loss on every rank
        if rank == 0:
            print(f"step {step}: loss {loss.item():.4f}", flush=True)
    stats = engine.activation_stats
    if rank % (dist.get_world_size() // args.stages) == 0:  # one line per stage
        print(
            f"rank {rank} stage {engine.stage_id}: layers {module.stage_layers()}, at most "
            f"{stats.peak_in_flight} micro-batches in flight, {stats.peak_bytes / 2**20:.1f} "
            f"MiB of saved activations, idle {1 - (engine.last_busy_fraction or 0):.2f}",
            flush=True,
        )
    engine.destroy()


if __name__ == "__main__":
    main()
