"""``provider: cli``: a CLI agent or model spawned per call.

Config fields: ``profile`` (``claude-code`` | ``llm`` | ``jsonl``), ``command``
(argv list or a shell-style string; defaults per profile, required for
``jsonl``), ``cwd``, ``env`` (extra environment), ``promptVia`` (``arg`` |
``stdin``; default ``arg`` for claude-code/llm, ``stdin`` for jsonl; an argv
element containing ``{prompt}`` is substituted instead), ``timeoutS`` (none by
default), ``killGraceS`` (SIGTERM → SIGKILL grace, default 2).

``arg`` puts the prompt last on the command line. Left at its default, a prompt no argument
can carry as it is goes on stdin instead (both default programs read it there when no prompt
argument is given): one longer than Linux takes (MAX_ARG_STRLEN, 131072 bytes with its NUL: a
long branch history), one holding a NUL, and one beginning with ``-`` (a markdown list or
``---`` front matter, which the program would read as an option). With ``promptVia = "arg"``
said, a prompt beginning with ``-`` comes after a ``--`` argument, and a prompt (or a
``{prompt}`` argument) too long for one argument is a ``ModelError`` naming ``promptVia =
"stdin"``.

The process runs in its own session/process group, with stdin from /dev/null
(or from a file holding the prompt) and stderr to a temporary file (kept bounded; its tail
goes into error messages). stdout is read as it streams: JSON lines for
claude-code/jsonl, raw text for llm. When the awaiting scope is cancelled (or
the consumer stops iterating), the whole process group gets SIGTERM, then
SIGKILL after the grace period. That teardown cannot be cut short: it runs as a task of its own
(``_Ending``), so a second cancel (the native front end cancels a request's task itself, which
a shielded scope does not stop) ends only the wait for it. The run ends when the program exits, even if a child it
left running holds stdout open: what it wrote is read, then its group (and any process still
holding its stdout) is stopped the same way. The group and the stdout's holders get SIGTERM
together and SIGKILL together, so the whole teardown fits in one grace. A per-run reaper
kills the group, and the processes still holding the run's stdout, if the sidecar exits or
dies before the teardown is over (an exit does not wait out a long grace). Lines that are not
JSON, and events of an unexpected shape, are ignored; NaN/Infinity in them are read as null. An in-stream error event (jsonl ``error``,
claude-code ``result`` with ``is_error``) raises ``ModelError`` after the run is
torn down; so does a non-zero exit, or death by a signal, whatever the program wrote before
(with the stderr tail): a reply cut short is no reply.
"""

from __future__ import annotations

import codecs
import errno
import fcntl
import logging
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from stat import S_IWUSR
from typing import Any, AsyncIterator, Iterable, Iterator

import anyio

from operate_sidecar.server.core.errors import ModelError
from operate_sidecar.server.core.imodel import BaseModelProvider, ModelRequest, StreamChunk

from ._common import (
    MAX_REPLY_CHARS,
    InlineThoughts,
    field_value,
    loads_json_safe,
    redact,
    redact_piece,
    remember_model_secrets,
    render_prompt,
)
from .config import CLI_PROFILES, FIELDS, absolute_path, check_model_config

log = logging.getLogger(__name__)

PROFILES = CLI_PROFILES
DEFAULT_COMMANDS: dict[str, list[str]] = {
    "claude-code": ["claude", "-p", "--output-format", "stream-json", "--verbose"],
    "llm": ["llm", "-m", "SmolLM2", "-u"],  # -u: a token usage line on stderr
}
CONFIG_FIELDS = frozenset(FIELDS["cli"])  # declared (with their types) in config.py
STDERR_TAIL_BYTES = 2000
#: the child's stderr file is emptied once it passes KEEP bytes, its last KEPT bytes kept in memory
STDERR_KEEP_BYTES = 8 * 1024 * 1024
STDERR_KEPT_BYTES = 64 * 1024
#: the longest argument a program can be given, its closing NUL included (Linux's MAX_ARG_STRLEN;
#: a longer one fails the spawn with E2BIG, "Argument list too long")
MAX_ARG_BYTES = 131072
MAX_LINE_BYTES = 64 * 1024 * 1024


