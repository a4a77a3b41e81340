-- take_over: a new submitter for a validating job whose submitter has not beaten for the stale seconds
-- (JobStore.take_over; batchery.jobs.submit's Submitter.resume). Uses the prelude.
-- KEYS: job, results, running, pending, done, runs
-- ARGV: stale seconds, the new submitter's token
-- Returns: {1, total, max_line}, or {0, status} (the job is not validating, its submitter is alive, or 'gone').
-- Promises: atomic: the token and a fresh heartbeat are set together; the old submitter's chunk and end_submit are
--   refused ('superseded') from then on, so two submitters never both count a chunk.
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return {0, 'gone'} end
if status ~= 'validating' then return {0, status} end
local now = server_now()
local beat = tonumber(redis.call('HGET', KEYS[1], 'submit_beat') or '0') or 0
if tonumber(now) - beat <= tonumber(ARGV[1]) then return {0, status} end
redis.call('HSET', KEYS[1], 'submitter', ARGV[2], 'submit_beat', now)
return {1, num(KEYS[1], 'total'), num(KEYS[1], 'max_line')}
