"""A gunicorn config file (`gunicorn -c tests/apps/gunicorn_forks.py --workers N ...`) for one
gunicorn that forks several workers on one socket: each forked process gets an index from 0 to N-1
in APP_WORKER_INDEX (the smallest index no live sibling holds, so a replaced process takes the index
of the one it replaces), which `wsgi_app.py` sends back in `X-Worker-Index` and matches against
APP_SLOW_INDEX. With APP_PIN_FORKS (a list of CPUs, `0,1`) the process of index i is pinned to the
(i mod length)-th of them, as `taskset -c` pins a process of its own.
"""
import os


def pre_fork(server, worker):
    """In gunicorn's arbiter, before the fork: the smallest index no live worker holds."""
    taken = {getattr(w, "app_index", None) for w in server.WORKERS.values()}
    worker.app_index = next(i for i in range(len(taken) + 1) if i not in taken)


def post_fork(server, worker):
    """In the forked process, before the app is loaded: its index and its CPU."""
    os.environ["APP_WORKER_INDEX"] = str(worker.app_index)
    cpus = [int(cpu) for cpu in os.environ.get("APP_PIN_FORKS", "").split(",") if cpu.strip()]
    if cpus:
        os.sched_setaffinity(0, {cpus[worker.app_index % len(cpus)]})
