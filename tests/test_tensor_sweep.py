"""calculate_metrics.py tensor-sweep (paper Figure 5b): one weight tensor's EMA length moved at a time, the others at
the global length; its rows against independent reconstructions and losses, and its bad input."""

import json

import pytest
from click.testing import CliRunner

import calculate_metrics
from edm2.data.dataset import ImageFolderDataset
from edm2.encoders import StandardRGBEncoder
from edm2.eval.magnitudes import bucket
from edm2.eval.sweep import round_to_stored
from edm2.eval.validation import ValidationSamples, validation_loss
from edm2.loss import recorded_loss
from edm2.formats.snapshot import read_metadata
from edm2.procedures import posthoc
from tests.helpers import assert_refused

NUM, GLOBAL, STDS = 16, 0.1, (0.05, 0.1, 0.2)


def tensor_sweep(*args):
    return CliRunner().invoke(calculate_metrics.main, ["tensor-sweep", *args])


def test_each_row_is_one_tensor_moved_and_measured(reference_run, train_data, tmp_path):
    dest = tmp_path / "out"
    result = tensor_sweep(f"--indir={reference_run}", f"--global-std={GLOBAL}", f"--std={','.join(map(str, STDS))}",
                          "--tensors=buckets", f"--data={train_data}", f"--num={NUM}", f"--batch={NUM}",
                          f"--dest={dest}")
    assert result.exit_code == 0, result.output
    rows = json.loads((dest / "ema-tensor-sweep.json").read_text())["rows"]
    assert (dest / "ema-tensor-sweep.png").stat().st_size > 0
    snapshots = posthoc.list_snapshots(reference_run)
    inputs, out_nimg = posthoc.select_inputs(snapshots)
    shapes = posthoc.header_architecture(inputs[-1].path)
    # One tensor per bucket: the U-Net's first weight (a matrix or kernel) of each, in the network's order.
    expected = {}
    for name, shape in shapes.items():
        if name.startswith("unet.") and len(shape) >= 2:
            expected.setdefault(bucket(name.removeprefix("unet.")), name)
    swept = list(dict.fromkeys(row["tensor"] for row in rows if row["tensor"] is not None))
    assert swept == list(expected.values()) and len(swept) >= 4
    assert sorted(row["std"] for row in rows if row["tensor"] is None) == list(STDS)

    metadata = read_metadata(inputs[-1].path)
    tracks = [s.track() for s in inputs]
    first_net = posthoc.combine_per_tensor(tracks, out_nimg, GLOBAL, {})[0]
    samples = ValidationSamples(ImageFolderDataset(str(train_data), use_labels=True), StandardRGBEncoder(),
                                first_net, NUM, recorded_loss(metadata["loss"], first_net.sigma_data), 0)

    def loss_of(tensor_stds: dict) -> float:
        net, _ = posthoc.combine_per_tensor(tracks, out_nimg, GLOBAL, tensor_stds)
        return validation_loss(round_to_stored(net), samples, NUM, "cpu")

    baseline = loss_of({})
    for name, std in ((swept[0], 0.05), (swept[-1], 0.2)):
        by_std = {row["std"]: row["loss"] for row in rows if row["tensor"] == name}
        assert by_std[GLOBAL] == baseline  # the unmoved row is the global network's
        # The sweep solves all lengths together, combine_per_tensor each alone: the coefficients differ by float64
        # round-off (~1e-13), which moves a float32 sum by at most an ulp and the loss, a mean of float32 squares,
        # far less than 1e-5 relative.
        assert by_std[std] == pytest.approx(loss_of({name: std}), rel=1e-5)
        assert by_std[std] != baseline


@pytest.mark.bad_input
@pytest.mark.parametrize("tensors, fragment", [
    ("unet.enc.nope.weight", "the network has no parameter 'unet.enc.nope.weight'"),
    ("unet.out_gain", "the network has no parameter 'unet.out_gain'"),  # a gain is no weight tensor (Appendix D.6)
])
def test_a_tensor_the_network_lacks_is_one_line_before_any_network_is_loaded(reference_run, train_data, tmp_path,
                                                                             monkeypatch, tensors, fragment):
    monkeypatch.setattr(posthoc, "load_network", lambda path: pytest.fail(f"loaded {path} for bad input"))
    assert_refused([tmp_path, reference_run], lambda: tensor_sweep(
        f"--indir={reference_run}", "--global-std=0.1", "--std=0.05,0.2", f"--tensors={tensors}",
        f"--data={train_data}", "--num=4", f"--dest={tmp_path / 'out'}"), "--tensors", fragment)
