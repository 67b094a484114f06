// The chat view (chatView.ts) streaming a long reply to its webview, the chat rebuilt after a window reload ended a
// turn, the file list of a multi-root workspace (context.ts) and a diff review whose file changed (diffReview.ts),
// against a scripted client and a stand-in for the `vscode` module (standIn.ts). The real workbench: scripts/run-ui-test.mjs.
// Run: tsc -p . && node --test out/test/
import { test } from 'node:test';
import * as assert from 'node:assert/strict';
import { chatHost, documentChanged, excludes, FakeClient, folders, found, log, memento, msg, result, until, Uri, webviewView, type RelativePattern } from './standIn';
import type { BranchStore as BranchStoreT } from '../branchStore';
import type { ChatView as ChatViewT } from '../chatView';
import type * as ContextT from '../context';
import type * as DiffReviewT from '../diffReview';
import type * as ChatModelT from '../chatModel';
import { CancellationTokenSource } from '../rpcClient';

// (the stand-in for `vscode`, standIn.ts, is installed by its import above: these modules get it)
const { BranchStore } = require('../branchStore') as { BranchStore: typeof BranchStoreT };
const { ChatView } = require('../chatView') as { ChatView: typeof ChatViewT };
const { workspaceFiles } = require('../context') as typeof ContextT;
const { DiffReview, staleWarning } = require('../diffReview') as typeof DiffReviewT;
const { INTERRUPTED_NOTE, renderMarkdown } = require('../chatModel') as typeof ChatModelT;

/**
 * A chat view on a FakeClient, with its webview: what is posted to it. Its page acknowledges each `stream` post
 * (`streamTaken`, as chat.js does once the update is in its DOM), soon after the post; postMessage's promise
 * resolves at once (VS Code took the message). `hold` set, the page acknowledges the next only once the test calls
 * `release`; `lose` set, it never acknowledges (a message lost).
 */
function makeChat() {
  const client = new FakeClient();
  const branches = new BranchStore(memento() as never);
  const chat = new ChatView({ extensionUri: Uri.file('/ext') } as never, chatHost(client, branches) as never);
  const page = { hold: false, lose: false, release: undefined as (() => void) | undefined };
  const { view, posted, send } = webviewView(async (m, reply) => {
    if (m.type !== 'stream' || page.lose) return true;
    const ack = () => { void reply({ type: 'streamTaken', seq: m.seq }); };
    if (page.hold) page.release = () => { page.release = undefined; ack(); };
    else setImmediate(ack);
    return true;
  });
  chat.resolveWebviewView(view as never);
  return { chat, client, branches, posted, page, send };
}

