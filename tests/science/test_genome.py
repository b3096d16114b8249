"""Synthetic genomes (planted motifs, deterministic) and the genome LM example end to end."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from slipstream.science import decode, encode, synthetic_genomes
from tests.distributed.harness import run_script

ROOT = Path(__file__).resolve().parents[2]


def test_motifs_are_planted_where_in_motif_says() -> None:
    """Tokens are ACGT ids; every planted slot holds a library motif; seeds reproduce."""
    batch = synthetic_genomes(3, 500, num_motifs=2, motif_length=10, motif_fraction=0.5, seed=3)
    assert batch.tokens.shape == batch.in_motif.shape == (3, 500)
    assert batch.tokens.min() >= 0 and batch.tokens.max() <= 3
    assert 0.2 < batch.in_motif.float().mean().item() < 0.45  # 0.5 x 6/10 of each motif
    for row in range(3):
        for start in range(0, 500 - 9, 10):
            if batch.in_motif[row, start + 4]:
                window = batch.tokens[row, start : start + 10]
                assert any(torch.equal(window, m) for m in batch.motifs)
    again = synthetic_genomes(3, 500, num_motifs=2, motif_length=10, motif_fraction=0.5, seed=3)
    assert torch.equal(batch.tokens, again.tokens)
    other = synthetic_genomes(3, 500, num_motifs=2, motif_length=10, motif_fraction=0.5, seed=4)
    assert torch.equal(batch.motifs, other.motifs) and not torch.equal(batch.tokens, other.tokens)


def test_encode_decode_round_trip_and_errors() -> None:
    """encode/decode are inverse; unknown symbols and bad sizes are named."""
    assert decode(encode("ACGTtg")) == "ACGTTG"
    with pytest.raises(ValueError, match=r"symbol 'N' is not one of ACGT"):
        encode("ACNG")
    with pytest.raises(ValueError, match=r"motif_fraction=1.0 must be in \[0, 1\)"):
        synthetic_genomes(1, 64, motif_fraction=1.0)
    with pytest.raises(ValueError, match=r"length >= motif_length"):
        synthetic_genomes(1, 8, motif_length=16)


@pytest.mark.slow
def test_genome_lm_example_trains_and_compares_memory() -> None:
    """examples/genome_lm.py runs (tiny sizes): training log, held-out losses, memory table."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args = ["--steps", "4", "--seq-len", "128", "--mem-seq-len", "256", "--mem-layers", "3"]
    proc = run_script(ROOT / "examples" / "genome_lm.py", *args, env=env, cwd=ROOT, timeout_s=180)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "held-out loss on motif bases" in proc.stdout
    assert "live tensors  without checkpointing" in proc.stdout
