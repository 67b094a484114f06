// The chat view (chatView.ts) and the extension (extension.ts) against a scripted client, with a stand-in for the
// `vscode` module (below): what reaches a chat turn when another operate runs on its branch, a read of a chat that
// answers late, the webview's messages, a model error that is no server death, a permissionAnswer setting that is
// none of its values. The real workbench and server: src/itest.
// Run: tsc -p . && node --test out/test/
import { test } from 'node:test';
import * as assert from 'node:assert/strict';
import Module = require('node:module');
import type { BranchStore as BranchStoreT } from '../branchStore';
import type { ChatView as ChatViewT } from '../chatView';
import type { DiffReview as DiffReviewT, clientFs as ClientFsT, firstNonUtf8Byte as FirstNonUtf8ByteT } from '../diffReview';
import type * as ExtensionT from '../extension';
import * as os from 'node:os';
import * as path from 'node:path';
import { CancellationTokenSource, ErrorCodes, Message, OperateParams, OperateResult, PermissionDecision, PermissionHandler, PermissionRequest, ResponseError,
  SidecarClient } from '../rpcClient';

// ---- a stand-in for `vscode`: enough for the chat view to run; it records the commands run and the messages shown,
// its webview what is posted, and hands the test the view's message listener. `require('vscode')` resolves to it.
const log = { commands: [] as unknown[][], errors: [] as string[], infos: [] as string[], picks: [] as unknown[] };

class EventEmitter<T> {
  private readonly listeners = new Set<(v: T) => void>();
  readonly event = (l: (v: T) => void) => { this.listeners.add(l); return { dispose: () => this.listeners.delete(l) }; };
  fire(v: T): void { for (const l of [...this.listeners]) l(v); }
  dispose(): void { this.listeners.clear(); }
}
class Uri {
  constructor(readonly scheme: string, readonly path: string) {}
  get fsPath(): string { return this.path; }
  static file(p: string): Uri { return new Uri('file', p); }
  static parse(s: string): Uri { const m = /^([a-z-]+):(?:\/\/)?(.*)$/.exec(s); return new Uri(m ? m[1] : 'file', m ? m[2] : s); }
  static joinPath(u: Uri, ...p: string[]): Uri { return new Uri(u.scheme, [u.path, ...p].join('/')); }
  toString(): string { return `${this.scheme}://${this.path}`; }
}
const none = () => ({ dispose() { /* nothing */ } });
class FileSystemError extends Error {
  constructor(readonly code: string) { super(code); }
}
/** The editor's open documents (the stand-in's workspace.textDocuments) and the files on its disk (workspace.fs). */
const docs: { uri: Uri; isDirty: boolean; getText: () => string }[] = [];
const files = new Map<string, Uint8Array>();
const edits: unknown[] = [];

