"""Model-FLOPs utilization (MFU): the training step's useful FLOPs per second over what the device could do.

The useful FLOPs are those of the network's forward pass as torch.utils.flop_counter counts them (2 per
multiply-accumulate of the convolutions, matrix products and attention) x 3 passes (forward, and a backward of twice
its cost), the convention of MFU; activation checkpointing's recomputation is not useful work. The peak is the
device's dense matrix peak in the precision the step computes in: from a table for the common GPUs, measured once
per machine on a CPU (cached), or given.
"""

from __future__ import annotations

import hashlib
import json
import platform
import time
from typing import Callable

import torch
from torch.utils.flop_counter import FlopCounterMode

from edm2.errors import EDM2Error, shown
from edm2.networks import Precond
from edm2.runtime import bounded_json, files

# Dense tensor-core peaks in TFLOP/s from the vendors' data sheets: (16-bit, TF32). The first name that occurs in
# torch.cuda.get_device_name() wins, so the specific names come before the general ones.
GPU_PEAK_TFLOPS = {
    "H100 PCIe": (756.0, 378.0),
    "H100 NVL": (835.0, 417.5),
    "H100": (989.4, 494.7),  # SXM
    "H200": (989.4, 494.7),
    "A100": (312.0, 156.0),
    "L40S": (362.05, 181.0),
    "RTX 4090": (165.2, 82.6),  # with float32 accumulation, as PyTorch computes
}
CPU_PEAK_FILE = "cpu-matmul-peak.json"
# Each timed kernel grows from the smallest size, doubling while one call takes under _PEAK_SECONDS, up to the
# largest: BLAS/oneDNN reach their peak by about 1024 on a CPU, while a 16-bit kernel that a CPU without 16-bit
# instructions emulates (about 1 GFLOP/s) stays small, so that a start never waits for minutes.
_PEAK_SIZES = (128, 2048)
_PEAK_SECONDS = 0.02
_CONV_PIXELS = 32  # the timed convolution's height and width
# A cached CPU peak is believed up to this many times the one measured at a start: a measurement beside other work
# gets about its share of the cores (beside 15 busy processes on each, a sixteenth); a cache beyond that holds no
# rate of this machine (a copied or hand-edited file), and the new measurement replaces it.
MAX_CACHED_RISE = 16.0


def forward_flops(net: Precond) -> int:
    """FLOPs of one evaluation of one sample, the log-variance head included, as FlopCounterMode counts them, from a
    copy of the network built on the meta device (no weights, no arithmetic)."""
    with torch.device("meta"):
        shadow = Precond(**net.init_kwargs).eval()
        x = torch.zeros([1, net.img_channels, net.img_resolution, net.img_resolution])
        labels = torch.zeros([1, net.label_dim]) if net.label_dim else None
        sigma = torch.ones([1])
    with FlopCounterMode(display=False) as counter, torch.no_grad(), torch.device("meta"):
        shadow(x, sigma, labels, return_logvar=True)
    return counter.get_total_flops()


def training_flops_per_image(net: Precond) -> float:
    """Useful FLOPs of one training image: 3 passes x forward_flops (the convention of MFU)."""
    return 3.0 * forward_flops(net)


def gpu_peak_tflops(name: str, dtype: torch.dtype) -> float | None:
    """A listed GPU's dense peak in dtype's tensor-core precision (TF32 for float32), or None when unlisted."""
    for key, (half, tf32) in GPU_PEAK_TFLOPS.items():
        if key in name:
            return tf32 if dtype == torch.float32 else half
    return None


def measure_cpu_tflops(dtype: torch.dtype, repeats: int = 3) -> float:
    """This process's peak TFLOP/s in dtype on the CPU (its threads as set): the best of a matmul and a 3x3
    convolution in either memory layout, each timed `repeats` times at the sizes it grows through (_grown_rate). All
    count: the step spends its time in convolutions, whose oneDNN kernels can outrun the BLAS
    matmul (on an AVX2 EPYC, float32: 83 against 68 GFLOP/s at one thread), and in bfloat16 on a Xeon with AMX the
    channels-last ones do (3.5 against 2.4 TFLOP/s on 2 cores, while NCHW reached 1.3-2.0). The global random state
    is left as it was."""
    generator = torch.Generator().manual_seed(0)
    kernels = (_matmul, _convolution, _channels_last_convolution)
    return max(_grown_rate(kernel, dtype, repeats, generator) for kernel in kernels)


def _matmul(size: int, dtype: torch.dtype, generator: torch.Generator) -> tuple[Callable[[], object], float]:
    """A size x size matmul to time, and its FLOPs."""
    a, b = (torch.randn(size, size, generator=generator).to(dtype) for _ in range(2))
    return (lambda: torch.mm(a, b)), 2.0 * size**3


