"""Data and builders shared by the test modules: reference numbers, tiny networks and detectors, stand-ins.

Fixtures live in conftest.py; test modules import from here, never from each other.
"""

import collections
import contextlib
import dataclasses
import fcntl
import hashlib
import importlib
import io
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
import textwrap
import time
import zipfile
import zlib
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np
import PIL.Image
import safetensors.torch
import torch

from edm2 import layers
from edm2.eval import detectors
from edm2.formats.snapshot import save_network, snapshot_name
from edm2.networks import Precond
from edm2.phema import PowerFunctionEMA
from training.options import TrainingOptions

REPO = Path(__file__).resolve().parent.parent
DATA = Path(__file__).resolve().parent / "data"

# ---------------------------------------------------------------------------------------------------
# Reference numbers, typed in from the paper (Table 6) and the release's published checkpoints.

# Preset size -> (model_channels, dropout, alpha_ref): paper Table 6.
SIZES = {
    "xs": (128, 0.00, 0.0120), "s": (192, 0.00, 0.0100), "m": (256, 0.10, 0.0090),
    "l": (320, 0.10, 0.0080), "xl": (384, 0.10, 0.0070), "xxl": (448, 0.10, 0.0065),
}
# Exact trainable parameters of the release's conditional img512 checkpoints (64x64x4 latents, 1000
# classes, including the 128 weights of the log-variance head), counted from its published .pkl files.
IMG512_PARAMS = {
    "xs": 124_713_253, "s": 280_212_837, "m": 497_807_781,
    "l": 777_498_085, "xl": 1_119_283_749, "xxl": 1_523_164_773,
}
# The same for the release's img64 U-Nets (64x64x3 RGB), without the log-variance head.
IMG64_UNET_PARAMS = {
    "xs": 124_710_821, "s": 280_209_253, "m": 497_803_045, "l": 777_492_197, "xl": 1_119_276_709,
}
# Paper Table 6, "gigaflops" per evaluation, img512: the release's count (edm2.eval.flops), a multiply-accumulate as
# one operation and elementwise operations included; the multiply-accumulates alone (count_macs) are ~1% fewer.
TABLE6_GMACS = {"xs": 45.5, "s": 102.2, "m": 180.8, "l": 282.2, "xl": 405.9, "xxl": 552.1}


def count_macs(net: Precond, batch_size: int = 1) -> int:
    """Multiply-accumulates of one evaluation in convolutions, linear layers and attention, counted by module hooks
    (works on the meta device): about 1% under Table 6's 'gigaflops', which also count elementwise operations (see
    edm2.eval.flops). The tests' own count, independent of edm2.runtime.utilization.forward_flops's
    torch.utils.flop_counter, which the library uses."""
    macs = 0

    def conv_hook(module: torch.nn.Module, inputs: tuple, output: torch.Tensor) -> None:
        nonlocal macs
        w = module.weight
        spatial = output.shape[2] * output.shape[3] if output.ndim == 4 else 1
        macs += output.shape[0] * spatial * w[0].numel() * w.shape[0]

    def attn_hook(module: torch.nn.Module, inputs: tuple, output: torch.Tensor) -> None:
        nonlocal macs
        n, c, h, w = output.shape
        macs += 2 * n * c * (h * w) ** 2  # q k^T and the weighted sum of v

    # Every family's learned layers hold their kernel as a `weight` of 2 or more dimensions (a group norm's 1-D scale
    # is no kernel), and its attention blocks count heads in num_heads.
    layers = [m for m in net.modules() if isinstance(getattr(m, "weight", None), torch.nn.Parameter)
              and m.weight.ndim >= 2]
    hooks = [m.register_forward_hook(conv_hook) for m in layers]
    hooks += [m.register_forward_hook(attn_hook) for m in net.modules() if getattr(m, "num_heads", 0)]
    try:
        device = next(net.parameters()).device
        x = torch.zeros(batch_size, net.img_channels, net.img_resolution, net.img_resolution, device=device)
        labels = torch.zeros(batch_size, net.label_dim, device=device) if net.label_dim else None
        was_training = net.training
        net.eval()
        with torch.no_grad():
            net(x, torch.ones(batch_size, device=device), labels, return_logvar=True)
        net.train(was_training)
    finally:
        for hook in hooks:
            hook.remove()
    return macs // batch_size

# ---------------------------------------------------------------------------------------------------
# Tiny networks.

# The tests' U-Net: two levels, one block each, attention at 4x4; seconds to train on a CPU.
TINY_UNET = dict(model_channels=16, channel_mult=(1, 2), num_blocks=1, attn_resolutions=(4,), channels_per_head=16)


