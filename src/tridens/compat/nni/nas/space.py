"""``nni.nas.space.model_context`` on tridens."""

from .._fixed import model_context

__all__ = ["model_context"]
