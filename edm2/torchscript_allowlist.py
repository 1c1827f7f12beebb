"""The names a TorchScript detector's code may use: tensor arithmetic and the builtins PyTorch's serializer prints.

Every list is an allowlist (what is not here is refused; see edm2/safe_torchscript.py). The entries are what
TorchScript prints for the published Inception file's program (StyleGAN2-ADA's inception-2015-12-05.pt: an
affine_grid/grid_sample resize to 299x299, convolutions with batch norm and ReLU, max/average pooling,
concatenation, a reshape, and a linear + softmax head) under the PyTorch versions that write or read it, plus the
closely related arithmetic a re-export may print instead (conv2d for _convolution, interpolate's upsample ops,
addmm/matmul for linear). Nothing here reads or writes files, storages, processes or the network.
"""

from __future__ import annotations

# Operators callable as torch.NAME(...), ops.aten.NAME(...) or as a tensor method x.NAME(...).
ATEN_OPS = frozenset({
    # Elementwise and scalar arithmetic.
    "add", "add_", "sub", "sub_", "rsub", "mul", "mul_", "div", "div_", "neg", "abs", "pow", "sqrt", "rsqrt",
    "exp", "log", "floor", "ceil", "round", "trunc", "clamp", "clamp_", "clamp_min", "clamp_max", "remainder",
    "fmod", "floordiv", "floor_divide", "reciprocal", "sign", "tanh", "sigmoid", "erf", "maximum", "minimum",
    "where", "lerp", "addcmul", "copy_", "fill_", "zero_",
    # Comparisons and the logic TorchScript uses for control flow and argument checks.
    "eq", "ne", "lt", "le", "gt", "ge", "__not__", "__and__", "__or__", "__is__", "__isnot__", "__contains__",
    "logical_and", "logical_or", "logical_not", "is_floating_point",
    # Reductions and normalizations.
    "sum", "mean", "var", "std", "amax", "amin", "max", "min", "softmax", "log_softmax", "batch_norm",
    "layer_norm", "group_norm", "instance_norm",
    # Shapes, views and dtype/device conversion.
    "size", "dim", "numel", "stride", "reshape", "view", "flatten", "squeeze", "unsqueeze", "permute", "transpose", "t",
    "expand", "expand_as", "repeat", "select", "slice", "narrow", "index_select", "chunk", "split", "unbind",
    "stack", "cat", "contiguous", "clone", "detach", "to", "type_as", "view_as", "float", "half",
    # Tensors from numbers (never from files or memory).
    "tensor", "scalar_tensor", "eye", "zeros", "ones", "full", "arange", "zeros_like", "ones_like", "full_like",
    "device",
    # Layers: convolution, pooling, resampling, linear maps, activations.
    "conv2d", "_convolution", "convolution", "max_pool2d", "avg_pool2d", "adaptive_avg_pool1d",
    "adaptive_avg_pool2d", "adaptive_avg_pool3d", "adaptive_max_pool2d", "affine_grid_generator", "grid_sampler",
    "grid_sampler_2d", "__interpolate", "upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d",
    "_upsample_nearest_exact1d", "_upsample_nearest_exact2d", "_upsample_nearest_exact3d", "upsample_linear1d",
    "upsample_bilinear2d", "upsample_trilinear3d", "upsample_bicubic2d", "_upsample_bilinear2d_aa",
    "_upsample_bicubic2d_aa", "_upsample_lanczos2d_aa", "constant_pad_nd", "pad", "linear", "addmm", "matmul",
    "mm", "bmm", "relu", "relu_", "gelu", "dropout", "scaled_dot_product_attention",
    # Builtins on lists, numbers and strings that TorchScript prints in the torch namespace.
    "len", "list", "append", "__getitem__", "_set_item", "__range_length", "__derive_index", "format", "warn",
    "item", "str", "Int", "Float", "Bool", "ScalarImplicit",
})

# Primitive operators callable as ops.prim.NAME(...): type and device queries, min/max of numbers, and raising
# an error with a message (how TorchScript prints `raise` and failed argument checks).
PRIM_OPS = frozenset({
    "device", "dtype", "layout", "min", "max", "abs", "NumToTensor", "RaiseException", "unchecked_unwrap_optional",
    "is_cuda", "shape", "requires_grad",
})

# Plain names a call may start with; annotate, unchecked_cast, uninitialized and isinstance take a type.
BUILTIN_CALLS = frozenset({
    "range", "len", "int", "float", "bool", "min", "max", "abs", "annotate", "unchecked_cast", "uninitialized",
    "isinstance", "getattr",
})
TYPE_ARGUMENT_CALLS = frozenset({"annotate", "unchecked_cast", "uninitialized", "isinstance"})

# Tensor attributes read without a call.
TENSOR_PROPERTIES = frozenset({"shape", "dtype", "device", "is_cuda", "requires_grad", "ndim", "T", "data"})

# Type names in annotations; GENERIC_TYPES take type arguments in brackets.
TYPE_NAMES = frozenset({"Tensor", "int", "float", "bool", "str", "NoneType", "Device", "number", "Any"})
GENERIC_TYPES = frozenset({"Optional", "List", "Tuple", "Dict", "Final", "Union"})

# Class-body assignments TorchScript prints for modules (each a list of names).
CLASS_LISTS = frozenset({"__parameters__", "__buffers__", "__constants__"})

# Globals the archive's pickles (data.pkl, constants.pkl, debug info) may name besides the archive's own
# classes: tensor and storage reconstruction and TorchScript's typed lists.
_STORAGES = ("Float", "Double", "Half", "BFloat16", "Long", "Int", "Short", "Char", "Byte", "Bool")
PICKLE_GLOBALS = frozenset({
    ("torch._utils", "_rebuild_tensor_v2"), ("torch._utils", "_rebuild_tensor"), ("collections", "OrderedDict"),
    ("torch", "device"),
    *(("torch", f"{kind}Storage") for kind in _STORAGES),
    *(("torch.jit._pickle", name) for name in ("build_intlist", "build_doublelist", "build_boollist",
                                               "build_tensorlist", "build_tensor_from_id", "restore_type_tag")),
})
