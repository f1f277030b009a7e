"""The text of a program's ``models/model.json`` that torch evaluates or pastes into Python source, checked
against the forms torch writes before torch reads any of it.

torch 2.13 turns strings of the file into code in four places:

1. **Symbolic sizes.** Each ``expr_str`` goes through ``sympy.sympify``, which evaluates it as Python.
2. **Guards.** ``ExportedProgram.module()`` pastes each ``guards_code`` string into the source of a function
   (``torch/export/_unlift.py``) and ``exec``\\ s it: a newline and a ``#`` in the string put statements of the
   file's own into that function, or before it.
3. **Names.** The graph module's generated ``forward`` spells the program's argument names
   (``forward_arg_names``) and keyword names (the input spec's dict keys) as written, and an attribute or
   subgraph name that is not an identifier inside ``getattr(self, "...")``.
4. **String constants.** A string graph input is pasted between quotes into a guard; keys of the sample
   inputs become subscripts of the guards.

It also looks up every operator the program names by ``getattr`` (``torch.os.system`` is :func:`os.system`),
and the graph calls it: each must be one :mod:`amppass.archive.operators` vouches for.

So before torch reads the file, every such string must have the one form torch writes:

- an expression is arithmetic on size symbols (:func:`check_expression`), small enough that evaluating it is
  cheap: a bounded number of calls, arguments (a ``Max`` or ``Min`` counted once nested ones are flattened,
  as sympy does), powers and terms once multiplied out, finite numbers whose text is short;
- a guard is a comparison of sizes of the inputs (:func:`check_guard`): ``L['x'].size()[0] != 1``, bounded in
  what it computes (no arithmetic on constants alone or on text, small numbers only);
- an argument or subgraph name is an identifier, an attribute path is dotted identifiers or indices, and
  any other string (op arguments, dict keys, type names) is printable ASCII without quotes or backslashes;
- a range key is a size symbol whose index is at most :data:`MAX_SYMBOL_INDEX` (torch counts up to it).
"""

from __future__ import annotations

import ast
import json
import keyword
import math
import re
from typing import Any, Callable, Iterator

from ..errors import InputError
from .operators import graph_operators, operator_refusal

MAX_EXPRESSION = 4096  # characters of one symbolic-size expression or guard
MAX_EXPRESSIONS = 200_000  # symbolic sizes in one program: torch runs sympify on each (about 50 us apiece)
MAX_SYMBOL_INDEX = 999_999  # s0 ... s999999: torch's reader counts up to the largest unbacked index
MAX_RANGES = 100_000  # range-constraint entries
MAX_ARGUMENTS = 32  # arguments of one call in an expression (Max(s0, ..., s599) takes sympy minutes)
MAX_EXTREMA = 16  # arguments of a Max or Min once nested ones are flattened, as sympy does (16: 0.1 s, 128: 12 s)
MAX_TERMS = 4096  # terms of an expression multiplied out ((s0 + ... + s11)**16 has millions)
MAX_EXPONENT, MAX_POWERS, MAX_DIGITS = 16, 3, 40  # a number's exponent, powers, digits of a number
MAX_PRECISION = 1024  # bits of a sympy Float
MAX_TEXT = 1024  # characters of a name or string constant

TRUST_HINT = ("If you trust the file's author, load it with amppass.load(path, trusted=True) "
              "(CLI: --trust-pickle), which lets torch run what the file holds")

