"""Writes this rank's launcher-visible facts to OUT_DIR/rank<RANK>.json (argv: OUT_DIR ...)."""

import argparse
import json
import os
import sys

ENV_KEYS = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE",
    "OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES", "MASTER_ADDR", "MASTER_PORT",
    "SLIPSTREAM_TEST_MARK",
)  # fmt: skip


def dump_facts(out_dir: str, local_rank: int | None, extra: str | None = None) -> None:
    facts = {
        "name": __name__ if __name__ == "__main__" else sys.modules["__main__"].__name__,
        "argv": sys.argv,
        "local_rank_arg": local_rank,
        "extra": extra,
        "env": {k: os.environ.get(k) for k in ENV_KEYS},
        "sys_path0": sys.path[0],
    }
    with open(os.path.join(out_dir, f"rank{os.environ['RANK']}.json"), "w") as fp:
        json.dump(facts, fp)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("--local_rank", type=int, default=None)
    parser.add_argument("--extra", default=None)
    args = parser.parse_args()
    dump_facts(args.out_dir, args.local_rank, args.extra)
