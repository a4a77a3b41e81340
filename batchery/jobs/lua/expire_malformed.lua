-- expire_malformed: a job hash with no status is no job (a write on a flushed or replaced Redis, by older code): its
-- keys expire (JobStore raises JobMalformed).
-- KEYS: job, results, running, pending, done, runs
-- ARGV: ttl
-- Returns: 1 if the keys were given the TTL, 0 if the job has a status (nothing is written).
-- Promises: atomic; never touches a real job; a key that already has a TTL keeps it.
if redis.call('HGET', KEYS[1], 'status') then return 0 end
for _, key in ipairs(KEYS) do
  if redis.call('TTL', key) == -1 then redis.call('EXPIRE', key, ARGV[1]) end
end
return 1