/** The settings the extension reads (operateSidecar.*): defaults unless a test sets one. */
const settings = new Map<string, unknown>();
const vscode = {
  EventEmitter, Uri, FileSystemError, version: '1.99.3',
  Position: class { constructor(readonly line: number, readonly character: number) {} },
  Range: class { constructor(readonly start: unknown, readonly end: unknown) {} },
  WorkspaceEdit: class {
    readonly ops: unknown[] = [];
    createFile(u: Uri) { this.ops.push(['create', u.path]); }
    insert(u: Uri, _at: unknown, t: string) { this.ops.push(['insert', u.path, t]); }
    replace(u: Uri, _r: unknown, t: string) { this.ops.push(['replace', u.path, t]); }
  }, StatusBarAlignment: { Left: 1 }, ProgressLocation: { Notification: 15 },
  Disposable: class { constructor(private readonly f?: () => void) {} dispose() { this.f?.(); } },
  ThemeColor: class { constructor(readonly id: string) {} },
  commands: { executeCommand: async (id: string, ...a: unknown[]) => { log.commands.push([id, ...a]); }, registerCommand: none },

  env: { clipboard: { writeText: async () => undefined } },
  languages: { getDiagnostics: () => [] },
  window: {
    registerWebviewViewProvider: none, activeTextEditor: undefined, visibleTextEditors: [], onDidChangeActiveTextEditor: none,
    showErrorMessage: async (m: string) => { log.errors.push(m); }, showWarningMessage: async (m: string) => { log.errors.push(m); },
    showInformationMessage: async (m: string) => { log.infos.push(m); }, tabGroups: { all: [], close: async () => true, onDidChangeTabs: none },
    showTextDocument: async () => undefined, showQuickPick: async (items: unknown) => { log.picks.push(items); return undefined; },
    createOutputChannel: () => ({ append() { /* */ }, appendLine() { /* */ }, show() { /* */ }, dispose() { /* */ } }),
    createStatusBarItem: () => ({ show() { /* */ }, dispose() { /* */ } }),
  },
  workspace: {
    workspaceFolders: [{ uri: Uri.file('/ws'), name: 'ws' }], textDocuments: docs, onDidChangeConfiguration: none,
    getConfiguration: () => ({ get: (k: string, d: unknown) => (settings.has(k) ? settings.get(k) : d) }),
    registerTextDocumentContentProvider: none, asRelativePath: (u: Uri | string) => String(typeof u === 'string' ? u : u.path),
    findFiles: async () => [], getWorkspaceFolder: () => undefined, applyEdit: async (e: { ops: unknown[] }) => { edits.push(...e.ops); return true; },
    // a file the test put in `files`, else an empty one (the chat tests' previews)
    fs: {
      stat: async (u: Uri) => { if (files.size && !files.has(u.path)) throw new FileSystemError('FileNotFound'); return {}; },
      readFile: async (u: Uri) => { if (files.size && !files.has(u.path)) throw new FileSystemError('FileNotFound'); return files.get(u.path) ?? Buffer.from(''); },
    },
    openTextDocument: async (o: object) => ({ getText: () => '', positionAt: (n: number) => n, ...o }),
  },
};

const M = Module as unknown as { _resolveFilename: (req: string, ...rest: unknown[]) => string };
const resolve = M._resolveFilename;
M._resolveFilename = function (req: string, ...rest: unknown[]) { return req === 'vscode' ? 'vscode' : resolve.call(this, req, ...rest); };
require.cache.vscode = { id: 'vscode', filename: 'vscode', loaded: true, exports: vscode } as NodeJS.Module;

/** A workspace state (Memento) in memory. */
function memento() {
  const m = new Map<string, unknown>();
  return { get: (k: string, d?: unknown) => (m.has(k) ? m.get(k) : d), update: async (k: string, v: unknown) => { m.set(k, v); }, keys: () => [...m.keys()] };
}

/** A webview view: what the chat posts to it, and `send` to post the chat a message as its page would. */
function webviewView() {
  const posted: { type: string; [k: string]: unknown }[] = [];
  let listener: ((m: unknown) => Promise<void>) | undefined;
  const view = {
    visible: true, badge: undefined as unknown,
    webview: { options: {}, html: '', cspSource: 'x', asWebviewUri: (u: Uri) => u,
      postMessage: async (m: { type: string }) => { posted.push(m); return true; },
      onDidReceiveMessage: (f: (m: unknown) => Promise<void>) => { listener = f; return none(); } },
    onDidDispose: none, onDidChangeVisibility: none,
  };
  return { view, posted, send: (m: unknown) => listener!(m) };
}

const { BranchStore } = require('../branchStore') as { BranchStore: typeof BranchStoreT };
const { ChatView } = require('../chatView') as { ChatView: typeof ChatViewT };
const { DiffReview, clientFs, firstNonUtf8Byte } = require('../diffReview') as
  { DiffReview: typeof DiffReviewT; clientFs: typeof ClientFsT; firstNonUtf8Byte: typeof FirstNonUtf8ByteT };
const extension = require('../extension') as typeof ExtensionT;

