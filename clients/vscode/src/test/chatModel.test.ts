// The chat's content model (no VS Code needed) and the client file system, the latter against the
// REAL Python server (scripted model) over real pipes.
// Run: tsc -p . && node --test --test-timeout=60000 out/test/
import { test } from 'node:test';
import * as assert from 'node:assert/strict';
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import MarkdownIt from 'markdown-it';
import {
  addThought, cardHtml, cardOfToolEvent, endThought, INTERRUPTED_NOTE, NOT_ANSWERED, StreamMarkdown, keepThoughts, repeatNote, thoughtHtml, thoughtsOf, cardTitle, conversationHtml, conversationParts, escapeHtml, KEPT_LOCAL_CHATS, KEPT_LOCAL_TURNS, LocalTurn, nameFrom, proseOf, proseOfResult,
  onBranch, progressAfter, refusesField, renderMarkdown, resolveLocalTurns, retryContext, statusText, storeLocalTurns, SUMMARY_LIMIT, toolSummary, ToolCard, Turn,
  TurnProgress, turnHtml, turnsAfterFailedRead, turnsFromMessages, withLocalTurns, forgetKeptTurns, KEPT_CHARS, KEPT_THOUGHT_CHARS, KEPT_TURNS,
  KeptTurn, StoredKeptTurns, storeKeptTurn, THOUGHT_CUT, replyText, chatMarkdown, fencesClosed, markdownCacheSize, turnsBuilt,
  permissionAnswerSetting, serverGone, OperateSpan, operateSpanAfter, ownsBranchEvent, ownTurn,
} from '../chatModel';
import { ErrorCodes, PermissionRequest, ResponseError, SidecarClient, SidecarExitedError, ToolEvent } from '../rpcClient';

const REPO = path.resolve(__dirname, '..', '..', '..', '..');
const VENV_PY = path.join(REPO, '.venv', 'bin', 'python');
const PYTHON = process.env.OPERATE_SIDECAR_PYTHON ?? (fs.existsSync(VENV_PY) ? VENV_PY : 'python3');

function within<T>(p: Promise<T>, what: string, ms = 20_000): Promise<T> {
  let timer: NodeJS.Timeout;
  const t = new Promise<never>((_, rej) => { timer = setTimeout(() => rej(new Error(`timeout after ${ms} ms: ${what}`)), ms); });
  return Promise.race([p, t]).finally(() => clearTimeout(timer));
}

test('chat prose: structured replies show their prose fields (also while streaming), never raw JSON', () => {
  assert.equal(proseOf('plain **text**'), 'plain **text**');
  const reply = JSON.stringify({ answer: 'I will edit it.', action_requests: [{ function: 'edit_file', arguments: { path: 'a.py' } }] });
  assert.equal(proseOf(reply), 'I will edit it.');
  assert.equal(proseOf('```json\n' + reply + '\n```'), 'I will edit it.');
  // every prefix of the streamed reply: only prose, growing, no JSON syntax
  let last = '';
  for (let i = 1; i <= reply.length; i++) {
    const p = proseOf(reply.slice(0, i));
    assert.ok(!p.includes('{') && !p.includes('"') && !p.includes('action_requests'), `prefix ${i}: ${JSON.stringify(p)}`);
    assert.ok(p.startsWith(last.slice(0, Math.max(0, last.length - 1))), `prefix ${i} grows: ${JSON.stringify(last)} -> ${JSON.stringify(p)}`);
    last = p;
  }
  assert.equal(last, 'I will edit it.');
  assert.equal(proseOf('{"answer": "line\\nbreak \\u00e9'), 'line\nbreak é');
  assert.equal(proseOf('{"answer": "cut in an escape \\u00'), 'cut in an escape ');
  assert.equal(proseOfResult({ answer: 'done', action_responses: [] }), 'done');
  assert.equal(proseOfResult('text result'), 'text result');
});