test('a long streamed reply reaches the view as what changed: each update posts the Markdown blocks settled since the last and the open tail, bounded as the reply grows; the prose the page builds from them is the render of the reply so far; the next post waits until the page has taken the last', async () => {
  const { chat, client, posted, page, send } = makeChat();
  await send({ type: 'ready', mod: 'Ctrl' });
  const reply = '# Long reply\n\n' + Array.from({ length: 300 }, (_, i) => `Paragraph ${i}: ` + 'lorem ipsum **dolor** `sit` amet '.repeat(20)
    + (i % 10 === 0 ? `\n\n\`\`\`python\nprint(${i})\n\`\`\`` : '')).join('\n\n');
  const done = chat.send('long please');
  await until(() => client.ops.length === 1, 'the operate sent');
  const op = client.ops[0];
  op.progress({ kind: 'begin', title: 'operate', message: 'communicate' });
  const piece = Math.ceil(reply.length / 60);
  const streams = () => posted.filter((m) => m.type === 'stream') as unknown as { reset?: boolean; html: string; tail: string }[];
  /** The page's prose as it builds it from the stream posts (see chat.js: stream). */
  let settled = '';
  let tail = '';
  let seen = 0;
  const take = () => {
    for (const m of streams().slice(seen)) { settled = m.reset ? m.html : settled + m.html; tail = m.tail; }
    seen = streams().length;
  };
  let at = 0;
  let most = 0;
  const deliver = async (n: number) => {
    const before = streams().length;
    const text = reply.slice(at, at + n);
    at += text.length;
    op.progress({ kind: 'report', phase: 'stream', message: 'streaming', delta: text });
    await until(() => streams().length > before || (at <= n && posted.some((m) => m.type === 'state' && JSON.stringify(m).includes('Long reply'))), `an update after ${at} characters`);
    // (a piece is some 3,400 characters of Markdown, its HTML about twice that; all of the reply some 360,000 characters of HTML)
    for (const [i, m] of streams().entries()) {
      if (i < before || i === 0) continue;   // (the first: all of it so far, after the redraw that showed its first piece)
      const size = (m.html?.length ?? 0) + (m.tail?.length ?? 0);
      assert.ok(size < 12_000, `stream post ${i} (after ${at} characters) carries ${size} characters of HTML`);
      most = Math.max(most, size);
    }
    take();
  };
  await deliver(piece);   // (the first piece: the turn is redrawn with its prose)
  while (at < reply.length) {
    await deliver(piece);
    assert.equal(settled + tail, renderMarkdown(reply.slice(0, at)), `the page's prose after ${at} characters`);
  }
  const whole = renderMarkdown(reply).length;
  assert.ok(whole > 25 * most, `the largest stream post: ${most} characters of HTML (the whole reply: ${whole})`);
  assert.equal(streams().filter((m) => m.reset).length, 1, 'all of it once: after the redraw that showed its first piece');
  // a page that has not taken the last post yet gets no other: what comes meanwhile goes with the next
  const more = '\n\nOne more paragraph.\n\nAnd its *last* one.';
  page.hold = true;
  op.progress({ kind: 'report', phase: 'stream', message: 'streaming', delta: more.slice(0, 22) });
  await until(() => !!page.release, 'a post the page has not taken');
  const held = streams().length;
  const waits = chat.stats().streamWaits;
  op.progress({ kind: 'report', phase: 'stream', message: 'streaming', delta: more.slice(22) });
  await until(() => chat.stats().streamWaits > waits || streams().length > held, 'the next update');
  assert.equal(streams().length, held, 'no post while the page has not taken the last');
  page.hold = false;
  page.release!();
  await until(() => streams().length > held, 'the update once the page took the last');
  take();
  assert.equal(settled + tail, renderMarkdown(reply + more));
  op.resolve(result(reply + more));
  await done;
  assert.equal(chat.stats().lastProse, reply + more, 'the whole reply shows when the turn ends');
});

test('a stream post the page does not acknowledge holds the next update, though postMessage resolved (VS Code took it); a lost acknowledgement delays the stream, never stalls it; the turn\'s final render has all of the reply, an acknowledgement outstanding or not', async () => {
  const { chat, client, posted, page, send } = makeChat();
  await send({ type: 'ready', mod: 'Ctrl' });
  const done = chat.send('stream please');
  await until(() => client.ops.length === 1, 'the operate sent');
  const op = client.ops[0];
  op.progress({ kind: 'begin', title: 'operate', message: 'communicate' });
  const streams = () => posted.filter((m) => m.type === 'stream') as unknown as { seq: number; reset?: boolean; html: string; tail: string }[];
  const say = (delta: string) => op.progress({ kind: 'report', phase: 'stream', message: 'streaming', delta });
  let text = 'First paragraph.\n\n';
  say(text);   // (the first piece: the turn is redrawn with its prose)
  await until(() => posted.some((m) => m.type === 'state' && JSON.stringify(m).includes('First paragraph.')), 'the prose shown');
  // not acknowledged: the post is held until the page says it took it
  page.hold = true;
  say('Second');
  text += 'Second';
  await until(() => !!page.release, 'a post the page has not acknowledged');
  const held = streams().length;
  const waits = chat.stats().streamWaits;
  say(' paragraph.\n\nThird');
  text += ' paragraph.\n\nThird';
  await until(() => chat.stats().streamWaits > waits || streams().length > held, 'the next update');
  assert.equal(streams().length, held, 'no post while the page has not acknowledged the last');
  page.hold = false;
  page.release!();
  await until(() => streams().length > held, 'the update once the page acknowledged the last');
  assert.ok(streams().at(-1)!.tail.includes('Third'), JSON.stringify(streams().at(-1)));
  // a lost acknowledgement: the next update goes once the wait for it ends (STREAM_ACK_MS)
  page.lose = true;
  const lost = streams().length;
  say(' one.\n\nFourth');
  text += ' one.\n\nFourth';
  await until(() => streams().length > lost, 'a post whose acknowledgement is lost');
  const missed = chat.stats().streamAckMissed;
  say(' and the last.');
  text += ' and the last.';
  await until(() => streams().length > lost + 1, 'the update after the lost acknowledgement');
  assert.ok(chat.stats().streamAckMissed > missed, 'it went because the wait ended');
  assert.ok(streams().at(-1)!.tail.includes('the last.'), JSON.stringify(streams().at(-1)));
  // the end of the turn while the last post is not acknowledged: the redraw has the whole reply
  say(' More.');
  text += ' More.';
  op.resolve(result(text));
  await done;
  assert.equal(chat.stats().lastProse, text, 'the whole reply shows when the turn ends');
  const last = posted.filter((m) => m.type === 'state').at(-1)!;
  assert.ok(Object.values(last.parts as Record<number, string>).some((h) => h.includes(renderMarkdown(text))), JSON.stringify(last).slice(0, 600));
});