class CLIModel(BaseModelProvider):
    """A CLI-backed model (``provider: cli``); operate runs it via run_and_collect."""

    is_cli = True

    def __init__(
        self,
        name: str,
        *,
        profile: str,
        command: list[str] | None = None,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        prompt_via: str | None = None,
        timeout_s: float | None = None,
        kill_grace_s: float = 2.0,
        inline_thinking: bool | str = True,
    ) -> None:
        from . import ModelConfigError

        if profile not in PROFILES:
            raise ModelConfigError(f"model config {name!r}: cli profile must be one of {list(PROFILES)}, not {profile!r}")
        command = list(command) if command else list(DEFAULT_COMMANDS.get(profile, []))
        if not command:
            raise ModelConfigError(f"model config {name!r}: cli profile {profile!r} needs a 'command'")
        if not command[0]:  # (config.py refuses it at initialize; this is for a model built in code)
            raise ModelConfigError(f"model config {name!r}: command must begin with the program to run, "
                                   "not an empty string")
        if prompt_via not in (None, "arg", "stdin"):
            raise ModelConfigError(f"model config {name!r}: promptVia must be 'arg' or 'stdin'")
        self.name = name
        self.profile = profile
        self.command = command
        self.cwd = cwd
        self.env = dict(env or {})
        self.prompt_via = prompt_via or ("stdin" if profile == "jsonl" else "arg")
        self.prompt_via_set = prompt_via is not None  # said in the config (else arg may fall back to stdin)
        self.timeout_s = timeout_s
        self.kill_grace_s = kill_grace_s
        self.inline_thinking = inline_thinking  # true: <think>...</think> opening a reply is thoughts; "opened": every reply begins in them
        self.last_pid: int | None = None  # pid (= process group id) of the latest run

    @classmethod
    def from_config(cls, name: str, config: dict[str, Any]) -> "CLIModel":
        remember_model_secrets(config)  # (given inline, they are masked as the settings' are)
        check_model_config(config, f"model config {name!r}", "cli")
        command = config.get("command")
        if isinstance(command, str):
            command = shlex.split(command)
        cwd = field_value(name, config, "cwd", None, str)
        return cls(
            name,
            profile=field_value(name, config, "profile", "", str),
            command=command,
            cwd=absolute_path(cwd) if cwd else None,  # "~/project" too (docs/PROTOCOL.md §2, paths)
            env=field_value(name, config, "env", None, dict),
            prompt_via=field_value(name, config, "promptVia", None, str),
            timeout_s=field_value(name, config, "timeoutS", None, float),
            kill_grace_s=field_value(name, config, "killGraceS", 2.0, float),
            inline_thinking=field_value(name, config, "inlineThinking", True),  # true, false or "opened" (checked)
        )

    # -- argv -----------------------------------------------------------------

    def build_argv(self, request: ModelRequest) -> tuple[list[str], str | None]:
        """The argv for one call, and the prompt to feed on stdin (if any)."""
        prompt = render_prompt(request.messages, request.response_schema)
        argv = list(self.command)
        argv[0] = _resolve_executable(argv[0])
        opts = request.options or {}
        if self.profile == "claude-code":
            resume = opts.get("resume") or opts.get("session_id")
            if resume:
                argv += ["--resume", str(resume)]
        if any("{prompt}" in a for a in argv):
            argv = [a.replace("{prompt}", prompt) for a in argv]
            why = next((w for w in map(_no_argument, argv) if w), None)
            if why:
                raise _model_error(f"model {self.name!r}: the command with the prompt in it {why}; take "
                                   '"{prompt}" out of the command and set promptVia = "stdin" to pass it on stdin')
            return argv, None
        if self.prompt_via == "stdin":
            return argv, prompt
        why = _no_argument(prompt)
        if not self.prompt_via_set:  # the default: on stdin what one argument cannot carry as it is
            if why or prompt.startswith("-"):
                return argv, prompt
            return argv + [prompt], None
        if why:
            raise _model_error(f'model {self.name!r}: the prompt {why}; set promptVia = "stdin" to pass it on stdin')
        # a prompt opening with "-" (a markdown list, "---" front matter) is no option
        return argv + (["--"] if prompt.startswith("-") else []) + [prompt], None

    # -- run ------------------------------------------------------------------

    async def stream(self, request: ModelRequest) -> AsyncIterator[StreamChunk]:
        argv, stdin_text = self.build_argv(request)
        parser = _PARSERS[self.profile]()
        env = {**os.environ, **self.env} if self.env else None
        stderr_file = _StderrFile()
        stdin_file: Any = subprocess.DEVNULL
        try:
            if stdin_text is not None:
                stdin_file = tempfile.TemporaryFile()
                stdin_file.write(stdin_text.encode(errors="replace"))  # (a lone surrogate as "?")
                stdin_file.seek(0)
            process = await _spawn(argv, stdin=stdin_file, stderr=stderr_file.file, cwd=self.cwd, env=env)
        except BaseException as e:  # whatever fails, neither file is left open
            stderr_file.close()
            if isinstance(e, OSError) and e.errno == errno.E2BIG:
                raise _model_error(f"model {self.name!r}: could not start {argv[0]!r}: its command line is too "
                                   'long (the prompt is passed as an argument); set promptVia = "stdin"') from None
            if isinstance(e, (OSError, ValueError)):  # (ValueError: what the config checks did not catch)
                what = f"{getattr(e, 'strerror', None) or e}"
                filename = getattr(e, "filename", None)
                what += f" ({filename})" if filename and filename != argv[0] else ""
                raise _model_error(f"model {self.name!r}: could not start {argv[0]!r}: {what}") from None
            raise
        finally:
            if stdin_file is not subprocess.DEVNULL:
                stdin_file.close()  # the child has its own copy of the descriptor
        self.last_pid = process.pid
        # the group, and what holds its stdout, die with the sidecar, even by SIGKILL
        reaper = _GroupReaper.start(process.pid, getattr(process, "stdout_inode", None))
        deadline = anyio.current_time() + self.timeout_s if self.timeout_s else None
        program = Path(argv[0]).name
        produced = False
        reply_chars = 0   # text and thinking so far: bounded (a program printing on and on)
        eof = False       # stdout reached its end: nothing holds it open any more
        ending = _Ending()  # the run's teardown: once, and never cut short

        def finish() -> Any:
            return _finish_run(process, self.kill_grace_s, eof, reaper)

        def timed_out() -> ModelError:
            return _model_error(f"model {self.name!r}: {program} timed out after {self.timeout_s:g}s")

        def checked(chunk: StreamChunk) -> StreamChunk:
            nonlocal produced, reply_chars
            if chunk.type == "error":
                raise _model_error(f"model {self.name!r}: {chunk.text}")
            if chunk.type in ("text", "thinking") and chunk.text:
                reply_chars += len(chunk.text)
                if reply_chars > MAX_REPLY_CHARS:
                    raise _model_error(f"model {self.name!r}: {program} wrote a reply longer than "
                                       f"{MAX_REPLY_CHARS >> 20} Mi characters; it was stopped")
            produced = True
            return chunk

        inline = InlineThoughts.of(self.inline_thinking)

        def split(chunk: StreamChunk) -> Iterable[StreamChunk]:
            """A text chunk's inline thoughts (``<think>...</think>`` opening the reply) as thinking."""
            if chunk.type != "text" or not chunk.text:
                return (chunk,)
            return [StreamChunk(type=kind, text=text) for kind, text in inline.feed(chunk.text)]

        try:
            assert process.stdout is not None
            drain_end: float | None = None  # set once the program exited while stdout stays open
            while True:
                if drain_end is None:
                    try:
                        data = await _read_or_exit(process, deadline, stderr_file.trim)
                    except TimeoutError:
                        raise timed_out() from None
                    if data is None:  # the program exited, but something it started still holds stdout:
                        # read what it wrote before it exited (briefly: a leftover child may write on),
                        # then end the run; whatever it left behind is killed below
                        drain_end = anyio.current_time() + DRAIN_MAX_S
                        continue
                else:
                    stderr_file.trim()  # a child left running may log on to stderr as it writes
                    left = drain_end - anyio.current_time()
                    data = await _receive_within(process.stdout, min(DRAIN_IDLE_S, left)) if left > 0 else None
                    if data is None:
                        break
                if not data:
                    eof = True
                    break
                try:
                    for chunk in parser.feed(data):
                        for piece in split(checked(chunk)):
                            yield piece
                except _LineTooLong:
                    raise _model_error(f"model {self.name!r}: {program} wrote a line longer than "
                                       f"{MAX_LINE_BYTES >> 20} MiB; it was stopped") from None
            for chunk in parser.close():
                for piece in split(checked(chunk)):
                    yield piece
            for kind, text in inline.end():
                yield StreamChunk(type=kind, text=text)
            if process.returncode is None:  # stdout closed: wait for the program itself
                try:
                    await _wait_exit(process, deadline, stderr_file.trim)
                except TimeoutError:
                    raise timed_out() from None
            rc = process.returncode
            # The program is done: nothing it started outlives the call.
            await ending.run(finish)
            if rc != 0:  # a failed run, whatever it wrote before: a reply cut short is no reply
                tail = _tail(stderr_file)
                raise _model_error(
                    f"model {self.name!r}: {program} {_exit_status(rc)}"
                    + (f": {tail}" if tail else " and no output on stderr" if produced else " and no output")
                )
            if not produced:  # exit 0 and not a byte on stdout: no reply (its reason, if any, is on stderr)
                tail = _tail(stderr_file)
                raise _model_error(f"model {self.name!r}: {program} exited with status 0 but printed no reply"
                                   + (f": {tail}" if tail else " (and nothing on stderr)"))
            inline.check(self.name)
            result = parser.result
            if result.usage is None:  # e.g. `llm -u` prints "Token usage: 10 input, 5 output" on stderr
                result.usage = _usage_line(stderr_file)
            yield result
        finally:
            try:
                await ending.run(finish)
            finally:
                stderr_file.close()


