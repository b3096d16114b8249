"""Sharded, reshardable, atomic and verified checkpoints (see ``format`` for the layout)."""

from slipstream.checkpoint.api import finish_save, load_checkpoint, save_checkpoint
from slipstream.checkpoint.export import convert_checkpoint
from slipstream.checkpoint.format import CheckpointError, CheckpointReader

__all__ = [
    "CheckpointError",
    "CheckpointReader",
    "convert_checkpoint",
    "finish_save",
    "load_checkpoint",
    "save_checkpoint",
]
