"""OpenMP's wait policy for the command lines: imported by each before anything loads PyTorch, whose OpenMP runtime
reads OMP_WAIT_POLICY (and GNU OpenMP its GOMP_SPINCOUNT) once, when it loads.

Threads that spin while they wait starve everything else on a shared CPU, our own loader workers included: a small
bf16 training step on 2 cores beside other work ran at 1.1 images/s with spinning threads, 9.7 with one thread and
14.3 with two threads waiting passively (an AMD EPYC). Threads that sleep at once pay a wake-up between every two
operators instead: on a 2-core Xeon the toy-small bf16 step at 16x16 ran at 170 images/s passive against 260
spinning. So unless the user chose a policy, waiting threads spin briefly and then sleep: GOMP_SPINCOUNT bounds the
spin of GNU OpenMP (the runtime of PyTorch's Linux wheels), 30,000 turns, about 0.3 ms; other runtimes read PASSIVE
and sleep at once. On that Xeon the step then ran at 260 images/s quiet and 120 beside two busy processes, where
passive waiting gave 170 and 44 (scripts/bench_load.py).
"""

import os

USER_POLICY = os.environ.get("OMP_WAIT_POLICY")
USER_SPIN = os.environ.get("GOMP_SPINCOUNT")
if USER_POLICY is None:
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    os.environ.setdefault("GOMP_SPINCOUNT", "30000")  # GNU OpenMP: it overrides PASSIVE's spin count of 0


def users_environment() -> dict[str, str]:
    """os.environ as the user set it, without the policy this module chose: the environment for another command
    line this one starts, which chooses (and says it chose) the same."""
    ours = {"OMP_WAIT_POLICY"} if USER_POLICY is None else set()
    ours |= {"GOMP_SPINCOUNT"} if USER_POLICY is None and USER_SPIN is None else set()
    return {name: value for name, value in os.environ.items() if name not in ours}


def describe() -> str:
    """The policy in force and who chose it, for a command's start line."""
    if USER_POLICY is not None:
        return f"OpenMP wait policy {USER_POLICY} (OMP_WAIT_POLICY, as set)"
    spin = os.environ["GOMP_SPINCOUNT"]
    said = "our default" if USER_SPIN is None else "GOMP_SPINCOUNT, as set"
    return (f"OpenMP wait policy PASSIVE after a spin of {spin} turns ({said}: long spins starve a shared CPU, "
            "immediate sleep slows every step; OMP_WAIT_POLICY overrides)")