def _convolution(size: int, dtype: torch.dtype, generator: torch.Generator,
                 memory_format: torch.memory_format = torch.contiguous_format) -> tuple[Callable[[], object], float]:
    """A 3x3 convolution (the U-Net's kernel) of size / 4 channels on a batch of size / 128 (at least one) of
    _CONV_PIXELS^2 pixels to time, and its FLOPs: a batch of one leaves oneDNN's 16-bit kernels short of their rate."""
    channels, batch = size // 4, max(1, size // 128)
    x = torch.randn(batch, channels, _CONV_PIXELS, _CONV_PIXELS, generator=generator)
    x = x.to(dtype, memory_format=memory_format)
    w = torch.randn(channels, channels, 3, 3, generator=generator).to(dtype)
    return (lambda: torch.nn.functional.conv2d(x, w, padding=1)), 2.0 * batch * channels**2 * 9 * _CONV_PIXELS**2


def _channels_last_convolution(size: int, dtype: torch.dtype,
                               generator: torch.Generator) -> tuple[Callable[[], object], float]:
    """_convolution with its input channels-last (oneDNN's own layout, as --channels-last runs), and its FLOPs."""
    return _convolution(size, dtype, generator, torch.channels_last)


def _grown_rate(kernel: Callable, dtype: torch.dtype, repeats: int, generator: torch.Generator) -> float:
    """The best TFLOP/s of a kernel (_matmul, _convolution) over the sizes it grows through, up to the first whose call
    takes _PEAK_SECONDS, or the largest: a kernel's rate need not grow with its size (in bfloat16 on AMX, a
    channels-last convolution of 256 channels ran at 3.6 TFLOP/s, of 512 at 2.7)."""
    size, largest = _PEAK_SIZES
    best = 0.0
    while True:
        call, flops = kernel(size, dtype, generator)
        call()  # warm-up: the kernel's first call at a size picks and prepares its implementation
        smallest_s = min(_time(call) for _ in range(repeats))
        best = max(best, flops / smallest_s / 1e12)
        if smallest_s >= _PEAK_SECONDS or size >= largest:
            return best
        size *= 2


def _time(call: Callable[[], object]) -> float:
    """Seconds of one call of a CPU kernel."""
    # Not torch.utils.benchmark.Timer: its timeit adds two untimed calls to each one-call measurement, tripling the
    # time a run's start spends measuring the peak.
    started = time.perf_counter()
    call()
    return time.perf_counter() - started


def _machine_key(dtype: torch.dtype) -> str:
    """What a CPU peak depends on: the processor, the thread count, the dtype and PyTorch's kernels."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        model = ""
    parts = [platform.machine(), model or platform.processor(), str(torch.get_num_threads()), str(dtype),
             torch.__version__]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def cpu_peak_tflops(dtype: torch.dtype) -> tuple[float, str]:
    """The CPU's peak in dtype for this process's thread count (measure_cpu_tflops) and where it came from: measured
    now, and the highest plausible one measured on this machine kept in $EDM2_CACHE_DIR (a measurement beside other
    work comes out low; the cache only rises)."""
    path, key = files.cache_dir() / CPU_PEAK_FILE, _machine_key(dtype)
    try:
        cached = bounded_json.read_object(path) or {}
    except EDM2Error:  # a damaged cache (not JSON, NaN, not a regular file) is rewritten
        cached = {}
    previous = cached.get(key)
    measured = measure_cpu_tflops(dtype)
    source = "the best measured here"
    if _is_rate(previous) and previous >= measured:
        if previous <= measured * MAX_CACHED_RISE:
            return float(previous), source
        source = (f"measured now: the {previous:.4g} TFLOP/s cached in {shown(path)} is over {MAX_CACHED_RISE:g} "
                  "times it, no rate of this machine, and is replaced")
    others = {name: value for name, value in cached.items() if name != key and _is_rate(value)}
    try:
        with files.atomic_path(path) as tmp:
            tmp.write_text(json.dumps({**others, key: measured}))
    except OSError:  # an unwritable cache only loses what this measurement adds
        pass
    return measured, source


def _is_rate(value: object) -> bool:
    """Whether a cached entry is a positive number (bounded_json has refused NaN and infinity)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def peak_tflops(device: torch.device, dtype: torch.dtype, given: float | None = None) -> tuple[float | None, str]:
    """One process's peak for a step computing in dtype on device (None for an unlisted GPU), and where it came from
    (for the start line)."""
    if given is not None:
        return given, "--peak-tflops"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = gpu_peak_tflops(name, dtype)
        if peak is None:
            return None, f"no peak known for {name}: MFU is not reported unless --peak-tflops gives it"
        return peak, f"the {name} data sheet's dense peak"
    kind = str(dtype).removeprefix("torch.")
    peak, source = cpu_peak_tflops(dtype)
    return peak, f"this CPU's {kind} matmul or convolution, {source}"


def utilization(flops_per_image: float, images_per_s: float, peak_per_process: float | None, processes: int) -> dict:
    """A status row's achieved TFLOP/s (all processes) and MFU (over the peak of all processes; None without one)."""
    tflops = flops_per_image * images_per_s / 1e12
    return dict(tflops=tflops, mfu=None if peak_per_process is None else tflops / (peak_per_process * processes))
