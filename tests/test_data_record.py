"""A resume on changed data: the training state records what identifies its data (counts, a ZIP's members, a shard
index's id, a blend's datasets and shares); a resume on other data says what changed in one line and refuses,
unless --allow-data-change, which goes on and logs it; a state that records nothing resumes as before, said once."""

import json
import shutil
import zipfile

import pytest
import torch
from click.testing import CliRunner

import dataset_tool
from edm2.data.sources import open_data
from training.data_record import data_change, data_record, is_record
from training.run import checkpoint
from training.run.checkpoint import Checkpoints
from training.run.run_dir import RunDirectory
from training.state import TrainingState
from tests.helpers import assert_one_error_line, run_training, toy_tiny_options, write_image_dataset

SHORT = ["--workers=0", "--status=64", "--snapshot=64", "--checkpoint=64", "--grid=0"]


def toy(dest, num, seed=0):
    result = CliRunner().invoke(dataset_tool.main, ["toy", "--dest", str(dest), "--resolution", "8", "--num", str(num),
                                                    "--classes", "4", "--seed", str(seed)])
    assert result.exit_code == 0, result.output
    return dest


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Toy ZIPs: a.zip (20 images), b.zip (20 others), c.zip (12), and a.zip's shards."""
    root = tmp_path_factory.mktemp("record")
    toy(root / "a.zip", 20), toy(root / "b.zip", 20, seed=1), toy(root / "c.zip", 12)
    result = CliRunner().invoke(dataset_tool.main, ["convert", "--source", str(root / "a.zip"), "--dest",
                                                    str(root / "a.shards"), "--shard-size", "8"])
    assert result.exit_code == 0, result.output
    return root


def record(spec):
    return data_record(open_data(spec))


def test_the_record_names_counts_identities_and_shares(data):
    single = record(data / "a.zip")
    assert is_record(single) and [(s["kind"], s["count"], s["share"]) for s in single["sources"]] == [("zip", 20, 20)]
    assert record(data / "a.shards")["sources"][0]["identity"] == json.loads(
        (data / "a.shards" / "index.json").read_text())["id"]
    blend = record(f"{data / 'a.zip'}:3,{data / 'c.zip'}:1")
    assert [(s["count"], s["share"]) for s in blend["sources"]] == [(20, 24), (12, 8)]
    assert json.loads(json.dumps(blend)) == blend  # plain JSON values, as a training state holds them


def test_moved_data_is_the_same_data(data, tmp_path):
    shutil.copy(data / "a.zip", tmp_path / "moved.zip")
    shutil.copytree(data / "a.shards", tmp_path / "moved.shards")
    assert data_change(record(data / "a.zip"), record(tmp_path / "moved.zip")) is None
    assert data_change(record(data / "a.shards"), record(tmp_path / "moved.shards")) is None


@pytest.mark.parametrize("before, after, words", [
    ("a.zip", "c.zip", ["c.zip holds 12 samples", "a.zip held 20"]),
    ("a.zip", "b.zip", ["b.zip (zip) holds other samples than the state's", "a.zip (zip)", "same count"]),
    ("a.zip", "a.shards", ["a.shards (shards) holds other samples"]),
    ("a.zip:1,b.zip:1", "a.zip:3,b.zip:1", ["a.zip's share is 30 of every 40 samples", "was 20 of every 40"]),
    ("a.zip:1,b.zip:1", "a.zip", ["the data is 1 dataset(s), the state's was 2"]),
])
def test_each_change_of_the_data_is_one_phrase_naming_it(data, before, after, words):
    spec = lambda text: ",".join(str(data / part) for part in text.split(","))
    change = data_change(record(spec(before)), record(spec(after)))
    assert change is not None and "\n" not in change and all(word in change for word in words), change


def test_a_zip_whose_image_changed_under_the_same_name_is_other_data(data, tmp_path):
    changed = tmp_path / "a.zip"
    with zipfile.ZipFile(data / "a.zip") as source, zipfile.ZipFile(changed, "w") as dest:
        names = source.namelist()
        for name in names:
            dest.writestr(name, source.read(names[1] if name == names[0] else name))  # image 0 is image 1 now
    assert "holds other samples" in data_change(record(data / "a.zip"), record(changed))


def test_a_folders_record_follows_its_images_and_labels(tmp_path):
    folder = write_image_dataset(tmp_path / "f", num=8)
    before = record(folder)
    labels = json.loads((folder / "dataset.json").read_text())
    labels["labels"][0][1] = 3
    (folder / "dataset.json").write_text(json.dumps(labels))
    assert "holds other samples" in data_change(before, record(folder))


def test_a_malformed_record_is_a_damaged_state(tmp_path):
    opts = toy_tiny_options(run_dir=str(tmp_path), data="data")
    state = TrainingState.create(opts, 3, torch.device("cpu"))
    state.data = {"sources": [{"name": 1}]}
    Checkpoints(RunDirectory(tmp_path)).save(state, opts)
    with pytest.raises(checkpoint.CheckpointError, match="its record of the data is not"):
        checkpoint.load_state(checkpoint.list_states(tmp_path)[0])


def test_a_resume_on_changed_data_refuses_in_one_line_unless_allowed_and_logs_it(data, tmp_path):
    zip_path, run = tmp_path / "data.zip", tmp_path / "run"
    shutil.copy(data / "a.zip", zip_path)
    assert run_training(zip_path, run, *SHORT, "--duration=64").returncode == 0
    assert checkpoint.load_state(run / "training-state-0000000-64.pt")["data"] == record(zip_path)
    shutil.copy(data / "c.zip", zip_path)  # the same path, another dataset of 12 images
    refused = run_training(zip_path, run, *SHORT, "--duration=128")
    assert_one_error_line(refused, f"{run / 'training-state-0000000-64.pt'}: the data is not what",
                          f"{zip_path} holds 12 samples", "held 20", "--allow-data-change")
    assert not list(run.glob("*-128*"))
    allowed = run_training(zip_path, run, *SHORT, "--duration=128", "--allow-data-change")
    assert allowed.returncode == 0, allowed.output
    warning = f"Warning: the data is not what training-state-0000000-64.pt was trained on: {zip_path} holds 12"
    assert warning in allowed.stdout and warning in (run / "log.txt").read_text()
    # The state written after it records the data it now reads.
    path = run / "training-state-0000000-128.pt"
    contents = checkpoint.load_state(path)
    assert contents["data"] == record(zip_path)
    # A state written before the data was recorded resumes as it always did, on any data, said once.
    checkpoint.save_state(path, {key: value for key, value in contents.items() if key != "data"})
    resumed = run_training(data / "b.zip", run, *SHORT, "--duration=192")
    assert resumed.returncode == 0, resumed.output
    note = "Note: training-state-0000000-128.pt records nothing of its data"
    assert resumed.stdout.count(note) == 1 and "cannot be checked" in resumed.stdout
    assert "Resuming from training-state-0000000-128.pt at 128 images" in resumed.stdout
