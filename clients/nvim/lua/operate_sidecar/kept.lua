-- What a branch does not hold of the turns the chat ran: a reasoning model's thoughts (the
-- server never records them) and the note of a turn whose rounds the repeat stop ended. Kept by
-- branch and turn (the index of the turn's instruction on the branch) in a file of the server's
-- state directory, so that they come back when the chat is read from the branch again, also after
-- Neovim restarts; in memory only when the server keeps no journal (state_dir = false: its
-- branches are gone when it stops). Bounded: the latest MAX_TURNS turns, at most MAX_CHARS
-- characters of thoughts in all, a stretch of thoughts cut to MAX_THOUGHT (marked CUT).
local M = {}

M.FILE = 'nvim-chat-kept.json'
M.MAX_TURNS = 200
M.MAX_CHARS = 1000000
M.MAX_THOUGHT = 100000
M.CUT = "\n… (cut: the chat keeps the first 100,000 characters of a model's thoughts)"

local entries -- { {key = 'branch@at', thoughts = { {at, text, ms} }, note}, ... }, oldest first
local loaded_from -- the file they were read from (false: none, in memory)

local function file()
  local dir = require('operate_sidecar.server').state_dir()
  return dir and (dir .. '/' .. M.FILE) or false
end

local function chars(e)
  local n = 0
  for _, t in ipairs(e.thoughts) do
    n = n + #t.text
  end
  return n
end

-- A stored entry as it should be (a file written by hand or by another version may hold anything).
local function valid(e)
  if type(e) ~= 'table' or type(e.key) ~= 'string' or type(e.thoughts) ~= 'table' then
    return nil
  end
  local thoughts = {}
  for _, t in ipairs(e.thoughts) do
    if type(t) == 'table' and type(t.text) == 'string' and type(t.at) == 'number' then
      thoughts[#thoughts + 1] = { at = t.at, text = t.text, ms = type(t.ms) == 'number' and t.ms or nil }
    end
  end
  return { key = e.key, thoughts = thoughts, note = type(e.note) == 'string' and e.note or nil }
end

local function load()
  local path = file()
  if entries and loaded_from == path then
    return entries
  end
  entries, loaded_from = {}, path
  if path and vim.loop.fs_stat(path) then
    local ok, lines = pcall(vim.fn.readfile, path)
    local decoded, data = false, nil
    if ok then
      decoded, data = pcall(vim.json.decode, table.concat(lines, '\n'))
    end
    if decoded and type(data) == 'table' and type(data.turns) == 'table' then
      for _, e in ipairs(data.turns) do
        entries[#entries + 1] = valid(e)
      end
    end
  end
  return entries
end

-- Written whole to a temporary file, then renamed over the old one (never half a file).
local function save()
  local path = loaded_from
  if not path then
    return
  end
  local turns = {}
  for i, e in ipairs(entries) do
    turns[i] = { key = e.key, thoughts = e.thoughts, note = e.note }
  end
  local ok, text = pcall(vim.json.encode, { version = 1, turns = turns })
  if not ok then
    return
  end
  pcall(vim.fn.mkdir, vim.fn.fnamemodify(path, ':h'), 'p')
  local tmp = path .. '.tmp'
  if pcall(vim.fn.writefile, { text }, tmp) then
    vim.loop.fs_rename(tmp, path)
  end
end

--- What was kept of the turn whose instruction is message `at` of `branch`: {thoughts, note}, or nil.
function M.get(branch, at)
  local key = branch .. '@' .. tostring(at)
  for _, e in ipairs(load()) do
    if e.key == key then
      return e
    end
  end
  return nil
end

--- Keep `thoughts` ({ {at = the number of the turn's other blocks before it, text, ms} }) and
--- `note` of the turn whose instruction is message `at` of `branch`, as the newest.
function M.put(branch, at, thoughts, note)
  local key = branch .. '@' .. tostring(at)
  local list = load()
  for i = #list, 1, -1 do
    if list[i].key == key then
      table.remove(list, i)
    end
  end
  local cut = {}
  for i, t in ipairs(thoughts) do
    local text = #t.text > M.MAX_THOUGHT and (t.text:sub(1, M.MAX_THOUGHT) .. M.CUT) or t.text
    cut[i] = { at = t.at, text = text, ms = t.ms }
  end
  list[#list + 1] = { key = key, thoughts = cut, note = note }
  local total = 0
  for _, e in ipairs(list) do
    total = total + chars(e)
  end
  while #list > M.MAX_TURNS or (total > M.MAX_CHARS and #list > 1) do
    total = total - chars(table.remove(list, 1))
  end
  save()
end

--- Forget what was kept of a deleted branch's turns.
function M.forget(branch)
  local list, prefix, changed = load(), branch .. '@', false
  for i = #list, 1, -1 do
    if list[i].key:sub(1, #prefix) == prefix then
      table.remove(list, i)
      changed = true
    end
  end
  if changed then
    save()
  end
end

return M
