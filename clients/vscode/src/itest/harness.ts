// What the extension-host test modules (index.ts, chats.ts, multiRoot.ts, noFolder.ts) share: bounded
// waits, scripted models, the extension's own `vscode` API (its messages recorded), the check runner
// and the JSON report run-itest.mjs reads from $OPERATE_SIDECAR_ITEST_REPORT.
import * as fs from 'node:fs';
import { createRequire } from 'node:module';
import * as path from 'node:path';
import * as vscode from 'vscode';

export const EXT_ID = 'operate-sidecar.operate-sidecar-vscode';
export const STEP_MS = 30_000;
/** Upper bound for one whole check: a check that hangs is reported as failed and the run goes on. */
export const CHECK_MS = 90_000;

export interface Check { name: string; ok: boolean; ms: number; error?: string }

export function within<T>(p: Thenable<T>, what: string, ms = STEP_MS): Promise<T> {
  let timer: NodeJS.Timeout;
  const t = new Promise<never>((_, rej) => { timer = setTimeout(() => rej(new Error(`timeout after ${ms} ms: ${what}`)), ms); });
  return Promise.race([Promise.resolve(p), t]).finally(() => clearTimeout(timer));
}
export function expect(cond: unknown, msg: string): asserts cond {
  if (!cond) throw new Error(msg);
}
export const exec = <T>(cmd: string, ...args: unknown[]) => within(vscode.commands.executeCommand<T>(cmd, ...args), cmd);

/** Waits until `cond()` holds (checked every 20 ms), or fails after `ms` naming `what`. */
export async function until(cond: () => boolean, what: string, ms = STEP_MS): Promise<void> {
  const end = Date.now() + ms;
  while (!cond()) {
    if (Date.now() > end) throw new Error(`timeout after ${ms} ms waiting for ${what}`);
    await new Promise((r) => setTimeout(r, 20));
  }
}

/** An inline scripted model answering `responses` in order (docs/PROTOCOL.md §2, Model configurations). */
export const scripted = (...responses: unknown[]) => ({ provider: 'scripted', responses });

/**
 * The `vscode` API object the extension itself uses. VS Code hands every extension its own API
 * instance: `require('vscode')` is resolved by the requiring file's path (extension path index),
 * and a test module outside the extension (the unpacked .vsix case) gets a different, default
 * instance whose `window` is not the one the extension calls. Requiring 'vscode' on behalf of a
 * file inside the extension returns the extension's (cached) instance.
 */
export function extensionVscode(ext: vscode.Extension<unknown>): typeof vscode {
  const main = path.join(fs.realpathSync(ext.extensionPath), 'out', 'extension.js');
  return createRequire(main)('vscode') as typeof vscode;
}

/**
 * Records in `shown` (as `<kind>: <message>`) every message of the `kinds` given (`showErrorMessage`,
 * `showWarningMessage`, `showInformationMessage`) the extension shows on its own `vscode.window`
 * (see extensionVscode), passed through to the real one.
 */
export function recordMessages(ext: vscode.Extension<unknown>, shown: string[], kinds: readonly string[]): void {
  const win = extensionVscode(ext).window as any;
  for (const k of kinds) {
    const orig = win[k];
    win[k] = (message: string, ...rest: unknown[]) => { shown.push(`${k}: ${message}`); return orig.call(win, message, ...rest); };
  }
}

/** A check runner recording into ``checks``: each check is bounded by CHECK_MS, a failure is
 * recorded with its stack and the run goes on; ``after`` runs after every check. */
export function checkRunner(checks: Check[], after?: () => void) {
  return async (name: string, fn: () => Promise<void>) => {
    const t0 = Date.now();
    try {
      await within(fn(), `check "${name}"`, CHECK_MS);
      checks.push({ name, ok: true, ms: Date.now() - t0 });
    } catch (e) {
      checks.push({ name, ok: false, ms: Date.now() - t0, error: e instanceof Error ? `${e.message}\n${e.stack ?? ''}`.slice(0, 2000) : String(e) });
    } finally {
      after?.();
    }
  };
}

/** Write the run's report (atomically) where run-itest.mjs looks for it: ok, the fatal error,
 * the host's identity, the extension loaded, the checks, and ``extra`` fields of the suite. */
export function writeReport(checks: Check[], fatal: string | undefined, extra: Record<string, unknown>): void {
  const reportPath = process.env.OPERATE_SIDECAR_ITEST_REPORT;
  const report = {
    ok: !fatal && checks.length > 0 && checks.every((c) => c.ok),
    fatal,
    vscodeVersion: vscode.version,
    appName: vscode.env.appName,
    extensionPath: vscode.extensions.getExtension(EXT_ID)?.extensionPath,
    checks,
    ...extra,
  };
  if (reportPath) {
    fs.writeFileSync(reportPath + '.tmp', JSON.stringify(report, null, 2));
    fs.renameSync(reportPath + '.tmp', reportPath);
  }
}
