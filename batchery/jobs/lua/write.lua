-- write: a line's record, stored once (JobStore.write, write_in). Uses the prelude.
-- KEYS: job, results, running, pending
-- ARGV: line, record, counter (completed|failed), prompt_tokens, completion_tokens, ttl, cached_tokens (of the prompt
--   tokens, those served from the prefix cache; optional)
-- Returns: {1, status} when the record is new, {0, status} when the line had one already, {0, 'gone'} (no job).
-- Promises: atomic and idempotent: HSETNX of the record and, only if it was new, the counter and token increments
--   and progress_at (server time), so a redelivered or retried request can never duplicate a line or a count. The
--   line leaves the running leases and the pending ledger either way. The last record of an in_progress job moves it
--   to finalizing; the last lease of a cancelling one ends it cancelled. A record written after the job ended
--   inherits the job's TTL.
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return {0, 'gone'} end
redis.call('HDEL', KEYS[3], ARGV[1])
redis.call('HDEL', KEYS[4], ARGV[1])
if redis.call('HSETNX', KEYS[2], ARGV[1], ARGV[2]) == 0 then return {0, status} end
inherit_ttl(KEYS[2], KEYS[1])
redis.call('HSET', KEYS[1], 'progress_at', server_now())
redis.call('HINCRBY', KEYS[1], ARGV[3], 1)
if tonumber(ARGV[4]) > 0 then redis.call('HINCRBY', KEYS[1], 'prompt_tokens', ARGV[4]) end
if tonumber(ARGV[5]) > 0 then redis.call('HINCRBY', KEYS[1], 'completion_tokens', ARGV[5]) end
if ARGV[7] and tonumber(ARGV[7]) > 0 then redis.call('HINCRBY', KEYS[1], 'cached_tokens', ARGV[7]) end
return {1, settle(KEYS[1], KEYS[2], KEYS[3], status, ARGV[6])}
