"""Importing the release's .pkl format safely: faithful rebuild of Precond, refusal of anything else."""

import builtins
import collections
import importlib
import importlib.util
import io
import json
import os
import pickle
import pickletools
import re
import struct
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import generate

from edm2 import encoders
from edm2.errors import EDM2Error
from edm2.formats import legacy_storage, release_pickle, snapshot
from edm2.networks import Precond
from edm2.toy import snapshot as toy_snapshot
from edm2.toy.model import ToyDenoiser
from tests.helpers import (
    RELEASE_TINY,
    assert_one_error_line,
    assert_refused,
    forget_release_standins,
    random_release_tiny_net,
    release_module,
    run_with_memory_limit,
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


# ---------------------------------------------------------------------------------------------------
# Hostile sizes and garbage: refused with one line, before anything is allocated for them.

def storage_blob(values: torch.Tensor, declared: int | None = None, recorded: int | None = None) -> bytes:
    """torch's legacy serialization of a storage holding values (what a pickled tensor embeds), written here
    independently of torch; its persistent id declares `declared` elements and its record `recorded` (default:
    as many as it holds)."""
    numel = values.numel()
    declaration = ("storage", getattr(torch, {torch.float16: "HalfStorage", torch.float32: "FloatStorage"}[values.dtype]),
                   "0", "cpu", numel if declared is None else declared, None)

    class Declaring(pickle.Pickler):
        def persistent_id(self, obj):
            return declaration if obj is values else None

    buffer = io.BytesIO()
    sys_info = dict(protocol_version=1001, little_endian=True, type_sizes=dict(short=2, int=4, long=4))
    for header in (legacy_storage.MAGIC_NUMBER, legacy_storage.PROTOCOL_VERSION, sys_info):
        pickle.dump(header, buffer, protocol=2)
    Declaring(buffer, protocol=2).dump(values)
    pickle.dump(["0"], buffer, protocol=2)
    buffer.write(struct.pack("<q", numel if recorded is None else recorded) + values.numpy().tobytes())
    return buffer.getvalue()


def pickled_tensor(values: torch.Tensor, size, stride, offset=0, **blob) -> Attack:
    """Unpickles as torch pickles a tensor: _rebuild_tensor_v2 of a storage holding values, with this view."""
    storage = Attack(torch.storage._load_from_bytes, storage_blob(values, **blob))
    return Attack(torch._utils._rebuild_tensor_v2, storage, offset, tuple(size), tuple(stride), False,
                  collections.OrderedDict())


@pytest.mark.filterwarnings("ignore:TypedStorage is deprecated")
def test_storage_blob_is_torchs_format():
    # Control for the hostile cases below: torch itself reads what storage_blob writes, and so do we.
    values = torch.tensor([1.5, -2.0, 3.25, 0.0], dtype=torch.float16)
    by_torch = torch.storage._load_from_bytes(storage_blob(values))
    assert by_torch.dtype == torch.float16 and by_torch.tolist() == values.tolist()
    assert torch.equal(legacy_storage.read_storage(storage_blob(values)).data, values)
    loaded = pickle.loads(pickle.dumps(pickled_tensor(values, (2, 2), (1, 2), offset=0)))
    assert torch.equal(loaded, values.reshape(2, 2).t())


def release_ema(persistence, weight=None, **init_kwargs):
    """The release's pickled network (a random RELEASE_TINY net), its constructor arguments updated by init_kwargs
    and, given `weight`, logvar_linear.weight ([1, 128]) replaced by it."""
    ema = release_module(random_release_tiny_net(), persistence)
    ema.meta["state"].update(_init_args=(), _init_kwargs=dict(RELEASE_TINY, dropout=0.0, use_fp16=True, **init_kwargs))
    if weight is not None:
        ema.meta["state"]["_modules"]["logvar_linear"].meta["state"]["_parameters"]["weight"] = weight
    return ema


FOUR = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float16)
HUGE = 3 << 30  # bytes: more than the memory limit lets the loading command allocate


def hostile_release_file(path, kind, persistence, util):
    """A release pickle with one hostile size: it would make the loader allocate far more than the file holds."""
    entries = {
        "tensor beyond its storage": dict(ema=release_ema(persistence, pickled_tensor(FOUR, (1, 128), (128, 1)))),
        "tensor at offset 1e10": dict(ema=release_ema(persistence, pickled_tensor(FOUR, (1, 128), (128, 1), 10**10))),
        "storage declaring 1e10": dict(ema=release_ema(persistence, pickled_tensor(
            FOUR, (1, 4), (4, 1), declared=10**10, recorded=10**10))),
        "array of 1e7 x 1e7": dict(encoder=persistence.Persistent("StabilityVAEEncoder", dict(
            vae_name="x", scale=Attack(np.zeros(0).__reduce__()[0], np.ndarray, (10**7, 10**7), b"b"),
            bias=np.zeros(4, np.float32), batch_size=8, _init_args=(), _init_kwargs={}))),
        "model_channels=1536": dict(ema=release_ema(persistence, model_channels=1536)),
    }
    if kind == "bytes declaring 3 GiB":
        path.write_bytes(b"\x80\x04\x8e" + struct.pack("<Q", HUGE) + b"abc")  # BINBYTES8 of HUGE bytes, 3 given
        return
    write_release_pickle(path, random_release_tiny_net(), persistence, util, replace=entries[kind])


