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
    local tail = server.last_log_lines(5)
    r.warn((util.exit_notice(st.exit, {})), #tail > 0 and table.concat(tail, '\n') or nil)
  elseif st.exit and st.exit.abnormal then
    local tail = server.last_log_lines(5)
    r.warn('the server ' .. server.describe_exit(st.exit.code, st.exit.signal),
      #tail > 0 and table.concat(tail, '\n') or nil)
  else
    r.ok('not running (it starts on first use, or :OperateStart)')
  end
  r.info('server log: ' .. server.log_file())
end

return M
