"""``operate-sidecar`` / ``python -m operate_sidecar.server``: the JSON-RPC stdio server."""

from __future__ import annotations

import sys

DESCRIPTION = """\
operate-sidecar: a JSON-RPC 2.0 server on stdin/stdout (LSP base-protocol framing) that
holds LLM conversation branches and runs composed operate calls. Editors spawn it as a
subprocess; see docs/PROTOCOL.md. stdout carries protocol frames only; logs go to stderr.

Settings are merged: initialize "settings" over the --config file over these flags."""


class EarlySignals:
    """SIGTERM, SIGINT and SIGHUP from the first lines of ``main`` until a front end's loop takes
    them over: the first one is recorded, not acted on (a SIGINT's KeyboardInterrupt traceback,
    or the process killed by the signal with a request it had been sent never answered, as during
    the imports before the loop runs). ``hand_over`` gives it to the loop, which then takes it
    as if it came at that moment (docs/PROTOCOL.md §2 and §13: the same exit, the requests read
    by then answered). A second one while the process still starts (stuck reading a ``--config``
    FIFO nobody writes, say) is not held back: the dispositions from before are put back and
    what was recorded raised again, so a second signal stops a start that does not end. Returning
    without serving (``restore``: a mistake, --help, --version) does the same: a signal recorded
    is raised, not dropped. A few microseconds at start-up: three ``signal`` calls, the module
    being imported by the front ends anyway; a signal the platform lacks (SIGHUP) is left out."""

    def __init__(self) -> None:
        import signal

        self.seen: list[int] = []
        self.before: dict[int, object] = {}  # the dispositions from before (a forked tool's child gets them)
        self._handing = False  # ``hand_over`` runs: a signal is only recorded
        for name in ("SIGTERM", "SIGINT", "SIGHUP"):
            sig = getattr(signal, name, None)
            if sig is None:
                continue
            try:
                self.before[sig] = signal.signal(sig, self._record)
            except (ValueError, OSError):  # not the main thread (main() called by a host): left alone
                pass

    def _record(self, sig: int, frame: object) -> None:
        self.seen.append(sig)
        if len(self.seen) > 1 and not self._handing:  # a second one: as if nothing held them
            self.restore()

    def hand_over(self, install) -> None:  # type: ignore[no-untyped-def]
        """Call ``install(before)`` (the loop's handlers, ``server.signals.install_signal_handlers``;
        ``before``, the dispositions from before, are what a forked child gets), which puts them
        straight over the recorder: never a moment with the dispositions from before (a signal
        then, taken by a thread already running, would kill the process). ``signal.signal`` first
        runs a handler still pending, so a signal that came until its swap is recorded; the
        signals are held on this thread meanwhile (one sent then reaches the loop's handler once
        let through). Then each one recorded is raised again, in order: the loop takes it as any
        signal, after the input that had come by then. Once only."""
        import signal

        before, self.before = self.before, {}
        if not before:
            install(None)
            return
        mask = getattr(signal, "pthread_sigmask", None)
        held = mask(signal.SIG_BLOCK, before) if mask is not None else None
        self._handing = True
        try:
            install(before)
        finally:
            if held is not None:
                mask(signal.SIG_SETMASK, held)  # type: ignore[misc]
        seen, self.seen = self.seen, []
        for sig in seen:
            signal.raise_signal(sig)

    def restore(self) -> None:
        """Not handed over (``main`` returns without serving, or a second signal came): the
        dispositions from before, then each signal recorded raised again with them (SIGTERM's
        default ends the process, SIGINT's is a KeyboardInterrupt). Once only."""
        import signal

        before, self.before = self.before, {}
        if not before:
            return
        for sig, disposition in before.items():
            signal.signal(sig, disposition)  # type: ignore[arg-type]
        seen, self.seen = self.seen, []
        for sig in seen:
            signal.raise_signal(sig)


