-- User commands and <Plug> mappings for operate-sidecar (Neovim 0.7.2+). Configure with
-- require('operate_sidecar').setup({...}); see :help operate-sidecar.
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

cmd('OperateChat', function()
  os_().chat()
end, { desc = 'Open the chat of the current branch' })

cmd('Operate', function(opts)
  os_().command_operate(opts)
end, { nargs = '*', range = true, desc = 'Send {instruction} to the chat (asked for when omitted); a range/selection goes along as context' })

cmd('OperateCancel', function()
  os_().cancel()
end, { desc = 'Cancel the running turn' })

cmd('OperateRetry', function(opts)
  os_().command_retry(fargs(opts))
end, {
  nargs = '*',
  desc = "Send the chat's last turn again if it failed or was stopped (edit: put it in the prompt)",
  complete = function(lead)
    return os_().filter({ 'edit' }, lead)
  end,
})

cmd('OperateAttach', function(opts)
  require('operate_sidecar.chat').attach(nil, opts.args)
end, {
  nargs = '?',
  complete = 'file',
  desc = "Attach {file} to the chat's message (#file:<path>; picked from the project's files when omitted)",
})

cmd('OperateExport', function(opts)
  require('operate_sidecar.chat').export(opts.args, opts.bang)
end, {
  nargs = '?',
  bang = true,
  complete = 'file',
  desc = 'The chat as Markdown: in a new tab, or written to {file} (! replaces an existing one)',
})

cmd('OperatePermission', function()
  require('operate_sidecar.permission').focus()
end, { desc = 'Show the waiting permission request or diff review' })

cmd('OperateMessages', function(opts)
  os_().command_messages(fargs(opts))
end, {
  nargs = '?',
  desc = 'Open the chat of the current branch (or of {branchId})',
  complete = function(lead)
    return os_().complete_branch_id(lead)
  end,
})

cmd('OperateBranch', function(opts)
  os_().command_branch(fargs(opts))
end, {
  nargs = '*',
  desc = 'pick | new [name] | fork | delete [id] | list | {branchId}',
  complete = function(lead, line)
    return os_().complete_branch(lead, line)
  end,
})

cmd('OperateModel', function(opts)
  os_().command_model(fargs(opts))
end, {
  nargs = '?',
  desc = 'Pick the chat model (or set {model})',
  complete = function(lead)
    return os_().complete_model(lead)
  end,
})

cmd('OperateTools', function(opts)
  os_().command_tools(fargs(opts))
end, {
  nargs = '*',
  desc = 'List tools, or {tool} {allow|deny|ask} [global] to set a policy',
  complete = function(lead, line)
    return os_().complete_tools(lead, line)
  end,
})

for lhs, spec in pairs(require('operate_sidecar').PLUGS) do
  vim.keymap.set(spec[1], lhs, spec[2], { desc = 'operate-sidecar' })
end

local group = vim.api.nvim_create_augroup('operate_sidecar', { clear = true })

vim.api.nvim_create_autocmd('BufEnter', {
  group = group,
  callback = function(ev)
    require('operate_sidecar.context').track(ev.buf)
  end,
})

vim.api.nvim_create_autocmd('VimResized', {
  group = group,
  callback = function()
    for _, name in ipairs({ 'operate_sidecar.chat', 'operate_sidecar.diff' }) do
      local m = package.loaded[name]
      if m then
        m.on_resize()
      end
    end
  end,
})

vim.api.nvim_create_autocmd('VimLeavePre', {
  group = group,
  callback = function()
    local m = package.loaded['operate_sidecar.server']
    if m and m.is_running() then
      local c = m.state.client
      for id in pairs(c.pending) do -- cancelled first: the shutdown answer does not wait for them
        c:cancel(id)
      end
      c:request_sync('shutdown', nil, 500)
      c:notify('exit')
      c:close_stdin()
    end
  end,
})
