"""Text conditioning in the magnitude-preserving U-Net (the pooled path, cross and fused attention over the tokens),
text dropout, and a training step on text conditions."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import train_edm2

from edm2.data.dataset import ImageFolderDataset
from edm2.encoders import StandardRGBEncoder
from edm2.formats.snapshot import load_network
from edm2.layers import ArchitectureError, attention, mp_silu, mp_sum, normalize
from edm2.networks import TextAttention, text_rows
from edm2.text_condition import condition_shape, pack_condition, unpack_condition
from tests.helpers import (ATTENTION_ROUTES, assert_one_error_line, randomized, take_attention_route, tiny_precond,
                           toy_tiny_options)
from training.data_order import label_dropout_seed
from training.options import OptionsError, TrainingOptions
from training.presets import PRESETS
from training.run.preflight import dataset_description
from training.run.run_dir import RunDirectory
from training.state import TrainingState, init_network
from training.step import TrainingStep, accumulate_gradients, drop_conditions, drop_labels, training_step
from training.text_conditioning import put_empty_condition

KINDS = ["cross", "fused"]
DIM, TOKENS = 12, 6


def unit_rms(x: torch.Tensor) -> float:
    return x.to(torch.float64).square().mean().sqrt().item()


def conditions(n: int, lengths: list[int] | None = None, scale: float = 3.0, seed: int = 0) -> torch.Tensor:
    """n random conditions [n, 1+TOKENS, DIM+1], tokens and pooled embeddings of RMS `scale` (a text encoder's scale
    is its own)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor(lengths if lengths is not None else [(3 * i) % (TOKENS + 1) for i in range(n)])
    return pack_condition(scale * torch.randn(n, DIM, generator=g), scale * torch.randn(n, TOKENS, DIM, generator=g),
                          lengths)


def text_net(kind: str = "cross", **overrides) -> torch.nn.Module:
    net = tiny_precond(label_dim=0, text_dim=DIM, text_tokens=TOKENS, text_attention=[8, 4], text_attention_kind=kind,
                       **overrides)
    return randomized(net).eval()  # nonzero output gains, so that every layer reaches the output


# ---------------------------------------------------------------------------------------------------------------
# Magnitudes: unit variance in, unit variance out.

def test_pooled_path_keeps_unit_magnitude_whatever_the_encoders_scale():
    torch.manual_seed(0)
    unet = tiny_precond(label_dim=0, text_dim=64, text_tokens=4, text_attention=[], model_channels=64).unet
    n = 4096
    noise = torch.randn(n) / 4
    with torch.no_grad():
        emb = unet.embedding(noise, conditions_of_dim(n, 64, scale=1.0))
        louder = unet.embedding(noise, conditions_of_dim(n, 64, scale=50.0))
        # The pre-activation: mp_sum of the noise embedding and the pooled path, both of unit magnitude (Eq. 88).
        pooled = unet.emb_text(normalize(unpack_condition(conditions_of_dim(n, 64, scale=1.0))[0], dim=1))
    assert abs(unit_rms(pooled) - 1) < 0.03
    # mp_silu of a unit-normal input has unit magnitude (Eq. 81): the embedding stays as the class path leaves it.
    assert abs(unit_rms(emb) - 1) < 0.03
    # The pooled vector enters at unit RMS: 50 times louder changes only Algorithm 1's eps term (1e-4 of the RMS),
    # carried through two unit-gain layers and mp_silu (slope below 2) to values of a few units.
    torch.testing.assert_close(louder, emb, rtol=0, atol=1e-3)


