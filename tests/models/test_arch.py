"""Tests for models.arch: every architecture builds, serves its example inputs and its other shapes with finite
outputs, is deterministic per seed, is exportable exactly when it says so, and keeps the structure of the model
it copies (parameter counts, convolution counts, the detector's post-processing, the constant-Q filters); the
ONNX helpers give valid models that onnxruntime runs within 1e-4 of torch."""

from __future__ import annotations

import functools
import math
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from models import ARCHS, ArchCase, ModelCase, build_arch
from models.arch import audio_onnx, db_onnx
from models.audio import ConstantQ
from models.detection import box_iou, nms
from models.vision import _window_mask

KINDS = {"depthwise-cnn", "grouped-cnn", "rnn", "transformer", "decoder-llm", "ssm", "detector", "audio",
         "segmentation"}
# torchvision's published parameter counts of the models whose layouts the registry copies
TORCHVISION_PARAMS = {
    "mobilenet_v3_small": 2_542_856,
    "regnet_y_400mf": 4_344_144,
    "efficientnet_b0": 5_288_548,
    "convnext_tiny": 28_589_128,
    "swin_t": 28_288_354,
}
# Default-run sizes for the architectures whose own shapes take seconds on two CPU cores; their own shapes
# run in the slow tests.
QUICK = {"convnext_tiny": 64, "swin_t": 64, "efficientnet_b0": 96, "regnet_y_400mf": 96,
         "db_text_detector": 128, "mamba": 16, "detector": 128}
EXPORT_QUICK = ("lstm", "gru", "interpolate_net", "qwen2", "distilbert", "detector")


@functools.cache
def _case(name: str) -> ArchCase:
    """One build per architecture (at its default-run shape), shared by the tests that only run it."""
    return build_arch(name, shape=QUICK.get(name))


