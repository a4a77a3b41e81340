-- end_submit: the submitter's last word (JobStore.end_submit), or the repair of a job whose submitter stopped
-- beating. Uses the prelude.
-- KEYS: job, results, running, pending, done, runs
-- ARGV: total ('' keeps), max_line ('' keeps), ttl, errors JSON ('' = none),
--   stale seconds ('' = now; else only if the submitter has not beaten for that long: the repair),
--   the submitter's token ('' = any; else 'superseded' if another submitter took the job over)
-- Returns: 'in_progress', 'finalizing' (every line already has a record), 'failed' (errors were given), 'gone',
--   'superseded', or the status unchanged (the job is not validating, or with stale seconds its submitter is alive).
-- Promises: atomic. The final total and max_line are set, then only a validating job moves: to in_progress
--   (finalizing if every line is recorded), or to failed with the job-level errors (and the TTL). A superseded
--   submitter, or a repair of a live submitter's job, writes nothing.
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return 'gone' end
if ARGV[6] and ARGV[6] ~= '' and redis.call('HGET', KEYS[1], 'submitter') ~= ARGV[6] then return 'superseded' end
local now = server_now()
if ARGV[5] ~= '' then
  if status ~= 'validating' then return status end
  local beat = tonumber(redis.call('HGET', KEYS[1], 'submit_beat') or '0') or 0
  if tonumber(now) - beat <= tonumber(ARGV[5]) then return status end
end
if ARGV[1] ~= '' then redis.call('HSET', KEYS[1], 'total', ARGV[1]) end
if ARGV[2] ~= '' then redis.call('HSET', KEYS[1], 'max_line', ARGV[2]) end
if status ~= 'validating' then return status end
if ARGV[4] ~= '' then
  redis.call('HSET', KEYS[1], 'errors', ARGV[4])
  finish(KEYS[1], KEYS[2], KEYS[3], 'failed', now, ARGV[3])
  return 'failed'
end
redis.call('HSET', KEYS[1], 'status', 'in_progress', 'in_progress_at', now)
if num(KEYS[1], 'completed') + num(KEYS[1], 'failed') >= num(KEYS[1], 'total') then
  redis.call('HSET', KEYS[1], 'status', 'finalizing', 'finalizing_at', now)
  return 'finalizing'
end
return 'in_progress'
