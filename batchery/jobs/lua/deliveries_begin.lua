-- deliveries_begin: count a delivery of a task that begins now (batchery.jobs.deliveries.Deliveries.begin).
-- KEYS: counter
-- ARGV: ttl
-- Returns: {open before this delivery, alone, first_at}.
-- Promises: atomic: open grows by one, first_at (server time) is set by the first delivery only, and the counter
--   expires ttl seconds after this change.
local t = redis.call('TIME')
local now = string.format('%d.%06d', tonumber(t[1]), tonumber(t[2]))
local open = redis.call('HINCRBY', KEYS[1], 'open', 1)
redis.call('HSETNX', KEYS[1], 'first_at', now)
redis.call('EXPIRE', KEYS[1], ARGV[1])
return {open - 1, tonumber(redis.call('HGET', KEYS[1], 'alone') or '0'), redis.call('HGET', KEYS[1], 'first_at')}