test('chat prose: plain text starting with "{" and JSON that is not the chat reply stay as they are (Markdown), while streaming too', () => {
  const set = '{x} is a Python set literal; use it for membership tests.';
  const fenced = '```json\n{"name": "demo", "version": "1.0.0", "private": true}\n```';
  const bare = '{"name": "demo", "version": "1.0.0"}';
  for (const t of [set, '{} is an empty dict in Python.', fenced, bare, '{"a": 1} and then prose', '{ not json at all }']) {
    assert.equal(proseOf(t), t, `shown as it is: ${t}`);
  }
  // every prefix of such a reply: never blank once it has shown it is not the chat's reply
  for (const t of [set, bare]) {
    for (let i = 3; i <= t.length; i++) if (t[1] !== '"' || i > 8) assert.ok(proseOf(t.slice(0, i)).trim(), `prefix ${i} of ${t}`);
  }
  const turns = turnsFromMessages([
    { kind: 'instruction', content: { instruction: 'what is {x}?' } },
    { kind: 'assistant_response', content: { text: set } },
    { kind: 'instruction', content: { instruction: 'show package.json' } },
    { kind: 'assistant_response', content: { text: fenced } },
  ] as any);
  assert.deepEqual(turns.map((t) => t.items), [[{ kind: 'prose', text: set }], [{ kind: 'prose', text: fenced }]]);
  const html = conversationHtml(turns);
  assert.ok(html.includes('{x} is a Python set literal'), html);
  assert.match(html, /<div class="code-block" data-code="\{&quot;name&quot;: &quot;demo&quot;/);
  // the chat's own shapes are still unpacked: its fields, or prose fields only
  assert.equal(proseOf('{"answer": "Done."}'), 'Done.');
  assert.equal(proseOf('{"action_required": false, "action_requests": [], "summary": "ok"}'), 'ok');
  assert.equal(proseOf('```json\n{"answer": "fenced", "action_requests": []}\n```'), 'fenced');
});

test('refusesField: only an "unknown field" refusal of maxRounds means the server has no rounds, not a bad value', () => {
  assert.ok(refusesField({ code: -32602, message: 'invalid params: unknown field: "maxRounds"' }, 'maxRounds'));
  assert.ok(refusesField({ code: -32602, message: 'invalid params: unknown fields: "x", "maxRounds"' }, 'maxRounds'));
  assert.ok(refusesField({ code: -32602, message: 'bad', data: { unknownFields: ['maxRounds'] } }, 'maxRounds'));
  assert.ok(!refusesField({ code: -32602, message: 'invalid params: maxRounds: expected integer, got number 2.5' }, 'maxRounds'));
  assert.ok(!refusesField({ code: -32602, message: 'invalid params: maxRounds: maxRounds must be an integer of at least 1' }, 'maxRounds'));
  assert.ok(!refusesField({ code: -32602, message: 'invalid params: unknown field: "maxRoundsX"' }, 'maxRounds'));
  assert.ok(!refusesField({ code: -32000, message: 'unknown field: "maxRounds"' }, 'maxRounds'));
});

test('chat Markdown is sanitized (raw HTML escaped) and code blocks carry copy/insert buttons', () => {
  const html = renderMarkdown('hi <img src=x onerror=alert(1)> <script>bad()</script>\n\n```py\nprint("<b>")\n```');
  assert.ok(!html.includes('<img') && !html.includes('<script'), html);
  assert.ok(html.includes('&lt;img') && html.includes('&lt;script&gt;'), html);
  assert.match(html, /<div class="code-block" data-code="print\(&quot;&lt;b&gt;&quot;\)\n">/);
  assert.ok(html.includes('data-action="copy"') && html.includes('data-action="insert"'), html);
  assert.equal(nameFrom('Explain #file please\nmore'), 'Explain please');
  assert.equal(nameFrom('x'.repeat(60)).length, 48);
});

test('tool cards: compact titles with +added −removed; denied and failed calls marked', () => {
  const base = { callId: 'c1', tool: 'edit_file', args: { path: 'src/x.py', edits: [] } };
  assert.equal(cardTitle({ ...base, state: 'ok', output: { path: 'src/x.py', diff: '--- a\n+++ b\n@@\n-a\n+b\n+c\n+d\n', added: 3, removed: 1 } }), '✓ edit_file src/x.py +3 −1');
  assert.equal(cardTitle({ ...base, state: 'ok', output: { diff: '--- a\n+++ b\n-x\n+y\n' } }), '✓ edit_file src/x.py +1 −1');
  assert.equal(cardTitle({ ...base, state: 'denied', output: { error: 'denied by governance gate' } }), '⊘ edit_file src/x.py (rejected)');
  assert.equal(cardTitle({ ...base, state: 'ask' }), '? edit_file src/x.py (waiting for you)');
  // the server's reason: a permission request nobody answered is no rejection
  const denied = (reason: string) => cardTitle({ ...base, state: 'denied', output: { error: 'denied by governance gate', reason } });
  assert.equal(denied('permission request timed out'), '⊘ edit_file src/x.py (timed out: no answer, denied)');
  assert.equal(denied('denied by the user'), '⊘ edit_file src/x.py (rejected)');
  assert.equal(denied('denied by policy'), '⊘ edit_file src/x.py (denied by policy)');
  // its turn ended while it waited (stopped, or the window reloaded: the server records `cancelled`): nobody answered it, nobody cancelled it
  assert.equal(denied('the turn was stopped'), '⊘ edit_file src/x.py (no answer: the turn ended first)');
  assert.equal(denied('cancelled'), '⊘ edit_file src/x.py (no answer: the turn ended first)');
  assert.equal(cardTitle({ ...base, state: 'cancelled' }), '⊘ edit_file src/x.py (cancelled)');
  assert.equal(cardTitle({ callId: 'c', tool: 'shout', args: { text: 'hey' }, state: 'error', output: { error: 'x' } }), '✗ shout hey');
});

test('toolEvent summaries (compact JSON text, cut at 200 characters): a value when they parse, the text marked cut otherwise', () => {
  assert.deepEqual(toolSummary('{"path":"a.py","n":1}'), { value: { path: 'a.py', n: 1 }, cut: false });
  assert.deepEqual(toolSummary('"HEY!"'), { value: 'HEY!', cut: false });
  assert.deepEqual(toolSummary('null'), { value: null, cut: false });
  assert.deepEqual(toolSummary(undefined), { value: null, cut: false });
  // a cut JSON string shows as its text so far (a cut escape dropped)
  const s = '"' + 'ab\\n'.repeat(49) + 'x\\u';
  assert.equal(s.length, SUMMARY_LIMIT);
  assert.deepEqual(toolSummary(s), { value: 'ab\n'.repeat(49) + 'x', cut: true });
  assert.deepEqual(toolSummary('"' + 'q\\\\'.repeat(66) + 'q'), { value: 'q\\'.repeat(66) + 'q', cut: true });
  // a cut object stays text; shorter text that is no JSON (an older server's repr) is not marked cut
  const obj = '{"path":"src/x.py","content":"' + 'z'.repeat(SUMMARY_LIMIT);
  assert.deepEqual(toolSummary(obj.slice(0, SUMMARY_LIMIT)), { value: obj.slice(0, SUMMARY_LIMIT), cut: true });
  assert.deepEqual(toolSummary("{'text': 'hi'}"), { value: "{'text': 'hi'}", cut: false });

  const ev = (event: ToolEvent['event'], extra: Partial<ToolEvent>): ToolEvent =>
    ({ seq: 1, branchId: 'b', callId: 'c1', event, tool: 'write_file', argsSummary: '{}', ...extra });
  // a running call: the arguments parsed, the title names the path
  const card = cardOfToolEvent(undefined, ev('pre', { argsSummary: '{"path":"src/x.py","content":"hi"}' }));
  assert.deepEqual(card.args, { path: 'src/x.py', content: 'hi' });
  assert.equal(cardTitle(card), '… write_file src/x.py');
  assert.ok(cardHtml(card).includes(escapeHtml(JSON.stringify({ path: 'src/x.py', content: 'hi' }, null, 2))), cardHtml(card));
  cardOfToolEvent(card, ev('post', { resultSummary: '{"path":"src/x.py","added":3,"removed":1}' }));
  assert.equal(cardTitle(card), '✓ write_file src/x.py +3 −1');
  // cut arguments: shown as the text they are, marked; the title still names the path (a whole field)
  const cut = cardOfToolEvent(undefined, ev('pre', { argsSummary: obj.slice(0, SUMMARY_LIMIT) }));
  assert.equal(cut.argsCut, true);
  assert.equal(cardTitle(cut), '… write_file src/x.py');
  const html = cardHtml(cut);
  assert.ok(html.includes('arguments <span class="cut">(the first 200 characters)</span>') && html.includes('zzz…</pre>'), html);
  // a field cut at the end is no subject
  const cutPath = '{"path":"' + 'd/'.repeat(100);
  assert.equal(cardTitle(cardOfToolEvent(undefined, ev('pre', { argsSummary: cutPath.slice(0, SUMMARY_LIMIT) }))), '… write_file');
  // a cut output: its text, marked
  const out = cardOfToolEvent(undefined, ev('pre', {}));
  cardOfToolEvent(out, ev('post', { resultSummary: ('"' + 'r'.repeat(SUMMARY_LIMIT)).slice(0, SUMMARY_LIMIT) }));
  assert.ok(out.state === 'ok' && out.output === 'r'.repeat(SUMMARY_LIMIT - 1) && out.outputCut === true, JSON.stringify(out));
  assert.ok(cardHtml(out).includes('output <span class="cut">(the first 200 characters)</span>'), cardHtml(out));
});

test('turns: a further round (the continuation instruction after tools ran) stays in its turn and counts as a round', () => {
  const msg = (kind: string, content: object, i: number) => ({ id: String(i), kind, role: '', sender: null, recipient: null, createdAt: i, content }) as any;
  const turns = turnsFromMessages([
    msg('instruction', { instruction: 'fix it' }, 1),
    msg('assistant_response', { text: '{"answer": "Fixing.", "action_requests": [{"function": "edit_file"}]}', usage: { prompt_tokens: 5, completion_tokens: 2 } }, 2),
    msg('action_request', { callId: 'a', function: 'edit_file', arguments: { path: 'x.py' } }, 3),
    msg('action_response', { callId: 'a', function: 'edit_file', arguments: { path: 'x.py' }, output: { diff: '-a\n+b\n' } }, 4),
    msg('instruction', { instruction: 'Continue the same task. The results of the tools you called are above.' }, 5),
    msg('assistant_response', { text: '{"answer": "Fixed."}', usage: { prompt_tokens: 7, completion_tokens: 1 } }, 6),
    msg('instruction', { instruction: 'Continue the same task. (typed by the user, no tool before)' }, 7),
  ]);
  assert.equal(turns.length, 2);
  assert.deepEqual(turns[0].items.map((i) => (i.kind === 'tool' ? cardTitle(i.card) : i.text)), ['Fixing.', '✓ edit_file x.py +1 −1', 'Fixed.']);
  assert.deepEqual(turns[0].usage, { inputTokens: 12, outputTokens: 3, modelCalls: 2, rounds: 2 });
  assert.equal(turns[1].user, 'Continue the same task. (typed by the user, no tool before)');
});

test('local turns: a failed or stopped turn stays in order among the server\'s turns; one recorded in part gets its mark', () => {
  const msg = (kind: string, content: object, i: number) => ({ id: String(i), kind, role: '', sender: null, recipient: null, createdAt: i, content }) as any;
  const local = (user: string, extra: Partial<Turn>): Turn => ({ user, contextLabels: [], items: [], ...extra });
  // turn A (messages 0-1), a crash that the server never recorded, turn B (messages 2-3) after it
  const crashed = local('crash here', { error: 'the server died', outcome: 'failed' });
  const locals: LocalTurn[] = [{ turn: crashed, at: 2 }];
  resolveLocalTurns(locals, 2);   // read first after the crash: nothing after message 2
  assert.equal(locals[0].recorded, false);
  const server = turnsFromMessages([
    msg('instruction', { instruction: 'A' }, 0), msg('assistant_response', { text: 'a' }, 1),
    msg('instruction', { instruction: 'crash here' }, 2), msg('assistant_response', { text: 'retried' }, 3),
  ]);
  assert.deepEqual(server.map((t) => t.start), [0, 2]);
  const shown = withLocalTurns(server, locals);
  assert.deepEqual(shown.map((t) => [t.user, t.outcome ?? 'ok']), [['A', 'ok'], ['crash here', 'failed'], ['crash here', 'ok']],
    'the failed turn, then its retry with the same text');
  assert.ok(!server[1].error && !server[1].outcome, 'the server turns are not changed');
  // a turn whose first round was recorded (a tool ran), stopped in the second: the server's turn gets the mark
  const stopped = local('edit it', { note: 'Stopped.', outcome: 'stopped' });
  const partial: LocalTurn[] = [{ turn: stopped, at: 2 }];
  resolveLocalTurns(partial, 6);
  const withPartial = withLocalTurns(turnsFromMessages([
    msg('instruction', { instruction: 'A' }, 0), msg('assistant_response', { text: 'a' }, 1),
    msg('instruction', { instruction: 'edit it' }, 2), msg('assistant_response', { text: 'Editing.' }, 3),
    msg('action_request', { callId: 'c', function: 'edit_file', arguments: {} }, 4),
    msg('action_response', { callId: 'c', function: 'edit_file', output: { diff: '' } }, 5),
  ]), partial);
  assert.deepEqual(withPartial.map((t) => [t.user, t.note ?? '', t.outcome ?? 'ok', t.items.length]), [['A', '', 'ok', 1], ['edit it', 'Stopped.', 'stopped', 2]]);
  // stopped before the branch had any message, then a turn that worked: local first
  assert.deepEqual(withLocalTurns(turnsFromMessages([msg('instruction', { instruction: 'B' }, 0)]), [{ turn: stopped, at: 0, recorded: false }])
    .map((t) => t.user), ['edit it', 'B']);
  const html = conversationHtml(shown);
  assert.ok(html.includes('<section class="turn failed" data-turn="1">') && html.includes('the server died'), html);
});

test('a failed or stopped turn offers Retry (a labelled button, by the turn\'s id) and Edit, also on the server\'s turn that got its mark; none on a finished or running turn', () => {
  const msg = (kind: string, content: object, i: number) => ({ id: String(i), kind, role: '', sender: null, recipient: null, createdAt: i, content }) as any;
  const local = (user: string, extra: Partial<Turn>): Turn => ({ user, contextLabels: [], items: [], ...extra });
  const retryOf = (html: string) => /<button class="retry secondary" data-action="retry" data-turn-id="([^"]*)" aria-label="Retry: send this message again"/.exec(html)?.[1];
  const failed = turnHtml(local('fix <it>', { error: 'boom', outcome: 'failed', id: 'a"1' }), 0);
  assert.equal(retryOf(failed), escapeHtml('a"1'), failed);
  assert.ok(failed.includes('<button class="edit link" data-action="edit" aria-label="Edit and resend: put this message back into the input"'), failed);
  assert.equal(retryOf(turnHtml(local('stop me', { note: 'Stopped.', outcome: 'stopped', id: 's1' }), 0)), 's1');
  for (const t of [local('done', {}), local('running', { outcome: 'stopped', id: 'r', running: true }), local('', { error: 'unreadable', outcome: 'failed', id: 'e' }),
    local('no id', { outcome: 'failed', error: 'x' })]) {
    assert.ok(!turnHtml(t, 0).includes('data-action="retry"'), `no Retry: ${JSON.stringify(t)}`);
  }
  // stopped in its second round: the server recorded the first; its turn gets the mark and the id (Retry finds the local turn)
  const withPartial = withLocalTurns(turnsFromMessages([msg('instruction', { instruction: 'edit it' }, 0), msg('assistant_response', { text: 'Editing.' }, 1)]),
    [{ turn: local('edit it', { note: 'Stopped.', outcome: 'stopped', id: 'p1' }), at: 0, recorded: true }]);
  assert.deepEqual(withPartial.map((t) => [t.user, t.id, t.items.length]), [['edit it', 'p1', 1]]);
  assert.equal(retryOf(conversationHtml(withPartial)), 'p1');
  // the keys of a waiting call are on its buttons
  const ask = cardHtml({ callId: 'c', tool: 'shout', args: { text: 'x' }, state: 'ask', ask: { diff: false } });
  assert.ok(ask.includes('aria-keyshortcuts="Control+Enter Meta+Enter">Accept</button>') && ask.includes('aria-keyshortcuts="Control+Backspace Meta+Backspace">Reject</button>'), ask);
});

