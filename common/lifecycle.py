"""How a process of this project starts and stops: with its parent, and in bounded time.

Two rules (PITFALLS, *Operations*):

* **A child dies with its parent.** ``die_with_parent`` runs in a child between fork and exec and
  asks the kernel (``PR_SET_PDEATHSIG``) to send it SIGTERM when the process that started it
  dies, however it dies: a launcher or a test run killed with SIGKILL leaves no role behind to
  compete with the next run.
* **A stop request is honoured in bounded time.** ``StopFlag`` turns SIGTERM/SIGINT into a flag
  the role's loop checks, so it finishes what it does (a learner its step and checkpoint, an actor
  its BYE). From then on a watchdog thread exits the process (status 1, naming what it waited
  for) once the role has reported no progress (``Health.beat``) for ``run.stall_timeout_s``,
  whatever it waits for: a broker that is gone, a collective, a stuck engine. A second Ctrl-C
  exits at once.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import structlog

from common.metrics import Health

log = structlog.get_logger()

PR_SET_PDEATHSIG = 1
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def die_with_parent() -> None:
    """``preexec_fn`` of a child process: SIGTERM when the parent dies (Linux; elsewhere a no-op).

    If the parent is already gone when this runs (it died between fork and here), the child exits
    at once instead of living on as an orphan.
    """
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the launcher's own stop() still applies
        return
    if os.getppid() != parent:
        os._exit(1)


class StopFlag:
    """Set by SIGTERM/SIGINT (or ``set()``); calling it says whether to stop.

    After the first signal a role that makes no progress for ``health.stall_s`` exits with
    status 1; a second SIGINT (Ctrl-C twice) exits at once.
    """

    def __init__(self, health: Health, signals: tuple[int, ...] = STOP_SIGNALS) -> None:
        self.health = health
        self._event = threading.Event()
        for signum in signals:
            signal.signal(signum, self._on_signal)

    def __call__(self) -> bool:
        return self._event.is_set()

    def set(self) -> None:
        self._event.set()

    def _on_signal(self, signum: int, frame: object) -> None:
        if self._event.is_set():
            if signum == signal.SIGINT:  # Ctrl-C twice: a person who does not want to wait
                log.warning("second interrupt: exiting now", signal=signum)
                hard_exit()
            return  # a supervisor repeating SIGTERM: already stopping
        self._event.set()
        log.info("stop signal: finishing", signal=signum)
        self.health.beat()  # the grace period starts now
        threading.Thread(target=self._watchdog, name="stop-watchdog", daemon=True).start()

    def _watchdog(self) -> None:
        while not self.health.stalled():
            time.sleep(1.0)
        log.error(
            "stopping made no progress for run.stall_timeout_s: exiting",
            stall_s=self.health.stall_s,
            waiting_for=self.health.waiting_for,
        )
        hard_exit()


def hard_exit() -> None:
    """Exit now, without joining threads or running finalisers that may be what hangs."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


def spawn(args: list[str], **kwargs: Any) -> subprocess.Popen:
    """A child process in a session of its own (a terminal's Ctrl-C goes to its parent, which
    stops it in order) that dies with its parent: how the launcher, the tests and the benchmarks
    start every role."""
    return subprocess.Popen(args, start_new_session=True, preexec_fn=die_with_parent, **kwargs)
