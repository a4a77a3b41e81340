-- expire: one piece of the completion window's enforcement (JobStore.expire, which holds the job's {job}:expiring
-- lock around the calls). Uses the prelude.
-- KEYS: job, results, running, pending, done, runs
-- ARGV: ttl, then line, its batch_expired record, line, record, ...
-- Returns: {lines recorded, status}.
-- Promises: atomic. Only once the job's completion window has ended and lines may still start (validating or
--   in_progress): each line given that has no record and no live lease is recorded batch_expired (counted as failed,
--   once); a line that has a record just leaves the ledger; a line running now keeps its lease, finishes and keeps
--   its result. Then the job settles (finalizing after its last record). Harmless to repeat.
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return {0, 'gone'} end
if status ~= 'validating' and status ~= 'in_progress' then return {0, status} end
local now = server_now()
if not window_passed(KEYS[1], now) then return {0, status} end
local n = 0
for i = 2, #ARGV - 1, 2 do
  local line = ARGV[i]
  if recorded(line) then
    redis.call('HDEL', KEYS[4], line)
  else
    local lease = tonumber(redis.call('HGET', KEYS[3], line) or '')
    if lease == nil or lease < tonumber(now) then  -- not running (or its worker died): it will not start now
      redis.call('HDEL', KEYS[3], line)
      n = n + expire_line(KEYS[1], KEYS[2], KEYS[4], line, ARGV[i + 1], now)
    end
  end
end
return {n, settle(KEYS[1], KEYS[2], KEYS[3], status, ARGV[1])}
