"""DeepSpeed's ``deepspeed.utils`` names that training scripts import."""

from slipstream.data.loader import RepeatingLoader

__all__ = ["RepeatingLoader"]
