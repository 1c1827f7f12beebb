"""What a training state holds: the network, Adam, the power-function EMA tracks and the images seen."""

from __future__ import annotations

import dataclasses
import json
import os

import torch

from edm2.networks import Precond
from edm2.phema import PowerFunctionEMA
from edm2.sharded_ema import ShardedPowerFunctionEMA, power_function_ema
from edm2.speed import to_channels_last
from training import checkpoint
from training.checkpoint import CheckpointError
from training.architecture import init_weights
from training.options import TrainingOptions

ADAM_BETAS = (0.9, 0.99)
ADAM_EPS = 1e-8


def init_network(opts: TrainingOptions, img_channels: int) -> Precond:
    """A freshly initialized Precond as the options describe it, for img_channels network input channels."""
    return Precond(
        img_resolution=opts.dataset["resolution"],
        img_channels=img_channels,
        label_dim=opts.dataset["label_dim"] if opts.cond else 0,
        model_channels=opts.channels,
        dropout=opts.dropout,
        use_fp16=opts.precision == "fp16",
        use_bf16=opts.precision == "bf16",
        **opts.network,
    )


def adam(params, device: torch.device) -> torch.optim.Adam:
    """Adam with the release's betas and eps at learning rate 0 (the loop sets it every step); one fused kernel
    per step on CUDA, foreach (one operation per update over all tensors) elsewhere."""
    implementation = dict(fused=True) if device.type == "cuda" else dict(foreach=True)
    return torch.optim.Adam(params, lr=0, betas=ADAM_BETAS, eps=ADAM_EPS, **implementation)


@dataclasses.dataclass
class TrainingState:
    """The network being trained, its Adam optimizer and EMA tracks, images seen and training time so far."""

    net: Precond
    optimizer: torch.optim.Optimizer
    ema: PowerFunctionEMA | ShardedPowerFunctionEMA
    cur_nimg: int = 0
    elapsed_s: float = 0.0

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
        net.unet.checkpoint_blocks = opts.checkpoint_activations
        return cls(net, adam(net.parameters(), device), power_function_ema(net, opts.ema_stds, opts.ema_shard))

    def check(self, saved: dict, path: str | os.PathLike) -> None:
        """Raise CheckpointError naming the first tensor of a training state (read by checkpoint.load_state) that
        does not fit this state's network, Adam or EMA tracks: a missing or extra name, or another shape."""
        shapes = {name: tensor.shape for name, tensor in self.net.state_dict().items()}
        _check_tensors(saved["net"], shapes, path, "net")
        stds, emas = saved["ema"].get("stds"), saved["ema"].get("emas")
        if not isinstance(stds, list) or tuple(stds) != self.ema.stds or not isinstance(emas, list) \
                or len(emas) != len(stds):
            raise CheckpointError(f"{path}: its EMA tracks are not those of sigma_rel {list(self.ema.stds)}")
        for index, ema in enumerate(emas):
            _check_tensors(ema, shapes, path, f"ema track {index}")
        groups = saved["optimizer"].get("param_groups")
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        if not isinstance(groups, list) or [len(g.get("params", ())) if isinstance(g, dict) else None for g in groups] \
                != [len(g["params"]) for g in self.optimizer.param_groups]:
            raise CheckpointError(f"{path}: its optimizer holds other parameter groups than the network's")
        moments = saved["optimizer"].get("state")
        if not isinstance(moments, dict) or not set(moments) <= set(range(len(params))):
            raise CheckpointError(f"{path}: its optimizer state names parameters the network does not have")
        for index, moment in moments.items():
            expected = {"step": torch.Size([]), "exp_avg": params[index].shape, "exp_avg_sq": params[index].shape}
            _check_tensors(moment, expected, path, f"optimizer state {index}")

    def load(self, saved: dict) -> None:
        """Continue from a training state read by checkpoint.load_state."""
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

    def to_dict(self, opts: TrainingOptions, rank_digests: list[str]) -> dict:
        """The contents of a training-state file; rank_digests records that every rank held these weights."""
        hyperparameters = opts.hyperparameters()
        return dict(
            net=self.net.state_dict(), optimizer=self.optimizer.state_dict(), ema=self.ema.state_dict(),
            cur_nimg=self.cur_nimg, elapsed_s=self.elapsed_s, options=json.dumps(hyperparameters, sort_keys=True),
            options_hash=checkpoint.options_hash(hyperparameters), rank_digests=rank_digests,
        )


def _check_tensors(saved: object, shapes: dict[str, torch.Size], path: str | os.PathLike, what: str) -> None:
    """Raise CheckpointError unless saved maps exactly the names of shapes to tensors of those shapes."""
    if not isinstance(saved, dict):
        raise CheckpointError(f"{path}: its {what} is a {type(saved).__name__}, not tensors by name")
    missing, extra = sorted(set(shapes) - set(saved)), sorted(set(saved) - set(shapes))
    if missing or extra:
        raise CheckpointError(f"{path}: its {what} " + (f"lacks {missing[0]}" if missing else f"has an unknown {extra[0]}"))
    for name, shape in shapes.items():
        tensor = saved[name]
        if not isinstance(tensor, torch.Tensor) or tensor.shape != shape:
            found = f"shape {list(tensor.shape)}" if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise CheckpointError(f"{path}: {what} {name} has {found}, the network's has shape {list(shape)}")
