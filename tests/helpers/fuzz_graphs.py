"""Random test programs for the fuzz tests: one abstract program, emitted as an ONNX model or a torch module.

A :class:`Program` is a pool of live fp32 values of known shapes (graph inputs first) and a list of
:class:`Step` s, each reading values and weights and adding one or more values to the pool. The same
program becomes an ONNX model (:func:`to_onnx`, onnx.helper nodes, opset 17 or 18) and a torch module
(:class:`ProgramModule`, an interpreter over the steps that torch.export unrolls), so both front ends are
fuzzed with the same op families: MatMul/Gemm/Conv, elementwise, Softmax/LogSoftmax, reductions,
Exp/Log/Pow/Sqrt/Div, LayerNorm, Where over a comparison, Concat/Split/Transpose/Reshape, Casts, Constant
nodes, weights shared by several readers, several outputs taken from the middle of the graph.

Magnitudes are kept realistic so that fp16 and bf16 are expected to be accurate and any gross error is
the converter's: inputs are N(0, 1), matrices N(0, 1/fan_in), and the generator computes every value in
fp32 on the feeds the tests use, rejecting an op that makes a value non-finite, larger than ``ABS_MAX`` or
with an RMS outside ``[SCALE_MIN, SCALE_MAX]`` (repeated products drift far from any static estimate: a
value squared three times underflows fp16, which is fp16's range, not a converter bug). It also computes
every value a second time with every value and weight jittered by bf16's rounding and rejects an op whose
output that moves by more than ``NOISE_BUDGET``: ill-conditioned graphs (a dot product of two terms that
cancel, a log of values near 1, seven matmuls deep into a single scalar) fail in bf16 whatever the
converter does, so they test the graph rather than the converter. Domains are
respected (Log and Sqrt read ``|x| + eps``, Exp reads a value clipped to [-3, 3], Div divides by
``|x| + 1``), and every selection is a continuous function of its inputs (``Where(a > b, a, b)``): a
comparison of two nearly equal values may flip in low precision, which must not switch to an unrelated
value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import onnx
import torch
import torch.nn.functional as F
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper
from torch import nn

SCALE_MIN, SCALE_MAX, ABS_MAX = 0.05, 30.0, 300.0
DIMS = (2, 4, 8, 16)
FEED_SEEDS = (0, 1)  # the feeds the tests compare on; the generator measures every value on them
# Conditioning: every value and weight jittered by up to JITTER (bf16's rounding) must move each output
# by at most NOISE_BUDGET (norm-relative), a third of the bf16 tolerance of the tests.
JITTER, NOISE_BUDGET = 2.0**-8, 2e-2


def input_array(shape: tuple[int, ...], seed: int, index: int) -> np.ndarray:
    """Graph input ``index`` of feed ``seed``, drawn from N(0, 1)."""
    return np.random.default_rng([seed, index]).standard_normal(shape).astype(np.float32)


@dataclass
class Weight:
    """A float32 tensor read by steps: an initializer / Parameter, or a Constant node / buffer."""

    array: np.ndarray
    constant: bool


@dataclass
class Step:
    """One operation: ``op`` over ``args`` (int: a value index; str: a weight name) with attributes."""

    op: str
    args: list[int | str]
    attrs: dict[str, Any] = field(default_factory=dict)
    n_out: int = 1


@dataclass
class Body:
    """An If branch or a Loop body (ONNX only): ``steps`` over a pool whose first values are its owner's
    args (outer values read as outer-scope captures; a Loop's first is its loop-carried state, a body
    input), then its own; it returns pool value ``output``, of shape ``shape``."""

    steps: list[Step]
    output: int
    shape: tuple[int, ...]

    def __repr__(self) -> str:
        return (
            f"Body(-> {self.output}: " + "; ".join(f"{s.op}({', '.join(map(str, s.args))})" for s in self.steps) + ")"
        )


@dataclass
class Program:
    """Input shapes, weights, steps and the values returned; ``shapes`` lists every value's shape."""

    inputs: list[tuple[int, ...]]
    weights: dict[str, Weight]
    steps: list[Step]
    shapes: list[tuple[int, ...]]
    outputs: list[int]
    opset: int = 17
    named_nodes: bool = True  # False leaves ONNX node names empty (legal; the converter must name them)
    int_constants: bool = False  # ONNX shape/axes tensors as Constant nodes instead of initializers

    def feeds(self, seed: int = 0, scale: float = 1.0) -> list[np.ndarray]:
        """Graph inputs drawn from N(0, scale**2); the generator kept values in range for seeds in FEED_SEEDS
        and scale 1."""
        return [input_array(shape, seed, i) * np.float32(scale) for i, shape in enumerate(self.inputs)]

    def __repr__(self) -> str:
        lines = [f"Program(opset={self.opset}, inputs={self.inputs}, outputs={self.outputs})"]
        for name, w in self.weights.items():
            lines.append(f"  {name}: {'const' if w.constant else 'init'} {tuple(w.array.shape)}")
        value = len(self.inputs)
        for step in self.steps:
            outs = list(range(value, value + step.n_out))
            value += step.n_out
            lines.append(f"  v{outs} = {step.op}({', '.join(map(str, step.args))}) {step.attrs or ''}")
        return "\n".join(lines)


