#!/bin/sh
# Run inside the VM by its one unit (vm-check.service), from the read-only payload disk mounted at
# /payload: what the VM's own kernel gives the eBPF sampler. Each step prints one line
# `check: NAME: ok|FAILED|skipped: DETAIL`, which `cargo xtask vm` counts; what the steps ran is
# printed before their line.
payload=/payload
failed=0

say() { echo "check: $1: $2"; }

say kernel "ok: $(uname -r) ($(. /etc/os-release && echo "$PRETTY_NAME"))"
if [ -r /sys/kernel/btf/vmlinux ]; then
    say btf "ok: /sys/kernel/btf/vmlinux"
else
    say btf "FAILED: no /sys/kernel/btf/vmlinux"
fi
if grep -qs 'sock_send_length' /sys/kernel/tracing/available_events /sys/kernel/debug/tracing/available_events; then
    say sock_send_length "ok: the tracepoint exists (6.3 and later): sends are counted there"
else
    say sock_send_length "ok: no such tracepoint (before 6.3): sends are counted at fexit/tcp_sendmsg"
fi

# The sampler's programs, loaded and checked against /proc by the eBPF crate's own tests, on this
# kernel; with PEREGRINE_REQUIRE_EBPF=1 none may skip.
mount -t tmpfs tmp /tmp 2>/dev/null
cd /tmp || exit 1
if PEREGRINE_REQUIRE_EBPF=1 "$payload/probe" --test-threads=1 > /tmp/probe.log 2>&1; then
    say probe "ok: $(grep '^test result' /tmp/probe.log | head -1)"
else
    failed=1
    cat /tmp/probe.log
    say probe "FAILED: $(grep '^test result' /tmp/probe.log | head -1)"
fi
grep '^test ' /tmp/probe.log

# The supervisor itself: which sampler it chooses and where it counts sends, with one built-in
# worker, until it says (60 s at most: TCG is slow).
cat > /tmp/peregrine.toml <<TOML
[supervisor]
bind = "http://127.0.0.1:18000"
control = "/tmp/peregrine.sock"
metrics = ""

[service.hello]
count = 1
TOML
"$payload/peregrine" run /tmp/peregrine.toml > /tmp/run.log 2>&1 &
run=$!
tries=0
until grep -q 'Sampler chosen' /tmp/run.log || [ $tries -ge 600 ]; do
    sleep 0.1
    tries=$((tries + 1))
done
chosen=$(grep 'Sampler chosen' /tmp/run.log | head -1 | sed 's/.*Sampler chosen for //')
kill -TERM "$run" 2>/dev/null
wait "$run"
case "$chosen" in
    *'sampler="ebpf"'*) say sampler "ok: $chosen" ;;
    '') failed=1; cat /tmp/run.log; say sampler "FAILED: the supervisor never said which sampler it chose" ;;
    *) failed=1; cat /tmp/run.log; say sampler "FAILED: $chosen" ;;
esac

# The waiting signal through the real Envoy: two workers of one request at a time on passed
# sockets, worker 0's requests waiting 5x longer, balanced on ORCA. On this kernel the sampler
# counts their responses where it said above, and sees their requests in flight in the socket
# tables; Envoy must weigh worker 0 at half the other or less.
cat > /tmp/app.toml <<TOML
[supervisor]
bind = "http://127.0.0.1:18000"
control = "/tmp/app.sock"
metrics = ""

[envoy]
listen = "127.0.0.1:10000"
admin = "127.0.0.1:9901"

[orca]
blackout_period_ms = 1000
weight_update_period_ms = 200

[service.app]
count = 2
pass_socket = true
command = ["/usr/bin/python3", "$payload/server.py"]
ready_path = "/healthz"
concurrency = 1
listener = "per-worker"
orca = true
env = { APP_WAIT_FACTOR = "5", APP_SLOW_INDEX = "0" }
TOML
"$payload/peregrine" envoy-bootstrap /tmp/app.toml > /tmp/envoy.yaml
"$payload/peregrine" run /tmp/app.toml > /tmp/app.log 2>&1 &
app=$!
"$payload/envoy" -c /tmp/envoy.yaml --concurrency 1 --base-id 7 > /tmp/envoy.log 2>&1 &
envoy=$!
if python3 "$payload/weights.py" 180; then
    :
else
    failed=1
    tail -n 40 /tmp/app.log /tmp/envoy.log
fi
kill -TERM "$envoy" "$app" 2>/dev/null
wait "$envoy" "$app"
exit $failed
