"""The generation driver's parts: seed sets held as ranges, per-seed randomness, the guidance pair check."""

import random
import tracemalloc
from types import SimpleNamespace

import pytest
import torch

from edm2.encoders import StandardRGBEncoder
from edm2.errors import EDM2Error
from edm2.formats.snapshot import save_network
from edm2.procedures import generation
from edm2.procedures.generation import MAX_SEED, SeedRanges
from edm2.sampler import SELF
from tests.helpers import tiny_precond


def distinct_in_order(ranges):
    """The seeds of the ranges as a plain list, later repeats dropped: what SeedRanges must equal."""
    seen, out = set(), []
    for r in ranges:
        for seed in r:
            if seed not in seen:
                seen.add(seed)
                out.append(seed)
    return out


@pytest.mark.parametrize("ranges", [
    [range(0, 64)],
    [range(5, 6), range(0, 3), range(2, 9), range(100, 101)],
    [range(10, 20), range(0, 30)],  # a later range around an earlier one: only its new seeds, in order
    [range(0, 3), range(3, 6), range(6, 7)],  # consecutive pieces join into one range
    [range(7, 8), range(7, 8), range(3, 10), range(0, 4)],
])
def test_seed_ranges_are_the_distinct_seeds_in_order(ranges):
    seeds = SeedRanges(ranges)
    expected = distinct_in_order(ranges)
    assert list(seeds) == expected and len(seeds) == len(expected)
    assert [seeds[i] for i in range(len(seeds))] == expected
    assert [seeds[-i] for i in range(1, len(seeds) + 1)] == [expected[-i] for i in range(1, len(expected) + 1)]
    for start in range(len(expected) + 1):
        for stop in range(start, len(expected) + 2):
            assert list(seeds[start:stop]) == expected[start:stop]
    assert seeds[::2] == expected[::2]
    assert all(seed in seeds for seed in expected) and -1 not in seeds and max(expected) + 1 not in seeds


def test_seed_ranges_match_a_brute_force_on_random_ranges():
    rnd = random.Random(0)
    for _ in range(200):
        ranges = [range(a, a + rnd.randrange(0, 12)) for a in (rnd.randrange(0, 40) for _ in range(rnd.randrange(1, 8)))]
        seeds = SeedRanges(ranges)
        assert list(seeds) == distinct_in_order(ranges)
        # Stored as disjoint ranges, never with two that could be one.
        assert all(a.stop != b.start for a, b in zip(seeds.ranges, seeds.ranges[1:]))


def test_seed_ranges_of_all_seeds_cost_a_few_bytes():
    tracemalloc.start()
    try:
        seeds = SeedRanges([range(0, MAX_SEED), range(5, 10)])
        assert len(seeds) == MAX_SEED and seeds[-1] == MAX_SEED - 1 and seeds[123456789] == 123456789
        assert list(seeds[MAX_SEED - 3:]) == [MAX_SEED - 3, MAX_SEED - 2, MAX_SEED - 1]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 100_000


@pytest.mark.parametrize("ranges", [[range(MAX_SEED - 1, MAX_SEED + 1)], [range(-1, 3)], [range(0, 10, 2)]])
def test_seed_ranges_refuse_seeds_the_release_cannot_reproduce(ranges):
    with pytest.raises(generation.GenerationError, match="seeds must be consecutive integers in"):
        SeedRanges(ranges)


def test_seeded_random_refuses_seeds_outside_32_bits():
    generation.SeededRandom([0, MAX_SEED - 1])
    for seed in (MAX_SEED, -1):
        with pytest.raises(generation.GenerationError, match=f"seed {seed} is outside"):
            generation.SeededRandom([3, seed])


def test_seeded_inputs_depend_on_each_seed_alone():
    seeds = [5, 0, 123456789, 7]
    noise, labels, randn_like = generation.seeded_inputs(seeds, 3, 4, 10)
    churn = [randn_like(noise), randn_like(noise)]
    for i, seed in enumerate(seeds):
        one_noise, one_labels, one_randn_like = generation.seeded_inputs([seed], 3, 4, 10)
        assert torch.equal(noise[i : i + 1], one_noise)
        assert torch.equal(labels[i : i + 1], one_labels)
        for draw in churn:
            assert torch.equal(draw[i : i + 1], one_randn_like(one_noise))
    assert labels.sum(dim=1).eq(1).all() and len(set(labels.argmax(dim=1).tolist())) > 1
    fixed_noise, fixed_labels, _ = generation.seeded_inputs(seeds, 3, 4, 10, class_idx=3)
    assert torch.equal(fixed_noise, noise) and fixed_labels.argmax(dim=1).eq(3).all()
    assert generation.seeded_inputs(seeds, 3, 4, 0)[1] is None
    # Seeds as a range or a SeedRanges draw exactly what the same seeds as a list draw.
    for same in (range(5, 9), SeedRanges([range(5, 9)])):
        assert torch.equal(generation.seeded_inputs(same, 3, 4, 10)[0], generation.seeded_inputs([5, 6, 7, 8], 3, 4, 10)[0])


