-- operate-sidecar for Neovim (0.7.2 and later): setup, configuration, the command and <Plug>
-- entry points, and the statusline component. The work is done by the modules beside this
-- file, one per concern:
--   rpc.lua        JSON-RPC over the server's stdio
--   server.lua     the server process, requests, operate with progress and cancellation
--   chat.lua       the chat transcript and its prompt buffer: streaming prose, tool cards, usage
--   diff.lua       diff review of proposed file changes (ga / gr / gA / gR)
--   fs.lua         the editor's buffers as the server's file system
--   permission.lua permission requests (float or diff review), tools and policies
--   branches.lua   current branch, picker, fork / delete, model picker
--   context.lua    #buffer, #selection, #diagnostics
--   health.lua     :checkhealth operate_sidecar
local config = require('operate_sidecar.config')
local server = require('operate_sidecar.server')
local branches = require('operate_sidecar.branches')
local util = require('operate_sidecar.util')

local M = {}
M.version = server.version
M.config = config.values
M._state = server.state
M.pretty = util.pretty

function M.setup(opts)
  config.set(opts)
  M.config = config.values
  return M
end

-- the lower-level API (scripts, tests, other plugins)
M.start = server.start
M.stop = server.stop
M.is_running = server.is_running
M.when_ready = server.when_ready
M.wait_ready = server.wait_ready
M.request = server.request
M.request_sync = server.request_sync
M.operate = server.operate
M.cancel = server.cancel
M.current_branch = branches.current
M.set_branch = branches.set
M.branch_new = branches.new
M.branch_fork = branches.fork
M.branch_delete = branches.delete
M.branch_list = branches.list
M.pick_branch = branches.pick
M.pick_model = branches.pick_model

function M.chat(branch)
  return require('operate_sidecar.chat').open(branch)
end

function M.send(text)
  return require('operate_sidecar.chat').send(nil, text)
end

