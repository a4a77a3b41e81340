-- recovery_lock_extend: keep the recovery lock (batchery.jobs.recover.RecoveryLock.extend).
-- KEYS: the lock
-- ARGV: token, ttl ms
-- Returns: 1 if the token still held the lock (now for another ttl), else 0.
-- Promises: atomic: only the holder's token extends it.
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
