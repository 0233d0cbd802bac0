// SPDX-License-Identifier: GPL-2.0-only OR Apache-2.0
/*
 * Peregrine's sampler: per-worker on-CPU time, run-queue wait and request counts, for the processes
 * the supervisor tracks and the processes they fork.
 *
 * Process trees. The supervisor inserts each worker (the *root*) in map `tracked`; a process that a
 * tracked process forks (a new thread group, not a thread) is inserted by the fork program with its
 * parent's lane and root, so grandchildren inherit the root too, and removed by the exit program when
 * its thread group dies (its last thread exits). Cells are tagged with the root: a descendant's time adds to its
 * root's totals. An entry whose root is no longer tracked as a root in the same lane (a fork that
 * raced the root's untracking) is stale: it counts nothing and is deleted when found. Descendants
 * have a budget of entries (`max_descendants`, set by the loader); past it, or when the map is full,
 * a new child is simply not counted.
 *
 * Requests. Workers count their requests in map `counters` themselves. For a lane whose listening
 * port is set in map `ports` (a server that cannot count, on a listener the supervisor passed it),
 * the send program counts instead, on the socket layer's send tracepoint (sock_send_length, once per
 * send call, with its result; fentry on tcp_sendmsg would need BPF trampolines, which some kernels
 * refuse): one per send call that sent bytes, by a process of the lane, on a TCP socket whose local
 * port is that port, i.e. on a connection the listener accepted (never on the server's own outgoing
 * connections, whose local ports are ephemeral). A response written in two sends counts two: the
 * count scales with requests the same way on every worker of a service.
 *
 * CO-RE without a generated vmlinux.h: the kernel types read here are declared below with only the
 * fields used, marked preserve_access_index, so libbpf-style relocations fix the offsets against the
 * running kernel's BTF at load time. tp_btf programs receive typed pointers and read them directly.
 *
 * Cost for a process that is not tracked: one hash lookup per scheduler event, per fork, per
 * process exit (a thread's exit reads one counter) and per socket send that sent bytes.
 */
#include <stdbool.h>
#include <linux/types.h>
#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_tracing.h>

#include "sampler.h"

#define TASK_RUNNING 0
#define TASK_DEAD 0x80

/* The kernel's atomic_t. */
struct peregrine_atomic {
	int counter;
};

struct signal_struct {
	struct peregrine_atomic live; /* the thread group's threads that have not begun to exit */
} __attribute__((preserve_access_index));

struct task_struct {
	int pid;
	int tgid;
	struct signal_struct *signal;
} __attribute__((preserve_access_index));

#define AF_INET 2
#define AF_INET6 10
#define IPPROTO_TCP 6

/* The kernel's skc_num sits in an anonymous union; relocations match it by name. */
struct sock_common {
	__u16 skc_num; /* the local port, host byte order */
	unsigned short skc_family;
} __attribute__((preserve_access_index));

struct sock {
	struct sock_common __sk_common;
	__u16 sk_protocol;
} __attribute__((preserve_access_index));

/* Only passed through: tcp_sendmsg's second argument. */
struct msghdr;

/* Set by the loader before the object is loaded. */
const volatile __u32 lanes = 1;
const volatile __u32 nr_cpus = 1;
const volatile __u64 max_descendants = 0;

/*
 * tgid -> struct peregrine_tracked (lane, root). The supervisor inserts and removes the roots; the
 * fork and exit programs insert and remove the descendants (and user space removes a root's
 * descendants with it).
 */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 1); /* resized by the loader: room for the roots plus max_descendants */
	__type(key, __u32);
	__type(value, struct peregrine_tracked);
} tracked SEC(".maps");

/* struct peregrine_descendants: the descendants' entries in `tracked`, against their budget. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(map_flags, BPF_F_MMAPABLE);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct peregrine_descendants);
} descendants SEC(".maps");

/* lane -> the listening port whose accepted sockets' sends count as requests; 0: not counted. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1); /* resized by the loader: lanes */
	__type(key, __u32);
	__type(value, __u16);
} ports SEC(".maps");

/* struct peregrine_cell per (CPU, lane), at cpu * lanes + lane; read by user space through mmap. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(map_flags, BPF_F_MMAPABLE);
	__uint(max_entries, 1); /* resized by the loader: nr_cpus * lanes */
	__type(key, __u32);
	__type(value, struct peregrine_cell);
} cells SEC(".maps");

/* struct peregrine_counter per lane; the workers map it and count their requests. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(map_flags, BPF_F_MMAPABLE);
	__uint(max_entries, 1); /* resized by the loader: lanes */
	__type(key, __u32);
	__type(value, struct peregrine_counter);
} counters SEC(".maps");

/*
 * Thread id -> when it became runnable (woken, or preempted while runnable). Removed when the thread
 * is switched in; LRU so that a thread that exits while waiting cannot leak an entry for long.
 */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 16384);
	__type(key, __u32);
	__type(value, __u64);
} runnable SEC(".maps");

