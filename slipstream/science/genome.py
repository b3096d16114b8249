"""Synthetic nucleotide sequences with planted motifs, for long-sequence genome LMs.

GenSLMs (Zvyagin et al. 2022) train causal LMs over genomes; DeepSpeed4Science (Song et al.
2023, sec. "GenSLMs") extends their context to hundreds of thousands of nucleotides. Offline
tests need data with a learnable signal and a known answer: here, uniform random ACGT
background (entropy log 4 = 1.386 nats per base) with copies of a fixed library of motifs
planted at random positions. Once a model has seen a motif's first bases, the rest of it is
predictable, so the loss on motif positions falls well below log 4 while the background
stays at log 4: the gap measures how much the model learned.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["NUCLEOTIDES", "GenomeBatch", "decode", "encode", "synthetic_genomes"]

NUCLEOTIDES = "ACGT"
"""Token ids 0-3, in this order."""


def encode(sequence: str) -> torch.Tensor:
    """'ACGT...' -> int64 token ids. Raises ValueError naming the first unknown symbol."""
    lookup = {c: i for i, c in enumerate(NUCLEOTIDES)}
    bad = next((c for c in sequence.upper() if c not in lookup), None)
    if bad is not None:
        raise ValueError(f"encode: symbol {bad!r} is not one of {NUCLEOTIDES}")
    return torch.tensor([lookup[c] for c in sequence.upper()], dtype=torch.int64)


def decode(tokens: torch.Tensor) -> str:
    """int token ids (1-D) -> 'ACGT...'."""
    return "".join(NUCLEOTIDES[int(t)] for t in tokens)


@dataclass
class GenomeBatch:
    """Sequences and where the planted motifs are."""

    tokens: torch.Tensor
    """int64 [num_sequences, length], values in 0..3."""
    in_motif: torch.Tensor
    """bool [num_sequences, length]: True on every motif base after its first
    ``identify`` bases (the positions a model that knows the library can predict)."""
    motifs: torch.Tensor
    """int64 [num_motifs, motif_length]: the library."""


def synthetic_genomes(
    num_sequences: int,
    length: int,
    *,
    num_motifs: int = 4,
    motif_length: int = 32,
    motif_fraction: float = 0.6,
    identify: int = 4,
    seed: int = 0,
    library_seed: int = 0,
) -> GenomeBatch:
    """Random ACGT with library motifs covering about ``motif_fraction`` of each sequence.

    Args:
        num_sequences, length: output shape.
        num_motifs, motif_length: size of the motif library (drawn from ``library_seed``).
        motif_fraction: share of bases inside motifs, in [0, 1); motifs are placed in
            non-overlapping slots of ``motif_length`` bases.
        identify: bases of a motif after which it counts as predictable in ``in_motif``.
        seed: seeds the background and the placement; same seeds, same data.
        library_seed: seeds the motif library; keep it fixed to draw held-out sequences
            (another ``seed``) that share the training motifs.

    Raises:
        ValueError: non-positive sizes, ``length < motif_length`` or a fraction out of range.
    """
    if min(num_sequences, length, num_motifs, motif_length) < 1 or length < motif_length:
        raise ValueError(
            f"synthetic_genomes: need positive sizes and length >= motif_length, got "
            f"num_sequences={num_sequences}, length={length}, num_motifs={num_motifs}, "
            f"motif_length={motif_length}"
        )
    if not 0.0 <= motif_fraction < 1.0:
        raise ValueError(f"synthetic_genomes: motif_fraction={motif_fraction} must be in [0, 1)")
    motifs = torch.randint(
        0, 4, (num_motifs, motif_length), generator=torch.Generator().manual_seed(library_seed)
    )
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 4, (num_sequences, length), generator=g)
    in_motif = torch.zeros(num_sequences, length, dtype=torch.bool)
    slots = length // motif_length
    planted = torch.rand(num_sequences, slots, generator=g) < motif_fraction
    which = torch.randint(0, num_motifs, (num_sequences, slots), generator=g)
    rows, cols = planted.nonzero(as_tuple=True)
    starts = cols * motif_length
    offsets = torch.arange(motif_length)
    positions = starts[:, None] + offsets  # [num_planted, motif_length]
    tokens[rows[:, None], positions] = motifs[which[rows, cols]]
    in_motif[rows[:, None], positions[:, identify:]] = True
    return GenomeBatch(tokens=tokens, in_motif=in_motif, motifs=motifs)
