"""The ATen op policy table: one row per category, keyed by ATen overload packet, each with a reason.

Facts from torch.autocast's cast lists, TF grappler's AMP lists, TVM's ToMixedPrecision and Apex: matrix
products and convolutions are Tensor Core work; exponentials, logarithms, powers, norms, losses and long
reductions lose range or bits in fp16 and run in fp32 (reductions and softmax accumulate in fp32 through
their ``dtype=`` argument, which avoids casting the whole input); everything else follows its inputs.
"""

from __future__ import annotations

from ..analysis.plan import Category
from ..analysis.policy import DIVISION, NORMALISATION, POWER, REDUCTION, SINGULAR, PolicyRow


# Each op is named once, by its ATen overload packet name.
POLICY: tuple[PolicyRow, ...] = (
    PolicyRow(
        Category.LOW,
        "matrix multiply: Tensor Core work, accumulates in fp32 inside the kernel",
        ("mm", "bmm", "matmul", "addmm", "baddbmm", "addbmm", "linear", "einsum", "mv", "addmv", "bilinear",
         "_addmm_activation", "tensordot"),
    ),
    PolicyRow(
        Category.LOW,
        "convolution: Tensor Core work, accumulates in fp32 inside the kernel",
        ("conv1d", "conv2d", "conv3d", "convolution", "_convolution", "conv_transpose1d", "conv_transpose2d",
         "conv_transpose3d", "conv_tbc"),
    ),
    PolicyRow(
        Category.LOW,
        "attention: fused kernel, softmax statistics kept in fp32 inside it",
        ("scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
         "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
         "_scaled_dot_product_flash_attention_for_cpu"),
        # an additive mask of -3.4e38 would become -inf in fp16; saturate it to the low dtype's range
        slots={"attn_mask": "saturate"},
    ),
    PolicyRow(
        Category.LOW,
        "recurrent cell: matrix products dominate",
        ("lstm", "gru", "rnn_tanh", "rnn_relu", "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell",
         "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell"),
    ),
    PolicyRow(
        Category.FP32_ACCUM,
        "softmax: exp and its sum overflow fp16; computed in fp32 from the low-precision input",
        ("softmax", "log_softmax", "_softmax", "_log_softmax"),
    ),
    PolicyRow(
        Category.FP32_ACCUM,
        "reduction: a sum over many terms loses bits and can overflow in fp16; accumulated in fp32",
        ("sum", "mean", "nansum", "nanmean", "prod", "cumsum", "cumprod", "logcumsumexp"),
        facts=frozenset({REDUCTION}),
    ),
    PolicyRow(
        Category.FP32,
        "normalisation: mean and variance statistics need fp32",
        ("layer_norm", "native_layer_norm", "group_norm", "native_group_norm", "batch_norm",
         "native_batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_no_training",
         "_native_batch_norm_legit_functional", "instance_norm", "rms_norm", "_fused_rms_norm",
         "var", "std", "var_mean", "std_mean", "normalize"),
        facts=frozenset({NORMALISATION}),
    ),
    PolicyRow(
        Category.FP32,
        "norm: a sum of squares overflows fp16 and loses bits; computed in fp32",
        ("local_response_norm", "renorm", "norm", "linalg_vector_norm", "linalg_norm", "frobenius_norm",
         "nuclear_norm"),
    ),
    PolicyRow(
        Category.FP32,
        "exponential: overflows fp16 quickly (exp(11.1) > 65504); computed in fp32",
        ("exp", "exp2", "expm1", "logsumexp", "logaddexp", "logaddexp2"),
    ),
    PolicyRow(
        Category.FP32,
        "logarithm: singular at zero and loses precision in fp16; computed in fp32",
        ("log", "log2", "log10", "xlogy"),
        facts=frozenset({SINGULAR}),
    ),
    PolicyRow(
        Category.FP32,
        "logarithm near one: loses precision in fp16; computed in fp32",
        ("log1p", "special_xlog1py", "special_entr"),
    ),
    PolicyRow(
        Category.FP32,
        "power: magnifies relative error and leaves fp16's range quickly",
        ("pow", "float_power"),
        facts=frozenset({POWER}),
    ),
    PolicyRow(
        Category.FP32,
        "reciprocal: singular at zero, magnifies relative error",
        ("reciprocal", "rsqrt"),
        facts=frozenset({SINGULAR}),
    ),
    PolicyRow(
        Category.FP32,
        "transcendental with a narrow fp16 domain or range",
        ("erfinv", "acos", "asin", "tan", "cosh", "sinh", "atanh", "acosh", "asinh", "polar", "lgamma",
         "digamma", "polygamma", "mvlgamma"),
    ),
    PolicyRow(
        Category.FP32,
        "distance: sums of squares overflow fp16",
        ("cdist", "dist", "pdist", "_cdist_forward", "cosine_similarity", "pairwise_distance"),
    ),
    PolicyRow(
        Category.FP32,
        "loss: log, exp and long sums; kept in fp32",
        ("cross_entropy_loss", "nll_loss", "nll_loss2d", "nll_loss_nd", "binary_cross_entropy",
         "binary_cross_entropy_with_logits", "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "kl_div",
         "soft_margin_loss", "multi_margin_loss", "multilabel_margin_loss", "margin_ranking_loss",
         "hinge_embedding_loss", "cosine_embedding_loss", "poisson_nll_loss", "ctc_loss",
         "triplet_margin_loss", "multilabel_soft_margin_loss"),
    ),
    PolicyRow(
        Category.FP32,
        "resampling: interpolation weights and coordinates need fp32",
        ("upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d", "upsample_linear1d",
         "upsample_bilinear2d", "upsample_bicubic2d", "upsample_trilinear3d", "_upsample_bilinear2d_aa",
         "_upsample_nearest_exact2d", "grid_sampler", "grid_sampler_2d", "affine_grid_generator"),
    ),
    PolicyRow(
        Category.FOLLOW,
        "division: runs in the precision of its inputs (a divisor that flushes to zero in fp16 is kept fp32 by "
        "calibration)",
        ("div", "div_", "floor_divide", "remainder", "fmod"),
        facts=frozenset({DIVISION}),
    ),
    PolicyRow(
        Category.FOLLOW,
        "average pooling: runs in the precision of its inputs (long windows are kept fp32 by calibration)",
        ("avg_pool1d", "avg_pool2d", "avg_pool3d", "adaptive_avg_pool1d", "adaptive_avg_pool2d",
         "adaptive_avg_pool3d"),
        facts=frozenset({REDUCTION}),
    ),
    PolicyRow(
        Category.FOLLOW,
        "picks one output of a multi-output op (split, lstm) or indexes a tensor: runs in the precision of its input",
        ("getitem",),  # Python's operator.getitem, which every graph with a multi-output op has
    ),
    PolicyRow(
        Category.FOLLOW,
        "elementwise or data movement: runs in the precision of its inputs",
        ("add", "sub", "rsub", "mul", "neg", "abs", "relu", "relu_", "gelu", "silu", "mish", "tanh",
         "sigmoid", "hardtanh", "hardswish", "hardsigmoid", "leaky_relu", "elu", "selu", "celu", "softplus",
         "dropout", "native_dropout", "feature_dropout", "alpha_dropout", "clamp", "clamp_min", "clamp_max",
         "clip", "where", "masked_fill", "sqrt", "sin", "cos", "erf", "sign", "floor", "ceil", "round",
         "trunc", "maximum", "minimum", "max", "min", "amax", "amin", "argmax", "argmin", "topk", "sort",
         "eq", "ne", "lt", "le", "gt", "ge", "logical_not", "isnan", "isinf", "isfinite",
         "view", "reshape", "_unsafe_view", "permute", "transpose", "t", "contiguous", "clone", "flatten",
         "unflatten", "squeeze", "unsqueeze", "expand", "expand_as", "repeat", "cat", "concat", "stack",
         "split", "split_with_sizes", "chunk", "unbind", "slice", "select", "narrow", "index", "index_select",
         "gather", "scatter", "embedding", "roll", "flip", "pad", "constant_pad_nd", "alias", "detach",
         "max_pool1d", "max_pool2d", "max_pool3d", "max_pool2d_with_indices", "adaptive_max_pool2d",
         "pixel_shuffle", "pixel_unshuffle", "tril", "triu", "zeros_like",
         "ones_like", "empty_like", "full_like", "fill", "new_zeros", "new_ones", "new_full", "new_empty",
         "type_as", "lerp", "addcmul", "addcdiv", "atan", "atan2", "square", "glu",
         "hardshrink", "softshrink", "tanhshrink", "threshold", "prelu", "rrelu", "logsigmoid", "bucketize",
         "masked_scatter", "index_put", "index_add", "_to_copy", "to", "sub_", "add_", "mul_",
         "copy", "copy_", "view_as", "movedim", "swapaxes", "diagonal", "as_strided", "unfold", "im2col",
         "col2im", "tile", "repeat_interleave", "slice_scatter", "select_scatter", "_unsafe_index",
         "take_along_dim", "rot90", "nonzero", "sym_size", "sym_numel", "sym_stride", "scalar_tensor",
         "lift_fresh_copy", "_assert_tensor_metadata", "_assert_scalar"),
    ),
)

UNKNOWN_REASON = "not in the policy table: follows its inputs (override it if it needs fp32)"

_BY_NAME: dict[str, PolicyRow] = {op: row for row in POLICY for op in row.ops}


def lookup(op_name: str) -> PolicyRow | None:
    """The policy row for an ATen op name ("linear", "aten.linear" or "aten.linear.default"), or None."""
    return _BY_NAME.get(canonical_name(op_name))


def canonical_name(op_name: str) -> str:
    """Strip the "aten." namespace and overload suffix: "aten.linear.default" -> "linear"."""
    parts = op_name.split(".")
    if parts[0] == "aten":
        parts = parts[1:]
    return parts[0] if parts else op_name
