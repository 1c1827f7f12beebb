"""Pieces of the training loop: data order, seeding, gradient accumulation, the optimizer step, checkpoints."""

import json
import math
import multiprocessing
import re

import numpy as np
import pytest
import torch

from edm2.data.dataset import ImageFolderDataset
from edm2.layers import force_weight_normalization
from edm2.loss import EDM2Loss
from training.run import checkpoint
from training.data_order import DataOrder, round_seed, run_batches
from training.options import OptionsError, OptionsMismatch, TrainingOptions, check_same_hyperparameters, rounds_per_step
from training.run import loop
from training.step import accumulate_gradients, drop_labels, optimizer_step
from tests.helpers import REPO, tiny_precond


def take(iterator, n):
    return [next(iterator) for _ in range(n)]


def test_data_order_visits_every_item_once_per_epoch():
    order = iter(DataOrder(size=10, seed=3, rank=0, world_size=1, batch_gpu=4, start_nimg=0))
    stream = take(order, 30)
    for epoch in range(3):
        assert sorted(stream[epoch * 10:(epoch + 1) * 10]) == list(range(10))
    assert stream[:10] != stream[10:20]  # a fresh permutation each epoch
    other_seed = take(iter(DataOrder(10, 4, 0, 1, 4, 0)), 10)
    assert other_seed != stream[:10]


def test_data_order_resumes_mid_epoch_and_splits_over_ranks():
    # One process, batch 12: the global stream of images.
    single = take(iter(DataOrder(size=7, seed=0, rank=0, world_size=1, batch_gpu=12, start_nimg=0)), 48)
    # Resuming after two steps (24 images, mid-epoch) continues the same stream.
    resumed = take(iter(DataOrder(7, 0, 0, 1, 12, start_nimg=24)), 24)
    assert resumed == single[24:]
    # Two ranks with 3 images per round (2 rounds per step of 12) read disjoint chunks of the same stream.
    ranks = [take(iter(DataOrder(7, 0, rank, 2, 3, start_nimg=0)), 24) for rank in range(2)]
    interleaved = [i for chunk in zip(*(np.reshape(r, (-1, 3)) for r in ranks)) for part in chunk for i in part]
    assert interleaved == single


def test_run_batches_start_their_workers_at_the_first_batch_and_stop_them_on_leaving(train_data):
    dataset, before = ImageFolderDataset(train_data), set(multiprocessing.active_children())
    with run_batches(dataset, seed=3, start_nimg=8, batch_gpu=4, workers=2, device=torch.device("cpu")) as loaded:
        assert set(multiprocessing.active_children()) == before  # nothing forked until a batch is asked for
        images, labels = next(loaded)
        workers = set(multiprocessing.active_children()) - before
        assert len(workers) == 2
    assert not any(worker.is_alive() for worker in workers)
    # The batch is the DataOrder's from the images seen on (one process: rank 0 of 1).
    order = DataOrder(len(dataset), 3, 0, 1, 4, start_nimg=8)
    items = [dataset[order.index(position)] for position in range(8, 12)]
    assert torch.equal(images, torch.stack([torch.from_numpy(image) for image, _ in items]))
    assert torch.equal(labels, torch.stack([torch.from_numpy(label) for _, label in items]))


def test_the_life_of_a_run_names_modules_that_exist():
    life = loop.__doc__.split("The life of a run")[1]
    named = re.findall(r"\b(training/(?:run/)?\w+\.py)\b", life)
    assert len(named) >= 10 and all((REPO / path).is_file() for path in named)
    # Its steps run from the options to the saved training state.
    assert named[0] == "training/options.py" and named[-1] == "training/run/checkpoint.py"


def test_round_seeds_differ_by_rank_step_and_round():
    seeds = {round_seed(0, rank, nimg, r) for rank in range(2) for nimg in (0, 2048) for r in range(2)}
    assert len(seeds) == 8
    assert round_seed(5, 1, 4096, 0) == round_seed(5, 1, 4096, 0)
    assert round_seed(5, 1, 4096, 0) != round_seed(6, 1, 4096, 0)