# names a symbolic-size expression may call or name besides size symbols: the functions torch's deserializer
# gives sympify (GraphModuleDeserializer.sympy_functions) and the sympy classes srepr() writes for sizes
SYMPY_NAMES = frozenset({
    "FloorDiv", "ModularIndexing", "Where", "PythonMod", "Mod", "CleanDiv", "CeilToInt", "FloorToInt", "CeilDiv",
    "LShift", "RShift", "PowByNatural", "FloatPow", "FloatTrueDiv", "IntTrueDiv", "IsNonOverlappingAndDenseIndicator",
    "TruncToFloat", "TruncToInt", "RoundToInt", "RoundDecimal", "ToFloat", "Identity",
    "Symbol", "Integer", "Rational", "Float", "Add", "Mul", "Pow", "Max", "Min", "Abs", "floor", "ceiling",
    "Equality", "Unequality", "StrictLessThan", "LessThan", "StrictGreaterThan", "GreaterThan", "Eq", "Ne", "Lt",
    "Le", "Gt", "Ge", "And", "Or", "Not", "Piecewise", "ExprCondPair", "ITE", "sqrt", "oo", "zoo", "nan", "true",
    "false", "Half", "One", "Zero", "NegativeOne", "Infinity", "NegativeInfinity", "NaN", "BooleanTrue",
    "BooleanFalse",
})
_ASSUMPTIONS = frozenset({"positive", "negative", "nonnegative", "nonpositive", "integer", "real", "finite",
                          "infinite", "zero", "nonzero", "even", "odd", "rational", "extended_real", "commutative",
                          "evaluate"})
_SYMBOL = re.compile(r"[a-z]+(\d+)")
_LITERAL = re.compile(r"(\d+\.?\d*|\.\d+)([eE][-+]?\d{1,3})?|True|False")  # a number as torch writes it
_NUMBER_TEXT = re.compile(r"[-+]?\d{1,40}(\.\d{0,40})?(e[-+]?\d{1,3})?")
_POWERS = ("Pow", "PowByNatural", "FloatPow")
_PRODUCTS = ("Mul",)

# what torch's guard printer (ShapeGuardPythonPrinter) writes: functions by name, math.* and torch.sym_* calls,
# and the size accessors of an input
_GUARD_FUNCTIONS = frozenset({"max", "min", "abs", "round", "float", "int"})
_GUARD_MODULE_NAMES = {
    "math": frozenset({"floor", "ceil", "trunc", "sqrt", "inf", "nan", "isnan", "cos", "cosh", "acos", "sin", "sinh",
                       "asin", "tan", "tanh", "atan", "log2", "exp", "log", "pow"}),
    "torch": frozenset({"sym_float", "sym_int", "sym_max", "sym_min", "sym_sqrt", "_sym_sqrt", "sym_ite", "sym_not"}),
}
_ACCESSORS = frozenset({"size", "stride", "storage_offset", "numel", "dim"})
_ATTRIBUTE = re.compile(r"[A-Za-z][A-Za-z0-9_]*")
_FQN = re.compile(r"[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*")
_TEXT = re.compile(r"[ !#-&(-\[\]-~]*")  # printable ASCII but the quotes and the backslash


def check_program(tree: Any, where: str) -> None:
    """Every string of a parsed ``models/model.json`` that torch evaluates or pastes into source (module
    docstring), in one walk; InputError naming ``where`` and the string otherwise."""
    expressions = 0
    guards = tree.get("guards_code", []) if isinstance(tree, dict) else []
    for text in guards if isinstance(guards, list) else [guards]:
        check_guard(text, where)
    ranges = tree.get("range_constraints", {}) if isinstance(tree, dict) else {}
    if isinstance(ranges, dict):
        if len(ranges) > MAX_RANGES:
            raise _refuse(where, f"has {len(ranges):,} range constraints, more than the {MAX_RANGES:,} amppass reads")
        for key in ranges:
            check_symbol(key, f"{where}: range constraint")
    module = tree.get("graph_module") if isinstance(tree, dict) else None
    if isinstance(module, dict):
        _check_signature(module.get("signature"), where)
        _check_call_graph(module.get("module_call_graph"), where)
        _check_operators(module.get("graph"), where)
    for key, value in _items(tree):
        if key == "inputs" and isinstance(value, list):  # a graph's inputs, or a node's named arguments
            for argument in value:
                if isinstance(argument, dict) and "as_string" in argument:
                    check_text(argument["as_string"], f"{where}: string input")
        elif key == "expr_str":
            expressions += 1
            if expressions > MAX_EXPRESSIONS:
                raise _refuse(where, f"holds more than {MAX_EXPRESSIONS:,} symbolic sizes")
            check_expression(value, where)
        elif key == "as_graph" and isinstance(value, dict):
            check_identifier(value.get("name"), f"{where}: subgraph name")
            _check_operators(value.get("graph"), where)
        elif key == "as_operator":
            _check_operator(value, f"{where}: an argument", target=False)


