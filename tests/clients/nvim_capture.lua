-- Driven by tests/clients/test_nvim.py inside tmux: a chat turn whose edit is reviewed in a diff
-- tab. Writes marker files so that the test knows when to capture the screen and press keys.
local cfg = vim.json.decode(os.getenv('OPERATE_CAPTURE_CFG'))
local marks = cfg.marks
vim.opt.runtimepath:prepend(cfg.plugin)
vim.cmd('runtime plugin/operate_sidecar.lua')
vim.o.laststatus = 2
vim.o.showtabline = 1
vim.o.cmdheight = 1
vim.o.termguicolors = false
local function mark(name)
  vim.defer_fn(function()
    vim.cmd('redraw!')
    local f = io.open(marks .. '/' .. name, 'w')
    f:write('1')
    f:close()
  end, 300)
end
require('operate_sidecar').setup({
  cmd = cfg.cmd, cmd_cwd = cfg.cwd, cmd_env = cfg.env, state_dir = false,
  settings = cfg.settings, chat = { size = 62 },
  notify = function(msg)
    local f = io.open(marks .. '/notes.txt', 'a')
    f:write(msg .. '\n')
    f:close()
  end,
})
vim.api.nvim_create_autocmd('User', { pattern = 'OperateSidecarDiff', callback = function() mark('diff') end })
vim.api.nvim_create_autocmd('User', { pattern = 'OperateSidecarDone', callback = function()
  vim.defer_fn(function() mark('done') end, 500)
end })
vim.cmd('edit ' .. cfg.file)
vim.defer_fn(function()
  local chat = require('operate_sidecar.chat')
  local c = chat.open()
  chat.set_prompt(c, 'Make greet() use an f-string. #buffer')
  vim.cmd('stopinsert')
  chat.send(c)
end, 200)
