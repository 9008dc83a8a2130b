"""The supernet: one module holding every model of a space, built from the space itself.

:func:`build_supernet` runs the space's ``__init__`` once under a :class:`SupernetResolver`
(the resolver mechanism of :mod:`tridens.space._context`; nothing is patched):

* ``tnn.LayerChoice`` -> :class:`MixedLayer`, holding every candidate;
* ``tnn.InputChoice`` -> :class:`MixedInput`, reading every input;
* ``tnn.Repeat`` with a chosen depth -> :class:`MixedDepth`, the largest depth, cut per sample;
* ``tnn.Cell`` -> :class:`MixedCell`: for every op of every node, a :class:`MixedEdge` holding the
  op's candidates (a :class:`MixedLayer`) on each state the op may read; a node's ops share one
  set of candidates per edge (node, input), as DARTS' edges and NNI's one-shot cells do;
* an int ``td.choice`` (width, kernel size, depth...) -> a :class:`~._traced.TracedInt` at the
  largest candidate, so layers are built at their largest size; afterwards each ``Conv1d/2d``,
  ``Linear``, ``BatchNorm1d/2d``, ``LayerNorm``, ``Embedding`` and ``MultiheadAttention`` whose sizes depend on a
  label becomes an entangled layer that slices its weight per sample (kernels centred, BatchNorm
  statistics sliced too; an attention's q/k/v in-projection blocks and out-projection sliced to
  the path's ``embed_dim``, its ``num_heads`` the path's); other modules
  whose attributes depend on a label (pooling sizes, dropout rates, strides) get those
  attributes set per sample before each call.

Every mixed module reads one :class:`ArchState`: either a *path* (a concrete sample: only the
chosen candidate runs, layers are sliced: SPOS, ENAS, subnet evaluation) or *weights* (a
probability vector per label: DARTS/GDAS; candidates are mixed, widths become soft channel
masks and kernel sizes soft centred kernel masks over the one largest weight; a LayerNorm's or
an attention's widths and head counts mix the outputs of every candidate, each computed on its
slice, since normalization statistics and the split into heads depend on the width).

After building, the supernet is checked against the space: for a set of samples (every value of
every label, one label at a time, plus random ones), the model built alone by ``space.freeze``
must take the weights extracted from the supernet (same names, same shapes) and, given example
inputs, compute the same output as the supernet on that path. A space that fails is refused with
:class:`~tridens.errors.InvalidSpace` naming the label and the reason.
"""

from __future__ import annotations

import itertools
import random
import warnings
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
from torch import nn

from ..errors import InvalidSample, InvalidSpace
from ..nn import ChosenInputs, instantiate_candidate
from ..space import Resolver, using
from ..space import Categorical, Domain, SearchSpace, same_value
from ..space import BaseSpace, ModelSpace
from ._arch import ArchState, Sample, not_one_shot
from ._entangled import _ENTANGLED, _Entangled
from ._traced import TracedFloat, TracedInt, is_traced, plain, traced_labels, value_at

__all__ = ["ArchState", "Supernet", "SupernetResolver", "MixedLayer", "MixedInput", "MixedDepth", "MixedEdge",
           "MixedCell", "build_supernet", "not_one_shot"]


class MixedLayer(nn.Module):
    """Every candidate of a ``LayerChoice``; runs the path's one or the probability-weighted sum."""

    _state: ArchState

    def __init__(self, label: str, keys: Sequence[Any], candidates: Sequence[nn.Module], state: ArchState):
        super().__init__()
        self.label, self.keys = label, list(keys)
        self.candidates = nn.ModuleList(candidates)
        self.__dict__["_state"] = state

    def chosen(self) -> nn.Module:
        return self.candidates[self._state.index(self.label)]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        state = self._state
        if state.weighted and self.label in state.probs:
            p = state.probs[self.label]
            total = None
            for i, cand in enumerate(self.candidates):
                if not p.requires_grad and float(p[i]) == 0.0:
                    continue  # a hard (one-hot) sample: only the chosen candidate runs
                y = p[i] * cand(*args, **kwargs)
                total = y if total is None else total + y
            return total
        return self.chosen()(*args, **kwargs)

    def extra_repr(self) -> str:
        return f"label={self.label!r}, keys={self.keys!r}"


