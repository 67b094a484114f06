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
-- Neovims started on the same state directory share the file: each change is made to what the
-- file holds when it is made (read again when another one wrote it since) and written whole to a
-- temporary file renamed over it, holding the file's lock (FILE.lock) from the read to the rename,
-- so that two changes at once are made one after the other and none loses another's turns; a read
-- sees their changes. A change waits up to LOCK_WAIT_MS for another Neovim's lock; a lock older
-- than LOCK_STALE_S seconds was left by one that ended holding it and is taken over.
local M = {}

M.FILE = 'nvim-chat-kept.json'
M.MAX_TURNS = 200
M.MAX_CHARS = 1000000
M.MAX_THOUGHT = 100000
M.CUT = "\n… (cut: the chat keeps the first 100,000 characters of a model's thoughts)"
M.MAX_LOCAL_TURNS = 20
M.MAX_LOCAL_BRANCHES = 30
M.MAX_LOCAL_CHARS = 2000000
M.LOCK_WAIT_MS = 2000
M.LOCK_STALE_S = 5

local entries -- { {key = 'branch@at', thoughts = { {at, text, ms} }, note}, ... }, oldest first
local locals -- { {branch, turns = {record, ...}}, ... }: the branch changed last is the last
local loaded_from -- the file they were read from (false: none, in memory)
local loaded_stamp -- that file as it was when read or written here (see stamp)

local uv = vim.uv or vim.loop