_USAGE_LINE = re.compile(rb"Token usage: ([\d,]+) input, ([\d,]+) output")


def _exit_status(rc: int) -> str:
    """How the program ended, in words: its exit status, or the signal that killed it."""
    if rc < 0:
        try:
            return f"was killed by signal {signal.Signals(-rc).name}"
        except ValueError:
            return f"was killed by signal {-rc}"
    return f"exited with status {rc}"


def _too_long_for_an_argument(arg: str) -> bool:
    return len(arg) >= MAX_ARG_BYTES // 4 and len(arg.encode(errors="surrogatepass")) + 1 > MAX_ARG_BYTES


def _no_argument(arg: str) -> str | None:
    """Why ``arg`` cannot be one command-line argument (too long, or holding a NUL), or None."""
    if "\0" in arg:
        return "holds a NUL character, which no command-line argument can carry"
    if _too_long_for_an_argument(arg):
        return (f"({len(arg.encode(errors='surrogatepass'))} bytes) is too long for one command-line argument "
                f"(at most {MAX_ARG_BYTES - 1} bytes)")
    return None


def _usage_line(f: "_StderrFile") -> dict | None:
    """Token counts from a usage line on the child's stderr (the ``llm`` CLI's ``-u``), or None."""
    m = None
    for m in _USAGE_LINE.finditer(f.last(4096)):
        pass
    if m is None:
        return None
    return {"input_tokens": int(m.group(1).replace(b",", b"")), "output_tokens": int(m.group(2).replace(b",", b""))}


