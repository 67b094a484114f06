// The client against the REAL Python server (scripted model), over real pipes.
// Run: npm test  (tsc -p tsconfig.test.json && node --test dist-test/test/)
import { test, afterEach } from 'node:test';
import * as assert from 'node:assert/strict';
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import { Trace, TraceFormat } from 'vscode-jsonrpc/node';
import {
  CancellationToken, CancellationTokenSource, ErrorCodes, ExitInfo, LogMessage, PermissionRequest, ProgressParams, ProgressValue, ReadTextFileRequest,
  DEFAULT_INITIALIZE_TIMEOUT_MS, ResponseError, SidecarClient, SidecarExitedError, SidecarStreamError, SidecarTimeoutError, ToolEvent, WriteTextFileRequest,
} from '../src/index';
import {
  callTool, endedUnreported, initialized, outputs, rejection, REPO, scripted, server, serverCommand, stderr, stopAll, until, within,
} from './support';

afterEach(stopAll);

test('initialize: capabilities, methods, models; ping; requests before initialize get -32002; stop exits 0', async () => {
  const c = await server();
  assert.deepEqual(await within(c.ping(), 'ping'), {});
  const early = await rejection(c.createBranch(), 'createBranch before initialize');
  assert.equal(early.code, ErrorCodes.NotInitialized);
  assert.equal(early.code, ErrorCodes.ServerNotInitialized);
  const r = await within(c.initialize({ clientInfo: { name: 'node-test', version: '1' }, settings: { models: { s: scripted('x') } } }), 'initialize');
  assert.equal(r.protocolVersion, 1);
  assert.equal(typeof r.serverInfo.name, 'string');
  for (const m of ['initialize', 'operate', 'createBranch', 'forkBranch', 'deleteBranch', 'listBranches', 'branchMessages', 'listTools', 'authorizeTool']) {
    assert.ok(r.capabilities.methods.includes(m), `methods lists ${m}`);
  }
  assert.ok(r.capabilities.models.includes('s'));
  assert.equal(r.capabilities.stateDir, null);
  assert.equal(await within(c.stop(), 'stop'), 0, 'exit code 0 after shutdown + exit');
  assert.equal(c.running, false);
});

test('branches: create, operate with $/progress in order before the response, messages, fork, list, delete', async () => {
  const { c } = await initialized({ models: { s: scripted({ text: 'streamed reply text', chunks: 4 }) } });
  const { branchId } = await within(c.createBranch({ system: 'be brief', name: 'main' }), 'createBranch');
  const values: ProgressValue[] = [];
  const out = await within(c.operate({ branchId, instruction: 'say it' }, { onProgress: (v) => values.push(v) }), 'operate');
  assert.equal(out.result, 'streamed reply text');
  assert.equal(out.kind, 'text');
  assert.deepEqual(values[0], { kind: 'begin', title: 'operate', message: 'communicate' });
  assert.equal(values[values.length - 1].kind, 'end');
  const deltas = values.flatMap((v) => (v.kind === 'report' && v.delta !== undefined ? [v.delta] : []));
  assert.equal(deltas.length, 4);
  assert.equal(deltas.join(''), 'streamed reply text');
  for (const v of values.slice(1, -1)) assert.equal(v.kind, 'report');

  const msgs = await within(c.branchMessages(branchId), 'branchMessages');
  assert.deepEqual(msgs.messages.map((m) => m.kind), ['system', 'instruction', 'assistant_response']);
  assert.equal(msgs.total, 3);
  assert.equal(msgs.messages[2].content.text, 'streamed reply text');
  assert.equal((await within(c.branchMessages(branchId, 1, 1), 'paged')).messages[0].kind, 'instruction');
  const fork = await within(c.forkBranch(branchId), 'forkBranch');
  assert.notEqual(fork.branchId, branchId);
  const { branches } = await within(c.listBranches(), 'listBranches');
  const counts = Object.fromEntries(branches.map((b) => [b.branchId, b.messageCount]));
  assert.deepEqual(counts, { [branchId]: 3, [fork.branchId]: 3 });
  assert.deepEqual(await within(c.deleteBranch(fork.branchId), 'deleteBranch'), {});
  assert.deepEqual((await within(c.listBranches(), 'listBranches')).branches.map((b) => b.branchId), [branchId]);
});

test('$/progress listeners: onNotification("$/progress") listeners and operate\'s onProgress all get every value, in order', async () => {
  const { c } = await initialized({ models: { s: scripted({ text: 'streamed reply text', chunks: 4 }, { text: 'again', chunks: 2 }) } });
  const { branchId } = await within(c.createBranch(), 'createBranch');
  const heard: ProgressParams[] = [];
  const heardToo: ProgressParams[] = [];
  c.onNotification('$/progress', (p) => heard.push(p));
  const second = c.onNotification('$/progress', (p) => heardToo.push(p));   // any number per method
  const values: ProgressValue[] = [];
  const out = await within(c.operate({ branchId, instruction: 'say it' }, { onProgress: (v) => values.push(v) }), 'operate');
  assert.equal(out.result, 'streamed reply text');
  const deltas = (vs: ProgressValue[]) => vs.flatMap((v) => (v.kind === 'report' && v.delta !== undefined ? [v.delta] : []));
  assert.equal(values[0]?.kind, 'begin', 'onProgress got the values');
  assert.equal(values[values.length - 1].kind, 'end');
  assert.equal(deltas(values).join(''), 'streamed reply text');
  const token = heard[0]?.token;
  assert.ok(token !== undefined, 'the listener heard the progress');
  assert.deepEqual(heard, values.map((value) => ({ token, value })), 'the listener heard the same values, in order');
  assert.deepEqual(heardToo, heard);
  // one listener disposed: the other and onProgress still get everything
  second.dispose();
  const more: ProgressValue[] = [];
  await within(c.operate({ branchId, instruction: 'again', workDoneToken: 'mine' }, { onProgress: (v) => more.push(v) }), 'operate again');
  assert.deepEqual([more[0]?.kind, more[more.length - 1]?.kind, deltas(more).join('')], ['begin', 'end', 'again']);
  assert.deepEqual(heard.slice(values.length), more.map((value) => ({ token: 'mine', value })));
  assert.equal(heardToo.length, values.length);
});

