"""Run tool calls off the rollout's event loop, so a tool that blocks cannot stall the batch.

A user's first tool often blocks inside `async def call` (`time.sleep`, `requests.get`, a CPU-heavy parse). On
the rollout's loop that call freezes every trajectory of the batch, and no timeout can fire, because the timeout
itself needs the loop. So every tool gets its own event loop in a daemon thread (`ToolLoop`): its calls share
that loop (and the connection pools bound to it), and the rollout's loop only waits on a future, with the
executor's timeout. A heartbeat on the tool's loop measures how long a call held it: past `block_s` the tool is
*blocking*; from then on each of its calls runs in a fresh daemon thread with its own loop (`run_in_thread`), so
blocking calls neither queue behind one another nor, if one never returns, hold anything but their own thread.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

logger = logging.getLogger(__name__)

BEAT_S = 0.02  # heartbeat period on a tool's loop; a gap much longer than this is a blocked loop


class ToolLoop:
    """An event loop in a daemon thread, dedicated to one tool, with a heartbeat that measures stalls.

    The heartbeat runs only while a call is in flight: an idle loop sleeps in its selector and costs nothing. (It
    used to beat 50 times a second for the process's life, for every tool instance ever called: envs that bind a
    fresh tool to each trajectory's sandbox left hundreds of such threads behind, ~0.3% of a core each.)"""

    def __init__(self, name: str) -> None:
        self.name = name
        self.loop = asyncio.new_event_loop()
        self._last_beat = time.monotonic()
        self._worst_gap = 0.0
        self._in_flight = 0  # calls running on the loop; touched only from the loop's thread
        self._next_beat: asyncio.TimerHandle | None = None  # the one pending beat while calls run (loop's thread)
        self._lock = threading.Lock()
        ready = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(ready,), daemon=True, name=f"tool-loop-{name}")
        self.thread.start()
        ready.wait()

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(ready.set)
        self.loop.run_forever()
        self.loop.close()

    def _record_gap(self, now: float) -> None:
        with self._lock:
            self._worst_gap = max(self._worst_gap, now - self._last_beat - BEAT_S)
            self._last_beat = now

    def _beat(self) -> None:
        self._record_gap(time.monotonic())
        self._next_beat = self.loop.call_later(BEAT_S, self._beat) if self._in_flight else None

    async def _tracked(self, make_call: Callable[[], Any]) -> Any:
        """One call on this loop, with the heartbeat running while it is in flight; the stretch since the last
        beat is recorded when it ends, before its caller can ask (take_stall_s)."""
        if self._next_beat is None:  # one heartbeat, however many calls start and end between two beats
            with self._lock:
                self._last_beat = time.monotonic()
            self._next_beat = self.loop.call_later(BEAT_S, self._beat)
        self._in_flight += 1
        try:
            return await _as_coroutine(make_call)
        finally:
            self._in_flight -= 1
            self._record_gap(time.monotonic())

    def take_stall_s(self) -> float:
        """The longest time the loop was held since the last call of this, and reset it: how long a synchronous
        piece of a tool call kept every other call of this tool waiting. A call still holding the loop (its caller
        timed out) counts up to now."""
        with self._lock:
            current = time.monotonic() - self._last_beat - BEAT_S if self._in_flight else 0.0
            worst, self._worst_gap = max(self._worst_gap, current), 0.0
        return max(worst, 0.0)

    def submit(self, make_call: Callable[[], Awaitable[Any]]) -> asyncio.Future:
        """Run the call on this tool's loop; the returned future belongs to the caller's loop (cancelling it
        cancels the call there)."""
        return asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self._tracked(make_call), self.loop))

    def close(self) -> None:
        """Stop the loop (from any thread, without waiting): its thread closes it and ends."""
        try:
            self.loop.call_soon_threadsafe(self.loop.stop)
        except RuntimeError:  # already closed
            pass


async def _as_coroutine(make_call: Callable[[], Any]) -> Any:
    """Call the tool inside the target loop; a plain `def call` (no awaitable) runs there too, off the caller's."""
    result = make_call()
    return await result if inspect.isawaitable(result) else result


