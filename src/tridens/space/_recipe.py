"""How the store and exports refer to code: importable dotted paths (or a script path), never
pickled objects. A *recipe* is the JSON needed to rebuild a space: its class and constructor
arguments, or for a mutator space the base's recipe, the mutators' and the example input shapes."""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import json
import math
import os
import re
import sys
import types
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from ..errors import TridensError
from ._choice import Choice, choice, loguniform, randint, uniform
from ._model_space import BaseSpace, ModelSpace, _meta_device
from ._mutator import Mutator, MutatorSpace

__all__ = ["object_path", "import_object", "space_recipe", "build_space", "checked_space", "check_frozen",
           "RecipeError"]


# The most elements one example input of a mutator-space recipe may have (a batch of images
# of 3x224x224 holds 150,528 per image).
_INPUT_ELEMENTS = 1 << 24

_MODULE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


class RecipeError(TridensError):
    """Something cannot be referred to by an import path, or an import path no longer resolves."""


def object_path(obj: Any) -> dict[str, Any]:
    """``{"path": "pkg.mod:Name", "file": script path or None}`` for a class or function."""
    target = obj if isinstance(obj, type) or callable(obj) and hasattr(obj, "__qualname__") else type(obj)
    module = getattr(target, "__module__", None)
    qualname = getattr(target, "__qualname__", None)
    if module is None or qualname is None or "<locals>" in qualname or "<lambda>" in qualname:
        raise RecipeError(f"{qualname or target!r} is defined inside a function; define it at module level "
                          "so tridens can refer to it by import path")
    file = None
    mod = sys.modules.get(module)
    if module in ("__main__", "__mp_main__") or module.startswith("tridens_script_"):
        file = getattr(mod, "__file__", None)
        if file is None:
            raise RecipeError(f"{qualname} is defined in an interactive session; put it in a file")
        file = os.path.abspath(file)
    return {"path": f"{module}:{qualname}", "file": file}


def import_object(ref: dict[str, Any], *, expect: type | None = None, trust_code: bool = False,
                  untrusted_dir: str | os.PathLike[str] | None = None,
                  allow_modules: Sequence[str] = ()) -> Any:
    """The object a reference made by :func:`object_path` points to.

    A reference read from a store or an export may have been written by someone else, and
    importing a module runs it (``venv.__main__`` builds a virtualenv, ``antigravity`` opens a
    browser). So by default it resolves only to code this process has already imported: a
    module in ``sys.modules`` or a script this process already runs. Before anything is
    imported, any other module is refused unless the user allows it: ``allow_modules`` names
    modules (each with its submodules, ``"mypkg"`` allows ``"mypkg.models"``) that may be
    imported from ``sys.path`` (never from inside ``untrusted_dir``, e.g. the export folder
    being loaded); ``trust_code=True`` allows every module and a script file (importing it runs
    it). With ``expect``, the object must be a class deriving from it; this is checked before
    anything is called, so ``"os:system"`` is refused, not run.

    >>> import_object({"path": "torch.nn:Linear", "file": None}, expect=nn.Module).__name__
    'Linear'
    >>> import_object({"path": "os:system", "file": None}, expect=nn.Module)
    Traceback (most recent call last):
    ...
    tridens.space._recipe.RecipeError: 'os:system' names a builtin_function_or_method, not a subclass of Module; ...
    """
    if not isinstance(ref, dict) or not isinstance(ref.get("path"), str) or ":" not in ref["path"]:
        raise RecipeError(f"{_short(ref)} is not a reference to code (a dict with a 'path' like 'pkg.module:Name')")
    allow_modules = _module_names(allow_modules)
    module_name, _, qualname = ref["path"].partition(":")
    file = ref.get("file")
    if file is not None and not isinstance(file, str):
        raise RecipeError(f"the 'file' of {ref['path']!r} is not a path: {_short(file)}")
    if file:
        module = _running_script(file)
        if module is None:
            if not trust_code:
                raise RecipeError(
                    f"{ref['path']!r} is defined in the script {file!r}; importing it would run that file, so "
                    f"tridens does so only when you trust it: pass trust_code=True (tridens --trust-code)")
            module = _import_script(file)
    else:
        if not _MODULE_NAME.fullmatch(module_name):
            raise RecipeError(f"{ref['path']!r} does not name a module (a dotted name like 'pkg.module')")
        if untrusted_dir is not None and not trust_code:
            _refuse_module_inside(module_name, Path(untrusted_dir), ref["path"])
        if not trust_code and module_name not in sys.modules:
            if not any(module_name == m or module_name.startswith(m + ".") for m in allow_modules):
                raise RecipeError(
                    f"{ref['path']!r} names the module {module_name!r}, which this process has not imported; "
                    f"importing a module runs it, so tridens imports one a file names only when you allow it: "
                    f"import it first, or pass allow_modules=[{module_name.split('.')[0]!r}] "
                    f"(tridens --allow-module {module_name.split('.')[0]}) or trust_code=True")
        try:
            module = importlib.import_module(module_name)
        except ImportError as err:
            raise RecipeError(f"cannot import {module_name!r} for {ref['path']!r}: {err}") from err
    obj: Any = module
    for part in qualname.split("."):
        # A module's own names only: a module-level __getattr__ may import more code.
        if isinstance(obj, types.ModuleType) and not trust_code and part not in vars(obj):
            raise RecipeError(f"{ref['path']!r} no longer exists ({file or module_name} defines no {part!r})")
        try:
            obj = getattr(obj, part)
        except AttributeError as err:
            raise RecipeError(f"{ref['path']!r} no longer exists ({file or module_name} has no {part!r})") from err
    if expect is not None and not (isinstance(obj, type) and issubclass(obj, expect)):
        raise RecipeError(f"{ref['path']!r} names a {type(obj).__name__}, not a subclass of {expect.__name__}; "
                          f"a recipe only names model spaces, modules and mutators")
    return obj


