"""The package path of NNI's ``nni.retiarii.experiment``; its module ``pytorch`` maps NNI's experiment onto tridens."""
