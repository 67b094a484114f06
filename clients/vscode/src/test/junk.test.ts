// What the chat reads from a server, of the wrong shapes (a server of another version, or a broken
// one): a branch's history, tool events, progress reports and operate results whose fields hold
// values of any type. Reading them never throws, and what the chat then renders (the conversation's
// HTML, the exported Markdown, each card's title, the status line) is text. Drawn from a seeded
// generator, so a failing case names its seed.
// Run: tsc -p . && node --test out/test/
import { test } from 'node:test';
import * as assert from 'node:assert/strict';
import {
  cardOfToolEvent, cardTitle, cardHtml, chatMarkdown, conversationHtml, permissionProblem, progressAfter, proseOfResult, statusText,
  ToolCard, TurnProgress, turnsFromMessages,
} from '../chatModel';

/** mulberry32: a small seeded generator (the same draws for the same seed on every machine). */
function rng(seed: number): () => number {
  let a = seed >>> 0;
  return () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

function pick<T>(r: () => number, xs: T[]): T { return xs[Math.floor(r() * xs.length)]; }

const STRINGS = ['', 'x', 'pre', 'post', 'error', 'denied', 'report', 'begin', 'end', 'stream', 'parse', 'request',
  'actions', 'thinking', 'repair attempt 2', '{"answer": "hi"}', '{"a":', 'line one\nline two', '<b>html</b>', '```',
  'Continue the same task.', 'denied by governance gate', '🙂', '\u0000', 'a'.repeat(300), 'edit_file', 'a.txt'];

function junk(r: () => number, depth = 0): unknown {
  const k = pick(r, ['null', 'undef', 'bool', 'num', 'str', 'str', ...(depth < 3 ? ['arr', 'obj', 'obj'] : [])]);
  switch (k) {
    case 'null': return null;
    case 'undef': return undefined;
    case 'bool': return r() < 0.5;
    case 'num': return pick(r, [0, -1, 1, 2 ** 53, 1e300, 0.5, NaN]);
    case 'str': return pick(r, STRINGS);
    case 'arr': return Array.from({ length: Math.floor(r() * 4) }, () => junk(r, depth + 1));
    default: {
      const o: Record<string, unknown> = {};
      for (let i = Math.floor(r() * 4); i > 0; i--) {
        o[pick(r, ['a', 'kind', 'text', 'error', 'output', 'path', 'answer', 'diff', 'added', 'removed', 'usage'])] = junk(r, depth + 1);
      }
      return o;
    }
  }
}

/** The right value most of the time, junk otherwise. */
function maybe<T>(r: () => number, good: T): unknown { return r() < 0.6 ? good : junk(r); }

function message(r: () => number): unknown {
  const content = {
    instruction: maybe(r, 'a question'), context: maybe(r, { selection: { path: 'a.py', text: 'x' } }),
    text: maybe(r, pick(r, ['an answer', '{"answer": "prose", "action_requests": []}'])),
    usage: maybe(r, { prompt_tokens: 3, completion_tokens: maybe(r, 4) }),
    function: maybe(r, 'read_file'), callId: maybe(r, `c${Math.floor(r() * 4)}`),
    arguments: maybe(r, { path: 'a.txt' }), output: maybe(r, pick(r, [{ diff: '@@ -1 +1 @@\n-a\n+b\n', added: 1, removed: 1 }, 'text', { error: 'boom' }])),
  };
  return maybe(r, {
    kind: maybe(r, pick(r, ['instruction', 'assistant_response', 'action_request', 'action_response', 'system'])),
    content: maybe(r, content), createdAt: maybe(r, '2026-12-01T10:00:00Z'),
  });
}

function rendered(what: string, seed: number, f: () => unknown): void {
  let out: unknown;
  try {
    out = f();
  } catch (e) {
    assert.fail(`seed ${seed}: ${what} threw ${(e as Error).stack ?? e}`);
  }
  assert.equal(typeof out, 'string', `seed ${seed}: ${what} gave ${typeof out}`);
}

test('a history of messages of any shape reads into turns, and the conversation and its export render', () => {
  for (let seed = 1; seed <= 3000; seed++) {
    const r = rng(seed);
    const messages = Array.from({ length: Math.floor(r() * 12) }, () => message(r));
    let turns: ReturnType<typeof turnsFromMessages> = [];
    try {
      turns = turnsFromMessages(messages as Parameters<typeof turnsFromMessages>[0]);
    } catch (e) {
      assert.fail(`seed ${seed}: turnsFromMessages threw ${(e as Error).stack ?? e}`);
    }
    rendered('conversationHtml', seed, () => conversationHtml(turns));
    rendered('chatMarkdown', seed, () => chatMarkdown(turns, 'a chat', '2026-12-06 10:00'));
  }
});

test('tool events, progress reports and results of any shape update the card and the status line, never throw', () => {
  for (let seed = 1; seed <= 3000; seed++) {
    const r = rng(seed);
    let card: ToolCard | undefined;
    let progress: TurnProgress = { round: 1 };
    for (let i = Math.floor(r() * 8); i >= 0; i--) {
      const event = {
        branchId: maybe(r, 'b'), callId: maybe(r, 'c1'), tool: maybe(r, pick(r, ['edit_file', 'read_file'])),
        event: maybe(r, pick(r, ['pre', 'post', 'error', 'denied'])), argsSummary: maybe(r, pick(r, ['{"path": "a.txt"}', '{"pa'])),
        resultSummary: maybe(r, pick(r, ['{"diff": "@@ -1 +1 @@\\n-a\\n+b\\n", "added": 1, "removed": 1}', '"ok"'])),
        error: maybe(r, 'boom'),
      };
      try {
        card = cardOfToolEvent(card, event as Parameters<typeof cardOfToolEvent>[1]);
        progress = progressAfter(progress, maybe(r, {
          kind: maybe(r, 'report'), phase: maybe(r, pick(r, ['request', 'stream', 'parse', 'actions', 'x'])),
          message: maybe(r, pick(r, ['thinking', 'repair attempt 2', 'working'])), delta: maybe(r, 'text'),
        }) as Parameters<typeof progressAfter>[1] ?? { kind: 'x' });
      } catch (e) {
        assert.fail(`seed ${seed}: reading an event threw ${(e as Error).stack ?? e}`);
      }
      const c = card;
      rendered('cardTitle', seed, () => cardTitle(c));
      rendered('cardHtml', seed, () => cardHtml(c));
      rendered('statusText', seed, () => statusText(progress));
    }
    rendered('proseOfResult', seed, () => proseOfResult(junk(r) as Parameters<typeof proseOfResult>[0]));
  }
});

test('a permission request of the wrong shape is named as such (denied unasked); one of the protocol\'s shape is put to the user', () => {
  const good = { branchId: 'b', callId: 'c', tool: 'edit_file', arguments: { path: 'a.txt' }, options: ['allow_once', 'deny_once'] };
  assert.equal(permissionProblem(good), undefined);
  assert.match(permissionProblem({ ...good, arguments: undefined }) ?? '', /arguments/);
  assert.match(permissionProblem(null) ?? '', /not an object/);
  assert.match(permissionProblem({ ...good, tool: 5 }) ?? '', /tool is not text/);
  assert.match(permissionProblem({ ...good, options: 'allow_once' }) ?? '', /options/);
  assert.match(permissionProblem({ ...good, options: ['allow', 'deny_once'] }) ?? '', /options/);
  assert.match(permissionProblem({ ...good, arguments: [1] }) ?? '', /arguments/);
  for (let seed = 1; seed <= 3000; seed++) {   // junk: a reason, or the shape the asking code reads
    const r = rng(seed);
    const req = maybe(r, { branchId: maybe(r, 'b'), callId: maybe(r, 'c'), tool: maybe(r, 'edit_file'),
      arguments: maybe(r, { path: 'a.txt' }), options: maybe(r, ['allow_once', 'deny_once']) }) as Record<string, unknown>;
    if (permissionProblem(req) === undefined) {
      assert.ok(typeof req.tool === 'string' && Array.isArray(req.options) && (req.options as string[]).every((o) => typeof o === 'string'), `seed ${seed}`);
      assert.equal(typeof JSON.stringify(req.arguments), 'string', `seed ${seed}: the arguments as the asking code logs them`);
    }
  }
});
