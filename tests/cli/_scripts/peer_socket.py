"""Two ranks joined by a plain TCP socket, the way gloo joins them, without importing torch
(so a launch takes well under a second); one rank SIGKILLs itself (argv: OUT_DIR VICTIM).

The survivor sees the connection end and raises gloo's message ("Connection closed by peer")
at once, racing the launcher's notice of the killed rank exactly as a real job does.
"""

import argparse
import os
import signal
import socket
import time

parser = argparse.ArgumentParser()
parser.add_argument("out_dir")
parser.add_argument("victim", type=int)
parser.add_argument("--local_rank", type=int)
args = parser.parse_args()
rank = int(os.environ["RANK"])
port_file = os.path.join(args.out_dir, "port")

if rank == 0:
    server = socket.create_server(("127.0.0.1", 0))
    with open(port_file + ".tmp", "w") as fp:
        fp.write(str(server.getsockname()[1]))
    os.replace(port_file + ".tmp", port_file)
    peer, _ = server.accept()
else:
    deadline = time.monotonic() + 30
    while not os.path.exists(port_file) and time.monotonic() < deadline:
        time.sleep(0.01)
    with open(port_file) as fp:
        peer = socket.create_connection(("127.0.0.1", int(fp.read())))
peer.sendall(b"x")
peer.recv(1)  # both ranks are connected and running
if rank == args.victim:
    os.kill(os.getpid(), signal.SIGKILL)
try:
    data = peer.recv(1)
except ConnectionResetError:
    data = b""
if not data:
    raise RuntimeError(f"[pair.cc] Connection closed by peer (rank {1 - rank})")