HOSTILE_SIZES = {
    "tensor beyond its storage": "a tensor of shape [1, 128] at offset 0 does not fit its storage of 4 elements",
    "tensor at offset 1e10": "at offset 10000000000 does not fit its storage of 4 elements",
    "storage declaring 1e10": "declares 10000000000 elements of torch.float16 (20000000000 bytes), but 8 bytes follow",
    "array of 1e7 x 1e7": "an array rebuilt with elements before its data",
    "model_channels=1536": "'unet.emb_fourier.freqs' is [16] in the file, [1536] in the Precond",
    "bytes declaring 3 GiB": f"expected {HUGE} bytes in a bytes8, but only 3 remain",
}


@pytest.mark.bad_input
@pytest.mark.parametrize("kind", HOSTILE_SIZES)
def test_hostile_sizes_are_refused_within_a_memory_bound(kind, tmp_path, release_standins):
    # generate.py loads the file with its address space limited to what importing torch mapped plus 1 GiB: enough
    # to load this network and generate from it (the control below), too little for any of these sizes.
    hostile_release_file(tmp_path / "hostile.pkl", kind, *release_standins)
    forget_release_standins()
    before = sorted(tmp_path.iterdir())
    result = run_with_memory_limit(1 << 30, "generate.py", "--net", tmp_path / "hostile.pkl", "--seeds=0",
                                   "--outdir", tmp_path / "out")
    assert_one_error_line(result, "--net", str(tmp_path / "hostile.pkl"), HOSTILE_SIZES[kind])
    assert sorted(tmp_path.iterdir()) == before and not (tmp_path / "ran").exists()


def test_an_honest_release_pickle_generates_within_the_memory_bound(tmp_path, release_standins):
    write_release_pickle(tmp_path / "net.pkl", random_release_tiny_net(), *release_standins, encoder=None)
    forget_release_standins()
    result = run_with_memory_limit(1 << 30, "generate.py", "--net", tmp_path / "net.pkl", "--seeds=0-1",
                                   "--outdir", tmp_path / "out")
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["000000.png", "000001.png", "labels.json"]


def deeply_nested_pickle(path, depth, persistence, util):
    """A release pickle whose dataset_kwargs nest `depth` dicts ({'a': {'a': ...}}), spliced into the stream as
    opcodes (pickling so deep a dict would exhaust the pickler's recursion); the enclosing frame's length follows."""
    write_release_pickle(path, random_release_tiny_net(), persistence, util, replace=dict(dataset_kwargs="PLACEHOLDER"))
    placeholder = b"\x8c\x0bPLACEHOLDER"  # SHORT_BINUNICODE
    nested = b"}\x8c\x01a" * (depth - 1) + b"}" + b"s" * (depth - 1)  # EMPTY_DICT, key 'a', ...; then SETITEMs
    data = path.read_bytes()
    at = data.index(placeholder)
    frame = max(pos for op, _, pos in pickletools.genops(data) if op.name == "FRAME" and pos < at)
    length = struct.unpack("<Q", data[frame + 1:frame + 9])[0] + len(nested) - len(placeholder)
    path.write_bytes(data[:frame + 1] + struct.pack("<Q", length) + data[frame + 9:at] + nested
                     + data[at + len(placeholder):])


def self_referencing():
    kwargs = dict(path="img512-sd.zip")
    kwargs["self"] = kwargs
    return kwargs


GARBAGE = {
    "self-referencing dataset_kwargs": (dict(dataset_kwargs=self_referencing()), "a dict that contains itself"),
    "model_channels=1e6": (dict(model_channels=1e6), "model_channels=1000000.0: expected an integer from 1 to 4096"),
    "model_channels=-4": (dict(model_channels=-4), "model_channels=-4: expected an integer from 1 to 4096"),
    "img_resolution=0": (dict(img_resolution=0), "img_resolution=0: expected an integer from 1 to 8192"),
    "channels_per_head=0": (dict(channels_per_head=0), "channels_per_head=0: expected an integer from 1 to 4096"),
    "unknown argument": (dict(mystery=1), "unknown network argument 'mystery'"),
    "400-digit P_mean": (dict(P_mean=10**400), "P_mean=<a 1329-bit integer>: expected a number in [-100.0, 100.0]"),
    "NaN P_std": (dict(P_std=float("nan")), "P_std=nan: expected a number in (0, 100.0]"),
}


def garbage_release_file(path, case, persistence, util):
    """A release pickle whose constructor arguments, loss settings or dataset_kwargs are garbage."""
    change, _ = GARBAGE[case]
    replace = {k: v for k, v in change.items() if k == "dataset_kwargs"}
    if "P_mean" in change or "P_std" in change:
        state = dict(dict(P_mean=-0.4, P_std=1.0, sigma_data=0.5), **change, _init_args=(), _init_kwargs={})
        replace["loss_fn"] = persistence.Persistent("EDM2Loss", state)
    elif not replace:
        replace["ema"] = release_ema(persistence, **change)
    write_release_pickle(path, random_release_tiny_net(), persistence, util, replace=replace)


