"""One optimizer step of the paper's recipe: Eq. 67's learning rate, Eq. 21's gradients accumulated over
rounds, Adam, and the power-function EMA update (Eq. 119/127).

A step never waits for the device: the loss stays a device tensor (status lines read it), and the learning
rate, the EMA decays and the random seeds are computed on the host from the image count alone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import TYPE_CHECKING, Callable, Iterator

import torch
from torch.optim.adam import adam as functional_adam

from edm2.consistency_loss import ConsistencyLoss, TrigFlowView
from edm2.formats.snapshot import load_network
from edm2.layers import force_weight_normalization
from edm2.loss import EDM2Loss
from edm2.runtime.speed import compile_loss
from training.data_order import label_dropout_seed, round_seed
from training.lr_schedule import learning_rate_schedule
from training.options import TrainingOptions
from training.presets import DEFAULT_METHOD
from training.state import TrainingState

if TYPE_CHECKING:
    from edm2.encoders import Encoder


# An optimizer step: (net, optimizer, lr) -> None, as optimizer_step.
OptimizerStep = Callable[[torch.nn.Module, torch.optim.Optimizer, float], None]
# The steps a run spends compiling, where it compiles: its loss on the first, on the CPU Adam's update
# (compile_optimizer_step) on the second. Whatever times steps starts after them.
WARMUP_STEPS = 2


@dataclasses.dataclass(frozen=True)
class TrainingStep:
    """The parts every step of a run shares; the state changes in place."""

    state: TrainingState
    # EDM2Loss, edm2.runtime.speed.compile_loss(EDM2Loss), or a consistency model's ConsistencyLoss
    loss_fn: EDM2Loss | ConsistencyLoss | Callable[..., torch.Tensor]
    encoder: Encoder
    batches: Iterator  # (images, labels) of batch_gpu images each, `rounds` per step
    opts: TrainingOptions  # batch, lr, decay, rampup_Mimg, ls, seed, label_dropout
    rounds: int = 1
    model: torch.nn.Module | None = None  # state.net wrapped in DistributedDataParallel; None: state.net
    rank: int = 0
    device: torch.device = torch.device("cpu")
    update: OptimizerStep = dataclasses.field(default_factory=lambda: optimizer_step)  # Adam's step

    @classmethod
    def of_run(cls, state: TrainingState, opts: TrainingOptions, encoder: Encoder, batches: Iterator, *,
               device: torch.device, rounds: int = 1, model: torch.nn.Module | None = None,
               rank: int = 0) -> TrainingStep:
        """The step a run of opts takes on device: its loss (training_loss) and Adam's step (training_update)
        compiled where the run compiles."""
        return cls(state=state, loss_fn=training_loss(opts, state.net.sigma_data, device), encoder=encoder,
                   batches=batches, opts=opts, rounds=rounds, model=model, rank=rank, device=device,
                   update=training_update(opts, device))


def data_parallel(net: torch.nn.Module, world_size: int, device: torch.device,
                  method: str = DEFAULT_METHOD) -> torch.nn.Module | None:
    """net wrapped in DistributedDataParallel, which averages its gradients over the ranks, for TrainingStep.model
    (a consistency model's as its TrigFlow model, the pass ConsistencyLoss takes gradients through); None for one
    process."""
    if world_size == 1:
        return None
    if method != DEFAULT_METHOD:
        net = TrigFlowView(net)
    return torch.nn.parallel.DistributedDataParallel(net, device_ids=[device.index] if device.type == "cuda" else None)


def recipe_loss(opts: TrainingOptions, sigma_data: float) -> EDM2Loss:
    """Eq. 21's loss (Eq. 14's weighted error with the uncertainty off) with the options' weighting, noise
    distribution and uncertainty: what the run trains, its snapshots record and its dashboard measures."""
    return EDM2Loss(opts.P_mean, opts.P_std, sigma_data, opts.loss_weighting, opts.noise_dist, opts.uncertainty)


def recipe_consistency(opts: TrainingOptions, sigma_data: float, teacher: torch.nn.Module | None = None) -> \
        ConsistencyLoss:
    """The consistency loss of a --method=sct or scd run (teacher: the network scd distils), which its snapshots
    record (ConsistencyLoss.record, the teacher by its file name)."""
    return ConsistencyLoss(opts.method, opts.P_mean, opts.P_std, sigma_data, round(opts.tangent_warmup_Mimg * 1e6),
                           teacher=teacher, teacher_name=opts.teacher and os.path.basename(opts.teacher))


def training_loss(opts: TrainingOptions, sigma_data: float, device: torch.device) -> EDM2Loss | ConsistencyLoss | \
        Callable:
    """recipe_loss, compiled with the network when the run compiles; for a consistency model its ConsistencyLoss
    (eager: forward-mode AD), with the scd teacher loaded on device."""
    if opts.method != DEFAULT_METHOD:
        teacher = load_network(opts.teacher)[0] if opts.method == "scd" else None
        return recipe_consistency(opts, sigma_data, teacher).to(device)
    loss_fn = recipe_loss(opts, sigma_data)
    return compile_loss(loss_fn, device) if opts.compiles(device) else loss_fn


def training_update(opts: TrainingOptions, device: torch.device) -> OptimizerStep:
    """TrainingStep.update: compile_optimizer_step when the run compiles on the CPU; optimizer_step elsewhere,
    CUDA's Adam being one fused kernel already."""
    return compile_optimizer_step(device) if opts.compiles(device) and device.type == "cpu" else optimizer_step


