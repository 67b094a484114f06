-- operate-sidecar for Neovim: start the server, run `operate`, show what happens.
-- Works on Neovim 0.7.2 and later. See clients/nvim/README.md.

local rpc = require('operate_sidecar.rpc')
local api = vim.api

local M = {}
M.version = '0.1.0'
M.OUTPUT = 'operate://output'
M.MESSAGES = 'operate://messages'
M.TOOLS = 'operate://tools'
M.PERMISSION_OPTIONS = { 'allow_once', 'allow_always', 'deny_once', 'deny_always' }

local islist = vim.islist or vim.tbl_islist
local is_null = rpc.is_null

local defaults = {
  cmd = { 'operate-sidecar' }, -- program + arguments
  cmd_env = nil, -- extra environment variables for the server
  cmd_cwd = nil, -- working directory of the server (default: the editor's)
  settings = {}, -- initialize `settings` (PROTOCOL §2)
  state_dir = nil, -- journal dir; nil = stdpath('state')/operate-sidecar, false = memory only
  branch_scope = 'tab', -- 'tab' (a current branch per tab page) or 'global'
  branch = {}, -- createBranch params for new branches: {system?, chatModel?, parseModel?, name?}
  log_file = nil, -- the server's stderr; default stdpath('cache')/operate-sidecar.log
  open_output = true, -- show operate://output in a split when an operate starts
  auto_start = true, -- start the server on first use
  request_timeout = 30000, -- ms, for initialize and the synchronous helpers
  permission_handler = nil, -- function(params, answer) -> decision|nil; replaces vim.ui.select
  client_tools = nil, -- extra {name, description, inputSchema, handler(args, params)} tools
  builtin_client_tools = true, -- offer `nvim_buffer_text` to the model
  notify = nil, -- function(msg, level); default vim.notify
  operate_defaults = {}, -- merged under the params of every operate, e.g. {actions = true, tools = true}
}

M.config = vim.deepcopy(defaults)

local S = {
  client = nil,
  ready = false,
  init_result = nil,
  queue = {},
  branches = { global = nil, tab = {} },
  running = nil, -- {id?, token, instruction, deltas, cancel_requested}
  seq = 0,
  tool_events = {},
  progress = {},
  last = nil, -- {err, result} of the last operate
  exit = nil, -- {code, signal} of the last server exit
  tools = {}, -- client tools by name
  stopping = false,
  after_exit = {}, -- run once the current server process is gone
}
M._state = S

-- ---------------------------------------------------------------- helpers

local function notify(msg, level)
  local f = M.config.notify or vim.notify
  f('[operate] ' .. msg, level or vim.log.levels.INFO)
end

local function event(name)
  if vim.fn.exists('#User#' .. name) == 1 then
    pcall(vim.cmd, 'doautocmd <nomodeline> User ' .. name)
  end
end

local function default_state_dir()
  local ok, dir = pcall(vim.fn.stdpath, 'state') -- 0.8+
  if not ok then
    local xdg = os.getenv('XDG_STATE_HOME')
    if not xdg or xdg == '' then
      xdg = (os.getenv('HOME') or '.') .. '/.local/state'
    end
    dir = xdg .. '/nvim'
  end
  return dir .. '/operate-sidecar'
end
M.default_state_dir = default_state_dir

local function default_log_file()
  return vim.fn.stdpath('cache') .. '/operate-sidecar.log'
end

local function json_scalar(v)
  local s = vim.json.encode(v)
  return (s:gsub('\\/', '/')) -- 0.7's encoder escapes '/'
end

--- Pretty-print a decoded JSON value (keys sorted, two-space indent). Returns a list of lines.
function M.pretty(value)
  local out = {}
  local function walk(v, indent, prefix, suffix)
    local pad = string.rep('  ', indent)
    if v == nil or v == vim.NIL then
      out[#out + 1] = pad .. prefix .. 'null' .. suffix
    elseif type(v) ~= 'table' then
      out[#out + 1] = pad .. prefix .. json_scalar(v) .. suffix
    elseif next(v) == nil then
      local empty = getmetatable(v) == getmetatable(vim.empty_dict()) and '{}' or '[]'
      out[#out + 1] = pad .. prefix .. empty .. suffix
    elseif islist(v) then
      out[#out + 1] = pad .. prefix .. '['
      for i, item in ipairs(v) do
        walk(item, indent + 1, '', i < #v and ',' or '')
      end
      out[#out + 1] = pad .. ']' .. suffix
    else
      out[#out + 1] = pad .. prefix .. '{'
      local keys = vim.tbl_keys(v)
      table.sort(keys, function(a, b)
        return tostring(a) < tostring(b)
      end)
      for i, k in ipairs(keys) do
        walk(v[k], indent + 1, json_scalar(tostring(k)) .. ': ', i < #keys and ',' or '')
      end
      out[#out + 1] = pad .. '}' .. suffix
    end
  end
  walk(value, 0, '', '')
  return out
end

local function compact(v)
  if v == nil or v == vim.NIL then
    return 'null'
  end
  local ok, s = pcall(json_scalar, v)
  return ok and s or tostring(v)
end

local function as_object(t)
  if t == nil or (type(t) == 'table' and next(t) == nil and getmetatable(t) == nil) then
    return vim.empty_dict()
  end
  return t
end

-- ---------------------------------------------------------------- scratch buffers

local function find_buf(name)
  for _, b in ipairs(api.nvim_list_bufs()) do
    if api.nvim_buf_is_valid(b) and api.nvim_buf_get_name(b) == name then
      return b
    end
  end
end

local function scratch(name)
  local b = find_buf(name)
  if b then
    return b
  end
  b = api.nvim_create_buf(false, true)
  api.nvim_buf_set_name(b, name)
  vim.bo[b].buftype = 'nofile'
  vim.bo[b].bufhidden = 'hide'
  vim.bo[b].swapfile = false
  vim.bo[b].filetype = 'operate_sidecar'
  vim.bo[b].modifiable = false
  return b
end

function M.output_buf()
  return scratch(M.OUTPUT)
end

local function show(b)
  for _, w in ipairs(api.nvim_tabpage_list_wins(0)) do
    if api.nvim_win_get_buf(w) == b then
      return w
    end
  end
  local prev = api.nvim_get_current_win()
  vim.cmd('botright split')
  local w = api.nvim_get_current_win()
  api.nvim_win_set_buf(w, b)
  api.nvim_set_current_win(prev)
  return w
end

local function follow(b)
  local last = api.nvim_buf_line_count(b)
  for _, w in ipairs(api.nvim_list_wins()) do
    if api.nvim_win_get_buf(w) == b then
      pcall(api.nvim_win_set_cursor, w, { last, 0 })
    end
  end
end

local function edit(b, fn)
  vim.bo[b].modifiable = true
  local ok, err = pcall(fn)
  vim.bo[b].modifiable = false
  if not ok then
    error(err)
  end
  follow(b)
end

local function buf_empty(b)
  return api.nvim_buf_line_count(b) == 1 and api.nvim_buf_get_lines(b, 0, 1, false)[1] == ''
end

local function split_lines(text)
  return vim.split(text, '\n', { plain = true })
end

-- Append whole lines; the buffer then ends with an empty line where streamed text continues.
local function out_lines(lines)
  local b = M.output_buf()
  edit(b, function()
    local n = api.nvim_buf_line_count(b)
    local last = api.nvim_buf_get_lines(b, n - 1, n, false)[1]
    local all = {}
    for _, l in ipairs(lines) do
      vim.list_extend(all, split_lines(l))
    end
    all[#all + 1] = ''
    if last == '' then
      api.nvim_buf_set_lines(b, n - 1, n, false, all)
    else
      api.nvim_buf_set_lines(b, n, n, false, all)
    end
  end)
end

-- Append text at the end of the last line (streamed deltas).
local function out_text(text)
  local b = M.output_buf()
  edit(b, function()
    local parts = split_lines(text)
    local n = api.nvim_buf_line_count(b)
    local last = api.nvim_buf_get_lines(b, n - 1, n, false)[1]
    parts[1] = last .. parts[1]
    api.nvim_buf_set_lines(b, n - 1, n, false, parts)
  end)
end

local function set_buf(name, lines)
  local b = scratch(name)
  edit(b, function()
    api.nvim_buf_set_lines(b, 0, -1, false, lines)
  end)
  return b
end

--- Lines of the output buffer (for tests and scripts).
function M.output_lines()
  return api.nvim_buf_get_lines(M.output_buf(), 0, -1, false)
end

function M.clear_output()
  local b = M.output_buf()
  edit(b, function()
    api.nvim_buf_set_lines(b, 0, -1, false, {})
  end)
end

-- ---------------------------------------------------------------- server → client

local levels = { vim.log.levels.ERROR, vim.log.levels.WARN, vim.log.levels.INFO, vim.log.levels.DEBUG }

local function on_progress(p)
  local run = S.running
  local v = type(p) == 'table' and p.value or nil
  if type(v) ~= 'table' then
    return
  end
  if not run or p.token ~= run.token then
    return
  end
  if v.kind == 'begin' then
    S.progress = { phase = 'begin', message = v.message }
    notify('operate: ' .. tostring(v.message))
  elseif v.kind == 'report' then
    if not is_null(v.delta) and v.delta ~= '' then
      run.deltas[#run.deltas + 1] = v.delta
      out_text(v.delta)
      event('OperateSidecarDelta')
    end
    if v.phase ~= S.progress.phase then
      S.progress = { phase = v.phase, message = v.message }
      notify('operate: ' .. tostring(v.phase) .. (is_null(v.message) and '' or (' ' .. tostring(v.message))))
    end
  elseif v.kind == 'end' then
    S.progress = { phase = 'end', message = v.message }
    notify('operate: done' .. (is_null(v.message) and '' or (' (' .. tostring(v.message) .. ')')))
  end
end

local function on_tool_event(e)
  S.tool_events[#S.tool_events + 1] = e
  local line = ('[tool %s] %s'):format(tostring(e.event), tostring(e.tool))
  if not is_null(e.argsSummary) then
    line = line .. ' ' .. tostring(e.argsSummary)
  end
  if not is_null(e.resultSummary) then
    line = line .. ' -> ' .. tostring(e.resultSummary)
  end
  if not is_null(e.error) then
    line = line .. ' !! ' .. tostring(e.error)
  end
  if not is_null(e.durationMs) then
    line = line .. (' (%d ms)'):format(math.floor((tonumber(e.durationMs) or 0) + 0.5))
  end
  out_lines({ line })
  event('OperateSidecarToolEvent')
end

local function on_notification(method, params)
  if method == '$/progress' then
    on_progress(params)
  elseif method == 'toolEvent' then
    on_tool_event(params)
  elseif method == 'window/logMessage' and type(params) == 'table' then
    notify(tostring(params.message), levels[params.type] or vim.log.levels.INFO)
  end
end

local function valid_decision(d)
  return vim.tbl_contains(M.PERMISSION_OPTIONS, d)
end

local function on_permission(params, reply, ctx)
  local answered = false
  local function answer(choice)
    if answered then
      return
    end
    answered = true
    local decision = valid_decision(choice) and choice or 'deny_once'
    if ctx.cancelled() then
      out_lines({ ('[permission] %s: answered %s after the server stopped waiting (denied)'):format(params.tool,
        decision) })
    else
      out_lines({ ('[permission] %s -> %s'):format(tostring(params.tool), decision) })
    end
    reply({ decision = decision })
  end
  out_lines({ ('[permission] %s %s ?'):format(tostring(params.tool), compact(params.arguments)) })
  if M.config.permission_handler then
    local d = M.config.permission_handler(params, answer)
    if d ~= nil then
      answer(d)
    end
    return
  end
  local options = (type(params.options) == 'table' and #params.options > 0) and params.options or M.PERMISSION_OPTIONS
  local labels = {
    allow_once = 'Allow once',
    allow_always = 'Allow always (this branch)',
    deny_once = 'Deny once',
    deny_always = 'Deny always (this branch)',
  }
  vim.ui.select(options, {
    prompt = ('operate-sidecar: run tool %s %s?'):format(tostring(params.tool), compact(params.arguments)),
    kind = 'operate_sidecar.permission',
    format_item = function(item)
      return labels[item] or item
    end,
  }, function(choice)
    answer(choice)
  end)
end

local function on_invoke_client_tool(params, reply)
  local tool = S.tools[params.tool]
  if not tool then
    reply(nil, { code = -32601, message = 'unknown client tool: ' .. tostring(params.tool) })
    return
  end
  local args = is_null(params.arguments) and {} or params.arguments
  local ok, out = pcall(tool.handler, args, params)
  if ok then
    reply({ output = is_null(out) and vim.NIL or out })
  else
    reply(nil, { code = -32603, message = tostring(out) })
  end
end

-- ---------------------------------------------------------------- client tools

local function builtin_tools()
  return {
    {
      name = 'nvim_buffer_text',
      description = 'The text of a buffer open in Neovim: the current buffer, or the loaded buffer whose name ends with `path`.',
      inputSchema = { type = 'object', properties = { path = { type = 'string' } } },
      handler = function(args)
        local b = api.nvim_get_current_buf()
        if type(args.path) == 'string' and args.path ~= '' then
          b = nil
          for _, cand in ipairs(api.nvim_list_bufs()) do
            local name = api.nvim_buf_get_name(cand)
            if api.nvim_buf_is_loaded(cand) and name:sub(-#args.path) == args.path then
              b = cand
              break
            end
          end
          if not b then
            error('no loaded buffer named ' .. args.path)
          end
        end
        return {
          name = api.nvim_buf_get_name(b),
          text = table.concat(api.nvim_buf_get_lines(b, 0, -1, false), '\n'),
        }
      end,
    },
  }
end

local function collect_tools()
  local list = {}
  if M.config.builtin_client_tools then
    vim.list_extend(list, builtin_tools())
  end
  vim.list_extend(list, M.config.client_tools or {})
  S.tools = {}
  local specs = {}
  for _, t in ipairs(list) do
    S.tools[t.name] = t
    specs[#specs + 1] = { name = t.name, description = t.description or '', inputSchema = as_object(t.inputSchema) }
  end
  return specs
end

-- ---------------------------------------------------------------- lifecycle

function M.setup(opts)
  M.config = vim.tbl_deep_extend('force', vim.deepcopy(defaults), opts or {})
  -- tbl_deep_extend merges lists by index; take cmd and client_tools as given
  if opts and opts.cmd then
    M.config.cmd = type(opts.cmd) == 'string' and { opts.cmd } or opts.cmd
  end
  if opts and opts.client_tools then
    M.config.client_tools = opts.client_tools
  end
  return M
end

local function init_settings()
  local s = vim.deepcopy(M.config.settings or {})
  if s.stateDir == nil then
    if M.config.state_dir == false then
      s.stateDir = vim.NIL
    else
      s.stateDir = M.config.state_dir or default_state_dir()
    end
  end
  for _, k in ipairs({ 'models', 'toolPolicy', 'mcpServers' }) do
    if s[k] ~= nil then
      s[k] = as_object(s[k])
    end
  end
  return s
end

local function flush_queue(err)
  local q = S.queue
  S.queue = {}
  for _, fn in ipairs(q) do
    fn(err)
  end
end

local function on_exit(client, code, signal)
  if S.client ~= client then
    return
  end
  S.client, S.ready = nil, false
  S.exit = { code = code, signal = signal }
  local journaled = S.init_result and S.init_result.capabilities
    and not is_null(S.init_result.capabilities.stateDir)
  if not journaled then
    S.branches = { global = nil, tab = {} } -- those branches are gone with the process
  end
  flush_queue({ code = rpc.codes.server_exited, message = 'operate-sidecar exited during start-up' })
  local lvl = (code == 0 or S.stopping) and vim.log.levels.INFO or vim.log.levels.WARN
  notify(('server exited (code %s%s)'):format(tostring(code), (signal and signal ~= 0) and (', signal ' .. signal) or ''),
    lvl)
  S.stopping = false
  event('OperateSidecarExit')
  local after = S.after_exit
  S.after_exit = {}
  for _, fn in ipairs(after) do
    fn()
  end
end

-- A server process that is still registered but stopping or dead (its exit not yet handled).
local function going_away()
  return S.client ~= nil and (S.stopping or not S.client:is_running())
end

--- Start the server and initialize it. cb(err, initialize_result) runs once it is ready.
function M.start(cb)
  cb = cb or function() end
  local function when_started(err) -- queued until initialize settles
    cb(err, S.init_result)
  end
  if S.ready then
    cb(nil, S.init_result)
    return
  end
  if going_away() then
    S.after_exit[#S.after_exit + 1] = function()
      M.start(cb)
    end
    return
  end
  if S.client then
    S.queue[#S.queue + 1] = when_started
    return
  end
  local ok, client = pcall(function()
    local c
    c = rpc.start({
      cmd = M.config.cmd,
      cwd = M.config.cmd_cwd,
      env = M.config.cmd_env,
      log_file = M.config.log_file or default_log_file(),
      on_notification = on_notification,
      handlers = { requestToolPermission = on_permission, invokeClientTool = on_invoke_client_tool },
      on_server_cancel = function(id)
        out_lines({ ('[server] stopped waiting for request %s'):format(tostring(id)) })
      end,
      on_exit = function(code, signal)
        on_exit(c, code, signal)
      end,
    })
    return c
  end)
  if not ok then
    notify(tostring(client), vim.log.levels.ERROR)
    cb({ code = rpc.codes.not_running, message = tostring(client) })
    return
  end
  S.client, S.ready, S.init_result, S.exit = client, false, nil, nil
  S.queue[#S.queue + 1] = when_started

  local timer = (vim.uv or vim.loop).new_timer()
  local settled = false
  local function settle(err)
    if settled then
      return
    end
    settled = true
    timer:stop()
    timer:close()
    if err then
      notify('start failed: ' .. tostring(err.message), vim.log.levels.ERROR)
      client:kill(9) -- on_exit then forgets this client
      flush_queue(err)
      return
    end
    S.ready = true
    notify(('started %s %s (pid %d)'):format(S.init_result.serverInfo.name, S.init_result.serverInfo.version,
      client.pid))
    event('OperateSidecarReady')
    flush_queue(nil)
  end
  timer:start(M.config.request_timeout, 0, vim.schedule_wrap(function()
    settle({ code = rpc.codes.timeout, message = 'initialize timed out' })
  end))

  local specs = collect_tools()
  client:request('initialize', {
    protocolVersion = 1,
    clientInfo = { name = 'operate-sidecar.nvim', version = M.version },
    processId = vim.fn.getpid(),
    capabilities = { toolPermission = true, clientTools = true },
    workspaceFolders = { vim.fn.getcwd() },
    settings = init_settings(),
  }, function(err, result)
    if err then
      settle(err)
      return
    end
    S.init_result = result
    client:notify('initialized', vim.empty_dict())
    if #specs == 0 then
      settle(nil)
      return
    end
    client:request('registerClientTools', { tools = specs }, function(rerr)
      if rerr then
        notify('registerClientTools failed: ' .. tostring(rerr.message), vim.log.levels.WARN)
      end
      settle(nil)
    end)
  end)
end

--- Run fn(err) once the server is ready (starting it when auto_start is on).
function M.when_ready(fn)
  if S.ready then
    fn(nil)
  elseif going_away() then
    S.after_exit[#S.after_exit + 1] = function()
      M.when_ready(fn)
    end
  elseif S.client then
    S.queue[#S.queue + 1] = fn
  elseif M.config.auto_start then
    M.start(function(err)
      fn(err)
    end)
  else
    fn({ code = rpc.codes.not_running, message = 'operate-sidecar is not running (:OperateStart)' })
  end
end

--- Block (processing events) until the server is ready or timeout_ms passes. Returns ready.
function M.wait_ready(timeout_ms)
  return vim.wait(timeout_ms or M.config.request_timeout, function()
    return S.ready or (S.client == nil)
  end, 10) and S.ready
end

--- Shut the server down (shutdown + exit; killed if it lingers). cb() runs once it is gone.
function M.stop(cb)
  local c = S.client
  if not c then
    if cb then
      cb()
    end
    return
  end
  if cb then
    S.after_exit[#S.after_exit + 1] = cb
  end
  if S.stopping then
    return
  end
  S.stopping, S.ready = true, false
  local gone = false
  local prev_exit = c.opts.on_exit
  c.opts.on_exit = function(code, signal)
    gone = true
    prev_exit(code, signal)
  end
  c:request('shutdown', nil, function()
    c:notify('exit')
    c:close_stdin()
  end)
  vim.defer_fn(function()
    if not gone then
      c:kill(9)
    end
  end, 3000)
end

function M.is_running()
  return S.client ~= nil and S.client:is_running()
end

function M.status()
  return {
    running = M.is_running(),
    ready = S.ready,
    pid = S.client and S.client.pid or nil,
    branch = M.current_branch(),
    operating = S.running ~= nil,
    phase = S.progress.phase,
    exit = S.exit,
    stateDir = S.init_result and S.init_result.capabilities and S.init_result.capabilities.stateDir or nil,
  }
end

--- Send any request once ready: cb(err, result).
function M.request(method, params, cb)
  cb = cb or function() end
  M.when_ready(function(err)
    if err then
      cb(err, nil)
      return
    end
    S.client:request(method, params, cb)
  end)
end

--- Synchronous form of M.request (waits at most timeout_ms). Returns result, err.
function M.request_sync(method, params, timeout_ms)
  local done, res, rerr = false, nil, nil
  M.request(method, params, function(err, result)
    done, res, rerr = true, result, err
  end)
  if not vim.wait(timeout_ms or M.config.request_timeout, function()
    return done
  end, 10) then
    return nil, { code = rpc.codes.timeout, message = method .. ' timed out' }
  end
  return res, rerr
end

-- M.request for the commands below: a failure is notified and passed on as cb(err); on_result(res)
-- handles a success.
local function request_or_notify(method, params, cb, on_result)
  M.request(method, params, function(err, res)
    if err then
      notify(method .. ' failed: ' .. tostring(err.message), vim.log.levels.ERROR)
      return cb(err)
    end
    on_result(res)
  end)
end

-- ---------------------------------------------------------------- branches

local function branch_key()
  if M.config.branch_scope == 'global' then
    return nil
  end
  return api.nvim_get_current_tabpage()
end

function M.current_branch()
  local k = branch_key()
  if k == nil then
    return S.branches.global
  end
  return S.branches.tab[k]
end

function M.set_branch(id, key)
  local k = key or branch_key()
  if k == nil then
    S.branches.global = id
  else
    S.branches.tab[k] = id
  end
  event('OperateSidecarBranch')
end

-- createBranch / forkBranch, then make the new branch current. cb(err, branchId).
local function request_new_branch(method, params, cb)
  local key = branch_key() -- the tab that asked, even if another is current when the answer comes
  request_or_notify(method, params, cb, function(res)
    M.set_branch(res.branchId, key)
    cb(nil, res.branchId)
  end)
end

--- Create a branch and make it current. cb(err, branchId).
function M.branch_new(cb, params)
  request_new_branch('createBranch', as_object(vim.deepcopy(params or M.config.branch)), cb or function() end)
end

--- Fork the current branch (or `id`) and make the fork current. cb(err, branchId).
function M.branch_fork(cb, id)
  cb = cb or function() end
  id = id or M.current_branch()
  if not id then
    M.branch_new(cb)
    return
  end
  request_new_branch('forkBranch', { branchId = id }, cb)
end

--- List branches; notifies a summary. cb(err, branches).
function M.branch_list(cb)
  cb = cb or function() end
  request_or_notify('listBranches', nil, cb, function(res)
    local cur = M.current_branch()
    local lines = {}
    for _, b in ipairs(res.branches) do
      lines[#lines + 1] = ('%s %s %s (%d messages, %s)'):format(b.branchId == cur and '*' or ' ', b.branchId,
        is_null(b.name) and '' or b.name, b.messageCount or 0, is_null(b.chatModel) and 'default model' or
        tostring(b.chatModel))
    end
    notify(#lines > 0 and ('branches:\n' .. table.concat(lines, '\n')) or 'no branches')
    cb(nil, res.branches)
  end)
end

local function forget_branch(id)
  if S.branches.global == id then
    S.branches.global = nil
  end
  for k, v in pairs(S.branches.tab) do
    if v == id then
      S.branches.tab[k] = nil
    end
  end
end

local function ensure_branch(cb)
  local id = M.current_branch()
  if id then
    cb(nil, id)
  else
    M.branch_new(cb)
  end
end

-- ---------------------------------------------------------------- operate

local function render_result(err, result)
  if err then
    if err.code == rpc.codes.cancelled then
      out_lines({ '--- cancelled ---' })
    else
      local lines = { ('--- error %s: %s ---'):format(tostring(err.code), tostring(err.message)) }
      if not is_null(err.data) then
        vim.list_extend(lines, M.pretty(err.data))
      end
      out_lines(lines)
    end
    return
  end
  local kind = type(result) == 'table' and result.kind or '?'
  local header = ('--- result (%s%s) ---'):format(tostring(kind),
    (type(result) == 'table' and not is_null(result.model)) and (': ' .. tostring(result.model)) or '')
  local lines = { header }
  if kind == 'text' and type(result.result) == 'string' then
    vim.list_extend(lines, split_lines(result.result))
  else
    vim.list_extend(lines, M.pretty(type(result) == 'table' and result.result or result))
  end
  out_lines(lines)
end

--- Run `operate` (PROTOCOL §5) on the current branch. params: the operate params (branchId
--- defaults to the current branch; a workDoneToken is added). on_done(err, result).
function M.operate(params, on_done)
  on_done = on_done or function() end
  params = vim.tbl_extend('keep', vim.deepcopy(params or {}), vim.deepcopy(M.config.operate_defaults or {}))
  if S.running then
    local err = { code = -32600, message = 'an operate is already running (:OperateCancel)' }
    notify(err.message, vim.log.levels.WARN)
    vim.schedule(function()
      on_done(err, nil)
    end)
    return
  end
  S.seq = S.seq + 1
  local instruction = params.instruction
  if instruction == nil and type(params.instruct) == 'table' then
    instruction = params.instruct.instruction
  end
  local run = { token = params.workDoneToken or ('nvim-' .. S.seq), instruction = instruction, deltas = {} }
  params.workDoneToken = run.token
  S.running = run
  S.progress = {}
  if M.config.open_output then
    show(M.output_buf())
  end
  out_lines({ ('## operate: %s'):format(is_null(instruction) and '(no instruction)' or tostring(instruction)) })

  local function finish(err, result)
    if S.running == run then
      S.running = nil
    end
    S.last = { err = err, result = result, deltas = run.deltas, branchId = run.branchId }
    render_result(err, result)
    if err and err.code ~= rpc.codes.cancelled then
      notify('operate failed: ' .. tostring(err.message), vim.log.levels.WARN)
    elseif err then
      notify('operate cancelled')
    end
    event('OperateSidecarDone')
    on_done(err, result)
  end

  local implicit = params.branchId == nil
  local send
  local function with_current_branch()
    ensure_branch(function(berr, bid)
      if berr then
        return finish(berr)
      end
      send(bid)
    end)
  end
  send = function(bid)
    if run.cancel_requested then
      return finish({ code = rpc.codes.cancelled, message = 'cancelled before it was sent' })
    end
    params.branchId = params.branchId or bid
    run.branchId = params.branchId
    run.client = S.client
    run.id = S.client:request('operate', params, function(err, result)
      -- The current branch is gone (a server restarted without its journal): use a new one, once.
      if err and err.code == -32012 and implicit and not run.retried and not run.cancel_requested then
        run.retried = true
        forget_branch(params.branchId)
        notify(('branch %s is unknown to the server; using a new branch'):format(params.branchId),
          vim.log.levels.WARN)
        params.branchId = nil
        return with_current_branch()
      end
      finish(err, result)
    end)
  end

  M.when_ready(function(err)
    if err then
      return finish(err)
    end
    if params.branchId then
      send(params.branchId)
    else
      with_current_branch()
    end
  end)
end

--- Cancel the running operate ($/cancelRequest). Returns false when nothing runs.
function M.cancel()
  local run = S.running
  if not run then
    notify('nothing to cancel')
    return false
  end
  run.cancel_requested = true
  if run.id and run.client then
    run.client:cancel(run.id)
  end
  return true
end

-- ---------------------------------------------------------------- views

--- Show the branch's messages in operate://messages. cb(err, messages).
function M.show_messages(cb, id)
  cb = cb or function() end
  id = id or M.current_branch()
  if not id then
    notify('no current branch', vim.log.levels.WARN)
    cb({ code = -32012, message = 'no current branch' })
    return
  end
  request_or_notify('branchMessages', { branchId = id }, cb, function(res)
    local lines = { ('# branch %s: %d messages'):format(id, res.total or #res.messages) }
    for _, m in ipairs(res.messages) do
      lines[#lines + 1] = ''
      lines[#lines + 1] = ('## %s (%s) %s -> %s'):format(tostring(m.kind), tostring(m.role), tostring(m.sender),
        tostring(m.recipient))
      local c = m.content
      if type(c) == 'table' and (m.kind == 'system' or m.kind == 'assistant_response') and type(c.text) == 'string' then
        vim.list_extend(lines, split_lines(c.text))
      elseif type(c) == 'table' and m.kind == 'instruction' and type(c.instruction) == 'string'
        and is_null(c.context) and is_null(c.guidance) then
        vim.list_extend(lines, split_lines(c.instruction))
      else
        for _, l in ipairs(M.pretty(c)) do
          vim.list_extend(lines, split_lines(l))
        end
      end
    end
    show(set_buf(M.MESSAGES, lines))
    cb(nil, res.messages)
  end)
end

--- Show the tools and the policy in force (for the current branch) in operate://tools.
function M.show_tools(cb)
  cb = cb or function() end
  local bid = M.current_branch()
  request_or_notify('listTools', bid and { branchId = bid } or nil, cb, function(res)
    local lines = { ('# tools (policy for %s)'):format(bid and ('branch ' .. bid) or 'the server') }
    for _, t in ipairs(res.tools) do
      local desc = is_null(t.description) and '' or tostring(t.description):gsub('\n.*', '')
      lines[#lines + 1] = ('%-24s %-8s %-6s %s'):format(t.name, tostring(t.source), tostring(t.policy), desc)
    end
    show(set_buf(M.TOOLS, lines))
    cb(nil, res.tools)
  end)
end

--- Set a tool's policy (allow|deny|ask) for the current branch, or server-wide if none / global.
function M.authorize(tool, decision, cb, global)
  cb = cb or function() end
  local params = { tool = tool, decision = decision }
  if not global then
    params.branchId = M.current_branch()
  end
  request_or_notify('authorizeTool', params, cb, function(res)
    notify(('%s: %s (%s)'):format(res.tool, res.decision, is_null(res.branchId) and 'server-wide' or res.branchId))
    cb(nil, res)
  end)
end

-- ---------------------------------------------------------------- commands

--- The text of a command range: the visual selection (charwise when it was `v`), else lines.
function M.range_text(line1, line2)
  local s, e = vim.fn.getpos("'<"), vim.fn.getpos("'>")
  if vim.fn.visualmode() == 'v' and s[2] == line1 and e[2] == line2 and s[2] > 0 then
    local lines = api.nvim_buf_get_lines(0, line1 - 1, line2, false)
    local last = lines[#lines] or ''
    local ecol = math.min(e[3], #last)
    ecol = ecol + math.max(#vim.fn.matchstr(last:sub(ecol), '^.') - 1, 0) -- whole last character
    lines[#lines] = last:sub(1, ecol)
    lines[1] = lines[1]:sub(s[3])
    return table.concat(lines, '\n')
  end
  return table.concat(api.nvim_buf_get_lines(0, line1 - 1, line2, false), '\n')
end

--- :Operate {instruction} (with a range: the selection is the `context`).
function M.command_operate(opts)
  local function run(instruction)
    if not instruction or instruction == '' then
      return
    end
    local params = { instruction = instruction }
    if opts.range and opts.range > 0 then
      params.context = M.range_text(opts.line1, opts.line2)
    end
    M.operate(params)
  end
  if opts.args and opts.args ~= '' then
    run(opts.args)
  else
    vim.ui.input({ prompt = 'Instruction: ' }, run)
  end
end

function M.command_branch(opts)
  local sub = opts.fargs[1] or 'list'
  if sub == 'new' then
    M.branch_new(function(err, id)
      if not err then
        notify('new branch ' .. id)
      end
    end)
  elseif sub == 'fork' then
    M.branch_fork(function(err, id)
      if not err then
        notify('forked into ' .. id)
      end
    end)
  elseif sub == 'list' then
    M.branch_list()
  else
    M.set_branch(sub) -- an id: make it current
    notify('current branch ' .. sub)
  end
end

function M.command_tools(opts)
  if #opts.fargs >= 2 then
    M.authorize(opts.fargs[1], opts.fargs[2], nil, opts.fargs[3] == 'global')
  else
    M.show_tools()
  end
end

return M
