// The chat view: a webview view in its own activity-bar container. It shows the current branch's
// conversation (Markdown, tool cards, usage), streams the model's prose while a turn runs, and
// puts permission requests (with their diff review) in the conversation.
import * as vscode from 'vscode';
import { BranchStore } from './branchStore';
import {
  addThought, cardOfToolEvent, cardTitle, chatMarkdown, conversationParts, endThought, isObject, keepThoughts, KeyMod, LocalTurn, nameFrom, operateSpanAfter,
  ownsBranchEvent, ownTurn, progressAfter, proseOf, proseOfResult, refusesField, repeatNote, replyText, resolveLocalTurns, retryContext, statusText, StreamMarkdown, thoughtsOf, ToolCard, Turn, TurnProgress,
  turnsAfterFailedRead, turnsFromMessages, usageFromResult, withLocalTurns,
} from './chatModel';
import { EditorTracker, kindOf, pickFileRef, relPath, resolveInput, workspaceFiles } from './context';
import { FileEntry, fileRefText, suggestionsFor, tokenAt } from './refCompletion';
import { DiffReview, previewOf } from './diffReview';
import { offeredDecision, webviewMessage } from './webviewMessages';
import {
  CancellationToken, CancellationTokenSource, ErrorCodes, Json, JsonObject, Message, OperateParams, OperateResult, PermissionDecision,
  PermissionRequest, ResponseError, SidecarClient, ToolEvent,
} from './rpcClient';

export const VIEW_ID = 'operateSidecar.chat';
/** Dropped resources read at most (a drag of a whole selection in the Explorer). */
const MAX_DROPPED = 100;
/**
 * A URI of the window's side as this extension sees it: with a remote workspace (VS Code remote, code-server) a
 * drag in the window names `vscode-remote://<host>/<path>` where the extension, running beside the files, has
 * `file:` URIs; the `file:` of that path then. Unchanged when the extension's own workspace folders are remote.
 */
function asExtensionUri(u: vscode.Uri): vscode.Uri {
  const remote = (vscode.workspace.workspaceFolders ?? []).some((f) => f.uri.scheme === 'vscode-remote');
  return u.scheme === 'vscode-remote' && !remote ? vscode.Uri.file(u.path) : u;
}
/** Context keys of the view's Escape keybinding (package.json): a chat turn runs; the keyboard focus is in the chat. */
const RUNNING_KEY = 'operateSidecar.chatRunning';
const FOCUS_KEY = 'operateSidecar.chatFocus';
const setContext = (key: string, value: boolean) => void vscode.commands.executeCommand('setContext', key, value);
/** How long the end of a turn waits for the branch's messages (a hung server must not keep the turn running). */
const FINISH_MS = 10_000;
/** Messages per branchMessages page (the server's default limit). */
const PAGE = 1000;
/** At most one render of the streaming prose per this many ms. */
const STREAM_MS = 50;
/**
 * How long a `stream` post waits for the page's acknowledgement (`streamTaken`) before the next update goes anyway:
 * a lost one (a page replaced meanwhile, a message dropped) delays the stream by this much, never stalls it.
 */
const STREAM_ACK_MS = 1000;
/** A turn's rounds stop after this many in a row that made the same calls, all failing the same way (the server's repeatLimit). */
const REPEAT_LIMIT = 3;
/** How long Attach File waits for a chat view being built to listen. */
const READY_MS = 10_000;

/** All of a branch's messages (in pages: a long chat has more than one). */
async function allMessages(client: SidecarClient, branchId: string): Promise<Message[]> {
  const first = await client.branchMessages(branchId, 0, PAGE);
  const messages = [...first.messages];
  while (messages.length < first.total) {
    const next = await client.branchMessages(branchId, messages.length, PAGE);
    if (!next.messages.length) break;
    messages.push(...next.messages);
  }
  return messages;
}

/** `p`, or a -32800 rejection as soon as `token` is cancelled (Stop while the server is still starting). */
function unlessCancelled<T>(p: Promise<T>, token: CancellationToken): Promise<T> {
  const stopped = () => new ResponseError(ErrorCodes.Cancelled, 'the chat turn was stopped');
  if (token.isCancellationRequested) return Promise.reject(stopped());
  return new Promise<T>((resolve, reject) => {
    const sub = token.onCancellationRequested(() => { sub.dispose(); reject(stopped()); });
    p.then((v) => { sub.dispose(); resolve(v); }, (e) => { sub.dispose(); reject(e); });
  });
}

/** What the chat needs from the rest of the extension. */
export interface ChatHost {
  ensure(): Promise<SidecarClient>;
  /** The running server's client, if any (never starts one). */
  current(): SidecarClient | undefined;
  readonly branches: BranchStore;
  readonly editors: EditorTracker;
  readonly review: DiffReview;
  maxRounds(): number;
  /** Called when a turn starts or ends, and when a call starts or stops waiting for the user's decision (status bar). */
  runningChanged(running: boolean): void;
  /** Logs a line to the output channel. */
  line(text: string): void;
  /** The server's stderr tail and the commands to offer when the server is unusable. */
  serverProblem(e: unknown): string | undefined;
}

export interface TurnOutcome { branchId: string; result?: OperateResult; cancelled?: boolean; error?: string }

interface Live {
  turn: Turn;
  /** the turn's branch, once known (read or made before the operate is sent) */
  branchId: string;
  /** the branch of the chat the turn was sent in ('' = a new chat): the turn's chat to name (status bar, header) until branchId is known */
  chat: string;
  stream: string;
  /** index in turn.items of the prose item being streamed (-1: none yet) */
  proseIdx: number;
  source: CancellationTokenSource;
  cards: Map<string, ToolCard>;
  /** The note of a turn stopped by the extension (not the user), e.g. for a restart. */
  stopNote?: string;
  /** The context sent with the instruction (kept with the turn if it fails, for Retry). */
  context?: JsonObject;
  /** The response format the turn asked for (see send; kept with the turn if it fails, for Retry). */
  responseFormat?: JsonObject;
  /** What its `$/progress` reports told so far: the turn's status line (turn.status). */
  progress: TurnProgress;
  /** The branch's message count before this turn; whether its operate was sent. */
  at: number;
  sent: boolean;
  /**
   * Its operate's progress began (it has the branch) and has not ended: the branch's tool events and permission
   * requests are its own only then (see ownsBranchEvent; another operate on the branch, e.g. the Operate command's, has them otherwise).
   */
  began: boolean;
  ended: boolean;
  /** The stream as last shown; when; the pending flush (see delta). */
  flushed: string;
  lastFlush: number;
  flushTimer?: NodeJS.Timeout;
  /** The streamed prose item's Markdown, rendered as it grows (see flush). */
  md: StreamMarkdown;
  /** The webview's prose of the item is the streamed one (the settled blocks, then the tail), not a redraw's (see flush). */
  shown: boolean;
  /** The `stream` post the webview has not acknowledged yet (its number; 0: none): the next waits for it (see flush). */
  posting: number;
  /** Ends the wait for the page's acknowledgement of `posting` (STREAM_ACK_MS). */
  ackTimer?: NodeJS.Timeout;
  /** The pending redraw of the thoughts that stream (see thought). */
  thoughtTimer?: NodeJS.Timeout;
}