def test_guidance_pair_must_match_in_shape_and_classes():
    def fake(resolution, channels, label_dim):
        return SimpleNamespace(img_resolution=resolution, img_channels=channels, label_dim=label_dim)

    generation.check_guidance_pair(fake(8, 3, 10), fake(8, 3, 0))  # unconditional guide: fine
    generation.check_guidance_pair(fake(8, 3, 10), fake(8, 3, 10))  # autoguidance: fine
    with pytest.raises(generation.GenerationError, match="resolution 16 with 3 channels"):
        generation.check_guidance_pair(fake(8, 3, 10), fake(16, 3, 0))
    with pytest.raises(generation.GenerationError, match="resolution 8 with 4 channels"):
        generation.check_guidance_pair(fake(8, 3, 10), fake(8, 4, 0))
    with pytest.raises(generation.GenerationError, match="5 classes"):
        generation.check_guidance_pair(fake(8, 3, 10), fake(8, 3, 5))


@pytest.mark.bad_input
def test_self_guidance_needs_a_conditional_network_trained_with_label_dropout():
    conditional, unconditional = SimpleNamespace(label_dim=10), SimpleNamespace(label_dim=0)
    generation.check_self_guidance(conditional, {"training_options": {"label_dropout": 0.1}})
    # Snapshot metadata is read from a file: only a number in (0, 1) counts as label dropout.
    for options in ({}, {"label_dropout": 0}, {"label_dropout": 0.0}, {"label_dropout": True},
                    {"label_dropout": "0.5"}, {"label_dropout": 1.5}, {"label_dropout": float("nan")}, [0.5]):
        with pytest.raises(generation.GenerationError, match="trained with label dropout"):
            generation.check_self_guidance(conditional, {"training_options": options})
    with pytest.raises(generation.GenerationError, match="trained with label dropout"):
        generation.check_self_guidance(conditional, {})  # the release's pickles hold no training options
    with pytest.raises(generation.GenerationError, match="unconditional"):
        generation.check_self_guidance(unconditional, {"training_options": {"label_dropout": 0.1}})


def tiny_generator(label_dim=5, seed=0, **kwargs):
    torch.manual_seed(seed)
    return tiny_precond(label_dim=label_dim, **kwargs).eval().requires_grad_(False)


def test_generate_images_refuses_bad_input_before_sampling():
    net = tiny_generator()
    cases = [
        (dict(class_idx=5), "class 5 is out of range"),
        (dict(gnet=tiny_generator(0, img_resolution=16), guidance=2.0), "resolution 16"),
        (dict(sigma_max=float("nan")), "sigma_max=nan"),
        (dict(seeds=[MAX_SEED]), f"seed {MAX_SEED} is outside"),
    ]
    for kwargs, message in cases:
        kwargs = {"seeds": [0, 1], **kwargs}
        with pytest.raises(EDM2Error, match=message):
            next(generation.generate_images(net, StandardRGBEncoder(), device="cpu", num_steps=2, **kwargs))


def test_load_guide_loads_a_guiding_network_and_refuses_one_that_cannot_guide(tmp_path):
    net, metadata = tiny_generator(), {"training_options": {"label_dropout": 0.1}}
    for name, gnet in (("fits", tiny_generator(0, seed=1)), ("res16", tiny_generator(0, img_resolution=16))):
        save_network(tmp_path / f"{name}.safetensors", gnet, {})
    guide = generation.load_guide(str(tmp_path / "fits.safetensors"), net, metadata)
    assert {k: v.shape for k, v in guide.state_dict().items()} == {k: v.shape for k, v in net.state_dict().items()
                                                                   if k in guide.state_dict()}
    assert guide.label_dim == 0 and generation.load_guide(SELF, net, metadata) == SELF
    with pytest.raises(generation.GenerationError, match="resolution 16"):
        generation.load_guide(str(tmp_path / "res16.safetensors"), net, metadata)
    with pytest.raises(generation.GenerationError, match="label dropout"):
        generation.load_guide(SELF, net, {})


def test_generate_images_over_all_seeds_starts_at_once_without_listing_them():
    net = tiny_generator()
    tracemalloc.start()
    try:
        batches = generation.generate_images(net, StandardRGBEncoder(), SeedRanges([range(0, MAX_SEED)]),
                                             batch_size=2, device="cpu", num_steps=2)
        seeds, images, _ = next(batches)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert seeds == [0, 1] and images.shape == (2, 3, 8, 8)
    # 2**32 seeds as a list would take over 100 GB; one batch of a tiny net needs a few MB at most.
    assert peak < 20_000_000
    [(one_seed, one_image, _)] = generation.generate_images(net, StandardRGBEncoder(), [1], batch_size=1, device="cpu",
                                                         num_steps=2)
    assert one_seed == [1] and torch.equal(one_image[0], images[1])



@pytest.mark.bad_input
@pytest.mark.parametrize("text, words", [("[" * 100_000 + "]" * 100_000, "nested 100000 levels"),
                                         ('{"labels": [["a.png", 1' + "0" * 30 + "]]}", "more than 20 digits")])
def test_a_labels_file_beyond_json_bounds_is_refused_in_one_line(tmp_path, text, words):
    path = tmp_path / "labels.json"
    path.write_text(text)
    with pytest.raises(generation.GenerationError, match="not a readable labels file") as info:
        generation.read_generated_labels(path)
    assert words in str(info.value) and "\n" not in str(info.value)
