"""What the WSGI and ASGI test applications share: their limits and the `cpu` and `ms` knobs.

Both servers put `tests/apps` on the import path (gunicorn's `--chdir`, uvicorn's `--app-dir`).
"""
import os
import time

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
