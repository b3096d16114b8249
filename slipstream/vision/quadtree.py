"""Batched, vectorized quadtrees over edge maps (APF step 3, arXiv 2404.09707 sec. III-A).

A node is an axis-aligned square ``(y, x, s)`` with ``s`` a power of two; its score is the
number of edge pixels inside it. The spec reads it from a summed-area table
(:func:`summed_area_table` / :func:`box_counts`, kept as utilities); the trees here get every
count at once from the edge pixels themselves: their Morton codes (cells of ``min_size``) are
sorted once, a node of side ``s`` is a code shifted right by ``2 log2(s / min_size)`` bits,
and the run lengths of the shifted codes are the counts of all non-empty nodes of that level.
Cost O(edge pixels x levels), nothing of size R^2 (at 8K a table or count pyramid over the
image costs more than the whole tree). Same splits as the SAT recursion (tested). Two variants:

* :func:`threshold_quadtree` (the authors' first release): split a node iff its edge count
  exceeds ``threshold`` and it is shallower than ``max_depth``. Nodes over the threshold are
  non-empty and their parents are over it too, so the split set is read level by level.
* :func:`fixed_length_quadtree` (the later release): repeatedly split the leaf with the most
  edges until the sequence holds ``length`` leaves. Because a child never has more edges than
  its parent, that greedy best-first expansion splits exactly the ``(length - 1) / 3`` nodes
  with the largest counts (ties: shallower first, then Morton order), so the whole tree is one
  ``topk`` over the non-empty nodes of all levels: no sequential loop, same result.

Leaves come back in Morton (Z) order -- TL, TR, BL, BR, recursively -- which is the depth-first
order of the tree, so spatially close leaves are close in the token sequence. Both variants
return :class:`Leaves`, padded to a common length with flagged empty leaves.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "Leaves",
    "box_counts",
    "fixed_length_quadtree",
    "morton_encode",
    "summed_area_table",
    "threshold_quadtree",
    "uniform_leaves",
]


@dataclass(frozen=True)
class Leaves:
    """The leaves of one quadtree per image, in Morton order, padded to a common length L.

    Padding entries (``valid`` False) sit at the end of each row with ``y = x = -1`` and
    ``size = 0``. Valid leaves of one image are pairwise disjoint; unless leaves were dropped
    to honour a length (threshold variant only) they cover the image exactly.
    """

    y: Tensor
    """(B, L) int64: top row of each leaf."""
    x: Tensor
    """(B, L) int64: left column of each leaf."""
    size: Tensor
    """(B, L) int64: side length, a power of two (0 for padding)."""
    valid: Tensor
    """(B, L) bool: False for padding."""
    image_size: int
    """Side R of the (square, power-of-two) image the tree partitions."""

    @property
    def num_leaves(self) -> Tensor:
        """(B,) int64: number of valid leaves per image."""
        return self.valid.sum(dim=1)

    @property
    def length(self) -> int:
        """L, the padded sequence length."""
        return self.y.shape[1]

    def select(self, index: Tensor | slice) -> Leaves:
        """The leaves of a subset of the images (``index`` into the batch axis)."""
        return Leaves(
            y=self.y[index],
            x=self.x[index],
            size=self.size[index],
            valid=self.valid[index],
            image_size=self.image_size,
        )

    @staticmethod
    def cat(parts: list[Leaves]) -> Leaves:
        """Concatenate along the batch axis (same L and image size required)."""
        if len({(p.length, p.image_size) for p in parts}) != 1:
            raise ValueError(
                "Leaves.cat needs equal length and image_size, got "
                f"{[(p.length, p.image_size) for p in parts]}; pad with a fixed length"
            )
        return Leaves(
            y=torch.cat([p.y for p in parts]),
            x=torch.cat([p.x for p in parts]),
            size=torch.cat([p.size for p in parts]),
            valid=torch.cat([p.valid for p in parts]),
            image_size=parts[0].image_size,
        )

    def centres(self) -> Tensor:
        """(B, L, 2) float: leaf centres (row, column) divided by R, in [0, 1]; -1 for padding."""
        c = torch.stack([self.y, self.x], dim=-1).float() + self.size.unsqueeze(-1) / 2.0
        c = c / self.image_size
        return torch.where(self.valid.unsqueeze(-1), c, torch.full_like(c, -1.0))

    def depth(self) -> Tensor:
        """(B, L) int64: log2(R / size), the tree depth of each leaf (0 for padding)."""
        s = self.size.clamp(min=1)
        d = (self.image_size // s).float().log2().round().long()
        return torch.where(self.valid, d, torch.zeros_like(d))


def _check_edges(edges: Tensor) -> int:
    if edges.dim() != 3 or edges.shape[1] != edges.shape[2]:
        raise ValueError(
            f"edges must have shape (batch, R, R) with square planes, got {tuple(edges.shape)}; "
            "resize images to a square power-of-two side first (slipstream.vision.resize_square)"
        )
    r = edges.shape[1]
    if r & (r - 1):
        raise ValueError(
            f"edges side R={r} is not a power of two; resize to {1 << (r - 1).bit_length()} "
            f"or {1 << (r.bit_length() - 1)} with slipstream.vision.resize_square"
        )
    return r


def _check_min_size(min_size: int, r: int) -> None:
    if min_size < 1 or min_size & (min_size - 1) or min_size > r:
        raise ValueError(
            f"min_size={min_size} must be a power of two between 1 and the image side {r}"
        )


def _pool_cells(edges: Tensor, cell: int) -> Tensor:
    """(B, R/cell, R/cell) int32 edge counts of the aligned ``cell`` x ``cell`` squares."""
    x = edges.to(torch.int32) if cell == 1 else edges
    while cell > 1:
        x = (
            x[:, 0::2, 0::2].to(torch.int32)
            + x[:, 1::2, 0::2]
            + x[:, 0::2, 1::2]
            + x[:, 1::2, 1::2]
        )
        cell //= 2
    return x


def _column_scan_(x: Tensor, block: int = 64) -> Tensor:
    """In-place inclusive prefix sum along dim 1 of (B, H, W).

    Blocked (``block`` row adds inside blocks, one short ``cumsum`` over block totals):
    ``cumsum(dim=1)`` on a non-innermost axis is several times slower on CPU.
    """
    b, h, w = x.shape
    if h % block or not x.is_contiguous():
        return x.copy_(x.cumsum(1, dtype=x.dtype))
    v = x.view(b, h // block, block, w)
    for i in range(1, block):
        v[:, :, i] += v[:, :, i - 1]
    totals = v[:, :, -1].cumsum(1, dtype=x.dtype)
    v[:, 1:] += totals[:, :-1].unsqueeze(2)
    return x


def _check_max_size(max_size: int | None, min_size: int, r: int) -> int:
    if max_size is None:
        return r
    if max_size < min_size or max_size & (max_size - 1):
        raise ValueError(
            f"max_size={max_size} must be a power of two >= min_size={min_size} (or None)"
        )
    return max_size


def summed_area_table(edges: Tensor, cell: int = 1) -> Tensor:
    """(B, H/cell + 1, W/cell + 1) prefix sums of ``edges`` (B, H, W), zero first row/column.

    ``S[b, i, j]`` counts ``edges[b, :i*cell, :j*cell]``; with ``cell > 1`` (a power of two
    dividing H and W) the table only answers queries aligned to the ``cell`` grid, at
    1/cell**2 of the memory. int32 while H*W < 2**31, else int64.
    """
    h, w = edges.shape[-2:]
    dtype = torch.int32 if h * w < 2**31 else torch.int64
    sums = _pool_cells(edges, cell).to(dtype).cumsum(2, dtype=dtype)
    return F.pad(_column_scan_(sums), (1, 0, 1, 0))


def box_counts(sat: Tensor, b: Tensor, y: Tensor, x: Tensor, s: Tensor | int) -> Tensor:
    """Edge count of squares ``[y, y+s) x [x, x+s)`` of images ``b``: four SAT reads each (O(1))."""
    _, hp, wp = sat.shape
    flat = sat.reshape(-1)
    base = b * (hp * wp)
    y2, x2 = y + s, x + s
    return (
        flat[base + y2 * wp + x2]
        - flat[base + y * wp + x2]
        - flat[base + y2 * wp + x]
        + flat[base + y * wp + x]
    ).long()


def _spread_bits(v: Tensor) -> Tensor:
    v = (v | (v << 16)) & 0x0000FFFF0000FFFF
    v = (v | (v << 8)) & 0x00FF00FF00FF00FF
    v = (v | (v << 4)) & 0x0F0F0F0F0F0F0F0F
    v = (v | (v << 2)) & 0x3333333333333333
    return (v | (v << 1)) & 0x5555555555555555


def _compact_bits(v: Tensor) -> Tensor:
    v = v & 0x5555555555555555
    v = (v | (v >> 1)) & 0x3333333333333333
    v = (v | (v >> 2)) & 0x0F0F0F0F0F0F0F0F
    v = (v | (v >> 4)) & 0x00FF00FF00FF00FF
    v = (v | (v >> 8)) & 0x0000FFFF0000FFFF
    return (v | (v >> 16)) & 0x00000000FFFFFFFF


def morton_encode(row: Tensor, col: Tensor) -> Tensor:
    """Z-order code of integer cell coordinates (< 2**31): bits interleaved, column lowest.

    Sorting by it visits TL, TR, BL, BR quadrants recursively.
    """
    return (_spread_bits(row.long()) << 1) | _spread_bits(col.long())


@functools.lru_cache(maxsize=32)
def _morton_perm(n: int, device: torch.device) -> Tensor:
    """Raster indices of an n x n grid (n a power of two) listed in Morton order."""
    r = torch.arange(n, device=device)
    codes = morton_encode(r.view(-1, 1), r.view(1, -1)).reshape(-1)
    perm = torch.empty_like(codes)
    perm[codes] = torch.arange(n * n, device=device)
    return perm


def _pack(
    b: Tensor, y: Tensor, x: Tensor, s: Tensor, batch: int, r: int, length: int | None
) -> Leaves:
    """Sort leaves by (image, Morton code) and lay them out as padded (B, L) rows."""
    unit = int(s.min()) if s.numel() else r
    order = torch.argsort(b * (r // unit) ** 2 + morton_encode(y // unit, x // unit))
    b, y, x, s = b[order], y[order], x[order], s[order]
    counts = torch.bincount(b, minlength=batch)
    width = int(counts.max()) if length is None else length
    start = torch.cumsum(counts, 0) - counts
    slot = torch.arange(b.numel(), device=b.device) - start[b]
    out = [
        torch.full((batch, width), fill, dtype=torch.long, device=b.device) for fill in (-1, -1, 0)
    ]
    for t, v in zip(out, (y, x, s)):
        t[b, slot] = v
    valid = torch.zeros((batch, width), dtype=torch.bool, device=b.device)
    valid[b, slot] = True
    return Leaves(y=out[0], x=out[1], size=out[2], valid=valid, image_size=r)


def _drop_to_length(leaves: Leaves, length: int, generator: torch.Generator | None) -> Leaves:
    """Keep a random ``length`` of the valid leaves of every over-long row (Morton order kept)."""
    dev = leaves.valid.device
    gen_dev = generator.device if generator is not None else dev
    noise = torch.rand(leaves.valid.shape, generator=generator, device=gen_dev).to(dev)
    noise = torch.where(leaves.valid, noise, torch.full_like(noise, 2.0))
    keep = torch.argsort(noise, dim=1)[:, :length].sort(dim=1).values
    take = lambda t: torch.gather(t, 1, keep)  # noqa: E731
    return Leaves(
        y=take(leaves.y),
        x=take(leaves.x),
        size=take(leaves.size),
        valid=take(leaves.valid),
        image_size=leaves.image_size,
    )


def _edge_codes(points: Tensor, r: int, min_size: int) -> Tensor:
    """Sorted keys ``image * n**2 + Morton(cell)`` of edge pixels (flat indices into (B, R, R)),
    cells of side ``min_size`` (n = R / min_size). A node of side ``s`` is the key shifted
    right by ``2 log2(s / min_size)``: run lengths of the shifted keys count its edges."""
    n = r // min_size
    img = points // (r * r)
    rem = points - img * (r * r)
    yy, xx = rem // r, rem % r
    return (img * (n * n) + morton_encode(yy // min_size, xx // min_size)).sort().values


def _level_nodes(codes: Tensor, side: int, r: int, min_size: int) -> tuple[Tensor, Tensor, Tensor]:
    """Image, Morton code (in the (R/side)**2 grid) and edge count of every node of ``side``
    holding at least one edge pixel."""
    shift = 2 * ((side // min_size).bit_length() - 1)
    keys, counts = torch.unique_consecutive(codes >> shift, return_counts=True)
    per_image = (r // side) ** 2
    return keys // per_image, keys % per_image, counts


def _all_nodes(batch: int, side: int, r: int, dev: torch.device) -> tuple[Tensor, Tensor]:
    per_image = (r // side) ** 2
    img = torch.arange(batch, device=dev).repeat_interleave(per_image)
    return img, torch.arange(per_image, device=dev).repeat(batch)


def _leaves_from_split_set(
    split: list[tuple[int, Tensor, Tensor]], batch: int, r: int, length: int | None
) -> Leaves:
    """Leaves of the trees whose split nodes are ``split`` (per side: image, Morton code).

    The split set is closed under parents (a child never has more edges than its parent),
    so the leaves are the root of unsplit images plus every child of a split node that is
    not split itself.
    """
    dev = split[0][1].device if split else torch.device("cpu")
    sides = [side for side, _, _ in split]
    bits = r.bit_length()  # room for every level's Morton codes
    gid = lambda side, img, code: (img * (2 * bits) + side.bit_length()) << (2 * bits) | code  # noqa: E731
    split_ids = (
        torch.cat([gid(sd, img, code) for sd, img, code in split]).sort().values
        if split
        else torch.empty(0, dtype=torch.long, device=dev)
    )
    parts = []
    any_split = torch.zeros(batch, dtype=torch.bool, device=dev)
    for side, img, code in split:
        any_split[img] = True
        half = side // 2
        child = (code.unsqueeze(1) * 4 + torch.arange(4, device=dev)).reshape(-1)
        cimg = img.repeat_interleave(4)
        ids = gid(half, cimg, child)
        if half in sides:
            pos = torch.searchsorted(split_ids, ids).clamp_(max=max(split_ids.numel() - 1, 0))
            leaf = split_ids[pos] != ids
            child, cimg = child[leaf], cimg[leaf]
        parts.append((cimg, _compact_bits(child >> 1) * half, _compact_bits(child) * half, half))
    root = (~any_split).nonzero().squeeze(1)
    zero = torch.zeros_like(root)
    parts.append((root, zero, zero, r))
    b = torch.cat([p[0] for p in parts])
    y = torch.cat([p[1] for p in parts])
    x = torch.cat([p[2] for p in parts])
    s = torch.cat([torch.full_like(p[1], p[3]) for p in parts])
    return _pack(b, y, x, s, batch, r, length)


def _points(edges: Tensor) -> Tensor:
    return edges.reshape(-1).nonzero().squeeze(1)


def threshold_quadtree(
    edges: Tensor,
    threshold: int = 50,
    *,
    max_depth: int = 10,
    min_size: int = 2,
    max_size: int | None = None,
    length: int | None = None,
    generator: torch.Generator | None = None,
) -> Leaves:
    """Variant A: split a node iff it holds more than ``threshold`` edge pixels.

    A node of side s at depth d splits iff ``count > threshold`` and ``d < max_depth`` and
    ``s / 2 >= min_size``, or unconditionally iff ``s > max_size``. Leaf count = 1 + 3 * splits.

    Args:
        edges: (B, R, R) edge map (bool or 0/1), R a power of two.
        length: pad every row to exactly this many leaves. Rows with more leaves keep a random
            subset of ``length`` (the authors' release does this; coverage is then lost, so
            prefer a larger ``threshold`` or the fixed-length variant). None pads to the
            longest row of the batch.
        generator: randomness for dropping leaves.

    Cost: one sort of the edge pixels, then O(edge pixels) per level; nothing of size R^2
    beyond finding the edge pixels.
    """
    r = _check_edges(edges)
    return _threshold_tree(
        _points(edges), edges.shape[0], r, threshold, max_depth, min_size, max_size, length,
        generator,
    )  # fmt: skip


def _threshold_tree(
    points: Tensor,
    batch: int,
    r: int,
    threshold: int,
    max_depth: int,
    min_size: int,
    max_size: int | None,
    length: int | None,
    generator: torch.Generator | None,
) -> Leaves:
    """:func:`threshold_quadtree` of the edge pixels ``points`` (flat indices, any order)."""
    _check_min_size(min_size, r)
    max_size = _check_max_size(max_size, min_size, r)
    if threshold < 0:
        raise ValueError(f"threshold={threshold} must be >= 0 (an edge-pixel count)")
    codes = _edge_codes(points, r, min_size)
    split = []
    side, depth = r, 0
    while side >= 2 * min_size:
        if side > max_size:  # forced: every node of this level splits
            img, code = _all_nodes(batch, side, r, points.device)
        elif depth < max_depth:
            # Nodes with more than threshold (>= 0) edges all appear among the non-empty
            # ones, and their parents split too (more edges, shallower): the set is a tree.
            img, code, count = _level_nodes(codes, side, r, min_size)
            keep = count > threshold
            img, code = img[keep], code[keep]
        else:
            break
        if img.numel() == 0:
            break
        split.append((side, img, code))
        side, depth = side // 2, depth + 1
    leaves = _leaves_from_split_set(split, batch, r, None)
    if length is None:
        return leaves
    if length < 1:
        raise ValueError(f"length={length} must be >= 1 (or None to pad to the longest row)")
    if leaves.length > length:
        return _drop_to_length(leaves, length, generator)
    return _pad(leaves, length)


def _pad(leaves: Leaves, length: int) -> Leaves:
    extra = length - leaves.length
    if extra == 0:
        return leaves
    pad = lambda t, v: torch.cat([t, torch.full_like(t[:, :1], v).expand(-1, extra)], 1)  # noqa: E731
    return Leaves(
        y=pad(leaves.y, -1),
        x=pad(leaves.x, -1),
        size=pad(leaves.size, 0),
        valid=pad(leaves.valid, False),
        image_size=leaves.image_size,
    )


def fixed_length_quadtree(
    edges: Tensor, length: int, *, min_size: int = 2, max_size: int | None = None
) -> Leaves:
    """Variant B: split the leaf with the most edges until there are exactly ``length`` leaves.

    ``length`` must be 1 mod 3 (each split adds 3 leaves): 64, 196, 256, 385, 1024, 4**k, ...
    Nodes with no edges and nodes of side ``min_size`` are never split; when the image runs
    out of such nodes the row is padded (flagged) up to ``length``. Nodes larger than
    ``max_size`` are split first, whatever their count.

    Equivalent to the greedy loop (see the module docstring) but computed as one ``topk``
    over the counts of the non-empty nodes of all splittable levels, read off the sorted
    Morton codes of the edge pixels: O(edge pixels x levels), nothing of size R^2 beyond
    finding the edge pixels.

    Raises:
        ValueError: bad shape, ``length`` not 1 mod 3, or ``max_size`` forcing more splits
            than ``length`` allows.
    """
    r = _check_edges(edges)
    return _fixed_length_tree(_points(edges), edges.shape[0], r, length, min_size, max_size)


def _fixed_length_tree(
    points: Tensor, batch: int, r: int, length: int, min_size: int, max_size: int | None
) -> Leaves:
    """:func:`fixed_length_quadtree` of the edge pixels ``points`` (flat indices, any order)."""
    _check_min_size(min_size, r)
    if length < 1 or length % 3 != 1:
        near = max(1, length - (length - 1) % 3)
        raise ValueError(
            f"length={length} is not 1 mod 3: every split adds 3 leaves, so a full tree has "
            f"1 + 3k leaves; use length={near} or {near + 3}"
        )
    max_size = _check_max_size(max_size, min_size, r)
    dev = points.device
    sides = [r >> d for d in range(r.bit_length()) if (r >> d) >= 2 * min_size]
    budget = (length - 1) // 3
    forced = sum((r // s) ** 2 for s in sides if s > max_size)
    if forced > budget:
        raise ValueError(
            f"max_size={max_size} forces {forced} splits but length={length} allows only "
            f"{budget}; raise length to >= {1 + 3 * forced} or max_size"
        )
    if not sides or budget == 0:
        return _pad(_leaves_from_split_set([], batch, r, None), length)
    codes = _edge_codes(points, r, min_size)
    forced_value = r * r + 1  # larger than any real count
    imgs, pos, counts, level = [], [], [], []
    offset = 0
    for k, side in enumerate(sides):
        if side > max_size:
            img, code = _all_nodes(batch, side, r, dev)
            count = torch.full_like(code, forced_value)
        else:
            img, code, count = _level_nodes(codes, side, r, min_size)
        imgs.append(img)
        pos.append(offset + code)  # position in the concatenation of all levels' grids
        counts.append(count)
        level.append(torch.full_like(code, k))
        offset += (r // side) ** 2
    img, p, count, lvl = (torch.cat(t) for t in (imgs, pos, counts, level))
    bits = max(1, (offset - 1).bit_length())
    # Ties broken by position: shallower level first, then Morton order (as the greedy loop).
    key = (count << bits) | (offset - 1 - p)
    # One row of keys per image (padded with -1), then one topk per row.
    order = torch.argsort(img, stable=True)
    img, key, p, lvl = img[order], key[order], p[order], lvl[order]
    per = torch.bincount(img, minlength=batch)
    width = max(int(per.max()) if per.numel() else 0, 1)
    slot = torch.arange(img.numel(), device=dev) - (torch.cumsum(per, 0) - per)[img]
    rows = torch.full((batch, width), -1, dtype=torch.long, device=dev)
    rows[img, slot] = key
    top = torch.topk(rows, min(budget, width), dim=1)
    take = (top.values >> bits) > 0  # a positive count (padding and empty nodes never split)
    bi = torch.arange(batch, device=dev).unsqueeze(1).expand_as(top.indices)[take]
    flat = bi * width + top.indices[take]
    owner = torch.full((batch * width,), -1, dtype=torch.long, device=dev)
    owner[img * width + slot] = torch.arange(img.numel(), device=dev)
    chosen = owner[flat]
    starts = [0] + [(r // s) ** 2 for s in sides]
    bases = torch.tensor(starts, device=dev).cumsum(0)
    split = []
    for k, side in enumerate(sides):
        sel = chosen[lvl[chosen] == k]
        if sel.numel():
            split.append((side, img[sel], p[sel] - bases[k]))
    return _leaves_from_split_set(split, batch, r, length)


@functools.lru_cache(maxsize=32)
def _uniform_cache(r: int, side: int, device: torch.device) -> tuple[Tensor, Tensor]:
    n = r // side
    perm = _morton_perm(n, device)
    return (perm // n) * side, (perm % n) * side


def uniform_leaves(
    batch: int, image_size: int, side: int, device: torch.device | None = None
) -> Leaves:
    """The uniform grid of ``side`` x ``side`` squares as :class:`Leaves`, in Morton order."""
    if side < 1 or side & (side - 1) or image_size % side:
        raise ValueError(f"side={side} must be a power of two dividing image_size={image_size}")
    y, x = _uniform_cache(image_size, side, torch.device(device or "cpu"))
    shape = (batch, y.numel())
    return Leaves(
        y=y.expand(shape).clone(),
        x=x.expand(shape).clone(),
        size=torch.full(shape, side, dtype=torch.long, device=y.device),
        valid=torch.ones(shape, dtype=torch.bool, device=y.device),
        image_size=image_size,
    )