def training_step(step: TrainingStep) -> torch.Tensor:
    """Advance step.state by one batch of opts.batch images; returns the sum of the rounds' mean losses."""
    state, opts = step.state, step.opts
    lr = learning_rate_schedule(state.cur_nimg, opts.batch, opts.lr, opts.decay, opts.rampup_Mimg)  # Eq. 67
    consistency = step.loss_fn if isinstance(step.loss_fn, ConsistencyLoss) else None
    if consistency is not None:
        consistency.set_images(state.cur_nimg)  # the tangent warmup's r, from the images seen (a resume goes on)
    loss = accumulate_gradients(                                                                    # Eq. 21
        step.model or state.net, step.loss_fn, step.encoder, step.batches, scale=opts.ls, device=step.device,
        seeds=[round_seed(opts.seed, step.rank, state.cur_nimg, r) for r in range(step.rounds)],
        label_dropout=opts.label_dropout, text_dropout=opts.text_dropout,
        empty_text=getattr(state.net.network, "empty_text", None),
    )
    if consistency is not None:
        consistency.note_gradients(state.net)
    step.update(state.net, state.optimizer, lr)                                                     # Adam
    state.cur_nimg += opts.batch
    state.ema.update(state.cur_nimg, opts.batch)                                                    # Eq. 119/127
    return loss


def accumulate_gradients(model: torch.nn.Module, loss_fn: Callable[..., torch.Tensor], encoder: Encoder,
                         batches: Iterator, *, seeds: list[int], scale: float, device: torch.device,
                         label_dropout: float = 0.0, text_dropout: float = 0.0,
                         empty_text: torch.Tensor | None = None) -> torch.Tensor:
    """Backpropagate one batch per seed (the round's random draws), each forward pass after the forced weight
    normalization (Eq. 66) of every layer, all-reducing gradients after the last under DistributedDataParallel;
    returns the sum of the rounds' mean losses. Each image's label becomes the all-zero label with probability
    label_dropout (classifier-free guidance); for a text network (empty_text, the empty caption's condition) each
    image's condition becomes the empty caption's with probability text_dropout."""
    rounds = len(seeds)
    loss_sum = torch.zeros([], device=device)
    for round_idx, seed in enumerate(seeds):
        sync = round_idx == rounds - 1 or not hasattr(model, "no_sync")
        with contextlib.nullcontext() if sync else model.no_sync():
            images, labels = next(batches)
            torch.manual_seed(seed)
            images = encoder.encode_latents(images.to(device, non_blocking=True))
            labels = labels.to(device, non_blocking=True) if labels.shape[1] else None
            if empty_text is not None and text_dropout:
                labels = drop_conditions(labels, empty_text, text_dropout, label_dropout_seed(seed))
            elif label_dropout and labels is not None:
                labels = drop_labels(labels, label_dropout, label_dropout_seed(seed))
            force_weight_normalization(model)
            loss = loss_fn(model, images, labels)
            # Sum over elements, mean over the rank's share of the batch; DDP averages over ranks.
            loss.sum().mul(scale / (rounds * images.shape[0])).backward()
            loss_sum += loss.detach().mean()
    return loss_sum


def dropped_rows(count: int, p: float, seed: int) -> torch.Tensor:
    """Which of count rows [count] (bool) are dropped, each with probability p, drawn on the CPU from seed: the same
    rows on any device."""
    return torch.rand([count], generator=torch.Generator().manual_seed(seed)) < p


