"""How the store and exports refer to code: importable dotted paths (or a script path), never
pickled objects. A *recipe* is the JSON needed to rebuild a space: its class and constructor
arguments, or for a mutator space the base's recipe, the mutators' and the example input shapes."""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import TridensError
from ._choice import Choice, choice, loguniform, randint, uniform
from ._model_space import ModelSpace
from ._mutator import MutatorSpace

__all__ = ["object_path", "import_object", "space_recipe", "build_space", "RecipeError"]


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


def import_object(ref: dict[str, Any]) -> Any:
    """The object a reference made by :func:`object_path` points to."""
    module_name, _, qualname = ref["path"].partition(":")
    file = ref.get("file")
    if file:
        module = _import_script(file)
    else:
        try:
            module = importlib.import_module(module_name)
        except ImportError as err:
            raise RecipeError(f"cannot import {module_name!r} for {ref['path']!r}: {err}") from err
    obj: Any = module
    for part in qualname.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as err:
            raise RecipeError(f"{ref['path']!r} no longer exists ({file or module_name} has no {part!r})") from err
    return obj


def _import_script(file: str) -> Any:
    """Import a user's script as a module (not as __main__, so its guarded main code does not run)."""
    path = Path(file)
    if not path.exists():
        raise RecipeError(f"the script {file} that defines this experiment's space no longer exists")
    main = sys.modules.get("__main__")
    if main is not None and os.path.abspath(getattr(main, "__file__", "") or "") == str(path.resolve()):
        return main
    name = "tridens_script_" + "".join(c if c.isalnum() else "_" for c in str(path.resolve()))
    if name in sys.modules:
        return sys.modules[name]
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
            "example_inputs": [[list(t.shape), str(t.dtype).removeprefix("torch.")] for t in space.example_inputs],
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


def build_space(recipe: dict[str, Any]) -> Any:
    """The space (or plain module) a recipe describes."""
    kind = recipe["kind"]
    if kind == "mutators":
        base = build_space(recipe["base"])
        mutators = [import_object(m)(**m["args"]) if m["args"] else import_object(m)() for m in recipe["mutators"]]
        inputs = tuple(torch.zeros(shape, dtype=getattr(torch, dtype)) for shape, dtype in recipe["example_inputs"])
        return ModelSpace.from_base(base, mutators, example_inputs=inputs)
    cls = import_object(recipe)
    return cls(*_json_to_placeholders(recipe["args"]), **_json_to_placeholders(recipe["kwargs"]))
