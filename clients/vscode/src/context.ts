// What the editor adds to an instruction: the selection (file, language, line range) and the
// `#file`, `#file:<path>`, `#selection`, `#problems` references typed in the chat input.
import * as fs from 'node:fs';
import * as path from 'node:path';
import * as vscode from 'vscode';
import type { Json, JsonObject } from './rpcClient';
import { FileEntry, fileRefText } from './refCompletion';

const MAX_FILE_CHARS = 40_000;
const MAX_PROBLEMS = 50;
/** `#file:<path>` references read per message (one beyond is named as not read). */
export const MAX_FILE_REFS = 10;

/** The last text editor the user worked in (focus in the chat view does not clear it). */
export class EditorTracker implements vscode.Disposable {
  private last: vscode.TextEditor | undefined;
  private readonly sub: vscode.Disposable;
  constructor(private readonly ignoreScheme: string) {
    this.last = this.usable(vscode.window.activeTextEditor);
    this.sub = vscode.window.onDidChangeActiveTextEditor((e) => { if (this.usable(e)) this.last = e; });
  }
  private usable(e: vscode.TextEditor | undefined) { return e && e.document.uri.scheme !== this.ignoreScheme && e.document.uri.scheme !== 'output' ? e : undefined; }
  get editor(): vscode.TextEditor | undefined {
    const active = this.usable(vscode.window.activeTextEditor);
    if (active) return active;
    if (this.last && vscode.window.visibleTextEditors.includes(this.last)) return this.last;
    return this.last && !this.last.document.isClosed ? this.last : undefined;
  }
  dispose(): void { this.sub.dispose(); }
}

/**
 * A file's path as the server's workspace tools take it (server/tools/builtin.py): relative to the first
 * workspace folder, or, in a multi-root workspace, `<folder name>/<path>` for a file of another folder
 * (the folder name being the last segment of its path, as the server knows it); absolute outside them.
 */
export function relPath(uri: vscode.Uri): string {
  if (uri.scheme !== 'file' && uri.scheme !== 'vscode-remote') return uri.toString();
  const folders = (vscode.workspace.workspaceFolders ?? []).filter((f) => f.uri.scheme === uri.scheme);
  const folder = vscode.workspace.getWorkspaceFolder(uri);
  const rel = vscode.workspace.asRelativePath(uri, false);
  if (folders.length < 2 || !folder || folder.uri.toString() === folders[0].uri.toString()) return rel;
  return `${path.posix.basename(folder.uri.path)}/${rel}`;
}

export interface SelectionContext { file: string; language: string; startLine: number; endLine: number; text: string }

export function selectionOf(editor: vscode.TextEditor | undefined): SelectionContext | undefined {
  if (!editor || editor.selection.isEmpty) return undefined;
  const s = editor.selection;
  return {
    file: relPath(editor.document.uri), language: editor.document.languageId,
    startLine: s.start.line + 1, endLine: s.end.line + 1, text: editor.document.getText(s),
  };
}

function fileOf(editor: vscode.TextEditor | undefined): JsonObject | undefined {
  if (!editor) return undefined;
  const text = editor.document.getText();
  return {
    file: relPath(editor.document.uri), language: editor.document.languageId,
    text: text.length > MAX_FILE_CHARS ? text.slice(0, MAX_FILE_CHARS) : text,
    ...(text.length > MAX_FILE_CHARS && { truncated: true }),
  };
}

function problems(): JsonObject[] {
  const sev = ['error', 'warning', 'info', 'hint'];
  const out: JsonObject[] = [];
  for (const [uri, diags] of vscode.languages.getDiagnostics()) {
    for (const d of diags) {
      if (out.length >= MAX_PROBLEMS) return out;
      out.push({ file: relPath(uri), line: d.range.start.line + 1, severity: sev[d.severity] ?? 'info', message: d.message,
        ...(d.source && { source: d.source }) });
    }
  }
  return out;
}

export interface ResolvedInput { instruction: string; context?: JsonObject }

/** Files workspaceFiles lists at most. */
const MAX_LISTED = 10_000;

