"""Running the network fast: torch.compile, the channels-last memory format and the compute precision.

None of these changes what a state dict holds: a network is compiled in place (its parameter names stay) and a
channels-last one keeps its values, so snapshots and training states read the same with or without them.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Callable

import torch

from edm2.loss import EDM2Loss
from edm2.networks import Precond
from edm2.runtime import files

# The one mapping of --precision's names: Precond's (use_fp16, use_bf16) flags and the dtype they compute in on CUDA.
_PRECISIONS = {"fp32": ((False, False), torch.float32), "fp16": ((True, False), torch.float16),
               "bf16": ((False, True), torch.bfloat16)}
PRECISIONS = tuple(_PRECISIONS)


def compile_by_default(device: torch.device) -> bool:
    """Whether --compile is on when not given: on CUDA; not on the CPU, where compiling takes longer than a
    short run gains (tens of seconds per graph on two cores)."""
    return device.type == "cuda"


def channels_last_by_default(device: torch.device) -> bool:
    """Whether --channels-last is on when not given: on CUDA, whose 16-bit convolutions run natively in NHWC;
    not on the CPU, where eager float32 gains nothing measurable and the default stays bit-identical."""
    return device.type == "cuda"


def cpu_16bit_units() -> str | None:
    """The 16-bit matrix instructions of this CPU that oneDNN computes bfloat16 with (AMX, AVX-512 BF16), or None:
    without them a bfloat16 matmul or convolution is emulated, several times slower than float32 (measured on an
    AVX2 EPYC: training 7x, sampling 14x slower, scripts/bench_release.py)."""
    for name, probe in (("AMX", "_is_amx_tile_supported"), ("AVX-512 BF16", "_is_avx512_bf16_supported")):
        if getattr(torch.cpu, probe, lambda: False)():
            return name
    return None


def compile_cache() -> Path:
    """Where torch.compile keeps compiled graphs, so that runs whose graphs are the same compile them once:
    $TORCHINDUCTOR_CACHE_DIR, else (set here for inductor) $EDM2_CACHE_DIR/torchinductor/ in a folder per PyTorch
    version and CPU kernel set, since inductor reused code built for another ATEN_CPU_CAPABILITY and crashed."""
    if not os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        kernels = f"{torch.__version__}-{torch.backends.cpu.get_cpu_capability()}".lower()
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(files.cache_dir() / "torchinductor" / kernels)
    return Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])


def compile_network(net: torch.nn.Module, device: torch.device, backend: str = "inductor") -> torch.nn.Module:
    """Compile net's forward on device in place (torch.compile, one graph per input shape); returns net.

    In place (nn.Module.compile), not wrapped: parameter and state-dict names stay those of the eager network.
    The backend 'aot_eager' captures the same graphs but runs them with eager kernels (quick to compile: tests).
    """
    # Imported here: inductor (and with it dynamo) takes about a second to import, which commands that do not compile
    # should not pay.
    from edm2.runtime.inductor_options import device_options

    compile_cache()
    net.compile(dynamic=False, backend=backend, options=device_options(device) if backend == "inductor" else None)
    return net


def compile_loss(loss_fn: EDM2Loss, device: torch.device, backend: str = "inductor") -> Callable[..., torch.Tensor]:
    """loss_fn(net, images, labels) on device with the network and the loss arithmetic compiled into one graph.

    Outside the graph, in eager mode: the noise levels and noise, drawn in the order loss_fn draws them so that a
    compiled run consumes exactly the random numbers of an eager one.
    """
    from edm2.runtime.inductor_options import training_options  # here, as in compile_network

    options = training_options(device) if backend == "inductor" else None
    compile_cache()
    compiled = torch.compile(_loss_given_noise, dynamic=False, backend=backend, options=options)

    def loss(net: torch.nn.Module, images: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        sigma = loss_fn.sample_sigma(images.shape[0], images.device)
        noise = torch.randn_like(images)
        return compiled(loss_fn, net, images, labels, sigma, noise)

    return loss


def _loss_given_noise(loss_fn: EDM2Loss, net: torch.nn.Module, images: torch.Tensor, labels: torch.Tensor | None,
                      sigma: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The deterministic part of loss_fn, which torch.compile traces."""
    return loss_fn(net, images, labels, sigma=sigma, noise=noise)


def to_channels_last(net: torch.nn.Module) -> torch.nn.Module:
    """Store net's convolution weights channels-last (NHWC), so its convolutions compute and return NHWC."""
    return net.to(memory_format=torch.channels_last)


def precision_flags(precision: str) -> dict[str, bool]:
    """Precond's use_fp16 and use_bf16 arguments for a precision (fp32, fp16 or bf16)."""
    use_fp16, use_bf16 = _PRECISIONS[precision][0]
    return dict(use_fp16=use_fp16, use_bf16=use_bf16)


def precision_dtype(precision: str) -> torch.dtype:
    """The dtype a network of this precision computes in on CUDA."""
    return _PRECISIONS[precision][1]


def set_precision(net: Precond, precision: str, cpu_16bit: bool = False) -> Precond:
    """Make net compute in `precision` (fp32, fp16 or bf16) on CUDA, and with cpu_16bit on the CPU too."""
    for name, value in precision_flags(precision).items():
        setattr(net, name, value)
    net.cpu_16bit = cpu_16bit
    return net


def snapshot_precision(net: Precond) -> str:
    """The precision a network was made (or trained) with: what set_precision would restore."""
    # A network built with both flags computes in bfloat16 (Precond.compute_dtype): bf16.
    flags = (net.use_fp16 and not net.use_bf16, net.use_bf16)
    return next(name for name, (pair, _) in _PRECISIONS.items() if pair == flags)


@dataclasses.dataclass(frozen=True)
class SamplingSpeed:
    """How a loaded network samples: compiled, channels-last and precision; None means the default (the device's,
    or for precision what the snapshot says)."""

    compile: bool | None = None
    channels_last: bool | None = None
    precision: str | None = None
    cpu_16bit: bool = False

    def compiles(self, device: torch.device) -> bool:
        """Whether networks are compiled on this device."""
        return compile_by_default(device) if self.compile is None else self.compile

    def uses_channels_last(self, device: torch.device) -> bool:
        """Whether networks run channels-last on this device."""
        return channels_last_by_default(device) if self.channels_last is None else self.channels_last

    def apply(self, net: Precond, device: torch.device) -> Precond:
        """Set net (already on device) up to sample this way; returns net, changed in place."""
        set_precision(net, self.precision or snapshot_precision(net), self.cpu_16bit)
        if self.uses_channels_last(device):
            to_channels_last(net)
        if self.compiles(device):
            compile_network(net, device)
        return net