export class ChatView implements vscode.WebviewViewProvider, vscode.Disposable {
  private view: vscode.WebviewView | undefined;
  /** What the chat shows: the branch's turns from the server with the local ones (below). */
  private turns: Turn[] = [];
  private serverTurns: Turn[] = [];
  private serverTotal = 0;
  /**
   * Turns of this chat the server did not record as shown (failed, stopped): kept, in order, per
   * chat in the workspace state (see BranchStore.localTurns), so that they come back when the chat
   * is shown again, also after a window reload. `localBranch`: their branch ('' = a chat not yet bound); while a turn
   * runs, the turn's own chat (only send, newBranch and leaveDeleted move it then: refresh begins no read until the turn's end,
   * and a read of the turn's chat begun before it was sent still shows).
   */
  private locals: LocalTurn[] = [];
  private localBranch = '';
  private live: Live | undefined;
  private supportsMaxRounds = true;
  private supportsRepeatLimit = true;
  private readonly pendingAsks = new Map<string, { resolve: (d: PermissionDecision) => void; card: ToolCard; options: readonly string[] }>();
  /** Requests of calls that waited when their turn was stopped: shown as stopped, answered once the server withdraws them or the turn ends (see stop). */
  private readonly unanswered = new Map<string, () => void>();
  private readonly subs: vscode.Disposable[] = [];
  private readonly ready = new vscode.EventEmitter<void>();
  /** The webview's script listens (it reported `ready` since the view was last built). */
  private scriptReady = false;
  private streamUpdates = 0;
  /** Streamed pieces received (streamUpdates: how often the prose was rendered and shown). */
  private deltas = 0;
  /**
   * `stream` posts, the characters of HTML they carried, updates that waited for the page to take the last, and posts
   * counted as taken without the page's acknowledgement (for the tests); the number of the last.
   */
  private streamPosts = 0;
  private streamChars = 0;
  private streamWaits = 0;
  private streamAckMissed = 0;
  private streamSeq = 0;
  /** The streamed prose shown when the last turn ended (for the tests). */
  private lastProse = '';
  /** Reloads of the branch from the server (for the tests). */
  private loads = 0;
  /** How often the view's page reported `ready` (built, or built again after it was hidden) and was shown the chat (for the tests). */
  private viewReady = 0;
  /** Reads of the chat begun (refresh): one that ends after a later one began shows nothing (the user switched chats meanwhile: the latest wins). */
  private reads = 0;
  /** The modifier the user's keyboard names (the webview says it when it starts): the cards' tooltips name it. */
  private keyMod: KeyMod = 'Ctrl';
  /**
   * The HTML of each part of the conversation as last posted to the webview: a redraw posts only
   * the parts that changed (a long chat costs no more per update than a short one). Cleared when
   * the webview (re)starts: it reports `ready`, and gets all of them.
   */
  private sentParts: string[] = [];
  /** Characters of HTML posted in `state` messages, and their number (for the tests). */
  private postedChars = 0;
  private posts = 0;
  /** What Attach File and Add the Selection put into the input, the last 20 in order (for the tests). */
  private readonly attached: string[] = [];
  /**
   * The workspace's files for the input's `#file:` completion: listed when a completion begins (the
   * webview says `fresh`) and reused while it is typed, so a file made meanwhile is offered next time.
   */
  private files: Promise<FileEntry[]> | undefined;

  constructor(private readonly ctx: vscode.ExtensionContext, private readonly host: ChatHost) {
    this.subs.push(vscode.window.registerWebviewViewProvider(VIEW_ID, this), this.ready);
    this.subs.push(host.review.onDidDecide((r) => this.settleAsk(r.callId, r.decision)));
    this.locals = host.branches.localTurns(this.localBranch);   // a new chat's own, kept through a window reload
    setContext(RUNNING_KEY, false);
    setContext(FOCUS_KEY, false);
  }

  // ---- webview ---------------------------------------------------------------------------------
  resolveWebviewView(view: vscode.WebviewView): void {
    this.view = view;
    this.sentParts = [];
    this.scriptReady = false;
    if (this.live) {   // (a new page: it has nothing streamed, and takes posts)
      this.live.shown = false;
      this.live.posting = 0;
      clearTimeout(this.live.ackTimer);
    }
    this.showWaiting();
    const media = vscode.Uri.joinPath(this.ctx.extensionUri, 'media');
    view.webview.options = { enableScripts: true, localResourceRoots: [media] };
    const nonce = Math.random().toString(36).slice(2) + Date.now().toString(36);
    const css = view.webview.asWebviewUri(vscode.Uri.joinPath(media, 'chat.css'));
    const js = view.webview.asWebviewUri(vscode.Uri.joinPath(media, 'chat.js'));
    view.webview.html = `<!DOCTYPE html><html lang="en"><head><meta charset="UTF-8">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; style-src ${view.webview.cspSource}; script-src 'nonce-${nonce}'; img-src ${view.webview.cspSource} data:;">
<meta name="viewport" content="width=device-width, initial-scale=1.0"><link rel="stylesheet" href="${css}"></head>
<body><header id="bar"><button id="branch" class="link" title="Switch chat (fork, delete)"></button><span class="grow"></span>
<button id="model" class="link" title="Pick the model"></button><button id="new" class="link" title="New chat">New</button></header>
<main id="log"></main>
<footer><ul id="complete" role="listbox" aria-label="Suggestions" hidden></ul><textarea id="input" rows="3" aria-label="Message to the chat" aria-autocomplete="list" aria-controls="complete" aria-expanded="false" placeholder="Ask or instruct… (#file, #file:path, #selection, #problems)  Enter to send, Shift+Enter for a new line"></textarea>
<div class="row"><button id="attach" class="secondary" title="Attach a file of the workspace to the message (#file:path)">+ File</button><span id="status" role="status" aria-live="polite"></span><span class="grow"></span><button id="stop" class="secondary" hidden>Stop</button><button id="send">Send</button></div></footer>
<script nonce="${nonce}" src="${js}"></script></body></html>`;
    view.webview.onDidReceiveMessage((m) => this.onMessage(m), undefined, this.subs);
    view.onDidDispose(() => { if (this.view === view) { this.view = undefined; setContext(FOCUS_KEY, false); } }, undefined, this.subs);
    view.onDidChangeVisibility(() => { if (!view.visible) setContext(FOCUS_KEY, false); }, undefined, this.subs);
  }

