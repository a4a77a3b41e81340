-- cancel: ask a job to stop (JobStore.cancel). Uses the prelude.
-- KEYS: job, results, running, pending, done, runs
-- ARGV: ttl
-- Returns: 'cancelling', 'cancelled' (no line holds a live lease), 'gone', or the status of a job that is not
--   validating, in_progress or cancelling (unchanged).
-- Promises: atomic and repeatable: validating or in_progress -> cancelling; cancelled (with the TTL) once no line
--   holds a live lease (a lease that outlived its deadline, its worker dead, is dropped). A job that already ended
--   keeps its status.
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return 'gone' end
if status ~= 'validating' and status ~= 'in_progress' and status ~= 'cancelling' then return status end
local now = server_now()
if status ~= 'cancelling' then redis.call('HSET', KEYS[1], 'status', 'cancelling', 'cancelling_at', now) end
if live_leases(KEYS[3], now) == 0 then
  finish(KEYS[1], KEYS[2], KEYS[3], 'cancelled', now, ARGV[1])
  return 'cancelled'
end
return 'cancelling'
