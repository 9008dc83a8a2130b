"""The driver's end of the conversation with a process that trains its trials: a :class:`Channel`
carries the typed messages of :mod:`._messages` and says whether the far side still lives.

* :class:`PipeChannel`: a multiprocessing pipe to one process (a pool worker, a forked child);
  the process's liveness and exit code come with it.
* :class:`HubChannel`: the Ray hub actor every Ray task posts to (:mod:`._ray_hub`); messages
  arrive in :class:`~._messages.Posted` envelopes, and :class:`~._messages.Answer` /
  :class:`~._messages.ArchiveAnswer` go back to the task that waits for them. A task's own
  death is told by its object ref (:func:`~._ray_hub.death_cause`).

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
from multiprocessing.connection import Connection, wait
from typing import Any, Sequence

__all__ = ["Channel", "ChannelClosed", "PipeChannel", "HubChannel", "ready"]


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


def ready(channels: Sequence[PipeChannel], timeout: float) -> list[PipeChannel]:
    """The ``channels`` with a message (or their end) to read, waiting up to ``timeout`` seconds."""
    by_conn = {channel.conn: channel for channel in channels}
    return [by_conn[conn] for conn in wait(list(by_conn), timeout=timeout)]  # type: ignore[index]


class HubChannel(Channel):
    """The driver's end of the Ray hub (``hub``: the actor, :func:`~._ray_hub.start_hub`): it
    receives every task's :class:`~._messages.Posted` messages, and sends each
    :class:`~._messages.Answer` (a verdict, for a report's trial, attempt and step) or
    :class:`~._messages.ArchiveAnswer` (under its call's key) to the task that waits for it."""

    def __init__(self, hub: Any):
        self.hub = hub
        self.inbox: list[Any] = []

    def send(self, message: Any) -> None:
        from ._messages import Answer, ArchiveAnswer

        if isinstance(message, Answer):
            self.hub.answer.remote(message.trial_id, message.attempt, message.step, message.verdict)
        elif isinstance(message, ArchiveAnswer):
            self.hub.reply.remote(message.key, message.result)
        else:
            raise TypeError(f"the Ray hub carries answers to tasks, not {type(message).__name__}")

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

    def close(self) -> None:
        import ray

        try:
            ray.kill(self.hub)
        except Exception:  # Ray already gone (a cluster that went away): nothing to release
            pass
