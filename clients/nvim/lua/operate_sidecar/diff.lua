-- Diff review of a proposed file change: a tab with the file's buffer and the proposed text
-- side by side (`:diffthis`), `ga` accept, `gr` reject, `gA` accept always (this branch),
-- `gR` reject always, `<C-c>` cancel the running turn. An accepted change is then written by
-- the server through the editor's file system (fs.lua), so it lands in this very buffer as one
-- undoable change. A new file is reviewed against an empty buffer of its path that the review
-- makes; when the change is not accepted that buffer goes again (fs.lua treats it as "no such
-- file" meanwhile).
local api = vim.api
local util = require('operate_sidecar.util')

local M = {}

-- the review's keys: a decision each, and <C-c> cancels the running turn as in the chat
-- (spelled as nvim_buf_get_keymap() gives it back, so the buffer's own <C-c> is saved too)
M.KEYS = { ga = 'allow_once', gA = 'allow_always', gr = 'deny_once', gR = 'deny_always', ['<C-C>'] = 'cancel' }
M.HINT = 'ga accept · gr reject · gA always · gR never'

M.current = nil -- {req, tab, file_buf, proposed_buf}

local function proposed_name(path)
  return 'operate://proposed/' .. util.display_path(path)
end

--- +added −removed of a unified diff.
function M.stats(diff)
  local add, del = 0, 0
  if type(diff) == 'string' then
    for line in (diff .. '\n'):gmatch('(.-)\n') do
      if line:sub(1, 1) == '+' and line:sub(1, 3) ~= '+++' then
        add = add + 1
      elseif line:sub(1, 1) == '-' and line:sub(1, 3) ~= '---' then
        del = del + 1
      end
    end
  end
  return add, del
end

-- Map the review keys in buffer b; returns the buffer's own mappings of those keys (an LSP
-- `gr`, say), which unmap_keys puts back.
local function map_keys(b, decide)
  local saved = {}
  for _, m in ipairs(api.nvim_buf_get_keymap(b, 'n')) do
    if M.KEYS[m.lhs] then
      saved[#saved + 1] = m
    end
  end
  for key, decision in pairs(M.KEYS) do
    vim.keymap.set('n', key, function()
      if decision == 'cancel' then
        require('operate_sidecar.server').cancel()
      else
        decide(decision)
      end
    end, { buffer = b, nowait = true, desc = 'operate-sidecar: ' .. decision })
  end
  return saved
end

local function unmap_keys(b, saved)
  if b and api.nvim_buf_is_valid(b) then
    for key in pairs(M.KEYS) do
      pcall(vim.keymap.del, 'n', key, { buffer = b })
    end
    for _, m in ipairs(saved or {}) do
      pcall(api.nvim_buf_set_keymap, b, 'n', m.lhs, m.rhs or '', { noremap = m.noremap == 1,
        silent = m.silent == 1, expr = m.expr == 1, nowait = m.nowait == 1, script = m.script == 1,
        desc = m.desc, callback = m.callback })
    end
  end
end

-- The review's windows get the user's options, not the chat's: the tab is opened from the
-- chat window (whose options a new window copies), and concealing there hid what changed (a
-- markdown `**` shown on one side only, the line marked changed and both sides alike).
local function review_win_options(w)
  local chat = require('operate_sidecar.chat')
  for _, list in ipairs({ chat.WIN_OPTIONS, chat.PROMPT_WIN_OPTIONS }) do
    for _, o in ipairs(list) do
      pcall(function()
        util.set_win_local(w, o[1], util.global_option(o[1]))
      end)
    end
  end
  util.set_win_local(w, 'conceallevel', 0) -- every character of both sides in view
end

M.STALE = {
  'The file changed after this change was proposed (it no longer holds the text the change',
  'was made from), so accepting it will fail and write nothing. gr rejects it; then ask again.',
  'The change as proposed:',
  '',
}

-- Draw the review `view` as it stands: the live diff of the file's buffer (left) and the
-- proposal (right), or, when the file's text is no longer the one the change was made from
-- (view.stale), the notice (M.STALE) and the change as proposed, without a diff.
local function draw(view)
  local p, fb, pb = view.req.params.preview, view.file_buf, view.proposed_buf
  local stale = view.stale
  local lines
  if stale then
    lines = util.extend(util.extend({}, M.STALE), util.split_lines((tostring(p.diff or '')):gsub('\n$', '')))
  else
    -- split as a buffer of that file holds it (its 'fileformat', 'bomb'): a CRLF file's lines
    -- end without their \r on both sides, so only the lines that change are marked
    lines = require('operate_sidecar.fs').text_lines(p.newText or '', fb)
  end
  local ft = stale and 'diff' or view.ft
  if vim.bo[pb].filetype ~= ft then
    vim.bo[pb].filetype = ft
  end
  util.set_lines(pb, 0, -1, lines)
  vim.bo[pb].modifiable = false
  for _, w in ipairs({ view.left, view.right }) do
    if api.nvim_win_is_valid(w) then
      api.nvim_win_call(w, function()
        vim.cmd(stale and 'diffoff' or 'diffthis')
      end)
    end
  end
  local add, del = M.stats(p.diff)
  util.set_win_local(view.left, 'statusline', stale and ' %f (now: changed since the proposal)%m' or ' %f (now)%m')
  util.set_win_local(view.right, 'statusline', (stale and ' proposed +%d −%d, for a text the file no longer holds · %s'
    or ' proposed +%d −%d · %s'):format(add, del, stale and 'gr reject · ga will fail' or M.HINT))
end

--- Open the review tab for request `req` (its params carry preview {path, oldText, newText,
--- diff}); decide(decision) answers it. Sets req.close.
function M.open(req, decide)
  local p = req.params.preview
  local fs = require('operate_sidecar.fs')
  local prev_tab = api.nvim_get_current_tabpage()
  vim.cmd('tabnew')
  local tab = api.nvim_get_current_tabpage()
  local scratch_of_tabnew = api.nvim_get_current_buf()
  local uv = vim.uv or vim.loop
  -- a buffer made only for this review (a new file): it goes again unless the change is accepted
  local made = not uv.fs_stat(p.path) and vim.fn.bufexists(p.path) == 0
  local fb = vim.fn.bufadd(p.path)
  vim.fn.bufload(fb)
  vim.bo[fb].buflisted = true
  local left = api.nvim_get_current_win()
  api.nvim_win_set_buf(left, fb)
  if scratch_of_tabnew ~= fb and api.nvim_buf_is_valid(scratch_of_tabnew) then
    pcall(api.nvim_buf_delete, scratch_of_tabnew, { force = true })
  end
  -- the file's text is no longer what the change was computed from (the user typed in it while
  -- the request waited, or the disk changed): a diff against it would show the user's own lines
  -- as the model's deletions, and the write fails (docs/PROTOCOL.md §9) whatever is decided
  local function is_stale()
    return type(p.oldText) == 'string' and fs.buf_text(fb) ~= p.oldText
  end
  local name = proposed_name(p.path)
  local old = util.find_buf(name)
  if old then
    pcall(api.nvim_buf_delete, old, { force = true })
  end
  local ft = vim.bo[fb].filetype ~= '' and vim.bo[fb].filetype or 'text'
  local stale = is_stale()
  local pb = util.scratch(name, stale and 'diff' or ft)
  vim.bo[pb].bufhidden = 'wipe'
  vim.cmd('rightbelow vsplit')
  local right = api.nvim_get_current_win()
  api.nvim_win_set_buf(right, pb)
  for _, w in ipairs({ left, right }) do
    review_win_options(w)
  end
  local view = { req = req, tab = tab, file_buf = fb, proposed_buf = pb, left = left, right = right, stale = stale,
    ft = ft }
  draw(view)
  local saved = map_keys(fb, decide)
  map_keys(pb, decide)
  api.nvim_set_current_win(right)
  M.current = view
  req.diff_view = view
  local group = api.nvim_create_augroup('operate_sidecar_review_' .. tostring(req.params.callId), { clear = true })
  req.close = function()
    pcall(api.nvim_del_augroup_by_id, group)
    unmap_keys(fb, saved)
    view = req.diff_view
    req.diff_view = nil
    if M.current == view then
      M.current = nil
    end
    if view and api.nvim_tabpage_is_valid(view.tab) then
      if api.nvim_get_current_tabpage() == view.tab and #api.nvim_list_tabpages() > 1 then
        if api.nvim_tabpage_is_valid(prev_tab) then
          api.nvim_set_current_tabpage(prev_tab)
        end
      end
      for _, w in ipairs(api.nvim_tabpage_list_wins(view.tab)) do
        if api.nvim_win_is_valid(w) and api.nvim_win_get_buf(w) == fb then
          api.nvim_win_call(w, function()
            vim.cmd('diffoff')
          end)
        end
      end
      if #api.nvim_list_tabpages() > 1 then
        vim.cmd('tabclose ' .. api.nvim_tabpage_get_number(view.tab))
      end
    end
    if api.nvim_buf_is_valid(pb) then
      pcall(api.nvim_buf_delete, pb, { force = true })
    end
    local accepted = type(req.decision) == 'string' and req.decision:match('^allow') ~= nil
    if made and not accepted and api.nvim_buf_is_valid(fb) and not vim.bo[fb].modified
        and not uv.fs_stat(p.path) then
      pcall(api.nvim_buf_delete, fb, { force = true }) -- no empty buffer of a file that was never made
    end
  end
  -- A review no longer whole (a window of it closed, the file's buffer deleted or unloaded with
  -- :bd, its tab closed) closes at once: its keys stayed live in what was left, and `ga` in the
  -- proposal after `:bd` of the file wrote around the buffer the review promised. The request
  -- still waits: :OperatePermission (gp in the chat) builds the review again.
  local watch = view
  local function check()
    vim.schedule(function()
      if req.diff_view == watch and not req.done and not M.intact(watch) then
        pcall(req.close)
        util.notify(('the review of %s was closed; :OperatePermission (gp in the chat) shows it again'):format(
          util.display_path(p.path)))
      end
    end)
  end
  -- (the review's own windows and buffers only, and a tab closed: no check for every other event)
  api.nvim_create_autocmd('WinClosed', { group = group, pattern = { tostring(left), tostring(right) }, callback = check })
  api.nvim_create_autocmd('TabClosed', { group = group, callback = check })
  for _, b in ipairs({ fb, pb }) do
    api.nvim_create_autocmd({ 'BufWinLeave', 'BufUnload', 'BufWipeout' }, { group = group, buffer = b, callback = check })
  end
  -- Typing in the file side (or any change of its buffer) while the review is open voids the
  -- proposal as a change before it opened does: the notice and the change as proposed instead
  -- of a diff that would show the typed lines as the model's; undone back to the text the change
  -- was made from, the diff is back. (nvim_buf_attach: every change, whichever window made it.)
  local queued = false
  api.nvim_buf_attach(fb, false, {
    on_lines = function()
      if req.diff_view ~= watch or req.done then
        return true -- (detach: this review is over)
      end
      if not queued then
        queued = true
        vim.schedule(function() -- (not while the change is being made: textlock)
          queued = false
          if req.diff_view == watch and not req.done and M.intact(watch) and is_stale() ~= watch.stale then
            watch.stale = not watch.stale
            draw(watch)
          end
        end)
      end
    end,
  })
  util.event('OperateSidecarDiff')
end

--- Called by permission.lua for a request with a diff preview: open the review now when the
--- user is at rest in normal mode, else wait (the permission float shows the diff meanwhile).
function M.review(req, decide)
  req.decide = decide
  local mode = api.nvim_get_mode().mode
  local f = require('operate_sidecar.config').values.permission_focus
  local ok = mode == 'n' and (f == 'always' or (f ~= 'never' and vim.b.operate_sidecar_chat == true))
  if ok then
    M.open(req, decide)
  else
    require('operate_sidecar.permission').open_preview_float(req)
  end
end

--- The branch of the review shown in the current tab page (nil elsewhere): the review tab has
--- no current branch of its own, yet the statusline there names the branch of the request.
function M.branch()
  local view = M.current
  if view and view.tab == api.nvim_get_current_tabpage() then
    local id = view.req.params.branchId
    return type(id) == 'string' and id or nil
  end
end

-- Is the review still whole: its tab, both windows (showing the file and the proposal)?
local function intact(view)
  if not (view and api.nvim_tabpage_is_valid(view.tab) and api.nvim_buf_is_valid(view.proposed_buf)) then
    return false
  end
  for w, b in pairs({ [view.left] = view.file_buf, [view.right] = view.proposed_buf }) do
    if not api.nvim_win_is_valid(w) or api.nvim_win_get_buf(w) ~= b or api.nvim_win_get_tabpage(w) ~= view.tab then
      return false
    end
  end
  return true
end
M.intact = intact

--- The editor was resized: the review's two windows share its width again (narrowing the
--- editor took every column from the proposal, down to one).
function M.on_resize()
  local view = M.current
  if intact(view) then
    pcall(api.nvim_win_call, view.left, function()
      vim.cmd('wincmd =')
    end)
  end
end

--- Show the review of `req` (opening it when only the float was shown, rebuilding it when a
--- window of it was closed).
function M.focus(req)
  if intact(req.diff_view) then
    api.nvim_set_current_tabpage(req.diff_view.tab)
    return true
  end
  if req.close then
    req.close()
  end
  M.open(req, req.decide)
  return true
end

return M
