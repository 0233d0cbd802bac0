"""Once Envoy (127.0.0.1:10000) answers through to a worker, sends requests through it from a few
threads, one after another, and polls Envoy's admin (127.0.0.1:9901) until its weights of the
service's two workers show the slow one (index 0) at half the other's or less; passes if they do
and no request failed, and prints the outcome as one check line. Usage: weights.py
DEADLINE_SECONDS.
"""
import http.client
import re
import sys
import threading
import time

deadline = time.monotonic() + float(sys.argv[1])
stop = threading.Event()
answered = [0]
failed = [0]


def load():
    while not stop.is_set():
        try:
            connection = http.client.HTTPConnection("127.0.0.1", 10000, timeout=10)
            connection.request("GET", "/slow?ms=20")
            response = connection.getresponse()
            response.read()
            connection.close()
            if response.status == 200:
                answered[0] += 1
            else:
                failed[0] += 1
        except OSError:
            failed[0] += 1


def weights():
    connection = http.client.HTTPConnection("127.0.0.1", 9901, timeout=5)
    connection.request("GET", "/clusters")
    text = connection.getresponse().read().decode()
    hosts = {}
    for line in text.splitlines():
        match = re.match(r"^app::([^:]+:\d+)::(hostname|weight)::(.*)$", line)
        if match:
            hosts.setdefault(match.group(1), {})[match.group(2)] = match.group(3)
    by_index = {}
    for host in hosts.values():
        name = host.get("hostname", "")
        parts = name.rsplit("-", 2)
        if len(parts) == 3 and "weight" in host:
            by_index[parts[1]] = int(host["weight"])
    return by_index


def answers():
    """Whether Envoy answers through to a worker."""
    try:
        connection = http.client.HTTPConnection("127.0.0.1", 10000, timeout=10)
        connection.request("GET", "/slow?ms=0")
        ok = connection.getresponse().status == 200
        connection.close()
        return ok
    except OSError:
        return False


# Envoy (slow to start under emulation) and the workers first: no load before they answer.
while not answers():
    if time.monotonic() > deadline:
        print("check: weights: FAILED: Envoy never answered through to a worker")
        sys.exit(1)
    time.sleep(0.5)

threads = [threading.Thread(target=load) for _ in range(3)]
for thread in threads:
    thread.start()
seen = {}
while time.monotonic() < deadline:
    time.sleep(1)
    try:
        seen = weights()
    except OSError:
        continue
    if len(seen) == 2 and min(seen.values()) > 1 and seen["0"] * 2 <= seen["1"]:
        break
stop.set()
for thread in threads:
    thread.join()
weighed = len(seen) == 2 and min(seen.values()) > 1 and seen["0"] * 2 <= seen["1"]
outcome = "ok" if weighed and failed[0] == 0 else "FAILED"
print(
    f"check: weights: {outcome}: Envoy weighs the slow worker {seen.get('0')} and the other "
    f"{seen.get('1')} ({answered[0]} answered, {failed[0]} failed)"
)
sys.exit(0 if outcome == "ok" else 1)