def test_batch_must_split_evenly():
    assert rounds_per_step(2048, 0, 32) == (64, 1)
    assert rounds_per_step(2048, 16, 32) == (16, 4)
    with pytest.raises(OptionsError, match="batch 2048 is not divisible by 3 process"):
        rounds_per_step(2048, 0, 3)
    with pytest.raises(OptionsError, match="batch-gpu 48"):
        rounds_per_step(2048, 48, 2)


def tiny_net():
    torch.manual_seed(0)
    net = tiny_precond(label_dim=4, use_fp16=False)
    with torch.no_grad():
        net.unet.out_gain.fill_(0.5)
    return net.train()


class FixedNoiseLoss(EDM2Loss):
    """EDM2Loss at fixed per-image noise levels, so batches split differently give the same loss."""

    def __call__(self, net, images, labels=None):
        sigma = images.flatten(1)[:, :1].abs().reshape(-1, 1, 1, 1) + 0.1
        return super().__call__(net, images, labels, sigma=sigma, noise=torch.zeros_like(images))


class Identity:
    def encode_latents(self, x):
        return x


def gradients(batches, rounds, scale):
    net = tiny_net()
    loss = accumulate_gradients(net, FixedNoiseLoss(), Identity(), iter(batches), seeds=[0] * rounds, scale=scale,
                                device=torch.device("cpu"))
    return loss, [p.grad.clone() for p in net.parameters()]


def test_gradient_accumulation_equals_one_big_batch():
    torch.manual_seed(1)
    images, labels = torch.randn(8, 3, 8, 8), torch.eye(4)[[0, 1, 2, 3, 0, 1, 2, 3]]
    loss_1, grads_1 = gradients([(images, labels)], rounds=1, scale=1)
    loss_4, grads_4 = gradients([(images[i:i + 2], labels[i:i + 2]) for i in range(0, 8, 2)], rounds=4, scale=1)
    _, grads_scaled = gradients([(images, labels)], rounds=1, scale=256)
    # Tolerances from the float32 arithmetic (eps 1.2e-7), not from one machine: each weight's gradient sums
    # at most 8 x 64 per-pixel terms, summed pairwise (error ~ eps x log2(n), about 1e-6 relative) in a
    # different order for 1 x 8 and 4 x 2 images; where the terms cancel, the error is eps x sum|terms|
    # (sum|terms| < 100 here), hence the absolute 1e-5. rtol 1e-3 leaves room for other kernels' orders.
    for g1, g4, gs in zip(grads_1, grads_4, grads_scaled):
        torch.testing.assert_close(g4, g1, rtol=1e-3, atol=1e-5)
        # A power-of-two loss scale multiplies every backward value exactly (barring underflow): 1e-5 is slack.
        torch.testing.assert_close(gs, 256 * g1, rtol=1e-5, atol=1e-6)
    # The gradient is that of the batch mean of each image's summed loss (release convention).
    net = tiny_net()
    force_weight_normalization(net)  # as accumulate_gradients does before every forward pass
    FixedNoiseLoss()(net, images, labels).sum(dim=(1, 2, 3)).mean().backward()
    for g1, p in zip(grads_1, net.parameters()):
        # The same upstream gradient (1/8 per element) either way: equal up to kernel reassociation.
        torch.testing.assert_close(g1, p.grad, rtol=1e-5, atol=1e-7)
    # Sum of per-round means: float32 means of 2 vs 8 images x 192 elements, pairwise-summed (~eps x log2(1536)
    # = 1.3e-6 relative each), so rel=1e-5.
    assert loss_4.item() == pytest.approx(4 * loss_1.item(), rel=1e-5)


