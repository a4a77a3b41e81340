-- chunk: the bookkeeping of one submitted chunk (JobStore.queue_chunk, in the submitter's pipeline). Uses the prelude.
-- KEYS: job, results, running, pending, done, runs
-- ARGV: number of new lines, max line, the submitter's token ('': any)
-- Returns: the status; nil (no job) or 'superseded' (another submitter took the job over): nothing is written then.
-- Promises: atomic: the running total, max_line and the submitter's heartbeat (submit_beat, server time) move
--   together, only for the job's current submitter, and never on a job that is gone.
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return false end
if ARGV[3] and ARGV[3] ~= '' and redis.call('HGET', KEYS[1], 'submitter') ~= ARGV[3] then return 'superseded' end
if tonumber(ARGV[1]) > 0 then redis.call('HINCRBY', KEYS[1], 'total', ARGV[1]) end
redis.call('HSET', KEYS[1], 'max_line', ARGV[2], 'submit_beat', server_now())
return status
