/* See fault_guard.h. The handler leaves a guarded function with siglongjmp, on the thread that
 * faulted. Guards sit in a global table of slots (thread, guard) rather than in thread-local
 * storage: a module loaded with dlopen reaches its thread-locals through __tls_get_addr, which
 * allocates on a thread's first access, and a handler that may run on any thread must not. */
#define _GNU_SOURCE
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stddef.h>
#include <string.h>

#include "fault_guard.h"

typedef struct {
    sigjmp_buf jump;
    const char *lo, *hi;
} guard_t;

/* A slot is free (0), being filled (1) or holds a running guard (2). More guards at once than
 * slots (kernel threads x calls at once) run unguarded rather than wait. */
#define GUARD_SLOTS 256
static struct {
    int state;
    pthread_t thread;
    guard_t *guard;
} slots[GUARD_SLOTS];
static int guards_running = 0;
static struct sigaction previous; /* the handler before ours, for signals that are not ours */

static guard_t *guard_of_this_thread(void) {
    if (!__atomic_load_n(&guards_running, __ATOMIC_ACQUIRE)) return NULL;
    pthread_t self = pthread_self();
    for (int i = 0; i < GUARD_SLOTS; i++)
        if (__atomic_load_n(&slots[i].state, __ATOMIC_ACQUIRE) == 2 && pthread_equal(slots[i].thread, self))
            return slots[i].guard;
    return NULL;
}

static void on_sigbus(int sig, siginfo_t *info, void *context) {
    if (info->si_code > 0) { /* a fault (not a signal someone sent) */
        guard_t *guard = guard_of_this_thread();
        const char *at = (const char *)info->si_addr;
        if (guard && at >= guard->lo && at < guard->hi) siglongjmp(guard->jump, 1);
    }
    /* Not ours: as if we were not here. The handler before ours runs first (faulthandler prints
     * its traceback; a library that recovers from its own faults jumps away and never returns). */
    struct sigaction before = previous;
    int handler = (before.sa_flags & SA_SIGINFO) ? before.sa_sigaction != NULL
                                                 : before.sa_handler != SIG_DFL && before.sa_handler != SIG_IGN;
    if (handler) {
        if (before.sa_flags & SA_SIGINFO)
            before.sa_sigaction(sig, info, context);
        else
            before.sa_handler(sig);
    }
    if (info->si_code > 0) {
        /* A fault comes back when the instruction runs again. Whatever handled it returned, so
         * the default action takes the next one: no two handlers can pass it back and forth. */
        signal(sig, SIG_DFL);
    } else if (!handler && before.sa_handler != SIG_IGN) {
        signal(sig, SIG_DFL); /* sent, and the default action was in place: take it */
        raise(sig);
    }
}

int fault_guard_ready(void) {
    struct sigaction now, ours;
    if (sigaction(SIGBUS, NULL, &now) != 0) return 0;
    if ((now.sa_flags & SA_SIGINFO) && now.sa_sigaction == on_sigbus) return 1;
    memset(&ours, 0, sizeof ours);
    ours.sa_sigaction = on_sigbus;
    ours.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&ours.sa_mask);
    previous = now; /* (ours is not in place: no signal of ours can be reading it) */
    return sigaction(SIGBUS, &ours, NULL) == 0;
}

int fault_guarded(void (*fn)(void *), void *arg, const void *lo, const void *hi) {
    guard_t guard;
    guard.lo = (const char *)lo, guard.hi = (const char *)hi;
    int slot = -1;
    for (int i = 0; i < GUARD_SLOTS && slot < 0; i++) {
        int free_state = 0;
        if (__atomic_compare_exchange_n(&slots[i].state, &free_state, 1, 0, __ATOMIC_ACQUIRE, __ATOMIC_RELAXED))
            slot = i;
    }
    if (slot < 0) { /* (no slot: unguarded, as without the guard) */
        fn(arg);
        return 0;
    }
    int faulted = 0;
    /* 1: the signal mask is restored on the jump back (SIGBUS is blocked inside the handler) */
    if (sigsetjmp(guard.jump, 1)) {
        faulted = 1;
    } else {
        slots[slot].thread = pthread_self();
        slots[slot].guard = &guard;
        __atomic_fetch_add(&guards_running, 1, __ATOMIC_ACQ_REL);
        __atomic_store_n(&slots[slot].state, 2, __ATOMIC_RELEASE);
        fn(arg);
    }
    __atomic_store_n(&slots[slot].state, 0, __ATOMIC_RELEASE);
    __atomic_fetch_sub(&guards_running, 1, __ATOMIC_ACQ_REL);
    return faulted;
}
