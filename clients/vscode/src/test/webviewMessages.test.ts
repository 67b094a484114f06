// The chat webview's messages, checked before the extension acts on them (see webviewMessages.ts).
// Run: tsc -p . && node --test out/test/
import { test } from 'node:test';
import * as assert from 'node:assert/strict';
import * as fs from 'node:fs';
import * as path from 'node:path';
import { offeredDecision, WEBVIEW_COMMANDS, webviewMessage } from '../webviewMessages';

test('the messages the page posts pass as they are; their fields are of the types it sends', () => {
  for (const m of [
    { type: 'ready', mod: 'Cmd' }, { type: 'send', text: 'hi' }, { type: 'retry', id: 'k1-abc' }, { type: 'stop' },
    { type: 'focus', focused: false }, { type: 'decide', callId: 'c1', decision: 'allow_once' }, { type: 'decide', callId: 'c1', decision: 'deny_always' },
    { type: 'showDiff', callId: 'c1' }, { type: 'copy', code: '' }, { type: 'copyReply', index: 0 }, { type: 'insert', code: 'x = 1' },
    { type: 'command', id: 'operateSidecar.pickBranch' }, { type: 'attach' }, { type: 'drop', uris: ['file:///a.py'] },
    { type: 'complete', seq: 3, before: '#fi', fresh: true }, { type: 'streamTaken', seq: 7 },
  ]) assert.deepEqual(webviewMessage(m), m);
  assert.deepEqual(webviewMessage({ type: 'ready' }), { type: 'ready', mod: 'Ctrl' });
  assert.deepEqual(webviewMessage({ type: 'drop', uris: ['file:///a', 3, null] }), { type: 'drop', uris: ['file:///a'] });
  assert.deepEqual(webviewMessage({ type: 'complete', seq: 1, before: '' }), { type: 'complete', seq: 1, before: '', fresh: false });
});

test('a decide with a decision that is none of the four, or none, or no call is no message (the request is not answered with it); an offered decision is one of the request\'s options', () => {
  for (const m of [{ type: 'decide', callId: 'c1', decision: 'allow_everything' }, { type: 'decide', callId: 'c1' }, { type: 'decide', callId: 'c1', decision: 'allow' },
    { type: 'decide', callId: 'c1', decision: ['allow_once'] }, { type: 'decide', decision: 'allow_once' }, { type: 'decide', callId: 7, decision: 'allow_once' }]) {
    assert.equal(webviewMessage(m), undefined, JSON.stringify(m));
  }
  assert.equal(offeredDecision(['allow_once', 'deny_once'], 'allow_once'), 'allow_once');
  assert.equal(offeredDecision(['allow_once', 'deny_once'], 'allow_always'), undefined);
  assert.equal(offeredDecision(['allow_once', 'deny_once'], undefined), undefined);
  assert.equal(offeredDecision(['allow_once', 'shout'], 'shout'), undefined);
});

test('command runs only the commands of the page\'s buttons (those chat.js posts), no other; messages of another shape are none', () => {
  const page = fs.readFileSync(path.resolve(__dirname, '..', '..', 'media', 'chat.js'), 'utf8');
  const posted = [...page.matchAll(/type: 'command', id: '([^']+)'/g)].map((m) => m[1]).sort();
  assert.deepEqual(posted, [...WEBVIEW_COMMANDS].sort());
  for (const m of [
    { type: 'command', id: 'workbench.action.closeAllEditors' }, { type: 'command', id: 'operateSidecar.deleteBranch' }, { type: 'command' },
    null, undefined, 'send', [], { type: 'nope' }, { type: 'send' }, { type: 'send', text: 3 }, { type: 'retry', id: 5 }, { type: 'focus', focused: 'yes' },
    { type: 'copy', code: null }, { type: 'copyReply', index: NaN }, { type: 'copyReply', index: -1 }, { type: 'copyReply', index: '2' },
    { type: 'drop', uris: 'file:///a' }, { type: 'complete', seq: '1', before: '#' }, { type: 'showDiff' }, { type: 'streamTaken' }, { type: 'streamTaken', seq: '7' },
  ]) assert.equal(webviewMessage(m), undefined, JSON.stringify(m));
});
