-- The plugin's configuration: defaults, and the values in force after setup().
local M = {}

M.defaults = {
  cmd = { 'operate-sidecar' }, -- program + arguments
  cmd_env = nil, -- extra environment variables for the server
  cmd_cwd = nil, -- working directory of the server (default: the editor's)
  settings = {}, -- initialize `settings`
  state_dir = nil, -- journal dir; nil = stdpath('state')/operate-sidecar, false = memory only
  branch_scope = 'tab', -- 'tab' (a current branch per tab page) or 'global'
  branch = {}, -- createBranch params for new branches: {system?, chatModel?, parseModel?, name?}
  model = nil, -- the chat model for new branches and chat turns (picked with :OperateModel)
  log_file = nil, -- the server's stderr; default stdpath('cache')/operate-sidecar.log
  auto_start = true, -- start the server on first use
  request_timeout = 30000, -- ms, for initialize and the synchronous helpers
  permission_handler = nil, -- function(params, answer) -> decision|nil; replaces the prompt
  permission_focus = 'chat', -- focus the prompt: 'chat' (when the cursor is in the chat), 'always', 'never'
  client_tools = nil, -- extra {name, description, inputSchema, handler(args, params)} tools
  builtin_client_tools = true, -- offer `nvim_buffer_text` to the model
  fs = true, -- serve the editor's buffers to the server's file tools (edits land in buffers)
  notify = nil, -- function(msg, level); default vim.notify
  operate_defaults = {}, -- merged under the params of every operate
  chat = {
    position = 'right', -- 'right', 'left', 'bottom' or 'top'
    size = 70, -- columns (right/left) or lines (bottom/top)
    prompt_height = 3, -- lines of the prompt window under the transcript
    tools = true, -- chat turns may call tools
    max_rounds = 8, -- model rounds per chat turn while tools keep running
    -- the prompt's completion of `#` words opens as you type: 'auto' (unless a completion plugin
    -- with its own menu is loaded: nvim-cmp, blink.cmp, coq, mini.completion), true, or false
    -- (CTRL-X CTRL-O only)
    complete = 'auto',
  },
}

M.values = vim.deepcopy(M.defaults)

local islist = vim.islist or vim.tbl_islist

-- How a value is named in a message: a string quoted, anything else by its type.
local function shown(v)
  if type(v) == 'string' then
    return ('%q'):format(v)
  end
  if type(v) == 'number' or type(v) == 'boolean' then
    return tostring(v)
  end
  return type(v) == 'table' and (next(v) == nil and 'an empty table' or 'a table') or type(v)
end

local function one_of(...)
  local allowed = { ... }
  local names = vim.tbl_map(function(a)
    return type(a) == 'string' and ("'" .. a .. "'") or tostring(a)
  end, allowed)
  return function(v)
    return vim.tbl_contains(allowed, v)
  end, 'one of ' .. table.concat(names, ', ')
end

local function kind(t, nilable)
  return function(v)
    return type(v) == t or (nilable and v == nil)
  end, (t == 'table' and 'a table' or ('a ' .. t)) .. (nilable and ' (or nil)' or '')
end

local function positive(integer, nilable)
  return function(v)
    return (nilable and v == nil) or (type(v) == 'number' and v > 0 and (not integer or v % 1 == 0))
  end, (integer and 'a positive whole number' or 'a positive number') .. (nilable and ' (or nil)' or '')
end

local function strings_map(v)
  if v == nil then
    return true
  end
  if type(v) ~= 'table' then
    return false
  end
  for k, val in pairs(v) do
    if type(k) ~= 'string' or (type(val) ~= 'string' and type(val) ~= 'number') then
      return false
    end
  end
  return true
end

local function command(v)
  if type(v) == 'string' then
    return v ~= ''
  end
  if type(v) ~= 'table' or #v == 0 or not islist(v) then
    return false
  end
  for _, a in ipairs(v) do
    if type(a) ~= 'string' then
      return false
    end
  end
  return v[1] ~= ''
end

