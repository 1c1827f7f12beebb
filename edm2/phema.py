"""Power-function EMA (paper Section 3, Appendix C): the training-time tracker and post-hoc math.

Time is counted in training images throughout, as in the release: a snapshot taken after `nimg`
images has response function p_{t,gamma} with t = nimg (Eq. 121).
"""

from __future__ import annotations

import copy
import functools
from typing import Sequence

import numpy as np
import torch

from edm2.errors import EDM2Error

# gamma > 0 requires sigma_rel < 12^-0.5 (Appendix C.4, below Eq. 126).
MAX_STD = 12.0**-0.5


class EMAError(EDM2Error):
    """A sigma_rel outside (0, 12^-0.5), or a saved EMA state whose sigma_rel values differ from the tracker's."""


def exp_to_std(exp: float | np.ndarray) -> float | np.ndarray:
    """Relative standard deviation sigma_rel of the power-function profile with exponent gamma."""
    exp = np.asarray(exp, dtype=np.float64)
    return np.sqrt((exp + 1) / ((exp + 2) ** 2 * (exp + 3)))  # Eq. 123


def std_to_exp(std: float | np.ndarray) -> float | np.ndarray:
    """Exponent gamma of the power-function profile with relative standard deviation sigma_rel."""
    std = np.asarray(std, dtype=np.float64)
    inside = (std > 0) & (std < MAX_STD)
    if not np.all(inside):
        raise EMAError(f"sigma_rel must lie in (0, {MAX_STD:.4f}), got {np.ravel(std)[~np.ravel(inside)][0]}")
    uniq, index = np.unique(std, return_inverse=True)
    roots = np.float64([_positive_root(float(s)) for s in uniq])
    return roots[index].reshape(std.shape)[()]


@functools.lru_cache(maxsize=4096)
def _positive_root(std: float) -> float:
    # Algorithm 2: the unique positive root of the cubic of Eq. 126. Cached because the tracker asks
    # for the same few values at every training step.
    return float(np.roots([1, 7, 16 - std**-2, 12 - std**-2]).real.max())


def power_function_beta(std: float, t_next: float, t_delta: float) -> float:
    """EMA decay for the step that ends at time t_next after a step of length t_delta."""
    return float((1 - t_delta / t_next) ** (std_to_exp(std) + 1))  # Eq. 127


def inference_copy(net: torch.nn.Module) -> torch.nn.Module:
    """A float32 copy of net for evaluation only: no gradients carried over or tracked."""
    ema = copy.deepcopy(net).float().eval().requires_grad_(False)
    for p in ema.parameters():
        p.grad = None
    return ema


def tracked_stds(stds: Sequence[float]) -> tuple[float, ...]:
    """A tracker's sigma_rel values as floats; EMAError for an impossible one now, not at the first step."""
    stds = tuple(float(std) for std in stds)
    std_to_exp(np.array(stds))
    return stds


def check_saved_stds(state: dict, stds: tuple[float, ...]) -> None:
    """Refuse (EMAError) a saved EMA state whose sigma_rel values differ from the tracker's."""
    if tuple(float(std) for std in state["stds"]) != stds:
        raise EMAError(f"EMA state tracks sigma_rel {state['stds']}, this tracker {list(stds)}")


class PowerFunctionEMA:
    """Power-function EMA tracks of a network, one float32 copy per sigma_rel (Eq. 119, 127).

    Parameters are averaged; buffers are not averaged but copied from the network by get(), as the
    release does (EDM2's buffers are fixed Fourier features).
    """

    @torch.no_grad()
    def __init__(self, net: torch.nn.Module, stds: tuple[float, ...] = (0.050, 0.100)):
        self.net = net
        self.stds = tracked_stds(stds)
        self.emas = [inference_copy(net) for _ in self.stds]

    @torch.no_grad()
    def update(self, cur_nimg: int, batch_size: int) -> None:
        """Fold in the network's current parameters after a step that brought the image count to cur_nimg."""
        # One foreach lerp per track over all parameters; float32 parameters are read as they are (no_grad: no
        # detached copies needed), others in float32.
        src = [p if p.dtype == torch.float32 else p.float() for p in self.net.parameters()]
        for std, ema in zip(self.stds, self.emas):
            beta = power_function_beta(std=std, t_next=cur_nimg, t_delta=batch_size)
            torch._foreach_lerp_(list(ema.parameters()), src, 1 - beta)  # Eq. 119

    @torch.no_grad()
    def get(self) -> list[tuple[torch.nn.Module, float]]:
        """The averaged networks with their sigma_rel, buffers refreshed from the network."""
        for ema in self.emas:
            for b_net, b_ema in zip(self.net.buffers(), ema.buffers()):
                b_ema.copy_(b_net)
        return list(zip(self.emas, self.stds))

    def state_dict(self) -> dict:
        """Everything needed to resume tracking exactly (plain containers of tensors and floats)."""
        return {"stds": list(self.stds), "emas": [ema.state_dict() for ema in self.emas]}

    def load_state_dict(self, state: dict) -> None:
        """Restore the tracks saved by state_dict(); the sigma_rel values must match."""
        check_saved_stds(state, self.stds)
        for ema, ema_state in zip(self.emas, state["emas"]):
            ema.load_state_dict(ema_state)


