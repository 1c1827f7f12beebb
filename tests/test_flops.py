"""count_flops.py and edm2.eval.flops: the release's way of counting, against paper Table 6 and Appendix D.5, and
against a trace of a stand-in of the release's network priced by the release's rules."""

import math
import re
import warnings

import numpy as np
import pytest
import safetensors.torch
import torch
import torch.nn.functional as F
from click.testing import CliRunner

import count_flops
from edm2.eval import flops
from edm2.formats.snapshot import load_network, save_network
from edm2.networks import Precond
from tests.helpers import (IMG512_PARAMS, RELEASE_TINY, TABLE6_GMACS, assert_refused, forget_release_standins,
                           random_release_tiny_net, randomized, tiny_precond, write_release_pickle)

# Paper Table 6, ImageNet-64 column: the same U-Nets on 64x64x3 pixels.
TABLE6_IMG64_GFLOPS = {"s": 101.9, "m": 180.8, "l": 282.1, "xl": 405.9}


def run(*args):
    return CliRunner().invoke(count_flops.main, [str(a) for a in args])


def printed(output: str, row: str) -> list[float]:
    """The numbers after each '{row}' line's label."""
    return [float(m) for m in re.findall(rf"^{row}\s+([0-9.]+)", output, flags=re.M)]


@pytest.mark.parametrize("size", [s for s in TABLE6_GMACS if s != "s"])
def test_prints_table6_gflops_for_the_img512_sizes(size):
    result = run(f"edm2-img512-{size}")
    assert result.exit_code == 0, result.output
    [gflops] = printed(result.output, "Gflops")
    # Printed with 2 decimals (0.005 of rounding); Table 6 rounds to 0.05: the 0.2% asked for covers both.
    assert abs(gflops - TABLE6_GMACS[size]) / TABLE6_GMACS[size] < 0.002
    # The release counts every parameter, the log-variance head's too.
    assert f"({IMG512_PARAMS[size]:,})" in result.output


def test_img512_s_is_the_release_count_of_its_architecture():
    # Table 6 gives 102.2 for img512-S, 0.28% above our count, while the other five img512 sizes and all four
    # img64 sizes agree to 0.04%. img512-S and img64-S differ only in 4 vs 3 input channels (0.014 Gflops here),
    # and Table 6 gives img64-S 101.9; Table 1 gives the same 102.2 for config G, measured with the exploration
    # code of Section 2. So 102.2 is not what the release's counting gives for the released architecture.
    result = run("edm2-img512-s")
    [gflops] = printed(result.output, "Gflops")
    assert abs(gflops - TABLE6_IMG64_GFLOPS["s"]) / TABLE6_IMG64_GFLOPS["s"] < 0.002
    assert abs(gflops - TABLE6_GMACS["s"]) / TABLE6_GMACS["s"] < 0.003
    assert f"({IMG512_PARAMS['s']:,})" in result.output


@pytest.mark.parametrize("size", list(TABLE6_IMG64_GFLOPS))
def test_img64_sizes_match_table6(size):
    gflops = flops.count_flops(count_flops.preset_network(f"edm2-img64-{size}")).total / 1e9
    assert abs(gflops - TABLE6_IMG64_GFLOPS[size]) / TABLE6_IMG64_GFLOPS[size] < 0.002


def test_xxl_ops_match_appendix_d5():
    # Appendix D.5 lists the costliest ops of XXL; these three agree to the 0.01 Gflops printed. (Its mul and div,
    # 1.68 and 1.62, split what is 1.58 and 1.65 here, with the same total within Table 6's rounding.)
    by_op = flops.count_flops(count_flops.preset_network("edm2-img512-xxl")).by_op()
    assert round(by_op["_convolution"] / 1e9, 2) == 545.50
    assert round(by_op["linalg_vector_norm"] / 1e9, 2) == 1.54
    assert round(by_op["matmul"] / 1e9, 2) == 1.43


