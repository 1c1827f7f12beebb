"""The release's generation presets, checked against a table typed in independently and against the paper."""

import pytest

from edm2.procedures import presets_generate

RELEASE = "https://nvlabs-fi-cdn.nvidia.com/edm2/posthoc-reconstructions/"

# name: network file, guiding network file ("-": none), guidance. Typed from the release's list of
# published networks (its README and generate_images.py), independently of edm2/procedures/presets_generate.py.
EXPECTED = """
edm2-img512-xs-fid               edm2-img512-xs-2147483-0.135.pkl         -                                        1
edm2-img512-xs-dino              edm2-img512-xs-2147483-0.200.pkl         -                                        1
edm2-img512-s-fid                edm2-img512-s-2147483-0.130.pkl          -                                        1
edm2-img512-s-dino               edm2-img512-s-2147483-0.190.pkl          -                                        1
edm2-img512-m-fid                edm2-img512-m-2147483-0.100.pkl          -                                        1
edm2-img512-m-dino               edm2-img512-m-2147483-0.155.pkl          -                                        1
edm2-img512-l-fid                edm2-img512-l-1879048-0.085.pkl          -                                        1
edm2-img512-l-dino               edm2-img512-l-1879048-0.155.pkl          -                                        1
edm2-img512-xl-fid               edm2-img512-xl-1342177-0.085.pkl         -                                        1
edm2-img512-xl-dino              edm2-img512-xl-1342177-0.155.pkl         -                                        1
edm2-img512-xxl-fid              edm2-img512-xxl-0939524-0.070.pkl        -                                        1
edm2-img512-xxl-dino             edm2-img512-xxl-0939524-0.150.pkl        -                                        1
edm2-img64-s-fid                 edm2-img64-s-1073741-0.075.pkl           -                                        1
edm2-img64-m-fid                 edm2-img64-m-2147483-0.060.pkl           -                                        1
edm2-img64-l-fid                 edm2-img64-l-1073741-0.040.pkl           -                                        1
edm2-img64-xl-fid                edm2-img64-xl-0671088-0.040.pkl          -                                        1
edm2-img512-xs-guid-fid          edm2-img512-xs-2147483-0.045.pkl         edm2-img512-xs-uncond-2147483-0.045.pkl  1.4
edm2-img512-xs-guid-dino         edm2-img512-xs-2147483-0.150.pkl         edm2-img512-xs-uncond-2147483-0.150.pkl  1.7
edm2-img512-s-guid-fid           edm2-img512-s-2147483-0.025.pkl          edm2-img512-xs-uncond-2147483-0.025.pkl  1.4
edm2-img512-s-guid-dino          edm2-img512-s-2147483-0.085.pkl          edm2-img512-xs-uncond-2147483-0.085.pkl  1.9
edm2-img512-m-guid-fid           edm2-img512-m-2147483-0.030.pkl          edm2-img512-xs-uncond-2147483-0.030.pkl  1.2
edm2-img512-m-guid-dino          edm2-img512-m-2147483-0.015.pkl          edm2-img512-xs-uncond-2147483-0.015.pkl  2.0
edm2-img512-l-guid-fid           edm2-img512-l-1879048-0.015.pkl          edm2-img512-xs-uncond-2147483-0.015.pkl  1.2
edm2-img512-l-guid-dino          edm2-img512-l-1879048-0.035.pkl          edm2-img512-xs-uncond-2147483-0.035.pkl  1.7
edm2-img512-xl-guid-fid          edm2-img512-xl-1342177-0.020.pkl         edm2-img512-xs-uncond-2147483-0.020.pkl  1.2
edm2-img512-xl-guid-dino         edm2-img512-xl-1342177-0.030.pkl         edm2-img512-xs-uncond-2147483-0.030.pkl  1.7
edm2-img512-xxl-guid-fid         edm2-img512-xxl-0939524-0.015.pkl        edm2-img512-xs-uncond-2147483-0.015.pkl  1.2
edm2-img512-xxl-guid-dino        edm2-img512-xxl-0939524-0.015.pkl        edm2-img512-xs-uncond-2147483-0.015.pkl  1.7
edm2-img512-s-autog-fid          edm2-img512-s-2147483-0.070.pkl          edm2-img512-xs-0134217-0.125.pkl         2.1
edm2-img512-s-autog-dino         edm2-img512-s-2147483-0.120.pkl          edm2-img512-xs-0134217-0.165.pkl         2.45
edm2-img512-xxl-autog-fid        edm2-img512-xxl-0939524-0.075.pkl        edm2-img512-m-0268435-0.155.pkl          2.05
edm2-img512-xxl-autog-dino       edm2-img512-xxl-0939524-0.130.pkl        edm2-img512-m-0268435-0.205.pkl          2.3
edm2-img512-s-uncond-autog-fid   edm2-img512-s-uncond-2147483-0.070.pkl   edm2-img512-xs-uncond-0134217-0.110.pkl  2.85
edm2-img512-s-uncond-autog-dino  edm2-img512-s-uncond-2147483-0.090.pkl   edm2-img512-xs-uncond-0134217-0.125.pkl  2.9
edm2-img64-s-autog-fid           edm2-img64-s-1073741-0.045.pkl           edm2-img64-xs-0134217-0.110.pkl          1.7
edm2-img64-s-autog-dino          edm2-img64-s-1073741-0.105.pkl           edm2-img64-xs-0134217-0.175.pkl          2.2
"""
ROWS = {name: (net, None if gnet == "-" else gnet, float(w)) for name, net, gnet, w in map(str.split, EXPECTED.strip().splitlines())}

