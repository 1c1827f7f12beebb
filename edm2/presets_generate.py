"""The release's generation presets: published network, guiding network and guidance strength."""

from __future__ import annotations

from dataclasses import dataclass

BASE_URL = "https://nvlabs-fi-cdn.nvidia.com/edm2/posthoc-reconstructions/"
DEFAULT_PRESET = "edm2-img512-s-guid-fid"


@dataclass(frozen=True)
class GeneratePreset:
    """URLs of the main and guiding networks and the guidance weight w of paper Eq. 152."""

    net: str
    gnet: str | None = None
    guidance: float = 1.0


def _url(dataset: str, size: str, kimg: str, std: float) -> str:
    return f"{BASE_URL}edm2-{dataset}-{size}-{kimg}-{std:.3f}.pkl"


def _build() -> dict[str, GeneratePreset]:
    presets = {}
    # Training length (kimg) of each published model; EMA stds as in paper Table 6 (the release's generate_images.py).
    img512_kimg = {"xs": "2147483", "s": "2147483", "m": "2147483", "l": "1879048", "xl": "1342177", "xxl": "0939524"}
    img512_fid = {"xs": 0.135, "s": 0.130, "m": 0.100, "l": 0.085, "xl": 0.085, "xxl": 0.070}
    img512_dino = {"xs": 0.200, "s": 0.190, "m": 0.155, "l": 0.155, "xl": 0.155, "xxl": 0.150}
    # Guided by the unconditional XS model with the same EMA std: (fid std, fid w, dino std, dino w).
    img512_guid = {
        "xs": (0.045, 1.40, 0.150, 1.70),
        "s": (0.025, 1.40, 0.085, 1.90),
        "m": (0.030, 1.20, 0.015, 2.00),
        "l": (0.015, 1.20, 0.035, 1.70),
        "xl": (0.020, 1.20, 0.030, 1.70),
        "xxl": (0.015, 1.20, 0.015, 1.70),
    }
    for size, kimg in img512_kimg.items():
        presets[f"edm2-img512-{size}-fid"] = GeneratePreset(_url("img512", size, kimg, img512_fid[size]))
        presets[f"edm2-img512-{size}-dino"] = GeneratePreset(_url("img512", size, kimg, img512_dino[size]))
        fid_std, fid_w, dino_std, dino_w = img512_guid[size]
        for metric, std, w in (("fid", fid_std, fid_w), ("dino", dino_std, dino_w)):
            net, gnet = _url("img512", size, kimg, std), _url("img512", "xs-uncond", "2147483", std)
            presets[f"edm2-img512-{size}-guid-{metric}"] = GeneratePreset(net, gnet, w)
    img64 = {"s": ("1073741", 0.075), "m": ("2147483", 0.060), "l": ("1073741", 0.040), "xl": ("0671088", 0.040)}
    for size, (kimg, std) in img64.items():
        presets[f"edm2-img64-{size}-fid"] = GeneratePreset(_url("img64", size, kimg, std))
    # Autoguidance: a smaller, shorter-trained version of the model guides it.
    autog = {
        "edm2-img512-s-autog-fid": (("img512", "s", "2147483", 0.070), ("img512", "xs", "0134217", 0.125), 2.10),
        "edm2-img512-s-autog-dino": (("img512", "s", "2147483", 0.120), ("img512", "xs", "0134217", 0.165), 2.45),
        "edm2-img512-xxl-autog-fid": (("img512", "xxl", "0939524", 0.075), ("img512", "m", "0268435", 0.155), 2.05),
        "edm2-img512-xxl-autog-dino": (("img512", "xxl", "0939524", 0.130), ("img512", "m", "0268435", 0.205), 2.30),
        "edm2-img64-s-autog-fid": (("img64", "s", "1073741", 0.045), ("img64", "xs", "0134217", 0.110), 1.70),
        "edm2-img64-s-autog-dino": (("img64", "s", "1073741", 0.105), ("img64", "xs", "0134217", 0.175), 2.20),
    }
    for name, (net, gnet, w) in autog.items():
        presets[name] = GeneratePreset(_url(*net), _url(*gnet), w)
    return presets


PRESETS: dict[str, GeneratePreset] = _build()
