"""Importing the release's .pkl format safely: faithful rebuild of Precond, refusal of anything else."""

import builtins
import importlib
import importlib.util
import io
import json
import os
import pickle
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch

from edm2 import encoders, release_pickle, snapshot
from edm2.errors import EDM2Error
from edm2.networks import Precond
from tests.helpers import (
    RELEASE_TINY,
    forget_release_standins,
    random_release_tiny_net,
    write_release_pickle,
)


def test_release_pickle_loads_into_precond_with_identical_outputs(tmp_path, release_standins):
    net = random_release_tiny_net()
    path = tmp_path / "edm2-img512-tiny-0000001-0.100.pkl"
    write_release_pickle(path, net, *release_standins)
    forget_release_standins()
    assert importlib.util.find_spec("torch_utils") is None

    loaded, metadata = snapshot.load_network(path)
    assert not (tmp_path / "ran").exists(), "code embedded in the pickle ran"
    assert "torch_utils" not in sys.modules

    assert isinstance(loaded, Precond) and not loaded.training
    assert all(t.dtype == torch.float32 and not t.requires_grad for t in loaded.state_dict().values())
    ref = Precond(**RELEASE_TINY).eval()
    ref.load_state_dict({k: v.half().float() for k, v in net.state_dict().items()})  # weights were stored as float16
    g = torch.Generator().manual_seed(1)
    x, sigma, labels = torch.randn([3, 4, 8, 8], generator=g), torch.tensor([0.1, 1.0, 20.0]), torch.eye(5)[[0, 3, 4]]
    out, logvar = loaded(x, sigma, labels, return_logvar=True)
    ref_out, ref_logvar = ref(x, sigma, labels, return_logvar=True)
    assert torch.equal(out, ref_out) and torch.equal(logvar, ref_logvar)
    assert not torch.allclose(out, random_release_tiny_net(seed=1)(x, sigma, labels))

    assert metadata["source"] == "release-pickle"
    assert metadata["network_kwargs"] == loaded.init_kwargs
    assert Precond(**metadata["network_kwargs"]).init_kwargs == loaded.init_kwargs
    encoder = metadata["encoder"]
    assert encoder["class"] == "StabilityVAEEncoder" and encoder["vae_name"] == "stabilityai/sd-vae-ft-mse"
    assert encoder["batch_size"] == 8 and encoders.encoder_from_config(encoder).config() == encoder
    # The release stores float32: rounding 4.17 and the quotient errs by <= 2 * 2^-24 ~ 1.2e-7 relative,
    # the bias adds two more roundings; float64 references, rtol 1e-6.
    np.testing.assert_allclose(encoder["scale"], 0.5 / np.array([4.17, 4.62, 3.71, 3.28]), rtol=1e-6)
    np.testing.assert_allclose(encoder["bias"], -np.array([5.81, 3.25, 0.12, -2.15]) * 0.5 / np.array([4.17, 4.62, 3.71, 3.28]), rtol=1e-6)
    assert metadata["loss"] == dict(P_mean=-0.4, P_std=1.0, sigma_data=0.5)
    assert metadata["dataset_kwargs"]["path"] == "img512-sd.zip" and type(metadata["dataset_kwargs"]) is dict
    json.dumps(metadata)


def test_rgb_release_pickle_keeps_its_encoder(tmp_path, release_standins):
    path = tmp_path / "rgb.pkl"
    write_release_pickle(path, random_release_tiny_net(), *release_standins, encoder="rgb")
    forget_release_standins()
    assert release_pickle.load_release_pickle(path)[1]["encoder"] == {"class": "StandardRGBEncoder"}


def test_pickle_without_encoder_or_loss_loads_with_the_rgb_encoder(tmp_path, release_standins):
    # Older and third-party pickles hold only the network (and dataset_kwargs); the release's generate_images.py
    # then decodes with StandardRGBEncoder, and nothing in sampling needs the loss.
    net = random_release_tiny_net()
    path = tmp_path / "old.pkl"
    write_release_pickle(path, net, *release_standins, encoder=None, loss=False)
    forget_release_standins()
    loaded, encoder, metadata = snapshot.load_generator(path)
    assert isinstance(encoder, encoders.StandardRGBEncoder) and metadata["encoder"] == {"class": "StandardRGBEncoder"}
    assert "loss" not in metadata
    assert all(torch.equal(loaded.state_dict()[k], v.half().float()) for k, v in net.state_dict().items())
    assert not (tmp_path / "ran").exists()


def test_pickle_with_a_foreign_encoder_or_loss_is_refused(tmp_path, release_standins):
    persistence, util = release_standins
    for entry, found in (("encoder", "expected StabilityVAEEncoder or StandardRGBEncoder, found Evil"),
                         ("loss_fn", "expected EDM2Loss, found Evil")):
        path = tmp_path / f"{entry}.pkl"
        write_release_pickle(path, random_release_tiny_net(), persistence, util,
                             replace={entry: persistence.Persistent("Evil", {})})
        with pytest.raises(release_pickle.ReleasePickleError, match=found):
            release_pickle.load_release_pickle(path)


class Attack:
    """Unpickles as a call fn(*args)."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return (self.fn, self.args)


def attacks(marker):
    legacy = io.BytesIO()
    torch.save(Attack(os.system, f"touch {marker}"), legacy, _use_new_zipfile_serialization=False)
    return {
        "os.system": (Attack(os.system, f"touch {marker}"), os.system.__module__ + ".system"),
        "builtins.eval": (Attack(builtins.eval, f"open({str(marker)!r}, 'w')"), "builtins.eval"),
        "subprocess": (Attack(subprocess.call, ["touch", str(marker)]), "subprocess.call"),
        "storage bytes": (Attack(torch.storage._load_from_bytes, legacy.getvalue()), "not plain weights"),
    }


@pytest.mark.parametrize("attack", ["os.system", "builtins.eval", "subprocess", "storage bytes"])
def test_pickles_that_run_code_are_refused(tmp_path, attack):
    marker = tmp_path / "ran"
    payload, named = attacks(marker)[attack]
    path = tmp_path / "evil.pkl"
    path.write_bytes(pickle.dumps(dict(ema=payload, dataset_kwargs=dict(path=payload))))
    # Control: a plain pickle.load of this file really does run the attack.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pickle.loads(path.read_bytes())
    assert marker.exists()
    marker.unlink()
    with pytest.raises(release_pickle.ReleasePickleError) as info:
        snapshot.load_network(path)
    message = str(info.value)
    assert named in message and str(path) in message and "\n" not in message
    assert not marker.exists(), "a refused pickle still ran code"


def test_unknown_persistent_class_is_refused_without_running_its_source(tmp_path, release_standins):
    persistence, _ = release_standins
    path = tmp_path / "other.pkl"
    path.write_bytes(pickle.dumps(dict(ema=persistence.Persistent("Evil", {"_modules": {}}))))
    forget_release_standins()
    with pytest.raises(release_pickle.ReleasePickleError, match="expected Precond, found Evil"):
        release_pickle.load_release_pickle(path)
    assert not (tmp_path / "ran").exists()


def test_errors_share_the_library_root():
    # A caller of load_network catches SnapshotError for either format, and EDM2Error for everything.
    assert issubclass(release_pickle.ReleasePickleError, snapshot.SnapshotError)
    assert issubclass(snapshot.SnapshotError, EDM2Error)
