-- claim: a worker's right to run a line (JobStore.claim). Uses the prelude.
-- KEYS: job, results, running, pending, done, runs
-- ARGV: line, lease seconds, the line's batch_expired record, ttl
-- Returns: 'run' (the caller holds the line's lease until now + lease seconds, server time), 'done' (the line has a
--   record), 'gone' (no job), the status (the job is not validating or in_progress: the line must not run), or
--   {'expired', status} (the window had ended: the line is recorded).
-- Promises: atomic against every other writer. A lease is taken only while the job is validating or in_progress,
--   the line has no record yet and the job's completion window (if any) has not ended. After the window's end the
--   claim writes the line's batch_expired record itself (counted as failed, once, like any record) and drops its
--   lease and ledger entry. started_at is set by the first claim only.
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return 'gone' end
if recorded(ARGV[1]) then return 'done' end
if status ~= 'validating' and status ~= 'in_progress' then return status end
local now = server_now()
if window_passed(KEYS[1], now) then
  redis.call('HDEL', KEYS[3], ARGV[1])
  expire_line(KEYS[1], KEYS[2], KEYS[4], ARGV[1], ARGV[3], now)
  return {'expired', settle(KEYS[1], KEYS[2], KEYS[3], status, ARGV[4])}
end
redis.call('HSETNX', KEYS[1], 'started_at', now)
redis.call('HSET', KEYS[3], ARGV[1], string.format('%.6f', tonumber(now) + tonumber(ARGV[2])))
inherit_ttl(KEYS[3], KEYS[1])
return 'run'
