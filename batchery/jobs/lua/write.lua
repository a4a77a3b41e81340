-- write: a line's record, stored once (JobStore.write, write_in). Uses the prelude.
-- KEYS: job, results, running, pending, done, runs, the set of jobs whose records are due for the store
-- ARGV: line, record, counter (completed|failed), prompt_tokens, completion_tokens, ttl, cached_tokens (of the prompt
--   tokens, those served from the prefix cache), drain_at (0: never), job id
-- Returns: {1, status} when the record is new, {0, status} when the line had one already, {0, 'gone'} (no job).
-- Promises: atomic and idempotent: the record (and the line's bit in done) only if the line had none, and then the counter and token increments
--   and progress_at (server time), so a redelivered or retried request can never duplicate a line or a count. The
--   line leaves the running leases and the pending ledger either way. The last record of an in_progress job moves it
--   to finalizing; the last lease of a cancelling one ends it cancelled. A record written after the job ended
--   inherits the job's TTL. Once a job that may still run lines holds drain_at records in Redis it joins KEYS[7],
--   where the workers' drainers (batchery.jobs.drain) find it and move its records to the store.
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return {0, 'gone'} end
redis.call('HDEL', KEYS[3], ARGV[1])
redis.call('HDEL', KEYS[4], ARGV[1])
if recorded(ARGV[1]) then return {0, status} end
mark(ARGV[1])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
inherit_ttl(KEYS[2], KEYS[1])
redis.call('HSET', KEYS[1], 'progress_at', server_now())
redis.call('HINCRBY', KEYS[1], ARGV[3], 1)
if tonumber(ARGV[4]) > 0 then redis.call('HINCRBY', KEYS[1], 'prompt_tokens', ARGV[4]) end
if tonumber(ARGV[5]) > 0 then redis.call('HINCRBY', KEYS[1], 'completion_tokens', ARGV[5]) end
if ARGV[7] and tonumber(ARGV[7]) > 0 then redis.call('HINCRBY', KEYS[1], 'cached_tokens', ARGV[7]) end
local drain_at = tonumber(ARGV[8] or '0') or 0
if drain_at > 0 and KEYS[7] and redis.call('HLEN', KEYS[2]) >= drain_at then
  redis.call('SADD', KEYS[7], ARGV[9])
end
return {1, settle(KEYS[1], KEYS[2], KEYS[3], status, ARGV[6])}
