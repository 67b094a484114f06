// The chat view (chatView.ts) when the user picks another chat while the server is (re)starting for a turn just sent,
// against a scripted client with the stand-in `vscode` module (standIn.ts): the turn goes to the chat it was sent in
// (its operate, its place, what is kept of it), and the chat picked is shown once it ends. A turn sent in a new chat,
// or in one deleted elsewhere, goes to, and is kept with, the branch made for it, and the pick stands. Chats picked
// while a turn runs, in the real workbench with the real server: src/itest/chats.ts.
// Run: tsc -p . && node --test out/test/
import { test } from 'node:test';
import * as assert from 'node:assert/strict';
import { chatHost, FakeClient, memento, msg, result, until, vscode, webviewView } from './standIn';
import type { BranchStore as BranchStoreT } from '../branchStore';
import type { ChatView as ChatViewT } from '../chatView';
import { ResponseError } from '../rpcClient';

// (the stand-in for `vscode`, standIn.ts, is installed by its import above: these modules get it)
const { BranchStore } = require('../branchStore') as { BranchStore: typeof BranchStoreT };
const { ChatView } = require('../chatView') as { ChatView: typeof ChatViewT };

/** A chat view on a scripted client whose server start can be held (`starting()`, see sendWhilePicking); chats A (1 turn) and B (2 turns). */
async function setUp() {
  const client = new FakeClient();
  const branches = new BranchStore(memento() as never);
  let gate: Promise<void> = Promise.resolve();
  const host = chatHost(client, branches, { ensure: async () => { await gate; return client; } });
  const chat = new ChatView({ extensionUri: vscode.Uri.file('/ext') } as never, host as never);
  // as the extension does: a chat picked while no turn runs is shown
  branches.onDidChangeCurrent(() => { if (!chat.running) void chat.refresh(); });
  const { view, send, posted } = webviewView();
  chat.resolveWebviewView(view as never);
  client.branches.set('A', [msg('instruction', { instruction: 'a1' }), msg('assistant_response', { text: 'a1 reply' })]);
  client.branches.set('B', [msg('instruction', { instruction: 'b1' }), msg('assistant_response', { text: 'b1 reply' }),
    msg('instruction', { instruction: 'b2' }), msg('assistant_response', { text: 'b2 reply' })]);
  await send({ type: 'ready', mod: 'Ctrl' });
  branches.remember('A', 'chat A');
  branches.remember('B', 'chat B');
  /** The server (re)starts: ensure() waits until the returned release is called. */
  const starting = () => { let release!: () => void; gate = new Promise((r) => { release = r; }); return release; };
  const users = () => chat.shownTurns().map((t) => (t.outcome ? [t.user, t.outcome] : t.user));
  /** Sends `text` while the server (re)starts, the user picking chat `pick` meanwhile; returns once the turn's operate
   * is sent, with the turn's outcome to come (`turn`). */
  const sendWhilePicking = async (text: string, pick: string) => {
    const release = starting();
    const turn = chat.send(text);
    await branches.setCurrent(pick);   // the user picks another chat while the server is (re)starting
    release();
    await until(() => client.ops.length === 1, 'the operate sent');
    return { turn };
  };
  /** The chat the view's header names (its last `state` post). */
  const header = () => (posted.filter((m) => m.type === 'state').at(-1) as { branch?: string } | undefined)?.branch;
  return { client, branches, chat, users, sendWhilePicking, starting, header };
}

test('a chat picked while the server starts for a turn sent in chat A: the turn goes to A (its operate, its place, its failure kept there); B is shown once it ends', async () => {
  const { client, branches, chat, users, sendWhilePicking } = await setUp();
  await branches.setCurrent('A');
  await chat.refresh();
  const { turn: failed } = await sendWhilePicking('question in A', 'B');
  assert.equal(client.ops[0].params.branchId, 'A');
  assert.deepEqual(users(), ['a1', 'question in A']);   // (while it runs: its own chat)
  client.ops[0].reject(new ResponseError(-32011, 'model failed'));
  const o = await failed;
  assert.equal(o.branchId, 'A');
  assert.equal(o.error, 'model failed');
  assert.equal(branches.current, 'B');
  assert.deepEqual(branches.localTurns('A').map((l) => [l.turn.user, l.at]), [['question in A', 2]]);   // (after A's 2 messages)
  assert.deepEqual(branches.localTurns('B'), []);
  await until(() => users().join() === 'b1,b2', 'chat B shown');
  await branches.setCurrent('A');
  await until(() => JSON.stringify(users()) === JSON.stringify(['a1', ['question in A', 'failed']]), 'chat A shown with the failed turn');
  chat.dispose();
});

test('a chat picked while the server starts for a turn sent in chat A that succeeds: A records it, B is shown, with B\'s turns only', async () => {
  const { client, branches, chat, users, sendWhilePicking } = await setUp();
  await branches.setCurrent('A');
  await chat.refresh();
  const { turn: sent } = await sendWhilePicking('question in A', 'B');
  assert.equal(client.ops[0].params.branchId, 'A');
  client.branches.get('A')!.push(msg('instruction', { instruction: 'question in A' }), msg('assistant_response', { text: 'answer' }));
  client.ops[0].resolve(result('answer'));
  const o = await sent;
  assert.equal(o.branchId, 'A');
  assert.equal(o.error, undefined);
  await until(() => users().join() === 'b1,b2', 'chat B shown');
  assert.deepEqual(branches.localTurns('A'), []);
  assert.deepEqual(branches.localTurns('B'), []);
  await branches.setCurrent('A');
  await until(() => users().join() === 'a1,question in A', 'chat A shown with the turn');
  chat.dispose();
});

