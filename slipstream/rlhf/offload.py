"""Host-resident frozen models for RLHF: DeepSpeed-Chat's ``--offload_reference_model``.

PPO holds four models; two of them, the reference (the SFT model) and the reward model, are
frozen and only run forwards. DeepSpeed-Chat gives them ``get_eval_ds_config(offload=True)``:
ZeRO-3 with ``offload_param`` on the host, so between forwards their weights live in host
memory and each forward brings one ZeRO-3 unit (a transformer block, say) at a time onto the
device and frees it after.

slipstream's ZeRO-3 partitions only trainable parameters (frozen ones stay replicated, see
:mod:`slipstream.zero.stage3`), so a ZeRO-3 ``offload_param`` config would move nothing of a
frozen model. :func:`offload_frozen_` therefore does the host residency directly: each
parameter's value lives in (pinned) host memory, and a forward pre-hook on each unit copies
the unit's parameters to the device (asynchronously from pinned memory) while a forward
post-hook points them back at the host copies, which frees the device copies. The traffic is
DeepSpeed's at one rank (every forward reads the model once over the host link) and the device
holds at most the units whose forwards are open (the root's own parameters, such as the
embedding and the LM head, plus one block); unlike DeepSpeed, each rank keeps a whole host
copy (no partitioning over ranks) and no unit is prefetched. Nothing is collective, so ranks
may call the model independently.

Units are the children of every ``nn.ModuleList`` (the transformer blocks) and every other
module that holds parameters directly (embedding, norms, heads), so calling a submodule
alone works too. A parameter shared by two modules (tied embeddings) is fetched once and
released when its last open user ends.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from slipstream.accelerator import get_accelerator
from slipstream.runtime.engine import Engine

__all__ = ["HostOffload", "offload_frozen_"]


@dataclass
class HostOffload:
    """The record of one offloaded model (returned by :func:`offload_frozen_`).

    Attributes:
        device: where forwards run.
        host: each parameter's host copy (by parameter id).
        fetches: unit fetches so far (one per unit per forward).
        fetched_bytes: bytes of parameters on the device right now.
        peak_fetched_bytes: the most ever at once.
    """

    device: torch.device
    host: dict[int, torch.Tensor] = field(default_factory=dict)
    fetches: int = 0
    fetched_bytes: int = 0
    peak_fetched_bytes: int = 0
    _users: dict[int, int] = field(default_factory=dict)
    _handles: list[RemovableHandle] = field(default_factory=list)

    def fetch(self, params: list[nn.Parameter]) -> None:
        """Copy ``params`` to the device (the first open user of each copies it)."""
        self.fetches += 1
        for p in params:
            users = self._users.get(id(p), 0)
            self._users[id(p)] = users + 1
            if users == 0:
                host = self.host[id(p)]
                # An explicit copy even when the device is the host's (a CPU-only run), so the
                # path a GPU takes is the path tests run; non_blocking overlaps the copy from
                # pinned memory with the work queued before it.
                p.data = torch.empty_like(host, device=self.device).copy_(host, non_blocking=True)
                self.fetched_bytes += host.numel() * host.element_size()
        self.peak_fetched_bytes = max(self.peak_fetched_bytes, self.fetched_bytes)

    def release(self, params: list[nn.Parameter]) -> None:
        """Point ``params`` back at their host copies (the last open user releases)."""
        for p in params:
            users = self._users[id(p)] - 1
            self._users[id(p)] = users
            if users == 0:
                host = self.host[id(p)]
                p.data = host
                self.fetched_bytes -= host.numel() * host.element_size()

    def remove(self) -> None:
        """Remove the hooks; the parameters stay in host memory."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def _units(model: nn.Module) -> Iterator[tuple[nn.Module, list[nn.Parameter]]]:
    """``(module, the parameters it fetches)``: each ModuleList child with every parameter
    under it, and each other module holding parameters directly, with those."""
    in_block: set[int] = set()
    for module in model.modules():
        if isinstance(module, nn.ModuleList):
            for block in module:
                if id(block) in in_block:
                    continue
                params = list(block.parameters())
                in_block.update(id(m) for m in block.modules())
                if params:
                    yield block, params
    for module in model.modules():
        if id(module) in in_block:
            continue
        own = [p for p in module._parameters.values() if p is not None]
        if own:
            yield module, own


def _check_frozen(model: nn.Module) -> None:
    if isinstance(model, Engine):
        raise TypeError(
            "offload_frozen_: got an Engine; pass the frozen nn.Module itself (a reference or "
            "reward model is not trained, so it needs no engine)"
        )
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    if trained:
        raise ValueError(
            f"offload_frozen_: {type(model).__name__} has trainable parameters {trained[:6]}: "
            "only frozen models are offloaded this way (gradients would land on the host "
            "copies); call model.requires_grad_(False) first, or train it in an engine"
        )


@torch.no_grad()
def offload_frozen_(
    model: nn.Module, device: torch.device | str | None = None, pin_memory: bool = True
) -> HostOffload:
    """Keep frozen ``model``'s parameters in host memory and stream them to ``device`` per
    forward, in place (module doc). Buffers (rotary tables, ...) move to ``device``.

    Args:
        model: a frozen module (every parameter ``requires_grad=False``); put in eval mode.
        device: where forwards run; default the accelerator's current device.
        pin_memory: page-lock the host copies (fast asynchronous copies on CUDA; ignored on
            a CPU-only machine).

    Returns:
        The :class:`HostOffload` record (fetch counts and device bytes, ``remove()``).

    Raises:
        TypeError: ``model`` is an engine.
        ValueError: ``model`` has trainable parameters (named).
    """
    _check_frozen(model)
    target = torch.device(device if device is not None else get_accelerator().current_device_name())
    state = HostOffload(target)
    accel = get_accelerator()
    for p in model.parameters():
        if id(p) in state.host:
            continue
        host = p.detach().to("cpu")
        if pin_memory and target.type != "cpu":
            host = accel.pin_memory(host)
        state.host[id(p)] = host
        p.data = host
    for module in model.modules():
        for key, buf in module._buffers.items():
            if buf is not None:
                module._buffers[key] = buf.to(target)
    for module, params in _units(model):
        state._handles.append(module.register_forward_pre_hook(_pre(state, params)))
        state._handles.append(module.register_forward_hook(_post(state, params), always_call=True))
    model.eval()
    return state


def _pre(state: HostOffload, params: list[nn.Parameter]) -> Any:
    return lambda module, args: state.fetch(params)


def _post(state: HostOffload, params: list[nn.Parameter]) -> Any:
    return lambda module, args, output: state.release(params)
