-- The chat: per branch a markdown transcript buffer (your messages, the model's prose as it
-- streams, folded tool cards, a usage line per turn) shown in a reusable side window, and a
-- prompt buffer in a small window below it; <CR> (normal mode) or <C-s> sends, <C-c> cancels.
-- The prompt is a buffer of its own so that streamed updates never touch its undo history.
local config = require('operate_sidecar.config')
local server = require('operate_sidecar.server')
local branches = require('operate_sidecar.branches')
local context = require('operate_sidecar.context')
local util = require('operate_sidecar.util')
local kept = require('operate_sidecar.kept')

local api = vim.api
local is_null, notify = util.is_null, util.notify

local M = {}

M.PROMPT = '## You  (<CR> send · <C-c> cancel · #buffer #selection #diagnostics)'
M.CARD = '  │ ' -- prefix of a tool card's folded detail lines
M.THOUGHT = '  ┊ ' -- prefix of the folded lines of a reasoning model's thoughts
M.THOUGHTS = '_thoughts_' -- the headline above them (while they stream, or when they took under a second)
M.clock = function() -- milliseconds, for how long a model thought (a test may replace it)
  return vim.loop.hrtime() / 1e6
end

--- The headline above a stretch of thoughts: how long the model thought once it is over
--- (`_thought for 12 s_`), else `_thoughts_`.
function M.thoughts_headline(ms)
  if type(ms) == 'number' and ms >= 1000 then
    return ('_thought for %d s_'):format(math.floor(ms / 1000 + 0.5))
  end
  return M.THOUGHTS
end
M.RETRY_HINT = '_R retry · gi edit and resend_' -- under a turn that failed or was stopped
M.REPEAT_LIMIT = 3 -- a turn's rounds stop after this many in a row of the same calls all failing the same way
M.PROMPT_HEIGHT = 3 -- lines of the prompt window (config chat.prompt_height)
-- the instruction of a turn's every round after the first (fixed by the protocol, §11)
M.CONTINUATION = 'Continue the same task. The results of the tools you called are above. If the task needs '
  .. 'more tool calls, make them now; if it is done, give your final answer and call no tool.'

local by_buf = {} -- transcript buffer -> chat
local chats = {} -- key (branchId, or 'new:<n>') -> chat
M.chats = chats
local new_seq = 0
local running_turn -- {chat, turn} of the turn in flight

-- ---------------------------------------------------------------- prose from replies

local SKIP = { action_requests = true, action_responses = true, action_required = true }
local PROSE = { answer = true, text = true, response = true, content = true, message = true, summary = true,
  explanation = true, reply = true }

local SIMPLE_ESCAPES = { n = '\n', t = '\t', r = '', b = '', f = '', ['"'] = '"', ['\\'] = '\\', ['/'] = '/' }

local function utf8_char(cp)
  if cp < 0x80 then
    return string.char(cp)
  elseif cp < 0x800 then
    return string.char(0xC0 + math.floor(cp / 0x40), 0x80 + cp % 0x40)
  elseif cp < 0x10000 then
    return string.char(0xE0 + math.floor(cp / 0x1000), 0x80 + math.floor(cp / 0x40) % 0x40, 0x80 + cp % 0x40)
  end
  return string.char(0xF0 + math.floor(cp / 0x40000), 0x80 + math.floor(cp / 0x1000) % 0x40,
    0x80 + math.floor(cp / 0x40) % 0x40, 0x80 + cp % 0x40)
end

