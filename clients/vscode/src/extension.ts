// VS Code front end for operate-sidecar: the server's lifecycle, the commands (each callable with
// arguments), the status bar and the wiring of the chat view, the diff review and the branch store.
// All protocol work lives in rpcClient.ts.
import * as fs from 'node:fs';
import * as vscode from 'vscode';
import { BranchStore } from './branchStore';
import { permissionAnswerSetting, permissionProblem, serverGone, toolSummary } from './chatModel';
import { ChatView, TurnOutcome, VIEW_ID } from './chatView';
import { EditorTracker, selectionOf } from './context';
import { clientFs, DiffReview, fault, faults, previewOf, PROPOSED_SCHEME, ReviewRecord } from './diffReview';
import {
  CancellationToken, CancellationTokenSource, ErrorCodes, InitializeResult, Json, JsonObject, OperateParams, OperateResult,
  PermissionDecision, PermissionRequest, PolicyDecision, ResponseError, SidecarClient,
  SidecarExitedError, SidecarTimeoutError, ToolEvent,
} from './rpcClient';

const CHANNEL = 'operate-sidecar';
const STDERR_TAIL_LINES = 12;
/** ... and at most this many characters of them (one line can be long: a dumped request, a blob). */
const STDERR_TAIL_CHARS = 2000;
/** Where the client's error of a process that ended (or hung at start) begins to quote its stderr. */
const STDERR_QUOTED = '; its stderr ends with:\n';
/** How much of the output channel's text the extension keeps for `outputText()` (its end). */
const OUTPUT_KEPT = 200_000;
/** Settings whose change restarts the server. */
const SERVER_SETTINGS = ['command', 'settings', 'stateDir', 'env', 'toolPolicy'].map((k) => `operateSidecar.${k}`);
/** Defaults (and bounds) of the numeric settings, as in package.json. */
const MAX_ROUNDS = { dflt: 4, min: 1, max: 50 };
const STARTUP_TIMEOUT_S = { dflt: 30, min: 1, max: 600 };
/** Context key: an operate or a chat turn runs (package.json: when Cancel shows in the command palette). */
const BUSY_KEY = 'operateSidecar.busy';

/**
 * The last lines of one server process's stderr (`stderr`: the end of it its client kept), as a notice quotes them:
 * at most STDERR_TAIL_LINES lines and STDERR_TAIL_CHARS characters, the end kept ('…' where the text is cut).
 */
export function lastStderrLines(stderr: string): string {
  const lines = stderr.replace(/\r\n?/g, '\n').trimEnd().split('\n').slice(-STDERR_TAIL_LINES);
  while (lines.length && !lines[0].trim()) lines.shift();
  const tail = lines.join('\n');
  if (tail.length <= STDERR_TAIL_CHARS) return tail;
  const cut = tail.slice(-(STDERR_TAIL_CHARS - 1));
  return '…' + (/^[\udc00-\udfff]/.test(cut) ? cut.slice(1) : cut);   // (not half of a surrogate pair)
}

/** Cancels a token source once: a second `cancel()` of a source whose token was never read throws in vscode-jsonrpc. */
export function cancelOnce(source: CancellationTokenSource): void {
  if (!source.token.isCancellationRequested) source.cancel();
}

/**
 * Why the server program could not be started, in words (not Node's `spawn x ENOENT`): a program
 * that is not there or not executable names the setting to fix.
 */
function spawnProblem(command: string[], e: unknown): string {
  const msg = (e instanceof Error ? e.message : String(e)).replace(/^operate-sidecar: /, '');
  const fix = `Install operate-sidecar or set operateSidecar.command to the server's full path (it is ${JSON.stringify(command)}).`;
  if (/\bENOENT\b/.test(msg)) return `cannot start the server: the program "${command[0]}" was not found${command[0].includes('/') ? '' : ' on the PATH'}. ${fix}`;
  if (/\bEACCES\b/.test(msg)) return `cannot start the server: the program "${command[0]}" is not executable (permission denied). ${fix}`;
  return msg;
}

/** The error of a start that `stop()` (a restart, Stop, deactivation) abandoned. */
class StartAborted extends Error {
  constructor() { super('the server start was stopped'); }
}

/** Errors the extension has already shown the user (an error notification): `runCommand` does not show them again. */
const shownErrors = new WeakSet<object>();
/** Marks `e` as shown to the user; returns it (to be thrown on). */
function markShown<T>(e: T): T {
  if (typeof e === 'object' && e !== null) shownErrors.add(e);
  return e;
}

/** Arguments of `operateSidecar.operate` (a plain string is the instruction). */
export interface OperateCommandArgs extends Partial<OperateParams> {
  /** Answer permission requests of this operate with this decision instead of asking. */
  permissionAnswer?: PermissionDecision;
  /** Open the result as an untitled JSON document (default false). */
  showResult?: boolean;
}

/** What `activate` returns (used by the integration tests and by other extensions). */
export interface OperateSidecarApi {
  /** The end of what was written to the "operate-sidecar" output channel: its last 200 000 characters. */
  outputText(): string;
  /** How many characters were written to that channel in all: a mark, the text after it ends `outputText()`. */
  outputLength(): number;
  client(): SidecarClient | undefined;
  currentBranch(): string | undefined;
  initializeResult(): InitializeResult | undefined;
  /** The chat view's counters (prose stream updates, turns, open permission cards). */
  chatStats(): { streamUpdates: number; deltas: number; lastProse: string; turns: number; pendingAsks: string[]; running: boolean; loads: number;
    /** how often the chat view's page reported ready (built, or built again after the chat was hidden) */
    viewReady: number;
    /** whether the chat view is shown (its page exists only while it is: it is built again when shown) */
    visible: boolean;
    /** the chat view's badge (calls waiting for a decision); `state` messages posted to the webview and their HTML's characters */
    badge: number; posts: number; postedChars: number;
    /** what Attach File and Add the Selection put into the chat input, in order */
    attached: string[];
    /** the running turn's tool cards */
    cards: { tool: string; state: string; title: string; args: Json; argsCut: boolean }[] };
  /** The turns the chat shows, oldest first: the instruction, a failed or stopped turn's mark, card titles. */
  chatTurns(): { user: string; outcome?: string; note?: string; error?: string; cards: string[] }[];
  /** Decided diff reviews, oldest first. */
  reviews(): ReviewRecord[];
  /** The status bar item's text. */
  statusText(): string;
  /** The status bar item: its text, tooltip, the command a click runs and its background colour's id ('' = none). */
  statusItem(): { text: string; tooltip: string; command: string; background: string };
  /** Error notifications shown by the extension (message and offered actions), oldest first. */
  notices(): { message: string; actions: string[] }[];
  /**
   * Test seam, for the integration tests only: step -> message; the step throws an Error with that
   * message the next time it runs, once (`vscode.diff`: a review's diff editor, once opened; a server
   * request's method: the extension's handler of it). Empty, so without effect, unless a test sets it.
   */
  faults: Map<string, string>;
}

