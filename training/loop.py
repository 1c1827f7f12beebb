"""The EDM2 training loop: Adam with Eq. 67's schedule, gradient accumulation, DDP, power-function EMA,
snapshots, checkpoints and exact resume."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import resource
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import numpy as np
import torch
import torch.distributed

from edm2 import distributed as dist
from edm2 import files
from edm2.loss import EDM2Loss, learning_rate_schedule
from edm2.networks import Precond, count_parameters
from edm2.phema import PowerFunctionEMA
from edm2.snapshot import save_network, snapshot_name
from training import checkpoint
from training.presets import get_preset

if TYPE_CHECKING:
    from edm2.dataset import ImageFolderDataset
    from edm2.encoders import Encoder

ADAM_BETAS = (0.9, 0.99)
ADAM_EPS = 1e-8
PRECISIONS = ("fp32", "fp16", "bf16")

# Options that define the trained model; a resumed run must keep them. The others (data path,
# duration, intervals, batch_gpu, workers, run_dir) may change between invocations: they affect
# where and for how long training runs and how much memory it uses, not what it computes.
HYPERPARAMETERS = (
    "preset", "cond", "batch", "channels", "dropout", "P_mean", "P_std", "lr", "decay", "rampup_Mimg",
    "ema_stds", "network", "precision", "ls", "seed", "dataset",
)


@dataclasses.dataclass(frozen=True)
class TrainingOptions:
    """Everything a run needs; image counts are in images, decay (t_ref) in iterations."""

    preset: str
    dataset: dict  # resolution, num_channels, label_dim of the training data
    encoder: dict  # encoder.config()
    duration: int
    batch: int
    channels: int
    dropout: float
    P_mean: float
    P_std: float
    lr: float
    decay: float
    rampup_Mimg: float
    ema_stds: tuple[float, ...]
    network: dict  # further Precond arguments of the preset
    status: int
    snapshot: int
    checkpoint: int
    run_dir: str
    data: str
    cond: bool = True
    batch_gpu: int = 0  # per rank and round; 0 = batch // world_size
    precision: str = "fp16"
    ls: float = 1.0
    seed: int = 0
    workers: int = 2

    @classmethod
    def from_preset(cls, preset: str, dataset: dict, encoder: dict, **overrides) -> TrainingOptions:
        """The preset's recipe for a dataset, with the overrides that are not None."""
        recipe = get_preset(preset)
        values = {f.name: getattr(recipe, f.name) for f in dataclasses.fields(recipe) if f.name in _FIELDS}
        values.update(run_dir=os.path.join("training-runs", preset), network=dict(recipe.network))
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(preset=preset, dataset=dataset, encoder=encoder, **values)

    def to_json(self) -> dict:
        """The options as plain JSON values (tuples become lists)."""
        return json.loads(json.dumps(dataclasses.asdict(self)))

    def hyperparameters(self) -> dict:
        """The options a resumed run must share with the original."""
        values = self.to_json()
        return {k: values[k] for k in HYPERPARAMETERS}


_FIELDS = {f.name for f in dataclasses.fields(TrainingOptions)}


def rounds_per_step(batch: int, batch_gpu: int, world_size: int) -> tuple[int, int]:
    """(batch_gpu, rounds) for gradient accumulation; ValueError unless batch = world * batch_gpu * rounds."""
    batch_gpu = batch_gpu or batch // world_size
    if batch_gpu < 1 or batch % (world_size * batch_gpu):
        raise ValueError(
            f"batch {batch} is not divisible by {world_size} process(es) x batch-gpu {batch_gpu}"
        )
    return batch_gpu, batch // (world_size * batch_gpu)


def build_network(opts: TrainingOptions, img_channels: int) -> Precond:
    """The Precond network the options describe, for img_channels network input channels."""
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


def round_seed(seed: int, rank: int, cur_nimg: int, round_idx: int) -> int:
    """Seed of the random draws (sigma, noise, latent sample, dropout) of one accumulation round."""
    return int(np.random.SeedSequence([seed, rank, cur_nimg, round_idx]).generate_state(1, np.uint64)[0])


