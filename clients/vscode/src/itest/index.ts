// Integration test module: runs INSIDE the real VS Code extension host (code-server 4.99.4 = Code
// 1.99.3, see scripts/run-itest.mjs). Drives the extension through its commands against a real
// server with scripted models (configured by the harness in the workspace settings) and writes a
// JSON report to $OPERATE_SIDECAR_ITEST_REPORT. Never throws: every failure lands in the report.
//
// The interactive paths (input boxes, quick picks, the progress notification's Cancel button) run
// in the same session: the user's answers are scripted by temporarily replacing showInputBox /
// showQuickPick on the EXTENSION's own `vscode.window` (see extensionVscode), restored after each
// case; Cancel is the real button of the real progress notification, pressed through the
// workbench command `notification.acceptPrimaryAction`. Server, tools and models are real.
import * as fs from 'node:fs';
import * as path from 'node:path';
import * as vscode from 'vscode';
import type { OperateSidecarApi } from '../extension';
import { type Check, EXT_ID, checkRunner, exec, expect, extensionVscode, scripted, until, within, writeReport } from './harness';

/** One scripted answer: an input box's value, a quick pick's choice or a warning's button (undefined = dismissed). */
type Step =
  | { input: string | undefined }
  | { pick: (items: any[], options: any, token?: vscode.CancellationToken) => unknown }
  | { warn: string | undefined }
  /** a createQuickPick picker (the chat picker) once shown: `act` clicks in it through `FakeQuickPick` */
  | { picker: (qp: FakeQuickPick) => void };
interface Prompt { kind: 'input' | 'pick' | 'warn' | 'picker'; items?: any[]; options?: any; token?: vscode.CancellationToken; message?: string }

/** What createQuickPick hands the extension while scripted: the properties it sets, its events, and the user's clicks. */
class FakeQuickPick {
  title?: string; placeholder?: string; matchOnDetail = false; items: any[] = []; selectedItems: any[] = []; activeItems: any[] = [];
  private readonly accepted = new vscode.EventEmitter<void>();
  private readonly hidden = new vscode.EventEmitter<void>();
  private readonly buttonPressed = new vscode.EventEmitter<{ button: any; item: any }>();
  readonly onDidAccept = this.accepted.event;
  readonly onDidHide = this.hidden.event;
  readonly onDidTriggerItemButton = this.buttonPressed.event;
  readonly onDidChangeValue = new vscode.EventEmitter<string>().event;
  readonly onDidChangeActive = new vscode.EventEmitter<any[]>().event;
  readonly onDidChangeSelection = new vscode.EventEmitter<any[]>().event;
  readonly onDidTriggerButton = new vscode.EventEmitter<any>().event;
  disposed = false;
  constructor(private readonly shown: (qp: FakeQuickPick) => void) {}
  show(): void { setTimeout(() => this.shown(this), 0); }
  hide(): void { this.hidden.fire(); }
  dispose(): void { this.disposed = true; }
  /** The user clicks the item's button with this tooltip. */
  press(item: any, tooltip: string): void {
    const button = (item.buttons as any[] | undefined)?.find((b) => b.tooltip === tooltip);
    expect(button, `no "${tooltip}" button on ${item.label}`);
    this.buttonPressed.fire({ button, item });
  }
}
interface ScriptedUi {
  prompts: Prompt[];
  /** options of every withProgress call (passed through to the real one) */
  progress: vscode.ProgressOptions[];
  /** messages of every showErrorMessage call (passed through to the real one) */
  errors: string[];
  /** messages of every showInformationMessage call (passed through to the real one) */
  infos: string[];
}
/** Restores the real UI functions; set while a script is installed. */
let restoreUi: (() => void) | undefined;

/**
 * Runs `fn` with showInputBox/showQuickPick and modal showWarningMessage of the extension's `vscode.window` answering from
 * `steps`, in order; withProgress and showErrorMessage are recorded and passed through. Restores
 * the originals afterwards and fails when a prompt came unexpectedly or a step was left unused.
 */
async function withScriptedUi(win: typeof vscode.window, steps: Step[], fn: (ui: ScriptedUi) => Promise<void>): Promise<void> {
  const w = win as any;
  const orig = { showInputBox: w.showInputBox, showQuickPick: w.showQuickPick, withProgress: w.withProgress, showErrorMessage: w.showErrorMessage,
    showWarningMessage: w.showWarningMessage, showInformationMessage: w.showInformationMessage, createQuickPick: w.createQuickPick };
  const ui: ScriptedUi = { prompts: [], progress: [], errors: [], infos: [] };
  const problems: string[] = [];
  const queue = [...steps];
  const next = (kind: 'input' | 'pick' | 'warn' | 'picker'): any => {
    const s = queue[0];
    if (!s || !(kind in s)) { problems.push(`unexpected ${kind} prompt (next step: ${s ? Object.keys(s)[0] : 'none'})`); return undefined; }
    return queue.shift();
  };
  const fakes = {
    showInputBox: async (options?: vscode.InputBoxOptions, token?: vscode.CancellationToken) => {
      ui.prompts.push({ kind: 'input', options, token });
      return next('input')?.input;
    },
    showQuickPick: async (items: any, options?: any, token?: vscode.CancellationToken) => {
      const list = await items;
      ui.prompts.push({ kind: 'pick', items: list, options, token });
      const s = next('pick');
      return s ? await s.pick(list, options, token) : undefined;
    },
    /** a modal warning (a confirmation): answered from `steps`; other warnings (the server's) pass through */
    showWarningMessage: async (message: string, ...rest: any[]) => {
      const options = rest[0] && typeof rest[0] === 'object' && !('title' in rest[0]) ? rest[0] : undefined;
      if (!options?.modal) return orig.showWarningMessage.call(win, message, ...rest);
      ui.prompts.push({ kind: 'warn', message, options, items: rest.slice(1) });
      return next('warn')?.warn;
    },
    /** the chat picker: a FakeQuickPick; once shown, the next `picker` step clicks in it (none: dismissed) */
    createQuickPick: () => new FakeQuickPick((qp) => {
      ui.prompts.push({ kind: 'picker', items: qp.items, options: { title: qp.title, placeholder: qp.placeholder } });
      const s = next('picker');
      try {
        if (s) s.picker(qp); else qp.hide();
      } catch (e) { problems.push(`picker: ${e instanceof Error ? e.message : String(e)}`); qp.hide(); }
    }),
    showInformationMessage: (message: string, ...rest: any[]) => { ui.infos.push(message); return orig.showInformationMessage.call(win, message, ...rest); },
    withProgress: (options: vscode.ProgressOptions, task: any) => { ui.progress.push(options); return orig.withProgress.call(win, options, task); },
    showErrorMessage: (message: string, ...rest: any[]) => { ui.errors.push(message); return orig.showErrorMessage.call(win, message, ...rest); },
  };
  Object.assign(w, fakes);
  let restored = false;
  const restore = () => {
    if (restored) return;
    restored = true;
    Object.assign(w, orig);
    if (restoreUi === restore) restoreUi = undefined;
  };
  restoreUi = restore;
  try {
    for (const k of Object.keys(fakes) as (keyof typeof fakes)[]) expect(w[k] === fakes[k], `could not replace window.${k}`);
    await fn(ui);
  } finally {
    restore();
  }
  expect(!problems.length, problems.join('; '));
  expect(!queue.length, `${queue.length} scripted answer(s) never asked for`);
}

/** A fresh inline scripted model (inline models are cached by their JSON: `text` keeps it unique) that calls shout once. */
const callsShout = (text: string) => scripted({ json: { action_requests: [{ function: 'shout', arguments: { text } }] } });
const PERMISSION_LABELS = ['Allow once', 'Always allow (this branch)', 'Deny once', 'Always deny (this branch)'];
const pickDecision = (decision: string) => (items: any[]) => items.find((i) => i.decision === decision);

