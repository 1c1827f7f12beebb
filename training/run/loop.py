"""The EDM2 training loop: steps of the paper's recipe until the duration, with status lines, EMA snapshots and
training states at their intervals, exact resume, and a clean stop on SIGTERM/SIGINT.

The life of a run, in order (every rank runs it; rank 0 alone writes files):
1. options: training/options.py (TrainingOptions, which check themselves when built; resolved by train_edm2.py).
2. preflight: training/run/preflight.py (check_run: the data, encoder, batch split and --init fit the options),
   before anything is written.
3. run directory and its lock: training/run/run_dir.py (RunDirectory.open and its RunLock), log.txt
   through training/run/log_tee.py, SIGTERM/SIGINT caught by training/run/signals.py.
4. checkpoints.resume: training/run/checkpoint.py (Checkpoints.resume loads the newest valid training state into
   training/state.py's TrainingState); the data is checked against what the state records (training/data_record.py);
   then training_options.json and stats.jsonl catch up with it (run_dir).
5. data order: training/data_order.py (run_batches: this rank's batches from the images seen on).
6. step: training/step.py (Eq. 67's learning rate from training/lr_schedule.py, Eq. 66 before each forward pass,
   Eq. 21's loss, Adam, the EMA update, sharded over the ranks with --ema-shard).
7. outputs: training/run/outputs.py (status lines and stats.jsonl, EMA snapshots with training/run/dashboard.py and
   training/run/sample_grid.py, training/run/trackers.py).
8. checkpoints.save: training/run/checkpoint.py (Checkpoints.save at each checkpoint interval, a stop and the end).
Steps 6 to 8 repeat until the duration or a stop signal.
"""

from __future__ import annotations

import contextlib
import signal
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import torch

from edm2.consistency_loss import ConsistencyLoss
from edm2.networks import count_parameters
from edm2.runtime import distributed
from edm2.runtime.sharded_ema import ShardedPowerFunctionEMA
from edm2.runtime.speed import cpu_16bit_units, precision_dtype
from edm2.runtime.utilization import peak_tflops
from training.run.checkpoint import Checkpoints
from training.run.dashboard import Dashboard
from training.run.disk import disk_report
from training.data_order import run_batches
from training.data_record import DataChanged, data_change, data_record
from training.run.log_tee import tee_output
from training.run.metrics import RunMetrics
from training.options import TrainingOptions, rounds_per_step
from training.run.outputs import Outputs, compile_notice
from training.run.preflight import check_run
from training.run.run_dir import LOG_FILE, RunDirectory
from training.run.sample_grid import SampleGrid, grid_classes
from training.run.signals import StopFlag, write_stop_marker
from training.state import TrainingState, training_flops
from training.text_conditioning import put_empty_condition
from training.step import TrainingStep, data_parallel, training_step
from training.run.trackers import Trackers

if TYPE_CHECKING:
    from edm2.data.dataset import ImageData
    from edm2.encoders import Encoder


def train(opts: TrainingOptions, dataset: ImageData, encoder: Encoder,
          start_notes: Sequence[str] = ()) -> signal.Signals | None:
    """Train (or resume) the run described by opts; every rank calls this inside distributed.session().
    start_notes: lines for rank 0 to print once the run directory is its own (a refused start prints only its error).

    Returns the signal that stopped this process's run before its duration, or None.
    """
    # Before the run directory: what the command line refuses, a run from Python is refused alike.
    distributed.on_main_rank(lambda: check_run(opts, dataset, encoder, distributed.get_world_size()))
    notes: list[str] = list(start_notes) if distributed.is_main() else []
    # The console guard comes first: a signal's message must not raise from its handler on a dead console.
    with tee_output(None), StopFlag() as stop, contextlib.ExitStack() as stack:
        # Rank 0 owns the run directory (DestinationInUse if another training holds it); the other ranks share its
        # errors.
        run = distributed.on_main_rank(
            lambda: stack.enter_context(RunDirectory.open(opts.run_dir, report=notes.append)))
        if run is not None:
            stack.enter_context(tee_output(run.path / LOG_FILE))
        for note in notes:
            print(note, flush=True)
        checkpoints = Checkpoints(run)
        step = _resume(opts, dataset, encoder, run, checkpoints, stack)
        if step.state.cur_nimg >= opts.duration:
            distributed.print0(f"Training already complete ({step.state.cur_nimg} >= {opts.duration} images).")
        elif _loop(step, Outputs(opts, run, checkpoints, step.state, step.device,
                                 _dashboard(run, opts, dataset, encoder, step),
                                 **_reporters(run, opts, encoder, step, stack),
                                 metrics=_metrics(opts, dataset, encoder, step.device),
                                 consistency=_consistency(step)), stop):
            distributed.print0(f"Stopped at {step.state.cur_nimg} images; rerun the same command to resume.")
            write_stop_marker(step.state.cur_nimg)
        else:
            distributed.print0(f"Training complete: {step.state.cur_nimg} images.")
    return stop.signal


