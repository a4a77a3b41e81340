-- release: give up a line's lease without a record: cancelled, retried, requeued (JobStore.release). Uses the prelude.
-- KEYS: job, results, running, pending, done, runs
-- ARGV: line, ttl
-- Returns: the status ('cancelled' when this ended a cancelling job), or 'gone'.
-- Promises: atomic; a cancelling job left with no live lease ends cancelled here (and gets the TTL).
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return 'gone' end
redis.call('HDEL', KEYS[3], ARGV[1])
if status == 'cancelling' then
  local now = server_now()
  if live_leases(KEYS[3], now) == 0 then
    finish(KEYS[1], KEYS[2], KEYS[3], 'cancelled', now, ARGV[2])
    return 'cancelled'
  end
end
return status