def _check_operators(graph: Any, where: str) -> None:
    """Every operator a serialised graph's nodes name (:mod:`amppass.archive.operators`), by node."""
    for name, text, target in graph_operators(graph):
        _check_operator(text, f"{where}: node {name[:80]!r}", target)


def _check_operator(text: Any, where: str, target: bool) -> None:
    why = operator_refusal(text, target)
    if why is not None:
        raise InputError(f"{where}: operator {_shown(text)} {why}; torch would look it up by name and the graph "
                         f"would call it, and amppass reads only the operators torch.export writes. {TRUST_HINT}")


def _items(tree: Any) -> Iterator[tuple[str, Any]]:
    """(key, value) of every object member in ``tree``, node metadata (stack traces, annotations) left out."""
    pending = [tree]
    while pending:
        item = pending.pop()
        if isinstance(item, dict):
            for key, value in item.items():
                if key == "metadata":
                    continue
                yield key, value
                if isinstance(value, (dict, list)):
                    pending.append(value)
        elif isinstance(item, list):
            pending.extend(v for v in item if isinstance(v, (dict, list)))


def _check_signature(signature: Any, where: str) -> None:
    """The graph signature's names (parameter, buffer and constant paths torch makes attributes of) and its
    string inputs (pasted between quotes into a guard)."""
    for key, value in _items(signature):
        if key == "as_string":
            check_text(value, f"{where}: string input")
        elif isinstance(value, str):
            check_attribute_path(value, f"{where}: graph signature")


def _check_call_graph(calls: Any, where: str) -> None:
    """Each call signature: argument names (identifiers) and the input and output specs' keys and types."""
    for call in calls if isinstance(calls, list) else []:
        signature = call.get("signature") if isinstance(call, dict) else None
        if isinstance(call, dict):
            check_text(call.get("fqn", ""), f"{where}: module call")
        if not isinstance(signature, dict):
            continue
        for name in signature.get("forward_arg_names") or []:
            check_identifier(name, f"{where}: forward argument name")
        for spec in ("in_spec", "out_spec"):
            text = signature.get(spec)
            if text is not None:
                _check_spec(text, f"{where}: {spec}")


def _check_spec(text: Any, where: str) -> None:
    """A serialised pytree spec: its type names and every key of its contexts are plain text."""
    for _, value in _spec_strings(text, where):
        check_text(value, where)


def spec_types(tree: Any) -> set[str]:
    """The type names the input and output specs of a parsed ``models/model.json`` use."""
    module = tree.get("graph_module") if isinstance(tree, dict) else None
    calls = module.get("module_call_graph") if isinstance(module, dict) else None
    found = set()
    for call in calls if isinstance(calls, list) else []:
        signature = call.get("signature") if isinstance(call, dict) else None
        for spec in ("in_spec", "out_spec"):
            text = signature.get(spec) if isinstance(signature, dict) else None
            found.update(v for k, v in _spec_strings(text, "spec") if k == "type")
    return found


def _spec_strings(text: Any, where: str) -> Iterator[tuple[str | None, str]]:
    """(key, string) for every string of a serialised pytree spec, its JSON-in-JSON contexts parsed."""
    def parse(value: Any) -> Any:
        if not isinstance(value, str):
            return value
        try:
            return json.loads(value)
        except (ValueError, RecursionError):
            raise _refuse(where, "is not JSON") from None

    pending: list[tuple[str | None, Any]] = [(None, parse(text))]
    while pending:
        key, item = pending.pop()
        if isinstance(item, dict):
            pending.extend((k, parse(v) if k == "context" else v) for k, v in item.items())
        elif isinstance(item, list):
            pending.extend((None, v) for v in item)
        elif isinstance(item, str):
            yield key, item


