"""Supervised fine-tuning in the style of DeepSpeed-Chat's
training/step1_supervised_finetuning/main.py: a causal LM loaded with ``from_pretrained``
(under ``HfDeepSpeedConfig`` at ZeRO-3, so transformers partitions it through
``deepspeed.zero.Init``), grouped weight decay, a transformers lr schedule, the config built
in code, ``model.backward``/``model.step``, perplexity evaluation with an all-reduce, and the
ZeRO-3 save through ``GatheredParameters``. Random token ids stand in for the prompt data."""

import argparse
import json
import math
import os

import deepspeed
import torch
from deepspeed import get_accelerator
from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoConfig, AutoModelForCausalLM, default_data_collator, get_scheduler
from transformers.integrations import HfDeepSpeedConfig


def parse_args():
    parser = argparse.ArgumentParser(
        description="Finetune a transformers model on a causal language modeling task"
    )
    parser.add_argument("--model_name_or_path", type=str, required=True)
    parser.add_argument("--per_device_train_batch_size", type=int, default=2)
    parser.add_argument("--per_device_eval_batch_size", type=int, default=2)
    parser.add_argument("--max_seq_len", type=int, default=12)
    parser.add_argument("--learning_rate", type=float, default=1e-3)
    parser.add_argument("--weight_decay", type=float, default=0.1)
    parser.add_argument("--num_train_epochs", type=int, default=1)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=1)
    parser.add_argument("--lr_scheduler_type", type=str, default="cosine")
    parser.add_argument("--num_warmup_steps", type=int, default=1)
    parser.add_argument("--output_dir", type=str, default=None)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--offload", action="store_true")
    parser.add_argument("--zero_stage", type=int, default=0)
    parser.add_argument("--loss_file", type=str, default=None)
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def get_train_ds_config(offload, stage=2):
    device = "cpu" if offload else "none"
    return {
        "train_batch_size": 32,
        "train_micro_batch_size_per_gpu": 4,
        "steps_per_print": 10,
        "zero_optimization": {
            "stage": stage,
            "overlap_comm": True,
            "offload_param": {"device": device},
            "offload_optimizer": {"device": device},
            "stage3_param_persistence_threshold": 1e4,
            "stage3_max_live_parameters": 3e7,
            "stage3_prefetch_bucket_size": 3e7,
            "memory_efficient_linear": False,
        },
        "gradient_clipping": 1.0,
        "prescale_gradients": False,
        "wall_clock_breakdown": False,
        "hybrid_engine": {"enabled": False, "max_out_tokens": 512, "inference_tp_size": 1},
    }


def create_hf_model(model_class, model_name_or_path, ds_config=None):
    model_config = AutoConfig.from_pretrained(model_name_or_path)
    # Note: dschf is defined in function scope to avoid global effects
    if ds_config is not None and ds_config["zero_optimization"]["stage"] == 3:
        dschf = HfDeepSpeedConfig(ds_config)  # transformers keeps a weak reference to it
    else:
        dschf = None
    model = model_class.from_pretrained(model_name_or_path, config=model_config)
    del dschf
    return model


def get_optimizer_grouped_parameters(
    model, weight_decay, no_decay_name_list=("bias", "layer_norm.weight")
):
    return [
        {
            "params": [
                p
                for n, p in model.named_parameters()
                if not any(nd in n for nd in no_decay_name_list) and p.requires_grad
            ],
            "weight_decay": weight_decay,
        },
        {
            "params": [
                p
                for n, p in model.named_parameters()
                if any(nd in n for nd in no_decay_name_list) and p.requires_grad
            ],
            "weight_decay": 0.0,
        },
    ]


def create_prompt_dataset(seed, n, seq_len, vocab):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, vocab, (n, seq_len), generator=g)
    return [{"input_ids": x, "attention_mask": torch.ones_like(x), "labels": x} for x in ids]


def get_all_reduce_mean(tensor):
    torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.SUM)
    return tensor / torch.distributed.get_world_size()


def to_device(batch, device):
    return {k: v.to(device) for k, v in batch.items()}


