"""A process group that dies with the sidecar: a tiny reaper process, in a session of its own,
blocks reading a pipe whose only write end this process holds. The read ends when the end is
closed: by this process's exit, crash or SIGKILL alike, or on purpose; the reaper then
SIGKILLs the group. Used for the sidecar's own group (``server.rpc.stdio``: the tools'
children) and for each CLI model run's group (``server.models.cli``), which leaves it."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess

log = logging.getLogger("operate_sidecar.server")

_SCRIPT = 'while read -r _; do :; done; kill -s KILL -- "-$0" 2>/dev/null; exit 0'


def start_reaper(pgid: int) -> tuple[subprocess.Popen, int] | None:
    """Start the reaper of process group ``pgid``: (its process, the pipe's write end to keep
    open while the group may live), or None when it cannot start (logged)."""
    r, w = os.pipe()  # non-inheritable: no other child ever holds the write end
    try:
        proc = subprocess.Popen([shutil.which("sh") or "/bin/sh", "-c", _SCRIPT, str(pgid)], stdin=r,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, close_fds=True,
                                start_new_session=True)
    except OSError as e:
        os.close(w)
        log.debug("cannot start a reaper for process group %d (%s): its processes may outlive the sidecar",
                  pgid, e)
        return None
    finally:
        os.close(r)
    return proc, w
