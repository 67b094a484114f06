// operate-sidecar-client: spawn the operate-sidecar server and talk to it over stdio (JSON-RPC 2.0 with
// LSP base-protocol framing, through vscode-jsonrpc). The wire types are generated from
// protocol/schema.json into ./generated/protocol.ts; the protocol itself is described in docs/PROTOCOL.md.
// No `vscode` import: usable from any Node program and from the VS Code extension.
import { spawn, ChildProcess } from 'node:child_process';
import { PassThrough } from 'node:stream';
import * as rpc from 'vscode-jsonrpc/node';
import type * as P from './generated/protocol';
import { WireErrorCodes } from './generated/protocol';

export * from './generated/protocol';
export { CancellationTokenSource, ResponseError } from 'vscode-jsonrpc/node';
export type { CancellationToken, Disposable } from 'vscode-jsonrpc/node';

/** Error codes, by the schema's names plus the short names `NotInitialized` and `Cancelled`. */
export const ErrorCodes = {
  ...WireErrorCodes,
  NotInitialized: WireErrorCodes.ServerNotInitialized,
  Cancelled: WireErrorCodes.RequestCancelled,
} as const;

export type Json = null | boolean | number | string | Json[] | { [k: string]: Json };
export type JsonObject = { [k: string]: Json };
export type PolicyDecision = P.AuthorizeToolParams['decision'];
export type PermissionDecision = P.RequestToolPermissionResult['decision'];
export const PERMISSION_OPTIONS: readonly PermissionDecision[] = ['allow_once', 'allow_always', 'deny_once', 'deny_always'];

// Names the VS Code extension's own client used, kept so that switching to this package is an import change.
export type ToolEvent = P.ToolEventParams;
export type LogMessage = P.LogMessageParams;
export type PermissionRequest = P.RequestToolPermissionParams;
export type ClientToolRequest = P.InvokeClientToolParams;

/** `fs/readTextFile` and `fs/writeTextFile` (server → client, when `capabilities.fs` was declared). */
export type ReadTextFileRequest = P.ReadTextFileParams;
export type WriteTextFileRequest = P.WriteTextFileParams;

/**
 * The handlers of the server's requests get a token that is cancelled when the server withdraws the request
 * (`$/cancelRequest`) and when its process exits: a request whose asker is gone waits for nothing.
 */
export type PermissionHandler = (req: PermissionRequest, token: rpc.CancellationToken) =>
  PermissionDecision | Promise<PermissionDecision>;
export type ClientToolHandler = (req: ClientToolRequest, token: rpc.CancellationToken) => unknown | Promise<unknown>;
/**
 * Serves the server's file reads and writes from the client (e.g. editor buffers). A thrown error becomes an
 * error response, which the server reports as a tool error.
 */
export interface FileSystemHandler {
  /** Returns the file's current text (for an editor: the buffer's text, saved or not). */
  readTextFile(req: ReadTextFileRequest, token: rpc.CancellationToken): string | Promise<string>;
  writeTextFile(req: WriteTextFileRequest, token: rpc.CancellationToken): void | Promise<void>;
}
/** The name the VS Code extension's client uses for a FileSystemHandler. */
export type FsHandlers = FileSystemHandler;

/** `initialize` params as this client sends them: `settings` may also be a loose JSON object. */
export type InitializeParams = Omit<P.InitializeParams, 'settings' | 'capabilities'> & {
  settings?: P.Settings | JsonObject;
  capabilities?: P.ClientCapabilities;
};
export type InitializeResult = P.InitializeResult;
/** A configured model's name or an inline model config (a loose JSON object is accepted too). */
export type ModelArg = P.Model | JsonObject;
export type CreateBranchParams = Omit<P.CreateBranchParams, 'chatModel' | 'parseModel'> & { chatModel?: ModelArg; parseModel?: ModelArg };
export type OperateParams = Omit<P.OperateParams, 'chatModel' | 'parseModel'> & { chatModel?: ModelArg; parseModel?: ModelArg };
/**
 * A branch message. `content`'s shape depends on `kind` (SystemContent, InstructionContent,
 * AssistantResponseContent, ActionRequestContent, ActionResponseContent); its fields can be read without narrowing.
 */
export type Message = Omit<P.Message, 'content'> & { content: P.MessageContent & { [k: string]: any } };
export type OperateResult = P.OperateResult;
export type ProgressValue = P.ProgressValue;

export interface StartOptions {
  /** argv; command[0] is the executable. */
  command: string[];
  cwd?: string;
  env?: NodeJS.ProcessEnv;
  /** Server stderr, decoded, chunk by chunk (it is always drained, and its tail is kept: `stderrTail`). */
  onStderr?: (text: string) => void;
  /** How many characters of stderr `stderrTail` keeps (default 16384; 0 keeps none). */
  stderrTailChars?: number;
}