class DataOrder(torch.utils.data.Sampler):
    """Endless dataset indices for one rank, a function of the images seen only.

    Global position p (counted in images) reads item permutation(seed, epoch)[p mod N], epoch = p // N.
    Each optimizer step covers positions [cur_nimg, cur_nimg + batch), split into chunks of batch_gpu
    handed to the ranks in turn, so a run resumed at any step reads what the uninterrupted run read.
    """

    def __init__(self, size: int, seed: int, rank: int, world_size: int, batch_gpu: int, start_nimg: int):
        super().__init__()
        self.size, self.seed, self.rank, self.world_size = size, seed, rank, world_size
        self.batch_gpu, self.start_nimg = batch_gpu, start_nimg
        self._epoch, self._perm = -1, None

    def index(self, position: int) -> int:
        """Dataset index read at a global image position."""
        epoch = position // self.size
        if epoch != self._epoch:
            self._epoch = epoch
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.size)
        return int(self._perm[position % self.size])

    def __iter__(self) -> Iterator[int]:
        chunk = self.start_nimg // self.batch_gpu + self.rank
        while True:
            for position in range(chunk * self.batch_gpu, (chunk + 1) * self.batch_gpu):
                yield self.index(position)
            chunk += self.world_size


def _ignore_signals(_worker_id: int) -> None:
    # Interruption is the main process's business: it finishes the step with data already queued.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def data_loader(dataset: ImageFolderDataset, order: DataOrder, workers: int, device: torch.device):
    """Batches of batch_gpu (images, labels) in the given order."""
    return torch.utils.data.DataLoader(
        dataset, batch_size=order.batch_gpu, sampler=order, num_workers=workers,
        pin_memory=device.type == "cuda", worker_init_fn=_ignore_signals if workers else None,
        prefetch_factor=2 if workers else None,
    )


def accumulate_gradients(
    ddp: torch.nn.Module, loss_fn: EDM2Loss, encoder: Encoder, batches: Iterator, rounds: int,
    seed: int, rank: int, cur_nimg: int, scale: float, device: torch.device,
) -> torch.Tensor:
    """Backpropagate `rounds` batches, all-reducing gradients after the last; returns the summed mean losses."""
    loss_sum = torch.zeros([], device=device)
    for round_idx in range(rounds):
        sync = round_idx == rounds - 1 or not hasattr(ddp, "no_sync")
        with contextlib.nullcontext() if sync else ddp.no_sync():
            images, labels = next(batches)
            torch.manual_seed(round_seed(seed, rank, cur_nimg, round_idx))
            images = encoder.encode_latents(images.to(device, non_blocking=True))
            labels = labels.to(device, non_blocking=True) if labels.shape[1] else None
            loss = loss_fn(ddp, images, labels)
            # Sum over elements, mean over the rank's share of the batch; DDP averages over ranks.
            loss.sum().mul(scale / (rounds * images.shape[0])).backward()
            loss_sum += loss.detach().mean()
    return loss_sum


def optimizer_step(net: torch.nn.Module, optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Zero non-finite gradients, step Adam at learning rate lr, clear the gradients."""
    for param in net.parameters():
        if param.grad is not None:
            torch.nan_to_num(param.grad, nan=0, posinf=0, neginf=0, out=param.grad)
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def max_memory_gb(device: torch.device) -> float:
    """Peak memory since the last call: CUDA allocations, or the process's peak RSS on the CPU."""
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        return peak / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


class StopFlag:
    """Set by SIGINT/SIGTERM; a second signal aborts at once. all_set() agrees across ranks."""

    def __init__(self):
        self.value = False
        self._group = torch.distributed.new_group(backend="gloo") if torch.distributed.is_initialized() else None
        self._previous = {}

    def __enter__(self) -> StopFlag:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, _frame) -> None:
        if self.value:
            raise KeyboardInterrupt
        self.value = True
        print(f"Received {signal.Signals(signum).name}: finishing this step and writing a checkpoint.", flush=True)

    def all_set(self) -> bool:
        """True when any rank was signalled (a collective call: every rank must make it)."""
        flag = torch.tensor([float(self.value)])
        if self._group is not None:
            torch.distributed.all_reduce(flag, group=self._group)
        return bool(flag.item() > 0)


