"""Block quantization for collectives (ZeRO++ qwZ and qgZ, Wang et al. 2023).

Symmetric int8 or int4 codes with one fp32 scale per block of ``block`` elements:
``scale = absmax / (2^(b-1) - 1)`` and ``q = round(x / scale)`` clamped to
``[-(2^(b-1) - 1), 2^(b-1) - 1]``. (DeepSpeed's kernel uses ``2^b / (2 absmax)``, which maps
+absmax to 2^(b-1) and then clips it; this variant never clips.) int4 codes are stored two per
byte. The error of every element is at most half a step, ``scale / 2``, of its own block.

Vectorized PyTorch on any device; a partial last block is padded with zeros.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["QuantizedBlocks", "dequantize_blocks", "fit_block", "quantize_blocks", "wire_bytes"]


@dataclass
class QuantizedBlocks:
    """``codes`` (int8, or uint8 holding two int4 codes) and one fp32 ``scale`` per block."""

    codes: torch.Tensor
    scales: torch.Tensor
    numel: int
    bits: int
    block: int


def _check(bits: int, block: int) -> None:
    if bits not in (4, 8):
        raise ValueError(f"block quantization supports 4 or 8 bits, got bits={bits}")
    if block <= 0 or (bits == 4 and block % 2):
        raise ValueError(f"block size must be positive (and even for int4), got block={block}")


def fit_block(n: int, block: int) -> int:
    """Equal, even blocks of at most ``block`` that just cover ``n`` elements (tiny padding)."""
    nblocks = max(1, -(-n // block))
    fitted = -(-n // nblocks)
    return fitted + fitted % 2


def quantize_blocks(x: torch.Tensor, bits: int = 8, block: int = 2048) -> QuantizedBlocks:
    """Quantize flat ``x`` (any float dtype) into symmetric ``bits``-bit codes per block."""
    _check(bits, block)
    flat = x.reshape(-1)
    numel = flat.numel()
    nblocks = max(1, -(-numel // block))
    padded = torch.zeros(nblocks * block, dtype=torch.float32, device=x.device)
    padded[:numel] = flat
    blocks = padded.view(nblocks, block)
    qmax = 2 ** (bits - 1) - 1
    scales = blocks.abs().amax(dim=1) / qmax
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(blocks / safe[:, None]).clamp_(-qmax, qmax).to(torch.int8)
    if bits == 4:
        nib = (q.view(-1) & 0x0F).to(torch.uint8)
        codes = nib[0::2] | (nib[1::2] << 4)
    else:
        codes = q.view(-1)
    return QuantizedBlocks(codes, scales, numel, bits, block)


def dequantize_blocks(
    q: QuantizedBlocks, dtype: torch.dtype = torch.float32, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Inverse of ``quantize_blocks`` (into ``out`` if given), flat, ``q.numel`` elements."""
    if q.bits == 4:
        low = (q.codes & 0x0F).to(torch.int8)
        high = (q.codes >> 4).to(torch.int8)
        vals = torch.stack((low, high), dim=1).view(-1)
        vals = torch.where(vals > 7, vals - 16, vals)  # sign-extend the nibbles
    else:
        vals = q.codes
    blocks = vals.view(-1, q.block).to(torch.float32) * q.scales[:, None]
    flat = blocks.view(-1)[: q.numel]
    if out is None:
        return flat.to(dtype)
    out.copy_(flat)
    return out


def wire_bytes(numel: int, bits: int, block: int) -> int:
    """Bytes of codes plus scales for ``numel`` elements."""
    nblocks = max(1, -(-numel // block))
    return nblocks * block * bits // 8 + nblocks * 4