export interface InitializeOptions {
  /**
   * How long to wait for the answer (default DEFAULT_INITIALIZE_TIMEOUT_MS, 30 s; 0 or Infinity: no limit).
   * On time-out the promise rejects with a SidecarTimeoutError; the process is left running (`kill()` it).
   */
  timeoutMs?: number;
}
/** The default time-out of `initialize`. */
export const DEFAULT_INITIALIZE_TIMEOUT_MS = 30_000;

export interface OperateOptions {
  token?: rpc.CancellationToken;
  /** Receives every $/progress value for this operate, in arrival order. */
  onProgress?: (value: ProgressValue) => void;
}

/** How the server process ended. */
export interface ExitInfo {
  /** Exit code, or null when a signal ended it. */
  exitCode: number | null;
  signal: NodeJS.Signals | null;
  /** The last characters the server wrote to stderr (its traceback or error message, typically). */
  stderrTail: string;
}

/** `initialize` was not answered in time (the server hangs, or is not an operate-sidecar server). */
export class SidecarTimeoutError extends Error {
  readonly method: string;
  readonly timeoutMs: number;
  readonly stderrTail: string;
  /** The start of what the server wrote to stdout when that was not JSON-RPC framing ('' otherwise). */
  readonly stdoutHead: string;
  constructor(method: string, timeoutMs: number, stderrTail: string, stdoutHead: string) {
    const secs = timeoutMs % 1000 ? `${timeoutMs} ms` : `${timeoutMs / 1000} s`;
    const tail = stderrTail.trim();
    const head = stdoutHead.trim();
    super(`operate-sidecar: the server did not answer ${method} within ${secs}`
      + (head ? `; its stdout is not JSON-RPC (Content-Length framing), it begins with: ${JSON.stringify(head.slice(0, 200))}` : '')
      + (tail ? `; its stderr ends with:\n${tail}` : ''));
    this.name = 'SidecarTimeoutError';
    this.method = method;
    this.timeoutMs = timeoutMs;
    this.stderrTail = stderrTail;
    this.stdoutHead = stdoutHead;
  }
}

/** A request that could not be answered because the server process is gone. */
export class SidecarExitedError extends Error {
  readonly exitCode: number | null;
  readonly signal: NodeJS.Signals | null;
  readonly stderrTail: string;
  /** `doing`: what the server did not get to do with `what` ('answering' a request, 'receiving' a notification). */
  constructor(what: string, info: ExitInfo, doing = 'answering') {
    const how = info.signal ? `signal ${info.signal}` : `exit code ${info.exitCode}`;
    const tail = info.stderrTail.trim();
    super(`operate-sidecar: the server exited (${how}) before ${doing} ${what}${tail ? `; its stderr ends with:\n${tail}` : ''}`);
    this.name = 'SidecarExitedError';
    this.exitCode = info.exitCode;
    this.signal = info.signal;
    this.stderrTail = info.stderrTail;
  }
}

/**
 * The server's stdout stopped being readable as JSON-RPC framing (a stray line, a frame that is not JSON): no
 * answer can be matched any more, so every pending and later request rejects with this instead of waiting forever.
 * The process is left running; `stop()` ends it (closing its stdin) or `kill()` it.
 */
export class SidecarStreamError extends Error {
  /** What the reader reported (the header or JSON it could not read). */
  readonly reason: string;
  /** The start of what the server wrote to stdout. */
  readonly stdoutHead: string;
  constructor(what: string, reason: Error, stdoutHead: string) {
    const head = stdoutHead.trim();
    super(`operate-sidecar: the server's output is no longer readable as JSON-RPC (${reason.message}), so ${what} cannot be answered`
      + (head ? `; its stdout begins with: ${JSON.stringify(head.slice(0, 200))}` : ''));
    this.name = 'SidecarStreamError';
    this.reason = reason.message;
    this.stdoutHead = stdoutHead;
  }
}

/** Calls every listener even when one throws; the first error is rethrown after the others ran. */
function callEach<A>(listeners: Iterable<(arg: A) => void>, arg: A): void {
  let first: { error: unknown } | undefined;
  for (const l of [...listeners]) {
    try { l(arg); } catch (error) { first ??= { error }; }
  }
  if (first) throw first.error;
}

/** Cancels `source` once (a second cancel() of a source whose token was never read throws). */
function cancelSource(source: rpc.CancellationTokenSource): void {
  if (!source.token.isCancellationRequested) source.cancel();
}

