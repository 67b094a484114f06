// Diff review: a permission request that carries a diff preview opens VS Code's diff editor on the
// file (left) and the proposed text (right, a virtual document), with Accept / Reject / Always in
// the editor title (and in the chat card). The decision answers the permission request.
import * as path from 'node:path';
import * as vscode from 'vscode';
import { type DiffPreview, ErrorCodes, type PermissionDecision, type PermissionRequest, ResponseError } from './rpcClient';

export const PROPOSED_SCHEME = 'operate-sidecar-proposed';
const CONTEXT_KEY = 'operateSidecar.reviewPending';

interface Pending {
  req: PermissionRequest;
  preview: DiffPreview;
  uri: vscode.Uri;
  resolve: (d: PermissionDecision) => void;
  /** The review could not be shown: the request fails with `e`. */
  fail: (e: unknown) => void;
  /** The file's text is no longer the one the change was previewed on (said as it becomes so: see fileChanged). */
  stale?: boolean;
}

export interface ReviewRecord { callId: string; path: string; decision: PermissionDecision }

/**
 * Test seam, for the integration tests only (the API's `faults`): a step named here throws an
 * Error with that message the next time it runs, once. `vscode.diff`: a review's diff editor,
 * once opened; a server request's method (`requestToolPermission`, `fs/readTextFile`,
 * `fs/writeTextFile`): its handler. Empty, so without effect, unless a test sets it.
 */
export const faults = new Map<string, string>();
/** Throws the fault a test set for `step` (see `faults`), once. */
export function fault(step: string): void {
  const message = faults.get(step);
  if (message === undefined) return;
  faults.delete(step);
  throw new Error(message);
}

function workspaceRoot(): string | undefined {
  return vscode.workspace.workspaceFolders?.find((f) => f.uri.scheme === 'file')?.uri.fsPath;
}
export function absPath(p: string): string {
  if (path.isAbsolute(p)) return p;
  const root = workspaceRoot();
  return root ? path.join(root, p) : path.resolve(p);
}

/**
 * Where the first byte of `bytes` that is not part of UTF-8 text is (as Python's UnicodeDecodeError.start
 * says it, so that the message matches the server's own for the disk); -1 when they are UTF-8.
 */
export function firstNonUtf8Byte(bytes: Uint8Array): number {
  let i = 0;
  while (i < bytes.length) {
    const c = bytes[i];
    if (c < 0x80) { i++; continue; }
    // the length of the sequence and the range of its second byte (no overlong forms, no surrogates, at most U+10FFFF)
    const [n, lo, hi] = c >= 0xc2 && c <= 0xdf ? [2, 0x80, 0xbf] : c === 0xe0 ? [3, 0xa0, 0xbf] : c === 0xed ? [3, 0x80, 0x9f]
      : c >= 0xe1 && c <= 0xef ? [3, 0x80, 0xbf] : c === 0xf0 ? [4, 0x90, 0xbf] : c === 0xf4 ? [4, 0x80, 0x8f]
        : c >= 0xf1 && c <= 0xf3 ? [4, 0x80, 0xbf] : [0, 0, 0];
    if (!n || i + 1 >= bytes.length || bytes[i + 1] < lo || bytes[i + 1] > hi) return i;
    for (let k = 2; k < n; k++) if (i + k >= bytes.length || (bytes[i + k] & 0xc0) !== 0x80) return i;
    i += n;
  }
  return -1;
}

/** What a file holds for the file tools (see fileText). */
type FileText = { text: string } | { missing: unknown } | { notUtf8: number } | { unreadable: unknown };

function openDocument(fsPath: string): vscode.TextDocument | undefined {
  return vscode.workspace.textDocuments.find((d) => d.uri.scheme === 'file' && d.uri.fsPath === fsPath);
}

/**
 * A file's text for the file tools: an unsaved (dirty) buffer's text, whatever the disk holds (docs/PROTOCOL.md §10);
 * else the file must be on disk: an open buffer of a file deleted or renamed since is no file (`missing`). The disk's
 * bytes must be UTF-8 (`notUtf8`: where they are not; an edit saved back as UTF-8 would replace them with U+FFFD),
 * unless the file is open in another encoding the user chose (its buffer is then the text, saved back in that
 * encoding). A file that is open is served as its buffer holds it (the line ends the editor keeps).
 */
