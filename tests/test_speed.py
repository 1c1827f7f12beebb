"""The speed work changes how the numbers are computed, not which: foreach operations against the loops they
replace (bitwise), channels-last and activation checkpointing against the plain network, bf16 on the CPU
against fp32, and a training step that never waits for the device."""

import copy
import os
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from edm2.eval import benchmark as eval_benchmark
from edm2.layers import force_weight_normalization
from edm2.loss import EDM2Loss
from edm2.phema import PowerFunctionEMA, power_function_beta
from edm2.runtime.speed import (PRECISIONS, compile_cache, precision_dtype, precision_flags, set_precision,
                                snapshot_precision, to_channels_last)
from training.run import benchmark
from training.run.benchmark import synthetic_step, with_unit_gains
from training.run.data_parallel_speed import data_parallel_speed
from training.options import TrainingOptions, check_same_hyperparameters
from training.state import adam, init_network
from training.step import training_step, zero_nonfinite_
from tests.helpers import bits, randomized, tiny_precond

CPU = torch.device("cpu")


class CountOps(TorchDispatchMode):
    """Counts the ATen operations run inside it, by name."""

    def __init__(self):
        super().__init__()
        self.counts = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def test_gradient_cleaning_is_the_release_loop_bitwise_in_a_few_operations():
    torch.manual_seed(0)
    shapes = [(5, 3, 3, 3), (7,), (), (4, 6), (1000,), (8, 16, 1, 1)] * 4
    grads = [torch.randn(s) for s in shapes] + [torch.randn(6, 4, 3, 3).to(memory_format=torch.channels_last)]
    grads += [torch.randn(9, dtype=torch.float16), torch.randn(9, dtype=torch.float64)]
    for g in grads:  # plant NaN, +-inf and -0 where the random mask says
        for value in (float("nan"), float("inf"), -float("inf"), -0.0):
            g[torch.rand(g.shape) < 0.1] = value
    want = [g.clone() for g in grads]
    for g in want:  # the release's loop (training_loop.py), kept here as the reference
        torch.nan_to_num(g, nan=0, posinf=0, neginf=0, out=g)
    with CountOps() as ops:
        zero_nonfinite_(grads, chunk_numel=1500)
    for g, w in zip(grads, want):
        assert g.dtype == w.dtype and g.stride() == w.stride() and torch.equal(bits(g), bits(w))
    # 27 tensors in 3 dtypes: one nan_to_num_ per chunk of one dtype within 1500 elements, not one per tensor.
    assert ops.counts["nan_to_num_"] == ops.counts["cat"] == ops.counts["_foreach_copy_"] == 6


def test_ema_update_is_the_per_tensor_loop_bitwise_in_one_operation_per_track():
    net = randomized(tiny_precond())
    tracker = PowerFunctionEMA(net, stds=(0.05, 0.1))
    reference = [copy.deepcopy(ema) for ema in tracker.emas]
    for step in range(1, 4):
        with torch.no_grad():
            for p in net.parameters():
                p.add_(torch.randn_like(p) * 0.1)
        with CountOps() as ops:
            tracker.update(cur_nimg=32 * step, batch_size=32)
        for std, ema in zip(tracker.stds, reference):  # Eq. 119 tensor by tensor
            beta = power_function_beta(std=std, t_next=32 * step, t_delta=32)
            for p_ema, p in zip(ema.parameters(), net.parameters()):
                p_ema.detach().lerp_(p.detach().float(), 1 - beta)
        assert ops.counts == {"_foreach_lerp_": 2}
        for ema, ref in zip(tracker.emas, reference):
            assert all(torch.equal(bits(a), bits(b)) for a, b in zip(ema.parameters(), ref.parameters()))


def test_foreach_adam_is_single_tensor_adam_bitwise():
    nets = [randomized(tiny_precond()) for _ in range(2)]
    optimizers = [adam(nets[0].parameters(), CPU),
                  torch.optim.Adam(nets[1].parameters(), lr=0, betas=(0.9, 0.99), eps=1e-8, foreach=False)]
    assert optimizers[0].param_groups[0]["foreach"] and not optimizers[0].param_groups[0]["fused"]
    for step in range(3):
        grads = [torch.randn_like(p) for p in nets[0].parameters()]
        for net, optimizer in zip(nets, optimizers):
            for p, g in zip(net.parameters(), grads):
                p.grad = g.clone()
            optimizer.param_groups[0]["lr"] = 0.01 * (step + 1)
            optimizer.step()
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(nets[0].parameters(), nets[1].parameters()))


