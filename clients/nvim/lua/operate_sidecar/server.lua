-- The server process: start (initialize, client tools), stop, requests, and `operate` with its
-- progress, tool events and cancellation. Views subscribe through the `on_*` hooks of operate().
local rpc = require('operate_sidecar.rpc')
local config = require('operate_sidecar.config')
local util = require('operate_sidecar.util')

local api = vim.api
local is_null, notify, event = util.is_null, util.notify, util.event

local M = {}
M.version = '0.2.0'

local S = {
  client = nil,
  ready = false,
  init_result = nil,
  queue = {},
  branches = { global = nil, tab = {} },
  running = nil, -- {id?, token, instruction, deltas, cancel_requested, hooks}
  seq = 0,
  tool_events = {},
  progress = {},
  last = nil, -- {err, result, deltas, branchId} of the last operate
  exit = nil, -- {code, signal, stopped, abnormal, failure, starting, printed} of the last server exit
  log = nil, -- {path, start}: the log file of the last server process and where its lines start
  tools = {}, -- client tools by name
  stopping = false,
  after_exit = {}, -- run once the current server process is gone
}
M.state = S

function M.default_state_dir()
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

function M.default_log_file()
  return vim.fn.stdpath('cache') .. '/operate-sidecar.log'
end

function M.log_file()
  return config.values.log_file or M.default_log_file()
end

