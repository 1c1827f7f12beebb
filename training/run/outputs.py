"""What a run writes as it goes, each at its interval and at the end: status lines with stats.jsonl rows,
EMA snapshots with the dashboard, and training states."""

from __future__ import annotations

import math
import resource
import time

import torch

from edm2.consistency_loss import ConsistencyLoss, stats_row
from edm2.runtime import distributed
from edm2.runtime.speed import compile_cache
from edm2.runtime.utilization import utilization
from training.run.checkpoint import Checkpoints
from training.run.dashboard import Dashboard, write_metrics
from training.run.metrics import RunMetrics
from training.lr_schedule import learning_rate_schedule
from training.options import TrainingOptions
from training.run.run_dir import RunDirectory, snapshot_path
from training.run.sample_grid import SampleGrid
from training.state import FLOAT16, NonFiniteError, TrainingState, first_nonfinite
from training.step import WARMUP_STEPS
from training.run.trackers import STATUS_KEYS, Trackers


def crossed(prev_nimg: int, cur_nimg: int, interval: int) -> bool:
    """True when a multiple of interval lies in (prev_nimg, cur_nimg]."""
    return interval > 0 and cur_nimg // interval > prev_nimg // interval


def max_memory_gb(device: torch.device) -> float:
    """Peak memory since the last call: CUDA allocations, or the process's peak RSS on the CPU."""
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        return peak / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def hms(seconds: float) -> str:
    """Seconds as '1h02m03s'."""
    s = int(seconds)
    return f"{s // 3600}h{s // 60 % 60:02d}m{s % 60:02d}s"


def status_text(row: dict, duration: int) -> str:
    """A stats row as a status line; kimg is padded to the duration's width, so the columns never shift."""
    total = f"{duration / 1000:.1f}"
    eta = hms(max(duration - row["nimg"], 0) / max(row["images_per_s"], 1e-9))
    speed = f"TFLOP/s {row['tflops']:<8.3g} " if "tflops" in row else ""
    speed += f"MFU {row['mfu']:<6.1%} " if row.get("mfu") is not None else ""
    return (f"kimg {row['kimg']:>{len(total)}.1f}/{total} loss {row['loss']:<8.4f} lr {row['lr']:<9.3e} "
            f"img/s {row['images_per_s']:<9.1f} sec/kimg {row['sec_per_kimg']:<8.3f} {speed}"
            f"maxmem {row['max_memory_gb']:.2f}GB time {hms(row['elapsed_s'])} ETA {eta}")


def compile_notice(device: torch.device) -> str:
    """The line a compiling run prints before its first step: how long compiling takes and where its graphs are
    cached (edm2.runtime.speed.compile_cache)."""
    what = "the network, its loss and Adam's update" if device.type == "cpu" else "the network and its loss"
    took = "about 3 to 6 minutes on two busy CPU cores" if device.type == "cpu" else "a few minutes"
    return (f"Compiling {what} in the first {WARMUP_STEPS} steps (this takes {took}; images/s and the ETA leave "
            f"them out); the compiled graphs are cached in {compile_cache()}, so a later run with the same graphs "
            "compiles faster")


def unstorable(tracks: list[tuple[torch.nn.Module, float]]) -> str | None:
    """What of the EMA tracks (the networks and sigma_rel of the tracker's get()) the snapshots' float16
    (edm2.formats.snapshot.save_network) cannot hold: NaN, infinity or a magnitude that overflows there; or None."""
    return first_nonfinite((f"EMA track sigma_rel {std:.3f}: {name}", t, FLOAT16)
                           for net, std in tracks for name, t in net.state_dict().items())


