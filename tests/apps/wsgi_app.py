"""A tiny WSGI application for the end-to-end tests, served by gunicorn.

GET /healthz answers `ok` (`503` when APP_UNREADY is set); every other path answers `Hello from worker <pid>!` (the hello worker's answer, so the tests'
load tells workers apart the same way), `<pid>` being the process the supervisor started: gunicorn's
arbiter, the parent of the process that serves; the `x-server` header says `gunicorn`. `?cpu=MS`
first burns MS milliseconds of CPU (at most 1000), so one worker can be loaded more than another;
`/slow?ms=N` first sleeps N milliseconds (at most 60000).

Under socket activation (LISTEN_FDS=1, LISTEN_PID) run
`gunicorn --no-control-socket --workers 1 --chdir tests/apps wsgi_app:app`: gunicorn takes fd 3 from
LISTEN_FDS itself (adding `--bind fd://3` makes it open fd 3 twice and fail); without
`--no-control-socket` each gunicorn binds `~/.gunicorn/gunicorn.ctl`, the last started taking it.
"""
import os
import time
from urllib.parse import parse_qs

from app_knobs import MAX_CPU_MS, MAX_SLEEP_MS, burn_cpu, millis

SERVER = "gunicorn"
UNREADY = bool(os.environ.get("APP_UNREADY"))
# The process the supervisor started: gunicorn's arbiter, which forked this worker and then loaded
# the app in it. Taken now, so a worker orphaned by a killed arbiter still names it.
SUPERVISED_PID = os.getppid()


def app(environ, start_response):
    path = environ.get("PATH_INFO", "/")
    query = parse_qs(environ.get("QUERY_STRING", ""))
    status = "200 OK"
    if path == "/healthz":
        # APP_UNREADY in the environment: a server that never becomes ready.
        if UNREADY:
            status, body = "503 Service Unavailable", b"not ready\n"
        else:
            body = b"ok\n"
    else:
        try:
            cpu = millis(query, "cpu", MAX_CPU_MS)
            sleep = millis(query, "ms", MAX_SLEEP_MS) if path == "/slow" else 0
        except ValueError:
            cpu = sleep = None
        if cpu is None:
            status, body = "400 Bad Request", b"cpu and ms take a count of milliseconds\n"
        else:
            burn_cpu(cpu)
            time.sleep(sleep / 1000)
            body = f"Hello from worker {SUPERVISED_PID}!\n".encode()
    start_response(
        status,
        [
            ("Content-Type", "text/plain"),
            ("Content-Length", str(len(body))),
            ("X-Server", SERVER),
        ],
    )
    return [b"" if environ.get("REQUEST_METHOD") == "HEAD" else body]