class MixedInput(nn.Module):
    """Every input of an ``InputChoice``: the path's selection or the weighted sum of selections."""

    _state: ArchState

    def __init__(self, label: str, selections: Sequence[Any], reduction: str, state: ArchState):
        super().__init__()
        self.label, self.reduction = label, reduction
        self.selectors = [ChosenInputs([s] if isinstance(s, int) else list(s), reduction) for s in selections]
        self.__dict__["_state"] = state

    def forward(self, inputs: Sequence[torch.Tensor]) -> Any:
        state = self._state
        if state.weighted and self.label in state.probs:
            if self.reduction == "none":
                raise not_one_shot(self.label, "is an InputChoice with reduction='none' (a list of tensors) that a "
                                               "weighted strategy cannot mix; use reduction sum/mean/concat or "
                                               "td.oneshot.RandomOneShot/ENAS")
            p = state.probs[self.label]
            return sum(p[i] * sel(inputs) for i, sel in enumerate(self.selectors)
                       if p.requires_grad or float(p[i]) != 0.0)
        return self.selectors[state.index(self.label)](inputs)

    def extra_repr(self) -> str:
        return f"label={self.label!r}, reduction={self.reduction!r}, options={len(self.selectors)}"


class MixedDepth(nn.Sequential):
    """A ``Repeat`` at its largest depth; the path runs its first ``depth`` blocks, weights mix
    the outputs after each candidate depth. Iterating it yields the path's blocks only."""

    _state: ArchState
    _depth: TracedInt

    def __init__(self, blocks: Sequence[nn.Module], depth: TracedInt, state: ArchState):
        super().__init__(*blocks)
        self.__dict__["_depth"] = depth
        self.__dict__["_state"] = state

    def _active(self) -> list[nn.Module]:
        return list(self._modules.values())[: value_at(self._depth, self._state.sample)]

    def __iter__(self) -> Iterator[nn.Module]:
        state = self._state
        if state.weighted and state.single(self._depth) is not None:
            raise not_one_shot(next(iter(self._depth.labels)), "is a Repeat depth whose blocks are iterated in "
                                                                 "forward; call the Repeat module itself (self.blocks(x)) so a weighted "
                                                                 "strategy can mix depths")
        return iter(self._active())

    def forward(self, x: Any) -> Any:
        state = self._state
        label = state.single(self._depth) if state.weighted else None
        if label is None:
            for block in self._active():
                x = block(x)
            return x
        p = state.probs[label]
        depths = [value_at(self._depth, {label: v}) for v in state.values[label]]
        wanted = {d: [i for i, e in enumerate(depths) if e == d] for d in set(depths)}
        total = None
        blocks = list(self._modules.values())
        for d in range(max(depths) + 1):
            if d > 0:
                x = blocks[d - 1](x)
            for i in wanted.get(d, ()):
                y = p[i] * x
                total = y if total is None else total + y
        return total

    def extra_repr(self) -> str:
        return f"depth={sorted(self._depth.labels)}"


class MixedEdge(nn.Module):
    """One op of a ``tnn.Cell`` node: its candidates (a :class:`MixedLayer`) on every state it may
    read. A path runs the chosen input's op; weights mix the inputs by the input label's probabilities."""

    _state: ArchState

    def __init__(self, label: str, edges: Sequence[nn.Module], state: ArchState):
        super().__init__()
        self.label = label
        self.edges = nn.ModuleList(edges)
        self.__dict__["_state"] = state

    def forward(self, states: Sequence[torch.Tensor]) -> torch.Tensor:
        state = self._state
        if state.weighted and self.label in state.probs:
            p = state.probs[self.label]
            total = None
            for i, edge in enumerate(self.edges):
                if not p.requires_grad and float(p[i]) == 0.0:
                    continue
                y = p[i] * edge(states[i])
                total = y if total is None else total + y
            assert total is not None   # the probabilities sum to one: some edge ran
            return total
        i = state.index(self.label)
        return self.edges[i](states[i])

    def extra_repr(self) -> str:
        return f"label={self.label!r}, inputs={len(self.edges)}"


