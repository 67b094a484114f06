// Integration test module: runs INSIDE the real VS Code extension host (code-server 4.99.4 = Code
// 1.99.3, see scripts/run-itest.mjs). Drives the extension through its commands against a real
// server with scripted models (configured by the harness in the workspace settings) and writes a
// JSON report to $OPERATE_SIDECAR_ITEST_REPORT. Never throws: every failure lands in the report.
import * as fs from 'node:fs';
import * as vscode from 'vscode';
import type { OperateSidecarApi } from '../extension';

const EXT_ID = 'operate-sidecar.operate-sidecar-vscode';
const STEP_MS = 30_000;

interface Check { name: string; ok: boolean; ms: number; error?: string }

function within<T>(p: Thenable<T>, what: string, ms = STEP_MS): Promise<T> {
  let timer: NodeJS.Timeout;
  const t = new Promise<never>((_, rej) => { timer = setTimeout(() => rej(new Error(`timeout after ${ms} ms: ${what}`)), ms); });
  return Promise.race([Promise.resolve(p), t]).finally(() => clearTimeout(timer));
}
async function until(cond: () => boolean, what: string, ms = STEP_MS): Promise<void> {
  const end = Date.now() + ms;
  while (!cond()) {
    if (Date.now() > end) throw new Error(`timeout after ${ms} ms waiting for ${what}`);
    await new Promise((r) => setTimeout(r, 20));
  }
}
function expect(cond: unknown, msg: string): asserts cond {
  if (!cond) throw new Error(msg);
}
const exec = <T>(cmd: string, ...args: unknown[]) => within(vscode.commands.executeCommand<T>(cmd, ...args), cmd);

