"""The local Ray that the Ray executor starts when it is given no address: its processes (GCS,
raylet and object manager, runtime-env agent, workers, the driver's own core worker) listen on
127.0.0.1 only, so nothing on the network can reach a run that was never meant to be a cluster.

Ray (2.58) binds every server to its *node IP address*, but replaces a loopback node address
(``127.0.0.1``, ``localhost``) with the machine's outward address unless it runs as a
single-machine Ray: the setting that ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` selects, read into
``ray._private.ray_constants.ENABLE_RAY_CLUSTER`` when Ray is imported. The environment variable
cannot serve here (Ray is imported before a run starts, and it would also turn a driver that
joins a real cluster into a loopback one), so that setting is switched off for the one
``ray.init`` call that starts the local Ray, and put back right after; the processes it starts
are handed ``127.0.0.1`` as their node address. ``address="local"``: always a Ray of its own, never
a cluster some other process on the machine started (which ``ray.init()`` would join). No dashboard is started. A Ray whose node
address still comes out otherwise (a Ray version without that setting) is logged as a warning
naming the address it listens on.
"""

from __future__ import annotations

import logging
from typing import Any

import ray

__all__ = ["LOOPBACK", "start_local_ray"]

log = logging.getLogger("tridens")

LOOPBACK = "127.0.0.1"


def start_local_ray(num_cpus: int, **options: Any) -> str:
    """Start a Ray on this machine with ``num_cpus`` CPUs, no dashboard and quiet logs, every
    process listening on 127.0.0.1; returns the node address it runs on (``"127.0.0.1"``).
    ``options`` go to ``ray.init`` (``logging_level``, ``num_gpus``, ...).

    >>> start_local_ray(2)                                     # doctest: +SKIP
    '127.0.0.1'
    >>> ray.shutdown()                                         # doctest: +SKIP
    """
    from ray._private import ray_constants

    settings = {"include_dashboard": False, "logging_level": logging.ERROR, "configure_logging": True, **options}
    cluster = getattr(ray_constants, "ENABLE_RAY_CLUSTER", None)
    if cluster is not None:
        ray_constants.ENABLE_RAY_CLUSTER = False  # keep 127.0.0.1 as the node address (see the module docstring)
    try:
        ray.init(address="local", num_cpus=num_cpus, _node_ip_address=LOOPBACK, **settings)
    finally:
        if cluster is not None:
            ray_constants.ENABLE_RAY_CLUSTER = cluster
    address = str(ray.util.get_node_ip_address())
    if address != LOOPBACK:
        log.warning("the local Ray listens on %s, not only on %s: this Ray version does not keep a loopback node "
                    "address", address, LOOPBACK)
    return address
