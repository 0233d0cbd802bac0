"""What the WSGI and ASGI test applications share: their limits and the `cpu` and `ms` knobs.

Both servers put `tests/apps` on the import path (gunicorn's `--chdir`, uvicorn's `--app-dir`).
"""
import os
import time

MAX_CPU_MS = 1000
MAX_SLEEP_MS = 60000


def wait_factor():
    """APP_WAIT_FACTOR (a number, 1 when unset) when this worker's index (PEREGRINE_WORKER_INDEX) is
    APP_SLOW_INDEX, else 1: the factor its `/slow` waits are multiplied by, so that one worker's
    requests wait longer than its peers' (an IO-bound worker on a slower database, say)."""
    slow = os.environ.get("APP_SLOW_INDEX")
    if slow is None or slow != os.environ.get("PEREGRINE_WORKER_INDEX"):
        return 1.0
    return float(os.environ.get("APP_WAIT_FACTOR", "1"))


WAIT_FACTOR = wait_factor()


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