def _mixed_node(edges: Sequence[MixedEdge], states: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """A cell node's output under weights: each distinct candidate module on each input runs once,
    weighted by ``sum_k p(input_k = i) p(op_k = o)`` over the node's ops ``k`` that hold it (they
    share the candidates of an edge), the same sum as running every op apart. None where the node
    has one op or a label has no weights (the ops then run one by one)."""
    state = edges[0]._state
    if len(edges) < 2 or not state.weighted:
        return None
    layers: list[list[MixedLayer]] = [list(e.edges) for e in edges]  # type: ignore[arg-type]
    if any(e.label not in state.probs or any(layer.label not in state.probs for layer in per_input)
           for e, per_input in zip(edges, layers)):
        return None
    total = None
    for i in range(len(layers[0])):
        runs: dict[int, tuple[nn.Module, torch.Tensor]] = {}  # id(candidate) -> (candidate, its weight)
        for e, per_input in zip(edges, layers):
            layer = per_input[i]
            w_ops = state.probs[e.label][i] * state.probs[layer.label]
            for o, cand in enumerate(layer.candidates):
                held = runs.get(id(cand))
                runs[id(cand)] = (cand, w_ops[o] if held is None else held[1] + w_ops[o])
        for cand, w in runs.values():
            if not w.requires_grad and float(w) == 0.0:
                continue  # hard (one-hot) samples: only the chosen ops on the chosen inputs run
            y = w * cand(states[i])
            total = y if total is None else total + y
    return total


class MixedCell(nn.Module):
    """A ``tnn.Cell`` holding every wiring; ``ops[n]`` is the :class:`MixedEdge` of the frozen
    cell's ``ops[n]``, so a subnet's weights keep their names.

    With ``merge_op="loose_end"`` the output always concatenates every node, as NNI's one-shot
    cells do (``output_nodes`` lists them all, so layers reading the cell are built at the full
    width), and a node that another op of the path reads is masked to zero: the frozen model's
    narrower output is the supernet's with those channels left out, and its next layers take the
    matching columns of the supernet's weights (found by :meth:`Supernet.extract`). Weights mask a
    node softly, by the probability that no later op reads it."""

    def __init__(self, edges: Sequence[MixedEdge], num_nodes: int, num_ops_per_node: int, num_predecessors: int,
                 concat_dim: int, merge_op: str = "all"):
        super().__init__()
        self.ops = nn.ModuleList(edges)
        self.num_nodes, self.num_ops_per_node, self.num_predecessors = num_nodes, num_ops_per_node, num_predecessors
        self.concat_dim, self.merge_op = concat_dim, merge_op
        self.output_nodes = list(range(num_predecessors, num_predecessors + num_nodes))
        self.__dict__["probing"] = False  # Supernet.extract: masked nodes become NaN to find their columns

    def forward(self, *inputs: Any) -> torch.Tensor:
        if len(inputs) == 1 and isinstance(inputs[0], (list, tuple)):
            inputs = tuple(inputs[0])
        states = list(inputs)
        n = self.num_ops_per_node
        for j in range(self.num_nodes):
            node_edges: list[MixedEdge] = list(self.ops[j * n:(j + 1) * n])  # type: ignore[arg-type]
            total = _mixed_node(node_edges, states)
            if total is None:
                for edge in node_edges:
                    y = edge(states)
                    total = y if total is None else total + y
            states.append(total)
        outs = states[self.num_predecessors:]
        if self.merge_op == "loose_end":
            outs = [out if keep is None else self._mask(out, keep) for out, keep in zip(outs, self.loose_weights())]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=self.concat_dim)

    def _mask(self, out: torch.Tensor, keep: Any) -> torch.Tensor:
        if self.probing and isinstance(keep, float) and keep == 0.0:
            return torch.full_like(out, float("nan"))
        return out * keep

    def loose_weights(self) -> list[Any]:
        """Per node: ``None`` where no later op can read it, else the weight its output is kept
        with: 1.0 or 0.0 on a path, the probability that no op reads it under weights."""
        edges: list[MixedEdge] = list(self.ops)  # type: ignore[arg-type]
        state = self._state_of(edges)
        out: list[Any] = []
        for j in range(self.num_nodes):
            node = self.num_predecessors + j
            keep: Any = None
            for edge in edges[(j + 1) * self.num_ops_per_node:]:
                not_read: torch.Tensor | float
                if state.weighted and edge.label in state.probs:
                    not_read = 1.0 - state.probs[edge.label][node]
                else:
                    not_read = 0.0 if state.index(edge.label) == node else 1.0
                keep = not_read if keep is None else keep * not_read
            out.append(keep)
        return out

    @staticmethod
    def _state_of(edges: Sequence[MixedEdge]) -> ArchState:
        return edges[0]._state




