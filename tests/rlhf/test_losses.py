"""RLHF losses and estimators equal hand-computed values on made-up tensors (spec 3.2, 3.5)."""

from __future__ import annotations

import math

import pytest
import torch

from slipstream.rlhf import advantages as adv
from slipstream.rlhf import losses


def logsig(x: float) -> float:
    return -math.log1p(math.exp(-x))


def test_reward_model_loss_is_per_token_over_the_divergent_suffix():
    """Pair 0 diverges at 2 and ends at max(4, 3): loss over positions 2 and 3; pair 1 is
    identical (last position only); scores at each sequence's last non-pad token."""
    chosen_ids = torch.tensor([[5, 6, 7, 8, 0], [5, 6, 7, 0, 0]])
    rejected_ids = torch.tensor([[5, 6, 9, 0, 0], [5, 6, 7, 0, 0]])
    rc = torch.tensor([[0.1, 0.2, 1.0, 2.0, 9.0], [0.0, 0.0, 0.3, 0.0, 1.5]])
    rr = torch.tensor([[0.1, 0.2, 0.5, 3.0, -9.0], [0.0, 0.0, 0.7, 0.0, 0.5]])
    out = losses.reward_model_loss(rc, rr, chosen_ids, rejected_ids, pad_token_id=0)
    pair0 = -(logsig(1.0 - 0.5) + logsig(2.0 - 3.0)) / 2
    pair1 = -logsig(1.5 - 0.5)
    assert out.loss.item() == pytest.approx((pair0 + pair1) / 2, rel=1e-6)
    assert out.chosen_scores.tolist() == pytest.approx([2.0, 0.3])
    assert out.rejected_scores.tolist() == pytest.approx([0.5, 0.7])
    assert out.accuracy.item() == 0.5


def test_reward_model_loss_skips_opt_leading_pad_and_backpropagates():
    """OPT's first token equals its pad id: num_padding_at_beginning=1 skips it."""
    ids_c = torch.tensor([[0, 5, 6, 0, 0]])
    ids_r = torch.tensor([[0, 5, 7, 8, 0]])
    rc = torch.tensor([[0.0, 0.0, 1.0, 4.0, 4.0]], requires_grad=True)
    rr = torch.tensor([[0.0, 0.0, 2.0, 1.0, 4.0]])
    out = losses.reward_model_loss(rc, rr, ids_c, ids_r, 0, num_padding_at_beginning=1)
    # diverges at 2, ends 3 and 4 -> positions 2, 3; scores rc[2] and rr[3]
    assert out.loss.item() == pytest.approx(-(logsig(-1.0) + logsig(3.0)) / 2, rel=1e-6)
    assert (out.chosen_scores.item(), out.rejected_scores.item()) == (1.0, 1.0)
    out.loss.backward()
    assert rc.grad is not None and rc.grad[0, 4] == 0 and rc.grad[0, 2] != 0


def test_token_logprobs_match_a_manual_log_softmax():
    logits = torch.tensor([[[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]]])
    got = losses.token_logprobs(logits, torch.tensor([[2, 1]]))
    z = math.log(math.exp(1) + math.exp(2) + math.exp(3))
    assert got.tolist()[0] == pytest.approx([3.0 - z, -math.log(3.0)], rel=1e-6)


# ----------------------------------------------------------------- per-token rewards
LP = torch.tensor([[-1.0, -2.0, -0.5, -1.5, -0.2, -3.0], [-1.0, -1.0, -1.0, -2.0, -0.5, -0.1]])
REF = torch.tensor([[-1.0, -1.0, -1.0, -1.0, -1.0, -1.0], [-2.0, -2.0, -2.0, -2.0, -2.0, -2.0]])
# prompt P = 3 -> start = 2; row 0: 2 answer tokens (end 5), row 1: 4 (end 7, past the row)
MASK = torch.tensor([[1, 1, 1, 1, 0, 0], [0, 1, 1, 1, 1, 1]])