# Paper Table 6: training duration (Mimg) and EMA lengths sigma_rel: without guidance for FID and for
# FD_DINOv2, and with guidance (and its strength) for FID and for FD_DINOv2.
TABLE6_IMG512 = {
    #      Mimg    fid    dino   guid-fid     guid-dino
    "xs": (2147.5, 0.135, 0.200, 0.045, 1.4, 0.150, 1.7),
    "s": (2147.5, 0.130, 0.190, 0.025, 1.4, 0.085, 1.9),
    "m": (2147.5, 0.100, 0.155, 0.030, 1.2, 0.015, 2.0),
    "l": (1879.0, 0.085, 0.155, 0.015, 1.2, 0.035, 1.7),
    "xl": (1342.2, 0.085, 0.155, 0.020, 1.2, 0.030, 1.7),
    "xxl": (939.5, 0.070, 0.150, 0.015, 1.2, 0.015, 1.7),
}
TABLE6_IMG64 = {"s": (1073.7, 0.075), "m": (2147.5, 0.060), "l": (1073.7, 0.040), "xl": (671.1, 0.040)}


def test_every_published_preset_is_there_with_its_networks_and_guidance():
    assert len(ROWS) == 36
    assert set(presets_generate.PRESETS) == set(ROWS)
    for name, (net, gnet, guidance) in ROWS.items():
        preset = presets_generate.PRESETS[name]
        assert preset.net == RELEASE + net, name
        assert preset.gnet == (None if gnet is None else RELEASE + gnet), name
        assert preset.guidance == guidance, name


def test_the_two_unconditional_autoguidance_presets():
    fid = presets_generate.PRESETS["edm2-img512-s-uncond-autog-fid"]
    dino = presets_generate.PRESETS["edm2-img512-s-uncond-autog-dino"]
    assert (fid.net, fid.gnet, fid.guidance) == (
        RELEASE + "edm2-img512-s-uncond-2147483-0.070.pkl", RELEASE + "edm2-img512-xs-uncond-0134217-0.110.pkl", 2.85)
    assert (dino.net, dino.gnet, dino.guidance) == (
        RELEASE + "edm2-img512-s-uncond-2147483-0.090.pkl", RELEASE + "edm2-img512-xs-uncond-0134217-0.125.pkl", 2.90)


def parse(url):
    """'.../edm2-img512-xs-uncond-2147483-0.045.pkl' -> ('img512', 'xs-uncond', kimg, sigma_rel)."""
    assert url.startswith(RELEASE) and url.endswith(".pkl")
    _, dataset, rest = url[len(RELEASE):-len(".pkl")].split("-", 2)
    size, kimg, std = rest.rsplit("-", 2)
    return dataset, size, int(kimg), float(std)


@pytest.mark.parametrize("size", TABLE6_IMG512)
def test_edm2_presets_agree_with_paper_table_6(size):
    mimg, fid, dino, guid_fid, w_fid, guid_dino, w_dino = TABLE6_IMG512[size]
    presets = presets_generate.PRESETS
    for name, std, w in [("fid", fid, 1.0), ("dino", dino, 1.0), ("guid-fid", guid_fid, w_fid), ("guid-dino", guid_dino, w_dino)]:
        preset = presets[f"edm2-img512-{size}-{name}"]
        dataset, net_size, kimg, net_std = parse(preset.net)
        assert (dataset, net_size, net_std, preset.guidance) == ("img512", size, std, w)
        assert abs(kimg / 1000 - mimg) < 0.05 * 1.01  # Table 6 rounds the duration to 0.1 Mimg
        if w != 1.0:  # guided by the unconditional XS model trained in full, at the same EMA length
            assert parse(preset.gnet) == ("img512", "xs-uncond", 2147483, std)


@pytest.mark.parametrize("size", TABLE6_IMG64)
def test_img64_presets_agree_with_paper_table_6(size):
    mimg, std = TABLE6_IMG64[size]
    dataset, net_size, kimg, net_std = parse(presets_generate.PRESETS[f"edm2-img64-{size}-fid"].net)
    assert (dataset, net_size, net_std) == ("img64", size, std) and abs(kimg / 1000 - mimg) < 0.05 * 1.01


def test_autoguidance_presets_guide_with_a_smaller_shorter_trained_model():
    sizes = ["xs", "s", "m", "l", "xl", "xxl"]
    for name, preset in presets_generate.PRESETS.items():
        if "autog" in name:
            net, gnet = parse(preset.net), parse(preset.gnet)
            assert net[0] == gnet[0] and preset.guidance > 1
            assert sizes.index(gnet[1].removesuffix("-uncond")) < sizes.index(net[1].removesuffix("-uncond"))
            assert gnet[1].endswith("-uncond") == net[1].endswith("-uncond") == ("uncond" in name)
            assert gnet[2] < net[2]