class Sidecar {
  private client: SidecarClient | undefined;
  private starting: Promise<SidecarClient> | undefined;
  private initResult: InitializeResult | undefined;
  private readonly running = new Set<CancellationTokenSource>();
  /** branchId -> pre-answered decision, for operates started with `permissionAnswer`. */
  private readonly preAnswers = new Map<string, PermissionDecision>();
  /** The end of the output channel's text (OUTPUT_KEPT characters) and how much was written in all. */
  private transcript = '';
  private written = 0;
  /** Why the server is not running after it failed to start or died (the status bar says so); undefined otherwise. */
  private down: string | undefined;
  /** The server process started last: its stderr is quoted when a request fails for want of a server. */
  private lastServer: SidecarClient | undefined;
  private stopping = false;
  /** Abandons the start in progress (kills its process); set while one runs. */
  private abortStart: (() => void) | undefined;
  /** Setting problems already reported (each bad value once, not at every use). */
  private readonly reportedSettings = new Set<string>();
  readonly noticeLog: { message: string; actions: string[] }[] = [];
  readonly channel: vscode.OutputChannel;
  readonly serverChannel: vscode.OutputChannel;
  readonly branches: BranchStore;
  readonly editors: EditorTracker;
  readonly review: DiffReview;
  readonly chat: ChatView;
  readonly status: vscode.StatusBarItem;

  constructor(private readonly ctx: vscode.ExtensionContext) {
    this.channel = vscode.window.createOutputChannel(CHANNEL);
    this.serverChannel = vscode.window.createOutputChannel(`${CHANNEL} (server stderr)`);
    this.branches = new BranchStore(ctx.workspaceState);
    this.editors = new EditorTracker(PROPOSED_SCHEME);
    this.review = new DiffReview();
    this.chat = new ChatView(ctx, {
      ensure: () => this.ensure(),
      current: () => (this.client?.running ? this.client : undefined),
      branches: this.branches,
      editors: this.editors,
      review: this.review,
      maxRounds: () => this.intSetting('maxRounds', MAX_ROUNDS),
      runningChanged: () => this.updateStatus(),
      line: (t) => this.line(t),
      serverProblem: (e) => this.serverProblem(e),
    });
    this.status = vscode.window.createStatusBarItem(vscode.StatusBarAlignment.Left, 50);
    this.updateStatus();
    this.status.show();
    ctx.subscriptions.push(this.channel, this.serverChannel, this.editors, this.review, this.chat, this.status,
      this.branches.onDidChangeCurrent(() => { this.updateStatus(); if (!this.chat.running) void this.chat.refresh(); }));
  }

  // ---- output ----------------------------------------------------------------------------------
  append(text: string): void {
    this.transcript = (this.transcript + text).slice(-OUTPUT_KEPT);
    this.written += text.length;
    this.channel.append(text);
  }
  line(text: string): void { this.append(text + '\n'); }
  outputText(): string { return this.transcript; }
  outputLength(): number { return this.written; }
  currentBranch(): string | undefined { return this.branches.current; }
  initializeResult(): InitializeResult | undefined { return this.initResult; }
  currentClient(): SidecarClient | undefined { return this.client; }

  updateStatus(): void {
    const busy = this.chat?.running || this.running.size > 0;
    void vscode.commands.executeCommand('setContext', BUSY_KEY, busy);   // Cancel in the command palette
    // a server is starting (abortStart is set from its spawn until it answered initialize), also after one died
    const starting = this.abortStart !== undefined;
    const down = !starting && this.down !== undefined;
    // the server failed to start or died: the item says so, its tooltip why, and a click restarts it
    this.setStatusBackground(down ? 'statusBarItem.errorBackground' : '');
    this.status.command = down ? 'operateSidecar.restart' : `${VIEW_ID}.focus`;
    if (starting) {
      this.status.text = '$(sync~spin) operate-sidecar: starting…';
      this.status.tooltip = 'operate-sidecar: the server is starting (click to open the chat)';
      return;
    }
    if (down) {
      this.status.text = '$(error) operate-sidecar: stopped';
      this.status.tooltip = `operate-sidecar: the server is not running: ${this.down}\nClick to restart it.`;
      return;
    }
    // the chat shown: a running turn's, also when another was picked meanwhile (shown once the turn ends)
    const id = this.chat?.runningBranch() || this.branches.current;
    const branch = (id && (this.branches.nameOf(id) ?? id.slice(0, 8))) || 'new chat';
    const model = this.branches.model ?? 'default model';
    // a chat turn's tool call waits for the user: said (and coloured) until it is decided, also with the chat hidden
    const waiting = this.chat?.waiting ?? 0;
    this.setStatusBackground(waiting ? 'statusBarItem.warningBackground' : '');
    const state = waiting ? ' · $(bell-dot) waiting for you' : busy ? ' · $(loading~spin) running' : '';
    this.status.text = `$(comment-discussion) ${model} · ${branch}${state}`;
    this.status.tooltip = waiting
      ? `operate-sidecar: ${waiting === 1 ? 'a tool call waits' : `${waiting} tool calls wait`} for your decision (Accept or Reject in the chat; click to open it)`
      : 'operate-sidecar: model · chat · state (click to open the chat)';
  }

