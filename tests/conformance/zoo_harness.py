"""Run transformers' model zoo through amppass: build each model class tiny and offline, then convert, generate,
compile, train and export it, and judge every step against fp32 and torch.autocast.

The classes are those of transformers' auto-model mappings (:data:`MAPPINGS`: causal LM, masked LM, sequence
classification, seq2seq, image classification, speech seq2seq, audio classification, CTC and the base models),
each built from its config class's defaults shrunk by :data:`SHRINK` (2 layers, width 32, 4 heads, vocab 128,
4 experts, 32-pixel images, every dropout 0; a hybrid keeps one layer of each kind ``layer_types`` names) with
seeded random weights; where that config does not build, the class's own config class (a text model of a
multimodal type) and a hybrid's first two layers alone are tried (:func:`configs`). A class that cannot be built that
way offline (a config the shrunk sizes break, a tokenizer
or hub file, a missing optional package) or that has no input recipe here is "unbuilt", with the reason. Each built
class goes through :data:`STEPS`:

- ``convert-speed`` / ``convert-coverage``: ``amppass.convert(..., dtype="bf16", plan_for=...)``; every float output
  within ``max(FLOOR, RATIO * autocast's error)`` of fp32's (relative L2, the worst output), autocast being
  ``torch.autocast("cpu", torch.bfloat16)`` on the same model and inputs; a non-finite output where fp32's is finite
  fails. Both errors come from the same CPU's kernels, so the ratio holds on any CPU where a fixed bound would not.
- ``generate`` (classes of the causal-LM mapping): greedy ``generate()`` of the coverage conversion against fp32's,
  token by token while fp32's top-2 margin exceeds twice the logit difference (past a near-tie both are correct),
  each step's logits within convert's bound (autocast's error measured on the prompt).
- ``compile``: ``torch.compile(backend="amppass", options={"dtype": "bf16", "plan_for": "coverage"})`` at two input
  shapes, each judged as convert's outputs.
- ``train``: ``convert(..., dtype="fp16", mode="train")``, 3 SGD steps with ``amppass.LossScaler``; first-step
  gradients (unscaled) against fp32's by per-parameter cosine, each error ``1 - cosine`` within twice autocast +
  ``GradScaler``'s for that parameter plus :data:`COSINE_SLACK` (:func:`judge_gradients`; a gradient autocast's
  fp16 cannot resolve either is not judged); every loss finite. A batch norm that needs two values per channel
  in training (one image, 1x1 at the end) trains on the batch of two.
- ``export-onnx``: ``amppass.export_onnx(..., dtype="fp16")``, ``onnx.checker`` (full check), onnxruntime's CPU
  provider; the first output within ``max(FLOOR_FP16, RATIO * fp16 autocast's error)`` of fp32's.

``compile`` and ``export-onnx`` capture the model type's shared body, which a head class adds a layer or a loss to:
they run on the first class of each model type that builds (:data:`PER_TYPE`, :func:`owners`) and are "covered" (by
that class) on its others, which keeps the whole zoo to a few seconds a class.

A step is "pass", "fail" (with the first line of the error, or the errors measured), "n/a" (it does not apply) or
"covered" (a per-type step, run on another class of the model type).
``python tests/conformance/zoo_harness.py --write-expected`` runs the whole zoo and writes ``zoo_expected.json``:
every unbuilt class and every failing step, with its reason, which ``tests/conformance/test_zoo.py`` then holds the code
to.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import json
import logging
import math
import os
import signal
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

import amppass
from tests.helpers.load import read_as_native_cpu

EXPECTED = Path(__file__).with_name("zoo_expected.json")
STEPS = ("convert-speed", "convert-coverage", "generate", "compile", "train", "export-onnx")
MAPPINGS = {  # kind -> transformers.models.auto.modeling_auto mapping of model type -> class name
    "causal-lm": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "masked-lm": "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
    "seq-cls": "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
    "seq2seq": "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "image-cls": "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
    "speech-seq2seq": "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES",
    "audio-cls": "MODEL_FOR_AUDIO_CLASSIFICATION_MAPPING_NAMES",
    "ctc": "MODEL_FOR_CTC_MAPPING_NAMES",
    "base": "MODEL_MAPPING_NAMES",
}
FLOOR = 2.0**-5  # 8 units of bf16 roundoff: below it no plan is judged, however exact autocast happens to be
FLOOR_FP16 = 2.0**-8  # the same for fp16
RATIO = 4.0  # amppass runs more ops low than autocast; 4x autocast's error on the same CPU is still its kind of error
COSINE_SLACK = 1e-2
GRADIENT_RATIO = 2.0  # amppass runs more ops low than autocast: twice its gradient error is still its kind
RESOLVED = 0.5  # a gradient autocast's fp16 gets less aligned than this with fp32's is rounding noise in fp16
PER_TYPE = ("compile", "export-onnx")  # steps run once per model type, on its first class that builds
STEP_SECONDS = 240  # a step still running then is a failure ("timed out"), so one class cannot stall the zoo
VOCAB = 128
SEQ = 8
# config attribute -> tiny value; set only where the config class has the attribute
SHRINK: dict[str, Any] = {
    "vocab_size": VOCAB, "unpadded_vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64,
    "num_hidden_layers": 2, "num_attention_heads": 4, "head_dim": 8, "rotary_dim": 8, "max_position_embeddings": 128,
    "n_positions": 128, "n_embd": 32, "n_layer": 2, "n_head": 4, "n_inner": 64, "d_model": 32, "d_ff": 64,
    "d_kv": 8, "num_layers": 2, "num_decoder_layers": 2, "encoder_layers": 2, "decoder_layers": 2,
    "encoder_attention_heads": 4, "decoder_attention_heads": 4, "encoder_ffn_dim": 64, "decoder_ffn_dim": 64,
    "ffn_dim": 64, "embed_dim": 32, "embedding_size": 32, "image_size": 32, "patch_size": 4, "num_channels": 3,
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "n_shared_experts": 1,
    "kv_lora_rank": 16, "q_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8,
    "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1, "num_mel_bins": 16, "max_source_positions": 16,
    "max_target_positions": 64, "num_conv_pos_embeddings": 16, "num_conv_pos_embedding_groups": 2,
    "conv_dim": [16, 16], "conv_stride": [5, 2], "conv_kernel": [10, 3], "window_size": 4, "num_labels": 2,
    "attn_layer_offset": 1, "attn_layer_period": 2, "expert_layer_offset": 1, "expert_layer_period": 2,
    "hidden_sizes": [8, 16], "depths": [1, 1], "num_heads": 4, "input_feat_per_channel": 16, "d_state": 8,
    "state_size": 8, "expand": 2, "time_step_rank": 4, "sliding_window": 64, "max_window_layers": 2,
    "emb_dim": 32, "n_layers": 2, "n_heads": 4,
}
MAX_PARAMETERS = 20_000_000  # a "tiny" model past this kept a size SHRINK does not name: unbuilt, not run out of memory
TOKENS = {"bos_token_id": 0, "pad_token_id": 1, "eos_token_id": 2, "decoder_start_token_id": 0}
LIST_SHRINK = {"num_heads": [2, 2], "embed_dim": [16, 32], "hidden_sizes": [8, 16], "depths": [1, 1],
               "conv_dim": [16, 16], "conv_stride": [5, 2], "conv_kernel": [10, 3]}
# model type -> values its config takes after SHRINK: sizes SHRINK cannot name generically. YOLOS's image is
# [512, 864] (a list, read as its first side); with the patch of 4 that is 16,485 tokens, whose attention scores
# alone take 4.3 GB in onnxruntime (its fp16 export failed allocating them)
TYPE_SHRINK: dict[str, dict[str, Any]] = {"yolos": {"image_size": [32, 32], "num_detection_tokens": 10}}
# class -> the steps it runs in the default suite: decoders (MoE, MLA, a state-space model among them), encoders,
# encoder-decoders, vision and audio, each with the steps it stands for; the whole zoo runs every step
REPRESENTATIVE: dict[str, tuple[str, ...]] = {
    "LlamaForCausalLM": ("convert-coverage", "generate", "export-onnx"),
    "GPT2LMHeadModel": ("convert-speed", "compile"),
    "DeepseekV3ForCausalLM": ("convert-coverage",),
    "MixtralForCausalLM": ("convert-coverage",),
    "MiniMaxM3VLTextModel": ("convert-coverage",),  # a router's sigmoid after .float(): fp32, as under autocast
    "MambaForCausalLM": ("convert-coverage",),
    "FalconForCausalLM": ("train",),
    "BertForSequenceClassification": ("convert-speed", "convert-coverage", "export-onnx"),
    "DistilBertForMaskedLM": ("convert-coverage",),
    "T5ForConditionalGeneration": ("convert-coverage",),
    "BartForConditionalGeneration": ("train",),
    "ViTForImageClassification": ("convert-coverage", "train"),
    "ResNetForImageClassification": ("train",),
    "WhisperForConditionalGeneration": ("convert-coverage",),
    "Wav2Vec2ForCTC": ("convert-coverage",),
}
SUBCONFIGS = ("text_config", "vision_config", "audio_config", "encoder", "decoder", "backbone_config")


def _commit() -> str:
    """The checkout's commit ("+dirty" with uncommitted changes), or "" outside a git checkout."""
    import subprocess

    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, check=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""
    return head + ("+dirty" if dirty else "")


