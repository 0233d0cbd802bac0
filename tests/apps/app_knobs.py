"""What the WSGI and ASGI test applications share: their limits, the `cpu` and `ms` knobs, and the
index each process names in `X-Worker-Index`.

Both servers put `tests/apps` on the import path (gunicorn's `--chdir`, uvicorn's `--app-dir`).

APP_INDEX_DIR (a directory) tells apart the processes that one server forks on one socket where the
server has no hook to number them (uvicorn's `--workers N`; gunicorn has one, see
`gunicorn_forks.py`): as the app loads, each process takes the smallest index whose lock file
(`INDEX.lock` in that directory) no live process holds, holds it for as long as it lives, and sets
APP_WORKER_INDEX to it. A replacement takes the index of the process it replaces. With
APP_PIN_FORKS (a list of CPUs, `0,1`) the process of index i is then pinned to the (i mod length)-th
of them, as `gunicorn_forks.py` pins gunicorn's. APP_INDEX_BASE (a number) is added to the index
each process names, so that the workers of several hosts are told apart.
"""
import fcntl
import itertools
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


# The lock file of the index this process holds (see APP_INDEX_DIR), open for as long as it lives.
_INDEX_LOCK = []


def claim_fork_index():
    """With APP_INDEX_DIR, takes this process's index and sets APP_WORKER_INDEX (and pins it with
    APP_PIN_FORKS); without it, does nothing."""
    directory = os.environ.get("APP_INDEX_DIR")
    if not directory or _INDEX_LOCK:
        return
    for index in itertools.count():
        lock = open(os.path.join(directory, f"{index}.lock"), "a")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            continue
        _INDEX_LOCK.append(lock)
        os.environ["APP_WORKER_INDEX"] = str(index)
        cpus = [int(cpu) for cpu in os.environ.get("APP_PIN_FORKS", "").split(",") if cpu.strip()]
        if cpus:
            os.sched_setaffinity(0, {cpus[index % len(cpus)]})
        return


def worker_index():
    """This process's index: APP_WORKER_INDEX, else the supervisor's PEREGRINE_WORKER_INDEX, plus
    APP_INDEX_BASE where set (so that the workers of several hosts have distinct indices)."""
    index = os.environ.get("APP_WORKER_INDEX", os.environ.get("PEREGRINE_WORKER_INDEX"))
    base = os.environ.get("APP_INDEX_BASE")
    if index is None or not base:
        return index
    return str(int(index) + int(base))