def tiny_precond(img_resolution: int = 8, img_channels: int = 3, label_dim: int = 10, **overrides) -> Precond:
    """A Precond with the tests' tiny U-Net; overrides replace any of its arguments."""
    return Precond(img_resolution, img_channels, label_dim, **{**TINY_UNET, **overrides})


# The two ways edm2.layers.attention computes: the CPU's products, and scaled-dot-product attention (CUDA's way;
# on a CPU, its fused kernel where the layout allows and no tangents are present).
ATTENTION_ROUTES = ["products", "SDPA"]


def take_attention_route(monkeypatch, route: str) -> None:
    """Make attention take `route` (ATTENTION_ROUTES) on this CPU."""
    if route == "SDPA":
        monkeypatch.setattr(layers, "FUSED_ATTENTION_DEVICES", ("cuda", "cpu"))


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of a float tensor: equal bits also means equal signs of zero and equal NaN payloads."""
    return t.view({4: torch.int32, 2: torch.int16, 8: torch.int64}[t.element_size()])


def randomized(net: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """net with every parameter and buffer drawn from N(0, 1): a fresh net's zero output gains would
    make all denoisers equal."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in [*net.parameters(), *net.buffers()]:
            t.copy_(torch.randn(t.shape, generator=generator))
    return net


# ---------------------------------------------------------------------------------------------------
# EMA snapshot files.

# The settings fake_training_run's snapshots share: another snapshot of the same 'run' has them too.
FAKE_RUN = {"preset": "tiny"}


def fake_training_run(run_dir: Path, num_snapshots: int = 6, steps_per_snapshot: int = 4, batch_size: int = 256,
                      **overrides) -> Path:
    """Random-walk 'training' of a tiny net (tiny_precond(**overrides)) whose two EMA tracks (0.05, 0.10)
    are saved as our snapshot files, network-snapshot-KIMG-STD.safetensors, after every steps_per_snapshot steps.
    Returns run_dir, created if needed."""
    run_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    net = tiny_precond(**overrides)
    ema = PowerFunctionEMA(net)
    nimg = 0
    for _ in range(num_snapshots):
        for _ in range(steps_per_snapshot):
            with torch.no_grad():
                for p in net.parameters():
                    p.add_(torch.randn_like(p), alpha=0.05)
            nimg += batch_size
            ema.update(cur_nimg=nimg, batch_size=batch_size)
        for track, std in ema.get():
            save_network(run_dir / snapshot_name("network-snapshot", nimg, std), track,
                         dict(FAKE_RUN, nimg=nimg, ema_std=std))
    return run_dir


def write_raw_snapshot(path: Path, metadata: str | None, net: torch.nn.Module | None = None) -> Path:
    """A safetensors file with net's float16 weights (default: a tiny net) and `metadata` as the raw text of
    its 'edm2' metadata entry (None: no entry): to build snapshot files that our writer never would."""
    state = (net or tiny_precond()).state_dict()
    tensors = {k: v.detach().to(torch.float16).contiguous() for k, v in state.items()}
    safetensors.torch.save_file(tensors, str(path), metadata=None if metadata is None else {"edm2": metadata})
    return path


# ---------------------------------------------------------------------------------------------------
# Command lines.

def assert_one_error_line(result, *fragments: str) -> str:
    """A failed command (click's CliRunner result or a CompletedProcess): non-zero exit, no traceback,
    and exactly one 'Error' line, which contains every fragment. Returns that line."""
    if hasattr(result, "exit_code"):
        code, output = result.exit_code, result.output
        assert isinstance(result.exception, SystemExit), (result.exception, output)
    else:
        code, output = result.returncode, result.stdout + result.stderr
    assert code != 0, output
    assert "Traceback" not in output, output
    errors = [line for line in output.splitlines() if line.startswith("Error")]
    assert len(errors) == 1, output
    for fragment in fragments:
        assert fragment in errors[0], output
    return errors[0]


def tree(path: Path) -> list[str]:
    """Every file and folder below path, relative and sorted: to check that a command left nothing behind."""
    return sorted(p.relative_to(path).as_posix() for p in path.rglob("*"))


def assert_refused(roots: Path | Sequence[Path], invoke: Callable[[], object], *fragments: str) -> str:
    """The bad-input promise: invoke() (running a command) fails with one error line holding every fragment
    (assert_one_error_line) and leaves every file and folder under roots as it was. Returns that line."""
    roots = [roots] if isinstance(roots, Path) else list(roots)
    before = [tree(root) for root in roots]
    line = assert_one_error_line(invoke(), *fragments)
    assert [tree(root) for root in roots] == before
    return line


