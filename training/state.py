"""What a training state holds: the network, Adam, the power-function EMA tracks, the images seen and their data."""

from __future__ import annotations

import dataclasses
from typing import Iterable

import torch

from edm2.errors import EDM2Error
from edm2.networks import Precond
from edm2.phema import PowerFunctionEMA
from edm2.runtime.sharded_ema import ShardedPowerFunctionEMA, power_function_ema
from edm2.runtime.speed import precision_flags, to_channels_last
from edm2.runtime.utilization import training_flops_per_image
from training.architecture import init_weights
from training.data_order import ORDER
from training.options import TrainingOptions
from training.text_conditioning import text_network

ADAM_BETAS = (0.9, 0.99)
ADAM_EPS = 1e-8


class NonFiniteError(EDM2Error):
    """A training's loss, weights, EMA tracks or Adam moments hold NaN or infinity: the run stops, writing nothing."""


# What first_nonfinite asks of a tensor besides being finite, and how its answer says what failed.
FINITE, NON_NEGATIVE, FLOAT16 = "", " or a negative value (impossible there)", " or a magnitude float16 overflows on"


def first_nonfinite(entries: Iterable[tuple[str, torch.Tensor, str]]) -> str | None:
    """'LABEL holds NaN or infinity' for the first (label, tensor, rule) entry whose floating-point tensor does, or
    breaks its rule (NON_NEGATIVE: a value below 0; FLOAT16: a magnitude above float16's largest), or None; one
    reduction per tensor, no copy of it, and one host sync per device."""
    entries = [(label, t, rule) for label, t, rule in entries
               if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel()]
    flags: dict[torch.device, list[torch.Tensor]] = {}
    for _, t, rule in entries:
        ok = torch.isfinite(t)
        if rule == NON_NEGATIVE:
            ok.logical_and_(t >= 0)
        elif rule == FLOAT16:
            ok.logical_and_(t.abs() <= torch.finfo(torch.float16).max)
        flags.setdefault(t.device, []).append(ok.all())
    good = {device: iter(torch.stack(found).tolist()) for device, found in flags.items()}
    bad = next(((label, rule) for label, t, rule in entries if not next(good[t.device])), None)
    return None if bad is None else f"{bad[0]} holds NaN or infinity{bad[1]}"


def state_nonfinite(net: dict, optimizer: dict, emas: Iterable[tuple[float, dict]], param_names: list[str]) -> \
        str | None:
    """What of a training state's parts (state dicts of the network, Adam and each EMA track by sigma_rel) is not
    finite, or is an impossible Adam moment (a negative second moment or step count), as first_nonfinite says it;
    None if nothing.

    Adam's exp_avg_sq is a running mean of squared gradients: it is never negative (Kingma and Ba, Algorithm 1).
    """
    moments = optimizer.get("state", {})
    return first_nonfinite([
        *((f"weight {name}", t, FINITE) for name, t in net.items()),
        *((f"EMA track sigma_rel {std:.3f}: {name}", t, FINITE) for std, ema in emas for name, t in ema.items()),
        *((f"Adam's {key} of {param_names[index] if index < len(param_names) else index}", t,
           FINITE if key == "exp_avg" else NON_NEGATIVE) for index, moment in moments.items() for key, t in moment.items()),
    ])


def init_network(opts: TrainingOptions, img_channels: int) -> Precond:
    """A freshly initialized Precond as the options describe it, for img_channels network input channels: on data
    with text embeddings a text network (no class labels), conditioned on them."""
    text = text_network(opts.dataset, opts.network)
    return Precond(
        img_resolution=opts.dataset["resolution"],
        img_channels=img_channels,
        label_dim=opts.dataset["label_dim"] if opts.cond and not text else 0,
        model_channels=opts.channels,
        dropout=opts.dropout,
        **precision_flags(opts.precision),
        **{**opts.network, **text},
    )


def training_flops(opts: TrainingOptions, img_channels: int) -> float:
    """Useful FLOPs of one training image of the options' network (MFU's numerator), counted on the meta device."""
    with torch.device("meta"):
        return training_flops_per_image(init_network(opts, img_channels))