/** Resolves once `cond` holds; fails after `ms`. */
async function until(cond: () => boolean, what: string, ms = 3000): Promise<void> {
  const end = Date.now() + ms;
  while (!cond()) {
    if (Date.now() > end) throw new Error(`timeout after ${ms} ms: ${what}`);
    await new Promise((r) => setTimeout(r, 5));
  }
}
/** What `p` settled to within `ms`, else 'waiting'. */
function settled<T>(p: Promise<T>, ms = 200): Promise<T | 'waiting'> {
  let timer: NodeJS.Timeout;
  return Promise.race([p, new Promise<'waiting'>((r) => { timer = setTimeout(() => r('waiting'), ms); })]).finally(() => clearTimeout(timer));
}

const msg = (kind: string, content: object): Message => ({ kind, content, createdAt: 1 } as unknown as Message);
const turn = (instruction: string, text: string) => [msg('instruction', { instruction }), msg('assistant_response', { text, usage: { inputTokens: 1, outputTokens: 1 } })];

interface Op { params: OperateParams; progress: (v: object) => void; resolve: (r: OperateResult) => void; reject: (e: unknown) => void }
/** The client's calls the chat makes, scripted: branches with their messages (a read of one in `slow` answers after that many ms); operates resolved by the test. */
class FakeClient {
  running = true;
  readonly branches = new Map<string, Message[]>();
  readonly slow = new Map<string, number>();
  readonly ops: Op[] = [];
  private n = 0;
  private readonly answered = new Map<string, { done: Promise<void>; resolve: () => void }>();
  /** Resolves once a read of branch `id` has answered (the first one; also when it answered before this call). */
  readAnswered(id: string): Promise<void> { return this.answer(id).done; }
  private answer(id: string) {
    let a = this.answered.get(id);
    if (!a) { let resolve!: () => void; const done = new Promise<void>((r) => { resolve = r; }); a = { done, resolve }; this.answered.set(id, a); }
    return a;
  }
  async createBranch() { const id = `new${++this.n}`; this.branches.set(id, []); return { branchId: id }; }
  async branchMessages(id: string, offset = 0, limit = 1000) {
    const ms = this.slow.get(id);
    if (ms) await new Promise((r) => setTimeout(r, ms));
    this.answer(id).resolve();
    const all = this.branches.get(id);
    if (!all) throw new ResponseError(ErrorCodes.BranchNotFound, `branch not found: ${id}`);
    return { messages: all.slice(offset, offset + limit), total: all.length };
  }
  operate(params: OperateParams, opts: { onProgress?: (v: object) => void }): Promise<OperateResult> {
    return new Promise((resolve, reject) => this.ops.push({ params, progress: (v) => opts.onProgress?.(v), resolve, reject }));
  }
}
const result = (text: string) => ({ result: text, kind: 'text', model: null, usage: { inputTokens: 1, outputTokens: 1, contextTokens: 1, modelCalls: 1 }, rounds: 1 } as unknown as OperateResult);

function makeChat() {
  const client = new FakeClient();
  const branches = new BranchStore(memento() as never);
  const lines: string[] = [];
  const host = { ensure: async () => client, current: () => (client.running ? client : undefined), branches, editors: { editor: undefined }, review: new DiffReview(),
    maxRounds: () => 1, runningChanged() { /* no status bar */ }, line: (t: string) => lines.push(t), serverProblem: () => undefined };
  const chat = new ChatView({ extensionUri: vscode.Uri.file('/ext') } as never, host as never);
  const page = webviewView();
  chat.resolveWebviewView(page.view as never);
  return { chat, client, branches, lines, ...page };
}

