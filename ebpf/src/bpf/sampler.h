/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Layouts shared by the kernel program (sampler.bpf.c) and user space (src/layout.rs mirrors each type
 * with #[repr(C)] and asserts its size). Change both together.
 */
#ifndef PEREGRINE_SAMPLER_H
#define PEREGRINE_SAMPLER_H

/* One cache line: entries written by different CPUs or processes never share a line. */
#define PEREGRINE_LINE 64

/*
 * A value of map `tracked` (key: a tgid): the lane the process is accounted to and its *root*, the
 * process the supervisor tracked. A root's entry names itself; a descendant's (inserted by the fork
 * program for a process a tracked process forked, at any depth) names the root it inherited.
 */
struct peregrine_tracked {
	__u32 lane;
	__u32 root;
};

/*
 * Scheduler totals of one worker lane, as seen by one CPU: map `cells`, entry `cpu * lanes + lane`.
 * Only programs running on `cpu` write it, so no two CPUs ever contend for a line. `tgid` says whose
 * totals these are, a root's (its descendants' time adds to it): the first event of a process with
 * another root in the lane on that CPU zeroes the cell.
 */
struct peregrine_cell {
	__u32 tgid;
	__u32 _pad;
	/* Nanoseconds on a CPU (from the scheduler's own runtime accounting). */
	__u64 on_cpu_ns;
	/* Nanoseconds runnable but waiting for a CPU (wake-up or preemption -> switched in). */
	__u64 runq_wait_ns;
	__u64 _reserved[5];
};

/*
 * The request counter of one worker lane: map `counters` (BPF_F_MMAPABLE), entry `lane`. The worker
 * maps the map's descriptor and increments `requests` once per request; or, for a lane whose
 * listening port is set (map `ports`), the send program increments it once per send on an
 * accepted socket of that port (and such a worker does not count). A memfd with the same layout
 * stands in where eBPF cannot load.
 */
struct peregrine_counter {
	__u64 requests;
	__u64 in_flight; /* kept by a worker that counts its own requests; never written here */
	__u64 features;
	__u64 _reserved[5];
};

/*
 * Map `descendants` (BPF_F_MMAPABLE, one entry): how many entries of `tracked` are descendants'. The
 * fork program adds one per entry it inserts and refuses past its budget (so the roots' room in
 * `tracked` is never taken); whoever deletes a descendant's entry (the exit program, a program that
 * finds it stale, or user space untracking its root) subtracts one, atomically.
 */
struct peregrine_descendants {
	__u64 entries;
	__u64 _reserved[7];
};

#endif
