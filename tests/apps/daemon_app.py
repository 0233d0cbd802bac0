"""A server that daemonizes, as the classic recipe has it, for the end-to-end tests.

It forks; the child starts a session of its own and forks again; the grandchild serves HTTP on
descriptor 3 (the listener the supervisor passed) while both parents exit at once, with status 0.
So the process the supervisor started exits within moments, and the server it leaves holds the
listener: what a supervisor must not take for an exit of the server. Every request is answered
`200 ok`.

Run as `python daemon_app.py`, with the listener on descriptor 3.
"""
import os
import socket

if os.fork() > 0:
    os._exit(0)
os.setsid()
if os.fork() > 0:
    os._exit(0)

listener = socket.socket(fileno=3)
while True:
    connection, _ = listener.accept()
    with connection:
        connection.recv(65536)
        connection.sendall(
            b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\nconnection: close\r\n\r\nok\n"
        )
