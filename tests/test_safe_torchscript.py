"""TorchScript detector files: tensor arithmetic loads and computes as before; anything else is refused unrun."""

import io
import os
import pickle
import zipfile

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from edm2 import detectors, safe_torchscript
from tests.helpers import FileWritingInception, TinyInceptionStandIn

EPS32 = torch.finfo(torch.float32).eps


class ConvBN(nn.Module):
    """Convolution without bias, batch norm, ReLU: the published Inception's basic layer."""

    def __init__(self, cin, cout, kernel, stride=1, padding=0):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, kernel, stride, padding, bias=False)
        self.bn = nn.BatchNorm2d(cout, eps=1e-3)

    def forward(self, x):
        return F.relu(self.bn(self.conv(x)))


class Mixed(nn.Module):
    """An Inception block: 1x1, factorized 1x3 + 3x1, and average-pool branches, concatenated."""

    def __init__(self, cin):
        super().__init__()
        self.conv = ConvBN(cin, 4, 1)
        self.tower = nn.Sequential(ConvBN(cin, 4, (1, 3), padding=(0, 1)), ConvBN(4, 4, (3, 1), padding=(1, 0)))
        self.tower_pool = nn.AvgPool2d(3, 1, 1, count_include_pad=False)

    def forward(self, x):
        return torch.cat([self.conv(x), self.tower(x).contiguous(), self.tower_pool(x)], 1)


class InceptionShaped(nn.Module):
    """The published Inception file's program in miniature (resize by affine_grid/grid_sample, conv/BN/ReLU
    stacks, pooling, Inception blocks, a reshape to features, and a linear + softmax head); one block is traced,
    as the published file's layers are, so its code uses _convolution and tensor constants."""

    def __init__(self, size=29):
        super().__init__()
        self.size = size
        mixed = Mixed(8).eval()
        self.layers = nn.Sequential(ConvBN(3, 8, 3, 2), ConvBN(8, 8, 3, padding=1), nn.MaxPool2d(3, 2),
                                    torch.jit.trace(mixed, torch.randn(1, 8, 6, 6)), Mixed(16),
                                    nn.AdaptiveAvgPool2d(1))
        self.output = nn.Linear(24, 10)

    def forward(self, img: torch.Tensor, return_features: bool = False, use_fp16: bool = False,
                no_output_bias: bool = False) -> torch.Tensor:
        batch_size, channels, height, width = img.shape
        x = img.to(torch.float16 if use_fp16 else torch.float32)
        theta = torch.eye(2, 3, device=x.device)
        theta[0, 2] += theta[0, 0] / width - theta[0, 0] / self.size
        theta[1, 2] += theta[1, 1] / height - theta[1, 1] / self.size
        theta = theta.to(x.dtype).unsqueeze(0).repeat([batch_size, 1, 1])
        grid = F.affine_grid(theta, [batch_size, channels, self.size, self.size], align_corners=False)
        x = F.grid_sample(x, grid, mode="bilinear", padding_mode="border", align_corners=False)
        x = F.interpolate((x - 128) / 128, size=(self.size + 2, self.size + 2), mode="bilinear", align_corners=False)
        features = torch.reshape(self.layers(x), [-1, 24]).to(torch.float32)
        if return_features:
            return features
        logits = F.linear(features, self.output.weight) if no_output_bias else self.output(features)
        return F.softmax(logits, dim=1) @ torch.eye(10)


def inception_shaped(seed=0):
    torch.manual_seed(seed)
    net = InceptionShaped().eval()
    with torch.no_grad():
        for name, buffer in net.named_buffers():
            if name.endswith("running_var"):
                buffer.uniform_(0.5, 2)
            elif name.endswith("running_mean"):
                buffer.normal_(0, 0.1)
    return net


def scripted_bytes(module) -> bytes:
    buffer = io.BytesIO()
    torch.jit.save(torch.jit.script(module), buffer)
    return buffer.getvalue()