test('a reply that ended well offers Copy (its Markdown, each prose piece once, the tool cards and thoughts left out); none while it runs, after a failure or a stop, or with no prose', () => {
  const turn = (extra: Partial<Turn>): Turn => ({ user: 'u', contextLabels: [], items: [], ...extra });
  const card: ToolCard = { callId: 'c', tool: 'read_file', args: { path: 'a' }, state: 'ok' };
  const done = turn({ items: [{ kind: 'thought', text: 'hmm' }, { kind: 'prose', text: 'First **part**.\n' }, { kind: 'tool', card },
    { kind: 'prose', text: '  ' }, { kind: 'prose', text: '```py\nx = 1\n```' }] });
  assert.equal(replyText(done), 'First **part**.\n\n```py\nx = 1\n```');
  const copy = '<button class="link" data-action="copyReply" aria-label="Copy this reply as Markdown"';
  assert.ok(turnHtml(done, 3).includes(copy), turnHtml(done, 3));
  for (const t of [turn({ ...done, running: true }), turn({ ...done, outcome: 'failed', error: 'x', id: 'f' }),
    turn({ ...done, outcome: 'stopped', id: 's' }), turn({ items: [{ kind: 'tool', card }] })]) {
    assert.ok(!turnHtml(t, 0).includes('copyReply'), `no Copy: ${JSON.stringify(t)}`);
  }
});

test('Export Chat: the conversation as one Markdown document, each message with its context, the reply\'s prose, thoughts folded, tool calls as lines with their arguments and output folded, an edit\'s diff (a fence longer than any backticks in it) and a failed call\'s error, the turn\'s error, note, usage; a running turn says so', () => {
  const edit: ToolCard = { callId: 'e', tool: 'edit_file', args: { path: 'src/x.py' }, state: 'ok',
    output: { path: 'src/x.py', diff: '--- a/src/x.py\n+++ b/src/x.py\n@@ -1 +1 @@\n-s = "```"\n+s = "````"\n' } };
  const failed: ToolCard = { callId: 'f', tool: 'run_command', args: { command: 'make `x`' }, state: 'error', output: { error: 'exit status 2\nmore' } };
  // a plain output the server cut (text, not a value), no arguments; a call not answered yet: its title only
  const cut: ToolCard = { callId: 'c', tool: 'read_file', args: {}, state: 'ok', output: 'line 1\n\n```', outputCut: true };
  const asked: ToolCard = { callId: 'a', tool: 'shout', args: '', state: 'running' };
  const turns: Turn[] = [
    { user: 'Fix #file:src/x.py', contextLabels: ['src/x.py'], items: [
      { kind: 'thought', text: 'Look at it.', ms: 3000 }, { kind: 'prose', text: 'Done:\n\n```py\ns = 1\n```' },
      { kind: 'tool', card: edit }, { kind: 'tool', card: failed }, { kind: 'tool', card: cut }, { kind: 'tool', card: asked },
      { kind: 'prose', text: '  ' }],
    usage: { inputTokens: 120, outputTokens: 30, modelCalls: 2, rounds: 2 } },
    { user: 'Again', contextLabels: [], items: [], outcome: 'failed', error: 'the server stopped' },
    { user: 'Stop', contextLabels: [], items: [{ kind: 'prose', text: 'Part' }], outcome: 'stopped', note: 'Stopped.' },
    { user: 'Now', contextLabels: [], items: [], running: true },
  ];
  const md = chatMarkdown(turns, '  Fix  the\nbug ', 'Exported then');
  assert.equal(md, [
    '# Fix the bug', '*Exported then*',
    '---', '### You', 'Fix #file:src/x.py', '*Context:* `src/x.py`',
    '### Assistant', '<details><summary>Thought for 3 s</summary>\n\n```text\nLook at it.\n```\n\n</details>', 'Done:\n\n```py\ns = 1\n```',
    '- `✓ edit_file src/x.py +1 −1`\n\n'
      + '  <details><summary>Arguments and output</summary>\n\n'
      + '  Arguments:\n\n  ```json\n  {\n    "path": "src/x.py"\n  }\n  ```\n\n'
      + '  Output:\n\n  ```json\n  {\n    "path": "src/x.py"\n  }\n  ```\n\n  </details>\n\n'
      + '  `````diff\n  --- a/src/x.py\n  +++ b/src/x.py\n  @@ -1 +1 @@\n  -s = "```"\n  +s = "````"\n  `````',
    '- `` ✗ run_command make `x` ``: `exit status 2`\n\n' // (a space inside both ends: CommonMark strips one from each)
      + '  <details><summary>Arguments and output</summary>\n\n'
      + '  Arguments:\n\n  ```json\n  {\n    "command": "make `x`"\n  }\n  ```\n\n'
      + '  Output:\n\n  ```json\n  {\n    "error": "exit status 2\\nmore"\n  }\n  ```\n\n  </details>',
    '- `✓ read_file`\n\n  <details><summary>Arguments and output</summary>\n\n'
      + '  Output (the first ' + SUMMARY_LIMIT + ' characters):\n\n  ````\n  line 1\n\n  ```…\n  ````\n\n  </details>',
    '- `… shout`',
    '*120 in · 30 out tokens · 2 model calls · 2 rounds*',
    '---', '### You', 'Again', '### Assistant', '**Error:**\n\n```text\nthe server stopped\n```',
    '---', '### You', 'Stop', '### Assistant', 'Part', '*Stopped.*',
    '---', '### You', 'Now', '### Assistant', '*(still running when the chat was exported)*',
  ].join('\n\n') + '\n');
  // a title with nothing in it; a turn with no message (the server could not be read) has no "You"
  assert.equal(chatMarkdown([{ user: '', contextLabels: [], items: [], error: 'x' }], ' '), '# Chat\n\n---\n\n### Assistant\n\n**Error:**\n\n```text\nx\n```\n');
});

test('Export Chat keeps the document whole: thoughts (often cut off) are fenced in their fold, and a message or reply that leaves a code fence open has it closed, so the turns after it stay turns', () => {
  assert.equal(fencesClosed('a\n```py\nx = 1'), 'a\n```py\nx = 1\n```');
  assert.equal(fencesClosed('~~~~\n```\n~~~'), '~~~~\n```\n~~~\n~~~~');          // (a shorter run, another character: still open)
  assert.equal(fencesClosed('```\nx\n````  \n    ```'), '```\nx\n````  \n    ```');  // (closed; then indented 4: code, no fence)
  assert.equal(fencesClosed('``` x\n``` y'), '``` x\n``` y\n```');                  // (a closing fence holds nothing after it)
  const turns: Turn[] = [
    { user: 'Show:\n```sh\nls', contextLabels: [], items: [
      { kind: 'thought', text: 'Draft:\n```python\nprint(1)\n</details>' }, { kind: 'prose', text: 'Open:\n~~~python\nx = 1' }] },
    { user: 'Next', contextLabels: [], items: [{ kind: 'prose', text: 'Fine.' }] },
  ];
  const md = chatMarkdown(turns, 'T');
  assert.ok(md.includes('<details><summary>Thought</summary>\n\n````text\nDraft:\n```python\nprint(1)\n</details>\n````\n\n</details>'), md);
  assert.ok(md.includes('Show:\n```sh\nls\n```') && md.includes('Open:\n~~~python\nx = 1\n~~~'), md);
  const html = new MarkdownIt('commonmark').render(md);
  assert.deepEqual([html.split('<h3>').length - 1, html.split('<details>').length - 1, html.split('</details>').length - 1,
    html.includes('<p>Fine.</p>')], [4, 1, 1, true], html);
});