class Outputs:
    """The writers of one run. Every rank makes the same calls (they hold collectives); rank 0 writes."""

    def __init__(self, opts: TrainingOptions, run: RunDirectory | None, checkpoints: Checkpoints, state: TrainingState,
                 device: torch.device, dashboard: Dashboard | None = None, trackers: Trackers | None = None,
                 grid: SampleGrid | None = None, metrics: RunMetrics | None = None,
                 speed: tuple[float, float | None] | None = None, consistency: ConsistencyLoss | None = None):
        self.opts, self.run, self.checkpoints, self.state = opts, run, checkpoints, state
        self.consistency = consistency  # a consistency model's loss, whose tangent and gradient norms rows report
        self.speed = speed  # (useful FLOPs per image, one process's peak TFLOP/s) for the MFU columns
        self.device, self.dashboard = device, dashboard
        self.trackers, self.grid, self.metrics = trackers, grid, metrics
        self.loss_stats = torch.zeros([2], device=device)  # sum of per-round mean losses, number of rounds
        self._clock = self._tick_time = time.monotonic()
        self._tick_nimg = self._rate_nimg = state.cur_nimg
        self._steps = 0  # steps of this process so far: the first WARMUP_STEPS compile and start up

    def add_loss(self, loss_sum: torch.Tensor, rounds: int) -> None:
        """Count one step's summed per-round mean losses toward the next status line."""
        self.loss_stats[0] += loss_sum
        self.loss_stats[1] += rounds

    def write_due(self, done: bool, stopping: bool) -> None:
        """After a step: the status line, snapshots and training state whose interval was crossed; at the end
        (done) all three, and on a stop (stopping) the status line and a training state."""
        now = time.monotonic()
        self.state.elapsed_s += now - self._clock
        self._clock = now
        cur, opts = self.state.cur_nimg, self.opts
        prev = cur - opts.batch
        self._steps += 1
        if self._steps == 1 and self.run is not None and opts.status:
            # A sign of life long before the first status line (2Ki images take over a minute on a CPU).
            print(f"First step done: {opts.batch} images in {now - self._tick_time:.1f} s, start-up included; a "
                  f"status line every {opts.status} images", flush=True)
        status = done or stopping or crossed(prev, cur, opts.status)
        snapshot, checkpoint = done or crossed(prev, cur, opts.snapshot), done or stopping or crossed(
            prev, cur, opts.checkpoint)
        if status:
            self.status(partial=not crossed(prev, cur, opts.status))
        writing = time.monotonic()
        if status or snapshot or checkpoint:
            self.check_finite()
        if snapshot:
            self.snapshots()
            if self.run:
                self.report_snapshot()
            if self.metrics and self.metrics.due(prev, cur, done):
                self.metrics_row()
        if checkpoint:
            self.training_state()
        # The next status line's images/s measures training, not the seconds spent checking and writing these files.
        self._tick_time += time.monotonic() - writing
        if self._steps == WARMUP_STEPS:  # nor the warm-up steps (start-up, compiling): from here on images/s counts
            self._tick_time, self._rate_nimg = time.monotonic(), cur

    def status(self, partial: bool = False) -> None:
        """Print a status line and append its stats.jsonl row (loss averaged over ranks since the last one);
        partial: the line ends an interval early (a stop, or the duration), which the line says."""
        stats = distributed.all_reduce_sum(self.loss_stats.clone()).tolist()
        self.loss_stats.zero_()
        extra = {}
        if self.consistency is not None:  # summed over ranks: every rank stops alike
            extra = stats_row(distributed.all_reduce_sum(self.consistency.take_stats()).tolist())
            if not math.isfinite(extra["g_norm"]):
                self.stop_nonfinite(f"the consistency tangent's norm ||g|| since the last status line is "
                                    f"{extra['g_norm']}")
        if not math.isfinite(stats[0]):  # the same sum on every rank: they all stop here
            self.stop_nonfinite(f"the training loss since the last status line is {stats[0]}")
        cur, opts, now = self.state.cur_nimg, self.opts, time.monotonic()
        interval = cur - self._tick_nimg
        # Within the warm-up steps, the rate is all there is to measure; the line says so (warm_up below).
        warm_up = self._steps <= WARMUP_STEPS
        images_per_s = (cur - self._rate_nimg) / max(now - self._tick_time, 1e-9)
        self._tick_nimg, self._rate_nimg, self._tick_time = cur, cur, now
        row = dict(
            kimg=cur / 1000, nimg=cur, loss=stats[0] / max(stats[1], 1),
            lr=learning_rate_schedule(cur - opts.batch, opts.batch, opts.lr, opts.decay, opts.rampup_Mimg),
            images_per_s=images_per_s, sec_per_kimg=1000 / max(images_per_s, 1e-9),
            max_memory_gb=max_memory_gb(self.device), elapsed_s=self.state.elapsed_s, timestamp=time.time(), **extra,
        )
        if self.speed is not None:
            flops_per_image, peak = self.speed
            row |= utilization(flops_per_image, images_per_s, peak, distributed.get_world_size())
        if self.run is None:
            return
        print(status_text(row, opts.duration) + (f" (partial interval: {interval} images)" if partial else "")
              + (" (warm-up included)" if warm_up else ""), flush=True)
        self.run.append_stats(row)
        if self.trackers:
            self.trackers.log("status", cur, {f"train/{key}": row[key] for key in STATUS_KEYS
                                              if row.get(key) is not None})

    def check_finite(self) -> None:
        """Every rank: stop (NonFiniteError) when any rank's weights, EMA tracks or Adam moments hold NaN or infinity,
        before anything of this step is written; a sweep of reductions at status, snapshot and checkpoint time only,
        never a wait per step."""
        found = [problem for problem in distributed.all_gather_object(self.state.nonfinite()) if problem]
        if found:
            self.stop_nonfinite(found[0])

    def stop_nonfinite(self, what: str) -> None:
        """Raise NonFiniteError naming the image count and what went non-finite."""
        cur = self.state.cur_nimg
        raise NonFiniteError(f"training stopped at kimg {cur / 1000:.1f} ({cur} images): {what}; nothing more is "
                             "written, the snapshots and training states written so far are kept (a lower --lr, or "
                             "data of a sane range, may help)")

    def snapshots(self) -> None:
        """Rank 0: the EMA snapshots and the dashboard. Every rank calls this: a sharded EMA gathers its tracks on
        rank 0 (edm2.runtime.sharded_ema), and they are freed on return, before anything else loads a network."""
        tracks = self.state.ema.get()
        problem = distributed.broadcast_object(unstorable(tracks) if self.run else None)
        if problem:
            self.stop_nonfinite(problem)
        if self.run:
            self.run.save_snapshots(tracks, self.state.cur_nimg, self.opts)
        if self.dashboard:
            self.dashboard.update(tracks[0][0], self.state.cur_nimg)

    def report_snapshot(self) -> None:
        """Rank 0: the sample grid of the snapshot just written (first EMA track), and the snapshot's numbers and
        grid to the trackers."""
        cur = self.state.cur_nimg
        grid = self.grid.write(snapshot_path(self.run.path, cur, self.opts.ema_stds[0]), cur) if self.grid else None
        if self.trackers:
            self.trackers.log("snapshot", cur, self.dashboard.numbers() if self.dashboard else {},
                              {} if grid is None else {"samples": grid})

    def metrics_row(self) -> None:
        """Measure the snapshot just written (training/run/metrics.py, every rank); rank 0 prints its line and logs
        its row to stats.jsonl, the trackers and the dashboard's metrics.png."""
        row = self.metrics.measure(self.state.cur_nimg)
        if row is None or self.run is None:
            return
        print(f"kimg {row['kimg']:.1f} metrics: " + "  ".join(f"{k} {v:.6g}" for k, v in row["metrics"].items())
              + f" ({row['seconds']:.1f} s)", flush=True)
        self.run.append_stats(row)
        if self.trackers:
            self.trackers.log("metrics", row["nimg"], {f"metrics/{k}": v for k, v in row["metrics"].items()})
        if self.dashboard:
            write_metrics(self.run.path)

    def training_state(self) -> None:
        """Write a training state (training/run/checkpoint.py), after the trackers flushed what they logged up to it."""
        if self.trackers:  # what was logged up to this state survives a kill
            self.trackers.flush()
        self.checkpoints.save(self.state, self.opts)
