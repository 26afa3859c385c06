"""Processes and ports for the launcher (`service.client.launcher`) and the project's other clients: a free loopback
port, a signal to a process's group, a stop with a grace period, and a child that dies with its parent.

A launched process runs in its own session (`start_new_session=True`), so it leads a process group: signals go to
the group (it and its children), and a Ctrl-C in the terminal reaches only the client. Standard library only.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess

# How long a process has to exit after SIGTERM before it gets SIGKILL, and then to be reaped.
STOP_GRACE_S = 20.0
REAP_TIMEOUT_S = 10.0
PR_SET_PDEATHSIG = 1  # prctl(2): the signal the child gets when its parent dies
LOOPBACK = "127.0.0.1"


def free_port() -> int:
    """A TCP port that is free on 127.0.0.1 now (another process may take it before it is bound: start() retries)."""
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))  # port 0: the kernel picks a free one
        return s.getsockname()[1]


def signal_group(process: subprocess.Popen, signum: int) -> None:
    """`signum` to the process's group when it leads one (start_new_session=True: it and its children), else to it."""
    try:
        if os.getpgid(process.pid) == process.pid:
            os.killpg(process.pid, signum)
        else:
            process.send_signal(signum)
    except ProcessLookupError:
        pass


def stop_process_group(process: subprocess.Popen, grace: float = STOP_GRACE_S) -> int:
    """SIGTERM, then SIGKILL if it has not exited after `grace` seconds (to its group when it leads one); reaps it
    and returns its exit status. No signal once it has exited."""
    if process.poll() is None:
        signal_group(process, signal.SIGTERM)
        try:
            process.wait(grace)
        except subprocess.TimeoutExpired:
            signal_group(process, signal.SIGKILL)
            process.wait(REAP_TIMEOUT_S)
    return process.returncode


def die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the parent dies (Linux PR_SET_PDEATHSIG)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):  # not Linux: stop() still ends the process
        pass
