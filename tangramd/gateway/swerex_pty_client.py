"""One request to a session's terminal (``swerex_pty.py``): ``DIR REQUEST`` sends the
JSON ``REQUEST`` to ``DIR/s`` (waiting up to 5 s for the terminal to listen) and prints
the answer, one line of JSON (stdlib only, Python 3.7+)."""

import socket
import sys
import time

conn = socket.socket(socket.AF_UNIX)
for _ in range(500):
    try:
        conn.connect(sys.argv[1] + "/s")
        break
    except OSError:
        time.sleep(0.01)
conn.sendall(sys.argv[2].encode() + b"\n")
sys.stdout.write(conn.makefile().readline())
