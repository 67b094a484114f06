// The chat view (chatView.ts) and the extension (extension.ts) against a scripted client, with a stand-in for the
// `vscode` module (standIn.ts): what reaches a chat turn when another operate runs on its branch, a read of a chat that
// answers late, the webview's messages, a model error that is no server death, a permissionAnswer setting that is
// none of its values. The real workbench and server: src/itest.
// Run: tsc -p . && node --test out/test/
import { test } from 'node:test';
import * as assert from 'node:assert/strict';
import { chatHost, docs, edits, FakeClient, files, log, memento, msg, result, settings, until, Uri, vscode, webviewView } from './standIn';
import type { BranchStore as BranchStoreT } from '../branchStore';
import type { ChatView as ChatViewT } from '../chatView';
import type { clientFs as ClientFsT, firstNonUtf8Byte as FirstNonUtf8ByteT } from '../diffReview';
import type * as ExtensionT from '../extension';
import * as os from 'node:os';
import * as path from 'node:path';
import { CancellationTokenSource, ErrorCodes, PermissionDecision, PermissionHandler, PermissionRequest, ResponseError,
  SidecarClient, SidecarExitedError } from '../rpcClient';

// (the stand-in for `vscode`, standIn.ts, is installed by its import above: these modules get it)
const { BranchStore } = require('../branchStore') as { BranchStore: typeof BranchStoreT };
const { ChatView } = require('../chatView') as { ChatView: typeof ChatViewT };
const { clientFs, firstNonUtf8Byte } = require('../diffReview') as { clientFs: typeof ClientFsT; firstNonUtf8Byte: typeof FirstNonUtf8ByteT };
const extension = require('../extension') as typeof ExtensionT;

/** What `p` settled to within `ms`, else 'waiting'. */
function settled<T>(p: Promise<T>, ms = 200): Promise<T | 'waiting'> {
  let timer: NodeJS.Timeout;
  return Promise.race([p, new Promise<'waiting'>((r) => { timer = setTimeout(() => r('waiting'), ms); })]).finally(() => clearTimeout(timer));
}

const turn = (instruction: string, text: string) => [msg('instruction', { instruction }), msg('assistant_response', { text, usage: { inputTokens: 1, outputTokens: 1 } })];