test('a chat picked while the server starts for a turn sent in a new chat: the turn goes to a branch made for it and is kept there; the pick stands', async () => {
  const { client, branches, chat, users, sendWhilePicking } = await setUp();
  await chat.refresh();   // (no current chat: a new one)
  const { turn: failed } = await sendWhilePicking('first question', 'B');
  assert.equal(client.ops[0].params.branchId, 'new1');
  assert.equal(branches.current, 'B');   // (the user's pick, not the new chat's branch)
  assert.equal(branches.nameOf('new1'), 'first question');
  assert.deepEqual(users(), ['first question']);
  client.ops[0].reject(new ResponseError(-32011, 'model failed'));
  const o = await failed;
  assert.equal(o.branchId, 'new1');
  assert.equal(branches.current, 'B');
  await until(() => users().join() === 'b1,b2', 'chat B shown');
  assert.deepEqual(branches.localTurns('new1').map((l) => [l.turn.user, l.at]), [['first question', 0]]);
  assert.deepEqual(branches.localTurns(''), []);
  assert.deepEqual(branches.localTurns('B'), []);
  await branches.setCurrent('new1');
  await until(() => JSON.stringify(users()) === JSON.stringify([['first question', 'failed']]), 'the new chat shown with the failed turn');
  chat.dispose();
});

test('a chat picked while the server starts for a turn sent in a chat deleted elsewhere: the turn goes to a new chat made for it and is kept there; the pick stands', async () => {
  const { client, branches, chat, users, sendWhilePicking } = await setUp();
  client.branches.set('G', [msg('instruction', { instruction: 'g1' }), msg('assistant_response', { text: 'g1 reply' })]);
  branches.remember('G', 'chat G');
  await branches.setCurrent('G');
  await chat.refresh();
  client.branches.delete('G');   // (another window deletes it)
  const { turn: failed } = await sendWhilePicking('question in G', 'B');
  assert.equal(client.ops[0].params.branchId, 'new1');
  assert.equal(branches.current, 'B');
  assert.deepEqual(users(), ['question in G']);
  client.ops[0].reject(new ResponseError(-32011, 'model failed'));
  assert.equal((await failed).branchId, 'new1');
  assert.equal(branches.current, 'B');
  await until(() => users().join() === 'b1,b2', 'chat B shown');
  assert.deepEqual(branches.localTurns('new1').map((l) => [l.turn.user, l.at]), [['question in G', 0]]);
  assert.deepEqual(branches.localTurns('G'), []);
  await branches.setCurrent('new1');
  await until(() => JSON.stringify(users()) === JSON.stringify([['question in G', 'failed']]), 'the new chat shown with the failed turn');
  chat.dispose();
});

test('a message sent in a chat just picked, before its history was read, with another chat picked while it runs: the turn shows under its own chat\'s history', async () => {
  const { client, branches, chat, users } = await setUp();
  await branches.setCurrent('B');
  await until(() => users().join() === 'b1,b2', 'chat B shown');
  client.slow.set('A', 300);   // (the server is slow to answer A's reads)
  await branches.setCurrent('A');   // (its read is out)
  const sent = chat.send('question in A');
  await branches.setCurrent('B');   // the user picks B while the turn runs
  await until(() => client.ops.length === 1, 'the operate sent');
  assert.equal(client.ops[0].params.branchId, 'A');
  // A's read, begun before the message was sent, answered: A's history with the running turn, not B's
  await until(() => users().join() === 'a1,question in A', 'the running turn under chat A\'s history', 3000);
  client.branches.get('A')!.push(msg('instruction', { instruction: 'question in A' }), msg('assistant_response', { text: 'answer' }));
  client.ops[0].resolve(result('answer'));
  assert.equal((await sent).branchId, 'A');
  await until(() => users().join() === 'b1,b2', 'chat B shown once the turn ended');
  await branches.setCurrent('A');
  await until(() => users().join() === 'a1,question in A', 'chat A shown with the turn');
  chat.dispose();
});

test('a turn sent in chat A names chat A (the status bar\'s running chat, the header) from the start, also with chat B picked before the server answers', async () => {
  const { client, branches, chat, starting, header } = await setUp();
  await branches.setCurrent('A');
  await chat.refresh();
  const release = starting();   // (no answer from the server yet: the turn's branch is not read)
  const sent = chat.send('question in A');
  await branches.setCurrent('B');
  assert.equal(chat.runningBranch(), 'A');
  assert.equal(header(), 'chat A');
  release();
  await until(() => client.ops.length === 1, 'the operate sent');
  assert.equal(chat.runningBranch(), 'A');
  client.ops[0].reject(new ResponseError(-32011, 'model failed'));
  await sent;
  assert.equal(chat.runningBranch(), undefined);
  await until(() => header() === 'chat B', 'chat B named once the turn ended');
  chat.dispose();
});