/**
 * The workspace's files (see relPath), those `files.exclude` and `search.exclude` leave out (node_modules...) not among
 * them, as a search would look in them (at most 10,000), each said open in an editor or not; none without a folder.
 * Both settings are a folder's own (a multi-root workspace's folders may each set them): each folder is listed with
 * its own.
 */
export async function workspaceFiles(): Promise<FileEntry[]> {
  const folders = vscode.workspace.workspaceFolders ?? [];
  const open = new Set(vscode.workspace.textDocuments.map((d) => d.uri.toString()));
  const out: FileEntry[] = [];
  for (const folder of folders) {
    if (out.length >= MAX_LISTED) break;
    const on = (section: string) => Object.entries(vscode.workspace.getConfiguration(section, folder.uri).get<Record<string, unknown>>('exclude') ?? {})
      .filter(([, v]) => v === true).map(([glob]) => glob);
    const globs = [...new Set([...on('files'), ...on('search')])];
    const uris = await vscode.workspace.findFiles(new vscode.RelativePattern(folder, '**/*'), globs.length ? `{${globs.join(',')}}` : undefined,
      MAX_LISTED - out.length);
    for (const u of uris) out.push({ rel: relPath(u), open: open.has(u.toString()) });
  }
  return out;
}

/**
 * Attach File: a quick pick of the workspace's files (workspaceFiles: the open ones first), answering the
 * chosen one's reference (fileRefText), or undefined (dismissed, or no folder to pick from: said).
 */
export async function pickFileRef(): Promise<string | undefined> {
  if (!vscode.workspace.workspaceFolders?.length) {
    void vscode.window.showInformationMessage('operate-sidecar: no folder is open; type #file:<absolute path> to attach a file');
    return undefined;
  }
  const items = (await workspaceFiles()).map(({ rel, open }) => {
    const dir = path.posix.dirname(rel);
    return { label: path.posix.basename(rel), description: dir === '.' ? '' : dir, rel, open };
  }).sort((a, b) => Number(b.open) - Number(a.open) || a.rel.localeCompare(b.rel));
  const pick = await vscode.window.showQuickPick(items, {
    title: 'operate-sidecar: attach a file to the message', matchOnDescription: true,
    placeHolder: 'A file of the workspace: its text goes along with the message (#file:<path>)',
  });
  return pick && fileRefText(pick.rel);
}

/** The `#file:<path>` references of a message (a path without spaces, or one in double quotes), each once, in order. */
export function fileRefs(text: string): string[] {
  const out: string[] = [];
  for (const m of text.matchAll(/#file:(?:"([^"]+)"|(\S+))/g)) {
    const ref = m[1] ?? m[2];
    if (!out.includes(ref)) out.push(ref);
  }
  return out;
}

/** The places a reference may name: absolute; `<folder name>/<path>` (see relPath) or a path in a workspace folder. */
function candidates(ref: string): vscode.Uri[] {
  if (path.isAbsolute(ref)) return [vscode.Uri.file(ref)];
  const folders = vscode.workspace.workspaceFolders ?? [];
  const [head, ...rest] = ref.split('/');
  return [
    ...folders.filter((f) => rest.length && path.posix.basename(f.uri.path) === head).map((f) => vscode.Uri.joinPath(f.uri, ...rest)),
    ...folders.map((f) => vscode.Uri.joinPath(f.uri, ref)),
  ];
}

const openDoc = (uri: vscode.Uri) => vscode.workspace.textDocuments.find((d) => d.uri.toString() === uri.toString());
/** What is at `uri` on the disk: a file, a folder, or neither (nothing, or not readable). */
export const kindOf = (uri: vscode.Uri): 'file' | 'folder' | undefined => {
  try { const s = fs.statSync(uri.fsPath); return s.isFile() ? 'file' : s.isDirectory() ? 'folder' : undefined; } catch { return undefined; }
};

/**
 * The file a `#file:` reference names, as `{file, language?, text, truncated?}`: an open document's text (unsaved
 * changes too), else the file's, at most MAX_FILE_CHARS characters; a reference followed by punctuation
 * (`#file:a.py,`) names the file without it when only that one exists. Else why it was not attached.
 */
export function fileOfRef(ref: string): { file: JsonObject } | { unavailable: string } {
  const bare = ref.replace(/[.,;:!?)\]}'"]+$/, '');
  const found = (r: string) => candidates(r).find((u) => openDoc(u) || kindOf(u) === 'file');
  const uri = found(ref) ?? (bare && bare !== ref ? found(bare) : undefined);
  if (!uri) {
    const dir = candidates(ref).some((u) => kindOf(u) === 'folder');
    return { unavailable: `#file:${ref}: ${dir ? 'a folder, not a file' : 'not found in the workspace'}` };
  }
  const doc = openDoc(uri);
  let text: string;
  if (doc) text = doc.getText();
  else {
    let bytes: Buffer;
    try { bytes = fs.readFileSync(uri.fsPath); } catch (e) { return { unavailable: `#file:${ref}: cannot be read (${(e as Error).message})` }; }
    if (bytes.includes(0)) return { unavailable: `#file:${ref}: a binary file` };
    text = bytes.toString('utf8');
  }
  const chars = [...text.slice(0, MAX_FILE_CHARS * 2 + 2)];   // (by characters, a surrogate pair never cut: more than MAX when longer)
  const cut = chars.length > MAX_FILE_CHARS;
  return { file: {
    file: relPath(uri), ...(doc && { language: doc.languageId }),
    text: cut ? chars.slice(0, MAX_FILE_CHARS).join('') : text, ...(cut && { truncated: true }),
  } };
}