SYNCING = {"_local_scalar_dense", "is_nonzero", "nonzero", "equal", "allclose", "masked_select", "item"}


class HostReads(TorchDispatchMode):
    """Records every operation that copies a tensor's value to the host: .item(), float(), bool(), nonzero, ...
    (on CUDA each waits for the device). .tolist() and .numpy() do not dispatch, so they are caught apart."""

    def __init__(self):
        super().__init__()
        self.reads = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in SYNCING:
            self.reads.append((func.overloadpacket.__name__, args))
        return func(*args, **(kwargs or {}))


def test_training_step_never_reads_device_values(monkeypatch):
    step = synthetic_step("toy-tiny", 8, CPU, resolution=8, precision="fp32")
    training_step(step)  # Adam creates its state
    for name in ("tolist", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, lambda *a, _n=name, **k: pytest.fail(f"Tensor.{_n} in a step"))
    with HostReads() as mode:
        loss = training_step(step)
    # The only reads are foreach Adam's step counts, which live on the host even when the parameters are on
    # CUDA (fused Adam on CUDA keeps them on the device and reads none).
    steps = [step.state.optimizer.state[p]["step"] for p in step.state.net.parameters()]
    assert all(any(arg is s for s in steps) for _, args in mode.reads for arg in args), mode.reads
    assert loss.shape == () and loss.device == CPU
    with HostReads() as mode:  # the detector sees what a step must not do
        float(loss), bool(loss > 0)
    assert [name for name, _ in mode.reads] == ["_local_scalar_dense"] * 2


def training_gradients(net, seed=0, rounds=1):
    """Loss and parameter gradients of Eq. 21 on a fixed batch; training mode (forced weight normalization)."""
    torch.manual_seed(seed)
    images, labels = torch.randn(4, 3, 8, 8), torch.eye(10)[:4]
    sigma, noise = (torch.randn(4, 1, 1, 1) * 1.2 - 0.4).exp(), torch.randn(4, 3, 8, 8)
    net.train().zero_grad(set_to_none=True)
    for _ in range(rounds):
        force_weight_normalization(net)  # as the training step does before every forward pass
        loss = EDM2Loss()(net, images, labels, sigma=sigma, noise=noise)
        loss.mean().backward()
    return loss.detach(), [p.grad.clone() for p in net.parameters()]


def test_channels_last_computes_what_contiguous_does():
    net = randomized(tiny_precond())
    fast = to_channels_last(copy.deepcopy(net))
    convs = [p for p in fast.parameters() if p.ndim == 4]
    assert convs and all(p.is_contiguous(memory_format=torch.channels_last) for p in convs)
    # Same values, same names: snapshots and training states do not see the memory format.
    assert all(torch.equal(a, b) for a, b in zip(net.state_dict().values(), fast.state_dict().values()))
    (loss, grads), (loss_cl, grads_cl) = training_gradients(net), training_gradients(fast)
    # The NHWC convolution kernels sum the same products in another order: float32 round-off of a sum of up to
    # 9 x 32 terms (eps 1.2e-7 x sqrt(288) ~ 2e-6 relative per layer), compounded over about ten layers in a
    # path, ~2e-5 relative; gradients also sum over 4 images x 64 pixels. 1e-4 relative allows 5x that.
    torch.testing.assert_close(loss_cl, loss, rtol=1e-4, atol=1e-5)
    for g_cl, g in zip(grads_cl, grads):
        torch.testing.assert_close(g_cl, g, rtol=1e-4, atol=1e-4 * g.abs().max().item())
    # Training mode renormalized the weights in place identically (the forced normalization is elementwise).
    for a, b in zip(net.parameters(), fast.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=0)