# ---------------------------------------------------------------------------------------------
class SupernetResolver(Resolver):
    """Answers every label so that the construction holds *all* its models (see module doc)."""

    def __init__(self, state: ArchState):
        super().__init__()
        self.state = state
        self.claimed: dict[str, str] = {}  # label -> what holds it (for errors and the description)

    def _register(self, label: str, domain: Domain, source: str) -> None:
        if not isinstance(label, str) or not label:
            raise InvalidSpace(f"a label must be a non-empty string, got {label!r}")
        if label in self.asked:
            known = self.asked[label][0]
            if not known.same_as(domain):
                raise InvalidSpace(f"label {label!r} is used with conflicting candidates: {known!r} and {domain!r}")
            return
        if not domain.finite:
            raise not_one_shot(label, f"is a continuous {source} ({domain!r}); a supernet needs finite choices "
                                      "(td.choice with a list of values)")
        self.asked[label] = (domain, domain.default(), source)
        self.state.values[label] = domain.values()

    def resolve(self, label: str, domain: Domain, source: str = "choice") -> Any:
        self._register(label, domain, source)
        values = domain.values()
        candidates = [domain.to_candidate(v) for v in values]
        if source == "layer_choice":
            self.claimed[label] = "LayerChoice"
            return MixedLayer(label, values, [instantiate_candidate(c, label) for c in candidates], self.state)
        if all(isinstance(c, int) and not isinstance(c, bool) for c in candidates):
            top = max(candidates)
            return TracedInt(top, _leaf(label, domain, top), {label})
        if all(isinstance(c, (int, float)) and not isinstance(c, bool) for c in candidates):
            top = max(candidates)  # a size computed from it (``dim * ratio``) is built at its largest
            return TracedFloat(float(top), _leaf(label, domain, top), {label})
        raise not_one_shot(label, f"has candidates {values!r} that are not numbers: its value is used in Python "
                                  "code the supernet cannot follow; choose between layers with "
                                  "tnn.LayerChoice({...}) instead")

    # -- hooks called by tnn.InputChoice and tnn.Repeat while this resolver is active ----------
    def input_choice(self, label: str, n_candidates: int, n_chosen: int, reduction: str) -> nn.Module:
        if n_chosen == 1:
            domain = Categorical(list(range(n_candidates)), label=label)
        else:
            domain = Categorical([list(c) for c in itertools.combinations(range(n_candidates), n_chosen)], label=label)
        self._register(label, domain, "input_choice")
        self.claimed[label] = "InputChoice"
        return MixedInput(label, domain.values(), reduction, self.state)

    def cell(self, label: str, op_domain: Domain, num_nodes: int, num_ops_per_node: int, num_predecessors: int,
             merge_op: str, concat_dim: int) -> nn.Module:
        values = op_domain.values()
        candidates = [op_domain.to_candidate(v) for v in values]
        edges = []
        # One set of candidate ops per edge (node, input), shared by the node's ops, as NNI's one-shot
        # cells (and DARTS' edges) have: a weighted cell then runs each candidate once per edge. A
        # factory that builds another op for another op index (its repr differs) keeps its own.
        first: dict[tuple[int, int, int], nn.Module] = {}
        for j in range(num_nodes):
            node = num_predecessors + j
            for k in range(num_ops_per_node):
                op_label, input_label = f"{label}/op_{node}_{k}", f"{label}/input_{node}_{k}"
                self._register(input_label, Categorical(list(range(node)), label=input_label), "cell")
                self._register(op_label, op_domain, "cell")
                self.claimed[input_label] = "Cell input"
                self.claimed[op_label] = "Cell op"
                per_input = []
                for i in range(node):
                    built = []
                    for o, c in enumerate(candidates):
                        op = _copy(c) if isinstance(c, nn.Module) else instantiate_candidate(c(node, k, i), op_label)
                        shared = first.setdefault((node, i, o), op)
                        built.append(shared if repr(shared) == repr(op) else op)
                    per_input.append(MixedLayer(op_label, values, built, self.state))
                edges.append(MixedEdge(input_label, per_input, self.state))
        return MixedCell(edges, num_nodes, num_ops_per_node, num_predecessors, concat_dim, merge_op)

    def repeat(self, blocks: Any, depth: int) -> nn.Module | None:
        if not isinstance(depth, TracedInt):
            return None  # a fixed depth: an ordinary Repeat
        if isinstance(blocks, nn.Module):
            built = [_copy(blocks) for _ in range(depth)]
        elif isinstance(blocks, Sequence):
            if depth > len(blocks):
                raise InvalidSpace(f"Repeat got depth {int(depth)} but only {len(blocks)} blocks")
            built = list(blocks)[:depth]
        else:
            built = [blocks(i) for i in range(depth)]
        for label in depth.labels:
            self.claimed[label] = "Repeat depth"
        return MixedDepth(built, depth, self.state)