  /** A message of the webview: checked first (webviewMessage); one of another shape is logged and ignored (a waiting request stays waiting). */
  private async onMessage(raw: unknown): Promise<void> {
    const m = webviewMessage(raw);
    if (!m) { this.host.line(`[chat] ignored a message from the chat view: ${String(JSON.stringify(raw)).slice(0, 200)}`); return; }
    try {
      switch (m.type) {
        case 'ready': this.keyMod = m.mod; this.sentParts = []; await this.refresh(); this.scriptReady = true; this.viewReady++; this.ready.fire(); break;
        case 'send': if (m.text.trim()) void this.send(m.text).catch(() => undefined); break;
        case 'retry': void this.retry(m.id).catch(() => undefined); break;
        case 'stop': this.stop(); break;
        case 'focus': setContext(FOCUS_KEY, m.focused); break;
        case 'decide': this.decide(m.callId, m.decision); break;
        case 'showDiff': await this.host.review.show(m.callId); break;
        case 'copy': await vscode.env.clipboard.writeText(m.code); break;
        case 'copyReply': await this.copyReply(m.index); break;
        case 'insert': await this.insert(m.code); break;
        case 'command': await vscode.commands.executeCommand(m.id); break;   // (one of WEBVIEW_COMMANDS)
        case 'attach': await this.attachFile(); break;
        case 'drop': await this.attachDropped(m.uris); break;
        case 'complete': await this.complete(m.seq, m.before, m.fresh); break;
        case 'streamTaken': this.streamTaken(m.seq); break;
      }
    } catch (e) {
      void vscode.window.showErrorMessage(`operate-sidecar: ${e instanceof Error ? e.message : String(e)}`);
    }
  }

  /** The turns the chat shows: the branch's with the local ones, then the running one (its own chat is shown while it runs: see localBranch). */
  private get shown(): Turn[] { return this.live ? [...this.turns, this.live.turn] : this.turns; }

  /** Copy under a reply: the Markdown of the turn shown at `index` goes on the clipboard. */
  private async copyReply(index: number): Promise<void> {
    const turn = this.shown[index];
    if (turn) await vscode.env.clipboard.writeText(replyText(turn));
  }

  /**
   * Export Chat: the conversation (read from the branch again, with the turns kept here) as one Markdown
   * document, opened unsaved: the user saves it where they like. An empty chat: a message, no document.
   */
  async exportMarkdown(): Promise<vscode.TextDocument | undefined> {
    await this.refresh();
    const turns = this.shown;
    if (!turns.length) { void vscode.window.showInformationMessage('operate-sidecar: nothing to export: the chat is empty'); return undefined; }
    const id = this.localBranch || undefined;   // (the chat shown: a running turn's, whichever was picked meanwhile)
    const title = this.host.branches.nameOf(id) ?? nameFrom(turns.find((t) => t.user)?.user ?? '');
    const when = `Exported from operate-sidecar on ${new Date().toLocaleString()}${id ? ` (branch ${id})` : ''}`;
    const doc = await vscode.workspace.openTextDocument({ language: 'markdown', content: chatMarkdown(turns, title, when) });
    await vscode.window.showTextDocument(doc, { preview: false });
    return doc;
  }

  private async insert(code: string): Promise<void> {
    const ed = this.host.editors.editor;
    if (!ed) { void vscode.window.showInformationMessage('operate-sidecar: open an editor to insert the code into'); return; }
    await ed.edit((b) => b.replace(ed.selection, code));
  }

  private post(msg: object): void { void this.view?.webview.postMessage(msg); }

  private header() {
    // a running turn's chat, also before its branch is read (a chat picked meanwhile is shown once it ends)
    const id = this.live ? this.runningBranch() : this.host.branches.current;
    return {
      branch: (id && this.host.branches.nameOf(id)) || (id ? id.slice(0, 8) : 'New chat'),
      model: this.host.branches.model ?? 'default model',
    };
  }

  /** Sends the conversation's turns that changed since the last post (structure changes); prose deltas go through `stream`. */
  render(): void {
    if (this.live) this.live.shown = false;   // (its prose is this redraw's now: the next stream post is all of it)
    const turns = this.shown;
    const all = conversationParts(turns, this.keyMod);
    // only the parts that changed since the last post (by index); `count` drops the ones after
    const parts: Record<number, string> = {};
    let chars = 0;
    all.forEach((h, i) => { if (this.sentParts[i] !== h) { parts[i] = h; chars += h.length; } });
    if (!this.view) return;   // nothing shown: the view gets everything when it reports ready
    this.sentParts = all;
    this.posts++;
    this.postedChars += chars;
    this.post({ type: 'state', count: all.length, parts, running: !!this.live, ...this.header() });
  }

  /** Calls waiting for the user's decision: the view's badge counts them (seen also when the chat is hidden); the status bar says so. */
  private showWaiting(): void {
    const n = this.pendingAsks.size;
    try {
      // none left: a badge of 0, which shows nothing (VS Code 1.99 leaves a webview view's last badge up when it is set to undefined)
      if (this.view) {
        this.view.badge = n ? { value: n, tooltip: n === 1 ? 'A tool call waits for your decision' : `${n} tool calls wait for your decision` }
          : this.view.badge ? { value: 0, tooltip: '' } : undefined;
      }
    } catch { /* a view being disposed: nothing to show it on (never in the way of a decision) */ }
    this.host.runningChanged(!!this.live);
  }

  /** How many tool calls of the running turn wait for the user's decision. */
  get waiting(): number { return this.pendingAsks.size; }