class _Tee:
    """A text stream writing to two streams."""

    def __init__(self, *streams):
        self.streams = streams

    def write(self, text: str) -> int:
        for stream in self.streams:
            stream.write(text)
            stream.flush()
        return len(text)

    def flush(self) -> None:
        for stream in self.streams:
            stream.flush()


class RunDirectory:
    """Rank 0's files of a run: options, log.txt (tee of stdout), stats.jsonl, snapshots, training states.

    A directory this invocation created is removed again if training fails before its first snapshot
    or training state, so a bad start leaves nothing behind.
    """

    OWN_FILES = (checkpoint.OPTIONS_FILE, "log.txt", "stats.jsonl")

    def __init__(self, path: str):
        self.path = Path(path)
        self.created = [p for p in [self.path, *self.path.parents] if not p.exists()]
        self.has_results = False
        self.path.mkdir(parents=True, exist_ok=True)

    def snapshot_paths(self) -> list[Path]:
        """Network snapshots already in the directory."""
        return sorted(self.path.glob("network-snapshot-*.safetensors"))

    def trim_stats(self, cur_nimg: int) -> None:
        """Drop stats rows past cur_nimg that a killed run wrote after its last checkpoint."""
        path = self.path / "stats.jsonl"
        if not path.is_file():
            return
        rows = [line for line in path.read_text().splitlines() if line.strip()]
        kept = [line for line in rows if json.loads(line)["nimg"] <= cur_nimg]
        if len(kept) != len(rows):
            with files.atomic_path(path) as tmp:
                tmp.write_text("".join(line + "\n" for line in kept))

    def append_stats(self, row: dict) -> None:
        """Add one JSON row to stats.jsonl."""
        with open(self.path / "stats.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")

    def remove_if_fruitless(self) -> None:
        """Undo this invocation's directory when it produced no snapshot or training state."""
        if not self.created or self.has_results:
            return
        for name in self.OWN_FILES:
            (self.path / name).unlink(missing_ok=True)
        for directory in self.created:
            with contextlib.suppress(OSError):  # not empty: someone else's files; keep them
                directory.rmdir()


def _crossed(prev_nimg: int, cur_nimg: int, interval: int) -> bool:
    """True when a multiple of interval lies in (prev_nimg, cur_nimg]."""
    return interval > 0 and cur_nimg // interval > prev_nimg // interval


def _resume_decision(opts: TrainingOptions, run: RunDirectory) -> tuple[str | None, dict | None]:
    """Rank 0: the training state to resume from (path, state), after checking the hyperparameters."""
    found = checkpoint.load_newest_state(run.path, report=lambda msg: print(msg, flush=True))
    current = opts.hyperparameters()
    if found is not None:
        path, state = found
        stored = json.loads(state["options"])
        checkpoint.check_same_hyperparameters(stored, current, HYPERPARAMETERS)
        return str(path), state
    stored_options = checkpoint.load_options(run.path)
    if stored_options is not None and run.snapshot_paths():
        checkpoint.check_same_hyperparameters(stored_options, opts.to_json(), HYPERPARAMETERS)
    return None, None


def train(opts: TrainingOptions, dataset: ImageFolderDataset, encoder: Encoder) -> None:
    """Train (or resume) the run described by opts; every rank calls this after dist.init()."""
    run = RunDirectory(opts.run_dir) if dist.is_main() else None
    try:
        with contextlib.ExitStack() as stack:
            if run:
                log = stack.enter_context(open(run.path / "log.txt", "a"))
                stack.enter_context(contextlib.redirect_stdout(_Tee(sys.stdout, log)))
                stack.enter_context(contextlib.redirect_stderr(_Tee(sys.stderr, log)))
            _train(opts, dataset, encoder, run)
    except BaseException:
        if run:
            run.remove_if_fruitless()
        raise


