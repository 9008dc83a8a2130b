"""Building blocks of model spaces: ``ModelSpace`` and the structural choices.

>>> from tridens import nn as tnn
"""

from ..space._model_space import ModelSpace
from ._cell import Cell, FrozenCell
from ._choices import ChosenInputs, InputChoice, LayerChoice, Repeat

__all__ = ["ModelSpace", "LayerChoice", "InputChoice", "Repeat", "Cell", "ChosenInputs", "FrozenCell"]
