// The chat input's inline completion of `#` references (no VS Code needed): what the token at the
// caret asks for, and the suggestions for it: the references themselves (`#file:`, `#file`,
// `#selection`, `#problems`) after a `#`, the workspace's files after `#file:`.

/** A file of the workspace as the completion sees it: its path as the tools take it (context.ts relPath), open in an editor or not. */
export interface FileEntry { rel: string; open: boolean }
/** One suggestion: `ref` replaces the token, `label` and `detail` are what the list shows. */
export interface Suggestion { ref: string; label: string; detail: string }

/** Suggestions shown at most (the list scrolls; typing more narrows it). */
export const MAX_SUGGESTIONS = 50;

/** How a message names the file at `rel`: `#file:<path>`, in double quotes when it holds white space. */
export const fileRefText = (rel: string): string => (/\s/.test(rel) ? `#file:"${rel}"` : `#file:${rel}`);

/** The references a `#` offers, in this order (`#file:` first: picking it goes on to the files). */
export const REFERENCES: readonly Suggestion[] = [
  { ref: '#file:', label: '#file:', detail: 'a file of the workspace…' },
  { ref: '#file', label: '#file', detail: 'the active file' },
  { ref: '#selection', label: '#selection', detail: 'the selection in the editor' },
  { ref: '#problems', label: '#problems', detail: 'the workspace\'s problems' },
];

/**
 * The `#` word being typed at the end of `before` (the input's text up to the caret), if any: a `#`
 * at the start or after white space, then a reference name (`kind: 'reference'`) or `#file:` and a
 * path, bare or after a double quote (`kind: 'file'`). `start` is where the `#` is.
 */
export function tokenAt(before: string): { kind: 'reference' | 'file'; query: string; start: number } | undefined {
  const m = /(?:^|\s)(#file:(?:"([^"\n]*)|([^\s"]*))|#([a-z]*))$/.exec(before);
  if (!m) return undefined;
  const start = before.length - m[1].length;
  if (m[4] !== undefined) return { kind: 'reference', query: m[4], start };
  return { kind: 'file', query: m[2] ?? m[3] ?? '', start };
}

/**
 * How well `query` matches the path `rel` (higher is better; -1: not at all), case aside: the file's
 * name starting with it, then holding it, then the path starting with it, then holding it, then the
 * query's characters in order in the path (`sutpy` finds `src/util.py`), scored by their best
 * placing (subsequenceCost): closer together, and at the starts of words, better.
 */
export function matchScore(query: string, rel: string): number {
  const q = query.toLowerCase();
  if (!q) return 0;
  const p = rel.toLowerCase();
  const base = p.slice(p.lastIndexOf('/') + 1);
  if (base.startsWith(q)) return 500;
  if (base.includes(q)) return 400;
  if (p.startsWith(q)) return 300;
  if (p.includes(q)) return 200;
  const cost = subsequenceCost(q, p, rel);
  return cost === undefined ? -1 : Math.max(1, Math.min(199, 100 - cost));
}

/** A character of `rel` at `j` that starts a word: the first, after a separator, or a capital after a small letter. */
function wordStart(rel: string, j: number): boolean {
  return j === 0 || /[/\\_\-. ]/.test(rel[j - 1]) || (/[A-Z]/.test(rel[j]) && /[a-z]/.test(rel[j - 1]));
}

/**
 * The lowest cost of placing the characters of `q` in order in `p` (`rel` lower-cased): the
 * characters skipped between two placed ones, less 3 for each placed at a word's start; undefined
 * when they are not all there in order. One pass per character of `q` (a running best of the last).
 */
function subsequenceCost(q: string, p: string, rel: string): number | undefined {
  for (let i = 0, at = -1; i < q.length; i++) if ((at = p.indexOf(q[i], at + 1)) < 0) return undefined; // (not all there: no table)
  let prev: number[] | undefined; // prev[j]: the lowest cost with q's previous character placed at j (Infinity: not there)
  for (let i = 0; i < q.length; i++) {
    const cur = new Array<number>(p.length).fill(Infinity);
    let best = Infinity; // the lowest prev[k] - k for k < j
    for (let j = 0; j < p.length; j++) {
      if (p[j] === q[i]) {
        const before = i === 0 ? 0 : best + j - 1;
        if (before < Infinity) cur[j] = before - (wordStart(rel, j) ? 3 : 0);
      }
      if (prev && prev[j] < Infinity) best = Math.min(best, prev[j] - j);
    }
    prev = cur;
  }
  const least = Math.min(...(prev ?? []));
  return least < Infinity ? least : undefined;
}

/** The suggestions for a token (see tokenAt): the references starting with its name, or the files matching its path, best first. */
export function suggestionsFor(token: { kind: 'reference' | 'file'; query: string }, files: readonly FileEntry[]): Suggestion[] {
  if (token.kind === 'reference') return REFERENCES.filter((r) => r.ref.slice(1).startsWith(token.query));
  const scored: { f: FileEntry; s: number }[] = [];
  for (const f of files) {
    const s = matchScore(token.query, f.rel);
    if (s >= 0) scored.push({ f, s });
  }
  // better matches first; among equals the open files, then the shorter paths (nearer the top), then by name
  scored.sort((a, b) => b.s - a.s || Number(b.f.open) - Number(a.f.open) || a.f.rel.length - b.f.rel.length || a.f.rel.localeCompare(b.f.rel));
  return scored.slice(0, MAX_SUGGESTIONS).map(({ f }) => {
    const cut = f.rel.lastIndexOf('/');
    return { ref: fileRefText(f.rel), label: f.rel.slice(cut + 1), detail: cut < 0 ? '' : f.rel.slice(0, cut) };
  });
}
