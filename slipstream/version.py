__version__ = "0.1.0"

DEEPSPEED_VERSION = "0.19.8"
"""The DeepSpeed release whose API, config defaults and behaviour slipstream follows (the
version ``importlib.metadata.version("deepspeed")`` reports under ``SLIPSTREAM_AS_DEEPSPEED=1``;
docs/compatibility.md lists what differs on purpose)."""
