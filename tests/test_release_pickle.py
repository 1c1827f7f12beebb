"""Importing the release's .pkl format safely: faithful rebuild of Precond, refusal of anything else."""

import builtins
import collections
import importlib
import importlib.util
import io
import json
import os
import pickle
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest
import torch

from edm2 import encoders, release_pickle, snapshot
from edm2.networks import Precond

TINY = dict(img_resolution=8, img_channels=4, label_dim=5, model_channels=16, channel_mult=[1, 2], num_blocks=1,
            attn_resolutions=[4], channels_per_head=16)  # fmt: skip

# Stand-ins for the release's helper modules, importable only while the test pickles.
PERSISTENCE_SRC = """
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
DNNLIB_UTIL_SRC = """
class EasyDict(dict):
    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name)

    def __setattr__(self, name, value):
        self[name] = value
"""


@pytest.fixture
def standins(tmp_path):
    """Import stand-in torch_utils.persistence and dnnlib.util; unimportable again once the test body has pickled."""
    root = tmp_path / "release_src"
    for package, module, src in (("torch_utils", "persistence", PERSISTENCE_SRC), ("dnnlib", "util", DNNLIB_UTIL_SRC)):
        (root / package).mkdir(parents=True)
        (root / package / "__init__.py").write_text("")
        (root / package / f"{module}.py").write_text(textwrap.dedent(src.format(marker=str(tmp_path / "ran"))))
    sys.path.insert(0, str(root))
    importlib.invalidate_caches()
    try:
        yield importlib.import_module("torch_utils.persistence"), importlib.import_module("dnnlib.util")
    finally:
        forget_standins()


def forget_standins():
    """Make the stand-ins unimportable again, as on a machine without the release's code."""
    sys.path[:] = [p for p in sys.path if not p.endswith("release_src")]
    for name in [n for n in sys.modules if n.split(".")[0] in ("torch_utils", "dnnlib")]:
        del sys.modules[name]
    importlib.invalidate_caches()


def release_module(module, persistence):
    """Mirror a module as the release pickles it: float16 tensors, module tree in _parameters/_buffers/_modules."""
    plain = (bool, int, float, str, type(None))
    state = {k: v for k, v in vars(module).items() if isinstance(v, plain)}
    state["_parameters"] = collections.OrderedDict(
        (n, torch.nn.Parameter(p.detach().half(), requires_grad=False)) for n, p in module._parameters.items()
    )
    state["_buffers"] = collections.OrderedDict((n, b.half()) for n, b in module._buffers.items())
    state["_non_persistent_buffers_set"] = set()
    state["_modules"] = collections.OrderedDict((n, release_module(c, persistence)) for n, c in module._modules.items())
    if isinstance(module, torch.nn.ModuleDict):
        # The release's enc/dec are plain torch ModuleDicts holding persistent blocks.
        container = torch.nn.ModuleDict.__new__(torch.nn.ModuleDict)
        container.__dict__.update(state)
        return container
    return persistence.Persistent(type(module).__name__, state)


def random_tiny_net(seed=0):
    torch.manual_seed(seed)
    net = Precond(**TINY)
    with torch.no_grad():
        for t in [*net.parameters(), *net.buffers()]:
            t.copy_(torch.randn(t.shape))
    return net.eval()


def write_release_pickle(path, net, persistence, util, encoder="vae"):
    ema = release_module(net, persistence)
    ema.meta["state"].update(_init_args=(), _init_kwargs=dict(TINY, dropout=0.0, use_fp16=True))
    if encoder == "vae":
        scale = np.float32(0.5) / np.float32([4.17, 4.62, 3.71, 3.28])
        bias = np.float32(0) - np.float32([5.81, 3.25, 0.12, -2.15]) * scale
        state = dict(vae_name="stabilityai/sd-vae-ft-mse", scale=scale, bias=bias, batch_size=8, _vae=None)
        encoder = persistence.Persistent("StabilityVAEEncoder", dict(state, _init_args=(), _init_kwargs={}))
    else:
        encoder = persistence.Persistent("StandardRGBEncoder", dict(_init_args=(), _init_kwargs={}))
    loss = dict(P_mean=-0.4, P_std=1.0, sigma_data=0.5)
    data = dict(
        ema=ema,
        encoder=encoder,
        dataset_kwargs=util.EasyDict(class_name="training.dataset.ImageFolderDataset", path="img512-sd.zip", use_labels=True),
        loss_fn=persistence.Persistent("EDM2Loss", dict(loss, _init_args=(), _init_kwargs=dict(P_mean=-0.4, P_std=1.0))),
    )
    with open(path, "wb") as f:
        pickle.dump(data, f)