  /** The status bar item's background colour ('' = none), kept by its id for statusItem(). */
  statusBackground = '';
  private setStatusBackground(id: string): void {
    this.statusBackground = id;
    this.status.backgroundColor = id ? new vscode.ThemeColor(id) : undefined;
  }

  /** Shows an error with actions; records it for the tests. */
  notify(message: string, actions: string[] = []): void {
    this.noticeLog.push({ message, actions });
    void vscode.window.showErrorMessage(message, ...actions).then((a) => {
      if (a === 'Show server log') this.serverChannel.show(true);
      if (a === 'Open settings') void vscode.commands.executeCommand('workbench.action.openSettings', 'operateSidecar');
    });
  }

  /**
   * A whole-number setting within its bounds; any other value (2.5, "3", 0) is reported once, naming the
   * setting, and the default is used instead (settings.json is not checked against package.json's schema).
   */
  intSetting(key: string, b: { dflt: number; min: number; max: number }): number {
    const v = vscode.workspace.getConfiguration('operateSidecar').get<unknown>(key, b.dflt);
    if (typeof v === 'number' && Number.isInteger(v) && v >= b.min && v <= b.max) return v;
    const report = `${key}=${JSON.stringify(v)}`;
    if (!this.reportedSettings.has(report)) {
      this.reportedSettings.add(report);
      this.line(`[settings] operateSidecar.${key} ${JSON.stringify(v)} is invalid; using ${b.dflt}`);
      this.notify(`operate-sidecar: operateSidecar.${key} must be a whole number from ${b.min} to ${b.max} (it is ${JSON.stringify(v)}); using ${b.dflt}.`,
        ['Open settings']);
    }
    return b.dflt;
  }

  /** The server command (argv) from the settings; a thrown Error names the setting. */
  private command(cfg: vscode.WorkspaceConfiguration): string[] {
    const c = cfg.get<unknown>('command', ['operate-sidecar']);
    if (!Array.isArray(c) || !c.length || !c.every((a) => typeof a === 'string')) {
      throw new Error(`operateSidecar.command must be an array of strings (the program and its arguments), e.g. ["operate-sidecar"]; it is ${JSON.stringify(c)}`);
    }
    return c;
  }

  /** Whether a start is in progress. */
  get isStarting(): boolean { return !!this.starting; }

  /**
   * The last lines of `client`'s own stderr (its process's, kept by its client: never an earlier or a later
   * server's), bounded (lastStderrLines).
   */
  private tailLines(client: SidecarClient | undefined): string {
    return client ? lastStderrLines(client.stderrTail) : '';
  }

  /**
   * A message for the user when the server cannot serve (start failure, death): the last stderr lines. Those of the
   * process the error names (a SidecarExitedError or SidecarTimeoutError carries its own stderr's end, which its
   * message quotes whole, from long before the end: the message is taken without it), else the last server's.
   */
  serverProblem(e: unknown): string | undefined {
    // (a connection lost or an exit; an error answer of a running server is its own message, whatever its words)
    if (!serverGone(e, !!this.client?.running)) return undefined;
    const own = e instanceof SidecarExitedError || e instanceof SidecarTimeoutError ? e : undefined;
    const tail = own ? lastStderrLines(own.stderrTail) : this.tailLines(this.lastServer);
    const why = own ? own.message.split(STDERR_QUOTED)[0] : e instanceof Error ? e.message : String(e);
    // the client's error of a server that died already quotes the end of its stderr: not twice
    const last = tail.split('\n').at(-1)?.trim();
    const quoted = !!last && why.includes(last);
    return `The operate-sidecar server is not running (${why}).${tail && !quoted ? `\nLast lines of its log:\n${tail}` : ''}`;
  }

  // ---- server lifecycle ------------------------------------------------------------------------
  ensure(): Promise<SidecarClient> {
    if (this.client?.running) return Promise.resolve(this.client);
    if (!this.starting) {
      this.starting = this.start().catch((e) => {
        if (!(e instanceof StartAborted)) this.serverDown(e instanceof Error ? e.message : String(e));
        throw e;
      }).finally(() => { this.starting = undefined; this.updateStatus(); });   // (no longer starting, whatever the end)
    }
    return this.starting;
  }

  /** The server failed to start or died (`why`): the status bar says so until a server runs again. */
  private serverDown(why: string): void {
    this.down = why;
    this.updateStatus();
  }

  private stateDir(cfg: vscode.WorkspaceConfiguration, settings: JsonObject): Json {
    if ('stateDir' in settings) return settings.stateDir;
    const s = cfg.get<string | null>('stateDir', '');
    if (s === null) return null;
    if (s) return s;
    const dir = this.ctx.globalStorageUri.fsPath;
    fs.mkdirSync(dir, { recursive: true });
    return dir;
  }

