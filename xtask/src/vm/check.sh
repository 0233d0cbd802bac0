#!/bin/sh
# Run inside the VM by its one unit (vm-check.service), from the read-only payload disk mounted at
# /payload: what the VM's own kernel gives the eBPF sampler. Each step prints one line
# `check: NAME: ok|FAILED|skipped: DETAIL`, which `cargo xtask vm` counts; what the steps ran is
# printed before their line.
payload=/payload
failed=0

say() { echo "check: $1: $2"; }
# A fact of this kernel for the docs' table (docs/kernels.md), which `cargo xtask vm` checks.
fact() { echo "fact: $1: $2"; }

# The supervisor's warnings and errors since its unit started, each kind once with its count
# (pids and numbers folded), then its last lines: what a failed step prints.
journal_summary() {
    journalctl -u peregrine -o cat --no-pager | grep -E 'ERROR|WARN|error' \
        | sed -e 's/^[0-9TZ:.-]* *//' -e 's/[0-9][0-9]*/N/g' | cut -c1-240 \
        | sort | uniq -c | sort -rn | head -n 15
    journalctl -u peregrine --no-pager | tail -n 15
}

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
fact kernel "$(uname -r | cut -d. -f1,2)"
if [ -r /sys/kernel/btf/vmlinux ]; then
    say btf "ok: /sys/kernel/btf/vmlinux"
    fact btf yes
else
    say btf "FAILED: no /sys/kernel/btf/vmlinux"
    fact btf no
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
    fact probe "$(grep -c '^test .* ok$' /tmp/probe.log) passed, none skipped"
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
fact sampler "$(echo "$chosen" | sed -n 's/.* sampler="\([a-z]*\)".*/\1/p')"
fact sends "$(echo "$chosen" | sed -n 's/.* sends=//p')"
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
    fact in_flight "socket tables (sock_diag), weighed by Envoy"
else
    failed=1
    tail -n 40 /tmp/app.log /tmp/envoy.log
fi
kill -TERM "$envoy" "$app" 2>/dev/null
wait "$envoy" "$app"

# The package under systemd, installed with apt from the payload (its dependencies are in the
# image: the VM has no network), started by its unit (Type=notify: `active` only once the
# supervisor said it is ready, with the real watchdog), served through Envoy run by the example
# unit the package ships, reloaded with more workers, upgraded under load, stopped and purged.
if apt-get install -y -q "$payload/peregrine.deb" > /tmp/apt.log 2>&1; then
    say install "ok: $(dpkg-query -W -f '${Package} ${Version}' peregrine) with apt, offline"
else
    failed=1
    cat /tmp/apt.log
    say install "FAILED: apt-get install of the package"
fi
systemctl start peregrine
state=$(systemctl is-active peregrine)
main=$(systemctl show -p MainPID --value peregrine)
watchdog=$(systemctl show -p WatchdogUSec --value peregrine)
if [ "$state" = active ]; then
    say unit "ok: systemctl start: $(systemctl show -p Type --value peregrine) unit $state, watchdog $watchdog, main pid $main"
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

# Envoy, the pinned binary, as the example unit runs it: its bootstrap written from the installed
# config at each start.
install -m 0755 "$payload/envoy" /usr/local/bin/envoy
cp /usr/share/doc/peregrine/examples/envoy.service /etc/systemd/system/envoy.service
systemctl daemon-reload
systemctl start envoy
python3 "$payload/host.py" every envoy 2 180 || {
    failed=1
    systemctl status envoy --no-pager | tail -n 5
    journalctl -u envoy --no-pager | tail -n 20
}

# A changed count, applied by `systemctl reload` (peregrine reload).
sed -i 's/^count = 2$/count = 3/' /etc/peregrine/peregrine.toml
if systemctl reload peregrine; then
    python3 "$payload/host.py" every reload 3 180 || failed=1
