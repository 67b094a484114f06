// A stand-in for the `vscode` module, shared by the unit tests that load the extension's modules that import it
// (chatView.test.ts, chatStream.test.ts): enough for the chat view, the diff review, the file list and the
// extension to run. Importing this module makes `require('vscode')` resolve to it; import it before requiring them.
// It records the commands run, the messages shown, the settings read (with their scope) and the file searches.
// Also the helpers of those tests: a Memento in memory, a bounded wait, a scripted client, the chat view's host, a webview view.
import Module = require('node:module');
import type * as DiffReviewT from '../diffReview';
import { ErrorCodes, Message, OperateParams, OperateResult, ResponseError } from '../rpcClient';

export const log = {
  commands: [] as unknown[][], errors: [] as string[], warnings: [] as string[], infos: [] as string[], picks: [] as unknown[],
  settings: [] as [string, unknown][], searches: [] as [unknown, unknown][],
};

export class EventEmitter<T> {
  private readonly listeners = new Set<(v: T) => void>();
  readonly event = (l: (v: T) => void) => { this.listeners.add(l); return { dispose: () => this.listeners.delete(l) }; };
  fire(v: T): void { for (const l of [...this.listeners]) l(v); }
  dispose(): void { this.listeners.clear(); }
}
export class Uri {
  constructor(readonly scheme: string, readonly path: string, readonly query = '') {}
  /** As VS Code's: a path that begins with a drive letter (`/C:/...`) has it lower-cased, without the leading slash. */
  get fsPath(): string { return /^\/[A-Za-z]:/.test(this.path) ? this.path[1].toLowerCase() + this.path.slice(2) : this.path; }
  static file(p: string): Uri { return new Uri('file', p); }
  static parse(s: string): Uri { const m = /^([a-z-]+):(?:\/\/)?(.*)$/.exec(s); return new Uri(m ? m[1] : 'file', m ? m[2] : s); }
  static from(c: { scheme: string; path: string; query?: string }): Uri { return new Uri(c.scheme, c.path, c.query); }
  static joinPath(u: Uri, ...p: string[]): Uri { return new Uri(u.scheme, [u.path, ...p].join('/')); }
  /** As VS Code's: a drive letter lower-cased (the same file, however its path spelled it). */
  toString(): string {
    const p = /^\/[A-Za-z]:/.test(this.path) ? `/${this.path[1].toLowerCase()}${this.path.slice(2)}` : this.path;
    return `${this.scheme}://${p}${this.query ? `?${this.query}` : ''}`;
  }
}
export class RelativePattern {
  constructor(readonly base: { uri: Uri }, readonly pattern: string) {}
}
export const none = () => ({ dispose() { /* nothing */ } });
class FileSystemError extends Error {
  constructor(readonly code: string) { super(code); }
}

/** The editor's open documents (workspace.textDocuments) and the files on its disk (workspace.fs; none: every file is there, empty). */
export const docs: { uri: Uri; isDirty: boolean; getText: () => string }[] = [];
export const files = new Map<string, Uint8Array>();
/** The WorkspaceEdits applied, as their operations. */
export const edits: unknown[] = [];
/** workspace.onDidChangeTextDocument: a test fires the changes. */
export const documentChanged = new EventEmitter<{ document: unknown; contentChanges: unknown[] }>();
/** The workspace's folders, and per folder the `files.exclude` and `search.exclude` it sets (its own settings). */
export const folders: { uri: Uri; name: string; index: number }[] = [{ uri: Uri.file('/ws'), name: 'ws', index: 0 }];
export const excludes = new Map<string, Record<string, Record<string, boolean>>>();
/** What workspace.findFiles finds in each folder searched (paths relative to it). */
export const found: string[] = [];
/** The settings the extension reads (operateSidecar.*): defaults unless a test sets one. */
export const settings = new Map<string, unknown>();

