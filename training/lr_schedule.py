"""The learning-rate schedule of paper Eq. 67 with the release's linear ramp-up."""

from __future__ import annotations

import math


def learning_rate_schedule(cur_nimg: int, batch: int, lr: float, decay: float, rampup_Mimg: float) -> float:
    """lr / sqrt(max(t / decay, 1)) with t = cur_nimg / batch iterations, ramped up linearly over rampup_Mimg.

    lr is alpha_ref and decay is t_ref of Eq. 67 (in iterations); decay 0 keeps lr, rampup_Mimg 0 skips the
    ramp-up (release: training/training_loop.py, learning_rate_schedule).
    """
    rate = lr
    if decay > 0:
        rate /= math.sqrt(max(cur_nimg / (decay * batch), 1))
    if rampup_Mimg > 0:
        rate *= min(cur_nimg / (rampup_Mimg * 1e6), 1)
    return float(rate)