/** Characters a header name is made of (RFC 9110 `token`), by byte. */
const TOKEN = new Uint8Array(256);
for (const ch of "!#$%&'*+-.^_`|~0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz") TOKEN[ch.charCodeAt(0)] = 1;
const CR = 13, LF = 10, COLON = 58;
/** The notification FrameWatch's finding reaches the connection as (see `unreadableFrame`); no server sends it. */
const UNREADABLE = '$/operate-sidecar-client/unreadableOutput';

/**
 * Follows the framing of the server's stdout (a header block, then Content-Length bytes of body) on its way to the
 * reader, to notice at once output that no frame header can begin with: a stray line a library printed. vscode-jsonrpc
 * reads a header block only once its blank line has come, so such a line followed by nothing would leave every
 * request waiting for ever. Only header lines are checked, never bodies: a name of token characters up to the `:`,
 * and a CRLF at the end (the server writes `Content-Length: N\r\n\r\n`), so that a line ending in a bare LF is a
 * stray one even when it begins as a header does (Python logging's `INFO:root:...`, `Warning: ...`). A header
 * block is held back until its blank line, so that the reader gets whole frames only. Before the server's first
 * frame nothing is judged (a program that prints something else first is not an operate-sidecar server:
 * `initialize`'s time-out says so): the output goes to the reader as it is from then on, as it does once a header
 * block has no Content-Length the reader can read (the reader reports that itself).
 */
class FrameWatch {
  /** Bytes of the current frame's body still to come. */
  private bodyLeft = 0;
  /** The header block read so far (latin1, byte for byte), held back from the reader until its blank line. */
  private block = '';
  /** Where the current header line begins in `block`, and whether its name has ended (its `:` was read). */
  private lineStart = 0;
  private named = false;
  private framesRead = 0;
  /** 'pass': forward everything as it is; 'stop': a stray was found, nothing more can be read. */
  private mode: 'watch' | 'pass' | 'stop' = 'watch';

  /** The bytes of `chunk` the reader is to get, and the stray line when one begins in it. */
  feed(chunk: Buffer): { forward: Buffer[]; stray?: string } {
    if (this.mode === 'pass') return { forward: [chunk] };
    if (this.mode === 'stop') return { forward: [] };
    const forward: Buffer[] = [];
    let i = 0;
    while (i < chunk.length) {
      if (this.bodyLeft > 0) {
        const n = Math.min(this.bodyLeft, chunk.length - i);
        forward.push(chunk.subarray(i, i + n));
        i += n;
        this.bodyLeft -= n;
        if (this.bodyLeft === 0) this.framesRead++;
        continue;
      }
      const c = chunk[i++];
      this.block += String.fromCharCode(c);
      if (this.named) {   // a header's value, up to its CRLF
        if (c !== LF) continue;
        if (this.block.charCodeAt(this.block.length - 2) === CR) {
          this.lineStart = this.block.length;
          this.named = false;
          continue;
        }
        // a bare LF ends no header line: a stray line that began like one (`INFO:root:...`, `Warning: ...`)
      } else {
        const at = this.block.length - 1 - this.lineStart;   // c's place in its line
        if (this.lineStart > 0 && this.block.charCodeAt(this.lineStart) === CR) {   // the blank line ending the block
          if (at === 0) continue;
          if (at === 1 && c === LF) {
            const length = contentLength(this.block);
            forward.push(Buffer.from(this.block, 'latin1'));
            this.block = '';
            this.lineStart = 0;
            if (length === undefined) return this.pass(forward, chunk.subarray(i));
            this.bodyLeft = length;
            if (length === 0) this.framesRead++;
            continue;
          }
        } else if (c === COLON ? at > 0 : TOKEN[c]) {
          this.named = c === COLON;
          continue;
        }
      }
      // no header line begins so: the output is out of step for good
      const line = Buffer.concat([Buffer.from(this.block.slice(this.lineStart), 'latin1'), chunk.subarray(i, i + 200)])
        .toString('utf8').replace(/(?<=\n)[\s\S]*$/, '').slice(0, 200);
      if (!this.framesRead) return this.pass(forward, Buffer.concat([Buffer.from(this.block, 'latin1'), chunk.subarray(i)]));
      this.mode = 'stop';
      return { forward, stray: line };
    }
    return { forward };
  }
  private pass(forward: Buffer[], rest: Buffer): { forward: Buffer[] } {
    this.mode = 'pass';
    if (rest.length) forward.push(rest);
    return { forward };
  }
}

/** A header block's Content-Length as vscode-jsonrpc reads it (the last one, parseInt), or undefined if it has none. */
function contentLength(block: string): number | undefined {
  let value: string | undefined;
  for (const line of block.split('\r\n')) {
    const colon = line.indexOf(':');
    if (colon > 0 && line.slice(0, colon).toLowerCase() === 'content-length') value = line.slice(colon + 1).trim();
  }
  const n = value === undefined ? NaN : parseInt(value, 10);
  return Number.isNaN(n) || n < 0 ? undefined : n;
}