  private async start(): Promise<SidecarClient> {
    const cfg = vscode.workspace.getConfiguration('operateSidecar');
    let command: string[];
    try {
      command = this.command(cfg);
    } catch (e) {
      const msg = (e as Error).message;
      this.line(`[server] ${msg}`);
      const err = new Error(`cannot start the server: ${msg}`);
      if (!this.reportedSettings.has(msg)) {   // once per bad value: every start attempt fails the same way
        this.reportedSettings.add(msg);
        this.notify(`operate-sidecar: ${msg}`, ['Open settings']);
        markShown(err);
      }
      throw err;
    }
    const timeoutS = this.intSetting('startupTimeoutSeconds', STARTUP_TIMEOUT_S);
    const settings: JsonObject = { ...(cfg.get<JsonObject>('settings') ?? {}) };
    settings.stateDir = this.stateDir(cfg, settings);
    const policy = cfg.get<Record<string, PolicyDecision>>('toolPolicy') ?? {};
    if (Object.keys(policy).length) settings.toolPolicy = { ...((settings.toolPolicy as JsonObject | undefined) ?? {}), ...policy };
    const folders = (vscode.workspace.workspaceFolders ?? []).filter((f) => f.uri.scheme === 'file').map((f) => f.uri.fsPath);
    const env = { ...process.env, ...(cfg.get<Record<string, string>>('env') ?? {}) };
    this.line(`[server] starting ${JSON.stringify(command)}`);
    // stop() abandons this start through abortStart: the process is killed, the start rejects
    let aborted = false;
    const abort = new Promise<never>((_, reject) => {
      this.abortStart = () => { aborted = true; reject(new StartAborted()); };
    });
    abort.catch(() => undefined);
    this.updateStatus();   // starting
    let client: SidecarClient;
    try {
      client = await SidecarClient.start({
        command, cwd: folders[0], env, onStderr: (t) => this.serverChannel.append(t),
      });
    } catch (e) {
      this.abortStart = undefined;
      const why = spawnProblem(command, e);
      this.notify(`operate-sidecar: ${why}`, ['Open settings']);
      throw markShown(new Error(why));
    }
    this.lastServer = client;
    if (aborted) { this.abortStart = undefined; client.kill(); throw new StartAborted(); }
    client.onToolEvent((e) => this.onToolEvent(e));
    client.onLogMessage((m) => {
      this.line(`[${['', 'error', 'warning', 'info', 'log'][m.type] ?? 'log'}] ${m.message}`);
      // warnings the user should see: not awaited, so never blocks a headless run
      if (m.type === 1) void vscode.window.showErrorMessage(`operate-sidecar: ${m.message}`);
      if (m.type === 2) void vscode.window.showWarningMessage(`operate-sidecar: ${m.message}`);
    });
    client.setPermissionHandler((req, token) => {
      const problem = permissionProblem(req);
      if (problem) {   // (nothing to put to the user: denied, said in the output channel)
        this.line(`\n[permission] a request this client cannot read (${problem}), denied: ${JSON.stringify(req).slice(0, 300)}`);
        return Promise.resolve<PermissionDecision>('deny_once');
      }
      return this.serve('requestToolPermission', token, () => this.askPermission(req, token),
        `the permission request of ${req.tool} could not be shown, so it was denied`);
    });
    client.setFsHandlers({
      readTextFile: (p, token) => this.serve('fs/readTextFile', token, () => clientFs.readTextFile(p)),
      writeTextFile: (p, token) => this.serve('fs/writeTextFile', token, () => clientFs.writeTextFile(p)),
    });
    let initialized = false;
    void client.exited.then(async (code) => {
      this.line(`[server] exited (${code})`);
      if (this.client === client) this.client = undefined;
      this.updateStatus();
      if (!this.stopping && initialized) {
        await new Promise((r) => setTimeout(r, 100));   // let the last stderr lines arrive
        const tail = this.tailLines(client);   // (its own: a server started since has its own stderr)
        if (!this.client) this.serverDown(`it exited (${code})${tail ? '\n' + tail : ''}`);
        // the one message of this death: what failed with it shows none of its own (reportedByExit)
        this.notify(`operate-sidecar: the server stopped (exit ${code}).${tail ? '\n' + tail : ''}`,
          ['Show server log', 'Open settings']);
      }
    });
    try {
      this.initResult = await Promise.race([abort, client.initialize({
        clientInfo: { name: 'vscode', version: vscode.version },
        processId: process.pid,
        capabilities: { toolPermission: true, clientTools: false, fs: true, thoughts: true },
        workspaceFolders: folders,
        settings,
      }, { timeoutMs: timeoutS * 1000 })]);
    } catch (e) {
      this.line(`[server] initialize failed: ${e instanceof Error ? e.message.split('\n')[0] : String(e)}`);
      client.kill();
      await Promise.race([client.exited, new Promise((r) => setTimeout(r, 1000))]);
      if (aborted || e instanceof StartAborted) throw new StartAborted();   // stopped on purpose: no error notice
      const tail = this.tailLines(client);
      const why = e instanceof ResponseError ? `${e.message} (${e.code})`
        : e instanceof SidecarTimeoutError
          ? `it did not answer initialize within ${timeoutS} s (operateSidecar.startupTimeoutSeconds). Is operateSidecar.command the operate-sidecar server?`
            + (e.stdoutHead ? ` It printed something that is not JSON-RPC: ${JSON.stringify(e.stdoutHead.trim().slice(0, 120))}` : '')
          // how it ended (before answering initialize, or right after): its exit code or signal; its stderr follows
          : e instanceof SidecarExitedError ? `the server exited during start (${e.signal ? `signal ${e.signal}` : `exit code ${e.exitCode}`})`
          : 'the server exited during start';
      this.notify(`operate-sidecar: could not start the server: ${why}${tail ? '\n' + tail : ''}`, ['Show server log', 'Open settings']);
      throw markShown(new Error(`cannot start the server: ${why}${tail ? '\n' + tail : ''}`));
    } finally {
      this.abortStart = undefined;
    }
    initialized = true;
    this.client = client;
    this.down = undefined;
    this.updateStatus();   // initialize answered: no longer starting (again below: the model or the branch may change)
    this.chat.serverStarted();   // a new server: what the previous one refused may work now
    const caps = this.initResult.capabilities;
    this.line(`[server] ${this.initResult.serverInfo.name} ${this.initResult.serverInfo.version}; models: ${caps.models.join(', ')}; stateDir: ${caps.stateDir}`);
    // the model picked for the chat is no longer configured (the settings changed): back to the default, said once
    const picked = this.branches.model;
    if (picked && !caps.models.includes(picked)) {
      await this.branches.setModel(undefined);
      const now = typeof settings.defaultModel === 'string' ? `the default model "${settings.defaultModel}"` : 'the server\'s default model';
      this.line(`[model] ${picked} is no longer configured; using the default`);
      void vscode.window.showInformationMessage(`operate-sidecar: the model "${picked}" picked for the chat is no longer in operateSidecar.settings; `
        + `chat turns now use ${now} (a chat made with its own model: that one). The model picker offers the others.`);
    }
    await this.branches.validate(client).catch(() => undefined);
    this.updateStatus();
    if (!this.chat.running) void this.chat.refresh();   // the chat resumes from the (journaled) branch
    return client;
  }