async function fileText(fsPath: string): Promise<FileText> {
  const open = openDocument(fsPath);
  if (open?.isDirty) return { text: open.getText() };
  let bytes: Uint8Array;
  try {
    bytes = await vscode.workspace.fs.readFile(vscode.Uri.file(fsPath));
  } catch (e) {
    return e instanceof vscode.FileSystemError && e.code === 'FileNotFound' ? { missing: e } : { unreadable: e };
  }
  // (TextDocument.encoding: not in the 1.90 API's types, there at run time from 1.99 on)
  const encoding = (open as { encoding?: unknown } | undefined)?.encoding;
  if (open && typeof encoding === 'string' && !encoding.startsWith('utf8')) return { text: open.getText() };
  let text: string;
  try {
    text = new TextDecoder('utf-8', { fatal: true }).decode(bytes);
  } catch {
    return { notUtf8: Math.max(0, firstNonUtf8Byte(bytes)) };
  }
  return { text: open ? open.getText() : text };
}

/**
 * The current text of a file for a preview computed here ('' when there is none); undefined when it cannot be
 * shown as text (not UTF-8, unreadable): no preview, nothing to review it in.
 */
export async function currentText(fsPath: string): Promise<string | undefined> {
  const f = await fileText(fsPath);
  return 'text' in f ? f.text : 'missing' in f ? '' : undefined;
}

/**
 * The preview of a request: the server's, or (servers without previews) computed here for the
 * builtin `write_file` and `edit_file` calls.
 */
export async function previewOf(req: PermissionRequest): Promise<DiffPreview | undefined> {
  const given = req.preview as Partial<DiffPreview> | null | undefined;
  if (given?.kind === 'diff' && typeof given.path === 'string' && given.path && typeof given.newText === 'string') {
    // (the fields as their types: a server of another version may send others; those are not reviewed)
    return { kind: 'diff', path: given.path, oldText: typeof given.oldText === 'string' ? given.oldText : null,
      newText: given.newText, diff: typeof given.diff === 'string' ? given.diff : '' };
  }
  if (given?.kind === 'diff') return undefined;
  const a = req.arguments as Record<string, unknown> | null;
  if (!a || typeof a.path !== 'string') return undefined;
  const p = absPath(a.path);
  if (req.tool === 'write_file' && typeof a.content === 'string') {
    const oldText = await currentText(p);
    return oldText === undefined ? undefined : { kind: 'diff', path: p, oldText, newText: a.content, diff: '' };
  }
  if (req.tool === 'edit_file' && Array.isArray(a.edits)) {
    const oldText = await currentText(p);
    if (oldText === undefined) return undefined;
    let text = oldText;
    for (const e of a.edits as { oldText?: string; newText?: string; replaceAll?: boolean }[]) {
      if (typeof e?.oldText !== 'string' || typeof e.newText !== 'string' || !text.includes(e.oldText)) return undefined;
      text = e.replaceAll ? text.split(e.oldText).join(e.newText) : text.replace(e.oldText, () => e.newText!);
    }
    return { kind: 'diff', path: p, oldText, newText: text, diff: '' };
  }
  return undefined;
}

/** The warning of a review whose file changed since its preview (see DiffReview.fileChanged). */
export function staleWarning(fsPath: string): string {
  return `operate-sidecar: ${path.basename(fsPath)} changed since the edit under review was previewed: the diff's right side is still `
    + 'that edit of the earlier text, and Accept will not write it (the call fails, the file stays as it is). Reject it and ask again.';
}

/** The diff editor's title of a review: the file's name and the tool. */
function titleOf(p: Pending): string { return `${path.basename(p.preview.path)} ↔ proposed by ${p.req.tool}`; }

export class DiffReview implements vscode.TextDocumentContentProvider, vscode.Disposable {
  private readonly pending = new Map<string, Pending>();
  private readonly texts = new Map<string, string>();
  private readonly changed = new vscode.EventEmitter<vscode.Uri>();
  readonly onDidChange = this.changed.event;
  private readonly decided = new vscode.EventEmitter<ReviewRecord>();
  /** Fires once per decided review. */
  readonly onDidDecide = this.decided.event;
  readonly history: ReviewRecord[] = [];
  private readonly subs: vscode.Disposable[];

  constructor() {
    this.subs = [vscode.workspace.registerTextDocumentContentProvider(PROPOSED_SCHEME, this), this.changed, this.decided,
      vscode.window.tabGroups.onDidChangeTabs((e) => this.tabsClosed(e.closed)),
      vscode.workspace.onDidChangeTextDocument((e) => { if (e.contentChanges.length) this.fileChanged(e.document); })];
    void vscode.commands.executeCommand('setContext', CONTEXT_KEY, false);
  }

