-- ledger: copies of a chunk's task messages, by line, for lost-line recovery (JobStore.ledger_in;
-- batchery.jobs.recover). Uses the prelude.
-- KEYS: job, results, running, pending, done, runs
-- ARGV: line, message, line, message, ...
-- Returns: 1 (written), or 0 when the job is not validating (nothing is written).
-- Promises: atomic; only while the job is validating, so never on a job that is gone or stopped. A chunk of any
--   size goes in whole (in pieces of 1000 arguments: unpack is bounded by Lua's C stack).
local status = redis.call('HGET', KEYS[1], 'status')
if status ~= 'validating' then return 0 end
for i = 1, #ARGV, 1000 do  -- unpack is bounded by Lua's C stack (8000): a chunk of any size goes in pieces
  redis.call('HSET', KEYS[4], unpack(ARGV, i, math.min(i + 999, #ARGV)))
end
return 1
