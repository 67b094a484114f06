#!/usr/bin/env node
// Through-the-browser test of the chat view and the diff review: code-server (VS Code 1.99.3) with
// the extension, headless Chromium driven over the DevTools protocol with real mouse clicks and key
// presses, the real Python server with a scripted model. It types prompts, watches the prose
// stream, accepts one diff (card button) and rejects another (diff editor title button), rejects
// and accepts two more with the extension's keybindings pressed in either side of the diff editor,
// checks the editor buffer (dirty, undo, save) and the files on disk, switches chats through the
// picker, picks a model, opens the chat with its shortcut and stops a running turn (Stop, Escape);
// Stop and Cancel show in the command palette only while a turn runs; long lines wrap, Hebrew is right to left;
// a redraw while a turn streams keeps the focus and a selection in earlier turns; the input's label and the live region;
// Retry (and Edit) on a stopped turn, Retry on a failed one, the input's history (Up / Down), Ctrl+Enter / Ctrl+Backspace on a request without a
// diff, the stopped turns kept through a window reload (and the turn it ended marked as interrupted), and Retry on a turn stopped after its first round (its #file not sent twice).
// Screenshots go to --out.
// Prints one JSON summary on stdout. Exit: 0 all checks passed, 1 a check failed, 3 harness error.
// Usage: node scripts/run-ui-test.mjs [--ext DIR] [--out DIR] [--timeout SECONDS] [--keep]
import { spawn } from 'node:child_process';
import * as fs from 'node:fs';
import * as http from 'node:http';
import * as net from 'node:net';
import * as os from 'node:os';
import * as path from 'node:path';
import { fileURLToPath } from 'node:url';
import { connect, getJSON, sleep, waitFor } from './cdp.mjs';

const HERE = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '..');   // clients/vscode
const REPO = path.resolve(HERE, '..', '..');
const argv = process.argv.slice(2);
const opt = (n, d) => { const i = argv.indexOf(n); return i >= 0 ? argv[i + 1] : d; };
const EXT = path.resolve(opt('--ext', HERE));
const OUT = path.resolve(opt('--out', path.join(HERE, '.test-results')));
const TIMEOUT_S = Number(opt('--timeout', '240'));
const KEEP = argv.includes('--keep');
const CODE_SERVER = path.join(HERE, 'itest-host', 'node_modules', '.bin', 'code-server');
const CHROMIUM = process.env.CHROMIUM ?? 'chromium';
const EXT_ID = 'operate-sidecar.operate-sidecar-vscode';
const STEP = 30_000;

const t0 = Date.now();
const timings = {}; const mark = (k) => (timings[k] = Date.now() - t0);
const checks = [];
const children = [];
const W = fs.mkdtempSync(path.join(os.tmpdir(), 'operate-sidecar-ui-'));
fs.mkdirSync(OUT, { recursive: true });

const APP_OLD = "def greet(name):\n    return 'hello ' + name\n";
const APP_NEW = "def greet(name):\n    return 'HELLO ' + name.upper() + '!'\n";
const UTIL_OLD = 'def add(a, b):\n    return a + b\n';
const scripted = (...responses) => ({ provider: 'scripted', responses });
/** The thoughts of the first reply (shown open while they stream, then folded as "Thought"). */
const THOUGHT = 'The user wants the plan for app.py: read it first, then make greet shout.';
/** How long the repair reply of the `mender` model waits: the running turn's status is read meanwhile. */
const REPAIR_DELAY_MS = 2000;
const FORMAT_TURN = 'Answer in the format';
const edit = (answer, p, oldText, newText) => ({ json: { answer, action_requests: [{ function: 'edit_file', arguments: { path: p, edits: [{ oldText, newText }] } }] } });
/** A model that streams its replies in pieces with a pause between them, as a real one does (test-fixtures/drip_model.py). */
const drip = (state, replies, pieces, pauseMs) => ({ provider: 'cli', profile: 'llm',
  command: [serverCommand()[0], path.join(HERE, 'test-fixtures', 'drip_model.py'), state, JSON.stringify(replies), String(pieces), String(pauseMs), '{prompt}'] });

function serverCommand() {
  const py = path.join(REPO, '.venv', 'bin', 'python');
  return [fs.existsSync(py) ? py : 'python3', '-m', 'operate_sidecar.server'];
}
const freePort = () => new Promise((res, rej) => { const s = net.createServer(); s.once('error', rej); s.listen(0, '127.0.0.1', () => { const p = s.address().port; s.close(() => res(p)); }); });
const healthy = (port) => new Promise((r) => { const q = http.get({ host: '127.0.0.1', port, path: '/healthz', timeout: 2000 }, (s) => { s.resume(); r(s.statusCode === 200); }); q.on('error', () => r(false)); q.on('timeout', () => { q.destroy(); r(false); }); });
function start(name, cmd, args, env) {
  const log = fs.openSync(path.join(W, `${name}.log`), 'a');
  const c = spawn(cmd, args, { detached: true, stdio: ['ignore', log, log], env });
  c.once('error', (e) => fs.appendFileSync(path.join(W, `${name}.log`), `spawn error: ${e.message}\n`));
  children.push(c); return c;
}
async function killAll() {   // async: a busy-wait would keep node from reaping the exited leaders
  for (const c of children) { try { process.kill(-c.pid, 'SIGTERM'); } catch { /* gone */ } }
  const t = Date.now();
  await Promise.all(children.map(async (c) => {
    while (Date.now() - t < 5000) { try { process.kill(-c.pid, 0); } catch { return; } await sleep(50); }
    try { process.kill(-c.pid, 'SIGKILL'); } catch { /* gone */ }
  }));
}
const tail = (f, n = 2500) => { try { return fs.readFileSync(path.join(W, f), 'utf8').slice(-n); } catch { return ''; } };

async function check(name, fn) {
  const t = Date.now();
  try { const detail = await fn(); checks.push({ name, ok: true, ms: Date.now() - t, ...(detail !== undefined && { detail }) }); }
  catch (e) { checks.push({ name, ok: false, ms: Date.now() - t, error: String(e?.stack ?? e).slice(0, 1500) }); throw e; }
}
function expect(cond, msg) { if (!cond) throw new Error(msg); }