export const vscode = {
  EventEmitter, Uri, RelativePattern, FileSystemError, version: '1.99.3',
  TabInputTextDiff: class { constructor(readonly original: Uri, readonly modified: Uri) {} },
  Position: class { constructor(readonly line: number, readonly character: number) {} },
  Range: class { constructor(readonly start: unknown, readonly end: unknown) {} },
  WorkspaceEdit: class {
    readonly ops: unknown[] = [];
    createFile(u: Uri) { this.ops.push(['create', u.path]); }
    insert(u: Uri, _at: unknown, t: string) { this.ops.push(['insert', u.path, t]); }
    replace(u: Uri, _r: unknown, t: string) { this.ops.push(['replace', u.path, t]); }
  }, StatusBarAlignment: { Left: 1 }, ProgressLocation: { Notification: 15 },
  Disposable: class { constructor(private readonly f?: () => void) {} dispose() { this.f?.(); } },
  ThemeColor: class { constructor(readonly id: string) {} },
  commands: { executeCommand: async (id: string, ...a: unknown[]) => { log.commands.push([id, ...a]); }, registerCommand: none },
  env: { clipboard: { writeText: async () => undefined } },
  languages: { getDiagnostics: () => [] },
  window: {
    registerWebviewViewProvider: none, activeTextEditor: undefined, visibleTextEditors: [], onDidChangeActiveTextEditor: none,
    showErrorMessage: async (m: string) => { log.errors.push(m); }, showWarningMessage: async (m: string) => { log.warnings.push(m); },
    showInformationMessage: async (m: string) => { log.infos.push(m); }, tabGroups: { all: [], close: async () => true, onDidChangeTabs: none },
    showTextDocument: async () => undefined, showQuickPick: async (items: unknown) => { log.picks.push(items); return undefined; },
    createOutputChannel: () => ({ append() { /* */ }, appendLine() { /* */ }, show() { /* */ }, dispose() { /* */ } }),
    createStatusBarItem: () => ({ show() { /* */ }, dispose() { /* */ } }),
  },
  workspace: {
    workspaceFolders: folders, textDocuments: docs, onDidChangeConfiguration: none, onDidChangeTextDocument: documentChanged.event,
    getConfiguration: (section: string, scope?: Uri) => {
      log.settings.push([section, scope]);
      return { get: (key: string, d?: unknown) => (key === 'exclude' ? excludes.get(scope?.path ?? '')?.[section] : settings.has(key) ? settings.get(key) : d) };
    },
    registerTextDocumentContentProvider: none, asRelativePath: (u: Uri | string) => String(typeof u === 'string' ? u : u.path),
    findFiles: async (include: unknown, exclude: unknown) => {
      log.searches.push([include, exclude]);
      const base = include instanceof RelativePattern ? include.base.uri.path : '/ws';
      return found.map((rel) => Uri.file(`${base}/${rel}`));
    },
    getWorkspaceFolder: () => undefined, applyEdit: async (e: { ops: unknown[] }) => { edits.push(...e.ops); return true; },
    fs: {
      stat: async (u: Uri) => { if (files.size && !files.has(u.path)) throw new FileSystemError('FileNotFound'); return {}; },
      readFile: async (u: Uri) => { if (files.size && !files.has(u.path)) throw new FileSystemError('FileNotFound'); return files.get(u.path) ?? Buffer.from(''); },
    },
    openTextDocument: async (o: object) => ({ getText: () => '', positionAt: (n: number) => n, ...o }),
  },
};

const M = Module as unknown as { _resolveFilename: (req: string, ...rest: unknown[]) => string };
const resolve = M._resolveFilename;
M._resolveFilename = function (req: string, ...rest: unknown[]) { return req === 'vscode' ? 'vscode' : resolve.call(this, req, ...rest); };
require.cache.vscode = { id: 'vscode', filename: 'vscode', loaded: true, exports: vscode } as NodeJS.Module;

/** A workspace state (Memento) in memory. */
export function memento() {
  const m = new Map<string, unknown>();
  return { get: (k: string, d?: unknown) => (m.has(k) ? m.get(k) : d), update: async (k: string, v: unknown) => { m.set(k, v); }, keys: () => [...m.keys()] };
}

