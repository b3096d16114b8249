"""Two gloo ranks meet in one labelled all-reduce, then one of them goes wrong (argv: OUT_DIR MODE).

MODE "kill0"/"kill1": that rank SIGKILLs itself and the other fails in the next all-reduce
with gloo's "Connection reset/closed by peer". "raise0": rank 0 raises ValueError and rank 1
fails the same way. "stall1": rank 1 writes OUT_DIR/stall.time and SIGSTOPs itself, so rank 0
waits in all-reduce 'train.step' until the collective timeout.
"""

import argparse
import os
import signal
import time

import torch

from slipstream.distributed import comm

parser = argparse.ArgumentParser()
parser.add_argument("out_dir")
parser.add_argument("mode", choices=["kill0", "kill1", "raise0", "stall1"])
parser.add_argument("--local_rank", type=int)
args = parser.parse_args()

comm.init_distributed()
rank = comm.get_rank()
with open(os.path.join(args.out_dir, f"rank{rank}.pid"), "w") as fp:
    fp.write(str(os.getpid()))
tensor = torch.ones(4)
comm.all_reduce(tensor, label="warmup")
if args.mode == f"kill{rank}":
    os.kill(os.getpid(), signal.SIGKILL)
if args.mode == "raise0" and rank == 0:
    raise ValueError("rank 0 broke on purpose")
if args.mode == "stall1" and rank == 1:
    with open(os.path.join(args.out_dir, "stall.time"), "w") as fp:
        fp.write(repr(time.time()))
    os.kill(os.getpid(), signal.SIGSTOP)
comm.all_reduce(tensor, label="train.step")
