// Integration test module for chats switched, deleted or changed under a turn (scripts/run-itest.mjs --suite chats).
// Runs INSIDE the real extension host against the real server (scripted models, the workspace settings of the main
// suite) and writes a JSON report to $OPERATE_SIDECAR_ITEST_REPORT: a turn that ends while another chat was picked and
// the chat view was built again keeps to its own chat; a message sent in a chat whose branch was deleted elsewhere
// goes to a new chat, saying so; the picked model removed from the settings is said once.
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import * as vscode from 'vscode';
import type { OperateSidecarApi } from '../extension';
import { type Check, EXT_ID, checkRunner, exec, expect, recordMessages, scripted, until, within, writeReport } from './harness';

export async function run(): Promise<void> {
  const checks: Check[] = [];
  let api: OperateSidecarApi | undefined;
  let fatal: string | undefined;
  /** Every information, warning and error message the extension showed (its own `vscode.window`, passed through). */
  const shown: string[] = [];
  /** Those since `from`, but the warning about the settings' broken tool module (said at every server start). */
  const since = (from: number) => shown.slice(from).filter((m) => !m.includes('no_such_module_xyz'));
  const check = checkRunner(checks);
  /** Pages of the chat view that had not loaded 10 s after being shown, dropped and built again (see the first checks). */
  let webviewStalls = 0;
  try {
    await check('activate the extension; its messages are recorded', async () => {
      const ext = vscode.extensions.getExtension<OperateSidecarApi>(EXT_ID);
      expect(ext, `extension ${EXT_ID} not found`);
      recordMessages(ext, shown, ['showInformationMessage', 'showWarningMessage', 'showErrorMessage']);
      api = await within(ext.activate(), 'activate');
    });
    if (!api) throw new Error('activation failed');
    const A = api;
    const python = vscode.workspace.getConfiguration('operateSidecar').get<string[]>('command')![0];
    const flags = fs.mkdtempSync(path.join(os.tmpdir(), 'chats-itest-'));

    // chat A's turn ends (Stop; the model fails) while chat B, picked during the turn, is the current chat and the chat
    // view was hidden and shown again (its page built anew: it reads the chat again)
    for (const how of ['stopped', 'failed'] as const) {
      await check(`a turn ${how} while another chat was picked and the chat view hidden and shown again stays in its own chat, marked, after switching back`, async () => {
        const b = await exec<string>('operateSidecar.newBranch', { name: `chat B ${how}`, chatModel: scripted(`reply in B ${how}`) });
        const ob: any = await exec('operateSidecar.chat', `hello B ${how}`);
        expect(ob && !ob.error, `B's turn: ${JSON.stringify(ob)}`);
        // a model that waits (Stop ends it), or one that fails once the test says so (a CLI model waiting for a file)
        const flag = path.join(flags, how);
        const model = how === 'stopped' ? scripted({ text: 'too late', delayMs: 120000 })
          : { provider: 'cli', profile: 'llm', command: [python, '-c',
            'import os, sys, time\nwhile not os.path.exists(sys.argv[1]): time.sleep(0.02)\nsys.exit("provider down")', flag, '{prompt}'] };
        const a = await exec<string>('operateSidecar.newBranch', { name: `chat A ${how}`, chatModel: model });
        // (sent at once: chat A's history may still be being read when B is picked; the read still shows, under the turn)
        const question = `question in A (${how})`;
        const turn = Promise.resolve(vscode.commands.executeCommand<any>('operateSidecar.chat', question));
        let o: any;
        let during: string[] = [];
        let status = '';
        try {
          await until(() => A.chatStats().running, 'the turn runs');
          await exec('operateSidecar.pickBranch', { branchId: b });   // the user picks chat B
          expect(A.currentBranch() === b, `current: ${A.currentBranch()}`);
          const ready = A.chatStats().viewReady;
          // the Explorer takes the side bar: the chat is hidden (its page goes); then shown again: a new page
          // reports ready and the chat is read again. Each step is awaited as the extension host sees it.
          // The workbench's webview host (VS Code 1.99 on the web) can leave a page built right after the
          // one before it went waiting for its service worker for ~30 s (the browser's console: "Found
          // unexpected service worker controller ... Waiting for controllerchange"; reworked upstream in
          // microsoft/vscode#312020): a page that has not loaded after 10 s is dropped the same way (hidden,
          // shown) at most twice, as a user would, and counted in the report.
          for (let attempt = 0; ; attempt++) {
            await exec('workbench.view.explorer');
            await until(() => !A.chatStats().visible, 'the chat view hidden');
            await exec('operateSidecar.openChat');
            await until(() => A.chatStats().visible, 'the chat view shown again');
            try {
              await until(() => A.chatStats().viewReady > ready, 'the chat view built again (its page reported ready)', attempt < 2 ? 10000 : undefined);
              break;
            } catch (e) {
              if (attempt >= 2) throw e;
              webviewStalls++;
            }
          }
          during = A.chatTurns().map((t) => t.user);
          status = A.statusText();
          expect(A.chatStats().running, 'the turn ended early');
        } finally {   // (whatever failed: the turn ends, the next check starts with none running)
          if (how === 'stopped') await exec('operateSidecar.stop');
          else fs.writeFileSync(flag, '');
          o = await within(turn, 'the turn ends');
        }
        expect(how === 'stopped' ? o?.cancelled : o?.error, `outcome: ${JSON.stringify(o)}`);
        // the turn over, the chat picked meanwhile is shown: B's own turns only
        await until(() => !A.chatStats().running && A.chatTurns().some((t) => t.user === `hello B ${how}`), 'chat B shown');
        const inB = A.chatTurns().map((t) => t.user);
        expect(!inB.includes(question), `chat B shows A's turn: ${JSON.stringify(inB)}`);
        await exec('operateSidecar.pickBranch', { branchId: a });   // back to chat A
        await until(() => !A.chatTurns().some((t) => t.user === `hello B ${how}`), 'chat A shown');
        const inA = A.chatTurns();
        expect(inA.length === 1 && inA[0].user === question && inA[0].outcome === how,
          `chat A lost its ${how} turn (or shows another chat's): ${JSON.stringify(inA)}`);
        // while it ran, the chat (shown again) and the status bar showed the running turn's chat, not B's history with A's turn under it
        expect(during.at(-1) === question && !during.includes(`hello B ${how}`), `shown while it ran: ${JSON.stringify(during)}`);
        expect(status.includes(`chat A ${how}`) && status.includes('running'), `the status bar while it ran: ${status}`);
      });
    }

    await check('a message in a chat whose branch was deleted elsewhere goes to a new chat, saying so; the next one too', async () => {
      const gone = await exec<string>('operateSidecar.newBranch', { name: 'chat gone', chatModel: scripted('first reply', 'second reply', 'third reply') });
      const o0: any = await exec('operateSidecar.chat', 'first');
      expect(o0 && !o0.error && o0.branchId === gone, `first: ${JSON.stringify(o0)}`);
      await within(A.client()!.deleteBranch(gone), 'deleteBranch');   // as another window's chat picker would
      await exec('operateSidecar.pickModel', { model: 'twice' });   // (the model of the chats made from now on: two replies)
      const before = shown.length;
      const o1: any = await exec('operateSidecar.chat', 'second');
      expect(o1 && !o1.error && !o1.cancelled && o1.branchId && o1.branchId !== gone, `second: ${JSON.stringify(o1)}`);
      expect(A.currentBranch() === o1.branchId, `current ${A.currentBranch()}, the turn's ${o1.branchId}`);
      const told = since(before);
      expect(told.length === 1 && /^showInformationMessage: .*"chat gone" was deleted.*new chat/.test(told[0]), `messages: ${JSON.stringify(told)}`);
      const turns = A.chatTurns();
      expect(turns.length === 1 && turns[0].user === 'second' && !turns[0].outcome, `the new chat: ${JSON.stringify(turns)}`);
      const o2: any = await exec('operateSidecar.chat', 'third');
      expect(o2 && !o2.error && o2.branchId === o1.branchId && since(before).length === 1, `third: ${JSON.stringify(o2)}; ${JSON.stringify(since(before))}`);
      expect(JSON.stringify(A.chatTurns().map((t) => t.user)) === '["second","third"]', `turns: ${JSON.stringify(A.chatTurns())}`);
    });

    await check('the picked model removed from the settings: the server restarts, an information message names it and the model used now', async () => {
      await exec('operateSidecar.pickModel', { model: 'twice2' });
      const cfg = vscode.workspace.getConfiguration('operateSidecar');
      const settings = JSON.parse(JSON.stringify(cfg.get('settings'))) as { models: Record<string, unknown>; defaultModel: string };
      delete settings.models.twice2;
      const pid = A.client()?.process.pid;
      const before = shown.length;
      await within(cfg.update('settings', settings, vscode.ConfigurationTarget.Workspace), 'update the settings');
      await until(() => !!A.client()?.running && A.client()!.process.pid !== pid && !A.statusText().includes('twice2'), 'the restart');
      await until(() => since(before).length > 0, 'a message');
      const told = since(before);
      expect(told.length === 1 && /^showInformationMessage: .*"twice2".*no longer.*"stream"/.test(told[0]), `messages: ${JSON.stringify(told)}`);
      expect(A.statusText().includes('default model'), `status bar: ${A.statusText()}`);
    });
  } catch (e) {
    fatal = e instanceof Error ? e.stack ?? e.message : String(e);
  }
  writeReport(checks, fatal, { shown, webviewStalls, outputChannel: api?.outputText().slice(-6000) ?? '' });
}
