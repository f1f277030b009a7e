"""Build amppass's torch kernel facts (``amppass/targets/data/torch_kernel_facts.json``) from torch's own sources.

The FX plan asks the target's torch directly where it can (:mod:`amppass.fx.view.low_kernels` calls the op once on
tiny inputs). This table answers where it cannot: a CUDA target planned on a machine without a GPU, a
symbolically traced graph whose nodes carry no example values, an op whose tiny call fails in fp32 too.
Three sources, each named in the file:

- torch.autocast's per-device fp32 cast lists: the ``KERNEL_CPU(..., fp32)`` registrations of
  ``aten/src/ATen/autocast_mode.cpp`` and the ``AT_FORALL_FP32`` / ``AT_FORALL_FP32_SET_OPT_DTYPE`` /
  fp32_append_dtype lists of ``autocast_mode.h`` that the CUDA key registers (kept below as data, read at
  the commit named). The script checks them against the installed torch's dispatcher: every op named has
  a kernel under that autocast key, and every op with a kernel under AutocastCPU is named in one of its
  three lists (lower precision, fp32, promote), so a torch that changed its lists is noticed.
- PyTorch's op database (``torch.testing._internal.common_methods_invocations.op_db``, the dtypes each
  OpInfo entry declares and tests per device), read from the installed torch: an ATen op whose entries
  support float32 but not the low dtype has no low kernel. On CUDA only ops that declare neither float16
  nor bfloat16 are kept: without a GPU, op_db drops dtypes that depend on the GPU's architecture
  (``SM53OrLater``, ``SM80OrLater``), which would otherwise read as missing kernels.
- :data:`NOTES`: facts neither source states, each with its reason.

Usage (needs the ``expecttest`` package, which ``torch.testing._internal`` imports)::

    python scripts/torch_kernel_tables.py            # writes amppass/targets/data/torch_kernel_facts.json
    python scripts/torch_kernel_tables.py --check    # exits 1 if the file differs from what it would write
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

OUT = Path(__file__).resolve().parent.parent / "amppass" / "targets" / "data" / "torch_kernel_facts.json"
LOW = {"bfloat16": torch.bfloat16, "float16": torch.float16}

AUTOCAST_SOURCE = {
    "repo": "pytorch/pytorch",
    "files": "aten/src/ATen/autocast_mode.cpp (TORCH_LIBRARY_IMPL(aten, AutocastCPU): fp32 cast policy); "
             "aten/src/ATen/autocast_mode.h (AT_FORALL_FP32, AT_FORALL_FP32_SET_OPT_DTYPE, "
             "AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE: the AutocastCUDA fp32 policies)",
    "commit": "008ec6b1840c94ff6d0f685bc10fbf585167c673",
}

# AutocastCPU, fp32 cast policy (ATen packet names; overloads merged)
AUTOCAST_CPU_FP32 = (
    "avg_pool3d", "binary_cross_entropy", "grid_sampler", "polar", "prod", "quantile", "nanquantile", "stft",
    "cdist", "grid_sampler_2d", "_grid_sampler_2d_cpu_fallback", "grid_sampler_3d", "trace", "view_as_complex",
    "cholesky", "cholesky_inverse", "cholesky_solve", "inverse", "lu_solve", "orgqr", "ormqr", "pinverse",
    "max_pool3d", "max_unpool2d", "max_unpool3d", "adaptive_avg_pool3d", "reflection_pad1d", "reflection_pad2d",
    "replication_pad1d", "replication_pad2d", "replication_pad3d", "mse_loss", "cosine_embedding_loss",
    "nll_loss", "nll_loss2d", "hinge_embedding_loss", "poisson_nll_loss", "smooth_l1_loss", "cross_entropy_loss",
    "l1_loss", "huber_loss", "margin_ranking_loss", "soft_margin_loss", "triplet_margin_loss",
    "multi_margin_loss", "ctc_loss", "kl_div", "multilabel_margin_loss", "binary_cross_entropy_with_logits",
    "fft_fft", "fft_ifft", "fft_fft2", "fft_ifft2", "fft_fftn", "fft_ifftn", "fft_rfft", "fft_irfft",
    "fft_rfft2", "fft_irfft2", "fft_rfftn", "fft_irfftn", "fft_hfft", "fft_ihfft", "linalg_cond",
    "linalg_matrix_rank", "linalg_solve", "linalg_cholesky", "linalg_svdvals", "linalg_eigvals",
    "linalg_eigvalsh", "linalg_inv", "linalg_householder_product", "linalg_tensorinv", "linalg_tensorsolve",
    "fake_quantize_per_tensor_affine", "geqrf", "_lu_with_info", "qr", "svd", "triangular_solve",
    "fractional_max_pool2d", "fractional_max_pool3d", "adaptive_max_pool3d", "multilabel_margin_loss_forward",
    "linalg_qr", "linalg_cholesky_ex", "linalg_svd", "linalg_eig", "linalg_eigh", "linalg_lstsq",
    "linalg_inv_ex",
)
# the other two AutocastCPU policies, named only to check that the three lists cover its registrations
_AUTOCAST_CPU_OTHERS = (
    "conv1d", "conv2d", "conv3d", "bmm", "mm", "linalg_vecdot", "baddbmm", "addmm", "_addmm_activation",
    "addbmm", "linear", "_convolution", "matmul", "conv_tbc", "mkldnn_rnn_layer", "conv_transpose1d",
    "conv_transpose2d", "conv_transpose3d", "prelu", "scaled_dot_product_attention",
    "_native_multi_head_attention", "stack", "cat", "index_copy",
)
# AutocastCUDA: AT_FORALL_FP32, AT_FORALL_FP32_SET_OPT_DTYPE, norm (fp32_append_dtype)
AUTOCAST_CUDA_FP32 = (
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt",
    "sinh", "tan", "pow", "softplus", "layer_norm", "native_layer_norm", "rms_norm", "group_norm",
    "frobenius_norm", "nuclear_norm", "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss",
    "nll_loss", "nll_loss2d", "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss",
    "mse_loss", "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss",
    "multi_margin_loss", "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm", "logsumexp",
    "upsample_nearest1d", "_upsample_nearest_exact1d", "upsample_nearest2d", "_upsample_nearest_exact2d",
    "upsample_nearest3d", "_upsample_nearest_exact3d", "upsample_linear1d", "upsample_bilinear2d",
    "_upsample_bilinear2d_aa", "upsample_trilinear3d", "upsample_bicubic2d", "_upsample_bicubic2d_aa",
    "prod", "softmax", "log_softmax", "cumprod", "cumsum", "linalg_vector_norm", "linalg_matrix_norm", "sum",
    "norm",
)

_FFT = ("fft_fft", "fft_ifft", "fft_fft2", "fft_ifft2", "fft_fftn", "fft_ifftn", "fft_rfft", "fft_irfft",
        "fft_rfft2", "fft_irfft2", "fft_rfftn", "fft_irfftn", "fft_hfft", "fft_ihfft", "fft_hfft2", "fft_ihfft2",
        "fft_hfftn", "fft_ihfftn", "_fft_r2c", "_fft_c2r", "_fft_c2c")
# facts neither source states: device -> low dtype -> op -> reason
NOTES = {
    "cuda": {
        "float16": {op: "cuFFT computes in half precision only for power-of-two signal sizes (torch raises "
                        "otherwise), which a plan cannot promise for every input" for op in _FFT},
        "bfloat16": {op: "cuFFT has no bfloat16 transforms" for op in _FFT},
    },
}


def op_db_gaps() -> dict[str, dict[str, list[str]]]:
    """device -> low dtype -> ATen ops whose op_db entries take float32 but not that dtype (module docstring)."""
    from torch.testing._internal.common_methods_invocations import op_db

    supported: dict[tuple[str, str], set[torch.dtype]] = {}
    for info in op_db:
        name = info.aten_name
        if not name or not hasattr(torch.ops.aten, name):
            continue
        for device in ("cpu", "cuda"):
            supported.setdefault((device, name), set()).update(info.supported_dtypes(device))
    gaps: dict[str, dict[str, list[str]]] = {device: {dtype: [] for dtype in LOW} for device in ("cpu", "cuda")}
    for (device, name), dtypes in sorted(supported.items()):
        if torch.float32 not in dtypes:
            continue
        if device == "cuda" and dtypes & set(LOW.values()):
            continue
        for dtype_name, dtype in LOW.items():
            if dtype not in dtypes:
                gaps[device][dtype_name].append(name)
    return gaps


def check_autocast_lists() -> list[str]:
    """Disagreements between the lists above and the installed torch's autocast registrations."""
    problems = []
    names = [n for n in torch._C._dispatch_get_all_op_names() if n.startswith("aten::")]

    def registered(key: str) -> set[str]:
        return {n.split("::")[1].split(".")[0] for n in names if torch._C._dispatch_has_kernel_for_dispatch_key(n, key)}

    cpu, cuda = registered("AutocastCPU"), registered("AutocastCUDA")
    problems += [f"AutocastCPU has no kernel for {op}" for op in AUTOCAST_CPU_FP32 if op not in cpu]
    problems += [f"AutocastCPU registers {op}, which no list names" for op in
                 sorted(cpu - set(AUTOCAST_CPU_FP32) - set(_AUTOCAST_CPU_OTHERS))]
    problems += [f"AutocastCUDA has no kernel for {op}" for op in AUTOCAST_CUDA_FP32 if op not in cuda]
    return problems


def table() -> dict:
    """The file's contents."""
    version = torch.__version__.split("+")[0]
    return {
        "source": {
            "torch": version,
            "torch_commit": torch.version.git_version,
            "autocast": AUTOCAST_SOURCE,
            "op_db": f"torch.testing._internal.common_methods_invocations.op_db of torch {version}: the dtypes "
                     "each entry declares per device (CUDA: ops declaring neither float16 nor bfloat16 only)",
            "made_by": "scripts/torch_kernel_tables.py",
        },
        "autocast_fp32": {"cpu": sorted(AUTOCAST_CPU_FP32), "cuda": sorted(AUTOCAST_CUDA_FP32)},
        "no_low_kernel": op_db_gaps(),
        "notes": NOTES,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with the packaged file instead of writing")
    options = parser.parse_args(argv)
    problems = check_autocast_lists()
    if problems:
        print("the autocast lists disagree with the installed torch:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 1
    text = json.dumps(table(), indent=1, sort_keys=True) + "\n"
    if options.check:
        same = OUT.read_text(encoding="utf-8") == text
        print(f"{OUT.name}: {'up to date' if same else 'differs from what this torch gives'}")
        return 0 if same else 1
    OUT.write_text(text, encoding="utf-8")
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
