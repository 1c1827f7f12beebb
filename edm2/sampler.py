"""The EDM sampler: noise levels (edm2.schedules: EDM Eq. 5, the release's, or another), churn (EDM Algorithm 2), a
solver's steps (edm2.solvers: Heun's method, the release's, or another), and the guidance blend (paper Eq. 152),
optionally limited to an interval of noise levels (Kynkaanniemi et al., NeurIPS 2024)."""

from __future__ import annotations

import math
from typing import Callable

import torch

from edm2.errors import EDM2Error
from edm2.layers import weights_normalized_once
from edm2.schedules import SCHEDULES, sigma_steps  # noqa: F401  (EDM Eq. 5's levels, also sampler.sigma_steps)
from edm2.solvers import SOLVERS, StepContext, evaluations


class SamplerError(EDM2Error):
    """Sampler settings that cannot produce images; the message names the setting."""


# gnet value for classifier-free guidance: the network guides itself by its unconditional prediction (Ho & Salimans
# 2022), as in Eq. 152 with D_gnet = D_net(x; sigma, u): u the all-zero label of a network trained with label
# dropout, the empty caption's condition of a text network trained with text dropout (Precond.unconditional_labels).
SELF = "self"


def unconditional_labels(net: Callable, labels: torch.Tensor) -> torch.Tensor:
    """The unconditional branch's labels for labels: the network's own (Precond.unconditional_labels), all-zero for
    a network that names none."""
    of_net = getattr(net, "unconditional_labels", None)
    return torch.zeros_like(labels) if of_net is None else of_net(labels)