def test_kl_shaped_rewards_fold_kl_and_clip_the_score_at_end_minus_one():
    rewards, ends = adv.kl_shaped_rewards(LP, REF, torch.tensor([7.0, -2.0]), MASK, start=2)
    assert ends.tolist() == [5, 7]
    expected = [[-0.1 * (a - b) for a, b in zip(r, f)] for r, f in zip(LP.tolist(), REF.tolist())]
    expected[0][4] += 5.0  # clip(7, -5, 5) at end - 1 = 4
    expected[0][5] = 0.0  # t >= end
    expected[1][5] += -2.0  # end 7 runs past the row: the last position
    for got_row, want_row in zip(rewards.tolist(), expected):
        assert got_row == pytest.approx(want_row, abs=1e-6)


def test_actor_equal_to_reference_leaves_only_the_clipped_score():
    """Spec 3.5 (a): logp = logp_ref -> KL terms 0, reward only at end - 1, zero after."""
    rewards, _ = adv.kl_shaped_rewards(LP, LP.clone(), torch.tensor([-9.0, 3.0]), MASK, start=2)
    want = torch.zeros(2, 6)
    want[0, 4], want[1, 5] = -5.0, 3.0
    assert torch.equal(rewards, want)


# ----------------------------------------------------------------------------- GAE
def naive_gae(values, rewards, start, gamma, lam):
    adv_rows, ret_rows = [], []
    for v, r in zip(values, rewards):
        a, out = 0.0, []
        for t in reversed(range(start, len(r))):
            nxt = v[t + 1] if t + 1 < len(v) else 0.0
            a = r[t] + gamma * nxt - v[t] + gamma * lam * a
            out.append(a)
        out.reverse()
        adv_rows.append(out)
        ret_rows.append([x + v[start + i] for i, x in enumerate(out)])
    return adv_rows, ret_rows


def test_gae_matches_a_scalar_loop():
    values = [[0.5, 0.1, -0.3, 0.8, 0.2], [1.0, 0.0, 0.4, -0.6, 0.3]]
    rewards = [[0.0, 0.2, -0.1, 1.0, 0.0], [0.3, -0.2, 0.0, 0.0, 2.0]]
    a, g = adv.gae_advantages_and_returns(torch.tensor(values), torch.tensor(rewards), start=1)
    want_a, want_g = naive_gae(values, rewards, 1, 1.0, 0.95)
    assert a.shape == (2, 4)
    for got, want in zip(a.tolist() + g.tolist(), want_a + want_g):
        assert got == pytest.approx(want, abs=1e-6)


def test_gae_with_gamma_lambda_one_returns_the_reward_to_go():
    """Spec 3.5 (b): gamma = lambda = 1 gives Monte-Carlo returns sum_{k >= t} r_k."""
    rewards = torch.tensor([[0.0, 1.0, -2.0, 0.5, 3.0]])
    values = torch.tensor([[9.0, -4.0, 2.0, 0.7, 1.1]])
    _, returns = adv.gae_advantages_and_returns(values, rewards, start=0, gamma=1.0, lam=1.0)
    assert returns[0].tolist() == pytest.approx([2.5, 2.5, 1.5, 3.5, 3.0], abs=1e-6)


# ----------------------------------------------------------------- actor and critic
def test_actor_loss_clips_the_ratio_and_ignores_masked_tokens():
    old = torch.zeros(1, 3)
    new = torch.tensor([[math.log(1.5), math.log(0.9), 5.0]])
    advantages = torch.tensor([[1.0, -2.0, 3.0]])
    loss = losses.ppo_actor_loss(new, old, advantages, torch.tensor([[1.0, 1.0, 0.0]]))
    # token 0: max(-1.5, -1.2) = -1.2; token 1: max(1.8, 1.8) = 1.8; token 2 masked
    assert loss.item() == pytest.approx((-1.2 + 1.8) / 2, rel=1e-6)


def test_actor_loss_inside_the_clip_range_is_minus_mean_advantage_times_ratio():
    """Spec 3.5 (c)."""
    old = torch.zeros(2, 2)
    new = torch.log(torch.tensor([[0.85, 1.1], [1.19, 0.95]]))
    a = torch.tensor([[2.0, -1.0], [0.5, 3.0]])
    loss = losses.ppo_actor_loss(new, old, a, torch.ones(2, 2))
    assert loss.item() == pytest.approx(-(1.7 - 1.1 + 0.595 + 2.85) / 4, rel=1e-5)


