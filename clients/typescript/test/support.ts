// Helpers for the node tests: every wait is bounded; servers started here are stopped after each test.
import * as assert from 'node:assert/strict';
import * as fs from 'node:fs';
import * as path from 'node:path';
import { JsonObject, ResponseError, SidecarClient, StartOptions } from '../src/index';

export const PKG = path.resolve(__dirname, '..', '..');          // clients/typescript (from dist-test/test)
export const REPO = path.resolve(PKG, '..', '..');
export const FIXTURES = path.join(PKG, 'test', 'fixtures');
const VENV_PY = path.join(REPO, '.venv', 'bin', 'python');
export const PYTHON = process.env.OPERATE_SIDECAR_PYTHON ?? (fs.existsSync(VENV_PY) ? VENV_PY : 'python3');
export const WAIT_MS = 20_000;

export function within<T>(p: Promise<T>, what: string, ms = WAIT_MS): Promise<T> {
  let timer: NodeJS.Timeout;
  const t = new Promise<never>((_, rej) => { timer = setTimeout(() => rej(new Error(`timeout after ${ms} ms: ${what}`)), ms); });
  return Promise.race([p, t]).finally(() => clearTimeout(timer));
}
export async function until(cond: () => boolean, what: string, ms = WAIT_MS): Promise<void> {
  const end = Date.now() + ms;
  while (!cond()) {
    if (Date.now() > end) throw new Error(`timeout after ${ms} ms waiting for ${what}`);
    await new Promise((r) => setTimeout(r, 10));
  }
}
/**
 * Blocks (the event loop too, so Node cannot report the exit) until process `pid` has ended: a zombie whose
 * threads have all exited, so its pipes are closed, but not yet reaped by Node. Linux (/proc); bounded by `ms`.
 */
export function endedUnreported(pid: number, ms = WAIT_MS): void {
  const end = Date.now() + ms;
  const nap = new Int32Array(new SharedArrayBuffer(4));
  for (;;) {
    const stat = fs.readFileSync(`/proc/${pid}/stat`, 'utf8');
    // the main thread is a zombie once it exited; the process's files are closed once no other thread is left
    if (stat.slice(stat.lastIndexOf(')') + 2).startsWith('Z') && fs.readdirSync(`/proc/${pid}/task`).length === 1) return;
    if (Date.now() > end) throw new Error(`timeout after ${ms} ms waiting for process ${pid} to end`);
    Atomics.wait(nap, 0, 0, 5);
  }
}
export async function rejection(p: Promise<unknown>, what: string): Promise<ResponseError<unknown>> {
  try {
    await within(p, what);
  } catch (e) {
    assert.ok(e instanceof ResponseError, `${what}: expected a ResponseError, got ${e}`);
    return e;
  }
  assert.fail(`${what}: expected an error response`);
}

export const scripted = (...responses: unknown[]) => ({ provider: 'scripted', responses }) as JsonObject;
export const callTool = (fn: string, args: JsonObject) => ({ json: { action_requests: [{ function: fn, arguments: args }] } });
export const outputs = (r: any) => (r.result.action_responses as any[]).map((a) => a.output);

const started: SidecarClient[] = [];
export const stderr = { text: '' };
export function serverCommand(...args: string[]): string[] { return [PYTHON, '-m', 'operate_sidecar.server', ...args]; }
export async function server(opts: Partial<StartOptions> = {}): Promise<SidecarClient> {
  const c = await SidecarClient.start({
    command: serverCommand(), cwd: REPO,
    env: { ...process.env, PYTHONPATH: [FIXTURES, REPO, process.env.PYTHONPATH ?? ''].join(path.delimiter) },
    onStderr: (t) => { stderr.text += t; },
    ...opts,
  });
  started.push(c);
  return c;
}
export async function initialized(settings: JsonObject, capabilities?: { toolPermission?: boolean; clientTools?: boolean; fs?: boolean },
  workspaceFolders?: string[]) {
  const c = await server();
  const r = await within(c.initialize({ clientInfo: { name: 'node-test' }, processId: process.pid, capabilities, settings, workspaceFolders }), 'initialize');
  return { c, r };
}
export async function stopAll(): Promise<void> {
  for (const c of started.splice(0)) await within(c.stop(5000), 'server stop', 15_000);
  stderr.text = '';
}