def _module_names(names: Any) -> tuple[str, ...]:
    if isinstance(names, str) or not all(isinstance(n, str) and _MODULE_NAME.fullmatch(n) for n in names):
        raise RecipeError(f"The 'allow_modules' parameter must be a list of module names. Got {_short(names)} instead.")
    return tuple(names)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _running_script(file: str) -> Any:
    """The module of ``file`` if this process already runs or imported it (its code already ran)."""
    path = Path(file)
    main = sys.modules.get("__main__")
    main_file = getattr(main, "__file__", None)
    if main_file and Path(main_file).resolve() == path.resolve():
        return main
    return sys.modules.get(_script_module_name(path))


def _script_module_name(path: Path) -> str:
    return "tridens_script_" + "".join(c if c.isalnum() else "_" for c in str(path.resolve()))


def _refuse_module_inside(module_name: str, folder: Path, path: str) -> None:
    """Refuse a module that Python would find inside ``folder`` (a file shipped with an export)."""
    top = module_name.split(".")[0]
    if top in sys.modules:
        return
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return  # import_module then names the failure
    if spec is None:
        return
    places = [spec.origin] if spec.origin else []
    places += list(spec.submodule_search_locations or [])
    root = folder.resolve()
    for place in places:
        if place and Path(place).resolve().is_relative_to(root):
            raise RecipeError(f"{path!r} would be imported from {place!r}, inside the folder being loaded; "
                              f"tridens runs no code shipped with it unless you pass trust_code=True")


def _import_script(file: str) -> Any:
    """Import a user's script as a module (not as __main__, so its guarded main code does not run)."""
    path = Path(file)
    if not path.exists():
        raise RecipeError(f"the script {file} that defines this experiment's space no longer exists")
    running = _running_script(file)
    if running is not None:
        return running
    name = _script_module_name(path)
    # An explicit source loader: spec_from_file_location finds none for a script not named *.py.
    loader = importlib.machinery.SourceFileLoader(name, str(path))
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    if spec is None or spec.loader is None:
        raise RecipeError(f"cannot import the script {file} that defines this experiment's space")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    sys.path.insert(0, str(path.parent))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(path.parent))
    return module


def _json_args(values: Any, what: str) -> Any:
    try:
        json.dumps(values)
    except TypeError as err:
        raise RecipeError(f"{what} must be JSON (numbers, strings, lists, dicts) to be stored: {err}") from err
    return values


def space_recipe(space: Any) -> dict[str, Any]:
    """JSON that :func:`build_space` turns back into an equal space."""
    if isinstance(space, MutatorSpace):
        return {
            "kind": "mutators",
            "base": space_recipe(space.base) if isinstance(space.base, ModelSpace) else _module_recipe(space.base),
            "mutators": [{**object_path(m), "args": _json_args(vars(m), f"the attributes of mutator {m.name}")}
                         for m in space.mutators],
            "example_inputs": [[list(t.shape), str(t.dtype).removeprefix("torch.")] for t in space.example_inputs or ()],
        }
    if isinstance(space, ModelSpace):
        args, kwargs = space.__dict__["_tridens_init"]
        return {"kind": "model_space", **object_path(space),
                "args": _json_args(_placeholders_to_json(list(args)), f"the arguments of {type(space).__name__}"),
                "kwargs": _json_args(_placeholders_to_json(dict(kwargs)), f"the arguments of {type(space).__name__}")}
    raise RecipeError(f"{type(space).__name__} is not a tridens space")