else
    failed=1
    journalctl -u peregrine --no-pager | tail -n 20
    say reload "FAILED: systemctl reload peregrine failed"
fi

# The logs are in the journal: the start and the reload.
journal=$(journalctl -u peregrine --no-pager -o cat)
if echo "$journal" | grep -q 'Serving xDS' && echo "$journal" | grep -q 'Control command done'; then
    say journal "ok: journalctl -u peregrine holds the start (Serving xDS) and the reload ($(echo "$journal" | grep -c .) lines)"
else
    failed=1
    echo "$journal" | tail -n 20
    say journal "FAILED: no start or no reload in journalctl -u peregrine"
fi

# The package upgraded in place under HTTP/1.1 and HTTP/2 load through Envoy: not one request lost.
python3 "$payload/host.py" upgrade upgrade "$payload/peregrine-next.deb" "$payload/http-load" 300 || {
    failed=1
    journal_summary
}

# The watchdog: pinged all along (the last ping within one period, minutes after the start),
# never fired (no restart, the same main pid).
restarts=$(systemctl show -p NRestarts --value peregrine)
pinged=$(systemctl show -p WatchdogTimestampMonotonic --value peregrine)
started=$(systemctl show -p ExecMainStartTimestampMonotonic --value peregrine)
now_main=$(systemctl show -p MainPID --value peregrine)
now=$(awk '{ printf "%d", $1 * 1000000 }' /proc/uptime)
seconds=$(echo "$watchdog" | sed -n 's/^\([0-9][0-9]*\)s$/\1/p')
period=$(( ${seconds:-0} * 1000000 ))
since_ping=$(( (now - ${pinged:-0}) / 1000000 ))
up=$(( (now - ${started:-0}) / 1000000 ))
if [ "$period" -gt 0 ] && [ "$restarts" = 0 ] && [ "$now_main" = "$main" ] && [ $((now - ${pinged:-0})) -le "$period" ] && [ "$up" -gt $((period / 1000000)) ]; then
    say watchdog "ok: WatchdogSec $watchdog: last ping ${since_ping} s ago, ${up} s after the start; 0 restarts, the same main pid"
else
    failed=1
    say watchdog "FAILED: watchdog $watchdog, restarts $restarts, main pid $main then $now_main, last ping ${since_ping} s ago, up ${up} s"
fi

# Many workers under the unit's limits (tasks, descriptors, locked memory). A supervisor sizes its
# tables at start, so growing past them takes a restart (a stop, which drains and stops every
# worker, and a start).
sed -i 's/^count = 3$/count = 256/' /etc/peregrine/peregrine.toml
if systemctl restart peregrine; then
    python3 "$payload/host.py" hosts many 256 420 || {
        failed=1
        journal_summary
    }
else
    failed=1
    journal_summary
    say many "FAILED: systemctl restart peregrine with 256 workers failed"
fi

systemctl stop envoy
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
# The README's install from source, its own commands (taken from README.md when the payload was
# made; `sudo` is root's here), on the host the purge left: the binary, the config and the unit put
# in place as the package would, with the system user the config's workers run as, and the unit
# started by those commands.
if (cd "$payload/tree" && sh -ec 'sudo() { "$@"; }; . "$1"' from-source "$payload/from-source.sh") > /tmp/from-source.log 2>&1; then
    if [ "$(systemctl is-active peregrine)" = active ]; then
        python3 "$payload/host.py" direct from_source 2 120 || {
            failed=1
            journal_summary
        }
    else
        failed=1
        journal_summary
        say from_source "FAILED: the README's commands left the unit $(systemctl is-active peregrine)"
    fi
else
    failed=1
    cat /tmp/from-source.log
    journal_summary
    say from_source "FAILED: the README's install commands failed"
fi
systemctl disable --now peregrine > /dev/null 2>&1
rm -f /usr/bin/peregrine /etc/systemd/system/peregrine.service
rm -rf /etc/peregrine
exit $failed
