/* See fault_guard.h. The handler leaves a guarded function with siglongjmp, on the thread that
 * faulted: that thread's guard (thread-local) holds the jump and the address range it answers
 * for. The thread set its guard before anything could fault, so its thread-local block exists
 * and reading it in the handler allocates nothing. (Not the initial-exec TLS model: a module
 * loaded with dlopen has only a small surplus of static TLS, and running out fails the import.) */
#define _GNU_SOURCE
#include <setjmp.h>
#include <signal.h>
#include <stddef.h>
#include <string.h>

#include "fault_guard.h"

typedef struct {
    sigjmp_buf jump;
    const char *lo, *hi;
} guard_t;

static _Thread_local guard_t *volatile active;
static struct sigaction previous; /* the handler before ours, for faults that are not ours */

static void on_sigbus(int sig, siginfo_t *info, void *context) {
    guard_t *guard = active;
    const char *at = (const char *)info->si_addr;
    if (guard && info->si_code > 0 && at >= guard->lo && at < guard->hi) {
        active = NULL;
        siglongjmp(guard->jump, 1);
    }
    /* Not ours: whatever runs next, a fault again ends the process (the default action), so a
     * handler before ours that returns (faulthandler, once it has printed its traceback) cannot
     * loop with this one. */
    struct sigaction before = previous;
    signal(sig, SIG_DFL);
    if ((before.sa_flags & SA_SIGINFO) && before.sa_sigaction)
        before.sa_sigaction(sig, info, context);
    else if (!(before.sa_flags & SA_SIGINFO) && before.sa_handler != SIG_DFL && before.sa_handler != SIG_IGN)
        before.sa_handler(sig);
    if (info->si_code <= 0) raise(sig); /* sent, not a fault: it would not come back by itself */
}

int fault_guard_ready(void) {
    struct sigaction now, ours;
    if (sigaction(SIGBUS, NULL, &now) != 0) return 0;
    if ((now.sa_flags & SA_SIGINFO) && now.sa_sigaction == on_sigbus) return 1;
    memset(&ours, 0, sizeof ours);
    ours.sa_sigaction = on_sigbus;
    ours.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&ours.sa_mask);
    previous = now; /* (ours is not in place: no fault of ours can be reading it) */
    return sigaction(SIGBUS, &ours, NULL) == 0;
}

int fault_guarded(void (*fn)(void *), void *arg, const void *lo, const void *hi) {
    guard_t guard;
    guard.lo = (const char *)lo, guard.hi = (const char *)hi;
    /* 1: the signal mask is restored on the jump back (SIGBUS is blocked inside the handler) */
    if (sigsetjmp(guard.jump, 1)) return 1;
    active = &guard;
    __atomic_signal_fence(__ATOMIC_SEQ_CST);
    fn(arg);
    __atomic_signal_fence(__ATOMIC_SEQ_CST);
    active = NULL;
    return 0;
}