class _StderrFile:
    """The child's stderr: a temporary file (a pipe nobody reads could block it, and one that a
    program it started keeps open could hold the run), bounded. The child's descriptor appends
    (``O_APPEND``), so once the file passes ``STDERR_KEEP_BYTES`` (a program logging on and on)
    :meth:`trim` keeps its last ``STDERR_KEPT_BYTES`` in memory and empties it, the child's
    next lines landing at its start: what :meth:`last` reads is those kept bytes followed by
    the file, never more than that bound on disk (``/tmp`` may be memory). It runs at every
    poll of the run (``EXIT_POLL_S``), while stdout is read, drained, or closed and the program
    not yet gone.

    A trim is two system calls, a read of the tail and a truncate, which nothing makes one: bytes
    the child appends between them are lost (the truncate removes them, and after it nothing of
    them is left to recover). Those are lines of a log passing the bound, not its end: what the
    child writes after the trim is kept."""

    def __init__(self) -> None:
        self.file = tempfile.TemporaryFile()
        fd = self.file.fileno()
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_APPEND)
        self.kept = b""

    def trim(self) -> None:
        try:
            fd = self.file.fileno()
            size = os.fstat(fd).st_size
            if size <= STDERR_KEEP_BYTES:
                return
            self.kept = (self.kept + os.pread(fd, STDERR_KEPT_BYTES, size - STDERR_KEPT_BYTES))[-STDERR_KEPT_BYTES:]
            os.ftruncate(fd, 0)
        except (OSError, ValueError):
            pass

    def last(self, n: int) -> bytes:
        """The last ``n`` bytes the child wrote (at most ``STDERR_KEPT_BYTES`` from before a trim)."""
        try:
            fd = self.file.fileno()
            size = os.fstat(fd).st_size
            tail = os.pread(fd, min(n, size), max(0, size - n))
        except (OSError, ValueError):
            return b""
        return (self.kept + tail)[-n:] if len(tail) < n else tail

    def close(self) -> None:
        self.file.close()


# -- process helpers ------------------------------------------------------------

PR_SET_PDEATHSIG = 1


