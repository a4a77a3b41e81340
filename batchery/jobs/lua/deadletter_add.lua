-- deadletter_add: one entry of the dead-letter list (batchery.jobs.deadletter.DeadLetters.add).
-- KEYS: entries, index
-- ARGV: id, entry JSON without its closing brace, max entries
-- Returns: dead_lettered_at (server time), as written into the entry.
-- Promises: atomic: the entry (closed with its dead_lettered_at) and its index score are written together, and the
--   oldest entries beyond max entries leave both.
local t = redis.call('TIME')
local now = string.format('%d.%06d', tonumber(t[1]), tonumber(t[2]))
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2] .. ',"dead_lettered_at":' .. now .. '}')
redis.call('ZADD', KEYS[2], now, ARGV[1])
local extra = redis.call('ZCARD', KEYS[2]) - tonumber(ARGV[3])
if extra > 0 then
  local old = redis.call('ZRANGE', KEYS[2], 0, extra - 1)
  redis.call('ZREMRANGEBYRANK', KEYS[2], 0, extra - 1)
  for _, id in ipairs(old) do redis.call('HDEL', KEYS[1], id) end
end
return now