/**
 * The frame that takes a FrameWatch finding to the connection in its place in the stream: the connection handles
 * messages in order, so the answers read before the stray line still settle their requests before it fails the rest.
 */
function unreadableFrame(line: string): Buffer {
  const body = Buffer.from(JSON.stringify({ jsonrpc: '2.0', method: UNREADABLE, params: { line } }));
  return Buffer.concat([Buffer.from(`Content-Length: ${body.length}\r\n\r\n`), body]);
}

let tokenCounter = 0;
/** After the process exited, how long to wait for the rest of its stderr (a grandchild may hold the pipe). */
const STDERR_DRAIN_MS = 500;

export class SidecarClient {
  readonly connection: rpc.MessageConnection;
  readonly process: ChildProcess;
  /** Resolves with the exit code (or signal name) once the server process ended. */
  readonly exited: Promise<number | string | null>;
  private readonly exitInfo: Promise<ExitInfo>;
  private notificationListeners = new Map<string, Set<(params: any) => void>>();
  /**
   * operate's `onProgress` by workDoneToken. `$/progress` is dispatched here, not by vscode-jsonrpc's `onProgress`:
   * vscode-jsonrpc keeps one handler per notification method, so an `onNotification('$/progress', ...)` listener
   * would replace its progress dispatch. `settled`: that operate's promise has settled (it was cancelled) while the
   * server has not answered yet; its handler still gets the values until then, unless a new operate takes the token.
   */
  private readonly progressHandlers = new Map<P.ProgressParams['token'], { handler: (v: ProgressValue) => void; settled: boolean }>();
  private exitListeners = new Set<(info: ExitInfo) => void>();
  private permissionHandler: PermissionHandler | undefined;
  private clientToolHandler: ClientToolHandler | undefined;
  private fsHandler: FileSystemHandler | undefined;
  private exitCode: number | string | null | undefined;
  private processGone = false;
  private stderrBuf = '';
  private readonly stderrMax: number;
  /** The first bytes of stdout (a diagnosis for a server that prints something that is not a frame). */
  private stdoutHead = '';
  /** Set when the reader could not read stdout as framing (then nothing can be answered). */
  private streamError: Error | undefined;
  /**
   * The tokens of the server's requests being answered (requestToolPermission, invokeClientTool, fs/*): all are
   * cancelled when the process exits, so that a handler waiting for the user (a review, a prompt) is withdrawn
   * instead of waiting for ever for a request nobody will read the answer of.
   */
  private readonly served = new Set<rpc.CancellationTokenSource>();
  /** Cancels a request waiting for its answer, one per request: `stop()` calls them before `shutdown`. */
  private readonly unanswered = new Set<() => void>();
  /** The stop in progress (or done): a `stop()` called while one runs shares it. */
  private stopped: Promise<number | string | null> | undefined;