def test_release_pickle_loads_into_precond_with_identical_outputs(tmp_path, standins):
    net = random_tiny_net()
    path = tmp_path / "edm2-img512-tiny-0000001-0.100.pkl"
    write_release_pickle(path, net, *standins)
    forget_standins()
    assert importlib.util.find_spec("torch_utils") is None

    loaded, metadata = snapshot.load_network(path)
    assert not (tmp_path / "ran").exists(), "code embedded in the pickle ran"
    assert "torch_utils" not in sys.modules

    assert isinstance(loaded, Precond) and not loaded.training
    assert all(t.dtype == torch.float32 and not t.requires_grad for t in loaded.state_dict().values())
    ref = Precond(**TINY).eval()
    ref.load_state_dict({k: v.half().float() for k, v in net.state_dict().items()})  # weights were stored as float16
    g = torch.Generator().manual_seed(1)
    x, sigma, labels = torch.randn([3, 4, 8, 8], generator=g), torch.tensor([0.1, 1.0, 20.0]), torch.eye(5)[[0, 3, 4]]
    out, logvar = loaded(x, sigma, labels, return_logvar=True)
    ref_out, ref_logvar = ref(x, sigma, labels, return_logvar=True)
    assert torch.equal(out, ref_out) and torch.equal(logvar, ref_logvar)
    assert not torch.allclose(out, random_tiny_net(seed=1)(x, sigma, labels))

    assert metadata["source"] == "release-pickle"
    assert metadata["network_kwargs"] == loaded.init_kwargs
    assert Precond(**metadata["network_kwargs"]).init_kwargs == loaded.init_kwargs
    encoder = metadata["encoder"]
    assert encoder["class"] == "StabilityVAEEncoder" and encoder["vae_name"] == "stabilityai/sd-vae-ft-mse"
    assert encoder["batch_size"] == 8 and encoders.encoder_from_config(encoder).config() == encoder
    np.testing.assert_allclose(encoder["scale"], 0.5 / np.array([4.17, 4.62, 3.71, 3.28]), rtol=1e-6)
    np.testing.assert_allclose(encoder["bias"], -np.array([5.81, 3.25, 0.12, -2.15]) * 0.5 / np.array([4.17, 4.62, 3.71, 3.28]), rtol=1e-6)
    assert metadata["loss"] == dict(P_mean=-0.4, P_std=1.0, sigma_data=0.5)
    assert metadata["dataset_kwargs"]["path"] == "img512-sd.zip" and type(metadata["dataset_kwargs"]) is dict
    json.dumps(metadata)


def test_rgb_release_pickle_keeps_its_encoder(tmp_path, standins):
    path = tmp_path / "rgb.pkl"
    write_release_pickle(path, random_tiny_net(), *standins, encoder="rgb")
    forget_standins()
    assert release_pickle.load_release_pickle(path)[1]["encoder"] == {"class": "StandardRGBEncoder"}


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
    with pytest.raises(ValueError) as info:
        snapshot.load_network(path)
    message = str(info.value)
    assert named in message and str(path) in message and "\n" not in message
    assert not marker.exists(), "a refused pickle still ran code"


def test_unknown_persistent_class_is_refused_without_running_its_source(tmp_path, standins):
    persistence, _ = standins
    path = tmp_path / "other.pkl"
    path.write_bytes(pickle.dumps(dict(ema=persistence.Persistent("Evil", {"_modules": {}}))))
    forget_standins()
    with pytest.raises(release_pickle.ReleasePickleError, match="expected Precond, found Evil"):
        release_pickle.load_release_pickle(path)
    assert not (tmp_path / "ran").exists()