  /**
   * Reloads the current branch's conversation from the server. While a turn runs, the chat shows the turn's own
   * chat, whichever chat was picked meanwhile (the turn's end shows that one, see finish): the server has already
   * recorded part of the turn (the reply, its calls) and the live turn shows it; the turns before it are unchanged
   * (a view shown again). Bound to another chat then, the turn would show under that chat's history and, ended, be
   * kept with neither.
   */
  async refresh(): Promise<void> {
    // (no read while a turn runs, and none begun: a read of the turn's chat that was out when it was sent still shows)
    if (this.live) { this.render(); return; }
    const read = ++this.reads;
    const id = this.host.branches.current;
    this.bindLocal(id ?? '');
    if (!id) { this.serverTurns = []; this.serverTotal = 0; this.turns = withLocalTurns([], this.locals); this.render(); return; }
    // a later read began while this one waited (another chat was picked), or the chat shown is another one now (the
    // current one; while a turn runs, the turn's own: a chat picked meanwhile does not make this read stale)
    const stale = () => read !== this.reads || (this.live ? this.localBranch : this.host.branches.current ?? '') !== id;
    try {
      const client = await this.host.ensure();
      const messages = await allMessages(client, id);
      if (stale()) return;
      // a turn sent in this chat meanwhile: the branch's history before it (what the server recorded of the turn since, it shows live)
      const live = this.live as Live | undefined;   // (sent since the read began: see send)
      this.loaded(live?.sent ? messages.slice(0, live.at) : messages);
      this.loads++;
    } catch (e) {
      // (failed while a turn runs in this chat: the turn's own read says what became of the chat, see send)
      if (stale() || this.live) return;
      const shown = turnsAfterFailedRead(e, this.locals, (x) => this.host.serverProblem(x));
      if (!shown) return;   // cancelled by a restart: no error (the chat is read again once the server runs)
      this.serverTurns = [];
      this.turns = shown;
      if (e instanceof ResponseError && e.code === ErrorCodes.BranchNotFound) await this.host.branches.setCurrent(undefined);
    }
    this.render();
  }

  /**
   * The chat shows `branchId` ('' = a new chat): its own local turns (kept), not another branch's.
   * Those of a new chat that never got a branch go when it is left (there is no way back to it).
   */
  private bindLocal(branchId: string): void {
    if (branchId === this.localBranch) return;
    if (this.localBranch === '') void this.host.branches.setLocalTurns('', []);
    this.locals = this.host.branches.localTurns(branchId);
    this.localBranch = branchId;
  }

  /** Keeps the chat's local turns (workspace state). */
  private saveLocals(): void { void this.host.branches.setLocalTurns(this.localBranch, this.locals); }

  /** The branch's messages were read: the local turns are placed among its turns. */
  private loaded(messages: Message[]): void {
    if (resolveLocalTurns(this.locals, messages.length)) this.saveLocals();
    this.serverTotal = messages.length;
    this.serverTurns = this.turnsOf(messages);
    this.turns = withLocalTurns(this.serverTurns, this.locals);
  }

  /** The turns of the chat's branch, read as `messages`, with what it kept of them that the branch does not hold (see BranchStore.keptTurn). */
  private turnsOf(messages: Message[]): Turn[] {
    const turns = turnsFromMessages(messages);
    for (const t of turns) {
      const kept = t.start !== undefined ? this.host.branches.keptTurn(this.localBranch, t.start) : undefined;
      if (kept) keepThoughts(t, kept.thoughts);
      if (kept?.note) t.note = kept.note;
    }
    return turns;
  }

  /** A new chat (New with no branch yet): forgets the turns that failed before it had one. */
  clearUnbound(): void {
    if (this.live || this.host.branches.current) return;
    this.locals = [];
    this.saveLocals();
    this.serverTurns = [];
    this.turns = [];
    this.render();
  }

  /** The turns shown (for the tests and other extensions). */
  shownTurns(): { user: string; outcome?: string; note?: string; error?: string; cards: string[]; thoughts: string[] }[] {
    const turns = this.shown;
    return turns.map((t) => ({ user: t.user, ...(t.outcome && { outcome: t.outcome }), ...(t.note && { note: t.note }),
      ...(t.error && { error: t.error }), cards: t.items.flatMap((i) => (i.kind === 'tool' ? [cardTitle(i.card)] : [])),
      thoughts: t.items.flatMap((i) => (i.kind === 'thought' ? [i.text] : [])) }));
  }

  async reveal(): Promise<void> {
    await vscode.commands.executeCommand(`${VIEW_ID}.focus`);
  }

  /** Resolves once the webview's script listens (it reported `ready`), at the latest after READY_MS. */
  private whenReady(): Promise<void> {
    if (this.scriptReady) return Promise.resolve();
    return new Promise((resolve) => {
      const done = () => { clearTimeout(timer); sub.dispose(); resolve(); };
      const timer = setTimeout(done, READY_MS);
      const sub = this.ready.event(done);
    });
  }

  /**
   * Attach File: the `#file:<path>` of the files given (the Explorer's or an editor tab's menu: the
   * file it was opened on, or all the files of a multiple selection; folders left out), else of the
   * file picked (the button under the input, the command), goes into the input at the caret.
   */
  async attachFile(uri?: unknown, uris?: unknown): Promise<void> {
    const given = (Array.isArray(uris) && uris.length ? uris : [uri]).filter((u): u is vscode.Uri => u instanceof vscode.Uri);
    if (given.length) return this.attachFiles(given);
    const ref = await pickFileRef();
    if (ref) await this.attachRef(ref);
  }

  /** The `#file:` references of the files among `uris` into the input (a folder left out); none of them a file on the disk: a message says so. */
  private async attachFiles(uris: vscode.Uri[]): Promise<void> {
    const files = uris.filter((u) => kindOf(u) === 'file');
    if (!files.length) {
      void vscode.window.showInformationMessage('operate-sidecar: only files on the disk can be attached to the chat message (not a folder, not an unsaved document)');
      return;
    }
    await this.attachRef(files.map((u) => fileRefText(relPath(u))).join(' '));
  }

  /** Files dropped on the chat (the URIs the webview read from the drag): as Attach File with them (attachFiles). */
  private async attachDropped(uris: unknown): Promise<void> {
    await this.attachFiles((Array.isArray(uris) ? uris : []).filter((u): u is string => typeof u === 'string').slice(0, MAX_DROPPED)
      .flatMap((u) => { try { return [asExtensionUri(vscode.Uri.parse(u, true))]; } catch { return []; } }));
  }

  /** `ref` (`#file:<path>`, `#selection`...) into the chat's input at the caret, set apart by spaces; the chat shown, the input focused. */
  async attachRef(ref: string): Promise<void> {
    await this.reveal();
    await this.whenReady();
    this.attached.push(ref);
    if (this.attached.length > 20) this.attached.shift();
    this.post({ type: 'attach', ref });
  }

  /**
   * The inline completion of the input's `#` references: the suggestions for the token that ends
   * `before` (the text up to the caret), answered with the request's `seq` (the webview shows the
   * newest only). The file list is read again when a completion begins (`fresh`).
   */
  private async complete(seq: number, before: string, fresh: boolean): Promise<void> {
    const token = tokenAt(before);
    let files: FileEntry[] = [];
    if (token?.kind === 'file') {
      if (fresh || !this.files) this.files = workspaceFiles().catch(() => []);
      files = await this.files;
    }
    this.post({ type: 'completions', seq, start: token?.start ?? -1, items: token ? suggestionsFor(token, files) : [] });
  }

