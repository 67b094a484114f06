"""The cache of the code attrs, cattrs and dataclasses generate (server/codecache.py): what it gives is
byte for byte what ``compile`` gives, a changed source is compiled again, a damaged or
untrusted file is ignored, and both front ends fill it and use it on the next spawn without
writing it again when nothing is new."""

from __future__ import annotations

import json
import marshal
import os
import re
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from operate_sidecar.server import codecache

from .support import ROOT, TIMEOUT, scripted, server_env, wait_log

FOUND = "code cache "


def _run(code: str, cache: Path | str) -> dict:
    """``code`` in a fresh interpreter with the cache at ``cache``; its last stdout line, as JSON."""
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                         env=server_env({codecache.ENV: str(cache)}), cwd=str(ROOT), timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


IMPORT_LSP = """
    import json
    from operate_sidecar.server import codecache
    codecache.install()
    import lsprotocol.types as t
    r = t.Range(start=t.Position(line=1, character=2), end=t.Position(line=3, character=4))
    same = r == t.Range(start=t.Position(line=1, character=2), end=t.Position(line=3, character=4))
    print(json.dumps({**codecache.stats(), "repr": repr(r), "eq": same, "ne": r != t.Range(start=r.end, end=r.end)}))
    codecache.save()
"""


def test_a_second_process_finds_every_class_it_compiled_and_the_classes_work(tmp_path):
    cache = tmp_path / "c.marshal"
    first = _run(IMPORT_LSP, cache)
    assert first["hits"] == 0 and first["added"] > 500, first   # lsprotocol.types: ~550 classes
    assert cache.exists() and oct(cache.stat().st_mode & 0o777) == "0o600"
    second = _run(IMPORT_LSP, cache)
    assert second["hits"] >= first["added"] - 2 and second["added"] == 0, second
    assert second["changed"] <= codecache.CHANGED_WORTH_SAVING
    assert second["repr"] == first["repr"] == "1:2-3:4" and second["eq"] is second["ne"] is True


def test_the_cached_code_is_byte_for_byte_what_compile_gives(tmp_path):
    cache = tmp_path / "c.marshal"
    _run(IMPORT_LSP, cache)
    checked = _run("""
        from __future__ import annotations
        import builtins, json, marshal, sys
        from operate_sidecar.server import codecache
        codecache.install()
        same = []
        for name in codecache.MODULES:
            mod = sys.modules[name]
            cached = mod.compile
            def both(source, filename, mode, *a, _cached=cached, **kw):
                code = _cached(source, filename, mode, *a, **kw)
                fresh = codecache._builtin_compile(source, filename, mode, *a, **kw)  # inherits this file's flags
                same.append(marshal.dumps(code) == marshal.dumps(fresh))
                return code
            mod.compile = both
        import lsprotocol.types
        print(json.dumps({"same": sum(same), "differ": len(same) - sum(same), **codecache.stats()}))
    """, cache)
    # that code has `from __future__ import annotations` as attrs's and cattrs's modules do, so the
    # builtin there compiles with the flags their own compile would have
    assert checked["same"] > 500 and checked["differ"] == 0, checked


def test_a_changed_source_under_the_same_name_is_compiled_again_never_served_stale(tmp_path):
    path = str(tmp_path / "c.marshal")
    first = codecache._Cache(path)
    ns: dict = {}
    exec(first.compile_for(0)("x = 1", "<attrs generated methods m.C>", "exec"), ns)
    first.save()
    same = codecache._Cache(path)   # the next process, same library
    same.read()
    exec(same.compile_for(0)("x = 1", "<attrs generated methods m.C>", "exec"), ns)
    assert ns["x"] == 1 and (same.hits, same.added, same.changed) == (1, 0, 0)
    upgraded = codecache._Cache(path)   # a process after the library changed
    upgraded.read()
    exec(upgraded.compile_for(0)("x = 2", "<attrs generated methods m.C>", "exec"), ns)
    assert ns["x"] == 2 and (upgraded.hits, upgraded.changed) == (0, 1)
    # the mode and the compiler flags are part of what is looked up too
    assert eval(upgraded.compile_for(0)("x", "<attrs generated methods m.C>", "eval"), {"x": 3}) == 3


def test_it_takes_every_way_the_builtin_compile_is_called(tmp_path):
    import __future__
    import ast

    compile_ = codecache._Cache(str(tmp_path / "c.marshal")).compile_for(__future__.annotations.compiler_flag)
    # by keyword, as the builtin's parameters are named
    code = compile_(source="def f(x: undefined): return x", filename="<g f>", mode="exec", flags=0,
                    dont_inherit=False)
    ns: dict = {}
    exec(code, ns)
    assert ns["f"].__annotations__ == {"x": "undefined"}   # the module's future flag was inherited
    with_flags = compile_("def g(x: int): return x", "<g g>", "exec", dont_inherit=True)
    exec(with_flags, ns)
    assert ns["g"].__annotations__ == {"x": int}            # ... and not when told not to
    tree = ast.parse("h = 5")                               # not a str: compiled as the builtin does
    exec(compile_(tree, "<g h>", "exec"), ns)
    assert ns["h"] == 5
    exec(compile_("k = 6", "<g k>", "exec", 0, False, 2), ns)  # an optimize level: as the builtin does
    assert ns["k"] == 6