def _train(opts: TrainingOptions, dataset: ImageFolderDataset, encoder: Encoder, run: RunDirectory | None) -> None:
    rank, world_size, device = dist.get_rank(), dist.get_world_size(), dist.device()
    batch_gpu, rounds = rounds_per_step(opts.batch, opts.batch_gpu, world_size)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
        # FP32 parts stay true FP32, as in the release.
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False

    # Rank 0 decides whether and where to resume; the others follow (or raise the same error).
    path, error, state = None, None, None
    if run:
        try:
            path, state = _resume_decision(opts, run)
        except checkpoint.OptionsMismatch as e:
            error = str(e)
    path, error = dist.broadcast_object((path, error))
    if error:
        raise checkpoint.OptionsMismatch(error)
    if path and state is None:
        state = checkpoint.load_state(path)

    torch.manual_seed(opts.seed)  # identical initial weights on every rank
    net = build_network(opts, encoder.out_channels(opts.dataset["num_channels"])).to(device).train()
    optimizer = torch.optim.Adam(net.parameters(), lr=0, betas=ADAM_BETAS, eps=ADAM_EPS)
    ema = PowerFunctionEMA(net, opts.ema_stds)
    cur_nimg, elapsed_s = 0, 0.0
    if state is not None:
        net.load_state_dict(state["net"])
        optimizer.load_state_dict(state["optimizer"])
        ema.load_state_dict(state["ema"])
        cur_nimg, elapsed_s = int(state["cur_nimg"]), float(state["elapsed_s"])
        del state
    ddp = net
    if world_size > 1:
        ddp = torch.nn.parallel.DistributedDataParallel(net, device_ids=[device.index] if device.type == "cuda" else None)

    if run:
        checkpoint.save_options(run.path, opts.to_json())
        run.trim_stats(cur_nimg)
        run.has_results = bool(path or run.snapshot_paths())
    dtype = net.compute_dtype(device)
    dist.print0(
        f"{'Resuming from ' + Path(path).name if path else 'Starting'} at {cur_nimg} images; "
        f"{count_parameters(net):,} parameters; {world_size} process(es) x {rounds} round(s) x {batch_gpu} "
        f"images; precision {opts.precision}, computing in {str(dtype).removeprefix('torch.')} on {device.type}"
    )
    if cur_nimg >= opts.duration:
        dist.print0(f"Training already complete ({cur_nimg} >= {opts.duration} images).")
        return

    loss_fn = EDM2Loss(opts.P_mean, opts.P_std, net.sigma_data)
    order = DataOrder(len(dataset), opts.seed, rank, world_size, batch_gpu, cur_nimg)
    batches = iter(data_loader(dataset, order, opts.workers, device))
    loss_stats = torch.zeros([2], device=device)  # sum of per-round mean losses, number of rounds
    start_nimg, tick_nimg = cur_nimg, cur_nimg
    tick_time = time.monotonic()

    with StopFlag() as stop:
        while True:
            done = cur_nimg >= opts.duration
            stopping = stop.all_set()
            prev_nimg = cur_nimg - opts.batch
            if cur_nimg != start_nimg and (done or stopping or _crossed(prev_nimg, cur_nimg, opts.status)):
                now = time.monotonic()
                elapsed_s += now - tick_time
                _report_status(run, cur_nimg, tick_nimg, now - tick_time, elapsed_s, opts, loss_stats, device)
                tick_nimg, tick_time = cur_nimg, now
            if cur_nimg != start_nimg and (done or _crossed(prev_nimg, cur_nimg, opts.snapshot)):
                _save_snapshots(run, ema, cur_nimg, opts)
            if cur_nimg != start_nimg and (done or stopping or _crossed(prev_nimg, cur_nimg, opts.checkpoint)):
                _save_checkpoint(run, net, optimizer, ema, cur_nimg, elapsed_s + time.monotonic() - tick_time, opts)
            if done or stopping:
                break

            lr = learning_rate_schedule(cur_nimg, opts.batch, opts.lr, opts.decay, opts.rampup_Mimg)
            loss_stats[0] += accumulate_gradients(
                ddp, loss_fn, encoder, batches, rounds, opts.seed, rank, cur_nimg, opts.ls, device
            )
            loss_stats[1] += rounds
            optimizer_step(net, optimizer, lr)
            cur_nimg += opts.batch
            ema.update(cur_nimg, opts.batch)

    dist.barrier()
    if stopping and not done:
        dist.print0(f"Stopped at {cur_nimg} images; rerun the same command to resume.")
    else:
        dist.print0(f"Training complete: {cur_nimg} images.")