# ---------------------------------------------------------------------------------------------------
# Statistics.

def random_covariance(rng: np.random.Generator, dim: int) -> np.ndarray:
    """A random symmetric positive definite dim x dim matrix (a Gram matrix of dim + 3 random columns)."""
    a = rng.standard_normal((dim, dim + 3))
    return a @ a.T / dim


# ---------------------------------------------------------------------------------------------------
# Detectors: a tiny DINOv2 in the official checkpoint layout and an Inception stand-in.

def official_dinov2_shapes(width=1024, depth=24, patch=14, grid=37, mlp=4096, channels=3) -> dict:
    """The DINOv2 checkpoint layout (names and shapes of dinov2_vit*_pretrain.pth), written out independently."""
    shapes = {
        "cls_token": (1, 1, width),
        "pos_embed": (1, 1 + grid * grid, width),
        "mask_token": (1, width),
        "patch_embed.proj.weight": (width, channels, patch, patch),
        "patch_embed.proj.bias": (width,),
        "norm.weight": (width,),
        "norm.bias": (width,),
    }
    for i in range(depth):
        b = f"blocks.{i}."
        shapes.update({
            b + "norm1.weight": (width,), b + "norm1.bias": (width,),
            b + "attn.qkv.weight": (3 * width, width), b + "attn.qkv.bias": (3 * width,),
            b + "attn.proj.weight": (width, width), b + "attn.proj.bias": (width,),
            b + "ls1.gamma": (width,),
            b + "norm2.weight": (width,), b + "norm2.bias": (width,),
            b + "mlp.fc1.weight": (mlp, width), b + "mlp.fc1.bias": (mlp,),
            b + "mlp.fc2.weight": (width, mlp), b + "mlp.fc2.bias": (width,),
            b + "ls2.gamma": (width,),
        })
    return shapes


def random_dinov2_state_dict(seed=0, **config) -> dict:
    """Random weights in the official DINOv2 layout (norm weights near 1, so activations stay sane)."""
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=g) * (0.3 if len(shape) > 1 else 0.5) + (1.0 if "norm" in name and
            name.endswith("weight") else 0.0) for name, shape in official_dinov2_shapes(**config).items()}


class TinyInceptionStandIn(torch.nn.Module):
    """A stand-in with the call signature of the published Inception TorchScript (not the real network)."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, stride=2)
        self.fc = torch.nn.Linear(4 * 7 * 7, 12)

    def forward(self, x: torch.Tensor, return_features: bool = False) -> torch.Tensor:
        x = torch.nn.functional.interpolate(x.to(torch.float32), size=(16, 16), mode="bilinear")
        features = self.fc(torch.relu(self.conv(x / 128 - 1)).flatten(1))
        if return_features:
            return features
        return torch.softmax(features, dim=1)


class FileWritingInception(torch.nn.Module):
    """TinyInceptionStandIn's features, but its forward also creates and writes the file `marker` through
    torch.from_file(shared=True): the kind of TorchScript program a detector file must never be allowed to run."""

    def __init__(self, marker: str):
        super().__init__()
        self.marker = marker
        self.features = TinyInceptionStandIn()

    def forward(self, x: torch.Tensor, return_features: bool = False) -> torch.Tensor:
        written = torch.from_file(self.marker, shared=True, size=4, dtype=torch.uint8).fill_(1)
        return self.features(x, return_features) + written.float().sum() * 0  # used, so TorchScript keeps it


def pin_detector_file(monkeypatch, metric: str, path: Path) -> None:
    """For one test, make the file at `path` the published file of `metric`'s detector: PUBLISHED pins its SHA-256
    in place of the real file's, so the real loading path runs on a tiny file the test built."""
    digest = hashlib.sha256(Path(path).read_bytes()).hexdigest()
    monkeypatch.setitem(detectors.PUBLISHED, metric, dataclasses.replace(detectors.PUBLISHED[metric], sha256=digest))


def run_within_memory(prepare: str, attempt: str, headroom: int, *args: str) -> subprocess.CompletedProcess:
    """Run `prepare` in a fresh Python, then limit its address space to what it already uses plus `headroom`
    bytes (RLIMIT_AS) and run `attempt`; an EDM2Error it raises is printed as 'refused: MESSAGE' (exit 0), while
    an allocation past the limit ends in a MemoryError traceback. sys.argv[1:] are `args`."""
    code = "\n".join([
        "import resource, sys", "from edm2.errors import EDM2Error", prepare,
        "used = int(open('/proc/self/status').read().split('VmSize:')[1].split()[0]) * 1024",
        f"resource.setrlimit(resource.RLIMIT_AS, (used + {headroom}, used + {headroom}))",
        "try:", textwrap.indent(attempt, "    "), "except EDM2Error as e:", "    print('refused:', e)"])
    return subprocess.run([sys.executable, "-c", code, *args], cwd=REPO, capture_output=True, text=True, timeout=300)