# -- generation ------------------------------------------------------------------------------------
class _Reject(Exception):
    """An op would take a value out of the realistic range; the op is undone and another drawn."""


class _Builder:
    """The program under construction. Every value is computed (fp32, torch) on the test feeds as it is
    added, so an op that would make a value non-finite, tiny or huge on them is rejected."""

    def __init__(self, draw: Callable, rng: np.random.Generator):
        self.draw, self.rng = draw, rng
        self.shapes: list[tuple[int, ...]] = []
        self.positive: list[bool] = []  # non-negative for every input, by construction
        self.values: list[list[torch.Tensor]] = []  # per value, one tensor per feed in FEED_SEEDS
        self.noisy: list[list[torch.Tensor]] = []  # the same, computed with every value and weight jittered
        self.weights: dict[str, Weight] = {}
        self.steps: list[Step] = []
        self.n_inputs = 0

    def add_input(self, shape: tuple[int, ...]) -> None:
        self.values.append([torch.from_numpy(input_array(shape, seed, self.n_inputs)) for seed in FEED_SEEDS])
        self.noisy.append([_jitter(v, (self.n_inputs, k)) for k, v in enumerate(self.values[-1])])
        self.shapes.append(shape)
        self.positive.append(False)
        self.n_inputs += 1

    def pick(self, ok: Callable[[int], bool] = lambda v: True) -> int | None:
        """A live value satisfying ``ok``; shrinks towards the most recent one (deep chains)."""
        found = [v for v in reversed(range(len(self.shapes))) if ok(v)]
        return found[self.draw(st.integers(0, len(found) - 1))] if found else None

    def weight(self, shape: tuple[int, ...], make: Callable[[np.random.Generator], np.ndarray]) -> str:
        """A weight of ``shape``: an existing one of that shape (a shared initializer) or a new one."""
        same = [name for name, w in self.weights.items() if w.array.shape == shape]
        if same and self.draw(st.booleans()):
            return same[self.draw(st.integers(0, len(same) - 1))]
        return self._new_weight(np.asarray(make(self.rng), np.float32).reshape(shape))

    def scalar(self, value: float) -> str:
        """A 0-d weight holding ``value``; an existing one with that value may be shared."""
        same = [n for n, w in self.weights.items() if w.array.shape == () and float(w.array) == np.float32(value)]
        if same and self.draw(st.booleans()):
            return same[0]
        return self._new_weight(np.asarray(value, np.float32))

    def _new_weight(self, array: np.ndarray) -> str:
        name = f"w{len(self.weights)}"
        self.weights[name] = Weight(array, constant=self.draw(st.booleans()))
        return name

    def emit(self, op: str, args: list[int | str], positive: bool = False, **attrs: Any) -> list[int]:
        """Append a step, computing its outputs on the feeds; raise :class:`_Reject` when any output has
        a non-finite value, an RMS outside ``[SCALE_MIN, SCALE_MAX]`` or a magnitude beyond ``ABS_MAX``."""
        step = Step(op, list(args), attrs)
        salt = len(self.steps) + 100 * len(self.weights)

        def run(source: list[list[torch.Tensor]], k: int, jitter: bool) -> list[torch.Tensor]:
            tensors = []
            for i, a in enumerate(args):
                if isinstance(a, str):
                    weight = torch.from_numpy(self.weights[a].array)
                    tensors.append(_jitter(weight, (salt, i, k)) if jitter else weight)
                else:
                    tensors.append(source[a][k])
            outs = _torch_step(step, tensors)
            return [_jitter(t, (salt, -j - 1, k)) for j, t in enumerate(outs)] if jitter else outs

        exact = list(zip(*(run(self.values, k, False) for k in range(len(FEED_SEEDS))), strict=False))
        noisy = list(zip(*(run(self.noisy, k, True) for k in range(len(FEED_SEEDS))), strict=False))
        for tensors, jittered in zip(exact, noisy, strict=False):
            _check(op, tensors, jittered)
        step.n_out = len(exact)
        self.steps.append(step)
        first = len(self.shapes)
        for tensors, jittered in zip(exact, noisy, strict=False):
            self.values.append(list(tensors))
            self.noisy.append(list(jittered))
            self.shapes.append(tuple(tensors[0].shape))
            self.positive.append(positive)
        return list(range(first, len(self.shapes)))

    def body(self, captured: list[int], values: list[list[torch.Tensor]] | None = None,
             noisy: list[list[torch.Tensor]] | None = None) -> _Builder:
        """A builder for an If branch or Loop body whose pool starts with the outer values ``captured``
        (or with ``values``/``noisy`` in their place: a loop's state after an iteration); weights are shared
        with this builder, so a body reads outer initializers and Constants as outer-scope captures."""
        sub = _Builder(self.draw, self.rng)
        sub.weights = self.weights
        sub.shapes = [self.shapes[v] for v in captured]
        sub.positive = [self.positive[v] for v in captured]
        sub.values = values if values is not None else [self.values[v] for v in captured]
        sub.noisy = noisy if noisy is not None else [self.noisy[v] for v in captured]
        sub.n_inputs = len(captured)
        return sub

    def add(self, op: str, args: list[int], attrs: dict[str, Any], exact: list[list[torch.Tensor]],
            noisy: list[list[torch.Tensor]], positive: bool = False) -> int:
        """Append a control-flow step whose output (per feed, exact and jittered) its bodies computed."""
        for tensors, jittered in zip(exact, noisy, strict=False):
            _check(op, tensors, jittered)
        self.steps.append(Step(op, list(args), attrs))
        self.values.append(exact[0])
        self.noisy.append(noisy[0])
        self.shapes.append(tuple(exact[0][0].shape))
        self.positive.append(positive)
        return len(self.shapes) - 1

    def checkpoint(self) -> tuple[int, int, list[str]]:
        return len(self.steps), len(self.shapes), list(self.weights)

    def rollback(self, mark: tuple[int, int, list[str]]) -> None:
        steps, values, weights = mark
        del self.steps[steps:], self.shapes[values:], self.positive[values:], self.values[values:]
        del self.noisy[values:]
        for name in [n for n in self.weights if n not in weights]:
            del self.weights[name]