def conditions_of_dim(n: int, dim: int, scale: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return pack_condition(scale * torch.randn(n, dim, generator=g), torch.zeros(n, 4, dim), torch.zeros(n))


@pytest.mark.parametrize("kind", KINDS)
def test_text_attention_keeps_unit_magnitude_with_one_key(kind):
    # With one key to attend to, softmax gives it weight 1: the branch is that key's value, unit RMS per head
    # (cosine attention, Eq. 30-34), through proj (unit by Eq. 47), and mp_sum keeps the residual at unit magnitude.
    # For fused attention the one key is the pixel's own (1x1 image, every text row masked); for cross the pooled row.
    # What remains is the sampling error of the random weights over 64 output channels: a few percent.
    torch.manual_seed(0)
    layer = TextAttention(64, DIM, num_heads=4, kind=kind, balance=0.3)
    side = 1 if kind == "fused" else 4
    x = torch.randn(2048 // side**2, 64, side, side)
    text = 5 * torch.randn(x.shape[0], 1 + TOKENS, DIM)
    mask = torch.zeros(x.shape[0], 1 + TOKENS, dtype=torch.bool)
    if kind == "cross":
        mask[:, 0] = True
    with torch.no_grad():
        out = layer(x, text, mask)
        branch = (out * math.sqrt(0.7**2 + 0.3**2) - 0.7 * x) / 0.3
    assert abs(unit_rms(branch) - 1) < 0.06
    assert abs(unit_rms(out) - 1) < 0.06


@pytest.mark.parametrize("kind", KINDS)
def test_text_attention_branch_is_a_convex_mean_of_unit_values(kind):
    # With many keys the branch averages unit-RMS values (a softmax mean), as the release's self-attention does: its
    # magnitude before proj is at most 1 and the residual's magnitude stays within the mp_sum of x and a branch of
    # magnitude 0 to 1.
    torch.manual_seed(0)
    layer = TextAttention(64, DIM, num_heads=4, kind=kind, balance=0.3)
    x = torch.randn(64, 64, 8, 8)
    rows, mask = text_rows(conditions(64))
    with torch.no_grad():
        out = layer(x, rows, mask)
    low, high = 0.7 / math.sqrt(0.58), math.sqrt(0.7**2 + 0.3**2) / math.sqrt(0.58)
    assert low - 0.03 < unit_rms(out) < high + 0.03


# ---------------------------------------------------------------------------------------------------------------
# Masks.

@pytest.mark.parametrize("route", ATTENTION_ROUTES)
def test_masked_attention_equals_softmax_over_the_kept_keys(monkeypatch, route):
    take_attention_route(monkeypatch, route)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, 2, 8, n, generator=g) for n in (5, 7, 7))
    mask = torch.tensor([[1, 0, 1, 1, 0, 0, 1], [1, 1, 1, 1, 1, 1, 1], [0, 0, 0, 1, 0, 0, 0]], dtype=torch.bool)
    got = attention(q, k, v, mask=mask)
    for i in range(3):
        kk, vv = k[i][..., mask[i]].double(), v[i][..., mask[i]].double()
        weights = torch.softmax(torch.einsum("hcq,hck->hqk", q[i].double(), kk) / math.sqrt(8), dim=2)
        torch.testing.assert_close(got[i].double(), torch.einsum("hqk,hck->hcq", weights, vv), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", KINDS)
def test_padding_rows_do_not_change_the_output(kind):
    net = text_net(kind)
    cond = conditions(4, lengths=[0, 2, 5, TOKENS])
    changed = cond.clone()
    pad = changed[:, 1:, -1] == 0  # the padding rows' mask is 0; their embedding is set to anything
    changed[:, 1:, :-1][pad] = 100 * torch.randn(int(pad.sum()), DIM)
    x, sigma = torch.randn(4, 3, 8, 8), torch.tensor([0.1, 0.5, 1.0, 3.0])
    with torch.no_grad():
        assert torch.equal(net(x, sigma, cond), net(x, sigma, changed))
        real = cond.clone()
        real[2, 3, 0] += 1  # a real token of the third caption
        assert not torch.equal(net(x, sigma, cond)[2], net(x, sigma, real)[2])


def test_an_empty_caption_attends_to_its_pooled_row():
    # Length 0: the pooled row is the one key, so the output is finite and depends on the pooled embedding.
    net = text_net("cross")
    cond = conditions(2, lengths=[0, 0])
    with torch.no_grad():
        y = net(torch.randn(2, 3, 8, 8), torch.ones(2), cond)
    assert torch.isfinite(y).all()
    assert text_rows(cond)[1].tolist() == [[True] + [False] * TOKENS] * 2


# ---------------------------------------------------------------------------------------------------------------
# The network: arguments, the empty caption, the class-conditional network unchanged, gradients.

def test_text_network_records_its_arguments_and_the_empty_condition():
    net = text_net("fused")
    assert {k: net.init_kwargs[k] for k in ("label_dim", "text_dim", "text_tokens", "text_attention",
                                            "text_attention_kind")} == dict(
        label_dim=0, text_dim=DIM, text_tokens=TOKENS, text_attention=[8, 4], text_attention_kind="fused")
    assert net.unet.empty_text.shape == condition_shape(TOKENS, DIM)
    assert "unet.empty_text" in net.state_dict()
    # Without labels a text network denoises with the empty caption's condition.
    net.unet.empty_text.copy_(conditions(1, lengths=[2])[0])
    x = torch.randn(3, 3, 8, 8)
    with torch.no_grad():
        # float32's tolerance: the one empty condition broadcast and three copies of it go through different matrix
        # products.
        torch.testing.assert_close(net(x, 1.0), net(x, 1.0, net.unet.empty_text.expand(3, -1, -1)))


@pytest.mark.parametrize("args,fragment", [
    (dict(label_dim=10, text_dim=DIM, text_tokens=TOKENS), "a text network takes a caption's condition"),
    (dict(label_dim=0, text_attention=[8]), "text_attention needs text_dim"),
    (dict(label_dim=0, text_dim=DIM, text_tokens=0), "text_tokens=0"),
    (dict(label_dim=0, text_dim=DIM, text_tokens=TOKENS, text_attention_kind="sideways"), "text_attention_kind"),
    (dict(label_dim=0, text_dim=DIM, text_tokens=TOKENS, text_attention=[8], model_channels=14, channels_per_head=4),
     "text attention at 8x8 splits 14 channels into 3 heads"),
])
def test_text_arguments_are_refused_in_one_line(args, fragment):
    with pytest.raises(ArchitectureError, match=fragment) as e:
        tiny_precond(**args)
    assert "\n" not in str(e.value)


def release_forward(unet: torch.nn.Module, x: torch.Tensor, noise_labels: torch.Tensor,
                    labels: torch.Tensor) -> torch.Tensor:
    """The class-conditional U-Net's forward pass written out from Figure 21 (the release's loop), independently of
    UNet.forward."""
    emb = unet.emb_noise(unet.emb_fourier(noise_labels))
    emb = mp_silu(mp_sum(emb, unet.emb_label(labels * math.sqrt(labels.shape[1])), t=unet.label_balance))
    x = torch.cat([x, torch.ones_like(x[:, :1])], dim=1)
    skips = []
    for name, block in unet.enc.items():
        x = block(x) if name.endswith("_conv") else block(x, emb)
        skips.append(x)
    for name, block in unet.dec.items():
        if "block" in name:
            x = unet.cat(x, skips.pop(), t=unet.concat_balance)
        x = block(x, emb)
    return unet.out_conv(x, gain=unet.out_gain)


def test_class_conditional_network_is_bitwise_unchanged():
    net = randomized(tiny_precond(label_dim=10))
    assert not [k for k in net.state_dict() if "text" in k]
    assert not [k for k in net.init_kwargs if k.startswith("text")]
    assert net.unet.emb_text is None and net.unet.text_attn is None
    x, labels = torch.randn(4, 3, 8, 8), torch.eye(10)[[1, 3, 5, 7]]
    noise = torch.randn(4)
    with torch.no_grad():
        assert torch.equal(net.unet(x, noise, labels), release_forward(net.unet, x, noise, labels))


@pytest.mark.parametrize("kind", KINDS)
def test_gradients_and_jvp_through_the_text_network(kind):
    net = text_net(kind).double()
    cond = conditions(2, lengths=[2, 5]).double()
    x, sigma = torch.randn(2, 3, 8, 8, dtype=torch.float64), torch.tensor([0.3, 2.0], dtype=torch.float64)
    tangent = torch.randn_like(x)
    _, jvp = torch.func.jvp(lambda x: net(x, sigma, cond), (x,), (tangent,))
    eps = 1e-6
    with torch.no_grad():
        central = (net(x + eps * tangent, sigma, cond) - net(x - eps * tangent, sigma, cond)) / (2 * eps)
    torch.testing.assert_close(jvp, central, rtol=1e-5, atol=1e-6)
    net(x, sigma, cond).square().sum().backward()
    for name in ("emb_text.weight", *(f"text_attn.{key}.{layer}.weight" for key in net.unet.text_attn
                                       for layer in ("q", "kv", "proj"))):
        grad = net.unet.get_parameter(name).grad
        assert grad is not None and grad.abs().sum() > 0, name


# ---------------------------------------------------------------------------------------------------------------
# Text dropout.

def test_text_dropout_replaces_conditions_by_the_empty_one_at_its_rate():
    p, n, batches = 0.1, 64, 300
    empty = conditions(1, lengths=[1], seed=9)[0]
    dropped = 0
    for seed in range(batches):
        cond = conditions(n, seed=seed)
        out = drop_conditions(cond, empty, p, seed)
        is_empty = (out == empty).flatten(1).all(dim=1)
        kept = (out == cond).flatten(1).all(dim=1)
        assert (is_empty | kept).all()  # each row is the empty caption's exactly, or the sample's own
        # The same rows as label dropout of the same seed zeroes.
        zeroed = drop_labels(torch.ones(n, 1), p, seed)[:, 0] == 0
        assert torch.equal(is_empty, zeroed)
        dropped += int(is_empty.sum())
    total = n * batches
    assert abs(dropped - p * total) < 4 * math.sqrt(total * p * (1 - p))  # binomial: 4 standard deviations


def test_text_options_need_text_and_label_dropout_does_not_apply():
    with pytest.raises(OptionsError, match="--text-attention shapes the attention over a caption's tokens"):
        toy_tiny_options(network=dict(channel_mult=[1, 2], num_blocks=1, attn_resolutions=[4],
                                      channels_per_head=16, text_attention=[4]), compile=False)
    text = dict(resolution=8, num_channels=3, label_dim=0, text_encoding=TextData(4).text_record)
    with pytest.raises(OptionsError, match="--label-dropout drops class labels"):
        TrainingOptions.from_preset("toy-tiny", text, {"class": "StandardRGBEncoder"}, label_dropout=0.1)


# ---------------------------------------------------------------------------------------------------------------
# Training on text conditions.

class TextData:
    """A stand-in for a dataset with text embeddings (the API of edm2.data's datasets with text): uint8 images and
    conditions as labels, the text_encoding record and the empty caption's condition."""

    resolution, num_channels, label_dim, classes = 8, 3, 0, None
    has_text = True
    text_record = dict(encoder={"name": "tiny", "class": "T5EncoderModel", "sha256": "0" * 64}, tokens=TOKENS, dim=DIM,
                       pooled="masked mean of the tokens")

    def __init__(self, size: int):
        g = torch.Generator().manual_seed(0)
        self.images = torch.randint(0, 256, (size, 3, 8, 8), generator=g, dtype=torch.uint8)
        self.conditions = conditions(size, seed=1).numpy()

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, idx: int) -> tuple[np.ndarray, np.ndarray]:
        return self.images[idx].numpy(), self.conditions[idx]

    def empty_condition(self) -> np.ndarray:
        return conditions(1, lengths=[1], seed=5)[0].numpy()


