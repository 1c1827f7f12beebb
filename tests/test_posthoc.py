"""edm2.procedures.posthoc from Python: the files reconstruct_phema.py writes, from a run folder, a list of files or
networks in memory, and the library's errors."""

import copy
import re
import shutil

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import reconstruct_phema
from edm2 import phema
from edm2.formats import snapshot
from edm2.formats.snapshot import save_network
from edm2.procedures import anyema, posthoc
from tests.helpers import FAKE_RUN, fake_training_run, tiny_precond


def test_python_api_writes_what_the_command_line_writes(tmp_path):
    run = fake_training_run(tmp_path / "run", num_snapshots=3)
    result = CliRunner().invoke(reconstruct_phema.main, [f"--indir={run}", f"--outdir={tmp_path / 'cli'}",
                                                         "--std=0.03,0.07,0.15", "--batch=2"])
    assert result.exit_code == 0, result.output
    # The README's example: a run folder in, (std, net, metadata) out, save_network to write.
    for std, net, metadata in posthoc.reconstruct(run, stds=[0.03, 0.07, 0.15], batch=2):
        save_network(tmp_path / "api" / f"phema-0000003-{std:.3f}.safetensors", net, metadata)
    # A list of files gives the same, whatever else lies beside them (here a copy the folder would refuse).
    inputs = sorted(run.glob("*.safetensors"))
    shutil.copy(run / "network-snapshot-0000001-0.050.safetensors", run / "copy-0000001-0.050.safetensors")
    with pytest.raises(posthoc.PosthocError, match="hold the same track"):
        next(posthoc.reconstruct(run, stds=[0.03]))
    for std, net, metadata in posthoc.reconstruct(inputs, stds=[0.03, 0.07, 0.15], batch=2):
        save_network(tmp_path / "list" / f"phema-0000003-{std:.3f}.safetensors", net, metadata)
    names = sorted(p.name for p in (tmp_path / "cli").iterdir())
    assert len(names) == 3
    for name in names:
        cli_bytes = (tmp_path / "cli" / name).read_bytes()
        assert (tmp_path / "api" / name).read_bytes() == cli_bytes
        assert (tmp_path / "list" / name).read_bytes() == cli_bytes


def test_combine_networks_in_memory(tmp_path):
    # Tracks need no files: here the tracker's float32 networks, copied at each snapshot time.
    torch.manual_seed(0)
    net = tiny_precond()
    ema = phema.PowerFunctionEMA(net, stds=(0.05, 0.10))
    tracks, nimg = [], 0
    for k in range(4):
        with torch.no_grad():
            for p in net.parameters():
                p.add_(torch.randn_like(p), alpha=0.05)
        nimg += 512
        ema.update(cur_nimg=nimg, batch_size=512)
        for track, std in ema.get():
            frozen = copy.deepcopy(track)
            tracks.append(posthoc.Track(f"step{k}-{std}", nimg, std, lambda frozen=frozen: (copy.deepcopy(frozen), {})))
    loaded = [t.load()[0] for t in tracks]
    outputs = [(std, copy.deepcopy(out), meta) for std, out, meta in posthoc.combine(tracks, nimg, [0.04, 0.2], batch=1)]
    assert [std for std, _, _ in outputs] == [0.04, 0.2]
    for std, out, meta in outputs:
        assert meta["nimg"] == nimg and meta["ema_std"] == std
        coefs = [u["coef"] for u in meta["phema"]["inputs"]]
        assert [u["file"] for u in meta["phema"]["inputs"]] == [t.name for t in tracks]
        np.testing.assert_array_equal(coefs, phema.solve_posthoc_coefficients(
            [t.nimg for t in tracks], [t.std for t in tracks], nimg, [std])[:, 0])
        for name, p in out.named_parameters():
            weights = [dict(n.named_parameters())[name].double() for n in loaded]
            want = sum(c * w for c, w in zip(coefs, weights))
            # float32 sum of n products: at most (n + 2) 2^-24 sum|c_i w_i| from the float64 sum.
            bound = (len(weights) + 2) * 2**-24 * sum(abs(c) * w.abs() for c, w in zip(coefs, weights))
            assert ((p.double() - want).abs() <= bound).all(), name


