"""The package path of NNI's ``nni.nas.nn``; its module ``pytorch`` maps NNI's names onto tridens."""
