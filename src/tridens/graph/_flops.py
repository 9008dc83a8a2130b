"""FLOP estimate: floating point operations of one forward pass on the example inputs.

Counting rules (an estimate for comparing models, not a profiler):

* Conv*d: 2 * output elements * (in_channels / groups) * kernel elements (+ output elements for the
  bias); ConvTranspose*d: 2 * input elements * (out_channels / groups) * kernel elements (+ bias).
* Linear: 2 * output elements * in_features (+ output elements for the bias); Bilinear likewise
  with in1 * in2 features. ``F.linear`` and ``F.conv*d`` calls are counted the same way.
* matmul / mm / bmm / ``@`` (function or method): 2 * output elements * the contracted dimension.
* MultiheadAttention: its four projections as Linear layers plus 4 * batch * L * S * embed_dim for
  the two attention products; TransformerEncoderLayer/DecoderLayer: their attention blocks and
  feed-forward Linear layers; LSTM/GRU/RNN: 2 * steps * batch * weight elements of each layer.
* Pooling: kernel elements per output element (adaptive pooling: one per input element).
* Normalization layers: 4 per element; softmax/log_softmax: 3 per element; other arithmetic and
  activations (modules, functions and methods): 1 per output element.
* Free: inputs, attributes, views and reshapes, indexing, size queries, the output.
* Any other module with parameters (an opaque one included): 2 * parameter elements * output
  elements / the last output dimension, i.e. as if every parameter were used once per position.

Per node in ``node.meta["tridens.flops"]``.
"""

from __future__ import annotations

import math
import operator
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from . import _meta

if TYPE_CHECKING:
    from ._graph import Graph

__all__ = ["flops", "forward_flops"]

_FREE_METHODS = {
    "view", "reshape", "flatten", "permute", "transpose", "contiguous", "size", "dim", "unsqueeze",
    "squeeze", "expand", "expand_as", "view_as", "chunk", "split", "unbind", "t", "detach", "to",
    "type", "float", "double", "half", "numel", "repeat", "narrow", "select", "__getitem__",
}
_FREE_FUNCTIONS = {
    operator.getitem, getattr, torch.flatten, torch.reshape, torch.permute, torch.transpose,
    torch.squeeze, torch.unsqueeze, torch.chunk, torch.split, torch.unbind, torch.cat, torch.stack,
    torch.narrow, torch.t, torch.zeros, torch.ones, torch.zeros_like, torch.ones_like, torch.arange,
    torch.empty, len,
}
_MATMUL = {torch.matmul, torch.mm, torch.bmm, operator.matmul}
_CONV_FN = {F.conv1d, F.conv2d, F.conv3d}
_SOFTMAX = {F.softmax, F.log_softmax, torch.softmax, torch.log_softmax}
_NORMS = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm, nn.LocalResponseNorm, nn.RMSNorm)
_FREE_MODULES = (nn.Identity, nn.Flatten, nn.Unflatten, nn.Dropout, nn.Dropout1d, nn.Dropout2d,
                 nn.Dropout3d, nn.AlphaDropout, nn.Embedding)


def _numel(shape: Any) -> int:
    if isinstance(shape, torch.Size):
        return math.prod(shape)
    if isinstance(shape, tuple):
        return sum(_numel(s) for s in shape)
    return 0


def _first(shape: Any) -> torch.Size | None:
    """The first tensor shape in a (nested) shape."""
    if isinstance(shape, torch.Size):
        return shape
    if isinstance(shape, tuple):
        for s in shape:
            found = _first(s)
            if found is not None:
                return found
    return None


def _in_shapes(n: fx.Node) -> list[Any]:
    return [src.meta.get(_meta.SHAPE) for src in n.all_input_nodes]


def _linear(out_elems: int, in_features: int, bias: bool) -> int:
    return 2 * out_elems * in_features + (out_elems if bias else 0)


def _mha(m: nn.MultiheadAttention, query: torch.Size | None, key: torch.Size | None) -> int:
    if query is None:
        return 0
    key = key if key is not None else query
    if len(query) == 3:
        batch, length_q = (query[0], query[1]) if m.batch_first else (query[1], query[0])
        length_k = key[1] if m.batch_first else key[0]
    else:  # unbatched (L, E)
        batch, length_q, length_k = 1, query[0], key[0]
    e = m.embed_dim
    proj = (_linear(batch * length_q * e, e, True) + _linear(batch * length_k * e, m.kdim, True)
            + _linear(batch * length_k * e, m.vdim, True))
    out = _linear(batch * length_q * e, e, True)
    attention = 4 * batch * length_q * length_k * e  # scores and weighted sum
    return proj + out + attention + 3 * batch * m.num_heads * length_q * length_k  # + softmax


