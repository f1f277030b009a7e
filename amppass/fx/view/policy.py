"""The ATen op policy table: one row per kind of op, keyed by ATen overload packet, each with a reason.

A row of a kind both front ends have names ATen's ops for a kind of :data:`amppass.analysis.policy.KINDS`, which
holds its category, reason and facts; the kinds ATen alone has (softmax and reductions accumulated in fp32 through
``dtype=``, matrix-vector products, distances, batch normalisation's slots) are written here.

Facts from torch.autocast's cast lists, TF grappler's AMP lists, TVM's ToMixedPrecision and Apex: matrix
products and convolutions are work for the device's matrix units (Tensor Cores, AMX; the reasons name the
target's: :func:`amppass.analysis.policy.for_target`); exponentials, logarithms, powers, norms, losses and long
reductions lose range or bits in fp16 and run in fp32 (reductions and softmax accumulate in fp32 through
their ``dtype=`` argument, which avoids casting the whole input); everything else follows its inputs.
Batch normalisation with stored statistics is a per-channel affine map and follows its input; its
training form, which computes statistics of its batch, has a row of its own in :data:`TRAINING`, picked
per node by :func:`in_training`: it follows its input too, since the kernels accumulate the statistics in fp32.
"""

from __future__ import annotations

from types import MappingProxyType

from torch import fx, nn

from ...analysis.plan import Category
from ...analysis.policy import HEAVY, KINDS, MATRIX_WORK, NORMALISATION, REDUCTION, OpKind, PolicyRow
from ..arguments import argument, argument_names
from . import ops

_BATCH_NORMS = ("batch_norm", "native_batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_no_training",
                "_native_batch_norm_legit_functional")

