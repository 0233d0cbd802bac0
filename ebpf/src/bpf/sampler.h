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
 * Scheduler totals of one worker lane, as seen by one CPU: map `cells`, entry `cpu * lanes + lane`.
 * Only programs running on `cpu` write it, so no two CPUs ever contend for a line. `tgid` says whose
 * totals these are: the first event of a new process in the lane on that CPU zeroes the cell.
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
 * maps the map's descriptor and increments `requests` once per request; nothing else writes it.
 * A memfd with the same layout stands in where eBPF cannot load.
 */
struct peregrine_counter {
	__u64 requests;
	__u64 _reserved[7];
};

#endif
