"""The planner against published large-scale runs: the validation table of docs/planner.md.

    python benchmarks/planner_validation.py               # print the tables
    python benchmarks/planner_validation.py --write-docs  # also rewrite them in docs/planner.md
    python benchmarks/planner_validation.py --no-ranks    # skip the (slower) searches

Every number in the tables is computed here from ``slipstream.planner`` and the published
values below; none is typed into the docs by hand (tests/planner/test_validation.py checks that
the docs hold what this script computes). The hardware profiles are used as shipped: no
constant is fitted to these rows.

Published values:

- Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
  Table 5: iteration times on A100 80GB (DGX A100 / Selene), full recompute and
  selective recompute + sequence parallelism. Layouts as in the open-source Calculon
  validation set (``calculon-ai/calculon``, ``validation/*.json``): TP 8, micro-batch 1
  (4 for 22B without a pipeline), batch = GPU count (4 for 22B), interleaving 3 for 175B and
  530B.
- Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
  Megatron-LM", Table 1: the 1T model on 3072 A100s, TP 8, PP 64, batch 3072, 502 PFLOP/s
  aggregate (163 TFLOP/s, 52% of peak per GPU). Micro-batch 1 and the plain 1F1B schedule
  are assumptions (the table does not give them).
- Dash et al. 2023, "Optimizing Distributed Training on Frontier for Large Language Models":
  38.38% / 36.14% / 31.96% of peak for 22B / 175B / 1T, weak scaling 100%, strong scaling 89%
  (175B) and 87% (1T). The paper's layouts, GCD counts and batch sizes were not available
  (specs/parallelism.md sec. 4.4 marks them unconfirmed), so those rows use stated assumptions
  (ZeRO-1, full recompute, the paper's search space TP/PP/micro-batch) and are checks, not
  reproductions.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from slipstream.planner import Hardware, Layout, load_hardware, model_preset, predict
from slipstream.planner.search import search

DOCS = Path(__file__).resolve().parents[1] / "docs" / "planner.md"
KORTHIKANTI_TOLERANCE = 15.0  # percent, from the issue


@dataclass(frozen=True)
class Row:
    """One published number and the planner's prediction of it."""

    source: str
    what: str
    layout: str
    published: float
    predicted: float
    unit: str
    note: str = ""

    @property
    def error_percent(self) -> float:
        return 100.0 * (self.predicted - self.published) / self.published


def _describe(layout: Layout) -> str:
    sp = " SP" if layout.sequence_parallel else ""
    v = f" v{layout.virtual_stages}" if layout.virtual_stages > 1 else ""
    return (
        f"TP{layout.tp} PP{layout.pp}{v} DP{layout.dp} mb{layout.micro_batch} "
        f"B{layout.batch} ZeRO-{layout.zero_stage} {layout.recompute}{sp}"
    )


# (preset, pp, batch, micro_batch, virtual stages, full-recompute s, selective+SP s)
KORTHIKANTI = [
    ("megatron-22b", 1, 4, 4, 1, 1.42, 1.10),
    ("gpt3-175b", 8, 64, 1, 3, 18.13, 13.75),
    ("mt-nlg-530b", 35, 280, 1, 3, 49.05, 37.83),
    ("megatron-1t", 64, 512, 1, 1, 94.42, 71.49),
]


def korthikanti_layouts() -> list[tuple[str, Layout, float]]:
    """(preset, layout, published seconds) of Korthikanti et al. 2022, Table 5."""
    rows = []
    for preset, pp, batch, mb, v, full_s, seqsel_s in KORTHIKANTI:
        base = Layout(tp=8, pp=pp, dp=1, virtual_stages=v, micro_batch=mb, global_batch=batch)
        rows.append((preset, replace(base, recompute="full"), full_s))
        rows.append(
            (preset, replace(base, recompute="selective", sequence_parallel=True), seqsel_s)
        )
    return rows


def korthikanti_rows(a100: Hardware) -> list[Row]:
    rows = []
    for preset, layout, seconds in korthikanti_layouts():
        p = predict(model_preset(preset), a100, layout)
        rows.append(
            Row(
                "Korthikanti 2022 T5",
                f"{preset} iteration",
                _describe(layout),
                seconds,
                p.step_time_s,
                "s",
            )
        )
    return rows


NARAYANAN_LAYOUT = Layout(tp=8, pp=64, dp=6, micro_batch=1, global_batch=3072, recompute="full")


def narayanan_rows(a100: Hardware) -> list[Row]:
    p = predict(model_preset("megatron-1t"), a100, NARAYANAN_LAYOUT)
    aggregate = p.tflops_per_device * NARAYANAN_LAYOUT.world / 1e3
    layout = _describe(NARAYANAN_LAYOUT)
    return [
        Row("Narayanan 2021 T1", "1T on 3072 A100, aggregate", layout, 502.0, aggregate,
            "PFLOP/s", "mb1 and 1F1B assumed"),
        Row("Narayanan 2021 T1", "1T on 3072 A100, % of peak", layout, 52.0,
            p.percent_of_peak, "%", "mb1 and 1F1B assumed"),
    ]  # fmt: skip


# Frontier assumptions (the paper's tables are unconfirmed): scale, batch, search space.
FRONTIER_RUNS = [("frontier-22b", 64, 38.38), ("frontier-175b", 1024, 36.14),
                 ("frontier-1t", 3072, 31.96)]  # fmt: skip
FRONTIER_SPACE = {"zero_stage": 1, "recompute": "full", "virtual_stages": 1}