def _pdeathsig_setter() -> Any:
    """A ``preexec_fn`` asking the kernel to SIGKILL the child when the sidecar dies (even
    by SIGKILL), or None where that is not available (not Linux). Everything it needs is
    resolved before the fork: the child only makes two system calls."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()
    sig = int(signal.SIGKILL)

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0)
        if os.getppid() != parent:  # the sidecar died before prctl took effect
            os._exit(1)

    return preexec


class _ProcessStream:
    __slots__ = ("_reader",)

    def __init__(self, reader: Any) -> None:
        self._reader = reader

    async def receive(self, max_bytes: int = 65536) -> bytes:
        return await self._reader.read(max_bytes)


class _AsyncioProcess:
    """The part of anyio's ``Process`` the CLI model uses, over an asyncio subprocess
    (anyio's ``open_process`` cannot take a ``preexec_fn``)."""

    def __init__(self, proc: Any) -> None:
        self._proc = proc
        self.pid = proc.pid
        self.stdout = _ProcessStream(proc.stdout)
        self.stdout_inode: int | None = None  # to find who holds it open (see _end_run)
        try:
            pipe = proc._transport.get_pipe_transport(1).get_extra_info("pipe")
            self.stdout_inode = os.fstat(pipe.fileno()).st_ino
        except (AttributeError, OSError, ValueError):
            pass

    @property
    def returncode(self) -> int | None:
        return self._proc.returncode

    async def wait(self) -> int:
        return await self._proc.wait()

    async def aclose(self) -> None:
        try:
            if self.returncode is None:
                await self.wait()
        finally:
            transport = getattr(self._proc, "_transport", None)
            if transport is not None:
                transport.close()


async def _spawn(argv: list[str], *, stdin: Any, stderr: Any, cwd: str | None, env: dict[str, str] | None) -> Any:
    """Start the CLI in a session (process group) of its own, dying with the sidecar
    (``PR_SET_PDEATHSIG``); its group is killed on cancel, time-out and exit."""
    import asyncio

    preexec = _pdeathsig_setter()
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        preexec = None
    if preexec is None:  # not Linux, or not asyncio: anyio's process, group kill only
        return await anyio.open_process(argv, stdin=stdin, stdout=subprocess.PIPE, stderr=stderr, cwd=cwd,
                                        env=env, start_new_session=True)
    proc = await asyncio.create_subprocess_exec(*argv, stdin=stdin, stdout=subprocess.PIPE, stderr=stderr,
                                                cwd=cwd, env=env, start_new_session=True, preexec_fn=preexec,
                                                limit=1 << 16)
    return _AsyncioProcess(proc)



async def _receive(stream: Any) -> bytes:
    try:
        return await stream.receive(65536)
    except (anyio.EndOfStream, anyio.ClosedResourceError, anyio.BrokenResourceError):
        return b""


#: how often a read checks whether the program has exited (its stdout may stay open after it:
#: a child it started in the background inherits it)
EXIT_POLL_S = 0.2
#: after the program exited with its stdout still open: how long to wait for more of what it
#: wrote (per read, and in all)
DRAIN_IDLE_S = 0.2
DRAIN_MAX_S = 2.0
KILL_POLL_S = 0.02


async def _receive_within(stream: Any, timeout: float) -> bytes | None:
    """The next bytes of ``stream`` (b"" at its end), or None if none came within ``timeout``."""
    with anyio.move_on_after(timeout):
        return await _receive(stream)
    return None


async def _read_or_exit(process: Any, deadline: float | None, tick: Any = None) -> bytes | None:
    """The next bytes of the program's stdout (b"" at its end), or None once the program has
    exited while its stdout is still open. TimeoutError once ``deadline`` has passed. ``tick()``
    runs at every poll (the stderr file's bound: a program may write only there)."""
    while True:
        if tick is not None:
            tick()
        data = await _receive_within(process.stdout, _poll_wait(deadline))
        if data is not None:
            return data
        if process.returncode is not None:
            return None


async def _wait_exit(process: Any, deadline: float | None, tick: Any) -> None:
    """Wait for the program to exit once its stdout is closed, ``tick()`` at every poll (the
    stderr file's bound: a program may log on there after closing stdout). TimeoutError once
    ``deadline`` has passed."""
    while process.returncode is None:
        tick()
        with anyio.move_on_after(_poll_wait(deadline)):
            await process.wait()


def _poll_wait(deadline: float | None) -> float:
    """How long the next poll waits: ``EXIT_POLL_S``, less once ``deadline`` is near;
    TimeoutError once it has passed."""
    if deadline is None:
        return EXIT_POLL_S
    left = deadline - anyio.current_time()
    if left <= 0:
        raise TimeoutError
    return min(EXIT_POLL_S, left)


async def _end_run(process: Any, grace: float, stdout_closed: bool, reaper: "_GroupReaper | None") -> None:
    """Stop everything the run left behind, all within one grace: its process group (the
    program, if it still runs, and the children it put in the background) and, if its stdout is
    still open, the processes holding it (children that left the group with setsid) get SIGTERM
    together, and SIGKILL together ``grace`` seconds later (``_kill_group``). Then the reaper is
    let go. Cut short (the sidecar exits during a long grace), the reaper is not let go: it
    kills what is left once the sidecar is gone."""
    inode = getattr(process, "stdout_inode", None)
    await _kill_group(process, grace, None if stdout_closed else inode)
    with anyio.CancelScope(shield=True):
        if reaper is not None:
            await reaper.stop()


async def _finish_run(process: Any, grace: float, stdout_closed: bool, reaper: "_GroupReaper | None") -> None:
    """The whole end of a run: what it left behind stopped (``_end_run``), then the program
    reaped and its pipes closed."""
    await _end_run(process, grace, stdout_closed, reaper)
    with anyio.CancelScope(shield=True), anyio.move_on_after(max(grace, 1.0)):
        try:
            await process.aclose()
        except Exception:  # noqa: BLE001 - best effort
            pass


#: run teardowns under way as tasks of their own (kept here until they end: the event loop
#: holds its tasks weakly, and the one that awaited a teardown may be gone)
_ENDINGS: set[Any] = set()


class _Ending:
    """A run's teardown (SIGTERM → grace → SIGKILL of its group, the processes still holding
    its stdout, its reaper, the program reaped), started once and always run to its end.

    Under asyncio it runs as a task of its own, awaited through ``asyncio.shield``: the native
    front end cancels a request's task itself (``$/cancelRequest``), and such a cancel goes
    through a shielded anyio scope. A cancel of the awaiting task (a second ``$/cancelRequest``,
    or one that comes while a time-out's grace runs) then ends only the wait, so the answer may
    go at once, while the teardown goes on and the processes still die within the grace. A wait
    cut short is not taken up again. Elsewhere (trio) the teardown runs in a shielded scope."""

    __slots__ = ("_task", "_over")

    def __init__(self) -> None:
        self._task: Any = None
        self._over = False  # done, or its wait was cancelled

    async def run(self, start: Any) -> None:
        """Start the teardown ``start()`` (the first time) and wait for its end."""
        import asyncio

        if self._over:
            return
        if self._task is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                loop = None
            if loop is None:
                self._over = True
                with anyio.CancelScope(shield=True):
                    await start()
                return
            self._task = loop.create_task(start())
            _ENDINGS.add(self._task)
            self._task.add_done_callback(_ending_done)
        try:
            with anyio.CancelScope(shield=True):
                await asyncio.shield(self._task)
        finally:
            self._over = True


def _ending_done(task: Any) -> None:
    _ENDINGS.discard(task)
    if not task.cancelled() and task.exception() is not None:
        log.warning("cli: a run's teardown failed", exc_info=task.exception())


class _GroupReaper:
    """A tiny process, in a session of its own, that SIGKILLs the run's process group once the
    sidecar is gone (exit, crash or SIGKILL alike): it blocks reading a pipe only the sidecar
    holds. ``PR_SET_PDEATHSIG`` takes the program itself down, not the children it started;
    this takes the whole group, and then every process still holding the run's stdout (a child
    the program detached with ``setsid``, out of the group; ``server.reaper``). So a sidecar
    that exits, or is killed, in the middle of a run's teardown leaves nothing behind either:
    what the teardown had not stopped yet is killed at once. (The sidecar's own reaper,
    ``server.rpc.stdio``, covers the sidecar's group, which a CLI run leaves.) Let go when the
    run's teardown is over."""

    def __init__(self, proc: Any, write_fd: int) -> None:
        self._proc = proc
        self._fd: int | None = write_fd

    @classmethod
    def start(cls, pgid: int, stdout_inode: int | None = None) -> "_GroupReaper | None":
        if sys.platform == "win32":
            return None
        from operate_sidecar.server.reaper import start_reaper

        started = start_reaper(pgid, stdout_inode)
        return cls(*started) if started is not None else None

    async def stop(self) -> None:
        """Let it go: the run is over (its group and its stdout's holders already stopped), so it
        exits killing nothing (its group's id, the leader's pid, may be reused by now)."""
        from operate_sidecar.server.reaper import release_reaper

        fd, self._fd = self._fd, None
        if fd is None:
            return
        release_reaper(fd)
        await _until(lambda: self._proc.poll() is not None, 2.0)
        if self._proc.poll() is None:  # pragma: no cover - a stuck shell
            self._proc.kill()
            await _until(lambda: self._proc.poll() is not None, 2.0)


def _signal_group(pgid: int, sig: int) -> bool:
    """Send ``sig`` to the group; False if it has no member left (or none we may signal)."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _group_alive(pgid: int) -> bool:
    """Does the group have a member that is not a zombie? (Zombies wait for whoever reaps the
    orphans, which may be never: they hold nothing and cannot be killed.)"""
    if not _signal_group(pgid, 0):
        return False
    if not sys.platform.startswith("linux"):
        return True
    for pid in _pids():
        stat = _stat(pid)
        if stat is not None and stat[1] == pgid and stat[0] not in "ZX":
            return True
    return False


def _pids() -> list[int]:
    try:
        return [int(n) for n in os.listdir("/proc") if n.isdigit()]
    except OSError:
        return []


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, process group) of ``pid`` from /proc, or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return fields[0].decode(), int(fields[2])
    except (OSError, IndexError, ValueError):
        return None


async def _until(done: Any, timeout: float) -> None:
    with anyio.move_on_after(timeout):
        while not done():
            await anyio.sleep(KILL_POLL_S)


async def _kill_group(process: Any, grace: float, stdout_inode: int | None = None) -> None:
    """SIGTERM the whole process group, and the processes holding the pipe ``stdout_inode``
    open for writing (the run's stdout, when it is still open: children that left the group
    with setsid), then SIGKILL what is left of either after ``grace`` seconds: the whole
    teardown fits in one grace. Waits (at most ``grace`` each time) until the leader is reaped
    and nothing of the group or the holders runs.

    A holder is a process outside the group (``killpg`` reaches the members, and a member that
    dies frees its pid for another process). Only what holds the pipe when it is signalled is
    signalled: the SIGKILL goes to what a fresh scan finds then, never to a pid remembered from
    before the grace (it may belong to another process by then). A holder the sidecar may not
    signal is left out: waiting for it would only add a grace."""
    pgid = process.pid
    holders: list[int] = []

    async def scan() -> list[int]:
        if stdout_inode is None:
            return []
        return await anyio.to_thread.run_sync(_pipe_holders, stdout_inode, pgid)

    def gone() -> bool:
        nonlocal holders
        if stdout_inode is not None:  # a holder that ended (its pid free, or reused) holds nothing
            holders = [p for p in holders if _holds(p, stdout_inode)]
        return process.returncode is not None and not holders and not _group_alive(pgid)

    with anyio.CancelScope(shield=True):
        holders = await scan()
        if holders:
            log.debug("cli: stopping %s, holding the program's stdout, with its process group", holders)
        signalled = _signal_group(pgid, signal.SIGTERM)
        holders = _signal_pids(holders, signal.SIGTERM)
        if not signalled and not holders:
            if process.returncode is None:  # not signalable, or raced with its exit: reap it
                with anyio.move_on_after(grace):
                    await process.wait()
            return
        await _until(gone, grace)
        if gone():
            return
        # Members of the group (or holders) may outlive the leader, or ignore SIGTERM: kill what
        # is left, and whatever took the pipe up meanwhile (a child started during the grace).
        _signal_group(pgid, signal.SIGKILL)
        holders = _signal_pids(await scan(), signal.SIGKILL)
        await _until(gone, grace)


def _signal_pids(pids: list[int], sig: int) -> list[int]:
    """Send ``sig`` to each of ``pids``: those it reached (the others are gone, or not the
    sidecar's to signal)."""
    reached = []
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            continue
        reached.append(pid)
    return reached


def _pipe_holders(inode: int, pgid: int | None = None) -> list[int]:
    """The processes with the pipe ``inode`` open for writing (Linux /proc): what keeps the
    run's stdout from ending. Not this process, not one that has only a read end (a pipe's two
    ends share its inode: a process the sidecar forked, or a sibling run's child before its
    exec, holds the sidecar's read end), and not a member of the group ``pgid``."""
    me = os.getpid()
    out = []
    for pid in _pids():
        if pid == me or not _holds(pid, inode):
            continue
        stat = _stat(pid)
        if stat is not None and (pgid is None or stat[1] != pgid):
            out.append(pid)
    return out


def _holds(pid: int, inode: int) -> bool:
    """Does ``pid`` have the pipe ``inode`` open for writing? (A ``/proc/PID/fd`` link's mode
    says how its descriptor is open: ``S_IWUSR`` for writing.)"""
    target = f"pipe:[{inode}]"
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        path = f"/proc/{pid}/fd/{fd}"
        try:
            if os.readlink(path) == target and os.lstat(path).st_mode & S_IWUSR:
                return True
        except OSError:
            continue
    return False


def _resolve_executable(cmd: str) -> str:
    """``cmd`` on PATH, else next to the running interpreter (an unactivated venv)."""
    if os.sep in cmd or shutil.which(cmd):
        return cmd
    candidate = Path(sys.executable).parent / cmd
    if candidate.is_file() and os.access(candidate, os.X_OK):
        return str(candidate)
    return cmd


def _model_error(message: str) -> ModelError:
    """A ModelError whose text has every known secret (and key-looking token) removed."""
    return ModelError(redact(message))


_UTF8_CONTINUATION = bytes(range(0x80, 0xC0))  # the bytes that go on a character begun before them


def _tail(f: "_StderrFile", limit: int = STDERR_TAIL_BYTES) -> str:
    """The last ``limit`` characters of the child's stderr, redacted *before* the cut (a
    window reaching back a little further, so a key straddling the cut is masked whole). The
    window's own start is a cut too, which masking can bring within the last ``limit``
    characters (each key masked makes the text shorter): the piece of a key it may begin with is
    left out (``redaction.redact_piece``)."""
    from operate_sidecar.server.redaction import known_secrets

    reach = limit + 2 * max((len(k) for k in known_secrets()), default=0) + 256
    window = f.last(reach)
    cut = len(window) >= reach
    if cut:  # (from its first whole character: a character cut in two is no piece of a key's text)
        window = window.lstrip(_UTF8_CONTINUATION)
    text = redact_piece(window.decode(errors="replace"), cut_before=cut).strip()
    return text[-limit:] if len(text) > limit else text


# -- stream parsers ---------------------------------------------------------------


class _Parser:
    """Turns stdout bytes into StreamChunks; holds the final result chunk."""

    def __init__(self) -> None:
        self.result = StreamChunk(type="result")
        self.saw_error = False

    def feed(self, data: bytes) -> Iterator[StreamChunk]:  # pragma: no cover - abstract
        raise NotImplementedError

    def close(self) -> Iterator[StreamChunk]:
        return iter(())


class _LineTooLong(Exception):
    """A line of the program's output outgrew MAX_LINE_BYTES."""


class _LineParser(_Parser):
    def __init__(self) -> None:
        super().__init__()
        self._buf = bytearray()  # the line begun and not ended yet: no newline in it

    def feed(self, data: bytes) -> Iterator[StreamChunk]:
        # Only the new bytes are searched for a line's end, and the buffer grows in place: a
        # line of many reads costs its length, not its length squared.
        start = len(self._buf)
        self._buf += data
        last = self._buf.rfind(b"\n", start)
        if last >= 0:
            lines = bytes(self._buf[:last]).split(b"\n")
            del self._buf[:last + 1]
            for line in lines:
                yield from self._line(line)
        if len(self._buf) > MAX_LINE_BYTES:
            raise _LineTooLong

    def close(self) -> Iterator[StreamChunk]:
        line, self._buf = bytes(self._buf), bytearray()
        yield from self._line(line)

    def _line(self, raw: bytes) -> Iterator[StreamChunk]:
        raw = raw.strip()
        if not raw:
            return
        try:
            event = loads_json_safe(raw)  # NaN, Infinity, 1e400 → null: what is kept stays JSON
        except (ValueError, RecursionError):
            log.debug("cli: ignoring a non-JSON line: %r", raw[:200])
            return
        if not isinstance(event, dict):
            return
        try:  # an event of an unexpected shape is ignored, like a line that is not JSON
            chunks = list(self.event(event))
        except (AttributeError, TypeError, ValueError, KeyError, RecursionError):
            log.debug("cli: ignoring an event of an unexpected shape: %r", raw[:200])
            return
        yield from chunks

    def event(self, event: dict) -> Iterator[StreamChunk]:  # pragma: no cover - abstract
        raise NotImplementedError

    def error(self, message: str) -> StreamChunk:
        """An error the CLI reported in-stream. Raised (not yielded) by ``stream`` so
        the run is torn down right away, whatever the consumer does next."""
        self.saw_error = True
        self.result.is_error = True
        return StreamChunk(type="error", text=message or "CLI model reported an error", is_error=True)


class JsonlParser(_LineParser):
    """``jsonl``: one event per line, named like StreamChunk types."""

    def event(self, e: dict) -> Iterator[StreamChunk]:
        t = e.get("type")
        if t in ("text", "thinking"):
            text = e.get("text")
            if text and isinstance(text, (str, int, float)) and not isinstance(text, bool):
                yield StreamChunk(type=t, text=str(text))
        elif t == "tool_use":
            yield StreamChunk(type="tool_use", id=_s(e.get("id")), name=_s(e.get("name")), input=_dict(e.get("input")))
        elif t == "tool_result":
            yield StreamChunk(
                type="tool_result", id=_s(e.get("id")), output=e.get("output"), is_error=bool(e.get("is_error"))
            )
        elif t == "result":
            r = self.result
            r.usage = e.get("usage") if isinstance(e.get("usage"), dict) else r.usage
            r.model = _s(e.get("model")) or r.model
            r.session_id = _s(e.get("session_id")) or r.session_id
            r.is_error = r.is_error or bool(e.get("is_error"))
        elif t == "error":
            yield self.error(str(e.get("message") or e.get("text") or ""))


class ClaudeCodeParser(_LineParser):
    """``claude -p --output-format stream-json --verbose`` events."""

    def __init__(self) -> None:
        super().__init__()
        self._partial = False  # --include-partial-messages deltas seen: skip duplicate full blocks
        self._text_seen = False

    def event(self, e: dict) -> Iterator[StreamChunk]:
        # Every value below the event is checked before use: a field of another shape than
        # claude's (a string where an object belongs, a list where text belongs) is skipped.
        t = e.get("type")
        r = self.result
        if e.get("session_id"):
            r.session_id = str(e["session_id"])
        if t == "system":
            r.model = _s(e.get("model")) or r.model
        elif t == "stream_event":
            ev = _obj(e.get("event"))
            delta = _obj(ev.get("delta"))
            if ev.get("type") == "content_block_delta":
                if delta.get("type") == "text_delta" and _text(delta.get("text")):
                    self._partial = self._text_seen = True
                    yield StreamChunk(type="text", text=delta["text"])
                elif delta.get("type") == "thinking_delta" and _text(delta.get("thinking")):
                    self._partial = True
                    yield StreamChunk(type="thinking", text=delta["thinking"])
        elif t == "assistant":
            msg = _obj(e.get("message"))
            r.model = _s(msg.get("model")) or r.model
            for block in _blocks(msg.get("content")):
                bt = block.get("type")
                if bt == "text" and not self._partial and _text(block.get("text")):
                    self._text_seen = True
                    yield StreamChunk(type="text", text=block["text"])
                elif bt == "thinking" and not self._partial and _text(block.get("thinking")):
                    yield StreamChunk(type="thinking", text=block["thinking"])
                elif bt == "tool_use":
                    yield StreamChunk(
                        type="tool_use", id=_s(block.get("id")), name=_s(block.get("name")), input=_dict(block.get("input"))
                    )
        elif t == "user":
            msg = _obj(e.get("message"))
            for block in _blocks(msg.get("content")):
                if block.get("type") == "tool_result":
                    yield StreamChunk(
                        type="tool_result",
                        id=_s(block.get("tool_use_id")),
                        output=_tool_output(block.get("content")),
                        is_error=bool(block.get("is_error")),
                    )
        elif t == "result":
            usage = dict(e["usage"]) if isinstance(e.get("usage"), dict) else {}
            for k in ("total_cost_usd", "num_turns", "duration_ms"):
                if e.get(k) is not None:
                    usage[k] = e[k]
            r.usage = usage or None
            text = e.get("result")
            if e.get("is_error") or str(e.get("subtype", "success")) != "success":
                detail = f": {text}" if isinstance(text, str) and text else ""
                yield self.error(f"claude-code: {_s(e.get('subtype')) or 'error'}{detail}")
            elif _text(text) and not self._text_seen:
                self._text_seen = True
                yield StreamChunk(type="text", text=text)


class TextParser(_Parser):
    """``llm``: plain text on stdout, streamed as decoded; the CLI's final newline is dropped."""

    def __init__(self) -> None:
        super().__init__()
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._pending = ""

    def _emit(self, text: str) -> Iterator[StreamChunk]:
        text = self._pending + text
        body = text.rstrip("\n")
        self._pending = text[len(body):]
        if body:
            yield StreamChunk(type="text", text=body)

    def feed(self, data: bytes) -> Iterator[StreamChunk]:
        yield from self._emit(self._decoder.decode(data))

    def close(self) -> Iterator[StreamChunk]:
        yield from self._emit(self._decoder.decode(b"", final=True))
        self._pending = ""


_PARSERS: dict[str, type[_Parser]] = {"jsonl": JsonlParser, "claude-code": ClaudeCodeParser, "llm": TextParser}


def _s(v: Any) -> str | None:
    return None if v is None else str(v)


def _dict(v: Any) -> dict | None:
    if v is None or isinstance(v, dict):
        return v
    return {"value": v}


def _obj(v: Any) -> dict:
    """``v`` if it is an object, else an empty one (a field of an unexpected shape)."""
    return v if isinstance(v, dict) else {}


def _text(v: Any) -> bool:
    """Is ``v`` text to pass on (a non-empty string)?"""
    return isinstance(v, str) and bool(v)


def _blocks(content: Any) -> list[dict]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        return []
    return [b for b in content if isinstance(b, dict)]


def _tool_output(content: Any) -> Any:
    if isinstance(content, list):
        texts = [b.get("text", "") for b in content if isinstance(b, dict) and b.get("type") == "text"]
        if len(texts) == len(content):
            return "\n".join(texts)
    return content
