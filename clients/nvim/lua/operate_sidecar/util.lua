-- Small helpers shared by the modules: notifications, JSON-ish rendering, buffers.
local config = require('operate_sidecar.config')
local api = vim.api

local M = {}

local islist = vim.islist or vim.tbl_islist
M.islist = islist

function M.is_null(v)
  return v == nil or v == vim.NIL
end

function M.notify(msg, level)
  local f = config.values.notify or vim.notify
  f('[operate] ' .. msg, level or vim.log.levels.INFO)
end

function M.event(name)
  if vim.fn.exists('#User#' .. name) == 1 then
    pcall(vim.cmd, 'doautocmd <nomodeline> User ' .. name)
  end
end

-- The helpers below stand in for vim.split, vim.list_extend and vim.tbl_keys on the chat's
-- render path (and in `pretty`), which call them for every line: on nvim 0.7 those go through
-- vim.validate, and under the LuaJIT 2.1.0-beta3 of Debian's 0.7.2 a hot vim.split once failed
-- with valid arguments ("vim/shared.lua:122: opt[string]: expected table, got string": only
-- validate's own type-name table has such an entry, so most likely a miscompiled trace).

--- The lines of a text (split at every "\n"; "" is one empty line).
function M.split_lines(text)
  local lines, i = {}, 1
  while true do
    local j = text:find('\n', i, true)
    if not j then
      lines[#lines + 1] = text:sub(i)
      return lines
    end
    lines[#lines + 1] = text:sub(i, j - 1)
    i = j + 1
  end
end

--- Append the items of list `src` to list `dst`; returns `dst`.
function M.extend(dst, src)
  for _, v in ipairs(src) do
    dst[#dst + 1] = v
  end
  return dst
end

--- The keys of a table (in no particular order).
function M.keys(t)
  local keys = {}
  for k in pairs(t) do
    keys[#keys + 1] = k
  end
  return keys
end

--- `t` as a JSON object: an empty table (or nil) is sent as `{}` (vim.empty_dict()), never `[]`.
function M.as_object(t)
  if t == nil or (type(t) == 'table' and next(t) == nil and getmetatable(t) == nil) then
    return vim.empty_dict()
  end
  return t
end

-- The keywords of a JSON Schema whose value is an object of schemas, one that is a schema, and
-- one that is a list of schemas (`items` may be either, `dependencies` an object of schemas or
-- lists of names).
local SCHEMA_MAPS = { 'properties', 'patternProperties', 'definitions', '$defs', 'dependentSchemas', 'dependencies' }
local SCHEMA_ONE = { 'items', 'additionalItems', 'additionalProperties', 'contains', 'not', 'if', 'then', 'else',
  'propertyNames', 'unevaluatedItems', 'unevaluatedProperties', 'contentSchema' }
local SCHEMA_LISTS = { 'allOf', 'anyOf', 'oneOf', 'prefixItems' }

--- A JSON Schema written as a Lua table, as it must be sent: every empty table where the schema
--- has an object (a schema itself, `properties`, `definitions`/`$defs`, `patternProperties`, ...,
--- at any depth) becomes vim.empty_dict(), so that `{type = 'object', properties = {}}` goes out
--- as `{"type":"object","properties":{}}` and not with `"properties":[]`, which is no schema. Other
--- values (`required`, `enum`, `default`, ...) are left as they are. The table given is not changed.
function M.as_schema(schema)
  if type(schema) ~= 'table' then
    return schema -- (a boolean schema, or nil)
  end
  if next(schema) == nil then
    return getmetatable(schema) == nil and vim.empty_dict() or schema
  end
  local out = {}
  for k, v in pairs(schema) do
    out[k] = v
  end
  setmetatable(out, getmetatable(schema))
  for _, k in ipairs(SCHEMA_MAPS) do
    local map = out[k]
    if type(map) == 'table' then
      local o = {}
      for name, sub in pairs(map) do
        -- (a `dependencies` entry that is a list of property names stays a list)
        o[name] = (k == 'dependencies' and type(sub) == 'table' and next(sub) ~= nil and islist(sub)) and sub
          or M.as_schema(sub)
      end
      out[k] = next(o) == nil and vim.empty_dict() or setmetatable(o, getmetatable(map))
    end
  end
  for _, k in ipairs(SCHEMA_ONE) do
    local sub = out[k]
    if k == 'items' and type(sub) == 'table' and next(sub) ~= nil and islist(sub) then
      local list = {} -- (a list of schemas: one per position)
      for i, item in ipairs(sub) do
        list[i] = M.as_schema(item)
      end
      out[k] = list
    elseif type(sub) == 'table' then
      out[k] = M.as_schema(sub)
    end
  end
  for _, k in ipairs(SCHEMA_LISTS) do
    if type(out[k]) == 'table' then
      local list = {}
      for i, sub in ipairs(out[k]) do
        list[i] = M.as_schema(sub)
      end
      out[k] = list
    end
  end
  return out
end

local function json_scalar(v)
  local s = vim.json.encode(v)
  return (s:gsub('\\/', '/')) -- 0.7's encoder escapes '/'
end

--- Pretty-print a decoded JSON value (keys sorted, two-space indent). Returns a list of lines.
function M.pretty(value)
  local out = {}
  local function walk(v, indent, prefix, suffix)
    local pad = string.rep('  ', indent)
    if v == nil or v == vim.NIL then
      out[#out + 1] = pad .. prefix .. 'null' .. suffix
    elseif type(v) ~= 'table' then
      out[#out + 1] = pad .. prefix .. json_scalar(v) .. suffix
    elseif next(v) == nil then
      local empty = getmetatable(v) == getmetatable(vim.empty_dict()) and '{}' or '[]'
      out[#out + 1] = pad .. prefix .. empty .. suffix
    elseif islist(v) then
      out[#out + 1] = pad .. prefix .. '['
      for i, item in ipairs(v) do
        walk(item, indent + 1, '', i < #v and ',' or '')
      end
      out[#out + 1] = pad .. ']' .. suffix
    else
      out[#out + 1] = pad .. prefix .. '{'
      local keys = M.keys(v)
      table.sort(keys, function(a, b)
        return tostring(a) < tostring(b)
      end)
      for i, k in ipairs(keys) do
        walk(v[k], indent + 1, json_scalar(tostring(k)) .. ': ', i < #keys and ',' or '')
      end
      out[#out + 1] = pad .. '}' .. suffix
    end
  end
  walk(value, 0, '', '')
  -- a multi-line string value stays one JSON line; split anything else the encoder produced
  local lines = {}
  for _, l in ipairs(out) do
    M.extend(lines, M.split_lines(l))
  end
  return lines
end

--- A short one-line form of a value, for headlines.
function M.compact(v, limit)
  if M.is_null(v) then
    return 'null'
  end
  local ok, s = pcall(json_scalar, v)
  s = ok and s or tostring(v)
  limit = limit or 80
  if #s > limit then
    s = s:sub(1, limit - 1) .. '…'
  end
  return s
end

--- Buffer `b`'s variable `name`, or nil (none, or no such buffer). Through the API, not
--- `vim.b[b]`: on 0.7 each `vim.b[b]` makes an accessor through `vim.validate`, and a chat's
--- windows are looked for often (LuaJIT once failed inside it, "invalid type name: 0").
function M.buf_var(b, name)
  local ok, v = pcall(api.nvim_buf_get_var, b, name)
  if ok then
    return v
  end
end

function M.find_buf(name)
  for _, b in ipairs(api.nvim_list_bufs()) do
    if api.nvim_buf_is_valid(b) and api.nvim_buf_get_name(b) == name then
      return b
    end
  end
end

--- A scratch buffer named `name` (reused when it exists).
function M.scratch(name, filetype)
  local b = M.find_buf(name)
  if b then
    return b
  end
  b = api.nvim_create_buf(false, true)
  api.nvim_buf_set_name(b, name)
  vim.bo[b].buftype = 'nofile'
  vim.bo[b].bufhidden = 'hide'
  vim.bo[b].swapfile = false
  vim.bo[b].filetype = filetype or 'operate_sidecar'
  return b
end

--- Replace a buffer's lines even when it is not modifiable.
function M.set_lines(b, first, last, lines)
  local was = vim.bo[b].modifiable
  vim.bo[b].modifiable = true
  local ok, err = pcall(api.nvim_buf_set_lines, b, first, last, false, lines)
  vim.bo[b].modifiable = was
  if not ok then
    error(err)
  end
end

--- Set window w's option `name` for that window only (as :setlocal): `vim.wo[w].x = v` also
--- sets the global value (as :set), which every window opened or file edited later inherits.
--- nvim_set_option_value with scope "local" (0.7+; its `win` key is 0.8+, hence win_call).
function M.set_win_local(w, name, value)
  api.nvim_win_call(w, function()
    api.nvim_set_option_value(name, value, { scope = 'local' })
  end)
end

--- The global value of option `name` (the user's default for new windows).
function M.global_option(name)
  return api.nvim_get_option_value(name, { scope = 'global' })
end

--- The absolute, resolved form of a path (for comparing buffer names with server paths).
function M.norm_path(p)
  if not p or p == '' then
    return p
  end
  local full = vim.fn.fnamemodify(p, ':p')
  local real = (vim.uv or vim.loop).fs_realpath(full)
  return real or full
end

--- The loaded buffer holding `path`, if any (`unloaded`: a buffer of it that is not loaded, after
--- :bdelete say, counts too).
function M.buf_for_path(path, unloaded)
  local want = M.norm_path(path)
  for _, b in ipairs(api.nvim_list_bufs()) do
    if (unloaded or api.nvim_buf_is_loaded(b)) and vim.bo[b].buftype == '' then
      local name = api.nvim_buf_get_name(b)
      if name ~= '' and M.norm_path(name) == want then
        return b
      end
    end
  end
end

--- A path relative to the working directory when it lies inside it.
function M.display_path(path)
  if type(path) ~= 'string' then
    return M.one_line(path)
  end
  return M.one_line(vim.fn.fnamemodify(path, ':~:.'))
end

--- The number of characters (code points) of `s`, and its first `n` characters: as strchars()
--- and strcharpart() count, but for any text, a NUL byte included (a Lua string holding one
--- reaches a Vim function as a Blob: E976, an error in the middle of drawing the chat).
function M.nchars(s)
  return select(2, s:gsub('[^\128-\191]', ''))
end

function M.first_chars(s, n)
  local at, count = 1, 0
  while true do
    local i = s:find('[^\128-\191]', at)
    if not i then
      return s
    end
    if count == n then
      return s:sub(1, i - 1)
    end
    count, at = count + 1, i + 1
  end
end

--- `v` as text on one line (a line break and the blanks around it as one space): a name from
--- the server put in a headline, which a buffer line cannot hold otherwise.
function M.one_line(v)
  return (tostring(v):gsub('%s*[\r\n]+%s*', ' '))
end

--- "HH:MM" today, else "YYYY-MM-DD HH:MM", for an ISO-8601 timestamp (or epoch seconds).
function M.human_time(ts)
  local t
  if type(ts) == 'number' then
    t = ts
  elseif type(ts) == 'string' then
    local y, mo, d, h, mi, s = ts:match('^(%d+)-(%d+)-(%d+)[T ](%d+):(%d+):?(%d*)')
    if y then
      local utc = { year = tonumber(y), month = tonumber(mo), day = tonumber(d), hour = tonumber(h),
        min = tonumber(mi), sec = tonumber(s) or 0, isdst = false }
      -- the timestamps are UTC: shift by the local offset
      local now = os.time()
      local offset = os.difftime(now, os.time(os.date('!*t', now)))
      t = os.time(utc) + offset
    end
  end
  if not t then
    return ''
  end
  if os.date('%Y-%m-%d', t) == os.date('%Y-%m-%d') then
    return os.date('%H:%M', t)
  end
  return os.date('%Y-%m-%d %H:%M', t)
end

--- vim.deepcopy that keeps vim.NIL (a JSON null: a `#selection` there is none of, say). On 0.7
--- vim.deepcopy raises "Cannot deepcopy object of type userdata" on it.
function M.copy(v)
  if type(v) ~= 'table' then
    return v
  end
  local out = {}
  for k, x in pairs(v) do
    out[M.copy(k)] = M.copy(x)
  end
  return setmetatable(out, getmetatable(v))
end

-- ---------------------------------------------------------------- errors in plain words

local rpc = require('operate_sidecar.rpc')
local codes = rpc.codes

--- Where s stops being UTF-8 text (a byte offset, from 0), or nil: see rpc.utf8_error.
M.utf8_error = rpc.utf8_error

-- The server's documented error codes and the plugin's own (rpc.codes), said as a user would:
-- what went wrong, and what to do about it; `detail`: the server's message follows (it carries
-- the useful part: the model's error text, the reason the change was not saved).
M.ERRORS = {
  [codes.branch_not_found] = { 'the branch is gone (deleted, from another editor say, or unknown to the server); '
    .. ':OperateBranch picks another, :OperateBranch new starts one' },
  [codes.model_error] = { 'the model reported an error', detail = true },
  [codes.validation_failed] = { 'the model\'s reply was not in the format asked for', detail = true },
  [codes.store_failed] = { 'the change could not be saved in the state directory, so nothing was changed', detail = true },
  [codes.cancelled] = { 'cancelled' },
  [codes.internal] = { 'the server hit an internal error (a bug: its log, see :checkhealth operate_sidecar, may say more)',
    detail = true },
  [codes.method_not_found] = { 'the server does not know this request (is it an older operate-sidecar? see '
    .. ':checkhealth operate_sidecar)' },
  [codes.not_initialized] = { 'the server is not ready yet; try again' },
  [codes.timeout] = { 'the server did not answer in time' },
}

-- protocol wording the user has no use for, stripped from the front of a server's message
local JARGON = { '^invalid params:%s*', '^invalid request:%s*', '^internal error:?%s*', '^JSON%-RPC[^:]*:%s*' }

local function plain(msg)
  msg = tostring(msg or '')
  local changed = true
  while changed do
    changed = false
    for _, pat in ipairs(JARGON) do
      local rest = msg:gsub(pat, '', 1)
      if rest ~= msg then
        msg, changed = rest, true
      end
    end
  end
  return vim.trim(msg)
end

--- What went wrong, in plain words, for an error answer {code, message, data} (a server's or the
--- plugin's own): the sentence for its code (ERRORS), with the server's message where it carries
--- the detail (the model's error text, the field refused), and no protocol wording.
function M.error_text(err)
  if type(err) ~= 'table' then
    return tostring(err)
  end
  local code, msg = err.code, plain(err.message)
  local data = type(err.data) == 'table' and err.data or {}
  if code == codes.model_error and type(data.refusal) == 'string' and data.refusal ~= '' then
    return 'the model declined the request: ' .. data.refusal
  elseif code == codes.invalid_params then
    -- a model the server does not have (config `model` or `branch.chatModel`, say)
    local name, known = msg:match("unknown model '([^']*)'; configured: (.*)$")
    if name then
      return ('the model %s is not one of the server\'s models (%s); :OperateModel picks one'):format(name, known)
    end
    return msg ~= '' and ('the server refused it: ' .. msg) or 'the server refused it'
  end
  local known = M.ERRORS[code]
  if not known then
    return msg ~= '' and msg or ('error ' .. tostring(code)) -- (the plugin's own: already in plain words)
  end
  return (known.detail and msg ~= '') and (known[1] .. ': ' .. msg) or known[1]
end

--- `what` (what could not be done: 'cannot delete the branch') and why, in plain words.
function M.error_message(what, err)
  return what .. ': ' .. M.error_text(err)
end

-- ---------------------------------------------------------------- the server's end

-- One message per server process that ends: its exit notice (exit_notice, from server.lua's
-- on_exit) says how it ended, what it ended and how to start it again. A request or turn that
-- failed because the process ended (-32099, rpc.exit_error), or because it could not start and
-- the plugin stopped it over that (a start that timed out: err.server_stopped), is not notified
-- as well: its caller notifies through notify_failure (the chat still marks the turn failed,
-- with the same words).

--- Whether the failure err is told by the server's exit notice (the process ended before it
--- answered, or was stopped because of err), so that its caller says nothing more.
function M.told_by_exit(err)
  return type(err) == 'table' and (err.code == codes.server_exited or err.server_stopped == true)
end

--- A duration in ms, for messages: "30 s", "1.5 s".
local function seconds(ms)
  return ('%g s'):format((tonumber(ms) or 0) / 1000)
end

--- Notify `text`, the message of the failure err, at `level`; nothing when the server's exit
--- notice tells it (told_by_exit).
function M.notify_failure(text, err, level)
  if not M.told_by_exit(err) then
    M.notify(text, level)
  end
end

--- The notice of a server process's end: text, level. exit: {code, signal, stopped, abnormal,
--- failure} (server.lua's state.exit; failure: why the plugin stopped a server that could not
--- start, e.g. one that did not answer `initialize` within request_timeout); ctx: {starting (it
--- ended before it was ready), turn (a turn ended with it), tail (the last lines it wrote to the
--- log), printed (the last lines it wrote on stdout that were not messages)}. A server stopped
--- on purpose (:OperateStop) is just that; one stopped because it could not start says why, that
--- it was stopped and what to check; any other end says how (one before it was ready, even with
--- code 0, is a failed start: an error); all say what did not finish and how to start it again.
function M.exit_notice(exit, ctx)
  local signaled = exit.signal ~= nil and exit.signal ~= 0
  local how = signaled and rpc.signal_label(exit.signal) or ('code ' .. tostring(exit.code))
  local failure = exit.failure
  local timed_out = failure ~= nil and failure.code == codes.timeout
  if exit.stopped and not failure then
    return ('server stopped (%s)'):format(how), vim.log.levels.INFO
  end
  local parts
  if timed_out then
    parts = { ('server did not answer within %s (request_timeout) and was stopped'):format(
      seconds(failure.timeout_ms or config.values.request_timeout)) }
  elseif failure then
    parts = { 'server could not start and was stopped: ' .. M.error_text(failure) }
  else
    parts = { exit.abnormal and ('server ' .. rpc.describe_exit(exit.code, exit.signal))
      or ('server stopped (' .. how .. ')') }
    if ctx.starting then
      parts[1] = parts[1] .. ' before it was ready'
    end
  end
  if ctx.turn then
    parts[#parts + 1] = 'the turn did not finish (R in the chat sends it again)'
  end
  if timed_out then
    local cmd = config.values.cmd
    parts[#parts + 1] = ('check that the server command (cmd: %s) starts operate-sidecar'):format(
      type(cmd) == 'table' and table.concat(vim.tbl_map(tostring, cmd), ' ') or tostring(cmd))
  end
  local again = (ctx.starting or failure) and 'tries again' or 'starts the server again'
  parts[#parts + 1] = (config.values.auto_start and 'the next message or :OperateStart ' or ':OperateStart ') .. again
  local text = table.concat(parts, '; ')
  local tail = ctx.tail or {} -- (the caller reads it for an abnormal end or a failed start only)
  if #tail > 0 then
    text = text .. '; its log ends:\n' .. table.concat(tail, '\n')
  end
  local printed = ctx.printed or {}
  if #printed > 0 then
    text = text .. (#tail > 0 and '\n' or '; ') .. 'it printed (not the protocol):\n' .. table.concat(printed, '\n')
  end
  -- a start that failed (the server ended by itself before it was ready, or was stopped because
  -- it could not start) is an error; an end of a server that ran, a warning
  local level = (failure or (exit.abnormal and ctx.starting)) and vim.log.levels.ERROR
    or exit.abnormal and vim.log.levels.WARN or vim.log.levels.INFO
  return text, level
end

return M
