// The protocol client against the REAL Python server (scripted model), over real pipes.
// Run: tsc -p . && node --test --test-timeout=60000 out/test/
import { test, afterEach } from 'node:test';
import * as assert from 'node:assert/strict';
import * as fs from 'node:fs';
import * as path from 'node:path';
import {
  CancellationTokenSource, ErrorCodes, JsonObject, LogMessage, PermissionRequest, ProgressValue, ResponseError, SidecarClient, ToolEvent,
} from '../rpcClient';

const EXT_ROOT = path.resolve(__dirname, '..', '..');           // clients/vscode
const REPO = path.resolve(EXT_ROOT, '..', '..');                 // the server repo
const FIXTURES = path.join(EXT_ROOT, 'test-fixtures');
const VENV_PY = path.join(REPO, '.venv', 'bin', 'python');
const PYTHON = process.env.OPERATE_SIDECAR_PYTHON ?? (fs.existsSync(VENV_PY) ? VENV_PY : 'python3');
const WAIT_MS = 20_000;

/** Every wait in these tests is bounded. */
function within<T>(p: Promise<T>, what: string, ms = WAIT_MS): Promise<T> {
  let timer: NodeJS.Timeout;
  const t = new Promise<never>((_, rej) => { timer = setTimeout(() => rej(new Error(`timeout after ${ms} ms: ${what}`)), ms); });
  return Promise.race([p, t]).finally(() => clearTimeout(timer));
}
async function until(cond: () => boolean, what: string, ms = WAIT_MS): Promise<void> {
  const end = Date.now() + ms;
  while (!cond()) {
    if (Date.now() > end) throw new Error(`timeout after ${ms} ms waiting for ${what}`);
    await new Promise((r) => setTimeout(r, 10));
  }
}
async function rejection(p: Promise<unknown>, what: string): Promise<ResponseError<unknown>> {
  try {
    await within(p, what);
  } catch (e) {
    assert.ok(e instanceof ResponseError, `${what}: expected a ResponseError, got ${e}`);
    return e;
  }
  assert.fail(`${what}: expected an error response`);
}

const scripted = (...responses: unknown[]) => ({ provider: 'scripted', responses }) as JsonObject;
const CALL_SHOUT = { json: { action_requests: [{ function: 'shout', arguments: { text: 'hey' } }] } };

const started: SidecarClient[] = [];
let stderr = '';
async function server(): Promise<SidecarClient> {
  const c = await SidecarClient.start({
    command: [PYTHON, '-m', 'operate_sidecar.server'], cwd: REPO,
    env: { ...process.env, PYTHONPATH: [FIXTURES, REPO, process.env.PYTHONPATH ?? ''].join(path.delimiter) },
    onStderr: (t) => { stderr += t; },
  });
  started.push(c);
  return c;
}
async function initialized(settings: JsonObject, capabilities?: { toolPermission?: boolean; clientTools?: boolean }) {
  const c = await server();
  const r = await within(c.initialize({ clientInfo: { name: 'node-test' }, processId: process.pid, capabilities, settings }), 'initialize');
  return { c, r };
}
const outputs = (r: any) => (r.result.action_responses as any[]).map((a) => a.output);

afterEach(async () => {
  for (const c of started.splice(0)) await within(c.stop(5000), 'server stop', 15_000);
  stderr = '';
});

test('initialize: capabilities, methods, models; ping; requests before initialize get -32002', async () => {
  const c = await server();
  assert.deepEqual(await within(c.ping(), 'ping'), {});
  const early = await rejection(c.createBranch(), 'createBranch before initialize');
  assert.equal(early.code, ErrorCodes.NotInitialized);
  const r = await within(c.initialize({ clientInfo: { name: 'node-test', version: '1' }, settings: { models: { s: scripted('x') } } }), 'initialize');
  assert.equal(r.protocolVersion, 1);
  assert.equal(typeof r.serverInfo.name, 'string');
  for (const m of ['initialize', 'operate', 'createBranch', 'forkBranch', 'listBranches', 'branchMessages', 'listTools', 'authorizeTool']) {
    assert.ok(r.capabilities.methods.includes(m), `methods lists ${m}`);
  }
  assert.ok(r.capabilities.models.includes('s'));
  assert.equal(r.capabilities.stateDir, null);
  assert.equal(await within(c.stop(), 'stop'), 0, 'exit code 0 after shutdown + exit');
});