COMMIT = _commit()


@dataclass
class Built:
    """A tiny model of one class, with its inputs."""

    name: str  # the class name
    kind: str  # the MAPPINGS key it was found under first
    model: torch.nn.Module
    inputs: dict  # keyword inputs of one forward call (no labels)
    other: dict  # the same inputs at another shape
    labels: dict  # what makes the model compute its loss ({} where it has none)
    generates: bool
    other_labels: dict = field(default_factory=dict)  # the labels of ``other``


@dataclass
class Result:
    """Every step's outcome for one class."""

    name: str
    kind: str
    built: bool
    reason: str = ""  # why it was not built
    steps: dict[str, dict] = field(default_factory=dict)  # step -> {"outcome", "detail", "seconds"}
    commit: str = field(default_factory=lambda: COMMIT)  # the amppass code that ran it


def classes(kinds: tuple[str, ...] = tuple(MAPPINGS)) -> dict[str, tuple[str, str]]:
    """Every class of the mappings of ``kinds``: name -> (kind, model type), first mapping wins."""
    from transformers.models.auto import modeling_auto

    found: dict[str, tuple[str, str]] = {}
    for kind in kinds:
        for model_type, names in getattr(modeling_auto, MAPPINGS[kind]).items():
            for name in (names,) if isinstance(names, str) else names:
                found.setdefault(name, (kind, model_type))
    return found


def by_type(found: dict[str, tuple[str, str]]) -> dict[str, list[str]]:
    """The class names of each model type, in the order :func:`classes` found them."""
    types: dict[str, list[str]] = {}
    for name, (_, model_type) in found.items():
        types.setdefault(model_type, []).append(name)
    return types


def owners(found: dict[str, tuple[str, str]], unbuilt: set[str] | dict) -> dict[str, str]:
    """Model type -> the class that runs its :data:`PER_TYPE` steps: its first class not in ``unbuilt``."""
    return {t: next(n for n in names if n not in unbuilt) for t, names in by_type(found).items()
            if any(n not in unbuilt for n in names)}


