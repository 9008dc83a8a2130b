"""``nni.retiarii.hub``: see ``tridens.compat.nni.retiarii.hub.pytorch``."""