export async function run(): Promise<void> {
  const reportPath = process.env.OPERATE_SIDECAR_ITEST_REPORT;
  const checks: Check[] = [];
  let api: OperateSidecarApi | undefined;
  let fatal: string | undefined;
  const check = async (name: string, fn: () => Promise<void>) => {
    const t0 = Date.now();
    try {
      await fn();
      checks.push({ name, ok: true, ms: Date.now() - t0 });
    } catch (e) {
      checks.push({ name, ok: false, ms: Date.now() - t0, error: e instanceof Error ? `${e.message}\n${e.stack ?? ''}`.slice(0, 2000) : String(e) });
    }
  };
  const out = () => api?.outputText() ?? '';
  const outputs = (r: any) => (r.result.action_responses as any[]).map((a) => a.output);

  try {
    await check('activate the extension (explicitly: implicit activation needs a contributed command)', async () => {
      const ext = vscode.extensions.getExtension<OperateSidecarApi>(EXT_ID);
      expect(ext, `extension ${EXT_ID} not found`);
      api = await within(ext.activate(), 'activate');
      const cmds = await within(vscode.commands.getCommands(true), 'getCommands');
      for (const c of ['operate', 'cancel', 'showMessages', 'newBranch', 'forkBranch', 'listTools', 'restart']) {
        expect(cmds.includes(`operateSidecar.${c}`), `command operateSidecar.${c} registered`);
      }
    });
    if (!api) throw new Error('activation failed');

    let branchId = '';
    await check('newBranch with arguments starts the server and journals under globalStorage by default', async () => {
      branchId = (await exec<string>('operateSidecar.newBranch', { system: 'itest system', name: 'itest' }))!;
      expect(typeof branchId === 'string' && branchId.length > 0, `branch id: ${branchId}`);
      expect(api!.currentBranch() === branchId, 'the new branch is current');
      const init = api!.initializeResult();
      expect(init?.protocolVersion === 1, `initialize result: ${JSON.stringify(init)}`);
      const stateDir = init!.capabilities.stateDir;
      expect(stateDir && stateDir.includes('operate-sidecar.operate-sidecar-vscode'), `stateDir is the extension's globalStorage: ${stateDir}`);
    });

    let first: any;
    await check('operate with arguments: streamed deltas reach the OutputChannel in order; selection becomes context; result document', async () => {
      const doc = await within(vscode.workspace.openTextDocument({ content: 'line one\nSELECTED CODE\nline three' }), 'open doc');
      const editor = await within(vscode.window.showTextDocument(doc), 'show doc');
      editor.selection = new vscode.Selection(1, 0, 1, 'SELECTED CODE'.length);
      const before = out().length;
      first = await exec('operateSidecar.operate', { instruction: 'greet the itest' });
      expect(first?.result === 'hello from the scripted model, streamed in pieces' && first.kind === 'text', `result: ${JSON.stringify(first)}`);
      const written = out().slice(before);
      const m = /\[progress\] begin communicate\n([\s\S]*)\n\[progress\] end/.exec(written);
      expect(m, `progress begin/end in the output channel:\n${written}`);
      expect(m[1] === first.result, `deltas in order between begin and end: ${JSON.stringify(m[1])}`);
      expect(written.includes('=== result (text)'), 'result line');
      const shown = vscode.workspace.textDocuments.find((d) => d.isUntitled && d.languageId === 'json' && d.getText().includes('streamed in pieces'));
      expect(shown, 'an untitled JSON document with the result');
      expect(JSON.stringify(JSON.parse(shown.getText())) === JSON.stringify(first), `document content: ${shown.getText()}`);
      const msgs: any = await exec('operateSidecar.showMessages', { show: false });
      const instr = msgs.messages.find((x: any) => x.kind === 'instruction');
      expect(instr?.content?.context === 'SELECTED CODE', `selection sent as context: ${JSON.stringify(instr?.content)}`);
      expect(instr?.content?.instruction === 'greet the itest', 'instruction sent');
    });

    await check('permission request answered by the pre-answer (allow_once): tool runs, toolEvents in the channel', async () => {
      const before = out().length;
      const r: any = await exec('operateSidecar.operate', { instruction: 'call shout', actions: true, chatModel: 'tooly', permissionAnswer: 'allow_once', showResult: false });
      expect(JSON.stringify(outputs(r)) === JSON.stringify(['HEY!']), `outputs: ${JSON.stringify(r)}`);
      const written = out().slice(before);
      const perm = written.indexOf('[permission] shout {"text":"hey"} -> allow_once');
      const pre = written.indexOf('[tool pre] shout');
      const post = written.indexOf('[tool post] shout');
      expect(perm >= 0 && pre > perm && post > pre, `permission, pre, post in order:\n${written}`);
      expect(written.includes('-> HEY!'), 'result summary in the channel');
    });

    await check('permission request answered deny_once: never invoked, denied toolEvent', async () => {
      const before = out().length;
      const r: any = await exec('operateSidecar.operate', { instruction: 'call shout', actions: true, chatModel: 'tooly', permissionAnswer: 'deny_once', showResult: false });
      const o = outputs(r)[0];
      expect(o?.error === 'denied by governance gate' && o.function === 'shout', `denied output: ${JSON.stringify(o)}`);
      const written = out().slice(before);
      expect(written.includes('-> deny_once') && written.includes('[tool denied] shout') && !written.includes('[tool pre] shout'), written);
    });

    await check('listTools (+ window/logMessage for a broken tool module), authorize, forkBranch, showMessages with arguments', async () => {
      const tools: any[] = (await exec('operateSidecar.listTools', { branchId }))!;
      const shout = tools.find((t) => t.name === 'shout');
      expect(shout?.source === 'python' && shout.policy === 'ask', `shout tool: ${JSON.stringify(shout)}`);
      // the broken module in settings.toolModules was reported with window/logMessage (tools load lazily)
      await until(() => /\[warning\] .*no_such_module_xyz/.test(out()), 'window/logMessage warning in the channel');
      const after: any[] = (await exec('operateSidecar.listTools', { branchId, authorize: { tool: 'shout', decision: 'allow', branchId } }))!;
      expect(after.find((t) => t.name === 'shout')?.policy === 'allow', 'branch policy now allow');
      const msgs: any = await exec('operateSidecar.showMessages', { branchId, show: false });
      const fork = await exec<string>('operateSidecar.forkBranch', { branchId });
      expect(fork && fork !== branchId && api!.currentBranch() === fork, `fork ${fork}`);
      const forkMsgs: any = await exec('operateSidecar.showMessages', { branchId: fork, show: false });
      expect(forkMsgs.total === msgs.total && msgs.total >= 7, `fork copies ${msgs.total} messages: ${forkMsgs.total}`);
    });

    await check('cancel command stops a running operate (-32800) and the channel says so', async () => {
      const before = out().length;
      let settled: { err?: any; res?: unknown } | undefined;
      const p = Promise.resolve(vscode.commands.executeCommand('operateSidecar.operate', { instruction: 'wait forever', chatModel: 'slow', showResult: false }))
        .then((res) => { settled = { res }; }, (err) => { settled = { err }; });
      await until(() => out().slice(before).includes('[progress] begin'), 'the slow operate started');
      const n = await exec<number>('operateSidecar.cancel');
      expect(n === 1, `cancelled ${n} operate(s)`);
      await within(p, 'cancelled operate settles');
      expect(settled?.err?.code === -32800, `rejected with -32800: ${JSON.stringify(settled)} ${settled?.err}`);
      expect(out().slice(before).includes('=== cancelled:'), 'channel shows the cancellation');
    });

    await check('restart: a new server process, state journaled in the stateDir survives', async () => {
      const oldPid = api!.client()?.process.pid;
      const init: any = await exec('operateSidecar.restart');
      const newPid = api!.client()?.process.pid;
      expect(init?.protocolVersion === 1 && newPid && newPid !== oldPid, `pids ${oldPid} -> ${newPid}`);
      const msgs: any = await exec('operateSidecar.showMessages', { branchId, show: false });
      expect(msgs.total >= 7, `branch ${branchId} reloaded from the journal with ${msgs.total} messages`);
      const stateDir = init.capabilities.stateDir as string;
      expect(fs.readdirSync(stateDir).length > 0, `journal files in ${stateDir}`);
    });
  } catch (e) {
    fatal = e instanceof Error ? e.stack ?? e.message : String(e);
  }

  const report = {
    ok: !fatal && checks.length > 0 && checks.every((c) => c.ok),
    fatal,
    vscodeVersion: vscode.version,
    appName: vscode.env.appName,
    uiKind: vscode.env.uiKind === vscode.UIKind.Web ? 'web' : 'desktop',
    extensionPath: vscode.extensions.getExtension(EXT_ID)?.extensionPath,
    checks,
    outputChannel: out().slice(-6000),
  };
  if (reportPath) fs.writeFileSync(reportPath + '.tmp', JSON.stringify(report, null, 2));
  if (reportPath) fs.renameSync(reportPath + '.tmp', reportPath);
}
