// VS Code front end for operate-sidecar. All protocol work lives in rpcClient.ts.
import * as fs from 'node:fs';
import * as vscode from 'vscode';
import {
  CancellationTokenSource, ErrorCodes, InitializeResult, Json, JsonObject, OperateParams, OperateResult,
  PERMISSION_OPTIONS, PermissionDecision, PermissionRequest, PolicyDecision, ResponseError, SidecarClient, ToolEvent,
} from './rpcClient';

const CHANNEL = 'operate-sidecar';

/** Arguments of `operateSidecar.operate` (a plain string is the instruction). */
export interface OperateCommandArgs extends Partial<OperateParams> {
  /** Answer permission requests of this operate with this decision instead of asking. */
  permissionAnswer?: PermissionDecision;
  /** Open the result as an untitled JSON document (default true). */
  showResult?: boolean;
}

/** What `activate` returns (used by the integration test and by other extensions). */
export interface OperateSidecarApi {
  /** Everything written to the "operate-sidecar" output channel, in order. */
  outputText(): string;
  client(): SidecarClient | undefined;
  currentBranch(): string | undefined;
  initializeResult(): InitializeResult | undefined;
}

class Sidecar {
  private client: SidecarClient | undefined;
  private starting: Promise<SidecarClient> | undefined;
  private initResult: InitializeResult | undefined;
  private branchId: string | undefined;
  private readonly running = new Set<CancellationTokenSource>();
  /** branchId -> pre-answered decision, for operates started with `permissionAnswer`. */
  private readonly preAnswers = new Map<string, PermissionDecision>();
  private transcript = '';
  readonly channel: vscode.OutputChannel;
  readonly serverChannel: vscode.OutputChannel;

  constructor(private readonly ctx: vscode.ExtensionContext) {
    this.channel = vscode.window.createOutputChannel(CHANNEL);
    this.serverChannel = vscode.window.createOutputChannel(`${CHANNEL} (server stderr)`);
    ctx.subscriptions.push(this.channel, this.serverChannel);
  }

  // ---- output ----------------------------------------------------------------------------------
  append(text: string): void { this.transcript += text; this.channel.append(text); }
  line(text: string): void { this.append(text + '\n'); }
  outputText(): string { return this.transcript; }
  currentBranch(): string | undefined { return this.branchId; }
  initializeResult(): InitializeResult | undefined { return this.initResult; }
  currentClient(): SidecarClient | undefined { return this.client; }

  // ---- server lifecycle ------------------------------------------------------------------------
  ensure(): Promise<SidecarClient> {
    if (this.client?.running) return Promise.resolve(this.client);
    if (!this.starting) {
      this.starting = this.start().finally(() => { this.starting = undefined; });
    }
    return this.starting;
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
    const command = cfg.get<string[]>('command', ['operate-sidecar']);
    const settings: JsonObject = { ...(cfg.get<JsonObject>('settings') ?? {}) };
    settings.stateDir = this.stateDir(cfg, settings);
    const folders = (vscode.workspace.workspaceFolders ?? []).filter((f) => f.uri.scheme === 'file').map((f) => f.uri.fsPath);
    const env = { ...process.env, ...(cfg.get<Record<string, string>>('env') ?? {}) };
    this.line(`[server] starting ${JSON.stringify(command)}`);
    const client = await SidecarClient.start({
      command, cwd: folders[0], env, onStderr: (t) => this.serverChannel.append(t),
    });
    client.onToolEvent((e) => this.onToolEvent(e));
    client.onLogMessage((m) => {
      this.line(`[${['', 'error', 'warning', 'info', 'log'][m.type] ?? 'log'}] ${m.message}`);
      // "warnings the user should see" (PROTOCOL §6): not awaited, so never blocks a headless run
      if (m.type === 1) void vscode.window.showErrorMessage(`operate-sidecar: ${m.message}`);
      if (m.type === 2) void vscode.window.showWarningMessage(`operate-sidecar: ${m.message}`);
    });
    client.setPermissionHandler((req, token) => this.askPermission(req, token));
    void client.exited.then((code) => {
      this.line(`[server] exited (${code})`);
      if (this.client === client) this.client = undefined;
    });
    try {
      this.initResult = await client.initialize({
        clientInfo: { name: 'vscode', version: vscode.version },
        processId: process.pid,
        capabilities: { toolPermission: true, clientTools: false },
        workspaceFolders: folders,
        settings,
      });
    } catch (e) {
      client.kill();
      throw e;
    }
    this.client = client;
    this.branchId = undefined;
    const caps = this.initResult.capabilities;
    this.line(`[server] ${this.initResult.serverInfo.name} ${this.initResult.serverInfo.version}; models: ${caps.models.join(', ')}; stateDir: ${caps.stateDir}`);
    return client;
  }

  async stop(): Promise<void> {
    for (const s of this.running) s.cancel();
    const c = this.client ?? (this.starting ? await this.starting.catch(() => undefined) : undefined);
    this.client = undefined;
    if (c) await c.stop();
  }

  // ---- server → client -------------------------------------------------------------------------
  private onToolEvent(e: ToolEvent): void {
    const extra = e.event === 'post' ? ` -> ${e.resultSummary ?? ''}` : e.error ? ` !! ${e.error}` : '';
    const ms = e.durationMs !== undefined ? ` (${Math.round(e.durationMs)} ms)` : '';
    this.line(`\n[tool ${e.event}] ${e.tool} ${e.argsSummary}${extra}${ms} [${e.callId}]`);
  }

