// The chat's content, independent of VS Code: a branch's messages become turns (the user's
// instruction, the model's prose, tool cards, a usage line), and turns become sanitized HTML.
// No `vscode` import: unit-tested with node's test runner.
import MarkdownIt from 'markdown-it';
import { ErrorCodes, PERMISSION_OPTIONS, ResponseError, SidecarExitedError } from './rpcClient';
import type { Json, JsonObject, Message, PermissionDecision, ToolEvent, Usage } from './rpcClient';

export type CardState = 'running' | 'ok' | 'error' | 'denied' | 'ask' | 'cancelled';
export interface ToolCard {
  callId: string; tool: string; args: Json; output?: Json; state: CardState;
  /** `args` / `output` is the start of a summary the server cut (a `toolEvent`'s, see toolSummary): text, not a value. */
  argsCut?: boolean; outputCut?: boolean;
  /** A pending permission request: shows Accept / Reject / Always (a diff review when `diff`). */
  ask?: { diff: boolean; path?: string };
}
/**
 * `thought`: a stretch of a reasoning model's thoughts (the `thought`s of its `thinking` reports, sent
 * to a client that announces `capabilities.thoughts`); `live` while it streams. Never on the branch:
 * the chat keeps them for the turns it ran (see keepThoughts).
 */
export type TurnItem = { kind: 'prose'; text: string } | { kind: 'tool'; card: ToolCard } | ThoughtItem;
/** A stretch of thoughts: `started` (ms since the epoch) while it streams, `ms` (how long it took) once it ended. */
export interface ThoughtItem { kind: 'thought'; text: string; live?: boolean; started?: number; ms?: number }
export interface Turn {
  user: string;
  /** Short labels of the context sent with the instruction (file and line range, #problems...). */
  contextLabels: string[];
  items: TurnItem[];
  usage?: TurnUsage;
  /** Shown under the turn, e.g. "Stopped." */
  note?: string;
  error?: string;
  running?: boolean;
  /** While it runs: what it is doing, from its progress reports (see statusText); shown in place of *working…*. */
  status?: string;
  /** A turn that did not finish: it failed (the server crashed, an error) or was stopped. */
  outcome?: 'failed' | 'stopped';
  /** The index of the turn's first message on the branch (turns read from the server). */
  start?: number;
  /** A local turn's id (see LocalTurn): a turn that failed or was stopped offers Retry by it. */
  id?: string;
}
export interface TurnUsage { inputTokens: number | null; outputTokens: number | null; modelCalls: number; rounds?: number }

/** Fields of a structured reply that are never prose. */
const NOT_PROSE = new Set(['action_requests', 'action_responses', 'action_required', 'confidence_score', 'confidence']);
/** Preferred order for prose fields; any other string field follows. */
const PROSE_FIRST = ['answer', 'response', 'text', 'message', 'content', 'summary', 'reason', 'explanation'];
/** The fields a chat turn asks the model for (`actions: true`: the action fields; `reason`). */
const CHAT_FIELDS = new Set(['action_required', 'action_requests', 'action_responses', 'reason']);
/** Keys of the chat's structured reply: its own fields, and the prose fields models put next to them. */
const REPLY_KEYS = new Set([...NOT_PROSE, ...PROSE_FIRST, ...CHAT_FIELDS]);

/**
 * Whether an object is the chat's own structured reply: it has one of the fields the chat asked for,
 * or only prose fields (`{"answer": ...}`). Any other JSON (`{"name": "demo", ...}`) is content.
 */
function isChatReply(keys: string[]): boolean {
  return keys.length > 0 && (keys.some((k) => CHAT_FIELDS.has(k)) || keys.every((k) => REPLY_KEYS.has(k)));
}

