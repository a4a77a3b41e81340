-- recovery_lock_acquire: take the recovery lock of a queue (batchery.jobs.recover.RecoveryLock.acquire).
-- KEYS: the lock
-- ARGV: token, ttl ms
-- Returns: 1 if the token holds the lock now (for another ttl), else 0.
-- Promises: atomic: takes the lock (SET NX PX), or keeps it if the token holds it already; never takes it from
--   another holder.
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return 1 end
return 0
