"""Sharded, reshardable, atomic and verified checkpoints (see ``format`` for the layout)."""

from slipstream.checkpoint.api import load_checkpoint, save_checkpoint
from slipstream.checkpoint.format import CheckpointError, CheckpointReader

__all__ = ["CheckpointError", "CheckpointReader", "load_checkpoint", "save_checkpoint"]