  /**
   * The user closed a review's diff editor without deciding: that denies the call once, as dismissing the permission
   * quick pick does (it would wait for the server's time-out otherwise, with nothing left on screen to decide it in).
   * The editors this class closes itself go after their review was taken (decided, withdrawn): not a decision. A tab
   * moved to another group (opened there, then closed here) still shows the review: nothing is decided.
   */
  private tabsClosed(closed: readonly vscode.Tab[]): void {
    for (const t of closed) {
      if (!(t.input instanceof vscode.TabInputTextDiff) || t.input.modified.scheme !== PROPOSED_SCHEME) continue;
      const uri = t.input.modified.toString();
      const callId = [...this.pending.entries()].find(([, p]) => p.uri.toString() === uri)?.[0];
      if (callId === undefined) continue;
      const shown = vscode.window.tabGroups.all.some((g) => g.tabs.some((o) =>
        o.input instanceof vscode.TabInputTextDiff && o.input.modified.toString() === uri));
      if (!shown) this.decide(callId, 'deny_once');
    }
  }

  /**
   * A file under review changed (on disk, which its open buffer follows, or typed into the diff's left side): its
   * diff's right side is still the change of the text it was previewed on, so the diff seems to undo the new text;
   * and Accept will not write it (the server writes nothing to a file whose text is not the previewed one:
   * docs/PROTOCOL.md §9, the call fails). A warning naming the file says so as its text turns from the previewed one,
   * not for each change after. Back to the previewed text (the change undone), Accept writes again: the review is
   * no longer stale, and the next change away from that text warns again. The file is the review's by its URI (as
   * the editor names it: a path differing only in a drive letter's case is the same file).
   */
  private fileChanged(doc: vscode.TextDocument): void {
    const uri = doc.uri.toString();
    for (const p of this.pending.values()) {
      if (p.preview.oldText === null || vscode.Uri.file(p.preview.path).toString() !== uri) continue;
      const stale = doc.getText() !== p.preview.oldText;
      if (stale && !p.stale) void vscode.window.showWarningMessage(staleWarning(p.preview.path));
      p.stale = stale;
    }
  }

  provideTextDocumentContent(uri: vscode.Uri): string { return this.texts.get(uri.toString()) ?? ''; }

  /** The waiting reviews, oldest first: the file, the tool and the title their diff editor shows. */
  pendingReviews(): { callId: string; path: string; tool: string; title: string }[] {
    return [...this.pending.entries()].map(([callId, p]) => ({ callId, path: p.preview.path, tool: p.req.tool, title: titleOf(p) }));
  }
  has(callId: string): boolean { return this.pending.has(callId); }

  /**
   * Opens the diff editor and resolves with the user's decision (deny_once when the request is
   * withdrawn). A diff editor that fails to open rejects with the error: the review is gone (with
   * whatever of it did open), nothing waits for a decision.
   */
  review(req: PermissionRequest, preview: DiffPreview, token: vscode.CancellationToken): Promise<PermissionDecision> {
    const fsPath = absPath(preview.path);
    const uri = vscode.Uri.from({ scheme: PROPOSED_SCHEME, path: fsPath, query: `callId=${encodeURIComponent(req.callId)}` });
    this.texts.set(uri.toString(), preview.newText);
    return new Promise<PermissionDecision>((resolve, reject) => {
      const sub = token.onCancellationRequested(() => this.decide(req.callId, 'deny_once', true));
      this.pending.set(req.callId, {
        req, preview: { ...preview, path: fsPath }, uri,
        resolve: (d) => { sub.dispose(); resolve(d); },
        fail: (e) => { sub.dispose(); reject(e); },
      });
      void this.updateContext();
      this.show(req.callId).catch((e) => this.take(req.callId)?.fail(e));
    });
  }

  /** (Re)opens the diff editor of a pending review. */
  async show(callId: string): Promise<void> {
    const p = this.pending.get(callId);
    if (!p) return;
    const left = vscode.Uri.file(p.preview.path);
    let leftUri = left;
    try {
      await vscode.workspace.fs.stat(left);
    } catch {   // a new file: compare with an empty virtual document
      leftUri = vscode.Uri.from({ scheme: PROPOSED_SCHEME, path: p.preview.path + '.empty', query: 'empty' });
      this.texts.set(leftUri.toString(), '');
    }
    await vscode.commands.executeCommand('vscode.diff', leftUri, p.uri, titleOf(p), { preview: false });
    fault('vscode.diff');
  }

  /** `callId` undefined: the review shown in the active diff editor, else the only pending one. */
  callIdFor(arg: unknown): string | undefined {
    if (typeof arg === 'string') return arg;
    if (arg && typeof arg === 'object' && 'callId' in arg && typeof (arg as { callId: unknown }).callId === 'string') {
      return (arg as { callId: string }).callId;
    }
    const uri = arg instanceof vscode.Uri ? arg : vscode.window.activeTextEditor?.document.uri;
    if (uri?.scheme === PROPOSED_SCHEME) {
      const id = new URLSearchParams(uri.query).get('callId');
      if (id) return id;
    }
    return this.pending.size === 1 ? [...this.pending.keys()][0] : undefined;
  }