function makeChat() {
  const client = new FakeClient();
  const branches = new BranchStore(memento() as never);
  const lines: string[] = [];
  const host = chatHost(client, branches, { current: () => (client.running ? client : undefined), line: (t: string) => lines.push(t) });
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
  assert.equal(log.warnings.length, 0, log.warnings.join('\n'));
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

test('lastStderrLines: the last 12 lines of a stderr, at most 2000 characters of them (the end kept, "…" where cut), blank ends dropped', () => {
  const numbered = Array.from({ length: 30 }, (_, i) => `line ${i + 1}`).join('\n');
  assert.equal(extension.lastStderrLines(numbered + '\n\n'), Array.from({ length: 12 }, (_, i) => `line ${i + 19}`).join('\n'));
  assert.equal(extension.lastStderrLines('one\r\ntwo\r\n'), 'one\ntwo');
  assert.equal(extension.lastStderrLines(''), '');
  const long = extension.lastStderrLines('start\n' + 'x'.repeat(5000) + '\nthe last line\n');
  assert.equal(long.length, 2000);
  assert.ok(long.startsWith('…x') && long.endsWith('x\nthe last line'), long.slice(0, 20));
  assert.equal(extension.lastStderrLines('a' + '😀'.repeat(1500)).startsWith('…😀'), true, 'not half of a surrogate pair');
});

test('the notice of a server that stopped, and the chat turn that failed with it, quote the last lines of that process\'s own stderr, bounded: not the start of its stderr, nor lines of another server (the one started after it, the one before it still writing)', async () => {
  /**
   * One server process per start: its stderr reaches the extension (onStderr) and is kept by its client
   * (stderrTail), as SidecarClient does; it logs a first line as it starts.
   */
  function fakeServer(name: string, onStderr?: (t: string) => void) {
    let exit!: (code: number | string) => void;
    const exited = new Promise<number | string>((r) => { exit = r; });
    const server = Object.assign(new FakeClient(), {
      exited, stderrTail: '',
      write(t: string) { server.stderrTail = (server.stderrTail + t).slice(-16384); onStderr?.(t); },
      /** It crashes: its request fails as the client fails it (quoting the end of its stderr whole), then it exits. */
      crash(code: number, last: string) {
        server.write('Traceback (most recent call last):\n  File "tool.py", line 1, in run\n' + 'y'.repeat(3000) + `\n${last}\n`);
        server.ops[0].reject(new SidecarExitedError('operate', { exitCode: code, signal: null, stderrTail: server.stderrTail }));
        server.running = false;
        exit(code);
      },
      kill() { server.running = false; exit('SIGKILL'); }, async stop() { server.running = false; exit(0); },
      onToolEvent() { /* */ }, onLogMessage() { /* */ }, setFsHandlers() { /* */ }, setPermissionHandler() { /* */ },
      async initialize() { return { serverInfo: { name: 'fake', version: '1' }, capabilities: { models: ['m'], stateDir: null } }; },
      async listBranches() { return { branches: [] }; },
    });
    server.write(`${name}: its first line\n`);
    return server;
  }
  const servers: ReturnType<typeof fakeServer>[] = [];
  (SidecarClient as unknown as { start: (o: { onStderr?: (t: string) => void }) => Promise<unknown> }).start = async (o) => {
    servers.push(fakeServer(servers.length ? 'second server' : 'first server', o.onStderr));
    return servers.at(-1);
  };
  const ctx = { subscriptions: [] as unknown[], workspaceState: memento(), extensionUri: Uri.file('/ext'),
    globalStorageUri: Uri.file(path.join(os.tmpdir(), `operate-sidecar-unit-${process.pid}`)) };
  const api = extension.activate(ctx as never);
  const chat = ctx.subscriptions.find((x) => x instanceof ChatView) as ChatViewT;
  const lines = (what: string, n: number) => Array.from({ length: n }, (_, i) => `${what} ${i + 1}\n`).join('');
  const notice = (code: number) => api.notices().find((n) => n.message.startsWith(`operate-sidecar: the server stopped (exit ${code}).`));
  /** What a notice or a turn's error quotes: the last lines of `own`'s stderr only, bounded. */
  const quotes = (what: string, shown: string, own: string, last: string) => {
    assert.ok(shown.includes(last), `${what}: ${shown}`);
    assert.ok(!shown.includes(own === 'first server' ? 'second server' : 'first server'), `${what} quotes the other server: ${shown}`);
    assert.ok(!shown.includes(`${own}: its first line`) && !shown.includes('log line 1\n'), `${what} quotes the start of the stderr: ${shown}`);
    assert.ok(shown.length < 2300 && shown.split('\n').length <= 14, `${what} is not bounded: ${shown.length} characters, ${shown.split('\n').length} lines`);
  };
  // the first server logs, then crashes during a turn; the next turn starts the second server at once
  const first = chat.send('first');
  await until(() => servers[0]?.ops.length === 1, 'the first server\'s operate');
  const [a] = servers;
  a.write(lines('first server: log line', 30));
  a.crash(1, 'RuntimeError: the first server crashed');
  const one = await first;
  const second = chat.send('second');
  await until(() => servers[1]?.ops.length === 1, 'the second server\'s operate');
  const b = servers[1];
  b.write(lines('second server: log line', 20));
  a.write('first server: a late line, after the restart\n');   // the process that ended: its stderr still arriving
  await until(() => !!notice(1), 'the first exit notice');
  quotes('the first exit notice', notice(1)!.message, 'first server', 'RuntimeError: the first server crashed');
  quotes('the first turn\'s error', one.error ?? '', 'first server', 'RuntimeError: the first server crashed');
  b.crash(2, 'RuntimeError: the second server crashed');
  const two = await second;
  await until(() => !!notice(2), 'the second exit notice');
  quotes('the second exit notice', notice(2)!.message, 'second server', 'RuntimeError: the second server crashed');
  quotes('the second turn\'s error', two.error ?? '', 'second server', 'RuntimeError: the second server crashed');
});
