"""Masked-language-model pretraining in the style of DeepSpeedExamples'
training/HelloDeepSpeed/train_bert_ds.py: a RoBERTa encoder with a masked-prediction head,
the config built in code (ZeRO-1, optimizer offloaded to the CPU), ``save_checkpoint`` with
a ``checkpoint_step`` client state every few steps, and a second run that resumes with
``load_checkpoint``. Random token ids stand in for the Wikitext data."""

import argparse
import json
import pathlib

import deepspeed
import torch
import torch.nn as nn
from transformers import RobertaConfig, RobertaModel
from transformers.models.roberta.modeling_roberta import RobertaLMHead, RobertaPreTrainedModel

VOCAB, PAD, MASK = 40, 1, 3


class RobertaLMHeadWithMaskedPredict(RobertaLMHead):
    def __init__(self, config, embedding_weight=None):
        super().__init__(config)
        if embedding_weight is not None:
            self.decoder.weight = embedding_weight

    def forward(self, features, masked_token_indices=None, **kwargs):
        if masked_token_indices is not None:
            features = torch.index_select(
                features.view(-1, features.shape[-1]), 0, masked_token_indices
            )
        return super().forward(features)


class RobertaMLMModel(RobertaPreTrainedModel):
    def __init__(self, config, encoder):
        super().__init__(config)
        self.encoder = encoder
        self.lm_head = RobertaLMHeadWithMaskedPredict(
            config, self.encoder.embeddings.word_embeddings.weight
        )
        self.lm_head.apply(self._init_weights)

    def forward(self, src_tokens, attention_mask, tgt_tokens):
        sequence_output, *_ = self.encoder(
            input_ids=src_tokens, attention_mask=attention_mask, return_dict=False
        )
        masked_token_indexes = torch.nonzero(
            (tgt_tokens != self.config.pad_token_id).view(-1)
        ).view(-1)
        prediction_scores = self.lm_head(sequence_output, masked_token_indexes)
        target = torch.index_select(tgt_tokens.view(-1), 0, masked_token_indexes)
        loss_fct = nn.CrossEntropyLoss(ignore_index=-1)
        return loss_fct(prediction_scores.view(-1, self.config.vocab_size), target)


def create_model(num_layers, num_heads, ff_dim, h_dim, dropout):
    roberta_config = RobertaConfig.from_dict(
        {
            "attention_probs_dropout_prob": dropout,
            "bos_token_id": 0,
            "eos_token_id": 2,
            "hidden_act": "gelu",
            "hidden_dropout_prob": dropout,
            "hidden_size": h_dim,
            "initializer_range": 0.02,
            "intermediate_size": ff_dim,
            "layer_norm_eps": 1e-05,
            "max_position_embeddings": 34,
            "model_type": "roberta",
            "num_attention_heads": num_heads,
            "num_hidden_layers": num_layers,
            "pad_token_id": PAD,
            "type_vocab_size": 1,
            "vocab_size": VOCAB,
        }
    )
    return RobertaMLMModel(roberta_config, RobertaModel(roberta_config))


def create_data_iterator(rank, batch_size, num_batches, seq_len=12):
    """Masked batches: 15% of the positions masked, targets padded elsewhere."""
    g = torch.Generator().manual_seed(77 + rank)
    for _ in range(num_batches):
        tokens = torch.randint(4, VOCAB, (batch_size, seq_len), generator=g)
        masked = torch.rand(batch_size, seq_len, generator=g) < 0.15
        masked[:, 0] = True
        yield {
            "src_tokens": tokens.masked_fill(masked, MASK),
            "attention_mask": torch.ones_like(tokens),
            "tgt_tokens": tokens.masked_fill(~masked, PAD),
        }


def train(checkpoint_dir, load_checkpoint_dir, num_iterations, checkpoint_every, batch_size=4):
    torch.manual_seed(0)
    model = create_model(num_layers=2, num_heads=2, ff_dim=32, h_dim=16, dropout=0.0)
    ds_config = {
        "train_micro_batch_size_per_gpu": batch_size,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}},
        "zero_force_ds_cpu_optimizer": False,
    }
    model, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=ds_config
    )
    start_step = 1
    if load_checkpoint_dir is not None:
        _, client_state = model.load_checkpoint(load_dir=load_checkpoint_dir)
        checkpoint_step = client_state["checkpoint_step"]
        start_step = checkpoint_step + 1
    exp_dir = pathlib.Path(checkpoint_dir or load_checkpoint_dir)
    data_iterator = create_data_iterator(torch.distributed.get_rank(), batch_size, num_iterations)
    model.train()
    losses = []
    for step, batch in enumerate(data_iterator, start=1):
        if step >= num_iterations:
            break
        if step < start_step:
            continue  # the resumed run skips the batches already trained on
        for key, value in batch.items():
            batch[key] = value.to(model.device)
        loss = model(**batch)
        model.backward(loss)
        model.step()
        losses.append(loss.item())
        if step % checkpoint_every == 0:
            model.save_checkpoint(save_dir=exp_dir, client_state={"checkpoint_step": step})
    return losses


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoint_dir", type=str, required=True)
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--loss_file", type=str, default=None)
    args = parser.parse_args()
    deepspeed.init_distributed()
    # Steps 1-4 with checkpoints after 2 and 4; a new engine resumes from the latest (4) and
    # trains steps 5-6; a third run trains steps 1-6 without stopping.
    first = train(args.checkpoint_dir, None, num_iterations=5, checkpoint_every=2)
    resumed = train(None, args.checkpoint_dir, num_iterations=7, checkpoint_every=100)
    straight = train(
        f"{args.checkpoint_dir}_straight", None, num_iterations=7, checkpoint_every=100
    )
    if args.loss_file and torch.distributed.get_rank() == 0:
        with open(args.loss_file, "w") as f:
            json.dump({"first": first, "resumed": resumed, "straight": straight}, f)


if __name__ == "__main__":
    main()
