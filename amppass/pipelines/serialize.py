"""``amppass.load``, and ``amppass.save`` of a torch model (:mod:`amppass.pipelines.save` sends it here): a converted
torch model as a torch.export program file (.pt2).

The converted graph is exported again (its casts and low-precision weights are plain ATen ops and
tensors), so the file is an ordinary ``ExportedProgram``: ``torch.export.load`` reads it, AOTInductor and
ExecuTorch take it. amppass keeps its plan in the program itself: each node's decision in the node's
``custom`` metadata (which torch.export serialises) and the conversion's summary in an extra file of the
archive, so ``amppass.report`` works on what :func:`load` returns.

Rules:

1. What is saved is the plan of the example's shapes with its guards: the export traces torch's guard
   function again, so the loaded program accepts what the converted module's own graph accepted, and
   dimensions that were dynamic stay dynamic. Later plans (shapes converted after the example's) are not
   saved; a warning says so.
2. The file is written through a temporary file in the same folder and renamed: no half-written file.
3. The loaded module checks its guards before each call; a call they reject raises an
   :class:`~amppass.errors.InputError` naming the input and dimension (it has no original model to convert
   again).
4. Saving where users save (:mod:`amppass.serving.dropin`, rule 9): a converted model's own ``save_pretrained`` /
   ``save`` writes the original's fp32 weights and, beside them, the plan as such a program, :data:`PLAN_BESIDE`
   (:func:`plan_file`), naming the class it was saved as. :func:`load_pretrained` gives the converted model back
   from the folder without capturing or planning: the program, in the class the folder's own files load (its
   attributes, tokenizer and config), holding that model as its original (so it saves again). It refuses a plan
   the folder's weights no longer match (the folder was saved over since): never a conversion of other weights.
"""

from __future__ import annotations

import copy
import json
import keyword
import logging
import operator
import os
import re
from typing import Any, Callable

import torch
from torch import fx, nn
from torch.export import Dim
from torch.utils import _pytree as pytree

from ..analysis.record import META_KEY
from ..archive import Pt2Archive, parse_json
from ..errors import InputError, first_line
from ..files import Staged, check_writable
from ..fx.capture.export import capture_program, capturing, size_one_dynamic
from ..fx.capture.guards import GUARDS_KEY, ShapeGuards
from ..reporting import stored_record
from ..serving.artifact import record_of
from ..serving.dropin import changed_weight, in_own_class
from ..serving.serving_graph import ServingGraph

log = logging.getLogger(__name__)

PLAN_FILE = "amppass.json"  # the archive's extra file holding the conversion's summary (gm.meta["amppass"])
PLAN_BESIDE = "amppass.pt2"  # rule 4: the plan a converted model's save_pretrained / save writes beside the weights
_PLAN_ENTRY = f"extra/{PLAN_FILE}"
MAX_PLAN = 16 << 20  # bytes of the plan entry amppass reads (a BERT's is about 2 KB)
MAX_TYPES = 64  # pytree types a saved program registers (a transformers model's inputs and outputs use a few)
_NODE_KEY = "amppass"  # node.meta["custom"] entry holding a node's decision, as JSON
_NAME_KEY = "amppass_name"  # node.meta["custom"] entry holding the node's name in the converted graph
MAX_NAME = 512  # characters of a stored node name (a transformers model's longest are about 80)
_ITEMS_KEY = "amppass_items"  # a multi-output op's entry holding its getitems' entries by index, as JSON
_STRINGS = "string_outputs"  # the plan entry's key listing the program's string outputs by index


def exported_program(converted: nn.Module) -> torch.export.ExportedProgram:
    """The ``ExportedProgram`` of a module :func:`amppass.convert` returned (inference mode), plan included."""
    served = _served(converted)
    guards: ShapeGuards = served.meta[GUARDS_KEY]
    later = len(served.plans) - 1
    if later:
        log.warning("%s: saving the plan of the example's shapes (%s); %d later plan(s) made for other shapes "
                    "are not saved, and the loaded model takes only what that plan takes",
                    type(served).__name__, guards.describe(), later)
    traced = _with_guard_call(served, guards)
    args, kwargs, dynamic = _example(served, guards)
    with capturing(traced, train=False), size_one_dynamic(True):
        return torch.export.export(traced, args, kwargs, dynamic_shapes=dynamic, strict=False)


