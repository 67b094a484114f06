#!/usr/bin/env node
// Extension-host integration test: code-server (VS Code 1.99.3 web workbench + node extension host,
// from itest-host/) + headless Debian chromium load the extension in development mode and run
// out/itest/index.js inside the extension host. Prints one JSON summary on stdout.
// Exit: 0 report ok, 1 report not ok, 2 no report (timeout / crash), 3 harness error.
// Usage: node scripts/run-itest.mjs [--ext DIR] [--timeout SECONDS] [--suite main|multi-root|no-folder|chats] [--keep]
//   --suite multi-root: a multi-root workspace (ws + second, a .code-workspace file) running
//   out/itest/multiRoot.js instead of out/itest/index.js.
//   --suite no-folder: a window with no folder open (the settings are user settings) running
//   out/itest/noFolder.js.
//   --suite chats: the main suite's workspace running out/itest/chats.js (chats switched, deleted or
//   changed under a turn).
import { spawn } from 'node:child_process';
import * as fs from 'node:fs';
import * as http from 'node:http';
import * as net from 'node:net';
import * as os from 'node:os';
import * as path from 'node:path';
import { fileURLToPath } from 'node:url';

const HERE = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '..');   // clients/vscode
const REPO = path.resolve(HERE, '..', '..');
const argv = process.argv.slice(2);
const opt = (name, dflt) => { const i = argv.indexOf(name); return i >= 0 ? argv[i + 1] : dflt; };
const EXT = path.resolve(opt('--ext', HERE));
const SUITE = opt('--suite', 'main');
if (!['main', 'multi-root', 'no-folder', 'chats'].includes(SUITE)) { console.error(`unknown --suite ${SUITE}`); process.exit(3); }
const MULTI = SUITE === 'multi-root';
const NO_FOLDER = SUITE === 'no-folder';
const TESTS = path.join(HERE, 'out', 'itest', MULTI ? 'multiRoot.js' : NO_FOLDER ? 'noFolder.js' : SUITE === 'chats' ? 'chats.js' : 'index.js');
const TIMEOUT_S = Number(opt('--timeout', '240'));
const KEEP = argv.includes('--keep');
const CODE_SERVER = path.join(HERE, 'itest-host', 'node_modules', '.bin', 'code-server');
const CHROMIUM = process.env.CHROMIUM ?? 'chromium';

const t0 = Date.now();
const timings = {};
const children = [];
const W = fs.mkdtempSync(path.join(os.tmpdir(), 'operate-sidecar-itest-'));
const REPORT = path.join(W, 'report.json');

function serverCommand() {
  const py = path.join(REPO, '.venv', 'bin', 'python');
  return [fs.existsSync(py) ? py : 'python3', '-m', 'operate_sidecar.server'];
}
const scripted = (...responses) => ({ provider: 'scripted', responses });
/** A model that streams its replies in pieces with a pause between them (test-fixtures/drip_model.py). */
const drip = (state, replies, pieces, pauseMs) => ({ provider: 'cli', profile: 'llm',
  command: [serverCommand()[0], path.join(HERE, 'test-fixtures', 'drip_model.py'), state, JSON.stringify(replies), String(pieces), String(pauseMs), '{prompt}'] });
/** The long reply of the drip model: 300 pieces of 5 characters, 5 ms apart. */
const DRIP_TEXT = Array.from({ length: 300 }, (_, i) => `w${String(i).padStart(3, '0')}`).join(' ') + ' end.';
const CALL_SHOUT = { json: { action_requests: [{ function: 'shout', arguments: { text: 'hey' } }] } };

function freePort() {
  return new Promise((resolve, reject) => {
    const s = net.createServer();
    s.once('error', reject);
    s.listen(0, '127.0.0.1', () => { const { port } = s.address(); s.close(() => resolve(port)); });
  });
}
function start(name, cmd, args, env) {
  const log = fs.openSync(path.join(W, `${name}.log`), 'a');
  const child = spawn(cmd, args, { detached: true, stdio: ['ignore', log, log], env });
  child.once('error', (e) => fs.appendFileSync(path.join(W, `${name}.log`), `spawn error: ${e.message}\n`));
  children.push(child);
  return child;
}
function killAll() {
  for (const c of children) { try { process.kill(-c.pid, 'SIGTERM'); } catch { /* gone */ } }
  const deadline = Date.now() + 5000;
  for (const c of children) {
    while (c.exitCode === null && c.signalCode === null && Date.now() < deadline) {
      try { process.kill(-c.pid, 0); } catch { break; }
      Atomics.wait(new Int32Array(new SharedArrayBuffer(4)), 0, 0, 50);
    }
    try { process.kill(-c.pid, 'SIGKILL'); } catch { /* gone */ }
  }
}
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
function healthy(port) {
  return new Promise((resolve) => {
    const req = http.get({ host: '127.0.0.1', port, path: '/healthz', timeout: 2000 }, (res) => { res.resume(); resolve(res.statusCode === 200); });
    req.on('error', () => resolve(false));
    req.on('timeout', () => { req.destroy(); resolve(false); });
  });
}
function tail(file, n = 3000) {
  try { const s = fs.readFileSync(path.join(W, file), 'utf8'); return s.slice(-n); } catch { return ''; }
}