test('operate streams $/progress in order before the response; branches, fork and messages', async () => {
  const { c } = await initialized({ models: { s: scripted({ text: 'streamed reply text', chunks: 4 }) } });
  const { branchId } = await within(c.createBranch({ system: 'be brief', name: 'main' }), 'createBranch');
  const values: ProgressValue[] = [];
  const out = await within(c.operate({ branchId, instruction: 'say it' }, { onProgress: (v) => values.push(v) }), 'operate');
  const { usage, rounds, ...rest } = out;
  assert.deepEqual(rest, { result: 'streamed reply text', kind: 'text', model: null });
  // servers that count usage: one model call, one round
  if (usage !== undefined) assert.equal(usage.modelCalls, 1);
  if (rounds !== undefined) assert.equal(rounds, 1);
  assert.deepEqual(values[0], { kind: 'begin', title: 'operate', message: 'communicate' });
  assert.equal(values[values.length - 1].kind, 'end');
  const deltas = values.flatMap((v) => (v.kind === 'report' && v.delta !== undefined ? [v.delta] : []));
  assert.equal(deltas.length, 4);
  assert.equal(deltas.join(''), 'streamed reply text');
  for (const v of values.slice(1, -1)) assert.equal(v.kind, 'report');

  const msgs = await within(c.branchMessages(branchId), 'branchMessages');
  assert.deepEqual(msgs.messages.map((m) => m.kind), ['system', 'instruction', 'assistant_response']);
  assert.equal(msgs.total, 3);
  assert.equal((msgs.messages[2].content as any).text, 'streamed reply text');
  const fork = await within(c.forkBranch(branchId), 'forkBranch');
  assert.notEqual(fork.branchId, branchId);
  const { branches } = await within(c.listBranches(), 'listBranches');
  const counts = Object.fromEntries(branches.map((b) => [b.branchId, b.messageCount]));
  assert.equal(counts[branchId], 3);
  assert.equal(counts[fork.branchId], 3);
});

test('a Python toolModules tool runs and its toolEvents arrive (pre then post, one callId); window/logMessage for a broken module', async () => {
  const c = await server();
  const logs: LogMessage[] = [];
  c.onLogMessage((m) => logs.push(m));
  await within(c.initialize({ settings: { models: { s: scripted(CALL_SHOUT) }, toolModules: ['no_such_module_xyz', 'vscode_fixture_tools'] } }), 'initialize');
  const events: ToolEvent[] = [];
  c.onToolEvent((e) => events.push(e));
  const { tools } = await within(c.listTools(), 'listTools');
  // tool modules load lazily: the broken one is reported with window/logMessage (a warning), the good one loads
  await until(() => logs.some((m) => m.type === 2 && m.message.includes('no_such_module_xyz')), 'window/logMessage warning');
  const shout = tools.find((t) => t.name === 'shout');
  assert.equal(shout?.source, 'python');
  assert.equal(shout?.policy, 'allow');
  const { branchId } = await within(c.createBranch(), 'createBranch');
  const out = await within(c.operate({ branchId, instruction: 'call it', actions: true }), 'operate');
  assert.deepEqual(outputs(out), ['HEY!']);
  await until(() => events.length >= 2, 'two toolEvents');
  assert.deepEqual(events.map((e) => e.event), ['pre', 'post']);
  assert.equal(events[0].callId, events[1].callId);
  assert.equal(events[1].seq, events[0].seq + 1);
  assert.equal(events[0].tool, 'shout');
  assert.equal(events[0].branchId, branchId);
});

test('requestToolPermission: the handler allows, then denies; no handler means deny', async () => {
  const { c } = await initialized({
    models: { s: scripted(CALL_SHOUT, CALL_SHOUT, CALL_SHOUT) }, toolModules: ['vscode_fixture_tools'], toolPolicy: { shout: 'ask' },
  }, { toolPermission: true });
  const asked: PermissionRequest[] = [];
  const answers = ['allow_once', 'deny_once'] as const;
  c.setPermissionHandler((req) => answers[asked.push(req) - 1]);
  const { branchId } = await within(c.createBranch(), 'createBranch');
  const op = () => within(c.operate({ branchId, instruction: 'call', actions: true }), 'operate');
  assert.deepEqual(outputs(await op()), ['HEY!']);
  const denied = outputs(await op())[0];
  assert.equal(denied.error, 'denied by governance gate');
  assert.equal(denied.function, 'shout');
  assert.equal(asked.length, 2);
  assert.equal(asked[0].tool, 'shout');
  assert.equal(asked[0].branchId, branchId);
  assert.deepEqual(asked[0].arguments, { text: 'hey' });
  assert.deepEqual(asked[0].options, ['allow_once', 'allow_always', 'deny_once', 'deny_always']);
  c.setPermissionHandler(undefined);
  assert.equal(outputs(await op())[0].error, 'denied by governance gate');
  assert.equal(asked.length, 2);
  // authorizeTool on the branch: allow without asking
  assert.deepEqual(await within(c.authorizeTool('shout', 'allow', branchId), 'authorizeTool'), { tool: 'shout', decision: 'allow', branchId });
  const pol = (await within(c.listTools(branchId), 'listTools')).tools.find((t) => t.name === 'shout')?.policy;
  assert.equal(pol, 'allow');
});