def save(converted: nn.Module, path: str | os.PathLike) -> None:
    """Write ``converted`` (what :func:`amppass.convert` returned) to ``path`` as a torch.export program.

    ``torch.export.load(path)`` reads it as any program; :func:`load` also restores the report.
    """
    with Staged() as staged:  # whole or not at all: the user's old file is kept on failure
        stage(staged, converted, path)
    log.info("saved %s to %s", type(converted).__name__, path)


def stage(staged: Staged, converted: nn.Module, path: str | os.PathLike) -> None:
    """Add ``converted`` to ``staged`` as the program at ``path`` (see :func:`save`)."""
    path = check_writable(path)
    _stage_program(staged, exported_program(converted), _info(converted), path)


def _stage_program(staged: Staged, program: torch.export.ExportedProgram, info: dict[str, Any], path: str) -> None:
    text = json.dumps({**info, "pytree_types": _custom_types(program)}, default=str)
    with staged.open(path) as out:
        torch.export.save(program, out, extra_files={PLAN_FILE: text})


def plan_file(converted: nn.Module, saved_as: type) -> Callable[[str], str]:
    """Rule 4: ``converted`` (a drop-in's converted graph) exported now, before its class's save writes anything;
    the function returned writes it into the save folder as :data:`PLAN_BESIDE`, whole or not at all, recording
    ``saved_as`` (the class whose files the folder holds), and says what it wrote beside the weights. Where the
    graph does not export again the weights are still saved: the function removes an older plan there instead
    (it was made from other weights or another conversion) and says why there is none."""
    try:
        program = exported_program(converted)
    except Exception as err:  # noqa: BLE001 - the class's save still writes the weights; the log line says why
        why = first_line(err, 300)

        def without(folder: str) -> str:
            stale = os.path.join(folder, PLAN_BESIDE)
            if os.path.isfile(stale):
                os.remove(stale)
            return (f"no plan beside them: the converted graph did not export again ({why}), so "
                    "amppass.load_pretrained cannot load the folder; convert the loaded model again")

        return without
    info = {**_info(converted), "saved_as": f"{saved_as.__module__}:{saved_as.__qualname__}"}

    def write(folder: str) -> str:
        path = check_writable(os.path.join(folder, PLAN_BESIDE))
        with Staged() as staged:
            _stage_program(staged, program, info, path)
        return (f"the converted model's plan beside them, {path}: amppass.load_pretrained({folder!r}) gives the "
                "converted model back without planning again")

    return write


