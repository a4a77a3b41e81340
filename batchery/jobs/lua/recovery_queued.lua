-- recovery_queued: which lines of some jobs have a message waiting in one of a queue's lists
-- (batchery.jobs.recover.queued_lines), a bounded piece of the list at a time.
-- KEYS: one of a queue's lists
-- ARGV: start index, max messages, max bytes, then the job ids looked for
-- Returns: {next index, the list's length, {job, line, job, line, ...}}.
-- Promises: read-only, and short (at most max messages, about max bytes). Reads from the left (the newest end):
--   pushes at the left only move unread messages further right and pops at the right take only unread ones, so no
--   message that stays in the list is skipped. A message's task id is its "id": key's value (headers.id; the body
--   is base64, so nothing else in the message spells it); compact and spaced JSON both match. A chunk's lines are
--   its batchery_lines header's, for the job its batchery_job header names.
local wanted = {}
for i = 4, #ARGV do wanted[ARGV[i]] = true end
local i = tonumber(ARGV[1])
local stop = i + tonumber(ARGV[2])
local max_bytes = tonumber(ARGV[3])
local bytes = 0
local found = {}
while i < stop and bytes < max_bytes do
  local batch = redis.call('LRANGE', KEYS[1], i, math.min(i + 31, stop - 1))
  if #batch == 0 then break end
  for _, msg in ipairs(batch) do
    bytes = bytes + #msg
    local pos = 1
    while true do
      local s, e = string.find(msg, '"id":', pos, true)
      if not s then break end
      local id = string.match(msg, '^%s*"([^"]*)"', e + 1)
      if id then
        local job, line = string.match(id, '^(.*)%-(%d+)$')
        if job and wanted[job] then
          found[#found + 1] = job
          found[#found + 1] = line
        end
      end
      pos = e + 1
    end
    -- a chunk (batchery.batch_lines) names its job and its lines in headers of its own
    local cjob = string.match(msg, '"batchery_job":%s*"([^"]*)"')
    if cjob and wanted[cjob] then
      local list = string.match(msg, '"batchery_lines":%s*"([%d,]*)"')
      for n in string.gmatch(list or '', '%d+') do
        found[#found + 1] = cjob
        found[#found + 1] = n
      end
    end
  end
  i = i + #batch
end
return {i, redis.call('LLEN', KEYS[1]), found}