-- The server's state directory as the server uses it: the absolute one it reported at initialize
-- (capabilities.stateDir), else the configured one as the server takes it: a leading `~` (`~user`)
-- expanded, a relative path against the server's working directory (cmd_cwd, else Neovim's).
-- Written as configured (`~/x`), it named `<Neovim's cwd>/~/x` here, while the server used `$HOME/x`.
local function state_dir()
  local server = require('operate_sidecar.server')
  local init = server.state.init_result
  local reported = init and type(init.capabilities) == 'table' and init.capabilities.stateDir
  if type(reported) == 'string' and reported ~= '' then
    return reported
  end
  local dir = server.state_dir()
  if type(dir) ~= 'string' or dir == '' then
    return nil
  end
  -- `~` as the server expands it, from $HOME as it is now (Neovim's own `~` is $HOME when it started)
  local home = (dir == '~' or dir:sub(1, 2) == '~/') and uv.os_homedir()
  if home then
    dir = home .. dir:sub(2)
  elseif not dir:match('^[/~]') then -- relative: to the server's working folder
    local base = require('operate_sidecar.config').values.cmd_cwd or vim.fn.getcwd()
    dir = base:gsub('/+$', '') .. '/' .. dir
  end
  -- absolute, `~user` expanded (a folder that exists gets a trailing slash: not kept)
  return (vim.fn.fnamemodify(dir, ':p'):gsub('(.)/+$', '%1'))
end

local function file()
  local dir = state_dir()
  return dir and (dir .. '/' .. M.FILE) or false
end

-- A stat's mtime as {sec, nsec} (a number in older luv).
local function mtime(st)
  return type(st.mtime) == 'table' and st.mtime or { sec = st.mtime, nsec = 0 }
end

-- What tells whether the file changed since: another Neovim on the same state directory writes
-- it too (each write is a new file renamed over the old one, so a new inode). Of a stat, or of
-- the file at `path` ('none' when there is none).
local function stamp_of(st)
  local t = mtime(st)
  return table.concat({ tostring(st.ino), tostring(st.size), tostring(t.sec), tostring(t.nsec) }, ':')
end

local function stamp(path)
  local st = uv.fs_stat(path)
  return st and stamp_of(st) or 'none'
end

-- A lock older than LOCK_STALE_S (`st`, as seen) taken away: moved to a name of this process
-- first, so that of two Neovims taking over the same stale lock, the one that finds it moved
-- already (a new lock, taken by the first meanwhile) puts that back instead of removing it.
local function take_over(name, st)
  local moved = ('%s.%d.stale'):format(name, vim.fn.getpid())
  if not uv.fs_rename(name, moved) then
    return
  end
  local now = uv.fs_stat(moved)
  if now and now.ino ~= st.ino then
    uv.fs_link(moved, name)
  end
  uv.fs_unlink(moved)
end

-- The lock of the file at `path`: FILE.lock, made only if there is none (another Neovim holds it
-- while it changes the file). Waits for it up to LOCK_WAIT_MS (blocking: the lock is held for one
-- read and write of the file), taking over a stale one. Returns the function that releases it,
-- or nil when it could not be had (held longer, the directory not writable).
local function lock(path)
  local name = path .. '.lock'
  pcall(vim.fn.mkdir, vim.fn.fnamemodify(path, ':h'), 'p')
  local deadline = uv.hrtime() + M.LOCK_WAIT_MS * 1e6
  while true do
    local fd, _, err = uv.fs_open(name, 'wx', 420)
    if fd then
      local mine = uv.fs_fstat(fd)
      uv.fs_close(fd)
      return function()
        local st = uv.fs_stat(name)
        if st and mine and st.ino == mine.ino then -- (not another's, had it been taken over)
          uv.fs_unlink(name)
        end
      end
    end
    if err ~= 'EEXIST' then
      return nil
    end
    local st = uv.fs_stat(name)
    if st and os.time() - mtime(st).sec > M.LOCK_STALE_S then
      take_over(name, st)
    elseif st then
      uv.sleep(2)
    end
    if uv.hrtime() > deadline then
      return nil
    end
  end
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

-- Read the file (a missing or damaged one reads as empty).
local function read(path)
  local turns, kept_locals = {}, {}
  local ok, lines = pcall(vim.fn.readfile, path)
  local decoded, data = false, nil
  if ok then
    decoded, data = pcall(vim.json.decode, table.concat(lines, '\n'))
  end
  if not (decoded and type(data) == 'table') then
    return turns, kept_locals
  end
  for _, e in ipairs(type(data.turns) == 'table' and data.turns or {}) do
    turns[#turns + 1] = valid(e)
  end
  for _, l in ipairs(type(data.locals) == 'table' and data.locals or {}) do
    if type(l) == 'table' and type(l.branch) == 'string' and type(l.turns) == 'table' then
      local records = {}
      for _, r in ipairs(l.turns) do
        records[#records + 1] = valid_local(r)
      end
      kept_locals[#kept_locals + 1] = { branch = l.branch, turns = records }
    end
  end
  return turns, kept_locals
end

-- What is kept, as the file holds it now: read again whenever it changed since it was read or
-- written here (another Neovim on the same state directory wrote it).
local function load()
  local path = file()
  if not path then
    if not entries or loaded_from ~= false then
      entries, locals, loaded_from, loaded_stamp = {}, {}, false, nil
    end
    return entries
  end
  local now = stamp(path)
  if not entries or loaded_from ~= path or loaded_stamp ~= now then
    entries, locals = read(path)
    loaded_from, loaded_stamp = path, now
  end
  return entries
end

-- Written whole to a temporary file of this process, then renamed over the old one (never half a
-- file, and never another Neovim's temporary file).
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
  local tmp = ('%s.%d.tmp'):format(path, vim.fn.getpid())
  local written, result = pcall(vim.fn.writefile, { text }, tmp)
  -- its stamp taken before the rename (which keeps it): after it, the file may be another's already
  local st = written and result == 0 and uv.fs_stat(tmp)
  if st and uv.fs_rename(tmp, path) then
    loaded_stamp = stamp_of(st) -- (this write is no news to read again)
  else
    pcall(uv.fs_unlink, tmp)
  end
end

-- A change: made to what the file holds now (read again if it changed since), then written, the
-- file's lock held all along, so that two Neovims on the same state directory keep each other's
-- turns: each adds its own change only, never an old copy of the whole file. (A change that
-- could not be written, the directory not writable or the lock not had, stays in memory until
-- the file changes.)
local function update(change)
  local path = file()
  local release = path and lock(path)
  local ok, err = pcall(function()
    load()
    change(entries, locals)
    if release then
      save()
    end
  end)
  if release then
    release()
  end
  if not ok then
    error(err, 0)
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
  local cut = {}
  for i, t in ipairs(thoughts) do
    local text = #t.text > M.MAX_THOUGHT and (t.text:sub(1, M.MAX_THOUGHT) .. M.CUT) or t.text
    cut[i] = { at = t.at, text = text, ms = t.ms }
  end
  update(function(list)
    for i = #list, 1, -1 do
      if list[i].key == key then
        table.remove(list, i)
      end
    end
    list[#list + 1] = { key = key, thoughts = cut, note = note }
    local total = 0
    for _, e in ipairs(list) do
      total = total + chars(e)
    end
    while #list > M.MAX_TURNS or (total > M.MAX_CHARS and #list > 1) do
      total = total - chars(table.remove(list, 1))
    end
  end)
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
  update(function(_, all)
    local mine = { branch = branch, turns = {} }
    for i = #all, 1, -1 do
      if all[i].branch == branch then
        mine = table.remove(all, i)
      end
    end
    mine.turns[#mine.turns + 1] = record
    while #mine.turns > M.MAX_LOCAL_TURNS do
      table.remove(mine.turns, 1)
    end
    all[#all + 1] = mine
    while #all > M.MAX_LOCAL_BRANCHES do
      table.remove(all, 1)
    end
    -- the characters: the oldest turns of the branches changed longest ago go first
    local total = 0
    for _, l in ipairs(all) do
      for _, r in ipairs(l.turns) do
        total = total + json_chars(r)
      end
    end
    while total > M.MAX_LOCAL_CHARS and #all > 0 do
      local oldest = all[1]
      if #oldest.turns > 0 then
        total = total - json_chars(table.remove(oldest.turns, 1))
      end
      if #oldest.turns == 0 then
        table.remove(all, 1)
      end
    end
  end)
end

--- Forget what was kept of a deleted branch's turns.
function M.forget(branch)
  local prefix = branch .. '@'
  load()
  local function held()
    for _, e in ipairs(entries) do
      if e.key:sub(1, #prefix) == prefix then
        return true
      end
    end
    for _, l in ipairs(locals) do
      if l.branch == branch then
        return true
      end
    end
    return false
  end
  if not held() then
    return
  end
  update(function(list, all)
    for i = #list, 1, -1 do
      if list[i].key:sub(1, #prefix) == prefix then
        table.remove(list, i)
      end
    end
    for i = #all, 1, -1 do
      if all[i].branch == branch then
        table.remove(all, i)
      end
    end
  end)
end

return M