def _check(op: str, tensors: tuple[torch.Tensor, ...] | list[torch.Tensor], jittered: Any) -> None:
    """Raise :class:`_Reject` unless every feed's value is finite and in range and its jittered twin
    moved by at most NOISE_BUDGET."""
    for t, n in zip(tensors, jittered, strict=False):
        rms = float(t.square().mean().sqrt())
        if not (torch.isfinite(t).all() and SCALE_MIN <= rms <= SCALE_MAX and t.abs().max() <= ABS_MAX):
            raise _Reject(op)
        if float((n - t).norm() / t.norm()) > NOISE_BUDGET:
            raise _Reject(op)


def _jitter(tensor: torch.Tensor, key: tuple[int, ...]) -> torch.Tensor:
    """``tensor`` with each element moved by a random relative amount up to bf16's rounding, 2**-8."""
    generator = torch.Generator().manual_seed(hash(key) & 0xFFFFFFFF)
    return tensor * (1 + JITTER * (2 * torch.rand(tensor.shape, generator=generator) - 1))


def _dense(shape: tuple[int, ...], fan_in: int) -> Callable[[np.random.Generator], np.ndarray]:
    return lambda rng: rng.standard_normal(shape) / math.sqrt(fan_in)


def _vector(shape: tuple[int, ...]) -> Callable[[np.random.Generator], np.ndarray]:
    """Bias- and gain-like vectors: 1 + N(0, 0.25) serves both as a gain and as an offset."""
    return lambda rng: 1.0 + 0.5 * rng.standard_normal(shape)


def _op_matmul(b: _Builder) -> bool:
    v = b.pick(lambda v: len(b.shapes[v]) >= 2)
    if v is None:
        return False
    k, m = b.shapes[v][-1], b.draw(st.sampled_from(DIMS))
    b.emit("matmul", [v, b.weight((k, m), _dense((k, m), k))])
    return True


def _op_matmul_values(b: _Builder) -> bool:
    """a @ b^T of two activations of one shape (attention scores)."""
    v = b.pick(lambda v: len(b.shapes[v]) >= 2)
    if v is None:
        return False
    u = b.pick(lambda u: b.shapes[u] == b.shapes[v])
    rank = len(b.shapes[v])
    (t,) = b.emit("transpose", [u], perm=list(range(rank - 2)) + [rank - 1, rank - 2])
    b.emit("matmul", [v, t])
    return True


def _op_gemm(b: _Builder) -> bool:
    v = b.pick(lambda v: len(b.shapes[v]) == 2)
    if v is None:
        return False
    k, m = b.shapes[v][1], b.draw(st.sampled_from(DIMS))
    trans_b = b.draw(st.booleans())
    w_shape = (m, k) if trans_b else (k, m)
    b.emit("gemm", [v, b.weight(w_shape, _dense(w_shape, k)), b.weight((m,), _vector((m,)))], trans_b=int(trans_b))
    return True