test('invokeClientTool: a registered client tool is answered by the pluggable handler', async () => {
  const call = { json: { action_requests: [{ function: 'editor_info', arguments: { what: 'version' } }] } };
  const { c } = await initialized({ models: { s: scripted(call) } }, { clientTools: true });
  const reg = await within(c.registerClientTools([{
    name: 'editor_info', description: 'Editor facts',
    inputSchema: { type: 'object', properties: { what: { type: 'string' } }, required: ['what'] },
  }]), 'registerClientTools');
  assert.deepEqual(reg, { registered: ['editor_info'] });
  const seen: unknown[] = [];
  c.setClientToolHandler((req) => { seen.push(req.arguments); return { answer: `node ${process.version}` }; });
  const { branchId } = await within(c.createBranch(), 'createBranch');
  const out = await within(c.operate({ branchId, instruction: 'ask the editor', actions: true }), 'operate');
  assert.deepEqual(outputs(out), [{ answer: `node ${process.version}` }]);
  assert.deepEqual(seen, [{ what: 'version' }]);
});

test('cancel mid model call (delayMs) sends $/cancelRequest: -32800, progress ends "cancelled", branch stays usable', async () => {
  const { c } = await initialized({ models: { s: scripted({ text: 'late', delayMs: 60000 }, 'next') } });
  const { branchId } = await within(c.createBranch(), 'createBranch');
  const values: ProgressValue[] = [];
  const source = new CancellationTokenSource();
  const pending = c.operate({ branchId, instruction: 'wait' }, { token: source.token, onProgress: (v) => values.push(v) });
  await until(() => values.length > 0, 'progress begin (the model call started)');
  source.cancel();
  const err = await rejection(pending, 'cancelled operate');
  assert.equal(err.code, ErrorCodes.Cancelled);
  assert.equal(values[0].kind, 'begin');
  // progress notifications precede the response, but be tolerant of the handler order
  await until(() => values[values.length - 1].kind === 'end', 'progress end');
  const { usage, ...end } = values[values.length - 1] as { usage?: unknown };
  assert.deepEqual(end, { kind: 'end', message: 'cancelled' });
  // servers that count usage report it with the end value (a cancelled call is counted too)
  if (usage !== undefined) assert.equal((usage as { modelCalls: number }).modelCalls, 1);
  const again = await within(c.operate({ branchId, instruction: 'again' }), 'operate after cancel');
  assert.equal(again.result, 'next');
});

test('error codes surface as ResponseError with the right code', async () => {
  const answer = { title: 'Answer', type: 'object', properties: { answer: { type: 'string' } }, required: ['answer'] };
  const { c } = await initialized({ models: { s: scripted({ error: 'provider down' }, { json: { wrong: 1 } }) } });
  const { branchId } = await within(c.createBranch(), 'createBranch');
  const code = async (p: Promise<unknown>, what: string) => (await rejection(p, what)).code;
  assert.equal(await code(c.branchMessages('no-such-branch'), 'unknown branch'), ErrorCodes.BranchNotFound);
  assert.equal(await code(c.request('noSuchMethod', {}), 'unknown method'), ErrorCodes.MethodNotFound);
  const unknownField = await rejection(c.request('operate', { branchId, instruction: 'x', bogusField: 1 }), 'unknown field');
  assert.equal(unknownField.code, ErrorCodes.InvalidParams);
  assert.match(unknownField.message, /bogusField/);
  assert.equal(await code(c.operate({ branchId, instruction: 'x', tools: ['not_a_tool'] }), 'unregistered tool'), ErrorCodes.InvalidParams);
  const model = await rejection(c.operate({ branchId, instruction: 'x' }), 'model error');
  assert.equal(model.code, ErrorCodes.ModelError);
  assert.match(model.message, /provider down/);
  const invalid = await rejection(c.operate({ branchId, instruction: 'x', responseFormat: answer, handleValidation: 'raise', parseOptions: { retryAttempts: 0 } }), 'validation');
  assert.equal(invalid.code, ErrorCodes.ValidationFailed);
  assert.equal((invalid.data as any).expected, 'Answer');
  assert.equal(await code(c.operate({ branchId, instruction: 'x' }), 'exhausted script'), ErrorCodes.ModelError);
});

test('a server that dies fails the pending request instead of hanging', async () => {
  const { c } = await initialized({ models: { s: scripted({ text: 'late', delayMs: 60000 }) } });
  const { branchId } = await within(c.createBranch(), 'createBranch');
  const pending = c.operate({ branchId, instruction: 'wait' });
  await within(c.ping(), 'ping');
  c.kill();
  await assert.rejects(within(pending, 'pending operate after kill'), (e: Error) => !/timeout after/.test(e.message));
  assert.notEqual(await within(c.exited, 'exit'), 0);
  assert.equal(c.running, false);
});