def check_identifier(text: Any, where: str) -> None:
    """A Python identifier (ASCII, not a keyword): what torch spells unquoted in generated source."""
    if not (isinstance(text, str) and text.isascii() and text.isidentifier() and not keyword.iskeyword(text)
            and len(text) <= MAX_TEXT):
        raise _refuse(where, f"{_shown(text)} is not a Python identifier, which torch writes there")


def check_attribute_path(text: Any, where: str) -> None:
    """A dotted path of identifiers or indices (``layers.0.weight``), as torch names parameters."""
    if not (isinstance(text, str) and len(text) <= MAX_TEXT and (not text or _FQN.fullmatch(text))):
        raise _refuse(where, f"{_shown(text)} is not a dotted attribute path, which torch writes there")


def check_text(text: Any, where: str) -> None:
    """Printable ASCII without quotes or backslashes: safe between the quotes torch pastes it into."""
    if not (isinstance(text, str) and len(text) <= MAX_TEXT and _TEXT.fullmatch(text)):
        raise _refuse(where, f"{_shown(text)} holds quotes, backslashes, control characters or non-ASCII text, "
                             "which torch pastes into Python source")


def check_symbol(text: Any, where: str) -> None:
    """A size symbol (``s31``, ``u4``) whose index is at most :data:`MAX_SYMBOL_INDEX`."""
    found = _SYMBOL.fullmatch(text) if isinstance(text, str) and len(text) <= 16 else None
    if found is None or int(found.group(1)) > MAX_SYMBOL_INDEX:
        raise _refuse(where, f"{_shown(text)} is not a size symbol with an index up to {MAX_SYMBOL_INDEX:,}")


def _shown(text: Any) -> str:
    """A string from the file as a message shows it: escaped, cut at 80 characters."""
    return repr(text[:80] if isinstance(text, str) else text)[:100]


def _refuse(where: str, why: str) -> InputError:
    return InputError(f"{where}: {why}; torch would run it as Python. {TRUST_HINT}")


def check_guard(text: Any, where: str) -> None:
    """A guard as torch's guard printer writes it: comparisons and arithmetic of input sizes
    (``L['x'].size()[0] != 1``, ``min(512, L['ids'].size()[1])``), nothing else; InputError otherwise.

    torch pastes the text into a function's source, so it must also be one line of printable ASCII without a
    comment, backslash or double quote.
    """
    def refuse(why: str) -> InputError:
        return InputError(f"{where}: guard {_shown(text)} {why}; torch pastes each guard into Python source and "
                          f"runs it. {TRUST_HINT}")

    if not isinstance(text, str) or len(text) > MAX_EXPRESSION:
        raise refuse(f"is not a string of at most {MAX_EXPRESSION} characters")
    if not (text.isascii() and text.isprintable()) or any(c in text for c in "#\\\""):
        raise refuse("holds a line break, comment, backslash, double quote or non-ASCII text")
    tree = _parse(text, refuse)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Expression, ast.Compare, ast.BoolOp, ast.BinOp, ast.UnaryOp, ast.operator,
                             ast.unaryop, ast.cmpop, ast.boolop, ast.Load)):
            continue
        if isinstance(node, ast.Constant):
            if isinstance(node.value, str):
                if not _TEXT.fullmatch(node.value):
                    raise refuse("subscripts with text other than a plain key")
            elif not isinstance(node.value, (bool, int, float)) or len(str(node.value)) > MAX_DIGITS:
                raise refuse(f"holds the constant {str(node.value)[:40]!r}")
        elif isinstance(node, ast.Name):
            if node.id not in ("L", *_GUARD_FUNCTIONS, *_GUARD_MODULE_NAMES):
                raise refuse(f"names {node.id!r}, which torch's guards do not")
        elif isinstance(node, ast.Subscript):
            if not isinstance(node.slice, ast.Constant) or not _rooted_at_input(node.value):
                raise refuse("subscripts something other than an input with a key or index")
        elif isinstance(node, ast.Attribute):
            module = node.value.id if isinstance(node.value, ast.Name) and node.value.id in _GUARD_MODULE_NAMES \
                else None
            if module is not None:
                if node.attr not in _GUARD_MODULE_NAMES[module]:
                    raise refuse(f"uses {module}.{node.attr}, which torch's guards do not")
            elif not (_rooted_at_input(node.value) and _ATTRIBUTE.fullmatch(node.attr)):
                raise refuse(f"reads the attribute {node.attr!r} of something other than an input")
        elif isinstance(node, ast.Call):
            _check_guard_call(node, refuse)
        else:
            raise refuse(f"holds Python syntax torch's guards do not ({type(node).__name__})")
        if isinstance(node, ast.Constant):
            _check_literal(text, node, refuse)
    try:
        _guard_value(tree.body, refuse)
    except RecursionError:
        raise refuse("nests deeper than torch's guards do") from None