async function main() {
  for (const [what, p] of [['code-server (run scripts/setup.sh)', CODE_SERVER], ['compiled itest (tsc -p .)', TESTS],
    ['extension package.json', path.join(EXT, 'package.json')]]) {
    if (!fs.existsSync(p)) throw new Error(`missing ${what}: ${p}`);
  }
  const deadline = t0 + TIMEOUT_S * 1000;
  const ws = path.join(W, 'ws');
  fs.mkdirSync(path.join(ws, '.vscode'), { recursive: true });
  fs.writeFileSync(path.join(ws, 'notes.txt'), 'alpha\nbeta\n');
  const editNotes = (answer, oldText, newText) => ({ json: { answer, action_requests: [{ function: 'edit_file', arguments: { path: 'notes.txt', edits: [{ oldText, newText }] } }] } });
  const readNotes = (answer) => ({ json: { answer, action_requests: [{ function: 'read_file', arguments: { path: 'notes.txt' } }] } });
  const settings = {
    'operateSidecar.command': serverCommand(),
    'operateSidecar.env': { PYTHONPATH: [path.join(HERE, 'test-fixtures'), REPO].join(path.delimiter) },
    'operateSidecar.settings': {
      models: {
        stream: scripted({ text: 'hello from the scripted model, streamed in pieces', chunks: 6 }),
        tooly: scripted(CALL_SHOUT, CALL_SHOUT),
        slow: scripted({ text: 'too late', delayMs: 120000 }),
        chat: scripted({ text: 'Hello from the **chat**, streamed.', chunks: 5 },
          editNotes('Editing the notes.', 'beta', 'BETA'), editNotes('Editing them again.', 'alpha', 'ALPHA')),
        chat2: scripted(editNotes('Title case.', 'BETA', 'Beta'), editNotes('Without asking.', 'Beta', 'Beta!')),
        // two rounds per turn (read_file is read-only: allowed without asking), for two turns
        rounds: scripted(readNotes('Reading the notes.'), { text: 'Read them.' }, readNotes('Reading again.'), { text: 'Read them again.' }),
        twice: scripted('Noted.', 'Noted again.'),
        // a model stuck on a call that fails the same way each round (the chat's repeat stop ends the turn after 3)
        stuck: scripted(...[1, 2, 3, 4].map(() => ({ json: { answer: 'Looking.', action_requests: [{ function: 'read_file', arguments: { path: 'nope.txt' } }] } })),
          'never reached'),
        twice2: scripted('Noted.', 'Noted again.'),
        // one reply, two edits of one file, the second editing the first's text (reviewed one after the other)
        twoEdits: scripted({ json: { answer: 'Two edits.', action_requests: [
          { function: 'edit_file', arguments: { path: 'notes.txt', edits: [{ oldText: 'gamma', newText: 'GAMMA' }] } },
          { function: 'edit_file', arguments: { path: 'notes.txt', edits: [{ oldText: 'GAMMA', newText: 'GAMMA!' }] } }] } },
        { json: { answer: 'Two more.', action_requests: [
          { function: 'edit_file', arguments: { path: 'notes.txt', edits: [{ oldText: 'delta', newText: 'DELTA' }] } },
          { function: 'edit_file', arguments: { path: 'notes.txt', edits: [{ oldText: 'DELTA', newText: 'DELTA!' }] } }] } }),
        // a tool call that runs for a while (its card shows its arguments while it runs)
        // a call that needs the user's decision (shout is "ask"), with no diff: the card alone asks
        asker: scripted({ json: { answer: 'Shouting.', action_requests: [{ function: 'shout', arguments: { text: 'wait' } }] } }),
        napper: scripted({ json: { answer: 'Resting.', action_requests: [{ function: 'nap', arguments: { note: 'a short rest', seconds: 2 } }] } }),
        drip: drip(path.join(W, 'drip-state'), [DRIP_TEXT], 300, 5),
        // multi-root: an edit of the second folder's file, named the way the server takes it
        editSecond: scripted({ json: { answer: 'Upper-casing.', action_requests: [{ function: 'edit_file',
          arguments: { path: 'second/src/app.py', edits: [{ oldText: 'two', newText: 'TWO' }] } }] } }),
      },
      defaultModel: 'stream',
      toolModules: ['no_such_module_xyz', 'vscode_fixture_tools'],   // the broken one -> window/logMessage
      toolPolicy: { shout: 'ask' },
    },
    'operateSidecar.maxRounds': 1,
    'workbench.startupEditor': 'none',
    'security.workspace.trust.enabled': false,
    'files.autoSave': 'off',
  };
  fs.writeFileSync(path.join(ws, '.vscode', 'settings.json'), JSON.stringify(settings, null, 2));
  // multi-root: the same file name in both folders, and a workspace file listing ws first
  let open = `folder=${encodeURIComponent(ws)}`;
  let target = ws;
  if (MULTI) {
    for (const [dir, text] of [[ws, 'one\n'], [path.join(W, 'second'), 'two\n']]) {
      fs.mkdirSync(path.join(dir, 'src'), { recursive: true });
      fs.writeFileSync(path.join(dir, 'src', 'app.py'), text);
    }
    target = path.join(W, 'multi.code-workspace');
    fs.writeFileSync(target, JSON.stringify({ folders: [{ path: ws }, { path: path.join(W, 'second') }], settings }, null, 2));
    open = `workspace=${encodeURIComponent(target)}`;
  }
  if (NO_FOLDER) {   // an empty window: the settings are the user's (no broken tool module: the suite counts warnings)
    settings['operateSidecar.settings'].toolModules = ['vscode_fixture_tools'];
    fs.mkdirSync(path.join(W, 'data', 'User'), { recursive: true });
    fs.writeFileSync(path.join(W, 'data', 'User', 'settings.json'), JSON.stringify(settings, null, 2));
    open = 'ew=true';
  }

  const port = await freePort();
  const env = { ...process.env, OPERATE_SIDECAR_ITEST_REPORT: REPORT, XDG_CONFIG_HOME: path.join(W, 'xdg-config'),
    XDG_DATA_HOME: path.join(W, 'xdg-data'), XDG_CACHE_HOME: path.join(W, 'xdg-cache') };
  delete env.VSCODE_IPC_HOOK_CLI;
  start('code-server', CODE_SERVER, ['--auth', 'none', '--bind-addr', `127.0.0.1:${port}`, '--disable-telemetry',
    '--disable-update-check', '--disable-workspace-trust', '--extensions-dir', path.join(W, 'exts'),
    '--user-data-dir', path.join(W, 'data'), ...(NO_FOLDER ? [] : [target])], env);
  while (!(await healthy(port))) {
    if (Date.now() > deadline) throw new Error(`code-server not healthy before the deadline\n${tail('code-server.log')}`);
    if (children[0].exitCode !== null) throw new Error(`code-server exited ${children[0].exitCode}\n${tail('code-server.log')}`);
    await sleep(250);
  }
  timings.codeServerReadyMs = Date.now() - t0;

  const remote = (p) => `vscode-remote://127.0.0.1:${port}${p}`;
  const payload = encodeURIComponent(JSON.stringify([['extensionDevelopmentPath', remote(EXT)], ['extensionTestsPath', remote(TESTS)]]));
  // --enable-logging=stderr: the pages' console messages (the workbench's, the webviews') go to chromium.log,
  // whose tail a failed run's summary carries (a webview that never loaded says why there)
  start('chromium', CHROMIUM, ['--headless=new', '--no-sandbox', '--disable-gpu', '--disable-dev-shm-usage', '--no-first-run', '--enable-logging=stderr',
    `--user-data-dir=${path.join(W, 'chrome')}`, `http://127.0.0.1:${port}/?${open}&payload=${payload}`], env);

  while (!fs.existsSync(REPORT)) {
    if (Date.now() > deadline) {
      return { code: 2, summary: { ok: false, error: `no report within ${TIMEOUT_S}s`, codeServerLog: tail('code-server.log'), chromiumLog: tail('chromium.log') } };
    }
    if (children[1].exitCode !== null) {
      return { code: 2, summary: { ok: false, error: `chromium exited ${children[1].exitCode}`, chromiumLog: tail('chromium.log') } };
    }
    await sleep(250);
  }
  timings.reportMs = Date.now() - t0;
  const report = JSON.parse(fs.readFileSync(REPORT, 'utf8'));
  return { code: report.ok ? 0 : 1, summary: { ok: report.ok, report, codeServerLog: report.ok ? undefined : tail('code-server.log'),
    chromiumLog: report.ok ? undefined : tail('chromium.log', 4000) } };
}

let result;
try {
  result = await main();
} catch (e) {
  result = { code: 3, summary: { ok: false, error: String(e?.stack ?? e) } };
}
killAll();
timings.totalMs = Date.now() - t0;
if (!KEEP) fs.rmSync(W, { recursive: true, force: true });
// exit once the summary is written: process.exit() right after a large write to a pipe would cut it short
process.stdout.write(JSON.stringify({ ...result.summary, extension: EXT, timings, workDir: KEEP ? W : undefined }, null, 2) + '\n',
  () => process.exit(result.code));
