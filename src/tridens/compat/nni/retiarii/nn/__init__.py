"""The package path of NNI's ``nni.retiarii.nn``; its module ``pytorch`` maps NNI's names onto tridens."""
