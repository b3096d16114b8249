"""Sharded, reshardable, atomic and verified checkpoints (see ``format`` for the layout)."""

from slipstream.checkpoint.api import finish_save, load_checkpoint, save_checkpoint
from slipstream.checkpoint.deepspeed_convert import deepspeed_to_slipstream
from slipstream.checkpoint.export import convert_checkpoint
from slipstream.checkpoint.format import CheckpointError, CheckpointReader
from slipstream.checkpoint.from_deepspeed import DeepSpeedReader
from slipstream.checkpoint.to_deepspeed import export_deepspeed

__all__ = [
    "CheckpointError",
    "CheckpointReader",
    "DeepSpeedReader",
    "convert_checkpoint",
    "deepspeed_to_slipstream",
    "export_deepspeed",
    "finish_save",
    "load_checkpoint",
    "save_checkpoint",
]