# what a guard's arithmetic may compute: numbers of at most this many bits (a size is 64; ``x**16`` of one is
# 1,024), so that no guard costs more than microseconds; text only as a key or compared
MAX_GUARD_BITS = 1 << 16
_FLOAT_BITS = 1024  # int() of a float: at most 2**1024
_NUMBER, _INPUT, _TEXT_VALUE = "number", "input", "text"  # what a guard's subexpression computes


def _guard_value(node: ast.AST, refuse: Callable[[str], InputError]) -> tuple[str, int]:
    """(what ``node`` computes: a number, an input's own value or text; an upper bound of its bits) for a guard
    the syntax check passed; InputError where it computes on constants alone (torch folds those), computes with
    text, repeats an input's value, raises to a power or shifts by other than a small constant, or reaches
    :data:`MAX_GUARD_BITS`."""
    def value(item: ast.AST) -> tuple[str, int]:
        return _guard_value(item, refuse)

    def number(item: ast.AST) -> int:
        kind, bits = value(item)
        if kind == _TEXT_VALUE:
            raise refuse("computes with text")
        return bits

    if isinstance(node, ast.Constant):
        if isinstance(node.value, str):
            return _TEXT_VALUE, 0
        return _NUMBER, _FLOAT_BITS if isinstance(node.value, float) else max(int(node.value).bit_length(), 1)
    if isinstance(node, (ast.Compare, ast.BoolOp)):
        parts = [node.left, *node.comparators] if isinstance(node, ast.Compare) else node.values
        bits = max(value(p)[1] for p in parts)
        return _NUMBER, 1 if isinstance(node, ast.Compare) else bits
    if _rooted_at_input(node) or (isinstance(node, ast.Call) and _rooted_at_input(node.func)):
        sized = (isinstance(node, ast.Call) and node.func.attr not in ("size", "stride")) or (  # type: ignore[attr-defined]
            isinstance(node, ast.Subscript) and isinstance(node.value, ast.Call))  # x.size()[0], x.numel()
        return (_NUMBER, 64) if sized else (_INPUT, 64)
    if isinstance(node, ast.Attribute):  # math.inf, math.nan
        return _NUMBER, _FLOAT_BITS
    if not _has_input(node) and not (isinstance(node, ast.UnaryOp) and isinstance(node.operand, (ast.Constant,
                                                                                                   ast.Attribute))):
        raise refuse("computes on constants alone, which torch's guards never do")
    if isinstance(node, ast.UnaryOp):
        return _NUMBER, 1 if isinstance(node.op, ast.Not) else number(node.operand)
    if isinstance(node, ast.BinOp):
        return _NUMBER, _bounded(_binary_bits(node, value, number, refuse), refuse)
    assert isinstance(node, ast.Call)  # the syntax check admits nothing else
    name = ast.unparse(node.func)
    bits = [number(a) for a in node.args] or [1]
    if name in ("round", "int", "math.floor", "math.ceil", "math.trunc", "torch.sym_int"):
        if name == "round" and len(node.args) == 2 and not _small_constant(node.args[1], MAX_DIGITS):
            raise refuse(f"rounds to other than at most {MAX_DIGITS} digits")
        return _NUMBER, max(bits[0], _FLOAT_BITS)
    if name in ("max", "min", "abs", "torch.sym_max", "torch.sym_min", "torch.sym_ite"):
        return _NUMBER, max(bits)
    return _NUMBER, 1 if name == "torch.sym_not" else _FLOAT_BITS  # float(), math.*, torch.sym_float, sqrt


