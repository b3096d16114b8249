"""Writes this rank's launcher-visible facts to OUT_DIR/rank<RANK>.json (argv: OUT_DIR ...)."""

import argparse
import json
import os
import sys

parser = argparse.ArgumentParser()
parser.add_argument("out_dir")
parser.add_argument("--local_rank", type=int, default=None)
parser.add_argument("--extra", default=None)
args = parser.parse_args()
facts = {
    "name": __name__,
    "argv": sys.argv,
    "local_rank_arg": args.local_rank,
    "extra": args.extra,
    "env": {
        k: os.environ.get(k)
        for k in (
            "RANK",
            "LOCAL_RANK",
            "WORLD_SIZE",
            "LOCAL_SIZE",
            "CROSS_RANK",
            "CROSS_SIZE",
            "OMP_NUM_THREADS",
            "CUDA_VISIBLE_DEVICES",
            "MASTER_ADDR",
            "MASTER_PORT",
        )
    },
    "sys_path0": sys.path[0],
}
with open(os.path.join(args.out_dir, f"rank{os.environ['RANK']}.json"), "w") as fp:
    json.dump(facts, fp)
