"""``deepspeed.git_version_info``: the version facts DeepSpeed's setup writes at install time.

``version`` is the DeepSpeed release slipstream follows; ``installed_ops`` says, for every
DeepSpeed op, that nothing was compiled ahead of time (slipstream compiles nothing;
``deepspeed.ops.__compatible_ops__`` says which ops run anyway); ``torch_info`` describes the
torch actually imported (DeepSpeed records the torch it was built against).
"""

from __future__ import annotations

import torch

from slipstream.accelerator import get_accelerator
from slipstream.ops.op_builder import ALL_OPS
from slipstream.version import DEEPSPEED_VERSION

__all__ = [
    "accelerator_name",
    "git_branch",
    "git_hash",
    "installed_ops",
    "torch_info",
    "version",
]

version = DEEPSPEED_VERSION
git_hash = "[none]"
git_branch = "[none]"
installed_ops: dict[str, bool] = dict.fromkeys(ALL_OPS, False)
accelerator_name = get_accelerator().device_name()


def _major_minor(text: str | None) -> str:
    return ".".join((text or "0.0").split("+")[0].split(".")[:2])


torch_info: dict[str, object] = {
    "version": _major_minor(torch.__version__),
    "bf16_support": bool(get_accelerator().is_bf16_supported()),
    "cuda_version": _major_minor(torch.version.cuda),
    # "0.0" is DeepSpeed's own "not recorded: ask the runtime" value.
    "nccl_version": "0.0",
    "hip_version": _major_minor(getattr(torch.version, "hip", None)),
}
