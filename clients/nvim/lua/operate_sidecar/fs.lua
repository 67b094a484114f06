-- The editor as the server's file system: reads see unsaved buffer text, writes land in the
-- buffer (one undo step, the rest of the buffer untouched) so that nothing is left stale.
-- A path with no file on disk whose buffer is empty and unmodified (e.g. the one a diff review
-- of a new file shows) is no file: reads answer an error (the server's "does not exist"), and a
-- write creates the file: into the buffer, then written to disk (parent directories made).
local api = vim.api
local util = require('operate_sidecar.util')

local M = {}

M.writes = {} -- the last writes, for the views: {path, buf, ...}

local function buf_text(b)
  local text = table.concat(api.nvim_buf_get_lines(b, 0, -1, false), '\n')
  if vim.bo[b].eol or vim.bo[b].fixeol then
    text = text .. '\n'
  end
  if text == '\n' and api.nvim_buf_line_count(b) == 1 then
    return '' -- an empty buffer is an empty file
  end
  return text
end
M.buf_text = buf_text

local function to_lines(text)
  local lines = util.split_lines(text)
  local eol = false
  if #lines > 1 and lines[#lines] == '' then
    table.remove(lines)
    eol = true
  end
  return lines, eol
end

--- Replace buffer b's text with `text`, touching only the lines that differ (one undo step).
function M.set_buf_text(b, text)
  local new, eol = to_lines(text)
  local old = api.nvim_buf_get_lines(b, 0, -1, false)
  local pre = 0
  while pre < #old and pre < #new and old[pre + 1] == new[pre + 1] do
    pre = pre + 1
  end
  local suf = 0
  while suf < #old - pre and suf < #new - pre and old[#old - suf] == new[#new - suf] do
    suf = suf + 1
  end
  local repl = {}
  for i = pre + 1, #new - suf do
    repl[#repl + 1] = new[i]
  end
  if pre < #old - suf or #repl > 0 then
    api.nvim_buf_set_lines(b, pre, #old - suf, false, repl)
  end
  if text ~= '' and vim.bo[b].eol ~= eol then
    vim.bo[b].eol = eol
    vim.bo[b].fixeol = eol
  end
end

local function on_disk(path)
  return (vim.uv or vim.loop).fs_stat(path) ~= nil
end

-- An empty, unmodified buffer of a path with no file: it stands for no file at all.
local function no_file(b, path)
  return not vim.bo[b].modified and buf_text(b) == '' and not on_disk(path)
end

--- fs/readTextFile {path} -> {text}: a loaded buffer's text (unsaved changes included), else disk.
--- No file (on disk or as a buffer with text) is an error answer, as the server expects.
function M.on_read(params, reply)
  local path = params.path
  local b = util.buf_for_path(path)
  if b and not no_file(b, path) then
    return reply({ text = buf_text(b) })
  end
  local f, err = io.open(path, 'rb')
  if not f then
    return reply(nil, { code = -32602, message = ('cannot read %s: %s'):format(path, tostring(err)) })
  end
  local text = f:read('*a')
  f:close()
  reply({ text = text })
end

--- fs/writeTextFile {path, text} -> {}: into the loaded buffer (modified, undoable), else to disk;
--- a buffer that stands for no file gets the text and is written (the file is created).
function M.on_write(params, reply)
  local path, text = params.path, params.text
  if type(path) ~= 'string' or type(text) ~= 'string' then
    return reply(nil, { code = -32602, message = 'fs/writeTextFile needs path and text' })
  end
  local b = util.buf_for_path(path)
  if b then
    local create = no_file(b, path)
    local ok, err = pcall(M.set_buf_text, b, text)
    if ok and create then -- a new file: the buffer is written, as the server would write it
      ok, err = pcall(function()
        vim.fn.mkdir(vim.fn.fnamemodify(path, ':h'), 'p')
        api.nvim_buf_call(b, function()
          vim.cmd('silent keepalt write')
        end)
      end)
    end
    if not ok then
      return reply(nil, { code = -32603, message = tostring(err) })
    end
    M.writes[#M.writes + 1] = { path = path, buf = b, callId = params.callId }
    util.event('OperateSidecarWrite')
    return reply(vim.empty_dict())
  end
  vim.fn.mkdir(vim.fn.fnamemodify(path, ':h'), 'p')
  local f, err = io.open(path, 'wb')
  if not f then
    return reply(nil, { code = -32603, message = ('cannot write %s: %s'):format(path, tostring(err)) })
  end
  f:write(text)
  f:close()
  -- a listed but unloaded buffer of that file reads the new text when it is loaded
  M.writes[#M.writes + 1] = { path = path, callId = params.callId }
  util.event('OperateSidecarWrite')
  reply(vim.empty_dict())
end

--- A tool that writes files itself (a Python or MCP tool, not through the editor) leaves the
--- buffers of those files stale. Reload the unmodified ones whose file changed, as `:checktime`
--- does with 'autoread' (a buffer with unsaved changes is left alone: nothing is asked mid-turn).
local refresh_due = false

function M.refresh()
  if not vim.o.autoread or refresh_due then
    return -- the user wants to be asked (when the editor gains focus); or one is on its way
  end
  refresh_due = true
  vim.schedule(M.refresh_now) -- once for a burst of tool calls
end

function M.refresh_now()
  refresh_due = false
  for _, b in ipairs(api.nvim_list_bufs()) do
    if api.nvim_buf_is_loaded(b) and vim.bo[b].buftype == '' and not vim.bo[b].modified
        and api.nvim_buf_get_name(b) ~= '' then
      pcall(vim.cmd, 'silent! checktime ' .. b)
    end
  end
end

return M