test('Export Chat: a turn\'s error, a failed call\'s error and a note are text, not Markdown: a traceback keeps its layout, `__init__.py` is no bold, a fence in an error takes in none of the turns after it', () => {
  const traceback = 'The server is not running (exit code 1).\nTraceback (most recent call last):\n  File "/srv/pkg/__init__.py", line 3\n'
    + '  File "/srv/tools.py", line 9\n    ```\n    ^\nSyntaxError: invalid syntax';
  const card: ToolCard = { callId: 'f', tool: 'read_file', args: { path: 'a.py' }, state: 'error', output: { error: 'no __init__.py in `pkg` <here>' } };
  const turns: Turn[] = [
    { user: 'first', contextLabels: [], items: [{ kind: 'prose', text: 'hi' }, { kind: 'tool', card }], error: traceback, outcome: 'failed' },
    { user: 'a', contextLabels: [], items: [], error: 'model error: could not parse the reply:\n```json\n{"answer": "x"', outcome: 'failed' },
    { user: 'b', contextLabels: [], items: [], note: 'Stopped: read_file: __init__.py *was* [gone] <b>', outcome: 'stopped' },
    { user: 'second question', contextLabels: [], items: [{ kind: 'prose', text: 'second answer' }] },
  ];
  const md = chatMarkdown(turns, 'T');
  const html = new MarkdownIt().render(md);
  // every turn is there: 4 "You" and 4 "Assistant" headings, the last answer a paragraph
  assert.equal(html.split('<h3>').length - 1, 8, html);
  assert.ok(html.includes('<p>second answer</p>'), html);
  // the traceback as it was, in a code block; nothing of the errors or the note read as emphasis or HTML
  assert.ok(html.includes('  File &quot;/srv/pkg/__init__.py&quot;, line 3\n'), html);
  assert.ok(!html.includes('<strong>init</strong>') && !html.includes('<em>init</em>') && !html.includes('<em>was</em>') && !html.includes('<b>'), html);
  assert.ok(html.includes('<code>no __init__.py in `pkg` &lt;here&gt;</code>'), html);
  assert.ok(html.includes('<em>Stopped: read_file: __init__.py *was* [gone] &lt;b&gt;</em>'), html);
});

test('Retry sends a turn\'s context again unless the branch holds the turn (stopped after its first round): the server recorded its instruction with that context, so it is not sent twice; the Retry button says which', () => {
  const msg = (kind: string, content: object, i: number) => ({ id: String(i), kind, role: '', sender: null, recipient: null, createdAt: i, content }) as any;
  const local = (user: string, extra: Partial<Turn>): Turn => ({ user, contextLabels: ['src/a.py'], items: [], ...extra });
  const context = { labels: ['src/a.py'], file: { file: 'src/a.py', text: 'print(1)\n' } };
  // a turn stopped while its first round's call waited for permission: the instruction (with its context) and the reply are on the branch
  const server = turnsFromMessages([
    msg('instruction', { instruction: 'A' }, 0), msg('assistant_response', { text: 'a' }, 1),
    msg('instruction', { instruction: 'edit #file', context }, 2),
    msg('assistant_response', { text: '{"answer": "Editing.", "action_requests": [{"function": "shout", "arguments": {"text": "x"}}]}' }, 3),
  ]);
  const stopped: LocalTurn = { turn: local('edit #file', { note: 'Stopped.', outcome: 'stopped', id: 's1' }), at: 2, recorded: true, context };
  assert.equal(onBranch(stopped, server), true);
  assert.equal(retryContext(stopped, server), undefined, 'the context is in the branch\'s history: not sent again');
  // a failed operate recorded nothing; not known yet (the end of the turn could not be read): the context as it was sent
  const failed: LocalTurn = { turn: local('edit #file', { error: 'boom', outcome: 'failed', id: 'f1' }), at: 4, recorded: false, context };
  assert.deepEqual(retryContext(failed, server), context);
  assert.deepEqual(retryContext({ ...stopped, recorded: undefined }, server), context);
  // recorded, but the branch's turn there is another message (or the branch was not read back): the context goes along
  assert.deepEqual(retryContext({ ...stopped, turn: local('something else', { outcome: 'stopped', id: 's2' }) }, server), context);
  assert.deepEqual(retryContext(stopped, []), context);
  assert.equal(retryContext({ ...failed, context: undefined }, server), undefined, 'nothing attached: nothing to send');
  // the Retry button's tooltip: the branch's turn has what was attached already; a local one sends it again
  const title = (html: string) => /data-action="retry"[^>]* title="([^"]*)"/.exec(html)?.[1];
  const shown = withLocalTurns(server, [stopped, failed]);
  assert.deepEqual(shown.map((t) => [t.user, t.outcome ?? 'ok', t.contextLabels]), [['A', 'ok', []], ['edit #file', 'stopped', ['src/a.py']], ['edit #file', 'failed', ['src/a.py']]]);
  assert.equal(title(turnHtml(shown[1], 1)), 'Send this message again (what was attached to it is in this turn already: not sent twice)');
  assert.equal(title(turnHtml(shown[2], 2)), 'Send this message again (with what was attached to it)');
});

test('the Accept / Reject tooltips name the modifier the user\'s keyboard has: Ctrl, Cmd on macOS (the webview says which), through the whole conversation', () => {
  const card: ToolCard = { callId: 'c', tool: 'shout', args: { text: 'x' }, state: 'ask', ask: { diff: false } };
  const titles = (html: string) => [...html.matchAll(/title="([^"]*)" aria-keyshortcuts/g)].map((m) => m[1]);
  assert.deepEqual(titles(cardHtml(card)), ['Accept (Ctrl+Enter in the chat)', 'Reject (Ctrl+Backspace in the chat, outside the input)']);
  assert.deepEqual(titles(cardHtml(card, 'Cmd')), ['Accept (Cmd+Enter in the chat)', 'Reject (Cmd+Backspace in the chat, outside the input)']);
  const turns: Turn[] = [{ user: 'go', contextLabels: [], items: [{ kind: 'tool', card }], running: true }];
  assert.deepEqual(titles(conversationParts(turns, 'Cmd')[0]), titles(cardHtml(card, 'Cmd')));
  assert.deepEqual(titles(conversationHtml(turns)), titles(cardHtml(card)));
  // the keys themselves are the same on every platform (the view takes either modifier)
  assert.ok(cardHtml(card, 'Cmd').includes('aria-keyshortcuts="Control+Enter Meta+Enter">Accept</button>'));
});

test('local turns are stored per chat (kept through a window reload), with the context Retry sends again; bounded per chat and by chats', () => {
  const turn = (user: string): LocalTurn => ({ turn: { user, contextLabels: ['src/a.py'], items: [], outcome: 'failed', error: 'x', id: user }, at: 2, recorded: false,
    context: { labels: ['src/a.py'], file: { file: 'src/a.py', text: 'print(1)\n' } } });
  let stored = storeLocalTurns(undefined, 'b1', [turn('one')], 1);
  // as the workspace state keeps it (JSON): the turn and its context come back whole
  stored = JSON.parse(JSON.stringify(stored));
  assert.deepEqual(stored.b1.turns, [turn('one')]);
  const many = Array.from({ length: KEPT_LOCAL_TURNS + 5 }, (_, i) => turn(`t${i}`));
  stored = storeLocalTurns(stored, 'b2', many, 2);
  assert.deepEqual(stored.b2.turns.map((l) => l.turn.user), many.slice(-KEPT_LOCAL_TURNS).map((l) => l.turn.user), 'the last ones of a chat');
  assert.equal(stored.b1.turns.length, 1, 'another chat is kept');
  const before = stored;
  stored = storeLocalTurns(stored, 'b1', [], 3);
  assert.ok(!('b1' in stored) && 'b1' in before, 'none left: the chat is dropped (a new object, the old one unchanged)');
  for (let i = 0; i < KEPT_LOCAL_CHATS + 3; i++) stored = storeLocalTurns(stored, `c${i}`, [turn('x')], 10 + i);
  assert.equal(Object.keys(stored).length, KEPT_LOCAL_CHATS);
  assert.ok(!('b2' in stored) && !('c0' in stored) && `c${KEPT_LOCAL_CHATS + 2}` in stored, 'the chats changed last are kept');
  // a turn of a chat not yet bound to a branch ('') is a chat like any other
  assert.deepEqual(storeLocalTurns(undefined, '', [turn('early')], 1)[''].turns.map((l) => l.turn.user), ['early']);
  // resolveLocalTurns says whether it decided anything (the chat then stores them again)
  const locals: LocalTurn[] = [{ turn: turn('u').turn, at: 2 }];
  assert.equal(resolveLocalTurns(locals, 2), true);
  assert.equal(resolveLocalTurns(locals, 5), false);
  assert.equal(locals[0].recorded, false);
});

test('the thoughts and notes of the turns a chat ran are kept by branch and turn (through a window reload), the newest replacing; bounded in turns and characters, a long stretch cut and marked; a deleted branch\'s go', () => {
  const kept = (text: string, note?: string): KeptTurn => ({ thoughts: [{ at: 0, text, ms: 1200 }], ...(note && { note }) });
  let stored = storeKeptTurn(undefined, 'b1@0', kept('first thought'));
  stored = storeKeptTurn(stored, 'b2@0', kept('other chat'));
  const before = stored;
  stored = storeKeptTurn(stored, 'b1@0', kept('first thought, again', 'Stopped: …'));
  assert.equal(before.length, 2, 'a new list: the old one unchanged');
  // as the workspace state keeps it (JSON): whole, the one stored last newest
  stored = JSON.parse(JSON.stringify(stored)) as StoredKeptTurns;
  assert.deepEqual(stored, [['b2@0', kept('other chat')], ['b1@0', kept('first thought, again', 'Stopped: …')]]);
  for (let i = 0; i < KEPT_TURNS + 5; i++) stored = storeKeptTurn(stored, `b3@${i * 2}`, kept(`t${i}`));
  assert.equal(stored.length, KEPT_TURNS);
  assert.deepEqual([stored[0][0], stored.at(-1)![0]], ['b3@10', `b3@${(KEPT_TURNS + 4) * 2}`], 'the latest turns');
  // a stretch longer than KEPT_THOUGHT_CHARS: its beginning, marked as cut; turns beyond KEPT_CHARS of thoughts: dropped, oldest first
  const long = 'x'.repeat(KEPT_THOUGHT_CHARS + 10);
  for (let i = 0; i < 12; i++) stored = storeKeptTurn(stored, `b4@${i}`, kept(long));
  const texts = stored.flatMap(([, k]) => k.thoughts.map((t) => t.text));
  assert.ok(texts.reduce((n, t) => n + t.length, 0) <= KEPT_CHARS + 12 * THOUGHT_CUT.length, 'at most KEPT_CHARS characters of thoughts');
  assert.equal(stored.at(-1)![1].thoughts[0].text, long.slice(0, KEPT_THOUGHT_CHARS) + THOUGHT_CUT);
  assert.ok(stored.length < 12 && stored.every(([k]) => k.startsWith('b4@')), `only the newest long ones: ${stored.map(([k]) => k)}`);
  // a turn over all the bounds alone is still kept (cut)
  assert.equal(storeKeptTurn([], 'b5@0', { thoughts: Array.from({ length: 20 }, () => ({ at: 0, text: long })) }).length, 1);
  // a deleted branch's turns go; another branch's (whose id begins the same) stay
  stored = storeKeptTurn(storeKeptTurn(stored, 'b4x@1', kept('stays')), 'b4@99', kept('goes'));
  assert.deepEqual(forgetKeptTurns(stored, 'b4').map(([k]) => k), ['b4x@1']);
  assert.deepEqual(forgetKeptTurns(undefined, 'b4'), []);
});