  private constructor(child: ChildProcess, opts: StartOptions) {
    this.process = child;
    this.stderrMax = opts.stderrTailChars ?? 16384;
    child.stderr!.setEncoding('utf8');
    const stderrEnded = new Promise<void>((r) => { child.stderr!.once('end', r); child.stderr!.once('close', r); });
    child.stderr!.on('data', (d: string) => {
      // (not slice(-0), which would keep it all)
      this.stderrBuf = this.stderrMax > 0 ? (this.stderrBuf + d).slice(-this.stderrMax) : '';
      opts.onStderr?.(d);
    });
    this.exitInfo = new Promise((resolve) => {
      child.once('exit', (code, signal) => {
        this.processGone = true;
        // the server's own requests go with it: their handlers are told at once (their answers go nowhere)
        for (const source of [...this.served]) cancelSource(source);
        const drained = new Promise<void>((r) => setTimeout(r, STDERR_DRAIN_MS).unref());
        void Promise.race([stderrEnded, drained]).then(() => {
          const info: ExitInfo = { exitCode: code, signal, stderrTail: this.stderrBuf };
          this.exitCode = code ?? signal;
          // fail every pending request instead of leaving it hanging
          this.connection.dispose();
          resolve(info);
          // a listener that throws neither stops the others nor `exited` (nor becomes an unhandled rejection)
          try { callEach(this.exitListeners, info); } catch { /* the listener's own error */ }
        });
      });
    });
    this.exited = this.exitInfo.then((i) => i.exitCode ?? i.signal);
    // stdout goes to the reader through a FrameWatch, which finds a stray line at once
    const watch = new FrameWatch();
    const framed = new PassThrough();
    child.stdout!.on('data', (d: Buffer) => {
      if (this.stdoutHead.length < 512) this.stdoutHead += d.toString('utf8', 0, 512 - this.stdoutHead.length);
      const { forward, stray } = watch.feed(d);
      if (stray !== undefined) forward.push(unreadableFrame(stray));
      if (forward.length) framed.write(forward.length === 1 ? forward[0] : Buffer.concat(forward));
    });
    const ended = () => { if (!framed.writableEnded) framed.end(); };
    child.stdout!.once('end', ended);
    child.stdout!.once('close', ended);
    child.stdout!.on('error', (err) => framed.destroy(err));   // (the reader reports it, as it did reading stdout)
    const reader = new rpc.StreamMessageReader(framed);
    // a header or body it cannot read: the stream is out of step for good (vscode-jsonrpc would go on waiting)
    reader.onError((err) => this.unreadable(err instanceof Error ? err : new Error(String(err))));
    this.connection = rpc.createMessageConnection(reader, new rpc.StreamMessageWriter(child.stdin!));
    this.connection.onNotification(UNREADABLE, (p: { line: string }) =>
      this.unreadable(new Error(`a line that is not a frame header: ${JSON.stringify(p.line)}`)));
    // a write to a dead server: the error surfaces through the request (as SidecarExitedError)
    child.stdin!.on('error', () => { /* EPIPE */ });
    this.serve('requestToolPermission', async (p: PermissionRequest, token) => {
      if (!this.permissionHandler) return { decision: 'deny_once' };
      return { decision: await this.permissionHandler(p, token) };
    });
    this.serve('invokeClientTool', async (p: ClientToolRequest, token) => {
      if (!this.clientToolHandler) {
        throw new rpc.ResponseError(ErrorCodes.MethodNotFound, `no client tool handler for ${p.tool}`);
      }
      // a handler that returns nothing answers `null` (docs/PROTOCOL.md §3): `undefined` would leave `output` out
      const output = await this.clientToolHandler(p, token);
      return { output: output === undefined ? null : output };
    });
    this.serve('fs/readTextFile', async (p: ReadTextFileRequest, token) => {
      if (!this.fsHandler) throw new rpc.ResponseError(ErrorCodes.MethodNotFound, 'no file system handler');
      return { text: await this.fsHandler.readTextFile(p, token) };
    });
    this.serve('fs/writeTextFile', async (p: WriteTextFileRequest, token) => {
      if (!this.fsHandler) throw new rpc.ResponseError(ErrorCodes.MethodNotFound, 'no file system handler');
      await this.fsHandler.writeTextFile(p, token);
      return {};
    });
    // $/progress: operate's onProgress for its token first, then every onNotification('$/progress') listener
    const progressListeners = new Set<(params: any) => void>();
    this.notificationListeners.set('$/progress', progressListeners);
    this.connection.onNotification('$/progress', (params: P.ProgressParams) => {
      // called directly (a hot path: every streamed delta), as callEach would: each runs, the first error is rethrown after
      let first: { error: unknown } | undefined;
      const own = this.progressHandlers.get(params.token);
      if (own) {
        try { own.handler(params.value); } catch (error) { first = { error }; }
      }
      if (progressListeners.size) {
        for (const l of [...progressListeners]) {
          try { l(params); } catch (error) { first ??= { error }; }
        }
      }
      if (first) throw first.error;
    });
    this.connection.onError(() => { /* a broken pipe surfaces through exited / rejected requests */ });
    this.connection.listen();
  }

  /**
   * Answers the server's request `method` with `handler`, whose token is cancelled when the server withdraws the
   * request ($/cancelRequest) or its process exits (see `served`).
   */
  private serve<P>(method: string, handler: (params: P, token: rpc.CancellationToken) => Promise<object>): void {
    this.connection.onRequest(method, async (params: P, token: rpc.CancellationToken) => {
      const source = new rpc.CancellationTokenSource();
      const linked = token.onCancellationRequested(() => cancelSource(source));
      this.served.add(source);
      if (this.processGone || token.isCancellationRequested) cancelSource(source);
      try {
        return await handler(params, source.token);
      } finally {
        this.served.delete(source);
        linked.dispose();
        source.dispose();
      }
    });
  }

  /** The server's output cannot be read as frames any more (`err` says why): every pending request is failed. */
  private unreadable(err: Error): void {
    if (this.streamError || this.processGone) return;
    this.streamError = err;
    this.connection.dispose();  // rejects every pending request; request() says why
  }

