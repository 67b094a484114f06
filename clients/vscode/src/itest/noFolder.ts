// Integration test module for a window with no folder open (scripts/run-itest.mjs --suite no-folder:
// the settings are user settings). Runs INSIDE the real extension host against the real server
// (scripted models) and writes a JSON report to $OPERATE_SIDECAR_ITEST_REPORT.
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import * as vscode from 'vscode';
import type { OperateSidecarApi } from '../extension';
import { type Check, EXT_ID, checkRunner, exec, expect, recordMessages, within, writeReport } from './harness';

const FILE_TOOLS = ['read_file', 'write_file', 'edit_file', 'list_dir', 'search_text'];

export async function run(): Promise<void> {
  const checks: Check[] = [];
  let api: OperateSidecarApi | undefined;
  let fatal: string | undefined;
  /** Every error and warning message the extension showed (its own `vscode.window`, passed through). */
  const shown: string[] = [];
  const check = checkRunner(checks);
  try {
    await check('activate the extension in a window with no folder open; its messages are recorded', async () => {
      const ext = vscode.extensions.getExtension<OperateSidecarApi>(EXT_ID);
      expect(ext, `extension ${EXT_ID} not found`);
      recordMessages(ext, shown, ['showErrorMessage', 'showWarningMessage']);
      api = await within(ext.activate(), 'activate');
      expect(vscode.workspace.workspaceFolders === undefined, `folders: ${JSON.stringify(vscode.workspace.workspaceFolders)}`);
    });
    if (!api) throw new Error('activation failed');

    await check('the chat answers a plain question with no folder open (a new chat, the reply shown); no error or warning shown', async () => {
      await exec('operateSidecar.pickModel', { model: 'twice' });
      await exec('operateSidecar.newChat');
      const o: any = await exec('operateSidecar.chat', 'What is a monad?');
      expect(o && !o.error && !o.cancelled && o.result?.result === 'Noted.', `outcome: ${JSON.stringify(o)}`);
      expect(api!.initializeResult()?.capabilities && api!.notices().length === 0 && shown.length === 0,
        `notices: ${JSON.stringify(api!.notices())}; messages: ${JSON.stringify(shown)}`);
    });

    await check('no file tools are offered to the model with no folder open (the server has no workspace to root them in)', async () => {
      const r: any = await exec('operateSidecar.listTools', {});
      const names: string[] = (r?.tools ?? r ?? []).map((t: any) => t.name);
      expect(Array.isArray(names) && !names.some((n) => FILE_TOOLS.includes(n)), `tools: ${JSON.stringify(names)}`);
    });

    await check('#file and #selection with no editor open say why nothing was attached (a chip; the model is told); a file outside any folder goes by its path', async () => {
      for (const t of vscode.window.tabGroups.all.flatMap((g) => g.tabs)) await within(vscode.window.tabGroups.close(t, true), 'close tab');
      await exec('workbench.action.closeAllEditors');
      const o: any = await exec('operateSidecar.chat', 'Explain #file and #selection');
      expect(o && !o.error, `outcome: ${JSON.stringify(o)}`);
      const { messages } = await within(api!.client()!.branchMessages(o.branchId), 'branchMessages');
      const ctx = messages.filter((m) => m.kind === 'instruction').at(-1)!.content.context as any;
      expect(JSON.stringify(ctx?.unavailable) === '["#selection: no file is open in an editor","#file: no file is open in an editor"]'
        && JSON.stringify(ctx.labels) === JSON.stringify(ctx.unavailable) && ctx.file === undefined, `context: ${JSON.stringify(ctx)}`);
      const file = path.join(fs.mkdtempSync(path.join(os.tmpdir(), 'nofolder-')), 'loose.py');
      fs.writeFileSync(file, 'x = 1\n');
      await within(vscode.window.showTextDocument(await within(vscode.workspace.openTextDocument(file), 'open')), 'show');
      await exec('operateSidecar.pickModel', { model: 'twice2' });
      const o2: any = await exec('operateSidecar.chat', 'Explain #file');
      expect(o2 && !o2.error, `outcome: ${JSON.stringify(o2)}`);
      const m2 = (await within(api!.client()!.branchMessages(o2.branchId), 'branchMessages')).messages;
      const c2 = m2.filter((m) => m.kind === 'instruction').at(-1)!.content.context as any;
      expect(c2?.file?.file === file && c2.file.text === 'x = 1\n' && c2.unavailable === undefined, `context: ${JSON.stringify(c2)}`);
      expect(api!.notices().length === 0 && shown.length === 0, `notices: ${JSON.stringify(api!.notices())}; messages: ${JSON.stringify(shown)}`);
    });
  } catch (e) {
    fatal = e instanceof Error ? e.stack ?? e.message : String(e);
  }
  writeReport(checks, fatal, { shown, outputChannel: api?.outputText().slice(-6000) ?? '' });
}