@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_checkpointed_blocks_give_the_same_gradients_and_weights_with_less_stored(dropout):
    net = randomized(tiny_precond(dropout=dropout))
    lean = copy.deepcopy(net)
    lean.unet.checkpoint_blocks = True

    def stored_bytes(model):
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel() * t.element_size()) or t,
                                                      lambda t: t):
            result = training_gradients(model, rounds=2)  # accumulation: two forwards before any update
        return result, sum(saved)

    ((loss, grads), full), ((loss_l, grads_l), stored) = stored_bytes(net), stored_bytes(lean)
    # The replay runs the same kernels on the same inputs with the same dropout masks (RNG state restored), and
    # writes no weights (Eq. 66 comes before the forward pass): bit-for-bit the plain network.
    assert torch.equal(bits(loss_l), bits(loss))
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(grads_l, grads))
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(lean.parameters(), net.parameters()))
    assert stored < full / 2, (stored, full)


def test_bf16_training_on_the_cpu_follows_fp32():
    runs = {}
    for precision in ("fp32", "bf16"):
        step = synthetic_step("toy-tiny", 16, CPU, resolution=8, precision=precision, cpu_16bit=True, seed=1)
        assert step.state.net.compute_dtype(CPU) == {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
        with_unit_gains(step.state.net)  # as a trained net has: a fresh net's zero gains hide the U-Net's output
        runs[precision] = torch.stack([training_step(step) for _ in range(40)])
    fp32, bf16 = runs["fp32"], runs["bf16"]
    # bf16 keeps 8 significant bits (unit round-off u = 2^-9). Rounding the input and the weight of each of the
    # ~16 layers on the network's longest path adds independent relative errors of about u each, so the U-Net
    # output F carries delta ~ u sqrt(2 x 16) = 1.1e-2 relative error. Eq. 21 with lambda c_out^2 = 1 makes the
    # loss mean((F - F_target)^2) / e^u + u, quadratic in F: a step's loss moves by at most ~2 delta relative.
    # Both runs draw the same noise, so the curves can be compared step by step.
    torch.testing.assert_close(bf16, fp32, rtol=2 * 2**-9 * math.sqrt(32), atol=0)
    assert not torch.equal(bf16, fp32)  # the U-Net really computed in bfloat16
    assert fp32[-10:].mean() < 0.75 * fp32[:5].mean() and bf16[-10:].mean() < 0.75 * bf16[:5].mean()


def test_speed_options_default_by_device_and_never_block_a_resume():
    def options(**speed):
        return TrainingOptions.from_preset("toy-tiny", dataset=dict(resolution=8, num_channels=3, label_dim=4),
                                           encoder={}, **speed)

    plain, fast = options(), options(compile=True, channels_last=True, checkpoint_activations=True, cpu_16bit=True)
    cuda = torch.device("cuda", 0)
    assert (plain.compiles(CPU), plain.compiles(cuda), plain.uses_channels_last(CPU), plain.uses_channels_last(cuda)) \
        == (False, True, False, True)
    assert fast.compiles(CPU) and fast.uses_channels_last(CPU) and not options(compile=False).compiles(cuda)
    check_same_hyperparameters(plain.hyperparameters(), fast.hyperparameters())  # a resume may switch them


def test_a_loaded_optimizer_keeps_this_runs_implementation():
    def trained_state(optimizer_kwargs):
        step = synthetic_step("toy-tiny", 8, CPU, resolution=8)
        step.state.optimizer = torch.optim.Adam(step.state.net.parameters(), lr=0, **optimizer_kwargs)
        training_step(step)
        return step.state

    fused, foreach = trained_state(dict(fused=True)), trained_state(dict(foreach=True))  # a CUDA run's, a CPU run's
    saved_fused, saved_foreach = fused.to_dict(), foreach.to_dict()
    fused.load(saved_foreach)
    foreach.load(saved_fused)
    # Each keeps its own implementation (a saved optimizer would otherwise impose its run's) and the moments it read.
    assert (fused.optimizer.param_groups[0]["fused"], fused.optimizer.param_groups[0]["foreach"]) == (True, None)
    assert (foreach.optimizer.param_groups[0]["fused"], foreach.optimizer.param_groups[0]["foreach"]) == (None, True)
    for a, b in ((fused, saved_foreach), (foreach, saved_fused)):
        states = [a.optimizer.state[p] for p in a.net.parameters()]
        assert all(s["step"].dtype == torch.float32 and s["step"].item() == 1 for s in states)
        assert all(torch.equal(s["exp_avg"], b["optimizer"]["state"][i]["exp_avg"]) for i, s in enumerate(states))


@pytest.mark.parametrize("precision", PRECISIONS)
def test_a_precision_name_maps_to_the_flags_and_dtype_it_computes_in_and_back(precision):
    # The one mapping (edm2.runtime.speed): a network built with its flags computes in its dtype, and reads back as
    # its name.
    net = tiny_precond(**precision_flags(precision))
    net.cpu_16bit = True  # compute as on CUDA
    assert net.compute_dtype(CPU) == precision_dtype(precision) and snapshot_precision(net) == precision
    other = set_precision(tiny_precond(use_fp16=precision != "fp16", use_bf16=precision != "bf16"), precision, True)
    assert other.compute_dtype(CPU) == precision_dtype(precision) and snapshot_precision(other) == precision
    # A training network is built with the same flags.
    opts = TrainingOptions.from_preset("toy-tiny", dict(resolution=8, num_channels=3, label_dim=4), {},
                                       precision=precision)
    assert snapshot_precision(init_network(opts, 3)) == precision


def test_the_data_parallel_measurement_trains_one_model_over_its_processes():
    # scripts/bench_release.py and bench_load.py time torchrun's CPU setting with it: the processes must really
    # all-reduce (each rank draws its own noise, so without it their weights part after the first step).
    speed = data_parallel_speed("toy-tiny", 4, 2, steps=2, warmup=1, rounds=1)
    assert len(speed.digests) == 2 and speed.digests[0] == speed.digests[1]
    assert math.isfinite(speed.images_per_s) and speed.images_per_s > 0
    with pytest.raises(ValueError, match="does not split over 3 processes"):
        data_parallel_speed("toy-tiny", 4, 3)


def test_the_timed_window_holds_every_step_between_two_barriers(monkeypatch):
    # The dry run and data_parallel_speed share it: a window opened and closed on barriers, read after the last loss.
    events, clock = [], [0.0]

    def step(_):
        events.append("step")
        clock[0] += 0.25
        return torch.tensor(1.0)

    def now():
        events.append("clock")
        return clock[0]

    monkeypatch.setattr(benchmark, "training_step", step)
    monkeypatch.setattr(benchmark.time, "perf_counter", now)
    monkeypatch.setattr(benchmark.distributed, "barrier", lambda: events.append("barrier"))
    rate = benchmark.group_images_per_s(object(), steps=3, images=8)
    assert events == ["barrier", "clock", "step", "step", "step", "barrier", "clock"]
    assert rate == 3 * 8 / 0.75  # 0.75 s and 32 images/s are exact in binary


def test_seconds_per_call_times_every_call_at_this_process_s_thread_count(monkeypatch):
    # torch.utils.benchmark.Timer would time at one thread unless told; the benchmarks measure the threads they set.
    seen, clock = [], [0.0]
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: seen.append(("set", n)))

    def call():
        seen.append("call")
        clock[0] += 0.125

    monkeypatch.setattr(eval_benchmark.time, "perf_counter", lambda: clock[0])
    seconds = eval_benchmark.seconds_per_call(call, calls=4, warmup=1, device=CPU)
    assert seconds == 0.125  # the clock advances 0.125 s per call, exactly, and only inside calls
    assert all(entry == ("set", 3) for entry in seen if entry != "call") and seen.count("call") >= 1 + 4


def test_compiled_graphs_are_cached_per_pytorch_and_cpu_kernels_unless_told_where(monkeypatch, tmp_path):
    monkeypatch.setenv("EDM2_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    kernels = f"{torch.__version__}-{torch.backends.cpu.get_cpu_capability()}".lower()
    assert compile_cache() == tmp_path / "torchinductor" / kernels
    # Set for inductor, which reads the variable: every compile of this process and its children uses the folder.
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "torchinductor" / kernels)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert compile_cache() == tmp_path / "mine"