  /** Spawn the server; rejects if the executable cannot be started. */
  static start(opts: StartOptions): Promise<SidecarClient> {
    if (!Array.isArray(opts.command) || !opts.command.every((a) => typeof a === 'string')) {
      return Promise.reject(new TypeError(`operate-sidecar: the server command must be an array of strings (argv), got ${JSON.stringify(opts.command)}`));
    }
    if (!opts.command.length) return Promise.reject(new Error('operate-sidecar: empty server command'));
    return new Promise((resolve, reject) => {
      const child = spawn(opts.command[0], opts.command.slice(1), {
        cwd: opts.cwd, env: opts.env ?? process.env, stdio: ['pipe', 'pipe', 'pipe'],
      });
      child.once('error', (err) => reject(new Error(`operate-sidecar: cannot start ${JSON.stringify(opts.command)}: ${err.message}`)));
      child.once('spawn', () => resolve(new SidecarClient(child, opts)));
    });
  }

  /** False once the server process has exited. */
  get running(): boolean { return !this.processGone && this.exitCode === undefined; }
  /** The last characters the server wrote to stderr. */
  get stderrTail(): string { return this.stderrBuf; }

  // ---- handlers and listeners -----------------------------------------------------------------
  onToolEvent(l: (e: ToolEvent) => void): rpc.Disposable { return this.onNotification('toolEvent', l); }
  onLogMessage(l: (m: LogMessage) => void): rpc.Disposable { return this.onNotification('window/logMessage', l); }
  /** Called once when the server process has ended, with its exit code or signal and its stderr tail. */
  onExit(l: (info: ExitInfo) => void): rpc.Disposable {
    this.exitListeners.add(l);
    return { dispose: () => this.exitListeners.delete(l) };
  }
  /** Any server notification by method, typed for the ones the protocol declares. */
  onNotification<M extends keyof P.ServerNotifications>(method: M, h: (params: P.ServerNotifications[M]['params']) => void): rpc.Disposable;
  onNotification(method: string, h: (params: any) => void): rpc.Disposable;
  onNotification(method: string, h: (params: any) => void): rpc.Disposable {
    let set = this.notificationListeners.get(method);
    if (!set) {
      // vscode-jsonrpc keeps one handler per method: fan out to every listener from it
      const listeners = new Set<(params: any) => void>();
      this.notificationListeners.set(method, listeners);
      this.connection.onNotification(method, (params: any) => callEach(listeners, params));
      set = listeners;
    }
    const listeners = set;
    listeners.add(h);
    return { dispose: () => { listeners.delete(h); } };
  }
  /** Answers `requestToolPermission`. Without a handler every request is answered `deny_once`. */
  setPermissionHandler(h: PermissionHandler | undefined): void { this.permissionHandler = h; }
  /**
   * Answers `invokeClientTool` with what the handler returns as `output` (`null` when it returns nothing). A thrown
   * error becomes an error response (a tool error).
   */
  setClientToolHandler(h: ClientToolHandler | undefined): void { this.clientToolHandler = h; }
  /**
   * Answers `fs/readTextFile` and `fs/writeTextFile`. The server sends them only when `initialize` declared
   * `capabilities.fs: true`; without a handler they are answered with an error (a tool error).
   */
  setFileSystemHandler(h: FileSystemHandler | undefined): void { this.fsHandler = h; }
  /** Same as setFileSystemHandler (the VS Code extension's name). */
  setFsHandlers(h: FsHandlers | undefined): void { this.fsHandler = h; }

