// The chat view (chatView.ts) when its chat's branch is deleted elsewhere (another window, another client of the
// server), against a scripted client with the stand-in `vscode` module (standIn.ts): deleted after the turn read it,
// the turn fails saying so in words; the next message, or Retry, goes to a new chat, said once. A branch deleted
// before the message is sent, in the real workbench with the real server: src/itest/chats.ts.
// Run: tsc -p . && node --test out/test/
import { test } from 'node:test';
import * as assert from 'node:assert/strict';
import { chatHost, FakeClient, log, memento, msg, result, until, vscode, webviewView } from './standIn';
import type { BranchStore as BranchStoreT } from '../branchStore';
import type { ChatView as ChatViewT } from '../chatView';
import { ErrorCodes, ResponseError } from '../rpcClient';

// (the stand-in for `vscode`, standIn.ts, is installed by its import above: these modules get it)
const { BranchStore } = require('../branchStore') as { BranchStore: typeof BranchStoreT };
const { ChatView } = require('../chatView') as { ChatView: typeof ChatViewT };

test('a chat whose branch is deleted elsewhere after the turn read it: the turn fails saying so in words (not the server\'s "branch not found"); Retry goes to a new chat, said once, and the chat goes on there', async () => {
  const client = new FakeClient();
  const branches = new BranchStore(memento() as never);
  const chat = new ChatView({ extensionUri: vscode.Uri.file('/ext') } as never, chatHost(client, branches) as never);
  const { view, send, posted } = webviewView();
  chat.resolveWebviewView(view as never);
  client.branches.set('G', [msg('instruction', { instruction: 'first' }), msg('assistant_response', { text: 'first reply' })]);
  await send({ type: 'ready', mod: 'Ctrl' });
  branches.remember('G', 'chat G');
  await branches.setCurrent('G');
  await chat.refresh();
  const infos = log.infos.length;

  // the turn read the branch; then another window deletes it: the server refuses the operate
  const failed = chat.send('second');
  await until(() => client.ops.length === 1, 'the operate sent');
  client.branches.delete('G');
  client.ops[0].reject(new ResponseError(ErrorCodes.BranchNotFound, 'branch not found: G'));
  const o = await failed;
  assert.match(o.error ?? '', /^this chat was deleted \(in another window, or by another client of the server\); send the message again, or Retry, to go on in a new chat$/);
  const shown = chat.shownTurns();
  assert.deepEqual(shown.map((t) => [t.user, t.outcome]), [['first', undefined], ['second', 'failed']]);

  // Retry: the message goes to a new chat, said once; the deleted chat's kept turns go with it
  const parts = posted.filter((m) => m.type === 'state').at(-1)!.parts as Record<number, string>;
  const html = String(parts[1]);
  const id = /data-turn-id="([^"]+)"/.exec(html)?.[1];
  assert.ok(id && html.includes('data-action="retry"'), html);
  await send({ type: 'retry', id });
  await until(() => client.ops.length === 2, 'the retried operate sent');
  assert.equal(client.ops[1].params.branchId, 'new1');
  assert.equal(branches.current, 'new1');
  assert.deepEqual(log.infos.slice(infos), ['operate-sidecar: the chat "chat G" was deleted (in another window, or by another client of the server); your message goes to a new chat.']);
  assert.deepEqual(branches.localTurns('G'), []);
  client.branches.get('new1')!.push(msg('instruction', { instruction: 'second' }), msg('assistant_response', { text: 'second reply' }));
  client.ops[1].resolve(result('second reply'));
  await until(() => !chat.running, 'the retried turn ended');
  assert.deepEqual(chat.shownTurns().map((t) => [t.user, t.outcome]), [['second', undefined]]);

  // the next message: in the new chat, nothing said
  const next = chat.send('third');
  await until(() => client.ops.length === 3, 'the next operate sent');
  assert.equal(client.ops[2].params.branchId, 'new1');
  client.branches.get('new1')!.push(msg('instruction', { instruction: 'third' }), msg('assistant_response', { text: 'third reply' }));
  client.ops[2].resolve(result('third reply'));
  assert.equal((await next).error, undefined);
  assert.deepEqual(chat.shownTurns().map((t) => t.user), ['second', 'third']);
  assert.equal(log.infos.length, infos + 1);
  chat.dispose();
});
