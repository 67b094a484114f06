-- Context for a chat turn: `#buffer`, `#selection` and `#diagnostics` references in the prompt
-- expand to the text, selection and diagnostics of the buffer the user came from; `#file:<path>`
-- to the text of that file (its buffer's, when it is loaded: unsaved changes included).
local api = vim.api
local util = require('operate_sidecar.util')

local M = {}

M.REFS = { 'buffer', 'selection', 'diagnostics' }
M.MAX_FILE_CHARS = 40000 -- of a `#file:` reference's text (the rest is left out, and it says so)
M.MAX_FILES = 10 -- `#file:` references per prompt

local last_source -- the last ordinary buffer the user was in

local function is_source(b)
  return b and api.nvim_buf_is_valid(b) and vim.bo[b].buftype == '' and not util.buf_var(b, 'operate_sidecar_chat')
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

-- What a reference sends: `text` in i, or, for text that is not UTF-8 (a file in another
-- encoding opened without conversion, or with `++bin`), `error` saying so and no text: it
-- cannot go over the wire (the server reads UTF-8 only), as a binary file's cannot.
M.NOT_UTF8 = 'not UTF-8 text'
local function with_text(i, text)
  if util.utf8_error(text) then
    i.error = M.NOT_UTF8
  else
    i.text = text
  end
  return i
end

function M.buffer(b)
  b = b or M.source_buf()
  return with_text(info(b), table.concat(api.nvim_buf_get_lines(b, 0, -1, false), '\n'))
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
  return with_text(i, table.concat(lines, '\n'))
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

--- The `#file:<path>` references of a prompt (a path with no spaces, or one in double quotes),
--- each once, in order.
function M.file_refs(text)
  local out, seen, at = {}, {}, 1
  while true do
    local s, e = text:find('#file:', at, true)
    if not s then
      return out
    end
    local ref = text:match('^"([^"]+)"', e + 1) or text:match('^([^%s"]%S*)', e + 1)
    at = e + 1
    if ref and not seen[ref] then
      seen[ref] = true
      out[#out + 1] = ref
    end
  end
end

--- How a prompt names the file `path`: `#file:<path>`, in double quotes when it holds white space.
function M.file_ref_text(path)
  return path:find('%s') and ('#file:"%s"'):format(path) or ('#file:' .. path)
end

M.MAX_PICK = 10000 -- files offered by the picker at most

--- The files under the current directory a `#file:` reference may name, for a picker: git's
--- (tracked and untracked, not ignored) in a git work tree, else the files found walking the
--- directory breadth first, hidden ones and `node_modules` left out; MAX_PICK at most (a walk
--- stops there: a home directory is not read whole).
function M.project_files()
  local ok, files = pcall(vim.fn.systemlist, { 'git', 'ls-files', '--cached', '--others', '--exclude-standard' })
  if ok and vim.v.shell_error == 0 and type(files) == 'table' then
    return vim.list_slice(files, 1, M.MAX_PICK)
  end
  local out, dirs, i = {}, { '' }, 1
  while i <= #dirs and #out < M.MAX_PICK do
    local dir = dirs[i]
    i = i + 1
    local handle = vim.loop.fs_scandir(dir == '' and '.' or dir)
    while handle and #out < M.MAX_PICK do
      local name, kind = vim.loop.fs_scandir_next(handle)
      if not name then
        break
      end
      local path = dir == '' and name or (dir .. '/' .. name)
      if name:sub(1, 1) == '.' or name == 'node_modules' then -- (left out)
      elseif kind == 'directory' then
        dirs[#dirs + 1] = path
      elseif kind == 'file' or kind == 'link' then
        out[#out + 1] = path
      end
    end
  end
  table.sort(out)
  return out
end

local recent -- {cwd, files, at}: what recent_files read last
M.RECENT_FILES_MS = 5000
--- project_files(), read again when the last read is older than RECENT_FILES_MS, of another
--- directory, or from before the prompt entered Insert mode: the completion asks for them at each
--- key typed in a `#file:` word.
local function recent_files()
  local cwd, now = vim.loop.cwd(), vim.loop.now()
  if not (recent and recent.cwd == cwd and now - recent.at < M.RECENT_FILES_MS) then
    recent = { cwd = cwd, files = M.project_files(), at = now }
  end
  return recent.files
end

--- What a `#` offers in the prompt's completion (|i_CTRL-X_CTRL-O|), with what each sends.
local OFFERED = {
  { '#file:', 'a file of the project: its path next' },
  { '#buffer', "the buffer's text" },
  { '#selection', 'the last visual selection' },
  { '#diagnostics', "the buffer's diagnostics" },
}
M.MAX_COMPLETE = 100 -- files offered by the completion at most (typing more narrows them)

-- The current line up to the cursor.
local function before_cursor()
  return api.nvim_get_current_line():sub(1, api.nvim_win_get_cursor(0)[2])
end

--- Where the `#` word at the end of `line` (the text before the cursor) begins (a column, from 0):
--- a `#` at the start of the line or after white space, then a reference's name, or `#file:` and a
--- path (bare, or after a double quote). nil: none there.
local function ref_start(line)
  local s = line:find('#file:"[^"]*$') or line:find('#file:[^%s"]*$') or line:find('#%l*$')
  if s and (s == 1 or line:sub(s - 1, s - 1):match('%s')) then
    return s - 1
  end
  return nil
end

--- 'omnifunc' of the chat's prompt (|i_CTRL-X_CTRL-O|): after a `#` (at the start of a line or
--- after white space) the references, after `#file:` (the path bare, or after a double quote) the
--- project's files (project_files) that match what follows, best first (|matchfuzzy()|), the
--- loaded buffers' first when nothing follows; each as its `#file:<path>` (file_ref_text).
function M.omnifunc(findstart, base)
  if findstart == 1 then
    return ref_start(before_cursor()) or -3 -- (no reference before the cursor: the completion stops, saying nothing)
  end
  local query = base:match('^#file:"?(.*)$')
  local items = {}
  if not query then
    for _, o in ipairs(OFFERED) do
      if vim.startswith(o[1], base) then
        items[#items + 1] = { word = o[1], menu = o[2] }
      end
    end
    return items
  end
  local files = recent_files()
  if query ~= '' then
    files = vim.fn.matchfuzzy(files, query)
  else
    local open, first, rest = {}, {}, {}
    for _, b in ipairs(api.nvim_list_bufs()) do
      if api.nvim_buf_is_loaded(b) and api.nvim_buf_get_name(b) ~= '' then
        open[vim.fn.fnamemodify(api.nvim_buf_get_name(b), ':.')] = true
      end
    end
    for _, f in ipairs(files) do
      table.insert(open[f] and first or rest, f)
    end
    files = vim.list_extend(first, rest)
  end
  for i = 1, math.min(#files, M.MAX_COMPLETE) do
    items[i] = { word = M.file_ref_text(files[i]), abbr = files[i], menu = '[file]' }
  end
  return items
end

--- Completion plugins with a menu of their own: with one of them loaded, the prompt's completion
--- does not open by itself (`chat.complete = 'auto'`); their omni source reaches it.
M.COMPLETION_PLUGINS = { 'cmp', 'blink.cmp', 'coq', 'mini.completion' }

--- Whether the prompt's completion opens by itself as a `#` word is typed (`chat.complete`).
function M.completes_by_itself()
  local c = require('operate_sidecar.config').values.chat.complete
  if c == 'auto' then
    for _, p in ipairs(M.COMPLETION_PLUGINS) do
      if package.loaded[p] then
        return false
      end
    end
    return true
  end
  return c == true
end

--- The prompt buffer `pb`'s completion as you type (once per buffer; see completes_by_itself):
--- typing a `#` word opens the menu CTRL-X CTRL-O would, without putting anything in:
--- CTRL-N / CTRL-P or the arrows choose, CTRL-Y or <CR> takes the one chosen, typing on narrows
--- the menu (asked again when nothing in it matches any more: a path matches fuzzily), a word
--- typed whole closes it (<CR> then makes a new line; `#file:` goes on to the files). While the
--- prompt is in Insert mode 'completeopt' is "menuone,noinsert" and 'shortmess' has "c" (no
--- "Pattern not found" at each key); both are the user's again when it leaves Insert mode or the
--- buffer.
function M.complete_as_you_type(pb)
  if util.buf_var(pb, 'operate_sidecar_completes') then
    return
  end
  vim.b[pb].operate_sidecar_completes = true
  local saved -- the user's options while ours are set
  -- the text before the cursor when the menu was last asked for: not asked again for the same
  -- (a completion that found nothing, or was closed with CTRL-E, puts the text back: a change)
  local asked
  -- the buffer's 'changedtick' when Insert mode began: the first TextChangedI can be for a change
  -- made before it (a message put back to edit), which is not typing
  local entered
  local function feed(keys) -- (as typed, not remapped)
    api.nvim_feedkeys(api.nvim_replace_termcodes(keys, true, false, true), 'n', false)
  end
  local function restore()
    if saved then
      vim.o.completeopt, vim.o.shortmess = saved.completeopt, saved.shortmess
      saved = nil
    end
  end
  api.nvim_create_autocmd('InsertEnter', { buffer = pb, callback = function()
    recent = nil -- (the files are read again once per Insert mode: a file made since is offered)
    entered, asked = api.nvim_buf_get_changedtick(pb), nil
    if not saved and M.completes_by_itself() then
      saved = { completeopt = vim.o.completeopt, shortmess = vim.o.shortmess }
      vim.o.completeopt = 'menuone,noinsert'
      vim.o.shortmess = saved.shortmess:gsub('c', '') .. 'c'
    end
  end })
  api.nvim_create_autocmd({ 'InsertLeave', 'BufLeave' }, { buffer = pb, callback = restore })
  api.nvim_create_autocmd('TextChangedI', { buffer = pb, callback = function()
    local before = before_cursor()
    if saved and before ~= asked and api.nvim_buf_get_changedtick(pb) ~= entered and vim.fn.pumvisible() == 0 and ref_start(before) then
      asked = before
      feed('<C-x><C-o>')
    end
  end })
  -- a word typed whole while the menu is open (`#buffer`, a file's whole path), with nothing else
  -- in the menu that goes on from it: the menu closes, so <CR> makes a new line rather than taking
  -- what is there already; `#file:` goes on to the files' menu
  api.nvim_create_autocmd('TextChangedP', { buffer = pb, callback = function()
    local before = before_cursor()
    local s = saved and ref_start(before)
    if not s then
      return
    end
    local base, left, whole = before:sub(s + 1), 0, false
    for _, item in ipairs(vim.fn.complete_info({ 'items' }).items) do
      if vim.startswith(item.word, base) then
        left, whole = left + 1, whole or item.word == base
      end
    end
    if whole and left == 1 then
      asked = before
      feed(base == '#file:' and '<C-e><C-x><C-o>' or '<C-e>')
    end
  end })
end

local function loaded_buf(full)
  for _, b in ipairs(api.nvim_list_bufs()) do
    if api.nvim_buf_is_loaded(b) and api.nvim_buf_get_name(b) == full then
      return b
    end
  end
  return nil
end

--- The file a `#file:` reference names (relative to the current directory, `~` for home), as
--- {path, language?, text, truncated?}: its loaded buffer's text, else the file's, at most
--- MAX_FILE_CHARS characters. A reference that names no readable text file: {path, error}. A
--- reference followed by punctuation (`#file:a.py,`) names the file without it, when only that
--- one exists.
function M.file(ref)
  local function full_of(r)
    return vim.fn.fnamemodify(r, ':p') -- (`:p` expands a leading ~)
  end
  local full = full_of(ref)
  local b = loaded_buf(full)
  local bare = ref:gsub('[%.,;:!%?%)%]}\'"]+$', '')
  if not b and vim.fn.filereadable(full) == 0 and bare ~= '' and bare ~= ref then
    local other = full_of(bare)
    local other_b = loaded_buf(other)
    if other_b or vim.fn.filereadable(other) == 1 then
      full, b = other, other_b
    end
  end
  local out = { path = util.display_path(full) }
  local text
  if b then
    out.language = vim.bo[b].filetype ~= '' and vim.bo[b].filetype or nil
    text = table.concat(api.nvim_buf_get_lines(b, 0, -1, false), '\n')
  elseif vim.fn.isdirectory(full) == 1 then
    out.error = 'a directory, not a file'
    return out
  else
    local f = vim.fn.filereadable(full) == 1 and io.open(full, 'rb') or nil
    if not f then
      out.error = 'not found'
      return out
    end
    text = f:read(M.MAX_FILE_CHARS * 4 + 1) or '' -- (enough bytes for MAX_FILE_CHARS characters)
    local more = f:read(1) ~= nil
    f:close()
    if text:find('\0', 1, true) then
      out.error = 'a binary file'
      return out
    end
    if more then -- (the read may have cut the last character short: that is no fault of the file)
      for _ = 1, 3 do
        local bad = util.utf8_error(text)
        if not bad or bad < #text - 3 then
          break
        end
        text = text:sub(1, #text - 1)
      end
    end
    out.truncated = more or nil
  end
  if util.utf8_error(text) then
    out.error, out.truncated = M.NOT_UTF8, nil
    return out
  end
  if util.nchars(text) > M.MAX_FILE_CHARS then
    text, out.truncated = util.first_chars(text, M.MAX_FILE_CHARS), true
  end
  out.text = text
  return out
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
  local refs, files = M.refs(text), M.file_refs(text)
  if #refs == 0 and #files == 0 then
    return nil
  end
  b = b or M.source_buf()
  local ctx = {}
  for _, r in ipairs(refs) do
    local v = M[r](b)
    ctx[r] = v == nil and vim.NIL or v
  end
  if #files > 0 then
    ctx.files = {}
    local seen = {}
    for _, ref in ipairs(files) do
      local f = #ctx.files < M.MAX_FILES and M.file(ref) -- (beyond that: said, not read)
        or { path = ref, error = ('more than %d #file: references in one message'):format(M.MAX_FILES) }
      if not seen[f.path] then -- (`a.py` and `a.py,` are one file)
        seen[f.path] = true
        ctx.files[#ctx.files + 1] = f
      end
    end
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
      if v.error and r ~= 'diagnostics' then -- (text that cannot be sent: why, as for a #file)
        parts[#parts + 1] = ('#%s (%s: %s)'):format(r, v.path, v.error)
      elseif r == 'selection' then
        parts[#parts + 1] = ('#selection (%s:%d-%d)'):format(v.path, v.startLine, v.endLine)
      elseif r == 'diagnostics' then
        parts[#parts + 1] = ('#diagnostics (%d)'):format(#v)
      else
        parts[#parts + 1] = ('#buffer (%s)'):format(v.path)
      end
    end
  end
  for _, f in ipairs(ctx and type(ctx.files) == 'table' and ctx.files or {}) do
    parts[#parts + 1] = f.error and ('#file (%s: %s)'):format(f.path, f.error)
      or ('#file (%s%s)'):format(f.path, f.truncated and ', cut' or '')
  end
  return table.concat(parts, ', ')
end

return M