  /** Stops the server; `why` (a restart for changed settings) is the note of a chat turn it stops. */
  async stop(why?: string): Promise<void> {
    this.stopping = true;
    try {
      for (const s of this.running) cancelOnce(s);
      this.chat.stop(why);
      // a start still finishing (e.g. a restart right after a restart) is abandoned (its process
      // killed) and settles first, so that the next ensure() starts a new process instead of reusing
      // the promise of the stopped one; bounded, whatever the server does
      this.abortStart?.();
      if (this.starting) await Promise.race([this.starting.catch(() => undefined), new Promise((r) => setTimeout(r, 5000))]);
      const c = this.client;
      this.client = undefined;
      // bounded: once the process is gone there is nothing left to wait for
      if (c) await Promise.race([c.stop(), c.exited, new Promise((r) => setTimeout(r, 8000))]);
    } finally {
      this.stopping = false;
    }
  }

  // ---- server → client -------------------------------------------------------------------------
  private onToolEvent(e: ToolEvent): void {
    // the summaries as the server sent them (JSON text); one it cut ends in …
    const text = (t: string | undefined) => (t ?? '') + (t && toolSummary(t).cut ? '…' : '');
    const extra = e.event === 'post' ? ` -> ${text(e.resultSummary)}` : e.error ? ` !! ${e.error}` : '';
    const ms = e.durationMs !== undefined ? ` (${Math.round(e.durationMs)} ms)` : '';
    this.line(`\n[tool ${e.event}] ${e.tool} ${text(e.argsSummary)}${extra}${ms} [${e.callId}]`);
    this.chat.onToolEvent(e);
  }

