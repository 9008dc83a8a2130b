"""The conversation between Ray workers and the driver of the Ray executor.

Workers post messages to one :class:`Hub` actor and wait there for the driver's answers; the
driver drains the hub (every ``POLL_S`` seconds at most) and hands each task's messages to
that task's channel (:class:`~._channel.TaskChannel`, read by the one lockstep driver,
:mod:`._driver`). Every message travels in a :class:`~._messages.Posted` envelope naming the
attempt (a task started again counts up), its worker (pid, node) and, for a call, the key its
answer comes back under; it names its trial:

* :class:`~._messages.Started`: the task began training the trial;
* :class:`~._messages.Round`: a unit's round of its members' reports, answered with
  :class:`~._messages.Verdicts` (posted by :meth:`Hub.call`, answered with :meth:`Hub.reply`);
* :class:`~._messages.Report`: a user loop's step, answered with a :class:`~._protocol.Verdict`
  value (posted by :meth:`Hub.call`);
* :class:`~._messages.Left`: a member of a unit left its task;
* :class:`~._messages.Forked`: a member continues from another's state;
* :class:`~._messages.ArchiveCall`: a stage tree's stage-store call (:mod:`._stage_relay`; posted
  by :meth:`Hub.call`, answered with :meth:`Hub.reply`).

An *outcome* is a :class:`~._messages.Outcome` (its weights: the final weights' file under storage),
read by :func:`~._watchdog.settle`.
"""

from __future__ import annotations

import asyncio
from typing import Any, Mapping

import ray

from ._messages import Posted


__all__ = ["Hub", "HubActor", "POLL_S", "death_cause", "start_hub"]

POLL_S = 0.05  # how long one drain of the hub waits for messages (the driver's reaction time)


class HubActor:
    """Workers post messages and wait for answers; the driver drains messages and answers (one
    actor per executor, :data:`Hub`).

    An async actor: a worker waiting for its decision holds no thread, and a drain returns as
    soon as a message arrives (or after ``timeout`` seconds)."""

    def __init__(self) -> None:
        self.messages: list[Posted] = []
        self.arrived = asyncio.Event()
        self.answers: dict[tuple[Any, ...], asyncio.Future] = {}

    def _future(self, key: tuple[Any, ...]) -> asyncio.Future:
        if key not in self.answers:
            self.answers[key] = asyncio.get_running_loop().create_future()
        return self.answers[key]

    async def post(self, message: Posted) -> None:
        self.messages.append(message)
        self.arrived.set()

    async def call(self, key: tuple[Any, ...], message: Posted) -> Any:
        """Post ``message`` and wait for the driver's :meth:`reply` under ``key``."""
        future = self._future(key)
        await self.post(message)
        try:
            return await future
        finally:
            self.answers.pop(key, None)

    async def reply(self, key: tuple[Any, ...], value: Any) -> None:
        future = self._future(key)
        if not future.done():
            future.set_result(value)

    async def node_id(self) -> str:
        """The Ray node this hub runs on (hex)."""
        return ray.get_runtime_context().get_node_id()

    async def drain(self, timeout: float) -> list[Posted]:
        if not self.messages:
            try:
                await asyncio.wait_for(self.arrived.wait(), timeout)
            except asyncio.TimeoutError:
                pass
        out, self.messages = self.messages, []
        self.arrived.clear()
        return out


Hub = ray.remote(num_cpus=0)(HubActor)  # the actor class: ``Hub.remote()`` starts one (it uses no CPU)


def start_hub() -> Any:
    """A hub on the driver's own node (not soft): the search's state stays with the driver, so
    losing any other node loses only the tasks that ran there."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    try:
        here = ray.get_runtime_context().get_node_id()
    except Exception:  # a driver without a node of its own (Ray Client): wherever Ray places it
        return Hub.remote()
    return Hub.options(scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False)).remote()


def death_cause(err: BaseException, trial_info: Mapping[str, Any]) -> str:
    """One line for a task whose worker or node died: the error's kind, the node the trial last
    ran on (from its ``"started"`` message) and the first line of Ray's text."""
    text = str(err).strip()
    node = (trial_info.get("ray") or {}).get("node")
    return f"{type(err).__name__}{f' on node {node}' if node else ''}: {text.splitlines()[0] if text else ''}"