def load(path: str | os.PathLike, *, trusted: bool = False) -> ServingGraph:
    """Read a model :func:`save` wrote: a module that runs it and that ``amppass.report`` reads.

    The file is read as untrusted input (:mod:`amppass.archive`): an archive holding pickles, compiled code or
    anything else torch would run is refused with an :class:`~amppass.errors.InputError`, unless ``trusted``.
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        raise InputError(f"amppass.load({path!r}): a folder, and amppass.load reads a .pt2 file; a folder a converted "
                         f"model's save_pretrained() or save() wrote loads with amppass.load_pretrained({path!r})")
    with Pt2Archive(path, trusted) as archive:
        if not archive.has(_PLAN_ENTRY):
            raise InputError(f"{path}: a torch.export program amppass did not convert; convert it with "
                             f"amppass.convert(amppass.load_program({path!r}), dtype=...) or "
                             f"`amppass convert {path} -o OUT.pt2`")
        return _converted(archive, path)


def load_pretrained(folder: str | os.PathLike, model: nn.Module | None = None, *, trusted: bool = False) -> nn.Module:
    """The converted model whose ``save_pretrained(folder)`` / ``save(folder)`` wrote ``folder`` (rule 4), without
    capturing or planning again: its plan (:data:`PLAN_BESIDE`) in the class the folder holds.

    Args:
        folder: what a converted model's ``save_pretrained`` or ``save`` wrote: the original's fp32 weights, which
            its plain class loads as the original, and the plan beside them.
        model: the folder loaded with its plain class (``SentenceTransformer(folder)``,
            ``AutoModel.from_pretrained(folder)``), which the converted model takes its attributes from and
            keeps as its original; by default loaded here with the class recorded at save where that is a
            transformers model or a ``SentenceTransformer`` (on the CPU). It is not changed.
        trusted: read the plan as :func:`load` reads a file.
    """
    folder = os.fspath(folder)
    path = os.path.join(folder, PLAN_BESIDE)
    if not os.path.isfile(path):
        raise InputError(f"amppass.load_pretrained({folder!r}): no {PLAN_BESIDE} in it, so no converted model was "
                         "saved there (a train-mode model, a model converted by parts and an original amppass kept "
                         "in fp32 save their fp32 weights alone): load it with its own class and convert it with "
                         "amppass.convert")
    with Pt2Archive(path, trusted) as archive:
        if not archive.has(_PLAN_ENTRY):
            raise InputError(f"{path}: a torch.export program amppass did not write; save the converted model's "
                             "folder again with its save_pretrained() or save()")
        info, program = _read(archive, path)
    original = model if model is not None else _folder_model(folder, info.get("saved_as"), path)
    name = type(original).__name__
    served = from_program(program, info, name, original=original,
                          origin=f"it was loaded from {folder} with the plan of the example's shapes")
    changed = changed_weight(served, original)
    if changed is not None:
        raise InputError(f"amppass.load_pretrained({folder!r}): the folder's {changed} is not the one its plan "
                         f"{PLAN_BESIDE} was made from (the folder was saved over since, or model= holds other "
                         f"weights): convert the model the folder holds again ({name}, loaded with its class) "
                         "and save that")
    return in_own_class(original, served, plan_file)


def _folder_model(folder: str, saved_as: Any, path: str) -> nn.Module:
    """The model in ``folder`` loaded with the class recorded at save (``module:qualname``): a transformers
    ``PreTrainedModel`` subclass or a sentence-transformers ``SentenceTransformer``; only those libraries'
    modules are imported."""
    import importlib

    module_name, _, class_name = saved_as.partition(":") if isinstance(saved_as, str) else ("", "", "")
    if module_name.partition(".")[0] not in ("transformers", "sentence_transformers") or not class_name.isidentifier():
        raise InputError(f"amppass.load_pretrained: {path} was saved from a {str(saved_as)[:200]!r}, which amppass "
                         "does not load by itself; pass the folder loaded with its class: "
                         "amppass.load_pretrained(folder, model=YourClass.from_pretrained(folder))")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as err:
        raise InputError(f"amppass.load_pretrained: {path} was saved from {saved_as}, which this environment cannot "
                         f"import ({err}); install the library it was saved with, or pass model=") from err
    if module_name.startswith("sentence_transformers"):
        from sentence_transformers import SentenceTransformer as base
    else:
        from transformers import PreTrainedModel as base
    if not isinstance(cls, type) or not issubclass(cls, base):
        raise InputError(f"amppass.load_pretrained: {path} names {saved_as} as the class it was saved from, which is "
                         f"not a {base.__name__}; the file is damaged or was edited: save the converted model again")
    if base.__name__ == "SentenceTransformer":
        return cls(folder, device="cpu")
    return cls.from_pretrained(folder).eval()


def load_program(path: str | os.PathLike, *, trusted: bool = False) -> torch.export.ExportedProgram:
    """``torch.export.load(path)`` for an untrusted file: refused (InputError) where torch would run code
    from it (:mod:`amppass.archive`), unless ``trusted``. Pass the program to :func:`amppass.convert`."""
    with Pt2Archive(path, trusted) as archive:
        return archive.load()


def read_file(path: str | os.PathLike, *, trusted: bool = False) -> ServingGraph | torch.export.ExportedProgram:
    """A .pt2 file, checked once: the converted module if amppass wrote it (:func:`load`), else its program
    (:func:`load_program`)."""
    path = os.fspath(path)
    with Pt2Archive(path, trusted) as archive:
        return _converted(archive, path) if archive.has(_PLAN_ENTRY) else archive.load()


def _converted(archive: Pt2Archive, path: str) -> ServingGraph:
    """The served module of a checked archive holding a plan: the plan read once, its types registered, then
    the program."""
    info, program = _read(archive, path)
    return from_program(program, info, name=os.path.basename(path))


def _read(archive: Pt2Archive, path: str) -> tuple[dict[str, Any], torch.export.ExportedProgram]:
    """The plan entry of a checked archive holding one, read once, and its program, read after registering the
    types the plan names."""
    info = _plan(archive, path)
    _register_types(info.get("pytree_types", []), archive.spec_types(), path)
    return info, archive.load()


def from_program(program: torch.export.ExportedProgram, info: dict[str, Any], name: str,
                 original: nn.Module | None = None, origin: str = "it was loaded from a file") -> ServingGraph:
    """The served module of a program amppass converted: decisions back in ``node.meta``, summary in ``meta``;
    ``original`` and ``origin`` as :class:`ServingGraph` takes them."""
    gm = capture_program(program)
    for node in gm.graph.nodes:
        _own_custom(node, name)
    for node in gm.graph.nodes:
        decision = None if _inherited(node) else stored_decision(node, name)
        if decision is not None:
            node.meta[META_KEY] = decision
    _string_outputs(gm, info.get(_STRINGS), name)
    _restore_names(gm, name)
    gm.meta[META_KEY] = info
    return ServingGraph(gm, gm.meta[GUARDS_KEY], original=original, name=name, origin=origin)


def _custom_types(program: torch.export.ExportedProgram) -> list[str]:
    """The serialised names of the registered pytree types in the program's inputs and outputs."""
    names, pending = set(), [program.call_spec.in_spec, program.call_spec.out_spec]
    while pending:
        spec = pending.pop()
        if spec is None:
            continue
        known = pytree.SUPPORTED_SERIALIZED_TYPES.get(spec.type)
        if known is not None and "." in known.serialized_type_name and not known.serialized_type_name.startswith(
                ("builtins.", "collections.", "torch.")):
            names.add(known.serialized_type_name)
        pending += [spec.child(i) for i in range(spec.num_children)]
    return sorted(names)


