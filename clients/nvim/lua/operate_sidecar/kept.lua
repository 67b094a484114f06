-- What a branch does not hold of the turns the chat ran: a reasoning model's thoughts (the
-- server never records them) and the note of a turn whose rounds the repeat stop ended. Kept by
-- branch and turn (the index of the turn's instruction on the branch) in a file of the server's
-- state directory, so that they come back when the chat is read from the branch again, also after
-- Neovim restarts; in memory only when the server keeps no journal (state_dir = false: its
-- branches are gone when it stops). Bounded: the latest MAX_TURNS turns, at most MAX_CHARS
-- characters of thoughts in all, a stretch of thoughts cut to MAX_THOUGHT (marked CUT).
-- Also the turns that failed or were stopped (`locals`, by branch): the branch holds none of one
-- that ended before its first round did, and of one that ended later not how it ended; the chat
-- puts them back where they were. Bounded: the latest MAX_LOCAL_TURNS of a branch, of the
-- MAX_LOCAL_BRANCHES branches changed last, at most MAX_LOCAL_CHARS characters (as JSON) in all.
local M = {}

M.FILE = 'nvim-chat-kept.json'
M.MAX_TURNS = 200
M.MAX_CHARS = 1000000
M.MAX_THOUGHT = 100000
M.CUT = "\n… (cut: the chat keeps the first 100,000 characters of a model's thoughts)"
M.MAX_LOCAL_TURNS = 20
M.MAX_LOCAL_BRANCHES = 30
M.MAX_LOCAL_CHARS = 2000000

local entries -- { {key = 'branch@at', thoughts = { {at, text, ms} }, note}, ... }, oldest first
local locals -- { {branch, turns = {record, ...}}, ... }: the branch changed last is the last
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

-- A stored failed or stopped turn as it should be (see M.put_local), or nil.
local function valid_local(r)
  if type(r) ~= 'table' or type(r.at) ~= 'number' or type(r.user) ~= 'string'
    or (r.status ~= 'error' and r.status ~= 'cancelled') then
    return nil
  end
  local out = { at = r.at, user = r.user, status = r.status, blocks = {} }
  for _, f in ipairs({ 'error', 'time', 'ctx_label', 'ctx_earlier', 'model', 'note' }) do
    out[f] = type(r[f]) == 'string' and r[f] or nil
  end
  if type(r.recorded) == 'boolean' then
    out.recorded = r.recorded
  end
  out.context = type(r.context) == 'table' and r.context or nil
  out.params = type(r.params) == 'table' and r.params or nil
  for _, b in ipairs(type(r.blocks) == 'table' and r.blocks or {}) do
    if type(b) == 'table' and (b.kind == 'text' or b.kind == 'thought') and type(b.raw) == 'string' then
      out.blocks[#out.blocks + 1] = { kind = b.kind, raw = b.raw, ms = type(b.ms) == 'number' and b.ms or nil }
    elseif type(b) == 'table' and b.kind == 'card' and type(b.card) == 'table' and type(b.card.tool) == 'string' then
      out.blocks[#out.blocks + 1] = { kind = 'card', card = b.card }
    end
  end
  return out
end

local function load()
  local path = file()
  if entries and loaded_from == path then
    return entries
  end
  entries, locals, loaded_from = {}, {}, path
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
    for _, l in ipairs(decoded and type(data) == 'table' and type(data.locals) == 'table' and data.locals or {}) do
      if type(l) == 'table' and type(l.branch) == 'string' and type(l.turns) == 'table' then
        local turns = {}
        for _, r in ipairs(l.turns) do
          turns[#turns + 1] = valid_local(r)
        end
        locals[#locals + 1] = { branch = l.branch, turns = turns }
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
  local ok, text = pcall(vim.json.encode, { version = 1, turns = turns, locals = locals })
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

--- The failed and stopped turns kept of `branch`, oldest first (the records M.put_local took).
function M.locals(branch)
  load()
  for _, l in ipairs(locals) do
    if l.branch == branch then
      return l.turns
    end
  end
  return {}
end

local function json_chars(v)
  local ok, text = pcall(vim.json.encode, v)
  return ok and #text or 0
end

--- Keep a turn of `branch` that failed or was stopped, as its newest: a record {at (the branch's
--- message count when it began), user, status ('error' / 'cancelled'), recorded? (its first
--- rounds are on the branch), error?, time?, ctx_label?, ctx_earlier?, model?, note?, context?,
--- params?, blocks = { {kind = 'text' / 'thought', raw, ms?} / {kind = 'card', card} }}.
function M.put_local(branch, record)
  load()
  local mine = { branch = branch, turns = {} }
  for i = #locals, 1, -1 do
    if locals[i].branch == branch then
      mine = table.remove(locals, i)
    end
  end
  mine.turns[#mine.turns + 1] = record
  while #mine.turns > M.MAX_LOCAL_TURNS do
    table.remove(mine.turns, 1)
  end
  locals[#locals + 1] = mine
  while #locals > M.MAX_LOCAL_BRANCHES do
    table.remove(locals, 1)
  end
  -- the characters: the oldest turns of the branches changed longest ago go first
  local total = 0
  for _, l in ipairs(locals) do
    for _, r in ipairs(l.turns) do
      total = total + json_chars(r)
    end
  end
  while total > M.MAX_LOCAL_CHARS and #locals > 0 do
    local oldest = locals[1]
    if #oldest.turns > 0 then
      total = total - json_chars(table.remove(oldest.turns, 1))
    end
    if #oldest.turns == 0 then
      table.remove(locals, 1)
    end
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
  for i = #locals, 1, -1 do
    if locals[i].branch == branch then
      table.remove(locals, i)
      changed = true
    end
  end
  if changed then
    save()
  end
end

return M
