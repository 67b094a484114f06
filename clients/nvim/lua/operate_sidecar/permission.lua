-- Tool permission requests, one at a time, never blocking the editor: a diff review when the
-- request carries a preview, else a floating window with the pretty-printed arguments. The
-- float is focused only when the user is looking at the chat in normal mode, so keys typed
-- elsewhere are never taken as an answer. Also the tools view and policy changes.
local config = require('operate_sidecar.config')
local server = require('operate_sidecar.server')
local util = require('operate_sidecar.util')

local api = vim.api
local is_null, notify = util.is_null, util.notify

local M = {}

M.OPTIONS = { 'allow_once', 'allow_always', 'deny_once', 'deny_always' }
M.LABELS = {
  allow_once = 'allow once',
  allow_always = 'allow always (this branch)',
  deny_once = 'deny once',
  deny_always = 'deny always (this branch)',
}
M.KEYS = { a = 'allow_once', A = 'allow_always', d = 'deny_once', D = 'deny_always' }
M.FLOAT = 'operate://permission'

local queue = {} -- pending requests; queue[1] is the one shown
M.queue = queue
M.answered = {} -- {tool, decision, callId} of the answers given (newest last)

local function valid(d)
  return vim.tbl_contains(M.OPTIONS, d)
end

function M.current()
  return queue[1]
end

local function close_view(req)
  if req.close then
    pcall(req.close)
    req.close = nil
  end
end

local show_next

-- Answer `req` with `decision`; or, with `why` (the server stopped waiting, or is gone, or it was
-- answered with an error), drop it as `decision` ('cancelled', 'timedout' or 'deny_once': how the
-- chat shows it), sending no answer.
local function settle(req, decision, why)
  if req.done then
    return
  end
  req.done = true
  req.decision = why and decision or (valid(decision) and decision or 'deny_once')
  close_view(req)
  for i, r in ipairs(queue) do
    if r == req then
      table.remove(queue, i)
      break
    end
  end
  decision = req.decision
  if why then
    M.answered[#M.answered + 1] = { tool = req.params.tool, decision = 'deny_once', callId = req.params.callId,
      why = why }
  else
    M.answered[#M.answered + 1] = { tool = req.params.tool, decision = decision, callId = req.params.callId }
    req.reply({ decision = decision })
  end
  require('operate_sidecar.chat').on_permission_answer(req.params, decision)
  util.event('OperateSidecarPermission')
  vim.schedule(show_next)
end

--- Answer the request shown (or `req`) with a decision.
function M.answer(decision, req)
  req = req or queue[1]
  if not req then
    notify('no permission request is waiting')
    return false
  end
  settle(req, decision)
  return true
end

-- ---------------------------------------------------------------- the float

M.KEYS_LINE = '[a] allow once  [A] always  [d] deny  [D] never  [q] later'
M.KEYS_LINE_DIFF = '[o] review the diff  [a] accept  [A] always  [d] reject  [D] never  [q] later'

--- The request's diff preview (`kind` "diff", the file's `path`, the `diff` and the `newText` the
--- review shows), or nil: without those as text there is nothing to review, and the float asks.
function M.diff_preview(p)
  local preview = p.preview
  if type(preview) == 'table' and preview.kind == 'diff' and type(preview.path) == 'string' and preview.path ~= ''
      and type(preview.diff) == 'string' and type(preview.newText) == 'string' then
    return preview
  end
  return nil
end

