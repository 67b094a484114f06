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

function M.check()
  local r = reporter()
  local config = require('operate_sidecar.config').values
  local server = require('operate_sidecar.server')

  r.start('operate-sidecar: editor')
  if vim.fn.has('nvim-0.7.2') == 1 then
    local v = vim.version()
    r.ok(('Neovim %d.%d.%d (0.7.2 or later)'):format(v.major, v.minor, v.patch))
  else
    r.error('Neovim 0.7.2 or later is needed')
  end

  r.start('operate-sidecar: server')
  local cmd = config.cmd or {}
  if type(cmd[1]) ~= 'string' then
    r.error('`cmd` is not set', 'setup({cmd = {"operate-sidecar"}})')
  elseif vim.fn.executable(cmd[1]) == 1 then
    r.ok(('server command: %s'):format(table.concat(cmd, ' ')))
  else
    r.error(('server command not found: %s'):format(cmd[1]),
      'pip install operate-sidecar, or setup({cmd = {"/path/to/.venv/bin/operate-sidecar"}})')
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
  elseif st.exit and st.exit.code ~= 0 then
    local tail = server.last_log_lines(5)
    r.warn(('the server exited with code %s'):format(tostring(st.exit.code)),
      #tail > 0 and table.concat(tail, '\n') or nil)
  else
    r.ok('not running (it starts on first use, or :OperateStart)')
  end
  r.info('server log: ' .. server.log_file())
end

return M