def test_one_class_that_changes_in_every_process_costs_no_write(tmp_path):
    path = str(tmp_path / "c.marshal")
    first = codecache._Cache(path)
    first.compile_for(0)("y = 1", "<attrs generated methods m.D>", "exec")
    first.save()
    mtime = os.stat(path).st_mtime_ns
    again = codecache._Cache(path)
    again.read()
    again.compile_for(0)("y = 2", "<attrs generated methods m.D>", "exec")   # a __hash__ with another seed
    assert not again.worth_saving()
    again.save()
    assert os.stat(path).st_mtime_ns == mtime
    for i in range(codecache.CHANGED_WORTH_SAVING + 1):   # a library upgraded: many changed
        again.compile_for(0)(f"z = {i}", f"<attrs generated methods m.E{i}>", "exec")
    assert again.worth_saving()


def test_classes_of_one_name_are_each_kept_in_their_order(tmp_path):
    """jsonschema's ``create`` makes one ``Validator`` class per draft, all of one name: each is
    found again by the next process (they used to replace one another, never found)."""
    path = str(tmp_path / "c.marshal")
    name = "<attrs generated methods jsonschema.validators.create.<locals>.Validator>"
    first = codecache._Cache(path)
    for draft in range(4):
        first.compile_for(0)(f"draft = {draft}", name, "exec")
    first.save()
    again = codecache._Cache(path)
    again.read()
    ns: dict = {}
    for draft in range(4):
        exec(again.compile_for(0)(f"draft = {draft}", name, "exec"), ns)
        assert ns["draft"] == draft
    assert (again.hits, again.added, again.changed) == (4, 0, 0)


FROZEN = """
    import json, attrs
    from operate_sidecar.server import codecache
    codecache.install()

    @attrs.frozen
    class Point:
        x: int

    p = Point(1)
    print(json.dumps({**codecache.stats(), "hashes": hash(p) == hash(Point(1)) and p == Point(1)}))
    codecache.save()
"""


def test_a_frozen_class_whose_hash_differs_per_process_is_never_kept(tmp_path):
    """attrs's ``__hash__`` of a frozen class holds a string hash, randomised per process: the
    source differs in every process, so it is compiled each time and never written (with many
    such classes, every process would otherwise write the cache)."""
    cache = tmp_path / "c.marshal"
    first = _run(FROZEN, cache)
    second = _run(FROZEN, cache)
    for r in (first, second):
        assert r["per_process"] >= 1 and r["hashes"] is True, r
    assert second["changed"] == 0 and second["added"] == 0, second


def test_two_processes_merge_what_each_compiled(tmp_path):
    path = str(tmp_path / "c.marshal")
    one, two = codecache._Cache(path), codecache._Cache(path)
    one.read()
    two.read()
    one.compile_for(0)("a = 1", "<g a>", "exec")
    two.compile_for(0)("b = 1", "<g b>", "exec")
    one.save()
    two.save()   # read before one wrote: merges one's entry instead of dropping it
    three = codecache._Cache(path)
    three.read()
    assert len(three.entries) == 2


def test_a_damaged_or_untrusted_cache_is_ignored_and_replaced(tmp_path):
    cache = tmp_path / "c.marshal"
    cache.write_bytes(b"\x00 not marshal at all")
    cache.chmod(0o600)
    r = _run(IMPORT_LSP, cache)
    assert r["hits"] == 0 and r["added"] > 500 and r["repr"] == "1:2-3:4"
    assert isinstance(marshal.loads(cache.read_bytes()), dict)       # written back whole
    cache.chmod(0o666)                                                # anyone could have put code in it
    r = _run(IMPORT_LSP, cache)
    assert r["hits"] == 0 and r["added"] > 500
    assert oct(cache.stat().st_mode & 0o777) == "0o600"


def test_a_fifo_in_place_of_the_cache_neither_blocks_the_start_nor_is_written_over(tmp_path):
    """Nor is anything that is not a regular file: renamed over, a device named to turn the cache
    off (``/dev/null``) would be gone for every program (as root, a plain file in its place)."""
    cache = tmp_path / "c.marshal"
    os.mkfifo(cache, 0o600)                 # an open of it for reading would wait for a writer for ever
    r = _run(IMPORT_LSP, cache)
    assert r["hits"] == 0 and r["added"] > 500 and r["repr"] == "1:2-3:4"
    assert stat.S_ISFIFO(os.lstat(cache).st_mode)   # left as it is
    target = tmp_path / "elsewhere"
    target.write_bytes(b"a file the link points at")
    link = tmp_path / "link.marshal"
    link.symlink_to(target)
    r = _run(IMPORT_LSP, link)
    assert r["added"] > 500 and link.is_symlink() and target.read_bytes() == b"a file the link points at"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(codecache.TMP_PREFIX)] == []


