"""``PipelineModule``: a layer list split into pipeline stages (DeepSpeed's ``deepspeed.pipe``).

Each rank builds only the layers of its own stage: ``LayerSpec`` entries are built lazily on
the owning rank, so a model too large for one device is never materialized whole. With
``virtual_stages=v`` the layers are cut into ``num_stages * v`` model chunks and rank ``s``
holds chunks ``s, s + p, s + 2p, ...`` (local chunk ``c`` is model chunk ``c * p + s``), the
layout of the interleaved 1F1B schedule (Narayanan et al. 2021, "Efficient Large-Scale
Language Model Training on GPU Clusters", sec. 2.2).

Parameter names are ``<layer index>.<name inside the layer>`` (global layer index, the same on
every partitioning) and ``tied_modules.<key>.<name>`` for tied layers.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from slipstream.config import ConfigError
from slipstream.distributed import comm
from slipstream.distributed.mesh import member_group
from slipstream.distributed.placement import mark_duplicate_
from slipstream.parallel.recompute import DEFAULT_CONTEXT, RecomputeContext
from slipstream.parallel.tensor import TPPlan, add_block_plan

__all__ = [
    "LayerSpec",
    "PipelineError",
    "PipelineModule",
    "TiedLayerSpec",
    "partition_balanced",
    "partition_uniform",
]


class PipelineError(RuntimeError):
    """Misuse of a pipeline engine or module (e.g. ``engine.forward`` instead of
    ``engine.train_batch``)."""


class LayerSpec:
    """A layer to build later, only on the stage that owns it: ``cls(*args, **kwargs)``."""

    def __init__(self, typename: type[nn.Module], *module_args: Any, **module_kwargs: Any) -> None:
        if not (isinstance(typename, type) and issubclass(typename, nn.Module)):
            raise TypeError(
                f"LayerSpec needs an nn.Module subclass, got {typename!r}: pass the class "
                "itself (LayerSpec(nn.Linear, 4, 4)), not an instance"
            )
        self.typename = typename
        self.module_args = module_args
        self.module_kwargs = module_kwargs

    def build(self) -> nn.Module:
        return self.typename(*self.module_args, **self.module_kwargs)

    def __repr__(self) -> str:
        return f"LayerSpec({self.typename.__name__})"


class TiedLayerSpec(LayerSpec):
    """A layer whose ``tied_weight_attr`` parameter(s) are shared by every entry with ``key``.

    Within a rank, all entries with the same key use one module (the first built); a later
    entry may call it differently through ``forward_fn(module, inputs)`` (e.g. an output head
    reusing the embedding matrix). Across stages, each holder has a copy: the copies start
    equal (broadcast from the lowest holding stage) and the pipeline engine sums their
    gradients before every optimizer step.
    """

    def __init__(
        self,
        key: str,
        typename: type[nn.Module],
        *module_args: Any,
        forward_fn: Callable[[nn.Module, Any], Any] | None = None,
        tied_weight_attr: str | Sequence[str] = "weight",
        **module_kwargs: Any,
    ) -> None:
        super().__init__(typename, *module_args, **module_kwargs)
        if not key or "." in key:
            raise ValueError(f"TiedLayerSpec key {key!r} must be a non-empty name without '.'")
        self.key = key
        self.forward_fn = forward_fn
        attrs = [tied_weight_attr] if isinstance(tied_weight_attr, str) else list(tied_weight_attr)
        self.tied_weight_attrs = attrs

    def __repr__(self) -> str:
        return f"TiedLayerSpec({self.key!r}, {self.typename.__name__})"


def partition_balanced(weights: Sequence[float], parts: int) -> list[int]:
    """Cut ``weights`` into ``parts`` contiguous non-empty runs as DeepSpeed does.

    DeepSpeed's rule (``partition_method="parameters"`` and ``"type:..."``), so a model gets
    the same stage boundaries on both: a dynamic program over prefixes that keeps, for the
    first ``i`` layers in ``j`` runs, the cut minimizing the spread (heaviest run minus
    lightest run) given the best state of the first ``j - 1`` runs; among equal spreads the
    latest cut wins. Returns ``parts + 1`` boundaries (``bounds[k]:bounds[k+1]`` is run
    ``k``). O(parts x n^2), fine for layer lists.
    """
    n = len(weights)
    if parts > n:
        raise ValueError(f"cannot cut {n} layers into {parts} non-empty parts")
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # For (runs j, layers i): spread, heaviest and lightest run, where run j starts.
    spread = [[inf] * (n + 1) for _ in range(parts + 1)]
    heavy = [[inf] * (n + 1) for _ in range(parts + 1)]
    light = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    spread[0][0] = heavy[0][0] = 0.0
    for i in range(1, n + 1):
        for j in range(1, min(i, parts) + 1):
            for k in range(j - 1, i):
                if spread[j - 1][k] == inf:
                    continue
                run = prefix[i] - prefix[k]
                hi, lo = max(heavy[j - 1][k], run), min(light[j - 1][k], run)
                if hi - lo <= spread[j][i]:
                    spread[j][i], heavy[j][i], light[j][i], cut[j][i] = hi - lo, hi, lo, k
    bounds = [n]
    for j in range(parts, 0, -1):
        bounds.append(cut[j][bounds[-1]])
    return bounds[::-1]


def partition_uniform(num_items: int, parts: int) -> list[int]:
    """DeepSpeed's ``"uniform"`` cut: ``num_items // parts`` each, the first
    ``num_items % parts`` runs one more."""
    if parts > num_items:
        raise ValueError(f"cannot cut {num_items} layers into {parts} non-empty parts")
    size, extra = divmod(num_items, parts)
    return [k * size + min(k, extra) for k in range(parts + 1)]


def _numel_on_meta(layer: Any) -> int:
    """Trainable parameters of a layer (DeepSpeed counts only those)."""
    if isinstance(layer, LayerSpec):
        with torch.device("meta"):
            layer = layer.build()
    if isinstance(layer, nn.Module):
        return sum(p.numel() for p in layer.parameters() if p.requires_grad)
    return 0


def _type_name(layer: Any) -> str:
    if isinstance(layer, LayerSpec):
        return layer.typename.__name__
    return type(layer).__name__ if isinstance(layer, nn.Module) else getattr(layer, "__name__", "")


class PipelineModule(nn.Module):
    """A sequential model split into ``num_stages`` pipeline stages.

    Args:
        layers: ``nn.Module``s, ``LayerSpec``/``TiedLayerSpec``s or plain callables, applied
            in order; each takes the previous one's output as its single argument (a tuple
            stays a tuple). The first takes the micro-batch's inputs.
        num_stages: pipeline stages; must divide the world size. Rank ``r`` is stage
            ``r // (world / num_stages)`` (the ``pp`` axis is outermost in the mesh).
        loss_fn: ``loss_fn(outputs, labels)`` on the last stage; None: the last layer returns
            the loss.
        partition_method: ``"parameters"`` (balance trainable parameter counts, counted on
            the meta device), ``"uniform"`` (equal layer counts) or ``"type:<regex>"``
            (balance the layers whose class name matches the regex, case-insensitive).
            Each gives DeepSpeed's stage boundaries (:func:`partition_balanced`).
        activation_checkpoint_interval: recompute every run of this many layers in backward
            (``slipstream.checkpointing.checkpoint``); 0 disables.
        virtual_stages: (slipstream) model chunks per rank for the interleaved schedule.
        seed_layers: seed the RNG with ``base_seed + layer index`` before building each layer
            (initialization then does not depend on the partitioning).
        base_seed: see ``seed_layers``.
        topology: accepted for DeepSpeed compatibility; only None.
        checkpointable_layers: class names of the layers that may be recomputed; a run of
            ``activation_checkpoint_interval`` layers is recomputed only if all of its layers
            are listed (None: every layer may be).
    Raises:
        ConfigError: ``num_stages`` does not divide the world, fewer layers than
            ``num_stages * virtual_stages``, an unknown partition method or a regex that
            matches no layer.
    Communication: a broadcast of each tied weight among its holders at construction.
    """

    recompute_context: RecomputeContext = DEFAULT_CONTEXT
    """Runs the ``activation_checkpoint_interval`` recomputes: the process-wide default until
    an engine gives the module its own (``use_recompute_context_``)."""

    def __init__(
        self,
        layers: Sequence[Any],
        num_stages: int | None = None,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
        partition_method: str = "parameters",
        activation_checkpoint_interval: int = 0,
        virtual_stages: int = 1,
        seed_layers: bool = False,
        base_seed: int = 1234,
        topology: Any = None,
        checkpointable_layers: Sequence[str] | None = None,
    ) -> None:
        super().__init__()
        if topology is not None:
            raise ConfigError(
                "PipelineModule(topology=...) is not supported: pass num_stages= (data and "
                "tensor parallel sizes come from the config)"
            )
        comm.init_distributed()
        world = comm.get_world_size()
        if num_stages is None or num_stages < 1 or world % num_stages:
            raise ConfigError(
                f"PipelineModule num_stages={num_stages!r} must be a positive divisor of the "
                f"world size {world}: choose num_stages in "
                f"{[d for d in range(1, world + 1) if world % d == 0]}"
            )
        if virtual_stages < 1:
            raise ConfigError(f"PipelineModule virtual_stages={virtual_stages} must be >= 1")
        if activation_checkpoint_interval < 0:
            raise ConfigError(
                "PipelineModule activation_checkpoint_interval="
                f"{activation_checkpoint_interval} must be >= 0 (0 disables recompute)"
            )
        self.tp_group: comm.Group = None  # set by the TP plan for a vocabulary-parallel loss
        self.layer_list = list(layers)
        self.num_stages = num_stages
        self.virtual_stages = virtual_stages
        self.loss_fn = loss_fn
        self.activation_checkpoint_interval = activation_checkpoint_interval
        self.partition_method = partition_method
        self.seed_layers = seed_layers
        self.checkpointable_layers = (
            None if checkpointable_layers is None else set(checkpointable_layers)
        )
        self.stage_size = world // num_stages  # ranks per stage
        self.stage_id = comm.get_rank() // self.stage_size
        chunks = num_stages * virtual_stages
        if len(self.layer_list) < chunks:
            raise ConfigError(
                f"PipelineModule has {len(self.layer_list)} layers but num_stages={num_stages} "
                f"x virtual_stages={virtual_stages} = {chunks} model chunks need at least one "
                "layer each: add layers or use fewer stages"
            )
        self.parts = self._partition(partition_method, chunks)
        self.tied_modules = nn.ModuleDict()
        self._tied_specs: dict[str, TiedLayerSpec] = {}
        self._chunk_fns: list[list[Callable[[Any], Any]]] = []
        self._chunk_layers: list[list[int]] = []
        for c in range(virtual_stages):
            k = self.model_chunk(c)
            idx = list(range(self.parts[k], self.parts[k + 1]))
            self._chunk_layers.append(idx)
            self._chunk_fns.append([self._build(i, seed_layers, base_seed) for i in idx])
        self.tied_groups: dict[str, comm.Group] = {}
        self.tied_owner: dict[str, bool] = {}
        self._tie_across_stages()

    # ------------------------------------------------------------------- layout
    def model_chunk(self, chunk: int) -> int:
        """Global model-chunk index of this rank's local ``chunk``."""
        return chunk * self.num_stages + self.stage_id

    def chunk_stage(self, model_chunk: int) -> int:
        """The stage holding ``model_chunk``."""
        return model_chunk % self.num_stages

    def stage_layers(self, stage: int | None = None) -> list[list[int]]:
        """Layer indices of each local chunk of ``stage`` (default: this rank's stage)."""
        s = self.stage_id if stage is None else stage
        p = self.num_stages
        return [
            list(range(self.parts[c * p + s], self.parts[c * p + s + 1]))
            for c in range(self.virtual_stages)
        ]

    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    def is_last_stage(self) -> bool:
        return self.stage_id == self.num_stages - 1

    def _partition(self, method: str, chunks: int) -> list[int]:
        """Chunk boundaries, DeepSpeed's for its methods (uniform counts, balanced weights)."""
        if method.lower() == "uniform":
            return partition_uniform(len(self.layer_list), chunks)
        return partition_balanced(self._layer_weights(method), chunks)

    def _layer_weights(self, method: str) -> list[float]:
        if method.lower() == "parameters":
            return [float(_numel_on_meta(layer)) for layer in self.layer_list]
        if method.startswith("type:"):
            pattern = re.compile(method[5:], re.IGNORECASE)
            hits = [1.0 if pattern.search(_type_name(x)) else 0.0 for x in self.layer_list]
            if not any(hits):
                names = sorted({_type_name(x) for x in self.layer_list})
                raise ConfigError(
                    f"PipelineModule partition_method={method!r}: the regex matches no layer "
                    f"class (layer classes: {names}); fix the regex or use 'parameters'"
                )
            return hits
        raise ConfigError(
            f"PipelineModule partition_method={method!r} is unknown: use 'parameters', "
            "'uniform' or 'type:<regex on the layer class name>'"
        )

    def _build(self, idx: int, seed_layers: bool, base_seed: int) -> Callable[[Any], Any]:
        layer = self.layer_list[idx]
        if seed_layers and isinstance(layer, LayerSpec):
            torch.manual_seed(base_seed + idx)
        # Modules are looked up at call time: tensor parallelism may replace them later.
        if isinstance(layer, TiedLayerSpec):
            if layer.key not in self.tied_modules:
                self.tied_modules[layer.key] = layer.build()
                self._tied_specs[layer.key] = layer
            return _Layer(self.tied_modules, layer.key, layer.forward_fn)
        if isinstance(layer, (LayerSpec, nn.Module)):
            self.add_module(str(idx), layer.build() if isinstance(layer, LayerSpec) else layer)
            return _Layer(self._modules, str(idx))
        if callable(layer):
            return layer  # type: ignore[no-any-return]
        raise TypeError(
            f"PipelineModule layer {idx} is a {type(layer).__name__}: layers must be "
            "nn.Modules, LayerSpecs or callables"
        )

    # ------------------------------------------------------------------- tied layers
    def _tie_across_stages(self) -> None:
        """Create a group per (tied key, data-parallel column) and equalize the copies.

        Every rank walks the same keys in the same order (creating a group is collective).
        """
        holders: dict[str, list[int]] = {}
        for k in range(self.num_stages * self.virtual_stages):
            for i in range(self.parts[k], self.parts[k + 1]):
                layer = self.layer_list[i]
                if isinstance(layer, TiedLayerSpec):
                    stages = holders.setdefault(layer.key, [])
                    if self.chunk_stage(k) not in stages:
                        stages.append(self.chunk_stage(k))
        for key in sorted(holders):
            stages = sorted(holders[key])
            if len(stages) < 2:
                continue
            columns = [
                [s * self.stage_size + col for s in stages] for col in range(self.stage_size)
            ]
            found = member_group(columns, axis="pp")
            if found is None:
                continue
            group, ranks = found
            self.tied_groups[key] = group
            self.tied_owner[key] = self.stage_id == stages[0]
            for p in self.tied_parameters(key):
                comm.broadcast(p.data, src=ranks[0], group=group, label=f"tied_{key}")
                if self.stage_id != stages[0]:
                    # Counted once in the global gradient norm (the optimizer skips it).
                    mark_duplicate_(p)

    def tied_parameters(self, key: str) -> list[nn.Parameter]:
        """The shared parameters of tied ``key`` on this rank."""
        module = self.tied_modules[key]
        out = []
        for attr in self._tied_specs[key].tied_weight_attrs:
            p = module.get_parameter(attr)
            out.append(p)
        return out

    def zero3_units(self) -> list[tuple[str, nn.Module]]:
        """ZeRO-3 gathers each layer this stage holds as one unit, just before it runs (asked
        when ZeRO shards the model, after tensor parallelism replaced any layers)."""
        units = [(n, m) for n, m in self.named_children() if n != "tied_modules"]
        return units + [(f"tied_modules.{k}", m) for k, m in self.tied_modules.items()]

    # ------------------------------------------------------------------- tensor parallel
    def tp_plan(self, sequence_parallel: bool = False) -> TPPlan:
        """The tensor-parallel split of this stage's layers (``parallelize_tp_`` asks).

        A layer may say how it splits with ``tp_styles(vocab_parallel_loss) -> {name inside
        the layer ("" for itself): style}``; other layers get the automatic per-block rule
        (``add_block_plan``). The vocabulary-parallel loss is used when ``loss_fn`` has
        ``vocab_parallel = True`` (it then takes ``tp_group=``, handed over once the layers
        are split); otherwise LM heads gather their logits and tied layers stay whole.

        Raises:
            ConfigError: ``sequence_parallel`` (stages exchange the full sequence).
        """
        if sequence_parallel:
            raise ConfigError(
                "tensor_parallel.sequence_parallel is not supported with a PipelineModule: set "
                "it to false (pipeline stages exchange the full sequence)"
            )
        vocab_parallel = bool(getattr(self.loss_fn, "vocab_parallel", False))
        plan = TPPlan()
        if vocab_parallel:
            plan.after_split.append(self._use_tp_group)
        held = [(n, m) for n, m in self.named_children() if n != "tied_modules"]
        if vocab_parallel:
            held += [(f"tied_modules.{k}", m) for k, m in self.tied_modules.items()]
        for name, module in held:
            styles = getattr(module, "tp_styles", None)
            if not callable(styles):
                add_block_plan(plan, module, name)
                continue
            for local, style in styles(vocab_parallel).items():
                plan.styles[f"{name}.{local}" if local else name] = style
        return plan

    def _use_tp_group(self, tp_group: comm.Group) -> None:
        """The loss and the gathered outputs of the last stage work over ``tp_group``."""
        self.tp_group = tp_group

    def compute_loss(self, outputs: Any, labels: Any) -> torch.Tensor:
        """``loss_fn(outputs, labels)`` on the last stage (vocabulary-parallel under TP)."""
        assert self.loss_fn is not None
        if self.tp_group is not None:
            return self.loss_fn(outputs, labels, tp_group=self.tp_group)  # type: ignore[call-arg]
        return self.loss_fn(outputs, labels)

    def full_outputs(self, outputs: Any) -> Any:
        """The last stage's outputs with vocabulary-sharded logits gathered (evaluation)."""
        if self.tp_group is None or not isinstance(outputs, torch.Tensor):
            return outputs
        from slipstream.parallel.tensor import gather_from_tp

        return gather_from_tp(outputs, self.tp_group)

    # ------------------------------------------------------------------- forward
    def forward_chunk(self, chunk: int, inputs: Any) -> Any:
        """Run local ``chunk`` on ``inputs``; recompute runs of
        ``activation_checkpoint_interval`` layers in backward when grad is enabled."""
        fns = self._chunk_fns[chunk]
        interval = self.activation_checkpoint_interval
        if interval <= 0 or not torch.is_grad_enabled():
            return _run(fns, inputs)
        x = inputs
        layers = self._chunk_layers[chunk]
        for start in range(0, len(fns), interval):
            run = fns[start : start + interval]
            if self._checkpointable(layers[start : start + interval]):
                x = _checkpointed(run, x, self.recompute_context)
            else:
                x = _run(run, x)
        return x

    def _checkpointable(self, indices: Sequence[int]) -> bool:
        allowed = self.checkpointable_layers
        return allowed is None or all(_type_name(self.layer_list[i]) in allowed for i in indices)

    def forward(self, inputs: Any) -> Any:
        """Run every layer this rank holds, chunk after chunk (the whole model when
        ``num_stages == 1``); the loss is not applied."""
        for c in range(self.virtual_stages):
            inputs = self.forward_chunk(c, inputs)
        return inputs