def _module_flops(m: nn.Module, n: fx.Node, out_shape: Any) -> int:
    out_elems = _numel(out_shape)
    ins = _in_shapes(n)
    first_in = _first(ins[0]) if ins else None
    if isinstance(m, nn.modules.conv._ConvTransposeNd):
        in_elems = _numel(first_in) if first_in is not None else 0
        kernel = math.prod(m.kernel_size)
        return 2 * in_elems * (m.out_channels // m.groups) * kernel + (out_elems if m.bias is not None else 0)
    if isinstance(m, nn.modules.conv._ConvNd):
        kernel = math.prod(m.kernel_size)
        return 2 * out_elems * (m.in_channels // m.groups) * kernel + (out_elems if m.bias is not None else 0)
    if isinstance(m, nn.Linear):
        return _linear(out_elems, m.in_features, m.bias is not None)
    if isinstance(m, nn.Bilinear):
        return _linear(out_elems, m.in1_features * m.in2_features, m.bias is not None)
    if isinstance(m, nn.MultiheadAttention):
        return _mha(m, first_in, _first(ins[1]) if len(ins) > 1 else None)
    if isinstance(m, (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)):
        x = _first(out_shape)
        if x is None:
            return 0
        tokens = math.prod(x[:-1])
        total = _mha(m.self_attn, x, x)
        if isinstance(m, nn.TransformerDecoderLayer):
            memory = _first(ins[1]) if len(ins) > 1 else x
            total += _mha(m.multihead_attn, x, memory)
        total += _linear(tokens * m.linear1.out_features, m.linear1.in_features, True)
        total += _linear(tokens * m.linear2.out_features, m.linear2.in_features, True)
        return total + 6 * tokens * x[-1]  # norms, residual adds, activation
    if isinstance(m, nn.RNNBase):
        if first_in is None:
            return 0
        steps_batch = math.prod(first_in[:-1]) if len(first_in) > 1 else 1
        weights = sum(p.numel() for name, p in m.named_parameters() if name.startswith("weight"))
        return 2 * steps_batch * weights
    if isinstance(m, (nn.modules.pooling._AdaptiveAvgPoolNd, nn.modules.pooling._AdaptiveMaxPoolNd)):
        return _numel(first_in) if first_in is not None else out_elems
    if isinstance(m, (nn.modules.pooling._MaxPoolNd, nn.modules.pooling._AvgPoolNd)):
        size: Any = m.kernel_size
        k = math.prod(size) if isinstance(size, tuple) else size ** max(1, len(_first(out_shape) or ()) - 2)
        return k * out_elems
    if isinstance(m, _NORMS):
        return 4 * out_elems
    if isinstance(m, (nn.Softmax, nn.LogSoftmax)):
        return 3 * out_elems
    if isinstance(m, _FREE_MODULES):
        return 0
    n_params = sum(p.numel() for p in m.parameters())
    if n_params:
        x = _first(out_shape)
        positions = out_elems // x[-1] if x is not None and len(x) and x[-1] else 1
        return 2 * n_params * positions
    return out_elems


def _node_flops(graph: Graph, n: fx.Node) -> int:
    out_shape = n.meta.get(_meta.SHAPE)
    if n.op in ("placeholder", "get_attr", "output"):
        return 0
    if n.op == "call_module":
        return _module_flops(graph._get(str(n.target)), n, out_shape)
    out_elems = _numel(out_shape)
    ins = [_first(s) for s in _in_shapes(n)]
    if n.op == "call_method":
        if n.target in _FREE_METHODS:
            return 0
        if n.target in ("matmul", "mm", "bmm"):
            return 2 * out_elems * (ins[0][-1] if ins and ins[0] is not None and len(ins[0]) else 1)
        if n.target in ("softmax", "log_softmax"):
            return 3 * out_elems
        return out_elems
    fn = n.target
    if fn in _FREE_FUNCTIONS:
        return 0
    if fn in _MATMUL:
        return 2 * out_elems * (ins[0][-1] if ins and ins[0] is not None and len(ins[0]) else 1)
    if fn is F.linear and len(ins) > 1 and ins[1] is not None:
        return _linear(out_elems, ins[1][-1], len(ins) > 2)
    if fn in _CONV_FN and len(ins) > 1 and ins[1] is not None:
        weight = ins[1]
        return 2 * out_elems * math.prod(weight[1:]) + (out_elems if len(ins) > 2 else 0)
    if fn in _SOFTMAX:
        return 3 * out_elems
    return out_elems


def flops(graph: Graph) -> int:
    """Total estimated FLOPs of ``graph`` (0 without example inputs); per node in meta."""
    if graph._example_inputs is None:
        return 0
    graph._ensure_shapes()
    total = 0
    for n in graph._fx.nodes:
        count = int(_node_flops(graph, n))
        n.meta[_meta.FLOPS] = count
        total += count
    return total


# -- counting an eager forward ------------------------------------------------------------------------
_ADD_MATMUL = {torch.addmm, torch.baddbmm, torch.addbmm}


class _MatmulCounter(torch.overrides.TorchFunctionMode):
    """Counts the matmul-like FLOPs of the torch functions a forward calls, as they run."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        try:
            self.total += _call_flops(func, args, kwargs or {}, out)
        except (AttributeError, IndexError, TypeError):  # an unusual call: counted as 0
            pass
        return out


def _call_flops(func: Any, args: Any, kwargs: Any, out: Any) -> int:
    if not isinstance(out, torch.Tensor):
        return 0
    if func is F.linear:
        weight = kwargs.get("weight", args[1] if len(args) > 1 else None)
        return 2 * out.numel() * weight.shape[-1]
    if func in _CONV_FN:
        weight = kwargs.get("weight", args[1] if len(args) > 1 else None)
        return 2 * out.numel() * math.prod(weight.shape[1:])
    if func in (F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d):
        x, weight = args[0], kwargs.get("weight", args[1] if len(args) > 1 else None)
        return 2 * x.numel() * math.prod(weight.shape[1:])
    name = getattr(func, "__name__", "")
    if func in _MATMUL or name in ("matmul", "__matmul__", "__rmatmul__", "mm", "bmm"):
        a = args[0] if name != "__rmatmul__" else args[1]
        return 2 * out.numel() * a.shape[-1]
    if func in _ADD_MATMUL or name in ("addmm", "baddbmm", "addbmm"):
        a = args[1] if len(args) > 1 else kwargs.get("mat1", kwargs.get("batch1"))
        return 2 * out.numel() * a.shape[-1]
    if func is F.scaled_dot_product_attention:
        q, k = args[0], args[1]
        return 4 * math.prod(q.shape[:-1]) * k.shape[-2] * q.shape[-1]
    return 0


def forward_flops(model: nn.Module, *inputs: Any) -> int:
    """Matmul-like FLOPs of one eager forward of ``model`` on ``inputs``, counted as it runs: Linear
    and convolution calls, matmuls, scaled dot-product attention, ``MultiheadAttention`` (as
    :func:`flops` counts it) and the recurrent layers' products (2 * steps * batch * weight
    elements). No trace, no example inputs kept; unlike
    ``torch.utils.flop_counter`` it needs no ``torch._dynamo`` (whose import costs about a second
    of CPU per process). Elementwise work counts 0.

    >>> forward_flops(nn.Linear(10, 4), torch.zeros(3, 10))
    240
    """
    counter = _MatmulCounter()
    modules = 0  # what module hooks count (layers whose inner calls the mode does not see)

    def rnn_hook(module: nn.Module, args: Any, _output: Any) -> None:
        nonlocal modules
        x = args[0]
        x = x.data if isinstance(x, nn.utils.rnn.PackedSequence) else x  # (steps * batch, features)
        steps_batch = math.prod(x.shape[:-1])
        weights = sum(p.numel() for n, p in module.named_parameters() if n.startswith("weight"))
        modules += 2 * steps_batch * weights

    def attention_hook(module: nn.Module, args: Any, _output: Any) -> None:
        nonlocal modules
        query, key = args[0], args[1] if len(args) > 1 else args[0]
        modules += _mha(module, query.shape, key.shape)  # type: ignore[arg-type]

    handles = [m.register_forward_hook(rnn_hook) for m in model.modules() if isinstance(m, nn.RNNBase)]
    handles += [m.register_forward_hook(attention_hook) for m in model.modules()
                if isinstance(m, nn.MultiheadAttention)]
    try:
        with counter:
            model(*inputs)
    finally:
        for h in handles:
            h.remove()
    return counter.total + modules