def conditional_and_unconditional(net: Callable, x: torch.Tensor, sigma: torch.Tensor,
                                  labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(net(x, sigma, labels), net(x, sigma, u)) from one call on the doubled batch [x, x] with labels [c, u], u the
    unconditional labels (unconditional_labels)."""
    both = net(torch.cat([x, x]), torch.cat([sigma, sigma]), torch.cat([labels, unconditional_labels(net, labels)]))
    return both.chunk(2)


def check_settings(
    *, num_steps: int, sigma_min: float, sigma_max: float, rho: float, guidance: float, S_churn: float, S_min: float,
    S_max: float, S_noise: float, dtype: torch.dtype = torch.float32, solver: str = "heun", schedule: str = "edm",
) -> None:
    """Raise SamplerError unless edm_sampler can run with these settings (its arguments of the same names).

    Cheap, so that a command line can check its options before it loads a network.
    """
    if solver not in SOLVERS:
        raise SamplerError(f"solver={solver!r}: expected one of {', '.join(SOLVERS)}")
    if schedule not in SCHEDULES:
        raise SamplerError(f"schedule={schedule!r}: expected one of {', '.join(SCHEDULES)}")
    if num_steps < 1:
        raise SamplerError(f"num_steps={num_steps}: at least one step is needed")
    finite = dict(sigma_min=sigma_min, sigma_max=sigma_max, rho=rho, guidance=guidance, S_churn=S_churn,
                  S_min=S_min, S_noise=S_noise)
    for name, value in [*finite.items(), ("S_max", S_max)]:
        if math.isnan(value) or (name in finite and math.isinf(value)):
            raise SamplerError(f"{name}={value}: not a finite number")
    for name in ("sigma_min", "sigma_max", "rho"):
        if finite[name] <= 0:
            raise SamplerError(f"{name}={finite[name]:g}: must be positive")
    if sigma_min >= sigma_max:
        raise SamplerError(f"sigma_min={sigma_min:g} must be below sigma_max={sigma_max:g}")
    check_guidance(guidance, dtype)
    if S_churn < 0 or S_noise < 0:
        raise SamplerError(f"S_churn={S_churn:g} and S_noise={S_noise:g} cannot be negative")
    if S_churn > 0 and not SOLVERS[solver].churn:
        churning = " or ".join(name for name, record in SOLVERS.items() if record.churn)
        raise SamplerError(f"S_churn={S_churn:g}: solver {solver} takes no churn; churn needs {churning}")
    try:
        t = SCHEDULES[schedule].levels(num_steps, sigma_min, sigma_max, rho)[:-1]
    except OverflowError:  # sigma ** (1 / rho) beyond float64
        t = torch.tensor([math.inf])
    # The preconditioning squares sigma (paper Appendix B.1, c_skip, c_out, c_in) in the sampler's precision; past
    # these limits a level's square overflows or vanishes there, and the images are NaN.
    squares = t.to(dtype).square()
    if not (torch.isfinite(t).all() and (t[1:] < t[:-1]).all() and torch.isfinite(squares).all() and (squares > 0).all()):
        raise SamplerError(f"the noise levels of schedule {schedule} from sigma_max={sigma_max:g} to "
                           f"sigma_min={sigma_min:g} with rho={rho:g} and {num_steps} steps are not decreasing levels "
                           f"whose squares are finite and above 0 in {dtype}")


def check_guidance(guidance: float, dtype: torch.dtype = torch.float32) -> None:
    """Raise SamplerError unless |guidance| < 1 / eps of dtype (2**23 in float32).

    Eq. 152's blend D_gnet + w (D_net - D_gnet) in dtype: from |w| = 1 / eps on, w times a unit difference has a
    spacing of 1 there, so D_gnet's share (of the data's scale, sigma_data = 0.5) rounds away; far beyond, w times
    the difference overflows mid-sampling.
    """
    bound = 1 / torch.finfo(dtype).eps
    if not abs(guidance) < bound:
        raise SamplerError(f"guidance={guidance:g}: must lie within +-{bound:g} (1 / eps of "
                           f"{str(dtype).removeprefix('torch.')}); beyond it the guided prediction is rounding error")


def check_guidance_interval(interval: tuple[float, float] | None) -> None:
    """Raise SamplerError unless interval is None or (sigma_lo, sigma_hi) with 0 <= sigma_lo < sigma_hi <= inf."""
    if interval is None:
        return
    lo, hi = interval
    if not 0 <= lo < hi:  # also refuses NaN, which fails every comparison
        raise SamplerError(f"guidance interval ({lo:g}, {hi:g}]: needs 0 <= sigma_lo < sigma_hi (sigma_hi may be inf)")


def guided_step(t_cur: float, interval: tuple[float, float] | None) -> bool:
    """Whether the step from noise level t_cur uses guidance: always without an interval, else when
    sigma_lo < t_cur <= sigma_hi.

    The limited interval of Kynkaanniemi et al. (NeurIPS 2024) is decided per step, as in their code (which
    picks steps by index): both of a Heun step's evaluations, at t_hat and at t_next, follow the step's own
    noise level t_cur (t_hat before churn raises it), so a step never averages a guided and an unguided slope.
    """
    return interval is None or interval[0] < t_cur <= interval[1]


def guided_denoiser(net: Callable, labels: torch.Tensor | None, gnet: Callable | str | None, guidance: float,
                    dtype: torch.dtype) -> Callable[[torch.Tensor, float, bool], torch.Tensor]:
    """The sampler's denoiser D(x; t) in dtype: net's, or for a guided step (and guidance other than 1) the blend
    of paper Eq. 152 with gnet's, or with net's own unconditional prediction for gnet=SELF."""

    def denoise(x: torch.Tensor, t: float, guided: bool) -> torch.Tensor:
        sigma = torch.full([x.shape[0]], t, dtype=dtype, device=x.device)
        if guidance == 1 or not guided:
            return net(x, sigma, labels).to(dtype)
        if gnet == SELF:
            d, d_guide = conditional_and_unconditional(net, x, sigma, labels)
        else:
            d, d_guide = net(x, sigma, labels), gnet(x, sigma, labels)
        # Paper Eq. 152: w * D_net + (1 - w) * D_gnet.
        return torch.lerp(d_guide.to(dtype), d.to(dtype), guidance)

    return denoise


def edm_sampler(
    net: Callable,
    noise: torch.Tensor,
    labels: torch.Tensor | None = None,
    gnet: Callable | str | None = None,
    num_steps: int = 32,
    sigma_min: float = 0.002,
    sigma_max: float = 80,
    rho: float = 7,
    guidance: float = 1,
    S_churn: float = 0,
    S_min: float = 0,
    S_max: float = float("inf"),
    S_noise: float = 1,
    randn_like: Callable[[torch.Tensor], torch.Tensor] = torch.randn_like,
    dtype: torch.dtype = torch.float32,
    guidance_interval: tuple[float, float] | None = None,
    solver: str = "heun",
    callback: Callable[[dict], None] | None = None,
    schedule: str = "edm",
) -> torch.Tensor:
    """Solve the probability-flow ODE from sigma_max to 0 (EDM Algorithm 1/2 with sigma(t) = t), or a stochastic
    solver's SDE, with a solver of edm2.solvers.SOLVERS on the noise levels of a schedule of edm2.schedules.SCHEDULES.

    randn_like draws the fresh noise of churn and of a stochastic solver
    (edm2.procedures.generation.SeededRandom.randn_like keeps each image on its own generator, so that an image depends
    on its seed alone, not on its batch). With guidance_interval = (sigma_lo, sigma_hi), guidance applies only to the
    steps whose noise level lies in (sigma_lo, sigma_hi] (guided_step); the others evaluate net alone, as with guidance
    1. gnet=SELF guides net by its own unconditional prediction, both halves from one call on a doubled batch. It
    records no gradients, and normalizes the weights of net and gnet once for the whole run
    (edm2.layers.weights_normalized_once). callback(step), as in k-diffusion, gets each step's start: x, i, sigma,
    sigma_hat (x and sigma after churn) and denoised = D(x; sigma_hat); those x and the returned sample form the
    trajectory.
    """
    check_settings(num_steps=num_steps, sigma_min=sigma_min, sigma_max=sigma_max, rho=rho, guidance=guidance,
                   S_churn=S_churn, S_min=S_min, S_max=S_max, S_noise=S_noise, dtype=dtype, solver=solver,
                   schedule=schedule)
    if guidance != 1 and gnet is None:
        raise SamplerError("guidance other than 1 needs a guiding network (gnet)")
    if guidance != 1 and gnet == SELF and labels is None:
        raise SamplerError("self-guidance (gnet=SELF) needs class labels or text conditions: it contrasts them with "
                           "the unconditional ones")
    check_guidance_interval(guidance_interval)
    denoise = guided_denoiser(net, labels, gnet, guidance, dtype)
    t_steps = SCHEDULES[schedule].levels(num_steps, sigma_min, sigma_max, rho).tolist()
    gamma_max = min(S_churn / num_steps, math.sqrt(2) - 1)
    x_next = noise.to(dtype) * t_steps[0]
    step, context = SOLVERS[solver].step, StepContext(randn_like)
    with weights_normalized_once(net, gnet):  # every layer's weight normalized once for the whole run
        for i, (t_cur, t_next) in enumerate(zip(t_steps[:-1], t_steps[1:])):
            x_cur = x_next
            # Churn (EDM Algorithm 2): raise the noise level to t_hat by adding fresh noise.
            gamma = gamma_max if S_min <= t_cur <= S_max else 0
            t_hat = t_cur + gamma * t_cur
            guided = guided_step(t_cur, guidance_interval)
            x_hat = x_cur + math.sqrt(t_hat**2 - t_cur**2) * S_noise * randn_like(x_cur) if gamma > 0 else x_cur
            x_next, denoised = step(lambda x, t: denoise(x, t, guided), x_hat, t_hat, t_next, context)
            if callback is not None:  # step i's start, in k-diffusion's keys
                callback({"x": x_hat, "i": i, "sigma": t_cur, "sigma_hat": t_hat, "denoised": denoised})
        return x_next

