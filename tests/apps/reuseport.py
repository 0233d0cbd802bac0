"""`python3 reuseport.py HOST:PORT COMMAND...`: binds HOST:PORT with SO_REUSEPORT, listens, and execs
COMMAND with that listener as file descriptor 3, for a server that cannot set SO_REUSEPORT itself
(`uvicorn --fd 3 ...`; uvicorn has no `--reuse-port`). Several such processes on one port are what
people run without a balancer in front: the kernel hashes each new connection to one of them.

The listener also has TCP_NODELAY, which every connection accepted from it inherits: uvicorn takes a
descriptor as a Unix socket (`socket.fromfd(fd, AF_UNIX, ...)`), so asyncio would not set it on the
connections, and each answer on a kept-alive connection after the first would wait about 40 ms for
the client's delayed ACK (Nagle). A uvicorn that binds its own port, which this stands in for, has
TCP_NODELAY on every connection.
"""
import os
import socket
import sys

LISTENER_FD = 3


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    host, port = sys.argv[1].rsplit(":", 1)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    listener.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    listener.bind((host, int(port)))
    listener.listen(1024)
    if listener.fileno() != LISTENER_FD:
        os.dup2(listener.fileno(), LISTENER_FD)
    os.set_inheritable(LISTENER_FD, True)
    os.execvp(sys.argv[2], sys.argv[2:])


if __name__ == "__main__":
    main()
