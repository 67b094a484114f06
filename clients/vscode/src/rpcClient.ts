// Protocol client for operate-sidecar (PROTOCOL.md, version 1). No `vscode` import: this module is
// unit-tested with node's test runner against the real Python server.
import { spawn, ChildProcess } from 'node:child_process';
import * as rpc from 'vscode-jsonrpc/node';

export { CancellationTokenSource, ResponseError } from 'vscode-jsonrpc/node';
export type { CancellationToken } from 'vscode-jsonrpc/node';

/** PROTOCOL §8. */
export const ErrorCodes = {
  ParseError: -32700,
  InvalidRequest: -32600,
  MethodNotFound: -32601,
  InvalidParams: -32602,
  InternalError: -32603,
  NotInitialized: -32002,
  Cancelled: -32800,
  ValidationFailed: -32010,
  ModelError: -32011,
  BranchNotFound: -32012,
} as const;

export type Json = null | boolean | number | string | Json[] | { [k: string]: Json };
export type JsonObject = { [k: string]: Json };
/** A configured model name or an inline ModelConfig. */
export type Model = string | JsonObject;
export type PolicyDecision = 'allow' | 'deny' | 'ask';
export type PermissionDecision = 'allow_once' | 'allow_always' | 'deny_once' | 'deny_always';
export const PERMISSION_OPTIONS: readonly PermissionDecision[] = ['allow_once', 'allow_always', 'deny_once', 'deny_always'];

export interface InitializeParams {
  protocolVersion?: 1;
  clientInfo?: { name: string; version?: string };
  processId?: number;
  capabilities?: { toolPermission?: boolean; clientTools?: boolean };
  workspaceFolders?: string[];
  settings?: JsonObject;
}
export interface InitializeResult {
  protocolVersion: 1;
  serverInfo: { name: string; version: string };
  capabilities: { methods: string[]; notifications: string[]; models: string[]; stateDir: string | null };
}
export interface CreateBranchParams { system?: string; chatModel?: Model; parseModel?: Model; name?: string }
export interface BranchInfo { branchId: string; name: string | null; messageCount: number; chatModel: string | null }
export interface Message {
  id: string; kind: 'system' | 'instruction' | 'assistant_response' | 'action_request' | 'action_response';
  role: string; sender: string | null; recipient: string | null; createdAt: string | number; content: JsonObject;
}
export interface ToolInfo {
  name: string; description: string; inputSchema: JsonObject;
  source: 'builtin' | 'python' | 'mcp' | 'client'; policy: PolicyDecision;
}
export interface ClientToolSpec { name: string; description: string; inputSchema: JsonObject }

export interface OperateParams {
  branchId: string;
  instruct?: { instruction?: Json; guidance?: Json; context?: Json; reason?: boolean; actions?: boolean; actionStrategy?: string };
  instruction?: Json; guidance?: Json; context?: Json;
  chatModel?: Model; parseModel?: Model;
  responseFormat?: JsonObject;
  fieldModels?: { name: string; schema: JsonObject; description?: string; default?: Json }[];
  reason?: boolean; actions?: boolean; invokeActions?: boolean;
  tools?: string[] | true;
  actionStrategy?: 'concurrent' | 'sequential';
  verboseAction?: boolean;
  handleValidation?: 'return_value' | 'return_none' | 'raise';
  skipValidation?: boolean; clearMessages?: boolean;
  streamPersist?: boolean; persistDir?: string; snapshotDir?: string;
  parseOptions?: JsonObject; modelOptions?: JsonObject;
  workDoneToken?: string | number;
}
export interface OperateResult { result: Json; kind: 'model' | 'dict' | 'text' | 'none'; model: string | null }

export type ProgressValue =
  | { kind: 'begin'; title: string; message: 'communicate' | 'run_and_collect' }
  | { kind: 'report'; message: string; phase: 'request' | 'stream' | 'parse' | 'actions'; delta?: string }
  | { kind: 'end'; message: string };