test('toolEvents: a Python tool runs, pre then post with one callId; window/logMessage for a broken module', async () => {
  const c = await server();
  const logs: LogMessage[] = [];
  c.onLogMessage((m) => logs.push(m));
  await within(c.initialize({ settings: { models: { s: scripted(callTool('shout', { text: 'hey' })) }, toolModules: ['no_such_module_xyz', 'ts_fixture_tools'] } }), 'initialize');
  const events: ToolEvent[] = [];
  c.onToolEvent((e) => events.push(e));
  const viaTyped: ToolEvent[] = [];
  c.onNotification('toolEvent', (e) => viaTyped.push(e));
  const { tools } = await within(c.listTools(), 'listTools');
  await until(() => logs.some((m) => m.type === 2 && m.message.includes('no_such_module_xyz')), 'window/logMessage warning');
  const shout = tools.find((t) => t.name === 'shout');
  assert.equal(shout?.source, 'python');
  assert.equal(shout?.policy, 'allow');
  const { branchId } = await within(c.createBranch(), 'createBranch');
  const out = await within(c.operate({ branchId, instruction: 'call it', actions: true }), 'operate');
  assert.deepEqual(outputs(out), ['HEY!']);
  await until(() => events.length >= 2 && viaTyped.length >= 2, 'two toolEvents');
  assert.deepEqual(events.map((e) => e.event), ['pre', 'post']);
  assert.equal(events[0].callId, events[1].callId);
  assert.equal(events[1].seq, events[0].seq + 1);
  assert.equal(events[0].tool, 'shout');
  assert.equal(events[0].branchId, branchId);
  assert.deepEqual(viaTyped, events);
});

test('requestToolPermission: the handler allows, then denies; no handler means deny; authorizeTool', async () => {
  const call = callTool('shout', { text: 'hey' });
  const { c } = await initialized({ models: { s: scripted(call, call, call) }, toolModules: ['ts_fixture_tools'], toolPolicy: { shout: 'ask' } },
    { toolPermission: true });
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
  assert.deepEqual(await within(c.authorizeTool('shout', 'allow', branchId), 'authorizeTool'), { tool: 'shout', decision: 'allow', branchId });
  const pol = (await within(c.listTools(branchId), 'listTools')).tools.find((t) => t.name === 'shout')?.policy;
  assert.equal(pol, 'allow');
});

test('invokeClientTool: a registered client tool is answered by the handler; a thrown error is a tool error', async () => {
  const call = callTool('editor_info', { what: 'version' });
  const { c } = await initialized({ models: { s: scripted(call, call) } }, { clientTools: true });
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
  c.setClientToolHandler(() => { throw new Error('editor is busy'); });
  const failed = outputs(await within(c.operate({ branchId, instruction: 'again', actions: true }), 'operate'))[0];
  assert.equal(failed.function, 'editor_info');
  assert.match(JSON.stringify(failed.error), /editor is busy/);
});

test('invokeClientTool: a handler that returns nothing answers output null (docs/PROTOCOL.md §3), recorded as null', async () => {
  const call = callTool('notify_user', {});
  const { c } = await initialized({ models: { s: scripted(call) } }, { clientTools: true });
  await within(c.registerClientTools([{ name: 'notify_user', description: 'Shows a toast', inputSchema: { type: 'object' } }]), 'registerClientTools');
  let called = 0;
  c.setClientToolHandler(async () => { called++; /* shows a toast: nothing to return */ });
  const { branchId } = await within(c.createBranch(), 'createBranch');
  const out = await within(c.operate({ branchId, instruction: 'tell the user', actions: true }), 'operate');
  assert.equal(called, 1);
  assert.deepEqual(outputs(out), [null]);
  const recorded = (await within(c.branchMessages(branchId), 'branchMessages')).messages.find((m) => m.kind === 'action_response');
  assert.equal(recorded?.content.output, null);
});

test('authorizeTool and listTools with an empty branchId: -32012 as for any unknown branch, never the server-wide policy', async () => {
  const ws = fs.realpathSync(fs.mkdtempSync(path.join(os.tmpdir(), 'ts-client-ws-')));
  const { c } = await initialized({}, undefined, [ws]);
  const policy = async () => (await within(c.listTools(), 'listTools')).tools.find((t) => t.name === 'write_file')?.policy;
  assert.equal(await policy(), 'ask');
  const authorized = await rejection(c.authorizeTool('write_file', 'allow', ''), 'authorizeTool with branchId ""');
  assert.equal(authorized.code, ErrorCodes.BranchNotFound);
  assert.equal(await policy(), 'ask', 'the server-wide decision is unchanged');
  assert.equal((await rejection(c.listTools(''), 'listTools with branchId ""')).code, ErrorCodes.BranchNotFound);
  // omitted: the server-wide decision
  assert.deepEqual(await within(c.authorizeTool('write_file', 'deny'), 'authorizeTool server-wide'), { tool: 'write_file', decision: 'deny', branchId: null });
  assert.equal(await policy(), 'deny');
});

