"""A strict HTTP/2 client (python-hyper's h2) against a worker, over h2c with prior knowledge.

Usage: h2_client.py HOST PORT. Opens 50 concurrent streams with 100 KiB request bodies, checks every
response, then sends a malformed request and expects that stream (only) to be reset. Exits non-zero on
any protocol violation (h2 raises on those).
"""
import socket
import sys

import h2.config
import h2.connection
import h2.events

host, port = sys.argv[1], int(sys.argv[2])
sock = socket.create_connection((host, port), timeout=10)
# Outbound validation off: the test sends one malformed request on purpose.
conn = h2.connection.H2Connection(
    h2.config.H2Configuration(client_side=True, validate_outbound_headers=False, normalize_outbound_headers=False)
)
conn.initiate_connection()
conn.increment_flow_control_window(16 * 1024 * 1024)
sock.sendall(conn.data_to_send())

STREAMS = 50
bodies = {}
responses = {}
pending = {}
for i in range(STREAMS):
    stream = conn.get_next_available_stream_id()
    body = bytes([65 + i % 26]) * (100 * 1024)
    conn.send_headers(
        stream,
        [(":method", "POST"), (":path", f"/{i}"), (":scheme", "http"), (":authority", host),
         ("content-length", str(len(body)))],
    )
    pending[stream] = body
    responses[stream] = {"status": None, "body": b"", "ended": False}


def send_pending():
    for stream, body in list(pending.items()):
        window = min(conn.local_flow_control_window(stream), conn.max_outbound_frame_size)
        while body and window > 0:
            chunk, body = body[:window], body[window:]
            conn.send_data(stream, chunk)
            window = min(conn.local_flow_control_window(stream), conn.max_outbound_frame_size)
        if body:
            pending[stream] = body
        else:
            conn.end_stream(stream)
            del pending[stream]
    sock.sendall(conn.data_to_send())


send_pending()
while not all(r["ended"] for r in responses.values()):
    data = sock.recv(65536)
    assert data, "the server closed the connection"
    for event in conn.receive_data(data):
        if isinstance(event, h2.events.ResponseReceived):
            headers = dict(event.headers)
            responses[event.stream_id]["status"] = headers[b":status"]
            responses[event.stream_id]["length"] = headers.get(b"content-length")
        elif isinstance(event, h2.events.DataReceived):
            responses[event.stream_id]["body"] += event.data
            conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
        elif isinstance(event, h2.events.StreamEnded):
            responses[event.stream_id]["ended"] = True
        elif isinstance(event, h2.events.StreamReset):
            raise AssertionError(f"stream {event.stream_id} reset: {event.error_code}")
        elif isinstance(event, h2.events.ConnectionTerminated):
            raise AssertionError(f"connection terminated: {event}")
    send_pending()
for stream, r in responses.items():
    assert r["status"] == b"200", (stream, r["status"])
    assert r["body"].startswith(b"Hello from worker "), r["body"][:40]
    assert r["length"] == str(len(r["body"])).encode(), (r["length"], len(r["body"]))
print(f"{STREAMS} concurrent streams ok")

# A request without :path is malformed: that stream is reset, the connection lives on.
bad = conn.get_next_available_stream_id()
conn.send_headers(bad, [(":method", "GET"), (":scheme", "http"), (":authority", host)], end_stream=True)
sock.sendall(conn.data_to_send())
reset = False
while not reset:
    data = sock.recv(65536)
    assert data, "the server closed the connection on one malformed stream"
    for event in conn.receive_data(data):
        if isinstance(event, h2.events.StreamReset) and event.stream_id == bad:
            reset = True
        if isinstance(event, h2.events.ConnectionTerminated):
            raise AssertionError(f"connection terminated: {event}")
    sock.sendall(conn.data_to_send())
good = conn.get_next_available_stream_id()
conn.send_headers(good, [(":method", "GET"), (":path", "/"), (":scheme", "http"), (":authority", host)], end_stream=True)
sock.sendall(conn.data_to_send())
done = False
while not done:
    data = sock.recv(65536)
    assert data
    for event in conn.receive_data(data):
        if isinstance(event, h2.events.StreamEnded) and event.stream_id == good:
            done = True
    sock.sendall(conn.data_to_send())
print("malformed stream reset ok")
conn.close_connection()
sock.sendall(conn.data_to_send())