  // ---- requests -------------------------------------------------------------------------------
  /**
   * A request, typed for the methods the protocol declares. Omitted params are sent as `{}` (vscode-jsonrpc
   * would send `"params": null`). If the server process is gone (or goes before answering), the promise
   * rejects with a SidecarExitedError carrying its exit code and stderr tail. Cancelling `token` (or `stop()`
   * while it runs) sends `$/cancelRequest`.
   */
  request<M extends keyof P.ClientRequests>(method: M, params?: P.ClientRequests[M]['params'], token?: rpc.CancellationToken):
    Promise<P.ClientRequests[M]['result']>;
  request<R>(method: string, params?: object, token?: rpc.CancellationToken): Promise<R>;
  request<R>(method: string, params: object = {}, token?: rpc.CancellationToken): Promise<R> {
    return this.call<R>(method, params, token);
  }
  /**
   * `request`; `onSent` gets the promise of the server's answer (it settles when the answer arrives or the
   * connection ends, which may be after the request was cancelled and its promise rejected).
   */
  private async call<R>(method: string, params: object, token?: rpc.CancellationToken, onSent?: (answer: Promise<unknown>) => void): Promise<R> {
    if (!this.running) throw new SidecarExitedError(method, await this.exitInfo);
    if (this.streamError) throw new SidecarStreamError(method, this.streamError, this.stdoutHead);
    // cancelled by `token` or by stop(); once (a second cancel() of a source whose token was never read throws)
    const source = new rpc.CancellationTokenSource();
    const cancel = () => { if (!source.token.isCancellationRequested) source.cancel(); };
    let linked: rpc.Disposable | undefined;
    let onCancel: rpc.Disposable | undefined;
    this.unanswered.add(cancel);
    const gone = this.exitInfo.then((info) => { throw new SidecarExitedError(method, info); });
    gone.catch(() => { /* handled by the race below */ });
    try {
      // (sendRequest throws at once, "Connection is closed.", when the server's output has ended and its exit is not
      // reported yet: the same transport error as a failed write, said as how the server ended)
      const sent = this.connection.sendRequest<R>(method, params, source.token);
      onSent?.(sent.then(() => undefined, () => undefined));
      // A cancel rejects at once, whether or not the server ever answers (a later answer is ignored). This listener
      // comes after the one sendRequest added, which writes $/cancelRequest: the cancel is written (after the
      // request) before the promise rejects. (Linked only now, so that a token cancelled already is handled the
      // same way, not by sendRequest's own path, which writes the cancel only once the request is written.)
      const cancelled = new Promise<never>((_, reject) => {
        onCancel = source.token.onCancellationRequested(() => reject(new rpc.ResponseError(ErrorCodes.Cancelled,
          `operate-sidecar: ${method} was cancelled (the client sent $/cancelRequest)`)));
      });
      linked = token?.onCancellationRequested(cancel);
      if (token?.isCancellationRequested) cancel();
      return await Promise.race([sent, gone, cancelled]);
    } catch (e) {
      if (e instanceof SidecarExitedError) throw e;
      // vscode-jsonrpc rejects a request it could not write (EPIPE: the process is gone, its exit maybe not reported
      // yet) and the pending ones when the connection is disposed (process gone) with these codes
      const transport = [rpc.ErrorCodes.MessageWriteError, rpc.ErrorCodes.PendingResponseRejected, rpc.ErrorCodes.ConnectionInactive] as number[];
      if (e instanceof rpc.ResponseError && !transport.includes(e.code)) throw e;
      throw await this.whyGone(method, e);
    } finally {
      this.unanswered.delete(cancel);
      linked?.dispose();
      onCancel?.dispose();
      source.dispose();
    }
  }
  /**
   * A transport error `e` of `what` (write EPIPE, the connection closed or disposed): when the process is ending, the
   * error that says how it ended (SidecarExitedError; its exit is waited for at most 2 s), or that its output is
   * unreadable (SidecarStreamError); `e` otherwise.
   */
  private async whyGone(what: string, e: unknown, doing?: string): Promise<unknown> {
    if (this.streamError && !this.processGone) return new SidecarStreamError(what, this.streamError, this.stdoutHead);
    const info = await Promise.race([this.exitInfo, new Promise<undefined>((r) => setTimeout(() => r(undefined), 2000).unref())]);
    if (info) return new SidecarExitedError(what, info, doing);
    if (this.streamError) return new SidecarStreamError(what, this.streamError, this.stdoutHead);
    return e;
  }
  /**
   * `initialize` then `initialized`. Bounded: without an answer within `opts.timeoutMs` (default 30 s) it
   * rejects with a SidecarTimeoutError (quoting the start of stdout when that was not JSON-RPC framing).
   * A server that exits right after its answer, before `initialized` could be written to it, rejects
   * with a SidecarExitedError too.
   */
  initialize(params: InitializeParams = {}, opts: InitializeOptions = {}): Promise<InitializeResult> {
    const answered = this.request<InitializeResult>('initialize', { protocolVersion: 1, ...params }).then(async (r) => {
      try {
        await this.connection.sendNotification('initialized', {});
      } catch (e) {   // (write EPIPE, the connection closed: the process is gone) as a request's would
        throw await this.whyGone('the initialized notification', e, 'receiving');
      }
      return r;
    });
    const ms = opts.timeoutMs ?? DEFAULT_INITIALIZE_TIMEOUT_MS;
    if (!ms || ms === Infinity) return answered;
    let timer: NodeJS.Timeout | undefined;
    const late = new Promise<never>((_, reject) => {
      timer = setTimeout(() => {
        // stdout that does not start with a frame header: something printed outside the protocol
        const head = this.stdoutHead;
        const notFramed = head && !/^content-(length|type)\s*:/i.test(head) ? head : '';
        reject(new SidecarTimeoutError('initialize', ms, this.stderrBuf, notFramed));
      }, ms);
      timer.unref();
    });
    answered.catch(() => { /* reported through the race */ });
    return Promise.race([answered, late]).finally(() => clearTimeout(timer));
  }
  ping(): Promise<P.Empty> { return this.request('ping', {}); }
  createBranch(p: CreateBranchParams = {}): Promise<P.BranchIdResult> { return this.request<P.BranchIdResult>('createBranch', p); }
  forkBranch(branchId: string): Promise<P.BranchIdResult> { return this.request('forkBranch', { branchId }); }
  deleteBranch(branchId: string): Promise<P.Empty> { return this.request('deleteBranch', { branchId }); }
  listBranches(): Promise<P.ListBranchesResult> { return this.request('listBranches', {}); }
  branchMessages(branchId: string, offset?: number, limit?: number): Promise<{ messages: Message[]; total: number }> {
    return this.request('branchMessages', { branchId, ...(offset !== undefined && { offset }), ...(limit !== undefined && { limit }) });
  }
  /** `branchId` omitted: the server-wide policies; given (even `''`), that branch's (-32012 when there is none). */
  listTools(branchId?: string): Promise<P.ListToolsResult> {
    return this.request('listTools', branchId !== undefined ? { branchId } : {});
  }
  /**
   * `branchId` omitted: the server-wide decision; given (even `''`), that branch's only (-32012 when there is none,
   * never the server-wide decision instead).
   */
  authorizeTool(tool: string, decision: PolicyDecision, branchId?: string): Promise<P.AuthorizeToolResult> {
    return this.request('authorizeTool', { tool, decision, ...(branchId !== undefined && { branchId }) });
  }
  registerClientTools(tools: P.ClientToolSpec[]): Promise<P.RegisterClientToolsResult> {
    return this.request('registerClientTools', { tools });
  }

