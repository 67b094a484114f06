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

function M.set(opts)
  opts = opts or {}
  local v = vim.tbl_deep_extend('force', vim.deepcopy(M.defaults), opts)
  -- tbl_deep_extend merges lists by index; take these as given
  if opts.cmd then
    v.cmd = type(opts.cmd) == 'string' and { opts.cmd } or opts.cmd
  end
  if opts.client_tools then
    v.client_tools = opts.client_tools
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