# Each op is named once, by its ATen overload packet name. A row of a kind both front ends have takes its meaning
# from amppass.analysis.policy.KINDS; a kind of ATen's alone is written here.
POLICY: tuple[PolicyRow, ...] = (
    PolicyRow(
        KINDS["matrix multiply"],
        ("mm", "bmm", "matmul", "addmm", "baddbmm", "addbmm", "linear", "einsum", "bilinear", "_addmm_activation",
         "linalg_multi_dot", "chain_matmul", "linalg_matrix_power"),
    ),
    PolicyRow(
        OpKind("matrix-vector product", Category.LOW,
               "matrix-vector product or tensor contraction: the products of a matrix multiply, accumulated in fp32 "
               "inside the kernel, so its error is the rounding of its inputs and output (torch.autocast runs "
               "mv/addmv low on CUDA; its CPU list leaves them to follow their inputs, and whether low pays there is "
               "measured)"),
        ("mv", "addmv", "tensordot"),
    ),
    PolicyRow(
        OpKind("grouped matrix multiply", Category.LOW,
               "grouped matrix multiply (a mixture of experts' per-expert products, one matrix multiply per group of "
               f"rows): {MATRIX_WORK}, accumulated in fp32 inside each kernel; transformers' fallback needs its input "
               "and weights in one dtype, which the rewrite's casts give it"),
        ("_grouped_mm", "transformers.grouped_mm_fallback"),
    ),
    PolicyRow(
        OpKind("dot product", Category.LOW,
               "dot product along a dimension: low-precision products summed in fp32 (torch.autocast runs it low)"),
        ("linalg_vecdot",),
    ),
    PolicyRow(
        KINDS["convolution"],
        ("conv1d", "conv2d", "conv3d", "convolution", "_convolution", "conv_transpose1d", "conv_transpose2d",
         "conv_transpose3d", "conv_tbc"),
    ),
    PolicyRow(
        KINDS["attention"],
        ("scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
         "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
         "_scaled_dot_product_flash_attention_for_cpu", "_native_multi_head_attention"),
        # an additive mask of -3.4e38 would become -inf in fp16; saturate it to the low dtype's range
        slots={"attn_mask": "saturate", "mask": "saturate"},
    ),
    PolicyRow(
        KINDS["recurrent cell"],
        ("lstm", "gru", "rnn_tanh", "rnn_relu", "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell",
         "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell"),
    ),
    PolicyRow(
        OpKind("softmax", Category.FP32_ACCUM,
               "softmax: exp and its sum overflow fp16; computed in fp32 from the low-precision input"),
        ("softmax", "log_softmax", "_softmax", "_log_softmax"),
    ),
    PolicyRow(
        OpKind("reduction", Category.FP32_ACCUM,
               "reduction: a sum over many terms loses bits and can overflow in fp16; accumulated in fp32",
               frozenset({REDUCTION})),
        ("sum", "mean", "nansum", "nanmean", "prod", "cumsum", "cumprod", "logcumsumexp"),
    ),
    PolicyRow(
        KINDS["normalisation"],
        ("layer_norm", "native_layer_norm", "group_norm", "native_group_norm", "instance_norm", "rms_norm",
         "_fused_rms_norm", "var", "std", "var_mean", "std_mean", "normalize"),
    ),
    PolicyRow(
        OpKind("batch normalisation", Category.FOLLOW,
               "batch normalisation with stored statistics (inference): a per-channel scale and shift; runs in the "
               "precision of its input and reads its statistics and affine weights in fp32, which torch's kernels "
               "take beside a low-precision input"),
        _BATCH_NORMS,
        slots=MappingProxyType({"weight": "keep", "bias": "keep", "running_mean": "keep", "running_var": "keep"}),
    ),
    PolicyRow(
        KINDS["norm"],
        ("local_response_norm", "renorm", "norm", "linalg_vector_norm", "linalg_norm", "frobenius_norm",
         "nuclear_norm"),
    ),
    PolicyRow(
        KINDS["exponential"],
        ("exp", "exp2", "expm1", "logsumexp", "logaddexp", "logaddexp2", "matrix_exp"),
    ),
    PolicyRow(
        KINDS["logarithm"],
        ("log", "log2", "log10", "xlogy"),
    ),
    PolicyRow(
        OpKind("logarithm near one", Category.FP32,
               "logarithm near one: loses precision in fp16; computed in fp32"),
        ("log1p", "special_xlog1py", "special_entr"),
    ),
    PolicyRow(
        KINDS["power"],
        ("pow", "float_power"),
    ),
    PolicyRow(
        KINDS["reciprocal"],
        ("reciprocal", "rsqrt"),
    ),
    PolicyRow(
        KINDS["transcendental"],
        ("erfinv", "acos", "asin", "tan", "cosh", "sinh", "atanh", "acosh", "asinh", "polar", "lgamma",
         "digamma", "polygamma", "special_polygamma", "mvlgamma"),
    ),
    PolicyRow(
        OpKind("distance", Category.FP32, "distance: sums of squares overflow fp16"),
        ("cdist", "dist", "pdist", "_cdist_forward", "cosine_similarity", "pairwise_distance"),
    ),
    PolicyRow(
        KINDS["loss"],
        ("cross_entropy_loss", "nll_loss", "nll_loss2d", "nll_loss_nd", "binary_cross_entropy",
         "binary_cross_entropy_with_logits", "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "kl_div",
         "soft_margin_loss", "multi_margin_loss", "multilabel_margin_loss", "margin_ranking_loss",
         "hinge_embedding_loss", "cosine_embedding_loss", "poisson_nll_loss", "ctc_loss",
         "triplet_margin_loss", "multilabel_soft_margin_loss"),
    ),
    PolicyRow(
        KINDS["resampling"],
        ("upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d", "upsample_linear1d",
         "upsample_bilinear2d", "upsample_bicubic2d", "upsample_trilinear3d", "_upsample_bilinear2d_aa",
         "_upsample_bicubic2d_aa", "_upsample_nearest_exact1d", "_upsample_nearest_exact2d",
         "_upsample_nearest_exact3d", "grid_sampler", "grid_sampler_2d", "grid_sampler_3d",
         "affine_grid_generator"),
    ),
    PolicyRow(
        OpKind("3-D adaptive average pooling", Category.FP32,
               "3-D adaptive average pooling: torch's CPU kernel sums each window in the low dtype (20x the output's "
               "rounding error on 6x6x6 windows in bf16), and torch.autocast keeps it fp32; computed in fp32",
               frozenset({REDUCTION})),
        ("adaptive_avg_pool3d",),
    ),
    PolicyRow(
        KINDS["division"],
        ("div", "div_", "floor_divide", "remainder", "fmod"),
    ),
    PolicyRow(
        KINDS["average pooling"],
        ("avg_pool1d", "avg_pool2d", "avg_pool3d", "adaptive_avg_pool1d", "adaptive_avg_pool2d"),
    ),
    PolicyRow(
        OpKind("output or index", Category.FOLLOW,
               "picks one output of a multi-output op (split, lstm) or indexes a tensor: runs in the precision of "
               "its input"),
        ("getitem",),  # Python's operator.getitem, which every graph with a multi-output op has
    ),
    PolicyRow(
        KINDS["concatenation"],
        ("cat", "concat", "stack"),
    ),
    PolicyRow(
        KINDS["addition"],
        ("add", "add_", "sub", "sub_", "rsub"),
    ),
    PolicyRow(
        KINDS["elementwise"],
        ("mul", "neg", "abs", "relu", "relu_", "gelu", "silu", "mish", "tanh",
         "sigmoid", "hardtanh", "hardswish", "hardsigmoid", "leaky_relu", "elu", "selu", "celu", "softplus",
         "dropout", "native_dropout", "feature_dropout", "alpha_dropout", "clamp", "clamp_min", "clamp_max",
         "clip", "where", "masked_fill", "sqrt", "sin", "cos", "erf", "sign", "floor", "ceil", "round",
         "trunc", "maximum", "minimum", "max", "min", "amax", "amin", "argmax", "argmin", "topk", "sort",
         "eq", "ne", "lt", "le", "gt", "ge", "logical_not", "isnan", "isinf", "isfinite",
         "view", "reshape", "_unsafe_view", "permute", "transpose", "t", "contiguous", "clone", "flatten",
         "unflatten", "squeeze", "unsqueeze", "expand", "expand_as", "repeat",
         "split", "split_with_sizes", "chunk", "unbind", "slice", "select", "narrow", "index", "index_select",
         "gather", "scatter", "embedding", "roll", "flip", "pad", "constant_pad_nd", "alias", "detach",
         "max_pool1d", "max_pool2d", "max_pool3d", "max_pool2d_with_indices", "adaptive_max_pool2d",
         "pixel_shuffle", "pixel_unshuffle", "tril", "triu", "zeros_like",
         "ones_like", "empty_like", "full_like", "fill", "new_zeros", "new_ones", "new_full", "new_empty",
         "type_as", "lerp", "addcmul", "addcdiv", "atan", "atan2", "square", "glu",
         "hardshrink", "softshrink", "tanhshrink", "threshold", "prelu", "rrelu", "logsigmoid", "bucketize",
         "masked_scatter", "index_put", "index_add", "_to_copy", "to", "mul_",
         "copy", "copy_", "view_as", "movedim", "swapaxes", "diagonal", "as_strided", "unfold", "im2col",
         "col2im", "tile", "repeat_interleave", "slice_scatter", "select_scatter", "_unsafe_index",
         "take_along_dim", "rot90", "nonzero", "sym_size", "sym_numel", "sym_stride", "scalar_tensor",
         "lift_fresh_copy", "_assert_tensor_metadata", "_assert_scalar"),
    ),
)