async function main() {
  const ws = path.join(W, 'ws');
  fs.mkdirSync(path.join(ws, '.vscode'), { recursive: true });
  fs.mkdirSync(path.join(ws, 'src'));
  fs.writeFileSync(path.join(ws, 'src', 'app.py'), APP_OLD);
  fs.writeFileSync(path.join(ws, 'src', 'util.py'), UTIL_OLD);
  fs.writeFileSync(path.join(ws, '.vscode', 'settings.json'), JSON.stringify({
    'operateSidecar.command': serverCommand(),
    'search.exclude': { '**/generated': true },   // (Attach File offers no file a search leaves out)
    'operateSidecar.env': { PYTHONPATH: [path.join(HERE, 'test-fixtures'), REPO].join(path.delimiter) },
    'operateSidecar.settings': {
      models: {
        chatty: drip(path.join(W, 'drip-state'), [
          // a reasoning model that writes its thoughts into its text (the server takes them apart: inlineThinking)
          '<think>' + THOUGHT + '</think>\n\nHere is the **plan**:\n\n1. read `src/app.py`\n2. make `greet` shout\n\n```python\nprint(greet("you"))\n```\n\nThat is all it takes.',
          edit('I will make `greet` shout.', 'src/app.py', "return 'hello ' + name", "return 'HELLO ' + name.upper() + '!'"),
          { json: { answer: 'Done: `greet` shouts now.' } },   // round 2 (the tool ran); the default maxRounds is 4
          edit('And `add` could subtract.', 'src/util.py', 'return a + b', 'return a - b'),
          edit('Or `add` could multiply.', 'src/util.py', 'return a + b', 'return a * b'),   // rejected by Ctrl+Backspace
          edit('Then `add` swaps its operands.', 'src/util.py', 'return a + b', 'return b + a'),   // accepted by Ctrl+Enter
          { json: { answer: 'Swapped.' } },
          `A **second** chat, with a long link: https://example.com/${'x'.repeat(300)}\n\nשלום! זו תשובה בעברית.`,
          'After the stops.',
          'Retried: here it is.',
          { json: { answer: 'Shouting.', action_requests: [{ function: 'shout', arguments: { text: 'no' } }] } },   // rejected by Ctrl+Backspace
          { json: { answer: 'Shouting again.', action_requests: [{ function: 'shout', arguments: { text: 'yes' } }] } },   // accepted by Ctrl+Enter
          { json: { answer: 'Shouted.' } },
          edit('This edit waits through a reload.', 'src/util.py', 'return a + b', 'return a + b + 0'),
        ], 14, 60),
        slow: scripted({ text: 'too late', delayMs: 120000 }, { text: 'too late again', delayMs: 120000 }),
        flaky: scripted({ error: 'the model is down' }, { text: 'Up again: retried.' }),   // a turn that fails, then its Retry
        // a turn stopped while its first round's call waits for a decision (the round is recorded), then its Retry;
        // the prompts it was given go to asker-state.prompts
        // a reply not in the chat's response format, then (the repair turn: the model asked again) one that is, after a pause
        mender: scripted('Not in the format at all.', { json: { answer: 'In the format now.' }, delayMs: REPAIR_DELAY_MS }),
        asker: drip(path.join(W, 'asker-state'), [
          { json: { answer: 'Shouting about the file.', action_requests: [{ function: 'shout', arguments: { text: 'file' } }] } },
          { json: { answer: 'Retried: the file once.' } },
        ], 4, 30),
      },
      defaultModel: 'chatty',
      stateDir: path.join(W, 'state'),
      toolModules: ['vscode_fixture_tools'],
      toolPolicy: { shout: 'ask' },   // a call that needs a decision and has no diff
    },
    'workbench.startupEditor': 'none',
    'security.workspace.trust.enabled': false,
    'files.autoSave': 'off',
    'workbench.tips.enabled': false,
    'workbench.welcomePage.walkthroughs.openOnInstall': false,
    'diffEditor.renderSideBySide': true,
    'diffEditor.useInlineViewWhenSpaceIsLimited': false,
  }, null, 2));

  // a key that sends a chat turn asking for a structured reply (the chat command's responseFormat): the chat's own
  // turns ask for none, and only a turn with a response format has repair turns
  fs.mkdirSync(path.join(W, 'data', 'User'), { recursive: true });
  fs.writeFileSync(path.join(W, 'data', 'User', 'keybindings.json'), JSON.stringify([{ key: 'ctrl+shift+alt+f10', command: 'operateSidecar.chat',
    args: { text: FORMAT_TURN, responseFormat: { type: 'object', properties: { answer: { type: 'string' } }, required: ['answer'] } } }], null, 2));

  const csPort = await freePort(), cdpPort = await freePort();
  const env = { ...process.env, XDG_CONFIG_HOME: path.join(W, 'xdg-config'), XDG_DATA_HOME: path.join(W, 'xdg-data'), XDG_CACHE_HOME: path.join(W, 'xdg-cache') };
  delete env.VSCODE_IPC_HOOK_CLI;
  const cs = start('code-server', CODE_SERVER, ['--auth', 'none', '--bind-addr', `127.0.0.1:${csPort}`, '--disable-telemetry', '--disable-update-check',
    '--disable-workspace-trust', '--extensions-dir', path.join(W, 'exts'), '--user-data-dir', path.join(W, 'data'), ws], env);
  await waitFor('code-server /healthz', async () => { if (cs.exitCode !== null) throw new Error('code-server exited'); return healthy(csPort); }, 60000, 250);
  mark('codeServerReady');
  const url = `http://127.0.0.1:${csPort}/?folder=${encodeURIComponent(ws)}&payload=`
    + encodeURIComponent(JSON.stringify([['extensionDevelopmentPath', `vscode-remote://127.0.0.1:${csPort}${EXT}`]]));
  start('chromium', CHROMIUM, ['--headless=new', '--no-sandbox', '--disable-gpu', '--disable-dev-shm-usage', '--no-first-run', '--no-default-browser-check',
    `--remote-debugging-port=${cdpPort}`, '--remote-debugging-address=127.0.0.1', `--user-data-dir=${path.join(W, 'chrome')}`, url], env);
  const version = await waitFor('chromium DevTools endpoint', () => getJSON(`http://127.0.0.1:${cdpPort}/json/version`), 30000, 200);

  const cdp = await connect(version.webSocketDebuggerUrl);
  const contexts = new Map();
  const exceptions = [];
  cdp.on((method, p, sid) => {
    if (method === 'Runtime.executionContextCreated' && p.context.auxData?.isDefault) contexts.set(`${sid}|${p.context.auxData.frameId}`, p.context.id);
    if (method === 'Runtime.executionContextDestroyed') for (const [k, v] of contexts) if (v === p.executionContextId && k.startsWith(`${sid}|`)) contexts.delete(k);
    if (method === 'Runtime.executionContextsCleared') for (const k of contexts.keys()) if (k.startsWith(`${sid}|`)) contexts.delete(k);
    if (method === 'Runtime.exceptionThrown') exceptions.push(p.exceptionDetails.exception?.description?.slice(0, 300) ?? p.exceptionDetails.text);
  });
  const page = await waitFor('workbench page', async () => (await cdp.send('Target.getTargets')).targetInfos.find((t) => t.type === 'page' && t.url.startsWith(`http://127.0.0.1:${csPort}/`)));
  const { sessionId: S } = await cdp.send('Target.attachToTarget', { targetId: page.targetId, flatten: true });
  const send = (m, p = {}) => cdp.send(m, p, S);
  await send('Target.setAutoAttach', { autoAttach: true, flatten: true, waitForDebuggerOnStart: false });
  await send('Page.enable');
  await send('Runtime.enable');
  await send('Emulation.setDeviceMetricsOverride', { width: 1400, height: 860, deviceScaleFactor: 1, mobile: false });
  await send('Browser.grantPermissions', { permissions: ['clipboardReadWrite', 'clipboardSanitizedWrite'] }).catch(() => undefined);

  const evalIn = async (expression, contextId) => {
    const r = await send('Runtime.evaluate', { expression, returnByValue: true, awaitPromise: true, ...(contextId ? { contextId } : {}) });
    if (r.exceptionDetails) throw new Error(r.exceptionDetails.exception?.description ?? r.exceptionDetails.text);
    return r.result.value;
  };
  const key = async (key, code, vk, { text, modifiers = 0 } = {}) => {
    await send('Input.dispatchKeyEvent', { type: 'keyDown', key, code, windowsVirtualKeyCode: vk, modifiers, ...(text ? { text } : {}) });
    await send('Input.dispatchKeyEvent', { type: 'keyUp', key, code, windowsVirtualKeyCode: vk, modifiers });
  };
  const enter = () => key('Enter', 'Enter', 13, { text: '\r' });
  const click = async ({ x, y }) => {
    await send('Input.dispatchMouseEvent', { type: 'mouseMoved', x, y });
    await send('Input.dispatchMouseEvent', { type: 'mousePressed', x, y, button: 'left', buttons: 1, clickCount: 1 });
    await send('Input.dispatchMouseEvent', { type: 'mouseReleased', x, y, button: 'left', buttons: 0, clickCount: 1 });
  };
  failShot = () => shot('failure').catch(() => undefined);
  const shot = async (name, clip) => {
    const r = await send('Page.captureScreenshot', { format: 'png', ...(clip && { clip: { ...clip, scale: 1 } }) });
    const f = path.join(OUT, `${name}.png`); fs.writeFileSync(f, Buffer.from(r.data, 'base64')); return f;
  };
  /** Center of an element of the workbench document. */
  const centerOf = async (selector) => {
    const c = await evalIn(`(() => { const e = document.querySelector(${JSON.stringify(selector)}); if (!e) return null;
      const r = e.getBoundingClientRect(); return { x: r.left + r.width / 2, y: r.top + r.height / 2 }; })()`);
    expect(c, `no element ${selector}`);
    return c;
  };
  /** Runs `text` in the command palette (F1): waits for its row, then Enter; a row that does not come fails, saying what the palette showed. */
  const palette = async (text, { clear = false, match = text.replace(/^>/, '') } = {}) => {
    await key('F1', 'F1', 112);
    await waitFor('quick input', () => evalIn(`!!document.querySelector('.quick-input-widget input:focus')`), 10000);
    if (clear) await key('Backspace', 'Backspace', 8);
    await send('Input.insertText', { text });
    await waitFor(`quick input row "${match}"`, () => evalIn(`(document.querySelector('.quick-input-list .monaco-list-row.focused')?.getAttribute('aria-label') ?? '').includes(${JSON.stringify(match)})`), 10000)
      .catch(async (e) => {
        const shown = await evalIn(`JSON.stringify({ input: document.querySelector('.quick-input-box input')?.value,
          rows: [...document.querySelectorAll('.quick-input-list .monaco-list-row')].slice(0, 5).map((r) => r.getAttribute('aria-label')) })`).catch(() => '?');
        throw new Error(`${e.message}; the palette showed ${shown}`);
      });
    await enter();
  };
  const quickPickChoose = async (filter, match) => {
    await waitFor('quick pick open', () => evalIn(`!!document.querySelector('.quick-input-widget:not([style*="display: none"]) input:focus')`), 10000);
    await send('Input.insertText', { text: filter });
    await waitFor(`quick pick row "${match}"`, () => evalIn(`(document.querySelector('.quick-input-list .monaco-list-row.focused')?.getAttribute('aria-label') ?? '').includes(${JSON.stringify(match)})`), 10000);
    await enter();
  };

  // ---- the webview ---------------------------------------------------------------------------------
  const probe = `location.href.includes('extensionId=${EXT_ID}') && !!document.getElementById('send')`;
  let web;
  const findWebview = async () => {
    for (const [k, id] of contexts) {
      const [sid] = k.split('|');
      if (sid !== S) continue;
      if (await evalIn(probe, id).catch(() => false)) return id;
    }
  };
  const settleWebview = async () => { web = await waitFor('chat webview', findWebview, STEP); await sleep(400); web = await waitFor('chat webview (settled)', findWebview, STEP); };
  const inWeb = (expr) => evalIn(expr, web);
  const OUTER = `document.querySelector('iframe.webview.ready[src*="extensionId=${EXT_ID}"]')`;
  /**
   * Page coordinates of an element inside the chat webview (outer iframe + inner frame + element), `selector`'s last:
   * its center, or `at` (pixels from its top left).
   */
  const webCenter = async (selector, at) => {
    const c = await evalIn(`(() => { const outer = ${OUTER}; const at = ${JSON.stringify(at ?? null)};
      const inner = outer.contentDocument.getElementById('active-frame'); const els = inner.contentDocument.querySelectorAll(${JSON.stringify(selector)});
      const el = els[els.length - 1]; if (!el) return null;
      const o = outer.getBoundingClientRect(), i = inner.getBoundingClientRect(), e = el.getBoundingClientRect();
      return { x: o.left + outer.clientLeft + i.left + inner.clientLeft + e.left + (at ? at.x : e.width / 2),
        y: o.top + outer.clientTop + i.top + inner.clientTop + e.top + (at ? at.y : e.height / 2) }; })()`);
    expect(c, `no element ${selector} in the chat`);
    return c;
  };
  const webClick = async (selector) => click(await webCenter(selector));
  const chatClip = () => evalIn(`(() => { const r = ${OUTER}.getBoundingClientRect(); return { x: r.x, y: r.y, width: r.width, height: r.height }; })()`);
  const type = async (text) => {
    await webClick('#input');
    await waitFor('chat input focused', () => inWeb(`document.activeElement?.id === 'input'`), 5000);
    await send('Input.insertText', { text });
  };
  const lastTurn = (expr) => inWeb(`(() => { const ts = document.querySelectorAll('section.turn'); const t = ts[ts.length - 1]; return t ? (${expr}) : null; })()`);
  const turnCount = () => inWeb(`document.querySelectorAll('section.turn').length`);
  /** Enter in the chat input; resolves once the new turn is on screen. */
  const submit = async () => {
    const before = await turnCount();
    // a # word ending the input has its suggestions listed once the extension answers, and Enter then takes one
    // instead of sending (on a loaded machine the answer can come before the Enter): wait for the list, close it
    if (await inWeb(`/(?:^|\\s)#\\S*$/.test(document.getElementById('input').value)`)) {
      await waitFor('the suggestions of the # word ending the input', () => inWeb(`!document.getElementById('complete').hidden`), 15000);
      await key('Escape', 'Escape', 27);
      await waitFor('the suggestions closed', () => inWeb(`document.getElementById('complete').hidden`), 5000);
    }
    await enter();
    await waitFor('the turn starts', async () => (await turnCount()) > before, 30000);   // (generous: a loaded machine, two test processes)
  };
  const turnDone = () => waitFor('the turn ends', () => inWeb(`!document.body.classList.contains('running') && document.getElementById('stop').hidden`), 60000);
  const tabDirty = (name) => evalIn(`[...document.querySelectorAll('.tabs-container .tab')].some((t) => (t.getAttribute('aria-label') ?? '').startsWith(${JSON.stringify(name)}) && t.classList.contains('dirty'))`);
  const editorText = () => evalIn(`(() => { const ed = [...document.querySelectorAll('.editor-instance .monaco-editor')].find((e) => !e.closest('.monaco-diff-editor'));
    return ed ? [...ed.querySelectorAll('.view-line')].sort((a, b) => parseFloat(a.style.top) - parseFloat(b.style.top)).map((l) => l.textContent.replace(/\\u00a0/g, ' ')).join('\\n') : null; })()`);
  const disk = (p) => fs.readFileSync(path.join(ws, p), 'utf8');

  await waitFor('workbench with the Sidecar Chat activity', () => evalIn(`!!document.querySelector('.activitybar .action-item a[aria-label^="Sidecar Chat"]')`), TIMEOUT_S * 1000);
  mark('workbenchReady');

  await check('open src/app.py and the chat view (keyboard: quick open, command palette)', async () => {
    await palette('View: Close All Editors').catch(() => undefined);   // code-server's walkthrough tab
    await palette('src/app.py', { clear: true, match: 'app.py' });
    await waitFor('app.py editor', async () => (await editorText())?.includes("return 'hello ' + name"), STEP);
    await palette('operate-sidecar: Open Chat');
    await settleWebview();
    // the webview draws its turns once the extension answers its 'ready' (a round trip that a loaded machine delays)
    await waitFor('an empty chat to start', () => inWeb(`document.querySelector('.empty') !== null && !document.querySelector('section.turn')`), STEP);
    // a wider side bar for the screenshots (the drag handle between the side bar and the editors)
    const sash = await centerOf('.monaco-sash.vertical:not(.disabled)').catch(() => undefined);
    if (sash) {
      await send('Input.dispatchMouseEvent', { type: 'mouseMoved', x: sash.x, y: 400 });
      await send('Input.dispatchMouseEvent', { type: 'mousePressed', x: sash.x, y: 400, button: 'left', buttons: 1, clickCount: 1 });
      for (let dx = 20; dx <= 160; dx += 20) await send('Input.dispatchMouseEvent', { type: 'mouseMoved', x: sash.x + dx, y: 400, buttons: 1 });
      await send('Input.dispatchMouseEvent', { type: 'mouseReleased', x: sash.x + 160, y: 400, button: 'left', buttons: 0, clickCount: 1 });
      await settleWebview();
    }
  });

  await check('type a prompt with #file: the model\'s thoughts show open ("Thinking…") while they stream, then fold ("Thought"), never in the reply; the prose streams in, renders as Markdown with code-block buttons, branch named after it; for screen readers the input has a label and a polite live region says "working…", what the turn does ("writing…") and "Turn finished.", each once, not each piece', async () => {
    await inWeb(`window.__seen = []; window.__thinking = []; new MutationObserver(() => { const ps = document.querySelectorAll('section.turn .prose'); const p = ps[ps.length - 1];
      if (p) window.__seen.push(p.textContent.length);
      const th = document.querySelector('section.turn:last-child .thought.live');
      if (th) window.__thinking.push(th.querySelector('.thought-head').textContent + '|' + th.querySelector('.thought-text').textContent.trim().length);
    }).observe(document.getElementById('log'), { childList: true, subtree: true, characterData: true }); true`);
    // what the live region says: each change of its text (a screen reader reads each one)
    await inWeb(`window.__said = []; const st = document.getElementById('status'); new MutationObserver(() => window.__said.push(st.textContent))
      .observe(st, { childList: true, subtree: true, characterData: true }); true`);
    await type('Explain the plan for #file');
    await submit();
    await turnDone();
    const seen = await inWeb('window.__seen');
    const distinct = [...new Set(seen)];
    expect(distinct.length >= 3 && distinct[distinct.length - 1] === Math.max(...distinct), `the prose grew in steps: ${JSON.stringify(distinct)}`);
    const thinking = [...new Set(await inWeb('window.__thinking'))];
    expect(thinking.length >= 1 && thinking.every((x) => x.startsWith('Thinking…|')), `the thoughts showed open while they streamed: ${JSON.stringify(thinking)}`);
    const folded = await lastTurn(`[...t.querySelectorAll('details.thought')].map((d) => ({ open: d.open, summary: d.querySelector('summary').textContent,
      text: d.querySelector('.thought-text').textContent.trim(), beforeProse: !!(d.compareDocumentPosition(t.querySelector('.prose')) & Node.DOCUMENT_POSITION_FOLLOWING) }))`);
    // ("Thought", or "Thought for 1 s" on a machine slow enough that the thoughts took a second)
    expect(folded.length === 1 && /^Thought( for \d+ s)?$/.test(folded[0].summary)
      && JSON.stringify({ ...folded[0], summary: 'Thought' }) === JSON.stringify({ open: false, summary: 'Thought', text: THOUGHT, beforeProse: true }),
    `folded, whole, before the reply: ${JSON.stringify(folded)}`);
    const prose = await lastTurn(`t.querySelector('.prose').innerHTML`);
    expect(!prose.includes('think') && !prose.includes('greet shout'), `no thought in the reply: ${prose}`);
    expect(prose.includes('<strong>plan</strong>') && prose.includes('<ol>') && prose.includes('<code>src/app.py</code>'), `Markdown rendered: ${prose}`);
    expect(await lastTurn(`t.querySelectorAll('.code-block button[data-action=copy]').length === 1 && t.querySelectorAll('.code-block button[data-action=insert]').length === 1`), 'copy and insert buttons on the code block');
    expect(await lastTurn(`[...t.querySelectorAll('.chip')].map((c) => c.textContent).join()`) === 'src/app.py', 'the #file reference is shown as a chip');
    expect(/model call/.test(await lastTurn(`t.querySelector('.usage')?.textContent ?? ''`)), 'a usage line under the turn');
    expect(await inWeb(`document.getElementById('branch').textContent`) === 'Explain the plan for', 'the branch is named after the first instruction');
    const a11y = await inWeb(`(() => { const i = document.getElementById('input'), st = document.getElementById('status');
      return { label: i.getAttribute('aria-label'), placeholder: i.placeholder, role: st.getAttribute('role'), live: st.getAttribute('aria-live'), said: window.__said }; })()`);
    expect(a11y.label && a11y.label !== a11y.placeholder && a11y.role === 'status' && a11y.live === 'polite', `the input's label, the live region: ${JSON.stringify(a11y)}`);
    // the changes of state only: the start, the turn's status while it held (a status that passed within the live region's
    // settle time, e.g. the model called or the reply read, may go unsaid), the end; each once, never a streamed piece
    const states = new Set(['working…', 'waiting for the model…', 'thinking…', 'writing…', 'reading the reply…', 'Turn finished.']);
    const said = a11y.said;
    expect(said[0] === 'working…' && said.at(-1) === 'Turn finished.' && said.includes('writing…') && said.every((x) => states.has(x))
      && said.every((x, i) => i === 0 || x !== said[i - 1]) && new Set(said).size === said.length,
      `the live region said the state changes only: ${JSON.stringify(said)}`);
    return { proseLengths: distinct.length, said, thinking };
  });
  await shot('chat', await chatClip());

  await check('Insert on a code block puts the code into the editor at the cursor, Copy puts it on the clipboard (real clicks); Copy under the reply puts the whole reply there as Markdown, without the thoughts', async () => {
    await evalIn(`document.querySelector('.code-block')?.dispatchEvent(new MouseEvent('mouseover'))`).catch(() => undefined);
    await webClick('.code-block button[data-action=insert]');
    await waitFor('code inserted', async () => (await editorText())?.includes('print(greet("you"))'), 10000);
    await webClick('.code-block button[data-action=copy]');
    await waitFor('code on the clipboard', async () => (await evalIn(`navigator.clipboard.readText().catch((e) => 'ERR ' + e)`)) === 'print(greet("you"))\n', 10000);
    await webClick('section.turn button[data-action=copyReply]');
    const reply = 'Here is the **plan**:\n\n1. read `src/app.py`\n2. make `greet` shout\n\n```python\nprint(greet("you"))\n```\n\nThat is all it takes.';
    await waitFor('the reply on the clipboard', async () => (await evalIn(`navigator.clipboard.readText().catch((e) => 'ERR ' + e)`)) === reply, 10000)
      .catch(async (e) => { throw new Error(`${e.message}: it holds ${JSON.stringify(await evalIn(`navigator.clipboard.readText().catch((e) => 'ERR ' + e)`))}`); });
    expect(await inWeb(`document.querySelector('section.turn button[data-action=copyReply]').textContent`) === 'Copied', 'the button says Copied');
  });

  await check('a structured reply with an edit_file call: prose field shown (never JSON), diff editor opens with the proposed text, Accept in the card; a second round answers', async () => {
    // undo the Insert in the editor (focus it first), so app.py is back to its disk text
    await click(await centerOf('.editor-instance .monaco-editor .view-lines'));
    for (let i = 0; i < 3 && (await editorText())?.includes('print(greet'); i++) { await key('z', 'KeyZ', 90, { modifiers: 2 }); await sleep(150); }
    expect(!(await editorText()).includes('print(greet'), 'insert undone');
    await type('Make greet shout');
    await submit();
    await waitFor('diff editor with insertions', () => evalIn(`document.querySelectorAll('.monaco-diff-editor .line-insert, .monaco-diff-editor .char-insert').length > 0`), STEP);
    await waitFor('Accept button in the card', () => lastTurn(`!!t.querySelector('.ask button.accept')`), STEP);
    const prose = await lastTurn(`t.querySelector('.prose')?.textContent ?? ''`);
    expect(prose.includes('I will make greet shout.') && !prose.includes('{') && !prose.includes('action_requests'), `prose, not JSON: ${prose}`);
    // the title buttons are labelled with their keybindings (package.json contributes.keybindings)
    const labels = await evalIn(`[...document.querySelectorAll('.editor-actions [aria-label]')].map((e) => e.getAttribute('aria-label'))`);
    expect(labels.includes('Accept Edit (Ctrl+Enter)') && labels.includes('Reject Edit (Ctrl+Backspace)'), `Accept / Reject in the diff editor title: ${JSON.stringify(labels)}`);
    const tab = await evalIn(`document.querySelector('.tabs-container .tab.active')?.getAttribute('aria-label')`);
    expect(tab?.includes('app.py') && tab.includes('proposed'), `the diff tab: ${tab}`);
    await sleep(300);
    await shot('diff-review');
    await webClick('.ask button.accept');
    await turnDone();
    const title = await lastTurn(`t.querySelector('details.tool summary').textContent`);
    expect(title === '✓ edit_file src/app.py +1 −1', `tool card: ${title}`);
    const after = await lastTurn(`[...t.querySelectorAll('.prose')].map((p) => p.textContent.trim())`);
    expect(JSON.stringify(after) === JSON.stringify(['I will make greet shout.', 'Done: greet shouts now.']), `a second round answered in the same turn: ${JSON.stringify(after)}`);
    expect((await lastTurn(`t.querySelector('.usage')?.textContent ?? ''`)).includes('2 rounds'), 'the usage line counts the rounds');
    expect(!(await evalIn(`!!document.querySelector('.monaco-diff-editor')`)), 'the diff editor closed');
  });

  await check('the accepted edit landed in the buffer (dirty, disk untouched); Ctrl+Z undoes it; redo + Ctrl+S writes it', async () => {
    await waitFor('app.py tab dirty', () => tabDirty('app.py'), 10000);
    expect(disk('src/app.py') === APP_OLD, 'the disk still has the old text (the edit went into the buffer)');
    await palette('src/app.py', { clear: true, match: 'app.py' });
    await waitFor('the new text in the editor', async () => (await editorText())?.includes("return 'HELLO ' + name.upper() + '!'"), 10000);
    await click(await centerOf('.editor-instance .monaco-editor .view-lines'));
    await key('z', 'KeyZ', 90, { modifiers: 2 });
    await waitFor('undo restores the old text', async () => (await editorText())?.includes("return 'hello ' + name"), 10000);
    await waitFor('not dirty after the undo', async () => !(await tabDirty('app.py')), 10000);
    await key('Z', 'KeyZ', 90, { modifiers: 2 | 8 });   // Ctrl+Shift+Z: redo
    await waitFor('redo brings the edit back', async () => (await editorText())?.includes("'HELLO '"), 10000);
    await key('s', 'KeyS', 83, { modifiers: 2 });
    await waitFor('saved to disk', () => disk('src/app.py') === APP_NEW, 10000);
    // (the tab is marked clean once the save has completed: after the file is written)
    await waitFor('clean after save', async () => !(await tabDirty('app.py')), 10000);
  });

  await check('a second edit, the chat hidden and shown again while it waits (the turn once, its card still asks; the turn and the live region say it waits for your decision, the activity bar badge counts it while the chat is hidden), rejected from the diff editor title: card shows the rejection, util.py untouched and not dirty', async () => {
    await type('Now change util');
    await submit();
    await waitFor('Reject in the diff editor title', () => evalIn(`!!document.querySelector('.editor-actions [aria-label^="Reject Edit"]')`), STEP);
    await waitFor('Accept button in the card', () => lastTurn(`!!t.querySelector('.ask button.accept')`), STEP);
    // waiting for you: said in the turn (not "working…") and by the live region, which names the call
    const waitingSaid = async () => ({ turn: await lastTurn(`t.querySelector('.running')?.textContent.trim() ?? ''`),
      status: await inWeb(`document.getElementById('status').textContent`) });
    const said = await waitingSaid();
    expect(said.turn === 'waiting for your decision: Accept or Reject above' && said.status === 'Waiting for your decision: edit_file src/util.py. Ctrl+Enter accepts, Ctrl+Backspace rejects.',
      `the waiting state: ${JSON.stringify(said)}`);
    const turns = await turnCount();
    // the Explorer takes the side bar: the chat's webview is disposed; Open Chat builds it again
    await palette('View: Show Explorer');
    await waitFor('the chat webview gone', async () => !(await findWebview()), STEP);
    const badge = await evalIn(`document.querySelector('.activitybar .action-item a[aria-label^="Sidecar Chat"]')?.parentElement?.querySelector('.badge-content')?.textContent ?? null`);
    expect(badge === '1', `the Sidecar Chat activity's badge while the chat is hidden: ${JSON.stringify(badge)}`);
    await palette('operate-sidecar: Open Chat');
    await settleWebview();
    await waitFor('the card asks again', () => lastTurn(`!!t.querySelector('.ask button.accept')`), STEP);
    const users = await inWeb(`[...document.querySelectorAll('section.turn .user')].map((u) => u.textContent)`);
    expect(users.length === turns && users.filter((u) => u.startsWith('Now change util')).length === 1,
      `the running turn shown once after the chat came back: ${JSON.stringify(users)}`);
    expect(await lastTurn(`t.querySelectorAll('.prose').length`) === 1, 'its prose once');
    const again = await waitingSaid();
    expect(again.turn === said.turn && again.status === said.status, `the waiting state, shown again: ${JSON.stringify(again)}`);
    await waitFor('diff decorations', () => evalIn(`document.querySelectorAll('.monaco-diff-editor .line-insert, .monaco-diff-editor .char-insert').length > 0`), STEP);
    await click(await centerOf('.editor-actions [aria-label^="Reject Edit"]'));
    await turnDone();
    const title = await lastTurn(`[...t.querySelectorAll('details.tool summary')].map((s) => s.textContent).join()`);
    expect(title.startsWith('⊘ edit_file src/util.py'), `tool card: ${title}`);
    expect(disk('src/util.py') === UTIL_OLD && !(await tabDirty('util.py')), 'util.py unchanged');
    expect(!(await evalIn(`!!document.querySelector('.monaco-diff-editor')`)), 'the diff editor closed');
    const activity = `document.querySelector('.activitybar .action-item a[aria-label^="Sidecar Chat"]')?.parentElement`;
    await waitFor('no badge once decided', () => evalIn(`(() => { const b = ${activity}?.querySelector('.badge'); return !!b && (!b.offsetParent || !b.textContent.trim()); })()`), 5000)
      .catch(async (e) => { throw new Error(`${e.message}: ${await evalIn(`${activity}?.outerHTML`)}`); });
  });

  // the extension's keybindings (package.json contributes.keybindings), pressed as real keys
  const diffSide = (side) => `.monaco-diff-editor .editor.${side}`;
  const focusDiffSide = async (side) => {
    await waitFor('diff decorations', () => evalIn(`document.querySelectorAll('.monaco-diff-editor .line-insert, .monaco-diff-editor .char-insert').length > 0`), STEP);
    await click(await centerOf(`${diffSide(side)} .view-lines`));
    await waitFor(`the ${side} side of the diff editor focused`, () => evalIn(`!!document.activeElement?.closest(${JSON.stringify(diffSide(side))})`), 10000);
  };
  const reviewPending = () => evalIn(`!!document.querySelector('.editor-actions [aria-label^="Reject Edit"]')`);

  await check('keyboard in the diff editor: Ctrl+Backspace in its left (file) side rejects the pending edit (card ⊘, util.py unchanged, not dirty); in the chat input the key still deletes a word and decides nothing', async () => {
    await type('Or make add multiply');
    await submit();
    await waitFor('Reject in the diff editor title', reviewPending, STEP);
    await waitFor('Accept button in the card', () => lastTurn(`!!t.querySelector('.ask button.accept')`), STEP);
    // not stolen elsewhere: in the chat input Ctrl+Backspace deletes the word before the cursor
    await type('keep draft');
    await key('Backspace', 'Backspace', 8, { modifiers: 2 });
    await waitFor('a word deleted in the chat input', async () => (await inWeb(`document.getElementById('input').value`)) === 'keep ', 5000);
    await sleep(800);
    expect(await reviewPending() && await lastTurn(`!!t.querySelector('.ask button.accept')`), 'Ctrl+Backspace in the chat input decided nothing');
    for (let i = 0; i < 4 && (await inWeb(`document.getElementById('input').value`)) !== ''; i++) await key('Backspace', 'Backspace', 8, { modifiers: 2 });
    expect(await inWeb(`document.getElementById('input').value`) === '', 'the chat input emptied again');
    await focusDiffSide('original');
    await key('Backspace', 'Backspace', 8, { modifiers: 2 });
    await turnDone();
    const title = await lastTurn(`[...t.querySelectorAll('details.tool summary')].map((s) => s.textContent).join()`);
    expect(title.startsWith('⊘ edit_file src/util.py'), `tool card: ${title}`);
    expect(disk('src/util.py') === UTIL_OLD && !(await tabDirty('util.py')), 'util.py unchanged');
    expect(!(await evalIn(`!!document.querySelector('.monaco-diff-editor')`)), 'the diff editor closed');
  });

  await check('keyboard in the diff editor: Ctrl+Enter in its right (proposed) side accepts: the edit lands in the buffer (dirty, disk untouched), the card reads ✓ and the second round answers; Ctrl+Z takes it back', async () => {
    await type('Then swap the operands of add');
    await submit();
    await waitFor('Accept button in the card', () => lastTurn(`!!t.querySelector('.ask button.accept')`), STEP);
    await focusDiffSide('modified');
    await key('Enter', 'Enter', 13, { modifiers: 2 });
    await turnDone();
    const title = await lastTurn(`t.querySelector('details.tool summary').textContent`);
    expect(title === '✓ edit_file src/util.py +1 −1', `tool card: ${title}`);
    const after = await lastTurn(`[...t.querySelectorAll('.prose')].map((p) => p.textContent.trim())`);
    expect(JSON.stringify(after) === JSON.stringify(['Then add swaps its operands.', 'Swapped.']), `the second round answered: ${JSON.stringify(after)}`);
    expect(!(await evalIn(`!!document.querySelector('.monaco-diff-editor')`)), 'the diff editor closed');
    expect(disk('src/util.py') === UTIL_OLD, 'the disk still has the old text (the edit went into the buffer)');
    await palette('src/util.py', { clear: true, match: 'util.py' });
    await waitFor('the accepted text in the editor', async () => (await editorText())?.includes('return b + a'), 10000);
    expect(await tabDirty('util.py'), 'util.py dirty');
    await click(await centerOf('.editor-instance .monaco-editor .view-lines'));
    await key('z', 'KeyZ', 90, { modifiers: 2 });
    await waitFor('undo restores util.py', async () => (await editorText())?.includes('return a + b'), 10000);
    await waitFor('not dirty after the undo', async () => !(await tabDirty('util.py')), 10000);
  });

  await check('New chat (+), then switch back through the chat picker (name, last message, model); a long unbroken line wraps (no sideways scrolling), Hebrew reads right to left', async () => {
    await webClick('#new');
    await waitFor('an empty chat', () => inWeb(`!!document.querySelector('.empty')`), 10000);
    await type(`Start a second chat\n${'y'.repeat(300)}\nשלום עולם, מה שלומך?`);
    await submit();
    await turnDone();
    expect((await lastTurn(`t.querySelector('.prose').innerHTML`)).includes('<strong>second</strong>'), 'second chat answered');
    const log = await inWeb(`(() => { const l = document.getElementById('log'); return { scroll: l.scrollWidth, client: l.clientWidth }; })()`);
    expect(log.scroll <= log.client, `the long lines wrap in the chat: ${JSON.stringify(log)}`);
    // the first Hebrew letter of a line or paragraph starts at its right edge (its own direction), not in its middle
    const gaps = await lastTurn(`[t.querySelector('.user'), [...t.querySelectorAll('.prose p')].at(-1)].map((el) => {
      const w = document.createTreeWalker(el, NodeFilter.SHOW_TEXT); let n; while ((n = w.nextNode()) && !n.data.includes('ש'));
      const r = document.createRange(); const i = n.data.indexOf('ש'); r.setStart(n, i); r.setEnd(n, i + 1);
      const s = getComputedStyle(el); return Math.round(el.getBoundingClientRect().right - parseFloat(s.paddingRight) - parseFloat(s.borderRightWidth) - r.getBoundingClientRect().right); })`);
    expect(gaps.every((g) => g >= 0 && g < 4), `Hebrew right to left (gap to the right edge, message and reply): ${JSON.stringify(gaps)}`);
    expect(await inWeb(`document.getElementById('branch').textContent`) === 'Start a second chat', 'second chat named');
    await webClick('#branch');
    await waitFor('chat picker', () => evalIn(`[...document.querySelectorAll('.quick-input-list .monaco-list-row')].some((r) => (r.getAttribute('aria-label') ?? '').includes('Explain the plan for'))`), 10000);
    const rows = await evalIn(`[...document.querySelectorAll('.quick-input-list .monaco-list-row')].map((r) => r.getAttribute('aria-label'))`);
    expect(rows.some((r) => r.includes('Explain the plan for') && r.includes('chatty')), `picker rows: ${JSON.stringify(rows)}`);
    await quickPickChoose('Explain', 'Explain the plan for');
    await waitFor('the first chat is shown', () => inWeb(`document.getElementById('branch').textContent === 'Explain the plan for' && document.querySelectorAll('section.turn').length === 5`), 10000);
    await settleWebview();
    expect(await inWeb(`document.querySelector('section.turn .prose').innerHTML.includes('<strong>plan</strong>')`), 'its conversation is rendered from the server');
    return { rows };
  });

  await check('pick a model from the header: quick pick of the server models; status bar shows model · chat', async () => {
    await webClick('#model');
    await quickPickChoose('slow', 'slow');
    await waitFor('model in the header', () => inWeb(`document.getElementById('model').textContent === 'slow'`), 10000);
    const status = await evalIn(`[...document.querySelectorAll('.statusbar-item')].map((s) => s.textContent).find((t) => t.includes(' · ')) ?? ''`);
    expect(status.includes('slow · Explain the plan for'), `status bar: ${status}`);
  });

  await check('keyboard only: Open Chat from the editor puts the cursor in the chat input (its shortcut, Ctrl+Shift+Alt+/); Enter sends; Escape in the editor leaves the turn running, Escape in the chat view (on its Stop button, not the input) stops it, also before the view has reported its focus', async () => {
    const editorFocused = () => waitFor('the editor focused', () => evalIn(`!!document.activeElement?.closest('.editor-instance')`), 10000);
    const openChat = async () => {
      await key('?', 'Slash', 191, { modifiers: 2 | 1 | 8 });   // Ctrl+Shift+Alt+/
      await settleWebview();
      await waitFor('the chat input focused', () => inWeb(`document.hasFocus() && document.activeElement?.id === 'input'`), 10000);
    };
    await click(await centerOf('.editor-instance .monaco-editor .view-lines'));
    await editorFocused();
    await openChat();
    const before = await turnCount();
    await send('Input.insertText', { text: 'Typed without the mouse' });
    expect(await inWeb(`document.getElementById('input').value`) === 'Typed without the mouse', 'the keys reached the chat input');
    await enter();
    await waitFor('the turn starts', async () => (await turnCount()) > before, 30000);   // (generous: a loaded machine, two test processes)
    await waitFor('running', () => inWeb(`!document.getElementById('stop').hidden`), 10000);
    // the chat's Escape is not taken from the editor while the turn runs
    await click(await centerOf('.editor-instance .monaco-editor .view-lines'));
    await editorFocused();
    await key('Escape', 'Escape', 27);
    await sleep(1000);
    expect(await inWeb(`!document.getElementById('stop').hidden`), 'Escape in the editor left the turn running');
    await openChat();
    await key('Tab', 'Tab', 9);   // (the input, + File, Stop: in the order they are shown)
    await waitFor('+ File focused', () => inWeb(`document.hasFocus() && document.activeElement?.id === 'attach'`), 5000);
    await key('Tab', 'Tab', 9);
    await waitFor('the Stop button focused', () => inWeb(`document.hasFocus() && document.activeElement?.id === 'stop'`), 5000);
    // the extension told that the chat has no focus, as it is before the view's focus report arrives (right
    // after it is opened, or focused by a command): Escape in the chat stops the turn all the same
    await inWeb(`dispatchEvent(new FocusEvent('blur')); document.hasFocus()`);
    await sleep(1000);
    await key('Escape', 'Escape', 27);
    await turnDone();
    expect(await lastTurn(`t.querySelector('.note')?.textContent`) === 'Stopped.', 'Escape stopped the turn');
  });

  /** The command palette's rows for `text` (closed again); `expected`: wait until it is among them. */
  const paletteRows = async (text, expected) => {
    await key('F1', 'F1', 112);
    await waitFor('quick input', () => evalIn(`!!document.querySelector('.quick-input-widget input:focus')`), 10000);
    await send('Input.insertText', { text });
    const rows = () => evalIn(`[...document.querySelectorAll('.quick-input-list .monaco-list-row')].map((r) => r.getAttribute('aria-label') ?? '')`);
    if (expected) await waitFor(`palette row "${expected}"`, async () => (await rows()).some((r) => r.includes(expected)), 10000);
    else await sleep(800);
    const found = await rows();
    await key('Escape', 'Escape', 27);
    await waitFor('the palette closed', () => evalIn(`!document.querySelector('.quick-input-widget input:focus')`), 5000);
    return found;
  };

  await check('Stop a running turn: "Stopped.", no error in the chat, no error notification; the server still serves; the view is not dimmed while it runs; Stop and Cancel are in the command palette only while it runs', async () => {
    for (const title of ['Stop the Chat Turn', 'Cancel Running Operate', 'Send to Chat']) {
      const idle = await paletteRows(`operate-sidecar: ${title}`);
      expect(!idle.some((r) => r.includes(title)), `"${title}" in the palette with nothing running: ${JSON.stringify(idle)}`);
    }
    await type('This will take forever');
    await submit();
    await waitFor('running', () => inWeb(`!document.getElementById('stop').hidden`), 10000);
    const view = await inWeb(`({ opacity: getComputedStyle(document.body).opacity, overflow: document.documentElement.scrollHeight - document.documentElement.clientHeight })`);
    expect(view.opacity === '1' && view.overflow <= 0, `the whole view, not dimmed or shifted while the turn runs: ${JSON.stringify(view)}`);
    await paletteRows('operate-sidecar: Stop the Chat', 'Stop the Chat Turn');
    await paletteRows('operate-sidecar: Cancel Running', 'Cancel Running Operate');
    const status = await evalIn(`[...document.querySelectorAll('.statusbar-item')].map((s) => s.textContent).find((t) => t.includes(' · ')) ?? ''`);
    expect(status.includes('running'), `status bar while running: ${status}`);
    await webClick('#stop');
    await turnDone();
    expect(await lastTurn(`t.querySelector('.note')?.textContent`) === 'Stopped.', 'stopped note');
    expect(await inWeb(`document.getElementById('status').textContent`) === 'Turn stopped.', 'the live region says the turn stopped');
    expect(await lastTurn(`!t.querySelector('.error')`), 'no error in the chat');
    const toasts = await evalIn(`[...document.querySelectorAll('.notifications-toasts .notification-toast')].map((t) => t.textContent)`);
    expect(!toasts.some((t) => /error|cancel/i.test(t)), `no error notification: ${JSON.stringify(toasts)}`);
    await webClick('#model');
    await quickPickChoose('default', '(default)');
    await waitFor('model back to the default', () => inWeb(`document.getElementById('model').textContent === 'default model'`), 10000);
  });

  await check('a redraw while a turn streams replaces only what changed: the keyboard focus on a button and a text selection in earlier turns stay', async () => {
    await type('One more after the stops');
    await submit();
    const set = await inWeb(`(() => { const ts = document.querySelectorAll('section.turn');
      window.__btn = ts[0].querySelector('.code-block button[data-action=copy]'); window.__btn.focus();
      getSelection().selectAllChildren(ts[1].querySelector('.user')); window.__sel = getSelection().toString();
      return { running: document.body.classList.contains('running'), focus: document.activeElement === window.__btn, selection: window.__sel }; })()`);
    expect(set.running && set.focus && set.selection === 'Make greet shout', `set while the turn runs: ${JSON.stringify(set)}`);
    await turnDone();
    expect(await lastTurn(`t.querySelector('.prose')?.textContent.trim()`) === 'After the stops.', 'the turn answered');
    const kept = await inWeb(`({ focus: document.activeElement === window.__btn && window.__btn.isConnected, selection: getSelection().toString() })`);
    expect(kept.focus && kept.selection === set.selection, `the focus and the selection after the redraws: ${JSON.stringify(kept)}`);
  });

  await check('stopped turns stay in the chat (marked, in order) after the next turn and when the chat is shown again', async () => {
    const lastThree = () => inWeb(`JSON.stringify([...document.querySelectorAll('section.turn')].slice(-3).map((t) =>
      [t.querySelector('.user').textContent, t.classList.contains('stopped'), t.querySelector('.note')?.textContent ?? '', t.querySelector('.prose')?.textContent.trim() ?? '']))`);
    const expected = JSON.stringify([['Typed without the mouse', true, 'Stopped.', ''], ['This will take forever', true, 'Stopped.', ''],
      ['One more after the stops', false, '', 'After the stops.']]);
    expect(await lastThree() === expected, `the stopped turns, then the answered one: ${await lastThree()}`);
    await palette('View: Show Explorer');
    await waitFor('the chat webview gone', async () => !(await findWebview()), STEP);
    await palette('operate-sidecar: Open Chat');
    await settleWebview();
    await waitFor('the chat shown again', async () => (await lastThree()) === expected, STEP);
  });

  const inputValue = () => inWeb(`document.getElementById('input').value`);
  /** Waits until the input has `text`. */
  const shows = (what, text) => waitFor(`${what}: ${JSON.stringify(text)}`, async () => (await inputValue()) === text, 5000)
    .catch(async (e) => { throw new Error(`${e.message} (it has ${JSON.stringify(await inputValue())})`); });
  const clearInput = () => inWeb(`(() => { const i = document.getElementById('input'); i.value = ''; i.dispatchEvent(new Event('input')); return true; })()`);
  /** Each turn's message and Retry button (label, text) if it has one. */
  const retryButtons = () => inWeb(`[...document.querySelectorAll('section.turn')].map((t) => { const b = t.querySelector('button[data-action=retry]');
    return [t.querySelector('.user')?.textContent ?? '', b ? [b.getAttribute('aria-label'), b.textContent, b.tabIndex] : null]; })`);

  await check('Retry on a stopped turn (a labelled button, reached with Shift+Tab from the input and pressed with Enter) sends the same message again on the same chat with what was attached to it then (nothing: not the selection in the editor now); Edit puts a message back into the input', async () => {
    const buttons = await retryButtons();
    const label = ['Retry: send this message again', 'Retry', 0];
    expect(JSON.stringify(buttons.filter(([, b]) => b)) === JSON.stringify([['Typed without the mouse', label], ['This will take forever', label]]),
      `Retry on the stopped turns only: ${JSON.stringify(buttons)}`);
    const branch = await inWeb(`document.getElementById('branch').textContent`);
    // a selection in the editor: a message sent now would take it along
    await click(await centerOf('.editor-instance .monaco-editor .view-lines'));
    await key('a', 'KeyA', 65, { modifiers: 2 });
    await waitFor('a selection in the editor', () => evalIn(`!!document.querySelector('.editor-instance .monaco-editor .selected-text')`), 5000);
    await webClick('#input');
    await waitFor('chat input focused', () => inWeb(`document.activeElement?.id === 'input'`), 5000);
    for (let i = 0; i < 6 && !(await inWeb(`document.activeElement?.dataset.action === 'retry'`)); i++) await key('Tab', 'Tab', 9, { modifiers: 8 });
    const focused = await inWeb(`(() => { const a = document.activeElement; return a?.dataset.action === 'retry' ? a.closest('section.turn').querySelector('.user').textContent : null; })()`);
    expect(focused === 'This will take forever', `Shift+Tab from the input reaches the last Retry: ${focused}`);
    const before = await turnCount();
    await enter();
    await waitFor('the retried turn starts', async () => (await turnCount()) === before + 1, 30000);
    await turnDone();
    const last = await lastTurn(`({ user: t.querySelector('.user').textContent, chips: t.querySelectorAll('.chip').length, stopped: t.classList.contains('stopped'),
      prose: t.querySelector('.prose')?.textContent.trim() })`);
    expect(JSON.stringify(last) === JSON.stringify({ user: 'This will take forever', chips: 0, stopped: false, prose: 'Retried: here it is.' }), `the retried turn: ${JSON.stringify(last)}`);
    expect(await inWeb(`document.getElementById('branch').textContent`) === branch, 'on the same chat');
    const still = (await retryButtons()).slice(-3).map(([u, b]) => [u, !!b]);
    expect(JSON.stringify(still) === JSON.stringify([['This will take forever', true], ['One more after the stops', false], ['This will take forever', false]]),
      `the stopped turn stays (with its Retry) before the next ones: ${JSON.stringify(still)}`);
    await click(await centerOf('.editor-instance .monaco-editor .view-lines'));   // no selection any more
    await waitFor('no selection in the editor', () => evalIn(`!document.querySelector('.editor-instance .monaco-editor .selected-text')`), 5000);
    await webClick('section.turn.stopped button[data-action=edit]');
    await waitFor('Edit puts the message into the input', async () => (await inWeb(`document.activeElement?.id === 'input'`)) && (await inputValue()) === 'This will take forever', 5000);
    await clearInput();
  });

  await check('Attach file (+ File under the input): a quick pick of the workspace\'s files (not those a search leaves out) puts #file:<path> into the input at the caret, set apart by spaces, the text typed around it kept, the input focused again', async () => {
    await clearInput();
    await type('Compare  with the app');
    // the caret after "Compare ": the #file: goes there
    await inWeb(`(() => { const i = document.getElementById('input'); i.focus(); i.setSelectionRange(8, 8); return true; })()`);
    // a file a search leaves out (search.exclude: node_modules, and generated/ in this workspace) is not offered
    for (const dir of [['node_modules', 'junk'], ['generated']]) {
      fs.mkdirSync(path.join(W, 'ws', ...dir), { recursive: true });
      fs.writeFileSync(path.join(W, 'ws', ...dir, 'util.py'), 'junk\n');
    }
    await webClick('#attach');
    await waitFor('quick pick open', () => evalIn(`!!document.querySelector('.quick-input-widget:not([style*="display: none"]) input:focus')`), 10000);
    await send('Input.insertText', { text: 'util' });
    const rows = () => evalIn(`[...document.querySelectorAll('.quick-input-list .monaco-list-row')].map((r) => r.getAttribute('aria-label') ?? '')`);
    await waitFor('util.py offered', async () => (await rows()).some((r) => r.includes('util.py')), 10000);
    expect(JSON.stringify(await rows()) === JSON.stringify(['util.py, src']), `rows: ${JSON.stringify(await rows())}`);
    await waitFor('util.py focused', () => evalIn(`(document.querySelector('.quick-input-list .monaco-list-row.focused')?.getAttribute('aria-label') ?? '').includes('util.py')`), 10000);
    await enter();
    await shows('the #file: at the caret', 'Compare #file:src/util.py with the app');
    await waitFor('the input focused again', () => inWeb(`document.hasFocus() && document.activeElement?.id === 'input'`), 10000);
    await clearInput();
  });
  await check('inline completion in the input: # offers the references, #file: the workspace\'s files (not those a search leaves out), narrowed as it is typed; Up/Down choose, Enter or Tab takes one (never sends), Escape closes the list, Ctrl+Space opens it (typing a # in an empty input), a click takes one; the input says which suggestion is chosen', async () => {
    const suggestions = () => inWeb(`document.getElementById('complete').hidden ? null : [...document.querySelectorAll('#complete li')].map((li) => li.textContent)`);
    const listed = (what, want) => waitFor(`${what}: ${JSON.stringify(want)}`, async () => JSON.stringify(await suggestions()) === JSON.stringify(want), 5000)
      .catch(async (e) => { throw new Error(`${e.message} (it shows ${JSON.stringify(await suggestions())})`); });
    const chosen = () => inWeb(`(() => { const i = document.getElementById('input'), id = i.getAttribute('aria-activedescendant');
      return [i.getAttribute('aria-expanded'), id && document.getElementById(id)?.getAttribute('aria-selected') === 'true' ? document.getElementById(id).textContent : null]; })()`);
    const turns = await turnCount();
    await clearInput();
    await type('Explain #');
    await listed('# offers the references', ['#file:a file of the workspace…', '#filethe active file', '#selectionthe selection in the editor', '#problemsthe workspace\'s problems']);
    expect(JSON.stringify(await chosen()) === JSON.stringify(['true', '#file:a file of the workspace…']), `chosen: ${JSON.stringify(await chosen())}`);
    await send('Input.insertText', { text: 'fi' });
    await listed('#fi narrows them', ['#file:a file of the workspace…', '#filethe active file']);
    await enter();
    await shows('Enter takes #file:', 'Explain #file:');
    // #file: goes on to the files, none of those a search leaves out (node_modules/, generated/ hold a util.py each)
    await waitFor('the files offered', async () => (await suggestions())?.some((t) => t.startsWith('util.py')), 10000);
    const all = await suggestions();
    expect(all.includes('app.pysrc') && all.includes('util.pysrc') && !all.some((t) => /node_modules|generated/.test(t)), `files: ${JSON.stringify(all)}`);
    expect(await turnCount() === turns, 'Enter with the list open sent nothing');
    await key('ArrowDown', 'ArrowDown', 40);
    await waitFor('Down chooses the second', async () => (await chosen())[1] === all[1], 5000);
    await key('ArrowUp', 'ArrowUp', 38);
    await waitFor('Up the first again', async () => (await chosen())[1] === all[0], 5000);
    await send('Input.insertText', { text: 'util' });
    await listed('#file:util narrows them to the one a search sees', ['util.pysrc']);
    await shot('chat-completion', await chatClip());
    await key('Tab', 'Tab', 9);
    await shows('Tab takes it, set apart by a space', 'Explain #file:src/util.py ');
    await listed('the list closed', null);
    expect(JSON.stringify(await chosen()) === JSON.stringify(['false', null]), `closed: ${JSON.stringify(await chosen())}`);
    await send('Input.insertText', { text: 'and #' });
    await listed('# again', ['#file:a file of the workspace…', '#filethe active file', '#selectionthe selection in the editor', '#problemsthe workspace\'s problems']);
    await key('Escape', 'Escape', 27);
    await listed('Escape closes the list', null);
    await shows('... and leaves the text', 'Explain #file:src/util.py and #');
    await key(' ', 'Space', 32, { modifiers: 2 });   // Ctrl+Space: the list again
    await listed('Ctrl+Space shows it again', ['#file:a file of the workspace…', '#filethe active file', '#selectionthe selection in the editor', '#problemsthe workspace\'s problems']);
    await key('Escape', 'Escape', 27);
    await listed('closed again', null);
    await send('Input.insertText', { text: 'pro' });
    await listed('#pro', ['#problemsthe workspace\'s problems']);
    await webClick('#complete li');
    await shows('a click takes it', 'Explain #file:src/util.py and #problems ');
    await waitFor('the input keeps the focus', () => inWeb(`document.hasFocus() && document.activeElement?.id === 'input'`), 5000);
    expect(await turnCount() === turns, 'nothing was sent');
    await clearInput();
    await key(' ', 'Space', 32, { modifiers: 2 });   // in an empty input: a # and its suggestions
    await listed('Ctrl+Space in an empty input', ['#file:a file of the workspace…', '#filethe active file', '#selectionthe selection in the editor', '#problemsthe workspace\'s problems']);
    await shows('the # typed for it', '#');
    await key('Escape', 'Escape', 27);
    await clearInput();
  });
  await check('the context menus (real right clicks): Attach File to the Chat Message in the Explorer\'s menu of a file puts its #file:<path> into the chat input, the chat shown again; Add the Selection to the Chat Message in the editor\'s menu of a selection puts #selection after it', async () => {
    const rightClick = async ({ x, y }) => {
      await send('Input.dispatchMouseEvent', { type: 'mouseMoved', x, y });
      await send('Input.dispatchMouseEvent', { type: 'mousePressed', x, y, button: 'right', buttons: 2, clickCount: 1 });
      await send('Input.dispatchMouseEvent', { type: 'mouseReleased', x, y, button: 'right', buttons: 0, clickCount: 1 });
    };
    // an item of the open context menu, by its title (the workbench draws its menus in a shadow root)
    const menuItem = (title) => evalIn(`(() => {
      const roots = [document, ...[...document.querySelectorAll('.shadow-root-host')].map((h) => h.shadowRoot).filter(Boolean)];
      for (const r of roots) for (const a of r.querySelectorAll('.monaco-menu .action-item .action-label')) {
        if ((a.getAttribute('aria-label') || a.textContent).trim() === ${JSON.stringify(title)}) {
          const b = a.getBoundingClientRect(); return { x: b.left + b.width / 2, y: b.top + b.height / 2 }; } }
      return null; })()`);
    const menuItems = () => evalIn(`[document, ...[...document.querySelectorAll('.shadow-root-host')].map((h) => h.shadowRoot).filter(Boolean)]
      .flatMap((r) => [...r.querySelectorAll('.monaco-menu .action-item .action-label')].map((a) => (a.getAttribute('aria-label') || a.textContent).trim()))`);
    const choose = async (title) => {
      const at = await waitFor(`the menu item "${title}"`, () => menuItem(title), 10000)
        .catch(async (e) => { throw new Error(`${e.message}; the menu has ${JSON.stringify(await menuItems())}`); });
      await send('Input.dispatchMouseEvent', { type: 'mouseMoved', x: at.x, y: at.y });
      await sleep(250);   // (a menu takes no click in the moment it opens)
      await click(at);
    };
    await clearInput();
    await palette('src/util.py', { clear: true, match: 'util.py' });
    await palette('File: Reveal Active File in Explorer View');
    await waitFor('the chat webview gone (the Explorer in the side bar)', async () => !(await findWebview()), STEP);
    const row = '.explorer-folders-view .monaco-list-row.selected';
    await waitFor('util.py selected in the Explorer', () => evalIn(`document.querySelector(${JSON.stringify(row)})?.textContent.trim() === 'util.py'`), 10000);
    // (where the row is once the Explorer has stopped moving: revealing the file expands and scrolls the tree)
    let at = await centerOf(row);
    await waitFor('the Explorer row in place', async () => {
      await sleep(300);
      const now = await centerOf(row), still = now.x === at.x && now.y === at.y;
      at = now;
      return still;
    }, 10000);
    await rightClick(at);
    await choose('Attach File to the Chat Message…');
    await settleWebview();
    await shows('the file\'s #file: in the input', '#file:src/util.py ');
    await waitFor('the input focused', () => inWeb(`document.hasFocus() && document.activeElement?.id === 'input'`), 10000);
    // a selection in the editor: its menu adds #selection at the caret
    const line = await evalIn(`(() => { const l = [...document.querySelectorAll('.editor-instance .monaco-editor .view-line')].find((v) => v.textContent.replace(/\\u00a0/g, ' ').includes('def add'));
      if (!l) return null; const b = l.getBoundingClientRect(); return { x: b.left + 4, y: b.top + b.height / 2 }; })()`);
    expect(line, 'the line of util.py to select');
    await click(line);
    await key('Home', 'Home', 36);
    await key('End', 'End', 35, { modifiers: 8 });   // (Shift: selects the line)
    await waitFor('a selection in the editor', () => evalIn(`!!document.querySelector('.editor-instance .monaco-editor .selected-text')`), 5000);
    await rightClick(await centerOf('.editor-instance .monaco-editor .selected-text'));
    await choose('Add the Selection to the Chat Message');
    await shows('#selection after it', '#file:src/util.py #selection ');
    await clearInput();
    await click(line);   // (no selection left for the checks after this one)
    await waitFor('no selection in the editor', () => evalIn(`!document.querySelector('.editor-instance .monaco-editor .selected-text')`), 5000);
  });
  await check('input history: Up on the first line of the input recalls the chat\'s earlier messages, Down goes back to the draft being typed; inside a multi-line text the caret moves first; kept when the chat is hidden and shown again', async () => {
    const up = () => key('ArrowUp', 'ArrowUp', 38);
    const down = () => key('ArrowDown', 'ArrowDown', 40);
    await type('a draft');
    await up();
    await shows('Up: the newest message', 'This will take forever');
    await up();
    await shows('Up again: the one before', 'One more after the stops');
    await down();
    await shows('Down: the newer one', 'This will take forever');
    await down();
    await shows('Down past the newest: the draft', 'a draft');
    await clearInput();
    await send('Input.insertText', { text: 'line one\nline two' });
    await up();
    await waitFor('Up on the second line moves the caret to the first', async () => (await inWeb(`document.getElementById('input').selectionStart`)) <= 'line one'.length, 5000);
    expect(await inputValue() === 'line one\nline two', 'the multi-line draft is still there');
    await up();
    await shows('Up on the first line: the newest message', 'This will take forever');
    await down();
    await shows('Down: the multi-line draft', 'line one\nline two');
    await clearInput();
    await palette('View: Show Explorer');
    await waitFor('the chat webview gone', async () => !(await findWebview()), STEP);
    await palette('operate-sidecar: Open Chat');
    await settleWebview();
    await waitFor('the chat input focused', () => inWeb(`document.hasFocus() && document.activeElement?.id === 'input'`), 10000);
    await up();
    await shows('shown again, Up: the newest message', 'This will take forever');
    await clearInput();
  });

  await check('a call waiting for a decision without a diff (shout, policy ask): the live region says its keys, its buttons carry them; Ctrl+Backspace in the input still deletes a word, outside it (on a card button) rejects; Ctrl+Enter in the input accepts and the second round answers', async () => {
    const waitingKeys = (call) => `Waiting for your decision: ${call}. Ctrl+Enter accepts, Ctrl+Backspace rejects.`;
    await type('Shout no');
    await submit();
    await waitFor('the card asks', () => lastTurn(`!!t.querySelector('.ask button.accept')`), STEP);
    await waitFor('the live region says the keys', async () => (await inWeb(`document.getElementById('status').textContent`)) === waitingKeys('shout no'), 5000)
      .catch(async (e) => { throw new Error(`${e.message}: ${await inWeb(`document.getElementById('status').textContent`)}`); });
    expect(!(await reviewPending()), 'no diff review');
    const buttons = await lastTurn(`[...t.querySelectorAll('.ask button')].map((b) => [b.textContent, b.getAttribute('aria-keyshortcuts') ?? '', b.tabIndex])`);
    expect(JSON.stringify(buttons) === JSON.stringify([['Accept', 'Control+Enter Meta+Enter', 0], ['Reject', 'Control+Backspace Meta+Backspace', 0],
      ['Always for this branch', '', 0]]), `the card's buttons: ${JSON.stringify(buttons)}`);
    await type('two words');
    await key('Backspace', 'Backspace', 8, { modifiers: 2 });
    await shows('Ctrl+Backspace in the input deletes a word', 'two ');
    expect(await lastTurn(`!!t.querySelector('.ask button.accept:not(:disabled)')`), 'and decided nothing');
    await clearInput();
    await key('Tab', 'Tab', 9, { modifiers: 8 });
    await waitFor('Shift+Tab from the input: a button of the card', () => inWeb(`!!document.activeElement?.closest('.ask')`), 5000);
    await key('Backspace', 'Backspace', 8, { modifiers: 2 });
    await turnDone();
    expect(await lastTurn(`t.querySelector('details.tool summary').textContent`) === '⊘ shout no (rejected)', `rejected: ${await lastTurn(`t.querySelector('details.tool summary').textContent`)}`);
    await type('Shout yes');
    await submit();
    await waitFor('the card asks', () => lastTurn(`!!t.querySelector('.ask button.accept')`), STEP);
    await waitFor('the live region says the keys', async () => (await inWeb(`document.getElementById('status').textContent`)) === waitingKeys('shout yes'), 5000);
    expect(await inWeb(`document.activeElement?.id === 'input'`), 'the focus is in the input');
    const turns = await turnCount();
    await key('Enter', 'Enter', 13, { modifiers: 2 });
    await turnDone();
    const done = await lastTurn(`({ card: t.querySelector('details.tool summary').textContent, prose: [...t.querySelectorAll('.prose')].map((p) => p.textContent.trim()) })`);
    expect(JSON.stringify(done) === JSON.stringify({ card: '✓ shout yes', prose: ['Shouting again.', 'Shouted.'] }), `accepted, the second round answered: ${JSON.stringify(done)}`);
    expect(await turnCount() === turns && await inputValue() === '', 'Ctrl+Enter sent nothing');
  });
  await check('Retry on a failed turn (the model failed: an error, not a stop) sends the same message again as a new turn that answers; the failed turn stays in its place, marked, with its error and Retry', async () => {
    await webClick('#model');
    await quickPickChoose('flaky', 'flaky');
    await waitFor('model in the header', () => inWeb(`document.getElementById('model').textContent === 'flaky'`), 10000);
    await type('Fail, then retry');
    await submit();
    await turnDone();
    const failed = () => inWeb(`JSON.stringify([...document.querySelectorAll('section.turn.failed')].map((t) => [t.querySelector('.user').textContent,
      t.querySelector('.error')?.textContent.includes('the model is down') ?? false, !!t.querySelector('button[data-action=retry]')]))`);
    const marked = JSON.stringify([['Fail, then retry', true, true]]);
    expect(await failed() === marked, `the failed turn: ${await failed()}`);
    expect(await inWeb(`document.getElementById('status').textContent`) === 'Turn failed.', 'the live region says the turn failed');
    const before = await turnCount();
    await webClick('section.turn.failed button[data-action=retry]');
    await waitFor('the retried turn starts', async () => (await turnCount()) === before + 1, 30000);
    await turnDone();
    const last = await lastTurn(`({ user: t.querySelector('.user').textContent, failed: t.classList.contains('failed'), prose: t.querySelector('.prose')?.textContent.trim() })`);
    expect(JSON.stringify(last) === JSON.stringify({ user: 'Fail, then retry', failed: false, prose: 'Up again: retried.' }), `the retried turn: ${JSON.stringify(last)}`);
    expect(await failed() === marked, `the failed turn stays, marked, with its Retry: ${await failed()}`);
    expect(await inWeb(`[...document.querySelectorAll('section.turn')].at(-2).classList.contains('failed')`), 'the failed turn is just before the retried one');
    await webClick('#model');
    await quickPickChoose('default', '(default)');
    await waitFor('model back to the default', () => inWeb(`document.getElementById('model').textContent === 'default model'`), 10000);
  });
  await check('the window reloaded while a review waits: the chat comes back with its conversation, the model\'s thoughts folded where they were (not on the branch: the chat keeps them), its stopped turns in place (marked, with Retry), and the draft in its input (Up recalls the newest message, Down the draft); the turn the reload ended is marked as interrupted (its note, Retry, no Copy) and its call says the turn ended before it was answered, not that it was cancelled; no diff editor is left, util.py untouched', async () => {
    const stoppedTurns = () => inWeb(`JSON.stringify([...document.querySelectorAll('section.turn')].map((t, i) => [i, t.querySelector('.user').textContent,
      t.classList.contains('stopped'), t.querySelector('.note')?.textContent ?? '', !!t.querySelector('button[data-action=retry]')]).filter((x) => x[2]))`);
    const stoppedBefore = await stoppedTurns();
    expect(JSON.parse(stoppedBefore).length === 2, `two stopped turns: ${stoppedBefore}`);
    const before = await inWeb(`[...document.querySelectorAll('section.turn')].map((t) => t.querySelector('.user').textContent)`);
    const thoughts = () => inWeb(`JSON.stringify([...document.querySelectorAll('section.turn')].map((t, i) => [...t.querySelectorAll('details.thought')].map((d) =>
      [i, d.open, d.querySelector('summary').textContent, d.querySelector('.thought-text').textContent.trim()])).flat())`);
    const thoughtsBefore = await thoughts();
    expect(JSON.parse(thoughtsBefore).some((x) => x[3] === THOUGHT), `the first turn's thoughts before the reload: ${thoughtsBefore} (turns: ${JSON.stringify(before)})`);
    await type('Edit util while I reload');
    await submit();
    await waitFor('Reject in the diff editor title', reviewPending, STEP);
    await type('a draft kept through the reload');
    await sleep(300);
    await evalIn(`window.__beforeReload = true`);
    await palette('Developer: Reload Window');
    const reloaded = Date.now();
    await waitFor('the reloaded workbench', () => evalIn(`!window.__beforeReload && !!document.querySelector('.activitybar .action-item a[aria-label^="Sidecar Chat"]')`).catch(() => false), 60000);
    // that activity is the workbench's cached one, shown before the extension host has started: the palette lists the
    // extension's commands only once it has loaded the extension, and one opened earlier never gets them (it filters
    // the commands there were when the text was typed). The chat view was open: the extension, once up, builds it again.
    const workbenchMs = Date.now() - reloaded;
    await waitFor('the chat view built again by the reloaded extension', findWebview, 60000);
    const extensionMs = Date.now() - reloaded;
    await palette('operate-sidecar: Open Chat');
    await settleWebview();
    // the turns the server recorded (the stopped ones were the extension's own); the interrupted turn as far as the server had it
    const users = () => inWeb(`[...document.querySelectorAll('section.turn')].map((t) => t.querySelector('.user')?.textContent ?? '')`);
    await waitFor('the conversation shown again', async () => { const u = await users(); return JSON.stringify(u.slice(0, before.length)) === JSON.stringify(before); }, STEP)
      .catch(async (e) => { throw new Error(`${e.message}: ${JSON.stringify(await users())} (before: ${JSON.stringify(before)})`); });
    const after = await users();
    // the turn the reload ended, as the server recorded it (its first round, the waiting call denied as cancelled)
    expect(JSON.stringify(after) === JSON.stringify([...before, 'Edit util while I reload']), `after the reload: ${JSON.stringify(after)}`);
    expect(await inWeb(`document.getElementById('input').value`) === 'a draft kept through the reload', `the draft: ${JSON.stringify(await inWeb(`document.getElementById('input').value`))}`);
    const INTERRUPTED = 'Interrupted: the turn ended before it finished (it was stopped, or the window was reloaded or the server stopped while it ran).';
    const stoppedAfter = JSON.stringify([...JSON.parse(stoppedBefore), [before.length, 'Edit util while I reload', true, INTERRUPTED, true]]);
    expect(await stoppedTurns() === stoppedAfter, `the stopped turns after the reload: ${await stoppedTurns()} (before: ${stoppedBefore})`);
    const interrupted = await lastTurn(`JSON.stringify({ card: t.querySelector('details.tool summary')?.textContent ?? '', stopped: t.classList.contains('stopped'),
      failed: t.classList.contains('failed'), retry: !!t.querySelector('button[data-action=retry]'), copy: !!t.querySelector('button[data-action=copyReply]') })`);
    expect(interrupted === JSON.stringify({ card: '⊘ edit_file src/util.py (no answer: the turn ended first)', stopped: true, failed: false, retry: true, copy: false }),
      `the interrupted turn: ${interrupted}`);
    expect(await thoughts() === thoughtsBefore, `the thoughts after the reload: ${await thoughts()} (before: ${thoughtsBefore})`);
    await waitFor('the chat input focused', () => inWeb(`document.hasFocus() && document.activeElement?.id === 'input'`), 10000);
    const newest = after.at(-1);
    await key('ArrowUp', 'ArrowUp', 38);
    await waitFor(`Up: the newest message (${newest})`, async () => (await inputValue()) === newest, 5000);
    await key('ArrowDown', 'ArrowDown', 40);
    await waitFor('Down: the draft again', async () => (await inputValue()) === 'a draft kept through the reload', 5000);
    await waitFor('no diff editor of a proposed text', async () => !(await evalIn(`[...document.querySelectorAll('.tabs-container .tab')].some((t) => (t.getAttribute('aria-label') ?? '').includes('proposed'))`)), 15000);
    expect(disk('src/util.py') === UTIL_OLD && !(await tabDirty('util.py')), 'util.py untouched');
    return { workbenchMs, extensionMs };   // after the reload: the workbench (its cached activity bar), the extension's chat view
  });
  await shot('chat-final', await chatClip());

  await check('Retry on a turn stopped after its first round (a call waited for a decision): the branch holds its message with the #file sent then, so the retried message goes without it: the model reads the file once, the retried turn shows no attachment, the Retry button says why', async () => {
    const prompts = () => { try { return fs.readFileSync(path.join(W, 'asker-state.prompts'), 'utf8').trim().split('\n').filter(Boolean).map((l) => JSON.parse(l)); } catch { return []; } };
    const times = (text, what) => text.split(what).length - 1;
    const FILE_MARK = "name.upper() + '!'";   // in src/app.py (saved above), in no message
    await palette('src/app.py', { clear: true, match: 'app.py' });
    await waitFor('app.py in the editor', async () => (await editorText())?.includes(FILE_MARK), 10000);
    await webClick('#new');
    await waitFor('an empty chat', () => inWeb(`!!document.querySelector('.empty')`), 10000);
    await webClick('#model');
    await quickPickChoose('asker', 'asker');
    await waitFor('model in the header', () => inWeb(`document.getElementById('model').textContent === 'asker'`), 10000);
    await clearInput();   // (the draft kept through the reload)
    await type('Shout about #file');
    await submit();
    await waitFor('the card asks', () => lastTurn(`!!t.querySelector('.ask button.accept')`), STEP);
    await webClick('#stop');
    await turnDone();
    const message = (t) => `${t}.querySelector('.user').firstChild.textContent`;   // (the message: the chips follow it)
    const stopped = () => inWeb(`JSON.stringify([...document.querySelectorAll('section.turn.stopped')].map((t) => [${message('t')},
      [...t.querySelectorAll('.chip')].map((c) => c.textContent), t.querySelector('button[data-action=retry]')?.title ?? null]))`);
    const marked = JSON.stringify([['Shout about #file', ['src/app.py'],
      'Send this message again (what was attached to it is in this turn already: not sent twice)']]);
    expect(await stopped() === marked, `the stopped turn, as the branch holds it (its #file), with Retry: ${await stopped()}`);
    const first = prompts();
    expect(first.length === 1 && times(first[0], FILE_MARK) === 1, `the first round read the file once: ${first.map((p) => times(p, FILE_MARK))}`);
    const before = await turnCount();
    await webClick('section.turn.stopped button[data-action=retry]');
    await waitFor('the retried turn starts', async () => (await turnCount()) === before + 1, 30000);
    await turnDone();
    const all = prompts();
    expect(all.length === 2 && times(all[1], FILE_MARK) === 1,
      `the retry's model call read the file once (in the stopped turn's message), not twice: ${all.map((p) => times(p, FILE_MARK))}`);
    const last = await lastTurn(`({ user: ${message('t')}, chips: [...t.querySelectorAll('.chip')].map((c) => c.textContent),
      stopped: t.classList.contains('stopped'), prose: t.querySelector('.prose')?.textContent.trim() })`);
    expect(JSON.stringify(last) === JSON.stringify({ user: 'Shout about #file', chips: [], stopped: false, prose: 'Retried: the file once.' }),
      `the retried turn (as the branch holds it: no context): ${JSON.stringify(last)}`);
    expect(await stopped() === marked, `the stopped turn stays as it was: ${await stopped()}`);
  });
  await check('a reply not in the expected format (a turn that asks for one, sent by a key bound to the chat command): while the model is asked again, the running turn\'s status line and the polite live region read the repair attempt (said once); both go when the turn ends', async () => {
    const REPAIR = 'the reply was not in the expected format: asking the model again (attempt 1)…';
    await webClick('#new');
    await waitFor('an empty chat', () => inWeb(`!!document.querySelector('.empty')`), 10000);
    await webClick('#model');
    await quickPickChoose('mender', 'mender');
    await waitFor('model in the header', () => inWeb(`document.getElementById('model').textContent === 'mender'`), 10000);
    await inWeb(`window.__said = []; const st = document.getElementById('status'); new MutationObserver(() => window.__said.push(st.textContent))
      .observe(st, { childList: true, subtree: true, characterData: true }); true`);
    const statusLine = () => lastTurn(`t.querySelector('.running')?.textContent.trim() ?? null`);
    const liveRegion = () => inWeb(`document.getElementById('status').textContent`);
    await click(await centerOf('.editor-instance .monaco-editor .view-lines'));
    await waitFor('the editor focused', () => evalIn(`!!document.activeElement?.closest('.editor-instance')`), 10000);
    const t0 = Date.now();
    await key('F10', 'F10', 121, { modifiers: 2 | 1 | 8 });   // Ctrl+Shift+Alt+F10 (keybindings.json)
    await waitFor('the turn starts', () => lastTurn(`t.querySelector('.user')?.firstChild?.textContent === ${JSON.stringify(FORMAT_TURN)}`), 10000);
    const read = [];   // what the status line read meanwhile (null: no status line, the turn over), for the error
    await waitFor('the status line reads the repair attempt', async () => {
      const now = await statusLine();
      if (read.at(-1) !== now) read.push(now);
      return now === REPAIR;
    }, REPAIR_DELAY_MS + 5000, 50).catch((e) => { throw new Error(`${e.message}; it read ${JSON.stringify(read)}`); });
    await waitFor('the live region reads it', async () => (await liveRegion()) === REPAIR, REPAIR_DELAY_MS, 50)
      .catch(async (e) => { throw new Error(`${e.message}: ${JSON.stringify(await liveRegion())}`); });
    const waited = Date.now() - t0;
    // (read while the repair reply waited: the turn had not ended)
    expect(await inWeb(`document.body.classList.contains('running')`) && await statusLine() === REPAIR, 'the turn still runs, its status the repair');
    await turnDone();
    expect(await statusLine() === null, `no status line once the turn ended: ${JSON.stringify(await statusLine())}`);
    expect(await liveRegion() === 'Turn finished.', `the live region: ${JSON.stringify(await liveRegion())}`);
    const said = await inWeb('window.__said');
    expect(said.filter((x) => x === REPAIR).length === 1 && said.at(-1) === 'Turn finished.' && said.every((x, i) => i === 0 || x !== said[i - 1]),
      `the live region said the repair once, then the end: ${JSON.stringify(said)}`);
    return { waitedMs: waited, said };
  });
  // (the last check: a drag the protocol intercepted leaves the browser's drag session open, and a page reloaded after
  // it took no keys in the window reload check, which passes with the same drops made up instead; nothing is reloaded now)
  await check('files dragged onto the chat with Shift held: an editor tab dragged for real (Chromium starts the drag, the protocol hands over its data) and dropped on the input puts its #file: at the caret; a drag of several files and a folder (the workbench\'s own list of them) puts each file\'s; a folder alone: a message, nothing in the input; a file dropped on the start of the input\'s text goes in there', async () => {
    const SHIFT = 8;
    /** A real drag from `from` with the mouse, until Chromium starts it: its data (intercepted, so no drag of the OS runs). */
    const startDrag = async (from) => {
      let data;
      const off = cdp.on((m, p, sid) => { if (m === 'Input.dragIntercepted' && sid === S) data = p.data; });
      try {
        await send('Input.setInterceptDrags', { enabled: true });
        await send('Input.dispatchMouseEvent', { type: 'mouseMoved', x: from.x, y: from.y });
        await send('Input.dispatchMouseEvent', { type: 'mousePressed', x: from.x, y: from.y, button: 'left', buttons: 1, clickCount: 1 });
        for (let d = 5; d <= 60 && !data; d += 5) {
          await send('Input.dispatchMouseEvent', { type: 'mouseMoved', x: from.x + d, y: from.y + d, button: 'left', buttons: 1 });
          await sleep(40);
        }
        return await waitFor('the drag started (its data intercepted)', () => data, 5000);
      } finally { off(); }
    };
    /** `data` dragged over `to` and dropped there with `modifiers` held, then the mouse let go. */
    const dropAt = async (data, to, modifiers = SHIFT) => {
      try {
        await send('Input.dispatchDragEvent', { type: 'dragEnter', x: to.x, y: to.y, data, modifiers });
        for (let i = 0; i < 3; i++) { await send('Input.dispatchDragEvent', { type: 'dragOver', x: to.x, y: to.y, data, modifiers }); await sleep(60); }
        await send('Input.dispatchDragEvent', { type: 'drop', x: to.x, y: to.y, data, modifiers });
      } finally {
        await send('Input.dispatchMouseEvent', { type: 'mouseReleased', x: to.x, y: to.y, button: 'left', buttons: 0, clickCount: 1 });
        await send('Input.dispatchMouseEvent', { type: 'mouseMoved', x: to.x, y: to.y + 1 });
        await send('Input.setInterceptDrags', { enabled: false });
      }
    };
    await palette('src/util.py', { clear: true, match: 'util.py' });   // (its editor tab, dragged below)
    await palette('operate-sidecar: Open Chat');
    await settleWebview();
    await clearInput();
    await type('Compare');
    const tab = await evalIn(`(() => { const t = [...document.querySelectorAll('.tabs-container .tab')].find((x) => x.textContent.includes('util.py'));
      if (!t) return null; const b = t.getBoundingClientRect(); return { x: b.left + b.width / 2, y: b.top + b.height / 2 }; })()`);
    expect(tab, 'the util.py editor tab');
    const data = await startDrag(tab);
    await dropAt(data, await webCenter('#input'));
    await shows('the tab\'s file at the caret', 'Compare #file:src/util.py ');
    // the workbench's list of several resources (an Explorer selection of two files and a folder): each file, the folder left out
    const util = JSON.parse(data.items.find((i) => i.mimeType === 'resourceurls')?.data ?? '[]')[0];
    expect(util && util.endsWith('/src/util.py'), `the tab's URI: ${JSON.stringify(data.items)}`);
    const src = util.slice(0, -'/util.py'.length);
    const several = { items: [{ mimeType: 'text/uri-list', data: `${src}/app.py` }, { mimeType: 'application/vnd.code.uri-list', data: `${src}/app.py\r\n${src}\r\n${src}/util.py` }],
      dragOperationsMask: 1 };
    await dropAt(several, await webCenter('#input'));
    await shows('each file of the list', 'Compare #file:src/util.py #file:src/app.py #file:src/util.py ');
    const text = await inputValue();
    await dropAt({ items: [{ mimeType: 'text/uri-list', data: src }], dragOperationsMask: 1 }, await webCenter('#input'));
    await waitFor('a message: only files', () => evalIn(`[...document.querySelectorAll('.notifications-toasts .notification-list-item-message')]
      .some((m) => m.textContent.includes('only files on the disk can be attached'))`), 10000);
    expect(await inputValue() === text, `the input unchanged: ${JSON.stringify(await inputValue())}`);
    // dropped on the input's text, at its start (the caret at its end): its #file: goes in where it was dropped
    await dropAt({ items: [{ mimeType: 'text/uri-list', data: `${src}/app.py` }], dragOperationsMask: 1 }, await webCenter('#input', { x: 8, y: 14 }));
    await shows('the file where it was dropped', `#file:src/app.py ${text}`);
    await palette('Notifications: Clear All Notifications');
    await clearInput();
  });
  await shot('workbench');
  cdp.close();
}
let failShot = async () => undefined;

let error;
try { await main(); } catch (e) { error = String(e?.stack ?? e); await failShot(); }
await killAll();
timings.totalMs = Date.now() - t0;
const ok = !error && checks.length > 0 && checks.every((c) => c.ok);
process.stdout.write(JSON.stringify({ ok, error, checks, timings, screenshots: fs.readdirSync(OUT).filter((f) => f.endsWith('.png')),
  workDir: KEEP || !ok ? W : undefined, codeServerLog: ok ? undefined : tail('code-server.log') }, null, 2) + '\n');
if (ok && !KEEP) fs.rmSync(W, { recursive: true, force: true });
process.exit(ok ? 0 : (checks.length ? 1 : 3));