def test_optimizer_step_zeroes_nonfinite_gradients_and_sets_lr():
    param = torch.nn.Parameter(torch.tensor([1.0, 2.0, 3.0]))
    module = torch.nn.Module()
    module.p = param
    optimizer = torch.optim.Adam([param], lr=0, betas=(0.9, 0.99), eps=1e-8)
    param.grad = torch.tensor([float("nan"), float("inf"), 0.5])
    optimizer_step(module, optimizer, lr=0.25)
    # Adam's first step moves by lr * g / (|g| + eps): zeroed entries stay, the finite one moves by lr
    # (to within eps / |g| = 2e-8 relative, below float32's default tolerance of assert_close).
    torch.testing.assert_close(param.detach(), torch.tensor([1.0, 2.0, 2.75]))
    assert optimizer.param_groups[0]["lr"] == 0.25 and param.grad is None


def sample_state(nimg):
    return dict(net={"w": torch.full([3], float(nimg))}, optimizer={}, ema={}, cur_nimg=nimg, elapsed_s=1.0,
                options="{}", options_hash=checkpoint.options_hash({}))


def test_newest_valid_state_is_used_and_damage_reported(tmp_path):
    for nimg in (1024, 2048, 3072):
        checkpoint.save_state(checkpoint.state_path(tmp_path, nimg), sample_state(nimg))
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "training-state-0000001.pt", "training-state-0000002.pt", "training-state-0000003.pt"
    ]
    newest = tmp_path / "training-state-0000003.pt"
    newest.write_bytes(newest.read_bytes()[:200])  # truncated by a crash or a full disk
    (tmp_path / "training-state-0000002.pt").write_bytes(b"garbage")
    reports = []
    (path, state), skipped = checkpoint.load_newest_state(tmp_path, report=reports.append)
    assert path.name == "training-state-0000001.pt" and state["cur_nimg"] == 1024
    assert len(reports) == 2 and "0000003.pt: unreadable" in reports[0] and "0000002.pt" in reports[1]
    assert [p.name for p in skipped] == ["training-state-0000003.pt", "training-state-0000002.pt"]
    assert checkpoint.load_newest_state(tmp_path / "missing") == (None, [])


def test_states_are_loaded_without_running_code(tmp_path):
    path = tmp_path / "training-state-0000001.pt"
    torch.save(dict(sample_state(1024), extra=np.random.default_rng(0)), path)  # an arbitrary object
    with pytest.raises(checkpoint.CheckpointError, match="unreadable"):
        checkpoint.load_state(path)
    torch.save({"net": {}}, path)
    with pytest.raises(checkpoint.CheckpointError, match="missing format_version, optimizer"):
        checkpoint.load_state(path)


def test_changed_hyperparameters_are_named():
    base = TrainingOptions.from_preset("toy-tiny", dataset={"resolution": 8}, encoder={})
    changed = TrainingOptions.from_preset("toy-tiny", dataset={"resolution": 8}, encoder={}, lr=0.02,
                                          P_std=2.0, status=64, workers=0, duration=4096)
    with pytest.raises(OptionsMismatch) as info:
        check_same_hyperparameters(base.hyperparameters(), changed.hyperparameters())
    assert str(info.value) == (
        "cannot resume with different hyperparameters (P_std: run has 1.6, now 2.0, lr: run has 0.01, now 0.02)"
    )
    # Intervals, duration and workers may change between invocations.
    relaxed = TrainingOptions.from_preset("toy-tiny", dataset={"resolution": 8}, encoder={}, status=64,
                                          workers=0, duration=4096, batch_gpu=8)
    check_same_hyperparameters(base.hyperparameters(), relaxed.hyperparameters())
    assert json.loads(json.dumps(base.hyperparameters())) == base.hyperparameters()