def drop_labels(labels: torch.Tensor, p: float, seed: int) -> torch.Tensor:
    """labels [N, C] with each row zeroed with probability p (dropped_rows)."""
    keep = ~dropped_rows(labels.shape[0], p, seed)
    return labels * keep.to(labels.device, labels.dtype).unsqueeze(1)


def drop_conditions(conditions: torch.Tensor, empty: torch.Tensor, p: float, seed: int) -> torch.Tensor:
    """Text conditions [N, 1+L, D+1] with each replaced by the empty caption's condition empty [1+L, D+1] with
    probability p (dropped_rows: the rows drop_labels would zero)."""
    drop = dropped_rows(conditions.shape[0], p, seed).to(conditions.device)
    return torch.where(drop[:, None, None], empty.to(conditions.device, conditions.dtype), conditions)


def optimizer_step(net: torch.nn.Module, optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Zero non-finite gradients, step Adam at learning rate lr, clear the gradients."""
    zero_nonfinite_([param.grad for param in net.parameters() if param.grad is not None])
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def compile_optimizer_step(device: torch.device) -> OptimizerStep:
    """optimizer_step with the zeroing of non-finite gradients and Adam's update compiled into one graph
    (torch.compile), from Adam's second step on; the first, which creates Adam's state, runs as optimizer_step.

    On the CPU, foreach Adam runs each of its operations tensor by tensor: several hundred small operations a step
    for a toy network, where the graph runs fused loops (toy-tiny's and toy-small's bf16 compiled steps 3-4% faster,
    for 15-25 s more compiling). The same update, rounded differently: Adam's bias corrections are float32 tensors
    in the graph (capturable Adam), Python doubles in eager Adam.
    """
    # Inductor's Python wrapper, not the C++ one of device_options: for this graph of many small loops (toy-small's
    # 81 tensors) the C++ wrapper took 20 s longer to compile and ran no faster.
    @torch.compile(dynamic=False)
    def update(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
               exp_avg_sqs: list[torch.Tensor], steps: list[torch.Tensor], lr: torch.Tensor,
               betas: tuple[float, float], eps: float) -> None:
        for grad in grads:
            grad.nan_to_num_(nan=0, posinf=0, neginf=0)
        functional_adam(params, grads, exp_avgs, exp_avg_sqs, [], steps, foreach=True, capturable=True, amsgrad=False,
                        beta1=betas[0], beta2=betas[1], lr=lr, weight_decay=0.0, eps=eps, maximize=False)

    lr_tensor = torch.zeros([], device=device)  # refilled every step: a learning rate given as a float recompiles

    def step(net: torch.nn.Module, optimizer: torch.optim.Optimizer, lr: float) -> None:
        params = [param for param in net.parameters() if param.grad is not None]
        if any(param not in optimizer.state for param in params):
            optimizer_step(net, optimizer, lr)
            return
        (group,) = optimizer.param_groups  # training.state.adam's one group
        group["lr"] = lr  # as optimizer_step sets it: the state dict records it
        states = [optimizer.state[param] for param in params]
        with torch.no_grad():
            update(params, [param.grad for param in params], [s["exp_avg"] for s in states],
                   [s["exp_avg_sq"] for s in states], [s["step"] for s in states], lr_tensor.fill_(lr),
                   group["betas"], group["eps"])
        optimizer.zero_grad(set_to_none=True)

    return step


def zero_nonfinite_(tensors: list[torch.Tensor], chunk_numel: int = 1 << 26) -> None:
    """torch.nan_to_num(t, nan=0, posinf=0, neginf=0, out=t) for every tensor, as in the release, with a few
    operations per chunk of tensors (a concatenation, one nan_to_num_, one foreach copy back) instead of one
    per tensor; a chunk holds at most chunk_numel elements (256 MiB of float32) unless one tensor is larger."""
    for chunk in _chunks(tensors, chunk_numel):
        flat = torch.cat([t.reshape(-1) for t in chunk]).nan_to_num_(nan=0, posinf=0, neginf=0)
        parts = flat.split([t.numel() for t in chunk])
        torch._foreach_copy_(chunk, [part.view(t.shape) for part, t in zip(parts, chunk)])


def _chunks(tensors: list[torch.Tensor], chunk_numel: int) -> Iterator[list[torch.Tensor]]:
    """The tensors in consecutive groups of one device and dtype, each within chunk_numel elements."""
    chunk, numel = [], 0
    for t in tensors:
        if chunk and (numel + t.numel() > chunk_numel or (t.device, t.dtype) != (chunk[0].device, chunk[0].dtype)):
            yield chunk
            chunk, numel = [], 0
        chunk.append(t)
        numel += t.numel()
    if chunk:
        yield chunk
