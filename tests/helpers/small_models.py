"""Small models the tests of several folders share: an ONNX MatMul graph, a torch MLP and its input, a module that
builds tensors on its input's device, a module that takes a plain flag through ``**kwargs``."""

from __future__ import annotations

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper
from torch import nn

F32 = TensorProto.FLOAT


def matmul_model(opset: int = 17, custom: bool = False) -> onnx.ModelProto:
    """x[2,8] @ W[8,8] (-> my.custom::Foo when ``custom``) -> MatMul W -> y."""
    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((8, 8)).astype(np.float32) * 0.3, "W")
    middle = "h"
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"], name="mm")]
    imports = [helper.make_opsetid("", opset)]
    if custom:
        nodes.append(helper.make_node("Foo", ["h"], ["c"], name="foo", domain="my.custom"))
        imports.append(helper.make_opsetid("my.custom", 1))
        middle = "c"
    nodes.append(helper.make_node("MatMul", [middle, "W"], ["y"], name="mm2"))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F32, [2, 8])],
                              [helper.make_tensor_value_info("y", F32, [2, 8])], [w],
                              value_info=[helper.make_tensor_value_info("c", F32, [2, 8])] if custom else [])
    return helper.make_model(graph, opset_imports=imports)


def mlp() -> torch.nn.Module:
    """A 4 -> 4 -> 2 MLP with a ReLU (unseeded: only its structure matters where it is used)."""
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))


X = (torch.ones(2, 4),)  # the example call of mlp()


class Positions(nn.Module):
    """Adds learned position embeddings for positions built on the input's device, as transformers do."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.embed = nn.Embedding(64, width)
        self.fc1, self.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        self.norm = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(x.shape[1], device=x.device)
        h = x + self.embed(positions)
        mask = torch.ones(x.shape[:2], device=x.device).unsqueeze(-1)
        return self.norm(h + self.fc2(torch.relu(self.fc1(h))) * mask)


class Flagged(nn.Module):
    """A linear layer that takes a plain value through ``**kwargs`` (``double``), as transformers models take
    ``return_dict=True``."""

    def __init__(self, width: int = 4):
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, **kwargs) -> torch.Tensor:
        y = self.fc(x)
        return y * 2 if kwargs.get("double") else y


class Split(nn.Module):
    """Two linear stages with a graph break between them: the second graph takes an activation."""

    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(16, 32), nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.first(x))
        torch._dynamo.graph_break()
        return self.second(h)