test('the status line of a running turn says what it does, from its $/progress phases: waiting for the model, writing, reading the reply, a repair attempt, running tools, the round after tool calls; a waiting decision comes first; gone once the turn ends', () => {
  const report = (phase: string, message = '', delta?: string) => ({ kind: 'report', phase, message, ...(delta !== undefined && { delta }) });
  /** The status line after each value, from a new turn of `maxRounds`. */
  const said = (values: { kind: string; phase?: string; message?: string; delta?: string }[], maxRounds?: number) => {
    let p: TurnProgress = { round: 1, ...(maxRounds !== undefined && { maxRounds }) };
    return values.map((v) => { p = progressAfter(p, v); return statusText(p); });
  };
  assert.equal(statusText(undefined), 'working…');   // nothing reported yet (the server starting, the branch made)
  assert.equal(statusText({ round: 1 }), 'working…');
  const repair = 'the reply was not in the expected format: asking the model again (attempt 1)…';
  assert.deepEqual(said([
    { kind: 'begin', message: 'communicate' },
    report('request', 'calling s'),
    report('stream', 'streaming', 'not '), report('stream', 'streaming', 'json'),
    report('parse', 'parsing reply'),
    report('parse', 'repair attempt 1'),
    report('parse', 'repair attempt 2'),
    { kind: 'end', message: 'completed' },
  ], 4), ['working…', 'waiting for the model…', 'writing…', 'writing…', 'reading the reply…', repair,
    'the reply was not in the expected format: asking the model again (attempt 2)…',
    'the reply was not in the expected format: asking the model again (attempt 2)…']);
  // several rounds: a request after tool calls ran is the next round (the wire has no round number); a
  // repair in a later round says both
  assert.deepEqual(said([
    report('request'), report('stream', 'streaming', '{'), report('parse', 'parsing reply'), report('actions', 'running tools'),
    report('request'), report('parse', 'parsing reply'), report('parse', 'repair attempt 1'), report('actions', 'running tools'),
    report('request'), report('stream', 'streaming', 'done'),
  ], 8), ['waiting for the model…', 'writing…', 'reading the reply…', 'running tools…',
    'round 2 of up to 8 · waiting for the model…', 'round 2 of up to 8 · reading the reply…', `round 2 of up to 8 · ${repair}`, 'round 2 of up to 8 · running tools…',
    'round 3 of up to 8 · waiting for the model…', 'round 3 of up to 8 · writing…']);
  // a reasoning model: its thoughts begin with a `stream` report "thinking" with no delta (their text, to a client
  // that announced `thoughts`, in more such reports with `thought`), then it writes; a delta whose message happens
  // to be "thinking" is writing
  const thought = { kind: 'report', phase: 'stream', message: 'thinking', thought: 'hmm' };
  assert.deepEqual(said([report('request'), report('stream', 'thinking'), thought, report('stream', 'streaming', 'Hi'),
    report('stream', 'thinking'), report('stream', 'thinking', 'x')]),
  ['waiting for the model…', 'thinking…', 'thinking…', 'writing…', 'thinking…', 'writing…']);
  // the round limit not known (a server without maxRounds: single rounds): the round alone, never an invented limit
  assert.deepEqual(said([report('request'), report('actions'), report('request')]), ['waiting for the model…', 'running tools…', 'round 2 · waiting for the model…']);
  // a request that follows no tool call is no new round; a phase this client does not know changes nothing
  assert.deepEqual(said([report('request'), report('parse', 'repair attempt 3'), report('later-phase'), report('request')], 4),
    ['waiting for the model…', 'the reply was not in the expected format: asking the model again (attempt 3)…',
      'the reply was not in the expected format: asking the model again (attempt 3)…', 'waiting for the model…']);
  // the turn shows it (escaped) in place of "working…"; a call waiting for a decision says that instead; an ended turn has no status line
  const turn: Turn = { user: 'go', contextLabels: [], items: [], running: true, status: `${repair} <b>` };
  assert.ok(turnHtml(turn, 0).includes(`<div class="running"><span class="spinner"></span> ${repair} &lt;b&gt;</div>`), turnHtml(turn, 0));
  const card: ToolCard = { callId: 'c1', tool: 'shout', args: { text: 'x' }, state: 'ask', ask: { diff: false } };
  turn.items.push({ kind: 'tool', card });
  turn.status = 'running tools…';
  const waiting = turnHtml(turn, 0);
  assert.ok(waiting.includes('waiting for your decision: Accept or Reject above') && !waiting.includes('running tools…'), waiting);
  turn.running = false;
  assert.ok(!turnHtml(turn, 0).includes('class="running'), turnHtml(turn, 0));
});

test('a running turn whose call waits for the user says so (not "working…"); the conversation comes in parts, one per turn; Markdown renders the same from its cache', () => {
  const card: ToolCard = { callId: 'c1', tool: 'shout', args: { text: 'x' }, state: 'ask', ask: { diff: false } };
  const waiting: Turn = { user: 'go', contextLabels: [], items: [{ kind: 'tool', card }], running: true };
  const html = conversationHtml([waiting]);
  assert.ok(html.includes('<div class="running waiting"><span class="spinner"></span> waiting for your decision: Accept or Reject above</div>') && !html.includes('working…'), html);
  delete card.ask;
  card.state = 'running';
  assert.ok(conversationHtml([waiting]).includes('working…') && !conversationHtml([waiting]).includes('waiting for your decision'));
  const parts = conversationParts([{ user: 'a', contextLabels: [], items: [] }, waiting]);
  assert.equal(parts.length, 2);
  assert.ok(parts[0].startsWith('<section class="turn" data-turn="0">') && parts[1].startsWith('<section class="turn" data-turn="1">'), parts.join('\n'));
  assert.deepEqual(conversationParts([]).length, 1);
  // a permission request that failed (the editor's handler failed) says so in words, not the transport's
  const failed = cardOfToolEvent(cardOfToolEvent(undefined, { branchId: 'b', callId: 'c2', tool: 'edit_file', event: 'pre', argsSummary: '{"path":"src/u.py"}' } as ToolEvent),
    { branchId: 'b', callId: 'c2', tool: 'edit_file', event: 'denied', error: 'permission request failed: Request requestToolPermission failed with message: x' } as ToolEvent);
  assert.equal(cardTitle(failed), '⊘ edit_file src/u.py (no answer: the request to the editor failed)');
  const md = '# T\n\n<img src=x onerror=alert(1)> **b**\n\n```js\nlet a = "<b>";\n```\n';
  const first = renderMarkdown(md);
  assert.equal(renderMarkdown(md), first);
  assert.ok(!first.includes('<img') && first.includes('&lt;img') && first.includes('data-code="let a = &quot;&lt;b&gt;&quot;;'), first);
});

test('the rendered-Markdown cache keeps no streamed prefix (only the latest), and finished text within a bound of characters', () => {
  const line = 'Some text of the reply, with `code` and **bold** words in it, line N.\n';
  const reply = line.repeat(Math.ceil(30_000 / line.length));
  const before = markdownCacheSize();
  // the reply streams: the view's flush renders each prefix, a redraw renders the running turn (its last item streams)
  for (let i = 1; i <= 300; i++) {
    const prefix = reply.slice(0, Math.floor(reply.length * i / 300));
    renderMarkdown(prefix, true);
    if (i % 30 === 0) conversationParts([{ user: 'q', contextLabels: [], items: [{ kind: 'thought', text: prefix, live: true }], running: true },
      { user: 'q', contextLabels: [], items: [{ kind: 'prose', text: prefix }], running: true }]);
  }
  const streamed = markdownCacheSize();
  assert.ok(streamed.entries <= before.entries + 1, `entries ${before.entries} -> ${streamed.entries}`);
  assert.ok(streamed.chars <= before.chars + 3 * reply.length, `chars ${before.chars} -> ${streamed.chars}`);
  // the reply ended: cached (one entry more), rendered the same
  const html = renderMarkdown(reply, true);
  assert.equal(renderMarkdown(reply), html);
  assert.equal(renderMarkdown(reply), html);
  // long finished texts: the oldest go once the cache holds 4,000,000 characters (source and HTML)
  for (let i = 0; i < 30; i++) renderMarkdown(`${i} ${line.repeat(1400)}`);
  const full = markdownCacheSize();
  assert.ok(full.chars <= 4_000_000 + 3 * reply.length && full.entries < 30, JSON.stringify(full));
});