/* Deletes descendant tgid's entry; the one that deletes it gives its place back to the budget. */
static __always_inline void forget_descendant(__u32 tgid)
{
	if (bpf_map_delete_elem(&tracked, &tgid) != 0)
		return;
	__u32 zero = 0;
	struct peregrine_descendants *d = bpf_map_lookup_elem(&descendants, &zero);
	if (d)
		__sync_fetch_and_sub(&d->entries, 1);
}

/*
 * What process tgid is accounted as (its lane and root), or false if it is not tracked. A
 * descendant counts only while its root is tracked as a root in the same lane; otherwise its entry
 * is stale (its fork raced the root's untracking) and is deleted here.
 */
static __always_inline bool accounted(__u32 tgid, struct peregrine_tracked *out)
{
	struct peregrine_tracked *entry = bpf_map_lookup_elem(&tracked, &tgid);
	if (!entry)
		return false;
	struct peregrine_tracked e = *entry;
	if (e.root != tgid) {
		__u32 root = e.root;
		struct peregrine_tracked *r = bpf_map_lookup_elem(&tracked, &root);
		if (!r || r->root != root || r->lane != e.lane) {
			forget_descendant(tgid);
			return false;
		}
	}
	*out = e;
	return true;
}

static __always_inline bool is_tracked(__u32 tgid)
{
	struct peregrine_tracked e;
	return accounted(tgid, &e);
}

/* This CPU's cell for process tgid (its root's), or NULL if it is not tracked. */
static __always_inline struct peregrine_cell *cell_for(__u32 tgid)
{
	struct peregrine_tracked e;
	if (!accounted(tgid, &e))
		return NULL;
	__u32 cpu = bpf_get_smp_processor_id();
	__u32 n = lanes;
	__u32 s = e.lane;
	if (cpu >= nr_cpus || s >= n)
		return NULL;
	__u32 index = cpu * n + s;
	struct peregrine_cell *cell = bpf_map_lookup_elem(&cells, &index);
	if (!cell)
		return NULL;
	if (cell->tgid != e.root) {
		/*
		 * A new root in this lane. Scheduler tracepoints run with interrupts off and only
		 * programs on this CPU write this cell, so nothing interleaves with this reset. The tag
		 * is stored last, with a fully ordered exchange, so a reader that sees the new tag (and
		 * checks it again after its loads) never takes the old totals for the new process's.
		 */
		cell->on_cpu_ns = 0;
		cell->runq_wait_ns = 0;
		__sync_lock_test_and_set(&cell->tgid, e.root);
	}
	return cell;
}

static __always_inline void mark_runnable(struct task_struct *task)
{
	if (!is_tracked(task->tgid))
		return;
	__u32 tid = task->pid;
	__u64 now = bpf_ktime_get_ns();
	bpf_map_update_elem(&runnable, &tid, &now, BPF_ANY);
}

/*
 * The scheduler's own runtime accounting (update_curr): at every switch, tick and preemption check,
 * the nanoseconds the running task used since the last update. A task that spins without being
 * switched out is still accounted at every tick.
 */
SEC("tp_btf/sched_stat_runtime")
int BPF_PROG(on_runtime, struct task_struct *task, __u64 runtime)
{
	struct peregrine_cell *cell = cell_for(task->tgid);
	if (cell)
		cell->on_cpu_ns += runtime;
	return 0;
}

SEC("tp_btf/sched_wakeup")
int BPF_PROG(on_wakeup, struct task_struct *task)
{
	mark_runnable(task);
	return 0;
}

SEC("tp_btf/sched_wakeup_new")
int BPF_PROG(on_wakeup_new, struct task_struct *task)
{
	mark_runnable(task);
	return 0;
}

SEC("tp_btf/sched_switch")
int BPF_PROG(on_switch, bool preempt, struct task_struct *prev, struct task_struct *next,
	     unsigned int prev_state)
{
	if (prev_state & TASK_DEAD) {
		/*
		 * Its last switch: drop any entry it left, even if it is no longer tracked (its parent
		 * may have reaped it, and the supervisor untracked it, before this final switch).
		 * Deaths are rare, so the unconditional delete costs nothing on the hot path.
		 */
		__u32 dead_tid = prev->pid;
		bpf_map_delete_elem(&runnable, &dead_tid);
	} else if (is_tracked(prev->tgid)) {
		__u32 prev_tid = prev->pid;
		if (preempt || prev_state == TASK_RUNNING) {
			/* Preempted (or yielding) while runnable: it waits for a CPU from now on. */
			__u64 now = bpf_ktime_get_ns();
			bpf_map_update_elem(&runnable, &prev_tid, &now, BPF_ANY);
		} else {
			/*
			 * Going to sleep (or exiting). A wake-up that arrived while it was still running
			 * (try_to_wake_up on a task that had not yet slept) left an entry that no switch-in
			 * consumed: drop it, or it would count running time as waiting, or outlive the task.
			 */
			bpf_map_delete_elem(&runnable, &prev_tid);
		}
	}

	struct peregrine_cell *cell = cell_for(next->tgid);
	if (!cell)
		return 0;
	__u32 tid = next->pid;
	__u64 *since = bpf_map_lookup_elem(&runnable, &tid);
	if (since) {
		__u64 now = bpf_ktime_get_ns();
		if (now > *since)
			cell->runq_wait_ns += now - *since;
		bpf_map_delete_elem(&runnable, &tid);
	}
	return 0;
}

