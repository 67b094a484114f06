-- Context for a chat turn: `#buffer`, `#selection` and `#diagnostics` references in the prompt
-- expand to the text, selection and diagnostics of the buffer the user came from.
local api = vim.api
local util = require('operate_sidecar.util')

local M = {}

M.REFS = { 'buffer', 'selection', 'diagnostics' }

local last_source -- the last ordinary buffer the user was in

local function is_source(b)
  return b and api.nvim_buf_is_valid(b) and vim.bo[b].buftype == '' and not vim.b[b].operate_sidecar_chat
end

--- Remember the ordinary buffer the user is in (called on BufEnter, and when the chat opens).
function M.track(b)
  b = b or api.nvim_get_current_buf()
  if is_source(b) then
    last_source = b
  end
end

--- The buffer `#buffer` means: the current one unless it is a chat/scratch buffer, else the last
--- ordinary buffer the user was in.
function M.source_buf()
  local cur = api.nvim_get_current_buf()
  if is_source(cur) then
    return cur
  end
  if is_source(last_source) then
    return last_source
  end
  return cur
end

local function info(b)
  local name = api.nvim_buf_get_name(b)
  return { path = name ~= '' and util.display_path(name) or '[No Name]', language = vim.bo[b].filetype }
end

function M.buffer(b)
  b = b or M.source_buf()
  local i = info(b)
  i.text = table.concat(api.nvim_buf_get_lines(b, 0, -1, false), '\n')
  return i
end

--- The last visual selection in buffer b (charwise when it was `v`), with its line range.
function M.selection(b)
  b = b or M.source_buf()
  local s = api.nvim_buf_get_mark(b, '<')
  local e = api.nvim_buf_get_mark(b, '>')
  if s[1] == 0 or e[1] == 0 then
    return nil
  end
  local lines = api.nvim_buf_get_lines(b, s[1] - 1, e[1], false)
  if #lines == 0 then
    return nil
  end
  if vim.fn.visualmode() == 'v' then
    local last = lines[#lines]
    local ecol = math.min(e[2] + 1, #last)
    ecol = ecol + math.max(#vim.fn.matchstr(last:sub(ecol), '^.') - 1, 0) -- whole last character
    lines[#lines] = last:sub(1, ecol)
    lines[1] = lines[1]:sub(s[2] + 1)
  end
  local i = info(b)
  i.startLine, i.endLine = s[1], e[1]
  i.text = table.concat(lines, '\n')
  return i
end

local severities = { 'error', 'warning', 'info', 'hint' }

function M.diagnostics(b)
  b = b or M.source_buf()
  local out = {}
  local path = info(b).path
  for _, d in ipairs(vim.diagnostic.get(b)) do
    out[#out + 1] = { path = path, line = d.lnum + 1, col = d.col + 1, severity = severities[d.severity] or 'error',
      message = d.message, source = d.source }
  end
  return out
end

--- The text of a command range: the visual selection (charwise when it was `v`), else lines.
function M.range_text(line1, line2)
  local s, e = vim.fn.getpos("'<"), vim.fn.getpos("'>")
  if vim.fn.visualmode() == 'v' and s[2] == line1 and e[2] == line2 and s[2] > 0 then
    local lines = api.nvim_buf_get_lines(0, line1 - 1, line2, false)
    local last = lines[#lines] or ''
    local ecol = math.min(e[3], #last)
    ecol = ecol + math.max(#vim.fn.matchstr(last:sub(ecol), '^.') - 1, 0)
    lines[#lines] = last:sub(1, ecol)
    lines[1] = lines[1]:sub(s[3])
    return table.concat(lines, '\n')
  end
  return table.concat(api.nvim_buf_get_lines(0, line1 - 1, line2, false), '\n')
end

--- The references in a prompt: a list of names in the order they appear (each once).
function M.refs(text)
  local found, seen = {}, {}
  for name in text:gmatch('#(%a+)') do
    if vim.tbl_contains(M.REFS, name) and not seen[name] then
      seen[name] = true
      found[#found + 1] = name
    end
  end
  return found
end

--- Expand the references of a prompt into an operate `context` object (nil when there are none).
function M.expand(text, b)
  local refs = M.refs(text)
  if #refs == 0 then
    return nil
  end
  b = b or M.source_buf()
  local ctx = {}
  for _, r in ipairs(refs) do
    local v = M[r](b)
    ctx[r] = v == nil and vim.NIL or v
  end
  return ctx
end

--- A short label for the chat: "#buffer (src/x.py), #selection (src/x.py:3-5)".
function M.describe(ctx)
  local parts = {}
  for _, r in ipairs(M.REFS) do
    local v = ctx and ctx[r]
    if v == vim.NIL and r == 'selection' then -- asked for, but there is none: say so, not nothing
      parts[#parts + 1] = '#selection (none: no visual selection)'
    elseif v and v ~= vim.NIL then
      if r == 'selection' then
        parts[#parts + 1] = ('#selection (%s:%d-%d)'):format(v.path, v.startLine, v.endLine)
      elseif r == 'diagnostics' then
        parts[#parts + 1] = ('#diagnostics (%d)'):format(#v)
      else
        parts[#parts + 1] = ('#buffer (%s)'):format(v.path)
      end
    end
  end
  return table.concat(parts, ', ')
end

return M