# rows for the training form of an op (:func:`in_training`), which computes statistics of its batch
TRAINING: tuple[PolicyRow, ...] = (
    PolicyRow(
        OpKind("batch normalisation in training", Category.FOLLOW,
               "batch normalisation in training mode: runs in the precision of its input; its kernel accumulates the "
               "batch's mean and variance in fp32 and reads and updates fp32 statistics and affine weights beside a "
               "low-precision input (torch's CPU kernel and cuDNN alike), so the batch's statistics keep fp32's "
               "accuracy and the activations it saves for backward stay low",
               frozenset({NORMALISATION})),
        _BATCH_NORMS,
        slots=MappingProxyType({"weight": "keep", "bias": "keep", "running_mean": "keep", "running_var": "keep"}),
    ),
)

UNKNOWN_REASON = "not in the policy table: follows its inputs (override it if it needs fp32)"

EINSUM_SUM_REASON = ("einsum whose equation only sums (no index is shared by two operands and summed): a reduction, "
                     "not a matrix multiply; a sum over many terms loses bits in the low dtype; computed in fp32")
EINSUM_FOLLOW_REASON = ("einsum whose equation sums nothing (an outer or elementwise product, a transpose, a "
                        "diagonal): elementwise work that runs in the precision of its inputs")
INVERSE_POWER_REASON = ("matrix power with a negative exponent: inverts the matrix, which has no low-precision "
                        "kernel and magnifies rounding by its condition number; computed in fp32")