test('fs/readTextFile and fs/writeTextFile: builtin file tools read and write through the handler, not the disk', async () => {
  const ws = fs.realpathSync(fs.mkdtempSync(path.join(os.tmpdir(), 'ts-client-ws-')));
  const file = path.join(ws, 'notes.txt');
  fs.writeFileSync(file, 'on disk\n');
  const { c } = await initialized({
    models: { s: scripted(callTool('read_file', { path: 'notes.txt' }), callTool('write_file', { path: 'notes.txt', content: 'from the model\n' })) },
    toolPolicy: { write_file: 'allow' },
  }, { fs: true }, [ws]);
  const reads: ReadTextFileRequest[] = [];
  const writes: WriteTextFileRequest[] = [];
  const buffers = new Map([[file, 'unsaved buffer text\n']]);
  c.setFileSystemHandler({
    readTextFile: (req) => { reads.push(req); return buffers.get(req.path) ?? ''; },
    writeTextFile: (req) => { writes.push(req); buffers.set(req.path, req.text); },
  });
  const { branchId } = await within(c.createBranch(), 'createBranch');
  const read = outputs(await within(c.operate({ branchId, instruction: 'read it', actions: true }), 'operate read'))[0];
  assert.match(JSON.stringify(read), /unsaved buffer text/, 'the model saw the buffer, not the disk');
  assert.equal(reads.length >= 1, true);
  assert.equal(reads[0].path, file);
  assert.equal(reads[0].branchId, branchId);
  const wrote = outputs(await within(c.operate({ branchId, instruction: 'write it', actions: true }), 'operate write'))[0];
  assert.equal(wrote.error, undefined, JSON.stringify(wrote));
  assert.deepEqual(writes.map((w) => [w.path, w.text]), [[file, 'from the model\n']]);
  assert.equal(fs.readFileSync(file, 'utf8'), 'on disk\n', 'the disk was not written');
  assert.equal(buffers.get(file), 'from the model\n');
});

test('requestToolPermission preview: edit_file asks with a diff computed without writing; deny keeps the file, allow writes it', async () => {
  const ws = fs.realpathSync(fs.mkdtempSync(path.join(os.tmpdir(), 'ts-client-preview-')));
  const file = path.join(ws, 'a.txt');
  fs.writeFileSync(file, 'one\ntwo\n');
  const edit = callTool('edit_file', { path: 'a.txt', edits: [{ oldText: 'two', newText: 'TWO' }] });
  const { c } = await initialized({ models: { s: scripted(edit, edit) } }, { toolPermission: true }, [ws]);
  const asked: PermissionRequest[] = [];
  const answers = ['deny_once', 'allow_once'] as const;
  c.setPermissionHandler((req) => answers[asked.push(req) - 1]);
  const { branchId } = await within(c.createBranch(), 'createBranch');
  const denied = outputs(await within(c.operate({ branchId, instruction: 'edit', actions: true }), 'operate denied'))[0];
  assert.equal(denied.error, 'denied by governance gate');
  assert.equal(fs.readFileSync(file, 'utf8'), 'one\ntwo\n', 'nothing written while asking, nor after a deny');
  assert.equal(asked[0].tool, 'edit_file');
  const preview = asked[0].preview;
  assert.ok(preview, 'the permission request carries a preview');
  assert.equal(preview.kind, 'diff');
  assert.equal(preview.oldText, 'one\ntwo\n');
  assert.equal(preview.newText, 'one\nTWO\n');
  assert.match(preview.diff, /^-two$/m);
  assert.match(preview.diff, /^\+TWO$/m);
  const done = outputs(await within(c.operate({ branchId, instruction: 'edit', actions: true }), 'operate allowed'))[0];
  assert.equal(done.error, undefined, JSON.stringify(done));
  assert.equal(fs.readFileSync(file, 'utf8'), 'one\nTWO\n');
  assert.equal(asked.length, 2);
});

test('usage and rounds: maxRounds runs another round after a tool ran; usage sums every model call; one begin/end', async () => {
  const { c } = await initialized({
    models: { s: scripted(callTool('shout', { text: 'hey' }), 'final answer', 'single') }, toolModules: ['ts_fixture_tools'],
  });
  const { branchId } = await within(c.createBranch(), 'createBranch');
  const values: ProgressValue[] = [];
  const out = await within(c.operate({ branchId, instruction: 'go', actions: true, maxRounds: 3 }, { onProgress: (v) => values.push(v) }), 'operate');
  assert.equal(out.rounds, 2, 'round 1 ran a tool, round 2 ran none: two rounds');
  assert.equal(out.result, 'final answer');
  assert.equal(out.usage?.modelCalls, 2);
  assert.deepEqual(values.map((v) => v.kind).filter((k) => k !== 'report'), ['begin', 'end']);
  const end = values[values.length - 1];
  assert.ok(end.kind === 'end');
  assert.deepEqual(end.usage, out.usage);
  const instructions = (await within(c.branchMessages(branchId), 'branchMessages')).messages.filter((m) => m.kind === 'instruction');
  assert.equal(instructions.length, 2);
  assert.match(String(instructions[1].content.instruction), /^Continue the same task/);
  const one = await within(c.operate({ branchId, instruction: 'once' }), 'operate without maxRounds');
  assert.equal(one.rounds ?? 1, 1);
  assert.equal(one.usage?.modelCalls, 1);
});

test('cancel mid model call sends $/cancelRequest: -32800, progress ends "cancelled", branch stays usable', async () => {
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
  await until(() => values[values.length - 1].kind === 'end', 'progress end');
  assert.equal(values[values.length - 1].message, 'cancelled');
  const again = await within(c.operate({ branchId, instruction: 'again' }), 'operate after cancel');
  assert.equal(again.result, 'next');
});