def save_zero_three_model(model_ema, global_rank, save_dir, zero_stage=0):
    os.makedirs(save_dir, exist_ok=True)
    model_to_save = model_ema.module if hasattr(model_ema, "module") else model_ema
    output_state_dict = {}
    for k, v in model_to_save.named_parameters():
        if hasattr(v, "ds_id"):
            with deepspeed.zero.GatheredParameters([v], enabled=zero_stage == 3):
                v_p = v.data.cpu()
        else:
            v_p = v.cpu()
        if global_rank == 0:
            output_state_dict[k] = v_p
    if global_rank == 0:
        torch.save(output_state_dict, os.path.join(save_dir, "pytorch_model.bin"))


def main():
    args = parse_args()
    get_accelerator().set_device(max(args.local_rank, 0))
    device = torch.device(get_accelerator().device_name())
    deepspeed.init_distributed()
    args.global_rank = torch.distributed.get_rank()
    ds_config = get_train_ds_config(offload=args.offload, stage=args.zero_stage)
    ds_config["train_micro_batch_size_per_gpu"] = args.per_device_train_batch_size
    ds_config["train_batch_size"] = (
        args.per_device_train_batch_size
        * torch.distributed.get_world_size()
        * args.gradient_accumulation_steps
    )
    deepspeed.runtime.utils.set_random_seed(args.seed)
    torch.distributed.barrier()
    model = create_hf_model(AutoModelForCausalLM, args.model_name_or_path, ds_config)
    vocab = model.config.vocab_size
    train_dataset = create_prompt_dataset(args.seed, 16, args.max_seq_len, vocab)
    eval_dataset = create_prompt_dataset(args.seed + 1, 8, args.max_seq_len, vocab)
    train_sampler = DistributedSampler(train_dataset)
    eval_sampler = DistributedSampler(eval_dataset)
    train_dataloader = DataLoader(
        train_dataset,
        collate_fn=default_data_collator,
        sampler=train_sampler,
        batch_size=args.per_device_train_batch_size,
    )
    eval_dataloader = DataLoader(
        eval_dataset,
        collate_fn=default_data_collator,
        sampler=eval_sampler,
        batch_size=args.per_device_eval_batch_size,
    )

    def evaluation(model, eval_dataloader):
        model.eval()
        losses, steps = 0, 0
        for batch in eval_dataloader:
            with torch.no_grad():
                outputs = model(**to_device(batch, device))
            losses += outputs.loss.float()
            steps += 1
        losses = get_all_reduce_mean(losses / steps)
        return torch.exp(losses).item(), losses.item()

    optimizer_grouped_parameters = get_optimizer_grouped_parameters(model, args.weight_decay)
    if args.offload:
        AdamOptimizer = DeepSpeedCPUAdam
    elif get_accelerator().device_name() == "cpu":
        AdamOptimizer = torch.optim.AdamW  # FusedAdam is a CUDA kernel in DeepSpeed
    else:
        AdamOptimizer = FusedAdam
    optimizer = AdamOptimizer(
        optimizer_grouped_parameters, lr=args.learning_rate, betas=(0.9, 0.95)
    )
    num_update_steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
    lr_scheduler = get_scheduler(
        name=args.lr_scheduler_type,
        optimizer=optimizer,
        num_warmup_steps=args.num_warmup_steps,
        num_training_steps=args.num_train_epochs * num_update_steps_per_epoch,
    )
    model, optimizer, _, lr_scheduler = deepspeed.initialize(
        model=model,
        optimizer=optimizer,
        args=args,
        config=ds_config,
        lr_scheduler=lr_scheduler,
        dist_init_required=True,
    )
    losses = []
    _, eval_loss = evaluation(model, eval_dataloader)
    losses.append(eval_loss)
    for _epoch in range(args.num_train_epochs):
        model.train()
        for _step, batch in enumerate(train_dataloader):
            batch = to_device(batch, device)
            outputs = model(**batch, use_cache=False)
            loss = outputs.loss
            model.backward(loss)
            model.step()
            losses.append(loss.item())
        perplexity, eval_loss = evaluation(model, eval_dataloader)
        print(f"ppl: {perplexity}, loss: {eval_loss}")
        losses.append(eval_loss)
        model.tput_timer.update_epoch_count()
    if args.output_dir is not None:
        save_zero_three_model(model, args.global_rank, args.output_dir, zero_stage=args.zero_stage)
    if args.loss_file and args.global_rank == 0:
        with open(args.loss_file, "w") as f:
            json.dump(losses, f)


if __name__ == "__main__":
    main()