test('an operate on the chat\'s branch started elsewhere (the Operate command) keeps its tool events and permission requests; the chat turn waiting behind it reads back its own turn, kept once', async () => {
  const { chat, client, branches, send } = makeChat();
  client.branches.set('B', [...turn('earlier question', 'earlier answer')]);
  await send({ type: 'ready', mod: 'Ctrl' });
  await branches.setCurrent('B');
  await chat.refresh();
  // the Operate command's operate runs on B (sent first); the chat's is sent and waits for the branch
  const done = chat.send('chat question');
  await until(() => client.ops.length === 1, 'the chat\'s operate sent');
  const foreign = (callId: string) => ({ seq: 1, branchId: 'B', callId, event: 'pre', tool: 'list_dir', argsSummary: '{"path":"."}' } as const);
  const request = (callId: string): PermissionRequest => ({ branchId: 'B', callId, tool: 'shout', arguments: { text: 'x' }, options: ['allow_once', 'allow_always', 'deny_once', 'deny_always'] });
  chat.onToolEvent(foreign('cmd-1'));
  assert.deepEqual(chat.stats().cards, []);
  assert.equal(chat.owns(request('cmd-2')), false);
  // the chat's operate has the branch: its progress began
  client.ops[0].progress({ kind: 'begin', title: 'operate', message: 'communicate' });
  client.ops[0].progress({ kind: 'report', message: 'calling m', phase: 'request' });
  chat.onToolEvent({ seq: 2, branchId: 'B', callId: 'chat-1', event: 'pre', tool: 'read_file', argsSummary: '{"path":"a.py"}' });
  assert.deepEqual(chat.stats().cards.map((c) => c.title), ['… read_file a.py']);
  assert.equal(chat.owns(request('chat-2')), true);
  chat.onToolEvent({ seq: 3, branchId: 'B', callId: 'chat-1', event: 'post', tool: 'read_file', argsSummary: '{"path":"a.py"}', resultSummary: '"x"' });
  // its progress ended: what follows on B is an operate sent after it
  client.ops[0].progress({ kind: 'end', message: 'completed' });
  chat.onToolEvent(foreign('later-1'));
  assert.equal(chat.owns(request('later-2')), false);
  assert.deepEqual(chat.stats().cards.map((c) => c.title), ['✓ read_file a.py']);
  // the branch recorded the Operate command's turn first, then the chat's
  client.branches.get('B')!.push(...turn('instruction of the Operate command', 'its answer'), ...turn('chat question', 'chat answer'));
  client.ops[0].resolve(result('chat answer'));
  const o = await done;
  assert.equal(o.error, undefined);
  assert.deepEqual(chat.shownTurns().map((t) => t.user), ['earlier question', 'instruction of the Operate command', 'chat question']);
  assert.deepEqual(branches.localTurns('B'), []);
});

test('switching chats quickly: the chat picked last is shown, also when the read of the one picked before answers after its read (latest wins)', async () => {
  const { chat, client, branches, send, posted } = makeChat();
  client.branches.set('A', [...turn('question in chat A', 'answer A')]);
  client.branches.set('B', [...turn('question in chat B', 'answer B')]);
  client.slow.set('A', 150);   // chat A is long, or the server busy: its read answers later
  branches.onDidChangeCurrent(() => { if (!chat.running) void chat.refresh(); });   // (as the extension does)
  await send({ type: 'ready', mod: 'Ctrl' });
  branches.remember('A', 'Chat A');
  branches.remember('B', 'Chat B');
  await branches.setCurrent('A');
  await branches.setCurrent('B');
  await until(() => chat.shownTurns()[0]?.user === 'question in chat B', 'chat B shown');
  // chat A's read answers after B is shown; then the chat's handling of it (no further reads) has run
  let aAnswered = false;
  void client.readAnswered('A').then(() => { aAnswered = true; });
  await until(() => aAnswered, 'chat A\'s read answered');
  await new Promise((r) => setImmediate(r));
  assert.deepEqual(chat.shownTurns().map((t) => t.user), ['question in chat B']);
  assert.equal(posted.filter((m) => m.type === 'state').at(-1)?.branch, 'Chat B');
});

