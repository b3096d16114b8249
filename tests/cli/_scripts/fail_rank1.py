"""Every rank dumps its facts (see write_env.py); rank 0 then records its pid and sleeps, and
rank 1 waits for that pid file, then fails (argv: OUT_DIR MODE).

MODE "exit": rank 1 calls sys.exit(7); "raise": rank 1 raises ValueError; "sleep": all ranks
record their pid (OUT_DIR/rank<RANK>.pid) and sleep.
"""

import argparse
import os
import sys
import time

from write_env import dump_facts

parser = argparse.ArgumentParser()
parser.add_argument("out_dir")
parser.add_argument("mode", choices=["exit", "raise", "sleep"])
parser.add_argument("--local_rank", type=int)
args = parser.parse_args()
dump_facts(args.out_dir, args.local_rank)
rank = os.environ["RANK"]
if rank == "0" or args.mode == "sleep":
    pid_file = os.path.join(args.out_dir, f"rank{rank}.pid")
    with open(pid_file + ".tmp", "w") as fp:
        fp.write(str(os.getpid()))
    os.replace(pid_file + ".tmp", pid_file)
    time.sleep(120)
    sys.exit(0)
deadline = time.monotonic() + 30
while not os.path.exists(os.path.join(args.out_dir, "rank0.pid")) and time.monotonic() < deadline:
    time.sleep(0.05)
if args.mode == "raise":
    raise ValueError("rank 1 broke on purpose")
sys.exit(7)