export async function run(): Promise<void> {
  const checks: Check[] = [];
  let api: OperateSidecarApi | undefined;
  let fatal: string | undefined;
  let sameApiInstance: boolean | undefined;
  // a check that timed out must not leave scripted prompts behind
  const check = checkRunner(checks, () => restoreUi?.());
  const out = () => api?.outputText() ?? '';
  /** A mark in the output channel's text (outputText() keeps only its end: marks count all that was written). */
  const mark = () => api?.outputLength() ?? 0;
  /** What the output channel got since `m`, a mark(). */
  const since = (m: number) => { const t = out(); return t.slice(Math.max(0, t.length - (mark() - m))); };
  const outputs = (r: any) => (r.result.action_responses as any[]).map((a) => a.output);
  /** An operate through the command that records how it settled instead of throwing. */
  const startOperate = (args: object) => {
    const s: { done: boolean; err?: any; res?: unknown } = { done: false };
    const p = Promise.resolve(vscode.commands.executeCommand('operateSidecar.operate', args))
      .then((res) => { s.res = res; }, (err) => { s.err = err; }).finally(() => { s.done = true; });
    return { s, p };
  };

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
      const before = mark();
      first = await exec('operateSidecar.operate', { instruction: 'greet the itest', showResult: true });
      expect(first?.result === 'hello from the scripted model, streamed in pieces' && first.kind === 'text', `result: ${JSON.stringify(first)}`);
      const written = since(before);
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
      const before = mark();
      const r: any = await exec('operateSidecar.operate', { instruction: 'call shout', actions: true, chatModel: 'tooly', permissionAnswer: 'allow_once', showResult: false });
      expect(JSON.stringify(outputs(r)) === JSON.stringify(['HEY!']), `outputs: ${JSON.stringify(r)}`);
      const written = since(before);
      const perm = written.indexOf('[permission] shout {"text":"hey"} -> allow_once');
      const pre = written.indexOf('[tool pre] shout');
      const post = written.indexOf('[tool post] shout');
      expect(perm >= 0 && pre > perm && post > pre, `permission, pre, post in order:\n${written}`);
      // the server's summaries, JSON text: the arguments, the string output quoted
      expect(written.includes('[tool pre] shout {"text":"hey"}') && written.includes('-> "HEY!"'), `summaries in the channel:\n${written}`);
    });

    await check('permission request answered deny_once: never invoked, denied toolEvent', async () => {
      const before = mark();
      const r: any = await exec('operateSidecar.operate', { instruction: 'call shout', actions: true, chatModel: 'tooly', permissionAnswer: 'deny_once', showResult: false });
      const o = outputs(r)[0];
      expect(o?.error === 'denied by governance gate' && o.function === 'shout', `denied output: ${JSON.stringify(o)}`);
      const written = since(before);
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

    await check('the output the extension keeps is bounded: after a 250 000-character reply outputText() is the channel\'s last 200 000 characters, its start dropped', async () => {
      const before = mark();
      const big = Array.from({ length: 25_000 }, (_, i) => `w${String(i).padStart(9, '0')}`).join('');
      const bid = (await within(api!.client()!.createBranch({ name: 'itest-long' }), 'createBranch')).branchId;
      const r: any = await exec('operateSidecar.operate', { instruction: 'a long reply', chatModel: scripted({ text: big, chunks: 25 }), branchId: bid, showResult: false });
      expect(r?.result === big, `the whole reply: ${String(r?.result).length} characters`);
      const kept = out();
      expect(mark() - before > big.length && kept.length === 200_000, `kept ${kept.length} of ${mark()} characters written`);
      expect(kept.includes(big.slice(-1000)) && /=== result \(text[^\n]*\)\n$/.test(kept) && !kept.includes('[server] starting'), 'the end kept, the start dropped');
      expect(since(before) === kept, 'a mark from before still finds what came after it');
    });

    await check('cancel command stops a running operate (the server answers -32800; the command resolves, no error) and the channel says so', async () => {
      const before = mark();
      const { s, p } = startOperate({ instruction: 'wait forever', chatModel: 'slow', showResult: false });
      await until(() => since(before).includes('[progress] begin') || s.done, 'the slow operate started');
      const n = await exec<number>('operateSidecar.cancel');
      expect(n === 1, `cancelled ${n} operate(s): ${JSON.stringify(s)}`);
      await within(p, 'cancelled operate settles');
      expect(!s.err && s.res === undefined, `the user's cancel resolves without an error: ${JSON.stringify(s)} ${s.err}`);
      expect(/=== cancelled: .*\(-32800\)/.test(since(before)), 'channel shows the cancellation (-32800)');
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

    // ---- interactive paths: scripted answers on the extension's own window, everything else real ----
    const ext = vscode.extensions.getExtension<OperateSidecarApi>(EXT_ID)!;
    const extVscode = extensionVscode(ext);
    const win = extVscode.window;
    sameApiInstance = extVscode.window === vscode.window;
    const client = () => { const c = api!.client(); expect(c?.running, 'the server is running'); return c; };
    const messagesOf = async (bid: string) => (await within(client().branchMessages(bid), 'branchMessages')).messages;
    const policyOf = async (bid?: string) => (await within(client().listTools(bid), 'listTools')).tools.find((t) => t.name === 'shout')?.policy;
    const freshBranch = async (name: string) => (await within(client().createBranch({ name }), 'createBranch')).branchId;
    /** operate on `branchId` whose (fresh, inline) model asks for shout({text}); no permissionAnswer, so it prompts. */
    const operateShout = (branchId: string, text: string) => exec<any>('operateSidecar.operate',
      { instruction: `call shout with ${text}`, actions: true, chatModel: callsShout(text), branchId, showResult: false });
    /** The user clicks Cancel on the newest notification, which is the operate's progress notification
     *  (its Cancel button exists because withProgress was called with cancellable: true). */
    const pressCancelOnProgress = () => exec('notification.acceptPrimaryAction');

    await check('operate without arguments asks for the instruction (input box); dismissed or empty runs nothing', async () => {
      const bid = (await exec<string>('operateSidecar.newBranch', { name: 'itest-input', chatModel: scripted({ text: 'answer to the typed instruction', chunks: 3 }) }))!;
      const before = mark();
      await withScriptedUi(win, [{ input: undefined }, { input: '' }], async (ui) => {
        expect(await exec('operateSidecar.operate') === undefined, 'dismissed: no result');
        expect(await exec('operateSidecar.operate') === undefined, 'empty: no result');
        expect(ui.prompts.length === 2 && ui.prompts.every((p) => p.kind === 'input' && p.options?.prompt === 'operate-sidecar: instruction'
          && p.options?.ignoreFocusOut === true), `prompts: ${JSON.stringify(ui.prompts)}`);
        expect(ui.progress.length === 0, 'no progress notification');
      });
      expect(!since(before).includes('=== operate'), 'no operate started');
      expect(!(await messagesOf(bid)).some((m) => m.kind === 'instruction'), 'nothing reached the branch');
      await withScriptedUi(win, [{ input: 'typed instruction' }], async (ui) => {
        const r: any = await exec('operateSidecar.operate');
        expect(r?.result === 'answer to the typed instruction' && r.kind === 'text', `result: ${JSON.stringify(r)}`);
        const [o] = ui.progress;
        expect(ui.progress.length === 1 && o.location === vscode.ProgressLocation.Notification && o.cancellable === true && o.title === 'operate-sidecar',
          `progress options: ${JSON.stringify(ui.progress)}`);
      });
      const instr = (await messagesOf(bid)).filter((m) => m.kind === 'instruction');
      expect(instr.length === 1 && instr[0].content.instruction === 'typed instruction', `instruction on the branch: ${JSON.stringify(instr)}`);
      expect(since(before).includes(`=== operate [${bid}] "typed instruction"`), 'the channel shows the operate');
    });

    // [answer of the quick pick (undefined = dismissed), the tool ran, the branch's policy afterwards]
    for (const [answer, ran, policyAfter] of [
      ['allow_once', true, 'ask'], ['deny_once', false, 'ask'], ['allow_always', true, 'allow'], ['deny_always', false, 'deny'],
      [undefined, false, 'ask'],
    ] as const) {
      const what = answer ? `answered ${answer}` : 'dismissed (= deny_once)';
      await check(`permission quick pick for an "ask" tool ${what}: tool ${ran ? 'runs' : 'never runs'}, branch policy ${policyAfter}`, async () => {
        const bid = await freshBranch(`itest-permission-${answer ?? 'dismissed'}`);
        const text = `permission ${answer ?? 'dismissed'}`;
        const before = mark();
        let r: any;
        await withScriptedUi(win, [{ pick: answer ? pickDecision(answer) : () => undefined }], async (ui) => {
          r = await operateShout(bid, text);
          const [p] = ui.prompts;
          expect(p?.kind === 'pick' && JSON.stringify(p.items!.map((i) => i.label)) === JSON.stringify(PERMISSION_LABELS)
            && JSON.stringify(p.items!.map((i) => i.decision)) === JSON.stringify(['allow_once', 'allow_always', 'deny_once', 'deny_always']),
          `quick pick items: ${JSON.stringify(p?.items)}`);
          expect(p.options?.title === 'operate-sidecar: allow tool "shout"?' && p.options?.placeHolder === JSON.stringify({ text })
            && p.options?.ignoreFocusOut === true, `quick pick options: ${JSON.stringify(p.options)}`);
          expect(p.token && !p.token.isCancellationRequested, 'the prompt got a live cancellation token');
        });
        const written = since(before);
        expect(written.includes(`[permission] shout ${JSON.stringify({ text })} -> ${answer ?? 'deny_once'}`), `permission line:\n${written}`);
        const responses = (await messagesOf(bid)).filter((m) => m.kind === 'action_response').map((m) => m.content.output as any);
        if (ran) {
          const shouted = `${text.toUpperCase()}!`;
          expect(JSON.stringify(outputs(r)) === JSON.stringify([shouted]), `operate result: ${JSON.stringify(r)}`);
          expect(responses.length === 1 && responses[0] === shouted, `branch action responses: ${JSON.stringify(responses)}`);
          expect(written.includes('[tool pre] shout') && written.includes(`[tool post] shout`), `tool events:\n${written}`);
        } else {
          expect(outputs(r)[0]?.error === 'denied by governance gate', `operate result: ${JSON.stringify(r)}`);
          expect(responses.length === 1 && responses[0]?.error === 'denied by governance gate', `branch action responses: ${JSON.stringify(responses)}`);
          expect(written.includes('[tool denied] shout') && !written.includes('[tool pre] shout'), `tool events:\n${written}`);
        }
        expect(await policyOf(bid) === policyAfter, `branch policy: ${await policyOf(bid)}`);
        expect(await policyOf() === 'ask', 'the server-wide policy is untouched');
        if (answer === 'allow_always' || answer === 'deny_always') {   // it sticks: the next call is not asked about
          const again = `${text} again`;
          await withScriptedUi(win, [], async (ui) => {
            const o = outputs(await operateShout(bid, again))[0];
            expect(ui.prompts.length === 0, 'not asked again');
            expect(ran ? o === `${again.toUpperCase()}!` : o?.error === 'denied by governance gate', `second call: ${JSON.stringify(o)}`);
          });
        }
      });
    }

    await check('set-policy command: tool quick pick then decision quick pick -> authorizeTool for the current branch; dismissing either changes nothing', async () => {
      const other = await freshBranch('itest-policy-other');
      const bid = (await exec<string>('operateSidecar.newBranch', { name: 'itest-policy' }))!;
      const shoutItem = (items: any[]) => items.find((i) => i.label === 'shout');
      const before = mark();
      await withScriptedUi(win, [{ pick: () => undefined }, { pick: shoutItem }, { pick: () => undefined }], async (ui) => {
        await exec('operateSidecar.listTools');   // dismissed at the tool pick
        await exec('operateSidecar.listTools');   // dismissed at the decision pick
        expect(ui.prompts.length === 3, `prompts: ${ui.prompts.length}`);
      });
      expect(!since(before).includes('[policy]') && await policyOf(bid) === 'ask', 'dismissed: no policy change');
      await withScriptedUi(win, [{ pick: shoutItem }, { pick: (items) => items.find((i) => i === 'allow') }], async (ui) => {
        const tools: any[] = (await exec<any[]>('operateSidecar.listTools'))!;
        const [tp, dp] = ui.prompts;
        expect(tp.items!.length === tools.length && shoutItem(tp.items!)?.description === 'python · ask'
          && tp.options?.title === 'operate-sidecar tools: pick one to change its policy', `tool pick: ${JSON.stringify(tp)}`);
        expect(JSON.stringify(dp.items) === '["allow","deny","ask"]' && dp.options?.title === 'policy for shout on this branch',
          `decision pick: ${JSON.stringify(dp)}`);
      });
      expect(since(before).includes(`[policy] shout -> allow (${bid})`), `policy line:\n${since(before)}`);
      expect(await policyOf(bid) === 'allow', 'listTools: the branch policy is now allow');
      expect(await policyOf(other) === 'ask' && await policyOf() === 'ask', 'another branch and the server-wide policy are untouched');
      await withScriptedUi(win, [], async (ui) => {   // real effect: the tool runs on this branch without asking
        const o = outputs(await operateShout(bid, 'policy allow'))[0];
        expect(ui.prompts.length === 0 && o === 'POLICY ALLOW!', `${ui.prompts.length} prompt(s), output ${JSON.stringify(o)}`);
      });
    });

    await check('new-branch command asks for the system prompt (input box); dismissed creates nothing, empty means no system message', async () => {
      const count = async () => (await within(client().listBranches(), 'listBranches')).branches.length;
      const current = api!.currentBranch();
      const n0 = await count();
      let typed: string | undefined;
      let empty: string | undefined;
      await withScriptedUi(win, [{ input: undefined }, { input: 'typed system prompt' }, { input: '' }], async (ui) => {
        expect(await exec('operateSidecar.newBranch') === undefined, 'dismissed: no branch id');
        expect(api!.currentBranch() === current && await count() === n0, 'dismissed: nothing created, current branch kept');
        typed = await exec<string>('operateSidecar.newBranch');
        expect(typed && api!.currentBranch() === typed, `typed: ${typed} is current`);
        empty = await exec<string>('operateSidecar.newBranch');
        expect(empty && empty !== typed && api!.currentBranch() === empty, `empty: ${empty} is current`);
        expect(ui.prompts.every((p) => p.kind === 'input' && p.options?.prompt === 'operate-sidecar: system prompt for the new branch (optional)'
          && p.options?.ignoreFocusOut === true), `prompts: ${JSON.stringify(ui.prompts)}`);
      });
      expect(await count() === n0 + 2, 'two branches created');
      const sys = (await messagesOf(typed!)).filter((m) => m.kind === 'system');
      expect(sys.length === 1 && sys[0].content.text === 'typed system prompt', `system message: ${JSON.stringify(sys)}`);
      expect(!(await messagesOf(empty!)).some((m) => m.kind === 'system'), 'no system message for an empty answer');
    });

    await check('Delete Branch from the command palette (no argument) asks first, modal, naming the chat: dismissed deletes nothing; "Delete" deletes it; with no current chat it says so', async () => {
      const ids = async () => (await within(client().listBranches(), 'listBranches')).branches.map((b) => b.branchId);
      const before = api!.currentBranch();
      const bid = (await exec<string>('operateSidecar.newBranch', { name: 'itest-delete-me' }))!;
      expect(api!.currentBranch() === bid, 'the branch to delete is current');
      await withScriptedUi(win, [{ warn: undefined }, { warn: 'Delete' }], async (ui) => {
        expect(await exec('operateSidecar.deleteBranch') === false, 'dismissed: deleteBranch resolves false');
        expect((await ids()).includes(bid) && api!.currentBranch() === bid, 'dismissed: the chat is kept, still current');
        expect(await exec('operateSidecar.deleteBranch') === true, 'confirmed: deleteBranch resolves true');
        expect(!(await ids()).includes(bid) && api!.currentBranch() === undefined, 'confirmed: deleted; no current chat');
        expect(ui.prompts.length === 2 && ui.prompts.every((p) => p.kind === 'warn' && p.message === 'Delete the chat "itest-delete-me"?'
          && p.options?.modal === true && JSON.stringify(p.items) === '["Delete"]'), `prompts: ${JSON.stringify(ui.prompts)}`);
      });
      // nothing current: nothing to delete, and nothing asked
      await withScriptedUi(win, [], async () => {
        expect(await exec('operateSidecar.deleteBranch') === false, 'no current chat: false');
      });
      // with an argument (scripts) it deletes without asking
      const other = await freshBranch('itest-delete-by-id');
      await withScriptedUi(win, [], async () => {
        expect(await exec('operateSidecar.deleteBranch', { branchId: other }) === true && !(await ids()).includes(other), 'deleted by id, unasked');
      });
      if (before) await exec('operateSidecar.pickBranch', { branchId: before });
      expect(api!.currentBranch() === before, `the earlier chat is current again: ${api!.currentBranch()}`);
    });

    await check('the chat picker\'s delete button asks first, the same modal as Delete Branch: dismissed deletes nothing; "Delete" deletes that chat', async () => {
      const ids = async () => (await within(client().listBranches(), 'listBranches')).branches.map((b) => b.branchId);
      const before = api!.currentBranch();
      const bid = await freshBranch('itest-picker-delete');
      const pressDelete = (qp: FakeQuickPick) => {
        const item = qp.items.find((i) => i.branchId === bid);
        expect(item, `the chat is in the picker: ${JSON.stringify(qp.items.map((i) => i.label))}`);
        qp.press(item, 'Delete this branch');
      };
      await withScriptedUi(win, [{ picker: pressDelete }, { warn: undefined }, { picker: pressDelete }, { warn: 'Delete' }], async (ui) => {
        await exec('operateSidecar.pickBranch');
        expect((await ids()).includes(bid), 'dismissed: the chat is kept');
        expect(api!.currentBranch() === before, `dismissed: the current chat is unchanged: ${api!.currentBranch()}`);
        await exec('operateSidecar.pickBranch');
        expect(!(await ids()).includes(bid), 'confirmed: the chat is deleted');
        const warns = ui.prompts.filter((p) => p.kind === 'warn');
        expect(JSON.stringify(ui.prompts.map((p) => p.kind)) === '["picker","warn","picker","warn"]' && warns.every((p) =>
          p.message === 'Delete the chat "itest-picker-delete"?' && p.options?.modal === true && /cannot be undone/.test(p.options?.detail)
          && JSON.stringify(p.items) === '["Delete"]'), `prompts: ${JSON.stringify(ui.prompts.map((p) => ({ kind: p.kind, message: p.message, options: p.options, items: p.kind === 'warn' ? p.items : undefined })))}`);
      });
      expect(api!.currentBranch() === before, `the earlier chat is still current: ${api!.currentBranch()}`);
    });

    await check('Cancel on the progress notification: $/cancelRequest, -32800, "cancelled" in the channel, no error message; the server keeps serving', async () => {
      const bid = await freshBranch('itest-cancel-notification');
      const pid = client().process.pid;
      await exec('notifications.clearAll');
      const before = mark();
      await withScriptedUi(win, [], async (ui) => {
        const { s, p } = startOperate({ instruction: 'wait for the cancel', branchId: bid, showResult: false,
          chatModel: scripted({ text: 'too late (notification)', delayMs: 120000 }) });
        await until(() => since(before).includes('[progress] begin') || s.done, 'the slow operate started');
        expect(ui.progress.length === 1 && ui.progress[0].cancellable === true, `progress options: ${JSON.stringify(ui.progress)}`);
        await pressCancelOnProgress();
        await within(p, 'the operate settles after Cancel', 15_000);
        expect(!s.err && s.res === undefined, `the cancel resolves the command: ${JSON.stringify(s)} ${s.err}`);
        expect(ui.errors.length === 0, `no error message for the user's own cancel: ${JSON.stringify(ui.errors)}`);
      });
      expect(since(before).includes('=== cancelled:'), 'the channel says cancelled');
      expect(await exec<number>('operateSidecar.cancel') === 0, 'nothing left running');
      const r: any = await exec('operateSidecar.operate', { instruction: 'after the cancel', branchId: bid, showResult: false,
        chatModel: scripted('still serving after the cancel') });
      expect(r?.result === 'still serving after the cancel' && client().process.pid === pid, `same server answers: ${JSON.stringify(r)}`);
    });

    await check('Cancel while the permission quick pick is open: the server withdraws the prompt (its token is cancelled), the tool never runs', async () => {
      const bid = await freshBranch('itest-cancel-at-prompt');
      await exec('notifications.clearAll');
      const before = mark();
      let promptToken: vscode.CancellationToken | undefined;
      const waitForToken = (_items: any[], _options: any, token?: vscode.CancellationToken) => new Promise((resolve) => {
        promptToken = token;
        const timer = setTimeout(() => resolve(undefined), 20_000);   // bounded even if nothing cancels it
        token?.onCancellationRequested(() => { clearTimeout(timer); resolve(undefined); });
      });
      await withScriptedUi(win, [{ pick: waitForToken }], async (ui) => {
        const { s, p } = startOperate({ instruction: 'call shout, then cancel', actions: true, branchId: bid, showResult: false,
          chatModel: callsShout('cancel at the prompt') });
        await until(() => ui.prompts.length === 1 || s.done, 'the permission prompt is open');
        expect(!s.done && promptToken && !promptToken.isCancellationRequested, `prompt open, operate running: ${JSON.stringify(s)}`);
        await pressCancelOnProgress();
        await within(p, 'the operate settles after Cancel', 15_000);
        expect(!s.err && s.res === undefined, `the cancel resolves the command: ${JSON.stringify(s)} ${s.err}`);
        await until(() => promptToken!.isCancellationRequested, 'the server cancelled requestToolPermission', 10_000);
      });
      const written = since(before);
      expect(written.includes('=== cancelled:') && !written.includes('[tool pre] shout'), `channel:\n${written}`);
      const msgs = await messagesOf(bid);
      const responses = msgs.filter((m) => m.kind === 'action_response');
      // Today the server journals no action_request when the operate is cancelled at the prompt, so this
      // holds trivially; it guards the pairing should one be journaled. The "[tool pre]" check above carries the case.
      expect(msgs.filter((m) => m.kind === 'action_request').every((q) => responses.some((a) => a.content.callId === q.content.callId)),
        `every action_request has its action_response: ${JSON.stringify(msgs)}`);
      expect(!responses.some((a) => a.content.output === 'CANCEL AT THE PROMPT!'), 'the tool never ran');
      expect(await policyOf(bid) === 'ask', 'policy unchanged');
      const r: any = await exec('operateSidecar.operate', { instruction: 'after the cancel', branchId: bid, showResult: false,
        chatModel: scripted('still serving after the prompt was withdrawn') });
      expect(r?.result === 'still serving after the prompt was withdrawn', `the server keeps serving: ${JSON.stringify(r)}`);
    });

    // ---- the chat, the diff review, settings and a dead server ------------------------------------
    const folder = vscode.workspace.workspaceFolders![0].uri;
    const notesUri = vscode.Uri.joinPath(folder, 'notes.txt');
    const disk = () => fs.readFileSync(notesUri.fsPath, 'utf8');
    const proposedTab = () => vscode.window.tabGroups.all.flatMap((g) => g.tabs).find((t) =>
      t.input instanceof vscode.TabInputTextDiff && t.input.modified.scheme === 'operate-sidecar-proposed');

    await check('a long reply streamed in 300 pieces is rendered and shown in batches (at most one render per 50 ms, not one per piece); the whole reply shows when the turn ends', async () => {
      const DRIP = Array.from({ length: 300 }, (_, i) => `w${String(i).padStart(3, '0')}`).join(' ') + ' end.';
      await exec('operateSidecar.pickModel', { model: 'drip' });
      await exec('operateSidecar.newChat');
      const s0 = api!.chatStats();
      const t0 = Date.now();
      const o: any = await exec('operateSidecar.chat', { text: 'Count to 300' });
      const ms = Date.now() - t0;
      const s1 = api!.chatStats();
      const renders = s1.streamUpdates - s0.streamUpdates, deltas = s1.deltas - s0.deltas;
      expect(o && !o.error && !o.cancelled && o.result?.result === DRIP, `outcome: ${JSON.stringify(o).slice(0, 300)}`);
      expect(s1.lastProse === DRIP, `the prose shown at the end is the whole reply: ${s1.lastProse.length} of ${DRIP.length} characters`);
      expect(deltas >= 30, `the reply streamed in pieces: ${deltas}`);
      expect(renders >= 3 && renders < deltas && renders <= Math.ceil(ms / 50) + 2,
        `renders: ${renders} for ${deltas} pieces in ${ms} ms (at most ${Math.ceil(ms / 50) + 2})`);
    });

    await check('Export Chat on an empty chat: an information message says so, no document opens', async () => {
      await exec('operateSidecar.newChat');
      const docs = vscode.workspace.textDocuments.length;
      await withScriptedUi(win, [], async (ui) => {
        expect(await exec('operateSidecar.exportChat') === undefined, 'no document');
        expect(ui.infos.includes('operate-sidecar: nothing to export: the chat is empty'), `information message: ${JSON.stringify(ui.infos)}`);
      });
      expect(vscode.workspace.textDocuments.length === docs, 'no document opened');
    });

    await check('chat command: a turn on a new chat named after the instruction, prose streamed, usage; status bar shows model · chat', async () => {
      await exec('operateSidecar.pickModel', { model: 'chat' });
      await exec('operateSidecar.newChat');
      expect(api!.currentBranch() === undefined, 'new chat: no branch until the first turn');
      const before = api!.chatStats().streamUpdates;
      const o: any = await exec('operateSidecar.chat', { text: 'Say hello' });
      expect(o && !o.error && !o.cancelled && o.result?.result === 'Hello from the **chat**, streamed.', `outcome: ${JSON.stringify(o)}`);
      expect(api!.chatStats().streamUpdates - before >= 1 && api!.chatStats().lastProse === o.result.result,
        `prose shown: ${api!.chatStats().streamUpdates - before} updates, ${JSON.stringify(api!.chatStats().lastProse)}`);
      const b = (await within(client().listBranches(), 'listBranches')).branches.find((x) => x.branchId === o.branchId);
      expect(b?.name === 'Say hello' && api!.currentBranch() === o.branchId, `branch named after the instruction: ${JSON.stringify(b)}`);
      expect(api!.statusText().includes('chat · Say hello'), `status bar: ${api!.statusText()}`);
    });

    await check('diff review: an edit_file preview opens vscode.diff on the proposed text; acceptEdit lands as a WorkspaceEdit (buffer dirty, disk unchanged, undoable)', async () => {
      const doc = await within(vscode.workspace.openTextDocument(notesUri), 'open notes.txt');
      await within(vscode.window.showTextDocument(doc), 'show notes.txt');
      const turn = Promise.resolve(vscode.commands.executeCommand<any>('operateSidecar.chat', { text: 'Upper-case beta' }));
      await until(() => !!proposedTab(), 'the diff editor with the proposed text');
      const input = proposedTab()!.input as vscode.TabInputTextDiff;
      expect(input.original.toString() === notesUri.toString(), `left side is the file: ${input.original}`);
      const proposed = await within(vscode.workspace.openTextDocument(input.modified), 'proposed doc');
      expect(proposed.getText() === 'alpha\nBETA\n', `proposed text: ${JSON.stringify(proposed.getText())}`);
      expect(api!.chatStats().pendingAsks.length === 1, 'a pending card in the chat');
      expect(await exec('operateSidecar.acceptEdit', input.modified) === true, 'acceptEdit took the proposed uri (editor/title)');
      const o: any = await within(turn, 'the turn ends');
      expect(o && !o.error, `outcome: ${JSON.stringify(o)}`);
      expect(doc.getText() === 'alpha\nBETA\n' && doc.isDirty, `buffer: ${JSON.stringify(doc.getText())} dirty=${doc.isDirty}`);
      expect(disk() === 'alpha\nbeta\n', 'the disk is unchanged (the edit is in the buffer)');
      await until(() => !proposedTab(), 'the diff editor closed');
      await within(vscode.window.showTextDocument(doc), 'focus notes.txt');
      await exec('undo');
      expect(doc.getText() === 'alpha\nbeta\n' && !doc.isDirty, `undo restores: ${JSON.stringify(doc.getText())} dirty=${doc.isDirty}`);
      await exec('redo');
      expect(doc.getText() === 'alpha\nBETA\n', 'redo');
      const r = api!.reviews().at(-1);
      expect(r?.decision === 'allow_once' && r.path === notesUri.fsPath, `review record: ${JSON.stringify(r)}`);
    });

    await check('Export Chat: the chat as an unsaved Markdown document, opened: its name, each message, the reply\'s prose, the edit\'s line, its arguments folded, its diff, the usage', async () => {
      const doc: any = await exec('operateSidecar.exportChat');
      const ed = vscode.window.activeTextEditor;
      expect(doc && ed?.document === doc && doc.isUntitled && doc.languageId === 'markdown', `an untitled Markdown editor: ${ed?.document.uri}`);
      const md: string = doc.getText();
      for (const part of ['# Say hello\n', '### You\n\nSay hello\n', 'Hello from the **chat**, streamed.', '### You\n\nUpper-case beta\n',
        '- `✓ edit_file notes.txt +1 −1`\n\n  <details><summary>Arguments and output</summary>\n\n  Arguments:\n\n  ```json\n',
        '  "path": "notes.txt"', '  </details>\n\n  ```diff\n', '  +BETA\n']) {
        expect(md.includes(part), `${JSON.stringify(part)} in the export:\n${md}`);
      }
      expect(/\n\*\S+ in · \S+ out tokens · \d+ model calls?( · \d+ rounds)?\*\n/.test(md), `the usage line:\n${md}`);
      expect(md.indexOf('Say hello') < md.indexOf('Upper-case beta'), 'in order');
      await exec('workbench.action.revertAndCloseActiveEditor');
    });

    await check('two edits of one file in one reply are reviewed one after the other: the second diff opens after the first closes, on the text after the first edit; accept then accept, accept then reject', async () => {
      const doc = await within(vscode.workspace.openTextDocument(notesUri), 'open notes.txt');
      await within(vscode.window.showTextDocument(doc), 'show notes.txt');
      const base = doc.getText();
      const edit = new vscode.WorkspaceEdit();
      edit.insert(notesUri, doc.positionAt(base.length), 'gamma\ndelta\n');
      expect(await within(vscode.workspace.applyEdit(edit), 'add lines'), 'lines added');
      const tabs = () => vscode.window.tabGroups.all.flatMap((g) => g.tabs).filter((t) =>
        t.input instanceof vscode.TabInputTextDiff && t.input.modified.scheme === 'operate-sidecar-proposed');
      const chat = api!.currentBranch();   // a chat of its own; the checks below go on with this one
      await exec('operateSidecar.pickModel', { model: 'twoEdits' });
      await exec('operateSidecar.newChat');
      for (const [word, second] of [['gamma', 'acceptEdit'], ['delta', 'rejectEdit']] as const) {
        const W = word.toUpperCase();
        const before = doc.getText();
        const turn = Promise.resolve(vscode.commands.executeCommand<any>('operateSidecar.chat', { text: `Shout ${word} twice` }));
        const seen: string[] = [];
        let ended: any;
        void turn.then((o) => { ended = o ?? {}; });
        for (const [i, decision] of (['acceptEdit', second] as const).entries()) {
          await until(() => !!ended || tabs().some((t) => !seen.includes((t.input as vscode.TabInputTextDiff).modified.toString())), `diff ${i + 1} of ${word}`);
          expect(!ended, `the turn ended before diff ${i + 1} of ${word}: ${String(JSON.stringify(ended)).slice(0, 1500)}`);
          const all = tabs();
          expect(all.length === 1 && api!.chatStats().pendingAsks.length === 1, `one review at a time: ${all.length} tabs, ${api!.chatStats().pendingAsks.length} asks`);
          const input = all[0].input as vscode.TabInputTextDiff;
          seen.push(input.modified.toString());
          expect(input.original.toString() === notesUri.toString(), `left side is the file: ${input.original}`);
          const after1 = before.replace(word, W);
          expect(doc.getText() === (i ? after1 : before), `the file as the diff shows it (review ${i + 1}): ${JSON.stringify(doc.getText())}`);
          const proposed = (await within(vscode.workspace.openTextDocument(input.modified), 'proposed')).getText();
          expect(proposed === (i ? after1.replace(W, W + '!') : after1), `proposed (review ${i + 1}): ${JSON.stringify(proposed)}`);
          expect(await exec(`operateSidecar.${decision}`, input.modified) === true, `${decision} ${i + 1}`);
          await until(() => !tabs().some((t) => (t.input as vscode.TabInputTextDiff).modified.toString() === input.modified.toString()), `diff ${i + 1} closed`);
        }
        const o: any = await within(turn, 'the turn ends');
        const outs = (o?.result?.result?.action_responses as any[] ?? []).map((r) => r.output);
        const want = second === 'acceptEdit' ? before.replace(word, W + '!') : before.replace(word, W);
        expect(doc.getText() === want, `buffer after ${word}: ${JSON.stringify(doc.getText())}`);
        expect(outs.length === 2 && !outs[0]?.error && (second === 'acceptEdit' ? !outs[1]?.error : outs[1]?.error === 'denied by governance gate'),
          `outputs: ${JSON.stringify(outs)}`);
        expect(JSON.stringify(api!.reviews().slice(-2).map((r) => r.decision)) === JSON.stringify(['allow_once', second === 'acceptEdit' ? 'allow_once' : 'deny_once']),
          `reviews: ${JSON.stringify(api!.reviews().slice(-2))}`);
      }
      await exec('operateSidecar.pickBranch', { branchId: chat });
      await exec('operateSidecar.pickModel', { model: 'chat' });
      // back to the text the next checks expect (buffer and disk)
      const all = new vscode.WorkspaceEdit();
      all.replace(notesUri, new vscode.Range(doc.positionAt(0), doc.positionAt(doc.getText().length)), base);
      expect(await within(vscode.workspace.applyEdit(all), 'restore'), 'restored');
    });

    /**
     * A chat turn sent on a new chat with `model`: `turn` its outcome, `ended()` that outcome once
     * it has ended (else undefined); `after()` waits for its end and goes back to the chat and model
     * the next checks go on with (also after a failure).
     */
    const turnOnNewChat = async (model: string, text: string) => {
      const chat = api!.currentBranch();
      await exec('operateSidecar.pickModel', { model });
      await exec('operateSidecar.newChat');
      const turn = Promise.resolve(vscode.commands.executeCommand<any>('operateSidecar.chat', { text }));
      let outcome: any;
      void turn.then((o) => { outcome = o ?? {}; });
      return {
        turn,
        ended: () => outcome,
        after: async () => {
          await within(turn, 'the turn ends').catch(() => undefined);
          await exec('operateSidecar.pickBranch', { branchId: chat });
          await exec('operateSidecar.pickModel', { model: 'chat' });
        },
      };
    };

    await check('a running tool card shows its arguments (the toolEvent\'s argsSummary is JSON text): title and arguments while the call runs, the output after', async () => {
      const { turn, ended, after } = await turnOnNewChat('napper', 'Take a nap');
      try {
        const nap = () => api!.chatStats().cards.find((c) => c.tool === 'nap');
        await until(() => !!ended() || nap()?.state === 'running', 'the running nap card');
        expect(!ended(), `the turn ended before the card ran: ${String(JSON.stringify(ended())).slice(0, 1000)}`);
        const card = nap()!;
        expect(card.title === '… nap a short rest', `title while it runs: ${JSON.stringify(card.title)}`);
        expect(JSON.stringify(card.args) === JSON.stringify({ note: 'a short rest', seconds: 2 }) && !card.argsCut, `arguments while it runs: ${JSON.stringify(card)}`);
        const o: any = await within(turn, 'the turn ends');
        expect(o && !o.error && o.result?.result?.action_responses?.[0]?.output === 'rested', `outcome: ${JSON.stringify(o).slice(0, 600)}`);
      } finally {
        await after();
      }
    });

    await check('a tool call waiting for your decision says so where you look, also with the chat hidden: the status bar says "waiting for you" (warning background, the tooltip says what to do) and the chat view\'s badge counts it; once decided both are back to a running turn', async () => {
      const { turn, ended, after } = await turnOnNewChat('asker', 'Shout, then wait for me');
      try {
        await until(() => !!ended() || api!.chatStats().pendingAsks.length === 1, 'the request waits');
        expect(!ended(), `the turn ended before the request: ${String(JSON.stringify(ended())).slice(0, 1000)}`);
        // the chat hidden: the Explorer takes the side bar
        await exec('workbench.view.explorer');
        const st = api!.statusItem();
        expect(st.text.endsWith(' · $(bell-dot) waiting for you') && st.background === 'statusBarItem.warningBackground'
          && /a tool call waits for your decision/.test(st.tooltip) && st.command === 'operateSidecar.chat.focus', `the status bar: ${JSON.stringify(st)}`);
        expect(api!.chatStats().badge === 1, `the chat's badge: ${api!.chatStats().badge}`);
        expect(JSON.stringify(api!.chatTurns().at(-1)?.cards) === JSON.stringify(['? shout wait (waiting for you)']), `the card: ${JSON.stringify(api!.chatTurns().at(-1))}`);
        expect(await exec('operateSidecar.acceptEdit', { callId: api!.chatStats().pendingAsks[0] }) === true, 'accepted');
        const decided = api!.statusItem();
        expect(!decided.text.includes('waiting') && decided.background === '' && api!.chatStats().badge === 0,
          `decided: ${JSON.stringify(decided)}, badge ${api!.chatStats().badge}`);
        const o: any = await within(turn, 'the turn ends');
        expect(o && !o.error && o.result?.result?.action_responses?.[0]?.output === 'WAIT!', `outcome: ${JSON.stringify(o).slice(0, 600)}`);
        expect(!api!.statusItem().text.includes('waiting') && !api!.statusItem().text.includes('running'), `ended: ${api!.statusText()}`);
      } finally {
        await after();
      }
    });

    await check('a long chat stays light: while a turn runs in a chat of 120 turns, each redraw posts only the turns that changed to the webview, not the whole conversation', async () => {
      const chat = api!.currentBranch();
      const N = 120;
      const answer = (i: number) => `Answer ${i}: here is **code**\n\n\`\`\`python\n${'def f(x):\n    return x + 1\n'.repeat(8)}\`\`\`\n\n- one\n- two\n`;
      // the branch's own model answers its N turns and one more (the chat turn below)
      const bid = (await within(client().createBranch({ name: 'a long chat',
        chatModel: scripted(...Array.from({ length: N }, (_, i) => answer(i)), 'The last answer.') as any }), 'createBranch')).branchId;
      for (let i = 0; i < N; i++) await within(client().operate({ branchId: bid, instruction: `question ${i}` }), `turn ${i}`);
      try {
        await exec('operateSidecar.pickModel', '');
        await exec('operateSidecar.pickBranch', { branchId: bid });
        await until(() => api!.chatTurns().length === N, `the long chat shown (${api!.chatTurns().length} turns)`);
        // the chat shown (the check before hid it): its webview starts, reports ready and gets the whole chat
        const l0 = api!.chatStats().loads;
        await exec('operateSidecar.openChat');
        await until(() => api!.chatStats().loads > l0, 'the chat view loaded the chat', 10_000).catch(() => undefined);
        await new Promise((r) => setTimeout(r, 300));
        const s0 = api!.chatStats();
        const o: any = await exec('operateSidecar.chat', { text: 'One more question' });
        const s1 = api!.chatStats();
        expect(o && !o.error && o.result?.result === 'The last answer.', `outcome: ${JSON.stringify(o).slice(0, 400)}`);
        const posts = s1.posts - s0.posts, chars = s1.postedChars - s0.postedChars;
        expect(api!.chatTurns().length === N + 1, `the turn was added: ${api!.chatTurns().length}`);
        // the whole conversation is over N * 1 000 characters of HTML; a turn's redraws send only that turn
        expect(posts >= 3 && chars < 20_000, `${posts} redraws posted ${chars} characters of HTML`);
      } finally {
        await exec('operateSidecar.pickBranch', { branchId: chat });
        await exec('operateSidecar.pickModel', { model: 'chat' });
      }
    });

    await check('diff review: rejectEdit denies the call; buffer and disk keep their text; the tool card says rejected', async () => {
      const doc = await within(vscode.workspace.openTextDocument(notesUri), 'open notes.txt');
      const turn = Promise.resolve(vscode.commands.executeCommand<any>('operateSidecar.chat', { text: 'Upper-case alpha' }));
      await until(() => !!proposedTab(), 'the diff editor with the proposed text');
      const callId = api!.chatStats().pendingAsks[0];
      expect(await exec('operateSidecar.rejectEdit', { callId }) === true, 'rejectEdit with a callId');
      const o: any = await within(turn, 'the turn ends');
      const out = (o.result.result.action_responses as any[])[0]?.output;
      expect(out?.error === 'denied by governance gate', `denied: ${JSON.stringify(out)}`);
      expect(doc.getText() === 'alpha\nBETA\n' && disk() === 'alpha\nbeta\n', 'nothing changed');
      expect(api!.reviews().at(-1)?.decision === 'deny_once', 'review record');
      await within(vscode.window.showTextDocument(doc), 'focus notes.txt');
      await exec('workbench.action.files.revert');
    });

    /** Reverts and closes the editors of `files`, removes them from the disk. */
    const dropFiles = async (...files: vscode.Uri[]) => {
      for (const f of files) {
        const doc = vscode.workspace.textDocuments.find((d) => d.uri.toString() === f.toString());
        if (doc?.isDirty) { await within(vscode.window.showTextDocument(doc), 'focus'); await exec('workbench.action.files.revert'); }
        const tabs = vscode.window.tabGroups.all.flatMap((g) => g.tabs).filter((t) => t.input instanceof vscode.TabInputText && t.input.uri.toString() === f.toString());
        if (tabs.length) await within(vscode.window.tabGroups.close(tabs), 'close its tabs');
        fs.rmSync(f.fsPath, { force: true });
      }
    };

    await check('Accept / Reject Edit from the palette with two reviews waiting and no diff editor focused: a quick pick names them (file, tool), the chosen one is decided (dismissed: none); one waiting: decided unasked; none: an information message says so', async () => {
      const files = ['review-a.txt', 'review-b.txt'].map((f) => vscode.Uri.joinPath(folder, f));
      for (const f of files) fs.writeFileSync(f.fsPath, `${path.basename(f.fsPath)} text\n`);
      const reviewTabs = () => vscode.window.tabGroups.all.flatMap((g) => g.tabs).filter((t) =>
        t.input instanceof vscode.TabInputTextDiff && t.input.modified.scheme === 'operate-sidecar-proposed');
      const runs = await Promise.all(files.map(async (f) => {
        const name = path.basename(f.fsPath);
        const model = scripted({ json: { answer: `Editing ${name}.`, action_requests: [{ function: 'edit_file',
          arguments: { path: name, edits: [{ oldText: 'text', newText: 'TEXT' }] } }] } });
        return startOperate({ instruction: `edit ${name}`, actions: true, chatModel: model, branchId: await freshBranch(`itest-${name}`), showResult: false });
      }));
      const [a, b] = runs;
      try {
        await until(() => reviewTabs().length === 2, 'two diff reviews waiting');
        const notes = await within(vscode.workspace.openTextDocument(notesUri), 'open notes.txt');
        await within(vscode.window.showTextDocument(notes), 'focus notes.txt (no diff editor)');
        const labels = ['review-a.txt ↔ proposed by edit_file', 'review-b.txt ↔ proposed by edit_file'];
        const sameLabels = (items: any[] | undefined) => JSON.stringify((items ?? []).map((i) => i.label).sort()) === JSON.stringify(labels);
        await withScriptedUi(win, [{ pick: () => undefined }, { pick: (items) => items.find((i) => i.description === 'review-b.txt') }], async (ui) => {
          expect(await exec('operateSidecar.rejectEdit') === false, 'dismissed quick pick: rejectEdit decided nothing');
          expect(reviewTabs().length === 2 && !a.s.done && !b.s.done, 'dismissed: both reviews still wait');
          expect(await exec('operateSidecar.acceptEdit') === true, 'acceptEdit decided the picked review');
          expect(ui.prompts.length === 2 && ui.prompts.every((p) => p.kind === 'pick' && sameLabels(p.items)
            && JSON.stringify(p.items!.map((i) => i.description).sort()) === '["review-a.txt","review-b.txt"]'),
          `the quick pick names the waiting reviews: ${JSON.stringify(ui.prompts.map((p) => p.items?.map((i) => [i.label, i.description])))}`);
        });
        await within(b.p, 'the accepted operate ends');
        expect(!b.s.err && !outputs(b.s.res)[0]?.error, `review-b.txt accepted: ${JSON.stringify(b.s.err ?? b.s.res)}`);
        expect(!a.s.done, 'review-a.txt still waits');
        await within(vscode.window.showTextDocument(notes), 'focus notes.txt again');
        await withScriptedUi(win, [], async () => {
          expect(await exec('operateSidecar.rejectEdit') === true, 'one waiting: rejectEdit decides it without asking');
        });
        await within(a.p, 'the rejected operate ends');
        expect(!a.s.err && outputs(a.s.res)[0]?.error === 'denied by governance gate', `review-a.txt rejected: ${JSON.stringify(a.s.err ?? a.s.res)}`);
        await withScriptedUi(win, [], async (ui) => {
          expect(await exec('operateSidecar.acceptEdit') === false, 'none waiting: false');
          expect(ui.infos.includes('operate-sidecar: no edit is waiting for review.'), `information message: ${JSON.stringify(ui.infos)}`);
        });
      } finally {
        for (const r of runs) if (!r.s.done) await exec('operateSidecar.cancel');
        await dropFiles(...files);
      }
    });

    await check('a diff review that fails to open (vscode.diff throws once, its tab open): one error, "the permission request of edit_file could not be shown, so it was denied: …", a line in the output channel; no review or diff editor left, the call denied, nothing written; in a chat turn the card says so; the next edit is reviewed and accepted as ever', async () => {
      const file = vscode.Uri.joinPath(folder, 'broken-review.txt');
      fs.writeFileSync(file.fsPath, 'one\n');
      const edit = (newText: string) => ({ json: { answer: 'Editing.', action_requests: [{ function: 'edit_file',
        arguments: { path: 'broken-review.txt', edits: [{ oldText: 'one', newText }] } }] } });
      const said = 'operate-sidecar: the permission request of edit_file could not be shown, so it was denied: the review broke';
      const chat = api!.currentBranch();
      const n0 = api!.notices().length;
      const reviews0 = api!.reviews().length;
      const m0 = mark();
      const bid0 = await freshBranch('itest-broken-review');
      // an Operate: the request is answered with the error, a denial
      api!.faults.set('vscode.diff', 'the review broke');
      const run = startOperate({ instruction: 'edit it', actions: true, chatModel: scripted(edit('ONE')), branchId: bid0, showResult: false });
      try {
        await within(run.p, 'the operate ends');
        const out = run.s.err ? undefined : outputs(run.s.res)[0];
        expect(out?.error === 'denied by governance gate' && /^permission request failed: .*the review broke$/.test(out.reason), `denied: ${JSON.stringify(run.s.err ?? run.s.res)}`);
        const shown = api!.notices().slice(n0);
        expect(shown.length === 1 && shown[0].message === said, `one error: ${JSON.stringify(shown)}`);
        expect(since(m0).includes('[requestToolPermission] failed: the review broke'), `the output channel: ${since(m0).slice(-2000)}`);
        await until(() => !proposedTab(), 'the half-open diff editor closed');
        expect(!api!.faults.size && api!.reviews().length === reviews0, `the fault used, no decision recorded: ${JSON.stringify(api!.reviews().slice(reviews0))}`);
        const text = () => vscode.workspace.textDocuments.find((d) => d.uri.toString() === file.toString())?.getText() ?? fs.readFileSync(file.fsPath, 'utf8');
        expect(text() === 'one\n' && fs.readFileSync(file.fsPath, 'utf8') === 'one\n', `nothing written: ${JSON.stringify(text())}`);
        // a chat turn: its card says denied (no answer), the turn goes on; the next turn's review is accepted
        const bid = (await within(client().createBranch({ name: 'itest-broken-review-chat', chatModel: scripted(edit('ONE'), edit('uno')) as any }), 'createBranch')).branchId;
        await exec('operateSidecar.pickModel', '');
        await exec('operateSidecar.pickBranch', { branchId: bid });
        api!.faults.set('vscode.diff', 'the review broke');
        const o: any = await exec('operateSidecar.chat', { text: 'Upper-case one' });
        const t = api!.chatTurns().at(-1);
        expect(o && !o.error && !o.cancelled && JSON.stringify(t?.cards) === JSON.stringify(['⊘ edit_file broken-review.txt (no answer: the request to the editor failed)']),
          `the card: ${JSON.stringify(t)} ${JSON.stringify(o).slice(0, 600)}`);
        await until(() => !proposedTab(), 'the half-open diff editor closed');
        expect(api!.chatStats().pendingAsks.length === 0 && text() === 'one\n', `nothing waits, nothing written: ${JSON.stringify(api!.chatStats().pendingAsks)} ${JSON.stringify(text())}`);
        expect(JSON.stringify(api!.notices().slice(n0).map((n) => n.message)) === JSON.stringify([said, said]), `one error each: ${JSON.stringify(api!.notices().slice(n0))}`);
        const turn = Promise.resolve(vscode.commands.executeCommand<any>('operateSidecar.chat', { text: 'Make it Spanish' }));
        await until(() => !!proposedTab(), 'the next diff review');
        expect(await exec('operateSidecar.acceptEdit', (proposedTab()!.input as vscode.TabInputTextDiff).modified) === true, 'accepted');
        const o2: any = await within(turn, 'the turn ends');
        expect(o2 && !o2.error && text() === 'uno\n' && api!.reviews().at(-1)?.decision === 'allow_once', `accepted: ${JSON.stringify(text())} ${JSON.stringify(o2).slice(0, 600)}`);
        expect(api!.notices().length === n0 + 2, `nothing more said: ${JSON.stringify(api!.notices().slice(n0))}`);
      } finally {
        api!.faults.clear();
        if (!run.s.done) await exec('operateSidecar.cancel');
        const doc = vscode.workspace.textDocuments.find((d) => d.uri.toString() === file.toString());
        if (doc?.isDirty) { await within(vscode.window.showTextDocument(doc), 'focus'); await exec('workbench.action.files.revert'); }
        const tabs = vscode.window.tabGroups.all.flatMap((g) => g.tabs).filter((t) => t.input instanceof vscode.TabInputText && t.input.uri.toString() === file.toString());
        if (tabs.length) await within(vscode.window.tabGroups.close(tabs), 'close its tabs');
        fs.rmSync(file.fsPath, { force: true });
        await exec('operateSidecar.pickBranch', { branchId: chat });
        await exec('operateSidecar.pickModel', { model: 'chat' });
      }
    });

    await check('an fs handler that throws (fs/readTextFile, once): one error naming the request and the error, a line in the output channel; the server gets the error (the read_file call fails with it) and the operate ends; a file that is not there is an answer, not an error', async () => {
      const n0 = api!.notices().length;
      const m0 = mark();
      const model = scripted({ json: { answer: 'Reading.', action_requests: [{ function: 'read_file', arguments: { path: 'notes.txt' } }] } });
      const bid = await freshBranch('itest-read-broke');
      api!.faults.set('fs/readTextFile', 'reading broke');
      const run = startOperate({ instruction: 'read the notes', actions: true, chatModel: model, branchId: bid, showResult: false });
      try {
        await within(run.p, 'the operate ends');
        const out = run.s.err ? undefined : outputs(run.s.res)[0];
        expect(out?.error && JSON.stringify(out).includes('reading broke'), `the call failed with the error: ${JSON.stringify(run.s.err ?? run.s.res)}`);
        const shown = api!.notices().slice(n0);
        expect(shown.length === 1 && shown[0].message === 'operate-sidecar: the editor could not answer the server\'s fs/readTextFile request (it was answered with an error): reading broke',
          `one error: ${JSON.stringify(shown)}`);
        expect(since(m0).includes('[fs/readTextFile] failed: reading broke'), `the output channel: ${since(m0).slice(-2000)}`);
        // no such file: the editor's answer (the call fails saying so), not its failure: nothing more is said
        const missing: any = await exec('operateSidecar.operate', { instruction: 'read a missing file', actions: true, branchId: bid, showResult: false,
          chatModel: scripted({ json: { answer: 'Reading.', action_requests: [{ function: 'read_file', arguments: { path: 'no-such-file.txt' } }] } }) });
        const gone = outputs(missing)[0];
        expect(/does not exist/.test(gone?.error) && api!.notices().length === n0 + 1, `no such file: ${JSON.stringify(gone)}, notices ${JSON.stringify(api!.notices().slice(n0))}`);
      } finally {
        api!.faults.clear();
        if (!run.s.done) await exec('operateSidecar.cancel');
      }
    });

    /** A scripted model (unique by `answer`: inline models are cached by their JSON) that edits `file` once. */
    const editOf = (file: string, oldText: string, newText: string, answer: string) =>
      scripted({ json: { answer, action_requests: [{ function: 'edit_file', arguments: { path: file, edits: [{ oldText, newText }] } }] } });
    /** A new chat on its own branch whose model is `model` (inline), made the current one. */
    const chatOn = async (name: string, model: object) => {
      const bid = (await within(client().createBranch({ name, chatModel: model as any }), 'createBranch')).branchId;
      await exec('operateSidecar.pickModel', '');
      await exec('operateSidecar.pickBranch', { branchId: bid });
      return bid;
    };

    await check('closing a review\'s diff editor without deciding denies the call once, as dismissing the permission quick pick does: an Operate ends denied at once (not after the permission time-out), a chat turn\'s card says rejected and the turn goes on; the extension\'s own closing after Accept is no denial', async () => {
      const name = 'close-review.txt';
      const file = vscode.Uri.joinPath(folder, name);
      fs.writeFileSync(file.fsPath, 'one\n');
      const chat = api!.currentBranch();
      const reviews0 = api!.reviews().length;
      const decided = () => api!.reviews().slice(reviews0).map((r) => `${path.basename(r.path)}:${r.decision}`).join(' ');
      const text = () => vscode.workspace.textDocuments.find((d) => d.uri.toString() === file.toString())?.getText() ?? fs.readFileSync(file.fsPath, 'utf8');
      const run = startOperate({ instruction: 'edit it', actions: true, chatModel: editOf(name, 'one', 'ONE', 'Closing the review (operate).'),
        branchId: await freshBranch('itest-close-review'), showResult: false });
      try {
        await until(() => !!proposedTab(), 'the diff review');
        await within(vscode.window.tabGroups.close(proposedTab()!), 'close the diff tab');
        // (the permission time-out is the default 120 s: an answer within this bound is the close's)
        await within(run.p, 'the operate ends, denied', 20_000);
        const out = run.s.err ? undefined : outputs(run.s.res)[0];
        expect(out?.error === 'denied by governance gate', `denied: ${JSON.stringify(run.s.err ?? run.s.res)}`);
        expect(decided() === `${name}:deny_once`, `one decision, deny_once: ${decided()}`);
        expect(text() === 'one\n' && fs.readFileSync(file.fsPath, 'utf8') === 'one\n', `nothing written: ${JSON.stringify(text())}`);
        // a chat turn: the card says rejected, the turn goes on
        await chatOn('itest-close-review-chat', scripted(
          { json: { answer: 'Closing the review (chat).', action_requests: [{ function: 'edit_file', arguments: { path: name, edits: [{ oldText: 'one', newText: 'ONE' }] } }] } },
          { json: { answer: 'Accepting this one.', action_requests: [{ function: 'edit_file', arguments: { path: name, edits: [{ oldText: 'one', newText: 'uno' }] } }] } }));
        const turn = Promise.resolve(vscode.commands.executeCommand<any>('operateSidecar.chat', { text: 'Upper-case one' }));
        await until(() => !!proposedTab() && api!.chatStats().pendingAsks.length === 1, 'the chat\'s review waits');
        await within(vscode.window.tabGroups.close(proposedTab()!), 'close the diff tab');
        const o: any = await within(turn, 'the turn ends', 20_000);
        const t = api!.chatTurns().at(-1);
        expect(o && !o.error && !o.cancelled && JSON.stringify(t?.cards) === JSON.stringify([`⊘ edit_file ${name} (rejected)`]),
          `the card: ${JSON.stringify(t)} ${JSON.stringify(o).slice(0, 600)}`);
        expect(api!.chatStats().pendingAsks.length === 0 && api!.chatStats().badge === 0 && !api!.statusText().includes('waiting'),
          `nothing waits: ${JSON.stringify(api!.chatStats().pendingAsks)} ${api!.statusText()}`);
        expect(decided() === `${name}:deny_once ${name}:deny_once` && text() === 'one\n', `the second deny_once: ${decided()}, ${JSON.stringify(text())}`);
        // Accept: the extension closes the diff editor itself, which is no denial
        const turn2 = Promise.resolve(vscode.commands.executeCommand<any>('operateSidecar.chat', { text: 'Make it Spanish' }));
        await until(() => !!proposedTab(), 'the next diff review');
        expect(await exec('operateSidecar.acceptEdit', (proposedTab()!.input as vscode.TabInputTextDiff).modified) === true, 'accepted');
        const o2: any = await within(turn2, 'the turn ends');
        await until(() => !proposedTab(), 'the diff editor closed');
        expect(o2 && !o2.error && text() === 'uno\n', `accepted: ${JSON.stringify(text())} ${JSON.stringify(o2).slice(0, 600)}`);
        expect(decided() === `${name}:deny_once ${name}:deny_once ${name}:allow_once`, `only the accept is recorded: ${decided()}`);
      } finally {
        if (!run.s.done) await exec('operateSidecar.cancel');
        await dropFiles(file);
        if (chat) await exec('operateSidecar.pickBranch', { branchId: chat });
        await exec('operateSidecar.pickModel', { model: 'chat' });
      }
    });

    await check('a file deleted or renamed on disk while its edit waits for review: Accept fails the call ("was deleted after the change was previewed"), nothing is created on disk (no empty file), its open buffer is not edited', async () => {
      const reviews0 = api!.reviews().length;
      for (const how of ['deleted', 'renamed'] as const) {
        const name = `vanish-${how}.txt`;
        const file = vscode.Uri.joinPath(folder, name);
        const moved = vscode.Uri.joinPath(folder, `${name}.moved`);
        fs.writeFileSync(file.fsPath, 'one\n');
        const doc = await within(vscode.workspace.openTextDocument(file), 'open the file');
        await within(vscode.window.showTextDocument(doc), 'show the file');   // an editor of its own (and the diff's left side)
        const run = startOperate({ instruction: 'edit it', actions: true, chatModel: editOf(name, 'one', 'ONE', `The file is ${how}.`),
          branchId: await freshBranch(`itest-vanish-${how}`), showResult: false });
        try {
          await until(() => !!proposedTab(), 'the diff review');
          const modified = (proposedTab()!.input as vscode.TabInputTextDiff).modified;
          if (how === 'deleted') fs.unlinkSync(file.fsPath); else fs.renameSync(file.fsPath, moved.fsPath);
          expect(await exec('operateSidecar.acceptEdit', modified) === true, 'accepted');
          await within(run.p, 'the operate ends');
          const out = run.s.err ? undefined : outputs(run.s.res)[0];
          expect(/^vanish-\w+\.txt was deleted after the change was previewed; nothing was written/.test(out?.error ?? ''),
            `${how}: the call failed: ${JSON.stringify(run.s.err ?? run.s.res)}`);
          expect(!fs.existsSync(file.fsPath), `${how}: nothing created on disk: ${fs.existsSync(file.fsPath) ? JSON.stringify(fs.readFileSync(file.fsPath, 'utf8')) : ''}`);
          expect(doc.getText() === 'one\n', `${how}: the buffer is not edited: ${JSON.stringify(doc.getText())} dirty=${doc.isDirty}`);
          if (how === 'renamed') expect(fs.readFileSync(moved.fsPath, 'utf8') === 'one\n', 'the renamed file keeps its text');
          expect(api!.reviews().at(-1)?.decision === 'allow_once', 'the decision is recorded (the call failed after it)');
        } finally {
          if (!run.s.done) await exec('operateSidecar.cancel');
          await dropFiles(file, moved);
        }
      }
      expect(api!.reviews().length === reviews0 + 2, `two reviews: ${JSON.stringify(api!.reviews().slice(reviews0))}`);
    });

    await check('a file that is not UTF-8 text (Latin-1) is neither edited nor its bytes replaced through the editor: the call fails saying so (which byte), as it does on disk; no review opens; also with the file open in an editor', async () => {
      const name = 'latin1.txt';
      const file = vscode.Uri.joinPath(folder, name);
      const bytes = Buffer.from('caf\xe9 cr\xe8me\nbeta\n', 'latin1');
      fs.writeFileSync(file.fsPath, bytes);
      const reviews0 = api!.reviews().length;
      try {
        for (const opened of [false, true]) {
          const doc = opened ? await within(vscode.workspace.openTextDocument(file), 'open the file') : undefined;
          if (doc) await within(vscode.window.showTextDocument(doc), 'show the file');
          const run = startOperate({ instruction: 'edit it', actions: true, chatModel: editOf(name, 'beta', 'BETA', `Latin-1, opened: ${opened}.`),
            branchId: await freshBranch(`itest-latin1-${opened}`), showResult: false });
          await until(() => run.s.done || !!proposedTab(), 'the operate ends or a review opens');
          expect(!proposedTab(), `opened=${opened}: no review of a file that is not UTF-8`);
          await within(run.p, 'the operate ends');
          const out = run.s.err ? undefined : outputs(run.s.res)[0];
          expect(typeof out?.error === 'string' && out.error.includes(`'${file.fsPath}' is not UTF-8 text (byte 3)`),
            `opened=${opened}: the call failed saying so: ${JSON.stringify(run.s.err ?? run.s.res)}`);
          expect(Buffer.compare(fs.readFileSync(file.fsPath), bytes) === 0, `opened=${opened}: its bytes are kept`);
          expect(!doc?.isDirty, `opened=${opened}: the buffer is not edited`);
        }
        expect(api!.reviews().length === reviews0, 'nothing was put to the user');
      } finally {
        await dropFiles(file);
      }
    });

    await check('changing a server setting (operateSidecar.toolPolicy) restarts the server by itself and applies it', async () => {
      const cfg = vscode.workspace.getConfiguration('operateSidecar');
      const pid = client().process.pid;
      await within(cfg.update('toolPolicy', { shout: 'allow' }, vscode.ConfigurationTarget.Workspace), 'update setting');
      await until(() => !!api!.client()?.running && api!.client()!.process.pid !== pid && !!api!.initializeResult(), 'a new server process', 20_000);
      await until(() => api!.outputText().includes('configuration changed; restarting'), 'the restart is logged');
      await new Promise((r) => setTimeout(r, 500));
      expect(await policyOf() === 'allow', 'the new policy is in force');
      const pid2 = api!.client()!.process.pid;
      await within(cfg.update('toolPolicy', undefined, vscode.ConfigurationTarget.Workspace), 'reset setting');
      await until(() => !!api!.client()?.running && api!.client()!.process.pid !== pid2, 'restarted after the reset', 20_000);
    });

    await check('a server that dies at start: an error with its last stderr lines, "Show server log" and "Open settings"; the status bar says stopped (why in its tooltip) and its click restarts the server once the setting is fixed', async () => {
      const cfg = vscode.workspace.getConfiguration('operateSidecar');
      const good = cfg.get<string[]>('command')!;
      const n0 = api!.notices().length;
      let down = api!.statusItem();
      try {
        await within(cfg.update('command', [good[0], '-c', 'import sys; sys.stderr.write("boom: the config is broken\\n"); sys.exit(3)'],
          vscode.ConfigurationTarget.Workspace), 'break the command');
        await until(() => api!.notices().length > n0, 'an error notice', 20_000);
        const n = api!.notices()[n0];
        expect(n.message.includes('boom: the config is broken') && !/EPIPE/.test(n.message), `notice: ${JSON.stringify(n)}`);
        expect(JSON.stringify(n.actions) === '["Show server log","Open settings"]', `actions: ${JSON.stringify(n.actions)}`);
        let err: any;
        await exec('operateSidecar.listTools', { branchId: undefined }).catch((e: unknown) => { err = e; });
        expect(err && /boom: the config is broken/.test(String(err?.message ?? err)), `a command fails with the server's words: ${err}`);
        down = api!.statusItem();
        expect(down.text === '$(error) operate-sidecar: stopped' && down.tooltip.includes('boom: the config is broken')
          && down.command === 'operateSidecar.restart', `the status bar: ${JSON.stringify(down)}`);
      } finally {
        await within(cfg.update('command', good, vscode.ConfigurationTarget.Workspace), 'restore the command');
      }
      await new Promise((r) => setTimeout(r, 300));
      const init: any = await exec(down.command);   // the status bar item clicked
      expect(init?.protocolVersion === 1 && api!.client()?.running, `restarted: ${JSON.stringify(init)}`);
      const up = api!.statusItem();
      expect(up.text.startsWith('$(comment-discussion) ') && up.command === 'operateSidecar.chat.focus', `the status bar is back: ${JSON.stringify(up)}`);
      const tools: any = await exec('operateSidecar.listTools', {});
      expect(Array.isArray(tools) && api!.client()?.running, 'the server serves again');
    });

    await check('the chat survives the restarts (remembered branch, reloaded from the journal); "Always for this branch" allows the next edit without a review, computed on the unsaved buffer; deleteBranch', async () => {
      const bid = api!.currentBranch();
      const b = (await within(client().listBranches(), 'listBranches')).branches.find((x) => x.branchId === bid);
      expect(b?.name === 'Say hello', `the remembered chat: ${JSON.stringify(b)}`);
      await until(() => api!.chatStats().turns === 3, `the chat reloaded its 3 turns (has ${api!.chatStats().turns})`, 10_000);
      const doc = await within(vscode.workspace.openTextDocument(notesUri), 'open notes.txt');
      await within(vscode.window.showTextDocument(doc), 'show notes.txt');
      await within(doc.save(), 'save');
      await within(vscode.workspace.fs.writeFile(notesUri, new TextEncoder().encode('alpha\nBETA\n')), 'reset notes');
      await until(() => doc.getText() === 'alpha\nBETA\n', 'the buffer follows the disk');
      const reviews = api!.reviews().length;
      await exec('operateSidecar.pickModel', 'chat2');   // a fresh scripted model (the restarted server replays from the start)
      const turn = Promise.resolve(vscode.commands.executeCommand<any>('operateSidecar.chat', { text: 'Title-case beta' }));
      await until(() => !!proposedTab(), 'the diff editor');
      expect(await exec('operateSidecar.alwaysAllowEdit', (proposedTab()!.input as vscode.TabInputTextDiff).modified) === true, 'alwaysAllowEdit');
      await within(turn, 'the turn ends');
      expect(doc.getText() === 'alpha\nBeta\n', `applied: ${JSON.stringify(doc.getText())}`);
      const policy = (await within(client().listTools(bid), 'listTools')).tools.find((t) => t.name === 'edit_file')?.policy;
      expect(policy === 'allow', `edit_file allowed on this branch: ${policy}`);
      // the buffer says "Beta" (unsaved), the disk still "BETA": the edit below applies only if the
      // server reads the file through the editor (fs/readTextFile serves the open buffer)
      expect(doc.isDirty && disk() === 'alpha\nBETA\n', 'the buffer differs from the disk');
      const o: any = await exec('operateSidecar.chat', { text: 'Add an exclamation mark' });
      expect(o && !o.error && api!.reviews().length === reviews + 1 && !proposedTab(), 'no review the second time');
      expect(doc.getText() === 'alpha\nBeta!\n' && doc.isDirty, `applied without asking: ${JSON.stringify(doc.getText())}`);
      await exec('workbench.action.files.revert');
      expect(await exec('operateSidecar.deleteBranch', { branchId: bid }) === true, 'deleteBranch');
      const left = (await within(client().listBranches(), 'listBranches')).branches.map((x) => x.branchId);
      expect(!left.includes(bid!) && api!.currentBranch() === undefined, 'deleted; no current chat');
    });

    await check('context: #selection (file, language, line range), #problems (diagnostics) and #file go with the chat instruction', async () => {
      const doc = await within(vscode.workspace.openTextDocument(notesUri), 'open notes.txt');
      const ed = await within(vscode.window.showTextDocument(doc), 'show notes.txt');
      ed.selection = new vscode.Selection(0, 0, 1, 4);
      const diags = vscode.languages.createDiagnosticCollection('itest');
      diags.set(notesUri, [new vscode.Diagnostic(new vscode.Range(0, 0, 0, 5), 'alpha is misspelled', vscode.DiagnosticSeverity.Warning)]);
      try {
        await exec('operateSidecar.pickModel', { model: 'chat' });
        await exec('operateSidecar.newChat');
        const o: any = await exec('operateSidecar.chat', { text: 'Explain #selection given #problems and #file' });
        expect(o && !o.error, `outcome: ${JSON.stringify(o)}`);
        const instr = (await messagesOf(o.branchId)).find((m) => m.kind === 'instruction')!;
        const c: any = instr.content.context;
        expect(instr.content.instruction === 'Explain #selection given #problems and #file', 'the instruction as typed');
        expect(JSON.stringify(c.selection) === JSON.stringify({ file: 'notes.txt', language: 'plaintext', startLine: 1, endLine: 2, text: 'alpha\nBETA' }),
          `selection: ${JSON.stringify(c.selection)}`);
        expect(c.problems.some((p: any) => p.file === 'notes.txt' && p.line === 1 && p.severity === 'warning' && p.message === 'alpha is misspelled' && p.source === undefined),
          `problems: ${JSON.stringify(c.problems)}`);
        expect(c.file.file === 'notes.txt' && c.file.text === doc.getText(), `file: ${JSON.stringify(c.file)}`);
        expect(JSON.stringify(c.labels) === JSON.stringify(['notes.txt:1-2', 'notes.txt', `${c.problems.length} problem${c.problems.length === 1 ? '' : 's'}`]), `labels: ${JSON.stringify(c.labels)}`);
        // #file:<path>: another file (from the disk; an open one's text as the editor has it), each once (`a,` is `a`);
        // one that is missing, binary or a folder is named as such
        fs.writeFileSync(vscode.Uri.joinPath(folder, 'other.txt').fsPath, 'other text\n');
        fs.writeFileSync(vscode.Uri.joinPath(folder, 'bin.dat').fsPath, Buffer.from([80, 75, 0, 1]));
        fs.mkdirSync(vscode.Uri.joinPath(folder, 'adir').fsPath, { recursive: true });
        fs.writeFileSync(vscode.Uri.joinPath(folder, 'big.txt').fsPath, '😀'.repeat(40_001));   // (40,000 characters kept: 80,000 UTF-16 units)
        ed.selection = new vscode.Selection(0, 0, 0, 0);
        const text = 'Compare #file:other.txt, #file:notes.txt #file:missing.txt #file:bin.dat #file:adir #file:big.txt and #file:other.txt';
        const o2: any = await exec('operateSidecar.chat', { text });
        expect(o2 && !o2.error, `outcome: ${JSON.stringify(o2)}`);
        const c2: any = (await messagesOf(o2.branchId)).filter((m) => m.kind === 'instruction').at(-1)!.content.context;
        expect(JSON.stringify(c2.files) === JSON.stringify([{ file: 'other.txt', text: 'other text\n' },
          { file: 'notes.txt', language: 'plaintext', text: doc.getText() }, { file: 'big.txt', text: '😀'.repeat(40_000), truncated: true }]),
          `files: ${JSON.stringify(c2.files).slice(0, 300)}`);
        const missing = ['#file:missing.txt: not found in the workspace', '#file:bin.dat: a binary file', '#file:adir: a folder, not a file'];
        expect(JSON.stringify(c2.unavailable) === JSON.stringify(missing), `unavailable: ${JSON.stringify(c2.unavailable)}`);
        expect(c2.file === undefined && c2.selection === undefined, `no #file, no selection: ${JSON.stringify(c2)}`);
        expect(JSON.stringify(c2.labels) === JSON.stringify(['other.txt', 'notes.txt', 'big.txt (cut)', ...missing]), `labels: ${JSON.stringify(c2.labels)}`);
      } finally {
        diags.dispose();
      }
    });

    await check('Attach File with the arguments the Explorer\'s menu gives (the file, then every file selected): their #file: references (a path with spaces quoted) go into the chat input, a folder left out; Add the Selection: #selection', async () => {
      fs.writeFileSync(vscode.Uri.joinPath(folder, 'my notes.md').fsPath, 'spaced\n');
      const spaced = vscode.Uri.joinPath(folder, 'my notes.md'), other = vscode.Uri.joinPath(folder, 'other.txt');
      await exec('operateSidecar.attachFile', other, [other, vscode.Uri.joinPath(folder, 'adir'), spaced]);
      await exec('operateSidecar.attachFile', spaced);   // (the tab's menu: the one file)
      await exec('operateSidecar.attachSelection');
      const attached = api!.chatStats().attached.slice(-3);
      expect(JSON.stringify(attached) === JSON.stringify(['#file:other.txt #file:"my notes.md"', '#file:"my notes.md"', '#selection']),
        `attached: ${JSON.stringify(attached)}`);
    });

    // ---- settings with bad values, Stop and Restart while the server starts, a server that hangs ----
    const cfg = () => vscode.workspace.getConfiguration('operateSidecar');
    const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));
    /** A chat turn through the command that records how it settled instead of throwing. */
    const startChat = (text: string) => {
      const s: { done: boolean; err?: any; res?: any } = { done: false };
      const p = Promise.resolve(vscode.commands.executeCommand<any>('operateSidecar.chat', text))
        .then((res) => { s.res = res; }, (err) => { s.err = err; }).finally(() => { s.done = true; });
      return { s, p };
    };

    await check('an invalid maxRounds (2.5) is reported naming the setting and the default is used (rounds still run); fixed to 3, rounds run', async () => {
      const before = cfg().inspect('maxRounds')?.workspaceValue;
      const n0 = api!.notices().length;
      try {
        await exec('operateSidecar.pickModel', { model: 'rounds' });
        await exec('operateSidecar.newChat');
        await within(cfg().update('maxRounds', 2.5, vscode.ConfigurationTarget.Workspace), 'maxRounds 2.5');
        const o: any = await exec('operateSidecar.chat', { text: 'Read the notes' });
        expect(o && !o.error && o.result?.rounds === 2, `rounds with the default (4): ${JSON.stringify(o)}`);
        const bad = api!.notices().slice(n0).filter((n) => n.message.includes('operateSidecar.maxRounds'));
        expect(bad.length === 1 && bad[0].message.includes('2.5') && bad[0].message.includes('using 4')
          && JSON.stringify(bad[0].actions) === '["Open settings"]', `one notice naming the setting: ${JSON.stringify(api!.notices().slice(n0))}`);
        await within(cfg().update('maxRounds', 3, vscode.ConfigurationTarget.Workspace), 'maxRounds 3');
        await exec('operateSidecar.newChat');
        const o2: any = await exec('operateSidecar.chat', { text: 'Read the notes again' });
        expect(o2 && !o2.error && o2.result?.rounds === 2, `rounds after the fix: ${JSON.stringify(o2)}`);
        expect(api!.notices().length === n0 + 1, `no further notices: ${JSON.stringify(api!.notices().slice(n0))}`);
      } finally {
        await within(cfg().update('maxRounds', before, vscode.ConfigurationTarget.Workspace), 'restore maxRounds');
        await exec('operateSidecar.pickModel', { model: 'chat' });
      }
    });

    await check('a model stuck on the same failing call: the chat\'s rounds stop after 3 in a row (repeatLimit), the turn\'s note says which call failed and what to do, also when the chat is shown again', async () => {
      const before = api!.currentBranch();
      const rounds = cfg().inspect('maxRounds')?.workspaceValue;
      try {
        await within(cfg().update('maxRounds', 8, vscode.ConfigurationTarget.Workspace), 'maxRounds 8');
        await exec('operateSidecar.pickModel', { model: 'stuck' });
        await exec('operateSidecar.newChat');
        const o: any = await exec('operateSidecar.chat', { text: 'Read nope.txt' });
        expect(o && !o.error && !o.cancelled && o.result?.rounds === 3 && o.result?.repeated === true, `stopped after 3 rounds: ${JSON.stringify(o)}`);
        const note = () => api!.chatTurns().at(-1)?.note ?? '';
        const want = /^Stopped: the model made the same failing tool call \(read_file: .*nope\.txt.*\) 3 rounds in a row, so another round would not help\. Rephrase the request, or choose another model\.$/;
        expect(want.test(note()), `the turn's note: ${JSON.stringify(api!.chatTurns().at(-1))}`);
        // shown again (another chat, then this one: read back from the branch, which holds no note)
        if (before) await exec('operateSidecar.pickBranch', { branchId: before });
        const loads = api!.chatStats().loads;
        await exec('operateSidecar.pickBranch', { branchId: o.branchId });
        await until(() => api!.currentBranch() === o.branchId && api!.chatStats().loads > loads, 'the stuck chat read again');
        expect(api!.chatTurns().length === 1, `one turn: ${JSON.stringify(api!.chatTurns())}`);
        expect(want.test(note()), `the note after the chat was shown again: ${JSON.stringify(api!.chatTurns())}`);
      } finally {
        await within(cfg().update('maxRounds', rounds, vscode.ConfigurationTarget.Workspace), 'restore maxRounds');
        await exec('operateSidecar.pickModel', { model: 'chat' });
        if (before) await exec('operateSidecar.pickBranch', { branchId: before });
      }
    });

    await check('operateSidecar.command given as a string: one clear error naming the setting (not a Node error); fixing it recovers', async () => {
      const good = cfg().get<string[]>('command')!;
      const n0 = api!.notices().length;
      try {
        await within(cfg().update('command', 'operate-sidecar', vscode.ConfigurationTarget.Workspace), 'command as a string');
        await until(() => api!.notices().length > n0, 'an error notice', 20_000);
        let err: any;
        await exec('operateSidecar.listTools', {}).catch((e: unknown) => { err = e; });   // a second start attempt
        expect(/operateSidecar\.command must be an array of strings/.test(String(err?.message ?? err)), `the command fails clearly: ${err}`);
        await sleep(300);
        const shown = api!.notices().slice(n0);
        expect(shown.length === 1 && shown[0].message.startsWith('operate-sidecar: operateSidecar.command must be an array of strings')
          && shown[0].message.includes('"operate-sidecar"') && !/argument must be/.test(shown[0].message)
          && JSON.stringify(shown[0].actions) === '["Open settings"]', `one clear notice: ${JSON.stringify(shown)}`);
      } finally {
        await within(cfg().update('command', good, vscode.ConfigurationTarget.Workspace), 'restore the command');
      }
      await sleep(300);
      const tools: any = await exec('operateSidecar.listTools', {});
      expect(Array.isArray(tools) && api!.client()?.running, 'the server serves again');
    });

    await check('the server program is missing: one readable error saying it was not found and which setting to fix (no "spawn ... ENOENT", no doubled prefix); fixing it recovers', async () => {
      const good = cfg().get<string[]>('command')!;
      const missing = path.join(path.dirname(good[0]), 'no-such-dir', 'operate-sidecar');
      const n0 = api!.notices().length;
      let err: any;
      try {
        await within(cfg().update('command', [missing], vscode.ConfigurationTarget.Workspace), 'a missing program');
        await sleep(500);   // the restart of the running server (see onDidChangeConfiguration)
        await exec('operateSidecar.listTools', {}).catch((e: unknown) => { err = e; });
        await until(() => api!.notices().length > n0, 'an error notice', 20_000);
      } finally {
        await within(cfg().update('command', good, vscode.ConfigurationTarget.Workspace), 'restore the command');
      }
      const shown = api!.notices().slice(n0);
      const readable = `operate-sidecar: cannot start the server: the program "${missing}" was not found. Install operate-sidecar or set operateSidecar.command`;
      expect(shown.length >= 1 && shown.every((n) => n.message.startsWith(readable) && !/ENOENT|spawn/.test(n.message)
        && JSON.stringify(n.actions) === '["Open settings"]'), `readable notices: ${JSON.stringify(shown)}`);
      const msg = String(err?.message ?? err);
      expect(msg.includes('was not found') && !/ENOENT|operate-sidecar: operate-sidecar/.test(msg), `the command fails in words: ${msg}`);
      await sleep(300);
      const tools: any = await exec('operateSidecar.listTools', {});
      expect(Array.isArray(tools) && api!.client()?.running, 'the server serves again');
    });

    await check('Stop pressed twice while the server is starting: the turn ends Stopped., no error; Restart works', async () => {
      await exec('operateSidecar.listTools', {});   // a running server (whatever the checks before left)
      const c = client();
      c.kill();
      await within(c.exited, 'the server is gone');
      await until(() => !api!.client(), 'no client');
      await within(vscode.window.showTextDocument(await within(vscode.workspace.openTextDocument(notesUri), 'open')), 'show');
      const { s, p } = startChat('hello while the server starts');
      await until(() => api!.chatStats().running, 'the turn runs');
      expect(!api!.client()?.running, 'the server is still starting');
      expect(await exec('operateSidecar.stop') === true, 'first Stop');
      await exec('operateSidecar.stop');   // the second Stop must not throw
      await within(p, 'the stopped turn ends', 5_000);
      expect(!s.err && s.res?.cancelled === true && !s.res.error, `stopped, not failed: ${JSON.stringify(s)} ${s.err}`);
      const init: any = await exec('operateSidecar.restart');
      expect(init?.protocolVersion === 1 && api!.client()?.running, `restart: ${JSON.stringify(init)}`);
      expect(!api!.chatStats().running, 'no turn left running');
    });

    await check('the server crashes mid-reply: the turn ends with an error naming the crash, its stderr lines once, the status bar says stopped; the next turn starts a new server on the same chat', async () => {
      // a fresh server whose stderr ends with its warning about the broken tool module
      const start = mark();
      await exec('operateSidecar.restart');
      await exec('operateSidecar.listTools', {});
      await until(() => since(start).includes('no_such_module_xyz'), 'the server warned about the broken tool module');
      await exec('operateSidecar.pickModel', 'slow');
      await exec('operateSidecar.newChat');
      const c = client();
      const { s, p } = startChat('crash during this reply');
      await until(() => api!.chatStats().running && !!api!.currentBranch(), 'the turn runs');
      const bid = api!.currentBranch();
      c.process.kill('SIGKILL');
      await within(p, 'the turn ends', 10_000);
      const err: string = s.res?.error ?? '';
      expect(!s.err && !s.res?.cancelled && /SIGKILL/.test(err), `the turn failed naming the crash: ${JSON.stringify(s)}`);
      await until(() => api!.statusItem().text === '$(error) operate-sidecar: stopped', 'the status bar says stopped');
      expect(/exited \(SIGKILL\)/.test(api!.statusItem().tooltip), `why, in its tooltip: ${JSON.stringify(api!.statusItem())}`);
      const logLine = "No module named 'no_such_module_xyz'";   // the server's last stderr line (a broken tool module)
      expect(err.split(logLine).length - 1 === 1, `the server's last stderr lines shown once: ${JSON.stringify(err)}`);
      await exec('operateSidecar.pickModel', 'twice');
      const o: any = await exec('operateSidecar.chat', 'after the crash');
      expect(o?.result?.result === 'Noted.' && o.branchId === bid && api!.client()?.running, `a new server: ${JSON.stringify(o)}`);
      expect(api!.statusItem().text.includes(' · '), `the status bar is back: ${api!.statusText()}`);
      // the server never recorded the crashed turn (no reply): the chat keeps it, marked, before the next one
      const shown = () => api!.chatTurns().map((t) => `${t.user}|${t.outcome ?? 'ok'}`).join(' / ');
      const expected = 'crash during this reply|failed / after the crash|ok';
      expect(shown() === expected, `both turns, in order: ${shown()}`);
      expect(/SIGKILL/.test(api!.chatTurns()[0].error ?? ''), `the crashed turn keeps its error: ${JSON.stringify(api!.chatTurns()[0])}`);
      // reloaded from the server (a restart reloads the chat): still there
      const loads = api!.chatStats().loads;
      await exec('operateSidecar.restart');
      await until(() => api!.chatStats().loads > loads, 'the chat reloaded the branch', 10_000);
      expect(shown() === expected, `after the reload: ${shown()}`);
      // another chat, then back: the failed turn is kept with its chat (in the workspace state), in its place
      await exec('operateSidecar.newChat');
      await until(() => api!.chatTurns().length === 0, 'the new chat is empty', 10_000);
      const back = api!.chatStats().loads;
      await exec('operateSidecar.pickBranch', { branchId: bid });
      await until(() => api!.chatStats().loads > back, 'the chat reloaded the branch', 10_000);
      expect(shown() === expected, `another branch in between: ${shown()}`);
      await exec('operateSidecar.pickModel', '');
    });

    await check('a permission request nobody answers times out: the card says so (not "rejected"), the diff editor closes, the turn goes on as denied, no error', async () => {
      const saved = cfg().inspect<any>('settings')!.workspaceValue;
      const pid = client().process.pid;
      const n0 = api!.notices().length;
      const doc = await within(vscode.workspace.openTextDocument(notesUri), 'open notes.txt');
      const text0 = doc.getText();
      const oldText = text0.split('\n')[0];
      try {
        await within(cfg().update('settings', { ...saved, permissionTimeoutMs: 2000, models: { ...saved.models,
          unanswered: scripted({ json: { answer: 'Editing; nobody will answer.', action_requests: [{ function: 'edit_file',
            arguments: { path: 'notes.txt', edits: [{ oldText, newText: oldText.toUpperCase() + '!' }] } }] } }) } },
        vscode.ConfigurationTarget.Workspace), 'a short permission time-out');
        await until(() => !!api!.client()?.running && api!.client()!.process.pid !== pid && !!api!.initializeResult()?.capabilities.models.includes('unanswered'),
          'the restarted server', 20_000);
        await exec('operateSidecar.pickModel', 'unanswered');
        await exec('operateSidecar.newChat');
        const turn = Promise.resolve(vscode.commands.executeCommand<any>('operateSidecar.chat', { text: 'Edit the notes, then wait' }));
        await until(() => !!proposedTab() && api!.chatStats().pendingAsks.length === 1, 'the review waits');
        const o: any = await within(turn, 'the turn ends by itself', 20_000);
        const out = (o?.result?.result?.action_responses as any[] | undefined)?.[0]?.output;
        expect(o && !o.error && !o.cancelled && out?.error === 'denied by governance gate' && out.reason === 'permission request timed out',
          `the turn went on, the call denied: ${JSON.stringify(o)}`);
        const [t] = api!.chatTurns().slice(-1);
        expect(t.user === 'Edit the notes, then wait' && !t.outcome && !t.error
          && JSON.stringify(t.cards) === JSON.stringify(['⊘ edit_file notes.txt (timed out: no answer, denied)']), `the card: ${JSON.stringify(t)}`);
        await until(() => !proposedTab(), 'the diff editor closed');
        expect(api!.chatStats().pendingAsks.length === 0 && doc.getText() === text0, 'nothing pending, the file unchanged');
        expect(api!.notices().length === n0, `no error: ${JSON.stringify(api!.notices().slice(n0))}`);
        // a server setting changed while a turn runs: the restart stops it and the turn says why (not a plain "Stopped.")
        await exec('operateSidecar.pickModel', 'slow');
        const pid2 = client().process.pid;
        const { s, p } = startChat('a turn while the settings change');
        await until(() => api!.chatStats().running, 'the turn runs');
        await within(cfg().update('settings', saved, vscode.ConfigurationTarget.Workspace), 'restore the settings');
        await within(p, 'the turn ends', 15_000);
        expect(!s.err && s.res?.cancelled === true && !s.res.error, `stopped, not failed: ${JSON.stringify(s)}`);
        const [stopped] = api!.chatTurns().slice(-1);
        expect(stopped.user === 'a turn while the settings change' && stopped.outcome === 'stopped'
          && stopped.note === 'Stopped: the server restarted to apply the changed settings.', `the turn says why: ${JSON.stringify(stopped)}`);
        await until(() => !!api!.client()?.running && api!.client()!.process.pid !== pid2, 'the restarted server', 20_000);
      } finally {
        await within(cfg().update('settings', saved, vscode.ConfigurationTarget.Workspace), 'restore the settings');
        await exec('operateSidecar.pickModel', '').catch(() => undefined);
      }
    });

    await check('a server that never answers initialize (a non-frame line on stdout): Stop ends the waiting turn; the start times out with "Show server log" / "Open settings"; the next turn fails, not hangs; the status bar says starting while a start waits; Restart recovers', async () => {
      const good = cfg().get<string[]>('command')!;
      const hang = [good[0], '-c', 'import sys, time; print("this is not a frame"); sys.stdout.flush(); time.sleep(120)'];
      await exec('operateSidecar.listTools', {});   // a running server (whatever the checks before left)
      const pid0 = client().process.pid;
      const n0 = api!.notices().length;
      try {
        await within(cfg().update('startupTimeoutSeconds', 3, vscode.ConfigurationTarget.Workspace), 'a short start-up time-out');
        await within(cfg().update('command', hang, vscode.ConfigurationTarget.Workspace), 'a server that hangs');   // restarts
        await until(() => out().includes(`[server] starting ${JSON.stringify(hang)}`), 'the hanging start', 10_000);
        const t0 = Date.now();
        const { s, p } = startChat('hello to a hanging server');
        await until(() => api!.chatStats().running, 'the turn runs');
        expect(await exec('operateSidecar.stop') === true, 'Stop');
        await within(p, 'the stopped turn ends', 2_000);
        expect(!s.err && s.res?.cancelled === true, `Stop ended the turn: ${JSON.stringify(s)} ${s.err}`);
        await until(() => api!.notices().length > n0, 'the time-out notice', 10_000);
        const n = api!.notices()[n0];
        expect(/did not answer initialize within 3 s \(operateSidecar\.startupTimeoutSeconds\)/.test(n.message)
          && n.message.includes('this is not a frame'), `notice: ${JSON.stringify(n)}`);
        expect(JSON.stringify(n.actions) === '["Show server log","Open settings"]', `actions: ${JSON.stringify(n.actions)}`);
        expect(Date.now() - t0 < 8_000, 'bounded by the setting');
        const o: any = await exec('operateSidecar.chat', 'hello again');   // a new start, which times out too
        expect(o?.error && /did not answer initialize/.test(o.error) && !api!.chatStats().running, `the turn fails: ${JSON.stringify(o)}`);
        expect(api!.statusItem().text === '$(error) operate-sidecar: stopped', `the failed start: ${JSON.stringify(api!.statusItem())}`);
        // a start that would wait long: fixing the command restarts at once, and Restart works
        await within(cfg().update('startupTimeoutSeconds', 120, vscode.ConfigurationTarget.Workspace), 'a long time-out');
        const waiting = startChat('waiting for the server');
        await until(() => api!.chatStats().running, 'the turn waits for the start');
        // from the spawn until initialize is answered the status bar says starting (not stopped, as the last start ended)
        const starting = api!.statusItem();
        expect(starting.text === '$(sync~spin) operate-sidecar: starting…' && starting.command === 'operateSidecar.chat.focus',
          `the status bar while the server starts: ${JSON.stringify(starting)}`);
        await within(cfg().update('command', good, vscode.ConfigurationTarget.Workspace), 'fix the command');
        await until(() => !!api!.client()?.running && api!.client()!.process.pid !== pid0, 'the fixed server', 20_000);
        expect(api!.statusItem().text.startsWith('$(comment-discussion) '), `initialize answered: ${JSON.stringify(api!.statusItem())}`);
        await within(waiting.p, 'the waiting turn ends', 10_000);
        expect(waiting.s.res?.cancelled === true, `the waiting turn: ${JSON.stringify(waiting.s)}`);
        const init: any = await exec('operateSidecar.restart');
        expect(init?.protocolVersion === 1 && api!.client()?.running, `restart: ${JSON.stringify(init)}`);
      } finally {
        await within(cfg().update('command', good, vscode.ConfigurationTarget.Workspace), 'restore the command');
        await within(cfg().update('startupTimeoutSeconds', undefined, vscode.ConfigurationTarget.Workspace), 'restore the time-out');
      }
    });

    // The workbench's own "Command '…' resulted in an error" (from the palette a modal dialog) is not
    // observable from the extension host: what is, is that a command run as the palette runs it (no
    // argument) resolves, so the palette has no rejection to show, and that the extension showed
    // exactly one error message of its own (every showErrorMessage of its window is recorded).
    await check('a command from the palette whose request fails shows one error message, not two: the server cannot start (Operate, List Tools, Restart) or answers an error (Operate on a deleted chat); each resolves (no rejection for the workbench to report again), a script still gets the error', async () => {
      const good = cfg().get<string[]>('command')!;
      const before = api!.currentBranch();
      /** Runs `id` as the command palette does (no argument) and says how it settled. */
      const fromPalette = (id: string) => Promise.resolve(vscode.commands.executeCommand(`operateSidecar.${id}`))
        .then((res) => ({ res, err: undefined as unknown }), (err: unknown) => ({ res: undefined, err }));
      /** `id` from the palette: it resolves, and the extension showed exactly one error message, recorded as one notice. */
      const once = async (id: string, ui: ScriptedUi, words: RegExp) => {
        const n0 = api!.notices().length;
        const e0 = ui.errors.length;
        const r = await within(fromPalette(id), `${id} from the palette`);
        expect(r.err === undefined && r.res === undefined,
          `${id} from the palette resolves, nothing left for the workbench to show again: rejected with ${String((r.err as Error)?.message ?? r.err)}`);
        await sleep(300);   // a late second message would land here
        const shown = api!.notices().slice(n0);
        expect(shown.length === 1 && words.test(shown[0].message), `${id}: one notice in the extension's words: ${JSON.stringify(shown)}`);
        expect(ui.errors.length - e0 === 1, `${id}: one error message shown: ${JSON.stringify(ui.errors.slice(e0))}`);
      };
      await exec('operateSidecar.listTools', {});   // a running server (whatever the checks before left)
      const n0 = api!.notices().length;
      try {
        await within(cfg().update('command', [good[0], '-c', 'import sys; sys.stderr.write("boom: palette start\\n"); sys.exit(3)'],
          vscode.ConfigurationTarget.Workspace), 'a server that dies at start');   // restarts (and fails, one notice)
        await until(() => api!.notices().length > n0 && !api!.client(), 'the failed restart', 20_000);
        await sleep(500);
        await withScriptedUi(win, [{ input: 'hello from the palette' }], async (ui) => {
          await once('operate', ui, /boom: palette start/);
          await once('listTools', ui, /boom: palette start/);
          await once('restart', ui, /boom: palette start/);
          expect(ui.prompts.length === 1 && ui.prompts[0].kind === 'input', `prompts: ${JSON.stringify(ui.prompts)}`);
        });
        // a script (an argument) still gets the rejection, in the same words
        let err: any;
        await exec('operateSidecar.listTools', {}).catch((e: unknown) => { err = e; });
        expect(/boom: palette start/.test(String(err?.message ?? err)), `a script gets the error: ${err}`);
      } finally {
        await within(cfg().update('command', good, vscode.ConfigurationTarget.Workspace), 'restore the command');
      }
      await sleep(300);
      await exec('operateSidecar.listTools', {});
      // the server answers an error: an operate on a chat it no longer has (deleted underneath, through the protocol)
      const gone = await freshBranch('itest-gone');
      const loads = api!.chatStats().loads;
      await exec('operateSidecar.pickBranch', { branchId: gone });
      await until(() => api!.chatStats().loads > loads, 'the chat loaded it (before it goes)', 10_000);
      await within(client().deleteBranch(gone), 'delete it on the server only');
      expect(api!.currentBranch() === gone, 'the deleted chat is still current in the extension');
      const start = mark();
      await withScriptedUi(win, [{ input: 'operate on a deleted chat' }], async (ui) => {
        await once('operate', ui, /^operate-sidecar: .*-32012/);
      });
      expect(since(start).includes('=== error:'), `the channel has the error: ${since(start)}`);
      if (before) await exec('operateSidecar.pickBranch', { branchId: before });
      else await exec('operateSidecar.newChat');
    });

    // A server that dies while a request runs is one event: its exit notice (the server stopped, how,
    // its last stderr lines, Show server log / Open settings) is the one error message; the Operate
    // (or the chat turn) that failed with it shows none of its own (it did: "The operate-sidecar
    // server is not running (… exited (signal SIGKILL) before answering operate …)" as a second one).
    await check('the server dies during an Operate from the palette: one error message, the exit notice (the server stopped, how, its last stderr lines, Show server log and Open settings), not also the Operate\'s own; the Operate resolves, the channel has its error; a chat turn the same, the turn marked failed', async () => {
      const before = api!.currentBranch();
      const logLine = "No module named 'no_such_module_xyz'";   // the server's last stderr line (a broken tool module)
      /** A fresh server whose stderr ends with its warning about the broken tool module. */
      const freshServer = async () => {
        const m = mark();
        await exec('operateSidecar.restart');
        await exec('operateSidecar.listTools', {});
        await until(() => since(m).includes('no_such_module_xyz'), 'the server warned about the broken tool module');
        return client();
      };
      /** `run` starts a request on `c`; the server is killed once `running()`; exactly one notice follows: the exit notice. */
      const oneNotice = async (what: string, c: ReturnType<typeof client>, ui: ScriptedUi, run: () => Promise<void>, running: () => boolean) => {
        const n0 = api!.notices().length;
        const e0 = ui.errors.length;
        const done = run();
        await until(running, `${what} runs`);
        await sleep(500);   // its operate request sent (the model answers after 2 minutes)
        c.process.kill('SIGKILL');
        await within(done, `${what} ends`, 15_000);
        await until(() => api!.notices().length > n0, `${what}: the exit notice`, 10_000);
        await sleep(600);   // a late second message would land here
        const shown = api!.notices().slice(n0);
        expect(shown.length === 1, `${what}: one notice per death: ${JSON.stringify(shown)}`);
        const [n] = shown;
        expect(/^operate-sidecar: the server stopped \(exit SIGKILL\)\./.test(n.message) && n.message.split(logLine).length - 1 === 1
          && JSON.stringify(n.actions) === '["Show server log","Open settings"]', `${what}: the exit notice says how, with the stderr lines and buttons: ${JSON.stringify(n)}`);
        expect(ui.errors.length - e0 === 1, `${what}: one error message shown: ${JSON.stringify(ui.errors.slice(e0))}`);
        await until(() => api!.statusItem().text === '$(error) operate-sidecar: stopped', `${what}: the status bar says stopped`);
      };
      // Operate from the palette (no argument: the input box), on a chat whose model answers after 2 minutes
      let c = await freshServer();
      await exec('operateSidecar.newBranch', { name: 'itest-dies', chatModel: 'slow' });
      const start = mark();
      await withScriptedUi(win, [{ input: 'the server dies during this operate' }], async (ui) => {
        let r: { res?: unknown; err?: unknown } = {};
        await oneNotice('Operate from the palette', c, ui, async () => {
          r = await Promise.resolve(vscode.commands.executeCommand('operateSidecar.operate'))
            .then((res) => ({ res }), (err: unknown) => ({ err }));
        }, () => since(start).includes('=== operate ['));
        expect(r.err === undefined && r.res === undefined, `the Operate from the palette resolves: ${JSON.stringify(r)} ${String((r.err as Error)?.message ?? '')}`);
      });
      expect(/=== error: .*SIGKILL/.test(since(start)), `the channel has the Operate's error: ${since(start)}`);
      // a chat turn: marked failed in the chat, naming the crash; the exit notice is the one message
      c = await freshServer();
      await exec('operateSidecar.pickModel', 'slow');
      await exec('operateSidecar.newChat');
      await withScriptedUi(win, [], async (ui) => {
        let res: any;
        await oneNotice('a chat turn', c, ui, async () => { res = await vscode.commands.executeCommand<any>('operateSidecar.chat', 'the server dies during this turn'); },
          () => api!.chatStats().running && !!api!.currentBranch());
        expect(!res?.cancelled && /SIGKILL/.test(res?.error ?? ''), `the turn failed naming the crash: ${JSON.stringify(res)}`);
      });
      const turns = api!.chatTurns();
      expect(turns.length === 1 && turns[0].outcome === 'failed' && /SIGKILL/.test(turns[0].error ?? ''), `the chat marks the turn failed: ${JSON.stringify(turns)}`);
      await exec('operateSidecar.pickModel', '');
      await exec('operateSidecar.listTools', {});   // a server again
      if (before) await exec('operateSidecar.pickBranch', { branchId: before });
      else await exec('operateSidecar.newChat');
    });

    await check('the server dies while an edit waits for review (a chat turn, an Operate): the review is withdrawn: its diff editor closes, nothing waits (no badge, the status bar does not say "waiting for you", also after Restart), Accept on it decides and records nothing, the card stays failed, nothing is written', async () => {
      const name = 'dies-review.txt';
      const file = vscode.Uri.joinPath(folder, name);
      fs.writeFileSync(file.fsPath, 'one\n');
      const chat = api!.currentBranch();
      const reviews0 = api!.reviews().length;
      const text = () => vscode.workspace.textDocuments.find((d) => d.uri.toString() === file.toString())?.getText() ?? fs.readFileSync(file.fsPath, 'utf8');
      try {
        await exec('operateSidecar.listTools', {});   // a server
        await chatOn('itest-dies-review', editOf(name, 'one', 'ONE', 'The server dies (chat).'));
        let c = client();
        const { s, p } = startChat('Edit it; the server dies meanwhile');
        await until(() => !!proposedTab() && api!.chatStats().pendingAsks.length === 1, 'the review waits');
        const modified = (proposedTab()!.input as vscode.TabInputTextDiff).modified;
        c.process.kill('SIGKILL');
        await within(p, 'the turn ends', 15_000);
        expect(!s.err && /SIGKILL/.test(s.res?.error ?? ''), `the turn failed naming the crash: ${JSON.stringify(s)}`);
        await until(() => !proposedTab(), 'the diff editor closed', 10_000);
        const failed = JSON.stringify([`✗ edit_file ${name}`]);
        const nothingWaits = (when: string) => {
          const st = api!.chatStats();
          expect(st.pendingAsks.length === 0 && st.badge === 0 && !api!.statusText().includes('waiting'),
            `${when}: nothing waits: ${JSON.stringify(st.pendingAsks)}, badge ${st.badge}, ${api!.statusText()}`);
          expect(JSON.stringify(api!.chatTurns().at(-1)?.cards) === failed && api!.chatTurns().at(-1)?.outcome === 'failed',
            `${when}: the card stays failed: ${JSON.stringify(api!.chatTurns().at(-1))}`);
        };
        nothingWaits('after the death');
        expect(await exec('operateSidecar.acceptEdit', modified) === false, 'Accept on the withdrawn review decides nothing');
        nothingWaits('after Accept');
        await exec('operateSidecar.restart');
        nothingWaits('after Restart');
        // an Operate from the palette's command: its review goes the same way
        c = client();
        const run = startOperate({ instruction: 'edit it', actions: true, chatModel: editOf(name, 'one', 'ONE', 'The server dies (operate).'),
          branchId: await freshBranch('itest-dies-review-op'), showResult: false });
        await until(() => !!proposedTab(), 'the Operate\'s review waits');
        const modified2 = (proposedTab()!.input as vscode.TabInputTextDiff).modified;
        c.process.kill('SIGKILL');
        await within(run.p, 'the operate ends', 15_000);
        await until(() => !proposedTab(), 'the diff editor closed', 10_000);
        expect(await exec('operateSidecar.acceptEdit', modified2) === false, 'Accept on the withdrawn review decides nothing');
        expect(api!.reviews().length === reviews0, `no decision recorded: ${JSON.stringify(api!.reviews().slice(reviews0))}`);
        expect(text() === 'one\n' && fs.readFileSync(file.fsPath, 'utf8') === 'one\n', `nothing written: ${JSON.stringify(text())}`);
      } finally {
        await exec('operateSidecar.listTools', {}).catch(() => undefined);   // a server again
        await dropFiles(file);
        if (chat) await exec('operateSidecar.pickBranch', { branchId: chat }).catch(() => undefined);
        await exec('operateSidecar.pickModel', { model: 'chat' }).catch(() => undefined);
      }
    });
  } catch (e) {
    fatal = e instanceof Error ? e.stack ?? e.message : String(e);
  }

  writeReport(checks, fatal, {
    uiKind: vscode.env.uiKind === vscode.UIKind.Web ? 'web' : 'desktop',
    /** whether the test module's `vscode.window` is the extension's (not when it lies outside the extension, e.g. the unpacked .vsix) */
    sameApiInstance,
    outputChannel: out().slice(-60000),
  });
}