def steps_of(name: str, found: dict[str, tuple[str, str]], unbuilt: set[str] | dict,
             steps: tuple[str, ...] = STEPS) -> tuple[str, ...]:
    """The steps class ``name`` runs itself: all of ``steps`` on its model type's owner, the rest elsewhere."""
    if owners(found, unbuilt).get(found[name][1]) == name:
        return steps
    return tuple(s for s in steps if s not in PER_TYPE)


def tiny_config(model_type: str, config_class: Any = None, every_layer_kind: bool = False) -> Any:
    """The config class's defaults for ``model_type`` (or ``config_class``'s) with :data:`SHRINK` applied and every
    source of training randomness (dropout, layer drop, SpecAugment masks) 0. The kept layers take the first
    entries of ``layer_types``, or with ``every_layer_kind`` one layer of each kind the defaults use."""
    from transformers import CONFIG_MAPPING

    config_class = config_class or CONFIG_MAPPING[model_type]
    return config_class(**{**_overrides(config_class().to_dict(), every_layer_kind), **TYPE_SHRINK.get(model_type, {})})


def _layer_kinds(types: list, every_kind: bool) -> list:
    """The ``layer_types`` of the kept layers: the first of each kind, in order, with ``every_kind`` (a hybrid's
    attention layer that its first layers lack), else the first ones; as many as :data:`SHRINK` keeps either way."""
    kept = [kind for i, kind in enumerate(types) if kind not in types[:i]] if every_kind else []
    layers = max(SHRINK["num_hidden_layers"], len(kept))
    return (kept + types[:layers])[:layers] if every_kind else types[:layers]


def _overrides(defaults: dict, every_layer_kind: bool = False) -> dict:
    changed: dict = {}
    for key, value in defaults.items():
        if key in SUBCONFIGS and isinstance(value, dict):
            changed[key] = {**value, **_overrides(value, every_layer_kind)}
        elif _random(key) and isinstance(value, float):
            changed[key] = 0.0
        elif isinstance(value, (list, tuple)) and key in LIST_SHRINK:
            changed[key] = list(LIST_SHRINK[key])
        elif key in SHRINK and not isinstance(value, (list, tuple, dict)) and value is not None and \
                not isinstance(SHRINK[key], list):
            changed[key] = SHRINK[key]
    heads, kv_heads = defaults.get("num_attention_heads"), defaults.get("num_key_value_heads")
    if isinstance(kv_heads, int) and isinstance(heads, int):  # grouped-query attention only where the class has it
        changed["num_key_value_heads"] = 2 if kv_heads < heads else SHRINK["num_attention_heads"]
    for key, value in defaults.items():  # special tokens inside the shrunk vocabulary
        if key.endswith("_token_id") and isinstance(value, int) and not isinstance(value, bool) and value >= VOCAB:
            changed[key] = TOKENS.get(key, VOCAB - 1)
    if "pad_token_id" in defaults and defaults["pad_token_id"] is None:  # a batch of 2 needs one (seq-cls heads)
        changed["pad_token_id"] = TOKENS["pad_token_id"]
    if isinstance(defaults.get("layer_types"), list):  # one per layer: rebuilt for the layers kept
        changed["layer_types"] = _layer_kinds(defaults["layer_types"], every_layer_kind)
        for key in ("num_hidden_layers", "num_layers", "n_layer", "n_layers") if every_layer_kind else ():
            if isinstance(defaults.get(key), int):
                changed[key] = len(changed["layer_types"])
    return changed


def _random(key: str) -> bool:
    """Whether a config float switches on randomness in training (dropout, layer drop, stochastic depth,
    SpecAugment's time and feature masks): set to 0, so the train step compares gradients of one computation."""
    return "dropout" in key or "layerdrop" in key or key.endswith(("drop_prob", "drop_path_rate", "_pdrop")) or \
        (key.startswith("mask_") and key.endswith("_prob"))


def build(name: str, kind: str, model_type: str) -> Built:
    """The tiny model of class ``name`` in eval mode with seeded weights, and its inputs. Raises on anything that
    stops it (the reason of an unbuilt class)."""
    import transformers

    cls = getattr(transformers, name, None)
    if cls is None:
        raise LookupError(f"transformers has no {name} (an optional dependency is missing)")
    failed: Exception | None = None
    for config in configs(cls, model_type):
        try:
            return _built(name, kind, cls, config())
        except Exception as err:  # noqa: BLE001 - the next config may build; the first error is the reason
            failed = failed or err
    raise failed


def configs(cls: type, model_type: str) -> Iterator[Callable[[], Any]]:
    """The tiny configs to build ``cls`` from, in turn until one builds: the model type's config, then where the
    class takes its own config class (a text model of a multimodal type), that one. Of a hybrid (``layer_types``
    naming kinds its first layers lack: linear attention before full, sliding windows before global), the config
    with one layer of each kind comes first, so the tiny model has the architecture's every layer kind; the
    first layers alone are the fallback."""
    from transformers import CONFIG_MAPPING

    classes = [CONFIG_MAPPING[model_type]]
    own = getattr(cls, "config_class", None)
    if own is not None and own is not classes[0]:
        classes.append(own)
    for config_class in classes:
        if _has_layer_kinds(config_class().to_dict()):
            yield functools.partial(tiny_config, model_type, config_class, every_layer_kind=True)
        yield functools.partial(tiny_config, model_type, config_class)