def test_critic_loss_clips_values_around_the_old_ones():
    values = torch.tensor([[1.0, 0.0, 2.0]])
    old = torch.tensor([[0.5, 0.1, 0.0]])
    returns = torch.tensor([[0.0, 1.0, 5.0]])
    loss = losses.ppo_critic_loss(values, old, returns, torch.ones(1, 3))
    # max(1, 0.49) = 1; 1; max(9, (0.2 - 5)^2 = 23.04)
    assert loss.item() == pytest.approx(0.5 * (1 + 1 + 23.04) / 3, rel=1e-6)


def test_critic_loss_near_the_old_values_is_half_the_mse():
    """Spec 3.5 (d)."""
    values = torch.tensor([[1.0, 2.1, -0.5]])
    old = torch.tensor([[0.9, 2.0, -0.4]])
    returns = torch.tensor([[0.0, 2.0, 1.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss = losses.ppo_critic_loss(values, old, returns, mask)
    assert loss.item() == pytest.approx(0.5 * (1.0 + 0.01) / 2, rel=1e-5)


# ------------------------------------------------------------------ group estimators
def test_grpo_advantages_normalize_within_each_group():
    got = adv.grpo_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0]), 4)
    std = math.sqrt(4 * 0.25 / 3)  # sample std of [1, 0, 0, 1]
    a = 0.5 / (std + 1e-4)
    assert got.tolist() == pytest.approx([a, -a, -a, a, 0.0, 0.0, 0.0, 0.0], rel=1e-6)


def test_rloo_advantages_subtract_the_mean_of_the_others():
    got = adv.rloo_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0, 3.0, 0.0]), 3)
    # group [1, 0, 0]: 1 - 0, 0 - 0.5, 0 - 0.5; group [1, 3, 0]: 1 - 1.5, 3 - 0.5, 0 - 2
    assert got.tolist() == pytest.approx([1.0, -0.5, -0.5, -0.5, 2.5, -2.0], abs=1e-6)


@pytest.mark.parametrize("fn", [adv.grpo_advantages, adv.rloo_advantages])
def test_group_estimators_refuse_bad_groups(fn):
    with pytest.raises(ValueError, match="group_size=4"):
        fn(torch.zeros(6), 4)
    with pytest.raises(ValueError, match="group_size must be >= 2"):
        fn(torch.zeros(6), 1)


def test_k3_kl_is_zero_at_equality_and_matches_its_formula():
    lp = torch.tensor([-1.0, -2.0])
    ref = torch.tensor([-1.0, -1.5])
    got = adv.k3_kl(lp, ref).tolist()
    assert got == pytest.approx([0.0, math.exp(0.5) - 0.5 - 1.0], abs=1e-7)


def test_dpo_loss_matches_its_formula():
    pc, pr = torch.tensor([-3.0, -5.0]), torch.tensor([-4.0, -4.0])
    rc, rr = torch.tensor([-3.5, -5.0]), torch.tensor([-3.0, -4.5])
    out = losses.dpo_loss(pc, pr, rc, rr, beta=0.5)
    m0 = 0.5 * ((-3.0 + 3.5) - (-4.0 + 3.0))  # 0.75
    m1 = 0.5 * ((-5.0 + 5.0) - (-4.0 + 4.5))  # -0.25
    assert out.loss.item() == pytest.approx(-(logsig(m0) + logsig(m1)) / 2, rel=1e-6)
    assert out.chosen_rewards.tolist() == pytest.approx([0.25, 0.0])
    assert out.accuracy.item() == 0.5


def test_ema_update_is_the_lerp_with_0992():
    """Spec 3.5 (f): theta_ema <- 0.992 theta_ema + 0.008 theta."""
    ema, theta = [torch.tensor([1.0, -2.0])], [torch.tensor([3.0, 0.0])]
    adv.ema_update_(ema, theta)
    assert ema[0].tolist() == pytest.approx([0.992 + 0.024, -1.984], abs=1e-6)