class _Layer:
    """Calls the module registered under ``name`` in ``table`` (looked up at each call)."""

    def __init__(
        self,
        table: Any,
        name: str,
        forward_fn: Callable[[nn.Module, Any], Any] | None = None,
    ) -> None:
        self.table, self.name, self.forward_fn = table, name, forward_fn

    def __call__(self, x: Any) -> Any:
        module = self.table[self.name]
        if self.forward_fn is None:
            return module(x)
        # Through module(...) so its hooks run (ZeRO-3 gathers the module's parameters in a
        # forward pre-hook): forward_fn stands in for its forward during this call.
        forward_fn = self.forward_fn
        module.forward = lambda inp: forward_fn(module, inp)
        try:
            return module(x)
        finally:
            del module.forward


def _run(fns: Sequence[Callable[[Any], Any]], x: Any) -> Any:
    for fn in fns:
        x = fn(x)
    return x


def _checkpointed(fns: Sequence[Callable[[Any], Any]], x: Any, context: RecomputeContext) -> Any:
    packed = isinstance(x, tuple)
    args = x if packed else (x,)

    def run(*inner: Any) -> Any:
        return _run(fns, inner if packed else inner[0])

    # The reentrant function only reaches parameters through inputs that require grad: when
    # none does (token ids entering the first stage) use the non-reentrant one.
    if any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
        return context.checkpoint(run, *args)
    return context.non_reentrant_checkpoint(run, *args)