test('the webview\'s messages are checked: a decision the request did not offer, or none, answers nothing (the request waits on for a proper one); only the page\'s own commands run', async () => {
  const { chat, client, send, lines } = makeChat();
  await send({ type: 'ready', mod: 'Ctrl' });
  const done = chat.send('edit it');
  await until(() => client.ops.length === 1, 'the operate sent');
  client.ops[0].progress({ kind: 'begin', title: 'operate', message: 'communicate' });
  const branchId = chat.runningBranch()!;
  const ask = (callId: string, options: PermissionDecision[] = ['allow_once', 'allow_always', 'deny_once', 'deny_always']) =>
    chat.ask({ branchId, callId, tool: 'shout', arguments: { text: 'x' }, options }, new CancellationTokenSource().token);
  const a1 = ask('c1');
  await until(() => chat.stats().pendingAsks.includes('c1'), 'c1 waits');
  await send({ type: 'decide', callId: 'c1', decision: 'allow_everything' });
  await send({ type: 'decide', callId: 'c1' });
  await send({ type: 'decide', callId: 'c1', decision: 7 });
  assert.equal(await settled(a1), 'waiting');
  assert.deepEqual(chat.stats().pendingAsks, ['c1']);
  assert.equal(log.errors.length, 0, log.errors.join('\n'));
  await send({ type: 'decide', callId: 'c1', decision: 'allow_once' });
  assert.equal(await settled(a1), 'allow_once');
  // a request that offers fewer options: a decision it did not offer is not sent
  const a2 = ask('c2', ['allow_once', 'deny_once']);
  await until(() => chat.stats().pendingAsks.includes('c2'), 'c2 waits');
  await send({ type: 'decide', callId: 'c2', decision: 'allow_always' });
  assert.equal(await settled(a2), 'waiting');
  await send({ type: 'decide', callId: 'c2', decision: 'deny_once' });
  assert.equal(await settled(a2), 'deny_once');
  // commands: the header's buttons' only
  const ran = () => log.commands.map((c) => c[0]).filter((id) => id !== 'setContext');
  await send({ type: 'command', id: 'workbench.action.closeAllEditors' });
  await send({ type: 'command', id: 'operateSidecar.deleteBranch' });
  await send({ type: 'command' });
  assert.deepEqual(ran(), []);
  await send({ type: 'command', id: 'operateSidecar.pickModel' });
  assert.deepEqual(ran(), ['operateSidecar.pickModel']);
  assert.ok(lines.filter((l) => l.startsWith('[chat] ignored')).length >= 6, lines.join('\n'));
  client.ops[0].resolve(result('done'));
  await done;
});

/**
 * The extension activated on a FakeClient (SidecarClient.start answers it): its API, its chat view, the permission
 * handler it gave the client. The server runs (its `exited` never settles) unless a test says otherwise.
 */
async function activated() {
  const client = Object.assign(new FakeClient(), {
    exited: new Promise<number>(() => undefined), kill() { /* */ }, async stop() { /* */ },
    onToolEvent() { /* */ }, onLogMessage() { /* */ }, setFsHandlers() { /* */ },
    handler: undefined as PermissionHandler | undefined,
    setPermissionHandler(h: PermissionHandler) { client.handler = h; },
    async initialize() { return { serverInfo: { name: 'fake', version: '1' }, capabilities: { models: ['m'], stateDir: null } }; },
    async listBranches() { return { branches: [] }; },
  });
  (SidecarClient as unknown as { start: () => Promise<unknown> }).start = async () => client;
  const ctx = { subscriptions: [] as unknown[], workspaceState: memento(), extensionUri: Uri.file('/ext'),
    globalStorageUri: Uri.file(path.join(os.tmpdir(), `operate-sidecar-unit-${process.pid}`)) };
  const api = extension.activate(ctx as never);
  const chat = ctx.subscriptions.find((x) => x instanceof ChatView) as ChatViewT;
  return { api, chat, client, ctx };
}

test('a model error with "closed" in its words, from a running server, is the turn\'s error as it is: not "the server is not running"', async () => {
  const { api, chat, client } = await activated();
  const done = chat.send('think hard');
  await until(() => client.ops.length === 1, 'the operate sent');
  const said = "model 'qwen3': the reply ended inside the model's thoughts (a <think> block that was never closed), with no answer after them";
  client.ops[0].reject(new ResponseError(-32011, said));
  const o = await done;
  assert.equal(o.error, said);
  assert.equal(api.chatTurns().at(-1)?.error, said);
});

