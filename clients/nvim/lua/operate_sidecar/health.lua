-- :checkhealth operate_sidecar (Neovim 0.7.2's health#report_* and 0.8+'s vim.health).
local M = {}

local function reporter()
  local h = vim.health
  if h and (h.ok or h.report_ok) then
    return {
      start = h.start or h.report_start,
      ok = h.ok or h.report_ok,
      warn = h.warn or h.report_warn,
      error = h.error or h.report_error,
      info = h.info or h.report_info,
    }
  end
  local function fn(name)
    return function(msg, ...)
      local advice = select('#', ...) > 0 and { ... } or nil
      if advice then
        vim.fn['health#report_' .. name](msg, advice)
      else
        vim.fn['health#report_' .. name](msg)
      end
    end
  end
  return { start = fn('start'), ok = fn('ok'), warn = fn('warn'), error = fn('error'), info = fn('info') }
end

-- Why `prog` cannot be run: 'not executable' / 'a directory' for a file that exists, else nil
-- (not found). A name without a slash is looked up in $PATH, as the spawn does.
local function why_not_executable(prog)
  local uv = vim.uv or vim.loop
  local candidates = {}
  if prog:find('/', 1, true) then
    candidates[1] = prog
  else
    for dir in (os.getenv('PATH') or ''):gmatch('[^:]+') do
      candidates[#candidates + 1] = dir .. '/' .. prog
    end
  end
  for _, path in ipairs(candidates) do
    local st = uv.fs_stat(path)
    if st and st.type == 'directory' then
      return 'a directory', path
    elseif st then
      return 'not executable', path
    end
  end
  return nil
end

-- Why the server's log file `path` cannot be written, or nil: it is a directory, or the nearest
-- of its directories that exists is a file (the start then runs the server without its log).
local function why_log_unwritable(path)
  local uv = vim.uv or vim.loop
  local st = uv.fs_stat(path)
  if st then
    if st.type == 'directory' then
      return 'it is a directory'
    elseif vim.fn.filewritable(path) ~= 1 then
      return 'it is not writable'
    end
    return nil
  end
  local dir = vim.fn.fnamemodify(path, ':h')
  while true do
    local dst = uv.fs_stat(dir)
    if dst then
      if dst.type ~= 'directory' then
        return ('%s is not a directory'):format(dir)
      elseif vim.fn.filewritable(dir) ~= 2 then
        return ('%s is not writable'):format(dir)
      end
      return nil
    end
    local up = vim.fn.fnamemodify(dir, ':h')
    if up == dir then
      return nil
    end
    dir = up
  end
end

function M.check()
  local r = reporter()
  local config = require('operate_sidecar.config').values
  local server = require('operate_sidecar.server')
  local util = require('operate_sidecar.util')

  r.start('operate-sidecar: editor')
  if vim.fn.has('nvim-0.7.2') == 1 then
    local v = vim.version()
    r.ok(('Neovim %d.%d.%d (0.7.2 or later)'):format(v.major, v.minor, v.patch))
  else
    r.error('Neovim 0.7.2 or later is needed')
  end

  r.start('operate-sidecar: server')
  local cmd = config.cmd
  if type(cmd) == 'string' then -- (setup() makes a list of it; a value set by hand may be one)
    cmd = { cmd }
  end
  local bad_cmd = cmd == nil and '`cmd` is not set'
    or (type(cmd) ~= 'table' or #cmd == 0) and ('`cmd` must be a list of strings (the program and its '
      .. 'arguments), got %s'):format(type(cmd) == 'table' and 'an empty list' or type(cmd))
  for i, a in ipairs(type(cmd) == 'table' and cmd or {}) do
    if not bad_cmd and type(a) ~= 'string' then
      bad_cmd = ('`cmd` must be a list of strings (the program and its arguments), but item %d is a %s'):format(i, type(a))
    end
  end
  local why_config = require('operate_sidecar.config').check(config)
  if why_config and not (bad_cmd and why_config:find('^`cmd`')) then
    r.error('the configuration cannot be used: ' .. why_config, 'fix it in setup({...})')
  end
  if bad_cmd then
    r.error(bad_cmd, 'setup({cmd = {"operate-sidecar"}})')
  elseif vim.fn.executable(cmd[1]) == 1 then
    r.ok(('server command: %s'):format(table.concat(cmd, ' ')))
  else
    local why, path = why_not_executable(cmd[1])
    if why == 'not executable' then
      r.error(('server command is not executable: %s'):format(path), ('chmod +x %s'):format(path))
    elseif why then
      r.error(('server command is a directory: %s'):format(path),
        'setup({cmd = {"/path/to/.venv/bin/operate-sidecar"}})')
    else
      r.error(('server command not found: %s'):format(cmd[1]),
        'pip install operate-sidecar, or setup({cmd = {"/path/to/.venv/bin/operate-sidecar"}})')
    end
  end
  local cwd_why = server.cmd_cwd_problem(config.cmd_cwd)
  if cwd_why then
    r.error(cwd_why, 'setup({cmd_cwd = "/an/existing/directory"}), or leave it unset (the editor\'s)')
  end
  local st = server.state
  if server.is_running() and st.ready and st.init_result then
    local info = st.init_result.serverInfo or {}
    local caps = st.init_result.capabilities or {}
    r.ok(('running: %s %s (pid %d), protocol %s'):format(tostring(info.name), tostring(info.version),
      st.client.pid, tostring(st.init_result.protocolVersion)))
    local models = type(caps.models) == 'table' and caps.models or {}
    r.ok(('models: %s'):format(#models > 0 and table.concat(models, ', ') or '(none)'))
    if type(caps.stateDir) == 'string' then
      r.ok('branches are journaled in ' .. caps.stateDir)
    else
      r.info('branches live in memory only (stateDir is off)')
    end
  elseif st.exit and st.exit.failure then -- (a start that failed, and was stopped over it)
    local tail = util.extend(server.last_log_lines(5), st.exit.printed or {})
    r.warn((util.exit_notice(st.exit, {})), #tail > 0 and table.concat(tail, '\n') or nil)
  elseif st.exit and st.exit.abnormal then
    local tail = util.extend(server.last_log_lines(5), st.exit.printed or {})
    r.warn('the server ' .. server.describe_exit(st.exit.code, st.exit.signal)
      .. (st.exit.starting and ' before it was ready' or ''),
      #tail > 0 and table.concat(tail, '\n') or nil)
  else
    r.ok('not running (it starts on first use, or :OperateStart)')
  end
  local log_why = type(server.log_file()) == 'string' and why_log_unwritable(server.log_file())
  if log_why then
    r.warn(('log_file %s cannot be written (%s): the server runs without its log'):format(server.log_file(), log_why),
      'setup({log_file = "/a/writable/operate-sidecar.log"})')
  else
    r.info('server log: ' .. server.log_file())
  end
end

return M
