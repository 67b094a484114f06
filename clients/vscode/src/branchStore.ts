// Branches as the user sees them: the current one (remembered per workspace, so a restart resumes
// it), names taken from the first instruction, and a picker with name, last message, model and time.
import * as vscode from 'vscode';
import { forgetKeptTurns, KeptTurn, LocalTurn, proseOf, StoredKeptTurns, storeKeptTurn, StoredLocalTurns, storeLocalTurns } from './chatModel';
import type { BranchInfo, Message, SidecarClient } from './rpcClient';

const CURRENT_KEY = 'operateSidecar.currentBranch';
const MODEL_KEY = 'operateSidecar.chatModel';
/** The chats' turns that failed or were stopped (the server has no record of them), kept across window reloads. */
const LOCAL_TURNS_KEY = 'operateSidecar.localTurns';
/** What the branches do not hold of the turns the chats ran (thoughts, repeat notes), kept across window reloads. */
const KEPT_TURNS_KEY = 'operateSidecar.keptTurns';

export interface BranchSummary extends BranchInfo { lastMessage: string; lastTime: number | undefined }

function messageLine(m: Message | undefined): string {
  if (!m) return '';
  const c = m.content as Record<string, unknown>;
  if (m.kind === 'instruction') return typeof c.instruction === 'string' ? c.instruction : JSON.stringify(c.instruction ?? '');
  if (m.kind === 'assistant_response') return proseOf(typeof c.text === 'string' ? c.text : '');
  if (m.kind === 'action_request' || m.kind === 'action_response') return `tool ${String(c.function)}`;
  return typeof c.text === 'string' ? c.text : '';
}

function timeOf(m: Message | undefined): number | undefined {
  if (!m) return undefined;
  const t = typeof m.createdAt === 'number' ? (m.createdAt < 1e12 ? m.createdAt * 1000 : m.createdAt) : Date.parse(m.createdAt);
  return Number.isFinite(t) ? t : undefined;
}

export function ago(t: number | undefined, now = Date.now()): string {
  if (t === undefined) return '';
  const s = Math.max(0, Math.round((now - t) / 1000));
  if (s < 60) return 'just now';
  if (s < 3600) return `${Math.floor(s / 60)} min ago`;
  if (s < 86400) return `${Math.floor(s / 3600)} h ago`;
  return new Date(t).toLocaleDateString();
}

export class BranchStore {
  private readonly changed = new vscode.EventEmitter<string | undefined>();
  /** Fires when the current branch changes. */
  readonly onDidChangeCurrent = this.changed.event;
  /** Names of branches this session knows (the server's list is the truth). */
  private readonly names = new Map<string, string>();

  constructor(private readonly state: vscode.Memento) {}

  get current(): string | undefined { return this.state.get<string>(CURRENT_KEY); }
  async setCurrent(branchId: string | undefined): Promise<void> {
    if (branchId === this.current) return;
    await this.state.update(CURRENT_KEY, branchId);
    this.changed.fire(branchId);
  }
  get model(): string | undefined { return this.state.get<string>(MODEL_KEY) || undefined; }
  async setModel(model: string | undefined): Promise<void> { await this.state.update(MODEL_KEY, model); }

  /** The local turns kept for a chat (branch id; '' = a chat not yet bound to a branch), oldest first. */
  localTurns(chat: string): LocalTurn[] {
    const kept = this.state.get<StoredLocalTurns>(LOCAL_TURNS_KEY)?.[chat]?.turns ?? [];
    return JSON.parse(JSON.stringify(kept)) as LocalTurn[];   // a copy: the chat changes its own
  }
  /** Keeps a chat's local turns (none: forgets them); bounded, see storeLocalTurns. */
  setLocalTurns(chat: string, locals: LocalTurn[]): Thenable<void> {
    const stored = this.state.get<StoredLocalTurns>(LOCAL_TURNS_KEY);
    if (!locals.length && !stored?.[chat]) return Promise.resolve();
    return this.state.update(LOCAL_TURNS_KEY, storeLocalTurns(stored, chat, locals, Date.now()));
  }

