"""A tiny ASGI 3 application for the end-to-end tests, served by uvicorn: the WSGI app's behaviour.

GET /healthz answers `ok`; every other path answers `Hello from worker <pid>!` (the hello worker's
answer), and the `x-server` header says `uvicorn`. `?cpu=MS` first burns MS milliseconds of CPU (at most 1000; it blocks the event loop, as a CPU-bound handler
does), so one worker can be loaded more than another; `/slow?ms=N` first sleeps N milliseconds (at
most 60000) without blocking.

Under socket activation run `uvicorn --fd 3 --app-dir tests/apps asgi_app:app` (uvicorn does not
read LISTEN_FDS). On SIGTERM uvicorn finishes what is in flight, then re-raises the signal: it ends
killed by SIGTERM rather than with status 0.
"""
import asyncio
import os
import time
from urllib.parse import parse_qs

SERVER = "uvicorn"
MAX_CPU_MS = 1000
MAX_SLEEP_MS = 60000


def burn_cpu(ms):
    """Busy-loops until this thread has used `ms` milliseconds of CPU."""
    end = time.thread_time() + ms / 1000
    while time.thread_time() < end:
        pass


def millis(query, name, cap):
    """The query's `name` as a count of milliseconds (0 when absent, capped); ValueError if malformed."""
    values = query.get(name)
    if not values:
        return 0
    value = int(values[0])
    if value < 0:
        raise ValueError(name)
    return min(value, cap)


async def app(scope, receive, send):
    # Only HTTP: returning from the lifespan scope tells uvicorn there is nothing to start or stop.
    if scope["type"] != "http":
        return
    path = scope["path"]
    query = parse_qs(scope["query_string"].decode("latin-1"))
    status = 200
    if path == "/healthz":
        body = b"ok\n"
    else:
        try:
            cpu = millis(query, "cpu", MAX_CPU_MS)
            sleep = millis(query, "ms", MAX_SLEEP_MS) if path == "/slow" else 0
        except ValueError:
            cpu = sleep = None
        if cpu is None:
            status, body = 400, b"cpu and ms take a count of milliseconds\n"
        else:
            burn_cpu(cpu)
            await asyncio.sleep(sleep / 1000)
            body = f"Hello from worker {os.getpid()}!\n".encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"text/plain"),
                (b"content-length", str(len(body)).encode()),
                (b"x-server", SERVER.encode()),
            ],
        }
    )
    await send(
        {
            "type": "http.response.body",
            "body": b"" if scope["method"] == "HEAD" else body,
        }
    )