/** Resolves once `cond` holds; fails after `ms`. */
export async function until(cond: () => boolean, what: string, ms = 5000): Promise<void> {
  const end = Date.now() + ms;
  while (!cond()) {
    if (Date.now() > end) throw new Error(`timeout after ${ms} ms: ${what}`);
    await new Promise((r) => setTimeout(r, 2));
  }
}

export const msg = (kind: string, content: object): Message => ({ kind, content, createdAt: 1 } as unknown as Message);
/** An operate's result of the reply `text`. */
export const result = (text: string) => ({ result: text, kind: 'text', model: null, usage: { inputTokens: 1, outputTokens: 1, contextTokens: 1, modelCalls: 1 }, rounds: 1 } as unknown as OperateResult);

export interface Op { params: OperateParams; progress: (v: object) => void; resolve: (r: OperateResult) => void; reject: (e: unknown) => void }
/** The client's calls the chat makes, scripted: branches with their messages (a read of one in `slow` answers after that many ms); operates resolved by the test. */
export class FakeClient {
  running = true;
  readonly branches = new Map<string, Message[]>();
  readonly slow = new Map<string, number>();
  readonly ops: Op[] = [];
  private n = 0;
  private readonly answered = new Map<string, { done: Promise<void>; resolve: () => void }>();
  /** Resolves once a read of branch `id` has answered (the first one; also when it answered before this call). */
  readAnswered(id: string): Promise<void> { return this.answer(id).done; }
  private answer(id: string) {
    let a = this.answered.get(id);
    if (!a) { let resolve!: () => void; const done = new Promise<void>((r) => { resolve = r; }); a = { done, resolve }; this.answered.set(id, a); }
    return a;
  }
  async createBranch() { const id = `new${++this.n}`; this.branches.set(id, []); return { branchId: id }; }
  async branchMessages(id: string, offset = 0, limit = 1000) {
    const ms = this.slow.get(id);
    if (ms) await new Promise((r) => setTimeout(r, ms));
    this.answer(id).resolve();
    const all = this.branches.get(id);
    if (!all) throw new ResponseError(ErrorCodes.BranchNotFound, `branch not found: ${id}`);
    return { messages: all.slice(offset, offset + limit), total: all.length };
  }
  operate(params: OperateParams, opts: { onProgress?: (v: object) => void }): Promise<OperateResult> {
    return new Promise((resolve, reject) => this.ops.push({ params, progress: (v) => opts.onProgress?.(v), resolve, reject }));
  }
}

/**
 * The chat view's host (ChatHost) on `client` and `branches` (a BranchStore): the server always up, a diff review of its
 * own, one round, no status bar, output channel or server problems; `overrides` replace any of its members.
 */
export function chatHost(client: FakeClient, branches: unknown, overrides: Record<string, unknown> = {}) {
  const { DiffReview } = require('../diffReview') as typeof DiffReviewT;   // (after the stand-in for `vscode` above)
  return { ensure: async () => client, current: () => client, branches, editors: { editor: undefined }, review: new DiffReview(),
    maxRounds: () => 1, runningChanged() { /* no status bar */ }, line() { /* no output channel */ }, serverProblem: () => undefined, ...overrides };
}

/**
 * A webview view: what the chat posts to it, and `send` to post the chat a message as its page would. `onPost`
 * answers a post as the page does (default: postMessage's promise resolves `true` at once; no acknowledgement).
 */
export function webviewView(onPost?: (m: { type: string; [k: string]: unknown }, send: (m: unknown) => Promise<void>) => Promise<boolean>) {
  const posted: { type: string; [k: string]: unknown }[] = [];
  let listener: ((m: unknown) => Promise<void>) | undefined;
  const send = (m: unknown) => listener!(m);
  const view = {
    visible: true, badge: undefined as unknown,
    webview: { options: {}, html: '', cspSource: 'x', asWebviewUri: (u: Uri) => u,
      postMessage: (m: { type: string }) => { posted.push(m); return onPost ? onPost(m, send) : Promise.resolve(true); },
      onDidReceiveMessage: (f: (m: unknown) => Promise<void>) => { listener = f; return none(); } },
    onDidDispose: none, onDidChangeVisibility: none,
  };
  return { view, posted, send };
}