  /** What the chat kept of the turn that began at message `start` of `branchId` (its thoughts, its note), if anything. */
  keptTurn(branchId: string, start: number): KeptTurn | undefined {
    const key = `${branchId}@${start}`;
    return this.state.get<StoredKeptTurns>(KEPT_TURNS_KEY)?.find(([k]) => k === key)?.[1];
  }
  /** Keeps what the branch does not hold of a turn (workspace state; bounded, see storeKeptTurn). */
  keepTurn(branchId: string, start: number, turn: KeptTurn): Thenable<void> {
    return this.state.update(KEPT_TURNS_KEY, storeKeptTurn(this.state.get<StoredKeptTurns>(KEPT_TURNS_KEY), `${branchId}@${start}`, turn));
  }
  /** Forgets what was kept of a deleted branch's turns. */
  forgetKept(branchId: string): Thenable<void> {
    const stored = this.state.get<StoredKeptTurns>(KEPT_TURNS_KEY);
    if (!stored?.some(([k]) => k.startsWith(`${branchId}@`))) return Promise.resolve();
    return this.state.update(KEPT_TURNS_KEY, forgetKeptTurns(stored, branchId));
  }

  nameOf(branchId: string | undefined): string | undefined { return branchId ? this.names.get(branchId) : undefined; }
  remember(branchId: string, name: string | null | undefined): void { if (name) this.names.set(branchId, name); }

  /** Whether the remembered current branch still exists on the server (journaled); clears it otherwise. */
  async validate(client: SidecarClient): Promise<string | undefined> {
    const id = this.current;
    if (!id) return undefined;
    const { branches } = await client.listBranches();
    const b = branches.find((x) => x.branchId === id);
    if (!b) { await this.setCurrent(undefined); return undefined; }
    this.remember(b.branchId, b.name);
    return id;
  }

  async summaries(client: SidecarClient): Promise<BranchSummary[]> {
    const { branches } = await client.listBranches();
    const out = await Promise.all(branches.map(async (b) => {
      this.remember(b.branchId, b.name);
      let last: Message | undefined;
      if (b.messageCount > 0) {
        try { last = (await client.branchMessages(b.branchId, b.messageCount - 1, 1)).messages[0]; } catch { /* deleted meanwhile */ }
      }
      return { ...b, lastMessage: messageLine(last), lastTime: timeOf(last) };
    }));
    return out.sort((a, b) => (b.lastTime ?? 0) - (a.lastTime ?? 0));
  }

  /**
   * The branch picker: pick to switch; the item buttons fork or delete. Resolves with what the user
   * chose (undefined when dismissed).
   */
  async pick(client: SidecarClient): Promise<{ action: 'switch' | 'fork' | 'delete' | 'new'; branchId?: string } | undefined> {
    const list = await this.summaries(client);
    const forkBtn = { iconPath: new vscode.ThemeIcon('repo-forked'), tooltip: 'Fork this branch' };
    const delBtn = { iconPath: new vscode.ThemeIcon('trash'), tooltip: 'Delete this branch' };
    type Item = vscode.QuickPickItem & { branchId?: string };
    const items: Item[] = [
      { label: '$(add) New chat', alwaysShow: true },
      ...list.map((b) => ({
        label: `${b.branchId === this.current ? '$(comment-discussion) ' : ''}${b.name ?? b.branchId.slice(0, 8)}`,
        description: [b.chatModel ?? '', ago(b.lastTime)].filter(Boolean).join(' · '),
        detail: b.lastMessage.replace(/\s+/g, ' ').slice(0, 120) || `${b.messageCount} messages`,
        branchId: b.branchId, buttons: [forkBtn, delBtn],
      })),
    ];
    const qp = vscode.window.createQuickPick<Item>();
    qp.title = 'operate-sidecar: chats';
    qp.placeholder = 'Switch to a chat (buttons: fork, delete)';
    qp.items = items;
    qp.matchOnDetail = true;
    return new Promise((resolve) => {
      let done = false;
      const finish = (v: { action: 'switch' | 'fork' | 'delete' | 'new'; branchId?: string } | undefined) => {
        if (done) return;
        done = true;
        resolve(v);
        qp.dispose();
      };
      qp.onDidAccept(() => {
        const it = qp.selectedItems[0];
        finish(it ? (it.branchId ? { action: 'switch', branchId: it.branchId } : { action: 'new' }) : undefined);
      });
      qp.onDidTriggerItemButton((e) => finish({ action: e.button === forkBtn ? 'fork' : 'delete', branchId: e.item.branchId }));
      qp.onDidHide(() => finish(undefined));
      qp.show();
    });
  }
}
