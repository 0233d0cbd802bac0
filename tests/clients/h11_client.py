"""A strict HTTP/1.1 client (h11) against a worker: every response must satisfy h11's checks.

Usage: h11_client.py HOST PORT. Prints one line per check; exits non-zero on the first violation.
"""
import socket
import sys

import h11

host, port = sys.argv[1], int(sys.argv[2])


def connect():
    sock = socket.create_connection((host, port), timeout=10)
    return sock, h11.Connection(our_role=h11.CLIENT)


def send(sock, conn, *events):
    for event in events:
        data = conn.send(event)
        if data:
            sock.sendall(data)


def receive(sock, conn):
    """Returns (response, body) for the next response; raises on any protocol violation."""
    response, body = None, b""
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(sock.recv(65536))
            continue
        if isinstance(event, h11.InformationalResponse):
            continue
        if isinstance(event, h11.Response):
            response = event
        elif isinstance(event, h11.Data):
            body += event.data
        elif isinstance(event, h11.EndOfMessage):
            return response, body
        elif isinstance(event, h11.ConnectionClosed):
            raise AssertionError("connection closed inside a response")


def headers(response):
    return {name.decode().lower(): value.decode() for name, value in response.headers}


sock, conn = connect()
# Keep-alive: three requests, one connection.
for i in range(3):
    send(sock, conn, h11.Request(method="GET", target=f"/{i}", headers=[("Host", host)]), h11.EndOfMessage())
    response, body = receive(sock, conn)
    assert response.status_code == 200, response
    assert body.startswith(b"Hello from worker "), body
    assert headers(response)["content-length"] == str(len(body))
    conn.start_next_cycle()
print("keep-alive ok")

# A chunked upload with Expect: 100-continue.
send(
    sock,
    conn,
    h11.Request(
        method="POST",
        target="/upload",
        headers=[("Host", host), ("Transfer-Encoding", "chunked"), ("Expect", "100-continue")],
    ),
)
event = None
while event is None or event is h11.NEED_DATA:
    event = conn.next_event()
    if event is h11.NEED_DATA:
        conn.receive_data(sock.recv(65536))
assert isinstance(event, h11.InformationalResponse) and event.status_code == 100, event
send(sock, conn, h11.Data(data=b"x" * 5000), h11.Data(data=b"y" * 3), h11.EndOfMessage())
response, body = receive(sock, conn)
assert response.status_code == 200, response
conn.start_next_cycle()
print("100-continue and chunked upload ok")

# HEAD: headers only, the length of the GET body.
send(sock, conn, h11.Request(method="HEAD", target="/", headers=[("Host", host)]), h11.EndOfMessage())
response, body = receive(sock, conn)
assert response.status_code == 200 and body == b"", (response, body)
assert int(headers(response)["content-length"]) > 0
conn.start_next_cycle()
print("head ok")

# Connection: close is honoured.
send(sock, conn, h11.Request(method="GET", target="/", headers=[("Host", host), ("Connection", "close")]), h11.EndOfMessage())
response, body = receive(sock, conn)
assert response.status_code == 200
assert headers(response).get("connection") == "close", response
assert sock.recv(1) == b"", "the server closes after Connection: close"
print("connection close ok")