def _op_conv(b: _Builder) -> bool:
    v = b.pick(lambda v: len(b.shapes[v]) == 4)
    if v is None:
        return False
    c = b.shapes[v][1]
    kernel, m = b.draw(st.sampled_from([1, 3])), b.draw(st.sampled_from(DIMS))
    shape = (m, c, kernel, kernel)
    args: list[int | str] = [v, b.weight(shape, _dense(shape, c * kernel * kernel))]
    if b.draw(st.booleans()):
        args.append(b.weight((m,), _vector((m,))))
    b.emit("conv", args, kernel=kernel, pad=kernel // 2)
    return True


def _op_reshape(b: _Builder) -> bool:
    """(N, K) <-> (N, C, 2, 2) for convolutions, (B, N, K) -> (B*N, K); -1 keeps the batch free."""
    v = b.pick(lambda v: len(b.shapes[v]) in (3, 4) or (len(b.shapes[v]) == 2 and b.shapes[v][1] % 4 == 0))
    if v is None:
        return False
    shape = b.shapes[v]
    if len(shape) == 2:
        target = [-1, shape[1] // 4, 2, 2]
    elif len(shape) == 4:
        target = [-1, shape[1] * shape[2] * shape[3]]
    else:
        target = [-1, shape[2]]
    b.emit("reshape", [v], b.positive[v], shape=target)
    return True


def _op_binary(b: _Builder) -> bool:
    op = b.draw(st.sampled_from(["add", "sub", "mul"]))
    v = b.pick()
    kind = b.draw(st.sampled_from(["value", "vector", "scalar"]))
    shape = b.shapes[v]
    if kind == "value":
        other: int | str = b.pick(lambda u: b.shapes[u] == shape)
        if op == "sub" and other == v:
            return False  # x - x is exactly zero: no relative error to speak of
    elif kind == "vector":
        other = b.weight((shape[-1],), _vector((shape[-1],)))
    else:
        other = b.scalar(b.draw(st.sampled_from([0.5, 2.0, -1.5])))
    b.emit(op, [v, other] if b.draw(st.booleans()) else [other, v])
    return True


def _op_div(b: _Builder) -> bool:
    """a / (|d| + 1): a denominator bounded away from zero."""
    v = b.pick()
    d = b.pick(lambda u: b.shapes[u] == b.shapes[v])
    b.emit("div", [v, _positive(b, d, 1.0)])
    return True


def _op_unary(b: _Builder) -> bool:
    op = b.draw(st.sampled_from(["relu", "tanh", "sigmoid", "abs", "neg", "cast"]))
    v = b.pick()
    b.emit(op, [v], op in ("relu", "sigmoid", "abs") or (b.positive[v] and op != "neg"))
    return True


def _op_softmax(b: _Builder) -> bool:
    op = b.draw(st.sampled_from(["softmax", "log_softmax"]))
    v = b.pick()
    axis = b.draw(st.integers(-len(b.shapes[v]), len(b.shapes[v]) - 1))
    b.emit(op, [v], op == "softmax", axis=axis)
    return True


def _op_reduce(b: _Builder) -> bool:
    op = b.draw(st.sampled_from(["reduce_sum", "reduce_mean"]))
    v = b.pick()
    rank = len(b.shapes[v])
    axes = sorted(b.draw(st.sets(st.integers(0, rank - 1), min_size=1, max_size=rank)))
    keep = len(axes) == rank or b.draw(st.booleans())  # no 0-d values
    b.emit(op, [v], b.positive[v], axes=axes, keepdims=int(keep))
    return True


def _op_exp(b: _Builder) -> bool:
    """exp of a value clipped to [-3, 3] (Clip's bounds are weights)."""
    v = b.pick()
    (c,) = b.emit("clip", [v, b.scalar(-3.0), b.scalar(3.0)])
    b.emit("exp", [c], True)
    return True


def _positive(b: _Builder, v: int, eps: float) -> int:
    """|v| + eps (v + eps when v is already non-negative)."""
    if not b.positive[v]:
        (v,) = b.emit("abs", [v], True)
    (p,) = b.emit("add", [v, b.scalar(eps)], True)
    return p


def _op_log_sqrt(b: _Builder) -> bool:
    op = b.draw(st.sampled_from(["log", "sqrt"]))
    p = _positive(b, b.pick(), 0.1)
    b.emit(op, [p], op == "sqrt")
    return True


def _op_pow(b: _Builder) -> bool:
    """x ** 2 or x ** 3 of any value; x ** 0.5 or x ** 1.5 of |x| + 0.1."""
    exponent = b.draw(st.sampled_from([2.0, 3.0, 0.5, 1.5]))
    v = b.pick()
    if exponent in (0.5, 1.5):
        v = _positive(b, v, 0.1)
    b.emit("pow", [v, b.scalar(exponent)], b.positive[v] or exponent == 2.0)
    return True


def _op_layer_norm(b: _Builder) -> bool:
    v = b.pick(lambda v: b.shapes[v][-1] >= 4)
    if v is None:
        return False
    k = b.shapes[v][-1]
    b.emit("layer_norm", [v, b.weight((k,), _vector((k,))), b.weight((k,), _vector((k,)))])
    return True


def _op_where(b: _Builder) -> bool:
    """Where(a > b, a, b) or Where(a < b, a, b): max/min, continuous where the comparison flips."""
    cmp = b.draw(st.sampled_from(["greater", "less"]))
    v = b.pick()
    shape = b.shapes[v]
    if b.draw(st.booleans()):
        other: int | str = b.pick(lambda u: b.shapes[u] == shape)
    else:
        other = b.weight((shape[-1],), _vector((shape[-1],)))
    b.emit("where", [v, other], cmp=cmp)
    return True


def _op_concat(b: _Builder) -> bool:
    v = b.pick()
    u = b.pick(lambda u: b.shapes[u] == b.shapes[v])
    b.emit("concat", [v, u], b.positive[v] and b.positive[u], axis=b.draw(st.integers(0, len(b.shapes[v]) - 1)))
    return True


def _op_split(b: _Builder) -> bool:
    v = b.pick(lambda v: any(d >= 2 for d in b.shapes[v]))
    if v is None:
        return False
    shape = b.shapes[v]
    axis = b.draw(st.sampled_from([i for i, d in enumerate(shape) if d >= 2]))
    first = b.draw(st.integers(1, shape[axis] - 1))
    b.emit("split", [v], b.positive[v], axis=axis, sizes=[first, shape[axis] - first])
    return True


def _op_transpose(b: _Builder) -> bool:
    v = b.pick()
    rank = len(b.shapes[v])
    perm = b.draw(st.permutations(range(rank)).filter(lambda p: list(p) != sorted(p)))
    b.emit("transpose", [v], b.positive[v], perm=list(perm))
    return True


def _branch(b: _Builder, captured: list[int]) -> Body:
    """A random body of 1 to 3 steps over ``captured`` returning a value of its own with the first
    captured value's shape (a unary step on the latest one of that shape if the random steps made none)."""
    sub = b.body(captured)
    shape, n_steps = sub.shapes[0], b.draw(st.integers(1, 3))
    for _ in range(4 * n_steps):
        if len(sub.steps) >= n_steps:
            break
        mark = sub.checkpoint()
        try:
            OPS[b.draw(st.sampled_from(sorted(OPS)))](sub)
        except _Reject:
            sub.rollback(mark)
    local = [v for v in range(sub.n_inputs, len(sub.shapes)) if sub.shapes[v] == shape]
    if not local:
        latest = max(v for v in range(len(sub.shapes)) if sub.shapes[v] == shape)
        local = sub.emit(b.draw(st.sampled_from(["tanh", "sigmoid", "neg"])), [latest])
    return Body(sub.steps, local[-1], shape)


def _captures(b: _Builder, first: int) -> list[int]:
    """``first`` and, half of the time, another outer value the body may read."""
    if b.draw(st.booleans()):
        other = b.pick(lambda u: u != first)
        if other is not None:
            return [first, other]
    return [first]


def _op_if(b: _Builder) -> bool:
    """If(mean(a) > t) over two random branches reading outer values. The threshold ``t`` sits halfway
    between a's means on the two feeds when they are far apart (each feed takes another branch), else a
    quarter of an RMS beyond both (one branch on both feeds); a mean at least a quarter of a's RMS from
    ``t`` on every feed, jittered too, means low precision cannot flip the branch taken."""
    a = b.pick()
    means = [float(x.mean()) for x in b.values[a]]
    rms = max(float(x.square().mean().sqrt()) for x in b.values[a])
    if max(means) - min(means) >= 0.5 * rms:
        threshold = (max(means) + min(means)) / 2
    elif b.draw(st.booleans()):
        threshold = min(means) - 0.25 * rms
    else:
        threshold = max(means) + 0.25 * rms
    threshold = float(np.float32(threshold))
    taken = [m > threshold for m in means]
    if any((float(n.mean()) > threshold) != t for n, t in zip(b.noisy[a], taken, strict=False)):
        raise _Reject("if")
    captured = _captures(b, a)
    then, other = _branch(b, captured), _branch(b, captured)
    (then_values, then_noisy), (else_values, else_noisy) = _replay(b, captured, then), _replay(b, captured, other)
    values = [t if c else e for t, e, c in zip(then_values, else_values, taken, strict=False)]
    noisy = [t if c else e for t, e, c in zip(then_noisy, else_noisy, taken, strict=False)]
    b.add("if", captured, {"then": then, "else": other, "threshold": threshold}, [values], [noisy])
    return True


def _op_loop(b: _Builder) -> bool:
    """Loop of 2 or 3 iterations of a random body over a loop-carried float state and outer values; every
    iteration is checked like a step (range, conditioning)."""
    state = b.pick()
    captured = _captures(b, state)
    body, trips = _branch(b, captured), b.draw(st.sampled_from([2, 3]))
    values, noisy = b.values[state], b.noisy[state]
    for _ in range(trips):
        values, noisy = _replay(b, captured, body, values, noisy)
    b.add("loop", captured, {"body": body, "trips": trips}, [values], [noisy])
    return True


def _replay(b: _Builder, captured: list[int], body: Body, state: list[torch.Tensor] | None = None,
            state_noisy: list[torch.Tensor] | None = None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``body``'s output per feed, exact and jittered, with its first captured value replaced by
    ``state`` (a loop's state after an iteration); raises :class:`_Reject` like :meth:`_Builder.emit`."""
    values = noisy = None
    if state is not None:
        values = [state] + [b.values[v] for v in captured[1:]]
        noisy = [state_noisy] + [b.noisy[v] for v in captured[1:]]
    sub = b.body(captured, values, noisy)
    for step in body.steps:
        sub.emit(step.op, step.args, **step.attrs)
    return sub.values[body.output], sub.noisy[body.output]


OPS: dict[str, Callable[[_Builder], bool]] = {
    "matmul": _op_matmul, "matmul_values": _op_matmul_values, "gemm": _op_gemm, "conv": _op_conv,
    "reshape": _op_reshape, "binary": _op_binary, "div": _op_div, "unary": _op_unary, "softmax": _op_softmax,
    "reduce": _op_reduce, "exp": _op_exp, "log_sqrt": _op_log_sqrt, "pow": _op_pow,
    "layer_norm": _op_layer_norm, "where": _op_where, "concat": _op_concat, "split": _op_split,
    "transpose": _op_transpose,
}
CONTROL: dict[str, Callable[[_Builder], bool]] = {"if": _op_if, "loop": _op_loop}  # ONNX only

_INPUT_SHAPES = st.one_of(
    st.tuples(st.sampled_from([1, 2, 3]), st.sampled_from(DIMS)),
    st.tuples(st.sampled_from([1, 2]), st.sampled_from([2, 3]), st.sampled_from(DIMS)),
    st.tuples(st.sampled_from([1, 2]), st.sampled_from([2, 4]), st.sampled_from([2, 4]), st.sampled_from([2, 4])),
)


@st.composite
def programs(draw: Callable, max_steps: int = 10, ops: tuple[str, ...] = tuple(OPS),
             control_flow: bool = False) -> Program:
    """A random :class:`Program` of about 1 to ``max_steps`` steps, op groups drawn from ``ops``;
    ``control_flow`` adds If and Loop steps (:data:`CONTROL`, for :func:`to_onnx` only)."""
    groups = {**OPS, **CONTROL} if control_flow else OPS
    ops = ops + tuple(CONTROL) * 3 if control_flow else ops  # about one program in two has If or Loop
    b = _Builder(draw, np.random.default_rng(draw(st.integers(0, 2**32 - 1))))
    first = draw(_INPUT_SHAPES)
    b.add_input(first)
    if draw(st.booleans()):  # a second input, of the same shape half of the time so values meet
        b.add_input(first if draw(st.booleans()) else draw(_INPUT_SHAPES))
    n_steps = draw(st.integers(1, max_steps))
    for _ in range(4 * n_steps):
        if len(b.steps) >= n_steps:
            break
        mark = b.checkpoint()
        try:
            groups[draw(st.sampled_from(ops))](b)
        except _Reject:
            b.rollback(mark)
    if not b.steps:
        b.emit("tanh", [0])
    last = len(b.shapes) - 1
    middle = list(range(b.n_inputs, last))
    extra = draw(st.lists(st.sampled_from(middle), max_size=2, unique=True)) if middle else []
    return Program(
        inputs=b.shapes[: b.n_inputs], weights=b.weights, steps=b.steps, shapes=b.shapes,
        outputs=extra + [last], opset=draw(st.sampled_from([17, 18])), named_nodes=draw(st.booleans()),
        int_constants=draw(st.booleans()),
    )


# -- ONNX emitter ----------------------------------------------------------------------------------
_ONNX_SIMPLE = {"add": "Add", "sub": "Sub", "mul": "Mul", "div": "Div", "relu": "Relu", "tanh": "Tanh",
                "sigmoid": "Sigmoid", "abs": "Abs", "neg": "Neg", "exp": "Exp", "log": "Log", "sqrt": "Sqrt",
                "pow": "Pow", "clip": "Clip", "matmul": "MatMul"}


def to_onnx(program: Program) -> onnx.ModelProto:
    """The program as an ONNX model (fp32 inputs ``v0``.., outputs ``v<i>``, weights ``w<j>``)."""
    nodes: list[onnx.NodeProto] = []
    inits: list[onnx.TensorProto] = []
    counter = [0]

    def name(op: str) -> str:
        counter[0] += 1
        return f"{op.lower()}_{counter[0]}" if program.named_nodes else ""

    scopes = [nodes]  # the graph being written: the main one, or an If branch / Loop body inside it

    def ints(values: list[int], scalar: bool = False) -> str:
        tensor_name = f"i{counter[0]}_{len(inits) + len(nodes)}"
        array = np.asarray(values[0] if scalar else values, np.int64)
        tensor = numpy_helper.from_array(array, tensor_name)
        if program.int_constants:
            scopes[-1].append(helper.make_node("Constant", [], [tensor_name], name=name("Constant"), value=tensor))
        else:
            inits.append(tensor)
        return tensor_name

    def node(op: str, inputs: list[str], outputs: list[str], **attrs: Any) -> None:
        scopes[-1].append(helper.make_node(op, inputs, outputs, name=name(op), **attrs))

    def body(b: Body, pool: list[str], prefix: str) -> tuple[list[onnx.NodeProto], str]:
        """The nodes of ``b`` over values named ``pool`` (outer names, a Loop's state input), and the
        name of the value it returns."""
        scopes.append([])
        names = list(pool)
        for step in b.steps:
            outs = [f"{prefix}{i}" for i in range(len(names), len(names) + step.n_out)]
            emit_step(step, [a if isinstance(a, str) else names[a] for a in step.args], outs)
            names += outs
        return scopes.pop(), names[b.output]

    def emit_step(step: Step, args: list[str], outs: list[str]) -> None:
        _onnx_step(step, args, outs, node, ints, program.opset, body)

    for wname, w in program.weights.items():
        tensor = numpy_helper.from_array(w.array, wname)
        if w.constant:
            node("Constant", [], [wname], value=tensor)
        else:
            inits.append(tensor)

    value = len(program.inputs)
    for step in program.steps:
        outs = [f"v{i}" for i in range(value, value + step.n_out)]
        value += step.n_out
        emit_step(step, [a if isinstance(a, str) else f"v{a}" for a in step.args], outs)

    def info(i: int) -> onnx.ValueInfoProto:
        return helper.make_tensor_value_info(f"v{i}", TensorProto.FLOAT, list(program.shapes[i]))

    graph = helper.make_graph(nodes, "fuzz", [info(i) for i in range(len(program.inputs))],
                              [info(i) for i in program.outputs], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", program.opset)])


def _onnx_step(step: Step, args: list[str], outs: list[str], node: Callable, ints: Callable, opset: int,
               body: Callable) -> None:
    a = step.attrs
    if step.op in ("if", "loop"):
        _onnx_control(step, args, outs, node, ints, body)
    elif step.op in _ONNX_SIMPLE:
        node(_ONNX_SIMPLE[step.op], args, outs)
    elif step.op == "cast":
        node("Cast", args, outs, to=TensorProto.FLOAT)
    elif step.op == "gemm":
        node("Gemm", args, outs, transB=a["trans_b"])
    elif step.op == "conv":
        node("Conv", args, outs, kernel_shape=[a["kernel"]] * 2, pads=[a["pad"]] * 4)
    elif step.op == "reshape":
        node("Reshape", [args[0], ints(a["shape"])], outs)
    elif step.op in ("softmax", "log_softmax"):
        node("Softmax" if step.op == "softmax" else "LogSoftmax", args, outs, axis=a["axis"])
    elif step.op in ("reduce_sum", "reduce_mean"):
        op = "ReduceSum" if step.op == "reduce_sum" else "ReduceMean"
        if op == "ReduceSum" or opset >= 18:  # ReduceSum takes axes as an input from opset 13, the rest from 18
            node(op, [args[0], ints(a["axes"])], outs, keepdims=a["keepdims"])
        else:
            node(op, args, outs, axes=a["axes"], keepdims=a["keepdims"])
    elif step.op == "layer_norm":
        node("LayerNormalization", args, outs, axis=-1, epsilon=1e-5)
    elif step.op == "where":
        cond = outs[0] + "_cond"
        node("Greater" if a["cmp"] == "greater" else "Less", args, [cond])
        node("Where", [cond, *args], outs)
    elif step.op == "concat":
        node("Concat", args, outs, axis=a["axis"])
    elif step.op == "split":
        if opset >= 18 and a["sizes"][0] * 2 == sum(a["sizes"]):
            node("Split", args, outs, axis=a["axis"], num_outputs=2)
        else:
            node("Split", [args[0], ints(a["sizes"])], outs, axis=a["axis"])
    elif step.op == "transpose":
        node("Transpose", args, outs, perm=a["perm"])
    else:
        raise ValueError(f"unknown step {step.op}")


def _onnx_control(step: Step, args: list[str], outs: list[str], node: Callable, ints: Callable,
                  body: Callable) -> None:
    """If(ReduceMean(args[0]) > threshold) with branches reading the outer ``args``, or Loop(trips) carrying
    ``args[0]`` through a body that also reads the outer ``args[1:]``."""
    out = outs[0]
    if step.op == "if":
        node("ReduceMean", [args[0]], [f"{out}_mean"], keepdims=0)
        node("Constant", [], [f"{out}_threshold"], value_float=step.attrs["threshold"])
        node("Greater", [f"{out}_mean", f"{out}_threshold"], [f"{out}_cond"])
        branches = {}
        for key, branch in (("then_branch", step.attrs["then"]), ("else_branch", step.attrs["else"])):
            nodes, result = body(branch, args, f"{out}_{key[:4]}")
            info = helper.make_tensor_value_info(result, TensorProto.FLOAT, list(branch.shape))
            branches[key] = helper.make_graph(nodes, f"{out}_{key}", [], [info])
        node("If", [f"{out}_cond"], outs, **branches)
        return
    loop = step.attrs["body"]
    state, keep = f"{out}_state", f"{out}_keep"
    nodes, result = body(loop, [state] + args[1:], f"{out}_body")
    nodes.append(helper.make_node("Identity", [f"{out}_iter_cond"], [keep]))
    graph = helper.make_graph(
        nodes, f"{out}_body",
        [helper.make_tensor_value_info(f"{out}_iter", TensorProto.INT64, []),
         helper.make_tensor_value_info(f"{out}_iter_cond", TensorProto.BOOL, []),
         helper.make_tensor_value_info(state, TensorProto.FLOAT, list(loop.shape))],
        [helper.make_tensor_value_info(keep, TensorProto.BOOL, []),
         helper.make_tensor_value_info(result, TensorProto.FLOAT, list(loop.shape))])
    node("Loop", [ints([step.attrs["trips"]], scalar=True), "", args[0]], outs, body=graph)


# -- torch emitter ---------------------------------------------------------------------------------
class ProgramModule(nn.Module):
    """Interprets a :class:`Program`: weights become Parameters, constant ones buffers; a weight read by
    several steps is one tensor read several times. ``forward`` returns the program's outputs as a tuple."""

    def __init__(self, program: Program):
        super().__init__()
        self.program = program
        for wname, w in program.weights.items():
            tensor = torch.from_numpy(w.array.copy())
            if w.constant:
                self.register_buffer(wname, tensor)
            else:
                self.register_parameter(wname, nn.Parameter(tensor))

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        values = list(inputs)
        for step in self.program.steps:
            args = [getattr(self, a) if isinstance(a, str) else values[a] for a in step.args]
            values.extend(_torch_step(step, args))
        return tuple(values[i] for i in self.program.outputs)


_TORCH_SIMPLE = {"add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div, "relu": torch.relu,
                 "tanh": torch.tanh, "sigmoid": torch.sigmoid, "abs": torch.abs, "neg": torch.neg, "exp": torch.exp,
                 "log": torch.log, "sqrt": torch.sqrt, "pow": torch.pow, "matmul": torch.matmul}


def _torch_step(step: Step, args: list[torch.Tensor]) -> list[torch.Tensor]:
    a = step.attrs
    if step.op in _TORCH_SIMPLE:
        return [_TORCH_SIMPLE[step.op](*args)]
    if step.op == "cast":
        return [args[0].to(torch.float32)]
    if step.op == "clip":
        return [torch.clamp(*args)]
    if step.op == "gemm":
        x, w, bias = args
        return [F.linear(x, w, bias) if a["trans_b"] else torch.addmm(bias, x, w)]
    if step.op == "conv":
        return [F.conv2d(args[0], args[1], args[2] if len(args) == 3 else None, padding=a["pad"])]
    if step.op == "reshape":
        return [args[0].reshape(a["shape"])]
    if step.op == "softmax":
        return [torch.softmax(args[0], a["axis"])]
    if step.op == "log_softmax":
        return [torch.log_softmax(args[0], a["axis"])]
    if step.op == "reduce_sum":
        return [torch.sum(args[0], a["axes"], keepdim=bool(a["keepdims"]))]
    if step.op == "reduce_mean":
        return [torch.mean(args[0], a["axes"], keepdim=bool(a["keepdims"]))]
    if step.op == "layer_norm":
        return [F.layer_norm(args[0], args[0].shape[-1:], args[1], args[2], 1e-5)]
    if step.op == "where":
        x, other = args
        return [torch.where(x > other if a["cmp"] == "greater" else x < other, x, other)]
    if step.op == "concat":
        return [torch.cat(args, a["axis"])]
    if step.op == "split":
        return list(torch.split(args[0], a["sizes"], a["axis"]))
    if step.op == "transpose":
        return [args[0].permute(a["perm"])]
    raise ValueError(f"unknown step {step.op}")


# -- calibration -----------------------------------------------------------------------------------
# 2 or 3 calibration feeds, all held out from the FEED_SEEDS the outputs are compared on, scaled by one of
# CALIBRATION_SCALES (inputs 1000 times smaller underflow fp16 a few ops in, 30 times larger overflow it
# after a cube or two: the range rules' business). The generator did not check these feeds' ranges; that
# is fine for calibration, whose statistics are made to catch ranges low precision cannot hold.
CALIBRATION_SEEDS = st.lists(st.integers(len(FEED_SEEDS), 2**16), min_size=2, max_size=3, unique=True)
CALIBRATION_SCALES = st.sampled_from([1.0, 1e-3, 30.0])
TOLERANCES = st.sampled_from([None, 1e-2, 1e-3, 1e-4])  # 1e-4 is below fp16's rounding: the search moves nodes


def check_calibration_info(info: dict, batches: int, tolerance: float | None, error: float) -> None:
    """The conversion's metadata after calibrating on ``batches`` feeds with ``tolerance``; ``error`` is
    the converted model's largest relative output error on those feeds, measured by the test: with a
    tolerance it must be the ``achieved_error`` the search reported, met exactly when within the tolerance."""
    assert info["calibrated"] is True and info["calibration_batches"] == batches, info
    if tolerance is None:
        assert "tolerance" not in info and "achieved_error" not in info, info
        return
    assert info["tolerance"] == tolerance, info
    assert info["tolerance_met"] is (info["achieved_error"] <= tolerance), info
    assert math.isclose(error, info["achieved_error"], rel_tol=1e-3, abs_tol=1e-6), (
        f"error on the calibration feeds {error:.6g} != achieved_error {info['achieved_error']:.6g}")


def check_calibrated_rows(rows: list, plain_rows: list, dtype: str, info: dict) -> None:
    """Calibration only moves nodes to fp32 (range rules and the tolerance search never lower one), so
    every node it runs low the plain conversion runs low; each node the search moved says so."""
    low = {r.name for r in rows if r.precision == dtype}
    plain_low = {r.name for r in plain_rows if r.precision == dtype}
    assert low <= plain_low, f"calibration lowered {sorted(low - plain_low)}"
    moved = [r.name for r in rows if r.source == "tolerance"]
    assert len(moved) == info.get("moved_by_tolerance", 0), (moved, info)
    assert all(r.precision == "fp32" for r in rows if r.source == "tolerance")


# -- the property's comparison ---------------------------------------------------------------------
def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    """``||got - want|| / ||want||`` over the elements where the fp32 ``want`` is finite.

    Raises AssertionError when ``got`` is not finite where ``want`` is, or when shapes or dtypes differ.
    """
    assert got.shape == want.shape, f"shape {got.shape} != fp32 shape {want.shape}"
    assert got.dtype == want.dtype, f"dtype {got.dtype} != fp32 dtype {want.dtype} (keep_io_types)"
    finite = np.isfinite(want)
    g, w = got[finite].astype(np.float64), want[finite].astype(np.float64)
    assert np.isfinite(g).all(), f"{np.count_nonzero(~np.isfinite(g))} non-finite values where fp32 is finite"
    return float(np.linalg.norm(g - w) / max(np.linalg.norm(w), 1e-30))
