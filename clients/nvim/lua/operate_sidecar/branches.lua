-- Branches: the current branch (per tab page or global), new / fork / delete, the picker with
-- names and dates, and the model picker.
local config = require('operate_sidecar.config')
local server = require('operate_sidecar.server')
local util = require('operate_sidecar.util')

local api = vim.api
local is_null, notify = util.is_null, util.notify
local S = server.state

local M = {}

M.names = {} -- branchId -> name (as last listed or created)

local function key()
  if config.values.branch_scope == 'global' then
    return nil
  end
  return api.nvim_get_current_tabpage()
end
M.key = key

--- The current branch (of tab page `k`, default the current one).
function M.current(k)
  k = k or key()
  if k == nil then
    return S.branches.global
  end
  return S.branches.tab[k]
end

function M.set(id, k)
  k = k or key()
  if k == nil then
    S.branches.global = id
  else
    S.branches.tab[k] = id
  end
  util.event('OperateSidecarBranch')
end

function M.forget(id)
  if S.branches.global == id then
    S.branches.global = nil
  end
  for k, v in pairs(S.branches.tab) do
    if v == id then
      S.branches.tab[k] = nil
    end
  end
end

function M.name(id)
  return M.names[id]
end

--- A branch name from the first instruction: its first line, at most 40 characters.
function M.name_from(text)
  if type(text) ~= 'string' then
    return nil
  end
  local line = vim.trim((text:gsub('#%a+', ''):match('[^\n]*') or ''))
  line = line:gsub('%s+', ' ')
  if line == '' then
    return nil
  end
  if util.nchars(line) > 40 then
    line = util.first_chars(line, 39) .. '…'
  end
  return line
end

-- createBranch / forkBranch, then make the new branch current (in the tab that asked).
local function request_new(method, params, cb, k)
  k = k or key()
  server.request_or_notify(method, params, cb, function(res)
    if params.name then
      M.names[res.branchId] = params.name
    end
    M.set(res.branchId, k)
    cb(nil, res.branchId)
  end)
end

--- Create a branch and make it current. cb(err, branchId). params default to config.branch
--- (+ the picked model); `name` names it; current in tab page `k` (default the current one).
function M.new(cb, params, name, k)
  params = util.copy(params or config.values.branch or {})
  if params.chatModel == nil and config.values.model then
    params.chatModel = config.values.model
  end
  if name and params.name == nil then
    params.name = name
  end
  request_new('createBranch', util.as_object(params), cb or function() end, k)
end

--- Fork the current branch (or `id`) and make the fork current. cb(err, branchId).
--- With no current branch there is nothing to fork: refused (nothing is created).
function M.fork(cb, id)
  cb = cb or function() end
  id = id or M.current()
  if not id then
    notify('no branch to fork: there is no current branch (:OperateBranch new starts one, '
      .. ':OperateBranch picks one)', vim.log.levels.WARN)
    return cb({ code = -32012, message = 'no current branch' })
  end
  local name = M.names[id] and (M.names[id] .. ' (fork)') or nil
  local k = key()
  server.request_or_notify('forkBranch', { branchId = id }, cb, function(res)
    M.names[res.branchId] = name
    M.set(res.branchId, k)
    cb(nil, res.branchId)
  end)
end

