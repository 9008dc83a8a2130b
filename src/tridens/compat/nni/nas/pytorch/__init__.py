"""NNI 1.x's ``nni.nas.pytorch`` (removed from NNI in 2.9): only ``callbacks``, whose names scripts
still import at top level for their ``--v1`` branches; everything else of 1.x is NNI 2.x's
``nni.retiarii`` here."""
