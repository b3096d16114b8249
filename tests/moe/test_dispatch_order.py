"""The dispatch's row orders, checked against their definitions (no process group needed):
choices sorted by expert with dropped ones left out, and the received rows regrouped from
(source rank, local expert) blocks to (local expert, source rank) blocks and back."""

from __future__ import annotations

import torch

from slipstream.moe.dispatch import _blocks_in_order, group_by_expert


def test_group_by_expert_is_a_stable_sort_of_the_kept_choices() -> None:
    """Every kept (token, choice) once, by expert, ties in (choice, token) order; dropped
    choices (-1) left out; counts per expert."""
    gen = torch.Generator().manual_seed(0)
    for k, s, experts in ((1, 7, 3), (2, 33, 8), (3, 20, 5), (2, 4, 6)):
        routed = torch.randint(-1, experts, (k, s), generator=gen)
        weights = torch.rand(k, s, generator=gen)
        g = group_by_expert(routed, weights, experts)
        want = sorted(
            (int(routed[c, t]), c, t) for c in range(k) for t in range(s) if routed[c, t] >= 0
        )
        assert g.tokens.tolist() == [t for _, _, t in want]
        assert torch.equal(g.weights, torch.tensor([float(weights[c, t]) for _, c, t in want]))
        assert g.counts.tolist() == [sum(e == x for x, _, _ in want) for e in range(experts)]
    g = group_by_expert(torch.full((2, 5), -1), torch.rand(2, 5), 4)
    assert g.tokens.numel() == 0 and g.counts.tolist() == [0, 0, 0, 0]


def test_blocks_regroup_by_expert_and_back() -> None:
    """4 source ranks x 3 local experts, empty blocks included: rank-major blocks come out
    expert-major, and the reverse restores the rows."""
    sizes = [[2, 0, 1], [0, 0, 3], [1, 2, 0], [0, 1, 1]]
    rows = torch.arange(sum(map(sum, sizes)), dtype=torch.float32).unsqueeze(1)
    starts, at = {}, 0
    for r, row in enumerate(sizes):
        for e, n in enumerate(row):
            starts[r, e] = at
            at += n
    want = [starts[r, e] + i for e in range(3) for r in range(4) for i in range(sizes[r][e])]
    by_expert = _blocks_in_order(rows, sizes, True)
    assert by_expert.squeeze(1).tolist() == want
    assert torch.equal(_blocks_in_order(by_expert, sizes, False), rows)
