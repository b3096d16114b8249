"""Smoke test of benchmarks/serve.py: ``--quick`` in this process, every row on one trace."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("transformers")

from benchmarks.serve import make_trace, parse_args, run


def test_quick_trace_is_seeded_and_every_row_reports_the_same_greedy_tokens(capsys) -> None:
    """The seeded trace repeats; static and HF rows give finite figures and identical
    tokens (exactly each request's answer length); the continuous row runs or says why not."""
    args = parse_args(["--quick"])
    assert make_trace(args, 1024) == make_trace(args, 1024)
    results = run(args)
    out = capsys.readouterr().out
    static, hf, continuous = results
    assert (static.name, hf.name, continuous.name) == ("static", "hf-generate", "continuous")
    trace = make_trace(args, 1024)
    for r in (static, hf) if continuous.error else results:
        assert {k: len(v) for k, v in r.tokens.items()} == {
            q.request_id: q.new_tokens for q in trace
        }
        assert r.tokens == static.tokens, r.name
        assert math.isfinite(r.tokens_per_s) and r.tokens_per_s > 0
        assert 0 <= r.latency_ms(0.5) <= r.latency_ms(0.99)
    assert "x static" in out and "8/8" in out
    if continuous.error:
        assert "not available" in out


def test_repeats_report_medians_and_spread(capsys) -> None:
    """``--repeats 2`` replays the trace twice per row and prints medians with their spread;
    every replay's tokens equal the first static replay's."""
    run(parse_args(["--quick", "--repeats", "2"]))
    out = capsys.readouterr().out
    assert "2 replays: medians (min-max)" in out
    rows = [line for line in out.splitlines() if line.startswith(("static", "hf-", "contin"))]
    assert len(rows) == 3 and all(line.endswith("8/8") for line in rows), out