def run_dataset_tool(*args: object, env: dict | None = None):
    """dataset_tool.py run in this process with these arguments (click's CliRunner; env added to the environment)."""
    import dataset_tool  # a command line: only the tests that run it import it
    from click.testing import CliRunner

    return CliRunner(env=env).invoke(dataset_tool.main, [str(arg) for arg in args])


def assert_ok(result) -> None:
    """A command line's click result that ended well; else its output is the failure's message."""
    assert result.exit_code == 0, result.output


def save_tiny_vae(path: Path, latent_channels: int = 4) -> Path:
    """A randomly initialized AutoencoderKL with 2 levels (2x downsampling, the real one has 4 and 8x)."""
    from diffusers import AutoencoderKL  # seconds to import; only the VAE tests need it

    torch.manual_seed(0)
    vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=latent_channels, block_out_channels=(8, 16),
                        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                        layers_per_block=1, norm_num_groups=8, sample_size=16)
    vae.save_pretrained(path)
    return path


# ---------------------------------------------------------------------------------------------------
# The release's pickle format: stand-ins for its helper modules, importable only while a test pickles.

RELEASE_TINY = dict(img_resolution=8, img_channels=4, label_dim=5, **TINY_UNET)

_PERSISTENCE_SRC = """
MARKER = {marker!r}


def _reconstruct_persistent_obj(meta):
    open(MARKER, "w").close()
    raise RuntimeError("the release's reconstruction code must never run")


class Persistent:
    \"\"\"Pickles like an instance of a class decorated with the release's persistent_class.\"\"\"

    def __init__(self, class_name, state):
        module_src = "import os\\nopen(%r, 'w').close()\\nos.system('touch %s')\\n" % (MARKER, MARKER)
        self.meta = dict(type="class", version=6, module_src=module_src, class_name=class_name, state=state)

    def __reduce__(self):
        return (_reconstruct_persistent_obj, (self.meta,))
"""
_DNNLIB_UTIL_SRC = """
class EasyDict(dict):
    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name)

    def __setattr__(self, name, value):
        self[name] = value
"""


def install_release_standins(tmp_path: Path) -> tuple:
    """Import stand-in torch_utils.persistence and dnnlib.util; running their code touches tmp_path/'ran'."""
    root = tmp_path / "release_src"
    for package, module, src in (("torch_utils", "persistence", _PERSISTENCE_SRC), ("dnnlib", "util", _DNNLIB_UTIL_SRC)):
        (root / package).mkdir(parents=True)
        (root / package / "__init__.py").write_text("")
        (root / package / f"{module}.py").write_text(textwrap.dedent(src.format(marker=str(tmp_path / "ran"))))
    sys.path.insert(0, str(root))
    importlib.invalidate_caches()
    return importlib.import_module("torch_utils.persistence"), importlib.import_module("dnnlib.util")


def forget_release_standins() -> None:
    """Make the stand-ins unimportable again, as on a machine without the release's code."""
    sys.path[:] = [p for p in sys.path if not p.endswith("release_src")]
    for name in [n for n in sys.modules if n.split(".")[0] in ("torch_utils", "dnnlib")]:
        del sys.modules[name]
    importlib.invalidate_caches()


def release_module(module: torch.nn.Module, persistence, dtype=torch.float16, names: dict | None = None):
    """Mirror a module as the release pickles it: tensors in dtype (its EDM2 networks float16, its toy models
    float32), the module tree in _parameters/_buffers/_modules; `names` maps our class names to the release's."""
    plain = (bool, int, float, str, type(None))
    state = {k: v for k, v in vars(module).items() if isinstance(v, plain)}
    state["_parameters"] = collections.OrderedDict(
        (n, torch.nn.Parameter(p.detach().to(dtype), requires_grad=False)) for n, p in module._parameters.items()
    )
    state["_buffers"] = collections.OrderedDict((n, b.to(dtype)) for n, b in module._buffers.items())
    state["_non_persistent_buffers_set"] = set()
    state["_modules"] = collections.OrderedDict((n, release_module(c, persistence, dtype, names))
                                                for n, c in module._modules.items())
    if isinstance(module, (torch.nn.ModuleDict, torch.nn.Sequential)):
        # The release's enc/dec and the toy model's layers are plain torch containers holding persistent modules.
        container = type(module).__new__(type(module))
        container.__dict__.update(state)
        return container
    name = type(module).__name__
    return persistence.Persistent((names or {}).get(name, name), state)


