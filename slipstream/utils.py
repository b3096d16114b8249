"""DeepSpeed's ``deepspeed.utils`` names that training scripts import."""

from slipstream.runtime.dataloader import RepeatingLoader

__all__ = ["RepeatingLoader"]
