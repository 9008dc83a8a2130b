"""Building blocks of model spaces: ``ModelSpace`` and the structural choices.

>>> from tridens import nn as tnn
"""

from ..space import ModelSpace
from ._cell import Cell, FrozenCell
from ._choices import ChosenInputs, InputChoice, LayerChoice, Repeat, instantiate_candidate

__all__ = ["ModelSpace", "LayerChoice", "InputChoice", "Repeat", "Cell", "ChosenInputs", "FrozenCell",
           "instantiate_candidate"]
