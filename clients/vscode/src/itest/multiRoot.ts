// Integration test module for a multi-root workspace (scripts/run-itest.mjs --suite multi-root): the
// folders `ws` (first) and `second`, each with src/app.py. Runs INSIDE the real extension host against
// the real server (scripted models) and writes a JSON report to $OPERATE_SIDECAR_ITEST_REPORT.
import * as fs from 'node:fs';
import * as vscode from 'vscode';
import type { OperateSidecarApi } from '../extension';
import { type Check, EXT_ID, checkRunner, exec, expect, within, writeReport } from './harness';


export async function run(): Promise<void> {
  const checks: Check[] = [];
  let api: OperateSidecarApi | undefined;
  let fatal: string | undefined;
  const check = checkRunner(checks);
  try {
    await check('activate the extension in a multi-root workspace (ws, second)', async () => {
      const ext = vscode.extensions.getExtension<OperateSidecarApi>(EXT_ID);
      expect(ext, `extension ${EXT_ID} not found`);
      api = await within(ext.activate(), 'activate');
      const names = (vscode.workspace.workspaceFolders ?? []).map((f) => f.name);
      expect(JSON.stringify(names) === '["ws","second"]', `folders: ${JSON.stringify(names)}`);
    });
    if (!api) throw new Error('activation failed');
    const [first, second] = vscode.workspace.workspaceFolders!.map((f) => f.uri);
    const firstApp = vscode.Uri.joinPath(first, 'src', 'app.py');
    const secondApp = vscode.Uri.joinPath(second, 'src', 'app.py');
    const contextOf = async (branchId: string) => {
      const { messages } = await within(api!.client()!.branchMessages(branchId), 'branchMessages');
      return messages.filter((m) => m.kind === 'instruction').at(-1)!.content.context as any;
    };

    await check('#file and the selection of a file in the second folder are sent as second/src/app.py; of the first folder as src/app.py; #file:<path> takes those names', async () => {
      const ed = await within(vscode.window.showTextDocument(await within(vscode.workspace.openTextDocument(secondApp), 'open')), 'show second');
      ed.selection = new vscode.Selection(0, 0, 0, 3);
      await exec('operateSidecar.pickModel', { model: 'twice' });
      await exec('operateSidecar.newChat');
      const o: any = await exec('operateSidecar.chat', 'Rename #selection in #file');
      expect(o && !o.error, `outcome: ${JSON.stringify(o)}`);
      const c = await contextOf(o.branchId);
      expect(c.file?.file === 'second/src/app.py' && c.file.text === 'two\n', `#file: ${JSON.stringify(c.file)}`);
      expect(c.selection?.file === 'second/src/app.py' && c.selection.text === 'two', `selection: ${JSON.stringify(c.selection)}`);
      expect(JSON.stringify(c.labels) === '["second/src/app.py:1","second/src/app.py"]', `labels: ${JSON.stringify(c.labels)}`);
      const ed1 = await within(vscode.window.showTextDocument(await within(vscode.workspace.openTextDocument(firstApp), 'open')), 'show first');
      ed1.selection = new vscode.Selection(0, 0, 0, 3);
      const o1: any = await exec('operateSidecar.chat', 'And #selection in #file');
      const c1 = await contextOf(o1.branchId);
      expect(c1.file?.file === 'src/app.py' && c1.selection?.file === 'src/app.py', `first folder: ${JSON.stringify(c1)}`);
      // #file:<path> names them the same way: <folder name>/<path> in another folder, the path in the first
      await exec('operateSidecar.pickModel', { model: 'twice2' });
      const o2: any = await exec('operateSidecar.chat', 'Compare #file:second/src/app.py and #file:src/app.py');
      const c2 = await contextOf(o2.branchId);
      expect(JSON.stringify(c2.files?.map((f: any) => [f.file, f.text])) === JSON.stringify([['second/src/app.py', 'two\n'], ['src/app.py', 'one\n']]),
        `#file:<path>: ${JSON.stringify(c2.files)}`);
    });

    await check('an edit of that path lands in the second folder\'s file, not in the first\'s', async () => {
      const doc2 = await within(vscode.workspace.openTextDocument(secondApp), 'open second');
      const doc1 = await within(vscode.workspace.openTextDocument(firstApp), 'open first');
      const r: any = await exec('operateSidecar.operate', { instruction: 'upper-case it', actions: true, chatModel: 'editSecond',
        permissionAnswer: 'allow_once', showResult: false });
      const out = r?.result?.action_responses?.[0]?.output;
      expect(out && !out.error, `edit output: ${JSON.stringify(out)}`);
      expect(doc2.getText() === 'TWO\n' && doc1.getText() === 'one\n', `second: ${JSON.stringify(doc2.getText())}, first: ${JSON.stringify(doc1.getText())}`);
      expect(fs.readFileSync(firstApp.fsPath, 'utf8') === 'one\n', 'the first folder\'s file is untouched on disk');
    });
  } catch (e) {
    fatal = e instanceof Error ? e.stack ?? e.message : String(e);
  }
  writeReport(checks, fatal, { outputChannel: api?.outputText().slice(-6000) ?? '' });
}