def _copy(module: nn.Module) -> nn.Module:
    import copy

    return copy.deepcopy(module)


def _leaf(label: str, domain: Domain, top: Any) -> Callable[[Sample], Any]:
    def fn(sample: Sample) -> Any:
        return domain.to_candidate(sample[label]) if label in sample else top
    return fn


# ---------------------------------------------------------------------------------------------
class Supernet:
    """A space's supernet: ``model`` (an ``nn.Module``), its :class:`ArchState` and helpers.

    >>> net = build_supernet(space)                      # doctest: +SKIP
    >>> net.set_path(space.random_sample(0)); y = net.model(x)   # doctest: +SKIP
    >>> child = net.extract(sample)   # a frozen model carrying the supernet's weights  # doctest: +SKIP
    """

    def __init__(self, space: BaseSpace, model: nn.Module, state: ArchState, claimed: Mapping[str, str],
                 example_inputs: Any = None):
        self.space, self.model, self.state = space, model, state
        self.claimed = dict(claimed)
        self.search_space: SearchSpace = space.search_space()
        self.example_inputs = space.example_inputs if space.example_inputs is not None else example_inputs
        self.loose_cells = [m for m in model.modules() if isinstance(m, MixedCell) and m.merge_op == "loose_end"]

    def set_path(self, sample: Sample) -> None:
        """Compute the model of ``sample`` (labels of the space; others are ignored)."""
        self.state.set_path({k: v for k, v in sample.items() if k in self.state.values})

    def set_weights(self, probs: Mapping[str, torch.Tensor]) -> None:
        """Mix every label by ``probs[label]`` (a vector over ``search_space[label].domain.values()``)."""
        argmax = {label: self.state.values[label][int(p.argmax())] for label, p in probs.items()}
        self.state.set_weights(probs, argmax)

    def parameters(self) -> Iterator[nn.Parameter]:
        return self.model.parameters()

    # -- subnets ------------------------------------------------------------------------------
    def subnet_state(self, sample: Sample, names: Sequence[str]) -> dict[str, torch.Tensor]:
        """The tensors the frozen model of ``sample`` has under ``names``, sliced from the supernet."""
        return {name: self._locate(name, sample) for name in names}

    def _owner(self, name: str, sample: Sample) -> tuple[nn.Module, str]:
        """The supernet module holding the frozen model's tensor ``name`` on ``sample``'s path, and its leaf name."""
        parts = name.split(".")
        module: nn.Module = self.model
        path: list[str] = []
        for part in parts[:-1]:
            module = _unwrap(module, sample, self.state)
            child = module._modules.get(part)
            if child is None:
                raise KeyError(".".join(path + [part]))
            module = child
            path.append(part)
        return _unwrap(module, sample, self.state), parts[-1]

    def _locate(self, name: str, sample: Sample) -> torch.Tensor:
        module, leaf = self._owner(name, sample)
        if isinstance(module, _Entangled) and leaf in {*module._parameters, *module._buffers}:
            return module.sliced(leaf, sample)
        tensor: torch.Tensor | None = module._parameters.get(leaf)
        if tensor is None:
            tensor = module._buffers.get(leaf)
        if tensor is None:
            raise KeyError(name)
        return tensor

    def extract(self, sample: Sample, *, seed: int = 0) -> nn.Module:
        """The frozen model of ``sample`` (``space.freeze``) carrying the supernet's weights."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = self.space.freeze(self.space.restrict(sample), check=False)
        clean: Sample = getattr(model, "tridens_sample")   # the restricted sample freeze() set
        state = model.state_dict()
        sliced = self.subnet_state(clean, list(state))
        if self.loose_cells:
            columns = self._loose_columns(clean)
            for name, tensor in sliced.items():
                if tensor.shape == state[name].shape:
                    continue
                module, leaf = self._owner(name, clean)
                dim = _INPUT_DIM.get((_kind(module), leaf))
                kept = columns.get(id(module))
                if dim is not None and kept is not None and tensor.shape[dim] != state[name].shape[dim]:
                    sliced[name] = tensor.index_select(dim, kept.to(tensor.device))
        model.load_state_dict({k: v.detach().clone() for k, v in sliced.items()})
        return model

    def _loose_columns(self, sample: Sample) -> dict[int, torch.Tensor]:
        """For each Conv/Linear/BatchNorm reading a loose-end cell's output on ``sample``'s path, the
        input channels the frozen model keeps (id(module) -> indices). One forward on the example
        inputs with the masked nodes set to NaN: a layer whose input has NaN in some channels keeps the
        others (and reads zeros there, so the layers after it see numbers again)."""
        if self.example_inputs is None:
            raise not_one_shot(None, "has a Cell with merge_op='loose_end' and no example inputs: set "
                                     "space.example_inputs so the supernet can map a subnet's weights")
        found: dict[int, torch.Tensor] = {}

        def before(module: nn.Module, args: tuple[Any, ...]) -> Any:
            x = args[0] if args else None
            if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() < 2:
                return None
            nan = torch.isnan(x)
            if not bool(nan.any()):
                return None
            dim = x.dim() - 1 if isinstance(module, nn.Linear) else 1
            dead = nan.movedim(dim, 0).flatten(1).any(1)  # (padding may have put numbers beside a NaN)
            if bool(dead.all()):
                return None  # NaN everywhere: mixed by something else, nothing to learn here
            found[id(module)] = (~dead).nonzero().flatten()
            if isinstance(module, (nn.modules.conv._ConvNd, nn.Linear)):
                return (torch.nan_to_num(x, nan=0.0), *args[1:])
            return None

        hooks = [m.register_forward_pre_hook(before) for m in self.model.modules()
                 if isinstance(m, (nn.modules.conv._ConvNd, nn.Linear, nn.modules.batchnorm._BatchNorm))]
        inputs = self.example_inputs if isinstance(self.example_inputs, (tuple, list)) else (self.example_inputs,)
        device = next(iter(self.model.parameters()), torch.empty(0)).device
        inputs = tuple(x.to(device) if isinstance(x, torch.Tensor) else x for x in inputs)
        was_training = self.model.training
        self.set_path(sample)
        for cell in self.loose_cells:
            cell.__dict__["probing"] = True
        self.model.eval()
        try:
            with torch.no_grad():
                self.model(*inputs)
        finally:
            for hook in hooks:
                hook.remove()
            for cell in self.loose_cells:
                cell.__dict__["probing"] = False
            self.model.train(was_training)
        return found


def _kind(module: nn.Module) -> str:
    if isinstance(module, nn.modules.conv._ConvNd):
        return "conv"
    if isinstance(module, nn.Linear):
        return "linear"
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        return "norm"
    return "other"


# The dimension of each tensor along which a layer reads its input channels.
_INPUT_DIM = {("conv", "weight"): 1, ("linear", "weight"): 1, ("norm", "weight"): 0, ("norm", "bias"): 0,
              ("norm", "running_mean"): 0, ("norm", "running_var"): 0}


def _unwrap(module: nn.Module, sample: Sample, state: ArchState) -> nn.Module:
    while isinstance(module, (MixedLayer, MixedEdge)):
        if isinstance(module, MixedEdge):
            module = module.edges[_index_in(state.values[module.label], sample, module.label)]
        else:
            module = module.candidates[_index_in(state.values[module.label], sample, module.label)]
    return module


def _index_in(values: list[Any], sample: Sample, label: str) -> int:
    if label not in sample:
        return 0
    for i, v in enumerate(values):
        if same_value(v, sample[label]):
            return i
    raise InvalidSample(f"value {sample[label]!r} of label {label!r} is outside its domain {values!r}")


# ---------------------------------------------------------------------------------------------
def build_supernet(space: BaseSpace, *, verify: bool = True, seed: int = 0, max_checks: int = 24,
                   example_inputs: Any = None) -> Supernet:
    """Build the supernet of ``space`` (see the module docstring); raises :class:`InvalidSpace`
    naming the label when the space cannot be made one-shot. ``example_inputs`` stand in for a
    space without its own where the supernet needs inputs (a loose-end cell's subnets are mapped
    by one forward).

    >>> net = td.oneshot.build_supernet(Net())   # doctest: +SKIP
    """
    if not isinstance(space, ModelSpace):
        raise not_one_shot(None, f"is a {type(space).__name__} (graph mutators edit each model after it is built, "
                                 "so no single module holds them all)")
    search_space = space.search_space()
    state = ArchState()
    resolver = SupernetResolver(state)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        with using(resolver):
            model = space._build(resolver, discovery=False)
    _entangle(model, state, resolver.claimed)
    for label, spec in search_space.items():
        if label not in resolver.claimed:
            if label not in resolver.asked:
                raise not_one_shot(label, "exists only under some values of another choice that the supernet "
                                          "cannot hold at once (Python control flow on a choice)")
            raise not_one_shot(label, "does not reach a layer the supernet can slice (it is used in Python code: "
                                      "an if, a loop, or a module type that is not Conv1d/Conv2d/Linear/BatchNorm/LayerNorm/"
                                      "Embedding/MultiheadAttention)")
    net = Supernet(space, model, state, resolver.claimed, example_inputs)
    if verify:
        _verify(net, seed, max_checks)
    return net


def _entangle(model: nn.Module, state: ArchState, claimed: dict[str, str]) -> None:
    """Turn layers whose sizes are traced into entangled layers; make other traced attributes
    dynamic (set from the path before each call)."""
    for name, module in list(model.named_modules()):
        traced = {k: v for k, v in vars(module).items()
                  if not k.startswith("_") and (is_traced(v) or (isinstance(v, (tuple, list)) and traced_labels(v)))}
        if not traced:
            continue
        where = f"{name or '<root>'} ({type(module).__name__})"
        spec = _ENTANGLED.get(type(module))
        if spec is not None:
            cls, allowed = spec
            bad = [k for k in traced if k not in allowed]
            if bad:
                raise not_one_shot(sorted(traced_labels(traced[bad[0]]))[0],
                                   f"sets {where}.{bad[0]}, which the supernet cannot slice")
            if "groups" in traced and not (traced.get("in_channels") is traced["groups"] or
                                           plain(traced.get("in_channels")) == plain(traced["groups"])):
                raise not_one_shot(sorted(traced_labels(traced["groups"]))[0],
                                   f"sets the groups of {where} without it being depthwise (groups == in_channels)")
            if getattr(module, "padding_mode", "zeros") != "zeros" and module.weight.dim() > 2:
                raise not_one_shot(sorted(traced_labels(next(iter(traced.values()))))[0],
                                   f"changes {where}, whose padding_mode {module.padding_mode!r} cannot be sliced")
            if isinstance(getattr(module, "padding", None), str):
                raise not_one_shot(sorted(traced_labels(next(iter(traced.values()))))[0],
                                   f"changes {where}, whose padding={module.padding!r} cannot be sliced; use an int padding")
            module.__class__ = cls  # our own supernet copy: the user's classes are untouched
            module._setup(traced, state)
            for k, v in traced.items():
                for label in traced_labels(v):
                    claimed.setdefault(label, f"{where}.{k}")
            continue
        if type(module) in _ENTANGLED or any(isinstance(module, t) for t in _ENTANGLED) and any(
                k in traced for k in ("in_channels", "out_channels", "in_features", "out_features", "num_features")):
            label = sorted(traced_labels(next(iter(traced.values()))))[0]
            raise not_one_shot(label, f"sets the size of {where}, a subclass with its own forward that the supernet "
                                      "cannot slice")
        if any(p is not None for p in module._parameters.values()):
            k = next(iter(traced))
            raise not_one_shot(sorted(traced_labels(traced[k]))[0],
                               f"sets {where}.{k}, a layer with weights the supernet does not know how to slice")
        _make_dynamic(module, traced, state)
        for k, v in traced.items():
            for label in traced_labels(v):
                claimed.setdefault(label, f"{where}.{k}")


def _make_dynamic(module: nn.Module, traced: dict[str, Any], state: ArchState) -> None:
    for k, v in traced.items():
        object.__setattr__(module, k, plain(v))

    def before(mod: nn.Module, _args: Any) -> None:
        for k, v in traced.items():
            object.__setattr__(mod, k, value_at(v, state.sample))
    module.register_forward_pre_hook(before)


# ---------------------------------------------------------------------------------------------
def _verify(net: Supernet, seed: int, max_checks: int) -> None:
    """Every checked sample's model built alone must take the supernet's weights and (with
    example inputs) compute the supernet's output on that path."""
    space, search_space = net.space, net.search_space
    # Two bases: every label at its default, and at the supernet's own (largest) values, where
    # labels that exist only under a large depth are active; each label varied one at a time.
    largest = _fill(search_space, {}, largest=True) or search_space.default_sample()
    checks: list[tuple[str | None, dict[str, Any]]] = [(None, search_space.default_sample()), (None, largest)]
    for base in (checks[0][1], largest):
        for label, spec in search_space.items():
            for value in spec.domain.values():
                filled = _fill(search_space, {**base, label: value})
                if filled is not None:
                    checks.append((label, filled))
    rng = random.Random(seed)
    unique: dict[str, tuple[str | None, dict[str, Any]]] = {}
    for varied, sample in checks:
        unique.setdefault(repr(sorted(sample.items())), (varied, sample))
    ordered = list(unique.values())
    if len(ordered) > max_checks:
        ordered = ordered[:1] + rng.sample(ordered[1:], max_checks - 1)
    inputs = space.example_inputs if space.example_inputs is not None or not net.loose_cells else net.example_inputs
    broken: list[tuple[dict[str, Any], str]] = []
    was_training = net.model.training
    net.model.eval()
    try:
        for varied, sample in ordered:
            try:
                child = net.extract(sample, seed=seed)
            except KeyError as err:
                raise not_one_shot(varied, f"changes the model's structure in a way the supernet does not hold "
                                          f"(sample {sample}: the model built alone has {err.args[0]!r}, the supernet "
                                          f"has nothing there)") from None
            except RuntimeError as err:
                detail = " ".join(str(err).split())[:300]
                raise not_one_shot(varied, f"changes a weight's shape in a way the supernet cannot slice (sample "
                                          f"{sample}: {detail})") from None
            if inputs is None:
                continue
            args = inputs if isinstance(inputs, (tuple, list)) else (inputs,)
            net.set_path(sample)
            child.eval()
            with torch.no_grad():
                try:
                    want = child(*args)
                except Exception as err:
                    if not net.loose_cells:
                        raise
                    broken.append((sample, " ".join(str(err).split())[:200]))
                    continue
                got = net.model(*args)
            if not _close(want, got):
                culprit = varied
                if culprit is None:
                    culprit = next(iter(search_space), None)
                raise not_one_shot(culprit, f"is used in a way the supernet cannot follow (sample {sample}: the model "
                                            "built alone and the supernet's path compute different outputs; a value "
                                            "stored and used in forward, or data-dependent control flow?)")
    finally:
        net.model.train(was_training)
    if broken:
        sample, error = broken[0]
        warnings.warn(f"{len(broken)} of {len(ordered)} checked models of this space fail when built alone (sample "
                      f"{sample}: {error}): a loose-end cell's output is narrower than all its nodes, and a layer "
                      "reading it was built for all of them. The supernet holds every node, as NNI's does, so the "
                      "search runs, but such subnets cannot be retrained; size the layers after the cell by "
                      "len(cell.output_node_indices)", stacklevel=3)


def _close(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and torch.allclose(a, b, rtol=1e-4, atol=1e-5)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    return a == b


def _fill(search_space: SearchSpace, partial: Mapping[str, Any], largest: bool = False) -> dict[str, Any] | None:
    """A valid sample keeping ``partial``'s values where active, else each label's default (or,
    with ``largest``, its largest int value)."""
    out: dict[str, Any] = {}
    for label, spec in search_space.items():
        if not spec.active(out):
            continue
        if label in partial and spec.domain.contains(partial[label]):
            out[label] = partial[label]
        elif largest and all(isinstance(v, int) and not isinstance(v, bool) for v in spec.domain.values()):
            out[label] = max(spec.domain.values())
        else:
            out[label] = spec.domain.default()
    try:
        return search_space.validate(out)
    except InvalidSample:
        return None