# ---------------------------------------------------------------------------------------------------
# A stand-in of the release's network: its forward pass written op for op as training/networks_edm2.py executes
# it (box-filter resampling by convolutions, einsum attention, weight normalization on every call), over the
# weights of our modules, traced and priced by the release's rules.

def release_normalize(x, dim=None, eps=1e-4):
    dim = list(range(1, x.ndim)) if dim is None else dim
    norm = torch.linalg.vector_norm(x, dim=dim, keepdim=True, dtype=torch.float32)
    return x / torch.add(eps, norm, alpha=np.sqrt(norm.numel() / x.numel())).to(x.dtype)


def release_mpconv(layer, x, gain=1):
    w = release_normalize(layer.weight.to(torch.float32))
    w = (w * (gain / np.sqrt(w[0].numel()))).to(x.dtype)
    return x @ w.t() if w.ndim == 2 else F.conv2d(x, w, padding=(w.shape[-1] // 2,))


def release_resample(x, mode):
    box = torch.full([1, 1, 2, 2], 0.25, dtype=x.dtype)
    if mode == "down":
        return F.conv2d(x, box.tile([x.shape[1], 1, 1, 1]), groups=x.shape[1], stride=2)
    if mode == "up":
        return F.conv_transpose2d(x, (box * 4).tile([x.shape[1], 1, 1, 1]), groups=x.shape[1], stride=2)
    return x


def release_mp_silu(x):
    return F.silu(x) / 0.596


def release_mp_sum(a, b, t):
    return a.lerp(b, t) / np.sqrt((1 - t) ** 2 + t ** 2)


def release_mp_cat(a, b, t):
    na, nb = a.shape[1], b.shape[1]
    scale = np.sqrt((na + nb) / ((1 - t) ** 2 + t ** 2))
    return torch.cat([scale / np.sqrt(na) * (1 - t) * a, scale / np.sqrt(nb) * t * b], dim=1)


def release_block(block, x, emb):
    x = release_resample(x, block.resample_mode)
    if block.flavor == "enc":
        x = release_normalize(release_mpconv(block.conv_skip, x) if block.conv_skip is not None else x, dim=1)
    y = release_mpconv(block.conv_res0, release_mp_silu(x))
    c = release_mpconv(block.emb_linear, emb, gain=block.emb_gain) + 1
    y = release_mpconv(block.conv_res1, release_mp_silu(y * c.unsqueeze(2).unsqueeze(3)))
    if block.flavor == "dec" and block.conv_skip is not None:
        x = release_mpconv(block.conv_skip, x)
    x = release_mp_sum(x, y, block.res_balance)
    if block.num_heads:
        y = release_mpconv(block.attn_qkv, x)
        y = y.reshape(y.shape[0], block.num_heads, -1, 3, y.shape[2] * y.shape[3])
        q, k, v = release_normalize(y, dim=2).unbind(3)
        w = (q.mT @ (k / np.sqrt(q.shape[2]))).softmax(dim=3)  # einsum nhcq,nhck->nhqk as the release's trace has it
        y = release_mpconv(block.attn_proj, (v @ w.mT).reshape(*x.shape))  # einsum nhqk,nhck->nhcq
        x = release_mp_sum(x, y, block.attn_balance)
    return x if block.clip_act is None else x.clip_(-block.clip_act, block.clip_act)


def release_forward(net, x, sigma, labels):
    unet, sd = net.unet, net.sigma_data
    sigma = sigma.reshape(-1, 1, 1, 1)
    c_skip, c_out = sd**2 / (sigma**2 + sd**2), sigma * sd / (sigma**2 + sd**2).sqrt()
    c_in, c_noise = 1 / (sd**2 + sigma**2).sqrt(), sigma.flatten().log() / 4
    fourier = (c_noise.ger(unet.emb_fourier.freqs) + unet.emb_fourier.phases).cos() * np.sqrt(2)
    emb = release_mpconv(unet.emb_noise, fourier)
    if unet.emb_label is not None:
        label_emb = release_mpconv(unet.emb_label, labels * np.sqrt(labels.shape[1]))
        emb = release_mp_sum(emb, label_emb, unet.label_balance)
    emb = release_mp_silu(emb)
    h = c_in * x
    h, skips = torch.cat([h, torch.ones_like(h[:, :1])], dim=1), []
    for name, block in unet.enc.items():
        h = release_mpconv(block, h) if name.endswith("_conv") else release_block(block, h, emb)
        skips.append(h)
    for name, block in unet.dec.items():
        if "block" in name:
            h = release_mp_cat(h, skips.pop(), unet.concat_balance)
        h = release_block(block, h, emb)
    return c_skip * x + c_out * release_mpconv(unet.out_conv, h, gain=unet.out_gain)


# The release's price per traced op (count_flops.py): per output element, times a factor for some; per input
# element for the norm; output elements times the reduced length for matmul and convolution; else nothing.
PER_OUTPUT = {"add": 1, "mul": 1, "div": 1, "pow": 1, "reciprocal": 1, "sqrt": 1, "cos": 1, "log": 1, "outer": 1,
              "lerp": 2, "clamp_": 2, "silu": 3, "softmax": 3}


def release_price(kind: str, shapes: list[list[int]]) -> int:
    op = kind.split("::")[-1]
    if op in PER_OUTPUT:
        return PER_OUTPUT[op] * math.prod(shapes[0])
    if op == "linalg_vector_norm":
        return math.prod(shapes[1])
    if op == "matmul":
        return math.prod(shapes[0]) * shapes[1][-1]
    if op == "_convolution":
        return math.prod(shapes[0]) * math.prod(shapes[2][1:])
    return 0


def traced_release_flops(net: Precond) -> int:
    x = torch.zeros([1, net.img_channels, net.img_resolution, net.img_resolution])
    sigma, labels = torch.zeros([1]), torch.zeros([1, net.label_dim])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tracer's warnings about Python values taken from tensors
        graph = torch.jit.trace(lambda: release_forward(net, x, sigma, labels), (), check_trace=False).graph
    total = 0
    for node in graph.nodes():
        shapes = []
        for value in [*node.outputs(), *node.inputs()]:
            match = re.search(r":\s*(?:Float|Double|Half|Long)\(([\d\s,]*)", str(value))
            shapes.append([int(d) for d in match[1].replace(" ", "").strip(",").split(",") if d] if match else [])
        total += release_price(node.kind(), shapes)
    return total


@pytest.mark.parametrize("config", [
    dict(label_dim=10),
    dict(img_resolution=16, img_channels=4, label_dim=0, model_channels=8, channel_mult=(1, 2, 3), num_blocks=2,
         attn_resolutions=(8, 4), channels_per_head=8),
    dict(img_resolution=16, img_channels=1, label_dim=5, model_channels=8, channel_mult=(1, 1, 2), attn_resolutions=(),
         clip_act=None, channel_mult_noise=2, channel_mult_emb=3),
], ids=["tiny", "uncond-deeper", "no-clip-wide-emb"])
def test_count_equals_the_release_rules_on_a_trace_of_the_release_network(config):
    net = randomized(tiny_precond(**config)).eval().requires_grad_(False)
    x, sigma = torch.randn([2, net.img_channels, net.img_resolution, net.img_resolution]), torch.tensor([0.3, 4.0])
    labels = torch.eye(net.label_dim)[[0, 1]] if net.label_dim else torch.zeros([2, 0])
    # The stand-in computes our network's function (float32 through ~20 layers: 1e-4 relative is loose enough).
    torch.testing.assert_close(release_forward(net, x, sigma, labels), net(x, sigma, labels), rtol=1e-4, atol=1e-4)
    assert flops.count_flops(net).total == traced_release_flops(net)


# ---------------------------------------------------------------------------------------------------
# Our snapshots, --verbose, bad input.

def test_counts_a_snapshot_of_ours(tmp_path):
    net = tiny_precond()
    path = tmp_path / "network-snapshot-0000001-0.100.safetensors"
    save_network(path, net, {"nimg": 1024, "ema_std": 0.1})
    result = run(path)
    assert result.exit_code == 0, result.output
    stored = safetensors.torch.load_file(str(path))
    # Every stored tensor is a parameter except the Fourier features' frequencies and phases (buffers).
    parameters = sum(t.numel() for name, t in stored.items() if not name.endswith(("freqs", "phases")))
    assert f"({parameters:,})" in result.output
    expected = flops.count_flops(load_network(path)[0]).total
    assert f"({expected:,} flops" in result.output
    assert expected == traced_release_flops(load_network(path)[0])
    # The same file by URL.
    assert run(path.as_uri()).output.replace(path.as_uri(), str(path)) == result.output


def test_counts_a_release_pickle(tmp_path, release_standins):
    path = tmp_path / "edm2-img512-tiny-0000001-0.100.pkl"
    write_release_pickle(path, random_release_tiny_net(), *release_standins)
    forget_release_standins()
    result = run(path)
    assert result.exit_code == 0, result.output
    with torch.device("meta"):
        expected = flops.count_flops(Precond(**RELEASE_TINY))
    assert f"({expected.total:,} flops" in result.output and f"({expected.parameters:,})" in result.output


def test_verbose_lists_every_block_and_op():
    result = run("edm2-img512-xs", "--verbose")
    assert result.exit_code == 0, result.output
    net = count_flops.preset_network("edm2-img512-xs")
    rows = dict(re.findall(r"^((?:enc|dec)\.\S+)\s+([0-9.]+)", result.output, flags=re.M))
    assert list(rows) == [f"enc.{n}" for n in net.unet.enc] + [f"dec.{n}" for n in net.unet.dec]
    ops = dict(re.findall(r"^(_convolution|matmul|linalg_vector_norm|silu|softmax)\s+([0-9.]+)", result.output, flags=re.M))
    assert set(ops) == {"_convolution", "matmul", "linalg_vector_norm", "silu", "softmax"}
    # The blocks hold nearly all the flops: the rest is the embedding, the first and last convolutions.
    [total] = printed(result.output, "Gflops")
    assert 0.99 * total < sum(map(float, rows.values())) <= total


def test_generation_preset_counts_main_and_guiding_networks():
    result = run("edm2-img512-s-uncond-autog-fid")
    assert result.exit_code == 0, result.output
    assert "main network" in result.output and "guiding network" in result.output
    main, guiding = printed(result.output, "Gflops")
    # The unconditional S and XS: the class embedding is all they lack, a few megaflops.
    assert abs(main - TABLE6_GMACS["s"]) < 0.3 and abs(guiding - TABLE6_GMACS["xs"]) < 0.1


@pytest.mark.cuda
def test_prints_memory_per_sample_on_cuda():
    result = run("edm2-img512-xs")
    [memory] = printed(result.output, "GPU memory")
    assert 0 < memory < 10


def text_file(path):
    path.write_text("hello")
    return path


BAD_INPUT = {
    "no such name": (lambda t: "edm2-img512-xxxl", ["NET", "no file, URL or preset name"]),
    "folder": (lambda t: t, ["is a folder"]),
    "not a snapshot": (lambda t: text_file(t / "x.safetensors"), ["x.safetensors"]),
    "dataset-dependent preset": (lambda t: "toy-tiny", ["NET", "toy-tiny", "count a snapshot"]),
    "unreachable url": (lambda t: "http://127.0.0.1:9/edm2-net.pkl", ["http://127.0.0.1:9/edm2-net.pkl"]),
}


@pytest.mark.bad_input
@pytest.mark.parametrize("argument, fragments", BAD_INPUT.values(), ids=BAD_INPUT.keys())
def test_bad_input_gives_one_line(tmp_path, monkeypatch, argument, fragments):
    monkeypatch.setenv("EDM2_CACHE_DIR", str(tmp_path / "cache"))
    arg = argument(tmp_path)
    assert_refused(tmp_path, lambda: run(arg), *fragments)