test('a permissionAnswer setting that is none of its values ("allow") is reported once, naming the setting and its values, and asks as if unset: in the chat\'s card, not in a bare quick pick', async () => {
  settings.set('permissionAnswer', 'allow');
  try {
    const { api, chat, client } = await activated();
    const done = chat.send('fix the bug');
    await until(() => client.ops.length === 1, 'the operate sent');
    client.ops[0].progress({ kind: 'begin', title: 'operate', message: 'communicate' });
    const req = (callId: string): PermissionRequest => ({ branchId: chat.runningBranch()!, callId, tool: 'shout', arguments: { text: 'x' },
      options: ['allow_once', 'allow_always', 'deny_once', 'deny_always'] });
    const picks = log.picks.length;
    const d1 = client.handler!(req('c1'), new CancellationTokenSource().token);
    await until(() => chat.stats().pendingAsks.includes('c1'), 'the chat\'s card asks');
    const d2 = client.handler!(req('c2'), new CancellationTokenSource().token);
    await until(() => chat.stats().pendingAsks.includes('c2'), 'the second card asks');
    assert.equal(log.picks.length, picks);
    const notices = api.notices().filter((n) => n.message.includes('operateSidecar.permissionAnswer'));
    assert.equal(notices.length, 1, JSON.stringify(api.notices()));
    assert.ok(notices[0].message.includes('"allow"') && notices[0].message.includes('allow_once, allow_always, deny_once, deny_always'), notices[0].message);
    chat.decide('c1', 'allow_once');
    chat.decide('c2', 'deny_once');
    assert.deepEqual([await settled(Promise.resolve(d1)), await settled(Promise.resolve(d2))], ['allow_once', 'deny_once']);
    client.ops[0].resolve(result('done'));
    await done;
  } finally {
    settings.delete('permissionAnswer');
  }
});

test('the server exits while a chat turn\'s call waits for a decision (its request\'s token cancelled, as the client does on exit; or the turn ends first): the ask is withdrawn, the card failed, nothing waits; a late decision decides nothing', async () => {
  for (const first of ['token', 'turn'] as const) {
    const { chat, client, send } = makeChat();
    await send({ type: 'ready', mod: 'Ctrl' });
    const done = chat.send('edit it');
    await until(() => client.ops.length === 1, 'the operate sent');
    client.ops[0].progress({ kind: 'begin', title: 'operate', message: 'communicate' });
    const source = new CancellationTokenSource();
    const asked = chat.ask({ branchId: chat.runningBranch()!, callId: 'c1', tool: 'shout', arguments: { text: 'x' },
      options: ['allow_once', 'allow_always', 'deny_once', 'deny_always'] }, source.token);
    await until(() => chat.stats().pendingAsks.includes('c1'), 'c1 waits');
    assert.equal(chat.waiting, 1);
    client.running = false;   // the server process is gone
    if (first === 'token') source.cancel();
    client.ops[0].reject(new Error('operate-sidecar: the server exited (signal SIGKILL) before answering operate'));
    const o = await done;
    if (first === 'turn') source.cancel();
    assert.ok(o.error, `${first}: the turn failed`);
    assert.equal(await settled(Promise.resolve(asked)), 'deny_once', `${first}: the request is answered (an answer nobody reads)`);
    assert.deepEqual(chat.stats().pendingAsks, [], `${first}: nothing waits`);
    assert.equal(chat.waiting, 0);
    assert.equal(chat.stats().badge, 0);
    const cards = () => chat.shownTurns().at(-1)?.cards;
    assert.deepEqual(cards(), ['✗ shout x'], `${first}: the card failed, not denied`);
    assert.equal(chat.decide('c1', 'allow_once'), false, `${first}: a late Accept decides nothing`);
    assert.deepEqual(cards(), ['✗ shout x'], `${first}: the card stays failed`);
  }
});