test('after a window reload ended a turn while its call waited for a decision (the server recorded the call denied, "cancelled"), the chat read back shows it marked as interrupted, with Retry and no Copy, its card saying the turn ended first; Retry sends the message again without its context (the branch holds it)', async () => {
  const { chat, client, branches, posted, send } = makeChat();
  client.branches.set('B', [
    msg('instruction', { instruction: 'reload test', context: { labels: ['src/a.py'], files: [] } }),
    msg('assistant_response', { text: '{"answer": "reload me", "action_requests": [{"function": "shout", "arguments": {"text": "seven"}}]}' }),
    msg('action_request', { callId: 'c1', function: 'shout', arguments: { text: 'seven' } }),
    msg('action_response', { callId: 'c1', function: 'shout', arguments: { text: 'seven' }, output: { error: 'denied by governance gate', function: 'shout', reason: 'cancelled' } }),
  ]);
  await branches.setCurrent('B');
  await send({ type: 'ready', mod: 'Ctrl' });
  assert.deepEqual(chat.shownTurns(), [{ user: 'reload test', outcome: 'stopped', note: INTERRUPTED_NOTE, cards: ['⊘ shout seven (no answer: the turn ended first)'], thoughts: [] }]);
  const html = String((posted.filter((m) => m.type === 'state').at(-1)!.parts as Record<number, string>)[0]);
  assert.ok(html.startsWith('<section class="turn stopped"') && html.includes('data-action="retry"') && !html.includes('data-action="copyReply"'), html);
  const id = /data-turn-id="([^"]+)"/.exec(html)![1];
  await send({ type: 'retry', id });
  await until(() => client.ops.length === 1, 'the retried operate sent');
  assert.equal(client.ops[0].params.instruction, 'reload test');
  assert.equal(client.ops[0].params.context, undefined);
  client.ops[0].resolve(result('ok'));
  await until(() => !chat.running, 'the retried turn ends');
});

test('the file list of a multi-root workspace leaves out what each folder\'s own files.exclude and search.exclude leave out (the settings read for that folder, never without one)', async () => {
  folders.push({ uri: Uri.file('/second'), name: 'second', index: 1 });
  found.push('src/a.py');   // (in each folder searched)
  excludes.set('/ws', { files: { '**/build': true }, search: { '**/node_modules': true } });
  excludes.set('/second', { files: { '**/dist': true, '**/keep': false } });
  log.settings.length = 0;
  log.searches.length = 0;
  try {
    const files = await workspaceFiles();
    assert.deepEqual(files.map((f) => f.rel).sort(), ['/second/src/a.py', '/ws/src/a.py']);
    assert.ok(log.settings.length > 0 && log.settings.every(([, scope]) => scope instanceof Uri), `settings read without a folder: ${JSON.stringify(log.settings)}`);
    assert.deepEqual(log.searches.map(([inc, exc]) => [(inc as RelativePattern).base.uri.path, exc]),
      [['/ws', '{**/build,**/node_modules}'], ['/second', '{**/dist}']]);
  } finally {
    folders.splice(1);
    found.length = 0;
    excludes.clear();
  }
});