export interface ToolEvent {
  seq: number; branchId: string; callId: string; event: 'pre' | 'post' | 'error' | 'denied'; tool: string;
  argsSummary: string; resultSummary?: string; error?: string; durationMs?: number;
}
export interface LogMessage { type: 1 | 2 | 3 | 4; message: string }
export interface PermissionRequest {
  branchId: string; callId: string; tool: string; arguments: Json; options: PermissionDecision[];
}
export interface ClientToolRequest { branchId: string; callId: string; tool: string; arguments: Json }

export type PermissionHandler = (req: PermissionRequest, token: rpc.CancellationToken) =>
  PermissionDecision | Promise<PermissionDecision>;
export type ClientToolHandler = (req: ClientToolRequest, token: rpc.CancellationToken) => Json | Promise<Json>;

export interface StartOptions {
  /** argv; command[0] is the executable. */
  command: string[];
  cwd?: string;
  env?: NodeJS.ProcessEnv;
  /** Server stderr, decoded, chunk by chunk (it is always drained). */
  onStderr?: (text: string) => void;
}

export interface OperateOptions {
  token?: rpc.CancellationToken;
  /** Receives every $/progress value for this operate, in arrival order. */
  onProgress?: (value: ProgressValue) => void;
}

const progressType = new rpc.ProgressType<ProgressValue>();
let tokenCounter = 0;

export class SidecarClient {
  readonly connection: rpc.MessageConnection;
  readonly process: ChildProcess;
  /** Resolves with the exit code (or signal name) once the server process ended. */
  readonly exited: Promise<number | string | null>;
  private toolEventListeners = new Set<(e: ToolEvent) => void>();
  private logListeners = new Set<(m: LogMessage) => void>();
  private permissionHandler: PermissionHandler | undefined;
  private clientToolHandler: ClientToolHandler | undefined;
  private exitCode: number | string | null | undefined;

  private constructor(child: ChildProcess, opts: StartOptions) {
    this.process = child;
    this.exited = new Promise((resolve) => {
      child.once('exit', (code, signal) => {
        this.exitCode = code ?? signal;
        // fail every pending request instead of leaving it hanging
        this.connection.dispose();
        resolve(this.exitCode);
      });
    });
    child.stderr!.setEncoding('utf8');
    child.stderr!.on('data', (d: string) => opts.onStderr?.(d));
    this.connection = rpc.createMessageConnection(
      new rpc.StreamMessageReader(child.stdout!), new rpc.StreamMessageWriter(child.stdin!));
    this.connection.onNotification('toolEvent', (e: ToolEvent) => this.toolEventListeners.forEach((l) => l(e)));
    this.connection.onNotification('window/logMessage', (m: LogMessage) => this.logListeners.forEach((l) => l(m)));
    this.connection.onRequest('requestToolPermission', async (p: PermissionRequest, token) => {
      if (!this.permissionHandler) return { decision: 'deny_once' };
      return { decision: await this.permissionHandler(p, token) };
    });
    this.connection.onRequest('invokeClientTool', async (p: ClientToolRequest, token): Promise<{ output: Json }> => {
      if (!this.clientToolHandler) {
        throw new rpc.ResponseError(ErrorCodes.MethodNotFound, `no client tool handler for ${p.tool}`);
      }
      return { output: await this.clientToolHandler(p, token) };
    });
    this.connection.onError(() => { /* a broken pipe surfaces through exited / rejected requests */ });
    this.connection.listen();
  }

  /** Spawn the server; rejects if the executable cannot be started. */
  static start(opts: StartOptions): Promise<SidecarClient> {
    if (!opts.command.length) return Promise.reject(new Error('operate-sidecar: empty server command'));
    return new Promise((resolve, reject) => {
      const child = spawn(opts.command[0], opts.command.slice(1), {
        cwd: opts.cwd, env: opts.env ?? process.env, stdio: ['pipe', 'pipe', 'pipe'],
      });
      child.once('error', (err) => reject(new Error(`operate-sidecar: cannot start ${JSON.stringify(opts.command)}: ${err.message}`)));
      child.once('spawn', () => resolve(new SidecarClient(child, opts)));
    });
  }

  get running(): boolean { return this.exitCode === undefined; }

