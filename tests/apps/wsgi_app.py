"""A tiny WSGI application for the end-to-end tests, served by gunicorn.

GET /healthz answers `ok` (`503` when APP_UNREADY is set); every other path answers `Hello from worker <pid>!` (the hello worker's answer, so the tests'
load tells workers apart the same way), `<pid>` being the process the supervisor started: gunicorn's
arbiter, the parent of the process that serves; the `x-server` header says `gunicorn`. `?cpu=MS`
first burns MS milliseconds of CPU (at most 1000), so one worker can be loaded more than another;
`/slow?ms=N` first sleeps N milliseconds (at most 60000); so does any path that ends in `/slow`
(`/api/slow?ms=N` behind a route prefix Envoy does not strip).

Each answer says which process served it in `X-Worker-Index`: APP_WORKER_INDEX (which
`gunicorn_forks.py` sets in each process gunicorn forks, so the forks of one gunicorn on one socket
are told apart), else PEREGRINE_WORKER_INDEX; no header when neither is set. APP_WAIT_FACTOR (5, say)
multiplies `/slow`'s wait in the process of index APP_SLOW_INDEX only (every process when unset): one
worker whose database calls take longer.

APP_LOAD_REPORT (`rps_fractional=100000,application_utilization=0.001`, say) makes the worker of
index APP_LOAD_REPORT_INDEX (every worker when unset) state that load to Envoy on every response, as
an application that sets ORCA's header itself does: in `endpoint-load-metrics-bin` (an
`OrcaLoadReport` in base64), or with APP_LOAD_REPORT_FORM=text in `endpoint-load-metrics` (`TEXT
name=value, ...`).

Under socket activation (LISTEN_FDS=1, LISTEN_PID) run
`gunicorn --no-control-socket --workers 1 --chdir tests/apps wsgi_app:app`: gunicorn takes fd 3 from
LISTEN_FDS itself (adding `--bind fd://3` makes it open fd 3 twice and fail); without
`--no-control-socket` each gunicorn binds `~/.gunicorn/gunicorn.ctl`, the last started taking it.
"""
import base64
import os
import struct
import time
from urllib.parse import parse_qs

from app_knobs import MAX_CPU_MS, MAX_SLEEP_MS, burn_cpu, millis, worker_index

SERVER = "gunicorn"
UNREADY = bool(os.environ.get("APP_UNREADY"))
# The process the supervisor started: gunicorn's arbiter, which forked this worker and then loaded
# the app in it. Taken now, so a worker orphaned by a killed arbiter still names it.
SUPERVISED_PID = os.getppid()
# The `double` fields of xds.data.orca.v3.OrcaLoadReport, by name: their field numbers.
ORCA_FIELDS = {
    "cpu_utilization": 1,
    "mem_utilization": 2,
    "rps_fractional": 6,
    "eps": 7,
    "application_utilization": 9,
}


def load_report_header():
    """The ORCA header this worker adds to its responses, if APP_LOAD_REPORT asks for one."""
    report = os.environ.get("APP_LOAD_REPORT")
    index = os.environ.get("APP_LOAD_REPORT_INDEX")
    if not report or (index is not None and index != os.environ.get("PEREGRINE_WORKER_INDEX")):
        return None
    fields = [pair.split("=") for pair in report.split(",")]
    if os.environ.get("APP_LOAD_REPORT_FORM") == "text":
        text = ", ".join(f"{name.strip()}={value.strip()}" for name, value in fields)
        return ("endpoint-load-metrics", "TEXT " + text)
    # Each field: its tag (field number, wire type 1: 64 bits), then the double, little-endian.
    encoded = b"".join(
        bytes([ORCA_FIELDS[name.strip()] << 3 | 1]) + struct.pack("<d", float(value))
        for name, value in fields
    )
    return ("endpoint-load-metrics-bin", base64.b64encode(encoded).decode())


LOAD_REPORT = load_report_header()


def wait_factor():
    """How much longer this process waits on `/slow` (APP_WAIT_FACTOR where APP_SLOW_INDEX is its
    index)."""
    factor = os.environ.get("APP_WAIT_FACTOR")
    slow = os.environ.get("APP_SLOW_INDEX")
    if not factor or (slow is not None and slow != worker_index()):
        return 1.0
    return float(factor)


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
            sleep = millis(query, "ms", MAX_SLEEP_MS) if path.endswith("/slow") else 0
        except ValueError:
            cpu = sleep = None
        if cpu is None:
            status, body = "400 Bad Request", b"cpu and ms take a count of milliseconds\n"
        else:
            burn_cpu(cpu)
            time.sleep(sleep * wait_factor() / 1000)
            body = f"Hello from worker {SUPERVISED_PID}!\n".encode()
    headers = [
        ("Content-Type", "text/plain"),
        ("Content-Length", str(len(body))),
        ("X-Server", SERVER),
    ]
    index = worker_index()
    if index is not None:
        headers.append(("X-Worker-Index", index))
    if LOAD_REPORT:
        headers.append(LOAD_REPORT)
    start_response(status, headers)
    return [b"" if environ.get("REQUEST_METHOD") == "HEAD" else body]