def test_label_dropout_is_a_hyperparameter_that_runs_made_before_it_hold_at_zero():
    base = TrainingOptions.from_preset("toy-tiny", dataset={"resolution": 8}, encoder={})
    dropping = TrainingOptions.from_preset("toy-tiny", dataset={"resolution": 8}, encoder={}, label_dropout=0.1)
    with pytest.raises(OptionsMismatch, match=r"label_dropout: run has 0.0, now 0.1"):
        check_same_hyperparameters(base.hyperparameters(), dropping.hyperparameters())
    older = {k: v for k, v in base.hyperparameters().items() if k != "label_dropout"}  # a run from before the option
    check_same_hyperparameters(older, base.hyperparameters())
    with pytest.raises(OptionsMismatch, match=r"label_dropout: run has 0.0, now 0.1"):
        check_same_hyperparameters(older, dropping.hyperparameters())


def test_weights_digest_is_bitwise():
    net = tiny_net()
    digest = checkpoint.weights_digest(net)
    assert digest == checkpoint.weights_digest(tiny_net())
    with torch.no_grad():
        net.unet.out_gain.copy_(torch.nextafter(net.unet.out_gain, torch.tensor(1.0)))
    assert checkpoint.weights_digest(net) != digest


class RecordingLoss(EDM2Loss):
    """EDM2Loss drawing sigma and noise from torch's global generator (as training does), recording its inputs."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __call__(self, net, images, labels=None):
        loss = super().__call__(net, images, labels)
        self.seen.append((labels, torch.get_rng_state()))
        return loss


def dropout_round(label_dropout, seed=7, n=16):
    net, loss_fn = tiny_net(), RecordingLoss()
    images, labels = torch.randn(n, 3, 8, 8, generator=torch.Generator().manual_seed(1)), torch.eye(4)[torch.arange(n) % 4]
    loss = accumulate_gradients(net, loss_fn, Identity(), iter([(images, labels)]), seeds=[seed], scale=1,
                                device=torch.device("cpu"), label_dropout=label_dropout)
    return loss, [p.grad for p in net.parameters()], loss_fn.seen[0], (images, labels)


def test_label_dropout_zero_is_the_round_without_dropout_bitwise():
    loss, grads, (labels_seen, rng_after), (images, labels) = dropout_round(0.0)
    # The round as it was before label dropout existed: the round's seed, then the loss on the labels as read.
    net = tiny_net()
    torch.manual_seed(7)
    force_weight_normalization(net)  # as accumulate_gradients does before every forward pass
    expected = RecordingLoss()(net, images, labels)
    expected.sum().mul(1 / images.shape[0]).backward()
    assert torch.equal(labels_seen, labels) and torch.equal(rng_after, torch.get_rng_state())
    assert torch.equal(loss, expected.detach().mean())
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, net.parameters()))


def test_label_dropout_draws_from_its_own_stream_and_leaves_the_other_draws_alone():
    _, grads_0, (_, rng_0), _ = dropout_round(0.0)
    _, grads_half, (dropped, rng_half), (_, labels) = dropout_round(0.5)
    assert torch.equal(rng_half, rng_0)  # sigma and noise came from the same global draws
    kept = dropped.any(dim=1)
    assert torch.equal(dropped[kept], labels[kept]) and not dropped[~kept].any()
    assert 0 < kept.sum() < len(kept)
    assert not all(torch.equal(a, b) for a, b in zip(grads_0, grads_half))
    # The same round seed drops the same rows: a resumed run draws what the uninterrupted one did.
    assert torch.equal(dropout_round(0.5)[2][0], dropped)
    assert not torch.equal(dropout_round(0.5, seed=8)[2][0], dropped)


def test_label_dropout_drops_each_label_with_its_probability():
    n, p = 1 << 14, 0.2
    dropped = drop_labels(torch.ones(n, 3), p, seed=3)
    assert set(dropped.sum(dim=1).tolist()) <= {0.0, 3.0}
    # The dropped fraction's std is sqrt(p (1 - p) / n) = 0.0031: five of them bound it.
    assert abs((dropped.sum(dim=1) == 0).float().mean().item() - p) < 5 * math.sqrt(p * (1 - p) / n)
