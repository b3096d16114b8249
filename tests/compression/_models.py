"""A tiny BERT-shaped model with Hugging Face's module names (so DeepSpeedExamples' group
patterns match it) and the compression configs the tests share."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

HIDDEN, HEADS, INTER, VOCAB, LAYERS = 48, 4, 96, 64, 4


class SelfAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.query = nn.Linear(HIDDEN, HIDDEN)
        self.key = nn.Linear(HIDDEN, HIDDEN)
        self.value = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (
            lin(x).view(b, t, -1, HIDDEN // HEADS).transpose(1, 2)
            for lin in (self.query, self.key, self.value)
        )
        att = torch.softmax(q @ k.transpose(-1, -2) / (HIDDEN // HEADS) ** 0.5, dim=-1)
        return (att @ v).transpose(1, 2).reshape(b, t, -1)


class Output(nn.Module):
    def __init__(self, d_in: int) -> None:
        super().__init__()
        self.dense = nn.Linear(d_in, HIDDEN)
        self.LayerNorm = nn.LayerNorm(HIDDEN)

    def forward(self, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(h) + x)


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.self = SelfAttention()
        self.output = Output(HIDDEN)


class Intermediate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.dense = nn.Linear(HIDDEN, INTER)


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention = Attention()
        self.intermediate = Intermediate()
        self.output = Output(INTER)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.attention.output(self.attention.self(x), x)
        return self.output(torch.nn.functional.gelu(self.intermediate.dense(a)), a)


class Encoder(nn.Module):
    def __init__(self, layers: int) -> None:
        super().__init__()
        self.layer = nn.ModuleList(Layer() for _ in range(layers))


class Embeddings(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(VOCAB, HIDDEN)


class Bert(nn.Module):
    def __init__(self, layers: int) -> None:
        super().__init__()
        self.embeddings = Embeddings()
        self.encoder = Encoder(layers)
        self.pooler = nn.Linear(HIDDEN, HIDDEN)


class TinyBert(nn.Module):
    """``bert.embeddings`` -> ``bert.encoder.layer.N`` -> ``bert.pooler`` -> ``classifier``."""

    def __init__(self, layers: int = LAYERS) -> None:
        super().__init__()
        self.bert = Bert(layers)
        self.classifier = nn.Linear(HIDDEN, 3)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor | None = None) -> Any:
        x = self.bert.embeddings.word_embeddings(ids)
        for layer in self.bert.encoder.layer:
            x = layer(x)
        logits = self.classifier(torch.tanh(self.bert.pooler(x[:, 0])))
        if labels is None:
            return logits
        return torch.nn.functional.cross_entropy(logits, labels)


def tiny_bert(seed: int = 0, layers: int = LAYERS) -> TinyBert:
    torch.manual_seed(seed)
    return TinyBert(layers)


def batch(seed: int, n: int = 4, t: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n, t), generator=g), torch.randint(0, 3, (n,), generator=g)


def _group(params: dict[str, Any], modules: list[str], **extra: Any) -> dict[str, Any]:
    return {"params": params, "modules": modules, **extra}


def weight_quantization(
    offset: int = 0, groups: int = 48, kind: str = "symmetric", bits: tuple[int, int] = (8, 4)
) -> dict[str, Any]:
    """ZeroQuant's W8/W4 split (DeepSpeedExamples' ds_config_W48A8_Qgroup48), tiny-sized."""
    return {
        "shared_parameters": {
            "enabled": True,
            "schedule_offset": offset,
            "quantize_groups": groups,
            "quantization_type": kind,
            "quantize_weight_in_forward": True,
        },
        "different_groups": {
            "wq1": _group(
                {"start_bits": bits[0], "target_bits": bits[0], "quantization_period": 0},
                ["attention.self", "attention.output.dense"],
            ),
            "wq2": _group(
                {"start_bits": bits[1], "target_bits": bits[1], "quantization_period": 0},
                ["intermediate", "layer.\\w+.output.dense"],
            ),
        },
    }


def activation_quantization(
    offset: int = 0, calibration: str = "dynamic", kind: str = "symmetric"
) -> dict[str, Any]:
    return {
        "shared_parameters": {
            "enabled": True,
            "quantization_type": kind,
            "range_calibration": calibration,
            "schedule_offset": offset,
        },
        "different_groups": {
            "aq1": _group({"bits": 8}, ["attention.self", "intermediate"]),
        },
    }


def ds_config(**techniques: Any) -> dict[str, Any]:
    return {
        "train_batch_size": 4,
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "SGD", "params": {"lr": 0.05}},
        "gradient_clipping": 0.0,
        "compression_training": copy.deepcopy(techniques),
    }


def layer_reduction(teacher_layer: list[int]) -> dict[str, Any]:
    """DeepSpeedExamples' BERT layer reduction, for the tiny model."""
    return {
        "enabled": True,
        "keep_number_layer": len(teacher_layer),
        "module_name_prefix": "bert.encoder.layer",
        "teacher_layer": teacher_layer,
        "other_module_name": ["bert.pooler", "bert.embeddings", "classifier"],
    }


class Block(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))))


class TinyCNN(nn.Module):
    """A ResNet-shaped CNN with DeepSpeedExamples' cifar names (``layer1.0.conv1``, ...)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.layer1 = nn.Sequential(Block(8), Block(8))
        self.fc = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.layer1(torch.relu(self.conv1(x))).mean(dim=(2, 3)))


def tiny_cnn(seed: int = 0) -> TinyCNN:
    torch.manual_seed(seed)
    model = TinyCNN()
    model.eval()  # BatchNorm with its running statistics: forwards are deterministic
    return model


def cnn_batch(seed: int) -> torch.Tensor:
    return torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(seed))


def pruning(kind: str, method: str, offset: int = 1, **shared: Any) -> dict[str, Any]:
    """One pruning technique, on the groups DeepSpeedExamples use."""
    groups = {
        "sparse_pruning": {"sp1": _group({"dense_ratio": 0.5}, ["attention.self", "conv2"])},
        "row_pruning": {
            "rp1": _group(
                {"dense_ratio": 0.5},
                ["intermediate.dense"],
                related_modules=[["layer.\\w+.output.dense"]],
            )
        },
        "head_pruning": {
            "hp1": _group(
                {"dense_ratio": 0.5},
                ["attention.output.dense"],
                related_modules=[["self.query", "self.key", "self.value"]],
            )
        },
        "channel_pruning": {
            "cp1": _group(
                {"dense_ratio": 0.5},
                ["layer....conv1"],
                related_modules=[["layer....conv2", "layer....bn1"]],
            )
        },
    }[kind]
    return {
        kind: {
            "shared_parameters": {
                "enabled": True,
                "schedule_offset": offset,
                "method": method,
                **shared,
            },
            "different_groups": groups,
        }
    }