def test_off_writes_nothing(tmp_path):
    r = _run(IMPORT_LSP, "off")
    assert r["hits"] == r["added"] == 0
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(IMPORT_LSP)], capture_output=True, text=True,
                         env=server_env({codecache.ENV: "", "XDG_CACHE_HOME": str(tmp_path)}), cwd=str(ROOT),
                         timeout=120)
    assert out.returncode == 0 and not any(tmp_path.iterdir())


def _found(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if FOUND in line and " found, " in line]


def test_the_native_server_fills_the_cache_then_uses_it_without_writing_again(spawn, tmp_path):
    env = {"XDG_CACHE_HOME": str(tmp_path)}
    first = spawn("--log-level", "info", env=env)
    first.init(models={"s": scripted("x")})
    assert first.request("createBranch", {}, timeout=TIMEOUT)["branchId"]
    assert wait_log(first, ": writing")
    deadline, files = time.monotonic() + TIMEOUT, []
    while time.monotonic() < deadline and not (files and len(marshal.loads(files[0].read_bytes())) > 500):
        time.sleep(0.05)   # (each write is atomic; wait for the one after pygls and the core)
        files = list((tmp_path / "operate-sidecar").glob("generated-code-*.marshal"))
    assert len(files) == 1 and len(marshal.loads(files[0].read_bytes())) > 500
    first.close()
    mtime = files[0].stat().st_mtime_ns
    second = spawn("--log-level", "info", env=env)
    second.init(models={"s": scripted("x")})
    assert second.request("createBranch", {}, timeout=TIMEOUT)["branchId"]
    assert wait_log(second, ": nothing to write")
    line = _found(second.stderr_text())[0]
    found = int(re.search(r"(\d+) found", line).group(1))  # type: ignore[union-attr]
    assert found > 500, line
    assert files[0].stat().st_mtime_ns == mtime


def _answer(p: subprocess.Popen, msg_id: int) -> dict:
    """The answer to ``msg_id`` on the ACP server's stdout (notifications skipped), within TIMEOUT."""
    import select

    assert p.stdout is not None
    deadline, buf = time.monotonic() + TIMEOUT, b""
    while time.monotonic() < deadline:
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            msg = json.loads(line)
            if msg.get("id") == msg_id and "method" not in msg:
                return msg
        if select.select([p.stdout], [], [], 0.2)[0]:
            chunk = os.read(p.stdout.fileno(), 65536)
            assert chunk, "the server closed its output"
            buf += chunk
    raise AssertionError(f"no answer to {msg_id} within {TIMEOUT} s")


def test_the_acp_front_end_fills_the_cache(tmp_path):
    env = server_env({"XDG_CACHE_HOME": str(tmp_path)})
    env.pop(codecache.ENV, None)
    p = subprocess.Popen([sys.executable, "-m", "operate_sidecar.server", "--acp", "--log-level", "info"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env,
                         cwd=str(tmp_path))
    try:
        assert p.stdin is not None
        for i, (method, params) in enumerate([("initialize", {"protocolVersion": 1, "clientCapabilities": {}}),
                                              ("session/new", {"cwd": str(tmp_path), "mcpServers": []})]):
            p.stdin.write((json.dumps({"jsonrpc": "2.0", "id": i, "method": method, "params": params}) + "\n").encode())
            p.stdin.flush()
            assert "result" in _answer(p, i)
        deadline = time.monotonic() + TIMEOUT
        files: list[Path] = []
        while time.monotonic() < deadline and not files:
            files = list((tmp_path / "operate-sidecar").glob("generated-code-*.marshal"))
            time.sleep(0.05)
        assert files and len(marshal.loads(files[0].read_bytes())) > 20   # protocol/'s classes
    finally:
        p.stdin.close()   # type: ignore[union-attr]
        try:
            p.wait(timeout=TIMEOUT)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=TIMEOUT)