def _binary_bits(node: ast.BinOp, value: Callable[[ast.AST], tuple[str, int]], number: Callable[[ast.AST], int],
                 refuse: Callable[[str], InputError]) -> int:
    """An upper bound of the bits ``node`` computes (:func:`_guard_value`)."""
    (left_kind, left), (right_kind, right) = value(node.left), value(node.right)
    op = node.op
    if _TEXT_VALUE in (left_kind, right_kind) or isinstance(op, ast.MatMult):
        raise refuse("computes with text")
    if _INPUT in (left_kind, right_kind) and isinstance(op, (ast.Mult, ast.Pow, ast.LShift, ast.Mod)):
        other = node.right if left_kind == _INPUT else node.left
        if isinstance(op, ast.Mod) or not _small_constant(other, 1024):
            raise refuse("repeats, raises or formats an input's own value, which torch's guards never do")
    if isinstance(op, ast.Pow):
        if not _small_constant(node.right, MAX_EXPONENT):
            raise refuse(f"raises to a power other than a constant of at most {MAX_EXPONENT}")
        return left * max(int(abs(_number(node.right) or 0)), 1)
    if isinstance(op, ast.LShift):
        if not _small_constant(node.right, 64):
            raise refuse("shifts by other than a constant of at most 64")
        return left + 64
    if isinstance(op, ast.Mult):
        return left + right
    if isinstance(op, ast.Div):
        return _FLOAT_BITS
    return right if isinstance(op, ast.Mod) else max(left, right) + 1


def _bounded(bits: int, refuse: Callable[[str], InputError]) -> int:
    if bits > MAX_GUARD_BITS:
        raise refuse(f"computes numbers of more than {MAX_GUARD_BITS:,} bits")
    return bits


def _small_constant(node: ast.AST, limit: int) -> bool:
    """Whether ``node`` is a number (``3``, ``-2``, ``0.5``) of absolute value at most ``limit``."""
    found = _number(node)
    return found is not None and abs(found) <= limit


def _has_input(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Name) and n.id == "L" for n in ast.walk(node))


def _check_guard_call(node: ast.Call, refuse: Callable[[str], InputError]) -> None:
    if node.keywords or len(node.args) > MAX_ARGUMENTS or any(isinstance(a, ast.Starred) for a in node.args):
        raise refuse("calls a function with keywords, unpacking or too many arguments")
    func = node.func
    if isinstance(func, ast.Name) and func.id in _GUARD_FUNCTIONS:
        return
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id in _GUARD_MODULE_NAMES:
        return  # the attribute itself is checked as a node of its own
    if isinstance(func, ast.Attribute) and func.attr in _ACCESSORS and not node.args and _rooted_at_input(func.value):
        return
    raise refuse(f"calls {ast.unparse(func)[:40]!r}, which torch's guards do not")


def _rooted_at_input(node: ast.AST) -> bool:
    """Whether ``node`` is ``L`` followed by keys, indices, attributes and size accessors."""
    while True:
        if isinstance(node, ast.Name):
            return node.id == "L"
        if isinstance(node, ast.Subscript):
            node = node.value
        elif isinstance(node, ast.Attribute):
            node = node.value
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _ACCESSORS:
            node = node.func.value
        else:
            return False


def _parse(text: str, refuse: Callable[[str], InputError]) -> ast.Expression:
    try:
        return ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise refuse("is not an expression") from None


