"""``nni.retiarii.fixed`` (NNI 2.x): ``fixed_arch``."""

from .._fixed import fixed_arch

__all__ = ["fixed_arch"]