-- The float's lines: the keys first (always in view, however long the rest), then the request.
local function float_lines(p)
  local lines = { M.KEYS_LINE, ('**%s** asks to run'):format(util.one_line(p.tool)), '' }
  local args = p.arguments
  local preview = M.diff_preview(p)
  if preview then
    local add, del = require('operate_sidecar.diff').stats(preview.diff)
    lines[1] = M.KEYS_LINE_DIFF
    lines[2] = ('**%s** wants to change %s (+%d −%d)'):format(util.one_line(p.tool), util.display_path(preview.path), add,
      del)
    lines[#lines + 1] = '```diff'
    vim.list_extend(lines, util.split_lines((tostring(preview.diff or '')):gsub('\n$', '')))
    lines[#lines + 1] = '```'
    return lines
  end
  if type(args) == 'table' and next(args) ~= nil then
    lines[#lines + 1] = '```json'
    vim.list_extend(lines, util.pretty(args))
    lines[#lines + 1] = '```'
  else
    lines[#lines + 1] = '_(no arguments)_'
  end
  return lines
end

local function want_focus()
  local mode = api.nvim_get_mode().mode
  if mode ~= 'n' then
    return false
  end
  local f = config.values.permission_focus
  if f == 'always' then
    return true
  elseif f == 'never' then
    return false
  end
  return vim.b.operate_sidecar_chat == true
end

--- Where the float of `lines` goes in an editor of `columns` x `rows`: {row, col, width, height}.
--- The height counts the screen rows of the wrapped lines, so nothing is cut when it fits.
--- The cells `s` takes in the float (tabs to the next 'tabstop' stop) and whether it holds a
--- double-width character. Not strdisplaywidth(): that also counts the padding the *current*
--- window's 'linebreak' adds where the line would wrap there (the chat window has it on), which
--- made the float taller than its lines.
local function measure(s, tabstop)
  local cells, wide = 0, false
  for i, part in ipairs(vim.split(s, '\t', { plain = true })) do
    if i > 1 then
      cells = cells + tabstop - cells % tabstop
    end
    local w = api.nvim_strwidth(part)
    wide = wide or w > util.nchars(part)
    cells = cells + w
  end
  return cells, wide
end

function M.float_layout(lines, columns, rows)
  local tabstop = vim.go.tabstop
  local width = 20
  for _, l in ipairs(lines) do
    width = math.max(width, (measure(l, tabstop)))
  end
  width = math.max(math.min(width + 2, columns - 4), 1)
  local need = 0
  for _, l in ipairs(lines) do
    local cells, wide = measure(l, tabstop)
    -- a double-width character that does not fit at the end of a row starts the next one
    local per_row = (wide and width > 1) and width - 1 or width
    need = need + math.max(1, math.ceil(cells / per_row))
  end
  local height = math.max(math.min(need, rows - 6), 1)
  return {
    row = math.max(math.floor((rows - height) / 2) - 1, 0),
    col = math.max(math.floor((columns - width) / 2), 0),
    width = width,
    height = height,
  }
end

local function place(win, lines)
  local l = M.float_layout(lines, vim.o.columns, vim.o.lines)
  api.nvim_win_set_config(win, { relative = 'editor', row = l.row, col = l.col, width = l.width, height = l.height })
  pcall(api.nvim_win_call, win, function()
    vim.cmd('normal! gg') -- the keys line on top in view
  end)
end

local resize_group = api.nvim_create_augroup('operate_sidecar_permission', { clear = true })

local function open_float(req, focus)
  local b = util.scratch(M.FLOAT, 'markdown')
  local lines = float_lines(req.params)
  util.set_lines(b, 0, -1, lines)
  vim.bo[b].modifiable = false
  local l = M.float_layout(lines, vim.o.columns, vim.o.lines)
  local win = api.nvim_open_win(b, focus, {
    relative = 'editor',
    row = l.row,
    col = l.col,
    width = l.width,
    height = l.height,
    style = 'minimal',
    border = 'rounded',
    zindex = 60,
  })
  api.nvim_clear_autocmds({ group = resize_group })
  api.nvim_create_autocmd('VimResized', { group = resize_group, callback = function()
    if req.win and api.nvim_win_is_valid(req.win) then
      place(req.win, lines)
    else
      return true -- the float is gone: drop this autocmd
    end
  end })
  -- window-locally: `vim.wo[win]` would set the global values too, for every window after
  util.set_win_local(win, 'wrap', true)
  util.set_win_local(win, 'linebreak', false)
  util.set_win_local(win, 'conceallevel', 2)
  for key, decision in pairs(M.KEYS) do
    vim.keymap.set('n', key, function()
      settle(req, decision)
    end, { buffer = b, nowait = true, desc = 'operate-sidecar: ' .. M.LABELS[decision] })
  end
  if req.diff then
    vim.keymap.set('n', 'o', function()
      require('operate_sidecar.diff').focus(req)
    end, { buffer = b, nowait = true, desc = 'operate-sidecar: review the diff' })
  else
    pcall(vim.keymap.del, 'n', 'o', { buffer = b })
  end
  for _, key in ipairs({ 'q', '<Esc>' }) do
    vim.keymap.set('n', key, function()
      M.hide()
    end, { buffer = b, nowait = true, desc = 'operate-sidecar: answer later (:OperatePermission)' })
  end
  -- <C-c> cancels the running turn, as in the chat and the review (the server then cancels
  -- this request too, which closes the float)
  vim.keymap.set('n', '<C-c>', function()
    require('operate_sidecar.server').cancel()
  end, { buffer = b, nowait = true, desc = 'operate-sidecar: cancel the turn' })
  req.win = win
  req.close = function()
    if req.win and api.nvim_win_is_valid(req.win) then
      api.nvim_win_close(req.win, true)
    end
    req.win = nil
  end
end

--- The float for a diff preview that waits for the user (the review tab opens on `o`).
function M.open_preview_float(req)
  open_float(req, false)
end

--- Hide the float (the request stays pending; :OperatePermission shows it again).
function M.hide()
  local req = queue[1]
  if req and req.win and api.nvim_win_is_valid(req.win) then
    api.nvim_win_close(req.win, true)
    req.win = nil
  end
end

--- Show (and focus) the request that is waiting.
function M.focus()
  local req = queue[1]
  if not req then
    notify('no permission request is waiting')
    return false
  end
  if req.diff then
    return require('operate_sidecar.diff').focus(req)
  end
  if req.win and api.nvim_win_is_valid(req.win) then
    api.nvim_set_current_win(req.win)
  else
    open_float(req, true)
  end
  return true
end

-- The tab pages and windows there are (to close what a failed show opened before it failed).
local function layout()
  local tabs, wins = {}, {}
  for _, t in ipairs(api.nvim_list_tabpages()) do
    tabs[t] = true
  end
  for _, w in ipairs(api.nvim_list_wins()) do
    wins[w] = true
  end
  return { tabs = tabs, wins = wins, tab = api.nvim_get_current_tabpage(), win = api.nvim_get_current_win() }
end

-- Close the floats and tab pages opened since `before` (a review tab half made, say).
local function close_opened(before)
  for _, w in ipairs(api.nvim_list_wins()) do
    if not before.wins[w] and api.nvim_win_get_config(w).relative ~= '' then
      pcall(api.nvim_win_close, w, true)
    end
  end
  for _, t in ipairs(api.nvim_list_tabpages()) do
    if not before.tabs[t] and api.nvim_tabpage_is_valid(t) and #api.nvim_list_tabpages() > 1 then
      pcall(vim.cmd, 'tabclose! ' .. api.nvim_tabpage_get_number(t))
    end
  end
  if api.nvim_tabpage_is_valid(before.tab) then
    pcall(api.nvim_set_current_tabpage, before.tab)
  end
  if api.nvim_win_is_valid(before.win) then
    pcall(api.nvim_set_current_win, before.win)
  end
end

-- Showing `req` failed with err: the user is told once and the server gets the error (the rpc
-- layer's ctx.fail; the server counts it as a denial), and it is settled as denied: it leaves the
-- queue and the screen (what it opened before it failed included), and the next one is shown.
local function show_failed(req, err, before)
  local why = tostring(err)
  req.ctx.fail(err, ('the permission request of %s could not be shown, so it was denied: %s'):format(
    tostring(req.params.tool), why))
  settle(req, 'deny_once', 'it could not be shown: ' .. why)
  close_opened(before)
end

local function show(req)
  local p = req.params
  require('operate_sidecar.chat').on_permission_request(p)
  if M.diff_preview(p) then
    req.diff = true
    require('operate_sidecar.diff').review(req, function(decision)
      settle(req, decision)
    end)
  else
    open_float(req, want_focus())
  end
end

show_next = function()
  local req = queue[1]
  if not req or req.shown then
    return
  end
  req.shown = true
  local before = layout()
  local ok, err = pcall(show, req)
  if not ok then
    show_failed(req, err, before)
    return
  end
  util.event('OperateSidecarPermissionShown')
end

-- ---------------------------------------------------------------- from the server

--- requestToolPermission handler (rpc): queue it and show it when its turn comes.
function M.on_request(params, reply, ctx)
  local req = { params = params, reply = reply, id = ctx.id, ctx = ctx }
  if config.values.permission_handler then
    local answered = false
    local d = config.values.permission_handler(params, function(choice)
      if not answered then
        answered = true
        reply({ decision = valid(choice) and choice or 'deny_once' })
      end
    end)
    if d ~= nil and not answered then
      answered = true
      reply({ decision = valid(d) and d or 'deny_once' })
    end
    return
  end
  queue[#queue + 1] = req
  show_next()
end

--- The server stopped waiting for request `id`: its operate was cancelled (we asked for it), or
--- the request timed out (permissionTimeoutMs; the server counts it as a deny).
function M.on_server_cancel(id)
  for _, req in ipairs(queue) do
    if req.id == id then
      local run = server.state.running
      if (run and run.cancel_requested) or server.state.stopping then -- (:OperateStop cancels it too)
        settle(req, 'cancelled', 'the operate was cancelled')
      else
        settle(req, 'timedout', 'the request timed out')
      end
      return
    end
  end
end

function M.server_gone()
  while queue[1] do
    settle(queue[1], 'cancelled', 'the server exited')
  end
end

-- ---------------------------------------------------------------- tools and policies

M.TOOLS = 'operate://tools'

--- Show the tools and the policy in force (for the current branch) in operate://tools.
function M.show_tools(cb)
  cb = cb or function() end
  local bid = require('operate_sidecar.branches').current()
  server.request_or_notify('listTools', bid and { branchId = bid } or nil, cb, function(res)
    local lines = { ('# tools (policy for %s)'):format(bid and ('branch ' .. bid) or 'the server') }
    M.tool_names = {}
    for _, t in ipairs(res.tools) do
      M.tool_names[#M.tool_names + 1] = t.name
      local desc = is_null(t.description) and '' or tostring(t.description):gsub('\n.*', '')
      lines[#lines + 1] = ('%-24s %-8s %-6s %s'):format(t.name, tostring(t.source), tostring(t.policy), desc)
    end
    local b = util.scratch(M.TOOLS)
    util.set_lines(b, 0, -1, lines)
    vim.bo[b].modifiable = false
    if vim.fn.bufwinnr(b) < 0 then
      vim.cmd('botright split')
      api.nvim_win_set_buf(0, b)
      vim.cmd('wincmd p')
    end
    cb(nil, res.tools)
  end)
end

--- Set a tool's policy (allow|deny|ask) for the current branch, or server-wide if none / global.
function M.authorize(tool, decision, cb, global)
  cb = cb or function() end
  local params = { tool = tool, decision = decision }
  if not global then
    params.branchId = require('operate_sidecar.branches').current()
  end
  server.request_or_notify('authorizeTool', params, cb, function(res)
    notify(('%s: %s (%s)'):format(res.tool, res.decision, is_null(res.branchId) and 'server-wide, until the server stops' or res.branchId))
    cb(nil, res)
  end)
end

return M
