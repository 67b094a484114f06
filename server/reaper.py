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
its leader was reaped, nor the holders; it exits at once, even while another process still holds
its pipe's write end.

The reaper is ``/bin/sh`` (else the ``sh`` on the ``PATH``), started without the variables that
change what a shell does before its script runs (``SHELLOPTS``, ``BASHOPTS``, ``ENV``,
``BASH_ENV``, ``IFS``, exported bash functions): a ``SHELLOPTS=errexit`` the sidecar inherited,
with bash as ``sh``, made the first ``kill`` that found nothing end the script. A process the
sidecar forks without an exec (a tool's ``os.fork()``) would inherit the write ends of the
reapers that live then: the child closes them at once (``os.register_at_fork``), so a reaper
still fires when the sidecar is gone, however long such a child runs."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess

log = logging.getLogger("operate_sidecar.server")

#: $0: the process group; $1: the inode of a pipe whose holders die too (or empty). A line read
#: (``release_reaper``) means "let go on purpose": the run's teardown is over, so the reaper
#: exits at once and kills nothing (the group's leader is reaped: its id may be reused). The end
#: of the pipe (every write end closed) means the sidecar is gone: it kills the group, then every
#: process holding the pipe open *for writing* (a descriptor open for reading, as a process
#: forked by the sidecar holds, does not count). ``ls -lnq``: a link's
#: target with a newline in it shows ``?``, so it cannot fake a line; ``TIME_STYLE`` and
#: ``QUOTING_STYLE``, which change what ``ls`` prints, are unset, and a line counts only by its
#: end (`` -> pipe:[inode]``), its mode (``l?w``: open for writing), a process id and a
#: descriptor name of digits. Each such line is then confirmed (a fork only for those): the
#: descriptor's link is exactly ``pipe:[inode]`` and its flags (``fdinfo``) say it is open for
#: writing. The sidecar itself ($PPID) and the reaper ($$) are never killed. ``set +e`` and
#: ``|| :`` after each ``kill``: a kill that finds nothing (the group already empty, a holder gone
#: meanwhile) never ends the script, whatever options the shell was started with.
_SCRIPT = (
    'set +e; i=$1; read -r l && exit 0; '
    'kill -s KILL -- "-$0" 2>/dev/null || :; [ -n "$i" ] || exit 0; '
    'unset TIME_STYLE QUOTING_STYLE; LC_ALL=C; export LC_ALL; '
    'ls -lnq /proc/[0-9]*/fd 2>/dev/null | { p=; while IFS= read -r l; do '
    'case $l in /proc/*/fd:) p=${l#/proc/}; p=${p%/fd:}; continue;; '
    'l?w*" -> pipe:[$i]") ;; *) continue;; esac; '
    'n=${l%" -> pipe:[$i]"}; n=${n##* }; '
    'case $p in ""|*[!0-9]*) continue;; esac; case $n in ""|*[!0-9]*) continue;; esac; '
    '[ "$p" != "$PPID" ] && [ "$p" != "$$" ] || continue; '
    '[ "$(readlink "/proc/$p/fd/$n")" = "pipe:[$i]" ] || continue; '
    'f=$(while read -r k v; do [ "$k" != flags: ] || { echo "$v"; break; }; done < "/proc/$p/fdinfo/$n"); '
    'case $f in *[123567]) kill -s KILL "$p" 2>/dev/null || :;; esac; '
    'done; }; exit 0'
)

#: what the shell reads from its environment before the script runs, and may change it by
#: (``SHELLOPTS=errexit``: a failed command ends the script); exported bash functions
#: (``BASH_FUNC_name%%``) too
_SHELL_ENV = frozenset({"SHELLOPTS", "BASHOPTS", "ENV", "BASH_ENV", "IFS"})

#: the reapers' pipe write ends this process holds: fd -> (device, inode) of the pipe, so that
#: an fd closed by its owner and reused for something else is never taken for one
_WRITE_ENDS: dict[int, tuple[int, int]] = {}


def _shell() -> str:
    """``/bin/sh`` when there is one (a ``sh`` earlier on the ``PATH`` may be anything), else
    the ``PATH``'s."""
    return "/bin/sh" if os.path.exists("/bin/sh") else (shutil.which("sh") or "/bin/sh")


def _reaper_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in _SHELL_ENV and not k.startswith("BASH_FUNC_")}


def _pipe_id(fd: int) -> tuple[int, int] | None:
    try:
        st = os.fstat(fd)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _close_in_child() -> None:
    """In a child forked without an exec: close the reapers' write ends it inherited (the
    sidecar's death must be the end of their pipes, not the child's exit)."""
    ends = list(_WRITE_ENDS.items())
    _WRITE_ENDS.clear()
    for fd, pipe in ends:
        if _pipe_id(fd) == pipe:
            try:
                os.close(fd)
            except OSError:
                pass


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_in_child)


def start_reaper(pgid: int, pipe_inode: int | None = None) -> tuple[subprocess.Popen, int] | None:
    """Start the reaper of process group ``pgid`` (and of the processes holding the pipe
    ``pipe_inode``, if given): (its process, the pipe's write end to keep open while they may
    live), or None when it cannot start (logged)."""
    r, w = os.pipe()  # non-inheritable: no other child ever holds the write end
    args = [str(pgid)] + ([str(pipe_inode)] if pipe_inode is not None else [])
    try:
        proc = subprocess.Popen([_shell(), "-c", _SCRIPT, *args], stdin=r, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, close_fds=True, start_new_session=True,
                                env=_reaper_env())
    except OSError as e:
        os.close(w)
        log.debug("cannot start a reaper for process group %d (%s): its processes may outlive the sidecar",
                  pgid, e)
        return None
    finally:
        os.close(r)
    for fd, pipe in list(_WRITE_ENDS.items()):  # ends their owners closed (``os.close``) since
        if _pipe_id(fd) != pipe:
            _WRITE_ENDS.pop(fd, None)
    _WRITE_ENDS[w] = _pipe_id(w) or (-1, -1)
    return proc, w


def release_reaper(write_fd: int) -> None:
    """Let a reaper go on purpose (closing ``write_fd``, its pipe's write end): it exits without
    killing anything (whoever lets it go stopped the group and the pipe's holders; the group's id
    may belong to another group by now). Nothing is done in a forked child, which closed the
    end it inherited (``_close_in_child``): the number may be another file's by then."""
    if _WRITE_ENDS.pop(write_fd, None) is None:
        return
    try:
        os.write(write_fd, b"release\n")
    except OSError:
        pass
    finally:
        os.close(write_fd)