def _tensors(out) -> list[torch.Tensor]:
    """Every tensor of a model output: tensors, tuples, dicts and ModelOutputs, and the keys and values of a
    transformers cache."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        return [t for v in out.values() for t in _tensors(v)]
    if isinstance(out, (tuple, list)):
        return [t for v in out for t in _tensors(v)]
    if hasattr(out, "layers"):  # DynamicCache
        return [t for layer in out.layers for t in (layer.keys, layer.values)]
    raise TypeError(f"unexpected output {type(out).__name__}")


def _run(case: ArchCase, inputs: tuple) -> list[torch.Tensor]:
    with torch.no_grad():
        return _tensors(case.model(*inputs, **case.example_kwargs))


def _check_serves(case: ArchCase, batch: int, shape) -> None:
    outputs = _run(case, case.make_inputs(3, batch, shape))
    assert outputs, case.name
    for out in outputs:
        if out.is_floating_point():
            assert torch.isfinite(out).all(), (case.name, batch, shape)
    assert outputs[0].shape[0] == batch


def test_registry():
    assert len(ARCHS) == len(set(ARCHS)) >= 18
    for name in ("mobilenet_v3_small", "regnet_y_400mf", "efficientnet_b0", "convnext_tiny", "swin_t", "lstm",
                 "gru", "transformer_encoder", "mamba", "mistral", "mistral_cache", "qwen2", "t5_small",
                 "interpolate_net", "detector", "audio_cqt", "db_text_detector"):
        assert name in ARCHS
    with pytest.raises(KeyError, match="unknown architecture 'nope'"):
        build_arch("nope")


@pytest.mark.parametrize("name", ARCHS)
def test_case_facts(name):
    case = _case(name)
    assert isinstance(case, ModelCase) and case.name == name
    assert case.kind in KINDS
    assert not case.model.training
    assert case.description and "\n" not in case.description
    (b1, s1), (b2, s2), (b3, s3) = case.other_shapes
    assert b1 == 1 and b2 > 1 and b3 == 1 and s1 == s2 != s3
    assert case.batch == 1 and case.shape == QUICK.get(name, s1)
    if name in TORCHVISION_PARAMS:
        assert sum(p.numel() for p in case.model.parameters()) == TORCHVISION_PARAMS[name]


@pytest.mark.parametrize("name", ARCHS)
def test_runs(name):
    """Example inputs, then the other shapes (for the heavy models: batch 3 at the reduced shape)."""
    case = _case(name)
    outputs = _run(case, case.example_inputs)
    assert outputs[0].std() > 0
    for batch, shape in [(3, case.shape)] if name in QUICK else case.other_shapes:
        _check_serves(case, batch, shape)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(QUICK))
def test_runs_at_own_shapes(name):
    case = build_arch(name)
    _check_serves(case, 1, case.shape)
    for batch, shape in case.other_shapes:
        _check_serves(case, batch, shape)


@pytest.mark.parametrize("name", ARCHS)
def test_deterministic(name):
    shape = QUICK.get(name)
    a, b = _case(name), build_arch(name, shape=shape)
    for (key, x), y in zip(a.model.state_dict().items(), b.model.state_dict().values(), strict=False):
        assert torch.equal(x, y), key
    for x, y in zip(_run(a, a.example_inputs), _run(b, a.example_inputs), strict=False):
        assert torch.equal(x, y)
    assert all(torch.equal(x, y) for x, y in zip(a.make_inputs(0), a.example_inputs, strict=False))
    assert all(torch.equal(x, y) for x, y in zip(a.make_inputs(5, 2), b.make_inputs(5, 2), strict=False))
    assert not torch.equal(a.make_inputs(1)[0], a.example_inputs[0])
    other = build_arch(name, shape=shape, seed=1)
    assert any(not torch.equal(x, y) for x, y in zip(a.model.parameters(), other.model.parameters(), strict=False))


def test_make_inputs_shapes():
    swin = build_arch("swin_t", batch=2)
    assert swin.example_inputs[0].shape == (2, 3, 224, 224)
    assert swin.make_inputs(0, batch=1, shape=(192, 256))[0].shape == (1, 3, 192, 256)
    t5 = build_arch("t5_small", shape=20)
    ids, mask, decoder = t5.make_inputs(0, batch=4)
    assert ids.shape == mask.shape == (4, 20) and decoder.shape == (4, 10)
    assert mask[0].all() and (ids[mask == 0] == 0).all() and (decoder[:, 0] == 0).all()
    assert build_arch("audio_cqt").example_inputs[0].shape == (1, 16000)


def test_build_leaves_global_rng_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_arch("lstm").make_inputs(4)
    assert torch.equal(torch.rand(3), expected)


def _exports(case: ArchCase) -> bool:
    try:
        torch.export.export(case.model, case.example_inputs, case.example_kwargs, strict=False)
    except Exception:  # noqa: BLE001 - any failure to capture counts: data-dependent guards, unknown output types, ...
        return False
    return True


@pytest.mark.parametrize("name", EXPORT_QUICK)
def test_exportable_flag_quick(name):
    case = build_arch(name, shape=QUICK.get(name))
    assert _exports(case) == case.exportable


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in ARCHS if n not in EXPORT_QUICK + ("mistral_cache",)])
def test_exportable_flag(name):
    case = build_arch(name)
    assert _exports(case) == case.exportable


def test_cache_output_blocks_export():
    """mistral_cache is marked not exportable: torch.export refuses the DynamicCache in its output, unless
    the process has registered a pytree for it (transformers' executorch helpers do)."""
    from transformers import DynamicCache

    case = build_arch("mistral_cache", shape=8)
    assert not case.exportable
    assert _exports(case) == (DynamicCache in torch.utils._pytree.SUPPORTED_NODES)


def test_detector_parts_export_and_outputs():
    case = build_arch("detector", batch=2, shape=128)
    model = case.model
    images = case.example_inputs[0]
    features = torch.export.export(model.backbone, (images,), strict=False).module()(images)
    pyramid = torch.export.export(model.fpn, (features,), strict=False).module()(features)
    torch.export.export(model.rpn, (pyramid,), strict=False)
    torch.export.export(model.box_head, (torch.randn(5, 64, 7, 7),), strict=False)

    with torch.no_grad():
        boxes, scores, labels = model(images)
    assert boxes.shape == (2, 20, 4) and scores.shape == labels.shape == (2, 20)
    for b in range(2):
        kept = labels[b] >= 0
        assert kept.any() and (labels[b][~kept] == -1).all() and (scores[b][~kept] == 0).all()
        assert (scores[b][kept].diff() <= 0).all() and (scores[b][kept] > 0.05).all()
        box = boxes[b][kept]
        assert (box[:, 2:] >= box[:, :2]).all() and box.min() >= 0 and box.max() <= 128
        for i in range(len(box)):  # class-aware NMS: no two kept boxes of one class overlap beyond 0.5
            same = (labels[b][kept] == labels[b][kept][i]).nonzero().squeeze(1)
            same = same[same != i]
            assert (box_iou(box[i], box[same]) <= 0.5 + 1e-6).all()


def test_nms():
    boxes = torch.tensor([[0, 0, 10, 10], [1, 1, 11, 11], [20, 20, 30, 30], [0, 0, 10, 9.0], [21, 20, 30, 30]])
    scores = torch.tensor([0.9, 0.8, 0.7, 0.95, 0.6])
    assert nms(boxes, scores, 0.5, 10).tolist() == [3, 2]
    assert nms(boxes, scores, 0.95, 10).tolist() == [3, 0, 1, 2, 4]
    assert nms(boxes, scores, 0.95, 2).tolist() == [3, 0]
    assert nms(boxes[:0], scores[:0], 0.5, 10).tolist() == []


def test_db_structure_and_binarization():
    case = build_arch("db_text_detector", shape=96)
    convs = [m for m in case.model.modules() if isinstance(m, (torch.nn.Conv2d, torch.nn.ConvTranspose2d))]
    assert len(convs) == 49
    with torch.no_grad():
        binary, p, t = case.model(*case.example_inputs)
    assert binary.shape == p.shape == t.shape == (1, 1, 96, 96)
    torch.testing.assert_close(binary, torch.sigmoid(50 * (p - t)))
    assert p.std() > 0.05 and t.std() > 0.05  # the maps spread over (0, 1), not all near 0.5


def test_constant_q_peaks_at_the_tone():
    cqt = ConstantQ()
    assert cqt.real.weight.shape == (72, 1, 4115) and cqt.real.stride == (256,)
    t = torch.arange(16000) / 16000
    for k in (5, 30, 60):
        freq = 65.41 * 2 ** (k / 12)
        with torch.no_grad():
            mag = cqt(0.3 * torch.sin(2 * math.pi * freq * t)[None])
        frame = mag[0, :, mag.shape[-1] // 2]
        assert frame.argmax() == k
        assert frame[k] == pytest.approx(0.15, rel=0.02)  # half the amplitude


def test_swin_shift_mask():
    """On a 14x14 map (four 7x7 windows) shifted by 3, the top-left window holds one image region and the
    bottom-right one four (4x4, 4x3, 3x4, 3x3 positions): attention stays inside a region."""
    mask = _window_mask(14, 14, 7, (3, 3), torch.device("cpu"))
    assert mask.shape == (4, 49, 49)
    assert (mask[0] == 0).all()
    assert int((mask[3] == 0).sum()) == 16 ** 2 + 12 ** 2 + 12 ** 2 + 9 ** 2
    assert set(mask.unique().tolist()) == {-100.0, 0.0}
    only_rows = _window_mask(14, 7, 7, (3, 0), torch.device("cpu"))  # one window wide: no shift across
    assert int((only_rows[1] == 0).sum()) == 28 ** 2 + 21 ** 2


def test_swin_serves_sizes_off_the_window_grid():
    """At 64x64 the first stage map (16x16) is padded to 21x21 and cropped back; images stay independent of
    the others in their batch, and non-square images work."""
    case = build_arch("swin_t", shape=64)
    x = case.make_inputs(0, batch=2)[0]
    with torch.no_grad():
        both = case.model(x)
        first = case.model(x[:1])
    torch.testing.assert_close(both[:1], first, rtol=1e-4, atol=1e-5)
    with torch.no_grad():
        assert case.model(case.make_inputs(0, shape=(64, 96))[0]).shape == (1, 1000)


def test_interpolate_net_keeps_even_sizes():
    case = build_arch("interpolate_net")
    for shape in (64, 100, (72, 120)):
        x = case.make_inputs(0, shape=shape)[0]
        with torch.no_grad():
            assert case.model(x).shape[-2:] == x.shape[-2:]


def _check_onnx(model: onnx.ModelProto, case: ArchCase, batches: tuple[int, ...]) -> None:
    onnx.checker.check_model(model, full_check=True)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    for seed, batch in enumerate(batches):
        inputs = case.make_inputs(seed + 1, batch=batch)
        expected = _run(case, inputs)
        feed = {i.name: x.numpy() for i, x in zip(session.get_inputs(), inputs, strict=False)}
        got = session.run(None, feed)
        assert len(got) == len(expected)
        for e, g in zip(expected, got, strict=False):
            np.testing.assert_allclose(g, e.numpy(), rtol=1e-4, atol=1e-4)


def test_audio_onnx(tmp_path):
    path = tmp_path / "audio.onnx"
    model = audio_onnx(path)
    assert onnx.load(path) == model
    assert model.opset_import[0].version == 17
    lengths = [n for n in model.graph.initializer if len(n.dims) == 3 and n.dims[-1] == 4115]
    assert len(lengths) == 2  # the real and imaginary filter banks
    _check_onnx(model, build_arch("audio_cqt"), (1, 3))


def test_db_onnx_small():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = db_onnx(shape=64)
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("Conv") + ops.count("ConvTranspose") == 49
    _check_onnx(model, build_arch("db_text_detector", shape=64), (1, 2))


@pytest.mark.slow
def test_db_onnx_full_size(tmp_path):
    model = db_onnx(tmp_path / "db.onnx")
    _check_onnx(model, build_arch("db_text_detector"), (1,))