def run_in_thread(make_call: Callable[[], Any], name: str) -> asyncio.Future:
    """Run one call in a fresh daemon thread with its own loop: nothing it blocks is shared, and if it never
    returns, the thread is abandoned (daemon: it cannot keep the process alive) once the caller stops waiting."""
    caller = asyncio.get_running_loop()
    future: asyncio.Future = caller.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if future.done():  # the caller timed out or was cancelled meanwhile
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def target() -> None:
        try:
            result, error = asyncio.run(_as_coroutine(make_call)), None
        except BaseException as e:  # noqa: BLE001 - handed to the caller, which turns it into a tool error
            result, error = None, e
        try:
            caller.call_soon_threadsafe(settle, result, error)
        except RuntimeError:  # the caller's loop is closed: nobody is waiting any more
            pass

    threading.Thread(target=target, daemon=True, name=f"tool-call-{name}").start()
    return future


@dataclass
class OffLoopRunner:
    """Where each tool's calls run: its `ToolLoop`, or one thread per call once it has blocked its loop.

    One runner is shared by every executor of a process, so a tool found blocking stays known as blocking (and is
    warned about once) for as long as it lives. A tool's loop ends when the tool is collected: some envs bind a
    fresh tool to each trajectory's sandbox."""

    block_s: float = 1.0  # a call that held its tool's loop this long is blocking (warned, counted)
    loops: dict[int, ToolLoop] = field(default_factory=dict)
    blocking: dict[int, str] = field(default_factory=dict)  # id(tool) -> name
    _tools: dict[int, Any] = field(default_factory=dict)  # tools without weak references, kept (ids stay valid)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self, tool: Any, name: str, arguments: dict[str, Any]) -> asyncio.Future:
        """Start `tool.call(arguments)` off the caller's loop; await the future (with a timeout)."""
        key = id(tool)
        if key in self.blocking:
            return run_in_thread(lambda: tool.call(arguments), name)
        with self._lock:
            if key not in self.loops:
                self.loops[key] = ToolLoop(name)
                self._forget_when_collected(tool, key)
            tool_loop = self.loops[key]
        return tool_loop.submit(lambda: tool.call(arguments))

    def _forget_when_collected(self, tool: Any, key: int) -> None:
        """A tool's loop lives as long as the tool: envs bind a fresh tool to each trajectory's sandbox, and the
        runner once kept every one (and its sandbox) alive, each with its thread. A tool that takes no weak
        reference is kept, so its id cannot be reused by another tool while the runner knows it."""
        try:
            weakref.finalize(tool, self._forget, key).atexit = False
        except TypeError:
            self._tools[key] = tool

    def _forget(self, key: int) -> None:
        """The tool's finalizer. It runs in whichever thread collected the tool, maybe one that start() is waiting
        on while it holds the lock (a new loop's own thread): so no lock here; each pop is atomic."""
        tool_loop = self.loops.pop(key, None)
        self.blocking.pop(key, None)
        if tool_loop is not None:
            tool_loop.close()

    def check_blocked(self, tool: Any, name: str, block_s: float | None = None) -> float | None:
        """After a call (answered or timed out): the seconds it held its tool's loop when that is a block, else
        None. The first block of a tool is warned about by name, and its later calls get a thread each."""
        key = id(tool)
        tool_loop = self.loops.get(key)
        if key in self.blocking or tool_loop is None:
            return None
        stall = tool_loop.take_stall_s()
        if stall < (self.block_s if block_s is None else block_s):
            return None
        with self._lock:
            first = key not in self.blocking
            self.blocking[key] = name
        if first:
            logger.warning(
                "tool %r blocked its event loop for %.1f s: its `call` runs synchronous code (time.sleep, "
                "requests, heavy CPU) instead of awaiting. It cannot stall other trajectories (tools run off the "
                "rollout loop) and its timeout holds, but from now on each of its calls gets its own thread; "
                "make it await (e.g. `await asyncio.to_thread(...)`).", name, stall)
        return stall


RUNNER = OffLoopRunner()
