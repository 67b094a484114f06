"""A cache of the code that attrs, cattrs and dataclasses generate, kept across processes.

attrs writes the methods of every class it builds (``__init__``, ``__repr__``, ``__eq__`` ...)
as source text and compiles it when the class is defined; cattrs does the same for each
(un)structure function it makes, and the standard library's ``dataclasses`` for each dataclass
(an ``exec`` of the text: ~310 in the core, a sixth of its import). The native front end imports
pygls, whose ``lsprotocol.types`` alone is ~550 such classes: compiling their methods is over a
third of that import, and the editor's first request after a spawn waits for it. Python keeps
the bytecode of a module in ``__pycache__`` for the same reason; this keeps the bytecode of the
generated methods.

How it works: while installed, ``compile`` in those libraries' modules is a function that looks
the code up by the name the library gives it (``<attrs generated methods lsprotocol.types.Position>``),
the mode and the compiler flags, and uses it only when it was compiled from the same source (a
hash of the text); else it compiles, as the builtin would. ``exec`` in ``dataclasses`` compiles
its text the same way, keyed by the text itself (it names none), then runs the code. So the code
is exactly what ``compile`` gives, and an entry whose library changed is compiled again and
replaced, never used. The cache is one file per interpreter bytecode version and environment,
``$XDG_CACHE_HOME/operate-sidecar/generated-code-*`` (``~/.cache`` without it), read once (the
marshalled code of each entry is unmarshalled only when used) and written back atomically,
merged with what another process wrote meanwhile, when a process compiled a class the cache did
not have, or many that changed. A class whose source differs in every process (attrs's
``__hash__`` holds a randomised string hash) is compiled each time and never kept.
``OPERATE_SIDECAR_CODE_CACHE`` names another file, or turns the cache off (``off``, ``0`` or
empty). Only a missing or regular file is ever written over: a device (``/dev/null``), a FIFO,
a socket, a folder or a symlink in its place is left as it is, and the cache is not written.

The folder does not grow with every environment that ever ran the sidecar (a fresh clone's
``.venv``, a throwaway test venv: ~1.7 MB each). A file there records the environment it is for
(``sys.prefix``), and a process that uses its file touches it once a day (its mtime: when it was
last used). When a process writes its file, on the daemon thread that writes it, it removes the
folder's other cache files whose environment no longer exists, those not used for
:data:`UNUSED_DAYS` days, and the least recently used beyond :data:`KEEP_FILES` in all: a scan of
the folder and a read of the few files kept (about 1 ms each). Removing a file breaks no process
that uses it: a process reads its file whole at start-up, and one that finds it gone when it
writes writes it anew. A file named by ``OPERATE_SIDECAR_CODE_CACHE`` is not in that folder's
count, and removes nothing.

Nothing here may break the server: a cache that cannot be read, written or trusted (not ours,
writable by others, damaged) is ignored, and everything is compiled as before.
"""

from __future__ import annotations

import builtins
import logging
import os
import sys
import threading
import time
from typing import Any, Callable

log = logging.getLogger("operate_sidecar.server.codecache")

ENV = "OPERATE_SIDECAR_CODE_CACHE"
#: the modules whose ``compile`` is the cached one: where attrs and cattrs compile what they generate
MODULES = ("attr._make", "cattrs.gen", "cattrs.gen.typeddicts")
#: the modules whose ``exec`` of a source text compiles through the cache (keyed by the text)
EXEC_MODULES = ("dataclasses",)
#: a cache grown past this (many library versions over time) starts again from this process's entries
MAX_ENTRIES = 20_000
#: values of OPERATE_SIDECAR_CODE_CACHE that turn the cache off
OFF = ("", "0", "off", "false", "no")
TMP_PREFIX = ".codecache-"
#: a temporary file older than this is a writer's that died
LEFTOVER_AGE_S = 600
#: more changed entries than this in one process is a library that changed: the cache is written
CHANGED_WORTH_SAVING = 8
#: the names of the default folder's cache files (one per interpreter and environment)
FILE_PREFIX, FILE_SUFFIX = "generated-code-", ".marshal"
#: the entry (no code's: a code's name starts with its mode) that records a default cache file's
#: environment, ``sys.prefix``, as ``(os.fsencode(prefix), b"")``
PREFIX_KEY = b"\0prefix"
#: a default folder's cache file not used for this many days is removed
UNUSED_DAYS = 30
#: at most this many cache files in the default folder: the least recently used go
KEEP_FILES = 8
#: a process that uses its file touches it (its mtime) when it is older than this
TOUCH_AFTER_S = 86400

