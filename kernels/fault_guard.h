/* Reading a memory-mapped file safely: a copy from the mapping of a file that shrinks under it
 * (another program truncates it; an NFS file is replaced on another host) faults with SIGBUS
 * instead of reading short. fault_guarded runs a function with that fault turned into a return
 * value, so the caller can refuse the bytes as it would refuse a file that ends early.
 *
 * Only faults at addresses the guard names, on the thread that runs it, are caught. Any other
 * SIGBUS goes where it would have gone without the guard: to the handler installed before it
 * (Python's faulthandler, say), or the default action. A guarded function must not take locks
 * or allocate: a fault leaves it where it stood. */
#ifndef KVTOOL_FAULT_GUARD_H
#define KVTOOL_FAULT_GUARD_H

/* Install the SIGBUS handler if it is not the one in place (call with the GIL held, before
 * guarded work starts on any thread); 0 when it cannot be installed: do not map then. */
int fault_guard_ready(void);

/* fn(arg); 1 when a SIGBUS at an address in [lo, hi) on this thread cut it short, else 0. */
int fault_guarded(void (*fn)(void *), void *arg, const void *lo, const void *hi);

#endif
