// What the editor adds to an instruction: the selection (file, language, line range) and the
// `#file`, `#selection`, `#problems` references typed in the chat input.
import * as path from 'node:path';
import * as vscode from 'vscode';
import type { Json, JsonObject } from './rpcClient';

const MAX_FILE_CHARS = 40_000;
const MAX_PROBLEMS = 50;

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

/**
 * The instruction with its context: `#file` (the active file), `#selection` (the selection with
 * its file, language and line range), `#problems` (diagnostics). A non-empty selection is sent even
 * without `#selection`. `labels` (shown in the chat) name what was attached.
 */
export function resolveInput(text: string, editor: vscode.TextEditor | undefined): ResolvedInput {
  const ctx: JsonObject = {};
  const labels: string[] = [];
  const refs = new Set((text.match(/#(file|selection|problems)\b/g) ?? []).map((r) => r.slice(1)));
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
  if (unavailable.length) { ctx.unavailable = unavailable; labels.push(...unavailable); }
  if (!labels.length) return { instruction: text };
  ctx.labels = labels;
  return { instruction: text, context: ctx };
}