--- What is wrong with `cmd_cwd` (the server's working directory), or nil: "cmd_cwd ... does not
--- exist" / "is not a directory".
function M.cmd_cwd_problem(cwd)
  if type(cwd) ~= 'string' then
    return nil
  end
  local st = (vim.uv or vim.loop).fs_stat(cwd)
  if not st then
    return ('cmd_cwd %s (the server\'s working directory) does not exist'):format(cwd)
  elseif st.type ~= 'directory' then
    return ('cmd_cwd %s (the server\'s working directory) is not a directory'):format(cwd)
  end
  return nil
end

-- ---------------------------------------------------------------- server → client

local levels = { vim.log.levels.ERROR, vim.log.levels.WARN, vim.log.levels.INFO, vim.log.levels.DEBUG }

local function hook(run, name, ...)
  local f = run and run.hooks and run.hooks[name]
  if f then
    local ok, err = pcall(f, ...)
    if not ok then
      notify(name .. ' failed: ' .. tostring(err), vim.log.levels.ERROR)
    end
  end
end

local function on_progress(p)
  local run = S.running
  local v = type(p) == 'table' and p.value or nil
  if type(v) ~= 'table' or not run or p.token ~= run.token then
    return
  end
  if v.kind == 'begin' then
    S.progress = { phase = 'begin', message = v.message }
  elseif v.kind == 'report' then
    if type(v.delta) == 'string' and v.delta ~= '' then -- (text: a delta of another type is not the reply's)
      run.deltas[#run.deltas + 1] = v.delta
      hook(run, 'on_delta', v.delta, run)
      event('OperateSidecarDelta')
    end
    -- a `stream` report "thinking" with no delta: a reasoning model thinks before it writes (the
    -- text of its thoughts in more such reports, as `thought`: this client announces `thoughts`);
    -- this client calls that phase `thinking`
    if type(v.thought) == 'string' and v.thought ~= '' then
      hook(run, 'on_thought', v.thought, run)
    end
    local phase = v.phase
    if phase == 'stream' and v.message == 'thinking' and (type(v.delta) ~= 'string' or v.delta == '') then
      phase = 'thinking'
    end
    -- a new phase, or a new step of one (`parse`: "parsing reply", then "repair attempt N" before
    -- each repair turn); not each streamed piece
    if phase ~= S.progress.phase or (phase ~= 'stream' and v.message ~= S.progress.message) then
      S.progress = { phase = phase, message = v.message }
      hook(run, 'on_phase', phase, run, v.message)
    end
  elseif v.kind == 'end' then
    S.progress = { phase = 'end', message = v.message }
    if type(v.usage) == 'table' then
      run.usage = v.usage
    end
  end
  event('OperateSidecarProgress')
end

local function on_tool_event(e)
  if type(e) ~= 'table' then
    return
  end
  S.tool_events[#S.tool_events + 1] = e
  if e.event == 'post' then
    require('operate_sidecar.fs').refresh() -- the tool may have written a file that a buffer shows
  end
  local run = S.running
  if run and (e.branchId == run.branchId) then
    hook(run, 'on_tool_event', e, run)
  else
    require('operate_sidecar.chat').on_tool_event(e) -- an event of some other branch's chat
  end
  event('OperateSidecarToolEvent')
end

-- An error answer with id null: the server could not read a message the editor sent (docs/PROTOCOL.md
-- §1: -32700, not JSON; -32600, not a request). Which one is unknown (a request, an answer to
-- one of the server's, a notification), so no request is failed on a guess; the user is told,
-- and a running turn is marked: if its own request was the one, the server never answers it, so
-- a cancel ends it here (M.cancel) when the server does not answer the cancel.
local function on_stray_error(err)
  local run = S.running
  if run then
    run.stray = true
  end
  local msg = type(err.message) == 'string' and err.message ~= '' and err.message or ('error ' .. tostring(err.code))
  notify(('the server could not read a message from the editor (%s)%s'):format(msg,
    run and '; if the turn does not go on, <C-c> in the chat (:OperateCancel) ends it' or ''), vim.log.levels.WARN)
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

local function on_invoke_client_tool(params, reply)
  local tool = S.tools[params.tool]
  if not tool then
    reply(nil, { code = -32601, message = 'unknown client tool: ' .. tostring(params.tool) })
    return
  end
  local args = is_null(params.arguments) and {} or params.arguments
  local ok, out = pcall(tool.handler, args, params)
  if not ok then
    return reply(nil, { code = -32603, message = tostring(out) })
  end
  -- an empty table returned is an empty object (`{}`): the likelier meaning of a tool's output
  out = is_null(out) and vim.NIL or util.as_object(out)
  -- what JSON cannot hold (a function, a sparse list, NaN) is the tool's error, as a throw is
  local sendable, why = pcall(vim.json.encode, out)
  if not sendable then
    return reply(nil, { code = -32603, message = ('the client tool %s returned what cannot be sent as JSON: %s'):format(
      tostring(params.tool), tostring(why)) })
  end
  reply({ output = out })
end

-- ---------------------------------------------------------------- client tools

local function builtin_tools()
  return {
    {
      name = 'nvim_buffer_text',
      description = 'The text of a buffer open in Neovim: the current buffer, or the loaded buffer whose name ends with `path`.',
      inputSchema = { type = 'object', properties = { path = { type = 'string' } } },
      handler = function(args)
        local b = require('operate_sidecar.context').source_buf()
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
            error('no loaded buffer named ' .. args.path, 0) -- (level 0: no source position)
          end
        end
        local text = table.concat(api.nvim_buf_get_lines(b, 0, -1, false), '\n')
        if util.utf8_error(text) then -- (it could not be sent: the server reads UTF-8 only)
          error(('the buffer %s is not UTF-8 text'):format(util.display_path(api.nvim_buf_get_name(b))), 0)
        end
        return { name = api.nvim_buf_get_name(b), text = text }
      end,
    },
  }
end

local function collect_tools()
  local list = {}
  if config.values.builtin_client_tools then
    vim.list_extend(list, builtin_tools())
  end
  vim.list_extend(list, config.values.client_tools or {})
  S.tools = {}
  local specs = {}
  for _, t in ipairs(list) do
    S.tools[t.name] = t
    specs[#specs + 1] = { name = t.name, description = t.description or '',
      inputSchema = util.as_object(util.as_schema(t.inputSchema)) }
  end
  return specs
end

-- ---------------------------------------------------------------- lifecycle

--- The server's state directory (its journal) as configured, or nil when it keeps none
--- (state_dir = false, or settings.stateDir = vim.NIL).
function M.state_dir()
  local s = config.values.settings or {}
  if type(s.stateDir) == 'string' then
    return s.stateDir
  elseif s.stateDir ~= nil or config.values.state_dir == false then
    return nil
  end
  return config.values.state_dir or M.default_state_dir()
end

local function init_settings()
  local s = util.copy(config.values.settings or {})
  if s.stateDir == nil then
    s.stateDir = M.state_dir() or vim.NIL
  end
  for _, k in ipairs({ 'models', 'toolPolicy', 'mcpServers' }) do
    if s[k] ~= nil then
      s[k] = util.as_object(s[k])
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

--- The last n lines the last server process wrote to the log (never an earlier session's).
local function last_log_lines(n)
  local log = S.log or { path = M.log_file(), start = 0 }
  local f = io.open(log.path, 'r')
  if not f then
    return {}
  end
  local size = f:seek('end') or 0
  -- a file shorter than the offset was truncated (or rotated) since: read all of it
  f:seek('set', (log.start or 0) <= size and (log.start or 0) or 0)
  local lines = {}
  for l in f:lines() do
    lines[#lines + 1] = l
    if #lines > n then
      table.remove(lines, 1)
    end
  end
  f:close()
  return lines
end
M.last_log_lines = last_log_lines

--- How a process ended, for messages: "exited with code 3", "was killed by signal 9 (SIGKILL)".
M.describe_exit = rpc.describe_exit

-- The last n lines (each cut to LINE_CHARS characters) of what the process wrote on stdout that
-- is not a message (the rest after its last frame): a `cmd` that is not the server (or prints
-- its usage) writes its words there, not in the log.
local LINE_CHARS = 300
local function unframed_lines(client, n)
  local lines, rest = {}, client.buf or ''
  if rest:lower():find('^content%-length:') then
    return lines -- (a message cut short when it ended: not words of its own)
  end
  for _, l in ipairs(util.split_lines(rest)) do
    l = l:gsub('%s+$', '')
    if l ~= '' then
      lines[#lines + 1] = util.nchars(l) > LINE_CHARS and (util.first_chars(l, LINE_CHARS) .. '…') or l
      if #lines > n then
        table.remove(lines, 1)
      end
    end
  end
  return lines
end

local function on_exit(client, code, signal)
  if S.client ~= client then
    return
  end
  local was_ready = S.ready
  S.client, S.ready = nil, false
  -- stopped: we asked for it (:OperateStop, or a failed start killed); abnormal: anything else
  -- but a clean exit (a non-zero code, or a signal: libuv then reports code 0); failure: why a
  -- start that failed was killed (a timeout, an error answer), unless :OperateStop came first
  -- starting: it ended by itself before it was ready, a failed start even with code 0 (a `cmd`
  -- that prints its usage and exits, say)
  local stopped = S.stopping or client.killed_on_purpose == true
  local starting = not stopped and not was_ready
  local abnormal = not stopped and (code ~= 0 or (signal ~= nil and signal ~= 0) or starting)
  local failure = not S.stopping and client.start_failure or nil
  S.exit = { code = code, signal = signal, stopped = stopped, abnormal = abnormal, failure = failure,
    starting = starting }
  local journaled = S.init_result and S.init_result.capabilities
    and not is_null(S.init_result.capabilities.stateDir)
  if not journaled then
    S.branches = { global = nil, tab = {} } -- those branches are gone with the process
  end
  flush_queue({ code = rpc.codes.server_exited, message = 'operate-sidecar exited during start-up' })
  require('operate_sidecar.permission').server_gone()
  -- the one message of this end: the requests and the turn it ended are not notified (util.told_by_exit)
  local run = S.running
  S.exit.printed = unframed_lines(client, was_ready and 3 or 8)
  notify(util.exit_notice(S.exit, { starting = not was_ready,
    turn = client.ended_turn or (run ~= nil and run.client == client),
    tail = (abnormal or failure) and last_log_lines(was_ready and 3 or 8) or nil,
    printed = (abnormal or failure) and S.exit.printed or nil }))
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

-- quiet: the caller reports a failure to start (cb gets it), so it is not notified here too.
local function start(cb, quiet)
  cb = cb or function() end
  if S.ready then
    cb(nil, S.init_result)
    return
  end
  if going_away() then
    S.after_exit[#S.after_exit + 1] = function()
      start(cb, quiet)
    end
    return
  end
  local function when_started(err)
    cb(err, S.init_result)
  end
  if S.client then
    S.queue[#S.queue + 1] = when_started
    return
  end
  local cfg = config.values
  local permission, fs = require('operate_sidecar.permission'), require('operate_sidecar.fs')
  -- what initialize sends, made before the process is (a value of the wrong type set by hand
  -- after setup() fails the start here, with why, not a start that never sends initialize)
  local why = config.check(cfg)
  local made, specs, settings = pcall(function()
    if why then
      error('the configuration cannot be used: ' .. why, 0)
    end
    return collect_tools(), init_settings()
  end)
  local function failed(msg, code) -- the start failed before the process ran: said once, and answered
    if not quiet then
      notify(msg, vim.log.levels.ERROR)
    end
    cb({ code = code, message = msg })
  end
  if not made then
    failed('cannot start the server: ' .. tostring(specs), rpc.codes.client_failed)
    return
  end
  local cwd_why = M.cmd_cwd_problem(cfg.cmd_cwd) -- (the spawn would blame the command: ENOENT)
  if cwd_why then
    failed('cannot start the server: ' .. cwd_why, rpc.codes.not_running)
    return
  end
  local ok, client = pcall(function()
    local c
    c = rpc.start({
      cmd = cfg.cmd,
      cwd = cfg.cmd_cwd,
      env = cfg.cmd_env,
      log_file = M.log_file(),
      on_notification = on_notification,
      handlers = {
        requestToolPermission = permission.on_request,
        invokeClientTool = on_invoke_client_tool,
        ['fs/readTextFile'] = fs.on_read,
        ['fs/writeTextFile'] = fs.on_write,
      },
      on_server_cancel = function(id)
        permission.on_server_cancel(id)
      end,
      on_stray_error = on_stray_error,
      on_exit = function(code, signal)
        on_exit(c, code, signal)
      end,
    })
    return c
  end)
  if not ok then
    failed(tostring(client), rpc.codes.not_running)
    return
  end
  S.client, S.ready, S.init_result, S.exit = client, false, nil, nil
  S.log = { path = M.log_file(), start = client.log_start or 0 }
  if client.log_error then
    notify(('log_file %s cannot be written (%s): the server runs without its log'):format(M.log_file(),
      vim.trim(client.log_error)), vim.log.levels.WARN)
  end
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
      if err.code == rpc.codes.server_exited then -- (as its exit notice says it: util.exit_notice)
        err = util.copy(err)
        err.message = err.message .. ' before it was ready'
      end
      if client.exited then -- (one that died by itself is reported as such by on_exit)
        if not quiet then
          util.notify_failure(util.error_message('cannot start the server', err), err, vim.log.levels.ERROR)
        end
      else
        -- killed over err: its exit notice (util.exit_notice) is the one message of this failure,
        -- and says why; the callers waiting for the start say nothing (util.told_by_exit)
        err = util.copy(err)
        err.server_stopped = true
        client.start_failure = err
        client.killed_on_purpose = true
        client:kill(9) -- on_exit then forgets this client
      end
      flush_queue(err)
      return
    end
    S.ready = true
    event('OperateSidecarReady')
    flush_queue(nil)
  end
  timer:start(cfg.request_timeout, 0, vim.schedule_wrap(function()
    if S.stopping and S.client == client then
      return -- (:OperateStop came first: its kill ends the start, and its notice is the one message)
    end
    settle({ code = rpc.codes.timeout, timeout_ms = cfg.request_timeout,
      message = ('initialize: no answer within %d ms'):format(cfg.request_timeout) })
  end))

  client:request('initialize', {
    protocolVersion = 1,
    clientInfo = { name = 'operate-sidecar.nvim', version = M.version },
    processId = vim.fn.getpid(),
    capabilities = { toolPermission = true, clientTools = true, fs = cfg.fs and true or false, thoughts = true },
    workspaceFolders = { vim.fn.getcwd() },
    settings = settings,
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
      -- (refused because :OperateStop came meanwhile, or the server is gone: that end's notice is the one message)
      if rerr and S.client == client and not S.stopping then
        util.notify_failure(util.error_message('the editor\'s tools (client_tools) were not added', rerr), rerr,
          vim.log.levels.WARN)
      end
      settle(nil)
    end)
  end)
end

--- Start the server and initialize it. cb(err, initialize_result) runs once it is ready. A
--- failure to start is notified (and passed to cb).
function M.start(cb)
  start(cb, false)
end

--- Run fn(err) once the server is ready (starting it when auto_start is on). A failure to start
--- is only passed to fn (the caller reports it, once).
function M.when_ready(fn)
  if going_away() then -- (first: a server that just died may not be marked so yet)
    S.after_exit[#S.after_exit + 1] = function()
      M.when_ready(fn)
    end
  elseif S.ready then
    fn(nil)
  elseif S.client then
    S.queue[#S.queue + 1] = fn
  elseif config.values.auto_start then
    start(function(err)
      fn(err)
    end, true)
  else
    fn({ code = rpc.codes.not_running, message = 'operate-sidecar is not running (:OperateStart)' })
  end
end

--- Block (processing events) until the server is ready or timeout_ms passes. Returns ready.
function M.wait_ready(timeout_ms)
  return vim.wait(timeout_ms or config.values.request_timeout, function()
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

--- Does the server process go on serving? cb(true) once it answers a ping; cb(false, err) if it
--- ends first (err: rpc.exit_error, how it ended; nil without a process). A server stopping by
--- itself (a SIGTERM) reads no more requests, so its ping is answered only by its exit. One
--- that neither answers nor ends within EXIT_WAIT_MS is taken to go on. Starts no server.
function M.probe(cb)
  local c, settled = S.client, false
  local function once(serving, err)
    if not settled then
      settled = true
      cb(serving, err)
    end
  end
  if not c then
    return vim.schedule(function()
      once(false, nil)
    end)
  end
  c:request('ping', nil, function(err)
    if err and err.code == rpc.codes.not_running then -- (gone already: how, once its exit is known)
      return c:when_exited(function(code, signal)
        once(false, rpc.exit_error(code, signal))
      end)
    end
    once(err == nil, err)
  end)
  vim.defer_fn(function()
    once(true)
  end, M.EXIT_WAIT_MS)
end

function M.models()
  local caps = S.init_result and S.init_result.capabilities
  if caps and type(caps.models) == 'table' then
    return caps.models
  end
  local names = vim.tbl_keys((config.values.settings or {}).models or {})
  table.sort(names)
  return names
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
  if not vim.wait(timeout_ms or config.values.request_timeout, function()
    return done
  end, 10) then
    return nil, { code = rpc.codes.timeout, message = method .. ' timed out' }
  end
  return res, rerr
end

-- what could not be done, per request, as the user asked for it (not the wire method's name)
M.CANNOT = {
  createBranch = 'cannot start a branch',
  forkBranch = 'cannot fork the branch (:OperateBranch fork)',
  deleteBranch = 'cannot delete the branch (:OperateBranch delete)',
  listBranches = 'cannot list the branches',
  listTools = 'cannot list the tools (:OperateTools)',
  authorizeTool = 'cannot set the tool\'s policy (:OperateTools)',
  branchMessages = 'cannot read the branch\'s messages',
}

--- M.request where a failure is notified (in plain words: util.error_message) and passed on as
--- cb(err), err marked `notified` (so that a turn it ends does not say it again); on_result(res)
--- handles success.
function M.request_or_notify(method, params, cb, on_result)
  M.request(method, params, function(err, res)
    if err then
      util.notify_failure(util.error_message(M.CANNOT[method] or ('cannot ' .. method), err), err,
        vim.log.levels.ERROR)
      if type(err) == 'table' then -- (a copy: one failed start's error may reach other callers too)
        err = util.copy(err)
        err.notified = true
      end
      return cb(err)
    end
    on_result(res)
  end)
end

-- ---------------------------------------------------------------- operate

-- how long a turn the server cancelled by itself waits for the server's exit (see operate), and
-- a card whose request the server stopped waiting for, for its answer to a ping (see probe)
M.EXIT_WAIT_MS = 5000
-- how long a cancel of a turn that may never be answered (see on_stray_error) waits for the
-- server's answer before the turn is ended here
M.CANCEL_WAIT_MS = 3000

--- Run `operate`. params: the operate params (branchId defaults to the current branch; a
--- workDoneToken is added). hooks: {on_start(run), on_delta(delta, run), on_thought(text, run)
--- (a reasoning model's thoughts), on_phase(phase, run, message) (a new phase, or a new message of
--- one other than `stream`), on_tool_event(e, run)}.
--- on_done(err, result, run). One notification tells how it ended (ended by the server's end:
--- that end's notice, util.exit_notice).
local operate -- (below: M.operate runs it, guarded)

function M.operate(params, on_done, hooks)
  on_done = on_done or function() end
  local run
  -- Something that throws while the turn starts (a configuration value of the wrong type, set
  -- by hand after setup(), say) ends the turn with the error shown: never a turn left running
  -- that blocks every later one.
  local function failed(err)
    local e = { code = rpc.codes.client_failed, message = 'the editor could not start the turn: ' .. tostring(err) }
    if run and run.finish then
      return run.finish(e)
    end
    if run and S.running == run then
      S.running = nil
    end
    notify('the turn did not finish: ' .. e.message, vim.log.levels.ERROR)
    e.notified = true
    S.last = { err = e, deltas = {} }
    vim.schedule(function()
      on_done(e, nil, run)
      event('OperateSidecarDone')
    end)
  end
  local why = config.check(config.values) -- (values set by hand after setup(): said plainly)
  if why then
    failed('the configuration cannot be used: ' .. why)
    return nil
  end
  local ok, res = pcall(function()
    return operate(params, on_done, hooks, failed, function(r)
      run = r
    end)
  end)
  if not ok then
    failed(res)
    return run
  end
  return res
end

operate = function(params, on_done, hooks, failed, made)
  local branches = require('operate_sidecar.branches')
  params = vim.tbl_extend('keep', util.copy(params or {}), util.copy(config.values.operate_defaults or {}))
  if type(params.responseFormat) == 'table' then -- (`properties = {}` sent as an object: util.as_schema)
    params.responseFormat = util.as_schema(params.responseFormat)
  end
  if S.running then
    local err = { code = -32600, message = 'an operate is already running (:OperateCancel)' }
    notify(err.message, vim.log.levels.WARN)
    vim.schedule(function()
      on_done(err, nil, nil)
    end)
    return
  end
  S.seq = S.seq + 1
  local instruction = params.instruction
  if instruction == nil and type(params.instruct) == 'table' then
    instruction = params.instruct.instruction
  end
  local run = { token = params.workDoneToken or ('nvim-' .. S.seq), instruction = instruction, deltas = {},
    hooks = hooks or {}, started = (vim.uv or vim.loop).hrtime() }
  params.workDoneToken = run.token
  S.running = run
  made(run)
  -- fn as a callback whose error ends the turn (see M.operate)
  local function guarded(fn)
    return function(...)
      local ok, err = pcall(fn, ...)
      if not ok then
        failed(err)
      end
    end
  end
  S.progress = {}
  event('OperateSidecarRunning')

  local function finish(err, result)
    if S.running == run then
      S.running = nil
    end
    run.elapsed_ms = ((vim.uv or vim.loop).hrtime() - run.started) / 1e6
    if type(result) == 'table' and type(result.usage) == 'table' then
      run.usage = result.usage
    end
    S.last = { err = err, result = result, deltas = run.deltas, branchId = run.branchId, usage = run.usage }
    local secs = ('%.1f s'):format(run.elapsed_ms / 1000)
    if err and err.code == rpc.codes.cancelled and S.stopping then -- (by :OperateStop: its notice is the one message)
    elseif err and err.code == rpc.codes.cancelled then
      notify('cancelled')
    elseif util.told_by_exit(err) then -- (the server's exit notice says it, and that this turn ended)
      local c = run.client or S.client
      if c then
        c.ended_turn = true
      end
    elseif err and err.notified then -- (said already: a branch that could not be made, say)
    elseif err then
      local hint = err.code == rpc.codes.model_error and '; R in the chat (:OperateRetry) sends it again' or ''
      notify('the turn did not finish: ' .. util.error_text(err) .. hint,
        err.code == rpc.codes.client_failed and vim.log.levels.ERROR or vim.log.levels.WARN)
    else
      notify('done · ' .. secs)
    end
    on_done(err, result, run)
    event('OperateSidecarDone')
  end
  run.finish = function(err, result)
    if not run.finished then
      run.finished = true
      finish(err, result)
    end
  end

  -- The server cancelled the turn by itself (nobody here asked): it is going away (a SIGTERM, its
  -- parent gone ...). The turn ends with how it ended, as when it dies without a word, once it
  -- has exited (at most EXIT_WAIT_MS later; a server that stays is taken at its word).
  local function finish_or_wait_exit(err, result)
    local c = run.client
    if not (err and err.code == rpc.codes.cancelled and not run.cancel_requested and not S.stopping and c) then
      return run.finish(err, result)
    end
    local once = run.finish
    c:when_exited(function(code, signal)
      once(rpc.exit_error(code, signal))
    end)
    vim.defer_fn(function()
      once(err, result)
    end, M.EXIT_WAIT_MS)
  end

  -- implicit: the caller means "the current branch" (a forgotten one is replaced, once)
  local implicit = params.branchId == nil or (hooks and hooks.implicit)
  local tab = branches.key() -- (the tab page it was sent from: the server may start meanwhile)
  local send
  local function with_current_branch()
    branches.ensure(guarded(function(berr, bid)
      if berr then
        return run.finish(berr)
      end
      send(bid)
    end), instruction, tab)
  end
  send = function(bid)
    if run.cancel_requested then
      return run.finish({ code = rpc.codes.cancelled, message = 'cancelled before it was sent' })
    end
    params.branchId = params.branchId or bid
    run.branchId = params.branchId
    run.client = S.client
    hook(run, 'on_start', run)
    run.id = S.client:request('operate', params, guarded(function(err, result)
      -- The current branch is gone (a server restarted without its journal): use a new one, once.
      if err and err.code == -32012 and implicit and not run.retried and not run.cancel_requested then
        run.retried = true
        branches.forget(params.branchId)
        notify(('branch %s is unknown to the server; using a new branch'):format(params.branchId),
          vim.log.levels.WARN)
        params.branchId = nil
        return with_current_branch()
      end
      finish_or_wait_exit(err, result)
    end))
  end

  M.when_ready(guarded(function(err)
    if err then
      return run.finish(err)
    end
    if params.branchId then
      send(params.branchId)
    else
      with_current_branch()
    end
  end))
  return run
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
    if run.stray and run.finish then
      -- the server could not read a message sent during this turn (on_stray_error): if it was
      -- this turn's request, the server knows of no turn to cancel and would never answer
      vim.defer_fn(function()
        if S.running == run then
          run.finish({ code = rpc.codes.cancelled, message = 'cancelled (the server did not answer the cancel)' })
        end
      end, M.CANCEL_WAIT_MS)
    end
  end
  return true
end

return M
