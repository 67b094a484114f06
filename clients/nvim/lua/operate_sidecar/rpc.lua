-- JSON-RPC 2.0 over a child process's stdio, framed as in the LSP base protocol
-- (`Content-Length: N\r\n\r\n<utf-8 json>`). Built on libuv (vim.uv / vim.loop) so the
-- same code runs on Neovim 0.7.2 and 0.11+.
--
--   local rpc = require('operate_sidecar.rpc')
--   local c = rpc.start({ cmd = { 'operate-sidecar' }, on_notification = fn, handlers = { m = fn } })
--   c:request('ping', nil, function(err, result) end)
--   local result, err = c:request_sync('ping', nil, 5000)
--
-- JSON null arrives as vim.NIL and `{}` as vim.empty_dict() (nothing is lost when re-encoding).
-- Every callback runs on the main loop (vim.schedule), so it may use the whole API.

local uv = vim.uv or vim.loop

local M = {}

-- Error codes: the server's (docs/PROTOCOL.md, "Error codes") and those of failures detected on
-- the client side.
M.codes = {
  server_exited = -32099, -- the process exited (or its stdout closed) before answering
  timeout = -32098, -- request_sync gave up waiting
  stream = -32097, -- the server wrote something that is not a frame
  not_running = -32096, -- a request was made while the server is not running
  not_utf8 = -32095, -- a message held text that is not UTF-8: not sent (the server could not read it)
  client_failed = -32094, -- the plugin itself failed (an error thrown while a turn started)
  not_initialized = -32002,
  method_not_found = -32601,
  invalid_params = -32602,
  internal = -32603,
  cancelled = -32800,
  validation_failed = -32010,
  model_error = -32011,
  branch_not_found = -32012,
  store_failed = -32013,
}

local function is_null(v)
  return v == nil or v == vim.NIL
end
M.is_null = is_null