def run_generate(net, outdir):
    return CliRunner().invoke(generate.main, ["--net", str(net), "--seeds=0", "--outdir", str(outdir)])


@pytest.mark.bad_input
@pytest.mark.parametrize("case", [*GARBAGE, "dataset_kwargs nested 5000 deep"])
def test_garbage_in_a_release_pickle_is_one_line(case, tmp_path, release_standins):
    path = tmp_path / "garbage.pkl"
    if case in GARBAGE:
        garbage_release_file(path, case, *release_standins)
        fragment = GARBAGE[case][1]
    else:
        deeply_nested_pickle(path, 5000, *release_standins)
        fragment = f"nested more than {release_pickle.safe_pickle.MAX_DEPTH} levels deep"
    forget_release_standins()
    assert_refused(tmp_path, lambda: run_generate(path, tmp_path / "out"), "--net", str(path), fragment)


def test_dataset_kwargs_nest_no_deeper_than_our_metadata_may(tmp_path, release_standins):
    # Nested within the unpickler's bound but beyond what our snapshot metadata may carry (edm2.runtime.bounded_json).
    deep, shallow = release_pickle.MAX_KWARGS_DEPTH + 1, release_pickle.MAX_KWARGS_DEPTH
    deeply_nested_pickle(tmp_path / "deep.pkl", deep, *release_standins)
    deeply_nested_pickle(tmp_path / "shallow.pkl", shallow, *release_standins)
    forget_release_standins()
    with pytest.raises(release_pickle.ReleasePickleError, match=f"dataset_kwargs nested more than {shallow} levels"):
        release_pickle.load_release_pickle(tmp_path / "deep.pkl")
    kwargs = release_pickle.load_release_pickle(tmp_path / "shallow.pkl")[1]["dataset_kwargs"]
    for _ in range(shallow - 1):
        kwargs = kwargs["a"]
    assert kwargs == {}


@pytest.mark.parametrize("blob, message", [
    (storage_blob(FOUR, declared=3), "declared as 3 elements is recorded with another count"),
    (storage_blob(FOUR, declared=5, recorded=5), "declares 5 elements of torch.float16 (10 bytes), but 8 bytes follow"),
    (storage_blob(FOUR)[:-1], "declares 4 elements of torch.float16 (8 bytes), but 7 bytes follow"),
    (storage_blob(FOUR).replace(b"\x88", b"\x89", 1), "written big-endian"),  # little_endian: NEWTRUE -> NEWFALSE
    (storage_blob(FOUR).replace(b"ctorch\nHalfStorage\n", b"cposix\nsystem\n"),  # protocol 2: no frames to fix
     "not plain weights: refusing to load 'posix.system'"),
], ids=["count", "more than follows", "truncated", "big-endian", "global"])
def test_storages_must_hold_what_they_declare(blob, message):
    with pytest.raises(legacy_storage.RefusedPickle, match=re.escape(message)):
        legacy_storage.read_storage(blob)


def test_tensor_views_must_lie_inside_their_storage():
    storage = legacy_storage.read_storage(storage_blob(FOUR))
    assert torch.equal(legacy_storage.tensor_view(storage, 1, (3,), (1,)), FOUR[1:])
    assert legacy_storage.tensor_view(storage, 4, (0,), (1,)).numel() == 0  # empty, at the end
    # Past the end; a million elements by a stride of 0 (a copy would be 2 MB, from 8 bytes); more dimensions than
    # strides.
    for offset, size, stride in [(1, (4,), (1,)), (0, (2, 2), (2, 2)), (0, (10**6,), (0,)), (0, (2, 2), (1,))]:
        with pytest.raises(legacy_storage.RefusedPickle):
            legacy_storage.tensor_view(storage, offset, size, stride)


@pytest.mark.parametrize("toy", [False, True])
def test_entries_of_another_type_are_one_line(toy, tmp_path, release_standins):
    persistence, util = release_standins
    path = tmp_path / "odd.pkl"
    if toy:
        model = release_module(ToyDenoiser(num_layers=1, hidden_dim=4), persistence, torch.float32,
                               {"ToyDenoiser": "ToyModel"})
        model.meta["state"].update(_init_args=(), _init_kwargs=[1, 2])
        path.write_bytes(pickle.dumps(model))
    else:
        ema = release_ema(persistence)
        ema.meta["state"]["_modules"]["logvar_linear"].meta["state"]["_parameters"] = "not a dict"
        write_release_pickle(path, random_release_tiny_net(), persistence, util, replace=dict(ema=ema))
    forget_release_standins()
    load = toy_snapshot.load_release_toy_pickle if toy else release_pickle.load_release_pickle
    with pytest.raises(release_pickle.ReleasePickleError, match=f"{re.escape(str(path))}: malformed release pickle"):
        load(path)