def check_expression(text: Any, where: str) -> None:
    """A symbolic size sympify may evaluate: arithmetic on size symbols with the functions torch's serializer
    writes (:data:`SYMPY_NAMES`), bounded so that evaluating it is cheap; InputError naming it otherwise.

    The text is parsed (never run) as a Python expression: no attribute access, subscripts or other names;
    at most :data:`MAX_ARGUMENTS` arguments a call, :data:`MAX_POWERS` powers of exponent at most
    :data:`MAX_EXPONENT`, :data:`MAX_TERMS` terms once multiplied out, finite numbers of at most
    :data:`MAX_DIGITS` digits, and symbol indices up to :data:`MAX_SYMBOL_INDEX`.
    """
    def refuse(why: str) -> InputError:
        return InputError(f"{where}: symbolic size {_shown(text)} {why}; torch would evaluate it as Python "
                          f"(sympy.sympify). {TRUST_HINT}")

    if not isinstance(text, str) or len(text) > MAX_EXPRESSION:
        raise refuse(f"is not a string of at most {MAX_EXPRESSION} characters")
    tree = _parse(text, refuse)
    operators = (ast.Expression, ast.BinOp, ast.UnaryOp, ast.Compare, ast.BoolOp, ast.Tuple, ast.operator,
                 ast.unaryop, ast.cmpop, ast.boolop, ast.Load)
    powers = 0
    for node in ast.walk(tree):
        powers += (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow)) or (
            isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _POWERS)
        if powers > MAX_POWERS:
            raise refuse(f"holds more than {MAX_POWERS} powers")
        if isinstance(node, ast.Name):
            if node.id not in SYMPY_NAMES and not _is_symbol(node.id):
                raise refuse(f"names {node.id!r}, neither a size symbol nor a function torch's serializer writes")
        elif isinstance(node, ast.Call):
            _check_call(node, refuse)
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow) and not _small_exponent(node.right):
            raise refuse(f"raises to a power beyond {MAX_EXPONENT}")
        elif isinstance(node, ast.Constant):
            _check_literal(text, node, refuse)
            _check_constant(node.value, refuse)
        elif not isinstance(node, (*operators, ast.keyword)):
            raise refuse(f"holds Python syntax other than arithmetic ({type(node).__name__})")
    try:
        terms = _terms(tree.body)
    except RecursionError:
        raise refuse("nests deeper than torch's serializer writes") from None
    if terms > MAX_TERMS:
        raise refuse(f"multiplies out to more than {MAX_TERMS:,} terms")


def _check_call(node: ast.Call, refuse: Callable[[str], InputError]) -> None:
    if not isinstance(node.func, ast.Name):
        raise refuse("calls something other than a named function")
    if len(node.args) > MAX_ARGUMENTS:
        raise refuse(f"calls {node.func.id} with {len(node.args)} arguments (at most {MAX_ARGUMENTS})")
    for item in node.keywords:
        value = item.value.value if isinstance(item.value, ast.Constant) else None
        if item.arg == "precision":
            if type(value) is not int or not 0 < value <= MAX_PRECISION:
                raise refuse(f"asks for a precision other than 1..{MAX_PRECISION} bits")
        elif item.arg not in _ASSUMPTIONS or type(value) is not bool:
            raise refuse(f"passes {item.arg!r}=..., not a symbol assumption")
    if node.func.id in _POWERS and len(node.args) == 2 and not _small_exponent(node.args[1]):
        raise refuse(f"raises to a power beyond {MAX_EXPONENT}")
    if node.func.id in ("Max", "Min") and _flattened(node, node.func.id) > MAX_EXTREMA:
        raise refuse(f"takes the {node.func.id} of more than {MAX_EXTREMA} values once nested {node.func.id}s are "
                     "flattened, as sympy does")


def _flattened(node: ast.AST, name: str) -> int:
    """How many arguments a call of ``name`` has once the calls of ``name`` among them are flattened into it."""
    count, pending = 0, [node]
    while pending:
        item = pending.pop()
        if isinstance(item, ast.Call) and isinstance(item.func, ast.Name) and item.func.id == name:
            pending.extend(item.args)
        else:
            count += 1
    return count