def test_each_environment_has_a_cache_of_its_own(monkeypatch, tmp_path):
    """Two virtualenvs with other library versions would replace each other's entries at every
    spawn: the file name holds the interpreter's bytecode version and the environment."""
    monkeypatch.delenv(codecache.ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    here = codecache.default_path()
    monkeypatch.setattr(sys, "prefix", "/elsewhere/venv")
    there = codecache.default_path()
    assert here != there and Path(here).parent == Path(there).parent == tmp_path / "operate-sidecar"
    assert Path(here).name.startswith(f"generated-code-{sys.implementation.cache_tag}-")
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/dir")   # not absolute: ignored, as the XDG spec says
    assert codecache.default_path().startswith(os.path.expanduser("~"))
    monkeypatch.setenv(codecache.ENV, "off")
    assert codecache.default_path() is None


DATACLASSES = """
    import dataclasses, json
    from operate_sidecar.server import codecache
    codecache.install()
    cached_exec = dataclasses.exec
    calls, same, through = [], [], []

    def checking(src, globals=None, locals=None):
        kept = len(codecache._state.by_text)
        out = cached_exec(src, globals, locals)
        through.append(src in calls or len(codecache._state.by_text) == kept + 1)   # through the cache
        # the function the text made, against the one the builtin compiles from the text
        # (dataclasses' module has no __future__ flags; exec names a text "<string>"). Compared as
        # code objects (bytecode, constants, names, line table...) and file names, not marshalled:
        # a code object once marshalled or run marshals its bytecode with a reference flag
        ran = locals["__create_fn__"].__code__
        fresh = next(c for c in compile(src, "<string>", "exec", dont_inherit=True).co_consts if hasattr(c, "co_code"))
        same.append(ran == fresh and ran.co_filename == fresh.co_filename == "<string>"
                    and [c.co_qualname for c in ran.co_consts if hasattr(c, "co_qualname")]
                    == [c.co_qualname for c in fresh.co_consts if hasattr(c, "co_qualname")])
        calls.append(src)
        return out

    dataclasses.exec = checking

    @dataclasses.dataclass(frozen=True, order=True)
    class P:
        x: int
        y: list = dataclasses.field(default_factory=list, compare=False, hash=False)

    @dataclasses.dataclass
    class Q:
        x: int

    @dataclasses.dataclass
    class R:   # the very texts of Q: compiled (or found) once
        x: int

    import operate_sidecar.server.core.params   # the core's dataclasses
    try:
        P(1).x = 2
        frozen = False
    except dataclasses.FrozenInstanceError:
        frozen = True
    works = (P(1) < P(2) and P(1, [1]) == P(1) and hash(P(1)) == hash(P(1)) and P(3).y == [] and frozen
             and repr(Q(1)) == "Q(x=1)" and R(2) == R(2) and R(2) != R(3))
    print(json.dumps({**codecache.stats(), "calls": len(calls), "texts": len(set(calls)), "through": all(through),
                      "same": sum(same), "differ": len(same) - sum(same), "works": works}))
    codecache.save()
"""


def test_dataclasses_are_found_by_their_text_as_compile_gives_them_and_work(tmp_path):
    """The standard library's dataclasses ``exec`` a text per class; the cache keys that text
    (all are named ``<string>``), gives what the builtin compiles from it, and compiles or
    finds a text used by several classes once per process."""
    cache = tmp_path / "c.marshal"
    first = _run(DATACLASSES, cache)
    assert first["works"] is first["through"] is True and first["differ"] == 0 and first["texts"] > 50, first
    assert first["hits"] == 0 and first["added"] >= first["texts"], first
    second = _run(DATACLASSES, cache)
    assert second["works"] is second["through"] is True, second
    assert second["differ"] == 0 and second["same"] == second["calls"], second
    assert second["added"] == second["changed"] == 0, second
    assert second["calls"] > second["texts"]                    # Q's and R's texts, among others
    assert second["hits"] == first["added"], second   # each text found once (and the attrs classes imported)


def test_a_text_is_found_or_compiled_once_and_used_again_without_a_write(tmp_path):
    """One text, many classes: found (or compiled) once, then served again; after a save the
    process keeps no copy of it (RSS), and a later use compiles it quietly: nothing to write."""
    path = str(tmp_path / "c.marshal")
    first = codecache._Cache(path)
    run = first.exec_for(0, {})
    for _ in range(2):
        g: dict = {}
        run("a = 1", g)
        assert g["a"] == 1
    assert (first.hits, first.added, first.changed) == (0, 1, 0)
    first.save()
    assert first.by_text == {}
    g = {}
    run("a = 1", g)
    assert g["a"] == 1 and (first.added, first.changed) == (1, 0) and not first.worth_saving()
    again = codecache._Cache(path)   # the next process
    again.read()
    module: dict = {"b": 2}
    run = again.exec_for(0, module)
    for _ in range(3):
        g = {}
        run("a = 1", g)
        assert g["a"] == 1
    assert (again.hits, again.added, again.changed) == (1, 0, 0)
    g = {"b": 3}
    run("c = b", g)          # globals given: used, as the builtin does
    assert g["c"] == 3
    run("d = b")             # none given: the module's, as the builtin takes the caller's
    assert module["d"] == 2