def adam(params, device: torch.device, eps: float | None = None) -> torch.optim.Adam:
    """Adam with the release's betas and eps (or this eps) at learning rate 0 (the loop sets it every step); one fused
    kernel per step on CUDA, foreach (one operation per update over all tensors) elsewhere."""
    implementation = dict(fused=True) if device.type == "cuda" else dict(foreach=True)
    return torch.optim.Adam(params, lr=0, betas=ADAM_BETAS, eps=ADAM_EPS if eps is None else eps,
                            **implementation)


@dataclasses.dataclass
class TrainingState:
    """The network being trained, its Adam optimizer and EMA tracks, images seen and training time so far."""

    net: Precond
    optimizer: torch.optim.Optimizer
    ema: PowerFunctionEMA | ShardedPowerFunctionEMA
    cur_nimg: int = 0
    elapsed_s: float = 0.0
    # The data order the run reads (training.data_order.ORDERS); a state written before it was recorded read the
    # stored permutation, and keeps reading it when resumed.
    data_order: str = ORDER
    # What identifies the data the state was trained on (training.data_record); None for a state written before it
    # was recorded.
    data: dict | None = None

    @classmethod
    def create(cls, opts: TrainingOptions, img_channels: int, device: torch.device) -> TrainingState:
        """A new state: weights from opts.seed (identical on every rank) or the opts.init snapshot, Adam at
        learning rate 0, EMA tracks equal to the weights.

        A run started from a snapshot is a new run: it counts its own images from 0, so the learning rate ramps up
        and decays (Eq. 67) and the EMA profiles (Eq. 127) span the new run's images as for any run; the snapshot
        enters the EMA only through the network's weights (the first update's beta is 0).
        """
        torch.manual_seed(opts.seed)
        net = init_network(opts, img_channels)
        if opts.init is not None:
            net.load_state_dict(init_weights(opts.init))
        net = net.to(device).train()
        if opts.uses_channels_last(device):
            to_channels_last(net)
        net.cpu_16bit = opts.cpu_16bit
        net.network.checkpoint_blocks = opts.checkpoint_activations
        return cls(net, adam(net.parameters(), device, opts.adam_eps),
                   power_function_ema(net, opts.ema_stds, opts.ema_shard))

    def load(self, saved: dict) -> None:
        """Continue from a training state read (and checked to fit) by training/run/checkpoint.py."""
        self.net.load_state_dict(saved["net"])
        settings = [(group["fused"], group["foreach"]) for group in self.optimizer.param_groups]
        self.optimizer.load_state_dict(saved["optimizer"])
        # A saved optimizer brings its run's implementation (fused on CUDA, foreach elsewhere): keep this run's.
        for group, (fused, foreach) in zip(self.optimizer.param_groups, settings):
            group["fused"], group["foreach"] = fused, foreach
            for param in group["params"]:
                param_state = self.optimizer.state[param]
                if "step" in param_state:  # fused Adam keeps its step counts on the parameters' device
                    param_state["step"] = param_state["step"].to(param.device if fused else "cpu", torch.float32)
        self.ema.load_state_dict(saved["ema"])
        self.cur_nimg, self.elapsed_s = int(saved["cur_nimg"]), float(saved["elapsed_s"])
        self.data_order = saved.get("data_order", "permutation")
        self.data = saved.get("data")

    def nonfinite(self) -> str | None:
        """What of this process's part of the state holds NaN or infinity (or an impossible Adam moment), or None:
        state_nonfinite over the weights, Adam and the EMA tracks this process holds (a sharded EMA: its part)."""
        if isinstance(self.ema, ShardedPowerFunctionEMA):
            emas = [(std, {"(this process's part)": shard}) for std, shard in zip(self.ema.stds, self.ema.shards)]
        else:
            emas = [(std, ema.state_dict()) for ema, std in zip(self.ema.emas, self.ema.stds)]
        names = [name for name, _ in self.net.named_parameters()]
        return state_nonfinite(self.net.state_dict(), self.optimizer.state_dict(), emas, names)

    def to_dict(self) -> dict:
        """The tensors and counts a training-state file holds (training/run/checkpoint.py adds the run's options)."""
        return dict(net=self.net.state_dict(), optimizer=self.optimizer.state_dict(), ema=self.ema.state_dict(),
                    cur_nimg=self.cur_nimg, elapsed_s=self.elapsed_s, data_order=self.data_order, data=self.data)