def test_listing_and_times(tmp_path):
    run = fake_training_run(tmp_path / "run", num_snapshots=3)
    save_network(run / "other-0000003-0.100.safetensors", tiny_precond(), dict(FAKE_RUN, nimg=4096, ema_std=0.1))
    snaps = posthoc.list_snapshots(run, inprefix="network-snapshot")
    assert [(s.nimg, s.std) for s in snaps] == [(n, s) for n in (1024, 2048, 3072) for s in (0.05, 0.1)]
    assert snaps[0].path == run / "network-snapshot-0000001-0.050.safetensors" and snaps[0].prefix == "network-snapshot"
    assert [s.std for s in posthoc.list_snapshots(run, instds=[0.1])] == [0.1] * 4
    assert posthoc.select_inputs(snaps) == (snaps, 3072)
    assert posthoc.select_inputs(snaps, kimg=2) == (snaps[:4], 2048)
    # Our own outputs are not tracks, so they are skipped.
    _, net, meta = next(posthoc.reconstruct(run, [0.2], inprefix="network-snapshot"))
    save_network(run / "phema-0000003-0.200.safetensors", net, meta)
    assert posthoc.is_reconstruction(run / "phema-0000003-0.200.safetensors")
    assert not posthoc.is_reconstruction(run / "other-0000003-0.100.safetensors")
    assert not posthoc.is_reconstruction(run / "missing.safetensors")
    assert "phema-0000003-0.200.safetensors" not in [s.path.name for s in posthoc.list_snapshots(run)]
    assert len(posthoc.list_snapshots(run)) == 7
    with pytest.raises(posthoc.NoSnapshotsError, match="holds no matching snapshot files"):
        posthoc.list_snapshots(run, inprefix="phema")
    # The release's names count kimg of 1024-image batches.
    assert snapshot.kimg_to_nimg(2147483) == 2**31
    assert snapshot.kimg_to_nimg(1) == 1024 and snapshot.kimg_to_nimg(42) is None


@pytest.mark.parametrize("name, prefix, nimg", [
    ("network-snapshot-0000002-0.050.safetensors", "network-snapshot", None),
    ("network-snapshot-0000001-1504-0.050.safetensors", "network-snapshot", "1504"),  # a count off 1024
    ("edm2-img512-xs-0134217-0.050.pkl", "edm2-img512-xs", None),
    ("phema-2147483-0.130.safetensors", "phema", None),
])
def test_snapshot_names_with_and_without_an_exact_count(name, prefix, nimg):
    match = snapshot.SNAPSHOT_NAME.fullmatch(name)
    assert (match["prefix"], match["nimg"], match["std"]) == (prefix, nimg, "0.050" if "0.050" in name else "0.130")


@pytest.mark.parametrize("std", [0.001, 0.05, 0.1234, 0.2884])
def test_one_helper_writes_the_std_suffix_and_its_pattern_reads_it_back(std):
    name = snapshot.snapshot_name("phema", 1024, std)
    assert name == f"phema-0000001-{snapshot.std_tag(std)}.safetensors"
    read = snapshot.SNAPSHOT_NAME.fullmatch(name)["std"]
    # Three decimals: the name's sigma_rel is within half a unit of the third (posthoc.STD_TOLERANCE) of std.
    assert read == snapshot.std_tag(std) and len(read.split(".")[1]) == 3
    assert abs(float(read) - std) <= posthoc.STD_TOLERANCE
    assert re.fullmatch(rf"ema-000000007-{snapshot.STD_TAG}\.safetensors", anyema.file_name("ema", 7, std))


def test_tracks_named_by_their_exact_count_are_found_by_prefix(tmp_path):
    # A stop by SIGTERM writes counts that are not multiples of 1024; their names carry the exact count.
    run = tmp_path / "run"
    run.mkdir()
    for nimg in (1024, 1504):
        for std in (0.05, 0.10):
            save_network(run / snapshot.snapshot_name("network-snapshot", nimg, std), tiny_precond(),
                         {"nimg": nimg, "ema_std": std})
    assert (run / "network-snapshot-0000001-1504-0.050.safetensors").is_file()
    found = posthoc.list_snapshots(run, inprefix="network-snapshot")
    assert [(s.prefix, s.nimg) for s in found] == [("network-snapshot", n) for n in (1024, 1024, 1504, 1504)]


