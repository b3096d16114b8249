"""Launched rank: write what `deepspeed` is, the CPU affinity and OMP_NUM_THREADS to JSON."""

import json
import os
import sys

out = sys.argv[-1]
try:
    import deepspeed

    what = getattr(deepspeed, "__slipstream_version__", None) and "slipstream"
    what = what or "deepspeed"
except ImportError:
    what = "missing"
record = {
    "deepspeed": what,
    "affinity": sorted(os.sched_getaffinity(0)),
    "omp": os.environ.get("OMP_NUM_THREADS"),
    "argv": sys.argv[1:],
}
with open(os.path.join(out, f"rank{os.environ['RANK']}.json"), "w") as f:
    json.dump(record, f)