def _report_status(run, cur_nimg, tick_nimg, tick_s, elapsed_s, opts, loss_stats, device) -> None:
    stats = dist.all_reduce_sum(loss_stats.clone()).tolist()
    loss_stats.zero_()
    images_per_s = (cur_nimg - tick_nimg) / max(tick_s, 1e-9)
    row = dict(
        kimg=cur_nimg / 1000, nimg=cur_nimg, loss=stats[0] / max(stats[1], 1),
        lr=learning_rate_schedule(cur_nimg - opts.batch, opts.batch, opts.lr, opts.decay, opts.rampup_Mimg),
        images_per_s=images_per_s, sec_per_kimg=1000 / max(images_per_s, 1e-9),
        max_memory_gb=max_memory_gb(device), elapsed_s=elapsed_s, timestamp=time.time(),
    )
    if run is None:
        return
    print(
        f"kimg {row['kimg']:<10.1f} loss {row['loss']:<8.4f} lr {row['lr']:<9.3e} img/s {images_per_s:<9.1f} "
        f"sec/kimg {row['sec_per_kimg']:<8.3f} maxmem {row['max_memory_gb']:.2f}GB time {_hms(elapsed_s)}",
        flush=True,
    )
    run.append_stats(row)


def _hms(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}h{s // 60 % 60:02d}m{s % 60:02d}s"


def _save_snapshots(run, ema, cur_nimg, opts) -> None:
    if run is None:
        return
    for ema_net, std in ema.get():
        metadata = dict(
            nimg=cur_nimg, ema_std=std, encoder=opts.encoder, dataset=opts.dataset, preset=opts.preset,
            loss=dict(P_mean=opts.P_mean, P_std=opts.P_std), training_options=opts.to_json(),
        )
        save_network(run.path / snapshot_name("network-snapshot", cur_nimg, std), ema_net, metadata)
    run.has_results = True


def _save_checkpoint(run, net, optimizer, ema, cur_nimg, elapsed_s, opts) -> None:
    # Every rank hashes its weights so the checkpoint records that the ranks agree.
    digest = checkpoint.weights_digest(net)
    digests = [None] * dist.get_world_size()
    if torch.distributed.is_initialized():
        torch.distributed.all_gather_object(digests, digest)
    else:
        digests = [digest]
    if len(set(digests)) != 1:
        raise RuntimeError(f"ranks hold different weights at {cur_nimg} images: {digests}")
    if run is None:
        return
    hyperparameters = opts.hyperparameters()
    state = dict(
        net=net.state_dict(), optimizer=optimizer.state_dict(), ema=ema.state_dict(), cur_nimg=cur_nimg,
        elapsed_s=elapsed_s, options=json.dumps(hyperparameters, sort_keys=True),
        options_hash=checkpoint.options_hash(hyperparameters), rank_digests=digests,
    )
    path = checkpoint.state_path(run.path, cur_nimg)
    checkpoint.save_state(path, state)
    run.has_results = True
    print(f"Saved {path.name}", flush=True)