def write_release_toy_pickle(path: Path, net: torch.nn.Module, persistence) -> None:
    """Write a toy denoiser as the release's toy_example.py saves its snapshots: the pickled ToyModel itself."""
    model = release_module(net, persistence, dtype=torch.float32, names={"ToyDenoiser": "ToyModel"})
    model.meta["state"].update(_init_args=(), _init_kwargs={k: v for k, v in net.init_kwargs.items() if k != "in_dim"})
    with open(path, "wb") as f:
        pickle.dump(model, f)


def random_release_tiny_net(seed=0) -> Precond:
    """A RELEASE_TINY Precond with random weights, in eval mode."""
    torch.manual_seed(seed)
    return randomized(Precond(**RELEASE_TINY), seed).eval()


def write_release_pickle(path: Path, net: Precond, persistence, util, encoder: str | None = "vae",
                         loss: bool = True, replace: dict | None = None) -> None:
    """Write net (built with RELEASE_TINY) as the release pickles a network, its encoder ('vae', 'rgb', or None
    for no entry, as in older and third-party pickles) and, with `loss`, its loss; `replace` maps entries to other values."""
    ema = release_module(net, persistence)
    ema.meta["state"].update(_init_args=(), _init_kwargs=dict(RELEASE_TINY, dropout=0.0, use_fp16=True))
    data = dict(ema=ema, dataset_kwargs=util.EasyDict(class_name="training.dataset.ImageFolderDataset",
                                                      path="img512-sd.zip", use_labels=True))
    if encoder == "vae":
        scale = np.float32(0.5) / np.float32([4.17, 4.62, 3.71, 3.28])
        bias = np.float32(0) - np.float32([5.81, 3.25, 0.12, -2.15]) * scale
        state = dict(vae_name="stabilityai/sd-vae-ft-mse", scale=scale, bias=bias, batch_size=8, _vae=None)
        data["encoder"] = persistence.Persistent("StabilityVAEEncoder", dict(state, _init_args=(), _init_kwargs={}))
    elif encoder == "rgb":
        data["encoder"] = persistence.Persistent("StandardRGBEncoder", dict(_init_args=(), _init_kwargs={}))
    if loss:
        state = dict(P_mean=-0.4, P_std=1.0, sigma_data=0.5, _init_args=(), _init_kwargs=dict(P_mean=-0.4, P_std=1.0))
        data["loss_fn"] = persistence.Persistent("EDM2Loss", state)
    data.update(replace or {})
    with open(path, "wb") as f:
        pickle.dump(data, f)


# ---------------------------------------------------------------------------------------------------
# Training runs: train_edm2.py with the toy-tiny preset on 8x8 images, seconds on a CPU.

# 64 steps of 32 images over a 48-image dataset: checkpoints and snapshots fall mid-epoch.
TRAIN_ARGS = ["--preset=toy-tiny", "--duration=2Ki", "--snapshot=1Ki", "--checkpoint=1Ki", "--status=512"]
DATA_8X8 = dict(resolution=8, num_channels=3, label_dim=4)  # the train_data fixture's (write_image_dataset's)


def toy_tiny_options(encoder: dict | None = None, **values) -> TrainingOptions:
    """toy-tiny's TrainingOptions for DATA_8X8 with these values; encoder: StandardRGBEncoder's config by default."""
    return TrainingOptions.from_preset("toy-tiny", dict(DATA_8X8),
                                       {"class": "StandardRGBEncoder"} if encoder is None else encoder, **values)


