"""Bounded math for the verifier: math-verify runs in child processes, each call under a deadline.

Why: the inner loop grades thousands of answers per step, all in the trainer's process. Sympy
on an adversarial answer can take seconds, math-verify's own timeout works only on the main
thread (signal.alarm), and a thread cannot be killed. So only the math questions (is this label
math? are these two math answers equal?) leave the process, to a small pool of children
(`math_server.py`) started on first use and shared by every verifier of the process; everything
else the verifier does is linear in the answer's length and runs in the caller's thread.

A call waits for a free child (waiting is not charged), then for the reply until the answer's
budget is spent plus `KILL_GRACE_S`: the child stops ordinary sympy work itself at the budget; a
child that does not answer by then is inside one C-level operation and is killed, and a fresh
one takes its place at the next call. `CheckTimeout` tells the verifier to score the answer 0.
Results are cached (labels repeat every step, and so do students' answers).
"""

from __future__ import annotations

import atexit
import json
import os
import select
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from pathlib import Path

KILL_GRACE_S = 0.5
START_TIMEOUT_S = 120.0  # importing sympy on a busy 2-core machine
CACHE_SIZE = 16384
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[3])  # the folder that holds slime_meta


class CheckTimeout(Exception):
    """Checking one answer took longer than its time bound."""


class MathUnavailable(RuntimeError):
    """The math child process could not be started."""


class _MathChild:
    """One `math_server` process and the pipes to it."""

    def __init__(self):
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_ROOT, env.get("PYTHONPATH")) if p)
        # Its own session: a Ctrl-C meant for the run reaches the trainer, which ends the children.
        self.process = subprocess.Popen(
            [sys.executable, "-m", "slime_meta.grading.verifier.math_server"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            start_new_session=True,
        )
        self._buffer = b""
        reply = self._read_line(time.monotonic() + START_TIMEOUT_S)
        if reply is None or not json.loads(reply).get("ready"):
            self.kill()
            raise MathUnavailable("the verifier's math process (math-verify) did not start; is math-verify installed?")

    def _read_line(self, deadline: float) -> bytes | None:
        """The next reply line, or None when the deadline passes or the child is gone."""
        fd = self.process.stdout.fileno()
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                return None
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line

    def ask(self, op: str, a: str, b: str, budget_s: float) -> bool | None:
        """The child's answer; None when it ran out of time (the child may then be dead)."""
        request = json.dumps({"op": op, "a": a, "b": b, "budget_s": budget_s}) + "\n"
        try:
            self.process.stdin.write(request.encode())
            self.process.stdin.flush()
        except (BrokenPipeError, OSError):
            self.kill()
            return None
        line = self._read_line(time.monotonic() + budget_s + KILL_GRACE_S)
        if line is None:
            self.kill()  # stuck where no signal reaches (one huge integer operation)
            return None
        reply = json.loads(line)
        return None if reply.get("timeout") else bool(reply["result"])

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        for pipe in (self.process.stdin, self.process.stdout):
            try:
                pipe.close()
            except OSError:
                pass


class MathPool:
    """Up to `max_children` math child processes, started on demand, reused, replaced when killed."""

    _shared: MathPool | None = None
    _shared_lock = threading.Lock()

    def __init__(self, max_children: int = 4):
        self.max_children = max(1, int(max_children))
        self._idle: list[_MathChild] = []
        self._started = 0
        self._condition = threading.Condition()
        self._cache: OrderedDict[tuple[str, str, str], bool] = OrderedDict()
        self._cache_lock = threading.Lock()
        self.kills = 0  # children killed at a deadline (for tests and diagnostics)

    @classmethod
    def shared(cls) -> MathPool:
        """The process-wide pool (children are expensive to start: about 1.5 s to import sympy)."""
        with cls._shared_lock:
            if cls._shared is None:
                cls._shared = cls()
                atexit.register(cls._shared.close)
            return cls._shared

    def _acquire(self) -> _MathChild:
        with self._condition:
            while not self._idle and self._started >= self.max_children:
                self._condition.wait()
            if self._idle:
                return self._idle.pop()
            self._started += 1
        try:
            return _MathChild()
        except BaseException:
            self._release(None)
            raise

    def _release(self, child: _MathChild | None) -> None:
        with self._condition:
            if child is not None and child.alive:
                self._idle.append(child)
            else:
                self._started -= 1
            self._condition.notify()

    def ask(self, op: str, a: str, b: str, budget_s: float) -> tuple[bool, float]:
        """`op` ("is_math" or "equal") on (a, b) within `budget_s` seconds, and the seconds the
        child spent on it (waiting for a free child is not counted); CheckTimeout when out of time."""
        key = (op, a, b)
        with self._cache_lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key], 0.0
        if budget_s <= 0:
            raise CheckTimeout
        child = self._acquire()
        started = time.monotonic()
        try:
            result = child.ask(op, a, b, budget_s)
        finally:
            spent = time.monotonic() - started
            if not child.alive:
                self.kills += 1
            self._release(child)
        if result is None:
            raise CheckTimeout
        with self._cache_lock:
            self._cache[key] = result
            if len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return result, spent

    def prestart(self, count: int) -> None:
        """Starts children until `count` are idle (a run pays the sympy import before its first step)."""
        while True:
            with self._condition:
                if len(self._idle) >= count or self._started >= self.max_children:
                    return
                self._started += 1
            try:
                child = _MathChild()
            except BaseException:
                self._release(None)
                raise
            self._release(child)

    @property
    def child_pids(self) -> list[int]:
        """The process ids of the idle children."""
        with self._condition:
            return [child.process.pid for child in self._idle]

    def close(self) -> None:
        """Ends the idle children (busy ones end when their caller releases them to a closed pool)."""
        with self._condition:
            idle, self._idle = self._idle, []
            self._started -= len(idle)
        for child in idle:
            child.kill()


class MathSession:
    """The math questions of one answer, sharing its time bound: `timeout_s` of child time in all
    (a question that runs out of it raises CheckTimeout, and so does every later one)."""

    def __init__(self, pool: MathPool, timeout_s: float):
        self.pool, self.timeout_s = pool, timeout_s
        self._spent = 0.0

    def ask(self, op: str, a: str, b: str = "") -> bool:
        result, spent = self.pool.ask(op, a, b, self.timeout_s - self._spent)
        self._spent += spent
        return result

    def is_math(self, text: str) -> bool:
        return self.ask("is_math", text)

    def equal(self, gold: str, answer: str) -> bool:
        return self.ask("equal", gold, answer)
