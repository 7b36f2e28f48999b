// omp_policy.h: how this process's idle OpenMP threads wait. Defines omp_policy_apply, the first
// call of both trainers' main.
// libgomp lets a thread that has finished its share of a parallel region spin for a while before
// it sleeps (GOMP_SPINCOUNT, 300,000 iterations by default). Alone on a machine that saves a wake-up
// per region; on cores shared with other work (other ranks, other jobs, the CI machine's other
// tests) the spinning threads take the cores the working threads need: the SmolLM2-135M step
// measured 4-5x slower by default than with OMP_WAIT_POLICY=passive on this project's shared 2-core
// machine, and the scripts had to set it. The CPU kernels now run few, large parallel regions (one
// per product, llmc/cpu/matmul.h), so the cost of sleeping between them is small: passive is the
// default. libgomp reads the variable once, when the library loads, so setting it in main is too
// late for this process: when neither OMP_WAIT_POLICY nor GOMP_SPINCOUNT is set, the process sets
// OMP_WAIT_POLICY=passive and executes itself again (/proc/self/exe, same arguments), once. Setting
// either variable (OMP_WAIT_POLICY=active to spin) keeps the process as it is; so does running
// under a tool that should follow it (valgrind does not follow an exec by default: set the
// variable there).
#pragma once
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
#include "../settings.h"

// libgomp's own variables, not settings of ours: rows of llmc/settings.h's table of the role
// SETTING_OUTSIDE, read as libgomp reads them.
static void omp_policy_apply(char** argv) {
    if (setting_outside(SETTING_OMP_WAIT_POLICY) || setting_outside(SETTING_GOMP_SPINCOUNT)) return;
    if (setenv("OMP_WAIT_POLICY", "passive", 1) != 0) return;
    execv("/proc/self/exe", argv);
    // exec failed (no /proc): run on with libgomp's default policy, which only costs speed
    fprintf(stderr,
            "note: could not re-execute with OMP_WAIT_POLICY=passive (%s); set it in the environment on shared cores\n",
            argv[0]);
}