  // ---- turns -----------------------------------------------------------------------------------
  get running(): boolean { return !!this.live; }
  runningBranch(): string | undefined { return this.live ? this.live.branchId || this.live.chat || undefined : undefined; }
  stats() {
    // the running turn's tool cards as the chat shows them
    const cards = [...this.live?.cards.values() ?? []].map((c) => ({ tool: c.tool, state: c.state, title: cardTitle(c), args: c.args, argsCut: !!c.argsCut }));
    return { streamUpdates: this.streamUpdates, deltas: this.deltas, streamPosts: this.streamPosts, streamChars: this.streamChars, streamWaits: this.streamWaits, streamAckMissed: this.streamAckMissed, lastProse: this.lastProse, turns: this.turns.length, pendingAsks: [...this.pendingAsks.keys()], loads: this.loads, viewReady: this.viewReady, visible: !!this.view?.visible, cards,
      status: this.live?.turn.status,
      badge: this.badgeValue(), posts: this.posts, postedChars: this.postedChars, attached: [...this.attached] };
  }

  private badgeValue(): number {
    try { return this.view?.badge?.value ?? 0; } catch { return 0; }
  }

  /**
   * Sends a failed or stopped turn of this chat again, by its id: the same text, as a new turn on the
   * same branch. Nothing of it needs undoing first: the server records a turn only with its reply (an
   * operate that fails records nothing), and the part of a stopped turn it recorded (the rounds before
   * the stop, their tool calls each with its response) is the branch's history, which the model sees.
   * A turn the branch does not hold goes with the same context (what was attached then, not the
   * editor's state now); one it holds goes without: its recorded instruction has that context
   * already (see retryContext), and the new turn shows no attachment. A turn the branch shows was
   * cancelled, of which this chat kept nothing (a window reload ended it: see turnsFromMessages), is one it holds;
   * it goes as a plain chat turn, its text only: the branch's record keeps no other parameter of the request (a
   * `responseFormat` only as the schema the model was shown, the model, tools and rounds not at all), nor who sent
   * it, so one started outside the chat (the Operate command, a script) is offered Retry alike (the README says so).
   */
  async retry(id: string): Promise<TurnOutcome | undefined> {
    if (this.live) return undefined;
    const l = this.locals.find((x) => x.turn.id === id);
    if (l) return this.send(l.turn.user, { context: retryContext(l, this.serverTurns) }, l.responseFormat && { responseFormat: l.responseFormat });
    const interrupted = this.serverTurns.find((t) => t.id === id && t.outcome && t.start !== undefined);
    return interrupted && this.send(interrupted.user, {});
  }

  /**
   * One chat turn on the current branch (created, named after the instruction, when there is none), which stays its
   * branch whichever chat is picked before it ends.
   * `sent`: the context to send as it is (Retry), instead of resolving the text's references now.
   * `responseFormat`: a JSON Schema the reply must follow (the server asks the model again, a repair
   * turn, when it does not); its fields show as prose.
   */
  async send(text: string, sent?: { context?: JsonObject }, opts?: { responseFormat?: JsonObject }): Promise<TurnOutcome> {
    if (this.live) throw new Error('a chat turn is already running');
    const resolved = sent ? { instruction: text, ...(sent.context && { context: sent.context }) } : resolveInput(text, this.host.editors.editor);
    const turn: Turn = { user: text, contextLabels: (resolved.context?.labels as string[] | undefined) ?? [], items: [], running: true };
    const source = new CancellationTokenSource();
    this.bindLocal(this.host.branches.current ?? '');
    this.live = { turn, branchId: '', chat: this.localBranch, stream: '', proseIdx: -1, source, cards: new Map(), at: this.serverTotal, sent: false, began: false, ended: false,
      flushed: '', lastFlush: 0, md: new StreamMarkdown(), shown: false, posting: 0, progress: { round: 1 }, ...(resolved.context && { context: resolved.context }),
      ...(opts?.responseFormat && { responseFormat: opts.responseFormat }) };
    this.render();
    this.host.runningChanged(true);
    setContext(RUNNING_KEY, true);
    let outcome: TurnOutcome = { branchId: '' };
    try {
      // Stop ends the turn even while the server is still starting (or never answers)
      const client = await unlessCancelled(this.host.ensure(), source.token);
      // the chat it was sent in, not the one picked while the server started: the turn shows, and is kept, there
      let branchId = this.localBranch || undefined;
      if (branchId) {
        // where this turn begins on the branch (and, read first after a turn that failed, whether
        // the server had recorded part of that one); a branch deleted elsewhere: the turn goes to a new chat
        try {
          const total = (await unlessCancelled(client.branchMessages(branchId, 0, 0), source.token)).total;
          if (resolveLocalTurns(this.locals, total)) this.saveLocals();
          this.live.at = total;
        } catch (e) {
          if (e instanceof ResponseError && e.code === ErrorCodes.Cancelled) throw e;
          if (e instanceof ResponseError && e.code === ErrorCodes.BranchNotFound) { await this.leaveDeleted(branchId); branchId = undefined; }
        }
      }
      if (!branchId) branchId = await this.newBranch(client, this.live, text, source.token);
      this.live.branchId = branchId;
      outcome.branchId = branchId;
      this.render();
      const model = this.host.branches.model;
      const params: OperateParams = {
        branchId, instruction: resolved.instruction, ...(resolved.context && { context: resolved.context }),
        actions: true, tools: true, ...(model && { chatModel: model }), ...(opts?.responseFormat && { responseFormat: opts.responseFormat }),
      };
      this.live.sent = true;
      const result = await this.operate(client, params, source);
      outcome.result = result;
      await this.finish(result);
    } catch (e) {
      const cancelled = e instanceof ResponseError && e.code === ErrorCodes.Cancelled;
      // (deleted elsewhere after the read above: the next message, or Retry, goes to a new chat)
      const gone = e instanceof ResponseError && e.code === ErrorCodes.BranchNotFound
        ? 'this chat was deleted (in another window, or by another client of the server); send the message again, or Retry, to go on in a new chat' : undefined;
      outcome = { ...outcome, cancelled, ...(!cancelled && { error: gone ?? this.host.serverProblem(e) ?? (e instanceof Error ? e.message : String(e)) }) };
      await this.finish(undefined, cancelled ? (this.live?.stopNote ?? 'Stopped.') : undefined, outcome.error);
    }
    return outcome;
  }