test('a redraw of a long chat builds the HTML of its running turn only: a finished turn\'s is built once, again when it changes', () => {
  const body = 'x = 1  # <some> "code" & more\n'.repeat(300);
  const turns: Turn[] = Array.from({ length: 50 }, (_, i) => ({ user: `q${i}`, contextLabels: [], items: Array.from({ length: 5 }, (_, j) => ({ kind: 'tool' as const,
    card: { callId: `c${i}-${j}`, tool: 'read_file', args: { path: `f${j}.py` }, output: { path: `f${j}.py`, text: body }, state: 'ok' as const } })) }));
  const live: Turn = { user: 'now', contextLabels: [], items: [], running: true };
  const built = () => { const n = turnsBuilt(); const parts = conversationParts([...turns, live]); return { n: turnsBuilt() - n, parts }; };
  const first = built();
  assert.equal(first.n, 51);
  // a tool event of the running turn, thoughts streaming: only the running turn is built again, the rest is the same HTML
  live.items.push({ kind: 'tool', card: { callId: 'r', tool: 'list_dir', args: { path: '.' }, state: 'running' } });
  for (let k = 0; k < 5; k++) {
    const again = built();
    assert.equal(again.n, 1);
    assert.deepEqual(again.parts.slice(0, 50), first.parts.slice(0, 50));
  }
  // what changes a finished turn builds it again: a mark, thoughts kept (a new items list), a card decided late, the modifier
  turns[3].note = 'Stopped.';
  turns[7].items = [{ kind: 'thought', text: 'hm', ms: 2000 }, ...turns[7].items];
  const late = turns[9].items[0];
  if (late.kind === 'tool') { late.card.state = 'denied'; late.card.output = { error: 'denied by governance gate' }; }
  const changed = built();
  assert.equal(changed.n, 4);
  assert.ok(changed.parts[3].includes('Stopped.') && changed.parts[7].includes('Thought for 2 s') && changed.parts[9].includes('⊘ read_file'));
  let n = turnsBuilt();
  conversationParts([...turns, live], 'Cmd');
  assert.equal(turnsBuilt() - n, 51);
  // a turn with a card that still runs or waits is built each time; a turn placed elsewhere (its data-turn) too
  const waiting: Turn = { user: 'w', contextLabels: [], items: [{ kind: 'tool', card: { callId: 'a', tool: 'shout', args: {}, state: 'ask', ask: { diff: false } } }] };
  n = turnsBuilt(); conversationParts([waiting]); conversationParts([waiting]);
  assert.equal(turnsBuilt() - n, 2);
  n = turnsBuilt(); const moved = conversationParts([live, ...turns]);
  assert.equal(turnsBuilt() - n, 51);
  assert.ok(moved[1].startsWith('<section class="turn" data-turn="1">'));
});

test('only a server that is gone says "the server is not running": an error answer of a running server is its own, also one with "closed" in it', () => {
  // the model's failures, answered by a running server
  for (const e of [
    new ResponseError(-32011, "model 'qwen3': the reply ended inside the model's thoughts (a <think> block that was never closed), with no answer after them"),
    new ResponseError(-32011, 'model error: RemoteProtocolError: peer closed connection without sending complete message body'),
    new ResponseError(-32011, 'the model did not answer initialize... within 30 s'),
    new ResponseError(-32602, 'EPIPE is not a field'),
    new Error('tool output: the file was closed'),
  ]) assert.equal(serverGone(e, true), false, e.message);
  // a server that is gone: not running, exited under the request, the connection lost, a start that failed
  const exited = new SidecarExitedError('operate', { exitCode: 1, signal: null, stderrTail: 'Traceback' });
  for (const e of [exited, new ResponseError(-32097, 'Pending response rejected since connection got disposed'), new ResponseError(-32099, 'write EPIPE'),
    new Error('Connection is closed.'), new Error('Connection is disposed.'), new Error('write EPIPE'),
    new Error('cannot start the server: the program "x" was not found on the PATH'), new Error('cannot start the server: it did not answer initialize within 30 s')]) {
    assert.equal(serverGone(e, true), true, e.message);
  }
  assert.equal(serverGone(new ResponseError(-32011, 'any'), false), true);
});

test('the permissionAnswer setting: a decision answers, empty or unset asks, any other value is a problem naming the setting and its values (and asks)', () => {
  for (const v of [undefined, null, '']) assert.deepEqual(permissionAnswerSetting(v), {});
  for (const v of ['allow_once', 'allow_always', 'deny_once', 'deny_always']) assert.deepEqual(permissionAnswerSetting(v), { answer: v });
  for (const v of ['allow', 'deny', 'Allow_once', 3, true, ['allow_once'], {}]) {
    const r = permissionAnswerSetting(v);
    assert.equal(r.answer, undefined);
    assert.ok(r.problem?.includes('operateSidecar.permissionAnswer') && r.problem.includes('allow_once, allow_always, deny_once, deny_always')
      && r.problem.includes(JSON.stringify(v)), r.problem);
  }
});

test('another operate on the chat\'s branch (the Operate command\'s) keeps its tool events and permission requests: the chat turn\'s are those between its progress\'s begin and end', () => {
  const span: OperateSpan = { branchId: 'B', began: false, ended: false };
  // the chat's operate waits behind the Operate command's on B: B's events are that one's
  assert.equal(ownsBranchEvent(span, 'B'), false);
  operateSpanAfter(span, { kind: 'begin' });
  assert.equal(ownsBranchEvent(span, 'B'), true);
  assert.equal(ownsBranchEvent(span, 'C'), false);
  assert.equal(ownsBranchEvent(undefined, 'B'), false);
  assert.equal(ownsBranchEvent({ branchId: '', began: true, ended: false }, ''), false);   // (no branch yet)
  operateSpanAfter(span, { kind: 'report' });
  assert.equal(ownsBranchEvent(span, 'B'), true);
  // it ended: an operate sent after it (waiting behind it) has the branch
  operateSpanAfter(span, { kind: 'end' });
  assert.equal(ownsBranchEvent(span, 'B'), false);
  // a first report without a begin (a server of another version) begins it too
  const s2: OperateSpan = { branchId: 'B', began: false, ended: false };
  operateSpanAfter(s2, { kind: 'report' });
  assert.equal(ownsBranchEvent(s2, 'B'), true);
});

test('the chat\'s own turn read back after it ended: where it began, also after another operate\'s turn recorded first on the branch; of two with the same message, the one with its reply', () => {
  const msg = (kind: string, content: object) => ({ kind, content, createdAt: 1 });
  const turn = (q: string, a: string) => [msg('instruction', { instruction: q }), msg('assistant_response', { text: a })];
  const server = turnsFromMessages([...turn('earlier', 'e'), ...turn('from the Operate command', 'its answer'), ...turn('chat question', 'chat answer')] as any);
  assert.equal(ownTurn(server, 2, 'chat question')?.start, 4);
  assert.equal(ownTurn(server, 2, 'not there'), undefined);
  assert.equal(ownTurn(server, 6, 'chat question'), undefined);   // (not recorded: the turn failed)
  const same = turnsFromMessages([...turn('q', 'e'), ...turn('go', 'the command\'s answer'), ...turn('go', 'the chat\'s answer')] as any);
  assert.equal(ownTurn(same, 2, 'go', "the chat's answer")?.start, 4);
  assert.equal(ownTurn(same, 2, 'go', "the command's answer")?.start, 2);
  assert.equal(ownTurn(same, 2, 'go')?.start, 2);
});

test('a chat that could not be read (the server is not running) shows its error with no empty message bubble above it', () => {
  const html = conversationHtml([{ user: '', contextLabels: [], items: [], error: 'The operate-sidecar server is not running (it exited).' }]);
  assert.ok(html.includes('<div class="error">The operate-sidecar server is not running (it exited).</div>'), html);
  assert.ok(!html.includes('class="user"'), `no empty bubble: ${html}`);
  assert.ok(conversationHtml([{ user: 'hi', contextLabels: [], items: [] }]).includes('<div class="user">hi</div>'));
});

test('a read of the chat cancelled by a restart (stop() cancels what still runs: -32800) shows no error; one the server could not answer does', async () => {
  const client = await SidecarClient.start({ command: [PYTHON, '-m', 'operate_sidecar.server'], cwd: REPO });
  let cancelled: unknown;
  let gone: unknown;
  try {
    await within(client.initialize({ settings: { stateDir: null, defaultModel: 'm', models: { m: { provider: 'scripted', responses: [{ text: 'late', delayMs: 60000 }] } } } }), 'initialize');
    const { branchId } = await within(client.createBranch({}), 'createBranch');
    // a request still running when the server is stopped for a restart (the chat's reads are quicker; they end the same way)
    let begun!: () => void;
    const began = new Promise<void>((r) => { begun = r; });
    const running = client.operate({ branchId, instruction: 'wait' }, { onProgress: () => begun() }).then(() => undefined, (e) => e);
    await within(began, 'the operate began');
    await within(client.stop(), 'stop');
    cancelled = await within(running, 'the running request ends');
    gone = await within(client.branchMessages(branchId).then(() => undefined, (e) => e), 'a read after the stop');
  } finally {
    await client.stop();
  }
  assert.ok(cancelled instanceof ResponseError && cancelled.code === ErrorCodes.Cancelled, `cancelled by stop(): ${cancelled}`);
  assert.ok(gone instanceof SidecarExitedError, `the server is gone: ${gone}`);
  const locals: LocalTurn[] = [{ turn: { user: 'failed before', contextLabels: [], items: [], outcome: 'failed', error: 'boom' }, at: 0, recorded: false }];
  // (while the server restarts, the extension says it is not running whatever the error)
  const problem = (e: unknown) => `The operate-sidecar server is not running (${e instanceof Error ? e.message : String(e)}).`;
  assert.equal(turnsAfterFailedRead(cancelled, locals, problem), undefined, 'a read the restart cancelled: the chat keeps what it shows, no error');
  assert.deepEqual(turnsAfterFailedRead(gone, locals, problem)?.map((t) => [t.user, t.error]), [['failed before', 'boom'], ['', problem(gone)]]);
  const missing = new ResponseError(ErrorCodes.BranchNotFound, 'no such branch');
  assert.deepEqual(turnsAfterFailedRead(missing, locals, problem)?.map((t) => [t.user, t.error]), [['failed before', 'boom']], 'a deleted branch: no error');
});