def test_the_step_drops_the_rounds_conditions_for_the_empty_one():
    net, empty = text_net(), conditions(1, lengths=[1], seed=9)[0]
    cond, seen = conditions(32), []

    def loss_fn(model, images, labels):
        seen.append(labels)
        return model(images, torch.ones(len(images)), labels).square()

    batches = iter([(torch.randn(32, 3, 8, 8), cond)])
    accumulate_gradients(net, loss_fn, StandardRGBEncoder(), batches, seeds=[7], scale=1.0, device=torch.device("cpu"),
                         text_dropout=0.5, empty_text=empty)
    want = drop_conditions(cond, empty, 0.5, label_dropout_seed(7))
    assert torch.equal(seen[0], want) and not torch.equal(want, cond)


def test_a_training_step_on_text_conditions(tmp_path):
    data = TextData(16)
    description = dataset_description(data)
    assert description["text_encoding"] == data.text_record
    opts = TrainingOptions.from_preset("toy-tiny", description, StandardRGBEncoder().config(), batch=8, compile=False)
    state = TrainingState.create(opts, 3, torch.device("cpu"))
    put_empty_condition(state.net, data)
    unet = state.net.unet
    assert unet.text_dim == DIM and state.net.label_dim == 0
    assert state.net.init_kwargs["text_attention"] == [4]  # toy-tiny's attention resolutions
    assert torch.equal(unet.empty_text, torch.from_numpy(data.empty_condition()))
    before = {k: v.clone() for k, v in state.net.state_dict().items() if "text" in k}

    def batches():
        while True:
            items = [data[i] for i in range(8)]
            yield (torch.from_numpy(np.stack([i for i, _ in items])), torch.from_numpy(np.stack([c for _, c in items])))

    step = TrainingStep.of_run(state, opts, StandardRGBEncoder(), batches(), device=torch.device("cpu"))
    loss = training_step(step)
    assert torch.isfinite(loss)
    after = state.net.state_dict()
    assert not torch.equal(before["unet.emb_text.weight"], after["unet.emb_text.weight"])
    assert torch.equal(before["unet.empty_text"], after["unet.empty_text"])  # a buffer: not trained
    # The snapshot records the data's text_encoding record (for generation) and holds the empty caption's condition.
    RunDirectory(tmp_path).save_snapshots([(state.net, 0.1)], 8, opts)
    loaded, metadata = load_network(next(tmp_path.glob("*.safetensors")))
    assert metadata["dataset"]["text_encoding"] == data.text_record
    torch.testing.assert_close(loaded.unet.empty_text, state.net.unet.empty_text.half().float(), rtol=0, atol=0)


