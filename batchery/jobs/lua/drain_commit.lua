-- drain_commit: a run of a job's records has been written to the file store; its records leave Redis
-- (batchery.jobs.drain, JobStore.drain_commit). Uses the prelude.
-- KEYS: job, results, running, pending, done, runs, the drainer's lock ({job}:draining), the set of jobs due a drain
-- ARGV: the drainer's token, the run's sequence number, the run's entry ('name first last count'), drain_at, job id,
--   then the lines of the run
-- Returns: 'committed', or why nothing was written: 'gone' (no job), 'lost' (the drainer's lock is not its token any
--   more: another drainer may be at it), 'stale' (another run took this sequence number), or the status of a job that
--   has ended (its records stay in Redis, which is bounded, and expire with it).
-- Promises: atomic and fenced: only the holder of the lock commits, each sequence number once, and only while the job
--   has not ended, so once a job has ended its records' layout (the runs and what is left in Redis) never changes and
--   a reader sees every record exactly once. The run's lines leave the results hash (their bits in done stay: a
--   redelivered line still finds its record); the job leaves the due set once fewer than drain_at records are left.
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return 'gone' end
if redis.call('GET', KEYS[7]) ~= ARGV[1] then return 'lost' end
if status == 'completed' or status == 'failed' or status == 'cancelled' or status == 'expired' then
  redis.call('SREM', KEYS[8], ARGV[5])
  return status
end
if num(KEYS[1], 'runs_seq') ~= tonumber(ARGV[2]) then return 'stale' end
for i = 6, #ARGV, 1000 do  -- unpack is bounded by Lua's C stack
  redis.call('HDEL', KEYS[2], unpack(ARGV, i, math.min(i + 999, #ARGV)))
end
redis.call('RPUSH', KEYS[6], ARGV[3])
redis.call('HSET', KEYS[1], 'runs_seq', tonumber(ARGV[2]) + 1)
if redis.call('HLEN', KEYS[2]) < tonumber(ARGV[4]) then redis.call('SREM', KEYS[8], ARGV[5]) end
return 'committed'