--- Delete a branch (the current one by default). cb(err).
function M.delete(cb, id)
  cb = cb or function() end
  id = id or M.current()
  if not id then
    notify('no current branch', vim.log.levels.WARN)
    return cb({ code = -32012, message = 'no current branch' })
  end
  local run = S.running
  if run and run.branchId == id and not run.cancel_requested then
    -- its turn goes first: it would run on (and ask, e.g. for a tool) for a branch that is gone,
    -- and no other turn could be sent meanwhile
    server.cancel()
  end
  server.request_or_notify('deleteBranch', { branchId = id }, cb, function()
    M.forget(id)
    M.names[id] = nil
    require('operate_sidecar.chat').forget(id)
    require('operate_sidecar.kept').forget(id) -- (its turns' thoughts and notes)
    notify('deleted branch ' .. (M.label_of(id)))
    cb(nil)
  end)
end

function M.ensure(cb, first_instruction, k)
  local id = M.current(k)
  if id then
    cb(nil, id)
  else
    M.new(cb, nil, M.name_from(first_instruction), k)
  end
end

function M.label_of(id)
  return M.names[id] or id
end

--- The branches of a `listBranches` answer, each with the fields of the types this client reads
--- (a branch id as text, else the entry is left out; a name as text, else none; a time as text,
--- a message count as a number), whatever a server of another version sends.
function M.entries(res)
  local out = {}
  for _, b in ipairs(type(res) == 'table' and type(res.branches) == 'table' and res.branches or {}) do
    if type(b) == 'table' and type(b.branchId) == 'string' and b.branchId ~= '' then
      b.name = type(b.name) == 'string' and b.name or nil
      b.updatedAt = type(b.updatedAt) == 'string' and b.updatedAt or nil
      b.messageCount = tonumber(b.messageCount) or 0
      out[#out + 1] = b
    end
  end
  return out
end

--- List the branches with their last activity: cb(err, list of {branchId, name, messageCount,
--- chatModel, updatedAt}), newest first.
function M.list(cb)
  cb = cb or function() end
  server.request_or_notify('listBranches', nil, cb, function(res)
    local list = M.entries(res)
    local pending = #list
    if pending == 0 then
      return cb(nil, list)
    end
    local function one_done()
      pending = pending - 1
      if pending == 0 then
        table.sort(list, function(a, b)
          return tostring(a.updatedAt or '') > tostring(b.updatedAt or '')
        end)
        cb(nil, list)
      end
    end
    for _, b in ipairs(list) do
      -- a name given here (a fork's) wins over the server's copy
      if M.names[b.branchId] then
        b.name = M.names[b.branchId]
      elseif b.name then
        M.names[b.branchId] = b.name
      end
      if type(b.updatedAt) == 'string' then
        one_done()
      else
        -- the last message's time
        local count = tonumber(b.messageCount) or 0
        server.request('branchMessages', { branchId = b.branchId, offset = math.max(count - 1, 0), limit = 1 },
          function(err, m)
            local msgs = not err and type(m) == 'table' and type(m.messages) == 'table' and m.messages or {}
            local last = type(msgs[#msgs]) == 'table' and msgs[#msgs] or nil
            b.updatedAt = last and type(last.createdAt) == 'string' and last.createdAt or nil
            local c = last and last.kind == 'instruction' and type(last.content) == 'table' and last.content
            -- (not the server's instruction of a turn's later round: that names no branch)
            if c and not b.name and c.instruction ~= require('operate_sidecar.chat').CONTINUATION then
              b.name = M.name_from(c.instruction)
            end
            one_done()
          end)
      end
    end
  end)
end

function M.format(b)
  local cur = b.branchId == M.current() and '● ' or '  '
  local model = is_null(b.chatModel) and '' or (' · ' .. (type(b.chatModel) == 'string' and b.chatModel or 'inline model'))
  return ('%s%s · %s · %d messages%s'):format(cur, b.name or ('branch ' .. b.branchId:sub(1, 8)),
    util.human_time(b.updatedAt), tonumber(b.messageCount) or 0, model)
end

--- Pick a branch with vim.ui.select and open its chat. cb(err, branchId|nil).
function M.pick(cb)
  cb = cb or function() end
  M.list(function(err, list)
    if err then
      return cb(err)
    end
    if #list == 0 then
      notify('no branches yet: send a message in the chat (:OperateChat)')
      return cb(nil, nil)
    end
    vim.ui.select(list, {
      prompt = 'operate-sidecar: branch',
      kind = 'operate_sidecar.branch',
      format_item = M.format,
    }, function(choice)
      if not choice then
        return cb(nil, nil)
      end
      M.set(choice.branchId)
      require('operate_sidecar.chat').open(choice.branchId)
      cb(nil, choice.branchId)
    end)
  end)
end

-- The server's configured models, sorted, to fn(models) once it is ready; a server that cannot
-- start is one error message and fail(err).
local function with_models(fail, fn)
  server.when_ready(function(err)
    if err then
      util.notify_failure(util.error_message('cannot list the models', err), err, vim.log.levels.ERROR)
      return fail(err)
    end
    local models = util.copy(server.models())
    table.sort(models)
    fn(models)
  end)
end

--- Pick the chat model (from the server's configured models). cb(model|nil).
function M.pick_model(cb)
  cb = cb or function() end
  with_models(function() cb(nil) end, function(models)
    local cur = config.values.model
    vim.ui.select(models, {
      prompt = 'operate-sidecar: model',
      kind = 'operate_sidecar.model',
      format_item = function(m)
        return (m == cur and '● ' or '  ') .. m
      end,
    }, function(choice)
      if choice then
        M.set_model(choice)
      end
      cb(choice)
    end)
  end)
end

--- Check that the server knows branch `id`: cb(nil) if so; else a notified error naming the
--- branches it has, and cb(err).
function M.check(id, cb)
  cb = cb or function() end
  server.request_or_notify('listBranches', nil, cb, function(res)
    local lines = {}
    for _, b in ipairs(M.entries(res)) do
      if b.branchId == id then
        return cb(nil)
      end
      local name = M.names[b.branchId] or b.name
      lines[#lines + 1] = '  ' .. b.branchId .. (name and ('  ' .. name) or '')
    end
    local msg = ('unknown branch: %s; %s'):format(id, #lines > 0
      and ('the server\'s branches:\n' .. table.concat(lines, '\n')) or 'the server has no branches')
    notify(msg, vim.log.levels.ERROR)
    cb({ code = -32012, message = msg })
  end)
end

--- Make branch `id` current and open its chat, once the server confirms it exists. cb(err).
function M.switch(id, cb)
  cb = cb or function() end
  local k = key()
  M.check(id, function(err)
    if err then
      return cb(err)
    end
    M.set(id, k)
    require('operate_sidecar.chat').open(id)
    cb(nil)
  end)
end

--- Set the chat model to `name`, one of the server's configured models (else a notified error
--- naming them, and nothing changes). cb(err).
function M.choose_model(name, cb)
  cb = cb or function() end
  with_models(cb, function(models)
    if not vim.tbl_contains(models, name) then
      local msg = ('unknown model: %s; the server\'s models: %s'):format(name,
        #models > 0 and table.concat(models, ', ') or 'none')
      notify(msg, vim.log.levels.ERROR)
      return cb({ code = -32602, message = msg })
    end
    M.set_model(name)
    cb(nil)
  end)
end

function M.set_model(name)
  config.values.model = name
  notify('model ' .. name)
  util.event('OperateSidecarModel')
end

return M