  // ---- handlers and listeners -----------------------------------------------------------------
  onToolEvent(l: (e: ToolEvent) => void): rpc.Disposable {
    this.toolEventListeners.add(l);
    return { dispose: () => this.toolEventListeners.delete(l) };
  }
  onLogMessage(l: (m: LogMessage) => void): rpc.Disposable {
    this.logListeners.add(l);
    return { dispose: () => this.logListeners.delete(l) };
  }
  /** Answers `requestToolPermission`. Without a handler every request is answered `deny_once`. */
  setPermissionHandler(h: PermissionHandler | undefined): void { this.permissionHandler = h; }
  /** Answers `invokeClientTool`. A thrown error becomes an error response (a tool error). */
  setClientToolHandler(h: ClientToolHandler | undefined): void { this.clientToolHandler = h; }

  // ---- requests -------------------------------------------------------------------------------
  /** A generic request. Omitted params are sent as `{}` (vscode-jsonrpc would send `"params": null`). */
  request<R>(method: string, params: object = {}, token?: rpc.CancellationToken): Promise<R> {
    return token ? this.connection.sendRequest<R>(method, params, token) : this.connection.sendRequest<R>(method, params);
  }
  initialize(params: InitializeParams = {}): Promise<InitializeResult> {
    return this.request<InitializeResult>('initialize', { protocolVersion: 1, ...params }).then(async (r) => {
      await this.connection.sendNotification('initialized', {});
      return r;
    });
  }
  ping(): Promise<{}> { return this.request('ping', {}); }
  createBranch(p: CreateBranchParams = {}): Promise<{ branchId: string }> { return this.request('createBranch', p); }
  forkBranch(branchId: string): Promise<{ branchId: string }> { return this.request('forkBranch', { branchId }); }
  deleteBranch(branchId: string): Promise<{}> { return this.request('deleteBranch', { branchId }); }
  listBranches(): Promise<{ branches: BranchInfo[] }> { return this.request('listBranches', {}); }
  branchMessages(branchId: string, offset?: number, limit?: number): Promise<{ messages: Message[]; total: number }> {
    return this.request('branchMessages', { branchId, ...(offset !== undefined && { offset }), ...(limit !== undefined && { limit }) });
  }
  listTools(branchId?: string): Promise<{ tools: ToolInfo[] }> {
    return this.request('listTools', branchId ? { branchId } : {});
  }
  authorizeTool(tool: string, decision: PolicyDecision, branchId?: string):
    Promise<{ tool: string; decision: PolicyDecision; branchId: string | null }> {
    return this.request('authorizeTool', { tool, decision, ...(branchId && { branchId }) });
  }
  registerClientTools(tools: ClientToolSpec[]): Promise<{ registered: string[] }> {
    return this.request('registerClientTools', { tools });
  }

  /**
   * operate; with `onProgress` a fresh workDoneToken is sent (unless params has one) and every
   * `$/progress` value for it is delivered in order. Cancelling `token` sends `$/cancelRequest`;
   * the promise then rejects with a ResponseError of code -32800.
   */
  async operate(params: OperateParams, opts: OperateOptions = {}): Promise<OperateResult> {
    let sub: rpc.Disposable | undefined;
    const p: OperateParams = { ...params };
    if (opts.onProgress) {
      if (p.workDoneToken === undefined) p.workDoneToken = `operate-${process.pid}-${++tokenCounter}`;
      sub = this.connection.onProgress(progressType, p.workDoneToken, opts.onProgress);
    }
    try {
      return await this.request<OperateResult>('operate', p, opts.token);
    } finally {
      sub?.dispose();
    }
  }

  /** shutdown + exit; kills the process if it has not exited within `timeoutMs`. */
  async stop(timeoutMs = 5000): Promise<number | string | null> {
    if (this.running) {
      const timer = (ms: number) => new Promise<'timeout'>((r) => setTimeout(() => r('timeout'), ms).unref());
      try {
        await Promise.race([this.request('shutdown'), timer(timeoutMs)]);
      } catch { /* already gone, or refused: exit anyway */ }
      try { await this.connection.sendNotification('exit'); } catch { /* already gone */ }
      if ((await Promise.race([this.exited, timer(timeoutMs)])) === 'timeout') this.process.kill('SIGKILL');
    }
    return this.exited;
  }

  /** Hard stop. */
  kill(): void { if (this.running) this.process.kill('SIGKILL'); }
}
