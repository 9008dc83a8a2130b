"""The package path of NNI's ``nni.retiarii.oneshot``; its package ``pytorch`` maps NNI's one-shot trainers onto tridens."""
