"""Rank bodies for ring and Ulysses x ring attention: fp64 outputs and gradients against
single-rank attention of the whole sequence, computed in the same process."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

BATCH, DIM = 2, 8

# (seq_len, ring size, ulysses size, query heads, kv heads, causal, packed documents)
Case = tuple[int, int, int, int, int, bool, bool]


def packed_positions(seq_len: int) -> torch.Tensor:
    """Position ids of rows packing several documents (restarting at 0), different per row."""
    rows = []
    for lengths in ([5, 9, seq_len - 14], [seq_len - 3, 3]):
        rows.append(torch.cat([torch.arange(n) for n in lengths]))
    return torch.stack(rows)


def reference_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, pos: torch.Tensor | None
) -> torch.Tensor:
    """Plain attention of the whole sequence, ``[B, S, H, D]``; packed rows attend within
    their document only."""
    s = q.shape[1]
    rep = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    allowed = torch.ones(s, s, dtype=torch.bool)
    if causal:
        allowed = allowed.tril()
    allowed = allowed.expand(q.shape[0], s, s)
    if pos is not None:
        start = torch.arange(s) - pos
        allowed = allowed & (start[:, :, None] == start[:, None, :])
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=allowed[:, None]
    )
    return out.transpose(1, 2)


def _case(mesh: Any, case: Case) -> dict[str, float]:
    from slipstream.distributed.mesh import sp_ring_groups
    from slipstream.sequence.ring import doc_starts, sequence_shard_indices, usp_attention

    seq, ring, uly, heads, kv, causal, packed = case
    ulysses_group, ring_group = sp_ring_groups(mesh, ring)
    g = torch.Generator().manual_seed(hash(case) % 2**31)
    q = torch.randn(BATCH, seq, heads, DIM, dtype=torch.float64, generator=g)
    k = torch.randn(BATCH, seq, kv, DIM, dtype=torch.float64, generator=g)
    v = torch.randn(BATCH, seq, kv, DIM, dtype=torch.float64, generator=g)
    grad = torch.randn(BATCH, seq, heads, DIM, dtype=torch.float64, generator=g)
    pos = packed_positions(seq) if packed else None
    idx = sequence_shard_indices(seq, ring, dist.get_rank(), uly)
    ql, kl, vl = (t[:, idx].clone().requires_grad_() for t in (q, k, v))
    doc = doc_starts(pos[:, idx], idx) if pos is not None else None
    out = usp_attention(ql, kl, vl, ulysses_group, ring_group, causal=causal, doc_start=doc)
    out.backward(grad[:, idx])
    qf, kf, vf = (t.clone().requires_grad_() for t in (q, k, v))
    ref = reference_attention(qf, kf, vf, causal, pos)
    ref.backward(grad)
    errors = {"out": (out.detach() - ref.detach()[:, idx]).abs().max().item()}
    for name, mine, full in (("dq", ql, qf), ("dk", kl, kf), ("dv", vl, vf)):
        assert mine.grad is not None and full.grad is not None
        errors[name] = (mine.grad - full.grad[:, idx]).abs().max().item()
    errors["scale"] = ref.abs().max().item()
    return errors


def kernel_world(cases: list[Case]) -> dict[tuple[Case, str], dict[str, float]]:
    """Every case through both block paths: PyTorch's fused CPU attention and the tiled
    formula (in row tiles of 3, so blocks of 4-6 rows are cut unevenly)."""
    from slipstream.distributed.mesh import ParallelDims, build_mesh
    from slipstream.sequence import _ring_blocks as ring

    world = dist.get_world_size()
    mesh = build_mesh(ParallelDims(world_size=world, sp=world), "cpu")
    out = {}
    fused = ring._FLASH_CPU
    for path in ("fused", "tiled"):
        ring._FLASH_CPU = fused and path == "fused"
        ring.ROW_TILE = 3 if path == "tiled" else 1024
        out.update({(case, path): _case(mesh, case) for case in cases})
    return out


# ------------------------------------------------------ training: HF causal LMs and the GPT
PACKED_DOCS = (5, 11)  # documents per packed row of 16 tokens


class RingData(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """``_hf_workloads.LMData`` rows, cut to ``seq`` tokens; ``packed``: each row packs two
    documents (position ids restart at 0; the first token of each document has label -100,
    so no target crosses a document boundary)."""

    def __init__(self, seq: int, packed: bool) -> None:
        from tests.sequence._hf_workloads import LMData

        data = LMData()
        self.ids, self.labels = data.ids[:, :seq].clone(), data.labels[:, :seq].clone()
        self.packed = packed
        if packed:
            self.labels[:, PACKED_DOCS[0]] = -100

    def __len__(self) -> int:
        return self.ids.shape[0]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        item = {"input_ids": self.ids[i], "labels": self.labels[i]}
        if self.packed:
            item["position_ids"] = torch.cat([torch.arange(n) for n in PACKED_DOCS])
        return item


def _ring_config(stage: int, sp: int, ring: int | None, bf16: bool = False) -> dict[str, Any]:
    from tests.sequence._hf_workloads import BATCH, LR

    cfg: dict[str, Any] = {
        "train_batch_size": BATCH,
        "optimizer": {"type": "SGD", "params": {"lr": LR, "momentum": 0.9}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "sequence_parallel_size": sp,
        "sequence_parallel_mode": "ring",
        "seed": 7,
        "gradient_clipping": 0.0,
    }
    if ring is not None:
        cfg["sequence_parallel_ring_size"] = ring
    return cfg


def hf_ring_run(name: str, stage: int, seq: int, packed: bool) -> dict[str, Any]:
    """SP = world in ring mode through ``slipstream.initialize`` and its loader."""
    import slipstream
    from tests.sequence._hf_workloads import STEPS, make_model

    model = make_model(name)
    engine, _, loader, _ = slipstream.initialize(
        model=model,
        config=_ring_config(stage, dist.get_world_size(), None),
        training_data=RingData(seq, packed),
    )
    losses, shapes, attn = [], set(), model.config._attn_implementation
    for _, batch in zip(range(STEPS), loader):
        shapes.add(tuple(batch["input_ids"].shape))
        loss = engine(**batch).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    with slipstream.zero.GatheredParameters(list(engine.module.parameters())):
        params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    engine.destroy()
    return {"losses": losses, "params": params, "shapes": sorted(shapes), "attn": attn}


def hf_reference_run(name: str, seq: int, packed: bool) -> dict[str, Any]:
    """One process, the whole batch, the sampler's order; packed rows are run document by
    document (separate forwards, positions from 0) and their token losses summed over the
    batch's counted tokens: what packing with no cross-document attention must equal."""
    from tests.sequence._hf_workloads import BATCH, LR, STEPS, make_model

    model = make_model(name)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    data = RingData(seq, packed)
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(7)).tolist()
    docs = [(0, PACKED_DOCS[0]), (PACKED_DOCS[0], seq)] if packed else [(0, seq)]
    losses = []
    for step in range(STEPS):
        idx = order[step * BATCH : (step + 1) * BATCH]
        ids, labels = data.ids[idx], data.labels[idx]
        total, count = torch.zeros(()), 0
        for lo, hi in docs:
            logits = model(input_ids=ids[:, lo:hi]).logits[:, :-1]
            target = labels[:, lo + 1 : hi]
            total = total + torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="sum"
            )
            count += int((target != -100).sum())
        loss = total / count
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return {"losses": losses, "params": {n: p.detach() for n, p in model.named_parameters()}}


