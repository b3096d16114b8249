"""An Accelerate training loop (``Accelerator().prepare``, ``accelerator.backward``) for
``accelerate launch --use_deepspeed --deepspeed_config_file ...``: a causal LM loaded with
``from_pretrained``; rank 0 writes the losses to the file named by the second argument."""

import json
import sys

import torch
from accelerate import Accelerator
from transformers import AutoModelForCausalLM


def main():
    model_dir, loss_file = sys.argv[1], sys.argv[2]
    accelerator = Accelerator()
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(3)
    samples = [{"input_ids": x, "labels": x} for x in torch.randint(0, 64, (8, 12), generator=g)]
    data = torch.utils.data.DataLoader(samples, batch_size=2)
    model, optimizer, data = accelerator.prepare(model, optimizer, data)
    losses = []
    for batch in data:
        loss = model(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    if torch.distributed.get_rank() == 0:
        with open(loss_file, "w") as f:
            json.dump({"losses": losses, "engine": type(model).__module__}, f)


if __name__ == "__main__":
    main()