/** The JSON text of a reply that is (or, while streaming, may become) the chat's structured reply. */
function jsonCandidate(text: string): string | undefined {
  const t = text.trim();
  // an object that opens with a key (or, while streaming, with nothing yet): `{x} is a set` is prose
  if (/^\{\s*("|$)/.test(t)) return t;
  const fence = /^```(?:json)?[ \t]*\n([\s\S]*?)(?:\n```\s*)?$/.exec(t);
  if (fence && /^\{\s*("|$)/.test(fence[1].trim())) return fence[1].trim();
  return undefined;
}

function proseFromObject(o: Record<string, unknown>): string {
  const keys = Object.keys(o).filter((k) => !NOT_PROSE.has(k));
  keys.sort((a, b) => (PROSE_FIRST.indexOf(a) + 1 || 99) - (PROSE_FIRST.indexOf(b) + 1 || 99));
  const parts: string[] = [];
  for (const k of keys) {
    const v = o[k];
    if (typeof v === 'string' && v.trim()) parts.push(v);
    else if (v && typeof v === 'object' && !Array.isArray(v) && k === 'reason') {
      const r = v as Record<string, unknown>;
      const t = [r.title, r.content].filter((x) => typeof x === 'string' && x).join(': ');
      if (t) parts.push(`*${t}*`);
    }
  }
  return parts.join('\n\n');
}

/** The index of the quote that closes the JSON string opening at `i` (or `src.length` if it never closes). */
function stringEnd(src: string, i: number): number {
  i++;
  while (i < src.length && src[i] !== '"') i += src[i] === '\\' ? 2 : 1;
  return i;
}

/** The text of a JSON string literal (from its opening quote) that may be cut anywhere: what it has so far. */
function partialStringText(raw: string): string {
  const whole = safeString(raw);
  if (whole !== undefined) return whole;
  let i = 1;   // to the end of the last complete character or escape
  while (i < raw.length && raw[i] !== '"') {
    const n = raw[i] !== '\\' ? 1 : raw[i + 1] === 'u' ? 6 : 2;
    if (i + n > raw.length) break;
    i += n;
  }
  return safeString(raw.slice(0, i) + '"') ?? '';
}

/** Decodes the string fields of a possibly unfinished JSON object (a reply still streaming);
 *  `complete`: only the fields whose value is complete (not one cut at the end). */
function partialStringFields(src: string, complete = false): Record<string, string> {
  const out: Record<string, string> = {};
  // only top-level keys: track depth while scanning
  let depth = 0;
  let i = 0;
  while (i < src.length) {
    const c = src[i];
    if (c === '{' || c === '[') { depth++; i++; continue; }
    if (c === '}' || c === ']') { depth--; i++; continue; }
    if (c !== '"') { i++; continue; }
    // a string: read it
    const start = i;
    i = stringEnd(src, i);
    const raw = src.slice(start, Math.min(i + 1, src.length));
    i++;
    const m = /^\s*:\s*"/.exec(src.slice(i));
    if (depth !== 1 || !m) continue;
    const key = safeString(raw);
    i += m[0].length - 1;
    const vs = i;
    i = stringEnd(src, i);
    const rawValue = src.slice(vs, Math.min(i + 1, src.length));
    const cut = i >= src.length;
    i++;
    if (key !== undefined && !(cut && complete)) out[key] = partialStringText(rawValue);
  }
  return out;
}
function safeString(raw: string): string | undefined {
  try { const v = JSON.parse(raw); return typeof v === 'string' ? v : undefined; } catch { return undefined; }
}

/**
 * The prose of a model reply: plain text as is; a structured (JSON) reply as its prose fields,
 * also while it is still streaming; never raw JSON.
 */
export function proseOf(text: string): string {
  // (plain text at once, without copying it: a long reply is read again for each update of the stream)
  if (!/^\s*(?:\{|```)/.test(text)) return text;
  const cand = jsonCandidate(text);
  if (cand === undefined) return text;
  let complete: unknown;
  try {
    complete = JSON.parse(cand);
  } catch {
    // unfinished (still streaming) or not JSON at all: structured only while every key so far fits
    if (!/^\{\s*$/.test(cand) && !isPartialChatReply(cand)) return text;
    return proseFromObject(partialStringFields(cand));
  }
  if (complete && typeof complete === 'object' && !Array.isArray(complete) && isChatReply(Object.keys(complete))) {
    return proseFromObject(complete as Record<string, unknown>);
  }
  return text;   // any other JSON is content: shown as it is (Markdown, e.g. a ```json block)
}

/** The top-level keys of a possibly unfinished JSON object whose value has begun (`"key":`). */
function partialKeys(src: string): string[] | undefined {
  const keys: string[] = [];
  let depth = 0;
  let i = 0;
  while (i < src.length) {
    const c = src[i];
    if (c === '{' || c === '[') { depth++; i++; continue; }
    if (c === '}' || c === ']') { depth--; i++; continue; }
    if (c !== '"') { i++; continue; }
    const start = i;
    i = stringEnd(src, i);
    if (i >= src.length) break;   // an unfinished string
    const raw = src.slice(start, i + 1);
    i++;
    if (depth === 1 && /^\s*:/.test(src.slice(i))) {
      const k = safeString(raw);
      if (k === undefined) return undefined;
      keys.push(k);
    }
  }
  return keys;
}

/** Whether an unfinished JSON object may be the chat's structured reply (no key so far says otherwise). */
function isPartialChatReply(src: string): boolean {
  const keys = partialKeys(src);
  if (!keys) return false;
  if (!keys.length) return true;   // `{"ans`: too early to tell; nothing is shown yet
  return isChatReply(keys);
}

/** Whether an error response refuses `field` as an unknown field (a server that does not have it), not its value. */
export function refusesField(e: { code?: unknown; message?: unknown; data?: unknown }, field: string): boolean {
  if (e.code !== -32602) return false;
  const data = e.data as { unknownFields?: unknown } | null | undefined;
  if (data && Array.isArray(data.unknownFields)) return data.unknownFields.includes(field);
  const msg = typeof e.message === 'string' ? e.message : '';
  const m = /unknown (?:field|param|propert)[a-z()]*:?\s*(.*)$/i.exec(msg);
  return !!m && new RegExp(`(^|[^A-Za-z0-9_])"?${field}"?([^A-Za-z0-9_]|$)`).test(m[1]);
}

/** Prose of a final operate result (`result` of kind model/dict/text). */
export function proseOfResult(result: Json): string {
  if (typeof result === 'string') return proseOf(result);
  if (result && typeof result === 'object' && !Array.isArray(result)) return proseFromObject(result as Record<string, unknown>);
  return '';
}

function addedRemoved(output: Json): { added: number; removed: number } | undefined {
  if (!output || typeof output !== 'object' || Array.isArray(output)) return undefined;
  const o = output as Record<string, Json>;
  if (typeof o.added === 'number' && typeof o.removed === 'number') return { added: o.added, removed: o.removed };
  if (typeof o.diff === 'string') {
    let added = 0; let removed = 0;
    for (const l of o.diff.split('\n')) {
      if (l.startsWith('+') && !l.startsWith('+++')) added++;
      else if (l.startsWith('-') && !l.startsWith('---')) removed++;
    }
    return { added, removed };
  }
  return undefined;
}

/**
 * What is wrong with a `requestToolPermission`'s params for this client to put it to the user (its
 * branch, call and tool as text, its options a list of the four decisions, its arguments an
 * object), or undefined when nothing is: a server of another version, or a broken one, may
 * send others. Such a request is denied without asking.
 */
export function permissionProblem(p: unknown): string | undefined {
  if (!isObject(p)) return 'its params are not an object';
  for (const k of ['branchId', 'callId', 'tool']) if (typeof p[k] !== 'string') return `its ${k} is not text`;
  const options = p.options;
  if (!Array.isArray(options) || !options.length || !options.every((o) => ['allow_once', 'allow_always', 'deny_once', 'deny_always'].includes(o as string))) {
    return 'its options are not a list of allow_once, allow_always, deny_once, deny_always';
  }
  if (!isObject(p.arguments)) return 'its arguments are not an object';
  return undefined;
}

/**
 * vscode-jsonrpc's codes of a request that never reached a server or whose answer can no longer come: it could
 * not be written (MessageWriteError), the connection went while it waited (PendingResponseRejected), or it was
 * sent on a connection no longer listening (ConnectionInactive).
 */
const TRANSPORT_CODES = [-32099, -32097, -32096];

/**
 * Whether `e` says the server is gone (or never came): its process is not `running`, it exited under the request,
 * the connection to it was lost, or it could not be started. An error response of a running server is not that,
 * whatever its words: a model error quoting "a <think> block that was never closed" or a provider's "peer closed
 * connection" is the model's failure, said as such.
 */
export function serverGone(e: unknown, running: boolean): boolean {
  if (!running || e instanceof SidecarExitedError) return true;
  if (e instanceof ResponseError) return TRANSPORT_CODES.includes(e.code);
  // the extension's own start errors and the transport's (a write to a dead pipe, a closed connection)
  return e instanceof Error && /^(operate-sidecar: )?cannot start|did not answer initialize|\bEPIPE\b|Connection is (disposed|closed)|connection got disposed/i.test(e.message);
}

/** Whether `v` is one of the protocol's permission decisions (PERMISSION_OPTIONS). */
export function isPermissionDecision(v: unknown): v is PermissionDecision {
  return typeof v === 'string' && (PERMISSION_OPTIONS as readonly string[]).includes(v);
}

/**
 * The `operateSidecar.permissionAnswer` setting read: a decision (answer every request with it), none (unset or
 * empty: ask), or, for any other value (settings.json is not checked against package.json's enum: `"allow"`, the
 * policy's word), none with the `problem` to report (once), naming the setting and the values it takes.
 */
export function permissionAnswerSetting(v: unknown): { answer?: PermissionDecision; problem?: string } {
  if (v === undefined || v === null || v === '') return {};
  if (isPermissionDecision(v)) return { answer: v };
  return { problem: `operateSidecar.permissionAnswer must be one of ${PERMISSION_OPTIONS.join(', ')}, or empty to be asked `
    + `(it is ${JSON.stringify(v)}); asking instead.` };
}

/** Whether `v` is a JSON object (not null, not an array). */
export function isObject(v: unknown): v is Record<string, Json> {
  return typeof v === 'object' && v !== null && !Array.isArray(v);
}

export function isErrorOutput(output: Json | undefined): boolean {
  return isObject(output) && 'error' in output;
}

/** A call whose permission request its turn's end took away (see deniedWhy): not the user's cancel. */
export const NOT_ANSWERED = 'no answer: the turn ended first';

/** Why a call was denied, from its output's `reason` (the server's words): a timed-out permission request is no rejection. */
function deniedWhy(output: Json | undefined): string {
  const o = isObject(output) ? output : {};
  const reason = typeof o.reason === 'string' ? o.reason : '';
  if (/timed out/i.test(reason)) return 'timed out: no answer, denied';
  // the request itself failed (the window was reloaded or closed while it waited, or the extension's handler failed):
  // no rejection either, and not the transport's words
  if (/permission request failed/i.test(reason)) return 'no answer: the request to the editor failed';
  if (/policy/i.test(reason)) return 'denied by policy';
  // its turn ended while it waited (the user stopped it, the window was reloaded, the server stopped): nobody
  // answered it, and the server records it so, `"reason": "cancelled"` (docs/PROTOCOL.md §7); the turn shows as
  // interrupted for the same reasons (cancelledCall asks this function)
  if (/stopped|cancel/i.test(reason)) return NOT_ANSWERED;
  if (!reason || /by the user/i.test(reason) || o.error === 'rejected') return 'rejected';
  return `denied: ${reason.length > 60 ? reason.slice(0, 59) + '…' : reason}`;
}

/** How long the server's `toolEvent` summaries may be: one this long that does not parse was cut. */
export const SUMMARY_LIMIT = 200;

/**
 * A `toolEvent`'s `argsSummary` / `resultSummary` (compact JSON text, cut at SUMMARY_LIMIT
 * characters): the value when it parses; else the text it is, `cut` when it has the full length
 * (a cut JSON string shows as its text, without the quotes and escapes).
 */
export function toolSummary(text: string | null | undefined): { value: Json; cut: boolean } {
  if (typeof text !== 'string') return { value: null, cut: false };   // (none, or not the summary's text)
  try {
    return { value: JSON.parse(text) as Json, cut: false };
  } catch {
    const cut = text.length >= SUMMARY_LIMIT;
    return { value: cut && text.startsWith('"') ? partialStringText(text) : text, cut };
  }
}

/**
 * A `toolEvent` on its call's card: a new card (`card` undefined) with the arguments as the
 * summary has them (a value, or the text of a cut one), or the card updated (post: the output,
 * error, denied: the server's reason). Answers the card.
 */
export function cardOfToolEvent(card: ToolCard | undefined, e: ToolEvent): ToolCard {
  if (!card) {
    const a = toolSummary(e.argsSummary);
    card = { callId: String(e.callId), tool: typeof e.tool === 'string' ? e.tool : String(e.tool),
      args: a.value, ...(a.cut && { argsCut: true }), state: 'running' };
  }
  const error = typeof e.error === 'string' && e.error ? e.error : undefined;
  if (e.event === 'post') {
    const r = toolSummary(e.resultSummary);
    card.state = 'ok';
    card.output = r.value;
    if (r.cut) card.outputCut = true;
  }
  if (e.event === 'error') { card.state = 'error'; card.output = { error: error ?? 'failed' }; }
  if (e.event === 'denied') {   // the server's reason: rejected, timed out, policy...
    card.state = 'denied';
    card.output = { error: 'denied by governance gate', ...(error && { reason: error }) };
  }
  return card;
}

/** The card's one-line title, e.g. `✓ edit_file src/x.py +3 −1`. */
export function cardTitle(card: ToolCard): string {
  const icon = { running: '…', ok: '✓', error: '✗', denied: '⊘', ask: '?', cancelled: '⊘' }[card.state];
  // a cut summary of the arguments: its fields that are there whole
  const a = isObject(card.args) ? card.args
    : card.argsCut && typeof card.args === 'string' && card.args.startsWith('{') ? partialStringFields(card.args, true) : {};
  let subject = '';
  if (typeof a.path === 'string') subject = a.path;
  else if (typeof a.command === 'string') subject = a.command;
  else {
    const first = Object.values(a).find((v) => typeof v === 'string') as string | undefined;
    if (first) subject = first.length > 40 ? first.slice(0, 39) + '…' : first;
  }
  const ar = card.state === 'ok' ? addedRemoved(card.output ?? null) : undefined;
  const counts = ar ? ` +${ar.added} −${ar.removed}` : '';
  const why = card.state === 'denied' ? ` (${deniedWhy(card.output)})` : card.state === 'ask' ? ' (waiting for you)'
    : card.state === 'cancelled' ? ' (cancelled)' : '';
  return `${icon} ${card.tool}${subject ? ' ' + subject : ''}${counts}${why}`;
}

function num(v: unknown): number | null { return typeof v === 'number' ? v : null; }
function addUsage(u: TurnUsage, raw: unknown): void {
  u.modelCalls++;
  if (!raw || typeof raw !== 'object') return;
  const r = raw as Record<string, unknown>;
  const inp = num(r.inputTokens) ?? num(r.prompt_tokens) ?? num(r.input_tokens);
  const out = num(r.outputTokens) ?? num(r.completion_tokens) ?? num(r.output_tokens);
  if (inp !== null) u.inputTokens = (u.inputTokens ?? 0) + inp;
  if (out !== null) u.outputTokens = (u.outputTokens ?? 0) + out;
}
export function usageFromResult(u: Usage | undefined, rounds?: number): TurnUsage | undefined {
  if (!u) return undefined;
  return { inputTokens: u.inputTokens, outputTokens: u.outputTokens, modelCalls: u.modelCalls, ...(rounds !== undefined && { rounds }) };
}
export function usageLine(u: TurnUsage): string {
  const t = (n: number | null) => (n === null ? '?' : String(n));
  const parts = [`${t(u.inputTokens)} in · ${t(u.outputTokens)} out tokens`, `${u.modelCalls} model call${u.modelCalls === 1 ? '' : 's'}`];
  if (u.rounds && u.rounds > 1) parts.push(`${u.rounds} rounds`);
  return parts.join(' · ');
}

function instructionText(v: Json | undefined): string {
  if (typeof v === 'string') return v;
  if (v === null || v === undefined) return '';
  return JSON.stringify(v);
}

/** Context labels stored with an instruction by this extension (see context.ts). */
function contextLabels(ctx: Json | undefined): string[] {
  if (!ctx || typeof ctx !== 'object' || Array.isArray(ctx)) return [];
  const labels = (ctx as Record<string, Json>).labels;
  return Array.isArray(labels) ? labels.filter((l): l is string => typeof l === 'string') : [];
}

/** How the server's instruction for a further round (after tools ran) begins. */
export const CONTINUATION_PREFIX = 'Continue the same task.';

/**
 * The note of a turn the branch shows was cancelled (see cancelledCall) when the chat keeps nothing of it: it
 * ended before it finished, and not necessarily by the user (a window reload ends the running turn).
 */
export const INTERRUPTED_NOTE = 'Interrupted: the turn ended before it finished (it was stopped, or the window was reloaded or the server stopped while it ran).';

/**
 * Whether a call's recorded output says its operate was cancelled under it (docs/PROTOCOL.md §7): its permission
 * request was still open (denied, its card saying NOT_ANSWERED: the server records `"reason": "cancelled"`; the
 * card and this mark read the reason alike, see deniedWhy), or the tool was running (`"cancelled"`, or for a write
 * the client had been asked for, `"cancelled; the client was asked to write ..."`).
 */
function cancelledCall(output: Json | undefined): boolean {
  if (!isObject(output) || typeof output.error !== 'string') return false;
  if (output.error.startsWith('denied')) return deniedWhy(output) === NOT_ANSWERED;
  return output.error === 'cancelled' || output.error.startsWith('cancelled; ');
}

/**
 * A branch's messages (oldest first) as chat turns; further rounds stay in their turn. A turn whose operate was
 * cancelled (one of its calls says so, see cancelledCall) did not finish: it is marked as stopped, with
 * INTERRUPTED_NOTE and an id for Retry (`interrupted@<start>`), and offers no Copy of a reply. The chat's own
 * record of a turn it stopped, when it kept one, puts its own mark over this one (withLocalTurns).
 */
export function turnsFromMessages(messages: Message[]): Turn[] {
  const turns: Turn[] = [];
  const cards = new Map<string, ToolCard>();
  let cur: Turn | undefined;
  let index = -1;
  const turn = () => {
    if (!cur) { cur = { user: '', contextLabels: [], items: [], start: index }; turns.push(cur); }
    return cur;
  };
  let prevKind = '';
  for (const item of messages as unknown[]) {
    index++;
    // (a server of another version may send what this client does not know: read as nothing shown)
    const m = (isObject(item) ? item : {}) as Partial<Message>;
    const c = (isObject(m.content) ? m.content : {}) as Record<string, Json>;
    const kindBefore = prevKind;
    prevKind = typeof m.kind === 'string' ? m.kind : '';
    if (m.kind === 'instruction') {
      const text = instructionText(c.instruction);
      if (cur && text.startsWith(CONTINUATION_PREFIX) && kindBefore === 'action_response') {
        // a further round of the same turn (the server's fixed continuation instruction)
        cur.usage ??= { inputTokens: null, outputTokens: null, modelCalls: 0 };
        cur.usage.rounds = (cur.usage.rounds ?? 1) + 1;
        continue;
      }
      cur = { user: text, contextLabels: contextLabels(c.context), items: [], start: index };
      turns.push(cur);
    } else if (m.kind === 'assistant_response') {
      const t = turn();
      const prose = proseOf(typeof c.text === 'string' ? c.text : '');
      if (prose.trim()) t.items.push({ kind: 'prose', text: prose });
      t.usage ??= { inputTokens: null, outputTokens: null, modelCalls: 0 };
      addUsage(t.usage, c.usage);
    } else if (m.kind === 'action_request') {
      const card: ToolCard = { callId: String(c.callId), tool: String(c.function), args: c.arguments ?? null, state: 'running' };
      cards.set(card.callId, card);
      turn().items.push({ kind: 'tool', card });
    } else if (m.kind === 'action_response') {
      let card = cards.get(String(c.callId));
      if (!card) {
        card = { callId: String(c.callId), tool: String(c.function), args: c.arguments ?? null, state: 'running' };
        turn().items.push({ kind: 'tool', card });
      }
      card.output = c.output ?? null;
      const err = isErrorOutput(card.output);
      const msg = err ? String((card.output as Record<string, Json>).error) : '';
      card.state = !err ? 'ok' : msg.startsWith('denied') ? 'denied' : 'error';
    }
  }
  for (const t of turns) {
    if (!t.items.some((it) => it.kind === 'tool' && cancelledCall(it.card.output))) continue;
    t.outcome = 'stopped';
    t.note = INTERRUPTED_NOTE;
    t.id = `interrupted@${t.start}`;
  }
  return turns;
}

/**
 * A turn the server has not recorded as it was shown: one that failed or was stopped (the server
 * records an instruction only with its reply, so such a turn is missing from the branch, or only
 * its first rounds are there), or one whose end could not be read back. `at`: the number of the
 * branch's messages before it; `recorded`: whether its messages begin there (undefined: not known
 * yet, decided by the next read of the branch, see `resolveLocalTurns`).
 */
export interface LocalTurn {
  turn: Turn; at: number; recorded?: boolean;
  /** The context sent with the instruction (Retry sends it again as it was, not the editor's state then; see retryContext). */
  context?: JsonObject;
  /** The response format it asked for (Retry asks for it again). */
  responseFormat?: JsonObject;
}

/**
 * Whether the branch holds (the first rounds of) a local turn: `recorded`, and the server's turn
 * that begins where it began is its message. Such a turn shows as that server turn, with its mark.
 */
export function onBranch(l: LocalTurn, server: Turn[]): boolean {
  return l.recorded === true && server.some((t) => t.start === l.at && t.user === l.turn.user);
}

/**
 * The context Retry sends with a local turn's message: the one it was sent with, unless the branch
 * holds the turn (stopped, or failed, after a round had ended): the server recorded its instruction
 * with that context, which the model reads in the branch's history; sent again, it would read (and
 * pay for) it twice. A turn the branch does not hold (an operate that failed records nothing), or
 * not known to (`recorded` undefined), gets it as it was.
 */
export function retryContext(l: LocalTurn, server: Turn[]): JsonObject | undefined {
  return onBranch(l, server) ? undefined : l.context;
}

/** Decides the unknown `recorded` of local turns from the branch's message count, read first after they ended; whether any changed. */
export function resolveLocalTurns(locals: LocalTurn[], total: number): boolean {
  let changed = false;
  for (const l of locals) if (l.recorded === undefined) { l.recorded = total > l.at; changed = true; }
  return changed;
}

/** Local turns kept per chat, and chats kept (the most recently changed), across window reloads (workspaceState). */
export const KEPT_LOCAL_TURNS = 20;
export const KEPT_LOCAL_CHATS = 30;
/** The stored local turns of the chats: by branch id ('' = a chat not yet bound), with when they last changed. */
export type StoredLocalTurns = Record<string, { time: number; turns: LocalTurn[] }>;

/**
 * `stored` with `chat`'s local turns set to `locals` (none: the chat is dropped), bounded: the last
 * KEPT_LOCAL_TURNS of a chat, the KEPT_LOCAL_CHATS chats changed last. A new object; `stored` is not changed.
 */
export function storeLocalTurns(stored: StoredLocalTurns | undefined, chat: string, locals: LocalTurn[], now: number): StoredLocalTurns {
  const out: StoredLocalTurns = { ...(stored ?? {}) };
  delete out[chat];
  if (locals.length) out[chat] = { time: now, turns: locals.slice(-KEPT_LOCAL_TURNS) };
  const chats = Object.keys(out).sort((a, b) => out[b].time - out[a].time);
  for (const c of chats.slice(KEPT_LOCAL_CHATS)) delete out[c];
  return out;
}

/**
 * The branch's turns (from the server) with the local ones, in order: a recorded one gets its
 * mark (stopped, the error) on the server's turn; any other goes where it happened, before the
 * first server turn that began after it. The server's turns are copied, never changed.
 */
export function withLocalTurns(server: Turn[], locals: LocalTurn[]): Turn[] {
  const byStart = new Map<number, Turn>();
  const out = server.map((t) => { const c = { ...t }; if (t.start !== undefined) byStart.set(t.start, c); return c; });
  const inserts: LocalTurn[] = [];
  for (const l of locals) {
    const target = l.recorded ? byStart.get(l.at) : undefined;
    if (target && target.user === l.turn.user) {
      if (l.turn.id) target.id = l.turn.id;
      if (l.turn.note) target.note = l.turn.note;
      if (l.turn.error) target.error = l.turn.error;
      if (l.turn.outcome) target.outcome = l.turn.outcome;
    } else {
      inserts.push(l);
    }
  }
  const merged: Turn[] = [];
  let i = 0;
  for (const t of out) {
    while (i < inserts.length && inserts[i].at <= (t.start ?? Number.MAX_SAFE_INTEGER)) merged.push(inserts[i++].turn);
    merged.push(t);
  }
  while (i < inserts.length) merged.push(inserts[i++].turn);
  return merged;
}

/**
 * Whether the events of a branch (its `toolEvent`s, its `requestToolPermission`s, which carry the branch and the call,
 * not the operate) are the chat's operate's: operates on one branch run one at a time, in arrival order (§5), and an
 * operate's `$/progress` begins (its first report, once the branch is its turn) before any of its tool calls and ends
 * before its answer (§6). So from its first progress value to its `end` the branch's events are its own; before (an
 * operate sent earlier on the branch, e.g. by the Operate command, runs while this one waits) and after (one sent
 * later) they are another's. `began`/`ended`: what its progress said so far (see operateSpanAfter).
 */
export interface OperateSpan { branchId: string; began: boolean; ended: boolean }
export function ownsBranchEvent(span: OperateSpan | undefined, branchId: unknown): boolean {
  return !!span && !!span.branchId && span.branchId === branchId && span.began && !span.ended;
}
/** The span after one of its operate's `$/progress` values (`span` changed). */
export function operateSpanAfter(span: OperateSpan, v: { kind?: unknown }): void {
  if (v.kind === 'begin' || v.kind === 'report') span.began = true;
  if (v.kind === 'end') span.ended = true;
}

/**
 * The chat's own turn among the branch's turns read back after it ended: it began at or after `at` (the branch's
 * messages before it was sent) with its message `user`; others may have been recorded there first (an operate sent
 * earlier on the same branch, which it waited behind) or after. Several with the same message: the one whose last
 * prose is the reply (`reply`, the operate's result), else the first.
 */
export function ownTurn(server: Turn[], at: number, user: string, reply?: string): Turn | undefined {
  const mine = server.filter((t) => t.start !== undefined && t.start >= at && t.user === user);
  if (mine.length > 1 && reply?.trim()) {
    const last = (t: Turn) => [...t.items].reverse().find((it) => it.kind === 'prose')?.text.trim();
    const same = mine.find((t) => last(t) === reply.trim());
    if (same) return same;
  }
  return mine[0];
}

/**
 * What the chat shows after reading its branch failed with `e`: its local turns, then (unless the branch is gone) the
 * error, in words (`problem`: the server's state, undefined when it runs). Undefined: what it shows stays, for a read
 * cancelled (-32800) by the server's stop, i.e. a restart (changed settings, Restart Server): a request the user never
 * made, and the chat reads its branch again once the server runs.
 */
export function turnsAfterFailedRead(e: unknown, locals: LocalTurn[], problem: (e: unknown) => string | undefined): Turn[] | undefined {
  if (e instanceof ResponseError && e.code === ErrorCodes.Cancelled) return undefined;
  const turns = withLocalTurns([], locals);
  if (!(e instanceof ResponseError && e.code === ErrorCodes.BranchNotFound)) {
    turns.push({ user: '', contextLabels: [], items: [], error: problem(e) ?? String(e) });
  }
  return turns;
}

// ---- what a running turn is doing ----------------------------------------------------------------
/**
 * A running turn's `$/progress` reports, as far as they tell what it does (docs/PROTOCOL.md §6):
 * the phase of the last report (`repair`: a `parse` report of a repair turn, the reply did not match
 * the response format), the repair attempt, and the model round. The wire has no round number: a
 * `request` report after tool calls ran begins the next round (§11). `maxRounds`: what the turn's
 * operate was sent (undefined: one round, or not known).
 */
export interface TurnProgress {
  phase?: 'request' | 'thinking' | 'stream' | 'parse' | 'repair' | 'actions';
  attempt?: number;
  round: number;
  /** Tools ran in this round (its calls were reported): the next `request` is a new round. */
  toolsRan?: boolean;
  maxRounds?: number;
}
/** The message of a `parse` report before a repair turn (`repair attempt 2`; the server's REPAIR_ATTEMPT). */
const REPAIR_MESSAGE = /^repair attempt\s+(\d+)/;
/** The message of the `stream` report (no delta) that begins a reasoning model's thoughts (the server's). */
const THINKING_MESSAGE = 'thinking';
/** What a running turn shows before its first report (the server starting, the branch being made). */
export const WORKING = 'working…';

/** The progress after one `$/progress` value (a new object; `begin` and `end` change nothing). */
export function progressAfter(p: TurnProgress, v: { kind: string; phase?: string; message?: string; delta?: string; thought?: string }): TurnProgress {
  if (v.kind !== 'report') return p;
  const next: TurnProgress = { round: p.round, ...(p.maxRounds !== undefined && { maxRounds: p.maxRounds }) };
  if (p.toolsRan) next.toolsRan = true;
  switch (v.phase) {
    case 'request':
      if (p.toolsRan) { next.round = p.round + 1; delete next.toolsRan; }
      next.phase = 'request';
      break;
    // (a `stream` report with the message `thinking` and no delta: a reasoning model thinks before it writes)
    case 'stream': next.phase = v.message === THINKING_MESSAGE && v.delta === undefined ? 'thinking' : 'stream'; break;
    case 'parse': {
      const m = REPAIR_MESSAGE.exec(v.message ?? '');
      if (m) { next.phase = 'repair'; next.attempt = Number(m[1]); } else next.phase = 'parse';
      break;
    }
    case 'actions': next.phase = 'actions'; next.toolsRan = true; break;
    default: return p;   // a phase this client does not know: what it showed stays
  }
  return next;
}

/**
 * The running turn's status line: what it waits for or does (`waiting for the model…` until the reply
 * begins, `thinking…` while a reasoning model thinks, `writing…` while it streams, `reading the reply…`, a repair attempt, `running tools…`), and
 * from the second round on which round (`round 2 of up to 4 · …`).
 */
export function statusText(p: TurnProgress | undefined): string {
  if (!p?.phase) return WORKING;
  const what = {
    request: 'waiting for the model…',
    thinking: 'thinking…',
    stream: 'writing…',
    parse: 'reading the reply…',
    repair: `the reply was not in the expected format: asking the model again (attempt ${p.attempt ?? 1})…`,
    actions: 'running tools…',
  }[p.phase];
  if (p.round < 2) return what;
  return `round ${p.round}${p.maxRounds && p.maxRounds > 1 ? ` of up to ${p.maxRounds}` : ''} · ${what}`;
}

/**
 * The note under a turn whose rounds the server stopped because the model kept making the same failing
 * calls (`repeated`): which call and its error (the last round's first), and what to do.
 */
export function repeatNote(result: { result?: unknown; repeated?: boolean | null }, limit = 3): string {
  const r = result.result && typeof result.result === 'object' && !Array.isArray(result.result) ? result.result as Record<string, Json> : {};
  const responses = Array.isArray(r.action_responses) ? r.action_responses : [];
  const first = responses[0] && typeof responses[0] === 'object' && !Array.isArray(responses[0]) ? responses[0] as Record<string, Json> : {};
  const out = first.output && typeof first.output === 'object' && !Array.isArray(first.output) ? first.output as Record<string, Json> : {};
  const error = typeof out.error === 'string' ? out.error.split('\n')[0].slice(0, 200).replace(/\.$/, '') : '';
  const what = error && typeof first.function === 'string' ? ` (${first.function}: ${error})` : '';
  return `Stopped: the model made the same failing tool call${responses.length > 1 ? 's' : ''}${what} ${limit} rounds in a row, `
    + 'so another round would not help. Rephrase the request, or choose another model.';
}

// ---- a reasoning model's thoughts ---------------------------------------------------------------
/** A piece of the model's thoughts: added to the stretch that streams, else the start of a new one (last in the turn). */
export function addThought(items: TurnItem[], text: string, now = Date.now()): void {
  const last = items[items.length - 1];
  if (last?.kind === 'thought' && last.live) last.text += text;
  else items.push({ kind: 'thought', text, live: true, started: now });
}

/** The stretch of thoughts that streams has ended (the reply or a tool call came): how long it took is kept; whether there was one. */
export function endThought(items: TurnItem[], now = Date.now()): boolean {
  const last = items[items.length - 1];
  if (last?.kind !== 'thought' || !last.live) return false;
  delete last.live;
  if (last.started !== undefined) last.ms = Math.max(0, now - last.started);
  delete last.started;
  return true;
}

/**
 * The thoughts of a turn as it ran (`shown`), where they came: before the first, second... of its
 * other items, as a list of (that index, the thought). Empty when it had none.
 */
export function thoughtsOf(shown: TurnItem[]): KeptThought[] {
  const out: KeptThought[] = [];
  let at = 0;
  for (const it of shown) {
    if (it.kind === 'thought') { if (it.text.trim()) out.push({ at, text: it.text, ...(it.ms !== undefined && { ms: it.ms }) }); } else at++;
  }
  return out;
}
/** A turn's stretch of thoughts kept by the chat (see thoughtsOf): before its `at`-th other item. */
export interface KeptThought { at: number; text: string; ms?: number }

/** What the branch does not hold of a turn a chat ran: its thoughts, and the note of a turn the repeat stop ended. */
export interface KeptTurn { thoughts: KeptThought[]; note?: string }
/** Kept turns by `branchId@start`, oldest first (workspace state: they come back after a window reload). */
export type StoredKeptTurns = [string, KeptTurn][];
/** Kept turns at most (the latest), and characters of thoughts in all of them at most; a stretch of thoughts is cut to KEPT_THOUGHT_CHARS. */
export const KEPT_TURNS = 200;
export const KEPT_CHARS = 1_000_000;
export const KEPT_THOUGHT_CHARS = 100_000;
/** The mark at the end of a kept stretch of thoughts that was cut. */
export const THOUGHT_CUT = '\n… (cut: the chat keeps the first 100,000 characters of a model\'s thoughts)';

const keptChars = (k: KeptTurn): number => k.thoughts.reduce((n, t) => n + t.text.length, 0);

/**
 * `stored` with the turn `key` (`branchId@start`) kept as the newest (replacing what was kept for it), bounded: each
 * stretch of thoughts cut to KEPT_THOUGHT_CHARS (marked THOUGHT_CUT), then the oldest turns dropped while there are
 * more than KEPT_TURNS or more than KEPT_CHARS characters of thoughts. A new list; `stored` is not changed.
 */
export function storeKeptTurn(stored: StoredKeptTurns | undefined, key: string, turn: KeptTurn): StoredKeptTurns {
  const thoughts = turn.thoughts.map((t) => t.text.length > KEPT_THOUGHT_CHARS ? { ...t, text: t.text.slice(0, KEPT_THOUGHT_CHARS) + THOUGHT_CUT } : t);
  const out: StoredKeptTurns = (stored ?? []).filter(([k]) => k !== key);
  out.push([key, { ...turn, thoughts }]);
  let chars = out.reduce((n, [, k]) => n + keptChars(k), 0);
  while (out.length > KEPT_TURNS || (chars > KEPT_CHARS && out.length > 1)) chars -= keptChars(out.shift()![1]);
  return out;
}

/** `stored` without the turns of `branchId` (the chat was deleted). A new list. */
export function forgetKeptTurns(stored: StoredKeptTurns | undefined, branchId: string): StoredKeptTurns {
  return (stored ?? []).filter(([k]) => !k.startsWith(`${branchId}@`));
}

/**
 * The turn read back from the branch (`t`, which holds no thoughts) with the thoughts it showed while
 * it ran (thoughtsOf), each before the item it came before (after the last one, when the branch holds
 * fewer). A new items list; `t` itself is changed.
 */
export function keepThoughts(t: Turn, thoughts: KeptThought[]): Turn {
  if (!thoughts.length) return t;
  const items: TurnItem[] = [];
  const item = (k: KeptThought): ThoughtItem => ({ kind: 'thought', text: k.text, ...(k.ms !== undefined && { ms: k.ms }) });
  let next = 0;
  t.items.forEach((it, i) => {
    while (next < thoughts.length && thoughts[next].at <= i) items.push(item(thoughts[next++]));
    items.push(it);
  });
  while (next < thoughts.length) items.push(item(thoughts[next++]));
  t.items = items;
  return t;
}

/**
 * A stretch of thoughts. While it streams: shown under *Thinking…*, its newest lines in view (a block that
 * does not fold: redrawn as it grows, a fold would open again under the user's click). Then folded, to be
 * opened: *Thought for 12 s* (*Thought* when that took under a second or is not known).
 */
export function thoughtHtml(text: string, live?: boolean, ms?: number): string {
  if (live) {
    return `<div class="thought live"><div class="thought-head">Thinking…</div>`
      + `<div class="thought-text"><div>${renderMarkdown(text, true)}</div></div></div>`;
  }
  const summary = ms !== undefined && ms >= 1000 ? `Thought for ${Math.round(ms / 1000)} s` : 'Thought';
  return `<details class="thought"><summary>${summary}</summary><div class="thought-text">${renderMarkdown(text)}</div></details>`;
}

// ---- HTML -------------------------------------------------------------------------------------
export function escapeHtml(s: string): string {
  return s.replace(/[&<>"']/g, (c) => ({ '&': '&amp;', '<': '&lt;', '>': '&gt;', '"': '&quot;', "'": '&#39;' }[c]!));
}

let md: MarkdownIt | undefined;
function markdown(): MarkdownIt {
  if (md) return md;
  md = new MarkdownIt({ html: false, linkify: true, breaks: false });
  const fence = md.renderer.rules.fence!;
  md.renderer.rules.fence = (tokens, idx, options, env, self) => {
    const code = tokens[idx].content;
    const buttons = `<div class="code-actions"><button class="code-btn" data-action="copy" title="Copy">Copy</button>`
      + `<button class="code-btn" data-action="insert" title="Insert at the cursor">Insert</button></div>`;
    return `<div class="code-block" data-code="${escapeHtml(code)}">${buttons}${fence(tokens, idx, options, env, self)}</div>`;
  };
  return md;
}
/**
 * Rendered Markdown of finished text by its source, the most recently used last (a redraw renders each turn's prose
 * again), bounded by entries and by characters (source and HTML): a few long replies must not pin hundreds of MB.
 */
const rendered = new Map<string, string>();
let renderedChars = 0;
const RENDERED_KEPT = 2000;
const RENDERED_CHARS = 4_000_000;
/**
 * Text that still streams (a reply, thoughts): each render is of a longer prefix, never asked for again once the
 * next one came, so only the latest is kept (a redraw of the running turn right after a flush reuses it). Cached
 * like finished text, a 100 KB reply streamed for a minute kept every prefix: hundreds of MB.
 */
let liveRendered: { text: string; html: string } | undefined;
/** Markdown to HTML; raw HTML in the source is escaped, never rendered. `live`: a text still streaming (see liveRendered). */
export function renderMarkdown(text: string, live = false): string {
  if (live) {
    if (liveRendered?.text !== text) liveRendered = { text, html: markdown().render(text) };
    return liveRendered.html;
  }
  let html = rendered.get(text);
  if (html !== undefined) { rendered.delete(text); rendered.set(text, html); return html; }
  html = liveRendered?.text === text ? liveRendered.html : markdown().render(text);   // (the stream's last render, now finished)
  const size = text.length + html.length;
  if (size > RENDERED_CHARS) return html;   // (larger than the whole cache: not kept)
  rendered.set(text, html);
  renderedChars += size;
  while (rendered.size > RENDERED_KEPT || renderedChars > RENDERED_CHARS) {
    const [oldest, h] = rendered.entries().next().value!;
    rendered.delete(oldest);
    renderedChars -= oldest.length + h.length;
  }
  return html;
}
/**
 * The Markdown of a reply while it streams, rendered so that an update costs about what changed, not the whole reply
 * so far: the blocks before the last top-level block of its complete lines are settled (rendered once, never again),
 * the rest, the open tail (the last block and the line still being written), is rendered on each update. A block
 * that another one follows is final: CommonMark decides the block structure line by line (a line begins a new
 * block or continues the open one; the next line of a table's header is the only look ahead, and it is among the
 * complete lines), so text added later changes the open tail only. Settled blocks and tail joined are the render
 * of the whole text (renderMarkdown's, which the finished reply still gets). Two things make that not so, and then
 * all of the text is the tail (rendered whole on each update, as a reply that is one long block is): a link
 * reference definition (`[x]: url`), which changes links in blocks before it; and text that is not the text so far
 * with more at its end (a structured reply whose fields came in another order: see proseOf), which settles again.
 */
export class StreamMarkdown {
  /** The source of the settled blocks (a prefix of the text) and their HTML. */
  private src = '';
  private html = '';
  /** A link reference definition was seen: no block settles any more. */
  private whole = false;

  /** The HTML of the settled blocks. */
  get settled(): string { return this.html; }
  /** The characters of the text that are settled. */
  get settledLength(): number { return this.src.length; }

  /**
   * The text so far (the previous update's with more at its end): what to show now. `added`: the HTML of the blocks
   * that settled since the previous update (shown after those before); `tail`: the HTML of the rest (in place of the
   * previous tail). `restarted`: the settled blocks are not those of the previous update any more (`added` is
   * all of them).
   */
  update(text: string): { added: string; tail: string; restarted: boolean } {
    let restarted = false;
    if (!text.startsWith(this.src)) { this.src = ''; this.html = ''; restarted = true; }
    if (this.whole) return { added: '', tail: markdown().render(text), restarted };
    let rest = text.slice(this.src.length);
    let added = '';
    const complete = rest.slice(0, rest.lastIndexOf('\n') + 1);
    if (complete) {
      const env: { references?: object } = {};
      const tokens = markdown().parse(complete, env);
      if (env.references && Object.keys(env.references).length) return this.wholeNow(text, restarted);
      let last = 0;
      for (const t of tokens) if (t.level === 0 && t.map) last = t.map[0];
      if (last > 0) {
        const chunk = rest.slice(0, lineOffset(rest, last));
        added = markdown().render(chunk);
        this.src += chunk;
        this.html += added;
        rest = rest.slice(chunk.length);
      }
    }
    const env: { references?: object } = {};
    const tail = rest ? markdown().render(rest, env) : '';
    if (env.references && Object.keys(env.references).length) return this.wholeNow(text, restarted);
    return { added: restarted ? this.html : added, tail, restarted };
  }

  /** From now on nothing settles (a link reference definition): the whole text is the tail. */
  private wholeNow(text: string, restarted: boolean): { added: string; tail: string; restarted: boolean } {
    restarted ||= this.src !== '';
    this.whole = true;
    this.src = '';
    this.html = '';
    return { added: '', tail: markdown().render(text), restarted };
  }
}

/** Where line `line` (0-based) of `text` begins, its lines ended as markdown-it ends them (\n, \r\n or \r). */
function lineOffset(text: string, line: number): number {
  let i = 0;
  for (let n = 0; n < line && i < text.length; i++) {
    const c = text.charCodeAt(i);
    if (c === 10) n++;
    else if (c === 13) { if (text.charCodeAt(i + 1) === 10) i++; n++; }
  }
  return i;
}

/** What the rendered-Markdown cache holds: its entries and their characters (source and HTML), the streaming one included (for the tests). */
export function markdownCacheSize(): { entries: number; chars: number } {
  const live = liveRendered ? liveRendered.text.length + liveRendered.html.length : 0;
  return { entries: rendered.size + (liveRendered ? 1 : 0), chars: renderedChars + live };
}

function diffHtml(diff: string): string {
  return diff.split('\n').map((l) => {
    const cls = l.startsWith('+++') || l.startsWith('---') ? 'meta' : l.startsWith('+') ? 'add' : l.startsWith('-') ? 'del' : l.startsWith('@@') ? 'meta' : '';
    return cls ? `<span class="${cls}">${escapeHtml(l)}</span>` : escapeHtml(l);
  }).join('\n');
}

function pretty(v: Json | undefined, cut?: boolean): string {
  if (cut) return `${typeof v === 'string' ? v : ''}…`;
  if (typeof v === 'string') return v;
  return JSON.stringify(v, null, 2) ?? '';
}
/** A tool's output with an edit's `diff` apart (the card shows it as a diff) and the rest of it. */
function diffApart(o: Json | undefined): { diff?: string; rest: Json | undefined } {
  if (!o || typeof o !== 'object' || Array.isArray(o) || typeof o.diff !== 'string') return { rest: o };
  return { diff: o.diff, rest: Object.fromEntries(Object.entries(o).filter(([k]) => k !== 'diff')) };
}
/** A section's label; a cut summary says so. */
function label(name: string, cut?: boolean): string {
  return `<div class="label">${name}${cut ? ` <span class="cut">(the first ${SUMMARY_LIMIT} characters)</span>` : ''}</div>`;
}

/** The modifier key of the chat's shortcuts as the user's keyboard names it: Cmd on macOS (the webview says which). */
export type KeyMod = 'Ctrl' | 'Cmd';

/** A tool card; `mod`: the modifier its buttons' tooltips name. */
export function cardHtml(card: ToolCard, mod: KeyMod = 'Ctrl'): string {
  const ask = card.ask
    ? `<div class="ask">`
      + `<button class="accept" data-action="decide" data-decision="allow_once" data-call="${escapeHtml(card.callId)}" title="Accept (${mod}+Enter in the chat)" aria-keyshortcuts="Control+Enter Meta+Enter">Accept</button>`
      + `<button class="reject secondary" data-action="decide" data-decision="deny_once" data-call="${escapeHtml(card.callId)}" title="Reject (${mod}+Backspace in the chat, outside the input)" aria-keyshortcuts="Control+Backspace Meta+Backspace">Reject</button>`
      + `<button class="always secondary" data-action="decide" data-decision="allow_always" data-call="${escapeHtml(card.callId)}">Always for this branch</button>`
      + (card.ask.diff ? `<button class="show-diff link" data-action="showDiff" data-call="${escapeHtml(card.callId)}">Show diff</button>` : '')
      + `</div>` : '';
  let output = '';
  if (card.output !== undefined) {
    const { diff, rest } = diffApart(card.output);
    output = `${label('output', card.outputCut)}<pre class="out">${escapeHtml(pretty(rest, card.outputCut))}</pre>`;
    if (diff !== undefined) output += `<pre class="diff">${diffHtml(diff)}</pre>`;
  }
  return `<details class="tool ${card.state}" data-call="${escapeHtml(card.callId)}">`
    + `<summary>${escapeHtml(cardTitle(card))}</summary>`
    + `${label('arguments', card.argsCut)}<pre class="args">${escapeHtml(pretty(card.args, card.argsCut))}</pre>${output}</details>${ask}`;
}

/** A turn's reply as Markdown: its prose, each piece once (what Copy under a reply copies). */
export function replyText(t: Turn): string {
  return t.items.flatMap((it) => (it.kind === 'prose' && it.text.trim() ? [it.text.trim()] : [])).join('\n\n');
}

/** The length of the longest run of backticks in `text` (0: none). */
const longestTicks = (text: string): number => Math.max(0, ...(text.match(/`+/g) ?? []).map((r) => r.length));

/** `text` in a fenced code block whose fence is longer than any run of backticks in it. */
function fenced(text: string, lang = ''): string {
  const fence = '`'.repeat(Math.max(3, longestTicks(text) + 1));
  return `${fence}${lang}\n${text.replace(/\n$/, '')}\n${fence}`;
}

/**
 * `text` with a code fence it leaves open closed at its end: an open fence would take in the rest
 * of the document (every turn after it). CommonMark's fences: 3 or more ` or ~, indented by 3
 * spaces at most, closed by a run of the same character at least as long and nothing after it.
 */
export function fencesClosed(text: string): string {
  let open: string | undefined;
  for (const line of text.split('\n')) {
    const m = /^ {0,3}(`{3,}|~{3,})/.exec(line);
    if (!m) continue;
    if (open === undefined) open = m[1];
    else if (m[1][0] === open[0] && m[1].length >= open.length && /^ *(`+|~+)\s*$/.test(line)) open = undefined;
  }
  return open === undefined ? text : `${text}\n${open}`;
}

/**
 * One line of text to read as such in Markdown (inside emphasis): the characters that would open
 * emphasis, code, a link, an HTML tag or an entity are escaped (`__init__.py` stays as it is).
 */
export function escapeMarkdown(text: string): string {
  return text.replace(/[\\`*_[\]<>&~]/g, (c) => `\\${c}`);
}

/** `text` as inline code, whatever backticks it holds. */
function inlineCode(text: string): string {
  const ticks = '`'.repeat(longestTicks(text) + 1);
  return /^`|`$/.test(text) ? `${ticks} ${text} ${ticks}` : `${ticks}${text}${ticks}`;
}

/** A tool call's arguments or output in a fence (JSON, or the text itself); undefined when there is nothing to show. */
function valueMarkdown(name: string, v: Json | undefined, cut?: boolean): string | undefined {
  if (v === undefined || v === null || (typeof v === 'object' && !Array.isArray(v) && !Object.keys(v).length)) return undefined;
  const text = pretty(v, cut);
  if (!text.trim()) return undefined;
  return `${name}${cut ? ` (the first ${SUMMARY_LIMIT} characters)` : ''}:\n\n${fenced(text, typeof v === 'string' ? '' : 'json')}`;
}

/**
 * A tool card as Markdown: its title line, a failed call's error, its arguments and output folded
 * (what the card shows when opened; an edit's diff apart), an edit's diff.
 */
function cardMarkdown(card: ToolCard): string {
  let line = `- ${inlineCode(cardTitle(card))}`;
  const o = card.output && typeof card.output === 'object' && !Array.isArray(card.output) ? card.output as Record<string, Json> : undefined;
  if (card.state === 'error' && typeof o?.error === 'string') {
    // as code: an error's text is not Markdown (`__init__.py` is no bold, a backtick opens nothing)
    const why = o.error.split('\n')[0];
    if (why.trim()) line += `: ${inlineCode(why.length > 200 ? why.slice(0, 199) + '…' : why)}`;
  }
  const { diff, rest } = diffApart(card.output);
  const shown = [valueMarkdown('Arguments', card.args, card.argsCut), valueMarkdown('Output', rest, card.outputCut)].filter((p) => p);
  const indent = (text: string) => text.replace(/^(?=.)/gm, '  ');
  if (shown.length) line += `\n\n${indent(`<details><summary>Arguments and output</summary>\n\n${shown.join('\n\n')}\n\n</details>`)}`;
  if (diff?.trim()) line += `\n\n${indent(fenced(diff, 'diff'))}`;
  return line;
}

/**
 * The conversation as one Markdown document (Export Chat): each turn's message with the context sent
 * with it, then the reply as it shows (its prose, its thoughts folded, each tool call's title line
 * with an edit's diff), its error or note and its usage. `title`: the chat's name; `when`: a line under it.
 */
export function chatMarkdown(turns: Turn[], title: string, when?: string): string {
  const out = [`# ${title.replace(/\s+/g, ' ').trim() || 'Chat'}`];
  if (when) out.push(`*${when}*`);
  for (const t of turns) {
    out.push('---');
    if (t.user || t.contextLabels.length) {
      out.push('### You');
      if (t.user) out.push(fencesClosed(t.user));
      if (t.contextLabels.length) out.push(`*Context:* ${t.contextLabels.map(inlineCode).join(' · ')}`);
    }
    out.push('### Assistant');
    for (const it of t.items) {
      if (it.kind === 'prose') { if (it.text.trim()) out.push(fencesClosed(it.text.trim())); }
      else if (it.kind === 'tool') out.push(cardMarkdown(it.card));
      else if (it.text.trim()) {
        const summary = it.ms !== undefined && it.ms >= 1000 ? `Thought for ${Math.round(it.ms / 1000)} s` : 'Thought';
        // (fenced: raw thoughts, often cut off, would break the fold or the rest of the document)
        out.push(`<details><summary>${summary}</summary>\n\n${fenced(it.text.trim(), 'text')}\n\n</details>`);
      }
    }
    if (t.running) out.push('*(still running when the chat was exported)*');
    // the note and the error are text, not Markdown: the note (one line) escaped, the error (a traceback, a
    // provider's message quoting the reply, with its own fences) fenced, its layout kept
    if (t.note) out.push(t.note.includes('\n') ? fenced(t.note, 'text') : `*${escapeMarkdown(t.note)}*`);
    if (t.error) out.push(`**Error:**\n\n${fenced(t.error, 'text')}`);
    if (t.usage) out.push(`*${usageLine(t.usage)}*`);
  }
  return out.join('\n\n') + '\n';
}

export function turnHtml(t: Turn, index: number, mod: KeyMod = 'Ctrl'): string {
  const chips = t.contextLabels.map((l) => `<span class="chip${l.startsWith('#') ? ' missing' : ''}">${escapeHtml(l)}</span>`).join('');
  // (the prose of a running turn's last item may still stream: rendered as such, not cached, see renderMarkdown)
  const items = t.items.map((it, i) => (it.kind === 'prose' ? `<div class="prose">${renderMarkdown(it.text, t.running && i === t.items.length - 1)}</div>`
    : it.kind === 'thought' ? thoughtHtml(it.text, it.live && t.running, it.ms) : cardHtml(it.card, mod))).join('');
  // a call waiting for the user's decision: the turn says so (not what it was doing before: running tools)
  const waiting = t.items.some((it) => it.kind === 'tool' && !!it.card.ask);
  const running = !t.running ? '' : waiting
    ? '<div class="running waiting"><span class="spinner"></span> waiting for your decision: Accept or Reject above</div>'
    : `<div class="running"><span class="spinner"></span> ${escapeHtml(t.status ?? WORKING)}</div>`;
  const note = t.note ? `<div class="note">${escapeHtml(t.note)}</div>` : '';
  const error = t.error ? `<div class="error">${escapeHtml(t.error)}</div>` : '';
  const usage = t.usage ? `<div class="usage">${escapeHtml(usageLine(t.usage))}</div>` : '';
  const cls = t.outcome ? ` ${t.outcome}` : '';
  // a turn that failed or was stopped: send it again (Retry), or put it back into the input to change it first (Edit);
  // one of the branch's turns (it has a start: its first rounds are there) has what was attached to it there already
  const resend = t.start !== undefined ? 'Send this message again (what was attached to it is in this turn already: not sent twice)'
    : 'Send this message again (with what was attached to it)';
  const retry = t.outcome && t.id && t.user && !t.running
    ? `<div class="turn-actions"><button class="retry secondary" data-action="retry" data-turn-id="${escapeHtml(t.id)}" `
      + `aria-label="Retry: send this message again" title="${resend}">Retry</button>`
      + `<button class="edit link" data-action="edit" aria-label="Edit and resend: put this message back into the input" `
      + `title="Put this message back into the input">Edit</button></div>` : '';
  // a reply that ended well: Copy puts its Markdown on the clipboard (the extension has it: not repeated in the page)
  const copy = !t.running && !t.outcome && replyText(t)
    ? '<div class="turn-actions"><button class="link" data-action="copyReply" aria-label="Copy this reply as Markdown" '
      + 'title="Copy this reply (Markdown)">Copy</button></div>' : '';
  // no instruction (the server could not be read): no empty message bubble above the error
  const user = t.user || chips ? `<div class="user">${escapeHtml(t.user)}${chips ? `<div class="chips">${chips}</div>` : ''}</div>` : '';
  return `<section class="turn${cls}" data-turn="${index}">${user}`
    + `<div class="assistant">${items}${running}${note}${error}${usage}${retry}${copy}</div></section>`;
}

/**
 * The HTML of the turns that ended, by turn, with what it was built from (see turnKey): the chat redraws on every
 * tool event and every 50 ms of thoughts, and a long chat's finished turns (each card's output escaped again) cost
 * far more than the running one. Weak: a turn the chat no longer shows goes with it.
 */
const builtTurns = new WeakMap<Turn, { key: unknown[]; html: string }>();
/** Turns whose HTML was built (not taken from builtTurns), in all (for the tests). */
let turnBuilds = 0;
export function turnsBuilt(): number { return turnBuilds; }

/**
 * What a finished turn's HTML depends on, each compared with ===: its place and the modifier, its fields (the
 * usage as its line: it is changed in place), its items list and each item's text or card fields. Cheap (no
 * output is read), and a turn changed in any of them (a mark, thoughts kept, a late decision on a card) is built
 * again. Undefined for a turn that may still change: one running, or with a card running or waiting for a decision.
 */
function turnKey(t: Turn, index: number, mod: KeyMod): unknown[] | undefined {
  if (t.running) return undefined;
  const key: unknown[] = [index, mod, t.user, t.contextLabels, t.contextLabels.length, t.note, t.error, t.outcome, t.id, t.start,
    t.usage && usageLine(t.usage), t.items, t.items.length];
  for (const it of t.items) {
    if (it.kind === 'tool') {
      const c = it.card;
      if (c.state === 'running' || c.state === 'ask' || c.ask) return undefined;
      key.push(c, c.state, c.tool, c.args, c.argsCut, c.output, c.outputCut);
    } else key.push(it, it.text, it.kind === 'thought' ? `${it.live}${it.ms}` : '');
  }
  return key;
}

/** A turn's HTML (turnHtml), from builtTurns when it ended and nothing it is built from changed. */
function turnPart(t: Turn, index: number, mod: KeyMod): string {
  const key = turnKey(t, index, mod);
  const built = key && builtTurns.get(t);
  if (key && built && built.key.length === key.length && built.key.every((k, i) => k === key[i])) return built.html;
  turnBuilds++;
  const html = turnHtml(t, index, mod);
  if (key) builtTurns.set(t, { key, html });
  return html;
}

/**
 * The conversation as the HTML of its parts, one per turn (the chat view replaces only the parts that changed); `mod`: see cardHtml.
 * A finished turn's is built once (see builtTurns): a redraw of a long chat costs about its running turn.
 */
export function conversationParts(turns: Turn[], mod: KeyMod = 'Ctrl'): string[] {
  if (!turns.length) return ['<div class="empty">Ask about your code. Use <code>#file</code>, <code>#file:path</code>, <code>#selection</code> or <code>#problems</code> to add context (type <code>#</code>, or press Ctrl+Space, for suggestions), or drop files here with Shift held.</div>'];
  return turns.map((t, i) => turnPart(t, i, mod));
}

export function conversationHtml(turns: Turn[]): string {
  return conversationParts(turns).join('');
}

/** A branch name from its first instruction. */
export function nameFrom(instruction: string): string {
  const line = instruction.replace(/#(file|selection|problems)\b/g, '').trim().split('\n')[0].replace(/\s+/g, ' ').trim() || 'chat';
  return line.length > 48 ? line.slice(0, 47) + '…' : line;
}
