"""The checks of the installed package that need more than a shell line, run by check.sh inside the
VM. Each prints its one line `check: NAME: ok|FAILED: DETAIL` and exits 0 when it passed.

  host.py every NAME COUNT DEADLINE
      `peregrine status` shows COUNT ready workers of the service `hello`, run by the `peregrine`
      user, and each of them answers 200 through Envoy (127.0.0.1:10000).
  host.py hosts NAME COUNT DEADLINE
      The same COUNT ready workers, and Envoy (admin 127.0.0.1:9901) holds each as a healthy host.
  host.py upgrade NAME DEB LOAD DEADLINE
      Under a steady HTTP/1.1 and HTTP/2 load through Envoy (the program LOAD), `apt-get install
      DEB`: no request may fail, the supervisor keeps its pid and its workers, and runs the new
      program file.
"""
import http.client
import json
import os
import pwd
import subprocess
import sys
import time

SERVICE = "hello"
ENVOY = ("127.0.0.1", 10000)
ADMIN = ("127.0.0.1", 9901)


def say(name, ok, detail):
    print(f"check: {name}: {'ok' if ok else 'FAILED'}: {detail}", flush=True)
    return 0 if ok else 1


def status():
    """`peregrine status --json`, or None while it does not answer."""
    try:
        out = subprocess.run(["peregrine", "status", "--json"], capture_output=True, timeout=30)
    except subprocess.TimeoutExpired:
        return None
    if out.returncode != 0:
        return None
    return json.loads(out.stdout)


def ready_workers(count):
    """The pids of the service's workers if exactly `count` are ready, else None."""
    now = status()
    if now is None:
        return None
    rows = [w for w in now.get("workers", []) if w.get("service") == SERVICE]
    if len(rows) != count or any(w.get("state") != "ready" for w in rows):
        return None
    return sorted(w["pid"] for w in rows)


def owner(pid):
    try:
        return pwd.getpwuid(os.stat(f"/proc/{pid}").st_uid).pw_name
    except (OSError, KeyError):
        return "?"


def get(address, path, timeout=10):
    connection = http.client.HTTPConnection(*address, timeout=timeout)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        return response.status, response.read().decode(errors="replace")
    finally:
        connection.close()


def until(deadline, probe):
    """`probe()` until it returns something other than None, or None at the deadline."""
    while time.monotonic() < deadline:
        try:
            found = probe()
        except OSError:
            found = None
        if found is not None:
            return found
        time.sleep(0.2)
    return None


def workers_of_peregrine(name, count, deadline):
    pids = until(deadline, lambda: ready_workers(count))
    if pids is None:
        now = status()
        rows = [(w.get("index"), w.get("state")) for w in (now or {}).get("workers", [])]
        return None, say(name, False, f"not {count} ready workers by the deadline: {rows}")
    users = {owner(pid) for pid in pids}
    if users != {"peregrine"}:
        return None, say(name, False, f"workers run as {sorted(users)}, not peregrine")
    return pids, 0


def every(name, count, deadline):
    pids, failed = workers_of_peregrine(name, count, deadline)
    if failed:
        return failed
    answered, requests, errors = set(), 0, 0
    while time.monotonic() < deadline and answered != set(pids):
        requests += 1
        try:
            code, body = get(ENVOY, "/")
        except OSError:
            errors += 1
            time.sleep(0.2)
            continue
        words = body.split()
        if code == 200 and len(words) == 4 and words[:3] == ["Hello", "from", "worker"]:
            answered.add(int(words[3].rstrip("!")))
    missing = sorted(set(pids) - answered)
    return say(
        name,
        not missing,
        f"{count} workers of the peregrine user, each answered 200 through Envoy "
        f"({requests} requests; {errors} connections refused before Envoy listened)"
        if not missing
        else f"no answer through Envoy from {missing} in {requests} requests",
    )


def envoy_hosts():
    code, text = get(ADMIN, "/clusters?format=json")
    if code != 200:
        return None
    for cluster in json.loads(text).get("cluster_statuses", []):
        if cluster.get("name") == SERVICE:
            return cluster.get("host_statuses", [])
    return []


def hosts(name, count, deadline):
    pids, failed = workers_of_peregrine(name, count, deadline)
    if failed:
        return failed

    def all_healthy():
        found = envoy_hosts()
        healthy = [h for h in found or [] if h.get("health_status", {}).get("eds_health_status") == "HEALTHY"]
        return healthy if len(healthy) == count else None

    healthy = until(deadline, all_healthy)
    tasks = subprocess.run(
        ["systemctl", "show", "-p", "TasksCurrent", "-p", "TasksMax", "--value", "peregrine"],
        capture_output=True, text=True,
    ).stdout.split()
    if healthy is None:
        return say(name, False, f"Envoy holds {len(envoy_hosts() or [])} hosts, not {count}")
    return say(
        name,
        True,
        f"{count} workers of the peregrine user ready, each a healthy host in Envoy "
        f"(the unit's tasks: {' of '.join(tasks)})",
    )


