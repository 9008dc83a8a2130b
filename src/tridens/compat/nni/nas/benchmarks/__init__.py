"""NNI 2.x's ``nni.nas.benchmarks`` (3.x: ``nni.nas.benchmark``): refused, naming the alternative."""

from ..benchmark import download_benchmark, load_benchmark

__all__ = ["load_benchmark", "download_benchmark"]