def _plan(archive: Pt2Archive, path: str) -> dict[str, Any]:
    """The plan entry, read once and bounded (:data:`MAX_PLAN` bytes), checked to be an object whose
    ``pytree_types`` are names and whose every field the report reads is as amppass writes it
    (:func:`amppass.reporting.stored_record.model_info`)."""
    info = archive.read_json(_PLAN_ENTRY, MAX_PLAN)
    types = info.get("pytree_types", []) if isinstance(info, dict) else None
    if not isinstance(types, list) or not all(isinstance(t, str) for t in types):
        raise InputError(f"{path}: entry {_PLAN_ENTRY!r} is not the object amppass.save writes (a summary with a "
                         "list of type names); the file is damaged or was edited: save the model again")
    return stored_record.model_info(info, f"{path}: entry {_PLAN_ENTRY!r}")


def _register_types(names: list[str], used: set[str], path: str) -> None:
    """Register the pytree types a saved program's inputs and outputs use, before torch.export reads it.

    Only the names the program's own input and output specs use (``used``) are registered, at most
    :data:`MAX_TYPES`: registering a type changes how every later pytree walk in the process treats it. Only
    the containers amppass writes are registered: transformers' model outputs (a class of
    ``transformers.modeling_outputs`` or of a model's ``transformers.models.<name>.modeling_<name>``, which
    registers itself when its module is imported) and caches (``transformers.cache_utils``). Any other name is
    refused before anything is imported (:data:`_CONTAINER_MODULE`), and a class that turns out to be neither
    an output nor a cache is refused without being registered.
    """
    import importlib

    names = [name for name in names if name in used]
    if len(names) > MAX_TYPES:
        raise InputError(f"{path}: the saved program's inputs and outputs name {len(names)} types, more than the "
                         f"{MAX_TYPES} amppass registers; the file is damaged or crafted: save the model again")
    for name in names:
        if name in pytree.SERIALIZED_TYPE_TO_PYTHON_TYPE:
            continue
        module_name, _, class_name = name.partition(":") if ":" in name else name.rpartition(".")
        if _CONTAINER_MODULE.fullmatch(module_name) is None or not class_name.isidentifier():
            raise InputError(f"{path}: the saved program's inputs or outputs name the type {name[:200]!r}, which is "
                             "not a container amppass writes (a transformers model output or cache); amppass "
                             "imports and registers no other class. The file is damaged or crafted: save the model "
                             "again, or load it with trusted=True and register the type yourself first")
        try:
            cls = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError, ValueError) as err:
            raise InputError(f"the saved program returns or takes {name[:200]!r}, which this environment cannot "
                             f"import ({err}); install the transformers version the model was saved with") from err
        if not _is_container(cls):
            raise InputError(f"{path}: the saved program names {name[:200]!r} as a type of its inputs or outputs, "
                             "but it is not a transformers model output or cache; the file is damaged or was edited: "
                             "save the model again")
        if cls not in pytree.SUPPORTED_NODES:
            from transformers.exporters.exporter_dynamo import register_pytree_node

            register_pytree_node(cls)