def main_pid():
    out = subprocess.run(["systemctl", "show", "-p", "MainPID", "--value", "peregrine"],
                         capture_output=True, text=True)
    return int(out.stdout.strip() or 0)


def upgrade(name, deb, load, deadline):
    before = status()
    pids_before = sorted(w["pid"] for w in before["workers"] if w.get("service") == SERVICE)
    main_before = main_pid()
    version_before = subprocess.run(["dpkg-query", "-W", "-f", "${Version}", "peregrine"],
                                    capture_output=True, text=True).stdout
    stop = "/tmp/load.stop"
    if os.path.exists(stop):
        os.remove(stop)
    running = subprocess.Popen([load, f"{ENVOY[0]}:{ENVOY[1]}", "2", "2", stop, "600"],
                               stdout=subprocess.PIPE, text=True)

    def served_by_envoy():
        code, text = get(ADMIN, f"/stats?filter=^cluster\\.{SERVICE}\\.upstream_rq_200$")
        return int(text.split(":")[1]) if code == 200 and ":" in text else 0

    # The load is on (Envoy counts its answers), then the upgrade, then more load on the new program.
    start = served_by_envoy()
    until(deadline, lambda: True if served_by_envoy() >= start + 200 else None)
    apt = subprocess.run(["apt-get", "install", "-y", "-q", deb], capture_output=True, text=True)
    after_upgrade = served_by_envoy()
    settled = until(deadline, lambda: ready_workers(len(pids_before)))
    until(deadline, lambda: True if served_by_envoy() >= after_upgrade + 200 else None)
    open(stop, "w").close()
    report = json.loads(running.communicate(timeout=60)[0])

    version = subprocess.run(["dpkg-query", "-W", "-f", "${Version}", "peregrine"],
                             capture_output=True, text=True).stdout
    main_after = main_pid()
    exe = os.readlink(f"/proc/{main_after}/exe") if main_after else "?"
    problems = []
    if apt.returncode != 0:
        problems.append(f"apt-get install failed: {apt.stdout[-400:]}{apt.stderr[-400:]}")
    if version == version_before:
        problems.append(f"still {version} installed")
    if report["failed"] != 0:
        problems.append(f"{report['failed']} requests failed: {report['failures'][:5]}")
    if set(report["ok"]) != {"Http1", "Http2"}:
        problems.append(f"not both protocols served: {report['ok']}")
    if main_after != main_before:
        problems.append(f"the supervisor's pid changed: {main_before} -> {main_after}")
    if exe.endswith("(deleted)"):
        problems.append(f"the supervisor still runs the old program file: {exe}")
    if settled != pids_before:
        problems.append(f"workers {pids_before} before, {settled} after")
    detail = (
        f"apt-get install {version_before} -> {version} under load through Envoy: "
        f"{report['served']} served ({report['ok']}), {report['failed']} failed; "
        f"the supervisor (pid {main_after}) runs the new {exe}, its {len(pids_before)} workers adopted"
    )
    if problems:
        print(apt.stdout, apt.stderr)
        return say(name, False, "; ".join(problems))
    return say(name, True, detail)


def direct(name, count, deadline):
    """`count` ready workers of the peregrine user, each answering 200 on its own address."""
    pids, failed = workers_of_peregrine(name, count, deadline)
    if failed:
        return failed
    wrong = []
    for row in [w for w in status()["workers"] if w.get("service") == SERVICE]:
        address = row["addresses"][0].split("://")[-1]
        host, port = address.rsplit(":", 1)
        try:
            code, body = get((host.strip("[]"), int(port)), "/")
        except OSError as error:
            wrong.append(f"{address}: {error}")
            continue
        if code != 200 or f"worker {row['pid']}!" not in body:
            wrong.append(f"{address}: {code} {body.strip()!r}")
    return say(
        name,
        not wrong,
        f"{count} workers of the peregrine user, each answered 200 on its own address"
        if not wrong
        else f"answers: {wrong}",
    )


def main(argv):
    command, name = argv[1], argv[2]
    if command == "every":
        return every(name, int(argv[3]), time.monotonic() + float(argv[4]))
    if command == "direct":
        return direct(name, int(argv[3]), time.monotonic() + float(argv[4]))
    if command == "hosts":
        return hosts(name, int(argv[3]), time.monotonic() + float(argv[4]))
    if command == "upgrade":
        return upgrade(name, argv[3], argv[4], time.monotonic() + float(argv[5]))
    return say(name, False, f"host.py does not know {command!r}")


if __name__ == "__main__":
    sys.exit(main(sys.argv))
