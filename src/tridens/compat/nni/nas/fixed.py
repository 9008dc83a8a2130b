"""``nni.nas.fixed.fixed_arch`` on tridens."""

from .._fixed import fixed_arch

__all__ = ["fixed_arch"]