  /**
   * A new branch for the running turn `live` (sent in a new chat), named after its message `text`: the chat's from
   * now on, and the current one unless the user picked another chat meanwhile (that pick stands; the turn is kept with
   * this branch all the same). The turns kept for the chat before it had a branch (failed before the server made one)
   * stay with it, before its first message.
   */
  private async newBranch(client: SidecarClient, live: Live, text: string, token: CancellationToken): Promise<string> {
    const name = nameFrom(text);
    const model = this.host.branches.model;
    const branchId = (await unlessCancelled(client.createBranch({ name, ...(model && { chatModel: model }) }), token)).branchId;
    this.host.branches.remember(branchId, name);
    void this.host.branches.setLocalTurns('', []);
    this.localBranch = branchId;
    this.saveLocals();
    this.serverTurns = [];
    this.serverTotal = 0;
    live.at = 0;
    if (!this.host.branches.current) await this.host.branches.setCurrent(branchId);
    this.host.line(`[chat] new branch "${name}" ${branchId}`);
    return branchId;
  }

  /**
   * The chat's branch `gone` was deleted elsewhere (another window's chat picker, another client of the server or
   * of its state directory) and the running turn was sent in it: the user is told so, in words, once; what
   * the chat kept of it goes with it (as with Delete Branch), and the turn goes to a new chat, as the chat's first
   * message (the chat has no branch then, see newBranch), instead of failing with the server's `branch not found`,
   * it and every message after it. The current chat becomes a new one unless the user picked another meanwhile.
   */
  private async leaveDeleted(gone: string): Promise<void> {
    const name = this.host.branches.nameOf(gone);
    this.host.line(`[chat] branch ${gone} is gone (deleted elsewhere): the message goes to a new chat`);
    void vscode.window.showInformationMessage(`operate-sidecar: the chat ${name ? `"${name}"` : gone.slice(0, 8)} was deleted (in another window, `
      + 'or by another client of the server); your message goes to a new chat.');
    void this.host.branches.setLocalTurns(gone, []);
    void this.host.branches.forgetKept(gone);
    this.locals = [];
    this.serverTurns = [];
    this.serverTotal = 0;
    this.turns = [];
    this.localBranch = '';
    // (a new chat: what fails before it has a branch stays with it)
    if (this.host.branches.current === gone) await this.host.branches.setCurrent(undefined);
  }

  private async operate(client: SidecarClient, params: OperateParams, source: CancellationTokenSource): Promise<OperateResult> {
    const maxRounds = this.host.maxRounds();
    const go = (p: OperateParams) => {
      const live = this.live;
      if (live) { live.progress = { round: 1, ...(p.maxRounds !== undefined && { maxRounds: p.maxRounds }) }; live.began = live.ended = false; }
      return client.operate(p, {
        token: source.token,
        onProgress: (v) => {
          if (!isObject(v)) return;   // (a server of another version: a value this client cannot read)
          if (live) operateSpanAfter(live, v);   // (its progress says when the branch's events are its own)
          if (v.kind === 'report' && typeof v.delta === 'string') this.delta(v.delta);
          if (v.kind === 'report' && typeof v.thought === 'string') this.thought(v.thought);
          this.progressed(v);
        },
      });
    };
    if (this.supportsMaxRounds && maxRounds > 1) {
      // (the rounds stop after REPEAT_LIMIT rounds in a row of the same failing calls: the model is stuck)
      const repeat = this.supportsRepeatLimit ? { repeatLimit: REPEAT_LIMIT } : {};
      try {
        return await go({ ...params, maxRounds, ...repeat });
      } catch (e) {
        // a server without rounds (or without their repeat stop) refuses the field as unknown, before any model
        // call: run without it (until the next server start). Any other -32602 (a bad value) is the error it is.
        const noRounds = e instanceof ResponseError && refusesField(e, 'maxRounds');
        const noRepeat = e instanceof ResponseError && refusesField(e, 'repeatLimit');
        if (!noRounds && !noRepeat) throw e;
        if (noRepeat) { this.host.line('[chat] the server has no repeatLimit: rounds without the repeat stop'); this.supportsRepeatLimit = false; }
        if (!noRounds) return go({ ...params, maxRounds });
        this.host.line('[chat] the server has no maxRounds: single rounds');
        this.supportsMaxRounds = false;
      }
    }
    return go(params);
  }

  /**
   * A `$/progress` value of the running turn: its status line says what it does now (redrawn only
   * when that changes: not for each streamed piece).
   */
  private progressed(v: { kind: string; phase?: string; message?: string; delta?: string }): void {
    const live = this.live;
    if (!live) return;
    live.progress = progressAfter(live.progress, v);
    const status = statusText(live.progress);
    if (status === live.turn.status) return;
    live.turn.status = status;
    this.render();
  }

  /**
   * A streamed piece of the reply. The prose is shown at most once per STREAM_MS, and then only what changed
   * (see flush: a render of the whole reply per update made a long reply quadratic); anything that renders
   * the turn (a card, the end of the turn) flushes it first.
   */
  private delta(d: string): void {
    const live = this.live;
    if (!live) return;
    endThought(live.turn.items);   // the reply begins: the thoughts fold (shown so with the reply's first render)
    live.stream += d;
    this.deltas++;
    if (live.flushTimer) return;
    const wait = Math.max(0, live.lastFlush + STREAM_MS - Date.now());
    live.flushTimer = setTimeout(() => { live.flushTimer = undefined; if (this.live === live) this.flush(); }, wait);
  }

  /**
   * A piece of a reasoning model's thoughts: shown under *Thinking…* in the running turn as they stream
   * (redrawn at most once per STREAM_MS), folded once its reply or a tool call comes.
   */
  private thought(text: string): void {
    const live = this.live;
    if (!live || !text) return;
    addThought(live.turn.items, text);
    if (live.thoughtTimer) return;
    live.thoughtTimer = setTimeout(() => { live.thoughtTimer = undefined; if (this.live === live) this.render(); }, STREAM_MS);
  }

