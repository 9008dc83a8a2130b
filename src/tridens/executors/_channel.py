"""The driver's end of the conversation with a process that trains its trials: a :class:`Channel`
carries the typed messages of :mod:`._messages` and says whether the far side still lives.

* :class:`PipeChannel`: a multiprocessing pipe to one process (a pool worker, a forked child);
  the process's liveness and exit code come with it.
* :class:`HubChannel`: the Ray hub actor every Ray task posts to (:mod:`._ray_hub`); messages
  arrive in :class:`~._messages.Posted` envelopes and go to their task's channel.
* :class:`TaskChannel`: one Ray task's channel on the hub: the messages of its trials and
  attempt, routed to it by :meth:`HubChannel.route`; answers go back under the key of the call
  the task waits on; its end is told by its object ref: what it returned (the members'
  outcomes), or how its worker or node died (:func:`~._ray_hub.death_cause`).

A far side that went away makes :meth:`Channel.receive` and :meth:`Channel.send` raise
:class:`ChannelClosed` (an ``OSError``); :meth:`Channel.exit_description` then says how it ended,
for the one death message (:func:`~._watchdog.death_error`).

>>> import multiprocessing as mp
>>> ours, theirs = mp.Pipe()
>>> channel = PipeChannel(ours)
>>> theirs.send("hello"); channel.poll(1.0), channel.receive()
(True, 'hello')
>>> channel.close()
"""

from __future__ import annotations

import abc
import time
from multiprocessing.connection import Connection, wait
from typing import Any, Sequence, TypeVar

__all__ = ["Channel", "ChannelClosed", "PipeChannel", "HubChannel", "TaskChannel", "ready"]


class ChannelClosed(OSError):
    """The far side of a channel went away (its process died, or closed its end)."""


class Channel(abc.ABC):
    """One end of a conversation with the process(es) that train trials."""

    @abc.abstractmethod
    def send(self, message: Any) -> None:
        """Send ``message``; :class:`ChannelClosed` when the far side is gone."""

    @abc.abstractmethod
    def receive(self) -> Any:
        """The next message (waits for it); :class:`ChannelClosed` when the far side is gone."""

    @abc.abstractmethod
    def poll(self, timeout: float = 0.0) -> bool:
        """Whether a message is there to :meth:`receive`, waiting up to ``timeout`` seconds."""

    def close(self) -> None:
        """Release this end (the far side sees the channel closed)."""

    def alive(self) -> bool:
        """Whether the far side still runs."""
        return True

    def kill(self) -> None:
        """End the far side now (it hangs, or the run stops) and close this end."""
        self.close()

    def exit_description(self, wait: float = 2.0) -> str:
        """How the far side ended (``"exit code -9"``), waiting up to ``wait`` seconds for it to end."""
        return "it ended"

    def waitables(self) -> list[Any]:
        """The connections whose data may be this channel's next message (for :func:`ready`)."""
        return []

    def buffered(self) -> bool:
        """Whether this channel has a message (or its end) read already, to :meth:`receive` now."""
        return False