/*
 * A new task. A child process (a new thread group: pid == tgid) of a tracked process joins its
 * parent's lane under the same root, before it first runs (the tracepoint fires before
 * wake_up_new_task). Threads belong to their process's entry already.
 */
SEC("tp_btf/sched_process_fork")
int BPF_PROG(on_fork, struct task_struct *parent, struct task_struct *child)
{
	__u32 tgid = child->tgid;
	if (child->pid != child->tgid)
		return 0;
	struct peregrine_tracked e;
	if (!accounted(parent->tgid, &e))
		return 0;
	__u32 zero = 0;
	struct peregrine_descendants *d = bpf_map_lookup_elem(&descendants, &zero);
	if (!d)
		return 0;
	/* Its place in the budget first, so that concurrent forks never exceed it. */
	if (__sync_fetch_and_add(&d->entries, 1) >= max_descendants) {
		__sync_fetch_and_sub(&d->entries, 1);
		return 0;
	}
	/* A full map (or an entry the pid already has) leaves the child uncounted. */
	if (bpf_map_update_elem(&tracked, &tgid, &e, BPF_NOEXIST) != 0)
		__sync_fetch_and_sub(&d->entries, 1);
	return 0;
}

/*
 * A task exits. When a descendant's thread group is dead (its last thread has begun to exit:
 * do_exit has counted signal->live down to 0 before this tracepoint), its entry goes; a root's
 * stays until the supervisor removes it. Not the leader's exit: a leader may exit before its
 * threads, and exec from another thread kills the leader while the process lives on. (Two threads
 * exiting at once may both see 0; the second delete finds nothing.)
 */
SEC("tp_btf/sched_process_exit")
int BPF_PROG(on_exit, struct task_struct *task)
{
	__u32 tgid = task->tgid;
	if (task->signal->live.counter != 0)
		return 0;
	struct peregrine_tracked *entry = bpf_map_lookup_elem(&tracked, &tgid);
	if (entry && entry->root != tgid)
		forget_descendant(tgid);
	return 0;
}

/*
 * A send that sent bytes on socket sk, by the current process: for a process of a lane with a
 * listening port, a send on a TCP socket whose local port is that port (a connection the passed
 * listener accepted) counts one request.
 */
static __always_inline void count_send(struct sock *sk)
{
	__u32 tgid = bpf_get_current_pid_tgid() >> 32;
	struct peregrine_tracked e;
	if (!accounted(tgid, &e))
		return;
	__u32 lane = e.lane;
	__u16 *port = bpf_map_lookup_elem(&ports, &lane);
	if (!port || *port == 0)
		return;
	__u16 family = sk->__sk_common.skc_family;
	if ((family != AF_INET && family != AF_INET6) || sk->sk_protocol != IPPROTO_TCP ||
	    sk->__sk_common.skc_num != *port)
		return;
	struct peregrine_counter *counter = bpf_map_lookup_elem(&counters, &lane);
	if (counter)
		__sync_fetch_and_add(&counter->requests, 1);
}

/*
 * A send on a socket has returned (sock_sendmsg: send, sendto, sendmsg, sendmmsg's each message,
 * write on a socket, io_uring's sends, splice and sendfile to a socket). Linux 6.3 and later.
 */
SEC("tp_btf/sock_send_length")
int BPF_PROG(on_send, struct sock *sk, int ret)
{
	if (ret > 0)
		count_send(sk);
	return 0;
}

/*
 * The same count where the kernel has no sock_send_length (before Linux 6.3, such as Debian 12's
 * 6.1): tcp_sendmsg has returned. It sees what on_send sees on TCP, except splice and sendfile
 * before Linux 6.5 (which went through tcp_sendpage). Attached only where on_send cannot be, so that
 * no send counts twice.
 */
SEC("fexit/tcp_sendmsg")
int BPF_PROG(on_tcp_sendmsg, struct sock *sk, struct msghdr *msg, __u64 size, int ret)
{
	if (ret > 0)
		count_send(sk);
	return 0;
}

/* Tracing programs must be GPL-compatible; this file is GPL-2.0 (or Apache-2.0). */
char LICENSE[] SEC("license") = "GPL";