class CommandLineMistake(Exception):
    """A command-line mistake, as the one line ``operate-sidecar: error: ...`` argparse would
    write: raised instead of exiting when ``--acp`` is asked for, so that the line can also be
    the answer to the editor's requests (as a bad ``--config`` file's line is)."""


def _pid(text: str) -> int:
    """A process id: a positive integer (0 or a negative number names a process group to kill(2),
    so a watchdog on it would never fire, or fire at once) that a ``pid_t`` holds (2^31 and more
    is no process: kill(2) cannot even be asked about it)."""
    import argparse

    from operate_sidecar.server.rpc.watchdog import MAX_PID

    try:
        pid = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a process id: {text!r}") from None
    if pid < 1:
        raise argparse.ArgumentTypeError(f"not a process id: {text!r} (a PID is a positive integer)")
    if pid > MAX_PID:
        raise argparse.ArgumentTypeError(f"not a process id: {text!r} (a PID is at most {MAX_PID})")
    return pid


def _load_config(path: str) -> dict:
    """The ``--config`` file's settings; SettingsError naming the file when it cannot be read or is
    not TOML."""
    import tomllib

    from operate_sidecar.server.rpc import settings as S

    try:
        return S.load_toml(path)
    except tomllib.TOMLDecodeError as e:
        raise S.SettingsError(f"{path} is not a TOML file: {e}") from None
    except UnicodeDecodeError:
        raise S.SettingsError(f"{path} is not a TOML file: it is not UTF-8 text") from None
    except OSError as e:
        raise S.SettingsError(f"cannot read {path}: {e.strerror or e}") from None


def _parser(answer_mistakes: bool = False):  # type: ignore[no-untyped-def]
    """The command line's parser. With ``answer_mistakes`` a mistake raises CommandLineMistake
    (its one line) instead of printing the usage and exiting 2: the ``--acp`` server answers it."""
    import argparse

    from operate_sidecar.server import __version__
    from operate_sidecar.server.rpc.settings import DEFAULTS

    class Parser(argparse.ArgumentParser):
        def error(self, message: str):  # type: ignore[override]
            if answer_mistakes:
                raise CommandLineMistake(f"{self.prog}: error: {message}")
            super().error(message)

    p = Parser(prog="operate-sidecar", description=DESCRIPTION,
                formatter_class=argparse.RawDescriptionHelpFormatter,
                epilog="Session scripts:\n"
                       "  operate-sidecar replay [--scripted] [--timeout S] [--quiet] SCRIPT.jsonl "
                       "[-- SERVER ARGV...]\n"
                       "      run a session script against a fresh server and report every step\n"
                       "      (see `operate-sidecar replay --help`; --record FILE writes one)")
    p.add_argument("--config", metavar="FILE",
                   help="TOML file with settings, as top-level keys, in a [settings] table or both (each "
                        "setting once; a UTF-8 byte-order mark is skipped): any of "
                        + ", ".join(DEFAULTS) + " (docs/PROTOCOL.md, initialize)")
    p.add_argument("--state-dir", metavar="DIR",
                   help="keep branches in a SQLite state store under DIR (DIR/state.sqlite3) so they survive "
                        "restarts (default: memory only)")
    p.add_argument("--client-process-id", metavar="PID", type=_pid,
                   help="exit when this process dies (as initialize processId)")
    p.add_argument("--log-level", default="warning", type=str.lower, choices=["debug", "info", "warning", "error", "critical"],
                   help="stderr log level (default: warning)")
    p.add_argument("--debug", action="store_true",
                   help="include tracebacks in internal-error responses (error.data) and log at debug level")
    p.add_argument("--acp", action="store_true",
                   help="speak the Agent Client Protocol (newline-delimited JSON-RPC, for Zed, CodeCompanion, "
                        "avante and other ACP editors) instead of the native protocol")
    p.add_argument("--record", metavar="FILE",
                   help="write the session served as a replayable session script (JSON Lines) to FILE, "
                        "with every model turn, so that `operate-sidecar replay --scripted FILE` replays "
                        "it without the model; an existing FILE is overwritten. `operate-sidecar replay` runs "
                        "such scripts (see its --help)")
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}",
                   help="print the version and exit")
    return p


