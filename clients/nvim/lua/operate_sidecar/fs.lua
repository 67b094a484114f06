-- The editor as the server's file system: reads see unsaved buffer text, writes land in the
-- buffer (one undo step, the rest of the buffer untouched) so that nothing is left stale.
-- A path with no file on disk whose buffer is empty and unmodified (e.g. the one a diff review
-- of a new file shows) is no file: reads answer an error (the server's "does not exist"), and a
-- write creates the file: into the buffer, then written to disk (parent directories made).
local api = vim.api
local util = require('operate_sidecar.util')

local M = {}

M.writes = {} -- the last writes, for the views: {path, buf, ...}

local BOM = '\239\187\191'

-- Whether buffer b is written as UTF-8 (a 'bomb' is a UTF-8 BOM only then).
local function utf8_buf(b)
  local fenc = vim.bo[b].fileencoding
  if fenc == '' then
    fenc = vim.o.encoding
  end
  return fenc == 'utf-8' or fenc == 'utf8'
end

-- The line break of buffer b's file ('fileformat').
local function line_break(b)
  local ff = vim.bo[b].fileformat
  return ff == 'dos' and '\r\n' or ff == 'mac' and '\r' or '\n'
end

--- Buffer b's text as the bytes of its file: the server compares it with the file it previewed
--- (read from disk when no buffer held it) and a difference fails the write ("changed after the
--- change was previewed"). So the line breaks of its 'fileformat' (\r\n for dos), the BOM when
--- 'bomb' is set, and a final line break as :w writes it: 'eol', or 'fixeol' once the buffer is
--- modified (an unmodified buffer is the file as it was read: a file without a final newline
--- loaded with 'fixeol' on has none until it is changed and written).
local function buf_text(b)
  local nl = line_break(b)
  local lines = api.nvim_buf_get_lines(b, 0, -1, false)
  local text = table.concat(lines, nl)
  local eol = vim.bo[b].eol
  if not eol and vim.bo[b].fixeol and not vim.bo[b].binary and vim.bo[b].modified then
    eol = true
  end
  if eol then
    text = text .. nl
  end
  if text == nl and #lines == 1 then
    text = '' -- an empty buffer is an empty file
  end
  if vim.bo[b].bomb and utf8_buf(b) then
    text = BOM .. text
  end
  return text
end
M.buf_text = buf_text

--- The lines of `text` as a buffer like b holds them (its 'fileformat': the \r of \r\n is no
--- part of a line of a dos buffer), whether it ends with a line break, and whether it starts
--- with a UTF-8 BOM (which a buffer holds as 'bomb', not as text). b nil: a unix buffer.
function M.text_lines(text, b)
  local bom = false
  if text:sub(1, 3) == BOM and (not b or utf8_buf(b)) then
    bom, text = true, text:sub(4)
  end
  local nl = b and line_break(b) or '\n'
  if nl ~= '\n' then
    -- the format's line breaks end the lines; another \r stays in its line, as :e shows it
    -- (a bare \n in a dos file's text ends a line too: a buffer line cannot hold one)
    text = text:gsub(nl, '\n')
  end
  local lines = util.split_lines(text)
  local eol = false
  if #lines > 1 and lines[#lines] == '' then
    table.remove(lines)
    eol = true
  end
  return lines, eol, bom
end

--- Replace buffer b's text with `text`, touching only the lines that differ (one undo step);
--- 'eol' and 'bomb' follow the text, so that :w writes exactly `text`.
function M.set_buf_text(b, text)
  local new, eol, bom = M.text_lines(text, b)
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
  if text ~= '' then
    if vim.bo[b].eol ~= eol then
      vim.bo[b].eol = eol
    end
    if not eol and vim.bo[b].fixeol then
      vim.bo[b].fixeol = false -- else :w adds the final line break the text has not
    end
  end
  if vim.bo[b].bomb ~= bom and utf8_buf(b) then
    vim.bo[b].bomb = bom
  end
end

local function on_disk(path)
  return (vim.uv or vim.loop).fs_stat(path) ~= nil
end

-- An empty, unmodified buffer of a path with no file: it stands for no file at all.
local function no_file(b, path)
  return not vim.bo[b].modified and buf_text(b) == '' and not on_disk(path)
end

-- The bytes of the file at path; nil and why when it cannot be read.
local function disk_text(path)
  local f, err = io.open(path, 'rb')
  if not f then
    return nil, err
  end
  local text = f:read('*a')
  f:close()
  return text
end

-- The answer to a read of `text`: it, or, when it is not UTF-8 text (a buffer opened with
-- `++bin`, a file in another encoding), the error answer of a read that failed
-- (docs/PROTOCOL.md §10: the call fails with this reason; never "does not exist", which would
-- let write_file replace the file unseen). Text that is not UTF-8 cannot go over the wire at all.
local function text_answer(path, text, reply)
  local bad = util.utf8_error(text)
  if bad then
    return reply(nil, { code = -32603, message = ("'%s' is not UTF-8 text (byte %d); it cannot be read "
      .. 'through the editor'):format(util.display_path(path), bad) })
  end
  reply({ text = text })
end

--- fs/readTextFile {path} -> {text}: a loaded buffer's text (unsaved changes included), else disk.
--- No file (on disk or as a buffer with text) is an error answer, as the server expects; so is
--- text that is not UTF-8.
function M.on_read(params, reply)
  local path = params.path
  local b = util.buf_for_path(path)
  if b and not no_file(b, path) then
    return text_answer(path, buf_text(b), reply)
  end
  local text, err = disk_text(path)
  if not text then
    return reply(nil, { code = -32602, message = ('cannot read %s: %s'):format(path, tostring(err)) })
  end
  text_answer(path, text, reply)
end

-- Whether a mode has a write bit (0o200, 0o020 or 0o002; no bit library needed).
local function any_write_bit(mode)
  return math.floor(mode / 128) % 2 == 1 or math.floor(mode / 16) % 2 == 1 or math.floor(mode / 2) % 2 == 1
end

-- Why the file at path (and its buffer b, if any) may not be written, or nil. The server's own
-- checks (§9: a read-only file is not replaced) are the client's with its file system. The mode
-- bits are read as well as access(): as root access(W_OK) says yes to a file of mode 0444.
local function not_writable(path, b)
  local uv = vim.uv or vim.loop
  local shown = util.display_path(path)
  if b and vim.bo[b].readonly then
    return ("'%s' is read-only (its buffer has 'readonly'); nothing written"):format(shown)
  end
  if b and not vim.bo[b].modifiable then
    return ("'%s' is not modifiable (its buffer has 'nomodifiable'); nothing written"):format(shown)
  end
  local st = uv.fs_stat(path)
  if st and st.type == 'directory' then
    return ("'%s' is a directory; nothing written"):format(shown)
  end
  if st and st.type == 'file' and (not any_write_bit(st.mode) or not uv.fs_access(path, 'W')) then
    return ("'%s' is read-only; nothing written"):format(shown)
  end
end

-- A buffer with no unsaved changes holds its file's bytes (buf_text): when the file on disk
-- differs, it changed outside after the buffer read it, so after the text the change was
-- previewed from (§9: such a write fails, nothing is written). A file in another encoding than
-- UTF-8 is not compared (its buffer's text is not its bytes).
local function changed_on_disk(path, b)
  if vim.bo[b].modified or not utf8_buf(b) or not on_disk(path) then
    return false
  end
  local text = disk_text(path)
  return text ~= nil and text ~= buf_text(b)
end

--- fs/writeTextFile {path, text} -> {}: into the file's buffer (modified, undoable), else to
--- disk; a buffer that stands for no file gets the text and is written (the file is created).
--- A buffer of the file that is not loaded (after :bdelete, say) is loaded first: the change
--- lands in a buffer, as the review promised, never on disk behind the user's back.
function M.on_write(params, reply)
  local path, text = params.path, params.text
  if type(path) ~= 'string' or type(text) ~= 'string' then
    return reply(nil, { code = -32602, message = 'fs/writeTextFile needs path and text' })
  end
  local b = util.buf_for_path(path, true)
  if b and not api.nvim_buf_is_loaded(b) then
    local ok, err = pcall(vim.fn.bufload, b)
    if not ok then
      return reply(nil, { code = -32603, message = ('cannot load the buffer of %s: %s'):format(path, tostring(err)) })
    end
    vim.bo[b].buflisted = true -- (:bdelete unlisted it: the modified buffer is one to find in :ls)
  end
  local why = not_writable(path, b)
  if why then
    return reply(nil, { code = -32603, message = why })
  end
  if b then
    if changed_on_disk(path, b) then
      return reply(nil, { code = -32603, message = ('%s changed on disk after the change was previewed; '
        .. 'nothing was written (:checktime reloads it)'):format(util.display_path(path)) })
    end
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
