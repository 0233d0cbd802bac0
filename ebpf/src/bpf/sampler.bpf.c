// SPDX-License-Identifier: GPL-2.0-only OR Apache-2.0
/*
 * Peregrine's sampler: per-worker on-CPU time, run-queue wait and (through an mmapable map the workers
 * write) request counts, for the processes the supervisor tracks.
 *
 * CO-RE without a generated vmlinux.h: the one kernel type read here is declared below with only the
 * fields used, marked preserve_access_index, so libbpf-style relocations fix the offsets against the
 * running kernel's BTF at load time. tp_btf programs receive typed pointers and read them directly.
 *
 * Cost for a process that is not tracked: one hash lookup per scheduler event.
 */
#include <stdbool.h>
#include <linux/types.h>
#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_tracing.h>

#include "sampler.h"

#define TASK_RUNNING 0
#define TASK_DEAD 0x80

struct task_struct {
	int pid;
	int tgid;
} __attribute__((preserve_access_index));

/* Set by the loader before the object is loaded. */
const volatile __u32 lanes = 1;
const volatile __u32 nr_cpus = 1;

/* tgid -> worker lane; the supervisor inserts and removes entries as workers come and go. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 1); /* resized by the loader */
	__type(key, __u32);
	__type(value, __u32);
} tracked SEC(".maps");

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

static __always_inline int is_tracked(__u32 tgid)
{
	return bpf_map_lookup_elem(&tracked, &tgid) != NULL;
}

/* This CPU's cell for process tgid, or NULL if it is not tracked. */
static __always_inline struct peregrine_cell *cell_for(__u32 tgid)
{
	__u32 *lane = bpf_map_lookup_elem(&tracked, &tgid);
	if (!lane)
		return NULL;
	__u32 cpu = bpf_get_smp_processor_id();
	__u32 n = lanes;
	__u32 s = *lane;
	if (cpu >= nr_cpus || s >= n)
		return NULL;
	__u32 index = cpu * n + s;
	struct peregrine_cell *cell = bpf_map_lookup_elem(&cells, &index);
	if (!cell)
		return NULL;
	if (cell->tgid != tgid) {
		/*
		 * A new process in this lane. Scheduler tracepoints run with interrupts off and only
		 * programs on this CPU write this cell, so nothing interleaves with this reset. The tag
		 * is stored last, with a fully ordered exchange, so a reader that sees the new tag (and
		 * checks it again after its loads) never takes the old totals for the new process's.
		 */
		cell->on_cpu_ns = 0;
		cell->runq_wait_ns = 0;
		__sync_lock_test_and_set(&cell->tgid, tgid);
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

/* Tracing programs must be GPL-compatible; this file is GPL-2.0 (or Apache-2.0). */
char LICENSE[] SEC("license") = "GPL";
