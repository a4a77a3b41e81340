-- create: a new validating job (JobStore.create). Uses the prelude.
-- KEYS: job, index
-- ARGV: job id, ttl, prefix, then the job's fields and values (created_at and submit_beat, server time, are added
--   here; with a window_s field, window_ends_at = created_at + window_s)
-- Returns: the ids of jobs created more than a TTL ago that still exist and have not ended (for the caller to repair).
-- Promises: atomic. The job hash is written afresh (an old hash of the same id is deleted first) and indexed by its
--   creation time; its keys get no TTL until the job ends. Of the (up to 1000) oldest jobs indexed more than a TTL
--   ago, those whose keys have expired leave the index.
local now = server_now()
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'created_at', now, 'submit_beat', now, unpack(ARGV, 4))
local window = tonumber(redis.call('HGET', KEYS[1], 'window_s') or '')
if window then redis.call('HSET', KEYS[1], 'window_ends_at', string.format('%.6f', tonumber(now) + window)) end
redis.call('ZADD', KEYS[2], now, ARGV[1])
local old = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', tonumber(now) - tonumber(ARGV[2]), 'LIMIT', 0, 1000)
local unended = {}
for _, id in ipairs(old) do
  local status = redis.call('HGET', ARGV[3] .. ':' .. id, 'status')
  if not status then
    if redis.call('EXISTS', ARGV[3] .. ':' .. id) == 0 then redis.call('ZREM', KEYS[2], id) end
  elseif status ~= 'completed' and status ~= 'failed' and status ~= 'expired' and status ~= 'cancelled' then
    table.insert(unended, id)
  end
end
return unended