def _loop(step: TrainingStep, outputs: Outputs, stop: StopFlag) -> bool:
    """Step until the duration or a stop signal; returns True when stopped early."""
    start_nimg = step.state.cur_nimg
    if step.opts.compiles(step.device):  # the first steps compile: minutes without a line otherwise
        distributed.print0(compile_notice(step.device))
    while True:
        done = step.state.cur_nimg >= step.opts.duration
        stopping = stop.all_set()
        if step.state.cur_nimg != start_nimg:
            outputs.write_due(done=done, stopping=stopping)  # status line, snapshots, training state
        if done or stopping:
            distributed.barrier()
            return not done
        # Eq. 67's learning rate, Eq. 21's gradients over `rounds` batches, Adam, the EMA update (Eq. 119/127).
        loss_sum = training_step(step)
        outputs.add_loss(loss_sum, step.rounds)


def _resume(opts: TrainingOptions, dataset: ImageData, encoder: Encoder, run: RunDirectory | None,
            checkpoints: Checkpoints, stack: contextlib.ExitStack) -> TrainingStep:
    """The run's step parts, its state new or loaded from the newest valid training state, its batches (their loader
    stopped when stack closes)."""
    rank, world_size, device = distributed.get_rank(), distributed.get_world_size(), distributed.device()
    batch_gpu, rounds = rounds_per_step(opts.batch, opts.batch_gpu, world_size)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
        # FP32 parts stay true FP32, as in the release.
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    state = TrainingState.create(opts, encoder.out_channels(opts.dataset["num_channels"]), device)
    put_empty_condition(state.net, dataset)  # a resumed state's own comes with it
    path = checkpoints.resume(state, opts)
    distributed.on_main_rank(lambda: _check_data(state, path, dataset, opts))
    if run:
        run.write_options(opts)
        run.trim_stats(state.cur_nimg)
    dtype = str(state.net.compute_dtype(device)).removeprefix("torch.")
    sharded = isinstance(state.ema, ShardedPowerFunctionEMA)
    distributed.print0(
        f"{_start(path, opts.init)} at {state.cur_nimg} images{_init_recipe(path, opts)}; "
        f"{count_parameters(state.net):,} parameters; {world_size} process(es) x {rounds} round(s) x {batch_gpu} "
        f"images; computing in {dtype} on {device.type}{_precision_note(opts, dtype, device)}"
        + (f"; each process keeps 1/{world_size} of the EMA tracks" if sharded else "")
    )
    if run:
        for line in disk_report(opts, state.net, state.cur_nimg, run.path):
            if line:
                print(line, flush=True)
    model = data_parallel(state.net, world_size, device, opts.method)
    batches = stack.enter_context(run_batches(dataset, opts.seed, state.cur_nimg, batch_gpu, opts.workers, device,
                                              state.data_order))
    return TrainingStep.of_run(state, opts, encoder, batches, device=device, rounds=rounds, model=model, rank=rank)


def _check_data(state: TrainingState, path: Path | None, dataset: ImageData, opts: TrainingOptions) -> None:
    """Rank 0: refuse (DataChanged) to resume on data other than the training state records, unless
    --allow-data-change, when the change is said (into the run's log); a state that records no data is resumed as it
    always was, said once. From here the state records this data."""
    current = data_record(dataset)
    if path is not None and state.data is None:
        print(f"Note: {path.name} records nothing of its data (written before training states did), so the data "
              "cannot be checked against it.", flush=True)
    change = None if path is None or state.data is None else data_change(state.data, current)
    if change and not opts.allow_data_change:
        raise DataChanged(f"{path}: the data is not what this training state was trained on: {change}; its order "
                          "from here would not be the uninterrupted run's (--allow-data-change goes on)")
    if change:
        print(f"Warning: the data is not what {path.name} was trained on: {change}; going on "
              "(--allow-data-change), the order of the data from here not the uninterrupted run's.", flush=True)
    state.data = current