test('a diff review whose file changes meanwhile (on disk, or typed into its left side) says so once: the proposal is the edit of the earlier text, and Accept will not write it', async () => {
  const review = new DiffReview();
  const preview = { kind: 'diff' as const, path: '/ws/src/a.py', oldText: 'x = 1\n', newText: 'x = 2\n', diff: '' };
  const req = { branchId: 'B', callId: 'c1', tool: 'edit_file', arguments: { path: 'src/a.py' }, options: ['allow_once', 'allow_always', 'deny_once', 'deny_always'] } as const;
  log.warnings.length = 0;
  const decided = review.review({ ...req, options: [...req.options] }, preview, new CancellationTokenSource().token);
  const doc = (path: string, text: string) => ({ document: { uri: Uri.file(path), getText: () => text }, contentChanges: [{}] });
  documentChanged.fire(doc('/ws/src/a.py', 'x = 1\n'));   // (the same text: nothing changed for the review)
  documentChanged.fire(doc('/ws/src/other.py', 'y = 1\n'));
  assert.deepEqual(log.warnings, []);
  documentChanged.fire(doc('/ws/src/a.py', 'x = 1\nz = 3\n'));
  documentChanged.fire(doc('/ws/src/a.py', 'x = 1\nz = 4\n'));
  assert.deepEqual(log.warnings, [staleWarning('/ws/src/a.py')]);
  assert.match(log.warnings[0], /a\.py changed since the edit under review was previewed.*Accept will not write it/);
  review.decide('c1', 'deny_once');
  assert.equal(await decided, 'deny_once');
  documentChanged.fire(doc('/ws/src/a.py', 'x = 9\n'));   // decided: no review to warn about
  assert.equal(log.warnings.length, 1);
  review.dispose();
});

test('a diff review whose file changed and then changed back to the previewed text (the change undone) is no longer stale: Accept writes again, so no warning stands; the next change away from that text warns again. The file is the review\'s by its URI, also where a path spells its drive letter otherwise', async () => {
  const review = new DiffReview();
  const req = (callId: string) => ({ branchId: 'B', callId, tool: 'edit_file', arguments: { path: 'src/a.py' },
    options: ['allow_once', 'allow_always', 'deny_once', 'deny_always'] as ('allow_once' | 'allow_always' | 'deny_once' | 'deny_always')[] });
  const doc = (uri: Uri, text: string) => ({ document: { uri, getText: () => text }, contentChanges: [{}] });
  log.warnings.length = 0;
  const a = review.review(req('c1'), { kind: 'diff', path: '/ws/src/a.py', oldText: 'x = 1\n', newText: 'x = 2\n', diff: '' }, new CancellationTokenSource().token);
  const a1 = Uri.file('/ws/src/a.py');
  documentChanged.fire(doc(a1, 'x = 1\ny'));   // typed into the diff's left side
  documentChanged.fire(doc(a1, 'x = 1\n'));    // undone: the previewed text again
  assert.deepEqual(log.warnings, [staleWarning('/ws/src/a.py')]);
  documentChanged.fire(doc(a1, 'x = 1\n'));    // (still the previewed text: nothing to say)
  documentChanged.fire(doc(a1, 'x = 1\nz'));   // changed again: said again, once
  documentChanged.fire(doc(a1, 'x = 1\nzz'));
  assert.deepEqual(log.warnings, [staleWarning('/ws/src/a.py'), staleWarning('/ws/src/a.py')]);
  review.decide('c1', 'deny_once');
  assert.equal(await a, 'deny_once');
  // the server's path with an upper-case drive letter; the editor's document of it (its fsPath lower-cases it)
  log.warnings.length = 0;
  const b = review.review(req('c2'), { kind: 'diff', path: '/C:/ws/b.py', oldText: 'b\n', newText: 'B\n', diff: '' }, new CancellationTokenSource().token);
  const b1 = Uri.file('/C:/ws/b.py');
  assert.notEqual(b1.fsPath, '/C:/ws/b.py');
  documentChanged.fire(doc(b1, 'b\nc\n'));
  assert.deepEqual(log.warnings, [staleWarning('/C:/ws/b.py')]);
  review.decide('c2', 'deny_once');
  assert.equal(await b, 'deny_once');
  review.dispose();
});
