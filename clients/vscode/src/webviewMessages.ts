// The messages the chat's webview (media/chat.js) posts to the extension, checked before anything is done with
// them: the page is the extension's own, but what it posts is data (built from the DOM, from attributes of
// the rendered conversation), so a message of another shape (a bug, a page of another version) must not send
// the server an answer it did not offer, leave a request unanswered, or run an arbitrary command.
// No `vscode` import: unit-tested with node's test runner.
import { isPermissionDecision } from './chatModel';
import type { PermissionDecision } from './rpcClient';

/** The commands the page runs (its header's buttons: the chat picker, the model picker, New): no other. */
export const WEBVIEW_COMMANDS: readonly string[] = ['operateSidecar.pickBranch', 'operateSidecar.pickModel', 'operateSidecar.newChat'];

export type WebviewMessage =
  | { type: 'ready'; mod: 'Ctrl' | 'Cmd' }
  | { type: 'send'; text: string }
  | { type: 'retry'; id: string }
  | { type: 'stop' }
  | { type: 'focus'; focused: boolean }
  | { type: 'decide'; callId: string; decision: PermissionDecision }
  | { type: 'showDiff'; callId: string }
  | { type: 'copy'; code: string }
  | { type: 'copyReply'; index: number }
  | { type: 'insert'; code: string }
  | { type: 'command'; id: string }
  | { type: 'attach' }
  | { type: 'drop'; uris: string[] }
  | { type: 'complete'; seq: number; before: string; fresh: boolean }
  | { type: 'streamTaken'; seq: number };

const isText = (v: unknown): v is string => typeof v === 'string';

/**
 * The message `m` as one of the page's messages, its fields of the types it posts; undefined for anything else
 * (not an object, an unknown type, a field missing or of another type, a decision that is none of the four, a
 * command the page does not run). Fields it does not read are left out.
 */
export function webviewMessage(m: unknown): WebviewMessage | undefined {
  if (typeof m !== 'object' || m === null || Array.isArray(m)) return undefined;
  const o = m as Record<string, unknown>;
  switch (o.type) {
    case 'ready': return { type: 'ready', mod: o.mod === 'Cmd' ? 'Cmd' : 'Ctrl' };
    case 'stop': return { type: 'stop' };
    case 'attach': return { type: 'attach' };
    case 'send': return isText(o.text) ? { type: 'send', text: o.text } : undefined;
    case 'retry': return isText(o.id) && o.id ? { type: 'retry', id: o.id } : undefined;
    case 'focus': return typeof o.focused === 'boolean' ? { type: 'focus', focused: o.focused } : undefined;
    case 'decide':
      return isText(o.callId) && o.callId && isPermissionDecision(o.decision)
        ? { type: 'decide', callId: o.callId, decision: o.decision } : undefined;
    case 'showDiff': return isText(o.callId) && o.callId ? { type: 'showDiff', callId: o.callId } : undefined;
    case 'copy': case 'insert': return isText(o.code) ? { type: o.type, code: o.code } : undefined;
    case 'copyReply': return Number.isInteger(o.index) && (o.index as number) >= 0 ? { type: 'copyReply', index: o.index as number } : undefined;
    case 'command': return isText(o.id) && WEBVIEW_COMMANDS.includes(o.id) ? { type: 'command', id: o.id } : undefined;
    case 'drop': return Array.isArray(o.uris) ? { type: 'drop', uris: o.uris.filter(isText) } : undefined;
    case 'complete':
      return Number.isInteger(o.seq) && isText(o.before) ? { type: 'complete', seq: o.seq as number, before: o.before, fresh: o.fresh === true } : undefined;
    case 'streamTaken': return Number.isInteger(o.seq) ? { type: 'streamTaken', seq: o.seq as number } : undefined;
    default: return undefined;
  }
}

/** A decision for a request that offered `options`: it, when it is one of them (docs/PROTOCOL.md §4: the answer is one of the options); else undefined. */
export function offeredDecision(options: readonly string[], decision: unknown): PermissionDecision | undefined {
  return isPermissionDecision(decision) && options.includes(decision) ? decision : undefined;
}