local function tools(v)
  if v == nil then
    return true
  end
  if type(v) ~= 'table' or not islist(v) then
    return false
  end
  for _, t in ipairs(v) do
    if type(t) ~= 'table' or type(t.name) ~= 'string' or type(t.handler) ~= 'function' then
      return false
    end
  end
  return true
end

-- option -> {check(value) -> ok, what it must be}: the types setup() takes (unknown keys are kept as given)
M.CHECKS = {
  cmd = { command, 'a non-empty list of strings (the program and its arguments), or one string' },
  cmd_env = { strings_map, 'a table of environment variables (names to strings), or nil' },
  cmd_cwd = { kind('string', true) },
  settings = { kind('table') },
  state_dir = { function(v)
    return v == nil or v == false or (type(v) == 'string' and v ~= '')
  end, 'a directory (a string), false (memory only) or nil (the default)' },
  branch_scope = { one_of('tab', 'global') },
  branch = { kind('table') },
  model = { kind('string', true) },
  log_file = { kind('string', true) },
  auto_start = { kind('boolean') },
  request_timeout = { positive(false) },
  permission_handler = { kind('function', true) },
  permission_focus = { one_of('chat', 'always', 'never') },
  client_tools = { tools, 'a list of tools ({name = string, handler = function, ...}), or nil' },
  builtin_client_tools = { kind('boolean') },
  fs = { kind('boolean') },
  notify = { kind('function', true) },
  operate_defaults = { kind('table') },
  chat = { kind('table') },
  ['chat.position'] = { one_of('right', 'left', 'bottom', 'top') },
  ['chat.size'] = { positive(false) },
  ['chat.prompt_height'] = { positive(true) },
  ['chat.tools'] = { kind('boolean') },
  ['chat.max_rounds'] = { positive(true, true) },
  ['chat.complete'] = { one_of('auto', true, false) },
}

local ORDER = { 'cmd', 'cmd_env', 'cmd_cwd', 'settings', 'state_dir', 'branch_scope', 'branch', 'model', 'log_file',
  'auto_start', 'request_timeout', 'permission_handler', 'permission_focus', 'client_tools', 'builtin_client_tools',
  'fs', 'notify', 'operate_defaults', 'chat', 'chat.position', 'chat.size', 'chat.prompt_height', 'chat.tools',
  'chat.max_rounds', 'chat.complete' }

--- Why the options v (merged over the defaults) cannot be used: "`chat.size` must be a positive
--- number, got \"big\"", or nil when each known option has its type.
function M.check(v)
  for _, name in ipairs(ORDER) do
    local parent, key = name:match('^(%w+)%.(.+)$')
    if not (parent and type(v[parent]) ~= 'table') then -- (a parent of the wrong type is said by its own check)
      local value -- (false is a value: `chat.tools = false`)
      if parent then
        value = v[parent][key]
      else
        value = v[name]
      end
      local check, what = M.CHECKS[name][1], M.CHECKS[name][2]
      if not check(value) then
        return ('`%s` must be %s, got %s'):format(name, what or '?', shown(value))
      end
    end
  end
  return nil
end

--- Take the options of setup(opts) (merged over the defaults). An option of the wrong type is an
--- error naming it and what it must be, and nothing is taken.
function M.set(opts)
  opts = opts or {}
  if type(opts) ~= 'table' then
    error(('operate_sidecar.setup: the options must be a table, got %s'):format(shown(opts)), 0)
  end
  local v = vim.tbl_deep_extend('force', vim.deepcopy(M.defaults), opts)
  -- tbl_deep_extend merges lists by index; take these as given
  if opts.cmd ~= nil then
    v.cmd = opts.cmd
  end
  if opts.client_tools then
    v.client_tools = opts.client_tools
  end
  local why = M.check(v)
  if why then
    error('operate_sidecar.setup: ' .. why, 0)
  end
  if type(v.cmd) == 'string' then
    v.cmd = { v.cmd }
  end
  -- keep the same table so that modules holding M.values see the change
  for k in pairs(M.values) do
    M.values[k] = nil
  end
  for k, val in pairs(v) do
    M.values[k] = val
  end
  return M.values
end

return M