def _check_literal(text: str, node: ast.Constant, refuse: Callable[[str], InputError]) -> None:
    """A number written in ``text`` has at most :data:`MAX_DIGITS` digits and an exponent of at most three
    (``1e-999999999`` parses as 0.0, but sympy reads its text and works out the power exactly)."""
    if isinstance(node.value, str):
        return
    written = ast.get_source_segment(text, node) or ""
    if not _LITERAL.fullmatch(written) or sum(c.isdigit() for c in written.partition("e")[0].partition("E")[0]) \
            > MAX_DIGITS:
        raise refuse(f"writes the number {written[:40]!r} other than as torch does (at most {MAX_DIGITS} decimal "
                     "digits and an exponent of at most three)")


def _check_constant(value: Any, refuse: Callable[[str], InputError]) -> None:
    if isinstance(value, str):
        if _is_symbol(value):
            return
        if not _NUMBER_TEXT.fullmatch(value) or not math.isfinite(float(value)):
            raise refuse(f"holds the text {value[:40]!r}, neither a symbol's name nor a number")
    elif not isinstance(value, (bool, int, float)) or len(str(value)) > MAX_DIGITS or (
            isinstance(value, float) and not math.isfinite(value)):
        raise refuse(f"holds the constant {str(value)[:40]!r}")


def _is_symbol(name: str) -> bool:
    found = _SYMBOL.fullmatch(name)
    return found is not None and int(found.group(1)) <= MAX_SYMBOL_INDEX


def _small_exponent(node: Any) -> bool:
    """Whether an exponent is symbolic, or a number at most :data:`MAX_EXPONENT` in size (``Integer(n)`` too)."""
    value = _number(node)
    if value is not None:
        return abs(value) <= MAX_EXPONENT
    return not any(isinstance(n, ast.Constant) and not isinstance(n.value, str) for n in ast.walk(node)) or \
        isinstance(node, ast.Name)


def _number(node: Any) -> float | None:
    """The value of a numeric literal (``3``, ``-3``, ``Integer(3)``, ``Float('1.5')``), else None."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("Integer", "Float") \
            and len(node.args) == 1:
        node = node.args[0]
    sign = 1
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        node, sign = node.operand, -1 if isinstance(node.op, ast.USub) else 1
    if isinstance(node, ast.Constant) and not isinstance(node.value, bool):
        try:
            return sign * float(node.value)
        except (TypeError, ValueError, OverflowError):
            return math.inf
    return None


def _terms(node: ast.AST) -> int:
    """How many terms ``node`` has once multiplied out (an upper bound, capped past :data:`MAX_TERMS`):
    products multiply their factors' terms, a power raises its base's to its exponent, sums and every other
    function add theirs."""
    cap = MAX_TERMS + 1

    def product(values: list[int]) -> int:
        result = 1
        for value in values:
            result = min(result * value, cap)
        return result

    if isinstance(node, ast.BinOp):
        left, right = _terms(node.left), _terms(node.right)
        if isinstance(node.op, ast.Mult):
            return product([left, right])
        if isinstance(node.op, ast.Pow):
            return _power(left, node.right, cap)
        return min(left + right, cap)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id not in ("Integer", "Float",
                                                                                                 "Symbol", "Rational"):
        counts = [_terms(a) for a in node.args]
        if node.func.id in _PRODUCTS:
            return product(counts)
        if node.func.id in _POWERS and len(node.args) == 2:
            return _power(counts[0], node.args[1], cap)
        return min(sum(counts), cap)
    if isinstance(node, (ast.UnaryOp,)):
        return _terms(node.operand)
    if isinstance(node, (ast.Compare, ast.BoolOp, ast.Tuple)):
        children = [node.left, *node.comparators] if isinstance(node, ast.Compare) else \
            node.values if isinstance(node, ast.BoolOp) else node.elts
        return min(sum(_terms(c) for c in children), cap)
    return 1


def _power(base: int, exponent: ast.AST, cap: int) -> int:
    """Terms of ``base`` terms raised to ``exponent``: a symbolic exponent keeps a single term single."""
    value = _number(exponent)
    if value is None:
        return 1 if base == 1 else cap
    return min(base ** min(int(abs(value)), MAX_EXPONENT), cap)
