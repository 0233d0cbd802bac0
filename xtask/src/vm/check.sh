#!/bin/sh
# Run inside the VM by its one unit (vm-check.service), from the read-only payload disk mounted at
# /payload: what the VM's own kernel gives the eBPF sampler. Each step prints one line
# `check: NAME: ok|FAILED|skipped: DETAIL`, which `cargo xtask vm` counts; what the steps ran is
# printed before their line.
payload=/payload
failed=0

say() { echo "check: $1: $2"; }

# `USER COMMAND LINE` of every process whose command line holds $1 (minbase has no procps).
processes() {
    for dir in /proc/[0-9]*; do
        line=$(tr '\0' ' ' < "$dir/cmdline" 2>/dev/null)
        case "$line" in
            *"$1"*) echo "$(stat -c %U "$dir") $line" ;;
        esac
    done
}

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

# The package under systemd, installed with apt from the payload (its dependencies are in the
# image: the VM has no network), started by its unit (Type=notify: `active` only once the
# supervisor said it is ready), then stopped and purged.
if apt-get install -y -q "$payload/peregrine.deb" > /tmp/apt.log 2>&1; then
    say install "ok: $(dpkg-query -W -f '${Package} ${Version}' peregrine) with apt, offline"
else
    failed=1
    cat /tmp/apt.log
    say install "FAILED: apt-get install of the package"
fi
systemctl start peregrine
state=$(systemctl is-active peregrine)
if [ "$state" = active ]; then
    say unit "ok: systemctl start: $(systemctl show -p Type --value peregrine) unit $state"
else
    failed=1
    journalctl -u peregrine --no-pager | tail -n 30
    say unit "FAILED: the unit is $state"
fi
tries=0
until peregrine status 2>/dev/null | grep -q 'sampler: ebpf' || [ $tries -ge 600 ]; do
    sleep 0.1
    tries=$((tries + 1))
done
workers=$(processes 'peregrine worker' | grep -c '^peregrine ')
if peregrine status 2>/dev/null | grep -q 'sampler: ebpf' && [ "$workers" -ge 1 ]; then
    say status "ok: peregrine status shows sampler: ebpf; $workers workers run as the peregrine user"
else
    failed=1
    peregrine status
    processes peregrine
    say status "FAILED: no eBPF sampler in peregrine status, or no worker of the peregrine user"
fi
systemctl stop peregrine
left=$( (processes 'peregrine run'; processes 'peregrine worker') | wc -l)
if [ "$(systemctl is-active peregrine)" != active ] && [ "$left" -eq 0 ]; then
    say stop "ok: systemctl stop: nothing of the supervisor or its workers left running"
else
    failed=1
    say stop "FAILED: $left processes left"
fi
apt-get purge -y -q peregrine > /tmp/purge.log 2>&1
leftovers=""
for path in /usr/bin/peregrine /etc/peregrine /lib/systemd/system/peregrine.service /usr/lib/systemd/system/peregrine.service; do
    [ -e "$path" ] && leftovers="$leftovers $path"
done
if ! dpkg-query -W -f '${Status}' peregrine 2>/dev/null | grep -q installed && [ -z "$leftovers" ]; then
    say purge "ok: apt-get purge left no package, binary, config or unit"
else
    failed=1
    cat /tmp/purge.log
    say purge "FAILED: left:$leftovers"
fi
exit $failed