def _flag_mistake(args) -> str | None:  # type: ignore[no-untyped-def]
    """The line for flags argparse accepts but that cannot go together or hold nothing."""
    if args.config == "":  # (--config "$CFG" with CFG unset): said, not run without the file in silence
        return "operate-sidecar: --config: no file name given (leave the flag out to run without a config file)"
    if args.state_dir == "":  # (--state-dir "$STATE" with STATE unset): said, not memory only in silence
        return ("operate-sidecar: --state-dir: no folder name given (leave the flag out to keep branches in memory "
                "only)")
    if args.record and args.acp:
        return "operate-sidecar: --record records the native protocol; it cannot be combined with --acp"
    return None


def _log_uncaught() -> None:
    """Send the tracebacks Python itself prints on stderr through logging, so that they pass the
    handlers' secret-masking filter as every log line does: an exception a tool's own thread
    does not catch (``threading.excepthook``), one raised where nothing can catch it, in a
    ``__del__`` or a finalizer (``sys.unraisablehook``), and one that ends the main thread
    (``sys.excepthook``). Each is one ERROR record with the traceback, under the logger
    ``operate_sidecar.server``; a thread ended by SystemExit stays silent, as Python's own
    hook leaves it."""
    import logging
    import threading

    log = logging.getLogger("operate_sidecar.server")

    def thread_hook(args) -> None:  # type: ignore[no-untyped-def]
        if args.exc_type is SystemExit:
            return
        name = args.thread.name if args.thread is not None else threading.get_ident()
        log.error("Exception in thread %s", name, exc_info=(args.exc_type, args.exc_value, args.exc_traceback))

    def unraisable_hook(args) -> None:  # type: ignore[no-untyped-def]
        try:
            where = f"{args.err_msg or 'Exception ignored in'}: {args.object!r}" if args.object is not None \
                else args.err_msg or "Exception ignored"
        except Exception:
            where = f"{args.err_msg or 'Exception ignored in'}: <object repr() failed>"
        exc_info = (args.exc_type, args.exc_value, args.exc_traceback) if args.exc_type is not None else None
        log.error("%s", where, exc_info=exc_info)

    def main_hook(exc_type, exc_value, exc_traceback) -> None:  # type: ignore[no-untyped-def]
        log.error("Uncaught exception", exc_info=(exc_type, exc_value, exc_traceback))

    threading.excepthook = thread_hook
    sys.unraisablehook = unraisable_hook
    sys.excepthook = main_hook


def main(argv: list[str] | None = None) -> int:
    """Run the server (or ``replay``). A mistake on the command line or in the ``--config`` file
    is one line on stderr and exit code 2; with ``--acp`` (written as such) the server first
    answers every request with that line (``server.acp.run.Unconfigured``), unless stdin is a
    terminal: a person there has read it. A signal that comes before the server's loop runs
    (during the imports, say) is recorded and taken once it does (``EarlySignals``)."""
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["replay"]:  # operate-sidecar replay SCRIPT.jsonl [-- SERVER ARGV...]
        from operate_sidecar.server.script.runner import main as replay_main

        return replay_main(argv[1:])
    early = EarlySignals()  # first: from now on a signal is recorded, not fatal
    try:
        return _main(argv, early)
    finally:
        early.restore()  # (returning without serving: a mistake, --help, --version)