--- The text of a JSON string body (between the quotes), in one pass: `\\` is a backslash (so
--- `\\u00e9` stays as written), a `\u` surrogate pair is one character, a lone surrogate is
--- U+FFFD. `partial`: the body was cut by the stream, so an escape cut at its end is dropped
--- (a high surrogate at the end waits for its pair).
local function decode_escapes(s, partial)
  local out, i, n = {}, 1, #s
  while i <= n do
    local j = s:find('\\', i, true)
    if not j then
      out[#out + 1] = s:sub(i)
      break
    end
    out[#out + 1] = s:sub(i, j - 1)
    local c = s:sub(j + 1, j + 1)
    if c == '' then -- a backslash at the very end: the rest of the escape has not come yet
      break
    elseif c == 'u' then
      local hex = s:match('^%x%x%x%x', j + 2)
      if not hex then
        if partial and not s:find('[^%x]', j + 2) then
          break -- \u and fewer than 4 digits at the end: cut by the stream
        end
        out[#out + 1] = utf8_char(0xFFFD) -- a malformed escape
        i = j + 2
      else
        local cp = tonumber(hex, 16)
        i = j + 6
        if cp >= 0xD800 and cp <= 0xDBFF then
          local lo = s:match('^\\u(%x%x%x%x)', i)
          local low = lo and tonumber(lo, 16)
          if low and low >= 0xDC00 and low <= 0xDFFF then
            cp = 0x10000 + (cp - 0xD800) * 0x400 + (low - 0xDC00)
            i = i + 6
          elseif partial and (i > n or s:sub(i) == '\\' or (s:match('^\\u%x*$', i) and n - i < 5)) then
            break -- its low half has not come yet
          else
            cp = 0xFFFD
          end
        elseif cp >= 0xDC00 and cp <= 0xDFFF then
          cp = 0xFFFD
        end
        out[#out + 1] = utf8_char(cp)
      end
    else
      out[#out + 1] = SIMPLE_ESCAPES[c] or c
      i = j + 2
    end
  end
  return table.concat(out)
end
M.decode_escapes = decode_escapes

--- The prose fields of a (possibly incomplete) JSON object reply, in order: {{key, text}}.
--- Returns nil when the text is not a JSON object.
function M.json_prose_fields(raw)
  local s = raw:match('^%s*```[%w_-]*%s*\n(.*)$') or raw
  local start = s:find('^%s*{')
  if not start then
    return nil
  end
  local fields = {}
  local stack, key_of = {}, {}
  local expect_key, cur_key = false, nil
  local i, n = s:find('{', 1, true), #s
  while i <= n do
    local c = s:sub(i, i)
    if c == '{' then
      stack[#stack + 1] = 'o'
      key_of[#stack] = cur_key
      expect_key = true
    elseif c == '[' then
      stack[#stack + 1] = 'a'
      key_of[#stack] = cur_key
      expect_key = false
    elseif c == '}' or c == ']' then
      stack[#stack] = nil
      if #stack == 0 then
        break
      end
    elseif c == ':' then
      expect_key = false
    elseif c == ',' then
      expect_key = stack[#stack] == 'o'
    elseif c == '"' then
      local j = i + 1
      while j <= n do
        local d = s:sub(j, j)
        if d == '\\' then
          j = j + 2
        elseif d == '"' then
          break
        else
          j = j + 1
        end
      end
      local body = s:sub(i + 1, math.min(j - 1, n))
      local str = decode_escapes(body, j > n) -- j > n: the string was cut by the stream
      if expect_key and stack[#stack] == 'o' then
        if #stack == 1 then
          cur_key = str
        end
      elseif #stack == 1 and cur_key and not SKIP[cur_key] then
        fields[#fields + 1] = { cur_key, str }
      elseif #stack == 2 and key_of[2] == 'reason' and stack[2] == 'o' then
        fields[#fields + 1] = { 'reason', str }
      end
      i = j
    end
    i = i + 1
  end
  return fields
end

local function field_lines(key, text)
  if PROSE[key] then
    return util.split_lines(text)
  elseif key == 'reason' then
    return { '_reasoning: ' .. text:gsub('\n', ' ') .. '_' }
  end
  local lines = util.split_lines(text)
  lines[1] = ('**%s:** %s'):format(key, lines[1])
  return lines
end

--- Markdown lines for streamed reply text: prose fields of a JSON reply, else the text itself.
function M.stream_lines(raw)
  local fields = M.json_prose_fields(raw)
  if not fields then
    return util.split_lines(raw)
  end
  local out = {}
  for _, f in ipairs(fields) do
    if #out > 0 then
      out[#out + 1] = ''
    end
    util.extend(out, field_lines(f[1], f[2]))
  end
  return out
end

local function scalar_text(v)
  if type(v) == 'string' then
    return v
  elseif is_null(v) then
    return '—'
  end
  return tostring(v)
end

-- A value as a markdown bullet tree (never JSON).
local function tree(v, indent, out)
  local pad = string.rep('  ', indent)
  if type(v) ~= 'table' then
    out[#out + 1] = pad .. '- ' .. scalar_text(v):gsub('\n', ' ')
    return
  end
  if util.islist(v) then
    for _, item in ipairs(v) do
      if type(item) == 'table' then
        out[#out + 1] = pad .. '-'
        tree(item, indent + 1, out)
      else
        out[#out + 1] = pad .. '- ' .. scalar_text(item):gsub('\n', ' ')
      end
    end
    return
  end
  local keys = util.keys(v)
  table.sort(keys)
  for _, k in ipairs(keys) do
    local item = v[k]
    if type(item) == 'table' then
      out[#out + 1] = pad .. '- ' .. k .. ':'
      tree(item, indent + 1, out)
    else
      out[#out + 1] = pad .. '- ' .. k .. ': ' .. scalar_text(item):gsub('\n', ' ')
    end
  end
end

--- Markdown lines for an operate result (`{result, kind, model}`): prose, never raw JSON.
function M.result_lines(result)
  if type(result) ~= 'table' then
    return {}
  end
  local r = result.result
  if type(r) == 'string' then
    return M.stream_lines(r)
  elseif type(r) ~= 'table' then
    return is_null(r) and {} or { scalar_text(r) }
  end
  if util.islist(r) then
    local out = {}
    tree(r, 0, out)
    return out
  end
  local keys = util.keys(r)
  table.sort(keys, function(a, b)
    local pa, pb = PROSE[a] and 0 or (a == 'reason' and 2 or 1), PROSE[b] and 0 or (b == 'reason' and 2 or 1)
    if pa ~= pb then
      return pa < pb
    end
    return a < b
  end)
  local out = {}
  for _, k in ipairs(keys) do
    local v = r[k]
    if not SKIP[k] and not is_null(v) then
      if #out > 0 then
        out[#out + 1] = ''
      end
      if type(v) == 'string' then
        util.extend(out, field_lines(k, v))
      elseif k == 'reason' and type(v) == 'table' and type(v.content) == 'string' then
        util.extend(out, field_lines('reason', v.content))
      elseif type(v) == 'table' then
        out[#out + 1] = ('**%s:**'):format(k)
        tree(v, 0, out)
      else
        out[#out + 1] = ('**%s:** %s'):format(k, scalar_text(v))
      end
    end
  end
  return out
end

-- ---------------------------------------------------------------- tool cards

-- (settling: the server stopped waiting for the user's answer by itself; "timed out" once the
-- server is seen to go on, "server exited ..." if it was going away)
local ICONS = { running = '…', waiting = '?', ok = '✓', error = '✗', denied = '⊘', cancelled = '⊘',
  timedout = '⊘', gone = '⊘', settling = '…' }
-- what a card's headline says after its summary, by status
local STATUS_NOTE = { denied = ' (denied)', cancelled = ' (cancelled)', timedout = ' (timed out)',
  waiting = ' (waiting for you: ga accept · gr reject)' }

--- The status of a call from its recorded output: ok, error, denied or timedout.
local function status_of_output(out)
  if type(out) ~= 'table' or out.error == nil then
    return 'ok'
  elseif out.error == 'denied by governance gate' then
    return type(out.reason) == 'string' and out.reason:find('timed out', 1, true) and 'timedout' or 'denied'
  end
  return 'error'
end

local function card_summary(card)
  local args = card.arguments
  local parts = {}
  if type(args) == 'table' then
    if type(args.path) == 'string' then
      parts[#parts + 1] = util.display_path(args.path)
    else
      local keys = util.keys(args)
      table.sort(keys)
      for _, k in ipairs(keys) do
        if type(args[k]) ~= 'table' then
          parts[#parts + 1] = scalar_text(args[k]):gsub('\n', ' ')
        end
      end
    end
  end
  local out = card.output
  if type(out) == 'table' and tonumber(out.added) and tonumber(out.removed) then
    parts[#parts + 1] = ('+%d −%d'):format(out.added, out.removed)
  elseif card.stats then
    parts[#parts + 1] = card.stats
  end
  local s = table.concat(parts, ' ')
  if util.nchars(s) > 60 then
    s = util.first_chars(s, 59) .. '…'
  end
  return s
end

function M.card_headline(card)
  local line = ('%s %s'):format(ICONS[card.status] or '•', util.one_line(card.tool))
  local s = card_summary(card)
  if s ~= '' then
    line = line .. ' ' .. s
  end
  if STATUS_NOTE[card.status] then
    line = line .. STATUS_NOTE[card.status]
  elseif card.status == 'gone' then -- the server ended while the call waited or ran
    line = line .. ' (server ' .. (card.gone or 'stopped') .. ')'
  elseif card.status == 'error' and type(card.error) == 'string' then
    line = line .. ' — ' .. card.error:gsub('\n.*', '')
  end
  return line
end

local function card_lines(card)
  local lines = { M.card_headline(card) }
  local detail = {}
  if type(card.arguments) == 'table' and next(card.arguments) ~= nil then
    detail[#detail + 1] = 'arguments:'
    for _, l in ipairs(util.pretty(card.arguments)) do
      detail[#detail + 1] = '  ' .. l
    end
  elseif type(card.argsSummary) == 'string' then
    detail[#detail + 1] = 'arguments: ' .. card.argsSummary
  end
  local out = card.output
  if type(out) == 'table' and type(out.diff) == 'string' then
    detail[#detail + 1] = 'diff:'
    for _, l in ipairs(util.split_lines((out.diff:gsub('\n$', '')))) do
      detail[#detail + 1] = '  ' .. l
    end
  elseif out ~= nil then
    detail[#detail + 1] = 'output:'
    if type(out) == 'string' then
      for _, l in ipairs(util.split_lines(out)) do
        detail[#detail + 1] = '  ' .. l
      end
    else
      for _, l in ipairs(util.pretty(out)) do
        detail[#detail + 1] = '  ' .. l
      end
    end
  elseif type(card.resultSummary) == 'string' then
    detail[#detail + 1] = 'output: ' .. card.resultSummary
  end
  if type(card.error) == 'string' then
    detail[#detail + 1] = 'error: ' .. card.error
  end
  for _, d in ipairs(detail) do
    -- (a summary or error from the server may hold newlines: the buffer takes no such line)
    for _, l in ipairs(util.split_lines(d)) do
      lines[#lines + 1] = M.CARD .. l
    end
  end
  return lines
end

--- The note under a turn whose rounds the server stopped because the model kept making the same
--- failing calls (`repeated`): which call and its error (the last round's first), and what to do.
function M.repeat_note(result)
  local r = type(result.result) == 'table' and result.result or {}
  local responses = type(r.action_responses) == 'table' and r.action_responses or {}
  local first = type(responses[1]) == 'table' and responses[1] or {}
  local out = type(first.output) == 'table' and first.output or {}
  local what = ''
  if type(out.error) == 'string' and type(first['function']) == 'string' then
    local err = vim.split(out.error, '\n', { plain = true })[1]:sub(1, 200):gsub('%.$', '')
    what = (' (%s: %s)'):format(first['function'], err)
  end
  return ('Stopped: the model made the same failing tool call%s%s %d rounds in a row, so another round would '
    .. 'not help. Rephrase the request, or choose another model.'):format(#responses > 1 and 's' or '', what,
    M.REPEAT_LIMIT)
end

-- ---------------------------------------------------------------- what a running turn does

-- A running turn's `$/progress` reports, as far as they tell what it does (turn.activity): the
-- phase of the last report ('repair': a `parse` report of a repair turn: the reply did not match
-- the response format and the model is asked again), the repair attempt, and the model round. The
-- wire has no round number: a `request` report after tool calls ran begins the next round.
-- max_rounds: what the turn's operate was sent (nil: not known).
M.WORKING = 'working…'
M.WAITING = 'waiting for your decision'
local DOING = { request = 'waiting for the model…', thinking = 'thinking…', stream = 'writing…',
  parse = 'reading the reply…', actions = 'running tools…' }

--- The activity after a report of `phase` with `message` (changed in place; returned).
function M.activity_step(a, phase, message)
  if phase == 'request' then
    if a.tools_ran then
      a.round, a.tools_ran = (a.round or 1) + 1, nil
    end
    a.phase, a.attempt = 'request', nil
  elseif phase == 'stream' or phase == 'thinking' then
    a.phase = phase
  elseif phase == 'parse' then
    local n = type(message) == 'string' and tonumber(message:match('^repair attempt%s+(%d+)')) or nil
    if n then
      a.phase, a.attempt = 'repair', n
    else
      a.phase = 'parse'
    end
  elseif phase == 'actions' then
    a.phase, a.tools_ran = 'actions', true
  end -- (a phase not known here: what it showed stays)
  return a
end

--- What a running turn does, in words: what it waits for or does, and from the second round on
--- which round ("round 2 of up to 8 · waiting for the model…").
function M.activity_text(a)
  if type(a) ~= 'table' then
    return M.WORKING
  end
  local what = DOING[a.phase]
  if a.phase == 'repair' then
    what = ('the reply was not in the expected format: asking the model again (attempt %d)…'):format(a.attempt or 1)
  end
  if not what then
    return M.WORKING
  end
  local round = tonumber(a.round) or 1
  if round < 2 then
    return what
  end
  local max = tonumber(a.max_rounds)
  return ('round %d%s · %s'):format(round, max and max > 1 and (' of up to %d'):format(max) or '', what)
end

-- The status line of a running turn: a call waiting for the user's decision, else what it does.
local function running_text(turn)
  for _, card in pairs(turn.cards or {}) do
    if card.status == 'waiting' then
      return M.WAITING
    end
  end
  return M.activity_text(turn.activity)
end

--- The status line of the turn in flight (nil when none runs): for a statusline (status().activity).
function M.activity()
  return running_turn and running_text(running_turn.turn) or nil
end

-- ---------------------------------------------------------------- turns

local function usage_line(turn)
  local parts = {}
  if turn.elapsed_ms then
    parts[#parts + 1] = ('%.1f s'):format(turn.elapsed_ms / 1000)
  end
  local u = turn.usage
  if type(u) == 'table' then
    local inp, outp = tonumber(u.inputTokens), tonumber(u.outputTokens)
    if inp or outp then
      parts[#parts + 1] = ('%s in · %s out tokens'):format(inp or '?', outp or '?')
    end
    if tonumber(u.contextTokens) then
      parts[#parts + 1] = ('context %d'):format(u.contextTokens)
    end
    if tonumber(u.modelCalls) then
      parts[#parts + 1] = ('%d model call%s'):format(u.modelCalls, u.modelCalls == 1 and '' or 's')
    end
  end
  if tonumber(turn.rounds) and turn.rounds > 1 then
    parts[#parts + 1] = ('%d rounds'):format(turn.rounds)
  end
  if #parts == 0 then
    return nil
  end
  return '_' .. table.concat(parts, ' · ') .. '_'
end

-- A card's lines, made again only when what they show changed (a turn of hundreds of calls
-- gets an event per call: its other cards are not laid out again for each).
local CARD_FIELDS = { 'status', 'tool', 'arguments', 'output', 'argsSummary', 'resultSummary', 'error', 'stats',
  'gone' }
local function cached_card_lines(card)
  local memo = card.memo
  if memo then
    local same = true
    for i, f in ipairs(CARD_FIELDS) do
      if memo[i] ~= card[f] then
        same = false
        break
      end
    end
    if same then
      return memo.lines
    end
  end
  memo = { lines = card_lines(card) }
  for i, f in ipairs(CARD_FIELDS) do
    memo[i] = card[f]
  end
  card.memo = memo
  return memo.lines
end

-- `text` with a code fence it leaves open closed at its end: an open fence would take in the
-- rest of the document (every turn after it). CommonMark's fences: 3 or more ` or ~, indented
-- by 3 spaces at most, closed by a run of the same character at least as long.
local function fences_closed(text)
  local open_char, open_len
  for line in (text .. '\n'):gmatch('(.-)\n') do
    local indent, char = line:match('^( *)([`~])')
    local runs = char == '`' and '`+' or '~+'
    local run = char and #indent <= 3 and line:match('^ *(' .. runs .. ')')
    if run and #run >= 3 then
      if not open_char then
        open_char, open_len = char, #run
      elseif char == open_char and #run >= open_len and line:match('^ *' .. runs .. '%s*$') then
        open_char = nil
      end
    end
  end
  return open_char and (text .. '\n' .. string.rep(open_char, open_len)) or text
end

-- A text block's lines, made again only when its text changed. A reply with CRLF line ends shows
-- no ^M (the CR is no part of a line), and once the block is complete (its round or turn ended)
-- a code fence it leaves open is closed, as the export closes it: it would take in all below.
local function cached_text_lines(blk)
  local closed = blk.closed == true
  if blk.memo and blk.memo_raw == blk.raw and blk.memo_final == blk.final and blk.memo_closed == closed then
    return blk.memo
  end
  local lines = {}
  for i, l in ipairs(blk.final or M.stream_lines(blk.raw)) do
    lines[i] = l:sub(-1) == '\r' and l:sub(1, -2) or l
  end
  if closed then
    local text = table.concat(lines, '\n'):gsub('\n+$', '') -- (the fence right after its last line)
    local shut = fences_closed(text)
    if shut ~= text then
      lines = util.split_lines(shut)
    end
  end
  blk.memo, blk.memo_raw, blk.memo_final, blk.memo_closed = lines, blk.raw, blk.final, closed
  return blk.memo
end

-- A text block's lines as the transcript shows them, nil when it shows none (empty text).
local function shown_text(blk)
  local body = cached_text_lines(blk)
  return (#body > 1 or (body[1] or '') ~= '') and body or nil
end

-- A thought block's lines (each with its prefix), made again only when its text changed.
local function cached_thought_lines(blk)
  if blk.memo and blk.memo_raw == blk.raw then
    return blk.memo
  end
  local out = {}
  for _, l in ipairs(util.split_lines(vim.trim(blk.raw))) do
    out[#out + 1] = M.THOUGHT .. l
  end
  blk.memo, blk.memo_raw = out, blk.raw
  return out
end

--- The lines of a turn, and the set of indices of its card detail lines (the folded ones).
local function turn_lines(turn)
  local lines, details = {}, {}
  if turn.user then
    lines[#lines + 1] = '## You' .. (turn.time and (' · ' .. turn.time) or '')
    util.extend(lines, util.split_lines(turn.user))
    if turn.ctx_label and turn.ctx_label ~= '' and turn.ctx_earlier then -- (sent again without it)
      lines[#lines + 1] = ('_%s: in the %s turn above, not sent again_'):format(turn.ctx_label, turn.ctx_earlier)
    elseif turn.ctx_label and turn.ctx_label ~= '' then
      lines[#lines + 1] = '_with ' .. turn.ctx_label .. '_'
    end
    lines[#lines + 1] = ''
  end
  lines[#lines + 1] = '## Assistant' .. (turn.model and (' · ' .. turn.model) or '')
  for _, blk in ipairs(turn.blocks) do
    if blk.kind == 'text' then
      local body = shown_text(blk)
      if body then
        util.extend(lines, body)
        lines[#lines + 1] = ''
      end
    elseif blk.kind == 'thought' then
      -- a reasoning model's thoughts: a headline, and the text folded under it (zo opens it)
      lines[#lines + 1] = M.thoughts_headline(blk.ms)
      for _, l in ipairs(cached_thought_lines(blk)) do
        lines[#lines + 1] = l
        details[#lines] = true
      end
      lines[#lines + 1] = ''
    else
      for i, l in ipairs(cached_card_lines(blk.card)) do
        lines[#lines + 1] = l
        if i > 1 then
          details[#lines] = true
        end
      end
      lines[#lines + 1] = ''
    end
  end
  if turn.status == 'running' then
    -- (its last line: what it does now; only this line is written again when that changes)
    lines[#lines + 1] = '_' .. running_text(turn) .. '_'
    lines[#lines + 1] = ''
  elseif turn.status == 'cancelled' then
    lines[#lines + 1] = '_cancelled_'
    lines[#lines + 1] = M.RETRY_HINT
    lines[#lines + 1] = ''
  elseif turn.status == 'error' then
    lines[#lines + 1] = '**error:** ' .. tostring(turn.error):gsub('\n', ' ')
    lines[#lines + 1] = M.RETRY_HINT
    lines[#lines + 1] = ''
  end
  if turn.note then
    lines[#lines + 1] = '_' .. turn.note .. '_'
    lines[#lines + 1] = ''
  end
  local u = turn.status ~= 'running' and usage_line(turn)
  if u then
    lines[#lines + 1] = u
    lines[#lines + 1] = ''
  end
  return lines, details
end

-- ---------------------------------------------------------------- the buffer

local function chat_title(chat)
  local name = chat.branch and branches.name(chat.branch) or nil
  return '# ' .. (name or (chat.branch and ('branch ' .. chat.branch:sub(1, 8)) or 'new chat'))
end

-- Edit the transcript buffer (not modifiable for the user; it keeps no undo history).
local function edit(chat, fn)
  local b = chat.buf
  local bo = vim.bo[b] -- (one accessor: on 0.7 each vim.bo[b] goes through vim.validate)
  local was = bo.modifiable
  bo.modifiable = true
  local ok, err = pcall(fn, b)
  bo.modifiable = was
  bo.modified = false
  if not ok then
    error(err)
  end
end

-- Keep the end of the transcript in view in its windows (not in the one the user is in).
local function follow(chat)
  local b = chat.buf
  local cur = api.nvim_get_current_win()
  local last = api.nvim_buf_line_count(b)
  for _, w in ipairs(api.nvim_list_wins()) do
    if w ~= cur and api.nvim_win_get_buf(w) == b then
      pcall(api.nvim_win_set_cursor, w, { last, 0 })
    end
  end
end

-- Is this chat buffer still ours: valid, loaded and marked? (`:bdelete` unloads a buffer and
-- clears its variables and mappings; `:bwipeout` makes it invalid.)
local function usable(b)
  if b == nil or not api.nvim_buf_is_valid(b) or not api.nvim_buf_is_loaded(b) then
    return false
  end
  return util.buf_var(b, 'operate_sidecar_chat') == true
end

--- The editor was resized: in each transcript window (but the one the user is in) the end of the
--- chat fills the window again (a window made tiny had scrolled its last line to the top, and
--- 0.7 kept it there once the window was large again: an empty-looking chat).
function M.on_resize()
  local cur = api.nvim_get_current_win()
  for _, w in ipairs(api.nvim_list_wins()) do
    local b = api.nvim_win_get_buf(w)
    if w ~= cur and by_buf[b] and usable(b) then
      local last = api.nvim_buf_line_count(b)
      pcall(api.nvim_win_set_cursor, w, { last, 0 })
      pcall(api.nvim_win_call, w, function()
        vim.cmd('normal! zb') -- the last line at the bottom: the window full of the chat's end
      end)
    end
  end
end

-- What the chat buffers were written (read by the tests): renders that changed lines, lines written.
M.stats = { renders = 0, lines_written = 0 }

-- Draw a turn again: only the lines that changed since it was last drawn are written (the
-- whole turn, hundreds of cards, for each tool event made a long turn slow to show).
local function render_turn(chat, turn)
  if not usable(chat.buf) then
    return -- the transcript was deleted: the turns are kept and drawn again when it is rebuilt
  end
  local lines, details = turn_lines(turn)
  local old = turn.lines
  local n_old, n_new = turn.nlines, #lines
  if not old or #old ~= n_old then
    old = {} -- (not known: all of it is written)
  end
  local p, s = 0, 0 -- lines the same at the start, at the end
  if #old == n_old and n_old > 0 then
    while p < n_old and p < n_new and old[p + 1] == lines[p + 1] do
      p = p + 1
    end
    while s < n_old - p and s < n_new - p and old[n_old - s] == lines[n_new - s] do
      s = s + 1
    end
  end
  -- (before the lines change: the folds are computed from this as they change)
  turn.details = details
  if p == n_old and p == n_new then
    turn.lines = lines
    return -- nothing changed
  end
  edit(chat, function(b)
    -- turns sit right above the prompt header (the last line): count back from it
    local last = api.nvim_buf_line_count(b) - 1
    for i = #chat.turns, 1, -1 do
      local t = chat.turns[i]
      if t == turn then
        break
      end
      last = last - t.nlines
    end
    local first = last - n_old
    local changed = {}
    for i = p + 1, n_new - s do
      changed[#changed + 1] = lines[i]
    end
    turn.nlines, turn.lines = n_new, lines
    api.nvim_buf_set_lines(b, first + p, last - s, false, changed)
    M.stats.renders = M.stats.renders + 1
    M.stats.lines_written = M.stats.lines_written + #changed
  end)
  follow(chat)
  util.event('OperateSidecarChat')
end
M.render_turn = render_turn

--- 'foldexpr' of the chat window: 1 on a tool card's detail lines (known from the rendered
--- turns, so reply text that looks like them is never folded), else 0.
function M.foldexpr(lnum)
  local chat = by_buf[api.nvim_get_current_buf()]
  if not chat then
    return 0
  end
  local row = lnum - 2 -- below the title and its blank line: the turns, in order
  for _, t in ipairs(chat.turns) do
    if row <= t.nlines then
      return (row >= 1 and t.details and t.details[row]) and 1 or 0
    end
    row = row - t.nlines
  end
  return 0
end

M.KEYS_BUF = 'operate://keys'

--- A float listing the chat's keys in buffer `b` (its mappings of this plugin, with what each
--- does), normal mode's then insert mode's; `q`, `<Esc>` or `g?` closes it.
function M.show_keys(b)
  local rows = {}
  for _, mode in ipairs({ 'n', 'i' }) do
    local mine = {}
    for _, m in ipairs(api.nvim_buf_get_keymap(b, mode)) do
      local desc = type(m.desc) == 'string' and m.desc:match('^operate%-sidecar: (.*)$')
      if desc then
        mine[#mine + 1] = { (mode == 'i' and 'insert ' or '') .. m.lhs, desc }
      end
    end
    table.sort(mine, function(x, y)
      return x[1] < y[1]
    end)
    vim.list_extend(rows, mine)
  end
  local width = 0
  for _, r in ipairs(rows) do
    width = math.max(width, vim.fn.strdisplaywidth(r[1]))
  end
  local lines = { ('Keys of the %s (q closes)'):format(util.buf_var(b, 'operate_sidecar_prompt') and 'prompt' or 'chat'), '' }
  for _, r in ipairs(rows) do
    lines[#lines + 1] = r[1] .. string.rep(' ', width - vim.fn.strdisplaywidth(r[1]) + 2) .. r[2]
  end
  local kb = util.scratch(M.KEYS_BUF, 'operate_sidecar')
  util.set_lines(kb, 0, -1, lines)
  vim.bo[kb].modifiable = false
  local w = 0
  for _, l in ipairs(lines) do
    w = math.max(w, vim.fn.strdisplaywidth(l))
  end
  w = math.min(w + 1, math.max(vim.o.columns - 4, 1))
  local h = math.min(#lines, math.max(vim.o.lines - 6, 1))
  local win = api.nvim_open_win(kb, true, { relative = 'editor', style = 'minimal', border = 'rounded', zindex = 50,
    width = w, height = h, row = math.max(math.floor((vim.o.lines - h) / 2) - 1, 0),
    col = math.max(math.floor((vim.o.columns - w) / 2), 0) })
  local function close()
    if api.nvim_win_is_valid(win) then
      api.nvim_win_close(win, true)
    end
  end
  for _, key in ipairs({ 'q', '<Esc>', 'g?' }) do
    vim.keymap.set('n', key, close, { buffer = kb, nowait = true })
  end
  api.nvim_create_autocmd('WinLeave', { buffer = kb, once = true, callback = close }) -- (no float left behind)
  return win
end

local function set_keymaps(chat, b)
  local function map(modes, lhs, fn, desc)
    vim.keymap.set(modes, lhs, fn, { buffer = b, desc = 'operate-sidecar: ' .. desc })
  end
  map('n', '<CR>', function()
    M.send(chat)
  end, 'send the prompt')
  map({ 'n', 'i' }, '<C-s>', function()
    M.send(chat)
  end, 'send the prompt')
  map({ 'n', 'i' }, '<C-c>', function()
    M.cancel(chat)
  end, 'cancel the running turn')
  local decisions = { ga = 'allow_once', gA = 'allow_always', gr = 'deny_once', gR = 'deny_always' }
  for lhs, decision in pairs(decisions) do
    map('n', lhs, function()
      require('operate_sidecar.permission').answer(decision)
    end, decision .. ' (the waiting tool call)')
  end
  map('n', 'gp', function()
    require('operate_sidecar.permission').focus()
  end, 'show the waiting permission request / diff')
  map('n', 'gb', function()
    branches.pick()
  end, 'pick a branch')
  map('n', 'g?', function()
    M.show_keys(b)
  end, "show the chat's keys")
  map('n', 'gm', function()
    branches.pick_model()
  end, 'pick a model')
  if b == chat.prompt_buf then
    map('i', '<C-f>', function()
      M.attach(chat)
    end, 'attach a file (#file:<path>, picked)')
  end
  if b == chat.buf then -- (the transcript is read-only: these keys edit nothing there)
    map('n', 'R', function()
      M.retry(chat, M.turn_at(chat, api.nvim_win_get_cursor(0)[1]))
    end, 'send the failed or stopped turn (under the cursor, else the last) again')
    map('n', 'gi', function()
      M.edit_again(chat, M.turn_at(chat, api.nvim_win_get_cursor(0)[1]))
    end, "put the turn's message (under the cursor, else the last) in the prompt")
    map('n', ']]', function()
      M.jump_turn(chat, vim.v.count1)
    end, 'the next turn')
    map('n', '[[', function()
      M.jump_turn(chat, -vim.v.count1)
    end, 'the turn before')
    map('n', 'gy', function()
      M.yank_code(chat, api.nvim_win_get_cursor(0)[1], vim.v.register)
    end, "yank the code block under the cursor (else the turn's last)")
    map('n', 'gY', function()
      M.yank_reply(chat, api.nvim_win_get_cursor(0)[1], vim.v.register)
    end, 'yank the reply of the turn under the cursor (else the last)')
  else -- the prompt: <Up> on its first line, <Down> on its last, go through the messages sent
    for lhs, step in pairs({ ['<Up>'] = -1, ['<Down>'] = 1 }) do
      vim.keymap.set({ 'n', 'i' }, lhs, function()
        local row = api.nvim_win_get_cursor(0)[1]
        if row ~= (step < 0 and 1 or api.nvim_buf_line_count(b)) then
          return lhs -- (not at that edge: the cursor moves as usual)
        end
        return ('<Cmd>lua require("operate_sidecar.chat").recall(%d)<CR>'):format(step)
      end, { buffer = b, expr = true, desc = 'operate-sidecar: ' .. (step < 0 and 'an earlier' or 'a later')
        .. ' message sent (on the first / last line)' })
    end
  end
end

-- Make (or make again) a chat's transcript and prompt buffers. A chat whose buffers were
-- deleted (`:bdelete`, `:bwipeout`) keeps its turns: they are drawn again, the running one too.
-- Draw the transcript of a chat whole: its title, each of its turns, the prompt header.
local function draw_whole(chat)
  edit(chat, function(b)
    api.nvim_buf_set_lines(b, 0, -1, false, { chat_title(chat), '', M.PROMPT })
  end)
  for _, t in ipairs(chat.turns) do
    t.nlines, t.lines = 0, nil -- none is drawn yet: each goes above the prompt header, after those before it
  end
  for _, t in ipairs(chat.turns) do
    render_turn(chat, t)
  end
end

local function create(chat)
  local key = chat.branch or chat.key
  local name = 'operate://chat/' .. key
  if chat.buf then
    by_buf[chat.buf] = nil
  end
  local b = util.find_buf(name) or api.nvim_create_buf(false, true)
  vim.fn.bufload(b) -- (one unloaded by :bdelete is loaded again, empty)
  api.nvim_buf_set_name(b, name)
  vim.bo[b].buftype = 'nofile'
  vim.bo[b].bufhidden = 'hide'
  vim.bo[b].swapfile = false
  vim.bo[b].undolevels = -1
  vim.bo[b].filetype = 'markdown'
  vim.bo[b].modifiable = false
  vim.b[b].operate_sidecar_chat = true
  vim.b[b].operate_sidecar_branch = chat.branch
  chat.buf = b
  chat.turns = chat.turns or {}
  by_buf[b] = chat
  draw_whole(chat)
  -- `:e` / `:e!` in the transcript would read a file of its name (there is none) and leave it
  -- empty: it is drawn again whole instead, from the turns the chat holds
  api.nvim_create_autocmd('BufReadCmd', {
    group = api.nvim_create_augroup('operate_sidecar_chat_' .. b, { clear = true }),
    buffer = b,
    callback = function()
      local c = by_buf[b]
      if c and c.buf == b then
        draw_whole(c)
      end
    end,
  })
  local pname = 'operate://prompt/' .. key
  local pb = util.find_buf(pname)
  if not pb then
    pb = api.nvim_create_buf(false, true)
    api.nvim_buf_set_name(pb, pname)
  end
  vim.fn.bufload(pb)
  vim.bo[pb].buftype = 'nofile'
  vim.bo[pb].bufhidden = 'hide'
  vim.bo[pb].swapfile = false
  vim.bo[pb].filetype = 'markdown'
  vim.bo[pb].omnifunc = "v:lua.require'operate_sidecar.context'.omnifunc" -- (# references, #file: paths)
  require('operate_sidecar.context').complete_as_you_type(pb)
  vim.b[pb].operate_sidecar_chat = true
  vim.b[pb].operate_sidecar_prompt = true
  vim.b[pb].operate_sidecar_branch = chat.branch
  chat.prompt_buf = pb
  set_keymaps(chat, b)
  set_keymaps(chat, pb)
  return chat
end

local function new_turn(chat, turn)
  turn.blocks = turn.blocks or {}
  turn.cards = turn.cards or {}
  turn.nlines, turn.lines = 0, nil
  chat.turns[#chat.turns + 1] = turn
  render_turn(chat, turn)
  return turn
end

function M.set_title(chat)
  if chat.buf and api.nvim_buf_is_valid(chat.buf) then
    edit(chat, function(b)
      api.nvim_buf_set_lines(b, 0, 1, false, { chat_title(chat) })
    end)
  end
end

-- What a turn showed that its branch does not hold, to keep (kept.lua): its stretches of
-- thoughts, each with the number of the turn's other blocks before it.
local function thoughts_of(turn)
  local out, at = {}, 0
  for _, blk in ipairs(turn.blocks) do
    if blk.kind ~= 'thought' then
      at = at + 1
    elseif vim.trim(blk.raw) ~= '' then
      out[#out + 1] = { at = at, text = blk.raw, ms = blk.ms }
    end
  end
  return out
end

-- A turn read from the branch (`turn`) with what was kept of it: each stretch of thoughts before
-- the block it came before (after the last, when the branch holds fewer), and its note.
local function put_back(turn, k)
  if not k then
    return
  end
  local blocks, next_t = {}, 1
  local function thought(t)
    blocks[#blocks + 1] = { kind = 'thought', raw = t.text, ms = t.ms, closed = true }
  end
  for i, blk in ipairs(turn.blocks) do
    while next_t <= #k.thoughts and k.thoughts[next_t].at <= i - 1 do
      thought(k.thoughts[next_t])
      next_t = next_t + 1
    end
    blocks[#blocks + 1] = blk
  end
  for j = next_t, #k.thoughts do
    thought(k.thoughts[j])
  end
  turn.blocks = blocks
  turn.note = turn.note or k.note
end

-- What kept.lua keeps of a turn that failed or was stopped besides what it showed (its blocks):
-- where it began, how it ended, and what a Retry sends (its message, context, model, parameters).
local LOCAL_FIELDS = { 'at', 'recorded', 'user', 'status', 'error', 'time', 'ctx_label', 'ctx_earlier', 'model', 'note',
  'context', 'params' }

-- A turn that failed or was stopped, as kept.lua keeps it (kept.put_local).
local function local_record(turn)
  local blocks = {}
  for _, blk in ipairs(turn.blocks) do
    if (blk.kind == 'text' or blk.kind == 'thought') and vim.trim(blk.raw or '') ~= '' then
      blocks[#blocks + 1] = { kind = blk.kind, raw = blk.raw, ms = blk.ms }
    elseif blk.kind == 'card' then
      local card = { callId = blk.card.callId }
      for _, f in ipairs(CARD_FIELDS) do
        card[f] = blk.card[f]
      end
      blocks[#blocks + 1] = { kind = 'card', card = card }
    end
  end
  local rec = { blocks = blocks }
  for _, f in ipairs(LOCAL_FIELDS) do
    rec[f] = turn[f]
  end
  return rec
end

-- A kept failed or stopped turn (`rec`) put back in a chat read from its branch (`loaded`: the
-- turns read, each with `at`, where its instruction is): when the branch holds its first rounds,
-- that turn, with how it ended; else a turn of its own, where it was: before the first turn read
-- that began after it (or at the same place: the branch holds nothing of it).
local function put_back_local(chat, loaded, rec)
  if rec.recorded ~= false then
    for _, t in ipairs(loaded) do
      if t.at == rec.at and t.user == rec.user and t.status == 'done' then
        t.status, t.error, t.recorded, t.note = rec.status, rec.error, true, t.note or rec.note
        t.ctx_label, t.ctx_earlier, t.context, t.model, t.params = rec.ctx_label, rec.ctx_earlier, rec.context,
          rec.model, rec.params
        return
      end
    end
  end
  local turn = { branch = chat.branch, kept_local = true, blocks = {}, cards = {}, nlines = 0 }
  for _, f in ipairs(LOCAL_FIELDS) do
    turn[f] = rec[f]
  end
  for _, kept_block in ipairs(rec.blocks) do
    local b = vim.deepcopy(kept_block) -- (the turn's own: drawing it caches its lines in it, never stored)
    b.closed = b.kind == 'thought' or nil
    if b.kind == 'card' then
      turn.cards[b.card.callId or #turn.blocks] = b.card
    end
    turn.blocks[#turn.blocks + 1] = b
  end
  local pos = #chat.turns + 1
  for i, t in ipairs(chat.turns) do
    if t.at and (t.at > rec.at or (t.at == rec.at and not t.kept_local)) then
      pos = i
      break
    end
  end
  table.insert(chat.turns, pos, turn) -- (drawn with the others: render_turn places it by the turns after it)
end

-- A branch's messages from `offset` on, every page of them (the server sends at most 1000 at
-- a time): cb(err, messages, next_offset).
local function fetch_messages(branch, offset, cb)
  local out = {}
  local function page(from)
    server.request('branchMessages', { branchId = branch, offset = from, limit = 1000 }, function(err, res)
      if err or type(res) ~= 'table' then
        return cb(err or { message = 'no messages' })
      end
      local msgs = type(res.messages) == 'table' and res.messages or {}
      util.extend(out, msgs)
      local total = tonumber(res.total) or (from + #msgs)
      if #msgs > 0 and from + #msgs < total then
        return page(from + #msgs)
      end
      cb(nil, out, from + #msgs)
    end)
  end
  page(offset or 0)
end
M.fetch_messages = fetch_messages

-- Rebuild a chat's transcript from the branch's messages (a branch from the journal or picker).
local function load_history(chat, cb)
  fetch_messages(chat.branch, 0, function(err, messages, seen)
    if err then
      return cb and cb(err)
    end
    chat.seen = seen -- (the messages read so far: a turn's cards are filled from there on)
    local turn
    local loaded = {}
    for i, m in ipairs(messages) do
      m = type(m) == 'table' and m or {} -- (an item that is no message: nothing to show, still counted)
      local c = type(m.content) == 'table' and m.content or {}
      if m.kind == 'instruction' and turn and c.instruction == M.CONTINUATION then
        turn.rounds = (turn.rounds or 1) + 1 -- the server's next round of that turn, not yours
      elseif m.kind == 'instruction' then
        if not branches.name(chat.branch) then
          branches.names[chat.branch] = branches.name_from(c.instruction)
        end
        turn = new_turn(chat, { user = is_null(c.instruction) and '' or tostring(c.instruction),
          time = util.human_time(m.createdAt), status = 'done', branch = chat.branch, at = i - 1 })
        loaded[#loaded + 1] = turn
      elseif turn and m.kind == 'assistant_response' and type(c.text) == 'string' then
        local lines = M.stream_lines(c.text)
        local ok, decoded = pcall(vim.json.decode, c.text)
        if ok and type(decoded) == 'table' then
          lines = M.result_lines({ result = decoded })
        end
        turn.blocks[#turn.blocks + 1] = { kind = 'text', raw = c.text, final = lines }
      elseif turn and m.kind == 'action_response' then
        local out = c.output
        local status = status_of_output(out)
        local card = { callId = c.callId, tool = c['function'], arguments = c.arguments, output = out,
          status = status, error = status == 'error' and tostring(out.error) or nil }
        turn.cards[c.callId or #turn.blocks] = card
        turn.blocks[#turn.blocks + 1] = { kind = 'card', card = card }
      end
    end
    for _, t in ipairs(loaded) do
      put_back(t, kept.get(chat.branch, t.at))
    end
    for _, rec in ipairs(kept.locals(chat.branch)) do
      put_back_local(chat, loaded, rec)
    end
    for _, t in ipairs(chat.turns) do
      render_turn(chat, t)
    end
    M.set_title(chat)
    if cb then
      cb(nil)
    end
  end)
end

--- The chat of a branch (created when missing; nil branch = a new, unbound chat).
local function intact(chat)
  return chat ~= nil and usable(chat.buf) and usable(chat.prompt_buf)
    -- (emptied some other way than by `:e`, which draws it again: its title is gone)
    and (api.nvim_buf_get_lines(chat.buf, 0, 1, false)[1] or ''):sub(1, 2) == '# '
end

-- Read a chat's history from its branch; M.loaded waits for it. A read that failed (the server
-- down, the branch gone) is tried again by the next M.get of a chat that has no turns yet.
local function read_history(chat)
  chat.waiting, chat.history_failed = chat.waiting or {}, nil
  load_history(chat, function(err)
    chat.history_failed = err
    local waiting = chat.waiting or {}
    chat.waiting = nil
    for _, fn in ipairs(waiting) do
      local ok, e = pcall(fn, err)
      if not ok then
        notify(tostring(e), vim.log.levels.ERROR)
      end
    end
  end)
end

function M.get(branch)
  local key = branch or ('new:' .. api.nvim_get_current_tabpage())
  local known = chats[key]
  if known and known.history_failed and not known.waiting and #known.turns == 0 then
    read_history(known)
  end
  if intact(known) then
    return known, false
  elseif known then -- its buffers were deleted: rebuilt from the turns it holds
    create(known)
    return known, false
  end
  local chat
  if branch then
    chat = { key = branch, branch = branch }
  else
    local k = key
    new_seq = new_seq + 1
    chat = { key = k, branch = nil, seq = new_seq }
  end
  create(chat)
  chats[chat.key] = chat
  if branch then
    read_history(chat) -- (whoever asks first: a chat of a branch is never left without its past)
  end
  return chat, true
end

--- How long a send or an export waits for a chat's history still being read (ms).
M.HISTORY_WAIT_MS = 10000

--- Call fn(err) once the chat's history is read from its branch (at once when it is, or when its
--- read failed: err says why). With `ms`: fn({ timeout = ms }) if it has not come by then (a
--- server alive but not answering), and not again when it comes.
function M.loaded(chat, fn, ms)
  if not chat.waiting then
    return fn(chat.history_failed)
  end
  local done = false
  local function once(err)
    if not done then
      done = true
      fn(err)
    end
  end
  chat.waiting[#chat.waiting + 1] = once
  if ms then
    vim.defer_fn(function()
      once({ timeout = ms })
    end, ms)
  end
end

-- Rename buffer b. Renaming leaves an unlisted buffer of the old name behind (as `:file` does,
-- for the alternate file): it goes, so that no `operate://chat/new:N` piles up.
local function rename(b, name)
  local old = api.nvim_buf_get_name(b)
  pcall(api.nvim_buf_set_name, b, name)
  local left = old ~= '' and old ~= name and util.find_buf(old)
  if left and left ~= b and not api.nvim_buf_is_loaded(left) then
    pcall(api.nvim_buf_delete, left, { force = true })
  end
end

local function bind(chat, branch)
  if chat.branch == branch then
    return
  end
  chats[chat.key] = nil
  chat.branch, chat.key = branch, branch
  chat.seen = nil -- (another branch: none of its messages read yet)
  chats[branch] = chat
  vim.b[chat.buf].operate_sidecar_branch = branch
  rename(chat.buf, 'operate://chat/' .. branch)
  if api.nvim_buf_is_valid(chat.prompt_buf) then
    vim.b[chat.prompt_buf].operate_sidecar_branch = branch
    rename(chat.prompt_buf, 'operate://prompt/' .. branch)
  end
  M.set_title(chat)
end

function M.forget(branch)
  local chat = chats[branch]
  chats[branch] = nil
  if chat then
    by_buf[chat.buf] = nil
    for _, b in ipairs({ chat.buf, chat.prompt_buf }) do
      if b and api.nvim_buf_is_valid(b) then
        pcall(api.nvim_buf_delete, b, { force = true })
      end
    end
  end
end

-- The chat's window options, set window-locally (util.set_win_local): `vim.wo[w].x = v` sets
-- the global value too (as :set does), and a file then opened with :edit in the chat window (or
-- a window split off it, the review's tab say) got the chat's folds and concealing.
M.WIN_OPTIONS = {
  { 'wrap', true }, { 'linebreak', true }, { 'number', false }, { 'relativenumber', false },
  { 'signcolumn', 'no' }, { 'foldmethod', 'expr' },
  { 'foldexpr', "v:lua.require'operate_sidecar.chat'.foldexpr(v:lnum)" },
  { 'foldtext', "'  │ ⋯ '.(v:foldend-v:foldstart+1).' lines (zo to open)'" },
  { 'foldlevel', 0 }, { 'foldminlines', 0 }, { 'foldenable', true }, { 'conceallevel', 2 },
  { 'statusline', " %<%{luaeval('require(\"operate_sidecar\").statusline()')}" },
  { 'fillchars', 'fold: ' },
}
M.PROMPT_WIN_OPTIONS = {
  { 'wrap', true }, { 'linebreak', true }, { 'number', false }, { 'relativenumber', false },
  { 'signcolumn', 'no' }, { 'foldenable', false }, { 'winfixheight', true },
  { 'statusline', ' prompt · <CR> send · <C-s> send · <C-c> cancel' },
}

local function win_options(w)
  for _, o in ipairs(M.WIN_OPTIONS) do
    pcall(util.set_win_local, w, o[1], o[2])
  end
end

local function prompt_win_options(w)
  for _, o in ipairs(M.PROMPT_WIN_OPTIONS) do
    pcall(util.set_win_local, w, o[1], o[2])
  end
end

local function find_win(want)
  for _, w in ipairs(api.nvim_tabpage_list_wins(0)) do
    local b = api.nvim_win_get_buf(w)
    if util.buf_var(b, 'operate_sidecar_chat') and want(b) then
      return w
    end
  end
end

--- The window of the current tab that shows a chat transcript, if any.
function M.window()
  return find_win(function(b)
    return not util.buf_var(b, 'operate_sidecar_prompt')
  end)
end

--- The window of the current tab that shows a chat prompt, if any.
function M.prompt_window()
  return find_win(function(b)
    return util.buf_var(b, 'operate_sidecar_prompt') == true
  end)
end

--- Show a chat in the side window (reused): the transcript, and the prompt in a small window
--- below it; the cursor goes to the prompt unless `stay`.
function M.show(chat, stay)
  context.track()
  local prev = api.nvim_get_current_win()
  local w, pw = M.window(), M.prompt_window()
  if not w and pw then -- only the prompt window is left: the transcript goes back above it
    api.nvim_set_current_win(pw)
    vim.cmd('aboveleft split')
    w = api.nvim_get_current_win()
  elseif not w then
    local pos, size = config.values.chat.position, config.values.chat.size
    local cmd = ({ right = 'botright vsplit', left = 'topleft vsplit', bottom = 'botright split',
      top = 'topleft split' })[pos] or 'botright vsplit'
    vim.cmd(cmd)
    w = api.nvim_get_current_win()
    if pos == 'bottom' or pos == 'top' then
      api.nvim_win_set_height(w, size)
    else
      api.nvim_win_set_width(w, size)
      util.set_win_local(w, 'winfixwidth', true)
    end
  end
  api.nvim_win_set_buf(w, chat.buf)
  win_options(w)
  if not pw then
    api.nvim_set_current_win(w)
    local height = tonumber(config.values.chat.prompt_height) or M.PROMPT_HEIGHT
    vim.cmd(('belowright %dsplit'):format(math.max(height, 1)))
    pw = api.nvim_get_current_win()
  end
  api.nvim_win_set_buf(pw, chat.prompt_buf)
  prompt_win_options(pw)
  pcall(api.nvim_win_set_cursor, w, { api.nvim_buf_line_count(chat.buf), 0 })
  if stay then
    if api.nvim_win_is_valid(prev) then
      api.nvim_set_current_win(prev)
    end
  else
    api.nvim_set_current_win(pw)
    pcall(api.nvim_win_set_cursor, pw, { api.nvim_buf_line_count(chat.prompt_buf), 0 })
  end
  return w
end

-- Closing a transcript window (`:q`) closes its prompt window too: the two are one chat, and a
-- prompt left alone took the transcript's room. (Not the tab's last window: nothing else is closed.)
api.nvim_create_autocmd('WinClosed', {
  group = api.nvim_create_augroup('operate_sidecar_chat', { clear = true }),
  callback = function(ev)
    local w = tonumber(ev.match)
    if not (w and api.nvim_win_is_valid(w)) then
      return
    end
    local chat = by_buf[api.nvim_win_get_buf(w)]
    if not chat then
      return
    end
    local tab = api.nvim_win_get_tabpage(w)
    vim.schedule(function()
      if not api.nvim_tabpage_is_valid(tab) then
        return
      end
      local wins, prompt = api.nvim_tabpage_list_wins(tab), nil
      for _, pw in ipairs(wins) do
        local b = api.nvim_win_get_buf(pw)
        if b == chat.buf then
          return -- the transcript is still shown in this tab
        elseif b == chat.prompt_buf then
          prompt = pw
        end
      end
      if prompt and #wins > 1 then
        pcall(api.nvim_win_close, prompt, false)
      end
    end)
  end,
})

-- The branch this tab page's chat is about: in the review tab, the reviewed change's branch
-- (that tab has no branch of its own); elsewhere the tab's current branch.
local function tab_branch()
  return require('operate_sidecar.diff').branch() or branches.current()
end

-- A new chat (not bound to a branch yet) belongs to its tab page: when that tab closes (a review
-- tab, say), it goes with its buffers, unless a turn is starting in it or a window shows it.
api.nvim_create_autocmd('TabClosed', {
  group = 'operate_sidecar_chat',
  callback = function()
    vim.schedule(M.wipe_closed_tabs)
  end,
})

function M.wipe_closed_tabs()
  for key, chat in pairs(chats) do
    local tab = chat.branch == nil and tonumber(tostring(key):match('^new:(%d+)$'))
    local busy = running_turn and running_turn.chat == chat
    if tab and not api.nvim_tabpage_is_valid(tab) and not busy then
      local shown = false
      for _, b in ipairs({ chat.buf, chat.prompt_buf }) do
        if b and api.nvim_buf_is_valid(b) and #vim.fn.win_findbuf(b) > 0 then
          shown = true
        end
      end
      if not shown then
        M.forget(key)
      end
    end
  end
end

--- Open the chat of `branch` (default: the current branch, in the review tab the branch of the
--- review; none yet = a new chat).
function M.open(branch, stay)
  branch = branch or tab_branch()
  local chat = M.get(branch)
  M.show(chat, stay)
  return chat
end

-- The chat whose transcript or prompt buffer `b` is, if any.
local function chat_of_buf(b)
  for _, c in pairs(chats) do
    if c.buf == b or c.prompt_buf == b then
      return c
    end
  end
end

--- The chat shown in this tab, or the current branch's.
function M.current()
  local w = M.window() or M.prompt_window()
  return w and chat_of_buf(api.nvim_win_get_buf(w)) or M.get(tab_branch())
end

--- The prompt text (the prompt buffer's lines).
function M.prompt_text(chat)
  chat = chat or M.current()
  local lines = api.nvim_buf_get_lines(chat.prompt_buf, 0, -1, false)
  return vim.trim(table.concat(lines, '\n'))
end

function M.set_prompt(chat, text)
  api.nvim_buf_set_lines(chat.prompt_buf, 0, -1, false, util.split_lines(text))
end

--- Attach a file to the message being written: `#file:<path>` goes into the chat's prompt, at
--- the cursor when it is in the prompt, else at its end (set apart by spaces). Without `path`,
--- the file is picked from the project's files (context.project_files) with vim.ui.select.
function M.attach(chat, path)
  chat = chat or M.current()
  -- where it goes: the cursor's place in the prompt (insert mode: before the cursor; normal: after
  -- the character under it), else the prompt's end
  local at = api.nvim_get_current_buf() == chat.prompt_buf and api.nvim_win_get_cursor(0) or nil
  local after_cursor = vim.fn.mode() ~= 'i'
  local function put(p)
    local pb = chat.prompt_buf
    M.show(chat)
    local w = api.nvim_get_current_win()
    local last = api.nvim_buf_line_count(pb)
    local row = at and math.min(at[1], last) or last
    local line = api.nvim_buf_get_lines(pb, row - 1, row, false)[1] or ''
    local col = at and math.min(at[2] + ((after_cursor and #line > 0) and 1 or 0), #line) or #line
    local before, after = line:sub(col, col), line:sub(col + 1, col + 1)
    local text = ((before ~= '' and not before:match('%s')) and ' ' or '') .. context.file_ref_text(p)
      .. (after:match('%s') and '' or ' ')
    api.nvim_buf_set_text(pb, row - 1, col, row - 1, col, { text })
    pcall(api.nvim_win_set_cursor, w, { row, col + #text })
  end
  if path and path:match('^[%%#<]') then
    path = vim.fn.expand(path) -- (the command's file completion expands `%`, `#` already)
  end
  if path and path:match('^operate://') then -- `%` in the chat: the file it was opened from
    path = api.nvim_buf_get_name(context.source_buf())
    if path == '' or path:match('^operate://') then
      notify('no file to attach: name one, or run :OperateAttach % from its window', vim.log.levels.WARN)
      return
    end
  end
  if path and path ~= '' then
    return put(vim.fn.fnamemodify(path, ':.')) -- (a file under the current directory: by its relative path)
  end
  local files = context.project_files()
  if #files == 0 then
    notify('no files here to attach (type #file:<path>)', vim.log.levels.WARN)
    return
  end
  vim.ui.select(files, { prompt = 'Attach a file: ' }, function(choice)
    if choice then
      put(choice)
    end
  end)
end

-- ---------------------------------------------------------------- a turn

-- The last block of a turn is over: the next text (or thoughts) starts below it; a stretch of
-- thoughts keeps how long it took.
local function close_last(turn)
  local last = turn.blocks[#turn.blocks]
  if last and (last.kind == 'text' or last.kind == 'thought') and not last.closed then
    last.closed = true
    if last.kind == 'thought' and last.started then
      last.ms = math.max(0, M.clock() - last.started)
    end
  end
end

local function text_block(turn)
  local last = turn.blocks[#turn.blocks]
  if last and last.kind == 'text' and not last.closed then
    return last
  end
  close_last(turn) -- (thoughts: the reply begins, they are over)
  local blk = { kind = 'text', raw = '' }
  turn.blocks[#turn.blocks + 1] = blk
  return blk
end

local function card_for(turn, callId, tool)
  local card = turn.cards[callId]
  if not card then
    card = { callId = callId, tool = tool, status = 'running' }
    turn.cards[callId] = card
    close_last(turn) -- the next streamed text (or thoughts) starts below this card
    turn.blocks[#turn.blocks + 1] = { kind = 'card', card = card }
  end
  return card
end

-- The value of a toolEvent summary (compact JSON text): nil when it was cut (the server cuts
-- one at SUMMARY_LIMIT characters, which leaves no valid JSON) or does not parse.
local SUMMARY_LIMIT = 200
function M.summary_value(text)
  if type(text) ~= 'string' or select(2, text:gsub('[^\128-\191]', '')) >= SUMMARY_LIMIT then
    return nil
  end
  local ok, value = pcall(vim.json.decode, text)
  if ok and value ~= nil then
    return value
  end
end

-- statuses a `denied` event leaves alone: the request ended otherwise, which the card says
local NOT_DENIED = { timedout = true, cancelled = true, gone = true, settling = true }

local function apply_tool_event(turn, e)
  if type(e) ~= 'table' or e.callId == nil or is_null(e.callId) then -- (not a call's event: nothing to show)
    return
  end
  local card = card_for(turn, e.callId, e.tool)
  card.argsSummary = not is_null(e.argsSummary) and e.argsSummary or card.argsSummary
  if card.arguments == nil then -- its arguments from the event itself, when they are whole
    local args = M.summary_value(card.argsSummary)
    card.arguments = type(args) == 'table' and args or nil
  end
  if e.event == 'pre' then
    card.status = 'running'
  elseif e.event == 'post' then
    card.status = 'ok'
    card.resultSummary = not is_null(e.resultSummary) and e.resultSummary or nil
    if card.output == nil then -- its output too (the branch's copy replaces it when the turn ends)
      card.output = M.summary_value(card.resultSummary)
    end
  elseif e.event == 'error' then
    card.status = 'error'
    card.error = not is_null(e.error) and tostring(e.error) or 'failed'
  elseif e.event == 'denied' and not NOT_DENIED[card.status] then
    card.status = 'denied' -- (a request that timed out or was cancelled is denied too: say which)
  end
end

--- toolEvent of a branch whose turn is not in flight (e.g. another client's): ignored.
function M.on_tool_event(_) end

function M.on_permission_request(p)
  if not running_turn or running_turn.turn.branch ~= p.branchId then
    return
  end
  local card = card_for(running_turn.turn, p.callId, p.tool)
  card.arguments = p.arguments
  card.status = 'waiting'
  if type(p.preview) == 'table' and p.preview.diff then
    local add, del = require('operate_sidecar.diff').stats(p.preview.diff)
    card.stats = ('+%d −%d'):format(add, del)
  end
  render_turn(running_turn.chat, running_turn.turn)
end

function M.on_permission_answer(p, decision)
  if not running_turn or running_turn.turn.branch ~= p.branchId then
    return
  end
  local chat, turn = running_turn.chat, running_turn.turn
  local card = turn.cards[p.callId]
  if card and card.status == 'waiting' then
    if decision == 'timedout' then
      -- The server stopped waiting by itself: a timeout, unless it is going away (a SIGTERM
      -- cancels its requests, then it exits). Said once known: it answers a ping, or it ends.
      card.status = 'settling'
      server.probe(function(serving, err)
        if card.status == 'settling' then
          local data = not serving and type(err) == 'table' and type(err.data) == 'table' and err.data or nil
          card.status = serving and 'timedout' or 'gone'
          card.gone = not serving and (data and require('operate_sidecar.rpc').exit_note(data.exitCode, data.signal)
            or 'stopped') or nil
          render_turn(chat, turn)
        end
      end)
    elseif decision == 'cancelled' then
      card.status = decision
    else
      card.status = decision:match('^allow') and 'running' or 'denied'
    end
    render_turn(chat, turn)
  end
end

-- Fill the cards of a chat's turns from the branch's messages (whole arguments and outputs):
-- those not read yet (a long branch's come in pages; its first 1000 alone left later turns'
-- cards bare), one read at a time (a turn of many calls asks at each; one more read follows).
local function fill_cards(chat, turn)
  -- (not without a ready server: a request would start one again, right after :OperateStop)
  if next(turn.cards) == nil or not chat.branch or not (server.state.ready and server.is_running()) then
    return
  end
  if chat.filling then
    chat.fill_again = true
    return
  end
  chat.filling = true
  fetch_messages(chat.branch, chat.seen or 0, function(err, messages, seen)
    chat.filling = false
    if not err then
      chat.seen = math.max(chat.seen or 0, seen)
      local cards, touched = {}, {}
      for _, t in ipairs(chat.turns) do
        for id, card in pairs(t.cards or {}) do
          cards[id] = { card, t }
        end
      end
      for _, m in ipairs(messages) do
        local c = type(m.content) == 'table' and m.content or nil
        local hit = c and c.callId and cards[c.callId]
        local card = hit and hit[1]
        if card and m.kind == 'action_request' then
          card.arguments = c.arguments
        elseif card and m.kind == 'action_response' then
          card.arguments = c.arguments
          card.output = c.output
          local status = status_of_output(c.output)
          if status == 'error' and type(c.output.error) == 'string' and card.status == 'ok' then
            card.status = 'error'
            card.error = c.output.error
          elseif status == 'timedout' and (card.status == 'denied' or card.status == 'cancelled') then
            card.status = 'timedout'
          end
        end
        if card then
          touched[hit[2]] = true
        end
      end
      for _, t in ipairs(chat.turns) do
        if touched[t] then
          render_turn(chat, t)
        end
      end
    end
    if chat.fill_again then
      chat.fill_again = nil
      fill_cards(chat, chat.turns[#chat.turns])
    end
  end)
end

-- Keeps what the branch does not hold of a turn that ended well (its thoughts, its note:
-- kept.lua) by where its instruction is on the branch: known when the turn read that as it
-- began, else the last instruction among the branch's last KEEP_LOOKBACK messages (the turn's
-- first round's: a later round's instruction is the server's continuation).
local KEEP_LOOKBACK = 200
local function keep_turn(turn)
  local thoughts = thoughts_of(turn)
  if (#thoughts == 0 and not turn.note) or not turn.branch then
    return
  end
  local bid = turn.branch
  if turn.at then
    return kept.put(bid, turn.at, thoughts, turn.note)
  elseif not (server.state.ready and server.is_running()) then
    return -- (a request would start the server again)
  end
  server.request('branchMessages', { branchId = bid, offset = 0, limit = 0 }, function(err, res)
    local total = not err and type(res) == 'table' and tonumber(res.total)
    if not total or total == 0 then
      return
    end
    local from = math.max(0, total - KEEP_LOOKBACK)
    server.request('branchMessages', { branchId = bid, offset = from, limit = total - from }, function(err2, res2)
      local msgs = not err2 and type(res2) == 'table' and type(res2.messages) == 'table' and res2.messages or {}
      for i = #msgs, 1, -1 do
        local c = type(msgs[i].content) == 'table' and msgs[i].content or {}
        if msgs[i].kind == 'instruction' and c.instruction ~= M.CONTINUATION then
          turn.at = turn.at or (from + i - 1)
          return kept.put(bid, turn.at, thoughts, turn.note)
        end
      end
    end)
  end)
end

-- Whether the branch holds a turn that failed or was stopped (its first rounds: the server
-- records each round that ended, its instruction with the context rendered in): the message at
-- `turn.at` (the branch's message count when the turn began) is its instruction. turn.recorded
-- is true or false once the branch was read; nil while unknown (never read: the turn began or
-- ended without a running server, or its start was not read). turn.checking: callbacks waiting
-- for the read in flight (run when it answers, at the latest after CHECK_MS: then not known).
local CHECK_MS = 5000
local function check_recorded(turn)
  if turn.at == nil or not turn.branch or not (server.state.ready and server.is_running()) then
    return
  end
  local waiting = {}
  turn.checking = waiting
  local function settle()
    if turn.checking == waiting then
      turn.checking = nil
      for _, fn in ipairs(waiting) do
        fn()
      end
    end
  end
  server.request('branchMessages', { branchId = turn.branch, offset = turn.at, limit = 1 }, function(err, res)
    if not err and type(res) == 'table' then
      local m = type(res.messages) == 'table' and res.messages[1] or nil
      local c = type(m) == 'table' and type(m.content) == 'table' and m.content or {}
      turn.recorded = type(m) == 'table' and m.kind == 'instruction' and c.instruction == turn.user
    end
    settle()
  end)
  vim.defer_fn(settle, CHECK_MS)
end

--- Send a prompt (default: the chat's prompt area) as a chat turn. extra: {context, label,
--- params} (given, not read from the text), or {again = turn} to send a turn again (Retry: its
--- context and model; `earlier` = 'stopped' / 'failed': no context, it is in that turn on the
--- branch already).
function M.send(chat, text, extra)
  chat = chat or M.current()
  local from_prompt = text == nil
  text = text or M.prompt_text(chat)
  if text == '' then
    return false
  end
  if server.state.running then
    notify('a turn is already running (<C-c> cancels it)', vim.log.levels.WARN)
    return false
  end
  -- text that is not UTF-8 (raw bytes typed or pasted, lines of a buffer opened with `++bin`)
  -- cannot be sent: the server reads UTF-8 only. Refused as it is, not changed behind the user's
  -- back; the message stays in the prompt to be fixed.
  local bad = util.utf8_error(text)
  local sel = extra and type(extra.context) == 'string' and util.utf8_error(extra.context)
  if bad or sel then
    notify(bad and ('not sent: the message is not UTF-8 text (byte %d)%s'):format(bad,
      from_prompt and '; it stays in the prompt' or '')
      or 'not sent: the lines are not UTF-8 text', vim.log.levels.ERROR)
    return false
  end
  if chat.branch and (chat.waiting or (chat.history_failed and #chat.turns == 0)) and not (extra and extra.after_history) then
    -- the branch's earlier turns first (still being read, or their read failed and nothing was
    -- sent since: read again), so that the transcript shows them before this one, as the branch
    -- holds them; the message stays in the prompt meanwhile
    if not chat.waiting then
      read_history(chat)
    end
    M.loaded(chat, function(err)
      if err and err.timeout then
        return notify(('not sent: the server has not sent the chat\'s history in %g s (the message '
          .. 'stays in the prompt; :OperateStop then :OperateStart restarts the server)'):format(err.timeout / 1000),
          vim.log.levels.ERROR)
      elseif err then
        notify("the chat's earlier turns could not be read (" .. util.error_text(err)
          .. '): this message still goes on the branch after them', vim.log.levels.WARN)
      end
      if from_prompt and M.prompt_text(chat) ~= text then
        return -- (the prompt was changed meanwhile: that text is the user's now, not this one)
      end
      M.send(chat, not from_prompt and text or nil, vim.tbl_extend('force', extra or {}, { after_history = true }))
    end, M.HISTORY_WAIT_MS)
    return true
  end
  local again = extra and extra.again -- a turn sent again: its context and model, not read anew
  local ctx, model
  if again then
    ctx, model = not extra.earlier and again.context or nil, again.model
  else
    ctx, model = (extra and extra.context) or context.expand(text), config.values.model
  end
  if from_prompt then
    M.set_prompt(chat, '') -- one undoable change of the prompt: `u` there brings the text back
    chat.recall = nil -- (the prompt history starts again from its newest message)
  end
  local turn = new_turn(chat, { user = text, time = os.date('%H:%M'), status = 'running',
    ctx_label = extra and extra.label or context.describe(ctx), model = model, branch = chat.branch,
    context = ctx, params = extra and extra.params, ctx_earlier = extra and extra.earlier, activity = { round = 1 } })
  running_turn = { chat = chat, turn = turn }
  local params = { instruction = text, branchId = chat.branch }
  if ctx ~= nil then
    params.context = ctx
  end
  if config.values.chat.tools then
    params.actions = true
    params.tools = true
    params.maxRounds = config.values.chat.max_rounds or nil
    -- (the rounds stop after REPEAT_LIMIT in a row of the same failing calls: the model is stuck)
    params.repeatLimit = M.REPEAT_LIMIT
  end
  if model then
    params.chatModel = model
  end
  for k, v in pairs(extra and extra.params or {}) do
    params[k] = v
  end
  turn.activity.max_rounds = tonumber(params.maxRounds) or tonumber((config.values.operate_defaults or {}).maxRounds)
  local hooks = {
    implicit = chat.branch == nil or chat.branch == branches.current(),
    on_start = function(run)
      if chat.branch ~= run.branchId then
        bind(chat, run.branchId)
      end
      turn.branch, turn.at = run.branchId, nil
      -- where the turn begins on the branch: a Retry asks whether it is there (check_recorded), and
      -- one that fails or is stopped is kept by it (kept.put_local). (Sent before the operate: answered first.)
      local bid = run.branchId
      server.request('branchMessages', { branchId = bid, offset = 0, limit = 0 }, function(err, res)
        if not err and type(res) == 'table' and turn.branch == bid then
          turn.at = tonumber(res.total)
        end
      end)
    end,
    on_delta = function(delta)
      local blk = text_block(turn)
      blk.raw = blk.raw .. delta
      render_turn(chat, turn)
    end,
    on_thought = function(thought)
      -- a reasoning model's thoughts (never on the branch: the chat keeps them while it shows the turn)
      local last = turn.blocks[#turn.blocks]
      if not (last and last.kind == 'thought' and not last.closed) then
        close_last(turn) -- text after these thoughts starts below them
        last = { kind = 'thought', raw = '', started = M.clock() }
        turn.blocks[#turn.blocks + 1] = last
      end
      last.raw = last.raw .. thought
      render_turn(chat, turn)
    end,
    on_phase = function(phase, _, message)
      if phase == 'request' then
        close_last(turn) -- a new model round
      end
      M.activity_step(turn.activity, phase, message)
      render_turn(chat, turn) -- (its status line)
    end,
    on_tool_event = function(e)
      apply_tool_event(turn, e)
      render_turn(chat, turn)
      local card = turn.cards[e.callId]
      if card and card.arguments == nil and not card.asked then
        card.asked = true -- its arguments now, from the branch, not only when the turn ends
        fill_cards(chat, turn)
      end
    end,
  }
  server.operate(params, function(err, result, run)
    if running_turn and running_turn.turn == turn then
      running_turn = nil
    end
    turn.elapsed_ms = run and run.elapsed_ms
    turn.usage = run and run.usage
    close_last(turn) -- (thoughts the turn ended in: how long they took)
    if err then
      turn.status = err.code == require('operate_sidecar.rpc').codes.cancelled and 'cancelled' or 'error'
      turn.error = util.error_text(err) -- (plain words: no protocol wording)
    else
      turn.status = 'done'
      turn.rounds = type(result) == 'table' and tonumber(result.rounds) or nil
      turn.note = type(result) == 'table' and result.repeated == true and M.repeat_note(result) or nil
      keep_turn(turn) -- (its thoughts and note: the branch does not hold them)
      local final = M.result_lines(result)
      -- the last round's streamed text is the reply the result holds: show it once, as prose
      local last
      for i = #turn.blocks, 1, -1 do
        if turn.blocks[i].kind == 'text' then
          last = turn.blocks[i]
          break
        end
      end
      if not last then
        last = { kind = 'text', raw = '' }
        turn.blocks[#turn.blocks + 1] = last
      end
      if #final > 0 then
        last.final = final
      end -- else the result kept no prose (e.g. only tool calls): the streamed prose stays
    end
    -- the server ended (killed, or it stopped by itself: a SIGTERM): its cards say how
    local gone = err and err.code == require('operate_sidecar.rpc').codes.server_exited and type(err.data) == 'table'
      and require('operate_sidecar.rpc').exit_note(err.data.exitCode, err.data.signal) or nil
    for _, card in pairs(turn.cards) do
      -- (a request still waiting when its turn ended, the server gone say, is answered by nobody)
      if gone and (card.status == 'waiting' or card.status == 'running' or card.status == 'settling') then
        card.status, card.gone = 'gone', gone
      elseif card.status == 'settling' then -- (the turn went on to its end: the server is there)
        card.status = 'timedout'
      elseif card.status == 'waiting' or (card.status == 'running' and turn.status == 'cancelled') then
        card.status = 'cancelled'
      end
    end
    render_turn(chat, turn)
    fill_cards(chat, turn)
    if err then
      -- (what a Retry sends: the context, unless the branch has it already) then the turn is kept,
      -- so that it comes back when the chat is read from the branch again (also in a new Neovim)
      check_recorded(turn)
      local function keep()
        if turn.branch and turn.at then
          kept.put_local(turn.branch, local_record(turn))
        end
      end
      if turn.checking then
        table.insert(turn.checking, keep)
      else
        keep()
      end
    end
  end, hooks)
  return true
end

function M.cancel()
  return server.cancel()
end

--- The turn shown at line `lnum` of a chat's transcript; after the last turn (the prompt
--- header) or before the first, the last turn.
function M.turn_at(chat, lnum)
  local row = lnum - 2 -- below the title and its blank line: the turns, in order
  if row >= 1 then
    for _, t in ipairs(chat.turns) do
      if row <= t.nlines then
        return t
      end
      row = row - t.nlines
    end
  end
  return chat.turns[#chat.turns]
end

--- The first line of each turn in a chat's transcript (its `## You` line), in order.
local function turn_starts(chat)
  local out, row = {}, 2 -- below the title and its blank line
  for _, t in ipairs(chat.turns) do
    out[#out + 1] = row + 1
    row = row + t.nlines
  end
  return out
end

--- Move the cursor to the start of the `step`-th turn after the cursor's line (before it when
--- `step` is negative), as far as there are turns.
function M.jump_turn(chat, step)
  local cur, ahead = api.nvim_win_get_cursor(0)[1], {} -- the turns' starts that way, nearest first
  for _, l in ipairs(turn_starts(chat)) do
    if step > 0 and l > cur then
      ahead[#ahead + 1] = l
    elseif step < 0 and l < cur then
      table.insert(ahead, 1, l)
    end
  end
  if #ahead > 0 then
    api.nvim_win_set_cursor(0, { ahead[math.min(math.abs(step), #ahead)], 0 })
  end
end

--- The code blocks (``` or ~~~ fences) of lines `from`..`to` of a chat's transcript: { {open, close} } (the fences' lines).
local function code_blocks(chat, from, to)
  local lines = api.nvim_buf_get_lines(chat.buf, from - 1, to, false)
  local out, open, fence = {}, nil, nil
  for i, l in ipairs(lines) do
    local f = l:match('^%s*(```+)') or l:match('^%s*(~~~+)')
    if f and not open then
      open, fence = from + i - 1, f
    elseif f and f:sub(1, 1) == fence:sub(1, 1) and #f >= #fence and vim.trim(l) == f then
      out[#out + 1] = { open, from + i - 1 }
      open = nil
    end
  end
  return out
end

-- `lines` into `register` (linewise; '' is the unnamed one), said as "yanked <what>".
local function yank(lines, register, what)
  vim.fn.setreg(register ~= '' and register or '"', lines, 'l')
  notify('yanked ' .. what)
  return true
end

--- Yank into `register` the code block at line `lnum` of a chat's transcript (its lines, not
--- the fences), else the last code block of the turn at that line; says how many lines, or that
--- there is none.
function M.yank_code(chat, lnum, register)
  local starts = turn_starts(chat)
  local turn, first, last = M.turn_at(chat, lnum), nil, nil
  for i, t in ipairs(chat.turns) do
    if t == turn then
      first, last = starts[i], starts[i] + t.nlines - 1
    end
  end
  if not first then
    notify('no code block here', vim.log.levels.WARN)
    return false
  end
  local blocks, pick = code_blocks(chat, first, last), nil
  for _, b in ipairs(blocks) do
    if lnum >= b[1] and lnum <= b[2] then
      pick = b
    end
  end
  pick = pick or blocks[#blocks]
  if not pick then
    notify("no code block in this turn", vim.log.levels.WARN)
    return false
  end
  local code = api.nvim_buf_get_lines(chat.buf, pick[1], pick[2] - 1, false)
  return yank(code, register, ('%d line%s of code'):format(#code, #code == 1 and '' or 's'))
end

--- Yank into `register` the reply of the turn at line `lnum` of a chat's transcript (else the
--- last turn's) as it reads: its text, not its thoughts or tool cards; says how many lines.
function M.yank_reply(chat, lnum, register)
  local turn, out = M.turn_at(chat, lnum), {}
  for _, blk in ipairs(turn and turn.blocks or {}) do
    local body = blk.kind == 'text' and shown_text(blk)
    if body then
      if #out > 0 then
        out[#out + 1] = ''
      end
      util.extend(out, body)
    end
  end
  if #out == 0 then
    notify('no reply in this turn', vim.log.levels.WARN)
    return false
  end
  return yank(out, register, ('the reply (%d line%s)'):format(#out, #out == 1 and '' or 's'))
end

local function retryable(turn)
  return turn ~= nil and (turn.status == 'error' or turn.status == 'cancelled')
end

--- Send a turn that failed or was stopped again (default: the chat's last turn): the same
--- message with the same model, on the chat's branch, as a new turn. A turn that failed or was
--- stopped before a round ended left nothing on the branch: its context (as it was sent, not
--- read again) goes along again. One stopped (or failed) in a later round left its first rounds
--- there, which stay, as the turn stays in the chat: the server recorded its instruction with
--- its context, which the model sees in the branch's history, so the message goes without it
--- (not twice); the new turn says where its context is. Not known (never read): sent with it.
function M.retry(chat, turn)
  chat = chat or M.current()
  turn = turn or chat.turns[#chat.turns]
  if not retryable(turn) then
    notify('nothing to retry: R sends a turn that failed or was stopped again', vim.log.levels.WARN)
    return false
  end
  local function again()
    local earlier = turn.ctx_earlier -- (a retry of a retry: the context is still in that turn)
      or (turn.recorded and turn.context ~= nil and (turn.status == 'cancelled' and 'stopped' or 'failed'))
      or nil
    return M.send(chat, turn.user, { again = turn, earlier = earlier, label = turn.ctx_label, params = turn.params })
  end
  if turn.checking then -- the branch is being read: whether it holds the turn decides (a moment)
    table.insert(turn.checking, again)
    return true
  end
  return again()
end

--- Put a turn's message (default: the chat's last turn) in the prompt, to edit and send again
--- (its #references are read again when it is sent). `u` in the prompt brings back what was there.
function M.edit_again(chat, turn)
  chat = chat or M.current()
  turn = turn or chat.turns[#chat.turns]
  if not (turn and turn.user and turn.user ~= '') then
    notify('no message to edit yet', vim.log.levels.WARN)
    return false
  end
  M.set_prompt(chat, turn.user)
  chat.recall = nil
  M.show(chat)
  vim.cmd('startinsert!')
  return true
end

--- The messages sent in a chat, oldest first (one sent twice in a row is one entry).
function M.sent(chat)
  local out = {}
  for _, t in ipairs(chat.turns) do
    if type(t.user) == 'string' and t.user ~= '' and t.user ~= out[#out] then
      out[#out + 1] = t.user
    end
  end
  return out
end

--- In a chat's prompt: an earlier (step -1) or later (1) message sent in place of the prompt's
--- text. The text being typed is kept and comes back past the newest message.
function M.recall(step)
  local b = api.nvim_get_current_buf()
  local chat = chat_of_buf(b)
  if not chat or chat.prompt_buf ~= b then
    return
  end
  local sent, r = M.sent(chat), chat.recall
  local text = table.concat(api.nvim_buf_get_lines(b, 0, -1, false), '\n')
  if not r then
    if step > 0 or #sent == 0 then
      return -- (nothing later than the text being typed)
    end
    r = { pos = #sent + 1, draft = text }
  elseif text ~= sent[r.pos] then
    r.draft = text -- a recalled message edited: that is the text being typed now
  end
  r.pos = math.max(1, r.pos + step)
  if r.pos > #sent then
    chat.recall = nil
    M.set_prompt(chat, r.draft)
  else
    chat.recall = r
    M.set_prompt(chat, sent[r.pos])
  end
  -- (on the first line going back, on the last going on: the next key goes on at once)
  local row = step < 0 and 1 or api.nvim_buf_line_count(b)
  local col = #(api.nvim_buf_get_lines(b, row - 1, row, false)[1] or '')
  pcall(api.nvim_win_set_cursor, 0, { row, col })
end

-- ---------------------------------------------------------------- export

-- Backticks one more than the longest run of them in `text` (at least `least`): a Markdown
-- fence or code span that nothing inside it ends.
local function ticks_around(text, least)
  local longest = least - 1
  for run in text:gmatch('`+') do
    longest = math.max(longest, #run)
  end
  return string.rep('`', longest + 1)
end

-- A fenced block of `text`.
local function fenced(text, lang)
  local fence = ticks_around(text, 3)
  return fence .. (lang or '') .. '\n' .. text:gsub('\n$', '') .. '\n' .. fence
end

-- A code span of `text` (CommonMark: a space inside each end when it starts or ends with a backtick).
local function inline_code(text)
  local tick = ticks_around(text, 1)
  local pad = (text:sub(1, 1) == '`' or text:sub(-1) == '`') and ' ' or ''
  return tick .. pad .. text .. pad .. tick
end

-- `text` with every ASCII punctuation character escaped: read as it is, never as Markdown.
local function md_escaped(text)
  return (text:gsub('[%p]', function(c)
    return c:byte() < 128 and '\\' .. c or c
  end))
end

local function json_text(v)
  return type(v) == 'string' and v or table.concat(util.pretty(v), '\n')
end

-- A tool call as Markdown: its headline as code, then its arguments and output folded in a
-- <details>, and an edit's diff fenced (shown, as the transcript shows it). A call waiting for
-- the user's decision says so, without the transcript's keys.
local function card_markdown(card)
  local headline = M.card_headline(card)
  if card.status == 'waiting' then
    headline = headline:sub(1, -#STATUS_NOTE.waiting - 1) .. ' (waiting for a decision)'
  end
  local out = { '- ' .. inline_code(headline) }
  local parts = {}
  if type(card.arguments) == 'table' and next(card.arguments) ~= nil then
    parts[#parts + 1] = '**Arguments**\n\n' .. fenced(json_text(card.arguments), 'json')
  elseif type(card.argsSummary) == 'string' then
    parts[#parts + 1] = '**Arguments:** ' .. inline_code(util.one_line(card.argsSummary))
  end
  local o, diff = card.output, nil
  if type(o) == 'table' and type(o.diff) == 'string' then
    diff, o = o.diff, vim.deepcopy(o)
    o.diff = nil
  end
  if o ~= nil and not (type(o) == 'table' and next(o) == nil and diff) then
    parts[#parts + 1] = '**Output**\n\n' .. fenced(json_text(o), type(o) == 'string' and '' or 'json')
  elseif type(card.resultSummary) == 'string' then
    parts[#parts + 1] = '**Output:** ' .. inline_code(util.one_line(card.resultSummary))
  end
  local indent = function(text)
    return (text:gsub('\n([^\n])', '\n  %1'))
  end
  if #parts > 0 then
    out[#out + 1] = indent('  <details><summary>Arguments and output</summary>\n\n' .. table.concat(parts, '\n\n')
      .. '\n\n</details>')
  end
  if diff and vim.trim(diff) ~= '' then
    out[#out + 1] = indent('  ' .. fenced(diff, 'diff'))
  end
  return table.concat(out, '\n\n')
end

--- A chat as one Markdown document (:OperateExport): its title and `when`, then each turn: the
--- message and what was sent with it, the reply as it reads (thoughts folded in a <details>, each
--- tool call's headline with its arguments and output folded and an edit's diff), its error or
--- note, and its usage.
function M.markdown(chat, when)
  local title = chat_title(chat):gsub('^# ', '')
  local out = { '# ' .. util.one_line(title) }
  if when then
    out[#out + 1] = '*' .. when .. '*'
  end
  for _, turn in ipairs(chat.turns) do
    out[#out + 1] = '---'
    if turn.user and turn.user ~= '' then
      out[#out + 1] = '### You' .. (turn.time and (' · ' .. turn.time) or '')
      out[#out + 1] = fences_closed(turn.user)
      if turn.ctx_label and turn.ctx_label ~= '' then
        out[#out + 1] = '*Context:* ' .. turn.ctx_label
      end
    end
    out[#out + 1] = '### Assistant' .. (turn.model and (' · ' .. turn.model) or '')
    for _, blk in ipairs(turn.blocks) do
      if blk.kind == 'text' then
        local body = shown_text(blk)
        if body then
          out[#out + 1] = fences_closed(vim.trim(table.concat(body, '\n')))
        end
      elseif blk.kind == 'thought' then
        -- (fenced: raw thoughts, often cut off, would break the fold or the rest of the document)
        if vim.trim(blk.raw or '') ~= '' then
          out[#out + 1] = ('<details><summary>%s</summary>\n\n%s\n\n</details>'):format(
            M.thoughts_headline(blk.ms):gsub('_', ''), fenced(vim.trim(blk.raw), 'text'))
        end
      else
        out[#out + 1] = card_markdown(blk.card)
      end
    end
    if turn.status == 'running' then
      out[#out + 1] = '*(still running when the chat was exported)*'
    elseif turn.status == 'cancelled' then
      out[#out + 1] = '*cancelled*'
    elseif turn.status == 'error' then
      -- (fenced: an error quotes server output, a traceback or a reply, which as Markdown would
      -- lose its lines, take `__init__` for bold, or open a fence over the rest of the document)
      out[#out + 1] = '**Error**\n\n' .. fenced(tostring(turn.error or 'failed'), 'text')
    end
    if turn.note then
      out[#out + 1] = '*' .. md_escaped(util.one_line(turn.note)) .. '*'
    end
    local u = turn.status ~= 'running' and usage_line(turn)
    if u then
      out[#out + 1] = '*' .. u:sub(2, -2) .. '*'
    end
  end
  return table.concat(out, '\n\n') .. '\n'
end

--- :OperateExport [file]: the chat of this tab (else of the current branch) as Markdown: into a
--- new buffer in a new tab, unsaved (`:w name` keeps it), or written to `file` (an existing one
--- only with `force`, :OperateExport!). Waits for the chat's history; an empty chat: a warning.
function M.export(file, force, chat)
  -- (in the tab an export opened: the chat it was exported from)
  local from = not chat and not (M.window() or M.prompt_window()) and vim.t.operate_export_of
  chat = chat or (from and (chats[from] or (not from:match('^new:') and M.get(from)))) or M.current()
  file = vim.trim(file or '') -- (as :w, which takes no trailing blank into the name)
  M.loaded(chat, function(err)
    if err and err.timeout then
      return notify(('cannot export the chat yet: the server has not sent its history in %g s '
        .. '(:OperateExport again waits again; :OperateStop then :OperateStart restarts it)')
        :format(err.timeout / 1000), vim.log.levels.ERROR)
    elseif err then
      return notify('cannot export the chat: its history could not be read: ' .. util.error_text(err),
        vim.log.levels.ERROR)
    elseif #chat.turns == 0 then
      return notify('nothing to export: the chat is empty', vim.log.levels.WARN)
    end
    local when = 'Exported from operate-sidecar on ' .. os.date('%Y-%m-%d %H:%M')
      .. (chat.branch and (' (branch ' .. chat.branch .. ')') or '')
    local text = M.markdown(chat, when)
    local n = #chat.turns
    local what = ('%d turn%s'):format(n, n == 1 and '' or 's')
    if file ~= '' then
      -- (expanded as :w expands its file: ~, $VAR, %, wildcards)
      local ok, expanded = pcall(vim.fn.expand, file)
      local path = vim.fn.fnamemodify(ok and expanded ~= '' and expanded or file, ':p')
      if vim.fn.isdirectory(path) == 1 then
        return notify(('cannot export to %s: it is a directory'):format(path), vim.log.levels.ERROR)
      elseif vim.fn.filereadable(path) == 1 and not force then
        return notify(('%s exists: :OperateExport! %s replaces it'):format(path, file), vim.log.levels.ERROR)
      end
      -- (the bytes as they are: writefile() would take a NUL for a Blob, and raises on failure)
      local f, why = io.open(path, 'wb')
      why = why and why:gsub('^' .. vim.pesc(path) .. ': ', '')
      local written = f and f:write(text)
      if f then
        written = f:close() and written
      end
      if not written then
        return notify(('cannot write %s: %s'):format(path, why or 'the write failed'), vim.log.levels.ERROR)
      end
      return notify(('exported the chat (%s) to %s'):format(what, path))
    end
    local lines = util.split_lines((text:gsub('\n$', '')))
    vim.cmd('tabnew')
    vim.t.operate_export_of = chat.key
    local b = api.nvim_get_current_buf()
    api.nvim_buf_set_lines(b, 0, -1, false, lines)
    vim.bo[b].filetype = 'markdown'
    api.nvim_win_set_cursor(0, { 1, 0 })
    notify(('exported the chat (%s): :w {file} keeps it'):format(what))
  end, M.HISTORY_WAIT_MS)
end

--- The lines of a branch's chat: the transcript, then the prompt (for scripts and tests).
function M.lines(branch)
  local chat
  if is_null(branch) then
    chat = M.current()
  else
    chat = chats[branch] -- (never another chat, nor a new one without its history)
  end
  if not intact(chat) then
    return {}
  end
  local lines = api.nvim_buf_get_lines(chat.buf, 0, -1, false)
  util.extend(lines, api.nvim_buf_get_lines(chat.prompt_buf, 0, -1, false))
  return lines
end

return M