def einsum_form(equation: str) -> str:
    """What an einsum equation computes: "contraction" when an index shared by two operands is summed (a
    matrix multiply), "sum" when it only sums indices of single operands, "elementwise" when it sums nothing.
    """
    equation = equation.replace(" ", "").replace("...", "")
    inputs, arrow, output = equation.partition("->")
    operands = [set(term) for term in inputs.split(",")]
    if not arrow:  # implicit output: the indices that appear once
        letters = [c for term in inputs.split(",") for c in term]
        output = "".join(c for c in letters if letters.count(c) == 1)
    summed = set().union(*operands) - set(output)
    if any(sum(c in term for term in operands) >= 2 for c in summed):
        return "contraction"
    return "sum" if summed else "elementwise"

_BY_NAME: dict[str, PolicyRow] = {op: row for row in POLICY for op in row.ops}
_TRAINING_BY_NAME: dict[str, PolicyRow] = {op: row for row in TRAINING for op in row.ops}
_NAMESPACED = frozenset(op for op in _BY_NAME if "." in op)  # ops of other libraries: "<namespace>.<name>"


# ATen's ops of the heavy kinds (amppass.analysis.policy.HEAVY): matrix products, convolutions, attention, recurrent
# layers and cells
HEAVY_OPS = frozenset(op for row in POLICY if row.kind in HEAVY for op in row.ops)


def lookup(op_name: str, training: bool = False) -> PolicyRow | None:
    """The policy row for an ATen op name ("linear", "aten.linear" or "aten.linear.default"), or None;
    ``training`` picks the row of the op's training form where it has one."""
    name = canonical_name(op_name)
    return (_TRAINING_BY_NAME.get(name) if training else None) or _BY_NAME.get(name)


def in_training(node: fx.Node, root: nn.Module | None = None) -> bool:
    """Whether ``node`` is a batch normalisation that normalises by its batch's statistics: its ``training``
    argument is True (or not a constant), or its module is in training mode or keeps no running statistics."""
    if ops.op_name(node, root) not in _TRAINING_BY_NAME:
        return False
    if node.op == "call_module":
        module = root.get_submodule(str(node.target)) if root is not None else None
        return module is None or module.training or getattr(module, "running_mean", None) is None
    flag = argument(node, "training")
    return not isinstance(flag, bool) or flag


def kept_arguments(node: fx.Node, root: nn.Module | None = None) -> tuple[set[fx.Node], frozenset[str]]:
    """What ``node``'s policy row feeds unchanged ("keep" slots): the argument nodes passed in those slots,
    and the slot names (for a ``call_module`` node, the names of the module state it keeps)."""
    row = lookup(ops.op_name(node, root), in_training(node, root))
    slots = frozenset(s for s, how in row.slots.items() if how == "keep") if row is not None else frozenset()
    if not slots or node.op != "call_function":
        return set(), slots
    names = argument_names(node)
    passed = [(names[i] if i < len(names) else "", a) for i, a in enumerate(node.args)] + list(node.kwargs.items())
    return {a for name, a in passed if name in slots and isinstance(a, fx.Node)}, slots


def canonical_name(op_name: str) -> str:
    """Strip the "aten." namespace and overload suffix: "aten.linear.default" -> "linear"; an op of another
    library's namespace that the table names keeps it ("transformers.grouped_mm_fallback.default" ->
    "transformers.grouped_mm_fallback")."""
    parts = op_name.split(".")
    if parts[0] == "aten":
        parts = parts[1:]
    elif len(parts) > 1 and ".".join(parts[:2]) in _NAMESPACED:
        return ".".join(parts[:2])
    return parts[0] if parts else op_name