def gpt_ring_run(stage: int) -> dict[str, Any]:
    """The reference GPT with ``sequence_parallel='ring'``, sp = world."""
    import slipstream
    from tests.sequence import _workloads as s

    model = s.make_gpt("ring")
    cfg = s._config(stage, dist.get_world_size(), 4)
    cfg["sequence_parallel_mode"] = "ring"
    engine, _, loader, _ = slipstream.initialize(
        model=model, config=cfg, training_data=s.TokenData()
    )
    losses = []
    for _, (x, y) in zip(range(s.STEPS), loader):
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    with slipstream.zero.GatheredParameters(list(engine.module.parameters())):
        params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    engine.destroy()
    return {"losses": losses, "params": params}


def refusal(config_extra: dict[str, Any], model_name: str) -> str:
    import slipstream
    from tests.sequence import _workloads as s
    from tests.sequence._hf_workloads import make_model

    model = s.make_gpt("ulysses") if model_name == "gpt_ulysses" else make_model(model_name)
    cfg = dict(_ring_config(0, dist.get_world_size(), None), **config_extra)
    try:
        slipstream.initialize(model=model, config=cfg)
    except ValueError as err:
        return str(err)
    return "no error"


def training_world(
    hf_runs: list[tuple[str, int, int, bool]], gpt_stages: list[int], refused: list[Any]
) -> dict[str, Any]:
    return {
        "hf": {run: hf_ring_run(*run) for run in hf_runs},
        "gpt": {stage: gpt_ring_run(stage) for stage in gpt_stages},
        "refused": {str(r): refusal(*r) for r in refused},
    }
