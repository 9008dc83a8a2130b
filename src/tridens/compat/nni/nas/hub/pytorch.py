"""``nni.nas.hub.pytorch``: the model-space hub on ``tridens.hub`` (see ``tridens.compat.nni._hub``)."""

from ..._hub import (DARTS, ENAS, PNAS, AmoebaNet, AutoFormer, MobileNetV3Space, NasBench101, NasBench201, NASNet,
                     ProxylessNAS, ShuffleNetSpace)

__all__ = ["NasBench101", "NasBench201", "NASNet", "ENAS", "AmoebaNet", "PNAS", "DARTS", "ProxylessNAS",
           "MobileNetV3Space", "ShuffleNetSpace", "AutoFormer"]