test('firstNonUtf8Byte: where bytes stop being UTF-8 (as Python says it: the start of the bad sequence); -1 for UTF-8', () => {
  const at = (...b: number[]) => firstNonUtf8Byte(Uint8Array.from(b));
  assert.equal(firstNonUtf8Byte(Buffer.from('café ☃ 𝄞 plain', 'utf8')), -1);
  assert.equal(firstNonUtf8Byte(Buffer.from('caf\xe9 cr\xe8me', 'latin1')), 3);
  assert.equal(at(0x61, 0xc0, 0x80), 1, 'an overlong form');
  assert.equal(at(0xe0, 0x80, 0x80), 0, 'an overlong three-byte form');
  assert.equal(at(0xed, 0xa0, 0x80), 0, 'a surrogate');
  assert.equal(at(0xf4, 0x90, 0x80, 0x80), 0, 'past U+10FFFF');
  assert.equal(at(0x61, 0x62, 0xe2, 0x98), 2, 'cut at the end');
  assert.equal(at(0xe2, 0x41, 0x83), 0, 'a continuation byte missing');
  assert.equal(at(0x80), 0, 'a lone continuation byte');
});

test('the client\'s file system: a file that is not UTF-8 is an error answer saying so (not text with U+FFFD); a saved buffer whose file is gone is "no such file" (-32002), an unsaved one is served; a write whose file vanished since its read fails and creates nothing', async () => {
  files.set('/ws/latin.txt', Buffer.from('caf\xe9\nbeta\n', 'latin1'));
  files.set('/ws/ok.txt', Buffer.from('ok\n'));
  try {
    await assert.rejects(clientFs.readTextFile({ path: '/ws/latin.txt', callId: 'l' }), (e: ResponseError<unknown>) =>
      e instanceof ResponseError && e.code === ErrorCodes.InternalError && e.message === "'/ws/latin.txt' is not UTF-8 text (byte 3); it cannot be changed safely by this tool");
    // open in the editor (decoded as UTF-8), not dirty: the disk's bytes decide
    docs.push({ uri: Uri.file('/ws/latin.txt'), isDirty: false, getText: () => 'caf\ufffd\nbeta\n' });
    await assert.rejects(clientFs.readTextFile({ path: '/ws/latin.txt', callId: 'l2' }), /is not UTF-8 text \(byte 3\)/);
    assert.equal(await clientFs.readTextFile({ path: '/ws/ok.txt', callId: 'c' }), 'ok\n');
    // a file deleted on disk, its document still open (saved): missing, as a file that is not there
    docs.push({ uri: Uri.file('/ws/gone.txt'), isDirty: false, getText: () => 'was here\n' });
    await assert.rejects(clientFs.readTextFile({ path: '/ws/gone.txt', callId: 'g' }), (e: ResponseError<unknown>) => e instanceof ResponseError && e.code === -32002);
    // an unsaved buffer of it: its text (docs/PROTOCOL.md §10)
    docs.push({ uri: Uri.file('/ws/draft.txt'), isDirty: true, getText: () => 'unsaved\n', positionAt: (n: number) => n } as never);
    assert.equal(await clientFs.readTextFile({ path: '/ws/draft.txt', callId: 'd' }), 'unsaved\n');
    // a write of a file the call read, deleted since: fails, nothing created
    const read = await clientFs.readTextFile({ path: '/ws/ok.txt', callId: 'w' });
    assert.equal(read, 'ok\n');
    files.delete('/ws/ok.txt');
    const n = edits.length;
    await assert.rejects(clientFs.writeTextFile({ path: '/ws/ok.txt', text: 'OK\n', callId: 'w' }), /no longer exists on disk .*nothing written/);
    assert.equal(edits.length, n, 'nothing applied');
    // a new file (its read said "no such file"): created; an unsaved buffer whose file is gone: its text replaced
    await assert.rejects(clientFs.readTextFile({ path: '/ws/new.txt', callId: 'n' }), (e: ResponseError<unknown>) => e.code === -32002);
    await clientFs.writeTextFile({ path: '/ws/new.txt', text: 'new\n', callId: 'n' });
    await clientFs.writeTextFile({ path: '/ws/draft.txt', text: 'edited\n', callId: 'd' });
    assert.deepEqual(edits.slice(n), [['create', '/ws/new.txt'], ['insert', '/ws/new.txt', 'new\n'], ['replace', '/ws/draft.txt', 'edited\n']]);
  } finally {
    files.clear();
    docs.splice(0);
  }
});
