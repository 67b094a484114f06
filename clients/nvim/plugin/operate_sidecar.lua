-- User commands for operate-sidecar (Neovim 0.7.2+). Configure with
-- require('operate_sidecar').setup({...}); see clients/nvim/README.md.
if vim.g.loaded_operate_sidecar then
  return
end
vim.g.loaded_operate_sidecar = 1

local function os_()
  return require('operate_sidecar')
end

local cmd = vim.api.nvim_create_user_command

-- 0.7 passes {''} as fargs for an omitted optional argument
local function fargs(opts)
  local out = {}
  for _, a in ipairs(opts.fargs or {}) do
    if a ~= '' then
      out[#out + 1] = a
    end
  end
  opts.fargs = out
  return opts
end

cmd('OperateStart', function()
  os_().start()
end, { desc = 'Start the operate-sidecar server' })

cmd('OperateStop', function()
  os_().stop()
end, { desc = 'Stop the operate-sidecar server' })

cmd('Operate', function(opts)
  os_().command_operate(opts)
end, { nargs = '*', range = true, desc = 'Run operate with {instruction}; a range/selection becomes the context' })

cmd('OperateCancel', function()
  os_().cancel()
end, { desc = 'Cancel the running operate' })

cmd('OperateMessages', function(opts)
  os_().show_messages(nil, fargs(opts).fargs[1])
end, { nargs = '?', desc = 'Show the messages of the current branch (or of {branchId})' })

cmd('OperateBranch', function(opts)
  os_().command_branch(fargs(opts))
end, {
  nargs = '?',
  desc = 'new | fork | list | {branchId}: manage the current branch',
  complete = function()
    return { 'new', 'fork', 'list' }
  end,
})

cmd('OperateTools', function(opts)
  os_().command_tools(fargs(opts))
end, {
  nargs = '*',
  desc = 'List tools, or {tool} {allow|deny|ask} [global] to set a policy',
  complete = function(_, line)
    local n = #vim.split(line, '%s+')
    if n == 3 then
      return { 'allow', 'deny', 'ask' }
    elseif n == 4 then
      return { 'global' }
    end
    return {}
  end,
})

vim.api.nvim_create_autocmd('VimLeavePre', {
  group = vim.api.nvim_create_augroup('operate_sidecar', { clear = true }),
  callback = function()
    local m = package.loaded['operate_sidecar']
    if m and m.is_running() then
      local c = m._state.client
      c:request_sync('shutdown', nil, 500)
      c:notify('exit')
      c:close_stdin()
    end
  end,
})
