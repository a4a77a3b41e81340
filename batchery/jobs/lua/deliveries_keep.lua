-- deliveries_keep: uncount only this delivery (batchery.jobs.deliveries.Deliveries.end with keep: an engine failure,
-- a requeue). A delivery that ended without showing the request is harmless: it leaves the deliveries that died
-- before it counted.
-- KEYS: counter
-- ARGV: ttl, 1 if the run was alone
-- Returns: 1, or 0 if the counter is gone (nothing is written then).
-- Promises: atomic; the counts never go below zero, and the counter expires ttl seconds after this change.
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
if tonumber(redis.call('HGET', KEYS[1], 'open') or '0') > 0 then redis.call('HINCRBY', KEYS[1], 'open', -1) end
if ARGV[2] == '1' and tonumber(redis.call('HGET', KEYS[1], 'alone') or '0') > 0 then
  redis.call('HINCRBY', KEYS[1], 'alone', -1)
end
redis.call('EXPIRE', KEYS[1], ARGV[1])
return 1