# the modules whose classes amppass registers: transformers' outputs, a model's own outputs, its caches
_CONTAINER_MODULE = re.compile(r"transformers\.(modeling_outputs|cache_utils|models(\.\w+)+\.modeling_\w+)")


def _is_container(cls: Any) -> bool:
    """Whether ``cls`` is a transformers model output or cache class."""
    from transformers.cache_utils import Cache
    from transformers.utils import ModelOutput

    return isinstance(cls, type) and issubclass(cls, (ModelOutput, Cache))


def stored_decision(node: fx.Node, name: str) -> dict[str, Any] | None:
    """The amppass decision a loaded program's node carries (an object, read from JSON text), or None;
    InputError naming the node where it is not one."""
    decision = node.meta.get("custom", {}).get(_NODE_KEY)
    if decision is None:
        return None
    where = f"{name}: node {node.name!r}: its amppass decision"
    if not isinstance(decision, str):
        raise InputError(f"{where} is a {type(decision).__name__}, not JSON text; convert the original again")
    decision = parse_json(decision.encode("utf-8", "surrogatepass"), where)
    if not isinstance(decision, dict):
        raise InputError(f"{where} is a JSON {type(decision).__name__}, not the object amppass writes; the file is "
                         "damaged or was edited: convert the original again")
    return stored_record.checked(decision, stored_record.DECISION, where)


def _own_custom(node: fx.Node, name: str) -> None:
    """A loaded ``getitem``'s own decision and name in its ``custom`` metadata, taken from its producer's entry
    (:func:`_with_guard_call`) in place of the producer's, which export copied onto it; none where it had none."""
    custom = node.meta.get("custom")
    if node.target is not operator.getitem or not custom or _ITEMS_KEY not in custom:
        return
    where = f"{name}: node {node.name!r}: the amppass decisions of its producer's outputs"
    items = custom[_ITEMS_KEY]
    items = parse_json(items.encode("utf-8", "surrogatepass"), where) if isinstance(items, str) else None
    if not isinstance(items, dict):
        raise InputError(f"{where} are not the JSON object amppass writes; the file is damaged or was edited: "
                         "convert the original again")
    own = {k: v for k, v in custom.items() if k not in (_ITEMS_KEY, _NODE_KEY, _NAME_KEY)}
    entry = items.get(str(node.args[1]))
    if isinstance(entry, dict) and isinstance(entry.get(_NODE_KEY), str) and isinstance(entry.get(_NAME_KEY), str):
        own.update({_NODE_KEY: entry[_NODE_KEY], _NAME_KEY: entry[_NAME_KEY]})
    node.meta["custom"] = own