def frontier_best(preset: str, gcds: int, hw: Hardware) -> Layout:
    """The planner's fastest layout in the paper's space at ``gcds`` GCDs and batch = GCDs."""
    ranked = search(model_preset(preset), hw, gcds, gcds, FRONTIER_SPACE, top=1).ranked
    return ranked[0].layout


def _per_device(preset: str, hw: Hardware, layout: Layout) -> float:
    return predict(model_preset(preset), hw, layout).tflops_per_device


def frontier_rows(hw: Hardware) -> list[Row]:
    rows = []
    for preset, gcds, percent in FRONTIER_RUNS:
        layout = frontier_best(preset, gcds, hw)
        p = predict(model_preset(preset), hw, layout)
        rows.append(
            Row("Dash 2023", f"{preset} % of peak, {gcds} GCDs", _describe(layout), percent,
                p.percent_of_peak, "%", "best ZeRO-1 layout, batch = GCDs (assumed)")
        )  # fmt: skip
    rows += _scaling_rows(hw)
    return rows


def _scaling_rows(hw: Hardware) -> list[Row]:
    """Weak scaling (batch grows with DP) and strong scaling (fixed batch) efficiencies of
    fixed TP/PP layouts: 175B TP8 PP16 (tiles 1024 GCDs), 1T TP8 PP64 (tiles 3072)."""
    rows = []
    cases = [("frontier-175b", 16, 1, 8, 100.0, 89.0, 4), ("frontier-1t", 64, 1, 6, 100.0, 87.0, 3)]
    for preset, pp, dp0, dp1, weak_pub, strong_pub, strong_dp0 in cases:
        base = Layout(tp=8, pp=pp, micro_batch=1, zero_stage=1, recompute="full")
        per_replica = 8 * pp  # micro-batches per pipeline per step: 8 p
        small = replace(base, dp=dp0, global_batch=per_replica * dp0)
        large = replace(base, dp=dp1, global_batch=per_replica * dp1)
        weak = 100 * _per_device(preset, hw, large) / _per_device(preset, hw, small)
        rows.append(Row("Dash 2023", f"{preset} weak scaling {small.world}->{large.world}",
                        f"TP8 PP{pp}, {per_replica} seqs per replica", weak_pub, weak, "%",
                        "layout and batch assumed"))  # fmt: skip
        fixed = per_replica * dp1
        a = replace(base, dp=strong_dp0, global_batch=fixed)
        b = replace(base, dp=dp1, global_batch=fixed)
        strong = 100 * _per_device(preset, hw, b) / _per_device(preset, hw, a)
        rows.append(Row("Dash 2023", f"{preset} strong scaling {a.world}->{b.world}",
                        f"TP8 PP{pp}, batch {fixed}", strong_pub, strong, "%",
                        "layout and batch assumed"))  # fmt: skip
    return rows


def all_rows() -> list[Row]:
    a100, frontier = load_hardware("dgx-a100-80gb"), load_hardware("frontier-mi250x")
    return korthikanti_rows(a100) + narayanan_rows(a100) + frontier_rows(frontier)


def format_rows(rows: list[Row]) -> str:
    lines = [
        "| source | quantity | layout | published | predicted | error | note |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.source} | {r.what} | {r.layout} | {r.published:g} {r.unit} | "
            f"{r.predicted:.2f} {r.unit} | {r.error_percent:+.1f}% | {r.note} |"
        )
    return "\n".join(lines)


def rank_rows() -> str:
    """Where the planner ranks each published layout among every layout that fits."""
    a100 = load_hardware("dgx-a100-80gb")
    cases = [(name, lay, a100) for name, lay, _ in korthikanti_layouts()[1::2]]
    cases.append(("megatron-1t", NARAYANAN_LAYOUT, a100))
    lines = ["| model | published layout | its rank | planner's first | published step / first |",
             "|---|---|---|---|---|"]  # fmt: skip
    for preset, layout, hw in cases:
        model = model_preset(preset)
        result = search(model, hw, layout.world, layout.batch)
        ranked = result.ranked
        keys = [_describe(p.layout) for p in ranked]
        mine = predict(model, hw, layout)
        rank = keys.index(_describe(layout)) + 1 if _describe(layout) in keys else None
        first = ranked[0]
        where = f"{rank} of {len(ranked)}" if rank else f"not among the {len(ranked)} that fit"
        lines.append(
            f"| {preset} | {_describe(layout)} | {where} | {_describe(first.layout)} | "
            f"{mine.step_time_s / first.step_time_s:.2f}x |"
        )
    return "\n".join(lines)


def _replace_block(text: str, name: str, body: str) -> str:
    pattern = re.compile(rf"(<!-- {name}:start -->\n).*?(<!-- {name}:end -->)", re.S)
    if not pattern.search(text):
        raise SystemExit(f"docs/planner.md has no <!-- {name}:start/end --> block")
    return pattern.sub(lambda m: m.group(1) + body + "\n" + m.group(2), text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write-docs", action="store_true", help="rewrite docs/planner.md")
    parser.add_argument("--no-ranks", action="store_true", help="skip the searches")
    args = parser.parse_args(argv)
    table = format_rows(all_rows())
    print(table)
    ranks = None if args.no_ranks else rank_rows()
    if ranks:
        print("\n" + ranks)
    if args.write_docs:
        text = _replace_block(DOCS.read_text(), "validation", table)
        if ranks:
            text = _replace_block(text, "ranks", ranks)
        DOCS.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
