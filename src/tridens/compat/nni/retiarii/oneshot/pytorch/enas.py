"""``nni.retiarii.oneshot.pytorch.enas`` (NNI 2.x): ``EnasTrainer``."""

from . import EnasTrainer

__all__ = ["EnasTrainer"]