  /**
   * Shows the streamed prose now (pending pieces of the running turn). An update costs what changed, not the
   * reply so far: its Markdown blocks that settled since the last post (rendered once, see StreamMarkdown), which
   * the webview adds to those it has, and the open tail, rendered again, in place of the tail it has. All of it
   * (`reset`) when the webview's prose is not the streamed one: a redraw of the turn (render) or a new page
   * replaced it, or the prose changed other than at its end. One post at a time: the next goes once the page has
   * taken the last, which it acknowledges (`streamTaken`, sent by chat.js once the update is in its DOM; postMessage's
   * promise says only that VS Code accepted the message), with all that came meanwhile, so a busy view gets fewer
   * updates, not a queue of them. A post not delivered, or not acknowledged within STREAM_ACK_MS, counts as taken.
   */
  private flush(): void {
    const live = this.live;
    if (!live) return;
    if (live.flushTimer) { clearTimeout(live.flushTimer); live.flushTimer = undefined; }
    if (live.stream === live.flushed) return;
    const prose = proseOf(live.stream);
    if (live.proseIdx < 0) {
      live.flushed = live.stream;
      live.lastFlush = Date.now();
      if (!prose.trim()) return;
      live.turn.items.push({ kind: 'prose', text: prose });
      live.proseIdx = live.turn.items.length - 1;
      this.streamUpdates++;
      this.render();
      return;
    }
    live.turn.items[live.proseIdx] = { kind: 'prose', text: prose };   // (what a redraw, the end of the turn, shows)
    if (live.posting) { this.streamWaits++; return; }   // (sent once the post under way is taken: see below)
    live.flushed = live.stream;
    live.lastFlush = Date.now();
    this.streamUpdates++;
    const u = live.md.update(prose);
    const view = this.view;
    if (!view) { live.shown = false; return; }
    const reset = u.restarted || !live.shown;
    const seq = live.posting = ++this.streamSeq;
    const msg = { type: 'stream', seq, ...(reset && { reset: true }), html: reset ? live.md.settled : u.added, tail: u.tail };
    live.shown = true;
    this.streamPosts++;
    this.streamChars += msg.html.length + msg.tail.length;
    live.ackTimer = setTimeout(() => { this.streamAckMissed++; this.streamTaken(seq); }, STREAM_ACK_MS);
    Promise.resolve(view.webview.postMessage(msg)).then((delivered) => { if (!delivered) this.streamTaken(seq); }, () => this.streamTaken(seq));
  }

  /**
   * The page took `stream` post `seq` (its acknowledgement), or will not (not delivered, no acknowledgement in
   * time): the update that waited for it, if any, goes (at most once per STREAM_MS, see flush).
   */
  private streamTaken(seq: number): void {
    const live = this.live;
    if (!live || live.posting !== seq) return;   // (a post of an earlier turn or page, or one already counted as taken)
    live.posting = 0;
    if (live.ackTimer) { clearTimeout(live.ackTimer); live.ackTimer = undefined; }
    if (live.stream === live.flushed || live.flushTimer) return;
    live.flushTimer = setTimeout(() => { live.flushTimer = undefined; if (this.live === live) this.flush(); },
      Math.max(0, live.lastFlush + STREAM_MS - Date.now()));
  }

  /** The running turn's next prose is a new item (a tool card came between): streamed from its start. */
  private newProse(live: Live): void {
    live.stream = '';
    live.flushed = '';
    live.proseIdx = -1;
    live.md = new StreamMarkdown();
    live.shown = false;
  }

  /** toolEvent notifications of the running turn become (updated) cards. */
  onToolEvent(e: ToolEvent): void {
    const live = this.live;
    if (!live || !ownsBranchEvent(live, e.branchId)) return;   // (another operate's on this branch: not this turn's)
    this.flush();
    endThought(live.turn.items);
    this.newProse(live);
    let card = live.cards.get(e.callId);
    if (!card) {
      card = cardOfToolEvent(undefined, e);
      live.cards.set(e.callId, card);
      live.turn.items.push({ kind: 'tool', card });
    } else cardOfToolEvent(card, e);
    this.render();
  }

  private async finish(result: OperateResult | undefined, note?: string, error?: string): Promise<void> {
    const live = this.live!;
    this.flush();   // all of the reply shows at once, not after the branch is read back
    const shown = live.turn.items[live.proseIdx];
    this.lastProse = shown?.kind === 'prose' ? shown.text : '';
    let messages: Message[] | undefined;
    const client = this.host.current();
    if (live.branchId && client?.running) {
      let timer: NodeJS.Timeout | undefined;
      try {
        const late = new Promise<never>((_, reject) => { timer = setTimeout(() => reject(new Error('timeout')), FINISH_MS); });
        messages = await Promise.race([allMessages(client, live.branchId), late]);
      } catch { /* keep what was streamed */ } finally { clearTimeout(timer); }
    }
    const t = live.turn;
    t.running = false;
    delete t.status;
    if (live.thoughtTimer) { clearTimeout(live.thoughtTimer); live.thoughtTimer = undefined; }
    clearTimeout(live.ackTimer);   // (the last post's: nothing streams after the turn)
    endThought(t.items);
    const thoughts = thoughtsOf(t.items);
    // the server's repeat stop ended its rounds: the turn says why (also when it is kept here, the branch not read back)
    const repeated = result?.repeated ? repeatNote(result, REPEAT_LIMIT) : undefined;
    if (repeated) t.note = repeated;
    if (note) { t.note = note; t.outcome = 'stopped'; }
    if (error) { t.error = error; t.outcome = 'failed'; }
    for (const it of t.items) {   // calls the turn never saw finish
      if (it.kind !== 'tool' || (it.card.state !== 'running' && it.card.state !== 'ask')) continue;
      delete it.card.ask;
      it.card.state = t.outcome === 'failed' ? 'error' : 'cancelled';
      if (t.outcome === 'failed') it.card.output ??= { error: 'the turn failed before this call finished' };
    }
    const u = usageFromResult(result?.usage, result?.rounds);
    if (u) t.usage = u;
    // the turn is kept with its own chat, the one shown: while a turn runs the chat stays bound to it (see refresh;
    // newBranch and leaveDeleted move the turn with it), whichever chat the user picked meanwhile
    if (messages) { this.reads++; this.loaded(messages); }   // (the earlier turns with what was kept of them; this one's is placed below; a read begun before holds less)
    // its own turn on the branch: where it began, after any other operate's the branch recorded first (see ownTurn)
    const own = live.sent && messages ? ownTurn(this.serverTurns, live.at, t.user, result && proseOfResult(result.result as Json)) : undefined;
    const recorded = !live.sent ? false : messages ? !!own : undefined;
    const at = own?.start ?? live.at;
    if (own) {   // the server's record of this turn, with what only the client knows (usage, rounds, thoughts)
      if (u) own.usage = u;
      else if (own.usage && result?.rounds) own.usage.rounds = result.rounds;
      if (thoughts.length || repeated) {
        keepThoughts(own, thoughts);
        if (repeated) own.note = repeated;
        void this.host.branches.keepTurn(live.branchId, at, { thoughts, ...(repeated && { note: repeated }) });
      }
    }
    // kept here unless the server's record of it is complete (a turn that ended well, read back)
    if (t.outcome || !own) {
      if (t.outcome) t.id = `${Date.now().toString(36)}-${Math.random().toString(36).slice(2, 8)}`;   // for Retry
      this.locals.push({ turn: t, at, recorded, ...(live.context && { context: live.context }),
        ...(live.responseFormat && { responseFormat: live.responseFormat }) });
      this.saveLocals();
    }
    this.turns = withLocalTurns(this.serverTurns, this.locals);
    this.live = undefined;
    this.answerStopped();   // (requests the server did not withdraw: the turn is over)
    // requests still waiting for a decision (the server died under the turn): nothing can decide them any more
    for (const id of [...this.pendingAsks.keys()]) this.withdrawAsk(id, 'the turn failed before this call was decided');
    live.source.dispose();
    this.host.runningChanged(false);
    setContext(RUNNING_KEY, false);
    this.render();
    // the user went to another chat while the turn ran: show that one now
    if ((this.host.branches.current ?? '') !== this.localBranch) void this.refresh();
  }

