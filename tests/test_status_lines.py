"""Training status lines: columns that stay put, a rate that measures training rather than file writing, a
partial interval said as such, and a precision note that explains the CPU's float32."""

import types

import pytest
import torch

from edm2.encoders import StandardRGBEncoder
from training.run import loop, outputs
from training.options import TrainingOptions
from training.step import WARMUP_STEPS


def row(nimg: int) -> dict:
    """A stats row at nimg images."""
    return dict(kimg=nimg / 1000, nimg=nimg, loss=0.5, lr=0.01, images_per_s=250.0, sec_per_kimg=4.0,
                max_memory_gb=1.0, elapsed_s=60.0)


def test_columns_stay_put_as_kimg_grows():
    lines = [outputs.status_text(row(n), 131072) for n in (512, 9900, 10240, 100352, 131072)]
    assert [line.split()[1] for line in lines] == ["0.5/131.1", "9.9/131.1", "10.2/131.1", "100.4/131.1",
                                                   "131.1/131.1"]
    for column in ("loss", "lr", "img/s", "sec/kimg", "maxmem", "ETA"):
        assert len({line.index(f" {column} ") for line in lines}) == 1, lines


class Clock:
    """A stand-in for time.monotonic that moves only when told."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_rates_leave_out_writing_time_and_a_stop_says_its_interval_is_partial(monkeypatch, tmp_path, capsys):
    clock = Clock()
    monkeypatch.setattr(outputs.time, "monotonic", clock)
    opts = TrainingOptions.from_preset("toy-tiny", dict(resolution=8, num_channels=3, label_dim=4),
                                       StandardRGBEncoder().config(), run_dir=str(tmp_path), data="unused")
    state = types.SimpleNamespace(cur_nimg=0, elapsed_s=0.0, ema=types.SimpleNamespace(get=lambda: []),
                                  nonfinite=lambda: None)
    rows = []

    def write_slowly(*args):
        clock.now += 100.0  # a snapshot or training state that takes 100 s to write

    run = types.SimpleNamespace(append_stats=rows.append, save_snapshots=write_slowly)
    checkpoints = types.SimpleNamespace(save=write_slowly)
    out = outputs.Outputs(opts, run, checkpoints, state, torch.device("cpu"))
    step_s = 0.5
    for nimg in range(opts.batch, 1024 + 512 + 2 * opts.batch + 1, opts.batch):  # toy-tiny: status 256, snapshot 1Ki
        clock.now += step_s
        state.cur_nimg = nimg
        out.add_loss(torch.tensor(1.0), 1)
        out.write_due(done=False, stopping=nimg == 1024 + 512 + 2 * opts.batch)
    assert [r["nimg"] for r in rows] == [*range(256, 1537, 256), 1600]
    # Every interval, also the one after the snapshot and training state at 1024, ran at batch / step_s.
    assert all(r["images_per_s"] == pytest.approx(opts.batch / step_s, rel=1e-12) for r in rows)
    # The run's time counts everything: the steps and the snapshot and training state at 1024 (the stop's training
    # state is written after the time was last added up).
    assert state.elapsed_s == pytest.approx(1600 / opts.batch * step_s + 2 * 100.0)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("kimg ")]
    assert lines[-1].endswith(" (partial interval: 64 images)")
    assert not any("partial" in line for line in lines[:-1])


def test_the_first_step_is_reported_before_the_first_status_line(reference_run):
    lines = (reference_run / "log.txt").read_text().splitlines()
    first = [i for i, line in enumerate(lines) if line.startswith("First step done: 32 images in ")]
    assert len(first) == 1 and lines[first[0]].endswith("a status line every 512 images")
    assert first[0] < min(i for i, line in enumerate(lines) if line.startswith("kimg "))


def test_the_start_line_explains_why_the_cpu_computes_in_float32(reference_run):
    log = (reference_run / "log.txt").read_text()
    assert "computing in float32 on cpu (--precision=fp16 applies on CUDA; --cpu-16bit uses it on the cpu too)" in log
    assert "precision fp16, computing" not in log


def stepped_outputs(monkeypatch, tmp_path, step_seconds, **overrides):
    """Outputs of a toy-tiny run (no files) whose steps take step_seconds[i] each on a fake clock; its stats rows."""
    clock = Clock()
    monkeypatch.setattr(outputs.time, "monotonic", clock)
    opts = TrainingOptions.from_preset("toy-tiny", dict(resolution=8, num_channels=3, label_dim=4),
                                       StandardRGBEncoder().config(), run_dir=str(tmp_path), data="unused",
                                       **overrides)
    state = types.SimpleNamespace(cur_nimg=0, elapsed_s=0.0, nonfinite=lambda: None)
    rows = []
    run = types.SimpleNamespace(append_stats=rows.append)
    out = outputs.Outputs(opts, run, types.SimpleNamespace(), state, torch.device("cpu"))
    for seconds in step_seconds:
        clock.now += seconds
        state.cur_nimg += opts.batch
        out.add_loss(torch.tensor(1.0), 1)
        out.write_due(done=False, stopping=False)
    return opts, rows


def test_the_warm_up_steps_stay_out_of_the_rate_and_the_eta(monkeypatch, tmp_path, capsys):
    # Two warm-up steps of 100 s each (compiling), then 0.5 s per step: the first line's rate is the training's.
    opts, rows = stepped_outputs(monkeypatch, tmp_path, [100.0] * WARMUP_STEPS + [0.5] * 14, duration=4096)
    assert [r["nimg"] for r in rows] == [256, 512]  # toy-tiny: 32 images per step, a status line every 256
    assert all(r["images_per_s"] == pytest.approx(opts.batch / 0.5, rel=1e-12) for r in rows)
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("kimg "))
    # The ETA is the rest of the duration at the training's rate: (4096 - 256) / 64 = 60 s.
    assert line.endswith("ETA 0h01m00s") and "warm-up" not in line
    assert rows[0]["elapsed_s"] == pytest.approx(2 * 100.0 + 6 * 0.5)  # the run's time keeps them


def test_a_status_line_within_the_warm_up_says_it_counts_it(monkeypatch, tmp_path, capsys):
    opts, rows = stepped_outputs(monkeypatch, tmp_path, [1.0] * (WARMUP_STEPS + 1), status=32)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("kimg ")]
    assert [line.endswith(" (warm-up included)") for line in lines] == [True] * WARMUP_STEPS + [False]
    assert [r["images_per_s"] for r in rows] == pytest.approx([opts.batch / 1.0] * (WARMUP_STEPS + 1), rel=1e-12)


@pytest.mark.parametrize("compiles", [True, False])
def test_a_compiling_run_says_so_before_its_first_step(monkeypatch, capsys, compiles):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/cache/of/graphs")
    opts = types.SimpleNamespace(compiles=lambda device: compiles, duration=0)
    step = types.SimpleNamespace(opts=opts, device=torch.device("cpu"), state=types.SimpleNamespace(cur_nimg=0))
    assert loop._loop(step, None, types.SimpleNamespace(all_set=lambda: False)) is False
    said = capsys.readouterr().out
    notice = outputs.compile_notice(torch.device("cpu"))
    assert said == (notice + "\n" if compiles else "")
    assert notice.startswith(f"Compiling the network, its loss and Adam's update in the first {WARMUP_STEPS} steps "
                             "(this takes about 3 to 6 minutes")
    assert "cached in /cache/of/graphs" in notice