def is_converted(program: torch.export.ExportedProgram) -> bool:
    """Whether ``program`` carries amppass decisions (it was written by :func:`save`)."""
    return any(_NODE_KEY in n.meta.get("custom", {}) for n in program.graph.nodes)


def _served(converted: Any) -> ServingGraph:
    """The ServingGraph that :func:`save` writes of ``converted``; InputError saying why where it holds none (each
    kind says it: :meth:`~amppass.serving.artifact.Artifact.saved_graph`)."""
    found = record_of(converted)
    if found is None:
        raise InputError(f"amppass.save takes the module amppass.convert returned, got {type(converted).__name__}")
    return found.saved_graph()


def _info(converted: ServingGraph) -> dict[str, Any]:
    info = {k: v for k, v in converted.meta[META_KEY].items() if k not in ("plans", "recaptures")}
    info["plans"] = converted.meta[META_KEY]["plans"][:1]
    info[_STRINGS] = {str(i): leaf for i, leaf in enumerate(_outputs(converted.graph)) if isinstance(leaf, str)}
    return info


def _outputs(graph: fx.Graph) -> list[Any]:
    """The flat outputs of a graph export made (its output node returns one tuple of leaves)."""
    args = next(n for n in graph.nodes if n.op == "output").args
    return list(args[0]) if len(args) == 1 and isinstance(args[0], (tuple, list)) else []


def _string_outputs(gm: fx.GraphModule, strings: Any, name: str) -> None:
    """Put back the string outputs :func:`_with_guard_call` wrote as None (torch.export.load reads no string
    output: sentence-transformers' features carry ``modality="text"``), as the plan entry lists them by index."""
    if not strings:
        return
    leaves = _outputs(gm.graph)
    if not isinstance(strings, dict) or not all(
            isinstance(k, str) and k.isdigit() and int(k) < len(leaves) and leaves[int(k)] is None
            and isinstance(v, str) for k, v in strings.items()):
        raise InputError(f"{name}: the plan entry's {_STRINGS!r} do not name outputs the program returns as None; the "
                         "file is damaged or was edited: save the model again")
    for index, value in strings.items():
        leaves[int(index)] = value
    output = next(n for n in gm.graph.nodes if n.op == "output")
    output.args = (tuple(leaves),)


def _with_guard_call(served: ServingGraph, guards: ShapeGuards) -> fx.GraphModule:
    """A copy of the served graph (sharing its tensors) that calls torch's guard module first (rule 1).

    Export traces the call: each condition on a size becomes a guard of the new program again. Every node
    carries its decision and name in ``custom`` metadata, which export keeps and serialises. Export gives each
    ``getitem`` of a multi-output op its producer's metadata, so a ``getitem``'s own decision and name travel in
    its producer's, by index (:func:`_own_custom` takes them back).
    """
    traced = fx.GraphModule(served, copy.deepcopy(served.graph))
    traced.meta = {}
    graph = traced.graph
    for node in graph.nodes:
        decision = node.meta.get(META_KEY)
        if decision is None:
            continue
        entry = {_NODE_KEY: json.dumps(decision, default=str), _NAME_KEY: node.name}
        producer = node.args[0] if node.target is operator.getitem else None
        if isinstance(producer, fx.Node) and isinstance(node.args[1], int) and _NODE_KEY in producer.meta.get(
                "custom", {}):
            items = json.loads(producer.meta["custom"].get(_ITEMS_KEY, "{}"))
            items[str(node.args[1])] = entry
            producer.meta["custom"][_ITEMS_KEY] = json.dumps(items)
            continue
        node.meta["custom"] = {**node.meta.get("custom", {}), **entry}
    leaves = _outputs(graph)
    if any(isinstance(leaf, str) for leaf in leaves):  # torch.export.load reads none: _string_outputs puts them back
        next(n for n in graph.nodes if n.op == "output").args = (
            tuple(None if isinstance(leaf, str) else leaf for leaf in leaves),)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if guards.guard_module is not None and placeholders:
        traced.add_submodule("_guards_fn", guards.guard_module)
        with graph.inserting_after(placeholders[-1]):
            graph.call_module("_guards_fn", tuple(placeholders))
    traced.recompile()
    return traced