  /** A new server process answered initialize: forget what the previous one did not support. */
  serverStarted(): void { this.supportsMaxRounds = true; this.supportsRepeatLimit = true; }

  /** Stops the running turn; `why`: its note when the extension stops it (a restart), not the user. */
  stop(why?: string): boolean {
    if (!this.live) return false;
    if (why && !this.live.source.token.isCancellationRequested) this.live.stopNote = `Stopped: ${why}.`;
    // a second Stop (or Stop then Restart) cancels nothing more
    if (!this.live.source.token.isCancellationRequested) this.live.source.cancel();
    // the calls waiting for a decision show the stop now, but their requests get no answer yet: the server withdraws
    // them as it stops the operate (as with the Neovim plugin). A denial sent now could reach it before the cancel, and
    // the turn would go on, the call rejected, instead of stopping.
    for (const id of [...this.pendingAsks.keys()]) this.settleAsk(id, 'deny_once', 'the turn was stopped', false);
    return true;
  }

  /** Answers the requests of a stopped turn's calls (`callId`: that one's): the server withdrew it, or the turn ended. */
  private answerStopped(callId?: string): void {
    for (const [id, answer] of [...this.unanswered]) {
      if (callId !== undefined && id !== callId) continue;
      this.unanswered.delete(id);
      answer();
    }
  }

  // ---- permission requests of chat turns --------------------------------------------------------
  /** Whether this permission request belongs to the running chat turn. */
  owns(req: PermissionRequest): boolean { return ownsBranchEvent(this.live, req.branchId); }

  /** Shows the request as a card (and the diff editor when it has a preview); resolves with the decision. */
  async ask(req: PermissionRequest, token: vscode.CancellationToken): Promise<PermissionDecision> {
    const live = this.live!;
    const preview = await previewOf(req);
    let card = live.cards.get(req.callId);
    if (!card) {
      card = { callId: req.callId, tool: req.tool, args: req.arguments as Json, state: 'ask' };
      live.cards.set(req.callId, card);
      this.flush();
      this.newProse(live);
      live.turn.items.push({ kind: 'tool', card });
    } else {   // the request has the arguments whole (a toolEvent's summary may be cut)
      card.args = req.arguments as Json;
      delete card.argsCut;
    }
    card.state = 'ask';
    card.ask = { diff: !!preview, ...(preview && { path: preview.path }) };
    this.render();
    let failed: Error | undefined;
    const decision = await new Promise<PermissionDecision>((resolve) => {
      this.pendingAsks.set(req.callId, { resolve, card: card!, options: req.options });
      this.showWaiting();
      // the server withdrew the request: its operate was stopped, or nobody answered in time; or the server exited
      // (the client cancels its requests' tokens then): nothing can be decided any more, the call failed with its turn
      token.onCancellationRequested(() => {
        this.answerStopped(req.callId);
        if (!this.host.current()) this.withdrawAsk(req.callId, 'the server exited while this call waited for your decision');
        else this.settleAsk(req.callId, 'deny_once', live.source.token.isCancellationRequested ? 'the turn was stopped' : 'permission request timed out');
      });
      if (preview) {
        // a review that could not be shown: the card says denied, the request is answered with the error (a denial)
        this.host.review.review(req, preview, token).then((d) => this.settleAsk(req.callId, d), (e) => {
          failed = e instanceof Error ? e : new Error(String(e));
          this.settleAsk(req.callId, 'deny_once', `permission request failed: ${failed.message}`);
        });
      }
    });
    if (failed) throw failed;
    this.host.line(`\n[permission] ${req.tool} ${JSON.stringify(req.arguments).slice(0, 200)} -> ${decision} [${req.callId}] (chat)`);
    return decision;
  }

  /**
   * A decision from the card's buttons (or a command with a callId). One the request did not offer (docs/PROTOCOL.md §4: the
   * answer is one of its options) is not sent: logged, and the request waits on for a decision it offered.
   */
  decide(callId: string, decision: PermissionDecision): boolean {
    const p = this.pendingAsks.get(callId);
    if (p && !offeredDecision(p.options, decision)) {
      this.host.line(`[chat] ignored the decision ${JSON.stringify(decision)} for ${callId}: not one of the request's options (${p.options.join(', ')})`);
      return false;
    }
    if (this.host.review.has(callId)) return this.host.review.decide(callId, decision);   // settles the ask through onDidDecide
    return this.settleAsk(callId, decision);
  }

  /** `answer` false: the card shows the decision, the request is answered later (see stop). */
  private settleAsk(callId: string, decision: PermissionDecision, withdrawn?: string, answer = true): boolean {
    const p = this.pendingAsks.get(callId);
    if (!p) return false;
    this.pendingAsks.delete(callId);
    this.showWaiting();
    if (this.host.review.has(callId)) this.host.review.decide(callId, decision, true);
    delete p.card.ask;
    p.card.state = decision.startsWith('allow') ? 'running' : 'denied';
    if (p.card.state === 'denied') p.card.output = { error: 'denied by governance gate', reason: withdrawn ?? 'denied by the user' };
    this.render();
    if (answer) p.resolve(decision);
    else this.unanswered.set(callId, () => p.resolve(decision));
    return true;
  }

  /**
   * Takes back the request of `callId` that can no longer be decided (its server exited, or its turn ended without
   * it): the card says `error` (unless the turn's end marked it already), its review closes, nothing is recorded; the
   * request is answered deny_once, an answer nobody reads.
   */
  private withdrawAsk(callId: string, error: string): void {
    const p = this.pendingAsks.get(callId);
    if (!p) return;
    this.pendingAsks.delete(callId);
    this.showWaiting();
    if (this.host.review.has(callId)) this.host.review.decide(callId, 'deny_once', true);
    delete p.card.ask;
    if (p.card.state === 'ask' || p.card.state === 'running') {
      p.card.state = 'error';
      p.card.output ??= { error };
    }
    this.render();
    p.resolve('deny_once');
  }

  dispose(): void {
    this.stop();
    this.answerStopped();
    for (const s of this.subs) s.dispose();
  }
}