test('fs/readTextFile and fs/writeTextFile: edit_file reads the unsaved buffer and writes through the client; the chat shows prose, card and usage', async () => {
  const ws = fs.mkdtempSync(path.join(os.tmpdir(), 'chat-fs-'));
  const file = path.join(ws, 'a.py');
  fs.writeFileSync(file, 'x = 1\n');
  const buffers = new Map<string, string>([[file, 'x = 1\ny = 2   # unsaved\n']]);   // the editor's buffer differs from the disk
  const reads: string[] = [];
  const permissions: PermissionRequest[] = [];
  const client = await SidecarClient.start({ command: [PYTHON, '-m', 'operate_sidecar.server'], cwd: REPO });
  try {
    client.setFsHandlers({
      readTextFile: (p) => { reads.push(p.path); const t = buffers.get(p.path); if (t === undefined) throw new Error('no such file'); return t; },
      writeTextFile: (p) => { buffers.set(p.path, p.text); },
    });
    client.setPermissionHandler((req) => { permissions.push(req); return 'allow_once'; });
    await within(client.initialize({
      capabilities: { toolPermission: true, fs: true }, workspaceFolders: [ws],
      settings: { stateDir: null, defaultModel: 'm', models: { m: { provider: 'scripted', responses: [
        { json: { answer: 'Renaming **y**.', action_requests: [{ function: 'edit_file', arguments: { path: 'a.py', edits: [{ oldText: 'y = 2', newText: 'why = 2' }] } }] } },
      ] } } },
    }), 'initialize');
    const { branchId } = await within(client.createBranch({ name: 'fs' }), 'createBranch');
    await within(client.operate({ branchId, instruction: 'rename y', actions: true, tools: true }), 'operate');
    assert.ok(reads.includes(file), `the server read through the client: ${JSON.stringify(reads)}`);
    assert.equal(buffers.get(file), 'x = 1\nwhy = 2   # unsaved\n', 'the edit applied to the unsaved buffer text, written through the client');
    assert.equal(fs.readFileSync(file, 'utf8'), 'x = 1\n', 'the disk is untouched');
    const preview = permissions[0]?.preview;
    assert.equal(preview?.kind, 'diff');
    assert.equal(preview?.oldText, 'x = 1\ny = 2   # unsaved\n');
    assert.equal(preview?.newText, 'x = 1\nwhy = 2   # unsaved\n');
    const turns = turnsFromMessages((await within(client.branchMessages(branchId), 'branchMessages')).messages);
    assert.equal(turns.length, 1);
    assert.equal(turns[0].user, 'rename y');
    const [prose, tool] = turns[0].items;
    assert.deepEqual(prose, { kind: 'prose', text: 'Renaming **y**.' });
    assert.ok(tool.kind === 'tool' && cardTitle(tool.card) === '✓ edit_file a.py +1 −1', JSON.stringify(tool));
    assert.equal(turns[0].usage?.modelCalls, 1);
    const html = conversationHtml(turns);
    assert.ok(html.includes('<strong>y</strong>') && html.includes('✓ edit_file a.py +1 −1') && html.includes('1 model call'), html);
  } finally {
    await client.stop();
    fs.rmSync(ws, { recursive: true, force: true });
  }
});

test('toolEvents of the real server become cards that show the arguments while the call runs: parsed, or cut and marked', async () => {
  const ws = fs.mkdtempSync(path.join(os.tmpdir(), 'chat-ev-'));
  const files = new Map<string, string>();
  const long = 'é'.repeat(300);
  const client = await SidecarClient.start({ command: [PYTHON, '-m', 'operate_sidecar.server'], cwd: REPO });
  try {
    client.setFsHandlers({
      readTextFile: (p) => { const t = files.get(p.path); if (t === undefined) throw new Error('no such file'); return t; },
      writeTextFile: (p) => { files.set(p.path, p.text); },
    });
    client.setPermissionHandler(() => 'allow_once');
    const cards = new Map<string, ToolCard>();
    const shown: string[] = [];   // each card's title as it changed
    client.onToolEvent((e) => {
      const c = cardOfToolEvent(cards.get(e.callId), e);
      cards.set(e.callId, c);
      shown.push(`${e.event}: ${cardTitle(c)}${c.argsCut ? ' [args cut]' : ''}`);
    });
    await within(client.initialize({
      capabilities: { toolPermission: true, fs: true }, workspaceFolders: [ws],
      settings: { stateDir: null, defaultModel: 'm', models: { m: { provider: 'scripted', responses: [
        { json: { answer: 'Writing.', action_requests: [
          { function: 'write_file', arguments: { path: 'short.txt', content: 'hi\n' } },
          { function: 'write_file', arguments: { path: 'long.txt', content: long } }] } },
      ] } } },
    }), 'initialize');
    const { branchId } = await within(client.createBranch({ name: 'ev' }), 'createBranch');
    await within(client.operate({ branchId, instruction: 'write', actions: true, tools: true }), 'operate');
    assert.equal(files.get(path.join(ws, 'long.txt')), long, 'the long file was written');
    assert.deepEqual(shown.filter((x) => x.startsWith('pre')), ['pre: … write_file short.txt', 'pre: … write_file long.txt [args cut]'], shown.join('\n'));
    const [short, cut] = [...cards.values()];
    assert.deepEqual(short.args, { path: 'short.txt', content: 'hi\n' });
    assert.ok(typeof cut.args === 'string' && cut.args.startsWith('{"path":"long.txt","content":"éé') && cardHtml(cut).includes('(the first 200 characters)'), cardHtml(cut));
    assert.ok(short.state === 'ok' && cut.state === 'ok', JSON.stringify([...cards.values()]));
    assert.ok(short.output !== null && typeof short.output === 'object', `the output parsed: ${JSON.stringify(short.output)}`);
  } finally {
    await client.stop();
    fs.rmSync(ws, { recursive: true, force: true });
  }
});

test('a reasoning model\'s thoughts: one item per stretch, open while it streams, folded after, kept where they came', () => {
  const items: Turn['items'] = [];
  addThought(items, 'The user wants ', 1000);
  addThought(items, 'a **greeting**.', 1500);
  assert.deepEqual(items, [{ kind: 'thought', text: 'The user wants a **greeting**.', live: true, started: 1000 }]);
  const running: Turn = { user: 'hi', contextLabels: [], items, running: true };
  const open = turnHtml(running, 0);
  assert.match(open, /<div class="thought live"><div class="thought-head">Thinking…<\/div><div class="thought-text"><div><p>The user wants a <strong>greeting<\/strong>.<\/p>/);
  assert.doesNotMatch(open, /<details class="thought"/);   // (no fold while it streams)
  // the reply (or a tool call) ends the stretch: folded, "Thought"; the next thoughts are a new stretch
  assert.equal(endThought(items, 13_400), true);   // how long it took: "Thought for 12 s"
  assert.equal(endThought(items), false);
  items.push({ kind: 'prose', text: 'Hello!' });
  addThought(items, 'Now <script>x</script> the tool.');
  items.push({ kind: 'tool', card: { callId: 'c1', tool: 'read_file', args: { path: 'a.txt' }, state: 'ok' } });
  endThought(items);
  const html = turnHtml({ ...running, running: false }, 0);
  assert.equal((html.match(/<details class="thought">/g) ?? []).length, 2);
  assert.doesNotMatch(html, /thought live|Thinking…|<script>/);   // folded once the turn ended; raw HTML escaped
  assert.match(html, /<summary>Thought for 12 s<\/summary>.*Hello!.*<summary>Thought<\/summary>.*read_file/s);   // (the second: under a second)
  // a stretch still streaming when the turn ends (stopped) shows folded too
  assert.doesNotMatch(turnHtml({ ...running, running: false, items: [{ kind: 'thought', text: 'x', live: true }] }, 0), /thought live/);
  // read back from the branch (which holds no thoughts), the turn gets them again before the items they came before
  const kept = thoughtsOf(items);
  assert.equal(kept.length, 2);
  assert.deepEqual(kept[0], { at: 0, text: 'The user wants a **greeting**.', ms: 12_400 });
  assert.deepEqual([kept[1].at, kept[1].text], [1, 'Now <script>x</script> the tool.']);
  const readBack: Turn = { user: 'hi', contextLabels: [], items: [{ kind: 'prose', text: 'Hello!' },
    { kind: 'tool', card: { callId: 'c1', tool: 'read_file', args: { path: 'a.txt' }, state: 'ok' } }] };
  assert.deepEqual(keepThoughts(readBack, kept).items.map((i) => i.kind), ['thought', 'prose', 'thought', 'tool']);
  assert.match(turnHtml(readBack, 0), /<summary>Thought for 12 s<\/summary>/);   // read back, it still says how long
  // fewer items on the branch than shown: the rest go last; no thoughts: the turn as it was
  const short: Turn = { user: 'hi', contextLabels: [], items: [{ kind: 'prose', text: 'Hello!' }] };
  assert.deepEqual(keepThoughts(short, kept).items.map((i) => i.kind), ['thought', 'prose', 'thought']);
  assert.deepEqual(keepThoughts({ user: '', contextLabels: [], items: [] }, []).items, []);
  assert.equal(thoughtHtml('a', false), '<details class="thought"><summary>Thought</summary><div class="thought-text"><p>a</p>\n</div></details>');
});