/**
 * The instruction with its context: `#file` (the active file), `#file:<path>` (that file, see fileOfRef: `files`),
 * `#selection` (the selection with its file, language and line range), `#problems` (diagnostics). A non-empty
 * selection is sent even without `#selection`. `labels` (shown in the chat) name what was attached.
 */
export function resolveInput(text: string, editor: vscode.TextEditor | undefined): ResolvedInput {
  const ctx: JsonObject = {};
  const labels: string[] = [];
  const refs = new Set((text.match(/#(file|selection|problems)\b(?!:)/g) ?? []).map((r) => r.slice(1)));
  const sel = selectionOf(editor);
  if (sel && (refs.has('selection') || !refs.has('file'))) {
    ctx.selection = sel as unknown as Json;
    labels.push(`${sel.file}:${sel.startLine}${sel.endLine !== sel.startLine ? '-' + sel.endLine : ''}`);
  }
  // a reference that finds nothing says so, in the chat (a chip) and to the model, instead of
  // going out as bare text the model can only guess about
  const unavailable: string[] = [];
  if (refs.has('selection') && !sel) unavailable.push(editor ? '#selection: nothing is selected' : '#selection: no file is open in an editor');
  if (refs.has('file')) {
    const f = fileOf(editor);
    if (f) { ctx.file = f; labels.push(String(f.file)); }
    else unavailable.push('#file: no file is open in an editor');
  }
  if (refs.has('problems')) {
    const p = problems();
    ctx.problems = p;
    labels.push(`${p.length} problem${p.length === 1 ? '' : 's'}`);
  }
  const files: JsonObject[] = [];
  for (const ref of fileRefs(text)) {
    if (files.length >= MAX_FILE_REFS) { unavailable.push(`#file:${ref}: not read (at most ${MAX_FILE_REFS} files per message)`); continue; }
    const r = fileOfRef(ref);
    if ('unavailable' in r) unavailable.push(r.unavailable);
    else if (!files.some((f) => f.file === r.file.file)) {   // (`a.py` and `a.py,` are one file)
      files.push(r.file);
      labels.push(`${String(r.file.file)}${r.file.truncated ? ' (cut)' : ''}`);
    }
  }
  if (files.length) ctx.files = files;
  if (unavailable.length) { ctx.unavailable = unavailable; labels.push(...unavailable); }
  if (!labels.length) return { instruction: text };
  ctx.labels = labels;
  return { instruction: text, context: ctx };
}