_builtin_compile = builtins.compile
_builtin_exec = builtins.exec
_lock = threading.Lock()
_state: _Cache | None = None


class _Cache:
    """The entries: one per generated file name (``<attrs generated methods lsprotocol.types.Position>``),
    each the hash of the source it was compiled from and its marshalled code. Keyed by name, the
    cache holds one entry per class however often a library changes, so it stays the size of
    what is imported. Classes of one name (a class made by a function, as jsonschema makes one
    ``Validator`` per draft) are told apart by their order in the process; a compile without a
    name, and a dataclass's text (``exec_for``), are keyed by their source."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.entries: dict[bytes, tuple[bytes, bytes]] = {}   # name key -> (source hash, code), as read
        self.mine: dict[bytes, tuple[bytes, bytes]] = {}      # what this process compiled
        self.hits = 0
        self.added = 0      # compiled under a name the cache did not have (a class not seen before)
        self.changed = 0    # compiled under a known name whose source differs (a new library version)
        self.per_process = 0  # compiled, never kept: a source that differs in every process
        self.seen: dict[bytes, int] = {}   # name -> how many times this process compiled under it
        #: text key -> its code, once used here (one text, many classes), until the next save (RSS)
        self.by_text: dict[bytes, Any] = {}
        self.unsaved = False
        #: the default folder's file of this environment: it records the environment, is touched
        #: when used, and its writes prune the folder (not a file OPERATE_SIDECAR_CODE_CACHE names)
        self.in_default_folder = False
        self.read_mtime: float | None = None  # the file's, when it was read

    def read(self, warn: bool = True) -> None:
        """The entries of the file; none when there is no file, or one that cannot be trusted or
        read (said on stderr unless ``warn`` is false: a re-read to merge has been said)."""
        say = log.warning if warn else log.debug

        try:
            fd, st = _open_trusted(self.path)
        except _Untrusted:
            say("code cache %s ignored: not a file owned by this user and writable by no one else", self.path)
            return  # (so every class is compiled as new: the file is replaced by one written here)
        except OSError:
            return  # none yet
        try:
            self.read_mtime = st.st_mtime
            data = _unmarshal(fd, st)
            if isinstance(data, dict) and all(
                    type(k) is bytes and type(v) is tuple and len(v) == 2 and type(v[0]) is bytes
                    and type(v[1]) is bytes for k, v in data.items()):
                self.entries = data
            else:
                say("code cache %s ignored: not a cache", self.path)
        except Exception as e:  # damaged: compile as usual, and write a good one back
            say("code cache %s ignored: %s", self.path, e)
        finally:
            os.close(fd)

    def compile_for(self, module_flags: int, by_text: bool = False) -> Callable[..., Any]:
        """``compile`` as called from a module with these future flags (what the builtin would
        inherit there). ``by_text``: entries are keyed by the source text, not by the name
        (dataclasses name every text ``<string>``); one text compiled once serves every class
        that has it."""
        import hashlib

        def cached_compile(source: Any, filename: Any, mode: str, flags: int = 0, dont_inherit: bool = False,
                           optimize: int = -1, **kw: Any) -> Any:
            flags |= 0 if dont_inherit else module_flags
            if not isinstance(source, str) or not isinstance(filename, str) or kw or optimize != -1:
                return _builtin_compile(source, filename, mode, flags, True, optimize, **kw)
            if _per_process(source, filename):
                self.per_process += 1
                return _builtin_compile(source, filename, mode, flags, True)
            src = hashlib.blake2b(source.encode("utf-8", "surrogatepass"), digest_size=20).digest()
            name = f"{mode}\0{flags}\0{filename}".encode("utf-8", "surrogatepass") + (b"" if filename else src)
            if by_text:
                return self._text_code(b"text\0" + name + src, src, source, filename, mode, flags)
            with _lock:  # the n-th class of one name in this process (jsonschema makes several `Validator`s)
                n = self.seen[name] = self.seen.get(name, -1) + 1
            if n:
                name += b"#%d" % n
            return self._found(name, src) or self._compiled(name, src, source, filename, mode, flags)

        return cached_compile

    def _text_code(self, key: bytes, src: bytes, source: str, filename: str, mode: str, flags: int) -> Any:
        """The code of a text keyed by itself. One text serves every class that has it, so its
        code is kept once used here, until the next save (RSS); used again after that, it is
        compiled, with nothing new to keep."""
        code = self.by_text.get(key)
        if code is None:
            code = self._found(key, src)
            if code is None:
                code = (_builtin_compile(source, filename, mode, flags, True) if self.entries.get(key) == (src, b"")
                        else self._compiled(key, src, source, filename, mode, flags))
            self.by_text[key] = code
        return code

    def exec_for(self, module_flags: int, module_globals: dict) -> Callable[..., Any]:
        """``exec`` as called from a module (its future flags, its globals when none are given):
        a source text is compiled through the cache (keyed by the text), then run."""
        compile_text = self.compile_for(module_flags, by_text=True)

        def cached_exec(source: Any, globals: Any = None, locals: Any = None, /, **kw: Any) -> Any:  # noqa: A002
            if isinstance(source, str):
                source = compile_text(source, "<string>", "exec")
            if globals is None:
                globals = module_globals  # noqa: A001 - what the builtin would take (the caller's module)
            return _builtin_exec(source, globals, locals, **kw)

        return cached_exec

    def _found(self, name: bytes, src: bytes) -> Any:
        """The code of entry ``name`` when it was compiled from the source hashed ``src``."""
        import marshal

        entry = self.entries.get(name)
        if entry is not None and entry[0] == src:
            try:
                code = marshal.loads(entry[1])
            except Exception:
                return None
            self.hits += 1
            self.entries[name] = (src, b"")   # a class is defined once: free its code (idle RSS)
            return code
        return None

    def _compiled(self, name: bytes, src: bytes, source: str, filename: str, mode: str, flags: int) -> Any:
        """``source`` compiled, and kept as entry ``name`` (to save)."""
        import marshal

        code = _builtin_compile(source, filename, mode, flags, True)
        try:
            blob = marshal.dumps(code)
        except ValueError:
            return code
        with _lock:
            self.mine[name] = (src, blob)
            if name not in self.entries:
                self.added += 1
            else:
                self.changed += 1
            self.unsaved = True
        return code

    def worth_saving(self) -> bool:
        """Whether to write: a class not seen before, or many changed (a library upgraded). A
        few changed are not worth a write of the whole file."""
        return self.unsaved and (self.added > 0 or self.changed > CHANGED_WORTH_SAVING)

    def save(self) -> None:
        import marshal
        import tempfile

        with _lock:
            worth = self.worth_saving()
            self.unsaved = False
            mine = dict(self.mine)
            self.by_text.clear()   # the classes are made (a text used again is compiled again, ~0.2 ms)
        log.info("code cache %s: %d found, %d compiled (%d not there, %d changed, %d never kept): %s", self.path,
                 self.hits, self.added + self.changed + self.per_process, self.added, self.changed, self.per_process,
                 "writing" if worth else "nothing to write")
        if not worth:
            self._touch()
            return
        directory = os.path.dirname(self.path) or "."
        try:
            if not _replaceable(self.path):
                log.info("code cache %s not written: it is not a regular file (it is left as it is)", self.path)
                return
            os.makedirs(directory, mode=0o700, exist_ok=True)
            other = _Cache(self.path)   # what another process wrote since this one read
            other.read(warn=False)
            merged = {**other.entries, **mine}
            if len(merged) > MAX_ENTRIES:
                merged = dict(mine)
            if self.in_default_folder:
                merged[PREFIX_KEY] = (os.fsencode(sys.prefix), b"")
            _remove_leftovers(directory)
            fd, tmp = tempfile.mkstemp(prefix=TMP_PREFIX, dir=directory)
            try:
                with os.fdopen(fd, "wb") as f:
                    marshal.dump(merged, f)
                os.replace(tmp, self.path)   # (mkstemp made it 0600)
            except BaseException:
                os.unlink(tmp)
                raise
            for name, (src, _) in mine.items():  # known now; their code is in use, not needed again
                self.entries[name] = (src, b"")
        except Exception as e:
            log.info("code cache %s not written: %s", self.path, e)
            return
        self.read_mtime = time.time()
        if self.in_default_folder:
            removed = prune(directory, self.path)
            if removed:
                log.info("code cache: removed %d old file(s) of %s: %s", len(removed), directory,
                         "; ".join(removed))

    def _touch(self) -> None:
        """Mark the default folder's file used (its mtime), at most once in TOUCH_AFTER_S: the
        least recently used files are the ones pruned."""
        if not self.in_default_folder or self.read_mtime is None or time.time() - self.read_mtime < TOUCH_AFTER_S:
            return
        try:
            os.utime(self.path, **({"follow_symlinks": False} if os.utime in os.supports_follow_symlinks else {}))
            self.read_mtime = time.time()
        except OSError:  # gone meanwhile (pruned by another process): written anew when worth it
            pass


_ATTRS_METHODS = "<attrs generated methods "


def _per_process(source: str, filename: str) -> bool:
    """Whether attrs wrote this source for this process only: the ``__hash__`` it generates for
    a frozen or hashable class holds ``hash("<attrs generated hash module.Class>")``, a string
    hash, which differs in every process (hash randomisation). Kept, it would be compiled again
    by the next process anyway, and with many such classes (jsonschema's ``referencing``) every
    process would write the cache."""
    if not filename.startswith(_ATTRS_METHODS) or "__hash__" not in source:
        return False
    return str(hash("<attrs generated hash " + filename[len(_ATTRS_METHODS):])) in source


class _Untrusted(Exception):
    """A cache file that is not a regular file of this user, or that someone else may write."""


def _open_trusted(path: str) -> tuple[int, os.stat_result]:
    """``path`` opened for reading, and what ``fstat`` says of it, when it may be unmarshalled:
    a regular file of this user that no one else may write (anyone who could write it could put
    code in it, or marshal data that crashes the interpreter). No link is followed, and a FIFO
    swapped in does not block the open (``O_NONBLOCK``): its ``fstat`` refuses it.
    :class:`OSError` when it cannot be opened (none there, a symlink), :class:`_Untrusted` when
    it is not such a file."""
    import stat

    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or (hasattr(os, "getuid") and st.st_uid != os.getuid()) \
                or st.st_mode & 0o022:
            raise _Untrusted(path)
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def _unmarshal(fd: int, st: os.stat_result) -> Any:
    """What the cache file opened as ``fd`` (:func:`_open_trusted`, which gave ``st``) holds:
    unmarshalled from a map of it, with no heap copy of the whole file (idle RSS). Raises what
    unmarshalling does (a damaged file), and ValueError for an empty one."""
    import marshal
    import mmap

    if st.st_size == 0:
        raise ValueError("empty file")
    with mmap.mmap(fd, 0, access=mmap.ACCESS_READ) as view:
        return marshal.loads(view)


def _replaceable(path: str) -> bool:
    """Whether the cache may be written over ``path``: it is missing or a regular file. Anything
    else (a device such as ``/dev/null`` named to turn the cache off, a FIFO, a socket, a folder, a
    symlink) is left as it is: renamed over, a device node would be gone for every program (as
    root, ``/dev/null`` would become a plain file)."""
    import stat

    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except FileNotFoundError:
        return True
    except OSError:
        return False


def _remove_leftovers(directory: str) -> None:
    """Temporary files of writers that died mid-write (a daemon thread stops with its process)."""
    now = time.time()
    try:
        with os.scandir(directory) as it:
            for e in it:
                if e.name.startswith(TMP_PREFIX) and now - e.stat(follow_symlinks=False).st_mtime > LEFTOVER_AGE_S:
                    os.unlink(e.path)
    except OSError:
        pass


def prune(directory: str, own: str) -> list[str]:
    """Remove the cache files of the default folder ``directory`` other than ``own`` that are no
    longer worth keeping: those of an environment that no longer exists, those not used for
    UNUSED_DAYS days, and the least recently used beyond KEEP_FILES (own included). Only regular
    files of this user named as cache files are considered (not another name, a symlink, a
    folder). Each is read only while fewer than KEEP_FILES are kept (to find its environment), so
    this is a scan of the folder and a few reads; and only as the cache itself is read
    (:func:`_open_trusted`), when it is still the file the scan saw: one that someone else may
    write, or that was swapped since (for a FIFO, say), is not read, and its environment is
    taken to exist. Returns what was removed and why."""
    import stat

    now = time.time()
    uid = os.getuid() if hasattr(os, "getuid") else None
    files = []
    try:
        with os.scandir(directory) as it:
            for e in it:
                if not (e.name.startswith(FILE_PREFIX) and e.name.endswith(FILE_SUFFIX)) or e.path == own:
                    continue
                try:
                    st = e.stat(follow_symlinks=False)
                except OSError:
                    continue
                if stat.S_ISREG(st.st_mode) and (uid is None or st.st_uid == uid):
                    files.append((st.st_mtime, e.name, st))
    except OSError:
        return []

    def environment(path: str, scanned: os.stat_result) -> str | None:
        """The environment a file records (None: unknown, an older file or one that cannot be
        read, or may not be: see :func:`_open_trusted`, or is no longer the file scanned)."""
        try:
            fd, st = _open_trusted(path)
        except (OSError, _Untrusted):
            return None
        try:
            if (st.st_dev, st.st_ino) != (scanned.st_dev, scanned.st_ino):
                return None
            data = _unmarshal(fd, st)
            entry = data.get(PREFIX_KEY) if type(data) is dict else None
            return os.fsdecode(entry[0]) if type(entry) is tuple and type(entry[0]) is bytes else None
        except Exception:
            return None
        finally:
            os.close(fd)

    removed = []
    kept = 1  # own
    for mtime, name, st in sorted(files, key=lambda f: f[0], reverse=True):  # most recently used first
        path = os.path.join(directory, name)
        if now - mtime > UNUSED_DAYS * 86400:
            why = f"not used for {UNUSED_DAYS} days"
        elif kept >= KEEP_FILES:
            why = f"more than {KEEP_FILES} files, the least recently used"
        else:
            env = environment(path, st)
            if env is None or os.path.isdir(env):
                kept += 1
                continue
            why = f"its environment {env} no longer exists"
        try:
            now_st = os.lstat(path)
            if (now_st.st_ino, now_st.st_mtime_ns) != (st.st_ino, st.st_mtime_ns):
                continue  # written or touched meanwhile: in use
            os.unlink(path)
        except OSError:
            continue
        removed.append(f"{name} ({why})")
    return removed


def default_path() -> str | None:
    """The cache file: ``$OPERATE_SIDECAR_CODE_CACHE`` (None when it turns the cache off), else
    one per interpreter bytecode version and environment (``sys.prefix``) under
    ``$XDG_CACHE_HOME/operate-sidecar``."""
    value = os.environ.get(ENV)
    if value is not None:
        return None if value.strip().lower() in OFF else value
    from importlib.util import MAGIC_NUMBER

    base = os.environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(base):   # unset, empty or relative: ignored, as the XDG spec says
        base = os.path.join(os.path.expanduser("~"), ".cache")
    import hashlib

    tag = sys.implementation.cache_tag or sys.implementation.name
    # one per environment too: two virtualenvs with other library versions would replace each
    # other's entries at every spawn
    env = hashlib.blake2b(os.fsencode(sys.prefix), digest_size=4).hexdigest()
    return os.path.join(base, "operate-sidecar", f"{FILE_PREFIX}{tag}-{MAGIC_NUMBER.hex()}-{env}{FILE_SUFFIX}")


def install() -> None:
    """Read the cache and make it the ``compile`` of :data:`MODULES` (imported here). Once per
    process; call it before the first class of lsprotocol or protocol/ is defined."""
    global _state
    if _state is not None:
        return
    path = default_path()
    if path is None:
        return
    try:
        import importlib

        cache = _Cache(path)
        cache.in_default_folder = os.environ.get(ENV) is None
        cache.read()
        for name in MODULES:
            mod = importlib.import_module(name)
            if mod.__dict__.get("compile", _builtin_compile) is not _builtin_compile:
                continue  # someone else's compile there: leave it
            mod.compile = cache.compile_for(_future_flags(mod))  # type: ignore[attr-defined]
        for name in EXEC_MODULES:
            mod = importlib.import_module(name)
            if mod.__dict__.get("exec", _builtin_exec) is not _builtin_exec:
                continue
            mod.exec = cache.exec_for(_future_flags(mod), mod.__dict__)  # type: ignore[attr-defined]
        _state = cache
    except Exception as e:  # a library laid out otherwise: no cache
        log.info("code cache not used: %s", e)


def _future_flags(mod: Any) -> int:
    """The compiler flags of the ``__future__`` features ``mod`` imports (what ``compile`` and
    ``exec`` called there inherit)."""
    import __future__

    flags = 0
    for feature in __future__.all_feature_names:
        if mod.__dict__.get(feature) is getattr(__future__, feature):
            flags |= getattr(__future__, feature).compiler_flag
    return flags


def save() -> None:
    """Write what this process compiled (nothing when it compiled nothing new)."""
    if _state is not None:
        _state.save()


def save_soon(later_s: float = 5.0) -> None:
    """Write what this process compiled now, on a daemon thread, and once more ``later_s``
    after (what its first requests compiled: cattrs's hooks for the types they used)."""
    if _state is None:
        return

    def run() -> None:
        save()
        time.sleep(later_s)
        save()

    threading.Thread(target=run, name="code-cache", daemon=True).start()


def stats() -> dict[str, int]:
    """What this process found in the cache and compiled (for tests and the log)."""
    if _state is None:
        return {"hits": 0, "added": 0, "changed": 0, "per_process": 0}
    return {"hits": _state.hits, "added": _state.added, "changed": _state.changed, "per_process": _state.per_process}