def _main(argv: list[str], early: EarlySignals) -> int:
    """``main`` once the signals are recorded: the front end it runs takes them over (``early``)."""
    import logging
    import os

    from operate_sidecar.server import __version__
    from operate_sidecar.server.rpc import settings as S

    acp = "--acp" in argv  # (as written: a misspelt --acp is the native server's mistake)
    if acp:
        # start-up is import-bound (the ACP SDK's pydantic schema, then the core): no cyclic
        # collection walks the freshly built modules meanwhile. The core loader turns the
        # collector back on (and freezes what was loaded) once it is in.
        import gc

        gc.disable()
    args = None
    try:
        args = _parser(answer_mistakes=acp).parse_args(argv)
    except CommandLineMistake as e:
        mistake: str | None = str(e)
    else:
        mistake = _flag_mistake(args)
    if mistake:
        print(mistake, file=sys.stderr)
        if not acp or os.isatty(0):
            return 2
        # answered as a bad --config file is (below, the config not read): an ACP editor shows
        # answers, not stderr
    debug = args.debug if args is not None else "--debug" in argv
    level = logging.DEBUG if debug else getattr(logging, args.log_level.upper()) if args is not None \
        else logging.WARNING
    logging.basicConfig(stream=sys.stderr, level=level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from operate_sidecar.server.models._common import RedactingFilter

    for handler in logging.getLogger().handlers:  # keys never reach stderr, --debug included
        handler.addFilter(RedactingFilter())
    logging.captureWarnings(True)  # a tool's warnings.warn(...) passes the filter too
    _log_uncaught()  # and a traceback Python would print on stderr itself
    base: dict = {}
    config_error = mistake
    if args is not None and not mistake:
        if args.state_dir is not None:
            base["stateDir"] = args.state_dir
            S.resolve_paths(base)  # (a flag's relative path is the working directory's; "~" expanded)
        try:
            config = _load_config(args.config) if args.config else {}
            if config:  # "~" expanded; relative paths the working directory's (docs/PROTOCOL.md §2, Paths)
                S.resolve_paths(config)
            base = S.merge(base, config)
            unknown = [k for k in base if k not in S.DEFAULTS]
            if unknown:
                raise S.SettingsError("unknown settings field(s): " + ", ".join(unknown) + f" (in {args.config})")
            S.finalize(S.merge(S.DEFAULTS, base))
            problem = S.not_json(config) if config else None  # (after the fields' own checks, which say more)
            if problem:
                raise S.SettingsError(f"{args.config}: {problem}")
        except (OSError, ValueError) as e:
            config_error = f"operate-sidecar: bad configuration: {e}"
            print(config_error, file=sys.stderr)
            if not args.acp or os.isatty(0):  # (a person at a terminal has read the line: nothing to wait for)
                return 2
            # an ACP editor shows answers, not stderr: the server answers every request with the
            # line (server.acp.run.Unconfigured), then exits 2

    if args is None or mistake or args.acp:  # (a mistake gets this far with --acp only)
        from operate_sidecar.server.acp.run import run as run_acp

        code = run_acp(base_settings=base, version=__version__, debug=debug,
                       client_pid=args.client_process_id if args is not None else None, config_error=config_error,
                       early=early)
        logging.shutdown()
        os._exit(code)
    assert args is not None

    import asyncio

    from operate_sidecar.server.rpc.run import serve
    from operate_sidecar.server.rpc.stdio import guard_stdio

    recorder = None
    if args.record is not None:  # --record "" too: said, not ignored
        from operate_sidecar.server.script.recorder import Recorder

        try:
            recorder = Recorder(args.record)
        except OSError as e:
            print(f"operate-sidecar: cannot record to {args.record}: {e}", file=sys.stderr)
            return 2
    fds = guard_stdio()  # before anything can write to fd 1
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        code = loop.run_until_complete(serve(base_settings=base, version=__version__, debug=args.debug,
                                             client_pid=args.client_process_id, fds=fds, recorder=recorder,
                                             early=early))
    except KeyboardInterrupt:
        code = 1
    logging.shutdown()
    try:
        sys.stderr.flush()
    except Exception:
        pass
    # Worker threads (blocking tools) must not hold the process: leave now.
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