def _module_recipe(module: nn.Module) -> dict[str, Any]:
    # A plain base model is rebuilt by calling its class without arguments.
    return {"kind": "module", **object_path(module), "args": [], "kwargs": {}}


def _placeholders_to_json(obj: Any) -> Any:
    if isinstance(obj, Choice):
        return {"__choice__": obj.label, "domain": obj.domain.describe()}
    if isinstance(obj, dict):
        return {k: _placeholders_to_json(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_placeholders_to_json(v) for v in obj]
    return obj


def _json_to_placeholders(obj: Any) -> Any:
    if isinstance(obj, dict) and "__choice__" in obj:
        d = obj["domain"]
        kind = d["type"]
        if kind == "categorical":
            return choice(obj["__choice__"], d["values"])
        maker = {"uniform": uniform, "loguniform": loguniform, "randint": randint}[kind]
        return maker(obj["__choice__"], d["low"], d["high"])
    if isinstance(obj, dict):
        return {k: _json_to_placeholders(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_json_to_placeholders(v) for v in obj]
    return obj


def build_space(recipe: Any, *, trust_code: bool = False,
                untrusted_dir: str | os.PathLike[str] | None = None,
                allow_modules: Sequence[str] = ()) -> Any:
    """The space (or plain module) a recipe describes.

    Every class a recipe names is resolved as :func:`import_object` does (already imported
    modules only, or those in ``allow_modules``, unless ``trust_code=True``; checked before any
    import) and must be a :class:`ModelSpace`, an ``nn.Module`` (a
    mutator space's base) or a :class:`Mutator`; a malformed recipe raises :class:`RecipeError`.

    >>> build_space({"kind": "module", "path": "os:system", "file": None, "args": ["touch x"], "kwargs": {}})
    Traceback (most recent call last):
    ...
    tridens.space._recipe.RecipeError: 'os:system' names a builtin_function_or_method, not a subclass of Module; ...
    """
    if not isinstance(recipe, dict):
        raise RecipeError(f"a space recipe must be a JSON object, got {_short(recipe)}")
    kind = recipe.get("kind")
    opts: dict[str, Any] = {"trust_code": trust_code, "untrusted_dir": untrusted_dir,
                            "allow_modules": _module_names(allow_modules)}
    if kind == "mutators":
        mutators, shapes = recipe.get("mutators"), recipe.get("example_inputs")
        if not isinstance(mutators, list) or not all(isinstance(m, dict) and isinstance(m.get("args", {}), dict)
                                                     for m in mutators):
            raise RecipeError(f"the mutators of a space recipe must be a list of references, got {_short(mutators)}")
        if not isinstance(shapes, list) or not all(
                isinstance(s, list) and len(s) == 2 and isinstance(s[0], list)
                and all(isinstance(d, int) and 0 <= d <= 1 << 20 for d in s[0])
                and isinstance(getattr(torch, str(s[1]), None), torch.dtype) for s in shapes):
            raise RecipeError(f"the example inputs of a space recipe must be [shape, dtype] pairs, got {_short(shapes)}")
        for shape, _ in shapes:
            if math.prod(shape) > _INPUT_ELEMENTS:
                raise RecipeError(f"an example input of a space recipe has shape {tuple(shape)}: "
                                  f"{math.prod(shape):,} elements, more than the {_INPUT_ELEMENTS:,} tridens builds one with")
        base = build_space(recipe.get("base"), **opts)
        classes = [import_object(m, expect=Mutator, **opts) for m in mutators]
        built = [cls(**m["args"]) if m.get("args") else cls() for cls, m in zip(classes, mutators)]
        inputs = tuple(torch.zeros(shape, dtype=getattr(torch, dtype)) for shape, dtype in shapes)
        return ModelSpace.from_base(base, built, example_inputs=inputs)
    if kind not in ("model_space", "module"):
        raise RecipeError(f"unknown space recipe kind {_short(kind)} (known: 'model_space', 'module', 'mutators')")
    args, kwargs = recipe.get("args", []), recipe.get("kwargs", {})
    if not isinstance(args, list) or not isinstance(kwargs, dict):
        raise RecipeError(f"the arguments of {recipe.get('path')!r} must be a list and a dict, got "
                          f"{_short(args)} and {_short(kwargs)}")
    cls = import_object(recipe, expect=ModelSpace if kind == "model_space" else nn.Module, **opts)
    try:
        args, kwargs = _json_to_placeholders(args), _json_to_placeholders(kwargs)
    except (KeyError, TypeError, ValueError) as err:
        raise RecipeError(f"a choice among the arguments of {recipe.get('path')!r} is malformed: {err!r}") from err
    return cls(*args, **kwargs)


def _tensors(obj: Any) -> list[tuple[str, torch.Tensor]]:
    """The parameters and buffers (persistent or not) a space or module holds."""
    module = obj.base if not isinstance(obj, nn.Module) and isinstance(getattr(obj, "base", None), nn.Module) else obj
    if not isinstance(module, nn.Module):
        return []
    return list(module.named_parameters()) + list(module.named_buffers())


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _refuse_oversize(tensors: list[tuple[str, torch.Tensor]], max_bytes: int, what: str, built: str) -> None:
    total = sum(_nbytes(t) for _, t in tensors)
    if total > max_bytes:
        name, big = max(tensors, key=lambda nt: _nbytes(nt[1]))
        raise RecipeError(f"{what} describes {built} of {total:,} bytes (its tensor {name!r} has shape "
                          f"{tuple(big.shape)}), more than the {max_bytes:,} tridens builds from it; it is not built")


def checked_space(recipe: Any, *, max_bytes: int, what: str, trust_code: bool = False,
                  untrusted_dir: str | os.PathLike[str] | None = None, allow_modules: Sequence[str] = ()) -> Any:
    """:func:`build_space` for a recipe someone else wrote (an export's manifest, a store's
    config): the space is first built on the meta device, which allocates nothing, and refused
    with :class:`RecipeError` naming ``what`` and its largest tensor if it would hold more than
    ``max_bytes`` of parameters and buffers; only then is it built. A constructor that cannot
    run on the meta device (it computes on tensor values) cannot be measured, so its space is
    refused unless ``trust_code=True``.

    >>> recipe = {"kind": "module", "path": "torch.nn:Linear", "file": None, "args": [100000, 100000], "kwargs": {}}
    >>> checked_space(recipe, max_bytes=1 << 20, what="the manifest m.json")
    Traceback (most recent call last):
    ...
    tridens.space._recipe.RecipeError: the manifest m.json describes a model space of 40,000,400,000 bytes ...
    """
    opts: dict[str, Any] = {"trust_code": trust_code, "untrusted_dir": untrusted_dir, "allow_modules": allow_modules}
    try:
        with _meta_device():
            probe = build_space(recipe, **opts)
    except TridensError:
        raise
    except Exception as err:
        if not trust_code:
            raise RecipeError(f"{what} describes a space whose size cannot be measured before it is built (it fails "
                              f"on the meta device: {type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}); "
                              "pass trust_code=True to build it anyway") from err
        probe = None
    if probe is not None:
        _refuse_oversize(_tensors(probe), max_bytes, what, "a model space")
        if not isinstance(probe, BaseSpace):
            raise RecipeError(f"{what} describes a {type(probe).__name__}, not a model space")
    return build_space(recipe, **opts)


def check_frozen(space: Any, sample: Any, *, what: str, max_bytes: int | None = None,
                 weights: Any = None, weights_file: str | os.PathLike[str] | None = None) -> None:
    """Before ``space.freeze(sample)`` builds a model from a file someone else wrote, build it on
    the meta device (nothing allocated) and refuse, with :class:`RecipeError` naming ``what`` and
    the tensor: a model larger than ``max_bytes``, or, with ``weights`` (a state dict, read from
    ``weights_file``), one whose tensors differ from the weights in name or shape (the weights
    would not load into it, so it is not built). A space that cannot be frozen on the meta
    device is left to ``freeze`` (:func:`checked_space` measured its constructor already).

    >>> check_frozen(space, {"width": 100000}, what="the manifest m.json", weights=state,
    ...              weights_file="weights.pt")   # doctest: +SKIP
    RecipeError: the manifest m.json describes a model whose tensor 'fc.weight' has shape (100000, 4), ...
    """
    try:
        with _meta_device():
            probe = space.freeze(space.restrict(sample), check=False)
    except TridensError:
        raise
    except Exception:
        return
    tensors = _tensors(probe)
    if weights is not None:
        state = probe.state_dict()
        for name, t in state.items():
            held = weights.get(name) if isinstance(weights, dict) else None
            if not isinstance(held, torch.Tensor) or tuple(held.shape) != tuple(t.shape):
                has = "no such tensor" if not isinstance(held, torch.Tensor) else f"shape {tuple(held.shape)}"
                raise RecipeError(f"{what} describes a model whose tensor {name!r} has shape {tuple(t.shape)} "
                                  f"({_nbytes(t):,} bytes), but {weights_file} holds {has}; it is not built")
        extra = [name for name in (weights if isinstance(weights, dict) else {}) if name not in state]
        if extra:
            raise RecipeError(f"{weights_file} holds the tensor {extra[0]!r}, which the model {what} describes "
                              "does not have; it is not built")
    if max_bytes is not None:
        _refuse_oversize(tensors, max_bytes, what, "a model")