def _precision_note(opts: TrainingOptions, dtype: str, device: torch.device) -> str:
    """Why the computing dtype is not --precision's, when it is not (the CPU computes in float32 by default), and on a
    CPU whether it has the 16-bit matrix instructions that would make --cpu-16bit pay (edm2.runtime.speed)."""
    units = cpu_16bit_units() if device.type == "cpu" else None
    if dtype != str(precision_dtype(opts.precision)).removeprefix("torch."):
        faster = f": this CPU has {units}, which computes bfloat16 faster than float32" \
            if units and opts.precision == "bf16" else ""
        return f" (--precision={opts.precision} applies on CUDA; --cpu-16bit uses it on the {device.type} too{faster})"
    if device.type == "cpu" and dtype != "float32" and not units:
        return " (this CPU has no 16-bit matrix instructions: it emulates them, several times slower than float32; " \
               "leave out --cpu-16bit)"
    return ""


def _start(path: Path | None, init: str | None) -> str:
    """How the first line of a run says where it starts: the training state it resumes, or the --init snapshot."""
    if path:
        return f"Resuming from {path.name}"
    return f"Starting from {init}" if init else "Starting"


def _init_recipe(path: Path | None, opts: TrainingOptions) -> str:
    """For a run starting from an --init snapshot: the label dropout and learning rate it trains with, which are
    this run's options, not the snapshot's run's."""
    if path or not opts.init:
        return ""
    return (f" (label dropout {opts.label_dropout}, learning rate alpha_ref {opts.lr:.4g} ramped up from image 0 as "
            "in a new run: not the snapshot's)")


def _dashboard(run: RunDirectory | None, opts: TrainingOptions, dataset: ImageData, encoder: Encoder,
               step: TrainingStep) -> Dashboard | None:
    """Rank 0's dashboard (RUN/plots/, redrawn at every snapshot); None on the other ranks."""
    if run is None:
        return None
    return Dashboard(run.path, opts, dataset, encoder, step.state.net, step.device, step.state.cur_nimg)


def _reporters(run: RunDirectory | None, opts: TrainingOptions, encoder: Encoder, step: TrainingStep,
               stack: contextlib.ExitStack) -> dict:
    """Rank 0's trackers (closed when training ends) and sample grid, as Outputs arguments; none elsewhere."""
    if run is None:
        return {}
    trackers = Trackers(opts.loggers, run.path, opts.to_json(), step.state.cur_nimg)
    stack.callback(trackers.close)
    grid = SampleGrid(run.path, encoder, *opts.grid, opts.grid_steps, step.device) if opts.grid else None
    if grid and grid_classes(grid.rows, step.state.net.label_dim):
        print(grid_classes(grid.rows, step.state.net.label_dim), flush=True)
    return dict(trackers=trackers, grid=grid, speed=_utilization(opts, step))


def _utilization(opts: TrainingOptions, step: TrainingStep) -> tuple[float, float | None]:
    """(useful FLOPs per training image, one process's peak TFLOP/s) for the status lines' MFU; said once."""
    flops = training_flops(opts, step.state.net.img_channels)
    peak, source = peak_tflops(step.device, step.state.net.compute_dtype(step.device), opts.peak_tflops)
    print(f"MFU counts {flops / 1e9:.4g} GFLOP per training image (3 x 2 x the network's multiply-accumulates) "
          f"against {'no peak' if peak is None else f'{peak:.4g} TFLOP/s per process'}: {source}", flush=True)
    return flops, peak


def _consistency(step: TrainingStep) -> ConsistencyLoss | None:
    """A consistency model's loss, whose statistics the stats rows report; None for a diffusion model."""
    return step.loss_fn if isinstance(step.loss_fn, ConsistencyLoss) else None


def _metrics(opts: TrainingOptions, dataset: ImageData, encoder: Encoder,
             device: torch.device) -> RunMetrics | None:
    """Every rank's metrics of the snapshots (train_edm2.py --metrics), or None."""
    return RunMetrics(opts, dataset, encoder, device) if opts.metrics else None