def _has_layer_kinds(defaults: dict) -> bool:
    """Whether the first layers the tiny config keeps lack a kind of layer that ``layer_types`` names."""
    types = defaults.get("layer_types")
    if isinstance(types, list) and _layer_kinds(types, True) != _layer_kinds(types, False):
        return True
    return any(_has_layer_kinds(defaults[key]) for key in SUBCONFIGS if isinstance(defaults.get(key), dict))


def _built(name: str, kind: str, cls: type, config: Any) -> Built:
    """``cls`` built from ``config`` with seeded weights and its inputs, the fp32 model run once on them."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = cls(config).eval()
    parameters = sum(p.numel() for p in model.parameters())
    if parameters > MAX_PARAMETERS:
        raise MemoryError(f"the tiny config keeps {parameters / 1e6:.0f}M parameters (a size SHRINK does not name)")
    if hasattr(model, "set_attn_implementation"):
        with contextlib.suppress(Exception):
            model.set_attn_implementation("sdpa")
    signature = inspect.signature(model.forward).parameters
    main = getattr(model, "main_input_name", "input_ids")
    inputs, other = _inputs(model, main, 1, SEQ), _inputs(model, main, 2, SEQ + 4)
    for batch in (inputs, other):
        if "use_cache" in signature:
            batch["use_cache"] = False
        if isinstance(getattr(model.config, "eos_token_id", None), int) and main == "input_ids":
            batch[main][:, -1] = model.config.eos_token_id  # classification heads of encoder-decoders read it
        if "decoder_input_ids" in signature and getattr(model.config, "is_encoder_decoder", False) and \
                kind not in ("seq-cls",):
            batch["decoder_input_ids"] = _ids(batch[main].shape[0], 4, seed=3)
    with torch.no_grad():
        model(**inputs)  # the fp32 model must run on its tiny inputs
    encoder_decoder = getattr(model.config, "is_encoder_decoder", False) and kind in ("causal-lm", "masked-lm")
    labels = _labels("seq2seq" if encoder_decoder else kind, inputs, main) if "labels" in signature else {}
    if labels:
        with torch.no_grad():
            out = model(**inputs, **labels)
        if _loss(out) is None:
            labels = {}
    generates = kind == "causal-lm" and hasattr(model, "generate") and model.can_generate()
    other_labels = _labels("seq2seq" if encoder_decoder else kind, other, main) if labels else {}
    return Built(name, kind, model, inputs, other, labels, generates, other_labels)


def _ids(batch: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(3, VOCAB - 1, (batch, length), generator=torch.Generator().manual_seed(seed))


def _inputs(model: torch.nn.Module, main: str, batch: int, length: int) -> dict:
    config = model.config
    generator = torch.Generator().manual_seed(batch * 100 + length)
    if main == "input_ids":
        return {"input_ids": _ids(batch, length, seed=batch * 100 + length)}
    if main == "pixel_values":
        size = getattr(config, "image_size", 32)
        size = size[0] if isinstance(size, (list, tuple)) else size
        return {"pixel_values": torch.randn(batch, getattr(config, "num_channels", 3), size, size,
                                            generator=generator)}
    if main == "input_values":
        return {"input_values": torch.randn(batch, 1600 + 160 * length, generator=generator)}
    if main == "input_features":
        bins = getattr(config, "num_mel_bins", None) or getattr(config, "input_feat_per_channel", 16)
        if getattr(config, "max_source_positions", None) and config.model_type == "whisper":
            frames = 2 * config.max_source_positions  # whisper's encoder takes exactly this many frames
            return {"input_features": torch.randn(batch, bins, frames, generator=generator)}
        return {"input_features": torch.randn(batch, 4 * length, bins, generator=generator)}
    raise LookupError(f"no input recipe for main input {main!r}")


def _labels(kind: str, inputs: dict, main: str) -> dict:
    batch = inputs[main].shape[0]
    if kind in ("causal-lm", "masked-lm"):
        return {"labels": inputs[main].clone()}
    if kind in ("seq-cls", "image-cls", "audio-cls"):
        return {"labels": torch.ones(batch, dtype=torch.long)}
    if kind in ("seq2seq", "speech-seq2seq"):
        return {"labels": _ids(batch, 4, seed=5)}
    if kind == "ctc":
        return {"labels": _ids(batch, 3, seed=6)}
    return {}


def _loss(out: Any) -> torch.Tensor | None:
    loss = out.get("loss") if isinstance(out, dict) else getattr(out, "loss", None)
    return loss if isinstance(loss, torch.Tensor) else None


def tensors(out: Any) -> list[torch.Tensor]:
    """Every float tensor of a model output (tensors, tuples, dicts, ModelOutputs, caches' keys and values)."""
    if isinstance(out, torch.Tensor):
        return [out] if out.is_floating_point() else []
    if isinstance(out, dict):
        return [t for v in out.values() for t in tensors(v)]
    if isinstance(out, (tuple, list)):
        return [t for v in out for t in tensors(v)]
    if hasattr(out, "layers"):
        return [t for layer in out.layers for t in tensors([getattr(layer, "keys", None),
                                                             getattr(layer, "values", None)])]
    return []


def error(got: Any, want: Any) -> float:
    """The worst relative L2 error over the float outputs; inf where the structure differs or a value fp32 has
    finite is not."""
    gots, wants = tensors(got), tensors(want)
    if len(gots) != len(wants) or not wants:
        return math.inf
    worst = 0.0
    for g, w in zip(gots, wants, strict=False):
        if g.shape != w.shape:
            return math.inf
        g, w = g.detach().double(), w.detach().double()
        finite = torch.isfinite(w)
        if not torch.isfinite(g[finite]).all():
            return math.inf
        scale = float(w[finite].norm())
        worst = max(worst, float((g[finite] - w[finite]).norm()) / (scale or 1.0))
    return worst


def autocast_error(model: torch.nn.Module, inputs: dict, reference: Any, dtype: torch.dtype,
                   first: bool = False) -> float:
    """torch.autocast's error on the same inputs (the first float output only, with ``first``); NaN where the
    model fails under autocast (DeBERTa fills a mask with fp32's lowest value, beyond bf16's range): the bound is
    then the floor alone."""
    try:
        with torch.no_grad(), torch.autocast("cpu", dtype=dtype):
            out = model(**inputs)
    except Exception:  # noqa: BLE001 - the model's own code under autocast: no comparison to make
        return math.nan
    return error(tensors(out)[0].float(), tensors(reference)[0]) if first else error(out, reference)


def _judge(err: float, autocast: float, floor: float) -> tuple[str, str]:
    bound = max(floor, RATIO * autocast) if math.isfinite(autocast) else floor
    detail = f"error {err:.3g}, autocast {autocast:.3g}, bound {bound:.3g}" if math.isfinite(autocast) else \
        f"error {err:.3g}, autocast fails on this model, bound {bound:.3g}"
    return ("pass" if err <= bound else "fail"), detail


def _split(built: Built, inputs: dict) -> tuple[tuple, dict]:
    """The main input positionally, the rest by keyword (convert captures with both)."""
    main = getattr(built.model, "main_input_name", "input_ids")
    rest = {k: v for k, v in inputs.items() if k != main}
    return (inputs[main],), rest


def step_convert(built: Built, plan: str) -> tuple[str, str]:
    args, kwargs = _split(built, built.inputs)
    with torch.no_grad():
        reference = built.model(**built.inputs)
    converted = amppass.convert(built.model, args, example_kwargs=kwargs, dtype="bf16", plan_for=plan)
    with torch.no_grad():
        out = converted(*args, **kwargs)
    return _judge(error(out, reference), autocast_error(built.model, built.inputs, reference, torch.bfloat16), FLOOR)


def step_generate(built: Built) -> tuple[str, str]:
    if not built.generates:
        return "n/a", ""
    model = built.model
    model.generation_config.eos_token_id = None  # every sequence runs its full length
    model.generation_config.pad_token_id = 0
    ids = _ids(1, SEQ, seed=11)
    converted = amppass.convert(model, (ids,), example_kwargs={"use_cache": False} if "use_cache" in
                                built.inputs else None, dtype="bf16", plan_for="coverage")
    if not hasattr(converted, "generate"):
        return "fail", f"the converted model ({type(converted).__name__}) has no generate()"
    settings = dict(max_new_tokens=8, do_sample=False, output_logits=True, return_dict_in_generate=True,
                    pad_token_id=0)
    with torch.no_grad():
        reference = model.generate(ids, **settings)
        out = converted.generate(ids, **settings)
    forward = {"input_ids": ids, **({"use_cache": False} if "use_cache" in built.inputs else {})}
    with torch.no_grad():
        bound = max(FLOOR, RATIO * autocast_error(model, forward, model(**forward), torch.bfloat16))
    start = reference.sequences.shape[1] - len(reference.logits)
    for step, (want, got) in enumerate(zip(reference.logits, out.logits, strict=False)):
        logits_error = error(got.float(), want.float())
        if logits_error > bound:  # only logits within convert's bound can disagree at a near-tie
            return "fail", f"token {step}: logits error {logits_error:.3g} > {bound:.3g}"
        top = want.float().topk(2, dim=-1).values
        margin = float((top[..., 0] - top[..., 1]).min())
        difference = float((got.float() - want.float()).abs().max())
        if margin <= 2 * difference:
            return "pass", f"{step} tokens compared, then a near-tie"
        if not torch.equal(out.sequences[:, start + step], reference.sequences[:, start + step]):
            return "fail", f"token {step} differs from fp32's (margin {margin:.3g}, logit difference {difference:.3g})"
    return "pass", f"{len(reference.logits)} tokens compared"


def step_compile(built: Built) -> tuple[str, str]:
    torch._dynamo.reset()
    try:
        compiled = torch.compile(built.model, backend="amppass", options={"dtype": "bf16", "plan_for": "coverage"})
        details = []
        for inputs in (built.inputs, built.other):
            with torch.no_grad():
                reference = built.model(**inputs)
                out = compiled(**inputs)
            outcome, detail = _judge(error(out, reference),
                                     autocast_error(built.model, inputs, reference, torch.bfloat16), FLOOR)
            details.append(detail)
            if outcome != "pass":
                shape = "x".join(str(s) for s in next(iter(inputs.values())).shape)
                return outcome, f"at {shape}: {detail}"
        return "pass", "; ".join(details)
    finally:
        torch._dynamo.reset()


def _gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _train_loss(out: Any) -> torch.Tensor:
    """The model's own loss; for a base model, its first float output's mean against fixed random weights (the
    mean square would be constant after a final LayerNorm, its gradients rounding noise)."""
    loss = _loss(out)
    if loss is None:
        first = tensors(out)[0].float()
        weights = torch.randn(first.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float32)
        loss = (first * weights.to(first.device)).mean()
    return loss


def _cosines(grads: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> dict[str, float]:
    """Each parameter's gradient cosine to fp32's (parameters whose fp32 gradient is zero left out): 0 for a
    missing gradient, -inf for a non-finite one."""
    found = {}
    for name, want in reference.items():
        if float(want.norm()) == 0.0:
            continue
        got = grads.get(name)
        if got is None or not torch.isfinite(got).all():
            found[name] = 0.0 if got is None else -math.inf
            continue
        found[name] = float(torch.nn.functional.cosine_similarity(got.flatten().double(), want.flatten().double(),
                                                                  dim=0))
    return found


def _autocast_cosines(model: torch.nn.Module, inputs: dict, reference: dict[str, torch.Tensor]) -> dict[str, float]:
    """Each parameter's first-step gradient cosine under torch.autocast (fp16) + GradScaler; empty where autocast
    itself fails (every parameter is then judged against 0.999)."""
    model = copy.deepcopy(model).train()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    try:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = _train_loss(model(**inputs))
        scaler.scale(loss.float()).backward()
    except Exception:  # noqa: BLE001 - an op autocast cannot run in fp16 on this CPU: no comparison to make
        return {}
    scaler.unscale_(torch.optim.SGD(model.parameters(), lr=1e-3))
    return _cosines(_gradients(model), reference)


def judge_gradients(cosines: dict[str, float], autocast: dict[str, float]) -> tuple[str, str]:
    """Every parameter's gradient error, ``1 - cosine`` to fp32's, at most :data:`GRADIENT_RATIO` times autocast's
    for it (autocast's cosine taken at most 0.999) plus :data:`COSINE_SLACK`: the kind of error autocast's fp16
    makes, as convert's outputs are judged; a parameter whose gradient fp16 autocast cannot resolve (cosine below
    :data:`RESOLVED`: its fp32 gradient is below fp16's rounding of the values it is made from) is not judged,
    only counted."""
    judged = {n: c for n, c in cosines.items() if autocast.get(n, 1.0) >= RESOLVED}
    short = {n: GRADIENT_RATIO * (1 - min(autocast.get(n, 1.0), 0.999)) + COSINE_SLACK - (1 - c)
             for n, c in judged.items()}
    worst = min(short, key=short.get) if short else None
    detail = (f"worst gradient cosine {min(judged.values(), default=1.0):.4f}"
              f" (autocast's {min((autocast.get(n, 1.0) for n in judged), default=1.0):.4f})")
    if len(judged) < len(cosines):
        detail += f"; {len(cosines) - len(judged)} parameters unresolved by fp16 autocast too"
    if worst is not None and short[worst] < 0:
        return "fail", f"{worst}: cosine {cosines[worst]:.4f}, autocast's {autocast.get(worst, 1.0):.4f}; {detail}"
    return "pass", detail


def step_train(built: Built) -> tuple[str, str]:
    inputs = {**built.inputs, **built.labels}
    fp32 = copy.deepcopy(built.model).train()
    try:
        _train_loss(fp32(**inputs)).backward()
    except ValueError as err:  # batch norm in training needs two values per channel: a batch of one image at 1x1
        if "more than 1 value per channel" not in str(err):
            raise
        inputs = {**built.other, **built.other_labels}
        fp32 = copy.deepcopy(built.model).train()
        _train_loss(fp32(**inputs)).backward()
    reference = _gradients(fp32)

    autocast = _autocast_cosines(built.model, inputs, reference)

    args, kwargs = _split(built, inputs)
    with read_as_native_cpu():  # the plan for speed of a CPU with fp16 instructions (one without trains in fp32)
        model = amppass.convert(copy.deepcopy(built.model).train(), args, example_kwargs=kwargs, dtype="fp16",
                                mode="train")
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = amppass.LossScaler(init_scale=2.0**10)
    cosines, losses = None, []
    for _ in range(3):
        optimizer.zero_grad()
        loss = _train_loss(model(*args, **kwargs))
        losses.append(float(loss))
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        if cosines is None:
            cosines = _cosines(_gradients(model), reference)
        scaler.step(optimizer)
        scaler.update()
    if not all(math.isfinite(x) for x in losses):
        return "fail", f"non-finite loss in 3 steps {losses}"
    return judge_gradients(cosines, autocast)


def step_export(built: Built) -> tuple[str, str]:
    import onnx
    import onnxruntime

    model = built.model
    names = list(inspect.signature(model.forward).parameters)
    last = max(names.index(k) for k in built.inputs if k != "use_cache")
    args = tuple(built.inputs.get(n) for n in names[:last + 1])
    with torch.no_grad():
        reference = tensors(model(**built.inputs))[0]
    with tempfile.TemporaryDirectory(prefix="zoo-onnx-") as folder:
        path = os.path.join(folder, "model.onnx")
        amppass.export_onnx(model, args, path, dtype="fp16")
        onnx.checker.check_model(path, full_check=True)
        session = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
        feed = {i.name: built.inputs[i.name].numpy() for i in session.get_inputs()}
        out = torch.from_numpy(session.run(None, feed)[0])
    err = error(out.float(), reference)
    return _judge(err, autocast_error(model, built.inputs, reference, torch.float16, first=True), FLOOR_FP16)


RUNNERS = {
    "convert-speed": lambda b: step_convert(b, "speed"),
    "convert-coverage": lambda b: step_convert(b, "coverage"),
    "generate": step_generate,
    "compile": step_compile,
    "train": step_train,
    "export-onnx": step_export,
}


class _Timeout(Exception):
    pass


@contextlib.contextmanager
def _deadline(seconds: int) -> Iterator[None]:
    def expire(signum, frame):  # signal handler's signature
        raise _Timeout(f"timed out after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def first_line(err: BaseException) -> str:
    """The exception's type and the first line of its message."""
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0][:240] if lines else ''}".rstrip(": ")


# the step each class is in, written before it runs: a step that kills the process (a native crash inside a
# compiled kernel) is found there on --resume and recorded as failed instead of run again (CRASHED)
RUNNING: Path | None = None
CRASHED = "the process died in this step (a native crash; python -X faulthandler names the frame)"


def _running(name: str | None, step: str = "") -> None:
    if RUNNING is not None:
        if name is None:
            RUNNING.unlink(missing_ok=True)
        else:
            RUNNING.write_text(json.dumps({"name": name, "step": step}), encoding="utf-8")


def _stopped(signum: int, frame: Any) -> None:
    _running(None)
    raise SystemExit(128 + signum)


def crashes(results: list[dict]) -> dict[str, set[str]]:
    """class -> the steps that killed the process, from the outcomes and the marker a crash left behind."""
    found: dict[str, set[str]] = {}
    for result in results:
        for step, value in result.get("steps", {}).items():
            if value.get("detail") == CRASHED:
                found.setdefault(result["name"], set()).add(step)
    if RUNNING is not None and RUNNING.exists():
        marker = json.loads(RUNNING.read_text(encoding="utf-8"))
        found.setdefault(marker["name"], set()).add(marker["step"])
    return found


def run_class(name: str, kind: str, model_type: str, steps: tuple[str, ...] = STEPS, owner: str | None = None,
              crashed: set[str] = frozenset()) -> Result:
    """Build ``name`` tiny and run ``steps`` on it; never raises. With ``owner`` (the class of the same model type
    that ran the :data:`PER_TYPE` steps), those steps are recorded "covered" by it instead of run; the steps in
    ``crashed`` killed the process before and are recorded failed."""
    logging.disable(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                _running(name, "build")
                with _deadline(STEP_SECONDS):
                    built = build(name, kind, model_type)
            except Exception as err:  # noqa: BLE001 - an unbuilt class is data, with its reason
                return Result(name, kind, False, first_line(err))
            result = Result(name, kind, True)
            for step in steps:
                if owner is not None and step in PER_TYPE:
                    result.steps[step] = {"outcome": "covered", "detail": f"by {owner}", "seconds": 0.0}
                    continue
                if step in crashed:
                    result.steps[step] = {"outcome": "fail", "detail": CRASHED, "seconds": 0.0}
                    continue
                _running(name, step)
                start = time.perf_counter()
                try:
                    with _deadline(STEP_SECONDS):
                        outcome, detail = RUNNERS[step](built)
                except Exception as err:  # noqa: BLE001 - what the zoo is here to find
                    outcome, detail = "fail", first_line(err)
                result.steps[step] = {"outcome": outcome, "detail": detail,
                                      "seconds": round(time.perf_counter() - start, 2)}
            return result
    finally:
        _running(None)
        logging.disable(logging.NOTSET)


def run_type(names: list[str], found: dict[str, tuple[str, str]], steps: tuple[str, ...] = STEPS,
             crashed: dict[str, set[str]] | None = None) -> Iterator[Result]:
    """Every class of one model type in turn: the first that builds runs ``steps``, the others all but the
    :data:`PER_TYPE` ones, which they record covered by it; steps that killed the process before are not run
    (``crashed``, by class)."""
    owner = None
    for name in names:
        result = run_class(name, *found[name], steps, owner, (crashed or {}).get(name, set()))
        if result.built and owner is None:
            owner = name
        yield result


def counts(results: list[dict]) -> list[dict]:
    """One row per step: classes passing, failing, where it does not apply, covered by another class of the model
    type, not run (a subset of the steps), and in the build row the classes not built."""
    built = [r for r in results if r["built"]]
    rows = [{"step": "build", "pass": len(built), "fail": "", "n/a": "", "covered": "", "not run": "",
             "unbuilt": len(results) - len(built)}]
    for step in STEPS:
        outcomes = [r["steps"].get(step, {}).get("outcome", "not run") for r in built]
        rows.append({"step": step, **{o: outcomes.count(o) for o in ("pass", "fail", "n/a", "covered", "not run")},
                     "unbuilt": ""})
    return rows


def stale_failures(results: list[dict]) -> list[tuple[str, tuple[str, ...]]]:
    """(class, its failing steps) for every built class another commit than this checkout's ran: what a rerun on
    this code must confirm before the outcomes stand for it."""
    todo = []
    for result in results:
        if not result["built"] or result.get("commit") == COMMIT:
            continue
        failing = tuple(s for s in STEPS if result["steps"].get(s, {}).get("outcome") == "fail"
                        and result["steps"][s]["detail"] != CRASHED)  # it would kill the rerun too
        if failing:
            todo.append((result["name"], failing))
    return todo


def merged(results: list[dict], later: list[dict]) -> list[dict]:
    """``results`` updated by ``later`` (a rerun): a class built in both keeps its other steps and takes the rerun's
    (with its commit); otherwise the later outcome replaces the class's."""
    index = {r["name"]: r for r in results}
    for result in later:
        known = index.get(result["name"])
        if known is not None and known["built"] and result["built"]:
            known["steps"] = {**known["steps"], **result["steps"]}
            known["commit"] = result.get("commit", "")
        else:
            index[result["name"]] = result
    return list(index.values())


def expected_from(results: list[dict], path: Path | None = None, about: str | None = None,
                  reason: Callable[[str], str] = str) -> dict:
    """The content of the expected file at ``path`` (default :data:`EXPECTED`) that ``results`` satisfy, each
    failure kept as ``reason(detail)``; the entries of classes and steps not in ``results`` are kept from the file
    as it is (so a run of some classes or steps updates theirs only). The peer zoo writes its file with it too."""
    path, about = path or EXPECTED, about or ABOUT
    previous = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
    ran = {r["name"] for r in results}
    unbuilt = {k: v for k, v in previous.get("unbuilt", {}).items() if k not in ran}
    expected = dict(previous.get("expected", {}))
    for result in results:
        name = result["name"]
        if not result["built"]:
            unbuilt[name] = result["reason"]
            expected.pop(name, None)
            continue
        kept = {s: r for s, r in expected.pop(name, {}).items() if s not in result["steps"]}  # steps not run
        kept.update({s: reason(v["detail"]) for s, v in result["steps"].items() if v["outcome"] == "fail"})
        if kept:
            expected[name] = dict(sorted(kept.items()))
    return {"about": about, "unbuilt": dict(sorted(unbuilt.items())), "expected": dict(sorted(expected.items()))}


def type_order(found: dict[str, tuple[str, str]]) -> list[str]:
    """The model types in the order of their first class in :func:`interleaved`."""
    return list(dict.fromkeys(found[name][1] for name in interleaved(found)))


def interleaved(found: dict[str, tuple[str, str]]) -> list[str]:
    """The class names: :data:`REPRESENTATIVE` first, then each kind in turn, so a run stopped part way has reached
    every kind."""
    by_kind: dict[str, list[str]] = {}
    for name, (kind, _) in found.items():
        if name in REPRESENTATIVE:
            continue
        by_kind.setdefault(kind, []).append(name)
    order = [name for name in REPRESENTATIVE if name in found]
    queues = [list(names) for names in by_kind.values()]
    while any(queues):
        order += [queue.pop(0) for queue in queues if queue]
    return order


ABOUT = ("Expected deviations of the transformers zoo (tests/conformance/test_zoo.py, "
         "tests/conformance/zoo_harness.py): "
         "'unbuilt' lists the classes a tiny offline config cannot build, with the reason; 'expected' lists per "
         "class the steps that fail today, with the first line of the error or the errors measured. A listed step "
         "that passes fails the test, as does an unlisted one that fails. Regenerate: python "
         "tests/conformance/zoo_harness.py --write-expected")


def main(argv: list[str] | None = None) -> None:
    """Run the zoo (or the classes named), print the counts per step, write the outcomes (and the expected file)."""
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="these classes only")
    parser.add_argument("--steps", nargs="*", default=list(STEPS))
    parser.add_argument("--representative", action="store_true",
                        help="the default suite's classes, each with its steps (REPRESENTATIVE)")
    parser.add_argument("--shard", default="0/1", help="i/n: every n-th model type from the i-th (run n at once)")
    parser.add_argument("--json", default=None, help="write every outcome here (after each class)")
    parser.add_argument("--resume", action="store_true", help="keep the classes already in --json")
    parser.add_argument("--write-expected", action="store_true", help=f"write {EXPECTED.name} from the outcomes")
    parser.add_argument("--memory-gb", type=float, default=8.0,
                        help="address space of this process: a class past it fails its step instead of the shard "
                             "being killed (0: no limit)")
    parser.add_argument("--rerun-failed", action="store_true",
                        help="run on this code the failing steps of the classes in --json that another commit ran "
                             "(this shard's share), merged into --json")
    parser.add_argument("--combine", nargs="*", type=Path, default=[],
                        help="run nothing: join these outcome files (the shards', a rerun's last) into --json")
    options = parser.parse_args(argv)
    if options.memory_gb:
        import resource

        limit = int(options.memory_gb * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
    global RUNNING
    RUNNING = Path(options.json).with_suffix(".running") if options.json and options.resume else None
    signal.signal(signal.SIGTERM, _stopped)  # a shard stopped on purpose is no crash: the marker goes
    found = classes()
    index, count = (int(p) for p in options.shard.split("/"))
    results: list[dict] = []
    if options.resume and options.json and os.path.exists(options.json):
        results = json.loads(Path(options.json).read_text(encoding="utf-8"))["results"]
    for path in options.combine:
        results = merged(results, json.loads(path.read_text(encoding="utf-8"))["results"])
    if options.combine and options.json:
        write_json(Path(options.json), {"versions": versions(), "results": results})
    done = {r["name"] for r in results}

    def record(result: Result, position: str) -> None:
        results.append(vars(result))
        summary = result.reason if not result.built else " ".join(
            f"{s}={v['outcome']}" for s, v in result.steps.items())
        print(f"[{position}] {result.name}: {summary}", flush=True)
        if options.json:
            write_json(Path(options.json), {"versions": versions(), "results": results})

    if options.combine:
        pass
    elif options.rerun_failed:
        todo = stale_failures(results)[index::count]
        for number, (name, steps) in enumerate(todo):
            result = run_class(name, *found[name], steps)
            results[:] = merged(results, [vars(result)])
            summary = " ".join(f"{s}={v['outcome']}" for s, v in result.steps.items()) or result.reason
            print(f"[rerun {number + 1}/{len(todo)}] {name}: {summary}", flush=True)
            if options.json:
                write_json(Path(options.json), {"versions": versions(), "results": results})
    elif options.representative or options.only:
        names = (list(REPRESENTATIVE) if options.representative else options.only)[index::count]
        crashed = crashes(results)
        for number, name in enumerate(n for n in names if n not in done):
            steps = REPRESENTATIVE[name] if options.representative else tuple(options.steps)
            record(run_class(name, *found[name], steps, crashed=crashed.get(name, set())), f"{number + 1}/{len(names)}")
    else:
        types = by_type(found)
        order = type_order(found)[index::count]
        for number, model_type in enumerate(order):
            names = types[model_type]
            if all(n in done for n in names):
                continue
            crashed = crashes(results)
            results[:] = [r for r in results if r["name"] not in names]  # a type stopped part way runs again whole
            for result in run_type(names, found, tuple(options.steps), crashed):
                record(result, f"type {number + 1}/{len(order)}")
    for row in counts(results):
        print(row)
    if options.write_expected:
        write_json(EXPECTED, expected_from(results))


def versions() -> dict:
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__}


def write_json(path: Path, data: dict) -> None:
    """``data`` written to ``path`` in full, then renamed into place (a stopped run leaves the last whole file)."""
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    partial.replace(path)


if __name__ == "__main__":
    main()
