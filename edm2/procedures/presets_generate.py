"""The release's generation presets: published network, guiding network and guidance strength.

One row per preset, as the release publishes them (config_presets in its generate_images.py). File names
read edm2-{dataset}-{size}-{training length in kimg}-{EMA length sigma_rel}.pkl. The comment on each row
is the number the paper reports for that preset: EDM2 paper Table 6 (also Tables 2, 3 and 5) and
Table 1 of the autoguidance paper (Karras et al. 2024, "Guiding a Diffusion Model with a Bad Version of
Itself"); lower is better.
"""

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


def _preset(net: str, gnet: str | None = None, guidance: float = 1.0) -> GeneratePreset:
    """A preset from the release's file names."""
    return GeneratePreset(BASE_URL + net, None if gnet is None else BASE_URL + gnet, guidance)


PRESETS: dict[str, GeneratePreset] = {
    # EDM2 paper, ImageNet-512 without guidance; EMA length chosen for FID (Table 2) or FD_DINOv2 (Table 5).
    "edm2-img512-xs-fid":               _preset(net="edm2-img512-xs-2147483-0.135.pkl"),  # FID 3.53
    "edm2-img512-xs-dino":              _preset(net="edm2-img512-xs-2147483-0.200.pkl"),  # FD_DINOv2 103.39
    "edm2-img512-s-fid":                _preset(net="edm2-img512-s-2147483-0.130.pkl"),  # FID 2.56
    "edm2-img512-s-dino":               _preset(net="edm2-img512-s-2147483-0.190.pkl"),  # FD_DINOv2 68.64
    "edm2-img512-m-fid":                _preset(net="edm2-img512-m-2147483-0.100.pkl"),  # FID 2.25
    "edm2-img512-m-dino":               _preset(net="edm2-img512-m-2147483-0.155.pkl"),  # FD_DINOv2 58.44
    "edm2-img512-l-fid":                _preset(net="edm2-img512-l-1879048-0.085.pkl"),  # FID 2.06
    "edm2-img512-l-dino":               _preset(net="edm2-img512-l-1879048-0.155.pkl"),  # FD_DINOv2 52.25
    "edm2-img512-xl-fid":               _preset(net="edm2-img512-xl-1342177-0.085.pkl"),  # FID 1.96
    "edm2-img512-xl-dino":              _preset(net="edm2-img512-xl-1342177-0.155.pkl"),  # FD_DINOv2 45.96
    "edm2-img512-xxl-fid":              _preset(net="edm2-img512-xxl-0939524-0.070.pkl"),  # FID 1.91
    "edm2-img512-xxl-dino":             _preset(net="edm2-img512-xxl-0939524-0.150.pkl"),  # FD_DINOv2 42.84
    # EDM2 paper, ImageNet-64 without guidance (Table 3).
    "edm2-img64-s-fid":                 _preset(net="edm2-img64-s-1073741-0.075.pkl"),  # FID 1.58
    "edm2-img64-m-fid":                 _preset(net="edm2-img64-m-2147483-0.060.pkl"),  # FID 1.43
    "edm2-img64-l-fid":                 _preset(net="edm2-img64-l-1073741-0.040.pkl"),  # FID 1.33
    "edm2-img64-xl-fid":                _preset(net="edm2-img64-xl-0671088-0.040.pkl"),  # FID 1.33
    # EDM2 paper, ImageNet-512 guided by the unconditional XS model at the same EMA length (Tables 2, 5).
    "edm2-img512-xs-guid-fid":          _preset(net="edm2-img512-xs-2147483-0.045.pkl", gnet="edm2-img512-xs-uncond-2147483-0.045.pkl", guidance=1.40),  # FID 2.91
    "edm2-img512-xs-guid-dino":         _preset(net="edm2-img512-xs-2147483-0.150.pkl", gnet="edm2-img512-xs-uncond-2147483-0.150.pkl", guidance=1.70),  # FD_DINOv2 79.94
    "edm2-img512-s-guid-fid":           _preset(net="edm2-img512-s-2147483-0.025.pkl", gnet="edm2-img512-xs-uncond-2147483-0.025.pkl", guidance=1.40),  # FID 2.23
    "edm2-img512-s-guid-dino":          _preset(net="edm2-img512-s-2147483-0.085.pkl", gnet="edm2-img512-xs-uncond-2147483-0.085.pkl", guidance=1.90),  # FD_DINOv2 52.32
    "edm2-img512-m-guid-fid":           _preset(net="edm2-img512-m-2147483-0.030.pkl", gnet="edm2-img512-xs-uncond-2147483-0.030.pkl", guidance=1.20),  # FID 2.01
    "edm2-img512-m-guid-dino":          _preset(net="edm2-img512-m-2147483-0.015.pkl", gnet="edm2-img512-xs-uncond-2147483-0.015.pkl", guidance=2.00),  # FD_DINOv2 41.98
    "edm2-img512-l-guid-fid":           _preset(net="edm2-img512-l-1879048-0.015.pkl", gnet="edm2-img512-xs-uncond-2147483-0.015.pkl", guidance=1.20),  # FID 1.88
    "edm2-img512-l-guid-dino":          _preset(net="edm2-img512-l-1879048-0.035.pkl", gnet="edm2-img512-xs-uncond-2147483-0.035.pkl", guidance=1.70),  # FD_DINOv2 38.20
    "edm2-img512-xl-guid-fid":          _preset(net="edm2-img512-xl-1342177-0.020.pkl", gnet="edm2-img512-xs-uncond-2147483-0.020.pkl", guidance=1.20),  # FID 1.85
    "edm2-img512-xl-guid-dino":         _preset(net="edm2-img512-xl-1342177-0.030.pkl", gnet="edm2-img512-xs-uncond-2147483-0.030.pkl", guidance=1.70),  # FD_DINOv2 35.67
    "edm2-img512-xxl-guid-fid":         _preset(net="edm2-img512-xxl-0939524-0.015.pkl", gnet="edm2-img512-xs-uncond-2147483-0.015.pkl", guidance=1.20),  # FID 1.81
    "edm2-img512-xxl-guid-dino":        _preset(net="edm2-img512-xxl-0939524-0.015.pkl", gnet="edm2-img512-xs-uncond-2147483-0.015.pkl", guidance=1.70),  # FD_DINOv2 33.09
    # Autoguidance paper Table 1: guided by a smaller, shorter-trained version of the same model.
    "edm2-img512-s-autog-fid":          _preset(net="edm2-img512-s-2147483-0.070.pkl", gnet="edm2-img512-xs-0134217-0.125.pkl", guidance=2.10),  # FID 1.34
    "edm2-img512-s-autog-dino":         _preset(net="edm2-img512-s-2147483-0.120.pkl", gnet="edm2-img512-xs-0134217-0.165.pkl", guidance=2.45),  # FD_DINOv2 36.67
    "edm2-img512-xxl-autog-fid":        _preset(net="edm2-img512-xxl-0939524-0.075.pkl", gnet="edm2-img512-m-0268435-0.155.pkl", guidance=2.05),  # FID 1.25
    "edm2-img512-xxl-autog-dino":       _preset(net="edm2-img512-xxl-0939524-0.130.pkl", gnet="edm2-img512-m-0268435-0.205.pkl", guidance=2.30),  # FD_DINOv2 24.18
    "edm2-img512-s-uncond-autog-fid":   _preset(net="edm2-img512-s-uncond-2147483-0.070.pkl", gnet="edm2-img512-xs-uncond-0134217-0.110.pkl", guidance=2.85),  # FID 3.86 (unconditional)
    "edm2-img512-s-uncond-autog-dino":  _preset(net="edm2-img512-s-uncond-2147483-0.090.pkl", gnet="edm2-img512-xs-uncond-0134217-0.125.pkl", guidance=2.90),  # FD_DINOv2 90.39 (unconditional)
    "edm2-img64-s-autog-fid":           _preset(net="edm2-img64-s-1073741-0.045.pkl", gnet="edm2-img64-xs-0134217-0.110.pkl", guidance=1.70),  # FID 1.01
    "edm2-img64-s-autog-dino":          _preset(net="edm2-img64-s-1073741-0.105.pkl", gnet="edm2-img64-xs-0134217-0.175.pkl", guidance=2.20),  # FD_DINOv2 31.85
}
