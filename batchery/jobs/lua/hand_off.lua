-- hand_off: a submitter stops feeding a job whose input is in the store and frees its lease at once, so that a
-- worker feeds the job on (JobStore.hand_off; batchery.jobs.submit's Submitter._room, batchery.jobs.feeder).
-- KEYS: job, the hand-off set
-- ARGV: the submitter's token, the job id
-- Returns: 'handed off', 'superseded' (the token is no longer the job's submitter), 'gone' (no job), or the status
--   (the job is not validating: there is nothing left to feed).
-- Promises: atomic: the heartbeat is zeroed only while the token holds the lease, and the job joins the hand-off set
--   in the same step, so a worker's take_over finds the lease free at once and the old token's chunks are refused
--   from then on.
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return 'gone' end
if redis.call('HGET', KEYS[1], 'submitter') ~= ARGV[1] then return 'superseded' end
if status ~= 'validating' then return status end
redis.call('HSET', KEYS[1], 'submit_beat', '0')
redis.call('SADD', KEYS[2], ARGV[2])
return 'handed off'