class PipeChannel(Channel):
    """A multiprocessing pipe ``conn`` to ``process`` (None: a pipe alone)."""

    def __init__(self, conn: Connection, process: Any = None):
        self.conn, self.process = conn, process

    def send(self, message: Any) -> None:
        try:
            self.conn.send(message)
        except OSError as err:   # (BrokenPipeError too)
            raise ChannelClosed(str(err)) from err

    def receive(self) -> Any:
        try:
            return self.conn.recv()
        except (EOFError, OSError) as err:
            raise ChannelClosed(str(err) or "the far side closed the pipe") from err

    def poll(self, timeout: float = 0.0) -> bool:
        try:
            return self.conn.poll(timeout)
        except (EOFError, OSError):
            return True   # what is there to read is the end: receive() says so

    def close(self) -> None:
        self.conn.close()

    def alive(self) -> bool:
        return self.process is None or self.process.is_alive()

    def kill(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.join()
        self.close()

    def exit_code(self, wait: float = 2.0) -> int | None:
        """The process's exit code once it ended (None if it still runs after ``wait`` seconds)."""
        if self.process is None:
            return None
        self.process.join(timeout=wait)
        return self.process.exitcode

    def exit_description(self, wait: float = 2.0) -> str:
        return f"exit code {self.exit_code(wait)}"

    def waitables(self) -> list[Any]:
        return [self.conn]


C = TypeVar("C", bound=Channel)


def ready(channels: Sequence[C], timeout: float) -> list[C]:
    """The ``channels`` with a message (or their end) to read, waiting up to ``timeout`` seconds:
    Ray tasks' channels after one drain of their hub (:meth:`HubChannel.route`); others holding
    one already, else those whose connections have data (several channels may read one
    connection: each of them is returned)."""
    tasks = [channel for channel in channels if isinstance(channel, TaskChannel)]
    if tasks:
        tasks[0].hub.route()
        return [channel for channel in channels if isinstance(channel, TaskChannel) and channel.poll()]
    now = [channel for channel in channels if channel.buffered()]
    by_conn: dict[Any, list[C]] = {}
    for channel in channels:
        for conn in channel.waitables():
            by_conn.setdefault(conn, []).append(channel)
    if not by_conn:
        if not now:
            time.sleep(timeout)
        return now
    for conn in wait(list(by_conn), timeout=0 if now else timeout):
        now += [channel for channel in by_conn[conn] if channel not in now]
    return now


class HubChannel(Channel):
    """The driver's end of the Ray hub (``hub``: the actor, :func:`~._ray_hub.start_hub`): it
    receives every task's :class:`~._messages.Posted` messages and hands them to the task's own
    channel (:meth:`task`, :meth:`route`), through which the task is answered."""

    def __init__(self, hub: Any):
        self.hub = hub
        self.inbox: list[Any] = []
        self.tasks: list[TaskChannel] = []

    def send(self, message: Any) -> None:
        raise TypeError(f"a Ray task is answered through its own channel (HubChannel.task), not the hub: "
                        f"{type(message).__name__}")

    def poll(self, timeout: float = 0.0) -> bool:
        if not self.inbox:
            import ray

            self.inbox.extend(ray.get(self.hub.drain.remote(timeout)))
        return bool(self.inbox)

    def receive(self) -> Any:
        while not self.poll(1.0):
            pass
        return self.inbox.pop(0)

    def receive_all(self, timeout: float) -> list[Any]:
        """Every message posted so far, waiting up to ``timeout`` seconds for the first."""
        self.poll(timeout)
        out, self.inbox = self.inbox, []
        return out

    def task(self, ref: Any, attempt: int, trials: Sequence[int]) -> TaskChannel:
        """The channel of the task ``ref`` (its ``attempt``, training ``trials``)."""
        channel = TaskChannel(self, ref, attempt, trials)
        self.tasks.append(channel)
        return channel

    def route(self) -> None:
        """One drain of the hub (waiting :data:`~._ray_hub.POLL_S` at most for a message): each
        message to its task's channel (a message of a task given up on goes nowhere), then the
        end of each task that returned or died. Which tasks ended is asked first: what a task
        posted before it returned is in the hub by then, and read before its end."""
        import ray

        from ._ray_hub import POLL_S

        refs = {task.ref: task for task in self.tasks if not task.ended}
        done = ray.wait(list(refs), num_returns=len(refs), timeout=0)[0] if refs else []
        for posted in self.receive_all(POLL_S):
            for task in self.tasks:
                if task.takes(posted):
                    task.deliver(posted)
                    break
        for ref in done:
            refs[ref].end()

    def close(self) -> None:
        import ray

        try:
            ray.kill(self.hub)
        except Exception:  # Ray already gone (a cluster that went away): nothing to release
            pass


class TaskChannel(Channel):
    """One Ray task's channel on the hub (made by :meth:`HubChannel.task`): the messages of its
    ``trials`` posted by its ``attempt`` (routed by :meth:`HubChannel.route`); an answer
    (:class:`~._messages.Verdicts`, :class:`~._messages.Answer`, :class:`~._messages.ArchiveAnswer`)
    goes back under the key of the call the task waits on. When the task returns, its result
    (its members' outcomes, or a user loop's one) reads as :class:`~._messages.Left` messages and
    an :class:`~._messages.End`; when its worker or node died, :meth:`receive` raises
    :class:`ChannelClosed` and :meth:`exit_description` says how."""

    def __init__(self, hub: HubChannel, ref: Any, attempt: int, trials: Sequence[int]):
        self.hub, self.ref, self.attempt, self.trials = hub, ref, attempt, set(trials)
        self.inbox: list[Any] = []
        self.key: Any = None             # the key of the call the task waits on
        self.node: str | None = None     # where it runs (from its first message)
        self.ended = False
        self.death: str | None = None

    def takes(self, posted: Any) -> bool:
        """Whether ``posted`` is this task's message (its attempt, one of its trials)."""
        from ._messages import Round

        message = posted.message
        trial_id = message.reports[0].trial_id if isinstance(message, Round) else getattr(message, "trial_id", None)
        return posted.attempt == self.attempt and trial_id in self.trials and not self.ended

    def deliver(self, posted: Any) -> None:
        """A message of this task, as the driver reads it (a :class:`~._messages.Started` notes
        where the trial runs in its ``trial.info["ray"]``)."""
        from ._messages import Started

        message = posted.message
        pid, node = posted.worker
        self.node = node
        if posted.key is not None:
            self.key = posted.key
        if isinstance(message, Started):
            resources = dict(message.resources or {})
            message = Started(message.trial_id, resources,
                              {"ray": {"pid": pid, "node": node, "attempt": self.attempt, "resources": resources}})
        self.inbox.append(message)

    def end(self) -> None:
        """The task returned or died: its result as messages (or its death)."""
        import ray

        from ._messages import End, Left, Outcome
        from ._ray_hub import death_cause

        self.ended = True
        try:
            result = ray.get(self.ref)
        except ray.exceptions.TaskCancelledError:   # cancelled by the driver: its members are decided
            self.inbox.append(End())
            return
        except ray.exceptions.RayTaskError as err:  # raised outside the training (unpickling a model)
            self.inbox.extend(Left(tid, Outcome("error", error=str(err))) for tid in sorted(self.trials))
            self.inbox.append(End())
            return
        except ray.exceptions.RayError as err:      # the worker process or its node died
            self.death = death_cause(err, {"ray": {"node": self.node}})
            return
        outcomes = result if isinstance(result, dict) else {next(iter(self.trials)): result}
        self.inbox.extend(Left(tid, outcome) for tid, outcome in outcomes.items())
        self.inbox.append(End())

    def send(self, message: Any) -> None:
        from ._messages import Answer, ArchiveAnswer, Verdicts

        if self.key is None:
            raise RuntimeError(f"the Ray task of trial(s) {sorted(self.trials)} waits for no answer")
        if isinstance(message, ArchiveAnswer):
            value: Any = message.result
        elif isinstance(message, Answer):
            value = message.verdict
        elif isinstance(message, Verdicts):
            value = message
        else:
            raise TypeError(f"a Ray task is answered, not sent {type(message).__name__}")
        key, self.key = self.key, None
        self.hub.hub.reply.remote(key, value)

    def poll(self, timeout: float = 0.0) -> bool:
        return bool(self.inbox) or self.death is not None

    def receive(self) -> Any:
        while not self.inbox and self.death is None:
            self.hub.route()
        if self.inbox:
            return self.inbox.pop(0)
        raise ChannelClosed(self.death)

    def close(self) -> None:
        if self in self.hub.tasks:
            self.hub.tasks.remove(self)

    def kill(self) -> None:
        import ray

        try:
            ray.cancel(self.ref, force=True)
        except Exception:  # it ended already
            pass
        self.close()

    def exit_description(self, wait: float = 2.0) -> str:
        return self.death or "it ended"
