"""Reference models: a LLaMA-style decoder used by the demo, tests and benchmarks."""

from slipstream.models.gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig"]
