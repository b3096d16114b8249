"""`slipstream --help` and every subcommand's help read as plain text (no reST markup)."""

from __future__ import annotations

import re

import pytest

from slipstream.cli.main import main, plain_text

MARKUP = re.compile(r"``|:[a-z]+:`|`[^`\s][^`]*`")


def test_plain_text_drops_roles_and_literals():
    doc = "``slipstream run``: see :mod:`slipstream.cli._multinode` and :func:`~a.b` (`x`)."
    assert plain_text(doc) == "slipstream run: see slipstream.cli._multinode and a.b (x)."


@pytest.mark.parametrize(
    "command", [[], ["run"], ["report"], ["convert"], ["quant"], ["plot"], ["demo"], ["chat"]]
)
def test_help_has_no_restructuredtext(command, capsys):
    with pytest.raises(SystemExit) as done:
        main([*command, "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: slipstream")
    assert MARKUP.search(out) is None, MARKUP.search(out)


def test_run_help_documents_the_comm_timeout_and_failure_report(capsys):
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--comm_timeout SECONDS" in out
    assert (
        "A collective that waits longer than SLIPSTREAM_COMM_TIMEOUT seconds (default 600;" in out
    )
    assert "listed after it as secondary" in out
