/* A kernel's team form, and the entry point that gives it a team.
 *
 * A kernel called by the C layer loop (decode_layers.c) comes in two forms. Its team form is called by every
 * thread of an enclosing OpenMP parallel region with the same arguments: each thread takes its share through
 * an orphaned `omp for`, whose closing barrier ends the call, and every thread returns the same code. Called
 * outside any region, the one caller does it all. The split depends on the kernel's arguments (num_threads
 * among them), never on the team, and no output's arithmetic depends on the split. Its entry point (what
 * Python calls) opens a region and runs the team form on it. So the layer loop runs a whole step in one region:
 * no fork and join per kernel, whose cost and restart of the weight stream were ~15% of a batch-1 step.
 */
#ifndef KVBATON_TEAM_H
#define KVBATON_TEAM_H

/* `call`, an int-returning team form, on a team of `threads` threads: its code (the master's; every thread
 * returns the same). */
#define ON_TEAM(threads, call)                                  \
    __extension__({                                             \
        const int team_threads_ = (threads);                    \
        int team_code_ = 0;                                     \
        _Pragma("omp parallel num_threads(team_threads_)")      \
        {                                                       \
            const int mine_ = (call);                           \
            _Pragma("omp master")                               \
            team_code_ = mine_;                                 \
        }                                                       \
        team_code_;                                             \
    })

#endif