  /**
   * Answers the server's request `method` with `handler`. A handler that fails (it throws; not an
   * error answer it chose, a ResponseError, nor after the server withdrew the request) is logged and
   * told the user once: `what` (else that the editor could not answer the request) and the error; the
   * server gets the error as the answer (for requestToolPermission: a denial).
   */
  private async serve<T>(method: string, token: CancellationToken, handler: () => Promise<T>, what?: string): Promise<T> {
    try {
      fault(method);
      return await handler();
    } catch (e) {
      if (!(e instanceof ResponseError) && !token.isCancellationRequested) {
        const why = e instanceof Error ? e.message : String(e);
        this.line(`\n[${method}] failed: ${why}`);
        this.notify(`operate-sidecar: ${what ?? `the editor could not answer the server's ${method} request (it was answered with an error)`}: ${why}`);
      }
      throw e;
    }
  }

  /**
   * The `operateSidecar.permissionAnswer` setting: a decision, or undefined (ask). Any other value is reported once,
   * naming the setting and its values, and treated as unset (the chat's card and the diff review ask), as intSetting does.
   */
  private permissionAnswer(): PermissionDecision | undefined {
    const v = vscode.workspace.getConfiguration('operateSidecar').get<unknown>('permissionAnswer');
    const { answer, problem } = permissionAnswerSetting(v);
    const report = `permissionAnswer=${JSON.stringify(v)}`;
    if (problem && !this.reportedSettings.has(report)) {
      this.reportedSettings.add(report);
      this.line(`[settings] operateSidecar.permissionAnswer ${JSON.stringify(v)} is invalid; asking instead`);
      this.notify(`operate-sidecar: ${problem}`, ['Open settings']);
    }
    return answer;
  }

  private async askPermission(req: PermissionRequest, token: vscode.CancellationToken): Promise<PermissionDecision> {
    const pre = this.preAnswers.get(req.branchId) || this.permissionAnswer();
    if (!pre && this.chat.owns(req)) return this.chat.ask(req, token);
    let decision: PermissionDecision;
    const preview = pre ? undefined : await previewOf(req);
    if (pre) {
      decision = pre;
    } else if (preview) {
      decision = await this.review.review(req, preview, token);
    } else {
      const labels: Record<PermissionDecision, string> = {
        allow_once: 'Allow once', allow_always: 'Always allow (this branch)',
        deny_once: 'Deny once', deny_always: 'Always deny (this branch)',
      };
      const pick = await vscode.window.showQuickPick(
        req.options.map((o) => ({ label: labels[o] ?? o, description: o, decision: o })),
        { title: `operate-sidecar: allow tool "${req.tool}"?`, placeHolder: JSON.stringify(req.arguments).slice(0, 200), ignoreFocusOut: true },
        token);
      decision = pick?.decision ?? 'deny_once';
    }
    this.line(`\n[permission] ${req.tool} ${JSON.stringify(req.arguments).slice(0, 200)} -> ${decision} [${req.callId}]`);
    return decision;
  }

  // ---- commands --------------------------------------------------------------------------------
  private async branch(client: SidecarClient, given?: string): Promise<string> {
    if (given) return given;
    let id = this.branches.current;
    if (!id) {
      id = (await client.createBranch({})).branchId;
      await this.branches.setCurrent(id);
    }
    return id;
  }

  async operate(arg?: string | OperateCommandArgs): Promise<OperateResult | undefined> {
    const args: OperateCommandArgs = typeof arg === 'string' ? { instruction: arg } : { ...(arg ?? {}) };
    const { permissionAnswer, showResult = false, ...rest } = args;
    if (rest.instruction === undefined && rest.instruct === undefined) {
      const text = await vscode.window.showInputBox({ prompt: 'operate-sidecar: instruction', ignoreFocusOut: true });
      if (!text) return undefined;
      rest.instruction = text;
    }
    if (rest.context === undefined && rest.instruct === undefined) {
      const sel = selectionOf(this.editors.editor);
      if (sel) rest.context = sel.text;
    }
    const client = await this.ensure();
    const branchId = await this.branch(client, rest.branchId);
    const params: OperateParams = { ...rest, branchId };
    if (permissionAnswer) this.preAnswers.set(branchId, permissionAnswer);
    const source = new CancellationTokenSource();
    this.running.add(source);
    this.updateStatus();
    this.line(`\n=== operate [${branchId}] ${JSON.stringify(params.instruction ?? params.instruct).slice(0, 200)}`);
    try {
      const out = await vscode.window.withProgress(
        { location: vscode.ProgressLocation.Notification, title: 'operate-sidecar', cancellable: true },
        async (progress, token) => {
          const sub = token.onCancellationRequested(() => cancelOnce(source));
          try {
            return await client.operate(params, {
              token: source.token,
              onProgress: (v) => {
                if (v.kind === 'report' && v.delta !== undefined) this.append(v.delta);
                if (v.kind === 'begin') this.line(`[progress] begin ${v.message}`);
                if (v.kind === 'end') this.line(`\n[progress] end ${v.message}`);
                progress.report({ message: v.kind === 'report' ? `${v.phase}: ${v.message}` : v.message });
              },
            });
          } finally { sub.dispose(); }
        });
      this.line(`=== result (${out.kind}${out.model ? ' ' + out.model : ''})`);
      if (showResult) await this.showJson(out);
      return out;
    } catch (e) {
      const msg = e instanceof ResponseError ? `${e.message} (${e.code})` : String(e);
      if (e instanceof ResponseError && e.code === ErrorCodes.Cancelled) {
        // the user's own cancel is not an error: no error message, the command resolves
        this.line(`=== cancelled: ${msg}`);
        return undefined;
      }
      this.line(`=== error: ${msg}`);
      if (!this.reportedByExit(e)) {   // the server died under it: its exit notice is the one message
        const problem = this.serverProblem(e);
        if (problem) this.notify(`operate-sidecar: ${problem}`, ['Show server log', 'Open settings']);
        else this.notify(`operate-sidecar: ${msg}`);
      }
      throw markShown(e);   // shown: the command from the palette resolves (runCommand), a script still gets the error
    } finally {
      this.running.delete(source);
      source.dispose();
      this.updateStatus();
      if (permissionAnswer) this.preAnswers.delete(branchId);
    }
  }

  /**
   * Whether `e` is a request that failed because the server died while it ran, a death the exit
   * handler (see start()) reports: "the server stopped (exit N)", how it ended, its last stderr lines,
   * Show server log and Open settings. One message per death: what failed with it (a running Operate,
   * a command's request) shows nothing of its own; it is still logged to the output channel, still
   * rejects for a script, and a chat turn is still marked failed in the chat (the chat shows no
   * notification of its own). The death is a SidecarExitedError (the client says so also for a request
   * sent just after the server's output ended, before its exit was reported). Not when the server is
   * being stopped on purpose (Stop, Restart, a settings change): the exit handler is silent then, so
   * the error is shown as before.
   */
  private reportedByExit(e: unknown): boolean {
    return e instanceof SidecarExitedError && !this.stopping;
  }

  /**
   * Runs a command's handler: every registration goes through here. A failure is shown to the user
   * once, by the extension (a notification, recorded in noticeLog): an error it has shown already (a
   * failed start, a failed operate) is not shown again, any other is shown here when the command was
   * run from the UI. Run from the UI (no argument: the command palette, a key binding, a view's title
   * button, the status bar; or the URI an editor's title menu passes) the command then resolves
   * (undefined): a rejection would make the workbench add its own "Command '…' resulted in an error"
   * (from the palette a modal dialog) to the extension's message. Run with an argument (a script,
   * another extension, the tests) it rejects with the error, as before. A start abandoned on purpose
   * (Restart, Stop, a settings change) is not an error: nothing is shown.
   */
  async runCommand(fn: (...a: any[]) => unknown, args: unknown[]): Promise<unknown> {
    try {
      return await fn(...args);
    } catch (e) {
      const fromUi = args.every((a) => a === undefined || a instanceof vscode.Uri);
      if (fromUi && !(e instanceof StartAborted) && !shownErrors.has(e as object) && !this.reportedByExit(e)) {
        const msg = e instanceof ResponseError ? `${e.message} (${e.code})` : e instanceof Error ? e.message : String(e);
        this.notify(`operate-sidecar: ${msg.replace(/^operate-sidecar: /, '')}`);
      }
      if (fromUi) return undefined;
      throw e;
    }
  }

  cancel(): number {
    const n = this.running.size + (this.chat.running ? 1 : 0);
    for (const s of this.running) cancelOnce(s);
    this.chat.stop();
    this.line(`[cancel] ${n} running operate(s)`);
    return n;
  }

  private async showJson(value: unknown): Promise<vscode.TextDocument> {
    const doc = await vscode.workspace.openTextDocument({ language: 'json', content: JSON.stringify(value, null, 2) });
    await vscode.window.showTextDocument(doc, { preview: false });
    return doc;
  }

  async showMessages(arg?: { branchId?: string; show?: boolean }) {
    const client = await this.ensure();
    const branchId = arg?.branchId ?? this.branches.current ?? await this.pickBranchId(client, arg !== undefined);
    if (!branchId) return undefined;
    const r = await client.branchMessages(branchId);
    this.line(`[messages] ${branchId}: ${r.total} message(s)`);
    if (arg?.show ?? true) await this.showJson(r.messages);
    return r;
  }

  async newBranch(arg?: { system?: string; name?: string; chatModel?: string | JsonObject; parseModel?: string | JsonObject }) {
    const client = await this.ensure();
    let params = arg;
    if (params === undefined) {
      const system = await vscode.window.showInputBox({ prompt: 'operate-sidecar: system prompt for the new branch (optional)', ignoreFocusOut: true });
      if (system === undefined) return undefined;
      params = system ? { system } : {};
    }
    const { branchId } = await client.createBranch(params);
    this.branches.remember(branchId, params.name);
    await this.branches.setCurrent(branchId);
    this.line(`[branch] new ${branchId}`);
    return branchId;
  }

  async forkBranch(arg?: { branchId?: string }) {
    const client = await this.ensure();
    const from = arg?.branchId ?? this.branches.current ?? await this.pickBranchId(client, arg !== undefined);
    if (!from) return undefined;
    const { branchId } = await client.forkBranch(from);
    const name = this.branches.nameOf(from);
    if (name) this.branches.remember(branchId, `${name} (fork)`);
    await this.branches.setCurrent(branchId);
    this.line(`[branch] forked ${from} -> ${branchId}`);
    return branchId;
  }

  /**
   * Deletes a chat (branch). With `{branchId}` (a script) at once; without
   * an argument (the command palette) it is the current chat, and only after the user confirmed it by
   * its name: the conversation is deleted on the server, there is no undo.
   */
  async deleteBranch(arg?: { branchId?: string }) {
    const client = await this.ensure();
    const id = arg?.branchId ?? this.branches.current;
    if (!id) {
      if (arg === undefined) void vscode.window.showInformationMessage('operate-sidecar: there is no chat to delete (the current chat has no messages yet).');
      return false;
    }
    return this.removeBranch(client, id, arg === undefined);
  }

  /** Deletes the branch `id`; `ask`: only after the user confirmed it by its name (a modal; dismissed = kept). */
  private async removeBranch(client: SidecarClient, id: string, ask: boolean): Promise<boolean> {
    if (ask) {
      const name = this.branches.nameOf(id)
        ?? (await client.listBranches()).branches.find((b) => b.branchId === id)?.name ?? id.slice(0, 8);
      const answer = await vscode.window.showWarningMessage(`Delete the chat "${name}"?`,
        { modal: true, detail: 'Its conversation is deleted on the server; this cannot be undone.' }, 'Delete');
      if (answer !== 'Delete') return false;
    }
    await client.deleteBranch(id);
    this.line(`[branch] deleted ${id}`);
    void this.branches.setLocalTurns(id, []);   // its failed and stopped turns go with it
    void this.branches.forgetKept(id);   // and its turns' thoughts
    if (this.branches.current === id) await this.branches.setCurrent(undefined);
    return true;
  }

  /** Switch to a branch (argument) or pick one (no argument; its buttons fork, and delete once confirmed). */
  async pickBranch(arg?: { branchId?: string }): Promise<string | undefined> {
    const client = await this.ensure();
    if (arg?.branchId) {
      await this.branches.setCurrent(arg.branchId);
      await this.branches.validate(client);
      return this.branches.current;
    }
    const choice = await this.branches.pick(client);
    if (!choice) return undefined;
    if (choice.action === 'new') { await this.newChat(); return undefined; }
    if (choice.action === 'switch') { await this.branches.setCurrent(choice.branchId); return choice.branchId; }
    if (choice.action === 'fork') return this.forkBranch({ branchId: choice.branchId });
    await this.removeBranch(client, choice.branchId!, true);   // the user's click: confirmed first
    return this.branches.current;
  }

  async newChat(): Promise<void> {
    await this.branches.setCurrent(undefined);
    this.chat.clearUnbound();   // already a new chat: what failed in it goes too
    await this.chat.reveal();
  }

  /** Pick the chat model from the server's models (argument: its name; '' = the branch's default). */
  async pickModel(arg?: { model?: string } | string): Promise<string | undefined> {
    await this.ensure();   // the model list comes with initialize
    const given = typeof arg === 'string' ? arg : arg?.model;
    let model: string | undefined = given;
    if (given === undefined) {
      const models = this.initResult?.capabilities.models ?? [];
      const pick = await vscode.window.showQuickPick(
        [{ label: '(default)', description: 'the branch\'s model or the server default', model: '' },
          ...models.map((m) => ({ label: m, description: m === this.branches.model ? 'current' : '', model: m }))],
        { title: 'operate-sidecar: model for chat turns' });
      if (!pick) return this.branches.model;
      model = pick.model;
    }
    if (model && !(this.initResult?.capabilities.models ?? []).includes(model)) throw new Error(`unknown model: ${model}`);
    await this.branches.setModel(model || undefined);
    this.line(`[model] ${model || '(default)'}`);
    this.updateStatus();
    this.chat.render();
    return this.branches.model;
  }

  async chatSend(arg?: string | { text?: string; responseFormat?: JsonObject }): Promise<TurnOutcome | undefined> {
    const text = typeof arg === 'string' ? arg : arg?.text;
    const responseFormat = typeof arg === 'object' && arg?.responseFormat && typeof arg.responseFormat === 'object' && !Array.isArray(arg.responseFormat)
      ? arg.responseFormat : undefined;
    await this.chat.reveal();
    if (!text) return undefined;
    return this.chat.send(text, undefined, responseFormat && { responseFormat });
  }

  /**
   * Accept / Reject / Always for an edit review: the one named by the argument, else the one in the
   * active diff editor, else the only one waiting. Without an argument (the palette, a key) and
   * several waiting it asks which (a quick pick naming file and tool); with none it says so.
   */
  async decideEdit(arg: unknown, decision: PermissionDecision): Promise<boolean> {
    let callId = this.review.callIdFor(arg) ?? (arg && typeof arg === 'object' && 'callId' in arg ? String((arg as { callId: unknown }).callId) : undefined);
    if (!callId && arg === undefined) {
      const waiting = this.review.pendingReviews();
      if (!waiting.length) {
        void vscode.window.showInformationMessage('operate-sidecar: no edit is waiting for review.');
        return false;
      }
      const verb = decision.startsWith('allow') ? (decision === 'allow_always' ? 'Always allow' : 'Accept') : 'Reject';
      const pick = await vscode.window.showQuickPick(
        waiting.map((r) => ({ label: r.title, description: vscode.workspace.asRelativePath(r.path), detail: `tool: ${r.tool}`, callId: r.callId })),
        { title: `operate-sidecar: ${verb} which edit?`, placeHolder: `${waiting.length} edits are waiting for review` });
      callId = pick?.callId;
    }
    if (!callId) return false;
    return this.chat.decide(callId, decision) || this.review.decide(callId, decision);
  }

  async listTools(arg?: { branchId?: string; authorize?: { tool: string; decision: PolicyDecision; branchId?: string } }) {
    const client = await this.ensure();
    if (arg?.authorize) {
      const a = arg.authorize;
      const r = await client.authorizeTool(a.tool, a.decision, a.branchId);
      this.line(`[policy] ${r.tool} -> ${r.decision} (${r.branchId ?? 'server-wide'})`);
    }
    const branchId = arg?.branchId ?? this.branches.current;
    const { tools } = await client.listTools(branchId);
    this.line(`[tools] ${tools.map((t) => `${t.name}(${t.source}, ${t.policy})`).join(', ')}`);
    if (arg === undefined) {
      const pick = await vscode.window.showQuickPick(
        tools.map((t) => ({ label: t.name, description: `${t.source} · ${t.policy}`, detail: t.description })),
        { title: 'operate-sidecar tools: pick one to change its policy' });
      if (pick) {
        const decision = await vscode.window.showQuickPick(['allow', 'deny', 'ask'], { title: `policy for ${pick.label}${branchId ? ' on this branch' : ''}` });
        if (decision) await this.listTools({ branchId, authorize: { tool: pick.label, decision: decision as PolicyDecision, branchId } });
      }
    }
    return tools;
  }

  private async pickBranchId(client: SidecarClient, nonInteractive: boolean): Promise<string | undefined> {
    const { branches } = await client.listBranches();
    if (nonInteractive || !branches.length) {
      if (!branches.length) void vscode.window.showInformationMessage('operate-sidecar: no branches yet');
      return branches[branches.length - 1]?.branchId;
    }
    const pick = await vscode.window.showQuickPick(
      branches.map((b) => ({ label: b.name ?? b.branchId, description: `${b.messageCount} messages · ${b.chatModel ?? ''}`, id: b.branchId })),
      { title: 'operate-sidecar: branch' });
    return pick?.id;
  }

  async restart(why?: string): Promise<InitializeResult> {
    this.line('[server] restarting');
    await this.stop(why);
    await this.ensure();
    return this.initResult!;
  }
}

let sidecar: Sidecar | undefined;

export function activate(ctx: vscode.ExtensionContext): OperateSidecarApi {
  const s = new Sidecar(ctx);
  sidecar = s;
  // every command through runCommand: one error message per failure (the extension's), none added by the workbench
  const reg = (id: string, fn: (...a: any[]) => unknown) =>
    ctx.subscriptions.push(vscode.commands.registerCommand(`operateSidecar.${id}`, (...a: unknown[]) => s.runCommand(fn, a)));
  reg('operate', (a?: string | OperateCommandArgs) => s.operate(a));
  reg('cancel', () => s.cancel());
  reg('showMessages', (a?: { branchId?: string; show?: boolean }) => s.showMessages(a));
  reg('newBranch', (a?: { system?: string; name?: string }) => s.newBranch(a));
  reg('forkBranch', (a?: { branchId?: string }) => s.forkBranch(a));
  reg('deleteBranch', (a?: { branchId?: string }) => s.deleteBranch(a));
  reg('listTools', (a?: { branchId?: string }) => s.listTools(a));
  reg('restart', () => s.restart());
  reg('openChat', () => s.chat.reveal());
  reg('chat', (a?: string | { text?: string; responseFormat?: JsonObject }) => s.chatSend(a));
  reg('stop', () => s.chat.stop());
  reg('newChat', () => s.newChat());
  reg('pickBranch', (a?: { branchId?: string }) => s.pickBranch(a));
  reg('pickModel', (a?: { model?: string } | string) => s.pickModel(a));
  // (from the Explorer's or an editor tab's menu: the file it was opened on, and all of a multiple selection)
  reg('attachFile', (uri?: unknown, uris?: unknown) => s.chat.attachFile(uri, uris));
  reg('attachSelection', () => s.chat.attachRef('#selection'));
  reg('exportChat', () => s.chat.exportMarkdown());
  reg('acceptEdit', (a?: unknown) => s.decideEdit(a, 'allow_once'));
  reg('rejectEdit', (a?: unknown) => s.decideEdit(a, 'deny_once'));
  reg('alwaysAllowEdit', (a?: unknown) => s.decideEdit(a, 'allow_always'));
  let restartTimer: NodeJS.Timeout | undefined;
  ctx.subscriptions.push(vscode.workspace.onDidChangeConfiguration((e) => {
    if (!SERVER_SETTINGS.some((k) => e.affectsConfiguration(k))) return;
    if (!s.currentClient() && !s.isStarting) return;   // applied at the next start
    s.line('[server] configuration changed; restarting');
    clearTimeout(restartTimer);
    restartTimer = setTimeout(() => { void s.restart('the server restarted to apply the changed settings').catch(() => undefined); }, 300);
  }), { dispose: () => clearTimeout(restartTimer) });
  return {
    outputText: () => s.outputText(),
    outputLength: () => s.outputLength(),
    client: () => s.currentClient(),
    currentBranch: () => s.currentBranch(),
    initializeResult: () => s.initializeResult(),
    chatStats: () => ({ ...s.chat.stats(), running: s.chat.running }),
    chatTurns: () => s.chat.shownTurns(),
    reviews: () => [...s.review.history],
    statusText: () => s.status.text,
    statusItem: () => ({ text: s.status.text, tooltip: String(s.status.tooltip ?? ''), command: String(s.status.command ?? ''),
      background: s.statusBackground }),
    notices: () => [...s.noticeLog],
    faults,
  };
}

export async function deactivate(): Promise<void> {
  await sidecar?.stop();
  sidecar = undefined;
}