def _example(served: ServingGraph, guards: ShapeGuards) -> tuple[tuple, dict, Any]:
    """Inputs of the example's shapes (zeros: export traces with fake values) and Dim.AUTO where dynamic."""
    values = [n.meta.get("val") for n in served.graph.nodes if n.op == "placeholder"]
    leaves, dims = [], {}
    for value in values:
        if isinstance(value, torch.Tensor):
            shape = [_hint(d) for d in value.shape]
            leaf = torch.zeros(shape, dtype=value.dtype)
            dims[id(leaf)] = {i: Dim.AUTO for i, d in enumerate(value.shape) if not isinstance(d, int)} or None
        else:
            leaf = value
        leaves.append(leaf)
    args, kwargs = pytree.tree_unflatten(leaves, guards.in_spec)

    def spec(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return dims.get(id(value))
        if type(value) in (list, tuple):
            return type(value)(spec(v) for v in value)
        if type(value) is dict:
            return {k: spec(v) for k, v in value.items()}
        node = pytree.SUPPORTED_NODES.get(type(value))
        return [spec(child) for child in node.flatten_fn(value)[0]] if node is not None else None

    bound = guards.signature.bind(*args, **kwargs)
    return args, kwargs, {name: spec(value) for name, value in bound.arguments.items()}


def _hint(size: Any) -> int:
    """The example's value of a (possibly symbolic) size."""
    if isinstance(size, int):
        return size
    hint = size.node.hint
    return int(hint) if hint is not None else 2


def _inherited(node: fx.Node) -> bool:
    """Whether ``node`` picks one output of a multi-output node (an LSTM's) and carries that node's ``custom``
    metadata only because torch.export's loader copies it to the outputs it makes: it has no name or decision
    of its own in the file."""
    source = node.args[0] if node.target is operator.getitem and node.args else None
    return isinstance(source, fx.Node) and _NAME_KEY in node.meta.get("custom", {}) and \
        source.meta.get("custom", {}).get(_NAME_KEY) == node.meta["custom"][_NAME_KEY]


def _restore_names(gm: fx.GraphModule, file: str) -> None:
    """Give each node the name it had in the converted graph (export renames nodes after their ops), so the
    loaded model's report, and the casts each decision names, read as the converted model's did.

    The names are read from the file: each must be a Python identifier of at most :data:`MAX_NAME` characters,
    not a keyword, and no two nodes may share one; InputError naming the node otherwise."""
    wanted = {n: n.meta["custom"][_NAME_KEY] for n in gm.graph.nodes
              if _NAME_KEY in n.meta.get("custom", {}) and not _inherited(n)}
    taken: set[str] = set()
    for node, name in wanted.items():
        where = f"{file}: node {node.name!r}: its stored name {_NAME_KEY!r}"
        if not isinstance(name, str) or len(name) > MAX_NAME or not name.isidentifier() or keyword.iskeyword(name):
            raise InputError(f"{where} is {str(name)[:60]!r}, not a Python identifier of at most {MAX_NAME} "
                             "characters; the file is damaged or was edited: convert the original again")
        if name in taken:
            raise InputError(f"{where} is {name!r}, which another node of the file also names itself; the file is "
                             "damaged or was edited: convert the original again")
        taken.add(name)
    namespace = gm.graph._graph_namespace
    for node in gm.graph.nodes:
        if node not in wanted and node.name in taken:
            node._rename(f"{node.name}_")  # a size computation export re-created under a name a decision had
    for node, name in wanted.items():
        if node.name != name and node.op != "placeholder":
            node.name = name
            namespace._rename_object(node, name)
    gm.recompile()
