"""OpenMP's wait policy for the command lines: imported by each before anything loads PyTorch, whose OpenMP runtime
reads OMP_WAIT_POLICY once, when it loads.

Threads that spin while they wait starve everything else on a shared CPU, our own loader workers included: a small
bf16 training step on 2 cores beside other work ran at 1.1 images/s with spinning threads, 9.7 with one thread and
14.3 with two threads waiting passively. So unless the user chose a policy, waiting threads sleep; on a quiet
machine that costs little (scripts/bench_load.py).
"""

import os

USER_POLICY = os.environ.get("OMP_WAIT_POLICY")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def describe() -> str:
    """The policy in force and who chose it, for a command's start line."""
    if USER_POLICY is not None:
        return f"OpenMP wait policy {USER_POLICY} (OMP_WAIT_POLICY, as set)"
    return "OpenMP wait policy PASSIVE (our default: spinning threads starve a shared CPU; OMP_WAIT_POLICY overrides)"
