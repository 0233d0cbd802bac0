"""A server of one request at a time on the listener the supervisor passes (descriptor 3, as
LISTEN_FDS says), as gunicorn's sync worker is, for the VM's check: `GET /healthz` answers `ok`,
`GET /slow?ms=N` sleeps N ms (APP_WAIT_FACTOR times longer in the worker whose PEREGRINE_WORKER_INDEX
is APP_SLOW_INDEX) and answers the worker's index. Every answer closes its connection.
"""
import os
import socket
import time
from urllib.parse import parse_qs, urlsplit

listener = socket.socket(fileno=3)
index = os.environ.get("PEREGRINE_WORKER_INDEX", "?")
factor = float(os.environ.get("APP_WAIT_FACTOR", "1")) if index == os.environ.get("APP_SLOW_INDEX") else 1.0

while True:
    connection, _ = listener.accept()
    with connection:
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = connection.recv(4096)
            if not chunk:
                break
            head += chunk
        if not head:
            continue
        target = head.split(b" ", 2)[1].decode("latin-1") if head.count(b" ") >= 2 else "/"
        url = urlsplit(target)
        if url.path == "/slow":
            ms = int(parse_qs(url.query).get("ms", ["0"])[0])
            time.sleep(min(ms, 10000) * factor / 1000)
            body = f"worker {index}\n".encode()
        else:
            body = b"ok\n"
        connection.sendall(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\nconnection: close\r\n"
            + f"content-length: {len(body)}\r\n\r\n".encode()
            + body
        )