def test_tensor_arithmetic_loads_and_gives_the_features_of_the_unchecked_program(tmp_path):
    net = inception_shaped()
    path = tmp_path / "inception.pt"
    path.write_bytes(scripted_bytes(net))
    detector = detectors.InceptionV3(path)
    assert detector.feature_dim == 24
    unchecked = torch.jit.load(path)  # how the file was loaded before the check
    images = torch.randint(0, 256, (5, 3, 24, 20), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    features = detector(images)
    expected = unchecked(images, return_features=True)
    # Same program on the same input; only the JIT's choice of kernels between its first and later runs may
    # reorder float32 sums: <= 2 computations x 8 layers x sqrt(72 terms, the largest reduction) x eps32,
    # relative to the feature scale.
    bound = 2 * 8 * 72 ** 0.5 * EPS32 * expected.abs().max().item()
    torch.testing.assert_close(features, expected, rtol=0, atol=bound)
    torch.testing.assert_close(features, net(images, return_features=True), rtol=0, atol=bound)
    probabilities = detector.model(images)  # the classifier head (linear, softmax, matmul) runs as well
    # Each row: 10 softmax outputs summed in float32, then summed again: within 10 eps32 of 1.
    torch.testing.assert_close(probabilities.sum(1), torch.ones(5), rtol=0, atol=10 * EPS32)


def test_the_test_stand_ins_pass_the_check():
    safe_torchscript.check_torchscript(scripted_bytes(TinyInceptionStandIn()))


class SetstateWritesFile(nn.Module):
    """A module whose __setstate__, run by torch.jit.load itself, writes a file."""

    def __init__(self, marker: str):
        super().__init__()
        self.marker = marker
        self.written = torch.zeros(4, dtype=torch.uint8)

    @torch.jit.export
    def __getstate__(self):
        return (self.marker, self.training)

    @torch.jit.export
    def __setstate__(self, state: tuple[str, bool]):
        self.marker = state[0]
        self.training = state[1]
        self.written = torch.from_file(self.marker, shared=True, size=4, dtype=torch.uint8).fill_(1)

    def forward(self, x: torch.Tensor, return_features: bool = False) -> torch.Tensor:
        return x.float().mean([2, 3])


@pytest.mark.parametrize("program", [FileWritingInception, SetstateWritesFile])
def test_a_program_that_writes_files_is_refused_before_any_of_it_runs(tmp_path, program):
    marker = tmp_path / "written"
    path = tmp_path / "inception.pt"
    path.write_bytes(scripted_bytes(program(str(marker))))
    # Control: loaded and probed without the check, the program really writes the file.
    torch.jit.load(path)(torch.zeros(1, 3, 16, 16, dtype=torch.uint8), return_features=True)
    assert marker.exists()
    marker.unlink()
    with pytest.raises(detectors.DetectorError, match=r"refusing to load .*inception\.pt: .*torch\.from_file"):
        detectors.InceptionV3(path)  # loading includes the feature-width probe
    assert not marker.exists()


def rewritten(archive: bytes, edit) -> bytes:
    """The archive with edit(name, data) -> {name: data} applied to every entry, as a hand-made file could be."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(archive)) as source, zipfile.ZipFile(out, "w") as target:
        for info in source.infolist():
            for name, data in edit(info.filename, source.read(info)).items():
                target.writestr(name, data)
    return out.getvalue()


class Plain(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x)


def with_code(expression: str) -> bytes:
    """A scripted module whose forward computes `expression` from x instead of torch.relu(x)."""
    def edit(name, data):
        if name.endswith(".py"):
            data = data.replace(b"torch.relu(x)", expression.encode())
        return {name: data}
    return rewritten(scripted_bytes(Plain()), edit)


# What hand-written code in an archive may try; each names what the refusal must mention.
HIDDEN_CODE = {
    "file op": ("torch.from_file(\"/etc/passwd\", False, 16)", "torch.from_file"),
    "save": ("torch.save(x, \"out.pt\")", "torch.save"),
    "load": ("torch.load(\"in.pt\")", "torch.load"),
    "storage method": ("(x).storage()", ".storage"),
    "untyped storage": ("torch.untyped_storage(x)", "torch.untyped_storage"),
    "aten namespace": ("ops.aten.from_file(\"f\", True, 4)", "ops.aten.from_file"),
    "custom namespace": ("ops.myns.run(x)", "ops.myns.run"),
    "torch.ops": ("torch.ops.aten.relu(x)", "torch.ops.aten.relu"),
    "literal getattr": ("getattr(x, \"storage\")()", ".storage"),
    "computed getattr": ("getattr(x, \"sto\" + \"rage\")()", "getattr with a computed name"),
    "alias": ("torch", "the name 'torch'"),
    "builtin": ("print(x)", "'print'"),
    "fork": ("fork(torch.relu, x)", "'fork'"),
    "undefined class": ("__torch__.torch.classes.myns.Thing(x)", "__torch__.torch.classes.myns.Thing"),
    "exception class": ("ops.prim.RaiseException(\"touch x\", \"os.system\")", "exception class outside"),
    "lambda": ("(lambda y: y)(x)", "lambda"),
    "comprehension": ("[y for y in x]", "expression"),
    "triple quotes": ("torch.relu(x)\n    _z = \"\"\"torch.save\"\"\"", "string literal"),
    "non-ASCII": ("torch.relu(\u0445)", "ASCII"),
    "tab": ("torch.relu(x)\n\t", "control characters"),
    "deep nesting": ("x" + " + x" * 20000, "nests deeper"),
}


@pytest.mark.parametrize("expression, mentioned", HIDDEN_CODE.values(), ids=HIDDEN_CODE.keys())
def test_code_beyond_tensor_arithmetic_is_refused(expression, mentioned):
    with pytest.raises(safe_torchscript.UnsafeTorchScript) as info:
        safe_torchscript.check_torchscript(with_code(expression))
    assert mentioned in str(info.value) and "\n" not in str(info.value)


def test_a_method_named_like_a_tensor_method_does_not_open_it():
    # A class may declare a member 'storage'; x.storage() on a tensor must still be refused.
    def edit(name, data):
        if name.endswith(".py"):
            data = data.replace(b"torch.relu(x)", b"(x).storage()") + b"  storage : Tensor\n"
        return {name: data}
    with pytest.raises(safe_torchscript.UnsafeTorchScript, match=r"\.storage"):
        safe_torchscript.check_torchscript(rewritten(scripted_bytes(Plain()), edit))


class Payload:
    def __reduce__(self):
        return os.system, ("true",)


ARCHIVE_TAMPERING = {
    "unknown entry": (lambda n, d: {n: d, n.replace("data.pkl", "extra/run.py"): b"x = 1"} if n.endswith("/data.pkl")
                      else {n: d}, "entry TorchScript does not"),
    "code outside code/": (lambda n, d: {n.replace("code/__torch__", "other/__torch__"): d}, "entry TorchScript does not"),
    "no code": (lambda n, d: {} if "/code/" in n else {n: d}, "holds no TorchScript code"),
    "pickle names os.system": (lambda n, d: {n: pickle.dumps(Payload()) if n.endswith("constants.pkl") else d},
                               "posix.system"),
    "pickle names an undefined class": (lambda n, d: {n: d.replace(b"\nPlain\n", b"\nOther\n")
                                                      if n.endswith("data.pkl") else d}, "test_safe_torchscript.Other"),
}


@pytest.mark.parametrize("edit, mentioned", ARCHIVE_TAMPERING.values(), ids=ARCHIVE_TAMPERING.keys())
def test_tampered_archives_are_refused(edit, mentioned):
    with pytest.raises(safe_torchscript.UnsafeTorchScript, match=mentioned.replace(".", r"\.")):
        safe_torchscript.check_torchscript(rewritten(scripted_bytes(Plain()), edit))


def test_repeated_entries_and_non_zip_files_are_refused():
    archive = scripted_bytes(Plain())
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(archive)) as source, zipfile.ZipFile(out, "w") as target:
        for info in source.infolist():
            target.writestr(info.filename, source.read(info))
        with pytest.warns(UserWarning, match="Duplicate name"):
            target.writestr(source.infolist()[0].filename, b"second copy")
    with pytest.raises(safe_torchscript.UnsafeTorchScript, match="twice"):
        safe_torchscript.check_torchscript(out.getvalue())
    with pytest.raises(safe_torchscript.UnsafeTorchScript, match="ZIP"):
        safe_torchscript.check_torchscript(b"not an archive")
