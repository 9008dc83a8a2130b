"""Parameter count: the parameter elements the graph's nodes use, each shared tensor once."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch.nn as nn

if TYPE_CHECKING:
    from ._graph import Graph

__all__ = ["num_params"]


def num_params(graph: Graph, trainable_only: bool = False) -> int:
    seen: set[int] = set()
    total = 0
    for n in graph._fx.nodes:
        if n.op not in ("call_module", "get_attr"):
            continue
        obj = graph._get(str(n.target))
        params = obj.parameters() if isinstance(obj, nn.Module) else [obj] if isinstance(obj, nn.Parameter) else []
        for p in params:
            if id(p) in seen or (trainable_only and not p.requires_grad):
                continue
            seen.add(id(p))
            total += p.numel()
    return total