test('the note of a turn the repeat stop ended names the failing call and its error, and what to do', () => {
  const failed = (fn: string, error: string) => ({ function: fn, arguments: {}, output: { error } });
  assert.equal(repeatNote({ repeated: true, result: { answer: 'Looking.', action_responses: [failed('read_file', "'nope.txt' does not exist.\nmore")] } }),
    "Stopped: the model made the same failing tool call (read_file: 'nope.txt' does not exist) 3 rounds in a row, so another round would not help. Rephrase the request, or choose another model.");
  assert.match(repeatNote({ result: { action_responses: [failed('a', 'x'), failed('b', 'y')] } }, 5), /^Stopped: the model made the same failing tool calls \(a: x\) 5 rounds in a row/);
  assert.match(repeatNote({ result: 'text' }), /^Stopped: the model made the same failing tool call 3 rounds in a row/);   // nothing to name
});

test('a turn the branch shows was cancelled while a call waited for a decision (a window reload ended it, no local record): marked as stopped and interrupted, with Retry and no Copy; its card says the turn ended first, not that the user cancelled', () => {
  const msg = (kind: string, content: object, i: number) => ({ id: String(i), kind, role: '', sender: null, recipient: null, createdAt: i, content }) as any;
  const round = (user: string, at: number, output: object) => [
    msg('instruction', { instruction: user }, at),
    msg('assistant_response', { text: '{"answer": "reload me", "action_requests": [{"function": "shout", "arguments": {"text": "seven"}}]}' }, at + 1),
    msg('action_request', { callId: `c${at}`, function: 'shout', arguments: { text: 'seven' } }, at + 2),
    msg('action_response', { callId: `c${at}`, function: 'shout', arguments: { text: 'seven' }, output }, at + 3),
  ];
  // as the server records it (docs/PROTOCOL.md §7): the waiting call denied with the reason "cancelled"; a running tool stopped: "cancelled"
  const turns = turnsFromMessages([
    ...round('rejected by the user', 0, { error: 'denied by governance gate', function: 'shout', reason: 'denied by the user' }),
    ...round('reload test', 4, { error: 'denied by governance gate', function: 'shout', reason: 'cancelled' }),
    ...round('tool stopped', 8, { error: 'cancelled' }),
  ]);
  assert.deepEqual(turns.map((t) => [t.user, t.outcome ?? 'ok', t.note ?? '', t.id ?? '']), [
    ['rejected by the user', 'ok', '', ''],
    ['reload test', 'stopped', INTERRUPTED_NOTE, 'interrupted@4'],
    ['tool stopped', 'stopped', INTERRUPTED_NOTE, 'interrupted@8'],
  ]);
  const card = turns[1].items.find((i) => i.kind === 'tool');
  assert.equal(card?.kind === 'tool' && cardTitle(card.card), '⊘ shout seven (no answer: the turn ended first)');
  const html = turnHtml(turns[1], 1);
  assert.ok(html.startsWith('<section class="turn stopped" data-turn="1">'), html);
  assert.ok(html.includes('data-action="retry" data-turn-id="interrupted@4"') && !html.includes('data-action="copyReply"'), html);
  assert.ok(html.includes(`<div class="note">${escapeHtml(INTERRUPTED_NOTE)}</div>`), html);
  assert.ok(turnHtml(turns[0], 0).includes('data-action="copyReply"') && !turnHtml(turns[0], 0).includes('data-action="retry"'), 'a turn that ended well: Copy, no Retry');
  // the chat's own record of a turn the user stopped (kept: the local turns) puts its mark over this one
  const stopped: LocalTurn = { turn: { user: 'reload test', contextLabels: [], items: [], note: 'Stopped.', outcome: 'stopped', id: 'local-1' }, at: 4, recorded: true };
  const shown = withLocalTurns(turns, [stopped]);
  assert.deepEqual([shown[1].note, shown[1].id, shown[1].outcome], ['Stopped.', 'local-1', 'stopped']);
});

test('a denied call\'s reason reads alike on its card and for its turn: the turn is marked interrupted exactly when the card says the turn ended first (no answer)', () => {
  const msg = (kind: string, content: object, i: number) => ({ id: String(i), kind, role: '', sender: null, recipient: null, createdAt: i, content }) as any;
  const reasons = ['cancelled', 'the turn was stopped', 'Cancelled by the client', 'permission request failed: Request requestToolPermission was cancelled',
    'permission request timed out', 'denied by the user', 'denied by policy', 'permission request was not answered', 'tool not selected for this call'];
  const turns = turnsFromMessages(reasons.flatMap((reason, n) => [
    msg('instruction', { instruction: reason }, 4 * n),
    msg('assistant_response', { text: '{"answer": "", "action_requests": [{"function": "shout", "arguments": {"text": "x"}}]}' }, 4 * n + 1),
    msg('action_request', { callId: `c${n}`, function: 'shout', arguments: { text: 'x' } }, 4 * n + 2),
    msg('action_response', { callId: `c${n}`, function: 'shout', arguments: { text: 'x' }, output: { error: 'denied by governance gate', function: 'shout', reason } }, 4 * n + 3),
  ]));
  assert.equal(turns.length, reasons.length);
  const seen = turns.map((t) => {
    const it = t.items.find((i) => i.kind === 'tool');
    const card = it?.kind === 'tool' ? cardTitle(it.card) : '';
    return [t.user, card.includes(`(${NOT_ANSWERED})`), t.outcome === 'stopped' && t.note === INTERRUPTED_NOTE && t.id === `interrupted@${t.start}`];
  });
  assert.deepEqual(seen.map(([user, card, interrupted]) => [user, card, interrupted]), seen.map(([user, card]) => [user, card, card]));
  assert.deepEqual(seen.filter(([, card]) => card).map(([user]) => user), ['cancelled', 'the turn was stopped', 'Cancelled by the client']);
});

test('StreamMarkdown: the settled blocks and the tail of a streaming reply, joined, are the render of the whole text at every point (fences, lists, tables, quotes, headings, CRLF); a link reference definition makes it all tail; text that changed other than at its end settles again', () => {
  const sample = '# Title\n\nIntro with **bold**, `code` and www.example.com.\n\n- a\n- b\n\n  more of b\n- c\n\n1. one\n2. two\n\n3. three\n\n'
    + 'Para\nlazy line\n\n```js\nconst x = 1;\n\nconst y = 2;\n```\n\n| a | b |\n|---|---|\n| 1 | 2 |\n\n> quote\nlazy quote\n\n> second\n\n'
    + '    indented\n\n    code\n\nSetext\n===\n\nx\n---\n\n***\n\n~~~\nt\n~~~\n\n- ```\n  in a list\n\n  fence\n  ```\n\n'
    + '- a\n  ```\n  x\n\npara\n```\ncode\n\nmore code\n```\npara\n```a`\n#hello\n# h\n\nwin\r\nlines\r\n\r\nend';
  const check = (text: string, steps: number[]) => {
    const r = new StreamMarkdown();
    let shown = '';
    for (const at of steps) {
      const part = text.slice(0, at);
      const u = r.update(part);
      shown = (u.restarted ? '' : shown) + u.added;
      assert.equal(shown + u.tail, renderMarkdown(part), `after ${at} characters: ${JSON.stringify(part.slice(-40))}`);
      assert.equal(shown, r.settled);
    }
    return r;
  };
  // split at every position, and in pieces of other sizes
  const all = Array.from({ length: sample.length }, (_, i) => i + 1);
  const r = check(sample, all);
  assert.ok(r.settledLength > sample.length / 2, `most of it settled: ${r.settledLength} of ${sample.length}`);
  for (const size of [2, 7, 40]) check(sample, all.filter((i) => i % size === 0 || i === sample.length));
  // a reference definition (it changes a link above it): all of it rendered, from then on
  const refs = check('[foo] and [bar]\n\nmore text\n\n[foo]: /url\n\nafter [foo]\n', Array.from({ length: 55 }, (_, i) => i + 1));
  assert.equal(refs.settledLength, 0);
  // the text changed before its end (a structured reply's fields in another order): settled again from the start
  const again = new StreamMarkdown();
  again.update('first\n\nsecond\n\nthird');
  assert.ok(again.settledLength > 0);
  const u = again.update('zero\n\nfirst\n\nsecond\n\nthird');
  assert.ok(u.restarted && u.added === again.settled);
  assert.equal(u.added + u.tail, renderMarkdown('zero\n\nfirst\n\nsecond\n\nthird'));
});

test('StreamMarkdown: a long reply costs about its newest blocks per update, not the reply so far', () => {
  const long = '# Long reply\n\n' + Array.from({ length: 300 }, (_, i) => `Paragraph ${i}: ` + 'lorem ipsum **dolor** `sit` amet '.repeat(20)
    + (i % 10 === 0 ? `\n\n\`\`\`python\nprint(${i})\n\`\`\`` : '')).join('\n\n');
  const r = new StreamMarkdown();
  let shown = '';
  let most = 0;
  for (let at = 280; at < long.length + 280; at += 280) {
    const u = r.update(long.slice(0, at));
    assert.ok(!u.restarted);
    shown += u.added;
    most = Math.max(most, u.added.length + u.tail.length);
  }
  const whole = renderMarkdown(long);
  assert.equal(shown + r.update(long).tail, whole);
  // (a paragraph renders to about 1 KB of HTML; the whole reply to some 300 KB)
  assert.ok(most < 4000 && whole.length > 100 * most, `the largest update: ${most} characters of HTML (the whole reply: ${whole.length})`);
});
