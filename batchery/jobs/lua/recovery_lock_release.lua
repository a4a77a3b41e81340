-- recovery_lock_release: give the recovery lock back (batchery.jobs.recover.RecoveryLock.release).
-- KEYS: the lock
-- ARGV: token
-- Returns: 1 if the lock was deleted, else 0.
-- Promises: atomic compare-and-delete: only the holder releases it.
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