def test_text_data_needs_the_unets_family():
    text = dict(resolution=8, num_channels=3, label_dim=0, text_encoding=TextData(4).text_record)
    with pytest.raises(OptionsError, match="the network family 'config-e' cannot take"):
        TrainingOptions.from_preset("config-e-toy", text, {"class": "StandardRGBEncoder"})


# An scd preset's network is that of the preset it distils (covered there); its options need a teacher.
@pytest.mark.parametrize("preset", [name for name, p in PRESETS.items() if p.family == "edm2" and p.method != "scd"])
def test_every_presets_network_takes_text(preset):
    # The preset's own data: latents of 64x64x4 (img512), 64x64 RGB images (img64), 16x16 RGB toys.
    shape = dict(img512=(64, 4), img64=(64, 3)).get(preset.split("-")[1], (16, 3))
    data = dict(resolution=shape[0], num_channels=shape[1], label_dim=1000, text_encoding=TextData(4).text_record)
    opts = TrainingOptions.from_preset(preset, data, StandardRGBEncoder().config())
    with torch.device("meta"):
        net = init_network(opts, shape[1])
    attention = opts.network.get("attn_resolutions", [16, 8])
    assert net.label_dim == 0 and net.init_kwargs["text_attention"] == list(attention)
    levels = {int(key.split("_")[1].split("x")[0]) for key in net.unet.text_attn}
    mult = opts.network.get("channel_mult", [1, 2, 3, 4])
    assert levels == {res for res in attention if res in [shape[0] >> i for i in range(len(mult))]}


