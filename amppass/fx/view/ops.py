"""Canonical op names for FX nodes, whatever the capture path produced.

torch.export gives ATen overloads; torch.fx.symbolic_trace gives torch functions, tensor methods, Python
operators and leaf modules. All of them are named here by the ATen overload packet they stand for, so one
policy table serves both.
"""

from __future__ import annotations

import operator

import torch
from torch import fx, nn

_OPERATORS = {
    operator.add: "add", operator.iadd: "add", operator.sub: "sub", operator.isub: "sub",
    operator.mul: "mul", operator.imul: "mul", operator.truediv: "div", operator.itruediv: "div",
    operator.floordiv: "floor_divide", operator.matmul: "matmul", operator.pow: "pow", operator.neg: "neg",
    operator.getitem: "getitem", operator.eq: "eq", operator.ne: "ne", operator.lt: "lt", operator.le: "le",
    operator.gt: "gt", operator.ge: "ge", operator.mod: "remainder", operator.abs: "abs",
}

# torch / torch.nn.functional spellings whose ATen packet has another name
_ALIASES = {
    "cross_entropy": "cross_entropy_loss", "interpolate": "upsample_bilinear2d", "softmin": "softmax",
    "layer_norm": "layer_norm", "normalize": "normalize", "binary_cross_entropy_with_logits":
    "binary_cross_entropy_with_logits", "dropout1d": "dropout", "dropout2d": "feature_dropout",
    "dropout3d": "feature_dropout", "adaptive_avg_pool2d": "adaptive_avg_pool2d", "relu6": "hardtanh",
    "float": "_to_copy", "half": "_to_copy", "bfloat16": "_to_copy", "double": "_to_copy", "type": "_to_copy",
}

_MODULES: tuple[tuple[type, str], ...] = (
    (nn.Linear, "linear"), (nn.Bilinear, "bilinear"), (nn.Conv1d, "conv1d"), (nn.Conv2d, "conv2d"),
    (nn.Conv3d, "conv3d"), (nn.ConvTranspose1d, "conv_transpose1d"), (nn.ConvTranspose2d, "conv_transpose2d"),
    (nn.ConvTranspose3d, "conv_transpose3d"), (nn.LSTM, "lstm"), (nn.GRU, "gru"), (nn.RNN, "rnn_tanh"),
    (nn.LSTMCell, "lstm_cell"), (nn.GRUCell, "gru_cell"), (nn.RNNCell, "rnn_tanh_cell"),
    (nn.MultiheadAttention, "scaled_dot_product_attention"),
    (nn.LayerNorm, "layer_norm"), (nn.GroupNorm, "group_norm"), (nn.modules.batchnorm._BatchNorm, "batch_norm"),
    (nn.modules.instancenorm._InstanceNorm, "instance_norm"), (nn.RMSNorm, "rms_norm"),
    (nn.LocalResponseNorm, "local_response_norm"),
    (nn.Softmax, "softmax"), (nn.LogSoftmax, "log_softmax"), (nn.Softmin, "softmax"),
    (nn.Embedding, "embedding"), (nn.EmbeddingBag, "embedding_bag"),
    (nn.ReLU, "relu"), (nn.ReLU6, "hardtanh"), (nn.GELU, "gelu"), (nn.SiLU, "silu"), (nn.Mish, "mish"),
    (nn.Tanh, "tanh"), (nn.Sigmoid, "sigmoid"), (nn.LeakyReLU, "leaky_relu"), (nn.ELU, "elu"),
    (nn.SELU, "selu"), (nn.Hardswish, "hardswish"), (nn.Hardsigmoid, "hardsigmoid"), (nn.Softplus, "softplus"),
    (nn.PReLU, "prelu"), (nn.Dropout, "dropout"), (nn.Dropout1d, "dropout"), (nn.Dropout2d, "feature_dropout"),
    (nn.Dropout3d, "feature_dropout"), (nn.AlphaDropout, "alpha_dropout"), (nn.Identity, "alias"),
    (nn.Flatten, "flatten"), (nn.Unflatten, "unflatten"),
    (nn.MaxPool1d, "max_pool1d"), (nn.MaxPool2d, "max_pool2d"), (nn.MaxPool3d, "max_pool3d"),
    (nn.AvgPool1d, "avg_pool1d"), (nn.AvgPool2d, "avg_pool2d"), (nn.AvgPool3d, "avg_pool3d"),
    (nn.AdaptiveAvgPool1d, "adaptive_avg_pool1d"), (nn.AdaptiveAvgPool2d, "adaptive_avg_pool2d"),
    (nn.AdaptiveAvgPool3d, "adaptive_avg_pool3d"), (nn.AdaptiveMaxPool2d, "adaptive_max_pool2d"),
    (nn.Upsample, "upsample_bilinear2d"), (nn.PixelShuffle, "pixel_shuffle"),
    (nn.CrossEntropyLoss, "cross_entropy_loss"), (nn.NLLLoss, "nll_loss"), (nn.MSELoss, "mse_loss"),
    (nn.L1Loss, "l1_loss"), (nn.SmoothL1Loss, "smooth_l1_loss"), (nn.HuberLoss, "huber_loss"),
    (nn.BCELoss, "binary_cross_entropy"), (nn.BCEWithLogitsLoss, "binary_cross_entropy_with_logits"),
    (nn.KLDivLoss, "kl_div"), (nn.CosineSimilarity, "cosine_similarity"), (nn.PairwiseDistance, "pairwise_distance"),
)

CAST_OPS = frozenset({"_to_copy", "to", "convert_element_type", "type_as"})


def op_name(node: fx.Node, root: nn.Module | None = None) -> str:
    """The ATen packet name a node stands for ("linear", "add", ...), or a descriptive name if none."""
    target = node.target
    if node.op == "call_function":
        if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
            return _packet_name(target)
        if target in _OPERATORS:
            return _OPERATORS[target]
        name = getattr(target, "__name__", str(target))
        return _from_python_name(name)
    if node.op == "call_method":
        return _from_python_name(str(target))
    if node.op == "call_module" and root is not None:
        module = root.get_submodule(str(target))
        for cls, name in _MODULES:
            if isinstance(module, cls):
                return name
        return type(module).__name__
    return node.op


def display_name(node: fx.Node, root: nn.Module | None = None) -> str:
    """The op as a user reads it in the report: "aten.linear", "aten.softmax", "module:MyBlock"."""
    name = op_name(node, root)
    if node.op == "call_module" and root is not None and not _is_known_module(root.get_submodule(str(node.target))):
        return f"module:{name}"
    return f"aten.{name}" if hasattr(torch.ops.aten, name) else name


def _is_known_module(module: nn.Module) -> bool:
    return any(isinstance(module, cls) for cls, _ in _MODULES)


def _packet_name(target: torch._ops.OpOverload | torch._ops.OpOverloadPacket) -> str:
    packet = target.overloadpacket if isinstance(target, torch._ops.OpOverload) else target
    namespace = getattr(packet, "_qualified_op_name", "aten::").split("::")[0]
    name = packet.__name__
    return name if namespace == "aten" else f"{namespace}.{name}"


def _from_python_name(name: str) -> str:
    name = name.rstrip("_") if name.endswith("_") and not name.startswith("_") else name
    return _ALIASES.get(name, name)