def test_library_errors(tmp_path):
    run = fake_training_run(tmp_path / "run", num_snapshots=2)
    with pytest.raises(posthoc.NoSnapshotsError, match="is not a directory"):
        posthoc.list_snapshots(tmp_path / "missing")
    with pytest.raises(posthoc.NoSnapshotsError, match="none of the given files"):
        posthoc.list_snapshots([], inprefix="x")
    with pytest.raises(posthoc.PosthocError, match="not named PREFIX-KIMG-STD"):
        posthoc.list_snapshots([run / "network-snapshot-0000001-0.050.safetensors", tmp_path / "net.safetensors"])
    with pytest.raises(posthoc.NoSuchTimeError, match="no snapshot at kimg 5"):
        posthoc.select_inputs(posthoc.list_snapshots(run), kimg=5)

    def never(name):
        return posthoc.Track(name, 1024, 0.05, lambda: pytest.fail("loaded for bad input"))

    with pytest.raises(phema.EMAError, match="sigma_rel must lie in"):
        next(posthoc.combine([never("a")], 1024, [0.05, 0.3]))
    with pytest.raises(posthoc.PosthocError, match="need tracks"):
        next(posthoc.combine([], 1024, [0.05]))
    with pytest.raises(posthoc.PosthocError, match="need tracks taken after 0 and up to 512 images"):
        next(posthoc.combine([never("a")], 512, [0.05]))
    # Tracks of different networks are caught as they load.
    tracks = [posthoc.Track("a", 1024, 0.05, lambda: (tiny_precond(), {})),
              posthoc.Track("b", 2048, 0.05, lambda: (tiny_precond(model_channels=32), {}))]
    with pytest.raises(posthoc.PosthocError, match="b: network architecture differs from a"):
        next(posthoc.combine(tracks, 2048, [0.07]))


def profile_errors(total: int, every: int, targets: list[float]) -> np.ndarray:
    """Eq. 134 for two tracks (0.05, 0.10) with a snapshot every `every` of `total` images, reconstructed at the end."""
    nimg = np.repeat(np.arange(every, total + 1, every, dtype=np.float64), 2)
    stds = np.tile([0.05, 0.10], len(nimg) // 2)
    coefs = phema.solve_posthoc_coefficients(nimg, stds, total, targets)
    return phema.reconstruction_error(nimg, stds, total, targets, coefs)


def test_profile_error_is_described_by_its_rms_distance_and_a_verdict_grounded_in_measured_settings():
    # The rule of thumb's grounds (posthoc.GOOD_PROFILE_ERROR): the paper's setting (a snapshot every 8Mi of
    # 2Gi images) is as good as tracking for 0.02-0.25; the toy demo's four snapshots are fair for 0.03-0.2.
    paper = profile_errors(2048 << 20, 8 << 20, [0.02, 0.03, 0.07, 0.15, 0.2, 0.25])
    assert all("as good as a tracked EMA" in posthoc.describe_profile_error(e) for e in paper)
    demo = profile_errors(32 << 10, 8 << 10, [0.03, 0.07, 0.15, 0.2])
    assert all("fair" in posthoc.describe_profile_error(e) for e in demo)
    far = profile_errors(32 << 10, 8 << 10, [0.01])[0]
    assert "poor" in posthoc.describe_profile_error(far)
    # A relative squared L2 distance of 0.0121 is an RMS distance of sqrt(0.0121) = 11%.
    assert "1.2e-02: the averaging profile is 11.0% (RMS)" in posthoc.describe_profile_error(0.0121)
    assert posthoc.describe_profile_error(-1e-17).startswith("profile error 0.0e+00")  # rounding below zero


def test_reconstruct_phema_says_what_the_profile_error_means(tmp_path):
    run = fake_training_run(tmp_path / "run", num_snapshots=3)
    result = CliRunner().invoke(reconstruct_phema.main, [f"--indir={run}", "--std=0.10"])
    assert result.exit_code == 0, result.output
    _, metadata = snapshot.load_network(run / "phema" / "phema-0000003-0.100.safetensors")
    assert posthoc.describe_profile_error(metadata["phema"]["profile_error"]) in result.output


@pytest.mark.bad_input
@pytest.mark.parametrize("kimg", ["9" * 200, str(2**53 // 1000)], ids=["200 digits", "2**53"])
def test_a_release_name_past_2_53_images_is_refused_not_believed(tmp_path, kimg):
    # Release pickles carry their time in the name alone; its digits are counted before converting them.
    path = tmp_path / f"edm2-img512-xs-{kimg}-0.050.pkl"
    path.write_bytes(b"never unpickled")
    with pytest.raises(posthoc.PosthocError, match="means 2\\*\\*53 images or more"):
        posthoc.list_snapshots(tmp_path)


def test_a_run_resumed_by_an_edm2_with_run_ids_is_one_run(tmp_path):
    # Its first snapshots carry no run id, the later ones one: nothing tells them apart, so they combine, and the
    # reconstruction carries the run's identity.
    run = fake_training_run(tmp_path / "run", num_snapshots=3)
    for path in sorted(run.iterdir())[2:]:
        net, meta = snapshot.load_network(path)
        save_network(path, net, dict(meta, run_id="c" * 32))
    snaps = posthoc.list_snapshots(run)
    assert [s.run.run_id for s in snaps] == [None, None] + ["c" * 32] * 4
    _, _, meta = next(posthoc.reconstruct(run, [0.2]))
    assert meta["run_id"] == "c" * 32 and len(meta["phema"]["inputs"]) == 6
