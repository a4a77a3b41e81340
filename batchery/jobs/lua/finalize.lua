-- finalize: a finalizing job ends (JobStore.finalize; status() repairs a job whose finalizer died). Uses the prelude.
-- KEYS: job, results, running, pending, done, runs
-- ARGV: ttl
-- Returns: 'completed', 'expired' (some line was recorded batch_expired), 'gone', or the status of a job that is not
--   finalizing (unchanged).
-- Promises: atomic and once: only a finalizing job ends here; its keys get the TTL (expires_at says when) and its
--   leases and ledger are deleted.
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return 'gone' end
if status ~= 'finalizing' then return status end
local ended = 'completed'
if num(KEYS[1], 'expired_lines') > 0 then ended = 'expired' end
finish(KEYS[1], KEYS[2], KEYS[3], ended, server_now(), ARGV[1])
return ended