def power_function_response(t: np.ndarray, ofs: float, std: float) -> np.ndarray:
    """Response function p_{ofs,gamma}(t) of a snapshot taken at time ofs (Eq. 107, 121)."""
    t = np.asarray(t, dtype=np.float64)
    exp = std_to_exp(std)
    inside = (t >= 0) & (t <= ofs)
    return np.where(inside, (exp + 1) / ofs * (np.clip(t, 0, ofs) / ofs) ** exp, 0.0)


def power_function_inner(a_ofs: np.ndarray, a_std: np.ndarray, b_ofs: np.ndarray, b_std: np.ndarray) -> np.ndarray:
    """Inner products <p_a, p_b> of power-function responses, broadcast over the arguments (Eq. 151)."""
    a_ofs, b_ofs = np.asarray(a_ofs, dtype=np.float64), np.asarray(b_ofs, dtype=np.float64)
    a_exp, b_exp = std_to_exp(a_std), std_to_exp(b_std)
    # Eq. 151 takes t_a <= t_b; otherwise the roles swap. Raising the ratio, not the times, to the
    # power avoids overflow.
    a_first = a_ofs <= b_ofs
    t_lo, t_hi = np.minimum(a_ofs, b_ofs), np.maximum(a_ofs, b_ofs)
    exp_hi = np.where(a_first, b_exp, a_exp)
    return (a_exp + 1) * (b_exp + 1) * (t_lo / t_hi) ** exp_hi / ((a_exp + b_exp + 1) * t_hi)


def _gram(in_ofs, in_std, out_ofs, out_std) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    # A (Eq. 142), B (Eq. 143, one column per target) and the targets' own norms <p_r, p_r>.
    # np.asarray, not np.float64(): NumPy 1.x turns an array of one element into a scalar (2.x keeps the array).
    in_ofs, in_std = (np.asarray(x, dtype=np.float64).reshape(-1) for x in np.broadcast_arrays(in_ofs, in_std))
    out_ofs, out_std = (np.asarray(x, dtype=np.float64).reshape(-1) for x in np.broadcast_arrays(out_ofs, out_std))
    a = power_function_inner(in_ofs[:, None], in_std[:, None], in_ofs[None, :], in_std[None, :])
    b = power_function_inner(in_ofs[:, None], in_std[:, None], out_ofs[None, :], out_std[None, :])
    return a, b, power_function_inner(out_ofs, out_std, out_ofs, out_std)


def solve_posthoc_coefficients(in_ofs, in_std, out_ofs, out_std) -> np.ndarray:
    """Least-squares weights [inputs, outputs] of stored snapshots for target profiles (Algorithm 3)."""
    a, b, _ = _gram(in_ofs, in_std, out_ofs, out_std)
    x = np.linalg.solve(a, b)
    # The release normalizes each column so the reconstructed weights stay an average.
    return x / x.sum(axis=0, keepdims=True)


def reconstruction_error(in_ofs, in_std, out_ofs, out_std, coefs: np.ndarray) -> np.ndarray:
    """Squared L2 distance of the synthesized response from each target (Eq. 134), relative to <p_r, p_r>."""
    a, b, rr = _gram(in_ofs, in_std, out_ofs, out_std)
    x = np.asarray(coefs, dtype=np.float64).reshape(len(a), -1)
    return (np.einsum("io,ij,jo->o", x, a, x) - 2 * np.einsum("io,io->o", x, b) + rr) / rr
