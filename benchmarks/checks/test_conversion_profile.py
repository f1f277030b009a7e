"""The conversion_profile section's model: a 3D Swin segmentation net that runs at both sizes' window arithmetic
(the profile itself takes minutes: the section runs it)."""

import torch

from benchmarks import conversion_profile
from benchmarks.__main__ import SECTIONS


def test_the_3d_swin_net_segments_its_input_and_the_section_is_listed():
    model, (x,) = conversion_profile.build(quick=True)
    with torch.no_grad():
        out = model(x)
    assert out.shape == (1, 14, *x.shape[2:]) and torch.isfinite(out).all()
    assert sum(isinstance(m, torch.nn.Conv3d) for m in model.modules()) >= 3
    assert "conversion_profile" in SECTIONS
