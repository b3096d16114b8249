"""NVMe offload of optimizer states: bit-identical training, verified swap files, lower peak RSS."""

from __future__ import annotations

from tests.distributed.harness import run_world
from tests.zero import _offload_workloads as w


def test_nvme_offload_is_exact_and_detects_corruption(tmp_path):
    """Stages 2/3 x fp32/bf16: same losses and weights as in-memory states, none held in
    memory between steps; a corrupted swap file is an error naming the file."""
    results = run_world(w.parity_and_corruption, 2, str(tmp_path))
    for r in results:
        for cfg in ((2, False), (2, True), (3, False), (3, True)):
            assert r[cfg]["same_losses"] and r[cfg]["same_params"], cfg
            assert r[cfg]["state_in_memory"] == 0, cfg
        message, victim = r["corrupt"]
        assert "is corrupted" in message and victim in message


def test_nvme_offload_lowers_peak_rss(tmp_path):
    """GPT-25m at ZeRO-2 on one process: swapping AdamW states (~190 MB) lowers peak RSS."""
    plain = run_world(w.peak_rss, 1, None)[0]
    swapped = run_world(w.peak_rss, 1, str(tmp_path))[0]
    print(
        f"peak RSS above baseline: in-memory states {plain / 2**20:.0f} MB, NVMe {swapped / 2**20:.0f} MB"
    )
    assert swapped < plain - 100 * 2**20, (plain, swapped)


def test_cpu_offload_path_is_exact():
    """The offload_optimizer.device = "cpu" path (host masters, step on the host; at stage 3
    also offload_param = cpu) trains bit-identically to no offload (fp32, stages 2 and 3);
    forced on this CPU-only box, where host and device memory are the same."""
    for r in run_world(w.cpu_offload_path, 2):
        for stage in (2, 3):
            assert r[stage]["same_losses"] and r[stage]["same_params"], stage
            assert r[stage]["separate_masters"], stage
            est = r[stage]["estimate"]
            assert abs(r[stage]["master_bytes"] - est["master"]) <= 0.05 * est["master"]
            assert est["host"] >= est["master"] + est["optimizer"]


def test_estimate_counts_the_offload_staging_buffers():
    """Offloading the optimizer from an accelerator keeps a host gradient buffer per shard
    (grad dtype) and, for bf16 weights, a host buffer of cast weights."""
    import torch

    from slipstream.models import GPT, GPTConfig
    from slipstream.zero import estimate_memory

    model = GPT(GPTConfig.preset("tiny"))
    shard = -(-sum(p.numel() for p in model.parameters()) // 2)
    bf16 = estimate_memory(model, 2, 2, param_dtype=torch.bfloat16, offload_optimizer="cpu")
    assert bf16["host_staging"] == shard * 4 + shard * 2
    assert bf16["host"] == bf16["master"] + bf16["optimizer"] + bf16["host_staging"]
    assert bf16["device"] + bf16["host"] + bf16["nvme"] == bf16["total"]
    assert estimate_memory(model, 2, 2, offload_optimizer="cpu")["host_staging"] == shard * 4
    assert estimate_memory(model, 2, 2)["host_staging"] == 0
    assert estimate_memory(model, 2, 2, offload_optimizer="nvme")["host_staging"] == 0
