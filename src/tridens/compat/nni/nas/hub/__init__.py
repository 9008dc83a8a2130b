"""``nni.nas.hub``: see ``tridens.compat.nni.nas.hub.pytorch``."""
