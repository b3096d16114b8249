"""benchmarks/rlhf.py without running it: argument checks and the two reward functions.

The benchmark itself takes minutes (two spawned worlds, TRL) and checks its own premises
(equal tokens, full-length answers) as it runs; these checks import no model code.
"""

from __future__ import annotations

import pytest

from benchmarks.rlhf import (
    KEYWORD,
    Options,
    keyword_reward,
    keyword_reward_text,
    parse_args,
    report_trl,
)


def test_defaults_parse_and_every_part_is_selected() -> None:
    opts, parts, json_path = parse_args([])
    assert opts == Options()
    assert parts == {"a", "b", "c"}
    assert json_path is None
    opts, parts, _ = parse_args(["--parts", "a,c", "--new-tokens", "8", "--kl-coef", "0"])
    assert parts == {"a", "c"} and opts.new_tokens == 8 and opts.kl_coef == 0.0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--parts", "a,d"], "--parts='a,d'"),
        (["--parts", ""], "--parts=''"),
        (["--group", "1"], "--group=1"),
        (["--steps", "0"], "--steps=0"),
        (["--hidden", "120"], "--hidden=120"),
        (["--warmup", "-1"], "--warmup=-1"),
        (["--eos-weight", "-1"], "--eos-weight=-1"),
    ],
)
def test_bad_arguments_exit_with_the_flag_named(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_the_two_reward_functions_agree() -> None:
    """slipstream scores token ids, TRL decoded words; the rule must be the same."""
    answers = [[KEYWORD, 9], [9, 10], [10, KEYWORD + 10]]
    texts = [" ".join(f"w{t}" for t in a) for a in answers]
    assert keyword_reward([], answers) == keyword_reward_text([], texts) == [1.0, 0.0, 0.0]


def test_the_grpo_report_compares_both_rollouts_with_trl() -> None:
    """(b)'s table from recorded steps: paged and static rollouts, each over TRL."""
    step = {"step_s": 1.0, "cpu_s": 0.9, "response_length": 20.0, "cpu_generate_s": 0.4}
    step |= {"cpu_score_s": 0.1, "cpu_train_s": 0.4}
    trl_phase = {"cpu_generate_s": 2.0, "cpu_score_s": 0.5, "cpu_train_s": 1.1}
    result = {
        "grpo": [dict(step, step_s=1.0)] * 3,
        "grpo_static": [dict(step, step_s=2.0)] * 3,
        "trl_s": [4.0] * 3,
        "trl_cpu_s": [3.6] * 3,
        "trl_version": "x",
        "trl_mean_length": [20.0],
        "trl_phases": [dict(trl_phase, cpu_optimizer_s=0.2)] * 3,
    }
    lines = report_trl(Options(eos_weight=0.9, group=8), result)
    phases = {line.split()[0]: line for line in lines if line.startswith("  ")}
    assert phases["slipstream"].split()[2:] == ["0.400", "/", "0.100", "/", "0.400"]
    assert phases["trl"].split()[1:6] == ["2.000", "/", "0.500", "/", "1.100"]
    assert "optimizer 0.200" in phases["trl"]
    paged = next(line for line in lines if line.startswith("slipstream paged"))
    static = next(line for line in lines if line.startswith("slipstream static"))
    assert paged.split()[2:4] == ["1.000", "0.900"] and paged.split()[4] == "0.25"
    assert static.split()[4] == "0.50"
    assert "ragged answers (eos weight 0.9)" in lines[0]