  private async askPermission(req: PermissionRequest, token: vscode.CancellationToken): Promise<PermissionDecision> {
    const pre = this.preAnswers.get(req.branchId)
      || (vscode.workspace.getConfiguration('operateSidecar').get<string>('permissionAnswer') as PermissionDecision | '');
    let decision: PermissionDecision;
    if (pre && PERMISSION_OPTIONS.includes(pre)) {
      decision = pre;
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
    if (!this.branchId) this.branchId = (await client.createBranch({})).branchId;
    return this.branchId;
  }

  async operate(arg?: string | OperateCommandArgs): Promise<OperateResult | undefined> {
    const args: OperateCommandArgs = typeof arg === 'string' ? { instruction: arg } : { ...(arg ?? {}) };
    const { permissionAnswer, showResult = true, ...rest } = args;
    if (rest.instruction === undefined && rest.instruct === undefined) {
      const text = await vscode.window.showInputBox({ prompt: 'operate-sidecar: instruction', ignoreFocusOut: true });
      if (!text) return undefined;
      rest.instruction = text;
    }
    if (rest.context === undefined && rest.instruct === undefined) {
      const ed = vscode.window.activeTextEditor;
      const sel = ed && !ed.selection.isEmpty ? ed.document.getText(ed.selection) : '';
      if (sel) rest.context = sel;
    }
    const client = await this.ensure();
    const branchId = await this.branch(client, rest.branchId);
    const params: OperateParams = { ...rest, branchId };
    if (permissionAnswer) this.preAnswers.set(branchId, permissionAnswer);
    const source = new CancellationTokenSource();
    this.running.add(source);
    this.line(`\n=== operate [${branchId}] ${JSON.stringify(params.instruction ?? params.instruct).slice(0, 200)}`);
    try {
      const out = await vscode.window.withProgress(
        { location: vscode.ProgressLocation.Notification, title: 'operate-sidecar', cancellable: true },
        async (progress, token) => {
          const sub = token.onCancellationRequested(() => source.cancel());
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
      this.line(`=== ${e instanceof ResponseError && e.code === ErrorCodes.Cancelled ? 'cancelled' : 'error'}: ${msg}`);
      void vscode.window.showErrorMessage(`operate-sidecar: ${msg}`);
      throw e;
    } finally {
      this.running.delete(source);
      source.dispose();
      if (permissionAnswer) this.preAnswers.delete(branchId);
    }
  }

  cancel(): number {
    const n = this.running.size;
    for (const s of this.running) s.cancel();
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
    const branchId = arg?.branchId ?? this.branchId ?? await this.pickBranch(client, arg !== undefined);
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
    this.branchId = branchId;
    this.line(`[branch] new ${branchId}`);
    return branchId;
  }

  async forkBranch(arg?: { branchId?: string }) {
    const client = await this.ensure();
    const from = arg?.branchId ?? this.branchId ?? await this.pickBranch(client, arg !== undefined);
    if (!from) return undefined;
    const { branchId } = await client.forkBranch(from);
    this.branchId = branchId;
    this.line(`[branch] forked ${from} -> ${branchId}`);
    return branchId;
  }

  async listTools(arg?: { branchId?: string; authorize?: { tool: string; decision: PolicyDecision; branchId?: string } }) {
    const client = await this.ensure();
    if (arg?.authorize) {
      const a = arg.authorize;
      const r = await client.authorizeTool(a.tool, a.decision, a.branchId);
      this.line(`[policy] ${r.tool} -> ${r.decision} (${r.branchId ?? 'server-wide'})`);
    }
    const branchId = arg?.branchId ?? this.branchId;
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

  private async pickBranch(client: SidecarClient, nonInteractive: boolean): Promise<string | undefined> {
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

  async restart(): Promise<InitializeResult> {
    this.line('[server] restarting');
    await this.stop();
    await this.ensure();
    return this.initResult!;
  }
}

let sidecar: Sidecar | undefined;

export function activate(ctx: vscode.ExtensionContext): OperateSidecarApi {
  const s = new Sidecar(ctx);
  sidecar = s;
  const reg = (id: string, fn: (...a: any[]) => unknown) =>
    ctx.subscriptions.push(vscode.commands.registerCommand(`operateSidecar.${id}`, fn));
  reg('operate', (a?: string | OperateCommandArgs) => s.operate(a));
  reg('cancel', () => s.cancel());
  reg('showMessages', (a?: { branchId?: string; show?: boolean }) => s.showMessages(a));
  reg('newBranch', (a?: { system?: string; name?: string }) => s.newBranch(a));
  reg('forkBranch', (a?: { branchId?: string }) => s.forkBranch(a));
  reg('listTools', (a?: { branchId?: string }) => s.listTools(a));
  reg('restart', () => s.restart());
  ctx.subscriptions.push(vscode.workspace.onDidChangeConfiguration((e) => {
    if (e.affectsConfiguration('operateSidecar.command') || e.affectsConfiguration('operateSidecar.settings')
      || e.affectsConfiguration('operateSidecar.stateDir') || e.affectsConfiguration('operateSidecar.env')) {
      s.line('[server] configuration changed; run "operate-sidecar: Restart Server" to apply');
    }
  }));
  return {
    outputText: () => s.outputText(),
    client: () => s.currentClient(),
    currentBranch: () => s.currentBranch(),
    initializeResult: () => s.initializeResult(),
  };
}

export async function deactivate(): Promise<void> {
  await sidecar?.stop();
  sidecar = undefined;
}
