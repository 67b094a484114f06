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
 * query's characters in order in the path (`sutpy` finds `src/util.py`), closer together better.
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
  let at = -1, gaps = 0;
  for (const c of q) {
    const next = p.indexOf(c, at + 1);
    if (next < 0) return -1;
    if (at >= 0) gaps += next - at - 1;
    at = next;
  }
  return 100 - Math.min(99, gaps);
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