def write_image_dataset(path: Path, num=48, resolution=8, classes=4, mode="RGB", labels=True, sizes=None) -> Path:
    """A release-format dataset written with PIL: PNG files plus dataset.json."""
    rng = np.random.default_rng(0)
    path.mkdir(parents=True)
    names = []
    for i in range(num):
        res = sizes[i % len(sizes)] if sizes else resolution
        channels = {"RGB": 3, "L": 1, "RGBA": 4}[mode]
        pixels = rng.integers(0, 256, size=(res, res, channels), dtype=np.uint8)
        pixels[: res // 2, :, 0] = 40 * (i % classes)  # class-dependent content
        name = f"{i // 100:05d}/img{i:08d}.png"
        (path / name).parent.mkdir(exist_ok=True)
        PIL.Image.fromarray(pixels.squeeze(-1) if channels == 1 else pixels, mode).save(path / name)
        names.append([name, i % classes])
    (path / "dataset.json").write_text(json.dumps({"labels": names if labels else None}))
    return path


def train_env(**values: str) -> dict[str, str]:
    """The environment of a subprocess the tests start: this process's as it is now (with what the session's fixtures
    set, such as $EDM2_CACHE_DIR), one OpenMP thread (two CPU cores are shared with other processes), then values."""
    return dict(os.environ, OMP_NUM_THREADS="1", **values)


def train_args(data: Path, outdir: Path, *extra: str) -> list[str]:
    """train_edm2.py's options: TRAIN_ARGS, then extra (later options win)."""
    return [*TRAIN_ARGS, f"--data={data}", f"--outdir={outdir}", *extra]


def train_command(data: Path, outdir: Path, *extra: str) -> list[str]:
    """python train_edm2.py with train_args."""
    return [sys.executable, "train_edm2.py", *train_args(data, outdir, *extra)]


def built_once(tmp_path_factory, name: str, build: Callable[[Path], object]) -> tuple[Path, object]:
    """The folder `name`, filled by build(folder) once per test session, whichever pytest-xdist process asks first
    (the others wait for it), and build's JSON value. For what the tests only read: a run that costs tens of
    seconds is then made once, not once per process."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the session's folder, above each process's own
    folder, value = root / f"once-{name}", root / f"once-{name}.json"
    with open(root / f"once-{name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if build fails
        if not value.exists():
            shutil.rmtree(folder, ignore_errors=True)  # what a build that failed left
            folder.mkdir()
            value.write_text(json.dumps(build(folder)))
        return folder, json.loads(value.read_text())


def run_training_process(data: Path, outdir: Path, *extra: str) -> subprocess.CompletedProcess:
    """Run a training to its end in a subprocess (for a test of how the process ends); it must not print a
    traceback."""
    result = subprocess.run(train_command(data, outdir, *extra), cwd=REPO, env=train_env(), capture_output=True,
                            text=True, timeout=300)
    assert "Traceback" not in result.stdout + result.stderr, result.stdout + result.stderr
    return result


def run_training(data: Path, outdir: Path, *extra: str) -> subprocess.CompletedProcess:
    """Run train_command's training to its end in this process, on one CPU thread as its subprocess would
    (train_env): the same bits as the subprocesses it resumes or is compared with, without the seconds a new
    interpreter spends importing torch. It must not raise; the result reads as run_training_process's."""
    import train_edm2
    from click.testing import CliRunner

    args = train_args(data, outdir, *extra)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        result = CliRunner().invoke(train_edm2.main, args)
    finally:
        torch.set_num_threads(threads)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise AssertionError(result.output) from result.exception
    assert "Traceback" not in result.output, result.output
    return subprocess.CompletedProcess(["train_edm2.py", *args], result.exit_code, result.stdout, result.stderr)


def start_training(data: Path, outdir: Path, *extra: str, **popen) -> subprocess.Popen:
    """Start a training in a subprocess, its stdout and stderr merged into one text pipe."""
    return subprocess.Popen(train_command(data, outdir, *extra), cwd=REPO, env=train_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, **popen)


def wait_for(predicate, proc: subprocess.Popen, timeout=120.0, poll_s=0.02) -> None:
    """Poll predicate() until true; fail if proc ends first or the time runs out."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert proc.poll() is None, f"process ended early:\n{proc.stdout.read() if proc.stdout else ''}"
        assert time.monotonic() < deadline, "timed out"
        time.sleep(poll_s)


def stopped_at(output: str) -> int:
    """The image count of a training's 'Stopped at N images' line."""
    [count] = re.findall(r"Stopped at (\d+) images; rerun the same command to resume\.", output)
    return int(count)


def snapshot_contents(outdir: Path, pattern: str, ignore=("run_dir", "workers")) -> dict[str, tuple]:
    """The EMA snapshots matching pattern: tensors as raw bytes, and metadata less the training options in
    ignore (those that may differ between invocations of one run) and the run's identity (which differs between
    two runs of the same command)."""
    import safetensors.torch

    from edm2.formats.snapshot import read_metadata

    contents = {}
    for path in sorted(outdir.glob(pattern)):
        tensors = safetensors.torch.load_file(str(path))
        meta = read_metadata(path)
        meta.pop("run_id")
        for key in ignore:
            meta["training_options"].pop(key)
        contents[path.name] = ({k: v.view(-1).view(torch.uint8).numpy().tobytes() for k, v in tensors.items()}, meta)
    return contents


# ---------------------------------------------------------------------------------------------------
# Outputs measured by hand: the validation loss of a network on a dataset, the PNG files of a folder.

def validation_loss_by_hand(net, data, num, seed, P_mean, P_std, weight=None) -> float:
    """Eq. 14 per element in float64, written from the paper: images evenly spaced through the dataset, sample i's
    generator (seed + i) draws ln(sigma) ~ N(P_mean, P_std^2) and then n ~ N(0, I); lambda of Eq. 15 unless
    weight(sigma, sigma_data) is given."""
    names = sorted(p.relative_to(data).as_posix() for p in data.rglob("*.png"))
    labels = dict(json.loads((data / "dataset.json").read_text())["labels"])
    picked = [names[i * len(names) // num] for i in range(num)]
    pixels = torch.from_numpy(np.stack([np.asarray(PIL.Image.open(data / name)) for name in picked]))
    y = pixels.permute(0, 3, 1, 2).contiguous().float() / 127.5 - 1
    draws = [torch.Generator().manual_seed(seed + i) for i in range(num)]
    sigma = torch.stack([(torch.randn([], generator=g) * P_std + P_mean).exp() for g in draws]).reshape(-1, 1, 1, 1)
    noise = torch.stack([torch.randn(y.shape[1:], generator=g) for g in draws])
    onehot = torch.nn.functional.one_hot(torch.tensor([labels[name] for name in picked]), net.label_dim).float()
    with torch.no_grad():
        denoised = net(y + sigma * noise, sigma, onehot).double()
    s = sigma.double().flatten()
    lam = (s**2 + 0.25) / (s * 0.5) ** 2 if weight is None else weight(s, 0.5)
    return float((lam * (denoised - y.double()).square().flatten(1).mean(1)).mean())


def read_pngs(outdir) -> dict[str, np.ndarray]:
    """The PNG files under outdir, {relative path: pixels}, in path order."""
    return {p.relative_to(outdir).as_posix(): np.asarray(PIL.Image.open(p)) for p in sorted(Path(outdir).rglob("*.png"))}


# ---------------------------------------------------------------------------------------------------
# Datasets built by hand, independently of edm2.data.dataset_writer.

def png_file(array: np.ndarray) -> bytes:
    """PNG bytes of a uint8 HWC (or HW grayscale) array, written by PIL with its default compression."""
    buffer = io.BytesIO()
    PIL.Image.fromarray(array).save(buffer, format="png")
    return buffer.getvalue()


def write_members(root: Path, members: dict, zip_name: str | None = None) -> Path:
    """Write {relative name: bytes} below root, or into the uncompressed ZIP root/zip_name; return the dataset."""
    if zip_name:
        with zipfile.ZipFile(root / zip_name, "w", zipfile.ZIP_STORED) as archive:
            for name, data in members.items():
                archive.writestr(name, data)
        return root / zip_name
    for name, data in members.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return root


@contextlib.contextmanager
def live_process() -> Iterator[subprocess.Popen]:
    """A process of this host that lives until the block ends (it waits for input that never comes), as a writer
    or a training still running; killed and reaped afterwards."""
    with subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE) as proc:
        try:
            yield proc
        finally:
            proc.kill()


def dead_pid() -> int:
    """The id of a process of this host that has exited (as a SIGKILLed writer's)."""
    child = subprocess.Popen([sys.executable, "-c", ""])
    child.wait()
    return child.pid


# ---------------------------------------------------------------------------------------------------
# Destination locks held by another process.

# argv: dest, what, lock name ('' for a file destination), what to write into the lock file once held ('' for
# nothing). Prints 'held' and holds the lock until its stdin closes.
_HOLD_LOCK = """\
import sys
from edm2.runtime.locks import DestinationLock
lock = DestinationLock(sys.argv[1], sys.argv[2], sys.argv[3] or None)
lock.acquire()
if sys.argv[4]:
    lock.path.write_text(sys.argv[4])  # in place: the locked file itself
print("held", flush=True)
sys.stdin.read()
lock.release()
"""


@contextlib.contextmanager
def lock_held_by_child(dest: Path, what: str, lock_name: str | None = None, contents: str = "",
                       prefix: Sequence[str] = ()):
    """A child process (started after `prefix`, e.g. unshare) that holds dest's lock for the block; yields it."""
    proc = subprocess.Popen([*prefix, sys.executable, "-c", _HOLD_LOCK, str(dest), what, lock_name or "", contents],
                            cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "held\n", "the child could not take the lock"
        yield proc
    finally:
        with contextlib.suppress(BrokenPipeError):  # a child killed by the block
            proc.stdin.close()
        proc.wait(timeout=60)
        proc.stdout.close()


# ---------------------------------------------------------------------------------------------------
# Decompression bombs.


def png_chunk(kind: bytes, data: bytes) -> bytes:
    """One PNG chunk: length, type, data and the CRC of type and data."""
    return len(data).to_bytes(4, "big") + kind + data + zlib.crc32(kind + data).to_bytes(4, "big")


def black_png(width: int, height: int, channels: int = 3) -> bytes:
    """A valid 8-bit PNG (1 channel gray, 3 RGB, 4 RGBA) of black pixels, built without ever holding them: a
    decompression bomb, a few MB inflating to gigabytes for large sizes.

    Its IDAT repeats one deflate block of 1 MiB of zeros (a full flush makes each block independent of the ones
    before); the zlib checksum of n zeros is (n mod 65521) << 16 | 1, since Adler-32's first sum stays 1."""
    row = 1 + width * channels  # a filter byte (0: none) before each row
    total = row * height
    chunk = 1 << 20
    block = zlib.compressobj(9, zlib.DEFLATED, -15)
    full = block.compress(bytes(chunk)) + block.flush(zlib.Z_FULL_FLUSH)
    last = zlib.compressobj(9, zlib.DEFLATED, -15)
    tail = last.compress(bytes(total % chunk)) + last.flush(zlib.Z_FINISH)
    stream = b"\x78\xda" + full * (total // chunk) + tail + ((total % 65521) << 16 | 1).to_bytes(4, "big")
    color_type = {1: 0, 3: 2, 4: 6}[channels]
    header = width.to_bytes(4, "big") + height.to_bytes(4, "big") + bytes([8, color_type, 0, 0, 0])
    return b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", header) + png_chunk(b"IDAT", stream) + png_chunk(b"IEND", b"")


def png_bomb_zip(root: Path, side: int, channels: int = 3, name: str = "00000/img00000000.png") -> Path:
    """root/bomb.zip, deflated, holding one black_png of side x side (3 GiB at side 32768, in a ZIP of about 8 KB)."""
    path = root / "bomb.zip"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr(name, black_png(side, side, channels))
    return path


# ---------------------------------------------------------------------------------------------------
# Memory bounds: a command line run with its address space limited, its peak reported.

# Run as `python -c WRAPPER LIMIT SCRIPT ARGS...`: cap the address space (RLIMIT_AS) at LIMIT bytes (0: no cap), or
# with '+HEADROOM' at what importing torch and NumPy (most of any command's address space) mapped plus HEADROOM;
# run SCRIPT with ARGS as __main__, and print the address space's peak to stderr at the end.
_PEAK_LINE = "address space peak: "
_WRAPPER = """
import atexit, resource, runpy, sys
limit = sys.argv[1]
if limit.startswith("+"):
    import numpy, torch
    with open("/proc/self/status") as status:
        mapped = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize:"))
    limit = mapped + int(limit[1:])
limit = int(limit)
if limit:
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
peak = lambda: [line.split()[1] for line in open("/proc/self/status") if line.startswith("VmPeak:")][0]
atexit.register(lambda: print("%s%s" % ({marker!r}, peak()), file=sys.stderr))
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def run_python_script(args: Sequence, address_limit: int | str = 0) -> tuple[subprocess.CompletedProcess, int]:
    """Run `python SCRIPT ARGS...` (args) from the repository with its address space capped at address_limit bytes
    (0: no cap; '+N': N bytes beyond what importing torch maps); return the finished process (its peak line removed
    from stderr) and its peak in bytes."""
    wrapper = _WRAPPER.format(marker=_PEAK_LINE)
    env = train_env(MALLOC_ARENA_MAX="2")  # threads and malloc arenas reserve address space
    result = subprocess.run([sys.executable, "-c", wrapper, str(address_limit), *map(str, args)], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=300)
    lines = result.stderr.splitlines(keepends=True)
    peaks = [int(line.removeprefix(_PEAK_LINE)) * 1024 for line in lines if line.startswith(_PEAK_LINE)]
    result.stderr = "".join(line for line in lines if not line.startswith(_PEAK_LINE))
    return result, max(peaks, default=0)


def run_with_memory_limit(headroom: int, script: str, *args: str) -> subprocess.CompletedProcess:
    """Run the repository's `script` with args in a child process whose address space may grow by no more than
    `headroom` bytes beyond what importing torch mapped (Linux); its output as text."""
    return run_python_script([script, *args], f"+{headroom}")[0]
