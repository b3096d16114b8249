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