  /**
   * operate; with `onProgress` a fresh workDoneToken is sent (unless params has one) and every
   * `$/progress` value for it is delivered in order (`onNotification('$/progress', ...)` listeners get them
   * too). Cancelling `token` sends `$/cancelRequest`; the promise then rejects at once with a ResponseError
   * of code -32800. `onProgress` still gets the values the server sends until it answers the cancelled
   * request (its last one, `end` with message `cancelled`), unless a new operate reuses that workDoneToken.
   */
  async operate(params: OperateParams, opts: OperateOptions = {}): Promise<OperateResult> {
    const p: OperateParams = { ...params };
    const onProgress = opts.onProgress;
    if (!onProgress) return this.call<OperateResult>('operate', p, opts.token);
    if (p.workDoneToken === undefined) p.workDoneToken = `operate-${process.pid}-${++tokenCounter}`;
    const key = p.workDoneToken;
    if (this.progressHandlers.get(key)?.settled === false) throw new Error(`Progress handler for token ${key} already registered`);
    const entry = { handler: onProgress, settled: false };
    this.progressHandlers.set(key, entry);
    const release = () => { if (this.progressHandlers.get(key) === entry) this.progressHandlers.delete(key); };
    let answer: Promise<unknown> | undefined;
    try {
      return await this.call<OperateResult>('operate', p, opts.token, (a) => { answer = a; });
    } finally {
      entry.settled = true;
      // kept until the server's answer (or the end of the connection), for the progress it sends after a cancel
      if (answer) void answer.then(release); else release();
    }
  }

  /**
   * shutdown + exit, then the end of its stdin; kills the process if it has not exited within `timeoutMs`. The requests still
   * waiting for their answer are cancelled first (`$/cancelRequest`, so the shutdown answer does not wait for them; they reject
   * with -32800). With an unreadable stream (SidecarStreamError) it closes the server's stdin instead, which makes it exit.
   * A `stop()` called while one runs returns that one's promise (one shutdown, one exit).
   */
  stop(timeoutMs = 5000): Promise<number | string | null> {
    this.stopped ??= this.stopOnce(timeoutMs);
    return this.stopped;
  }
  private async stopOnce(timeoutMs: number): Promise<number | string | null> {
    if (this.running) {
      const timer = (ms: number) => new Promise<'timeout'>((r) => setTimeout(() => r('timeout'), ms).unref());
      if (!this.streamError) {  // (with an unreadable stream nothing could be answered: only the end of its input)
        for (const cancel of this.unanswered) cancel();   // written before shutdown (one write queue, in order)
        try {
          await Promise.race([this.request('shutdown'), timer(timeoutMs)]);
        } catch { /* already gone, or refused: exit anyway */ }
        try { await this.connection.sendNotification('exit'); } catch { /* already gone */ }
      }
      this.process.stdin?.end();  // the end of its input: a server that did not take `exit` ends on that
      if ((await Promise.race([this.exited, timer(timeoutMs)])) === 'timeout') this.process.kill('SIGKILL');
    }
    return this.exited;
  }

  /** Hard stop. */
  kill(): void { if (this.running) this.process.kill('SIGKILL'); }
}
