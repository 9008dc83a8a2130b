"""The package path of NNI's ``nni.nas`` (3.0): its modules map NNI's names onto tridens."""
