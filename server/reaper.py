"""A process group that dies with the sidecar: a tiny reaper process, in a session of its own,
blocks reading a pipe whose only write end this process holds. The read ends when the end is
closed: by this process's exit, crash or SIGKILL alike, or on purpose; the reaper then
SIGKILLs the group. Used for the sidecar's own group (``server.rpc.stdio``: the tools'
children) and for each CLI model run's group (``server.models.cli``), which leaves it.

A CLI run's reaper is also told its stdout pipe (by inode): a child the program detached with
``setsid`` leaves the group, but holds that pipe open while it runs. Once the sidecar is gone the
reaper kills, after the group, every process that still holds the pipe open for writing (Linux
``/proc``: one ``ls`` of the processes' descriptors; a line that may be one is confirmed by the
descriptor's own link and flags; a read end, which shares the pipe's inode, does not count). A
reaper let go on purpose (:func:`release_reaper`: the run ended and its teardown already stopped
the group and the holders) kills nothing: neither the group, whose id may have been reused since
its leader was reaped, nor the holders."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess

log = logging.getLogger("operate_sidecar.server")

#: $0: the process group; $1: the inode of a pipe whose holders die too (or empty). A line read
#: before the end (``release_reaper``) means "let go on purpose": the run's teardown is over, so
#: the reaper kills nothing (the group's leader is reaped: its id may be reused). Otherwise it
#: kills the group, then every process holding the pipe open *for writing* (a descriptor open
#: for reading, as a process forked by the sidecar holds, does not count). ``ls -lnq``: a link's
#: target with a newline in it shows ``?``, so it cannot fake a line; ``TIME_STYLE`` and
#: ``QUOTING_STYLE``, which change what ``ls`` prints, are unset, and a line counts only by its
#: end (`` -> pipe:[inode]``), its mode (``l?w``: open for writing), a process id and a
#: descriptor name of digits. Each such line is then confirmed (a fork only for those): the
#: descriptor's link is exactly ``pipe:[inode]`` and its flags (``fdinfo``) say it is open for
#: writing. The sidecar itself ($PPID) and the reaper ($$) are never killed.
_SCRIPT = (
    'i=$1; s=; while read -r l; do s=$l; done; [ -z "$s" ] || exit 0; '
    'kill -s KILL -- "-$0" 2>/dev/null; [ -n "$i" ] || exit 0; '
    'unset TIME_STYLE QUOTING_STYLE; LC_ALL=C; export LC_ALL; '
    'ls -lnq /proc/[0-9]*/fd 2>/dev/null | { p=; while IFS= read -r l; do '
    'case $l in /proc/*/fd:) p=${l#/proc/}; p=${p%/fd:}; continue;; '
    'l?w*" -> pipe:[$i]") ;; *) continue;; esac; '
    'n=${l%" -> pipe:[$i]"}; n=${n##* }; '
    'case $p in ""|*[!0-9]*) continue;; esac; case $n in ""|*[!0-9]*) continue;; esac; '
    '[ "$p" != "$PPID" ] && [ "$p" != "$$" ] || continue; '
    '[ "$(readlink "/proc/$p/fd/$n")" = "pipe:[$i]" ] || continue; '
    'f=$(while read -r k v; do [ "$k" != flags: ] || { echo "$v"; break; }; done < "/proc/$p/fdinfo/$n"); '
    'case $f in *[123567]) kill -s KILL "$p" 2>/dev/null;; esac; '
    'done; }; exit 0'
)


def start_reaper(pgid: int, pipe_inode: int | None = None) -> tuple[subprocess.Popen, int] | None:
    """Start the reaper of process group ``pgid`` (and of the processes holding the pipe
    ``pipe_inode``, if given): (its process, the pipe's write end to keep open while they may
    live), or None when it cannot start (logged)."""
    r, w = os.pipe()  # non-inheritable: no other child ever holds the write end
    args = [str(pgid)] + ([str(pipe_inode)] if pipe_inode is not None else [])
    try:
        proc = subprocess.Popen([shutil.which("sh") or "/bin/sh", "-c", _SCRIPT, *args], stdin=r,
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


def release_reaper(write_fd: int) -> None:
    """Let a reaper go on purpose (closing ``write_fd``, its pipe's write end): it exits without
    killing anything (whoever lets it go stopped the group and the pipe's holders; the group's id
    may belong to another group by now)."""
    try:
        os.write(write_fd, b"release\n")
    except OSError:
        pass
    finally:
        os.close(write_fd)
