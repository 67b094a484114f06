// The chat view's script (runs in the webview). The extension renders all HTML (Markdown is
// sanitized there); this script places it, keeps the scroll and the open tool cards, and turns
// clicks and keys into messages for the extension.
(function () {
  const vscode = acquireVsCodeApi();
  const $ = (id) => document.getElementById(id);
  const log = $('log'), input = $('input'), send = $('send'), stop = $('stop');
  const saved = vscode.getState() || {};
  if (saved.draft) input.value = saved.draft;
  const openCards = new Set(saved.open || []);
  let running = false;
  /** The modifier of the view's shortcuts, as the keyboard says it. */
  const MOD = /Mac|iPhone|iPad/.test(navigator.platform || navigator.userAgent) ? 'Cmd' : 'Ctrl';

  const nearBottom = () => log.scrollHeight - log.scrollTop - log.clientHeight < 60;
  /** The HTML each child of the log (a turn section, data-turn) was made from, by index. */
  const placed = [];
  // the extension sends only the parts (turns) that changed, by index, and how many there are: only
  // those are parsed and replaced; the others keep their DOM, and with it the keyboard focus and a
  // text selection in them (a redraw while another turn streams), and a long chat costs no more per
  // update than a short one
  function place(count, parts) {
    const stick = nearBottom();
    const was = [...log.children];
    for (const i of Object.keys(parts).map(Number).sort((a, b) => a - b)) {
      const h = parts[i];
      if (placed[i] === h && was[i]) continue;
      const t = document.createElement('template');
      t.innerHTML = h;
      const n = t.content.firstElementChild;
      if (!n) continue;
      for (const d of n.querySelectorAll('details.tool')) if (openCards.has(d.dataset.call)) d.open = true;
      if (was[i]) was[i].replaceWith(n); else log.append(n);
      placed[i] = h;
    }
    for (const o of was.slice(count)) o.remove();
    placed.length = Math.min(placed.length, count);
    if (stick) log.scrollTop = log.scrollHeight;
  }
  /**
   * The streamed reply's prose (the last .prose of the last turn) grows by what changed: `html`, the Markdown
   * blocks that settled since the last update, goes after those it has; `tail`, the open rest, replaces the tail
   * it has (the extension renders both: chatView.ts flush). `reset`: all of it, from the settled blocks on (the
   * extension sends that first for each prose element it has not streamed into, e.g. after a redraw of the turn).
   */
  const tails = new WeakMap();   // prose element -> the nodes of its tail
  const fragment = (html) => { const t = document.createElement('template'); t.innerHTML = html; return t.content; };
  function stream(m) {
    const turns = log.querySelectorAll('section.turn');
    const last = turns[turns.length - 1];
    const proses = last ? last.querySelectorAll('.prose') : [];
    const el = proses[proses.length - 1];
    if (!el || (!m.reset && !tails.has(el))) return;   // (not the streamed prose: a reset comes for the new one)
    const stick = nearBottom();
    if (m.reset) el.innerHTML = m.html;
    else {
      for (const n of tails.get(el)) n.remove();
      el.append(fragment(m.html));
    }
    const tail = fragment(m.tail);
    tails.set(el, [...tail.childNodes]);
    el.append(tail);
    placed[turns.length - 1] = undefined;   // its DOM is no longer what its HTML made
    if (stick) log.scrollTop = log.scrollHeight;
  }
  /**
   * The live region (role=status, polite) says what the user needs to hear, each once: that a turn
   * runs and how it ended, a call waiting for a decision, and what the running turn does (its status
   * line: waiting for the model, writing, a repair attempt, running tools...), never each streamed
   * piece. A status is said once it has held for SETTLE_MS (one that passes quicker, such as reading a
   * reply that parses at once, is not said); the start, the end and a decision to make at once.
   */
  const SETTLE_MS = 300;
  let sayTimer;
  function say(text, now) {
    clearTimeout(sayTimer);
    sayTimer = undefined;
    const st = $('status');
    if (st.textContent === text) return;
    if (now) { st.textContent = text; return; }
    sayTimer = setTimeout(() => { sayTimer = undefined; if (running && st.textContent !== text) st.textContent = text; }, SETTLE_MS);
  }
  /** The running turn's status line (the last turn's), as it reads. */
  function statusLine() {
    const turns = log.querySelectorAll('section.turn');
    const line = turns.length ? turns[turns.length - 1].querySelector('.running') : null;
    return line ? line.textContent.trim() : '';
  }
  /**
   * While a turn runs, the live region says whether a call waits for the user's decision (which
   * one), else the turn's status line; it changes only when that changes. A new request is scrolled into view.
   */
  let asked = '';
  function announceWaiting() {
    const ask = log.querySelector('details.tool.ask');
    const what = ask ? ask.querySelector('summary').textContent.replace(/^\?\s*/, '').replace(/\s*\(waiting for you\)$/, '') : '';
    if (ask && what !== asked) ask.scrollIntoView({ block: 'nearest' });
    asked = what;
    if (!running) return;
    // the keys that answer it (see the keydown handler below), said once with the request
    if (ask) say(`Waiting for your decision: ${what}. ${MOD}+Enter accepts, ${MOD}+Backspace rejects.`, true);
    else say(statusLine() || 'working…', false);
  }
  function setRunning(r) {
    if (r === running) return;
    running = r;
    stop.hidden = !r;
    send.disabled = r;
    // the live region says that a turn runs and how it ended
    const last = log.querySelector('section.turn:last-of-type');
    say(r ? 'working…' : last?.classList.contains('failed') ? 'Turn failed.'
      : last?.classList.contains('stopped') ? 'Turn stopped.' : 'Turn finished.', true);
    document.body.classList.toggle('running', r);
  }
  function submit() {
    const text = input.value;
    if (!text.trim() || running) return;
    vscode.postMessage({ type: 'send', text });
    endCompletion();
    input.value = '';
    recalled = null;
    vscode.setState({ ...vscode.getState(), draft: '' });
  }
  /** The message of a turn (its .user text without the chips). */
  const userText = (turn) => [...(turn?.querySelector('.user')?.childNodes ?? [])].filter((n) => n.nodeType === Node.TEXT_NODE).map((n) => n.data).join('');
  /** Puts `text` into the input, the caret at its start or end. */
  function setInput(text, atEnd) {
    input.value = text;
    const at = atEnd ? text.length : 0;
    input.setSelectionRange(at, at);
  }
  /** `text` in place of the input's characters `from`..`to`, the caret after it; kept as the draft. */
  function replaceInput(from, to, text) {
    const v = input.value;
    input.value = v.slice(0, from) + text + v.slice(to);
    input.setSelectionRange(from + text.length, from + text.length);
    vscode.setState({ ...vscode.getState(), draft: input.value });
  }
  /** `text` at the caret (over what is selected), set apart by a space from a word before it. */
  function atCaret(text) {
    const a = input.selectionStart;
    replaceInput(a, input.selectionEnd, (a > 0 && !/\s$/.test(input.value.slice(0, a)) ? ' ' : '') + text);
  }

  // Input history: Up on the input's first line recalls the chat's earlier messages (its turns, so it
  // is the chat's own and comes back with it: shown again, reloaded), Down on its last line the later
  // ones and, past the newest, the draft that was being typed
  let recalled = null;   // index into the history of the message shown; null: the draft
  let draft = '';
  function history() {
    const out = [];
    for (const t of log.querySelectorAll('section.turn')) {
      const u = userText(t);
      if (u.trim() && out[out.length - 1] !== u) out.push(u);
    }
    return out;
  }
  function recall(e) {
    const up = e.key === 'ArrowUp';
    if (e.altKey || e.ctrlKey || e.metaKey || e.shiftKey || e.isComposing) return;
    const v = input.value, a = input.selectionStart, b = input.selectionEnd;
    if (up ? v.slice(0, a).includes('\n') : v.slice(b).includes('\n')) return;   // not on the first / last line: the caret moves
    const h = history();
    if (recalled !== null && recalled >= h.length) recalled = null;   // another chat meanwhile
    let next;
    if (up) next = recalled === null ? h.length - 1 : recalled - 1;
    else if (recalled === null) return;
    else next = recalled + 1;
    if (next < 0) return;
    e.preventDefault();
    if (recalled === null) draft = v;
    recalled = next < h.length ? next : null;
    // Up leaves the caret at the start (Up again goes on to older ones), Down at the end
    setInput(recalled === null ? draft : h[recalled], !up);
  }

  // Inline completion of the input's # references: typing `#` offers #file:, #file, #selection and
  // #problems, typing `#file:` the workspace's files (the extension matches them: refCompletion.ts),
  // in a list above the input (Ctrl+Space shows it too). Up and Down choose, Enter or Tab takes one
  // (it replaces the # word being typed), Escape closes the list; a click takes one too. The list
  // follows each keystroke; a suggestion list of the editor's own is what it looks like.
  const list = $('complete');
  let items = [], active = 0, tokenStart = -1, seq = 0;
  /** A completion is under way (the caret is in a reference): the extension lists the files once per completion. */
  let completing = false;
  const listOpen = () => !list.hidden;
  /** The text before the caret ends in a # word (a reference name, or #file: and a path, bare or quoted): the extension's token (refCompletion.ts tokenAt) is one of these. */
  const IN_REF = /(?:^|\s)#(?:file:"[^"\n]*|\S*)$/;
  function hideList() {
    list.hidden = true;
    list.replaceChildren();
    items = [];
    input.removeAttribute('aria-activedescendant');
    input.setAttribute('aria-expanded', 'false');
  }
  function endCompletion() {
    completing = false;
    seq++;   // an answer on its way is dropped
    hideList();
  }
  /** Asks for the suggestions of the # word at the caret, if the text before it may end in one. */
  function complete() {
    const a = input.selectionStart;
    const before = input.value.slice(0, a);
    if (a !== input.selectionEnd || !IN_REF.test(before)) { endCompletion(); return; }
    vscode.postMessage({ type: 'complete', seq: ++seq, before, fresh: !completing });
    completing = true;
  }
  function markActive() {
    [...list.children].forEach((li, i) => { li.classList.toggle('active', i === active); li.setAttribute('aria-selected', String(i === active)); });
    const li = list.children[active];
    if (li) { input.setAttribute('aria-activedescendant', li.id); li.scrollIntoView({ block: 'nearest' }); }
  }
  function showList(m) {
    if (m.seq !== seq) return;   // a newer request is on its way (or the completion ended)
    if (m.start < 0) { endCompletion(); return; }
    if (!m.items.length) { hideList(); return; }
    items = m.items;
    tokenStart = m.start;
    active = 0;
    list.replaceChildren(...items.map((it, i) => {
      const li = document.createElement('li');
      li.id = `suggestion-${i}`;
      li.setAttribute('role', 'option');
      li.dataset.i = String(i);
      const label = document.createElement('span');
      label.textContent = it.label;
      const detail = document.createElement('span');
      detail.className = 'detail';
      detail.textContent = it.detail;
      li.append(label, detail);
      return li;
    }));
    list.hidden = false;
    input.setAttribute('aria-expanded', 'true');
    markActive();
  }
  /** Takes suggestion `i`: it replaces the # word, from its `#` to the end of the word at the caret. */
  function accept(i) {
    const it = items[i];
    if (!it) return;
    const v = input.value;
    let b = input.selectionStart;
    while (b < v.length && !/\s/.test(v[b])) b++;
    const goesOn = it.ref.endsWith(':');   // #file: goes on to the files
    replaceInput(tokenStart, b, it.ref + (goesOn || /^\s/.test(v.slice(b)) ? '' : ' '));
    endCompletion();
    if (goesOn) complete();
  }
  function move(by) {
    active = (active + by + items.length) % items.length;
    markActive();
  }
  list.addEventListener('mousedown', (e) => {   // (mousedown: the input keeps the focus)
    const li = e.target.closest('li[data-i]');
    e.preventDefault();
    if (li) accept(Number(li.dataset.i));
  });
  input.addEventListener('blur', endCompletion);
  input.addEventListener('click', complete);
  input.addEventListener('keyup', (e) => { if (['ArrowLeft', 'ArrowRight', 'Home', 'End'].includes(e.key)) complete(); });

  window.addEventListener('message', (e) => {
    const m = e.data;
    if (m.type === 'state') {
      place(m.count, m.parts);
      setRunning(m.running);
      announceWaiting();
      if ($('branch').textContent !== m.branch) recalled = null;
      $('branch').textContent = m.branch;
      $('model').textContent = m.model;
    } else if (m.type === 'attach') {   // Attach File (its #file:), Add the Selection (#selection): in at the caret, set apart by spaces
      atCaret(m.ref + (/^\s/.test(input.value.slice(input.selectionEnd)) ? '' : ' '));
      input.focus();
    } else if (m.type === 'completions') {
      showList(m);
    } else if (m.type === 'stream') {
      stream(m);
      // taken (in the DOM now, or not for this page): the extension sends the next update only after this (chatView.ts flush)
      vscode.postMessage({ type: 'streamTaken', seq: m.seq });
    }
  });

  send.addEventListener('click', submit);
  stop.addEventListener('click', () => vscode.postMessage({ type: 'stop' }));
  $('branch').addEventListener('click', () => vscode.postMessage({ type: 'command', id: 'operateSidecar.pickBranch' }));
  $('model').addEventListener('click', () => vscode.postMessage({ type: 'command', id: 'operateSidecar.pickModel' }));
  $('new').addEventListener('click', () => vscode.postMessage({ type: 'command', id: 'operateSidecar.newChat' }));
  $('attach').addEventListener('click', () => vscode.postMessage({ type: 'attach' }));
  /** Ctrl+Space: the suggestions for the # word at the caret, else a `#` typed there and its suggestions. */
  function suggest() {
    const a = input.selectionStart;
    if (a === input.selectionEnd && !IN_REF.test(input.value.slice(0, a))) atCaret('#');   // (not in a # word: one typed)
    completing = false;   // (the file list read again)
    complete();
  }
  input.addEventListener('keydown', (e) => {
    if (e.key === ' ' && e.ctrlKey && !e.altKey && !e.metaKey && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      suggest();
      return;
    }
    if (listOpen() && !e.altKey && !e.ctrlKey && !e.metaKey && !e.isComposing) {
      const act = e.key === 'ArrowDown' ? () => move(1) : e.key === 'ArrowUp' ? () => move(-1)
        : (e.key === 'Enter' || e.key === 'Tab') && !e.shiftKey ? () => accept(active) : undefined;
      if (act) { e.preventDefault(); act(); return; }
    }
    if (e.key === 'ArrowUp' || e.key === 'ArrowDown') recall(e);
    else if (e.key === 'Enter' && !e.shiftKey && !e.isComposing) { e.preventDefault(); submit(); }
  });
  input.addEventListener('input', () => { vscode.setState({ ...vscode.getState(), draft: input.value }); complete(); });
  // Files dropped on the chat: dragged from the Explorer or an editor tab with Shift held (the workbench passes a
  // drag on to a webview only then), their #file: references go into the input where they are dropped on it (else
  // at the caret), as Attach File puts them. The workbench's own list of the dragged resources first (text/uri-list
  // holds only the first of several).
  const URI_TYPES = ['application/vnd.code.uri-list', 'resourceurls', 'text/uri-list'];
  const carriesUris = (dt) => !!dt && [...dt.types].some((t) => URI_TYPES.includes(t.toLowerCase()));
  function droppedUris(dt) {
    const lines = (s) => (s || '').split(/\r?\n/).map((l) => l.trim()).filter((l) => l && !l.startsWith('#'));
    const internal = lines(dt.getData('application/vnd.code.uri-list'));
    if (internal.length) return internal;
    try {
      const r = JSON.parse(dt.getData('resourceurls') || 'null');
      if (Array.isArray(r) && r.length) return r.filter((u) => typeof u === 'string');
    } catch { /* not JSON: the next */ }
    return lines(dt.getData('text/uri-list'));
  }
  const dropping = (on) => document.body.classList.toggle('dropping', on);
  document.addEventListener('dragover', (e) => {
    if (!carriesUris(e.dataTransfer)) return;
    e.preventDefault();   // (a drop here: not the textarea's own, which would type the path)
    e.dataTransfer.dropEffect = 'copy';
    dropping(true);
  });
  document.addEventListener('dragleave', (e) => { if (!e.relatedTarget) dropping(false); });
  document.addEventListener('drop', (e) => {
    dropping(false);
    if (!carriesUris(e.dataTransfer)) return;
    e.preventDefault();
    e.stopPropagation();
    const uris = droppedUris(e.dataTransfer);
    if (!uris.length) return;
    // dropped on the input's text: the caret goes there first (where the references then go in)
    const at = document.caretPositionFromPoint?.(e.clientX, e.clientY);
    if (at?.offsetNode === input) input.setSelectionRange(at.offset, at.offset);
    vscode.postMessage({ type: 'drop', uris });
  }, true);
  /** Answers a call waiting for a decision with one of its card's buttons. */
  function decide(b) {
    b.closest('.ask')?.querySelectorAll('button').forEach((x) => (x.disabled = true));
    vscode.postMessage({ type: 'decide', callId: b.dataset.call, decision: b.dataset.decision });
  }
  // The chat's own keys, anywhere in its page, handled here and not passed on to the workbench:
  // - Escape stops the running turn (the keybinding's `when` needs the focus this view reports, a
  //   round trip through the extension host, so it would miss a key pressed right after the view was
  //   opened or focused by a command; passed on, the keybinding would stop it a second time);
  // - for a call waiting for a decision (the diff editor's keys, for any request, with a diff or
  //   without): Ctrl+Enter accepts the first waiting call, Ctrl+Backspace rejects it, except in the
  //   input, where it deletes a word as everywhere (Tab reaches the card's buttons).
  document.addEventListener('keydown', (e) => {
    if (e.altKey || e.shiftKey || e.isComposing) return;
    const mod = e.ctrlKey || e.metaKey;
    let act;
    if (e.key === 'Escape' && !mod && listOpen()) act = endCompletion;   // (the list closes; a running turn goes on)
    else if (e.key === 'Escape' && !mod && running) act = () => vscode.postMessage({ type: 'stop' });
    else if (mod) {
      const decision = e.key === 'Enter' ? 'allow_once' : e.key === 'Backspace' && e.target !== input ? 'deny_once' : '';
      const b = decision && log.querySelector(`.ask button[data-decision="${decision}"]:not(:disabled)`);
      if (b) act = () => decide(b);
    }
    if (!act) return;
    e.preventDefault();
    e.stopPropagation();
    act();
  }, true);
  log.addEventListener('toggle', (e) => {
    const d = e.target;
    if (!(d instanceof HTMLDetailsElement) || !d.dataset.call) return;
    if (d.open) openCards.add(d.dataset.call); else openCards.delete(d.dataset.call);
    vscode.setState({ ...vscode.getState(), open: [...openCards] });
  }, true);
  /** A Copy button says "Copied" for a moment. */
  function copied(b) {
    b.textContent = 'Copied';
    setTimeout(() => (b.textContent = 'Copy'), 1200);
  }
  log.addEventListener('click', (e) => {
    const b = e.target.closest('button[data-action]');
    if (!b) return;
    const a = b.dataset.action;
    if (a === 'copy' || a === 'insert') {
      const block = b.closest('.code-block');
      vscode.postMessage({ type: a, code: block ? block.dataset.code : '' });
      if (a === 'copy') copied(b);
    } else if (a === 'decide') {
      decide(b);
    } else if (a === 'retry') {
      if (!running) vscode.postMessage({ type: 'retry', id: b.dataset.turnId });
    } else if (a === 'edit') {
      setInput(userText(b.closest('section.turn')), true);
      recalled = null;
      vscode.setState({ ...vscode.getState(), draft: input.value });
      input.focus();
    } else if (a === 'copyReply') {
      vscode.postMessage({ type: 'copyReply', index: Number(b.closest('section.turn')?.dataset.turn) });
      copied(b);
    } else if (a === 'showDiff') {
      vscode.postMessage({ type: 'showDiff', callId: b.dataset.call });
    }
  });
  // the view focused (Open Chat, the status bar, a keybinding): the cursor goes to the input, as
  // in the editor's own chat, unless something in the view already has it; and the extension
  // learns where the keyboard focus is, for the view's keybindings (Escape, which the view also
  // handles itself, see above): the workbench's focusedView does not follow the focus into a webview
  const focused = (f) => vscode.postMessage({ type: 'focus', focused: f });
  const onFocus = () => {
    const a = document.activeElement;
    if (!a || a === document.body || a === document.documentElement) input.focus();
    focused(true);
  };
  window.addEventListener('focus', onFocus);
  window.addEventListener('blur', () => focused(false));
  if (document.hasFocus()) onFocus();
  vscode.postMessage({ type: 'ready', mod: MOD });   // the cards' tooltips name the same modifier
})();