/** The messages in wire order, as the client sends and receives them from now on (`-> method #id`, `<- #id [code]`). */
async function wireOf(c: SidecarClient): Promise<string[]> {
  const wire: string[] = [];
  await c.connection.trace(Trace.Messages, {
    log: (m: any) => {
      const msg = m.message ?? {};
      if (m.type === 'send-request' || m.type === 'send-notification') wire.push(`-> ${msg.method}${msg.id !== undefined ? ` #${msg.id}` : ''}`);
      if (m.type === 'receive-response') wire.push(`<- #${msg.id}${msg.error ? ` ${msg.error.code}` : ''}`);
    },
  }, { traceFormat: TraceFormat.JSON });
  return wire;
}

test('stop cancels the running requests first ($/cancelRequest before shutdown): they end -32800, answered before shutdown is', async () => {
  const { c } = await initialized({ models: { s: scripted({ text: 'late', delayMs: 60000 }) } });
  const { branchId } = await within(c.createBranch(), 'createBranch');
  const wire = await wireOf(c);
  const values: ProgressValue[] = [];
  const pending = c.operate({ branchId, instruction: 'wait' }, { onProgress: (v) => values.push(v) }).then(() => undefined, (e) => e);
  await until(() => values.length > 0, 'progress begin (the model call started)');
  assert.equal(await within(c.stop(5000), 'stop', 15_000), 0);
  const err = await within(pending, 'the running operate ends');
  assert.ok(err instanceof ResponseError && err.code === ErrorCodes.Cancelled, `cancelled (-32800), got ${err}`);
  const op = /^-> operate #(\d+)$/.exec(wire[0])?.[1];
  const shutdown = wire.find((w) => w.startsWith('-> shutdown'))?.split('#')[1];
  assert.ok(op && shutdown, JSON.stringify(wire));
  assert.deepEqual(wire, ['-> operate #' + op, '-> $/cancelRequest', '-> shutdown #' + shutdown, `<- #${op} -32800`, `<- #${shutdown}`, '-> exit'],
    'the operate is cancelled before shutdown is sent, and answered before it');
});

test('stop() called again while it runs shares that stop: the same promise and result; shutdown and exit written once, the shutdown not cancelled', async () => {
  const { c } = await initialized({ models: { s: scripted('x') } });
  const wire = await wireOf(c);
  const first = c.stop(5000);
  const second = c.stop(5000);   // while the first waits for the answer to its shutdown
  assert.equal(await within(first, 'first stop', 15_000), 0);
  assert.equal(await within(second, 'second stop', 15_000), 0);
  const shutdown = /^-> shutdown #(\d+)$/.exec(wire[0] ?? '')?.[1];
  assert.deepEqual(wire, [`-> shutdown #${shutdown}`, `<- #${shutdown}`, '-> exit'], 'one shutdown, answered (not cancelled), one exit');
  assert.equal(second, first, 'the second stop() returns the first one\'s promise');
  assert.equal(await within(c.stop(5000), 'a stop after the end', 15_000), 0);
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

test('a server that dies at start: initialize rejects with its exit code and stderr, onExit reports it (not "write EPIPE")', async () => {
  const bad = path.join(os.tmpdir(), `ts-client-bad-${process.pid}.toml`);
  fs.writeFileSync(bad, 'x = [\n');
  const c = await SidecarClient.start({ command: serverCommand('--config', bad), cwd: REPO });
  const exits: ExitInfo[] = [];
  c.onExit((i) => exits.push(i));
  // give it time to die first, so the request really is written to a dead process
  await within(c.exited, 'the server exits');
  let err: unknown;
  try { await within(c.initialize({}), 'initialize to a dead server'); } catch (e) { err = e; }
  assert.ok(err instanceof SidecarExitedError, `expected SidecarExitedError, got ${err}`);
  assert.equal(err.exitCode, 2);
  assert.match(err.message, /exit code 2/);
  assert.match(err.message, /bad configuration/);
  assert.doesNotMatch(err.message, /EPIPE/);
  assert.deepEqual(exits.map((i) => i.exitCode), [2]);
  assert.match(exits[0].stderrTail, /bad configuration/);
  assert.match(c.stderrTail, /bad configuration/);
  assert.equal(c.running, false);

  // racing: the request is sent while the process is still starting up
  const d = await SidecarClient.start({ command: serverCommand('--config', bad), cwd: REPO });
  const raced = await within(d.initialize({}).then(() => undefined, (e) => e), 'initialize while it dies');
  assert.ok(raced instanceof SidecarExitedError, `expected SidecarExitedError, got ${raced}`);
  assert.match(raced.stderrTail, /bad configuration/);
  fs.rmSync(bad);
});

test('a server that dies mid-request fails the pending request with SidecarExitedError instead of hanging', async () => {
  const { c } = await initialized({ models: { s: scripted({ text: 'late', delayMs: 60000 }) } });
  const { branchId } = await within(c.createBranch(), 'createBranch');
  const exits: ExitInfo[] = [];
  c.onExit((i) => exits.push(i));
  const pending = c.operate({ branchId, instruction: 'wait' });
  await within(c.ping(), 'ping');
  c.kill();
  await assert.rejects(within(pending, 'pending operate after kill'), (e: Error) => e instanceof SidecarExitedError && e.signal === 'SIGKILL');
  assert.equal(await within(c.exited, 'exit'), 'SIGKILL');
  assert.deepEqual(exits.map((i) => i.signal), ['SIGKILL']);
  await assert.rejects(c.ping(), SidecarExitedError);
  assert.equal(c.running, false);
  void stderr;
});

test('a server that dies while a handler answers its request (requestToolPermission waiting for the user): the handler\'s token is cancelled, nothing waits for ever', async () => {
  const call = callTool('shout', { text: 'hey' });
  const { c } = await initialized({ models: { s: scripted(call) }, toolModules: ['ts_fixture_tools'], toolPolicy: { shout: 'ask' } },
    { toolPermission: true });
  const { branchId } = await within(c.createBranch(), 'createBranch');
  let asked: { token: CancellationToken; cancelledBefore: boolean } | undefined;
  let withdrawn = false;
  // a handler that waits for a decision that never comes: only its token ends it
  c.setPermissionHandler((_req, token) => new Promise((resolve) => {
    asked = { token, cancelledBefore: token.isCancellationRequested };
    token.onCancellationRequested(() => { withdrawn = true; resolve('deny_once'); });
  }));
  const pending = c.operate({ branchId, instruction: 'call', actions: true });
  pending.catch(() => undefined);
  await until(() => asked !== undefined, 'the permission request');
  assert.equal(asked!.cancelledBefore, false, 'a live request: its token is not cancelled');
  assert.equal(withdrawn, false);
  c.kill();
  await until(() => withdrawn, 'the handler\'s token cancelled by the exit');
  assert.equal(asked!.token.isCancellationRequested, true);
  await assert.rejects(within(pending, 'the operate after kill'), (e: Error) => e instanceof SidecarExitedError && e.signal === 'SIGKILL');
});

test('a request written to a server that was killed, its exit not reported yet, fails naming the signal (not "write EPIPE")', async () => {
  const { c } = await initialized({ models: { s: scripted('x') } });
  const { branchId } = await within(c.createBranch(), 'createBranch');
  // the kill and the wait for the end of the process run just before the request is written (both immediates, in
  // this order): the write meets a dead process whose exit Node has not reported yet
  let unreported: boolean | undefined;
  setImmediate(() => { c.process.kill('SIGKILL'); endedUnreported(c.process.pid!); unreported = c.running; });
  let writeError: string | undefined;
  c.process.stdin!.once('error', (e: NodeJS.ErrnoException) => { writeError = e.code; });
  const err = await within(c.operate({ branchId, instruction: 'too late' }).then(() => undefined, (e) => e), 'operate to the killed server');
  assert.equal(unreported, true, 'the process had ended, its exit not reported, when the request was written');
  assert.equal(writeError, 'EPIPE', 'the write failed');
  assert.ok(err instanceof SidecarExitedError, `expected SidecarExitedError, got ${err}`);
  assert.equal(err.signal, 'SIGKILL');
  assert.match(err.message, /^operate-sidecar: the server exited \(signal SIGKILL\) before answering operate/);
  assert.doesNotMatch(err.message, /EPIPE/);
});

test('initialize time-out: a server that never answers (or prints a non-frame line first) rejects with SidecarTimeoutError instead of hanging', async () => {
  assert.equal(DEFAULT_INITIALIZE_TIMEOUT_MS, 30_000);
  // silent: reads stdin, answers nothing
  const silent = await SidecarClient.start({ command: [process.execPath, '-e', 'process.stdin.resume(); setTimeout(() => {}, 60000)'] });
  try {
    const t0 = Date.now();
    const err = await within(silent.initialize({}, { timeoutMs: 800 }).then(() => undefined, (e) => e), 'initialize to a silent server', 10_000);
    assert.ok(err instanceof SidecarTimeoutError, `expected SidecarTimeoutError, got ${err}`);
    assert.ok(Date.now() - t0 >= 700, 'not before the time-out');
    assert.equal(err.method, 'initialize');
    assert.equal(err.timeoutMs, 800);
    assert.match(err.message, /did not answer initialize within 800 ms/);
    assert.equal(err.stdoutHead, '');
    assert.equal(silent.running, true, 'the process is left to the caller');
  } finally { silent.kill(); }
  await within(silent.exited, 'the silent server is killed');

  // a line on stdout that is not a frame (a print() in the server, a wrong program): the framing never recovers
  const chatty = await SidecarClient.start({ command: [process.execPath, '-e',
    'process.stdout.write("hello from a print\\n"); process.stderr.write("started\\n"); process.stdin.resume(); setTimeout(() => {}, 60000)'] });
  try {
    const err = await within(chatty.initialize({}, { timeoutMs: 1000 }).then(() => undefined, (e) => e), 'initialize to a chatty server', 10_000);
    assert.ok(err instanceof SidecarTimeoutError, `expected SidecarTimeoutError, got ${err}`);
    assert.match(err.message, /did not answer initialize within 1 s; its stdout is not JSON-RPC .* "hello from a print"/);
    assert.match(err.message, /stderr ends with:\nstarted/);
  } finally { chatty.kill(); }
  await within(chatty.exited, 'the chatty server is killed');

  // the real server answers well within a time-out; a command that is not an argv array is refused clearly
  const { c } = await initialized({ models: { s: scripted('x') } });
  assert.equal(c.running, true);
  await assert.rejects(SidecarClient.start({ command: 'operate-sidecar' as unknown as string[] }),
    /the server command must be an array of strings \(argv\), got "operate-sidecar"/);
});

test('listeners that throw: the other toolEvent and onExit listeners still run, exited resolves, no unhandled rejection', async () => {
  const unhandled: unknown[] = [];
  const onUnhandled = (e: unknown) => { unhandled.push(e); };
  process.on('unhandledRejection', onUnhandled);
  try {
    const { c } = await initialized({ models: { s: scripted(callTool('shout', { text: 'hey' })) }, toolModules: ['ts_fixture_tools'] });
    c.onToolEvent(() => { throw new Error('a faulty listener'); });
    const events: string[] = [];
    c.onToolEvent((e) => events.push(e.event));
    const { branchId } = await within(c.createBranch(), 'createBranch');
    await within(c.operate({ branchId, instruction: 'call it', actions: true }), 'operate');
    await until(() => events.length >= 2, 'the second listener sees pre and post');
    assert.deepEqual(events, ['pre', 'post']);

    const exits: ExitInfo[] = [];
    c.onExit(() => { throw new Error('a faulty exit listener'); });
    c.onExit((i) => exits.push(i));
    const pending = c.operate({ branchId, instruction: 'nothing left in the script' }).then(() => undefined, (e) => e);
    c.kill();
    assert.equal(await within(c.exited, 'exited resolves'), 'SIGKILL');
    assert.deepEqual(exits.map((i) => i.signal), ['SIGKILL']);
    const err = await within(pending, 'the pending request fails');
    assert.ok(err instanceof SidecarExitedError || (err as any)?.code === ErrorCodes.ModelError, `got ${err}`);
    await assert.rejects(within(c.ping(), 'ping after exit'), SidecarExitedError);
    assert.equal(await within(c.stop(), 'stop after exit'), 'SIGKILL');
    await new Promise((r) => setImmediate(r));
    assert.deepEqual(unhandled, []);
  } finally {
    process.off('unhandledRejection', onUnhandled);
  }
});

// A stand-in server (node -e): reads framed messages and hands each request to `onRequest(msg)` (its code,
// with `send(obj)` to answer); it ends at the end of its input.
const standIn = (onRequest: string) => `
let buf = Buffer.alloc(0); let n = 0;
const send = (o) => { const b = Buffer.from(JSON.stringify(o)); process.stdout.write('Content-Length: ' + b.length + '\\r\\n\\r\\n'); process.stdout.write(b); };
process.stdin.on('data', (d) => {
  buf = Buffer.concat([buf, d]);
  for (;;) {
    const end = buf.indexOf('\\r\\n\\r\\n'); if (end < 0) return;
    const len = Number(/Content-Length: (\\d+)/i.exec(buf.subarray(0, end).toString())[1]);
    if (buf.length < end + 4 + len) return;
    const msg = JSON.parse(buf.subarray(end + 4, end + 4 + len).toString()); buf = buf.subarray(end + 4 + len);
    if (msg.id === undefined) continue;
    ${onRequest}
  }
});
process.stdin.on('end', () => process.exit(0));
`;

// answers every request (shutdown too) and never takes `exit`
const NO_EXIT_SERVER = standIn(`send({ jsonrpc: '2.0', id: msg.id, result: null });`);

test('stop ends the server input after exit: a server that does not take exit ends on it, not killed after the wait', async () => {
  const c = await SidecarClient.start({ command: [process.execPath, '-e', NO_EXIT_SERVER] });
  try {
    assert.equal(await within(c.ping(), 'ping'), null);
    assert.equal(await within(c.stop(5000), 'stop', 15_000), 0);
  } finally { c.kill(); }
});

test('stderrTailChars: 0 keeps none of stderr, n keeps its last n characters', async () => {
  const writes = `process.stderr.write('x'.repeat(100000) + 'THE END'); process.exitCode = 3`;
  for (const [chars, tail] of [[0, ''], [7, 'THE END']] as const) {
    const c = await SidecarClient.start({ command: [process.execPath, '-e', writes], stderrTailChars: chars });
    const exits: ExitInfo[] = [];
    c.onExit((i) => exits.push(i));
    assert.equal(await within(c.exited, 'the process ends'), 3);
    assert.equal(c.stderrTail, tail, `stderrTailChars ${chars}`);
    assert.deepEqual(exits.map((i) => i.stderrTail), [tail]);
    const err = await within(c.ping().then(() => undefined, (e) => e), 'ping to the ended process');
    assert.ok(err instanceof SidecarExitedError && err.stderrTail === tail, `expected SidecarExitedError with stderrTail ${JSON.stringify(tail)}, got ${err}`);
  }
});

// answers the first request (its frame with an extra header, Content-Type), the second with a stray line in
// the same write, and never the third: the stray line ends in a newline and nothing follows it
const STRAY_THEN_SILENT = standIn(`n++;
    const body = JSON.stringify({ jsonrpc: '2.0', id: msg.id, result: { n } });
    const frame = 'Content-Length: ' + Buffer.byteLength(body) + '\\r\\nContent-Type: application/vscode-jsonrpc; charset=utf-8\\r\\n\\r\\n' + body;
    if (n === 1) process.stdout.write(frame);
    if (n === 2) process.stdout.write(frame + 'a stray print from a library\\n');`);

test('a stray line that ends in a newline with nothing after it: pending and later requests reject with SidecarStreamError at once; an answer read before it settles its request', async () => {
  const c = await SidecarClient.start({ command: [process.execPath, '-e', STRAY_THEN_SILENT] });
  try {
    assert.deepEqual(await within(c.ping(), 'first ping'), { n: 1 });
    assert.deepEqual(await within(c.ping(), 'second ping, answered in the write that holds the stray line'), { n: 2 });
    const third = await within(c.ping().then(() => undefined, (e) => e), 'a ping the server never answers, after the stray line', 10_000);
    assert.ok(third instanceof SidecarStreamError, `expected SidecarStreamError, got ${third}`);
    assert.match(third.message, /no longer readable as JSON-RPC \(a line that is not a frame header: "a stray print from a library\\n"\)/);
    assert.equal(third.reason, 'a line that is not a frame header: "a stray print from a library\\n"');
    const later = await within(c.request('listBranches').then(() => undefined, (e) => e), 'a later request', 10_000);
    assert.ok(later instanceof SidecarStreamError, `expected SidecarStreamError, got ${later}`);
    assert.equal(c.running, true, 'the process is still there');
    assert.equal(await within(c.stop(5000), 'stop closes its stdin', 10_000), 0);
  } finally { c.kill(); }
});

// answers the first request with a frame whose header is written byte by byte, its name in lowercase, and whose body
// holds a blank line and a line like a log line; the second with `line` in the same write; never the third
const HEADERLIKE_STRAY_THEN_SILENT = (line: string) => standIn(`n++;
    const body = JSON.stringify({ jsonrpc: '2.0', id: msg.id, result: { n, text: 'a\\r\\n\\r\\nINFO:root:in a body\\n' } });
    const header = 'content-length: ' + Buffer.byteLength(body) + '\\r\\n\\r\\n';
    if (n === 1) { for (const ch of header) process.stdout.write(ch); process.stdout.write(body); }
    if (n === 2) process.stdout.write(header + body + ${JSON.stringify(line)});`);

test('a stray line that begins as a header does (a name and a colon) and ends in a bare newline, nothing after it: SidecarStreamError at once', async () => {
  for (const line of ['INFO:root:loaded\n', 'Loaded: 3 models\n', 'Warning: x\n']) {
    const c = await SidecarClient.start({ command: [process.execPath, '-e', HEADERLIKE_STRAY_THEN_SILENT(line)] });
    try {
      const text = 'a\r\n\r\nINFO:root:in a body\n';
      assert.deepEqual(await within(c.ping(), 'first ping'), { n: 1, text });
      assert.deepEqual(await within(c.ping(), 'second ping, answered in the write that holds the stray line'), { n: 2, text });
      const third = await within(c.ping().then(() => undefined, (e) => e), `a ping the server never answers, after ${JSON.stringify(line)}`, 10_000);
      assert.ok(third instanceof SidecarStreamError, `expected SidecarStreamError, got ${third}`);
      assert.equal(third.reason, `a line that is not a frame header: ${JSON.stringify(line)}`);
      assert.equal(await within(c.stop(5000), 'stop closes its stdin', 10_000), 0);
    } finally { c.kill(); }
  }
});

// answers the first request, then writes a line that is not a frame before the next answer
const GARBAGE_SERVER = standIn(`if (++n === 2) process.stdout.write('a stray print from a library\\n');
    send({ jsonrpc: '2.0', id: msg.id, result: {} });`);

test('a server that writes garbage mid-session: pending and later requests reject with SidecarStreamError instead of hanging; stop ends it', async () => {
  const c = await SidecarClient.start({ command: [process.execPath, '-e', GARBAGE_SERVER] });
  try {
    assert.deepEqual(await within(c.ping(), 'first ping'), {});
    const second = await within(c.ping().then(() => undefined, (e) => e), 'ping answered after a stray line', 10_000);
    assert.ok(second instanceof SidecarStreamError, `expected SidecarStreamError, got ${second}`);
    assert.match(second.message, /no longer readable as JSON-RPC/);
    assert.match(second.stdoutHead, /a stray print from a library/);
    const third = await within(c.request('listBranches').then(() => undefined, (e) => e), 'a later request', 10_000);
    assert.ok(third instanceof SidecarStreamError, `expected SidecarStreamError, got ${third}`);
    assert.equal(c.running, true, 'the process is still there');
    assert.equal(await within(c.stop(5000), 'stop closes its stdin', 10_000), 0);
  } finally { c.kill(); }
});

// answers initialize, then on `initialized` closes its output and exits with code 4 a moment later: the client sees
// its output end while the process still runs
const CLOSES_OUTPUT = standIn(`send({ jsonrpc: '2.0', id: msg.id, result: { protocolVersion: 1, serverInfo: { name: 'stand-in', version: '0' }, capabilities: {} } });`)
  .replace("if (msg.id === undefined) continue;", "if (msg.method === 'initialized') { process.stderr.write('stand-in: closing stdout\\n'); require('fs').closeSync(1); setTimeout(() => process.exit(4), 300); }\n    if (msg.id === undefined) continue;");

test('a request sent after the server closed its output, its exit not reported yet, fails naming how it ended (not "Connection is closed.")', async () => {
  const c = await SidecarClient.start({ command: [process.execPath, '-e', CLOSES_OUTPUT] });
  try {
    const closed = new Promise<void>((r) => c.connection.onClose(() => r()));
    await within(c.initialize({}), 'initialize');
    await within(closed, 'the connection closes when the output ends');
    assert.equal(c.running, true, 'the process still runs when the request is sent');
    const err = await within(c.request('listBranches').then(() => undefined, (e) => e), 'a request after the output ended');
    assert.ok(err instanceof SidecarExitedError, `expected SidecarExitedError, got ${err}`);
    assert.equal(err.exitCode, 4);
    assert.match(err.message, /^operate-sidecar: the server exited \(exit code 4\) before answering listBranches/);
    assert.match(err.stderrTail, /stand-in: closing stdout/);
    assert.doesNotMatch(err.message, /Connection is/);
  } finally { c.kill(); }
});

// answers initialize (and says so on stderr); exits with code 3 on SIGUSR2
// stderr first: the test kills the stand-in as soon as the answer is read (a line written after it could be lost)
const ANSWERS_INITIALIZE = `process.on('SIGUSR2', () => process.exit(3));
${standIn(`process.stderr.write('stand-in: initialize answered\\n');
    send({ jsonrpc: '2.0', id: msg.id, result: { protocolVersion: 1, serverInfo: { name: 'stand-in', version: '0' }, capabilities: {} } });`)}`;

test('a server that exits right after answering initialize (with a code, by a signal): initialize rejects with SidecarExitedError naming how (not "write EPIPE")', async () => {
  for (const [signal, how] of [['SIGUSR2', 'exit code 3'], ['SIGKILL', 'signal SIGKILL']] as const) {
    const c = await SidecarClient.start({ command: [process.execPath, '-e', ANSWERS_INITIALIZE] });
    try {
      // the answer has arrived (it is being handled, not yet delivered): the server ends now, and the client waits
      // (blocking: Node reports no exit meanwhile) until it has ended. `initialized` is then written to a dead process.
      await c.connection.trace(Trace.Messages, {
        log: (m: any) => {
          if (m.type !== 'receive-response') return;
          c.process.kill(signal);
          endedUnreported(c.process.pid!);
        },
      }, { traceFormat: TraceFormat.JSON });
      const err = await within(c.initialize({}).then(() => undefined, (e) => e), `initialize (${signal})`);
      assert.ok(err instanceof SidecarExitedError, `${signal}: expected SidecarExitedError, got ${err}`);
      assert.deepEqual([err.exitCode, err.signal], signal === 'SIGKILL' ? [null, 'SIGKILL'] : [3, null]);
      assert.ok(err.message.startsWith(`operate-sidecar: the server exited (${how}) before receiving the initialized notification`), err.message);
      assert.match(err.message, /its stderr ends with:\nstand-in: initialize answered/);
      assert.match(err.stderrTail, /stand-in: initialize answered/);
      assert.doesNotMatch(err.message, /EPIPE|Connection is/);
      assert.equal(c.running, false);
    } finally { c.kill(); }
  }
});

// A stand-in server that never answers operate (the real server always answers a cancelled request, with -32800): it
// holds every operate until a `release` request, then answers the held ones (late: for one with a workDoneToken, its
// last $/progress, end "cancelled", just before) and the release; it answers any other request (shutdown too) at once.
const HOLDS_OPERATE = `const held = [];
${standIn(`if (msg.method === 'operate') { held.push({ id: msg.id, token: msg.params && msg.params.workDoneToken }); continue; }
    if (msg.method === 'release') for (const { id, token } of held.splice(0)) {
      if (token !== undefined) send({ jsonrpc: '2.0', method: '$/progress', params: { token, value: { kind: 'end', message: 'cancelled' } } });
      send({ jsonrpc: '2.0', id, result: { result: 'late', kind: 'text' } });
    }
    send({ jsonrpc: '2.0', id: msg.id, result: {} });`)}`;

test('cancel when the server never answers: the request rejects -32800 at once, after its $/cancelRequest is written; a late answer is ignored', async () => {
  const unhandled: unknown[] = [];
  const onUnhandled = (e: unknown) => { unhandled.push(e); };
  process.on('unhandledRejection', onUnhandled);
  const c = await SidecarClient.start({ command: [process.execPath, '-e', HOLDS_OPERATE] });
  try {
    const wire = await wireOf(c);
    // how the promise settled, and the wire at that moment
    const ended = (p: Promise<unknown>) => p.then((r) => ({ r, e: undefined, wire: [...wire] }), (e) => ({ r: undefined, e, wire: [...wire] }));
    const source = new CancellationTokenSource();
    const values: ProgressValue[] = [];
    const pending = ended(c.operate({ branchId: 'b', instruction: 'wait' }, { token: source.token, onProgress: (v) => values.push(v) }));
    assert.deepEqual(await within(c.ping(), 'ping (the operate was written before it)'), {});
    source.cancel();
    const first = await within(pending, 'the cancelled operate settles though the server never answers it', 10_000);
    assert.ok(first.e instanceof ResponseError && first.e.code === ErrorCodes.Cancelled, `expected -32800, got ${first.e ?? JSON.stringify(first.r)}`);
    const op = /^-> operate #(\d+)$/.exec(first.wire[0])?.[1];
    assert.ok(op, JSON.stringify(first.wire));
    assert.equal(first.wire[first.wire.length - 1], '-> $/cancelRequest', `$/cancelRequest written before the rejection: ${JSON.stringify(first.wire)}`);
    assert.ok(!first.wire.includes(`<- #${op}`), 'the server had not answered');

    // a token cancelled already: the request is written, then its cancel, then it rejects
    const pre = new CancellationTokenSource();
    pre.cancel();
    const from = wire.length;
    const second = await within(ended(c.request('operate', { branchId: 'b', instruction: 'x' }, pre.token)), 'a request with a cancelled token settles', 10_000);
    assert.ok(second.e instanceof ResponseError && second.e.code === ErrorCodes.Cancelled, `expected -32800, got ${second.e ?? JSON.stringify(second.r)}`);
    const op2 = /^-> operate #(\d+)$/.exec(second.wire[from] ?? '')?.[1];
    assert.deepEqual(second.wire.slice(from), [`-> operate #${op2}`, '-> $/cancelRequest'], JSON.stringify(second.wire));

    // the server answers both now, late: ignored; the connection goes on
    assert.deepEqual(values, []);   // no progress before the release
    assert.deepEqual(await within(c.request('release'), 'release'), {});
    assert.ok(wire.includes(`<- #${op}`) && wire.includes(`<- #${op2}`), `the late answers arrived: ${JSON.stringify(wire)}`);
    assert.deepEqual(await within(c.ping(), 'ping after the late answers'), {});
    // the cancelled operate's last progress, sent just before its late answer, reached onProgress (kept until the answer)
    assert.deepEqual(values, [{ kind: 'end', message: 'cancelled' }]);
    await new Promise((r) => setImmediate(r));
    assert.deepEqual(unhandled, []);
    assert.equal(await within(c.stop(5000), 'stop', 15_000), 0);
  } finally {
    c.kill();
    process.off('unhandledRejection', onUnhandled);
  }
});