--- Where the string s stops being UTF-8 text: the offset (from 0) of the first byte that is not,
--- as a strict decoder (the server's) reads it: no overlong forms, no surrogates, nothing past
--- U+10FFFF, no sequence cut short. nil: all of it is UTF-8. (The server answers a body that is
--- not UTF-8 with a parse error it cannot tie to a request, so such text is never sent.)
function M.utf8_error(s)
  local i = 1
  while true do
    i = s:find('[\128-\255]', i)
    if not i then
      return nil
    end
    local c = s:byte(i)
    local len, lo, hi = 0, 0x80, 0xBF -- (lo, hi: the range of the second byte)
    if c >= 0xC2 and c <= 0xDF then
      len = 2
    elseif c >= 0xE0 and c <= 0xEF then
      len = 3
      lo = c == 0xE0 and 0xA0 or lo -- (below: an overlong form)
      hi = c == 0xED and 0x9F or hi -- (above: a surrogate)
    elseif c >= 0xF0 and c <= 0xF4 then
      len = 4
      lo = c == 0xF0 and 0x90 or lo
      hi = c == 0xF4 and 0x8F or hi -- (above: past U+10FFFF)
    else
      return i - 1
    end
    for k = 1, len - 1 do
      local b = s:byte(i + k)
      if not b or b < (k == 1 and lo or 0x80) or b > (k == 1 and hi or 0xBF) then
        return i - 1
      end
    end
    i = i + len
  end
end

--- Spawn-free framing helpers (exported for tests and reuse).
function M.frame(body)
  return 'Content-Length: ' .. #body .. '\r\n\r\n' .. body
end

--- Parse as many complete frames as `buf` holds. Returns the list of bodies, the unconsumed
--- rest, and an error string when the stream is not framed correctly.
function M.parse_frames(buf)
  local bodies = {}
  while true do
    local header_end = buf:find('\r\n\r\n', 1, true)
    if not header_end then
      break
    end
    local header = buf:sub(1, header_end - 1)
    local len
    for line in (header .. '\r\n'):gmatch('(.-)\r\n') do
      local name, value = line:match('^([^:]+):%s*(.-)%s*$')
      if name and name:lower() == 'content-length' then
        len = tonumber(value)
      end
    end
    if not len then
      return bodies, '', 'frame without Content-Length: ' .. header:sub(1, 200)
    end
    local body_start = header_end + 4
    if #buf < body_start + len - 1 then
      break
    end
    bodies[#bodies + 1] = buf:sub(body_start, body_start + len - 1)
    buf = buf:sub(body_start + len)
  end
  return bodies, buf, nil
end

local signal_names = { [1] = 'SIGHUP', [2] = 'SIGINT', [3] = 'SIGQUIT', [4] = 'SIGILL', [6] = 'SIGABRT',
  [7] = 'SIGBUS', [8] = 'SIGFPE', [9] = 'SIGKILL', [11] = 'SIGSEGV', [13] = 'SIGPIPE', [14] = 'SIGALRM',
  [15] = 'SIGTERM' }

--- A signal's name ("SIGKILL"), or "signal N".
function M.signal_label(signal)
  return signal_names[signal] or ('signal ' .. tostring(signal))
end

--- How a process ended, for messages: "exited with code 3", "was killed by signal 9 (SIGKILL)".
function M.describe_exit(code, signal)
  if signal and signal ~= 0 then
    return ('was killed by signal %s%s'):format(tostring(signal),
      signal_names[signal] and (' (' .. signal_names[signal] .. ')') or '')
  end
  return 'exited with code ' .. tostring(code)
end

--- How a process ended, in short (a tool card's note): "exited with code 1", "killed by SIGTERM".
function M.exit_note(code, signal)
  if signal and signal ~= 0 then
    return 'killed by ' .. M.signal_label(signal)
  end
  return 'exited with code ' .. tostring(code)
end

--- The error of a request the process never answered because it ended (-32099): its message
--- tells how ("the server exited with code 1"), its data the exit code and signal.
function M.exit_error(code, signal)
  return { code = M.codes.server_exited, message = 'the server ' .. M.describe_exit(code, signal),
    data = { exitCode = code, signal = signal } }
end

local Client = {}
Client.__index = Client

local function empty_dict_if_empty(params)
  if type(params) == 'table' and next(params) == nil and getmetatable(params) == nil then
    return vim.empty_dict()
  end
  return params
end

--- Start the server.
--- opts: cmd (list: program + args), cwd?, env? (table of overrides merged over the editor's
--- environment), log_file? (stderr is appended there; client.log_start is the file's size
--- before this process wrote to it; one that cannot be opened is not written, client.log_error
--- says why), on_notification?(method, params),
--- handlers? {method = function(params, reply, ctx)} for server->client requests (call
--- reply(result) or reply(nil, {code, message, data}); ctx.cancelled() tells whether the server
--- has cancelled it; a handler that throws, or calls ctx.fail(err, text?) for a failure found
--- later, is logged, told the user once and answered with the error), on_exit?(code, signal),
--- on_server_cancel?(id), on_stray_error?(error) (an error answer with id null: the server could
--- not read a message of ours, and which one is unknown). A message holding text that is not
--- UTF-8 is never sent: a request fails with codes.not_utf8, an answer becomes an error answer.
--- An answer JSON cannot hold (a function in it, a sparse list, NaN) becomes an error answer
--- saying why, and is logged and told the user as a handler's failure is.
function M.start(opts)
  assert(type(opts.cmd) == 'table' and #opts.cmd > 0, 'rpc.start: cmd must be a non-empty list')
  local self = setmetatable({
    opts = opts,
    next_id = 1,
    pending = {}, -- id -> callback(err, result)
    server_requests = {}, -- id -> { cancelled = bool }
    handlers = opts.handlers or {},
    buf = '',
    exited = false,
    closed = false,
    stdout_eof = false,
    finalized = false,
    exit_code = nil,
    exit_signal = nil,
    stream_errors = {},
    exit_waiters = {}, -- fn(code, signal) to run once the process has exited
  }, Client)

  local stdin, stdout, stderr = uv.new_pipe(false), uv.new_pipe(false), uv.new_pipe(false)
  self.stdin, self.stdout, self.stderr = stdin, stdout, stderr

  local env
  if opts.env then
    local merged = vim.fn.environ()
    for k, v in pairs(opts.env) do
      merged[k] = v
    end
    env = {}
    for k, v in pairs(merged) do
      env[#env + 1] = k .. '=' .. tostring(v)
    end
  end

  if opts.log_file then
    -- a log file that cannot be made (its directory is a file, say) is no reason not to start:
    -- the process runs without it, and self.log_error says why
    local made, why = pcall(vim.fn.mkdir, vim.fn.fnamemodify(opts.log_file, ':h'), 'p')
    if made then
      self.log, why = io.open(opts.log_file, 'a')
    end
    if not self.log then
      self.log_error = tostring(why):gsub('^Vim:', '')
    end
    -- where this process's lines start (the file keeps earlier sessions' lines)
    self.log_start = self.log and self.log:seek('end') or 0
  end

  local args = {}
  for i = 2, #opts.cmd do
    args[#args + 1] = opts.cmd[i]
  end
  local handle, pid = uv.spawn(opts.cmd[1], {
    args = args,
    cwd = opts.cwd,
    env = env,
    stdio = { stdin, stdout, stderr },
  }, function(code, signal)
    self.exited = true
    self.exit_code, self.exit_signal = code, signal
    local waiters = self.exit_waiters
    self.exit_waiters = {}
    for _, fn in ipairs(waiters) do
      vim.schedule(function()
        fn(code, signal)
      end)
    end
    if self.handle and not self.handle:is_closing() then
      self.handle:close()
    end
    -- Give stdout a moment to deliver the last frames (a grandchild may hold it open).
    local t = uv.new_timer()
    t:start(1000, 0, function()
      t:close()
      self:_finalize()
    end)
    if self.stdout_eof then
      self:_finalize()
    end
  end)
  if not handle then
    for _, p in ipairs({ stdin, stdout, stderr }) do
      p:close()
    end
    if self.log then
      self.log:close()
    end
    -- level 0: a message for the user, without this file's name and line
    error(('cannot start %s: %s'):format(tostring(opts.cmd[1]), tostring(pid)), 0)
  end
  self.handle, self.pid = handle, pid

  stdout:read_start(function(err, chunk)
    if err or not chunk then
      self.stdout_eof = true
      if not stdout:is_closing() then
        stdout:close()
      end
      if self.exited then
        self:_finalize()
      end
      return
    end
    self:_on_stdout(chunk)
  end)

  stderr:read_start(function(err, chunk)
    if err or not chunk then
      if not stderr:is_closing() then
        stderr:close()
      end
      return
    end
    if self.log then
      self.log:write(chunk)
      self.log:flush()
    end
  end)

  return self
end

function Client:_log(msg)
  if self.log then
    self.log:write('[operate_sidecar.rpc] ' .. msg .. '\n')
    self.log:flush()
  end
end

-- Called from the luv read callback: no API calls here, only vim.schedule.
function Client:_on_stdout(chunk)
  self.buf = self.buf .. chunk
  local bodies, rest, perr = M.parse_frames(self.buf)
  self.buf = rest
  for _, body in ipairs(bodies) do
    local ok, msg = pcall(vim.json.decode, body)
    if ok and type(msg) == 'table' then
      vim.schedule(function()
        self:_dispatch(msg)
      end)
    else
      self.stream_errors[#self.stream_errors + 1] = 'undecodable body: ' .. body:sub(1, 200)
      self:_log('undecodable body: ' .. body:sub(1, 200))
    end
  end
  if perr then
    self.stream_errors[#self.stream_errors + 1] = perr
    self:_log(perr)
  end
end

-- Send msg; false when it was not sent: the process is gone, or (false, 'not_utf8') the message
-- holds text that is not UTF-8 (the server would answer it with a parse error it cannot tie to
-- this message: a request would never be answered).
function Client:_send(msg)
  if self.closed or self.exited or not self.stdin or self.stdin:is_closing() then
    return false
  end
  msg.jsonrpc = '2.0'
  local ok, body = pcall(vim.json.encode, msg)
  if not ok then
    error('operate-sidecar: cannot encode message: ' .. tostring(body), 0)
  end
  local bad = M.utf8_error(body)
  if bad then
    self:_log(('not sent (%s): text that is not UTF-8 at byte %d of its body'):format(
      tostring(msg.method or ('answer to ' .. tostring(msg.id))), bad))
    return false, 'not_utf8'
  end
  self.stdin:write(M.frame(body))
  return true
end

--- The error of a request that was not sent because it held text that is not UTF-8.
M.NOT_UTF8 = { code = M.codes.not_utf8, message = 'not sent: it holds text that is not UTF-8 (the server reads UTF-8 only)' }

function Client:_dispatch(msg)
  local method = msg.method
  if type(method) == 'string' and not is_null(msg.id) then
    self:_on_server_request(msg)
  elseif type(method) == 'string' then
    if method == '$/cancelRequest' then
      local id = type(msg.params) == 'table' and msg.params.id
      local req = self.server_requests[id]
      if req then
        req.cancelled = true
      end
      if self.opts.on_server_cancel then
        self.opts.on_server_cancel(id)
      end
      return
    end
    if self.opts.on_notification then
      local ok, err = pcall(self.opts.on_notification, method, msg.params)
      if not ok then
        self:_log('notification handler for ' .. method .. ' failed: ' .. tostring(err))
      end
    end
  elseif not is_null(msg.id) then
    local cb = self.pending[msg.id]
    self.pending[msg.id] = nil
    if cb then
      if not is_null(msg.error) then
        cb(msg.error, nil)
      else
        cb(nil, msg.result)
      end
    end
  else
    -- an error response with id null: the server could not read something we sent (docs/PROTOCOL.md
    -- §1: -32700, not JSON; -32600, not a message). It cannot be tied to a request: which of the
    -- pending ones (if any) it was is unknown, so none is failed here; on_stray_error tells the user.
    self:_log('response without id: ' .. vim.inspect(msg))
    if self.opts.on_stray_error then
      local ok, err = pcall(self.opts.on_stray_error, type(msg.error) == 'table' and msg.error or {})
      if not ok then
        self:_log('on_stray_error failed: ' .. tostring(err))
      end
    end
  end
end

function Client:_on_server_request(msg)
  local id, method = msg.id, msg.method
  local state = { cancelled = false }
  self.server_requests[id] = state
  local answered, failed = false, false
  -- Logged, and told the user once (`text`, else which request and the error).
  local function tell(why, text)
    self:_log(('request handler for %s failed: %s'):format(method, why))
    if failed then
      return
    end
    failed = true
    -- (required here: util requires this module)
    local util = require('operate_sidecar.util')
    util.notify_failure(text or ('the editor could not answer the server\'s %s request (it was answered with '
      .. 'an error): %s'):format(method, why), { code = M.codes.internal, message = why }, vim.log.levels.ERROR)
  end
  local function reply(result, err)
    if answered then
      return
    end
    answered = true
    self.server_requests[id] = nil
    local msg_out
    if err then
      msg_out = { id = id, error = { code = err.code or M.codes.internal,
        message = err.message or tostring(err), data = err.data } }
    else
      msg_out = { id = id, result = is_null(result) and vim.NIL or result }
    end
    local encoded, sent_or_err, why = pcall(self._send, self, msg_out)
    if not encoded then
      -- an answer JSON cannot hold (a function, a sparse list, NaN in it): the server gets an
      -- error answer saying why instead (else it would wait for its time-out), and the user is told
      local reason = ('the editor\'s answer to %s cannot be sent as JSON: %s'):format(method,
        (tostring(sent_or_err):gsub('^operate%-sidecar: cannot encode message: ', '')))
      tell(reason)
      self:_send({ id = id, error = { code = M.codes.internal, message = reason } })
    elseif why == 'not_utf8' then -- (an answer the server could not read: it would wait for its time-out)
      self:_send({ id = id, error = { code = M.codes.internal,
        message = ('the editor\'s answer to %s holds text that is not UTF-8'):format(method) } })
    end
  end
  local handler = self.handlers[method]
  if not handler then
    reply(nil, { code = M.codes.method_not_found, message = 'method not found: ' .. method })
    return
  end
  -- The handler failed (it threw, or it calls this for a failure after it returned): logged,
  -- told the user once (`text`, else which request and the error), and the server gets the
  -- error as the answer unless it has one already.
  local function fail(err, text)
    local why = tostring(err)
    tell(why, text)
    reply(nil, { code = M.codes.internal, message = why })
  end
  local ok, err = pcall(handler, msg.params, reply, {
    id = id,
    cancelled = function()
      return state.cancelled
    end,
    fail = fail,
  })
  if not ok then
    fail(err)
  end
end

-- Fail every pending request once the process is gone (runs at most once).
function Client:_finalize()
  if self.finalized then
    return
  end
  self.finalized = true
  self.closed = true
  for _, p in ipairs({ self.stdin, self.stdout, self.stderr }) do
    if p and not p:is_closing() then
      p:close()
    end
  end
  vim.schedule(function()
    local pending = self.pending
    self.pending = {}
    local ids = vim.tbl_keys(pending)
    table.sort(ids, function(a, b)
      return tostring(a) < tostring(b)
    end)
    for _, id in ipairs(ids) do
      pending[id](M.exit_error(self.exit_code, self.exit_signal), nil)
    end
    if self.log then
      self.log:close()
      self.log = nil
    end
    if self.opts.on_exit then
      self.opts.on_exit(self.exit_code, self.exit_signal)
    end
  end)
end

--- Send a request; callback(err, result) runs on the main loop. Returns the request id.
function Client:request(method, params, callback)
  local id = self.next_id
  self.next_id = id + 1
  callback = callback or function() end
  local msg = { id = id, method = method }
  if params ~= nil then
    msg.params = empty_dict_if_empty(params)
  end
  local sent, why = self:_send(msg)
  if not sent then
    vim.schedule(function()
      callback(why == 'not_utf8' and vim.deepcopy(M.NOT_UTF8)
        or { code = M.codes.not_running, message = 'operate-sidecar is not running' }, nil)
    end)
    return id
  end
  self.pending[id] = callback
  return id
end

--- Send a request and wait (processing events) for its response, at most timeout_ms.
--- Returns result, err. On timeout the request is cancelled ($/cancelRequest).
function Client:request_sync(method, params, timeout_ms)
  local done, res, rerr = false, nil, nil
  local id = self:request(method, params, function(err, result)
    done, res, rerr = true, result, err
  end)
  local ok = vim.wait(timeout_ms or 10000, function()
    return done
  end, 10)
  if not ok then
    self.pending[id] = nil
    self:notify('$/cancelRequest', { id = id })
    return nil, { code = M.codes.timeout, message = ('no response to %s within %d ms'):format(method, timeout_ms or 10000) }
  end
  return res, rerr
end

function Client:notify(method, params)
  local msg = { method = method }
  if params ~= nil then
    msg.params = empty_dict_if_empty(params)
  end
  return self:_send(msg)
end

--- Ask the server to cancel request `id` ($/cancelRequest).
function Client:cancel(id)
  return self:notify('$/cancelRequest', { id = id })
end

--- Run fn(code, signal) on the main loop once the process has exited (at once if it has).
function Client:when_exited(fn)
  if self.exited then
    vim.schedule(function()
      fn(self.exit_code, self.exit_signal)
    end)
  else
    self.exit_waiters[#self.exit_waiters + 1] = fn
  end
end

function Client:is_running()
  return not self.exited and not self.closed
end

--- Close stdin (the server exits on EOF).
function Client:close_stdin()
  if self.stdin and not self.stdin:is_closing() then
    self.stdin:shutdown(function()
      if self.stdin and not self.stdin:is_closing() then
        self.stdin:close()
      end
    end)
  end
end

function Client:kill(signal)
  if self.handle and not self.handle:is_closing() then
    self.handle:kill(signal or 15)
  end
end

return M