  decide(callId: string | undefined, decision: PermissionDecision, withdrawn = false): boolean {
    const p = this.take(callId);
    if (!p) return false;
    if (!withdrawn) {
      const rec = { callId: callId!, path: p.preview.path, decision };
      this.history.push(rec);
      this.decided.fire(rec);
    }
    p.resolve(decision);
    return true;
  }

  /** Removes the pending review `callId` (its diff editor closes); undefined when there is none. */
  private take(callId: string | undefined): Pending | undefined {
    const p = callId ? this.pending.get(callId) : undefined;
    if (!p) return undefined;
    this.pending.delete(callId!);
    void this.updateContext();
    void this.closeTabs(p.uri);
    this.texts.delete(p.uri.toString());
    return p;
  }

  private async closeTabs(uri: vscode.Uri): Promise<void> {
    const tabs = vscode.window.tabGroups.all.flatMap((g) => g.tabs).filter((t) =>
      t.input instanceof vscode.TabInputTextDiff && t.input.modified.toString() === uri.toString());
    if (tabs.length) await vscode.window.tabGroups.close(tabs, true);
  }

  private updateContext() { return vscode.commands.executeCommand('setContext', CONTEXT_KEY, this.pending.size > 0); }

  dispose(): void {
    for (const id of [...this.pending.keys()]) this.decide(id, 'deny_once', true);
    for (const s of this.subs) s.dispose();
  }
}

/**
 * Whether each call's last read found its file (callId and path -> true: text was answered, false: "no such
 * file"), so that its write can tell a file that vanished since from a new one. Bounded: the oldest go first.
 */
const readFound = new Map<string, boolean>();
const READS_KEPT = 1000;
function noteRead(p: { path: string; callId?: string }, found: boolean): void {
  const key = `${p.callId ?? ''}\0${p.path}`;
  readFound.delete(key);
  readFound.set(key, found);
  if (readFound.size > READS_KEPT) readFound.delete(readFound.keys().next().value!);
}

/**
 * The client's file system for builtin file tools: reads serve open buffers (unsaved text
 * included), writes land in the buffer as one WorkspaceEdit (dirty, undoable), never on disk.
 * A file that cannot be read (none there, a folder) is an error answer (a ResponseError), not a
 * failure of the editor: a missing one is answered -32002, which the server takes as "no such
 * file" (write_file creates it). So is the saved buffer of a file deleted or renamed on disk since
 * it was opened (only an unsaved one is served without its file: docs/PROTOCOL.md §10), and the
 * write of a call whose read found the file fails when it has vanished since (nothing is created:
 * the edit would land behind the user's back). A file that is not UTF-8 text is an error answer
 * saying so: the server's call fails with it, as it does for such a file on disk (docs/PROTOCOL.md
 * §9), instead of editing a text decoded with U+FFFD that a save would write over its bytes.
 */
export const clientFs = {
  async readTextFile(p: { path: string; callId?: string }): Promise<string> {
    const f = await fileText(p.path);
    if ('text' in f) { noteRead(p, true); return f.text; }
    if ('notUtf8' in f) {
      noteRead(p, true);
      throw new ResponseError(ErrorCodes.InternalError, `'${p.path}' is not UTF-8 text (byte ${f.notUtf8}); it cannot be changed safely by this tool`);
    }
    // none there: -32002, the protocol's "no such file" for fs/readTextFile
    const e = 'missing' in f ? f.missing : f.unreadable;
    if ('missing' in f) noteRead(p, false);
    throw new ResponseError('missing' in f ? -32002 : ErrorCodes.InternalError,
      `cannot read ${p.path}: ${e instanceof Error ? e.message : String(e)}`);
  },
  async writeTextFile(p: { path: string; text: string; callId?: string }): Promise<void> {
    const uri = vscode.Uri.file(p.path);
    const key = `${p.callId ?? ''}\0${p.path}`;
    const found = readFound.get(key);
    readFound.delete(key);
    let exists = true;
    try { await vscode.workspace.fs.stat(uri); } catch { exists = false; }
    const open = openDocument(p.path);
    const edit = new vscode.WorkspaceEdit();
    if (exists || open?.isDirty) {   // the file, or the unsaved buffer the call read (its file gone)
      const doc = open ?? await vscode.workspace.openTextDocument(uri);
      const all = new vscode.Range(doc.positionAt(0), doc.positionAt(doc.getText().length));
      edit.replace(uri, all, p.text);
    } else if (found) {
      throw new ResponseError(ErrorCodes.InternalError,
        `${p.path} no longer exists on disk (deleted or renamed since it was read); nothing written`);
    } else {
      edit.createFile(uri, { ignoreIfExists: true });
      edit.insert(uri, new vscode.Position(0, 0), p.text);
    }
    if (!(await vscode.workspace.applyEdit(edit))) throw new Error(`could not apply the edit to ${p.path}`);
  },
};