class TextFolder(ImageFolderDataset):
    """An image folder with the text API of a dataset with text embeddings (the stand-in's conditions and record):
    what train_edm2.py opens when the data has text."""

    has_text = True
    text_record = TextData.text_record

    def __getitem__(self, idx: int) -> tuple[np.ndarray, np.ndarray]:
        raw = self._raw_idx[idx]
        return self._load(raw), TEXT_CONDITIONS[raw % len(TEXT_CONDITIONS)]

    def empty_condition(self) -> np.ndarray:
        return TextData(1).empty_condition()


TEXT_CONDITIONS = conditions(16, seed=3).numpy()


def test_train_edm2_trains_a_text_network_on_data_with_text(train_data, tmp_path, monkeypatch):
    monkeypatch.setattr(train_edm2, "open_dataset", lambda data, cond: TextFolder(data))
    args = ["--preset=toy-tiny", f"--data={train_data}", "--duration=128", "--batch=16", "--snapshot=128",
            "--checkpoint=128", "--status=64", "--workers=0", "--no-compile"]
    result = CliRunner().invoke(train_edm2.main, [*args, f"--outdir={tmp_path / 'run'}", "--text-attention-kind=fused"])
    assert result.exit_code == 0, result.output
    snapshot = next((tmp_path / "run").glob("*.safetensors"))
    net, metadata = load_network(snapshot)
    assert metadata["dataset"]["text_encoding"] == TextData.text_record
    assert metadata["training_options"]["text_dropout"] == 0.1
    assert (net.label_dim, net.init_kwargs["text_dim"], net.init_kwargs["text_attention_kind"]) == (0, DIM, "fused")
    torch.testing.assert_close(net.unet.empty_text, torch.from_numpy(TextData(1).empty_condition()).half().float(),
                               rtol=0, atol=0)
    # A run from the text snapshot (--init) trains on; data without text embeddings is refused in one line.
    again = [*args, f"--outdir={tmp_path / 'again'}", f"--init={snapshot}"]
    result = CliRunner().invoke(train_edm2.main, again)
    assert result.exit_code == 0, result.output
    monkeypatch.undo()
    assert_one_error_line(CliRunner().invoke(train_edm2.main, [*again[:-2], f"--outdir={tmp_path / 'plain'}",
                                                                again[-1]]),
                          f"takes text embeddings of {TOKENS} tokens of {DIM} features; the data has none")