function M.status()
  local S = server.state
  return {
    running = server.is_running(),
    ready = S.ready,
    pid = S.client and S.client.pid or nil,
    branch = require('operate_sidecar.diff').branch() or branches.current(), -- (the review tab: its request's)
    operating = S.running ~= nil,
    phase = S.progress.phase,
    -- what the chat turn in flight does ("waiting for the model…", a repair attempt ...; nil: none runs)
    activity = package.loaded['operate_sidecar.chat'] and package.loaded['operate_sidecar.chat'].activity() or nil,
    exit = S.exit,
    model = config.values.model,
    waiting = require('operate_sidecar.permission').current() ~= nil,
    stateDir = S.init_result and S.init_result.capabilities and S.init_result.capabilities.stateDir or nil,
  }
end

--- A statusline component: "operate: model · branch · running" (empty when the server is off
--- and nothing is chosen). Use in 'statusline' as %{luaeval('require"operate_sidecar".statusline()')}.
function M.statusline()
  local st = M.status()
  if not st.running and not st.branch and not st.model then
    return ''
  end
  local parts = { 'operate' }
  local default = (config.values.settings or {}).defaultModel
  parts[#parts + 1] = st.model or (type(default) == 'string' and default) or 'default model'
  if st.branch then
    parts[#parts + 1] = branches.name(st.branch) or st.branch:sub(1, 8)
  end
  if st.waiting then
    parts[#parts + 1] = 'waiting for you'
  elseif st.operating then
    parts[#parts + 1] = 'running'
  elseif not st.running then
    parts[#parts + 1] = 'stopped'
  end
  return table.concat(parts, ' · ')
end

-- ---------------------------------------------------------------- commands

--- :Operate {instruction} — a chat turn (with a range: the lines/selection go along as context).
--- Without words it asks for the instruction (vim.ui.input); cancelled or left empty, nothing is sent.
function M.command_operate(opts)
  local chat = require('operate_sidecar.chat')
  local context = require('operate_sidecar.context')
  local function run(instruction)
    if type(instruction) ~= 'string' or vim.trim(instruction) == '' then
      return
    end
    local extra
    if opts.range and opts.range > 0 then
      local b = vim.api.nvim_get_current_buf()
      local name = vim.api.nvim_buf_get_name(b)
      local sel = { path = name ~= '' and util.display_path(name) or '[No Name]', language = vim.bo[b].filetype,
        startLine = opts.line1, endLine = opts.line2, text = context.range_text(opts.line1, opts.line2) }
      extra = { context = sel.text, label = ('lines %d-%d of %s'):format(opts.line1, opts.line2, sel.path) }
    end
    local c = chat.open(nil, true)
    chat.send(c, instruction, extra)
  end
  if opts.args and opts.args ~= '' then
    run(opts.args)
  else
    -- CTRL-C in the default prompt (input()) raises "Keyboard interrupt" on nvim 0.7: a cancel too
    local ok, err = pcall(vim.ui.input, { prompt = 'Instruction: ' }, run)
    if not ok and not tostring(err):find('Keyboard interrupt', 1, true) then
      error(err, 0)
    end
  end
end

M.BRANCH_SUBCOMMANDS = { 'pick', 'new', 'fork', 'delete', 'list' }
M.BRANCH_USAGE = ':OperateBranch [pick | new [name] | fork | delete [id] | list | {id}]'
M.TOOLS_USAGE = ':OperateTools [{tool} {allow|deny|ask} [global]]'

-- A command given words it does not take: one error naming its usage, and nothing is done.
local function refuse(what, usage)
  util.notify(('%s; usage: %s'):format(what, usage), vim.log.levels.ERROR)
end

M.RETRY_USAGE = ':OperateRetry [edit]'

--- :OperateRetry [edit]: send the chat's last turn again if it failed or was stopped (with
--- `edit`: put its message in the prompt instead).
function M.command_retry(opts)
  local chat = require('operate_sidecar.chat')
  local what = opts.fargs[1]
  if #opts.fargs > 1 or (what and what ~= 'edit') then
    return refuse(('unexpected: %s'):format(table.concat(opts.fargs, ' ')), M.RETRY_USAGE)
  end
  if what == 'edit' then
    chat.edit_again()
  else
    chat.retry()
  end
end

function M.command_branch(opts)
  local sub = opts.fargs[1] or 'pick'
  local most = ({ new = math.huge, delete = 2 })[sub] or 1 -- the words it takes, itself included
  if #opts.fargs > most then
    return refuse(('too many arguments: %s'):format(table.concat(opts.fargs, ' ')), M.BRANCH_USAGE)
  end
  if sub == 'new' then
    branches.new(function(err, id)
      if not err then
        require('operate_sidecar.chat').open(id)
      end
    end, nil, opts.fargs[2] and table.concat(vim.list_slice(opts.fargs, 2), ' ') or nil)
  elseif sub == 'fork' then
    branches.fork(function(err, id)
      if not err then
        util.notify('forked into ' .. branches.label_of(id))
        require('operate_sidecar.chat').open(id)
      end
    end)
  elseif sub == 'delete' then
    local id = opts.fargs[2]
    if not id then
      return branches.delete()
    end
    branches.check(id, function(err) -- an unknown id is refused with the server's branches
      if not err then
        branches.delete(nil, id)
      end
    end)
  elseif sub == 'list' then
    branches.list(function(err, list)
      if err then
        return
      end
      local lines = {}
      for _, b in ipairs(list) do
        lines[#lines + 1] = branches.format(b) .. '  ' .. b.branchId
      end
      util.notify(#lines > 0 and ('branches:\n' .. table.concat(lines, '\n')) or 'no branches')
    end)
  elseif sub == 'pick' then
    branches.pick()
  else
    branches.switch(sub) -- an id: make it current (if the server knows it) and open its chat
  end
end

--- :OperateMessages [{id}]: the chat of the current branch, or of a branch the server knows.
function M.command_messages(opts)
  local id = opts.fargs[1]
  if not id then
    return M.chat()
  end
  branches.check(id, function(err)
    if not err then
      M.chat(id)
    end
  end)
end

function M.command_tools(opts)
  local permission = require('operate_sidecar.permission')
  local n = #opts.fargs
  if n == 1 then
    return refuse(('%s needs a policy: allow, deny or ask'):format(opts.fargs[1]), M.TOOLS_USAGE)
  elseif n > 3 or (n == 3 and opts.fargs[3] ~= 'global') then
    return refuse(('unexpected: %s'):format(table.concat(vim.list_slice(opts.fargs, 3), ' ')), M.TOOLS_USAGE)
  end
  if n >= 2 then
    local tool, policy = opts.fargs[1], opts.fargs[2]
    if not vim.tbl_contains({ 'allow', 'deny', 'ask' }, policy) then
      return refuse(('unknown policy: %s (allow, deny or ask)'):format(policy), M.TOOLS_USAGE)
    end
    -- a tool the server does not have is refused here, naming the ones it has (as a model is)
    server.request_or_notify('listTools', nil, function() end, function(res)
      local names = {}
      for _, t in ipairs(res.tools or {}) do
        names[#names + 1] = t.name
      end
      table.sort(names)
      if not vim.tbl_contains(names, tool) then
        return util.notify(('unknown tool: %s; the server\'s tools: %s'):format(tool,
          #names > 0 and table.concat(names, ', ') or 'none'), vim.log.levels.ERROR)
      end
      permission.authorize(tool, policy, nil, opts.fargs[3] == 'global')
    end)
  else
    permission.show_tools()
  end
end

function M.command_model(opts)
  if opts.fargs[1] then
    branches.choose_model(opts.fargs[1])
  else
    branches.pick_model()
  end
end

local function filter(items, lead)
  local out = {}
  for _, it in ipairs(items) do
    if it:sub(1, #lead) == lead then
      out[#out + 1] = it
    end
  end
  return out
end
M.filter = filter

--- Completion of a branch id: the server's branches (when it runs).
function M.complete_branch_id(lead)
  local ids = {}
  if server.state.ready then
    for _, b in ipairs(require('operate_sidecar.branches').entries(server.request_sync('listBranches', nil, 2000))) do
      ids[#ids + 1] = b.branchId
    end
    table.sort(ids)
  end
  return filter(ids, lead)
end

--- Completion for :OperateBranch (subcommands, then branch ids for delete).
function M.complete_branch(lead, line)
  local words = vim.split(line, '%s+', { trimempty = false })
  if #words <= 2 then
    return filter(M.BRANCH_SUBCOMMANDS, lead)
  elseif #words == 3 and words[2] == 'delete' then
    return M.complete_branch_id(lead)
  end
  return {}
end

function M.complete_model(lead)
  local models = util.copy(server.models())
  table.sort(models)
  return filter(models, lead)
end

--- Completion for :OperateTools {tool} {allow|deny|ask} [global].
function M.complete_tools(lead, line)
  local n = #vim.split(line, '%s+', { trimempty = false })
  if n == 2 then
    local names = require('operate_sidecar.permission').tool_names
    if not names and server.state.ready then
      local res = server.request_sync('listTools', nil, 2000)
      names = {}
      for _, t in ipairs(res and res.tools or {}) do
        names[#names + 1] = t.name
      end
      require('operate_sidecar.permission').tool_names = names
    end
    return filter(names or {}, lead)
  elseif n == 3 then
    return filter({ 'allow', 'deny', 'ask' }, lead)
  elseif n == 4 then
    return filter({ 'global' }, lead)
  end
  return {}
end

--- The <Plug> mappings (defined by plugin/operate_sidecar.lua; map your keys to them).
M.PLUGS = {
  ['<Plug>(operate-sidecar-chat)'] = { 'n', function()
    M.chat()
  end },
  ['<Plug>(operate-sidecar-send-selection)'] = { 'x', function()
    vim.cmd('normal! \27') -- leave visual mode so that '< and '> are set
    local chat = require('operate_sidecar.chat')
    local c = chat.open()
    local cur = chat.prompt_text(c)
    chat.set_prompt(c, (cur ~= '' and (cur .. ' ') or '') .. '#selection ')
    vim.cmd('startinsert!')
  end },
  ['<Plug>(operate-sidecar-cancel)'] = { 'n', function()
    server.cancel()
  end },
  ['<Plug>(operate-sidecar-branches)'] = { 'n', function()
    branches.pick()
  end },
  ['<Plug>(operate-sidecar-models)'] = { 'n', function()
    branches.pick_model()
  end },
  ['<Plug>(operate-sidecar-permission)'] = { 'n', function()
    require('operate_sidecar.permission').focus()
  end },
  ['<Plug>(operate-sidecar-retry)'] = { 'n', function()
    require('operate_sidecar.chat').retry()
  end },
  ['<Plug>(operate-sidecar-edit-again)'] = { 'n', function()
    require('operate_sidecar.chat').edit_again()
  end },
}

return M
