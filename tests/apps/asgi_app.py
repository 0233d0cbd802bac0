"""A tiny ASGI 3 application for the end-to-end tests, served by uvicorn: the WSGI app's behaviour.

GET /healthz answers `ok` (`503` when APP_UNREADY is set); every other path answers `Hello from
worker <pid>!` (the hello worker's answer), and the `x-server` header says `uvicorn`. `?cpu=MS`
first burns MS milliseconds of CPU (at most 1000; it blocks the event loop, as a CPU-bound handler
does), so one worker can be loaded more than another; `/slow?ms=N` first sleeps N milliseconds (at
most 60000) without blocking; so does any path that ends in `/slow` (`/api/slow?ms=N` behind a route
prefix Envoy does not strip).

`x-worker-index` names the process that served: APP_WORKER_INDEX, else PEREGRINE_WORKER_INDEX; no
header when neither is set. With APP_INDEX_DIR the processes of one `uvicorn --workers N` take an
index each as they load the app (`app_knobs.py`).

Under socket activation run `uvicorn --fd 3 --app-dir tests/apps asgi_app:app` (uvicorn does not
read LISTEN_FDS). On SIGTERM uvicorn finishes what is in flight, then re-raises the signal: it ends
killed by SIGTERM rather than with status 0.
"""
import asyncio
import os
from urllib.parse import parse_qs

from app_knobs import MAX_CPU_MS, MAX_SLEEP_MS, burn_cpu, claim_fork_index, millis, worker_index

SERVER = "uvicorn"
UNREADY = bool(os.environ.get("APP_UNREADY"))
# uvicorn loads the app in each process it serves from (not in the one that manages `--workers`).
claim_fork_index()
INDEX = worker_index()


async def app(scope, receive, send):
    # Only HTTP: returning from the lifespan scope tells uvicorn there is nothing to start or stop.
    if scope["type"] != "http":
        return
    path = scope["path"]
    query = parse_qs(scope["query_string"].decode("latin-1"))
    status = 200
    if path == "/healthz":
        # APP_UNREADY in the environment: a server that never becomes ready.
        if UNREADY:
            status, body = 503, b"not ready\n"
        else:
            body = b"ok\n"
    else:
        try:
            cpu = millis(query, "cpu", MAX_CPU_MS)
            sleep = millis(query, "ms", MAX_SLEEP_MS) if path.endswith("/slow") else 0
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
            ]
            + ([(b"x-worker-index", INDEX.encode())] if INDEX is not None else []),
        }
    )
    await send(
        {
            "type": "http.response.body",
            "body": b"" if scope["method"] == "HEAD" else body,
        }
    )
