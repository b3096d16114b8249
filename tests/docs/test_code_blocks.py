"""Every ```python block of README.md and docs/ runs as written (markers: docs/development.md)."""

from __future__ import annotations

import multiprocessing
import socket
import time
from pathlib import Path

import pytest

from tests.distributed.harness import FORKSERVER_PRELOAD
from tests.docs._blocks import Block, doc_files, parse_blocks, run_rank, script_for

TIMEOUT_S = 120.0  # per block; a hung block is killed and fails

BLOCKS = {path: parse_blocks(path) for path in doc_files()}
CASES = [(path, k) for path, blocks in BLOCKS.items() for k in range(len(blocks))]


@pytest.fixture(scope="module")
def forkserver() -> multiprocessing.context.BaseContext:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(FORKSERVER_PRELOAD)
    return ctx


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_env(rank: int, nproc: int, port: int) -> dict[str, str]:
    """What ``slipstream run --nproc N`` sets for a rank (none of it for a plain process)."""
    if nproc == 1:
        return {}
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(nproc),
        "LOCAL_WORLD_SIZE": str(nproc),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "SLIPSTREAM_COMM_TIMEOUT": "60",
    }


def _run(ctx: multiprocessing.context.BaseContext, block: Block, script: str, cwd: Path) -> None:
    path = cwd / "block.py"
    path.write_text(script)
    port = _free_port()
    logs = [cwd / f"rank{r}.log" for r in range(block.nproc)]
    procs = [
        ctx.Process(  # type: ignore[attr-defined]
            target=run_rank, args=(str(path), str(cwd), _rank_env(r, block.nproc, port), str(log))
        )
        for r, log in enumerate(logs)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + TIMEOUT_S
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    output = "\n".join(f"--- rank {r}\n{log.read_text()[-3000:]}" for r, log in enumerate(logs))
    assert not hung, f"{block.id}: ranks {hung} still running after {TIMEOUT_S:.0f} s\n{output}"
    codes = [p.exitcode for p in procs]
    assert codes == [0] * block.nproc, f"{block.id}: exit codes {codes}\n{output}"


@pytest.mark.parametrize(("path", "k"), CASES, ids=[BLOCKS[path][k].id for path, k in CASES])
def test_code_block_runs(forkserver, tmp_path, path: Path, k: int) -> None:
    blocks = BLOCKS[path]
    block = blocks[k]
    if block.skip_reason is not None:
        pytest.skip(f"marked no-test: {block.skip_reason}")
    _run(forkserver, block, script_for(blocks, k), tmp_path)


def test_markers_are_few_and_explained() -> None:
    skipped = [b.id for blocks in BLOCKS.values() for b in blocks if b.skip_reason]
    total = sum(len(blocks) for blocks in BLOCKS.values())
    assert total >= 20, f"only {total} python blocks found in {len(BLOCKS)} files"
    assert len(skipped) <= 3, f"too many blocks marked no-test: {skipped}"


def test_a_typo_in_a_marker_is_an_error(tmp_path) -> None:
    page = tmp_path / "page.md"
    page.write_text("<!-- test: nprocs=2 -->\n```python\nprint(1)\n```\n")
    with pytest.raises(ValueError, match="unknown test option 'nprocs=2'"):
        parse_blocks(page)
    page.write_text("<!-- no-test -->\n```python\nprint(1)\n```\n")
    with pytest.raises(ValueError, match="malformed marker"):
        parse_blocks(page)
