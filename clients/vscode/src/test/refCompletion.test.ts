// The chat input's inline completion of # references (no VS Code needed); the list itself, in the
// webview, is driven by the browser test (scripts/run-ui-test.mjs).
import { test } from 'node:test';
import * as assert from 'node:assert/strict';
import { FileEntry, fileRefText, matchScore, MAX_SUGGESTIONS, REFERENCES, suggestionsFor, tokenAt } from '../refCompletion';

test('the token at the caret: a # at the start or after white space, a reference name or #file: and a path (bare or quoted)', () => {
  assert.deepEqual(tokenAt('#'), { kind: 'reference', query: '', start: 0 });
  assert.deepEqual(tokenAt('look at #sel'), { kind: 'reference', query: 'sel', start: 8 });
  assert.deepEqual(tokenAt('look at #file'), { kind: 'reference', query: 'file', start: 8 });
  assert.deepEqual(tokenAt('a\n#file:'), { kind: 'file', query: '', start: 2 });
  assert.deepEqual(tokenAt('see #file:src/ut'), { kind: 'file', query: 'src/ut', start: 4 });
  assert.deepEqual(tokenAt('see #file:"my fi'), { kind: 'file', query: 'my fi', start: 4 });
  // not a reference being typed: inside a word, after it, a closed quote, an upper-case name, a new line
  for (const before of ['', 'x#file:a', 'tag#12', '#file:a.py ', '#file:"a b"', '#File', '#file:"a\nb', '# ']) {
    assert.equal(tokenAt(before), undefined, JSON.stringify(before));
  }
});

test('a # offers the references whose name starts with what follows it, #file: first', () => {
  assert.deepEqual(suggestionsFor({ kind: 'reference', query: '' }, []).map((s) => s.ref), REFERENCES.map((r) => r.ref));
  assert.deepEqual(suggestionsFor({ kind: 'reference', query: 'fi' }, []).map((s) => s.ref), ['#file:', '#file']);
  assert.deepEqual(suggestionsFor({ kind: 'reference', query: 'pro' }, []).map((s) => s.ref), ['#problems']);
  assert.deepEqual(suggestionsFor({ kind: 'reference', query: 'zz' }, []), []);
});

test('match score: the name starting with the query, then holding it, then the path starting with it, holding it, its letters in order', () => {
  const q = 'ut';
  const ranks = ['src/util.py', 'src/shut.py', 'utils/a.py', 'src/a_ut/b.py', 'src/u_t.py'].map((p) => matchScore(q, p));
  assert.deepEqual([...ranks].sort((a, b) => b - a), ranks, `strictly in that order: ${ranks}`);
  assert.equal(new Set(ranks).size, ranks.length);
  assert.equal(matchScore('UTIL', 'src/Util.py'), 500, 'case aside');
  assert.equal(matchScore('xyz', 'src/util.py'), -1);
  assert.ok(matchScore('sutpy', 'src/util.py') > matchScore('sutpy', 'src/u/t/x/other/p/y.txt'), 'closer together is better');
  // the best placing of the letters, not the first one found: `um` as util_main's starts, not user's u
  assert.ok(matchScore('um', 'user/x/util_main.py') > matchScore('um', 'user/x/utilxmain.py'), 'at the starts of words is better');
  assert.equal(matchScore('um', 'user/x/util_main.py'), 100 - (4 - 6));
  assert.ok(matchScore('cm', 'src/chatModel.ts') > matchScore('cm', 'src/cxxm.ts'), 'a capital starts a word');
  assert.ok(matchScore('mv', 'src/model_view.ts') > matchScore('mv', 'src/mxxxxv.ts'), 'word starts before a smaller gap');
  for (const [q, p] of [['sutpy', 'src/util.py'], ['um', 'user/x/util_main.py'], ['zq', 'a/z/' + 'x'.repeat(500) + 'q']]) {
    const s = matchScore(q, p);
    assert.ok(s >= 1 && s < 200, `${q} in ${p}: below the tier of the paths holding the query (${s})`);
  }
  assert.equal(matchScore('', 'anything'), 0);
});

test('#file: offers the matching files best first (the open ones first among equals), as references that quote a path with spaces', () => {
  const files: FileEntry[] = [
    { rel: 'src/app.py', open: false }, { rel: 'src/util.py', open: false }, { rel: 'lib/util.py', open: true },
    { rel: 'docs/my notes.md', open: false }, { rel: 'README.md', open: false },
  ];
  const util = suggestionsFor({ kind: 'file', query: 'util' }, files);
  assert.deepEqual(util.map((s) => s.ref), ['#file:lib/util.py', '#file:src/util.py']);
  assert.deepEqual(util[0], { ref: '#file:lib/util.py', label: 'util.py', detail: 'lib' });
  assert.deepEqual(suggestionsFor({ kind: 'file', query: 'notes' }, files), [{ ref: '#file:"docs/my notes.md"', label: 'my notes.md', detail: 'docs' }]);
  assert.deepEqual(suggestionsFor({ kind: 'file', query: 'read' }, files)[0], { ref: '#file:README.md', label: 'README.md', detail: '' });
  // no query: every file, the open one first, then the shorter paths
  assert.deepEqual(suggestionsFor({ kind: 'file', query: '' }, files).map((s) => s.ref)[0], '#file:lib/util.py');
  assert.deepEqual(suggestionsFor({ kind: 'file', query: 'nothing-like-it' }, files), []);
  const many = Array.from({ length: 200 }, (_, i) => ({ rel: `f${i}.txt`, open: false }));
  assert.equal(suggestionsFor({ kind: 'file', query: 'f' }, many).length, MAX_SUGGESTIONS);
  assert.equal(fileRefText('a b/c.py'), '#file:"a b/c.py"');
});
